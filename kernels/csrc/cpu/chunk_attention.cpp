// Prompt-chunk attention over the paged KV cache, FlashAttention-2's loop on CPU threads.
//
// A prompt chunk is many queries of one sequence: the ones at positions start .. start + n - 1,
// each reading the keys up to its own position, the earlier ones from the cache and the chunk's
// own (which the RoPE / cache-write kernel has already put into the pool). Where the decode
// kernel does a matrix-vector product per query, here a tile of queries meets a tile of keys, so
// each key and value row read from the pool (and widened to float) serves every query of the tile
// and every query head of its kv head's group (GQA).
//
// A task is (sequence, kv head, tile of kQueryTile queries): it walks the keys in tiles of
// kKeyTile (64 or 32) from position 0 up to its last query's position, never past it (the causal bound skips
// the tiles above the diagonal), keeping per query row a running max m, a running sum l of
// exp(score - m) and an unnormalised output acc, rescaled by exp(m_old - m_new) when a tile raises
// the max: the online softmax, so no row ever holds all its scores. The output is acc / l.
//
// Why the key tiles start at position 0 and each row stops at its own last key: a query row's
// result is then computed by the same operations in the same order whatever chunk it came in, and
// whichever tile of queries it sits in (its scores are one FMA chain over head_dim per key, the
// rows of a tile do not mix). A prompt cut into other chunks, or a row alone, gives the same bits.
//
// A step's decode rows (one query each) stay with paged_attention.cpp (the engine's choice,
// chapter 06's ops.py): its partitions spread one query's long context over threads, where here a
// lone query would be one task per kv head.
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

// Keys per tile: 64 on AVX512 (4 vectors of scores a row), 32 elsewhere (4 AVX2 vectors); the
// per-tile work of the softmax (a max, a sum, the rescale) is then spread over more keys.
template <class S>
constexpr int kKeyTile = S::W >= 16 ? 64 : 32;
constexpr int kMaxKeyTile = 64;
constexpr int kQueryTile = 16;  // queries per task (times the group's heads: rows of a task)

struct ChunkArgs {
    void* out;
    const void* q;
    int64_t q_stride;  // elements from one token's q to the next's (out's is n_heads * head_dim)
    const void* k_pool;
    const void* v_pool;
    const int32_t* block_tables;
    const int32_t* query_start;
    const int32_t* query_lens;
    const int32_t* context_lens;
    int batch, n_heads, n_kv_heads, head_dim, block_size, max_blocks;
    float scale;
};

// Per-thread scratch of a task, in floats.
struct ChunkScratch {
    float* q;       // [rows, head_dim]: the task's queries, scaled, row = query * group + head
                    //   (bf16 pairs: the queries as they are, [rows, head_dim / 2] words)
    float* acc;     // [rows, head_dim]: unnormalised outputs
    float* m;       // [rows] running max
    float* l;       // [rows] running sum
    float* kt;      // [head_dim, kKeyTile]: the key tile transposed, zeros past its keys
                    //   (bf16 pairs: [head_dim / 2, kKeyTile] words, each two dims of a key)
    float* v;       // [kKeyTile, head_dim]: the value tile
    float* scores;  // [kRowBlock, kKeyTile]
};

// Where key `pos` of sequence b, kv head kvh, starts in the pools (element offset), through the
// block table.
KERNELS_INLINE int64_t key_row(const ChunkArgs& a, int b, int kvh, int pos) {
    const int32_t* table = a.block_tables + int64_t(b) * a.max_blocks;
    const int bs = a.block_size;
    return ((int64_t(table[pos / bs]) * bs + pos % bs) * a.n_kv_heads + kvh) * a.head_dim;
}

// The value rows of keys j0 .. min(j0 + W, n) - 1 of a tile (their rows in the pool: rows[0] on),
// widened into the scratch as rows.
template <class S, DType D>
KERNELS_INLINE void load_value_rows(const ChunkArgs& a, const ChunkScratch& sc, const int64_t* rows, int j0, int n) {
    for (int j = j0; j < std::min(j0 + S::W, n); ++j)
        for (int i = 0; i < a.head_dim; i += S::W)
            S::store(sc.v + int64_t(j) * a.head_dim + i, S::template load_as<D>(a.v_pool, rows[j - j0] + i));
}

