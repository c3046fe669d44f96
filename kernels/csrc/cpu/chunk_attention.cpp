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
// kKeyTile from position 0 up to its last query's position, never past it (the causal bound skips
// the tiles above the diagonal), keeping per query row a running max m, a running sum l of
// exp(score - m) and an unnormalised output acc, rescaled by exp(m_old - m_new) when a tile raises
// the max: the online softmax, so no row ever holds all its scores. The output is acc / l.
//
// Why the key tiles start at position 0 and each row stops at its own last key: a query row's
// result is then computed by the same operations in the same order whatever chunk it came in, and
// whichever tile of queries it sits in (its scores are one FMA chain over head_dim per key, the
// rows of a tile do not mix). A prompt cut into other chunks, or a row alone, gives the same bits.
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

constexpr int kKeyTile = 32;    // keys per tile: a multiple of every vector width (16, 8, 1)
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
    float* acc;     // [rows, head_dim]: unnormalised outputs
    float* m;       // [rows] running max
    float* l;       // [rows] running sum
    float* kt;      // [head_dim, kKeyTile]: the key tile transposed, zeros past its keys
    float* v;       // [kKeyTile, head_dim]: the value tile
    float* scores;  // [kKeyTile]
};

// One key tile, keys k0 .. k0 + n - 1 of sequence b, kv head kvh, widened into the scratch: keys
// transposed (a vector of scores is then kKeyTile / W FMA chains over head_dim, one per key lane),
// values as rows.
template <class S, DType D>
KERNELS_INLINE void load_key_tile(const ChunkArgs& a, const ChunkScratch& sc, int b, int kvh, int k0, int n) {
    constexpr int W = S::W;
    const int hd = a.head_dim, bs = a.block_size;
    const int32_t* table = a.block_tables + int64_t(b) * a.max_blocks;
    for (int j = 0; j < n; ++j) {
        const int pos = k0 + j;
        const int64_t row = ((int64_t(table[pos / bs]) * bs + pos % bs) * a.n_kv_heads + kvh) * hd;
        for (int i = 0; i < hd; ++i) sc.kt[int64_t(i) * kKeyTile + j] = load_as_float<D>(a.k_pool, row + i);
        float* vj = sc.v + int64_t(j) * hd;
        int i = 0;
        for (; i + W <= hd; i += W) S::store(vj + i, S::template load_as<D>(a.v_pool, row + i));
        for (; i < hd; ++i) vj[i] = load_as_float<D>(a.v_pool, row + i);
    }
    // Lanes past the tile's keys: finite, so their scores are too (they are never used).
    if (n < kKeyTile)
        for (int i = 0; i < hd; ++i) std::fill(sc.kt + int64_t(i) * kKeyTile + n, sc.kt + int64_t(i + 1) * kKeyTile, 0.f);
}

// Scores of one query row against the tile's keys: s[j] = q . k_j for every lane j.
template <class S>
KERNELS_INLINE void row_scores(const float* q, const float* kt, int hd, float* s) {
    using V = typename S::V;
    constexpr int W = S::W, NV = kKeyTile / W;
    V acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = S::zero();
    for (int i = 0; i < hd; ++i) {
        const V qi = S::set1(q[i]);
        const float* k = kt + int64_t(i) * kKeyTile;
        for (int v = 0; v < NV; ++v) acc[v] = S::fma(qi, S::load(k + v * W), acc[v]);
    }
    for (int v = 0; v < NV; ++v) S::store(s + v * W, acc[v]);
}

