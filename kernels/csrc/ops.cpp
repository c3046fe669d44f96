// The operators of ops.h: each checks its tensors (device, dtype, shape, layout), allocates its
// output (and any workspace) through torch's allocator, and hands raw pointers to run_kernel
// (dispatch.h), which calls the CPU function or the CUDA launcher.
#include "ops.h"

#include <ATen/cpu/Utils.h>

#include <cctype>
#include <cstdlib>
#include <string>

#include "dispatch.h"

namespace kernels::ops {

namespace {

std::string head_dims_text() {  // "32, 64, ...": kernels.h's list, for an error message
    std::string text;
    for (int d : kHeadDims) text += (text.empty() ? "" : ", ") + std::to_string(d);
    return text;
}

void check_x(const at::Tensor& x, int64_t n_in) {
    check_supported_device(x);
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [rows, n_in] expected, got ", x.sizes());
    TORCH_CHECK(x.size(1) == n_in, "x has ", x.size(1), " inputs, the weight ", n_in);
}

// A float16 or bfloat16 tensor's elements as the raw bits the kernels take (cpu_kernels.h).
const uint16_t* half_bits(const at::Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); }

// The CUDA launcher of a linear layer for a call of `rows` rows: the matrix product (cuda/gemm.cu)
// from kGemmMinRows rows (kernels.h), the matrix-vector kernel (cuda/quant_linear.cu) below. The
// CPU functions make the same choice themselves, so run_kernel gets one CPU function either way.
template <class Launcher>
Launcher linear_launcher(int64_t rows, Launcher matvec, Launcher gemm) {
    return rows >= kGemmMinRows ? gemm : matvec;
}

}  // namespace

// --- paged decode attention ------------------------------------------------------------------

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t partition_size) {
    check_supported_device(q);
    TORCH_CHECK(q.dim() == 3, "q: [batch, n_heads, head_dim] expected, got ", q.sizes());
    TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(),
                "k_pool, v_pool: the same [num_blocks, block_size, n_kv_heads, head_dim] expected, got ",
                k_pool.sizes(), " and ", v_pool.sizes());
    const int64_t batch = q.size(0), n_heads = q.size(1), head_dim = q.size(2);
    const int64_t block_size = k_pool.size(1), n_kv_heads = k_pool.size(2);
    TORCH_CHECK(k_pool.size(3) == head_dim, "k_pool's head_dim ", k_pool.size(3), " differs from q's ", head_dim);
    TORCH_CHECK(supported_head_dim(static_cast<int>(head_dim)), "head_dim ", head_dim,
                " is not one the kernels are built for (", head_dims_text(), ": kernels.head_dims())");
    TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "n_heads ", n_heads, " is not a multiple of n_kv_heads ",
                n_kv_heads);
    TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == head_dim,
                "q: heads must be contiguous (a token's heads side by side)");
    TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "k_pool and v_pool must be contiguous");
    const DType dtype = dtype_of(q, "q");
    TORCH_CHECK(k_pool.scalar_type() == q.scalar_type() && v_pool.scalar_type() == q.scalar_type(),
                "q, k_pool and v_pool must share a dtype");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == batch &&
                    block_tables.is_contiguous(),
                "block_tables: contiguous int32 [batch, max_blocks] expected");
    TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 && context_lens.size(0) == batch &&
                    context_lens.is_contiguous(),
                "context_lens: contiguous int32 [batch] expected");
    for (const at::Tensor* t : {&k_pool, &v_pool, &block_tables, &context_lens})
        check_same_device(q, *t, "an argument");
    TORCH_CHECK(partition_size > 0 && partition_size % block_size == 0, "partition_size ", partition_size,
                " must be a positive multiple of block_size ", block_size);
    const int64_t max_blocks = block_tables.size(1);
    const int64_t n_partitions = (max_blocks * block_size + partition_size - 1) / partition_size;

    at::Tensor out = at::empty({batch, n_heads, head_dim}, q.options());
    if (batch == 0) return out;
    TORCH_CHECK(max_blocks > 0, "block_tables has no blocks");
    // partial outputs, then partial maxima and sums (cpu_kernels.h)
    at::Tensor workspace = at::empty({batch * n_heads * n_partitions * (head_dim + 2)}, q.options().dtype(at::kFloat));
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    if (q.is_cpu()) {
        // Lengths are checked on the CPU only: on CUDA it would cost a device-to-host copy, a wait.
        for (int64_t b = 0; b < batch; ++b)
            TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "context_lens[", b, "] = ", lens[b],
                        " is outside 1..", max_blocks * block_size, " (the block table's slots)");
    }
    run_kernel("paged_decode_attention", q, cpu::paged_decode_attention, KERNELS_LAUNCHER(paged_decode_attention),
               out.data_ptr(), q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
               block_tables.data_ptr<int32_t>(), lens, workspace.data_ptr<float>(), batch, n_heads, n_kv_heads,
               head_dim, block_size, max_blocks, partition_size, static_cast<float>(scale), dtype);
    return out;
}