// One key tile, keys k0 .. k0 + n - 1 of sequence b, kv head kvh, widened into the scratch: keys
// transposed (a vector of scores is then kKeyTile / W FMA chains over head_dim, one per key lane),
// values as rows. The keys go W at a time through a W x W transpose in registers: stored a float
// at a time, the transpose was a fifth of a 2,000-token prompt's attention.
template <class S, DType D>
KERNELS_INLINE void load_key_tile(const ChunkArgs& a, const ChunkScratch& sc, int b, int kvh, int k0, int n) {
    constexpr int W = S::W, KT = kKeyTile<S>;
    const int hd = a.head_dim;
    for (int j0 = 0; j0 < n; j0 += W) {
        int64_t rows[W];  // keys past n read key n - 1 again; their lanes are zeroed below
        for (int j = 0; j < W; ++j) rows[j] = key_row(a, b, kvh, k0 + std::min(j0 + j, n - 1));
        for (int i = 0; i < hd; i += W) {  // head_dim is a whole number of vectors (kHeadDims)
            typename S::V block[W];
            for (int j = 0; j < W; ++j) block[j] = S::template load_as<D>(a.k_pool, rows[j] + i);
            S::transpose(block);  // block[c]: dim i + c of the W keys
            for (int c = 0; c < W; ++c) S::store(sc.kt + int64_t(i + c) * KT + j0, block[c]);
        }
        load_value_rows<S, D>(a, sc, rows, j0, n);
    }
    // Lanes past the tile's keys: finite, so their scores are too (they are never used).
    if (n < KT)
        for (int i = 0; i < hd; ++i) std::fill(sc.kt + int64_t(i) * KT + n, sc.kt + int64_t(i + 1) * KT, 0.f);
}

// How many query rows share each load of the key tile (scores) and of the value rows (outputs):
// as many as fit the vector registers beside the loads. One row at a time on the portable path.
template <class S>
constexpr int kRowBlock = S::W >= 16 ? 4 : S::W >= 8 ? 2 : 1;

