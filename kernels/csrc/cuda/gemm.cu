// Linear layers for many rows of x: y = x @ W.T as a tiled matrix product, for int4 (group-wise),
// int8 (per row) and bf16 weights; the CUDA twin of cpu/gemm.cpp (int4_gemm, int8_gemm, bf16_gemm
// in cuda/launchers.h; the formats are described in cpu/cpu_kernels.h).
//
// Why a second kernel. quant_linear.cu's kernels are matrix-vector products: each weight is read
// once and used for the few rows of x of a decode step, so they are as fast as memory delivers W.
// A prompt chunk or a batch of many sequences has tens to hundreds of rows; there each weight is
// used `rows` times, the work is the multiply-adds, and what matters is to do them from fast
// memory. The classic way is tiling:
//
//   grid     one block per tile of the output: BM rows of x by BN = 64 outputs (rows of W).
//   k loop   the block walks the inputs in steps of BK = 32. At each step its 256 threads
//            (1) stage a BM x BK tile of x and a BN x BK tile of W in shared memory, as floats (an
//            int4 weight is dequantized here, min + scale * code, once per weight per block), then
//            (2) multiply the two tiles into the block's accumulators.
//   thread   owns a register tile of TM rows x TN = 4 outputs of the block's tile, 16 float32
//            accumulators at BM = 64 (TM = 4): at each of the BK inputs it reads TM values of x
//            and TN weights from shared memory and does TM * TN multiply-adds with them.
//
// Data reuse, level by level. From global memory, each weight of the block's tile is read once
// and used for BM rows of x, each x value once and used for BN outputs: global traffic is 1/BM
// (W) and 1/BN (x) of a naive kernel's. From shared memory, each thread reads TM + TN floats per
// input for TM * TN multiply-adds: with a 4 x 4 tile, 8 reads (two 16-byte loads) per 16 FMAs,
// where one output per thread would need 2 reads per FMA and be bound by shared memory's
// bandwidth (128 bytes per clock per SM), not by the FMA units. The register tile is what makes
// the loop compute-bound; its accumulators are a fixed-size array indexed by compile-time
// constants (the loops over it are unrolled), so they live in registers.
//
// The row tile BM follows the call: 16, 32 or 64 rows (TM = 1, 2, 4), the smallest that holds
// the call's rows, so that 16 rows (a batched decode step, the fewest this kernel gets from the
// library: kGemmMinRows) do not pay for 64. Rows past the end of x, outputs past the end of W and
// inputs past the end of a row are zeros in shared memory, and nothing is stored for them.
//
// Shared-memory banks. Shared memory is 32 banks of 4-byte words; a warp's access is served in
// one pass when its threads touch different banks (or the same word: a broadcast), else in as
// many passes as the most-requested bank has distinct words. Both tiles are stored k-major
// (ws[k][n], xs[k][m]) so that:
//   - reading: at input k, the 16 threads across the outputs read ws[k][4 tx .. 4 tx + 3] (16
//     consecutive float4s, 256 bytes: two passes, the fewest 256 bytes can take), and the warp's
//     two thread rows read two TM-float pieces of xs[k] (broadcasts): no conflict;
//   - writing: a warp's 32 loader threads take 32 consecutive rows of W (or x) at the same
//     inputs, so each store instruction writes 32 consecutive words of one k row of ws (xs): no
//     conflict. (The other choice, consecutive threads along the inputs, would make a warp's
//     global loads of W contiguous, but each store would then write 8 outputs in each of 4 k
//     rows of ws, rows a multiple of 32 words apart: 4 threads on each bank, a 4-way conflict.)
// xs rows are padded by 4 floats: at BM = 16 a warp's loaders span two k rows of xs, which
// without the pad would sit on the same banks; 4 keeps the rows 16-byte aligned for float4 reads.
//
// What it leaves out, on purpose (it is a teaching kernel; the GPU check measures it against
// cuBLAS, bench.py --parts kernels --device cuda):
//   - overlap: a block loads a tile, waits, computes, waits. A production kernel double-buffers
//     (cp.async on sm_80+: the next tile's loads fly while the current one is multiplied).
//   - tensor cores: these are float32 FMAs on the CUDA cores. A tensor-core version would stage
//     x and the dequantized W as bf16 (W rounded to bf16, as a dense bf16 copy is), and replace
//     the register tile by warp-level matrix instructions (WMMA fragments, or mma.sync m16n8k16
//     on bf16 with float32 accumulators): each warp then multiplies whole sub-tiles (say 64 x 64
//     outputs) at ~15x the multiply-add rate of the CUDA cores, and the shared-memory layout must
//     match what the fragments load (ldmatrix, with a swizzle instead of padding against bank
//     conflicts). The tiling, the dequantization per tile and the masking of tails stay as here.
//   - split-K: a small output (few rows and outputs) makes few blocks, fewer than the SMs; a
//     production kernel would then split the inputs over several blocks and add their sums.
#include <cstdint>
#include <type_traits>