// The online-softmax step of one row over its first n keys of the tile (its causal bound):
// m, l, acc rescaled by exp(m_old - m_new) and the tile's weights added.
template <class S>
KERNELS_INLINE void row_update(float* s, int n, const float* v, int hd, float& m, float& l, float* acc) {
    using V = typename S::V;
    constexpr int W = S::W;
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < n; ++j) tile_max = std::max(tile_max, s[j]);
    const float m_new = std::max(m, tile_max);
    const float alpha = std::exp(m - m_new);  // the first tile: exp(-inf) = 0 times the zeros so far
    float sum = 0.f;
    int j = 0;
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

    // acc = alpha * acc + sum_j p_j v_j, 4 register widths of head_dim at a time (as the decode kernel)
    const int vec_end = hd - hd % W;
    const V va = S::set1(alpha);
    int i = 0;
    for (; i + 4 * W <= vec_end; i += 4 * W) {
        V o0 = S::mul(S::load(acc + i), va), o1 = S::mul(S::load(acc + i + W), va);
        V o2 = S::mul(S::load(acc + i + 2 * W), va), o3 = S::mul(S::load(acc + i + 3 * W), va);
        for (int jj = 0; jj < n; ++jj) {
            const V pj = S::set1(s[jj]);
            const float* vj = v + int64_t(jj) * hd + i;
            o0 = S::fma(pj, S::load(vj), o0);
            o1 = S::fma(pj, S::load(vj + W), o1);
            o2 = S::fma(pj, S::load(vj + 2 * W), o2);
            o3 = S::fma(pj, S::load(vj + 3 * W), o3);
        }
        S::store(acc + i, o0);
        S::store(acc + i + W, o1);
        S::store(acc + i + 2 * W, o2);
        S::store(acc + i + 3 * W, o3);
    }
    for (; i < vec_end; i += W) {
        V o = S::mul(S::load(acc + i), va);
        for (int jj = 0; jj < n; ++jj) o = S::fma(S::set1(s[jj]), S::load(v + int64_t(jj) * hd + i), o);
        S::store(acc + i, o);
    }
    for (; i < hd; ++i) {
        float o = acc[i] * alpha;
        for (int jj = 0; jj < n; ++jj) o += s[jj] * v[int64_t(jj) * hd + i];
        acc[i] = o;
    }
}

template <class S, DType D>
KERNELS_INLINE void chunk_task(const ChunkArgs& a, const ChunkScratch& sc, int b, int kvh, int tile) {
    constexpr int W = S::W;
    const int hd = a.head_dim, group = a.n_heads / a.n_kv_heads;
    const int n_q = a.query_lens[b];
    const int first = tile * kQueryTile, count = std::min(kQueryTile, n_q - first);
    const int pos0 = a.context_lens[b] - n_q;  // position of the chunk's first query
    const int rows = count * group;

    for (int qi = 0; qi < count; ++qi)
        for (int g = 0; g < group; ++g) {
            // The scale folded into the query: one multiply per query element, not per score.
            const int64_t src = int64_t(a.query_start[b] + first + qi) * a.q_stride + int64_t(kvh * group + g) * hd;
            float* row = sc.q + int64_t(qi * group + g) * hd;
            for (int i = 0; i < hd; ++i) row[i] = load_as_float<D>(a.q, src + i) * a.scale;
        }
    std::fill(sc.acc, sc.acc + int64_t(rows) * hd, 0.f);
    std::fill(sc.m, sc.m + rows, -std::numeric_limits<float>::infinity());
    std::fill(sc.l, sc.l + rows, 0.f);

    const int key_end = pos0 + first + count;  // the last query's keys: 0 .. its position
    for (int k0 = 0; k0 < key_end; k0 += kKeyTile) {
        const int n = std::min(kKeyTile, key_end - k0);
        load_key_tile<S, D>(a, sc, b, kvh, k0, n);
        for (int qi = 0; qi < count; ++qi) {
            const int own = std::min(n, pos0 + first + qi - k0 + 1);  // keys of this tile the query reads
            if (own <= 0) continue;  // the tile is wholly after this query
            for (int g = 0; g < group; ++g) {
                const int r = qi * group + g;
                row_scores<S>(sc.q + int64_t(r) * hd, sc.kt, hd, sc.scores);
                row_update<S>(sc.scores, own, sc.v, hd, sc.m[r], sc.l[r], sc.acc + int64_t(r) * hd);
            }
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
    if (isa() >= Isa::avx512) task = chunk_avx512;
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
        buffer.resize(2 * rows * head_dim + 2 * rows + 2 * size_t(kKeyTile) * head_dim + kKeyTile);
        float* p = buffer.data();
        ChunkScratch sc;
        sc.q = p, p += rows * head_dim;
        sc.acc = p, p += rows * head_dim;
        sc.m = p, p += rows;
        sc.l = p, p += rows;
        sc.kt = p, p += size_t(kKeyTile) * head_dim;
        sc.v = p, p += size_t(kKeyTile) * head_dim;
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