// --- prompt-chunk attention ----------------------------------------------------------------------

at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& query_lens,
                           const at::Tensor& context_lens, double scale) {
    check_supported_device(q);
    TORCH_CHECK(q.dim() == 3, "q: [tokens, n_heads, head_dim] expected, got ", q.sizes());
    TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(),
                "k_pool, v_pool: the same [num_blocks, block_size, n_kv_heads, head_dim] expected, got ",
                k_pool.sizes(), " and ", v_pool.sizes());
    const int64_t tokens = q.size(0), n_heads = q.size(1), head_dim = q.size(2);
    const int64_t block_size = k_pool.size(1), n_kv_heads = k_pool.size(2);
    TORCH_CHECK(k_pool.size(3) == head_dim, "k_pool's head_dim ", k_pool.size(3), " differs from q's ", head_dim);
    TORCH_CHECK(supported_head_dim(static_cast<int>(head_dim)), "head_dim ", head_dim,
                " is not one the kernels are built for (", head_dims_text(), ": kernels.head_dims())");
    TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "n_heads ", n_heads, " is not a multiple of n_kv_heads ",
                n_kv_heads);
    TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == head_dim,
                "q: heads must be contiguous (a token's heads side by side)");
    TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "k_pool and v_pool must be contiguous");
    const DType dtype = dtype_of(q, "q");
    TORCH_CHECK(k_pool.scalar_type() == q.scalar_type() && v_pool.scalar_type() == q.scalar_type(),
                "q, k_pool and v_pool must share a dtype");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
                "block_tables: contiguous int32 [batch, max_blocks] expected");
    const int64_t batch = block_tables.size(0), max_blocks = block_tables.size(1);
    for (const at::Tensor* t : {&query_start, &query_lens, &context_lens})
        TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->size(0) == batch && t->is_contiguous(),
                    "query_start, query_lens, context_lens: contiguous int32 [batch] expected (batch ", batch,
                    " from block_tables), got ", t->scalar_type(), " ", t->sizes());
    for (const at::Tensor* t : {&k_pool, &v_pool, &block_tables, &query_start, &query_lens, &context_lens})
        check_same_device(q, *t, "an argument");

    at::Tensor out = at::zeros({tokens, n_heads, head_dim}, q.options());
    if (batch == 0) return out;
    const int32_t *starts = query_start.data_ptr<int32_t>(), *lens = query_lens.data_ptr<int32_t>();
    const int32_t* ctx = context_lens.data_ptr<int32_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int64_t blocks = k_pool.size(0);
    // Lengths and tables are checked on the CPU only: on CUDA it would cost a device-to-host copy, a wait.
    for (int64_t b = 0; q.is_cpu() && b < batch; ++b) {
        TORCH_CHECK(lens[b] >= 1 && lens[b] <= ctx[b] && ctx[b] <= max_blocks * block_size, "sequence ", b,
                    ": query_lens ", lens[b], " and context_lens ", ctx[b], " must satisfy 1 <= query_lens <= ",
                    "context_lens <= ", max_blocks * block_size, " (the block table's slots)");
        TORCH_CHECK(starts[b] >= 0 && starts[b] + lens[b] <= tokens, "sequence ", b, ": its queries ", starts[b], "..",
                    starts[b] + lens[b] - 1, " are outside q's ", tokens, " tokens");
        for (int64_t i = 0; i < (ctx[b] + block_size - 1) / block_size; ++i)
            TORCH_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < blocks, "block_tables[", b,
                        ", ", i, "] = ", tables[b * max_blocks + i], " is outside the pool's 0..", blocks - 1);
    }
    run_kernel("chunk_attention", q, cpu::chunk_attention, KERNELS_LAUNCHER(chunk_attention), out.data_ptr(),
               q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), tables, starts, lens, ctx, tokens, batch,
               n_heads, n_kv_heads, head_dim, block_size, max_blocks, static_cast<float>(scale), dtype);
    return out;
}