#include "dtype.cuh"
#include "launchers.h"

namespace kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int BN = 64;                               // outputs (rows of W) per block
constexpr int BK = 32;                               // inputs per step of the k loop
constexpr int TN = 4;                                // outputs per thread
constexpr int kThreadCols = BN / TN;                 // 16 threads across the outputs
constexpr int kThreadRows = kThreads / kThreadCols;  // 16 threads down the rows: BM = 16 * TM
constexpr int kXPad = 4;                             // floats of padding per k row of xs (see the top)
constexpr int kWRun = 8;                             // consecutive weights a loader thread stages: BN * BK / kThreads
constexpr int kXRun = 4;                             // consecutive x values per load (16 bytes of float32)
static_assert(BN * BK == kWRun * kThreads, "one run of W per thread per step");

// --- the weight formats: a run of kWRun consecutive weights of row o from input i --------------
// Each stages the weights as floats into w[]; zeros past n_in. `aligned`: the run is one vector
// load (the launcher checked the pointer and the row length); else element by element.

struct Int4Weights {
    const uint8_t* packed;  // [n_out, n_in / 2], two codes per byte, input 2j in the low nibble
    const __half* scale;    // [n_out, n_in / G]
    const __half* min;
    int group_size;
    // n_in is a multiple of G, itself of 32: a run of 8 (i a multiple of 8) is whole and in one
    // group. Its 8 codes are one 4-byte word, and nibble e of the little-endian word is input i + e.
    __device__ void load(int o, int i, int n_in, bool aligned, float (&w)[kWRun]) const {
        const uint8_t* p = packed + static_cast<int64_t>(o) * (n_in / 2) + i / 2;
        uint32_t word;
        if (aligned) {
            word = __ldg(reinterpret_cast<const uint32_t*>(p));
        } else {
            word = 0u;
#pragma unroll
            for (int b = 0; b < 4; ++b) word |= static_cast<uint32_t>(__ldg(p + b)) << (8 * b);
        }
        const int64_t g = static_cast<int64_t>(o) * (n_in / group_size) + i / group_size;
        const float s = __half2float(scale[g]), m = __half2float(min[g]);
#pragma unroll
        for (int e = 0; e < kWRun; ++e) w[e] = fmaf(static_cast<float>((word >> (4 * e)) & 0xFu), s, m);
    }
    __device__ float row_scale(int) const { return 1.f; }
};

struct Int8Weights {
    const int8_t* q;     // [n_out, n_in]
    const float* scale;  // [n_out]: applied once to the sum, as quant_linear.cu does
    __device__ void load(int o, int i, int n_in, bool aligned, float (&w)[kWRun]) const {
        const int8_t* p = q + static_cast<int64_t>(o) * n_in + i;
        if (aligned) {  // n_in % 8 == 0: the run is whole
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
#pragma unroll
            for (int e = 0; e < kWRun; ++e) {
                const uint32_t word = e < 4 ? v.x : v.y;
                w[e] = static_cast<float>(static_cast<int8_t>((word >> (8 * (e % 4))) & 0xFFu));
            }
        } else {
#pragma unroll
            for (int e = 0; e < kWRun; ++e) w[e] = i + e < n_in ? static_cast<float>(__ldg(p + e)) : 0.f;
        }
    }
    __device__ float row_scale(int o) const { return scale[o]; }
};

