// The C++ CPU twins of the CUDA kernels: the same algorithms, parallel over OpenMP threads and
// vectorised with AVX2 / AVX512 chosen at run time (isa.cpp). Torch-free: raw pointers and sizes.
// Shapes are given as [dims] in row-major order; "stride" is in elements.
#pragma once

#include <cstdint>
#include <utility>

#include "../kernels.h"

namespace kernels::cpu {

// --- instruction set, chosen once at run time ------------------------------------------------
// Ordered: each level has every instruction of the ones below. avx512_bf16 is avx512 plus
// vdpbf16ps, which the linear kernels and the GEMM use with bf16 x, and the chunk attention with
// bf16 keys; every other kernel runs its avx512 path there (the integer products ask for VNNI apart).
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3 };
Isa best_isa();         // what this CPU supports, capped by ATEN_CPU_CAPABILITY if set (default|avx2|avx512)
Isa isa();              // the one in use
void set_isa(Isa isa);  // tests force each path in turn; a level the CPU lacks is an error (throws)
const char* isa_name(Isa isa);

// --- batch invariance, off unless set -----------------------------------------------------------
// On: every row of x of a linear kernel is computed by the same instructions in the same order
// whatever the number of rows in the call, so a sequence's outputs do not depend on what else is
// in its step (chapter 06's --batch-invariant). Off, the kernels pick per row count the fastest
// form, which rounds differently (int4 on AVX512: the factored form for one row, the table form
// for several; int8 and bf16: two interleaved accumulators for one row, one for several).
void set_batch_invariant(bool on);
bool batch_invariant();

// --- bf16 x in the matrix product: bf16 pairs or floats -------------------------------------
// At the AVX512-BF16 level the matrix product (gemm.cpp) can multiply bf16 x in bf16 pairs
// (vdpbf16ps: two multiply-adds a lane an instruction) or widen it to floats for FMAs; so can the
// chunk attention its bf16 queries and keys (chunk_attention.cpp). Which is faster depends on the
// core, not on the instruction set (isa.cpp says why), so by default pairs are on where the CPU is
// AMD's, off elsewhere; tests set both. mode: 1 on, 0 off, -1 the default.
void set_gemm_bf16_pairs(int mode);
bool gemm_bf16_pairs();  // at the current ISA level: false below AVX512-BF16

// --- AMX tiles -------------------------------------------------------------------------------
// A CPU with AMX (Intel's Xeons from Sapphire Rapids on) multiplies a tile of 16 rows of int8 by a
// tile of 16 columns in one instruction (q8_tiles.h). The int4 and int8 products take every 16
// rows of x there, the rest on VNNI, the same integer sums and so the same bits. One switch for
// every use of the tiles (ops.cpp's bf16 route reads it too): mode 1 on (throws where the CPU or
// the OS has no AMX-INT8), 0 off, -1 on where there are tiles; the integer products never take them
// below the AVX512-BF16 level, so ATEN_CPU_CAPABILITY=avx512 or avx2 reproduces a CPU without them.
constexpr int kQ8AmxRows = 16;  // rows of x a tile instruction takes
bool amx_int8_supported();  // the CPU has AMX-INT8 and the OS lets this process use it (asked once)
void set_amx(int mode);
bool amx_allowed();  // the switch is not off
bool q8_amx();       // whether the integer products use the tiles now