// Scores of R query rows against the tile's keys: s[r][j] = q_r . k_j for every lane j, each one
// FMA chain over head_dim in order (the same bits whichever rows share the loads).
template <class S, int R>
KERNELS_INLINE void row_scores(const float* q, const float* kt, int hd, float* s) {
    using V = typename S::V;
    constexpr int W = S::W, KT = kKeyTile<S>, NV = KT / W;
    V acc[R][NV];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = S::zero();
    for (int i = 0; i < hd; ++i) {
        const float* k = kt + int64_t(i) * KT;
        V kv[NV];
        for (int v = 0; v < NV; ++v) kv[v] = S::load(k + v * W);
        for (int r = 0; r < R; ++r) {
            const V qi = S::set1(q[int64_t(r) * hd + i]);
            for (int v = 0; v < NV; ++v) acc[r][v] = S::fma(qi, kv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) S::store(s + r * KT + v * W, acc[r][v]);
}

#ifdef KERNELS_X86
// The AVX512-BF16 form of the scores, for bf16 pools where the CPU multiplies bf16 pairs faster
// than it widens them (gemm_bf16_pairs: AMD's cores, isa.cpp): the key tile stays bf16, each
// 32-bit word a pair of neighbouring dims of one key (kt2[p][j] = k_j[2p], k_j[2p + 1]), and
// vdpbf16ps adds both products of a pair to a key's lane, twice an FMA's work an instruction. A
// bf16 times a bf16 is exact in a float, so a score differs from the widened form's only in the
// order of its sums; the query is taken as it is (bf16) and the scale applied to the scores.
// The words of 16 keys go through the same 16 x 16 transpose as floats (shuffles move bits).
KERNELS_AVX512_BF16 inline void load_key_tile_pairs(const ChunkArgs& a, const ChunkScratch& sc, int b, int kvh, int k0,
                                                     int n) {
    constexpr int W = Avx512::W, KT = kKeyTile<Avx512>;
    const int hd = a.head_dim;
    const uint16_t* k_pool = static_cast<const uint16_t*>(a.k_pool);
    uint32_t* kt2 = reinterpret_cast<uint32_t*>(sc.kt);  // [head_dim / 2][KT]
    for (int j0 = 0; j0 < n; j0 += W) {
        int64_t rows[W];  // keys past n read key n - 1 again; their words are zeroed below
        for (int j = 0; j < W; ++j) rows[j] = key_row(a, b, kvh, k0 + std::min(j0 + j, n - 1));
        for (int w0 = 0; w0 < hd / 2; w0 += W) {  // 16 words (32 dims) of each key
            __m512 block[W];
            for (int j = 0; j < W; ++j) block[j] = _mm512_castsi512_ps(_mm512_loadu_si512(k_pool + rows[j] + 2 * w0));
            Avx512::transpose(block);  // block[c]: word w0 + c of the 16 keys
            for (int c = 0; c < W; ++c)
                _mm512_storeu_ps(reinterpret_cast<float*>(kt2 + int64_t(w0 + c) * KT + j0), block[c]);
        }
        load_value_rows<Avx512, DType::bf16>(a, sc, rows, j0, n);
    }
    if (n < KT)  // words past the tile's keys: bf16 zeros, finite scores (never used)
        for (int w = 0; w < hd / 2; ++w) std::fill(kt2 + int64_t(w) * KT + n, kt2 + int64_t(w + 1) * KT, 0u);
}

// row_scores in bf16 pairs: q holds R rows of head_dim / 2 words (the queries' bf16 pairs).
template <int R>
KERNELS_AVX512_BF16 inline void row_scores_pairs(const uint32_t* q, const uint32_t* kt2, int hd, float scale,
                                                 float* s) {
    constexpr int W = Avx512::W, KT = kKeyTile<Avx512>, NV = KT / W;
    __m512 acc[R][NV];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int p = 0; p < hd / 2; ++p) {
        __m512bh kv[NV];
        for (int v = 0; v < NV; ++v) kv[v] = (__m512bh)_mm512_loadu_si512(kt2 + int64_t(p) * KT + v * W);
        for (int r = 0; r < R; ++r) {
            const __m512bh qp = (__m512bh)_mm512_set1_epi32(int(q[int64_t(r) * (hd / 2) + p]));
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qp, kv[v]);
        }
    }
    const __m512 sv = _mm512_set1_ps(scale);
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + r * KT + v * W, _mm512_mul_ps(acc[r][v], sv));
}
#endif

// The online-softmax step of one row over its first n keys of the tile (its causal bound): m and l
// updated, s[j] turned into the weight exp(s[j] - m_new); -> alpha = exp(m_old - m_new), the
// rescale of everything summed so far.
template <class S>
KERNELS_INLINE float row_softmax(float* s, int n, float& m, float& l) {
    using V = typename S::V;
    constexpr int W = S::W;
    // The max is exact in any order: vectors, then the tail.
    float tile_max = -std::numeric_limits<float>::infinity();
    int j = 0;
    if (n >= W) {
        V vmax = S::load(s);
        for (j = W; j + W <= n; j += W) vmax = S::max(vmax, S::load(s + j));
        tile_max = S::reduce_max(vmax);
    }
    for (; j < n; ++j) tile_max = std::max(tile_max, s[j]);
    const float m_new = std::max(m, tile_max);
    // The first tile: exp(-inf) = 0 times the zeros so far. A max that did not move: exp(0) = 1
    // exactly, without the call (most tiles after the first few).
    const float alpha = m_new == m ? 1.f : std::exp(m - m_new);
    float sum = 0.f;
    j = 0;
    for (; j + W <= n; j += W) {
        const V e = S::exp(S::sub(S::load(s + j), S::set1(m_new)));
        S::store(s + j, e);
        sum += S::reduce_add(e);
    }
    for (; j < n; ++j) {
        s[j] = std::exp(s[j] - m_new);
        sum += s[j];
    }
    l = l * alpha + sum;
    m = m_new;
    return alpha;
}