struct Bf16Weights {
    const uint16_t* w;  // [n_out, n_in], bf16 bits
    __device__ void load(int o, int i, int n_in, bool aligned, float (&out)[kWRun]) const {
        const uint16_t* p = w + static_cast<int64_t>(o) * n_in + i;
        if (aligned) {  // n_in % 8 == 0: the run is whole, 16 bytes
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
            const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {  // a bf16 is the top half of its float (dtype.cuh)
                out[2 * k] = __uint_as_float(words[k] << 16);
                out[2 * k + 1] = __uint_as_float(words[k] & 0xFFFF0000u);
            }
        } else {
#pragma unroll
            for (int e = 0; e < kWRun; ++e) {
                out[e] = i + e < n_in ? __uint_as_float(static_cast<uint32_t>(__ldg(p + e)) << 16) : 0.f;
            }
        }
    }
    __device__ float row_scale(int) const { return 1.f; }
};

// N consecutive floats of shared memory into registers: 16-byte loads where N allows (the
// address is then 16-byte aligned: see the layout), else one by one.
template <int N>
__device__ __forceinline__ void read_shared(const float* p, float (&v)[N]) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int q = 0; q < N / 4; ++q) {
            const float4 f = reinterpret_cast<const float4*>(p)[q];
            v[4 * q] = f.x, v[4 * q + 1] = f.y, v[4 * q + 2] = f.z, v[4 * q + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int e = 0; e < N; ++e) v[e] = p[e];
    }
}

// One block: rows m0 .. m0 + BM - 1 of x (blockIdx.y) by outputs n0 .. n0 + BN - 1 (blockIdx.x).
template <typename F, typename T, int TM>
__global__ void __launch_bounds__(kThreads) gemm_kernel(T* __restrict__ y, const T* __restrict__ x, const F weights,
                                                        int rows, int n_in, int n_out, bool x_aligned, bool w_aligned) {
    constexpr int BM = kThreadRows * TM;
    constexpr int XS = BM + kXPad;               // floats per k row of xs
    extern __shared__ float4 smem[];             // float4: 16-byte aligned
    float* xs = reinterpret_cast<float*>(smem);  // [BK][XS]: x, k-major
    float* ws = xs + BK * XS;                    // [BK][BN]: W, k-major

    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int tx = threadIdx.x % kThreadCols, ty = threadIdx.x / kThreadCols;  // this thread's tile

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
    }

    for (int k0 = 0; k0 < n_in; k0 += BK) {
        __syncthreads();  // every thread is done reading the previous step's tiles

        // 1a. x: BM rows x BK inputs, kXRun consecutive inputs of one row per load; consecutive
        //     threads take consecutive rows (conflict-free stores, see the top).
        for (int idx = threadIdx.x; idx < BM * (BK / kXRun); idx += kThreads) {
            const int m = idx % BM, k = (idx / BM) * kXRun;
            const int row = m0 + m, col = k0 + k;
            float v[kXRun];
#pragma unroll
            for (int e = 0; e < kXRun; ++e) v[e] = 0.f;
            if (row < rows) {
                const T* p = x + static_cast<int64_t>(row) * n_in + col;
                if (x_aligned && col + kXRun <= n_in) {
                    load_vec<T, kXRun>(p, v);
                } else {
#pragma unroll
                    for (int e = 0; e < kXRun; ++e) {
                        if (col + e < n_in) v[e] = load(p + e);
                    }
                }
            }
#pragma unroll
            for (int e = 0; e < kXRun; ++e) xs[(k + e) * XS + m] = v[e];
        }
        // 1b. W: BN rows x BK inputs, one run of kWRun per thread, dequantized on the way.
        {
            const int n = threadIdx.x % BN, k = (threadIdx.x / BN) * kWRun;
            const int o = n0 + n, col = k0 + k;
            float w[kWRun];
#pragma unroll
            for (int e = 0; e < kWRun; ++e) w[e] = 0.f;
            if (o < n_out && col < n_in) weights.load(o, col, n_in, w_aligned, w);
#pragma unroll
            for (int e = 0; e < kWRun; ++e) ws[(k + e) * BN + n] = w[e];
        }
        __syncthreads();  // both tiles are complete

        // 2. The register tile: at each input, TM values of x and TN weights, TM * TN FMAs.
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float a[TM], b[TN];
            read_shared<TM>(xs + k * XS + ty * TM, a);
            read_shared<TN>(ws + k * BN + tx * TN, b);
#pragma unroll
            for (int i = 0; i < TM; ++i) {
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
            }
        }
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = m0 + ty * TM + i;
        if (row >= rows) break;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int o = n0 + tx * TN + j;
            if (o < n_out) store(y + static_cast<int64_t>(row) * n_out + o, weights.row_scale(o) * acc[i][j]);
        }
    }
}