// --- RMSNorm (+ residual) and RoPE -------------------------------------------------------------

at::Tensor add_rms_norm(at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
    check_supported_device(x);
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [rows, hidden] expected, got ", x.sizes());
    const DType dtype = dtype_of(x, "x");
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                    weight.scalar_type() == x.scalar_type(),
                "weight: contiguous [hidden] of x's dtype expected");
    check_same_device(x, weight, "weight");
    if (delta) {
        TORCH_CHECK(delta->sizes() == x.sizes() && delta->is_contiguous() && delta->scalar_type() == x.scalar_type(),
                    "delta: contiguous, of x's shape and dtype expected");
        check_same_device(x, *delta, "delta");
    }
    at::Tensor out = at::empty_like(x);
    const void* d = delta ? delta->data_ptr() : nullptr;
    if (x.numel() == 0) return out;
    run_kernel("add_rms_norm", x, cpu::add_rms_norm, KERNELS_LAUNCHER(add_rms_norm), out.data_ptr(), x.data_ptr(), d,
               weight.data_ptr(), x.size(0), x.size(1), static_cast<float>(eps), dtype);
    return out;
}

void rope_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
    check_supported_device(qk);
    TORCH_CHECK(qk.dim() == 3, "qk: [tokens, heads, head_dim] expected, got ", qk.sizes());
    const int64_t tokens = qk.size(0), heads = qk.size(1), head_dim = qk.size(2);
    TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
    TORCH_CHECK(qk.stride(2) == 1 && qk.stride(1) == head_dim, "qk: heads must be contiguous");
    for (const at::Tensor* t : {&cos, &sin}) {
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == tokens &&
                        t->size(1) == head_dim / 2,
                    "cos, sin: contiguous float32 [tokens, head_dim / 2] expected, got ", t->sizes());
        check_same_device(qk, *t, "cos/sin");
    }
    const DType dtype = dtype_of(qk, "qk");
    if (qk.numel() == 0) return;
    run_kernel("rope", qk, cpu::rope, KERNELS_LAUNCHER(rope), qk.data_ptr(), cos.data_ptr<float>(),
               sin.data_ptr<float>(), tokens, heads, head_dim, qk.stride(0), dtype);
}

void rope_cache_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool, at::Tensor& v_pool,
                 const at::Tensor& slots) {
    check_supported_device(qkv);
    TORCH_CHECK(
        k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() && v_pool.is_contiguous(),
        "k_pool, v_pool: the same contiguous [num_blocks, block_size, n_kv_heads, head_dim] expected, got ",
        k_pool.sizes(), " and ", v_pool.sizes());
    const int64_t n_kv_heads = k_pool.size(2), head_dim = k_pool.size(3);
    const int64_t slots_total = k_pool.size(0) * k_pool.size(1);
    TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.size(2) == head_dim && qkv.size(1) > 2 * n_kv_heads,
                "qkv: contiguous [tokens, n_heads + 2 * n_kv_heads, head_dim] expected (q, k, v heads), with the "
                "pool's n_kv_heads ",
                n_kv_heads, " and head_dim ", head_dim, ", got ", qkv.sizes());
    TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
    const int64_t tokens = qkv.size(0), n_heads = qkv.size(1) - 2 * n_kv_heads;
    for (const at::Tensor* t : {&cos, &sin}) {
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == tokens &&
                        t->size(1) == head_dim / 2,
                    "cos, sin: contiguous float32 [tokens, head_dim / 2] expected, got ", t->sizes());
    }
    TORCH_CHECK(
        slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == tokens && slots.is_contiguous(),
        "slots: contiguous int64 [tokens] expected, got ", slots.scalar_type(), " ", slots.sizes());
    const at::Tensor* others[] = {&cos, &sin, &k_pool, &v_pool, &slots};
    for (const at::Tensor* t : others) check_same_device(qkv, *t, "an argument");
    const DType dtype = dtype_of(qkv, "qkv");
    TORCH_CHECK(k_pool.scalar_type() == qkv.scalar_type() && v_pool.scalar_type() == qkv.scalar_type(),
                "qkv, k_pool and v_pool must share a dtype");
    if (tokens == 0) return;
    const int64_t* s = slots.data_ptr<int64_t>();
    if (qkv.is_cpu()) {
        // Slots are checked on the CPU only (on CUDA it would cost a device-to-host copy, a wait).
        for (int64_t t = 0; t < tokens; ++t)
            TORCH_CHECK(s[t] >= 0 && s[t] < slots_total, "slots[", t, "] = ", s[t], " is outside the pool's 0..",
                        slots_total - 1);
    }
    run_kernel("rope_cache", qkv, cpu::rope_cache, KERNELS_LAUNCHER(rope_cache), qkv.data_ptr(), cos.data_ptr<float>(),
               sin.data_ptr<float>(), k_pool.data_ptr(), v_pool.data_ptr(), s, tokens, n_heads, n_kv_heads, head_dim,
               dtype);
}

