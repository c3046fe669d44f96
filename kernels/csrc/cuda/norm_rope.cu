// RMSNorm with the residual add fused, RoPE (alone, and fused with the KV cache write), and
// SwiGLU's silu(gate) * up: the CUDA twins of add_rms_norm, rope, rope_cache and silu_mul in
// cpu/cpu_kernels.h (the contracts and the maths are there).
//
// All are small, memory-bound kernels: they read and write each element once or twice and do a
// few flops on it. What matters is that the loads are coalesced (neighbouring threads read
// neighbouring elements) and, for the norm, wide (16 bytes per thread per instruction).
#include <algorithm>
#include <climits>
#include <cstdint>

#include "dtype.cuh"
#include "launchers.h"

namespace kernels::cuda {
namespace {

// --- add_rms_norm ---------------------------------------------------------------------------
// One block per row. Each thread takes VEC consecutive elements at a time (VEC * sizeof(T) = 16
// bytes when the row allows it, else 1 element), striding over the row by the block's width.
//
//   pass 1: x += delta (rounded to T and written back: the residual stream), sum of x^2 in float
//   block reduction: the row's sum of squares -> 1 / sqrt(mean + eps), shared by all threads
//   pass 2: out = x * inv_rms * weight, rounded once
//
// Pass 2 reads x again rather than keeping it in registers: a row is a few KB, and each thread
// reads back exactly the elements it wrote in pass 1 (so it sees its own writes, no barrier
// needed for that), from L1/L2.

constexpr int kMaxNormThreads = 1024;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// The sum of v over the block (blockDim.x a multiple of 32), returned to every thread: each warp
// sums its lanes with shuffles, warp leaders leave their sums in shared memory, and the first
// warp sums those.
__device__ float block_sum(float v) {
    __shared__ float warp_sums[32];
    __shared__ float total;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    v = warp_sum(v);
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int n_warps = blockDim.x / 32;
        v = warp_sum(lane < n_warps ? warp_sums[lane] : 0.f);
        if (lane == 0) total = v;
    }
    __syncthreads();
    return total;
}

template <typename T, int VEC>
__global__ void add_rms_norm_kernel(T* __restrict__ out, T* __restrict__ x, const T* __restrict__ delta,
                                    const T* __restrict__ weight, int hidden, float eps) {
    const int64_t row = blockIdx.x;
    T* xr = x + row * hidden;
    T* outr = out + row * hidden;
    const int step = blockDim.x * VEC;

    float sum_sq = 0.f;
    for (int i = threadIdx.x * VEC; i < hidden; i += step) {
        float v[VEC];
        load_vec<T, VEC>(xr + i, v);
        if (delta != nullptr) {  // the same for every thread: no divergence
            float d[VEC];
            load_vec<T, VEC>(delta + row * hidden + i, d);
#pragma unroll
            for (int e = 0; e < VEC; ++e) v[e] = round_to<T>(v[e] + d[e]);  // what the residual stream holds
            store_vec<T, VEC>(xr + i, v);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) sum_sq = fmaf(v[e], v[e], sum_sq);
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq) / hidden + eps);

    for (int i = threadIdx.x * VEC; i < hidden; i += step) {
        float v[VEC], w[VEC];
        load_vec<T, VEC>(xr + i, v);
        load_vec<T, VEC>(weight + i, w);
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[e] = v[e] * inv_rms * w[e];
        store_vec<T, VEC>(outr + i, v);
    }
}

template <typename T, int VEC>
cudaError_t launch_norm(void* out, void* x, const void* delta, const void* weight, int rows, int hidden, float eps,
                        cudaStream_t stream) {
    // Enough threads for one pass over the row, in whole warps, at most 1024.
    const int vectors = (hidden + VEC - 1) / VEC;
    const int threads = std::min(kMaxNormThreads, std::max(32, (vectors + 31) / 32 * 32));
    add_rms_norm_kernel<T, VEC><<<rows, threads, 0, stream>>>(static_cast<T*>(out), static_cast<T*>(x),
                                                              static_cast<const T*>(delta),
                                                              static_cast<const T*>(weight), hidden, eps);
    return cudaGetLastError();
}

