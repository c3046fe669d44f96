// The emulated launchers of csrc/cuda/launchers.h as C functions (kernels/emulator.py calls them
// through ctypes, with the addresses of CPU tensors standing in for device memory). Each returns
// the launcher's cudaError_t; emu_last_message() says more about a failed launch.
#include "../cuda/launchers.h"

using kernels::DType;
namespace cu = kernels::cuda;

extern "C" {

int emu_paged_decode_attention(void* out, const void* q, int64_t q_stride, const void* k_pool, const void* v_pool,
                               const int32_t* block_tables, const int32_t* context_lens, float* workspace, int batch,
                               int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks,
                               int partition_size, float scale, int dtype) {
    return cu::paged_decode_attention(out, q, q_stride, k_pool, v_pool, block_tables, context_lens, workspace, batch,
                                      n_heads, n_kv_heads, head_dim, block_size, max_blocks, partition_size, scale,
                                      static_cast<DType>(dtype), nullptr);
}

int emu_chunk_attention(void* out, const void* q, int64_t q_stride, const void* k_pool, const void* v_pool,
                        const int32_t* block_tables, const int32_t* query_start, const int32_t* query_lens,
                        const int32_t* context_lens, int tokens, int batch, int n_heads, int n_kv_heads, int head_dim,
                        int block_size, int max_blocks, float scale, int dtype) {
    return cu::chunk_attention(out, q, q_stride, k_pool, v_pool, block_tables, query_start, query_lens, context_lens,
                               tokens, batch, n_heads, n_kv_heads, head_dim, block_size, max_blocks, scale,
                               static_cast<DType>(dtype), nullptr);
}

int emu_add_rms_norm(void* out, void* x, const void* delta, const void* weight, int rows, int hidden, float eps,
                     int dtype) {
    return cu::add_rms_norm(out, x, delta, weight, rows, hidden, eps, static_cast<DType>(dtype), nullptr);
}

int emu_rope(void* qk, const float* cos, const float* sin, int tokens, int n_heads, int head_dim, int64_t token_stride,
             int dtype) {
    return cu::rope(qk, cos, sin, tokens, n_heads, head_dim, token_stride, static_cast<DType>(dtype), nullptr);
}

int emu_rope_cache(void* qkv, const float* cos, const float* sin, void* k_pool, void* v_pool, const int64_t* slots,
                   int tokens, int n_heads, int n_kv_heads, int head_dim, int dtype) {
    return cu::rope_cache(qkv, cos, sin, k_pool, v_pool, slots, tokens, n_heads, n_kv_heads, head_dim,
                          static_cast<DType>(dtype), nullptr);
}

int emu_silu_mul(void* out, const void* gate_up, int rows, int inter, int dtype) {
    return cu::silu_mul(out, gate_up, rows, inter, static_cast<DType>(dtype), nullptr);
}

int emu_int4_linear(void* y, const void* x, const uint8_t* packed, const uint16_t* scale, const uint16_t* min, int rows,
                    int n_in, int n_out, int group_size, int dtype) {
    return cu::int4_linear(y, x, packed, scale, min, rows, n_in, n_out, group_size, static_cast<DType>(dtype), nullptr);
}

int emu_int8_linear(void* y, const void* x, const int8_t* q, const float* scale, int rows, int n_in, int n_out,
                    int dtype) {
    return cu::int8_linear(y, x, q, scale, rows, n_in, n_out, static_cast<DType>(dtype), nullptr);
}

int emu_bf16_linear(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, int dtype) {
    return cu::bf16_linear(y, x, w, rows, n_in, n_out, static_cast<DType>(dtype), nullptr);
}

int emu_int4_gemm(void* y, const void* x, const uint8_t* packed, const uint16_t* scale, const uint16_t* min, int rows,
                  int n_in, int n_out, int group_size, int dtype) {
    return cu::int4_gemm(y, x, packed, scale, min, rows, n_in, n_out, group_size, static_cast<DType>(dtype), nullptr);
}

int emu_int8_gemm(void* y, const void* x, const int8_t* q, const float* scale, int rows, int n_in, int n_out,
                  int dtype) {
    return cu::int8_gemm(y, x, q, scale, rows, n_in, n_out, static_cast<DType>(dtype), nullptr);
}

int emu_bf16_gemm(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, int dtype) {
    return cu::bf16_gemm(y, x, w, rows, n_in, n_out, static_cast<DType>(dtype), nullptr);
}

int emu_lora_shrink(float* v, int64_t v_stride, const void* x, int64_t x_stride, const void* a, const int32_t* ranks,
                    const int32_t* seg_starts, const int32_t* seg_slots, int rows, int n_seg, int n_slots, int n_in,
                    int r_max, int dtype, int w_dtype) {
    return cu::lora_shrink(v, v_stride, x, x_stride, a, ranks, seg_starts, seg_slots, rows, n_seg, n_slots, n_in, r_max,
                           static_cast<DType>(dtype), static_cast<DType>(w_dtype), nullptr);
}

int emu_lora_expand(void* y, int64_t y_stride, const float* v, int64_t v_stride, const void* b_t, const int32_t* ranks,
                    const float* scale, const int32_t* seg_starts, const int32_t* seg_slots, int rows, int n_seg,
                    int n_slots, int n_out, int r_max, int dtype, int w_dtype) {
    return cu::lora_expand(y, y_stride, v, v_stride, b_t, ranks, scale, seg_starts, seg_slots, rows, n_seg, n_slots,
                           n_out, r_max, static_cast<DType>(dtype), static_cast<DType>(w_dtype), nullptr);
}

}  // extern "C"