// --- quantized and bf16 linear layers ----------------------------------------------------------

namespace {

// packed, scale, min as cpu_kernels.h's int4 layout has them; -> n_in.
int64_t check_int4(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min, int64_t group_size) {
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
                "packed: contiguous uint8 [n_out, n_in / 2] expected");
    const int64_t n_out = packed.size(0), n_in = packed.size(1) * 2;
    TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && n_in % group_size == 0, "group_size ", group_size,
                " must be a multiple of 32 that divides n_in ", n_in);
    for (const at::Tensor* t : {&scale, &min}) {
        TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == n_out &&
                        t->size(1) == n_in / group_size,
                    "scale, min: contiguous float16 [n_out, n_in / group_size] expected, got ", t->scalar_type(), " ",
                    t->sizes());
        check_same_device(packed, *t, "scale/min");
    }
    return n_in;
}

// The tiles' width, after checking them against the weight: [ceil(n_out / width), n_in / 32, bytes * width],
// bytes per output and block: 20 for int4_tiles, 32 for int8_tiles (`maker`).
int tiles_width(const at::Tensor& tiles, int64_t n_in, int64_t n_out, int64_t bytes, const char* maker) {
    TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 3 && tiles.is_contiguous() && tiles.is_cpu(),
                "tiles: contiguous uint8 [n_tiles, n_in / 32, ", bytes, " * width] on the CPU expected (", maker, ")");
    const int64_t width = tiles.size(2) / bytes;
    TORCH_CHECK(tiles.size(2) == bytes * width && width > 0 && n_in % 32 == 0 && tiles.size(1) == n_in / 32 &&
                    tiles.size(0) == (n_out + width - 1) / width,
                "tiles ", tiles.sizes(), " are not ", maker, " of a [", n_out, ", ", n_in, "] weight");
    return static_cast<int>(width);
}

}  // namespace

at::Tensor int4_linear_lora(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                            const at::Tensor& min, int64_t group_size, const std::optional<at::Tensor>& tiles,
                            cpu::LoraGroup* lora) {
    const int64_t n_in = check_int4(packed, scale, min, group_size), n_out = packed.size(0);
    check_x(x, n_in);
    check_same_device(x, packed, "packed");
    const DType dtype = dtype_of(x, "x");
    at::Tensor y = at::empty({x.size(0), n_out}, x.options());
    if (y.numel() == 0) return y;
    if (tiles && tiles->numel() > 0 && x.is_cpu()) {
        const int width = tiles_width(*tiles, n_in, n_out, cpu::kQ8TileBytes, "int4_tiles");
        if (cpu::q8_gemm_applies(static_cast<int>(x.size(0)), dtype, width)) {
            if (lora) lora->y = y.data_ptr(), lora->y_stride = y.stride(0);
            cpu::int4_q8_gemm(y.data_ptr(), x.data_ptr(), tiles->data_ptr<uint8_t>(), x.size(0), n_in, n_out, width,
                              dtype, lora);
            return y;
        }
    }
    run_kernel("int4_linear", x, cpu::int4_linear,
               linear_launcher(x.size(0), KERNELS_LAUNCHER(int4_linear), KERNELS_LAUNCHER(int4_gemm)), y.data_ptr(),
               x.data_ptr(), packed.data_ptr<uint8_t>(), half_bits(scale), half_bits(min), x.size(0), n_in, n_out,
               group_size, dtype);
    return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min,
                       int64_t group_size, const std::optional<at::Tensor>& tiles) {
    return int4_linear_lora(x, packed, scale, min, group_size, tiles, nullptr);
}

