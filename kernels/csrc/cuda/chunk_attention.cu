// Prompt-chunk attention over the paged KV cache, FlashAttention-2's loop on a GPU: the twin of
// cpu/chunk_attention.cpp (cpu_kernels.h has the contract).
//
// A block serves kRows query rows of one sequence and one kv head, a row being one (query, query
// head of the kv head's group) pair: the sequence's rows are its queries times the group's heads,
// cut into tiles of kRows. Its 4 warps own kRowsPerWarp rows each; a lane holds head_dim / 32
// elements of each row's q (scaled) and of its output accumulator, in registers. The block walks
// the keys from position 0 to its last query's, in tiles of KT keys: the whole block stages the
// tile's K and V rows (read through the block table where they lie in the pool, widened to float)
// in shared memory, then each warp runs the online softmax for its rows over the tile. Scores are
// one lane's partial dot products summed across the warp (a butterfly); lane j keeps key j's
// score, so the tile's max, the weights p_j = exp(s_j - m) and their sum are warp reductions, and
// acc = alpha * acc + sum_j p_j v_j reads each p_j from lane j by a shuffle. Each row stops at its
// own position (the causal bound), a warp-uniform test since a warp does one row at a time.
//
// The grid: (an upper bound on the row tiles of all sequences, n_kv_heads). The host does not read
// the lengths (they are on the device: reading them would be a wait), so x is tokens * group /
// kRows + batch, and a block finds its sequence and tile by walking query_lens; blocks past the
// last tile return at once.
//
// What it leaves out (a teaching kernel, unmeasured on hardware): tensor cores (mma.sync on bf16
// tiles would replace both products), double buffering of the K/V tiles (cp.async), splitting one
// long chunk's keys over blocks (a prompt of a few hundred queries fills a GPU's SMs only with
// many heads), and 16-byte loads of the pool.
#include <cmath>
#include <cstdint>

#include "dtype.cuh"
#include "launchers.h"

namespace kernels::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 4;
constexpr int kRows = kWarps * kRowsPerWarp;  // (query, head) rows per block

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

struct ChunkParams {
    const void* q;
    int64_t q_stride;
    const void* k_pool;
    const void* v_pool;
    const int32_t* block_tables;
    const int32_t* query_start;
    const int32_t* query_lens;
    const int32_t* context_lens;
    void* out;
    int batch, n_heads, n_kv_heads, block_size, max_blocks;
    float scale;
};