// acc_r = alpha_r * acc_r + sum_{j < n} p_rj v_j for R rows that read the same n keys, U register
// widths of head_dim at a time: each value row loaded once for the R rows. Per element of a row:
// one multiply, then an FMA per key in key order, whatever R and U (the same bits).
template <class S, int R, int U>
KERNELS_INLINE void rows_accumulate(const float* p, const float* alpha, int n, const float* v, int hd, float* acc) {
    using V = typename S::V;
    constexpr int W = S::W, KT = kKeyTile<S>;
    for (int i = 0; i < hd; i += U * W) {
        V o[R][U];
        for (int r = 0; r < R; ++r)
            for (int u = 0; u < U; ++u) o[r][u] = S::mul(S::load(acc + int64_t(r) * hd + i + u * W), S::set1(alpha[r]));
        for (int jj = 0; jj < n; ++jj) {
            V vj[U];
            for (int u = 0; u < U; ++u) vj[u] = S::load(v + int64_t(jj) * hd + i + u * W);
            for (int r = 0; r < R; ++r) {
                const V pj = S::set1(p[r * KT + jj]);
                for (int u = 0; u < U; ++u) o[r][u] = S::fma(pj, vj[u], o[r][u]);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int u = 0; u < U; ++u) S::store(acc + int64_t(r) * hd + i + u * W, o[r][u]);
    }
}

// One row, any head_dim (a vector loop, then a scalar tail).
template <class S>
KERNELS_INLINE void row_accumulate(const float* p, float alpha, int n, const float* v, int hd, float* acc) {
    using V = typename S::V;
    constexpr int W = S::W;
    const int vec_end = hd - hd % W;
    int i = 0;
    for (; i < vec_end; i += W) {
        V o = S::mul(S::load(acc + i), S::set1(alpha));
        for (int jj = 0; jj < n; ++jj) o = S::fma(S::set1(p[jj]), S::load(v + int64_t(jj) * hd + i), o);
        S::store(acc + i, o);
    }
    for (; i < hd; ++i) {
        float o = acc[i] * alpha;
        for (int jj = 0; jj < n; ++jj) o += p[jj] * v[int64_t(jj) * hd + i];
        acc[i] = o;
    }
}

// Pairs: the scores in bf16 pairs (S = Avx512, D = bf16, at the AVX512-BF16 level).
template <class S, DType D, bool Pairs = false>
KERNELS_INLINE void chunk_task(const ChunkArgs& a, const ChunkScratch& sc, int b, int kvh, int tile) {
    constexpr int W = S::W, KT = kKeyTile<S>, R = kRowBlock<S>;
    const int hd = a.head_dim, group = a.n_heads / a.n_kv_heads;
    const int n_q = a.query_lens[b];
    const int first = tile * kQueryTile, count = std::min(kQueryTile, n_q - first);
    const int pos0 = a.context_lens[b] - n_q;  // position of the chunk's first query
    const int rows = count * group;

    for (int qi = 0; qi < count; ++qi)
        for (int g = 0; g < group; ++g) {
            const int64_t src = int64_t(a.query_start[b] + first + qi) * a.q_stride + int64_t(kvh * group + g) * hd;
            const int64_t r = qi * group + g;
            if constexpr (Pairs) {  // the bf16 query as it is, as pairs (head_dim / 2 words a row)
                std::copy_n(static_cast<const uint16_t*>(a.q) + src, hd, reinterpret_cast<uint16_t*>(sc.q) + r * hd);
            } else {  // the scale folded into the query: one multiply per query element, not per score
                for (int i = 0; i < hd; ++i) sc.q[r * hd + i] = load_as_float<D>(a.q, src + i) * a.scale;
            }
        }
    std::fill(sc.acc, sc.acc + int64_t(rows) * hd, 0.f);
    std::fill(sc.m, sc.m + rows, -std::numeric_limits<float>::infinity());  // rows = count * group
    std::fill(sc.l, sc.l + rows, 0.f);

    const int key_end = pos0 + first + count;  // the last query's keys: 0 .. its position
    for (int k0 = 0; k0 < key_end; k0 += KT) {
        const int n = std::min(KT, key_end - k0);
        if constexpr (Pairs) load_key_tile_pairs(a, sc, b, kvh, k0, n);
        else load_key_tile<S, D>(a, sc, b, kvh, k0, n);
        // The rows that read any of this tile's keys: the tile is wholly after the queries before
        // `live` (only the diagonal tiles cut a task's queries).
        const int live = std::max(0, k0 - (pos0 + first));
        const int row_end = count * group;
        for (int r0 = live * group; r0 < row_end; r0 += R) {
            const int nr = std::min(R, row_end - r0);
            // keys of this tile each row reads: its query's causal bound
            auto own = [&](int r) { return std::min(n, pos0 + first + r / group - k0 + 1); };
            if constexpr (Pairs) {
                const uint32_t* q2 = reinterpret_cast<const uint32_t*>(sc.q);
                const uint32_t* kt2 = reinterpret_cast<const uint32_t*>(sc.kt);
                if (nr == R) row_scores_pairs<R>(q2 + int64_t(r0) * (hd / 2), kt2, hd, a.scale, sc.scores);
                else
                    for (int r = 0; r < nr; ++r)
                        row_scores_pairs<1>(q2 + int64_t(r0 + r) * (hd / 2), kt2, hd, a.scale, sc.scores + r * KT);
            } else if (nr == R) {
                row_scores<S, R>(sc.q + int64_t(r0) * hd, sc.kt, hd, sc.scores);
            } else {
                for (int r = 0; r < nr; ++r)
                    row_scores<S, 1>(sc.q + int64_t(r0 + r) * hd, sc.kt, hd, sc.scores + r * KT);
            }
            float alpha[R];
            for (int r = 0; r < nr; ++r)
                alpha[r] = row_softmax<S>(sc.scores + r * KT, own(r0 + r), sc.m[r0 + r], sc.l[r0 + r]);
            // R x 4 accumulators where head_dim is a multiple of 4 vectors (AVX512: 64, 128, 256;
            // R x 2 took 6 % longer over a 2,000-token prompt), else R x 2 (AVX512: 32, 96).
            const bool together = nr == R && own(r0) == own(r0 + R - 1);
            if (together && hd % (4 * W) == 0)
                rows_accumulate<S, R, 4>(sc.scores, alpha, own(r0), sc.v, hd, sc.acc + int64_t(r0) * hd);
            else if (together && hd % (2 * W) == 0)
                rows_accumulate<S, R, 2>(sc.scores, alpha, own(r0), sc.v, hd, sc.acc + int64_t(r0) * hd);
            else
                for (int r = 0; r < nr; ++r)
                    row_accumulate<S>(sc.scores + r * KT, alpha[r], own(r0 + r), sc.v, hd,
                                      sc.acc + int64_t(r0 + r) * hd);
        }
    }

    const int vec_end = hd - hd % W;
    for (int qi = 0; qi < count; ++qi)
        for (int g = 0; g < group; ++g) {
            const int r = qi * group + g;
            const float inv = 1.f / sc.l[r];
            const float* acc = sc.acc + int64_t(r) * hd;
            const int64_t dst = (int64_t(a.query_start[b] + first + qi) * a.n_heads + kvh * group + g) * hd;
            int i = 0;
            for (; i < vec_end; i += W) S::template store_as<D>(a.out, dst + i, S::mul(S::load(acc + i), S::set1(inv)));
            for (; i < hd; ++i) store_from_float<D>(a.out, dst + i, acc[i] * inv);
        }
}

template <class S>
KERNELS_INLINE void chunk_task_any(const ChunkArgs& a, DType d, const ChunkScratch& sc, int b, int kvh, int tile) {
    switch (d) {
        case DType::f32: chunk_task<S, DType::f32>(a, sc, b, kvh, tile); break;
        case DType::bf16: chunk_task<S, DType::bf16>(a, sc, b, kvh, tile); break;
        case DType::f16: chunk_task<S, DType::f16>(a, sc, b, kvh, tile); break;
    }
}

using ChunkFn = void (*)(const ChunkArgs&, DType, const ChunkScratch&, int, int, int);

void chunk_scalar(const ChunkArgs& a, DType d, const ChunkScratch& sc, int b, int kvh, int tile) {
    chunk_task_any<Scalar>(a, d, sc, b, kvh, tile);
}
#ifdef KERNELS_X86
KERNELS_AVX2 __attribute__((flatten)) void chunk_avx2(const ChunkArgs& a, DType d, const ChunkScratch& sc, int b,
                                                      int kvh, int tile) {
    chunk_task_any<Avx2>(a, d, sc, b, kvh, tile);
}
KERNELS_AVX512 __attribute__((flatten)) void chunk_avx512(const ChunkArgs& a, DType d, const ChunkScratch& sc, int b,
                                                          int kvh, int tile) {
    chunk_task_any<Avx512>(a, d, sc, b, kvh, tile);
}
KERNELS_AVX512_BF16 __attribute__((flatten)) void chunk_avx512_pairs(const ChunkArgs& a, DType d,
                                                                     const ChunkScratch& sc, int b, int kvh, int tile) {
    if (d == DType::bf16) chunk_task<Avx512, DType::bf16, true>(a, sc, b, kvh, tile);
    else chunk_task_any<Avx512>(a, d, sc, b, kvh, tile);
}
#endif

}  // namespace