at::Tensor int4_tiles(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min, int64_t group_size) {
    const int64_t n_in = check_int4(packed, scale, min, group_size), n_out = packed.size(0);
    const int width = cpu::q8_tile_width();
    if (!packed.is_cpu() || width == 0) return at::empty({0}, packed.options());
    at::Tensor tiles = at::empty({(n_out + width - 1) / width, n_in / 32, cpu::kQ8TileBytes * width}, packed.options());
    cpu::int4_tiles(tiles.data_ptr<uint8_t>(), packed.data_ptr<uint8_t>(), half_bits(scale), half_bits(min),
                    static_cast<int>(n_in), static_cast<int>(n_out), static_cast<int>(group_size), width);
    return tiles;
}

namespace {

void check_int8(const at::Tensor& q) {
    TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(),
                "q: contiguous int8 [n_out, n_in] expected");
}

}  // namespace

at::Tensor int8_linear_lora(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                            const std::optional<at::Tensor>& tiles, cpu::LoraGroup* lora) {
    check_int8(q);
    const int64_t n_out = q.size(0), n_in = q.size(1);
    check_x(x, n_in);
    TORCH_CHECK(
        scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1 && scale.size(0) == n_out,
        "scale: contiguous float32 [n_out] expected");
    check_same_device(x, q, "q");
    check_same_device(x, scale, "scale");
    const DType dtype = dtype_of(x, "x");
    at::Tensor y = at::empty({x.size(0), n_out}, x.options());
    if (y.numel() == 0) return y;
    if (tiles && tiles->numel() > 0 && x.is_cpu()) {
        const int width = tiles_width(*tiles, n_in, n_out, cpu::kQ8Int8TileBytes, "int8_tiles");
        if (cpu::q8_gemm_applies(static_cast<int>(x.size(0)), dtype, width)) {
            if (lora) lora->y = y.data_ptr(), lora->y_stride = y.stride(0);
            cpu::int8_q8_gemm(y.data_ptr(), x.data_ptr(), tiles->data_ptr<uint8_t>(), scale.data_ptr<float>(),
                              x.size(0), n_in, n_out, width, dtype, lora);
            return y;
        }
    }
    run_kernel("int8_linear", x, cpu::int8_linear,
               linear_launcher(x.size(0), KERNELS_LAUNCHER(int8_linear), KERNELS_LAUNCHER(int8_gemm)), y.data_ptr(),
               x.data_ptr(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), x.size(0), n_in, n_out, dtype);
    return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& tiles) {
    return int8_linear_lora(x, q, scale, tiles, nullptr);
}

at::Tensor int8_tiles(const at::Tensor& q) {
    check_int8(q);
    const int64_t n_out = q.size(0), n_in = q.size(1);
    const int width = cpu::q8_tile_width();
    if (!q.is_cpu() || width == 0 || n_in % 32 != 0) return at::empty({0}, q.options().dtype(at::kByte));
    at::Tensor tiles = at::empty({(n_out + width - 1) / width, n_in / 32, cpu::kQ8Int8TileBytes * width},
                                 q.options().dtype(at::kByte));
    cpu::int8_tiles(tiles.data_ptr<uint8_t>(), q.data_ptr<int8_t>(), static_cast<int>(n_in), static_cast<int>(n_out),
                    width);
    return tiles;
}