// --- rope -------------------------------------------------------------------------------------
// One thread per (token, head, pair i < head_dim/2): it rotates (x[i], x[i + half]) by the angle
// whose cos and sin are cos[t, i], sin[t, i]  (rotate-half, as HF Llama):
//   x[i]        <- x[i] cos - x[i + half] sin
//   x[i + half] <- x[i + half] cos + x[i] sin
// Threads with consecutive indices take consecutive i, so a warp reads 32 consecutive elements
// of each half and 32 consecutive cos/sin values: coalesced. A pair is read and written by its
// thread only, so in place is safe.
template <typename T>
__global__ void rope_kernel(T* __restrict__ qk, const float* __restrict__ cos, const float* __restrict__ sin,
                            int64_t pairs_total, int n_heads, int half, int64_t token_stride) {
    const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (index >= pairs_total) return;
    const int i = static_cast<int>(index % half);
    const int64_t token_head = index / half;
    const int head = static_cast<int>(token_head % n_heads);
    const int64_t token = token_head / n_heads;

    T* x = qk + token * token_stride + static_cast<int64_t>(head) * 2 * half;
    const float c = cos[token * half + i], s = sin[token * half + i];
    const float x1 = load(x + i), x2 = load(x + i + half);
    store(x + i, x1 * c - x2 * s);
    store(x + i + half, x2 * c + x1 * s);
}

constexpr int kRopeThreads = 256;

// --- rope_cache -------------------------------------------------------------------------------
// One thread per (token, head of q, k and v, pair i < head_dim/2), as rope's: a q pair is rotated
// in place, a k pair rotated into the pool row of the token's slot, a v pair copied there. The
// heads of a token are consecutive in qkv and in a pool row, so a warp's reads and writes stay
// coalesced across the q/k/v boundaries (a branch per head kind, uniform over most warps).
template <typename T>
__global__ void rope_cache_kernel(T* __restrict__ qkv, const float* __restrict__ cos, const float* __restrict__ sin,
                                  T* __restrict__ k_pool, T* __restrict__ v_pool, const int64_t* __restrict__ slots,
                                  int64_t pairs_total, int n_heads, int n_kv_heads, int half) {
    const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (index >= pairs_total) return;
    const int heads = n_heads + 2 * n_kv_heads;
    const int i = static_cast<int>(index % half);
    const int64_t token_head = index / half;
    const int head = static_cast<int>(token_head % heads);
    const int64_t token = token_head / heads;

    T* x = qkv + token_head * 2 * half;
    const float x1 = load(x + i), x2 = load(x + i + half);
    if (head >= n_heads + n_kv_heads) {  // v: copied as it is
        T* out = v_pool + (slots[token] * n_kv_heads + head - n_heads - n_kv_heads) * 2 * half;
        store(out + i, x1);
        store(out + i + half, x2);
        return;
    }
    T* out = head < n_heads ? x : k_pool + (slots[token] * n_kv_heads + head - n_heads) * 2 * half;
    const float c = cos[token * half + i], s = sin[token * half + i];
    store(out + i, x1 * c - x2 * s);
    store(out + i + half, x2 * c + x1 * s);
}

// --- silu_mul -----------------------------------------------------------------------------------
// One thread per output element (row, i): gate at [row, i], up at [row, inter + i]; consecutive
// threads read consecutive elements of both halves. e^-g overflowing to inf for g < -88 gives
// g / inf = -0, silu's limit, as the C++ twin's cap does.
template <typename T>
__global__ void silu_mul_kernel(T* __restrict__ out, const T* __restrict__ gate_up, int64_t total, int inter) {
    const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (index >= total) return;
    const int64_t row = index / inter;
    const int i = static_cast<int>(index % inter);
    const T* r = gate_up + row * 2 * inter;
    const float g = load(r + i);
    store(out + index, g / (1.f + __expf(-g)) * load(r + inter + i));
}

