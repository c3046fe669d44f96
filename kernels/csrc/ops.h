// The library's operators on torch tensors (ops.cpp): what bindings.cpp registers, as torch ops
// and as the pybind module's functions, and what the decoder layer (decoder_layer.cpp) chains.
// Each checks its tensors so that a wrong call is a Python error naming the argument, never a
// wild read, then runs the CPU function or the CUDA launcher of its tensors' device.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace kernels::cpu {
struct LoraGroup;  // cpu/cpu_kernels.h
}  // namespace kernels::cpu

namespace kernels::ops {

// flash-decoding over a paged KV cache -> [batch, n_heads, head_dim]
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t partition_size);

// causal attention of prompt chunks over a paged KV cache -> [T, n_heads, head_dim] (rows no chunk names: 0)
at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& query_lens,
                           const at::Tensor& context_lens, double scale);

// x += delta (in place, if given); -> rms_norm(x) * weight
at::Tensor add_rms_norm(at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps);

// q and k heads rotated in place (rotate-half)
void rope_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin);

// q heads rotated in place, k heads rotated into k_pool at slots, v heads copied into v_pool at slots
void rope_cache_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool, at::Tensor& v_pool,
                 const at::Tensor& slots);

// silu(gate) * up for gate_up = [gate | up] -> [rows, inter]
at::Tensor silu_mul(const at::Tensor& gate_up);

// x @ W.T for group-wise int4, per-row int8 and plain bfloat16 W
// int4 and int8: with `tiles` (int4_tiles / int8_tiles of the same weight), bf16 x on a CPU is
// multiplied in integers (cpu/int4_q8_gemm.cpp, cpu/int8_q8_gemm.cpp); every other call goes as
// without them.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min,
                       int64_t group_size, const std::optional<at::Tensor>& tiles = std::nullopt);
// The int4 weight's codes, scales and mins laid out for the CPU's integer product: uint8 [n_tiles,
// n_in / 32, 20 * width], width the ISA's (8 or 16); an empty tensor where this CPU has no such path.
at::Tensor int4_tiles(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min, int64_t group_size);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& tiles = std::nullopt);
// The int8 weight's q the same way: uint8 [n_tiles, n_in / 32, 32 * width]; empty where this CPU has
// no integer product, or n_in is not a multiple of 32.
at::Tensor int8_tiles(const at::Tensor& q);
// The same two, the integer product's team (where it runs) also adding `lora`'s deltas into y: it
// sets lora->y then, which stays null where the deltas are the caller's to add. DecoderLayer.decode's
// form (lora may be null), not bound to Python.
at::Tensor int4_linear_lora(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                            const at::Tensor& min, int64_t group_size, const std::optional<at::Tensor>& tiles,
                            cpu::LoraGroup* lora);
at::Tensor int8_linear_lora(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                            const std::optional<at::Tensor>& tiles, cpu::LoraGroup* lora);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w);
// bf16 weights times bf16 x on a CPU with AMX-BF16 tiles: from kAmxMinRows rows bf16_linear is
// torch's GEMM (oneDNN runs it on the tiles; ops.cpp says why). mode -1: where the CPU has the tiles
// and the OS grants them (the default), 0: never, 1: required (an error where there are none).
// cpu_gemm_amx() says whether it applies now; ops.cpp lists when it does not. The same switch sets
// the integer products' AMX-INT8 tiles (cpu::set_amx, cpu::q8_amx()).
constexpr int64_t kAmxMinRows = 16;
void set_cpu_gemm_amx(int mode);
bool cpu_gemm_amx();

// LoRA for many adapters in one batch (cpu/cpu_kernels.h has the contract): the shrink -> v float32
// [rows, r_max]; the expand adds scale * B v to y in place. Rows are cut into segments
// (seg_starts [n_seg + 1], seg_slots [n_seg], slot -1: no adapter); a decode row is a segment of one.
at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& ranks, const at::Tensor& seg_starts,
                       const at::Tensor& seg_slots);
void lora_expand_(at::Tensor& y, const at::Tensor& v, const at::Tensor& b_t, const at::Tensor& ranks,
                  const at::Tensor& scale, const at::Tensor& seg_starts, const at::Tensor& seg_slots);

// The same two kernels without the checks, for a caller that checked its tables once when it built
// them (DecoderLayer's LoraProjection and StepLora) and calls them many times a step: v float32
// [x's rows, r_max] with contiguous rows, written; the expand adds into y's columns col .. col + n_out.
// check_lora_segments: rows or slots < 0 where the caller does not know them yet.
void check_lora_weights(const at::Tensor& on, const at::Tensor& w, const char* w_name, const at::Tensor& ranks);
void check_lora_segments(const at::Tensor& on, const at::Tensor& seg_starts, const at::Tensor& seg_slots, int64_t rows,
                         int64_t slots);
void run_lora_shrink(at::Tensor& v, const at::Tensor& x, const at::Tensor& a, const at::Tensor& ranks,
                     const at::Tensor& seg_starts, const at::Tensor& seg_slots);
void run_lora_expand(at::Tensor& y, int64_t col, const at::Tensor& v, const at::Tensor& b_t, const at::Tensor& ranks,
                     const at::Tensor& scale, const at::Tensor& seg_starts, const at::Tensor& seg_slots);

}  // namespace kernels::ops