// AMX. A CPU with AMX-BF16 (Intel's Xeons from Sapphire Rapids on) multiplies bf16 tiles of 16 x 32
// by 32 x 16 in one instruction, many times what AVX512's FMAs do: torch's bf16 GEMM, which oneDNN
// runs on those tiles, took a layer's four products 1.8x as fast as the library's at 16 rows of x,
// 3.7x at 128 and 6.5x at 512 on the Xeon of chapter 06's README; 1.3x at 12 rows and 0.94x at 8, so
// the route starts where the library's own matrix product does. The library's own AMX kernel is
// its integer products' (int4 and int8 weights, cpu/q8_tiles.h); bf16 weights would need theirs in
// pairs of rows, so on such a CPU a bf16 weight's product of kAmxMinRows rows or more is at::linear's.
// Not where oneDNN may not use the tiles (ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA below them, or
// torch.backends.mkldnn off); not below the AVX512-BF16 level, a choice (torch's GEMM would still use
// the tiles): ATEN_CPU_CAPABILITY=avx2 or avx512 then reproduces a CPU without them; and not under
// batch invariance: oneDNN's rounding of a row may depend on the rows beside it.
namespace {

bool isa_cap_allows_amx(const char* name) {  // oneDNN reads its cap once, at its first use: so here
    const char* cap = std::getenv(name);
    if (cap == nullptr || *cap == '\0') return true;
    std::string s(cap);
    for (char& c : s) c = char(std::toupper(static_cast<unsigned char>(c)));
    return s == "ALL" || s == "DEFAULT" || s.find("AMX") != std::string::npos;
}

bool amx_available() {
    static const bool available = [] {  // asked once: cpuinfo's flags, oneDNN's cap, the OS's leave (Linux)
        const auto caps = at::cpu::get_cpu_capabilities();
        const auto it = caps.find("amx_bf16");
        return it != caps.end() && it->second.isBool() && it->second.toBool() &&
               isa_cap_allows_amx("ONEDNN_MAX_CPU_ISA") && isa_cap_allows_amx("DNNL_MAX_CPU_ISA") &&
               at::cpu::init_amx();
    }();
    return available && at::globalContext().userEnabledMkldnn();
}

}  // namespace

// One switch for both uses of the tiles (cpu::set_amx): torch's GEMM for bf16 weights, the
// library's integer products for int4 and int8 weights. On: each where it can run, an error where
// neither can (on without AMX-INT8 is the default for the library's part: -1, which cannot throw).
void set_cpu_gemm_amx(int mode) {
    TORCH_CHECK(mode <= 0 || amx_available() || cpu::amx_int8_supported(),
                "set_cpu_gemm_amx(True): this CPU has no AMX-BF16 tiles (or the OS does not grant them, ",
                "ONEDNN_MAX_CPU_ISA keeps oneDNN below them, or torch.backends.mkldnn is off) and no AMX-INT8 ones");
    cpu::set_amx(mode > 0 && !cpu::amx_int8_supported() ? -1 : mode);
}

bool cpu_gemm_amx() {
    return cpu::amx_allowed() && cpu::isa() == cpu::Isa::avx512_bf16 && !cpu::batch_invariant() && amx_available();
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
                "w: contiguous bfloat16 [n_out, n_in] expected, got ", w.scalar_type(), " ", w.sizes());
    const int64_t n_out = w.size(0), n_in = w.size(1);
    check_x(x, n_in);
    check_same_device(x, w, "w");
    const DType dtype = dtype_of(x, "x");
    if (x.is_cpu() && dtype == DType::bf16 && x.size(0) >= kAmxMinRows && cpu_gemm_amx()) return at::linear(x, w);
    at::Tensor y = at::empty({x.size(0), n_out}, x.options());
    if (y.numel() == 0) return y;
    run_kernel("bf16_linear", x, cpu::bf16_linear,
               linear_launcher(x.size(0), KERNELS_LAUNCHER(bf16_linear), KERNELS_LAUNCHER(bf16_gemm)), y.data_ptr(),
               x.data_ptr(), half_bits(w), x.size(0), n_in, n_out, dtype);
    return y;
}

// --- silu_mul ------------------------------------------------------------------------------------

at::Tensor silu_mul(const at::Tensor& gate_up) {
    check_supported_device(gate_up);
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous(),
                "gate_up: contiguous [rows, 2 * inter] expected (gate, then up), got ", gate_up.sizes());
    const DType dtype = dtype_of(gate_up, "gate_up");
    const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
    at::Tensor out = at::empty({rows, inter}, gate_up.options());
    if (out.numel() == 0) return out;
    run_kernel("silu_mul", gate_up, cpu::silu_mul, KERNELS_LAUNCHER(silu_mul), out.data_ptr(), gate_up.data_ptr(), rows,
               inter, dtype);
    return out;
}

