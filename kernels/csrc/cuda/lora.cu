// LoRA for many adapters in one batch: the CUDA twin of cpu/lora.cpp (the contract and the maths
// are in cpu/cpu_kernels.h; why one kernel serves prompt chunks and decode rows, and why B is
// stored transposed, at the top of cpu/lora.cpp).
//
//   shrink   v[row, k] = A[s][k] . x[row]: r dot products of length n_in per row.
//            grid: one block per (row, tile of kRankTile ranks). Its 256 threads split the inputs
//            (split-K): thread t takes inputs t, t + 256, ..., so a warp reads 32 consecutive
//            elements of x and of each A row (coalesced), and keeps one partial sum per rank of
//            the tile in registers. The partial sums are then added within each warp by shuffles
//            and across the 8 warps in shared memory. A rank tile past the slot's rank (or a row
//            of the base model) writes zeros and reads nothing.
//   expand   y[row, o] += scale[s] * sum_k v[row, k] * b_t[s, k, o]: n_out sums of r terms per row.
//            grid: one block per (tile of kExpandRows rows, tile of kExpandOut outputs). The rows'
//            slots and ranks, and their v (kExpandRows x r_max floats), are staged in shared memory
//            once; then each thread owns one (row, output): a warp covers 32 consecutive outputs
//            of one row, so its reads of b_t[s, k, :] and its read-modify-write of y are coalesced.
//            Rows of the base model return before touching y.
//
// A row finds its segment by a binary search of seg_starts (the last start <= row), in each
// block: no table of rows is built on the host, so a step's table goes to the GPU as it is.
// Slots and ranks are not checked on the host for CUDA tensors (ops.cpp: a copy to the host and a
// wait); here a slot outside the table counts as -1 and a rank is clamped to 0..r_max, so that a
// bad table gives wrong numbers, never a read outside the weights.
//
// What it leaves out (a teaching kernel; not yet measured on a GPU):
//   - SGMV's reuse within a segment: a prompt chunk's rows each read their A rows again (from L2,
//     as the other blocks of the segment have just read them). Punica's SGMV stages a tile of A
//     in shared memory for a tile of the segment's rows, a small matrix product per block.
//   - vector loads (8 bf16 in 16 bytes) of x, A and b_t: these read one element per thread.
//   - one launch for both halves and for several projections (q, k, v share x).
#include <cstdint>

#include "dtype.cuh"
#include "launchers.h"

namespace kernels::cuda {
namespace {

constexpr int kShrinkThreads = 256;
constexpr int kWarps = kShrinkThreads / 32;
constexpr int kRankTile = 16;  // ranks per shrink block: 16 partial sums per thread
constexpr int kExpandOut = 64;
constexpr int kExpandRows = 4;  // 64 x 4 = 256 threads, one (row, output) each

// The segment holding `row`: the last i with starts[i] <= row (empty segments before it skipped).
// starts[0] = 0 <= row < rows = starts[n_seg] keeps the search inside the table.
__device__ int segment_of(const int32_t* starts, int n_seg, int row) {
    int lo = 0, hi = n_seg;  // starts[lo] <= row < starts[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (starts[mid] <= row) lo = mid;
        else hi = mid;
    }
    return lo;
}

struct SlotRank {
    int slot, rank;
};

// The slot of `row` (-1 for the base model or a slot outside the table) and its rank (0 then).
__device__ SlotRank slot_and_rank(const int32_t* ranks, const int32_t* seg_starts, const int32_t* seg_slots, int n_seg,
                              int n_slots, int r_max, int row) {
    const int slot = seg_slots[segment_of(seg_starts, n_seg, row)];
    if (slot < 0 || slot >= n_slots) return {-1, 0};
    return {slot, min(max(ranks[slot], 0), r_max)};
}

template <typename T, typename W>
__global__ void __launch_bounds__(kShrinkThreads)
    lora_shrink_kernel(float* __restrict__ v, int64_t v_stride, const T* __restrict__ x, int64_t x_stride,
                       const W* __restrict__ a, const int32_t* ranks, const int32_t* seg_starts,
                       const int32_t* seg_slots, int n_seg, int n_slots, int n_in, int r_max) {
    __shared__ float partial[kWarps][kRankTile];  // each warp's sums
    const int row = blockIdx.x, k0 = blockIdx.y * kRankTile;
    const SlotRank sr = slot_and_rank(ranks, seg_starts, seg_slots, n_seg, n_slots, r_max, row);
    const int slot = sr.slot, nk = min(kRankTile, sr.rank - k0);  // ranks of this tile the adapter has
    const int tile = min(kRankTile, r_max - k0);              // entries of v this block writes
    float* out = v + static_cast<int64_t>(row) * v_stride + k0;
    if (nk <= 0) {  // the same for the whole block: leaving before the barrier below is safe
        for (int k = threadIdx.x; k < tile; k += kShrinkThreads) out[k] = 0.f;
        return;
    }

    float acc[kRankTile];
#pragma unroll
    for (int k = 0; k < kRankTile; ++k) acc[k] = 0.f;
    const T* xr = x + static_cast<int64_t>(row) * x_stride;
    const W* ar = a + (static_cast<int64_t>(slot) * r_max + k0) * n_in;
    for (int i = threadIdx.x; i < n_in; i += kShrinkThreads) {
        const float xi = load(xr + i);
#pragma unroll
        for (int k = 0; k < kRankTile; ++k) {
            if (k < nk) acc[k] = fmaf(load(ar + static_cast<int64_t>(k) * n_in + i), xi, acc[k]);
        }
    }

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int k = 0; k < kRankTile; ++k) {
        float s = acc[k];
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
        if (lane == 0) partial[warp][k] = s;
    }
    __syncthreads();  // every warp's sums are in shared memory
    if (threadIdx.x < tile) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) s += partial[w][threadIdx.x];
        out[threadIdx.x] = threadIdx.x < nk ? s : 0.f;  // zeros past the rank
    }
}