// --- paged decode attention (flash-decoding) -------------------------------------------------
// One query token per sequence, attending to its context_lens[b] keys, read block by block
// through its block table. The keys are cut into partitions of `partition_size` slots; each
// (sequence, partition) is one task, or each (sequence, kv head, partition) where there are few: an
// online softmax over its keys for every query head (GQA: query head h reads kv head
// h / (n_heads / n_kv_heads)), leaving a partial output with its running max and sum. A second pass
// merges the partitions.
//   out          [batch, n_heads, head_dim]                      contiguous
//   q            [batch, n_heads, head_dim]                      token stride q_stride, heads contiguous
//   k/v_pool     [num_blocks, block_size, n_kv_heads, head_dim]  contiguous
//   block_tables int32 [batch, max_blocks]                       entries past the context are not read
//   context_lens int32 [batch]                                   1 <= len <= max_blocks * block_size
//   workspace    float32, partial outputs [batch, n_heads, n_partitions, head_dim]
//                then partial max and sum [batch, n_heads, n_partitions] each, where
//                n_partitions = ceil(max_blocks * block_size / partition_size)
// partition_size is a multiple of block_size. scale = 1 / sqrt(head_dim) for Llama.
void paged_decode_attention(void* out, const void* q, int64_t q_stride, const void* k_pool, const void* v_pool,
                            const int32_t* block_tables, const int32_t* context_lens, float* workspace, int batch,
                            int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks,
                            int partition_size, float scale, DType dtype);

// --- prompt-chunk attention (FlashAttention-2's loop) over the paged cache ----------------------
// Sequence b adds query_lens[b] queries, rows query_start[b] .. + query_lens[b] - 1 of q and out,
// at positions context_lens[b] - query_lens[b] .. context_lens[b] - 1; each reads the keys from
// position 0 up to its own, causally, through the block table (its own chunk's keys included:
// they are in the pool already). Tiles of queries meet tiles of keys with an online softmax
// (chunk_attention.cpp); GQA as paged_decode_attention. A row's result does not depend on how its
// prompt was cut into chunks (the key tiles are fixed from position 0): bitwise.
//   out          [T, n_heads, head_dim]                          contiguous; rows no chunk names untouched
//   q            [T, n_heads, head_dim]                          token stride q_stride, heads contiguous
//   k/v_pool     [num_blocks, block_size, n_kv_heads, head_dim]  contiguous
//   block_tables int32 [batch, max_blocks]
//   query_start, query_lens, context_lens  int32 [batch]; 1 <= query_lens[b] <= context_lens[b] <= max_blocks * block_size
// tokens (T) sizes the CUDA twin's grid (its blocks find their sequence from the lengths on the device).
void chunk_attention(void* out, const void* q, int64_t q_stride, const void* k_pool, const void* v_pool,
                     const int32_t* block_tables, const int32_t* query_start, const int32_t* query_lens,
                     const int32_t* context_lens, int tokens, int batch, int n_heads, int n_kv_heads, int head_dim,
                     int block_size, int max_blocks, float scale, DType dtype);

// --- RMSNorm, with the residual add fused --------------------------------------------------
// For each of `rows` rows of `hidden` values:
//   if delta: x = x + delta          (x updated in place, rounded to dtype: the residual stream)
//   out = x / sqrt(mean(x^2) + eps) * weight
// x, delta, out: [rows, hidden] contiguous; weight [hidden]. out may not alias x.
void add_rms_norm(void* out, void* x, const void* delta, const void* weight, int rows, int hidden, float eps,
                  DType dtype);

// --- RoPE, rotate-half convention (HF Llama), in place ---------------------------------------
// qk: [tokens, n_heads, head_dim] with token stride `token_stride`, heads contiguous (q and k
// heads side by side in the qkv projection's output). cos, sin: float32 [tokens, head_dim / 2].
// Pair (i, i + head_dim/2) of every head of token t is rotated by the angle whose cos/sin are
// cos[t, i], sin[t, i]; computed in float32, rounded once.
void rope(void* qk, const float* cos, const float* sin, int tokens, int n_heads, int head_dim, int64_t token_stride,
          DType dtype);