// --- LoRA: shrink and expand over a segment table ------------------------------------------------

// The adapters' weights (a or b_t: [slots, r_max, n]) and their ranks [slots], checked against each
// other and the tensor `on` they are used with. On a CPU the ranks' values are
// checked too (on CUDA that would be a copy to the host and a wait: the kernels read no rank past
// r_max instead, cpu_kernels.h).
void check_lora_weights(const at::Tensor& on, const at::Tensor& w, const char* w_name, const at::Tensor& ranks) {
    TORCH_CHECK(w.dim() == 3 && w.is_contiguous(), w_name, ": contiguous [slots, r_max, n] expected, got ", w.sizes());
    TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, w_name,
                ": float32 or bfloat16 adapter weights expected, got ", w.scalar_type());
    const int64_t slots = w.size(0), r_max = w.size(1);
    TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.dim() == 1 && ranks.size(0) == slots && ranks.is_contiguous(),
                "ranks: contiguous int32 [slots] expected (", slots, " slots in ", w_name, "), got ",
                ranks.scalar_type(), " ", ranks.sizes());
    check_same_device(on, w, w_name);
    check_same_device(on, ranks, "ranks");
    if (on.is_cpu()) {
        const int32_t* rank = ranks.data_ptr<int32_t>();
        for (int64_t s = 0; s < slots; ++s)
            TORCH_CHECK(rank[s] >= 0 && rank[s] <= r_max, "ranks[", s, "] = ", rank[s], " is outside 0..", r_max,
                        " (r_max: ", w_name, "'s second dimension)");
    }
    TORCH_CHECK(w.size(2) <= INT32_MAX && r_max <= INT32_MAX, "LoRA call too large");
}

// A step's segments (seg_starts [n_seg + 1], seg_slots [n_seg]), checked against the call's `rows`
// and the tables' `slots`; on a CPU their values too (on CUDA the kernels count a slot outside the
// table as -1 instead).
void check_lora_segments(const at::Tensor& on, const at::Tensor& seg_starts, const at::Tensor& seg_slots, int64_t rows,
                         int64_t slots) {
    TORCH_CHECK(seg_starts.scalar_type() == at::kInt && seg_starts.dim() == 1 && seg_starts.size(0) >= 1 &&
                    seg_starts.is_contiguous(),
                "seg_starts: contiguous int32 [n_seg + 1] expected, got ", seg_starts.scalar_type(), " ",
                seg_starts.sizes());
    const int64_t n_seg = seg_starts.size(0) - 1;
    TORCH_CHECK(seg_slots.scalar_type() == at::kInt && seg_slots.dim() == 1 && seg_slots.size(0) == n_seg &&
                    seg_slots.is_contiguous(),
                "seg_slots: contiguous int32 [n_seg] expected (", n_seg, " segments in seg_starts), got ",
                seg_slots.scalar_type(), " ", seg_slots.sizes());
    check_same_device(on, seg_starts, "seg_starts");
    check_same_device(on, seg_slots, "seg_slots");
    TORCH_CHECK(rows <= INT32_MAX, "LoRA call too large");
    if (!on.is_cpu()) return;
    const int32_t* starts = seg_starts.data_ptr<int32_t>();
    const int32_t* slot = seg_slots.data_ptr<int32_t>();
    TORCH_CHECK(starts[0] == 0 && (rows < 0 || starts[n_seg] == rows), "seg_starts must run from 0 to the call's ",
                rows, " rows, got ", starts[0], " .. ", starts[n_seg]);
    for (int64_t i = 0; i < n_seg; ++i) {
        TORCH_CHECK(starts[i] <= starts[i + 1], "seg_starts must not decrease: seg_starts[", i, "] = ", starts[i],
                    " > seg_starts[", i + 1, "] = ", starts[i + 1]);
        TORCH_CHECK(slot[i] >= -1 && (slots < 0 || slot[i] < slots), "seg_slots[", i, "] = ", slot[i],
                    " is outside -1..", slots - 1, " (-1: no adapter; ", slots, " slots in the adapters' tables)");
    }
}