void chunk_attention(void* out, const void* q, int64_t q_stride, const void* k_pool, const void* v_pool,
                     const int32_t* block_tables, const int32_t* query_start, const int32_t* query_lens,
                     const int32_t* context_lens, int tokens, int batch, int n_heads, int n_kv_heads, int head_dim,
                     int block_size, int max_blocks, float scale, DType dtype) {
    (void)tokens;  // the CUDA twin's grid; here the lengths are at hand
    const ChunkArgs a{out,        q,          q_stride,   k_pool,     v_pool,   block_tables, query_start, query_lens,
                      context_lens, batch,    n_heads,    n_kv_heads, head_dim, block_size,   max_blocks,  scale};
    const int group = n_heads / n_kv_heads;

    ChunkFn task = chunk_scalar;
#ifdef KERNELS_X86
    if (gemm_bf16_pairs()) task = chunk_avx512_pairs;  // AVX512-BF16, where pairs are the faster form
    else if (isa() >= Isa::avx512) task = chunk_avx512;
    else if (isa() == Isa::avx2) task = chunk_avx2;
#endif

    // Tasks (sequence, query tile), the latest tiles first: they read the most keys, and dynamic
    // scheduling then fills in with the short ones. Each is done for every kv head.
    struct Tile {
        int b, tile, keys;
    };
    std::vector<Tile> tiles;
    int64_t work = 0;  // query-key pairs, to decide whether threads pay
    for (int b = 0; b < batch; ++b) {
        const int n_q = query_lens[b], pos0 = context_lens[b] - n_q;
        for (int t = 0; t * kQueryTile < n_q; ++t) {
            const int keys = pos0 + std::min(n_q, (t + 1) * kQueryTile);
            tiles.push_back({b, t, keys});
            work += int64_t(keys) * std::min(kQueryTile, n_q - t * kQueryTile);
        }
    }
    std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& x, const Tile& y) { return x.keys > y.keys; });
    const int64_t tasks = int64_t(tiles.size()) * n_kv_heads;
    const bool parallel = work * n_heads * head_dim > (int64_t(1) << 16) && omp_get_max_threads() > 1 && tasks > 1;

#pragma omp parallel if (parallel)
    {
        thread_local std::vector<float> buffer;
        const size_t rows = size_t(kQueryTile) * group;
        buffer.resize(2 * rows * head_dim + 2 * rows + 2 * size_t(kMaxKeyTile) * head_dim + 4 * kMaxKeyTile);
        float* p = buffer.data();
        ChunkScratch sc;
        sc.q = p, p += rows * head_dim;
        sc.acc = p, p += rows * head_dim;
        sc.m = p, p += rows;
        sc.l = p, p += rows;
        sc.kt = p, p += size_t(kMaxKeyTile) * head_dim;
        sc.v = p, p += size_t(kMaxKeyTile) * head_dim;
        sc.scores = p;
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < tasks; ++t) {
            const Tile& tile = tiles[size_t(t / n_kv_heads)];
            task(a, dtype, sc, tile.b, int(t % n_kv_heads), tile.tile);
        }
    }
}

}  // namespace kernels::cpu

KERNELS_VECTOR_CODE_END