// Keys per tile: K and V of a tile as floats in static shared memory, 32 KB at most (KT * HEAD_DIM
// * 8 bytes), under the 48 KB a block gets without opting in.
template <int HEAD_DIM>
struct KeyTile {
    static constexpr int value = HEAD_DIM <= 128 ? 32 : 16;
};

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads, 4) chunk_attention_kernel(ChunkParams p) {
    constexpr int KT = KeyTile<HEAD_DIM>::value;
    constexpr int E = HEAD_DIM / 32;  // elements of a row per lane: lane + 32 * i
    __shared__ float k_tile[KT][HEAD_DIM];
    __shared__ float v_tile[KT][HEAD_DIM];

    const int group = p.n_heads / p.n_kv_heads, kvh = blockIdx.y;
    // Which sequence and tile of its rows: the same answer in every thread, so the early return
    // below is taken by the whole block (no barrier is left waiting).
    int tile = blockIdx.x, b = 0;
    for (; b < p.batch; ++b) {
        const int tiles = (p.query_lens[b] * group + kRows - 1) / kRows;
        if (tile < tiles) break;
        tile -= tiles;
    }
    if (b == p.batch) return;

    const int n_q = p.query_lens[b], pos0 = p.context_lens[b] - n_q, rows = n_q * group;
    const int first_row = tile * kRows, last_row = min(first_row + kRows, rows) - 1;
    const int key_end = pos0 + last_row / group + 1;  // the block's last query reads keys 0 .. key_end - 1
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const T* q = static_cast<const T*>(p.q);
    const T* k_pool = static_cast<const T*>(p.k_pool);
    const T* v_pool = static_cast<const T*>(p.v_pool);
    const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks;

    float qr[kRowsPerWarp][E], acc[kRowsPerWarp][E], m[kRowsPerWarp], l[kRowsPerWarp];
    int pos[kRowsPerWarp];  // each row's query position; -1: no row (past the sequence's rows)
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const int r = first_row + warp * kRowsPerWarp + rr;
        pos[rr] = r < rows ? pos0 + r / group : -1;
        m[rr] = -INFINITY;
        l[rr] = 0.f;
        const int64_t src = r < rows ? (p.query_start[b] + r / group) * p.q_stride +
                                           static_cast<int64_t>(kvh * group + r % group) * HEAD_DIM
                                     : 0;
#pragma unroll
        for (int i = 0; i < E; ++i) {
            qr[rr][i] = r < rows ? load(q + src + lane + 32 * i) * p.scale : 0.f;
            acc[rr][i] = 0.f;
        }
    }

    for (int k0 = 0; k0 < key_end; k0 += KT) {
        const int n = min(KT, key_end - k0);
        __syncthreads();  // every warp is done with the previous tile
        for (int idx = threadIdx.x; idx < n * HEAD_DIM; idx += kThreads) {
            const int j = idx / HEAD_DIM, d = idx % HEAD_DIM, key = k0 + j;
            const int64_t row =
                ((static_cast<int64_t>(table[key / p.block_size]) * p.block_size + key % p.block_size) * p.n_kv_heads +
                 kvh) * HEAD_DIM;
            k_tile[j][d] = load(k_pool + row + d);
            v_tile[j][d] = load(v_pool + row + d);
        }
        __syncthreads();  // the tile is staged

#pragma unroll
        for (int rr = 0; rr < kRowsPerWarp; ++rr) {
            const int own = min(n, pos[rr] - k0 + 1);  // keys of this tile the row reads (warp-uniform)
            if (pos[rr] < 0 || own <= 0) continue;
            float score = -INFINITY;  // lane j: key j's
            for (int j = 0; j < own; ++j) {
                float partial = 0.f;
#pragma unroll
                for (int i = 0; i < E; ++i) partial += qr[rr][i] * k_tile[j][lane + 32 * i];
                const float s = warp_sum(partial);
                if (lane == j) score = s;
            }
            const float m_new = fmaxf(m[rr], warp_max(score));
            const float alpha = __expf(m[rr] - m_new);  // the first tile: exp(-inf) = 0
            const float weight = lane < own ? __expf(score - m_new) : 0.f;
            l[rr] = l[rr] * alpha + warp_sum(weight);
            m[rr] = m_new;
#pragma unroll
            for (int i = 0; i < E; ++i) acc[rr][i] *= alpha;
            for (int j = 0; j < own; ++j) {
                const float pj = __shfl_sync(0xffffffffu, weight, j);
#pragma unroll
                for (int i = 0; i < E; ++i) acc[rr][i] += pj * v_tile[j][lane + 32 * i];
            }
        }
    }

    T* out = static_cast<T*>(p.out);
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        if (pos[rr] < 0) continue;
        const int r = first_row + warp * kRowsPerWarp + rr;
        const int64_t dst =
            (static_cast<int64_t>(p.query_start[b] + r / group) * p.n_heads + kvh * group + r % group) * HEAD_DIM;
        const float inv = 1.f / l[rr];
#pragma unroll
        for (int i = 0; i < E; ++i) store(out + dst + lane + 32 * i, acc[rr][i] * inv);
    }
}

template <typename T, int HEAD_DIM>
cudaError_t launch_chunks(const ChunkParams& p, int tokens, cudaStream_t stream) {
    const int group = p.n_heads / p.n_kv_heads;
    const int64_t tiles = (static_cast<int64_t>(tokens) * group + kRows - 1) / kRows + p.batch;
    if (tiles > INT32_MAX || p.n_kv_heads > 65535) return cudaErrorInvalidValue;
    chunk_attention_kernel<T, HEAD_DIM><<<dim3(static_cast<unsigned>(tiles), p.n_kv_heads), kThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace

cudaError_t chunk_attention(void* out, const void* q, int64_t q_stride, const void* k_pool, const void* v_pool,
                            const int32_t* block_tables, const int32_t* query_start, const int32_t* query_lens,
                            const int32_t* context_lens, int tokens, int batch, int n_heads, int n_kv_heads,
                            int head_dim, int block_size, int max_blocks, float scale, DType dtype,
                            cudaStream_t stream) {
    if (batch < 0 || tokens < 0 || n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 || block_size <= 0 ||
        max_blocks <= 0) {
        return cudaErrorInvalidValue;
    }
    if (!supported_head_dim(head_dim)) return cudaErrorInvalidValue;  // the instantiated sizes (kernels.h)
    if (batch == 0 || tokens == 0) return cudaSuccess;
    const ChunkParams p{q,        q_stride, k_pool,  v_pool,     block_tables, query_start, query_lens, context_lens,
                        out,      batch,    n_heads, n_kv_heads, block_size,   max_blocks,  scale};
    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        switch (head_dim) {  // kernels.h's kHeadDims
            case 32: return launch_chunks<T, 32>(p, tokens, stream);
            case 64: return launch_chunks<T, 64>(p, tokens, stream);
            case 96: return launch_chunks<T, 96>(p, tokens, stream);
            case 128: return launch_chunks<T, 128>(p, tokens, stream);
            case 256: return launch_chunks<T, 256>(p, tokens, stream);
        }
        return cudaErrorInvalidValue;
    });
}

}  // namespace kernels::cuda