// --- RoPE and the KV cache write, fused: what a layer does to its qkv projection before attention --
// qkv: [tokens, n_heads + 2 * n_kv_heads, head_dim] contiguous, each token's q heads, then k, then v.
// k_pool, v_pool: [slots_total, n_kv_heads, head_dim] contiguous (a paged pool viewed by slot);
// slots: [tokens], token t's slot, distinct within a call, each < slots_total. For each token:
//   q heads    rotated in place (as rope)
//   k heads    rotated, stored at k_pool[slots[t]] (qkv's k heads are left as they were)
//   v heads    copied to v_pool[slots[t]]
// One pass where rope then two indexed copies take three (vLLM's rotary + reshape_and_cache).
void rope_cache(void* qkv, const float* cos, const float* sin, void* k_pool, void* v_pool, const int64_t* slots,
                int tokens, int n_heads, int n_kv_heads, int head_dim, DType dtype);

// --- SwiGLU's activation, fused: out = silu(gate) * up -----------------------------------------
// gate_up: [rows, 2 * inter] contiguous, each row the gate projection's outputs then the up
// projection's (the model stacks the two weights, so one matmul makes both); out: [rows, inter]
// contiguous. silu(g) = g / (1 + e^-g); computed in float, rounded once.
void silu_mul(void* out, const void* gate_up, int rows, int inter, DType dtype);

// --- quantized linear layers for decode: y = x @ W.T, W dequantized in registers -------------
// x [rows, n_in], y [rows, n_out], contiguous. Each weight row is read once and used for every
// row of x (rows is small in decode: one per sequence in the step).
// int4, group-wise: W[o, i] = min[o, i / G] + scale[o, i / G] * code(o, i), code 0..15;
//   packed uint8 [n_out, n_in / 2], element 2j in the low nibble of byte j, 2j+1 in the high one;
//   scale, min float16 (raw bits) [n_out, n_in / G], as a Q4_1 block stores them: 0.125 bytes per
//   weight where float32 took 0.25 (with the codes' 0.5: 0.625 bytes a weight, not 0.75);
//   G a multiple of 32, n_in a multiple of G.
void int4_linear(void* y, const void* x, const uint8_t* packed, const uint16_t* scale, const uint16_t* min, int rows,
                 int n_in, int n_out, int group_size, DType dtype);
// int8, per output row: W[o, i] = scale[o] * q[o, i].  q int8 [n_out, n_in], scale float32 [n_out].
void int8_linear(void* y, const void* x, const int8_t* q, const float* scale, int rows, int n_in, int n_out,
                 DType dtype);
// bf16, unquantized: W bfloat16 (raw bits) [n_out, n_in], any n_in. The weights of a bf16 model
// are the same matrix-vector problem at 2 bytes a weight, and torch's GEMM, made for larger
// products, streams them at about half the bandwidth at 1-8 rows of x. With AVX512-BF16 and bf16
// x, each instruction takes 32 weights and 32 inputs as stored; elsewhere weights are widened.
void bf16_linear(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, DType dtype);

// --- the same linear layers for many rows of x: a matrix product (gemm.cpp) -------------------
// Same arguments and results as the three above (to float32 summation order; with AVX512-BF16 and
// bf16 x, an int4 weight rounded to bf16 as in a dense bf16 copy). Each weight is dequantized once
// per call into a cache-resident panel and multiplied into every row of x in register tiles.
// The kernels above hand their call here when gemm_applies(rows): from kGemmMinRows (kernels.h) rows, on
// AVX2 and up, unless batch-invariant (the matrix-vector kernels sum in another order).
bool gemm_applies(int rows);
// Its path for this ISA and mode: "avx2-fma", "avx512-fma", "avx512-bf16 (bf16 x) / avx512-fma",
// or "off (...)" where the matrix-vector kernels take every row count.
const char* gemm_name();
void int4_gemm(void* y, const void* x, const uint8_t* packed, const uint16_t* scale, const uint16_t* min, int rows,
               int n_in, int n_out, int group_size, DType dtype);
void int8_gemm(void* y, const void* x, const int8_t* q, const float* scale, int rows, int n_in, int n_out,
               DType dtype);
void bf16_gemm(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, DType dtype);

