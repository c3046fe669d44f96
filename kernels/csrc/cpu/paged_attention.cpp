// Paged decode attention, flash-decoding style, on CPU threads.
//
// One decode step has one query per sequence, so the work per sequence is a matrix-vector product
// over its keys, then another over its values. Splitting by sequence and head alone leaves
// threads idle when a few long sequences dominate (or there is only one): instead the keys of
// each sequence are cut into partitions, and every (sequence, partition) is a task of its own, or
// (sequence, kv head, partition) where those would be too few to share among the threads. Each task
// runs softmax over its keys without knowing the others, keeping what a merge needs: its running max
// m, its sum l of exp(score - m), and its unnormalised output acc = sum exp(score - m) * v. A second
// pass rescales each partition to the common max and combines them, which gives exactly softmax
// over all keys.
//
// A kv head's rows serve all query heads of its group (GQA), so each key and value row read from
// memory is used group-size times while it is hot in L1. A head's sums are the same operations in
// the same order whichever tasks its kv head shares: a sequence's result never depends on the batch.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_kernels.h"
#include "vec.h"

KERNELS_VECTOR_CODE_BEGIN

namespace kernels::cpu {

namespace {

struct AttnArgs {
    void* out;
    const void* q;
    int64_t q_stride;
    const void* k_pool;
    const void* v_pool;
    const int32_t* block_tables;
    const int32_t* context_lens;
    float* part_out;  // [batch, n_heads, n_partitions, head_dim]
    float* part_max;  // [batch, n_heads, n_partitions]
    float* part_sum;  // [batch, n_heads, n_partitions]
    int batch, n_heads, n_kv_heads, head_dim, block_size, max_blocks, partition_size, n_partitions;
    float scale;
};

// Per-thread scratch of a task: per query head it serves (a group's, or all a sequence's), its
// query (scaled, as float), the scores of one block of keys, and the running max and sum of its
// softmax.
struct TaskScratch {
    float* q;       // [heads, head_dim]
    float* scores;  // [heads, block_size]
    float* m;       // [heads]
    float* l;       // [heads]
    float* alpha;   // [heads]: exp(old max - new max) of the block being added
};

// A block of one KV head's rows is n pieces of head_dim values, a pool row apart, in blocks
// scattered over the pool: too short and too far apart for the hardware prefetchers. The next
// block's rows are asked for while this block computes (two blocks ahead measured no better), a
// key's rows per key scored: all 64 lines of a block of 16 asked for at once fill the core's queue
// of misses and hold up the loads of the block being computed (16 sequences of 200 keys, 30 layers
// of pools, two threads: 4.0 ms so, 3.2 ms with the requests spread; on a Zen 5).
template <DType D>
struct NextRows {
    const void* k_pool;
    const void* v_pool;
    int64_t base;  // the next block's first row in the pools (of this KV head)
    int n;         // its rows; 0 where this block is the partition's last (or a later pass asks none)