// Calls f(std::integral_constant<int, TM>{}) for the smallest row tile (16 * TM) that holds `rows`,
// 64 rows at most.
template <typename Fn>
cudaError_t with_row_tile(int rows, Fn&& f) {
    if (rows <= kThreadRows) return f(std::integral_constant<int, 1>{});
    if (rows <= 2 * kThreadRows) return f(std::integral_constant<int, 2>{});
    return f(std::integral_constant<int, 4>{});
}

template <typename F>
cudaError_t launch_gemm(void* y, const void* x, const F& weights, bool w_aligned, int rows, int n_in, int n_out,
                        DType dtype, cudaStream_t stream) {
    if (rows < 0 || n_in < 0 || n_out < 0) return cudaErrorInvalidValue;
    if (rows == 0 || n_out == 0) return cudaSuccess;
    // 16-byte loads of kXRun floats (8 bytes of bf16/fp16): every row keeps the first's alignment.
    const bool x_aligned = is_aligned(x, 16) && n_in % kXRun == 0;
    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        return with_row_tile(rows, [&](auto tile) {
            constexpr int TM = decltype(tile)::value;
            constexpr int BM = kThreadRows * TM;
            const dim3 grid((n_out + BN - 1) / BN, (rows + BM - 1) / BM);
            const size_t smem = static_cast<size_t>(BK) * (BM + kXPad + BN) * sizeof(float);  // 17 KB at most
            gemm_kernel<F, T, TM><<<grid, kThreads, smem, stream>>>(static_cast<T*>(y), static_cast<const T*>(x),
                                                                    weights, rows, n_in, n_out, x_aligned, w_aligned);
            return cudaGetLastError();
        });
    });
}

}  // namespace

cudaError_t int4_gemm(void* y, const void* x, const uint8_t* packed, const uint16_t* scale, const uint16_t* min,
                      int rows, int n_in, int n_out, int group_size, DType dtype, cudaStream_t stream) {
    // A step of BK = 32 inputs must lie in one group: G a multiple of 32, as the contract says.
    if (group_size <= 0 || group_size % 32 != 0 || n_in % group_size != 0) return cudaErrorInvalidValue;
    const Int4Weights w{packed, reinterpret_cast<const __half*>(scale), reinterpret_cast<const __half*>(min),
                        group_size};
    return launch_gemm(y, x, w, is_aligned(packed, 4), rows, n_in, n_out, dtype, stream);
}

cudaError_t int8_gemm(void* y, const void* x, const int8_t* q, const float* scale, int rows, int n_in, int n_out,
                      DType dtype, cudaStream_t stream) {
    return launch_gemm(y, x, Int8Weights{q, scale}, is_aligned(q, 8) && n_in % kWRun == 0, rows, n_in, n_out, dtype,
                       stream);
}

cudaError_t bf16_gemm(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, DType dtype,
                      cudaStream_t stream) {
    return launch_gemm(y, x, Bf16Weights{w}, is_aligned(w, 16) && n_in % kWRun == 0, rows, n_in, n_out, dtype, stream);
}

}  // namespace kernels::cuda
