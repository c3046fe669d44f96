// Launchers of the CUDA kernels: the same contracts as cpu/cpu_kernels.h (read it for shapes and
// maths), on device pointers, queued on `stream`. Torch-free, so nvcc compiles them with or
// without a CUDA build of torch. No launcher allocates memory or synchronises the device: the
// caller passes any workspace, and errors of the launch itself are returned, not waited for.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "../kernels.h"

namespace kernels::cuda {

cudaError_t paged_decode_attention(void* out, const void* q, int64_t q_stride, const void* k_pool, const void* v_pool,
                                   const int32_t* block_tables, const int32_t* context_lens, float* workspace,
                                   int batch, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks,
                                   int partition_size, float scale, DType dtype, cudaStream_t stream);

cudaError_t chunk_attention(void* out, const void* q, int64_t q_stride, const void* k_pool, const void* v_pool,
                            const int32_t* block_tables, const int32_t* query_start, const int32_t* query_lens,
                            const int32_t* context_lens, int tokens, int batch, int n_heads, int n_kv_heads,
                            int head_dim, int block_size, int max_blocks, float scale, DType dtype,
                            cudaStream_t stream);

cudaError_t add_rms_norm(void* out, void* x, const void* delta, const void* weight, int rows, int hidden, float eps,
                         DType dtype, cudaStream_t stream);

cudaError_t rope(void* qk, const float* cos, const float* sin, int tokens, int n_heads, int head_dim,
                 int64_t token_stride, DType dtype, cudaStream_t stream);

cudaError_t rope_cache(void* qkv, const float* cos, const float* sin, void* k_pool, void* v_pool, const int64_t* slots,
                       int tokens, int n_heads, int n_kv_heads, int head_dim, DType dtype, cudaStream_t stream);

cudaError_t silu_mul(void* out, const void* gate_up, int rows, int inter, DType dtype, cudaStream_t stream);

cudaError_t int4_linear(void* y, const void* x, const uint8_t* packed, const uint16_t* scale, const uint16_t* min,
                        int rows, int n_in, int n_out, int group_size, DType dtype, cudaStream_t stream);

cudaError_t int8_linear(void* y, const void* x, const int8_t* q, const float* scale, int rows, int n_in, int n_out,
                        DType dtype, cudaStream_t stream);

cudaError_t bf16_linear(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, DType dtype,
                        cudaStream_t stream);

// The same three for many rows of x: a tiled matrix product (gemm.cu), the twin of cpu/gemm.cpp.
// Any row count works; the library (ops.cpp) calls them from kGemmMinRows rows (kernels.h), the
// matrix-vector kernels above below that.
cudaError_t int4_gemm(void* y, const void* x, const uint8_t* packed, const uint16_t* scale, const uint16_t* min,
                      int rows, int n_in, int n_out, int group_size, DType dtype, cudaStream_t stream);

cudaError_t int8_gemm(void* y, const void* x, const int8_t* q, const float* scale, int rows, int n_in, int n_out,
                      DType dtype, cudaStream_t stream);

cudaError_t bf16_gemm(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, DType dtype,
                      cudaStream_t stream);

// LoRA for many adapters in one batch (lora.cu), the twin of cpu/lora.cpp: a shrink, then an expand.
cudaError_t lora_shrink(float* v, int64_t v_stride, const void* x, int64_t x_stride, const void* a,
                        const int32_t* ranks, const int32_t* seg_starts, const int32_t* seg_slots, int rows, int n_seg,
                        int n_slots, int n_in, int r_max, DType dtype, DType w_dtype, cudaStream_t stream);

cudaError_t lora_expand(void* y, int64_t y_stride, const float* v, int64_t v_stride, const void* b_t,
                        const int32_t* ranks, const float* scale, const int32_t* seg_starts, const int32_t* seg_slots,
                        int rows, int n_seg, int n_slots, int n_out, int r_max, DType dtype, DType w_dtype,
                        cudaStream_t stream);

}  // namespace kernels::cuda