    KERNELS_INLINE void ask(int j, int64_t row_stride, int hd) const {
        if (j >= n) return;
        prefetch_elements<D>(k_pool, base + j * row_stride, hd);
        prefetch_elements<D>(v_pool, base + j * row_stride, hd);
    }
};

// A tile of scores: 4 keys against kTileHeads query heads. Each key's row is loaded (and
// widened) once for the tile's heads: with the dot products a key and head at a time (the rows
// widened to float first), loading the rows took more time than the multiply-adds (one thread,
// keys in the caches: 14.6 -> 11.1 ns per key and KV head of SmolLM2's groups of 3). A dot
// product is a vector of partial sums until one tree sums the lanes of W vectors at once
// (reduce_each), so a tile of vectors is W dot products: AVX512 4 keys x 4 heads, AVX2 4 x 2;
// scalar code sums as it goes (4 x 4).
constexpr int kTileKeys = 4;
template <class S>
constexpr int kTileHeads = S::W >= kTileKeys ? S::W / kTileKeys : 4;

// scores[h * s_stride + j] = q_h . k_j for G heads (q: G rows of head_dim, scaled) and the n keys
// of a block (rows row_stride apart from `base`). Each dot product's lanes add up its head_dim
// products in the same order as one vector a key would.
template <class S, DType D, int G>
KERNELS_INLINE void qk_pass(const float* q, const void* k_pool, int64_t base, int64_t row_stride, int n, int hd,
                            float* scores, int s_stride, const NextRows<D>& next) {
    using V = typename S::V;
    constexpr int W = S::W, KJ = kTileKeys, tile = KJ * kTileHeads<S>;
    for (int j0 = 0; j0 < n; j0 += KJ) {
        const int nk = std::min(KJ, n - j0);
        for (int jj = 0; jj < KJ; ++jj) next.ask(j0 + jj, row_stride, hd);
        int64_t row[KJ];  // keys past n read the last key again; their sums are not stored
        for (int jj = 0; jj < KJ; ++jj) row[jj] = base + std::min(j0 + jj, n - 1) * row_stride;
        V acc[tile];
        for (int t = 0; t < tile; ++t) acc[t] = S::zero();
        for (int i = 0; i < hd; i += W) {
            V qv[G];
            for (int h = 0; h < G; ++h) qv[h] = S::load(q + h * hd + i);
            for (int jj = 0; jj < KJ; ++jj) {
                const V k = S::template load_as<D>(k_pool, row[jj] + i);
                for (int h = 0; h < G; ++h) acc[h * KJ + jj] = S::fma(qv[h], k, acc[h * KJ + jj]);
            }
        }
        float sums[tile];
        if constexpr (W == 1) std::copy_n(acc, tile, sums);
        else S::store(sums, S::reduce_each(acc));
        for (int h = 0; h < G; ++h) std::copy_n(sums + h * KJ, nk, scores + h * s_stride + j0);
    }
}

// qk_pass for `heads` (1..kTileHeads) heads, its count a template argument.
template <class S, DType D, int G = kTileHeads<S>>
KERNELS_INLINE void qk_heads(const float* q, const void* k_pool, int64_t base, int64_t row_stride, int n, int hd,
                             float* scores, int s_stride, const NextRows<D>& next, int heads) {
    if constexpr (G > 1) {
        if (heads < G) return qk_heads<S, D, G - 1>(q, k_pool, base, row_stride, n, hd, scores, s_stride, next, heads);
    }
    qk_pass<S, D, G>(q, k_pool, base, row_stride, n, hd, scores, s_stride, next);
}

// The first nk lanes of v to p (a whole vector when nk == W), and back.
template <class S>
KERNELS_INLINE void store_first(float* p, const typename S::V& v, int nk) {
    if (nk == S::W) return S::store(p, v);
    float lanes[S::W];
    S::store(lanes, v);
    std::copy_n(lanes, nk, p);
}
template <class S>
KERNELS_INLINE void load_first(const float* p, int nk, typename S::V& v) {
    if (nk == S::W) {
        v = S::load(p);
        return;
    }
    float lanes[S::W] = {};
    std::copy_n(p, nk, lanes);
    v = S::load(lanes);
}

// x = exp(x - m) in the first nk lanes, 0 in the others (exp's clamp makes -inf 1.6e-38, not 0).
template <class S>
KERNELS_INLINE void exp_first(typename S::V& x, float m, int nk) {
    x = S::exp(S::sub(x, S::set1(m)));
    if (nk == S::W) return;
    float lanes[S::W];
    S::store(lanes, x);
    std::fill(lanes + nk, lanes + S::W, 0.f);
    x = S::load(lanes);
}

// Heads of a GQA group whose value sums one pass over a block's V rows carries in registers: 4
// vectors of head_dim per head (AVX512: 4 heads, 16 accumulators of its 32 registers; AVX2: 2
// heads, 8 of 16).
template <class S>
constexpr int kPassHeads = 1;
#ifdef KERNELS_X86
template <>
constexpr int kPassHeads<Avx2> = 2;
template <>
constexpr int kPassHeads<Avx512> = 4;
#endif

// acc[h] = alphas[h] * acc[h] + sum_j p[h][j] v_j for G heads (h < G), v_j the n rows of the block
// from `base` (a pool row apart), p[h] `p_stride` apart, acc[h] `acc_stride` apart. Each head's
// elements see the same multiply and multiply-adds in the same order as one head at a time would:
// the same bits, with each V row loaded once for the G heads instead of G times.
template <class S, DType D, int G>
KERNELS_INLINE void pv_pass(const void* v_pool, int64_t base, int64_t row_stride, int n, int hd, const float* p,
                            int p_stride, const float* alphas, float* acc, int64_t acc_stride) {
    using V = typename S::V;
    constexpr int W = S::W;
    int i = 0;
    for (; i + 4 * W <= hd; i += 4 * W) {
        V o[G][4];
        for (int h = 0; h < G; ++h)
            for (int c = 0; c < 4; ++c) o[h][c] = S::mul(S::load(acc + h * acc_stride + i + c * W), S::set1(alphas[h]));
        for (int j = 0; j < n; ++j) {
            V vj[4];
            for (int c = 0; c < 4; ++c) vj[c] = S::template load_as<D>(v_pool, base + j * row_stride + i + c * W);
            for (int h = 0; h < G; ++h) {
                const V pj = S::set1(p[h * p_stride + j]);
                for (int c = 0; c < 4; ++c) o[h][c] = S::fma(pj, vj[c], o[h][c]);
            }
        }
        for (int h = 0; h < G; ++h)
            for (int c = 0; c < 4; ++c) S::store(acc + h * acc_stride + i + c * W, o[h][c]);
    }
    for (; i + W <= hd; i += W)
        for (int h = 0; h < G; ++h) {
            V o = S::mul(S::load(acc + h * acc_stride + i), S::set1(alphas[h]));
            for (int j = 0; j < n; ++j)
                o = S::fma(S::set1(p[h * p_stride + j]), S::template load_as<D>(v_pool, base + j * row_stride + i), o);
            S::store(acc + h * acc_stride + i, o);
        }
    for (; i < hd; ++i)
        for (int h = 0; h < G; ++h) {
            float o = acc[h * acc_stride + i] * alphas[h];
            for (int j = 0; j < n; ++j) o += p[h * p_stride + j] * load_as_float<D>(v_pool, base + j * row_stride + i);
            acc[h * acc_stride + i] = o;
        }
}

// pv_pass for `heads` (1..kPassHeads) heads, its count a template argument.
template <class S, DType D, int G = kPassHeads<S>>
KERNELS_INLINE void pv_heads(const void* v_pool, int64_t base, int64_t row_stride, int n, int hd, const float* p,
                             int p_stride, const float* alphas, float* acc, int64_t acc_stride, int heads) {
    if constexpr (G > 1) {
        if (heads < G)
            return pv_heads<S, D, G - 1>(v_pool, base, row_stride, n, hd, p, p_stride, alphas, acc, acc_stride, heads);
    }
    pv_pass<S, D, G>(v_pool, base, row_stride, n, hd, p, p_stride, alphas, acc, acc_stride);
}

// One task: partition p of sequence b for KV heads kv0 .. kv1 - 1 and their query heads (rows h0 =
// kv0 * group on, `heads` of them, here numbered from 0).
template <class S, DType D>
KERNELS_INLINE void attention_task(const AttnArgs& a, const TaskScratch& scratch, int b, int kv0, int kv1, int p) {
    using V = typename S::V;
    constexpr int W = S::W;
    const int hd = a.head_dim, group = a.n_heads / a.n_kv_heads, bs = a.block_size;
    const int h0 = kv0 * group, heads = (kv1 - kv0) * group;
    const int context = a.context_lens[b];
    const int start = p * a.partition_size, end = std::min(start + a.partition_size, context);
    auto slot = [&](int h) { return (int64_t(b) * a.n_heads + h0 + h) * a.n_partitions + p; };

    if (start >= end) {  // past this sequence's context: nothing to contribute
        for (int h = 0; h < heads; ++h) {
            a.part_max[slot(h)] = -std::numeric_limits<float>::infinity();
            a.part_sum[slot(h)] = 0.f;
        }
        return;
    }

    // The scale folded into the query: one multiply per query element instead of per score.
    for (int h = 0; h < heads; ++h) {
        const int64_t src = int64_t(b) * a.q_stride + int64_t(h0 + h) * hd;
        float* qh = scratch.q + int64_t(h) * hd;
        for (int i = 0; i < hd; ++i) qh[i] = load_as_float<D>(a.q, src + i) * a.scale;
    }
    float* m = scratch.m;
    float* l = scratch.l;
    float* alphas = scratch.alpha;
    for (int h = 0; h < heads; ++h) {
        m[h] = -std::numeric_limits<float>::infinity();
        l[h] = 0.f;
        float* acc = a.part_out + slot(h) * hd;
        for (int i = 0; i < hd; ++i) acc[i] = 0.f;
    }

    const int64_t row_stride = int64_t(a.n_kv_heads) * hd;  // from one slot's K row to the next's
    const int32_t* table = a.block_tables + int64_t(b) * a.max_blocks;
    // Partitions start on block boundaries (partition_size is a multiple of block_size).
    for (int first = start; first < end; first += bs) {
        const int n = std::min(bs, end - first);
        const int64_t block = int64_t(table[first / bs]) * bs * row_stride;  // the block's first slot row
        const int next_n = std::min(bs, end - first - bs);                   // <= 0: no next block
        const int64_t next = next_n > 0 ? int64_t(table[first / bs + 1]) * bs * row_stride : 0;
        // Each KV head's scores, from its rows of the block (hd values of each slot row); its
        // first pass of query heads asks for its rows of the next block.
        for (int kvh = kv0; kvh < kv1; ++kvh) {
            const int k = (kvh - kv0) * group;  // its first query head, numbered in this task
            const NextRows<D> ahead{a.k_pool, a.v_pool, next + int64_t(kvh) * hd, next_n};
            for (int g0 = 0; g0 < group; g0 += kTileHeads<S>)
                qk_heads<S, D>(scratch.q + int64_t(k + g0) * hd, a.k_pool, block + int64_t(kvh) * hd, row_stride, n,
                               hd, scratch.scores + int64_t(k + g0) * bs, bs, g0 == 0 ? ahead : NextRows<D>{},
                               std::min(kTileHeads<S>, group - g0));
        }
        for (int h = 0; h < heads; ++h) {  // the block's max, until the new max is known
            const float* s = scratch.scores + int64_t(h) * bs;
            V vmax = S::set1(-std::numeric_limits<float>::infinity());
            int j = 0;
            for (; j + W <= n; j += W) vmax = S::max(vmax, S::load(s + j));
            float block_max = S::reduce_max(vmax);
            for (; j < n; ++j) block_max = std::max(block_max, s[j]);
            alphas[h] = block_max;
        }
        // Online softmax, a block at a time: if this block raises the max, everything summed so far
        // was weighted by exp(score - old max) and is rescaled by alpha = exp(old - new) to match.
        // (The first block: exp(-inf), clamped to 1.6e-38, times the zeros so far.) All heads at once.
        for (int g0 = 0; g0 < heads; g0 += W) {
            const int nh = std::min(W, heads - g0);
            V m_old, block_max;
            load_first<S>(m + g0, nh, m_old);
            load_first<S>(alphas + g0, nh, block_max);
            const V m_new = S::max(m_old, block_max);
            store_first<S>(m + g0, m_new, nh);
            store_first<S>(alphas + g0, S::exp(S::sub(m_old, m_new)), nh);
        }
        for (int h = 0; h < heads; ++h) {
            float* s = scratch.scores + int64_t(h) * bs;
            V vsum = S::zero();
            for (int j0 = 0; j0 < n; j0 += W) {
                const int nk = std::min(W, n - j0);
                V e;
                load_first<S>(s + j0, nk, e);
                exp_first<S>(e, m[h], nk);
                vsum = S::add(vsum, e);
                store_first<S>(s + j0, e, nk);
            }
            l[h] = l[h] * alphas[h] + S::reduce_add(vsum);
        }
        // acc = alpha * acc + sum_j p_j v_j for every head of a group, reading each V row of the
        // block once (from the pool, widened in registers) for up to kPassHeads heads at a time.
        for (int kvh = kv0; kvh < kv1; ++kvh)
            for (int g0 = 0; g0 < group; g0 += kPassHeads<S>) {
                const int h = (kvh - kv0) * group + g0;
                pv_heads<S, D>(a.v_pool, block + int64_t(kvh) * hd, row_stride, n, hd, scratch.scores + int64_t(h) * bs,
                               bs, alphas + h, a.part_out + slot(h) * hd, a.n_partitions * hd,
                               std::min(kPassHeads<S>, group - g0));
            }
    }
    for (int h = 0; h < heads; ++h) {
        a.part_max[slot(h)] = m[h];
        a.part_sum[slot(h)] = l[h];
    }
}

// Merges the partitions of one (sequence, head): with M the largest partition max, each
// partition's sum and output were computed relative to its own max m_p, so both are scaled by
// exp(m_p - M) before they are added up; the output is then divided by the total sum.
template <class S, DType D>
KERNELS_INLINE void merge_partitions(const AttnArgs& a, float* weights, int b, int h) {
    using V = typename S::V;
    constexpr int W = S::W;
    const int hd = a.head_dim, vec_end = hd - hd % W;
    const int live = (a.context_lens[b] + a.partition_size - 1) / a.partition_size;
    const int64_t first = (int64_t(b) * a.n_heads + h) * a.n_partitions;
    float M = -std::numeric_limits<float>::infinity();
    for (int p = 0; p < live; ++p) M = std::max(M, a.part_max[first + p]);
    float total = 0.f;
    for (int p = 0; p < live; ++p) {
        weights[p] = std::exp(a.part_max[first + p] - M);
        total += weights[p] * a.part_sum[first + p];
    }
    for (int p = 0; p < live; ++p) weights[p] /= total;

    const float* acc = a.part_out + first * hd;
    const int64_t dst = (int64_t(b) * a.n_heads + h) * hd;
    int i = 0;
    for (; i < vec_end; i += W) {
        V o = S::zero();
        for (int p = 0; p < live; ++p) o = S::fma(S::set1(weights[p]), S::load(acc + int64_t(p) * hd + i), o);
        S::template store_as<D>(a.out, dst + i, o);
    }
    for (; i < hd; ++i) {
        float o = 0.f;
        for (int p = 0; p < live; ++p) o += weights[p] * acc[int64_t(p) * hd + i];
        store_from_float<D>(a.out, dst + i, o);
    }
}

template <class S>
KERNELS_INLINE void attention_task_any(const AttnArgs& a, DType d, const TaskScratch& s, int b, int kv0, int kv1,
                                       int p) {
    switch (d) {
        case DType::f32: attention_task<S, DType::f32>(a, s, b, kv0, kv1, p); break;
        case DType::bf16: attention_task<S, DType::bf16>(a, s, b, kv0, kv1, p); break;
        case DType::f16: attention_task<S, DType::f16>(a, s, b, kv0, kv1, p); break;
    }
}

template <class S>
KERNELS_INLINE void merge_any(const AttnArgs& a, DType d, float* weights, int b, int h) {
    switch (d) {
        case DType::f32: merge_partitions<S, DType::f32>(a, weights, b, h); break;
        case DType::bf16: merge_partitions<S, DType::bf16>(a, weights, b, h); break;
        case DType::f16: merge_partitions<S, DType::f16>(a, weights, b, h); break;
    }
}

using TaskFn = void (*)(const AttnArgs&, DType, const TaskScratch&, int, int, int, int);
using MergeFn = void (*)(const AttnArgs&, DType, float*, int, int);

void task_scalar(const AttnArgs& a, DType d, const TaskScratch& s, int b, int kv0, int kv1, int p) {
    attention_task_any<Scalar>(a, d, s, b, kv0, kv1, p);
}
void merge_scalar(const AttnArgs& a, DType d, float* w, int b, int h) { merge_any<Scalar>(a, d, w, b, h); }
#ifdef KERNELS_X86
KERNELS_AVX2
__attribute__((flatten)) void task_avx2(const AttnArgs& a, DType d, const TaskScratch& s, int b, int kv0, int kv1,
                                        int p) {
    attention_task_any<Avx2>(a, d, s, b, kv0, kv1, p);
}
KERNELS_AVX2 __attribute__((flatten)) void merge_avx2(const AttnArgs& a, DType d, float* w, int b, int h) {
    merge_any<Avx2>(a, d, w, b, h);
}
KERNELS_AVX512 __attribute__((flatten)) void task_avx512(const AttnArgs& a, DType d, const TaskScratch& s, int b,
                                                         int kv0, int kv1, int p) {
    attention_task_any<Avx512>(a, d, s, b, kv0, kv1, p);
}
KERNELS_AVX512 __attribute__((flatten)) void merge_avx512(const AttnArgs& a, DType d, float* w, int b, int h) {
    merge_any<Avx512>(a, d, w, b, h);
}
#endif

}  // namespace

void paged_decode_attention(void* out, const void* q, int64_t q_stride, const void* k_pool, const void* v_pool,
                            const int32_t* block_tables, const int32_t* context_lens, float* workspace, int batch,
                            int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks,
                            int partition_size, float scale, DType dtype) {
    const int n_partitions = (max_blocks * block_size + partition_size - 1) / partition_size;
    const int64_t heads_parts = int64_t(batch) * n_heads * n_partitions;
    float* part_max = workspace + heads_parts * head_dim;  // after the partial outputs
    float* part_sum = part_max + heads_parts;
    AttnArgs a{out,        q,          q_stride,       k_pool,       v_pool,  block_tables, context_lens,
               workspace,  part_max,   part_sum,       batch,        n_heads, n_kv_heads,   head_dim,
               block_size, max_blocks, partition_size, n_partitions, scale};
    const int group = n_heads / n_kv_heads;

    TaskFn task = task_scalar;
    MergeFn merge = merge_scalar;
#ifdef KERNELS_X86
    if (isa() >= Isa::avx512) task = task_avx512, merge = merge_avx512;
    else if (isa() == Isa::avx2) task = task_avx2, merge = merge_avx2;
#endif

    int64_t keys = 0, live = 0;  // keys, and (sequence, partition) pairs with keys
    for (int b = 0; b < batch; ++b) {
        keys += context_lens[b];
        live += (context_lens[b] + partition_size - 1) / partition_size;
    }
    // A step of a few short contexts is done before other threads would have woken up.
    const bool parallel = keys * n_heads * head_dim > (int64_t(1) << 15) && omp_get_max_threads() > 1;

    // A task is a partition of a sequence with all its KV heads, whose rows lie side by side in each
    // slot: a block is then read whole, K and V each one run of block_size * n_kv_heads * head_dim
    // values (a step of 16 sequences in chapter 06: 0.4-0.6 ms less than with a task per KV head).
    // Where that leaves the threads too few tasks (a few sequences: the step of one), a KV head each.
    const int kv_per_task = live >= 4 * omp_get_max_threads() ? n_kv_heads : 1;
    const int kv_tasks = n_kv_heads / kv_per_task;
    const int64_t tasks = int64_t(batch) * kv_tasks * n_partitions;
    const size_t heads = size_t(kv_per_task) * group;  // query heads a task serves
    // Tasks differ in size (contexts differ, and partitions past a context are empty): dynamic.
#pragma omp parallel if (parallel)
    {
        thread_local std::vector<float> buffer;
        buffer.resize(heads * (head_dim + block_size + 3));
        float* q_scratch = buffer.data();
        float* scores = q_scratch + heads * head_dim;
        float* m = scores + heads * block_size;
        const TaskScratch scratch{q_scratch, scores, m, m + heads, m + 2 * heads};
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < tasks; ++t) {
            const int p = int(t % n_partitions);
            const int kv0 = int(t / n_partitions % kv_tasks) * kv_per_task;
            const int b = int(t / (int64_t(n_partitions) * kv_tasks));
            task(a, dtype, scratch, b, kv0, kv0 + kv_per_task, p);
        }
        // (the implicit barrier of `omp for`: every partition is written before any merge)
        thread_local std::vector<float> weights;
        weights.resize(size_t(n_partitions));
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < int64_t(batch) * n_heads; ++bh)
            merge(a, dtype, weights.data(), int(bh / n_heads), int(bh % n_heads));
    }
}

}  // namespace kernels::cpu

KERNELS_VECTOR_CODE_END