template <typename T, typename W>
__global__ void __launch_bounds__(kExpandOut* kExpandRows)
    lora_expand_kernel(T* __restrict__ y, int64_t y_stride, const float* __restrict__ v, int64_t v_stride,
                       const W* __restrict__ b, const int32_t* ranks, const float* scale, const int32_t* seg_starts,
                       const int32_t* seg_slots, int rows, int n_seg, int n_slots, int n_out, int r_max) {
    extern __shared__ float vs[];  // [kExpandRows][r_max]: the rows' v
    __shared__ int slot_of[kExpandRows], rank_of[kExpandRows];
    const int row0 = blockIdx.y * kExpandRows;
    if (threadIdx.x < kExpandRows) {
        const int row = row0 + threadIdx.x;
        const SlotRank sr = row < rows ? slot_and_rank(ranks, seg_starts, seg_slots, n_seg, n_slots, r_max, row)
                                       : SlotRank{-1, 0};
        slot_of[threadIdx.x] = sr.slot;
        rank_of[threadIdx.x] = sr.rank;
    }
    __syncthreads();  // the rows' slots and ranks are known
    for (int idx = threadIdx.x; idx < kExpandRows * r_max; idx += blockDim.x) {
        const int j = idx / r_max, k = idx % r_max;
        if (k < rank_of[j]) vs[idx] = v[static_cast<int64_t>(row0 + j) * v_stride + k];
    }
    __syncthreads();  // v is staged

    const int j = threadIdx.x / kExpandOut, o = blockIdx.x * kExpandOut + threadIdx.x % kExpandOut;
    const int slot = slot_of[j], rank = rank_of[j];
    if (rank == 0 || o >= n_out) return;  // the base model's rows (and rows past the end): y untouched
    const W* bs = b + static_cast<int64_t>(slot) * r_max * n_out + o;
    const float* vj = vs + j * r_max;
    float acc = 0.f;
    for (int k = 0; k < rank; ++k) acc = fmaf(vj[k], load(bs + static_cast<int64_t>(k) * n_out), acc);
    T* yp = y + static_cast<int64_t>(row0 + j) * y_stride + o;
    store(yp, fmaf(scale[slot], acc, load(yp)));
}

// Calls f(TypeTag<W>{}) with the adapters' C++ type: float or bf16.
template <typename F>
cudaError_t dispatch_weights(DType w_dtype, F&& f) {
    if (w_dtype == DType::f32) return f(TypeTag<float>{});
    if (w_dtype == DType::bf16) return f(TypeTag<__nv_bfloat16>{});
    return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t lora_shrink(float* v, int64_t v_stride, const void* x, int64_t x_stride, const void* a,
                        const int32_t* ranks, const int32_t* seg_starts, const int32_t* seg_slots, int rows, int n_seg,
                        int n_slots, int n_in, int r_max, DType dtype, DType w_dtype, cudaStream_t stream) {
    if (rows < 0 || n_seg < 0 || n_in < 0 || r_max < 0 || (rows > 0 && n_seg == 0)) return cudaErrorInvalidValue;
    if (rows == 0 || r_max == 0) return cudaSuccess;
    const dim3 grid(rows, (r_max + kRankTile - 1) / kRankTile);
    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        return dispatch_weights(w_dtype, [&](auto wtag) {
            using W = typename decltype(wtag)::type;
            lora_shrink_kernel<T, W><<<grid, kShrinkThreads, 0, stream>>>(
                v, v_stride, static_cast<const T*>(x), x_stride, static_cast<const W*>(a), ranks, seg_starts,
                seg_slots, n_seg, n_slots, n_in, r_max);
            return cudaGetLastError();
        });
    });
}

cudaError_t lora_expand(void* y, int64_t y_stride, const float* v, int64_t v_stride, const void* b_t,
                        const int32_t* ranks, const float* scale, const int32_t* seg_starts, const int32_t* seg_slots,
                        int rows, int n_seg, int n_slots, int n_out, int r_max, DType dtype, DType w_dtype,
                        cudaStream_t stream) {
    if (rows < 0 || n_seg < 0 || n_out < 0 || r_max < 0 || (rows > 0 && n_seg == 0)) return cudaErrorInvalidValue;
    if (rows == 0 || n_out == 0 || r_max == 0) return cudaSuccess;
    const size_t smem = static_cast<size_t>(kExpandRows) * r_max * sizeof(float);
    if (smem > 48 * 1024) return cudaErrorInvalidValue;  // r_max over 3072: more than a block's default shared memory
    const dim3 grid((n_out + kExpandOut - 1) / kExpandOut, (rows + kExpandRows - 1) / kExpandRows);
    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        return dispatch_weights(w_dtype, [&](auto wtag) {
            using W = typename decltype(wtag)::type;
            lora_expand_kernel<T, W><<<grid, kExpandOut * kExpandRows, smem, stream>>>(
                static_cast<T*>(y), y_stride, v, v_stride, static_cast<const W*>(b_t), ranks, scale, seg_starts,
                seg_slots, rows, n_seg, n_slots, n_out, r_max);
            return cudaGetLastError();
        });
    });
}

}  // namespace kernels::cuda