// --- int4 weights times int8-quantized bf16 x, in integers (int4_q8_gemm.cpp) -------------------
// For bf16 x of any number of rows: each block of 32 inputs of a row of x quantized to int8
// with its own scale (dx = max|x| / 127, xq = round(x / dx)), multiplied with the codes in integers
// (vpmaddubsw on AVX2, VNNI's vpdpbusd on AVX512-BF16), then scaled per block:
//   y[r, o] = sum_b scale[o, b] * dx[r, b] * sum_k code[o, k] xq[r, k]  +  min[o, b] * sum_k x[r, k]
// The codes are first laid out into tiles of `width` outputs (int4_tiles; the layout is in the
// .cpp), whose width is the ISA's: q8_tile_width(), 0 where there is none (portable C++).
// tiles: uint8 [ceil(n_out / width), n_in / 32, kQ8TileBytes * width]; n_in a multiple of group_size.
constexpr int kQ8TileBytes = 20;  // a tile's bytes per output and block: 16 of codes, a float16 scale and min
int q8_tile_width();
bool q8_gemm_applies(int rows, DType dtype, int tile_width);  // and the tiles' width is this ISA's
void int4_tiles(uint8_t* tiles, const uint8_t* packed, const uint16_t* scale, const uint16_t* min, int n_in, int n_out,
                int group_size, int width);
// With `lora`, the product's team adds those deltas into y after it (lora_group_share, below).
struct LoraGroup;
void int4_q8_gemm(void* y, const void* x, const uint8_t* tiles, int rows, int n_in, int n_out, int width,
                  DType dtype, const LoraGroup* lora = nullptr);
// x [rows, n_in] (n_in a multiple of 32) as both integer products take it: xq int8 [rows, n_in],
// dx and xsum float32 [rows, n_in / 32] (x's sum over each block), in the calling thread's scratch,
// valid until its next call. x86 only (elsewhere there are no tiles to meet it).
struct Q8Rows {
    int8_t* xq = nullptr;
    float* dx = nullptr;
    float* xsum = nullptr;
};
Q8Rows quantize_q8(const void* x, int rows, int n_in, DType dtype);

// --- int8 weights times int8-quantized bf16 x, in integers (int8_q8_gemm.cpp) -------------------
// The same for int8 weights (per output row, W[o, i] = scale[o] * q[o, i]), llama.cpp's Q8_0 x Q8_0:
//   y[r, o] = scale[o] * sum_b dx[r, b] * sum_k q[o, k] xq[r, k]
// q laid out into tiles of `width` (q8_tile_width()) outputs by int8_tiles (layout in the .cpp):
// tiles: uint8 [ceil(n_out / width), n_in / 32, kQ8Int8TileBytes * width]; n_in a multiple of 32.
constexpr int kQ8Int8TileBytes = 32;  // a tile's bytes per output and block: the block's 32 weights
void int8_tiles(uint8_t* tiles, const int8_t* q, int n_in, int n_out, int width);
void int8_q8_gemm(void* y, const void* x, const uint8_t* tiles, const float* scale, int rows, int n_in, int n_out,
                  int width, DType dtype, const LoraGroup* lora = nullptr);

// The float32 FMA peak of this machine at the current ISA, on every OpenMP thread, measured by
// `steps` steps of independent FMA chains (peak.cpp): the ceiling gemm.cpp's GFLOP/s compare to.
double fma_peak_gflops(int64_t steps);