constexpr int kSiluThreads = 256;

}  // namespace

cudaError_t add_rms_norm(void* out, void* x, const void* delta, const void* weight, int rows, int hidden, float eps,
                         DType dtype, cudaStream_t stream) {
    if (rows < 0 || hidden <= 0) return cudaErrorInvalidValue;
    if (rows == 0) return cudaSuccess;
    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        // 16-byte accesses when every row of every tensor starts 16-byte aligned: the base
        // pointers are, and a row (hidden elements) is a whole number of 16-byte vectors.
        constexpr int VEC = 16 / sizeof(T);
        const bool wide = hidden % VEC == 0 && is_aligned(out, 16) && is_aligned(x, 16) &&
                          (delta == nullptr || is_aligned(delta, 16)) && is_aligned(weight, 16);
        return wide ? launch_norm<T, VEC>(out, x, delta, weight, rows, hidden, eps, stream)
                    : launch_norm<T, 1>(out, x, delta, weight, rows, hidden, eps, stream);
    });
}

cudaError_t rope(void* qk, const float* cos, const float* sin, int tokens, int n_heads, int head_dim,
                 int64_t token_stride, DType dtype, cudaStream_t stream) {
    if (tokens < 0 || n_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0) return cudaErrorInvalidValue;
    const int half = head_dim / 2;
    const int64_t pairs_total = static_cast<int64_t>(tokens) * n_heads * half;
    if (pairs_total == 0) return cudaSuccess;
    const int64_t blocks = (pairs_total + kRopeThreads - 1) / kRopeThreads;
    if (blocks > INT_MAX) return cudaErrorInvalidValue;
    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        rope_kernel<T><<<static_cast<unsigned>(blocks), kRopeThreads, 0, stream>>>(
            static_cast<T*>(qk), cos, sin, pairs_total, n_heads, half, token_stride);
        return cudaGetLastError();
    });
}

cudaError_t rope_cache(void* qkv, const float* cos, const float* sin, void* k_pool, void* v_pool, const int64_t* slots,
                       int tokens, int n_heads, int n_kv_heads, int head_dim, DType dtype, cudaStream_t stream) {
    if (tokens < 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0)
        return cudaErrorInvalidValue;
    const int half = head_dim / 2;
    const int64_t pairs_total = static_cast<int64_t>(tokens) * (n_heads + 2 * n_kv_heads) * half;
    if (pairs_total == 0) return cudaSuccess;
    const int64_t blocks = (pairs_total + kRopeThreads - 1) / kRopeThreads;
    if (blocks > INT_MAX) return cudaErrorInvalidValue;
    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        rope_cache_kernel<T><<<static_cast<unsigned>(blocks), kRopeThreads, 0, stream>>>(
            static_cast<T*>(qkv), cos, sin, static_cast<T*>(k_pool), static_cast<T*>(v_pool), slots, pairs_total,
            n_heads, n_kv_heads, half);
        return cudaGetLastError();
    });
}

cudaError_t silu_mul(void* out, const void* gate_up, int rows, int inter, DType dtype, cudaStream_t stream) {
    if (rows < 0 || inter <= 0) return cudaErrorInvalidValue;
    const int64_t total = static_cast<int64_t>(rows) * inter;
    if (total == 0) return cudaSuccess;
    const int64_t blocks = (total + kSiluThreads - 1) / kSiluThreads;
    if (blocks > INT_MAX) return cudaErrorInvalidValue;
    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        silu_mul_kernel<T><<<static_cast<unsigned>(blocks), kSiluThreads, 0, stream>>>(
            static_cast<T*>(out), static_cast<const T*>(gate_up), total, inter);
        return cudaGetLastError();
    });
}

}  // namespace kernels::cuda