void run_lora_shrink(at::Tensor& v, const at::Tensor& x, const at::Tensor& a, const at::Tensor& ranks,
                     const at::Tensor& seg_starts, const at::Tensor& seg_slots) {
    run_kernel("lora_shrink", x, cpu::lora_shrink, KERNELS_LAUNCHER(lora_shrink), v.data_ptr<float>(), v.stride(0),
               x.data_ptr(), x.stride(0), a.data_ptr(), ranks.data_ptr<int32_t>(), seg_starts.data_ptr<int32_t>(),
               seg_slots.data_ptr<int32_t>(), static_cast<int>(x.size(0)), static_cast<int>(seg_slots.size(0)),
               static_cast<int>(a.size(0)), static_cast<int>(x.size(1)), static_cast<int>(a.size(1)),
               dtype_of(x, "x"), lora_weight_dtype(a));
}

void run_lora_expand(at::Tensor& y, int64_t col, const at::Tensor& v, const at::Tensor& b_t, const at::Tensor& ranks,
                     const at::Tensor& scale, const at::Tensor& seg_starts, const at::Tensor& seg_slots) {
    void* y_at = static_cast<char*>(y.data_ptr()) + col * y.element_size();
    run_kernel("lora_expand", y, cpu::lora_expand, KERNELS_LAUNCHER(lora_expand), y_at, y.stride(0),
               v.data_ptr<float>(), v.stride(0), b_t.data_ptr(), ranks.data_ptr<int32_t>(), scale.data_ptr<float>(),
               seg_starts.data_ptr<int32_t>(), seg_slots.data_ptr<int32_t>(), static_cast<int>(y.size(0)),
               static_cast<int>(seg_slots.size(0)), static_cast<int>(b_t.size(0)), static_cast<int>(b_t.size(2)),
               static_cast<int>(b_t.size(1)), dtype_of(y, "y"), lora_weight_dtype(b_t));
}

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& ranks, const at::Tensor& seg_starts,
                       const at::Tensor& seg_slots) {
    check_supported_device(x);
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [rows, n_in] with contiguous rows expected, got ", x.sizes());
    dtype_of(x, "x");
    check_lora_weights(x, a, "a", ranks);
    check_lora_segments(x, seg_starts, seg_slots, x.size(0), a.size(0));
    TORCH_CHECK(a.size(2) == x.size(1), "x has ", x.size(1), " inputs, the adapters' A (a) ", a.size(2));
    at::Tensor v = at::empty({x.size(0), a.size(1)}, x.options().dtype(at::kFloat));
    if (v.numel() > 0) run_lora_shrink(v, x, a, ranks, seg_starts, seg_slots);
    return v;
}

void lora_expand_(at::Tensor& y, const at::Tensor& v, const at::Tensor& b_t, const at::Tensor& ranks,
                  const at::Tensor& scale, const at::Tensor& seg_starts, const at::Tensor& seg_slots) {
    check_supported_device(y);
    TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1, "y: [rows, n_out] with contiguous rows expected, got ", y.sizes());
    dtype_of(y, "y");
    const int64_t rows = y.size(0);
    check_lora_weights(y, b_t, "b_t", ranks);
    check_lora_segments(y, seg_starts, seg_slots, rows, b_t.size(0));
    TORCH_CHECK(b_t.size(2) == y.size(1), "y has ", y.size(1), " outputs, the adapters' B (b_t [slots, r_max, n_out]) ",
                b_t.size(2));
    const int64_t r_max = b_t.size(1);
    TORCH_CHECK(v.scalar_type() == at::kFloat && v.dim() == 2 && v.size(0) == rows && v.size(1) == r_max &&
                    v.stride(1) == 1,
                "v: float32 [rows, r_max] = [", rows, ", ", r_max, "] with contiguous rows expected (lora_shrink's "
                "output), got ", v.scalar_type(), " ", v.sizes());
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == b_t.size(0) &&
                    scale.is_contiguous(),
                "scale: contiguous float32 [slots] expected (", b_t.size(0), " slots), got ", scale.scalar_type(), " ",
                scale.sizes());
    check_same_device(y, v, "v");
    check_same_device(y, scale, "scale");
    if (y.numel() > 0) run_lora_expand(y, 0, v, b_t, ranks, scale, seg_starts, seg_slots);
}

}  // namespace kernels::ops