// --- LoRA: many adapters in one batch, a shrink then an expand (lora.cpp) ------------------------
// A step's rows are cut into segments: seg_starts int32 [n_seg + 1] (0 = starts[0] <= starts[1] <=
// ... <= starts[n_seg] = rows), seg_slots int32 [n_seg], each -1 (the base model: no delta) or an
// adapter slot 0..slots-1. A prompt chunk is a segment, a decode row a segment of one. Slot s has
// rank ranks[s] (int32 [slots], 0..r_max); weight rows past it are padding that is never read.
//   shrink: v[row, k] = sum_i a[s, k, i] * x[row, i]   for k < ranks[s]; 0 for k >= ranks[s]
//           and on every row of slot -1.
//     x   [rows, n_in], row stride x_stride, dtype (elements contiguous along n_in)
//     a   [slots, r_max, n_in] contiguous, w_dtype (f32 or bf16): PEFT's lora_A.weight per slot
//     v   float32 [rows, r_max], row stride v_stride
//   expand: y[row, o] += scale[s] * sum_{k < ranks[s]} v[row, k] * b_t[s, k, o], rounded once to
//           dtype; rows of slot -1 are not touched (not even read).
//     y   [rows, n_out], row stride y_stride, dtype, updated in place
//     b_t [slots, r_max, n_out] contiguous, w_dtype: lora_B.weight ([n_out, r]) transposed
//     scale float32 [slots] (alpha / r, or alpha / sqrt(r) for rsLoRA: given, not computed)
// n_slots: the slots in a and b_t. Computed in float32. ops.cpp checks the tables on a CPU; on a
// GPU it cannot without a wait, so both halves count a slot outside 0..n_slots-1 as -1 and clamp a
// rank to 0..r_max: a bad table gives wrong numbers, never a read outside the weights.
void lora_shrink(float* v, int64_t v_stride, const void* x, int64_t x_stride, const void* a, const int32_t* ranks,
                 const int32_t* seg_starts, const int32_t* seg_slots, int rows, int n_seg, int n_slots, int n_in,
                 int r_max, DType dtype, DType w_dtype);
void lora_expand(void* y, int64_t y_stride, const float* v, int64_t v_stride, const void* b_t, const int32_t* ranks,
                 const float* scale, const int32_t* seg_starts, const int32_t* seg_slots, int rows, int n_seg,
                 int n_slots, int n_out, int r_max, DType dtype, DType w_dtype);

// The projections of one fused matmul (q, k, v; gate, up) that share x, their deltas added into
// y's columns: every part's shrink, then every part's expand, by one team of threads. Each part's
// a, b_t and ranks as above (all with r_max ranks and n_in inputs), its outputs at y_col.., its v
// float32 [rows, r_max] contiguous (scratch, left holding the shrink).
struct LoraPart {
    const void* a;
    const void* b_t;
    const int32_t* ranks;
    float* v;
    int64_t y_col;
    int n_out;
};
void lora_group(void* y, int64_t y_stride, const void* x, int64_t x_stride, const LoraPart* parts, int n_parts,
                const float* scale, const int32_t* seg_starts, const int32_t* seg_slots, int rows, int n_seg,
                int n_slots, int n_in, int r_max, DType dtype, DType w_dtype);
// The same arguments in one place, for a team that another kernel runs (the matmul whose output y is):
// every thread of it calls lora_group_share (which waits at barriers of the team), after its share
// of the matmul when y_pending; LoraPrefetch asks for the tables that thread's share reads.
struct LoraGroup {
    void* y;
    int64_t y_stride;
    const void* x;
    int64_t x_stride;
    const LoraPart* parts;
    int n_parts;
    const float* scale;
    const int32_t *seg_starts, *seg_slots;
    int rows, n_seg, n_slots, n_in, r_max;
    DType dtype, w_dtype;
};
void lora_group_share(const LoraGroup& g, int thread, int threads, bool y_pending);
// The tables thread `thread` of `threads` reads in lora_group_share, asked into the caches a few lines
// at a time by step(n) while the team's matmul runs before it.
class LoraPrefetch {
  public:
    LoraPrefetch(const LoraGroup& g, int thread, int threads);
    void step(int64_t n);
    int64_t lines = 0;
  private:
    static constexpr int kMaxRanges = 256;
    std::pair<const char*, int64_t> ranges[kMaxRanges];
    int n_ranges = 0, i = 0;
    int64_t offset = 0;
};

}  // namespace kernels::cpu
