// The torch glue, and the only file of the library that knows about at::Tensor.
//
// Each function checks its tensors (device, dtype, shape, layout) so that a wrong call is a
// Python error naming the argument, never a wild read; allocates the output (and any workspace)
// through torch's allocator, which on CUDA is a caching allocator, so no call pays a cudaMalloc;
// then hands raw pointers to the CPU function or to the CUDA launcher, with the current stream.
// Nothing here waits for the GPU.
//
// ATen and torch's pybind11 casters rather than <torch/extension.h>, which also brings the whole
// C++ frontend (modules, optimizers, data loaders): this file then compiles in about two thirds
// of the time, in every first build and in `make kernels-check`.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <torch/version.h>

#include <cmath>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"
#include "cpu/cpu_kernels.h"
#ifdef WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/launchers.h"
#endif

namespace {

using kernels::DType;

DType dtype_of(const at::Tensor& t, const char* name) {
    switch (t.scalar_type()) {
        case at::kFloat: return DType::f32;
        case at::kBFloat16: return DType::bf16;
        case at::kHalf: return DType::f16;
        default: TORCH_CHECK(false, name, ": float32, bfloat16 or float16 expected, got ", t.scalar_type());
    }
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* name) {
    TORCH_CHECK(a.device() == b.device(), name, " is on ", b.device(), ", expected ", a.device());
}

#ifdef WITH_CUDA
void check_cuda(cudaError_t err, const char* what) {
    TORCH_CHECK(err == cudaSuccess, what, ": ", cudaGetErrorString(err));
}
#endif

void check_supported_device(const at::Tensor& t) {
    TORCH_CHECK(t.is_cpu() || t.is_cuda(), "kernels run on cpu or cuda tensors, got ", t.device());
#ifndef WITH_CUDA
    TORCH_CHECK(t.is_cpu(), "this build of kernels/ has no CUDA half (torch ", TORCH_VERSION,
                " is a CPU build, or nvcc was not found when it was built); got a tensor on ", t.device());
#endif
}

// --- paged decode attention ------------------------------------------------------------------

std::string head_dims_text() {  // "32, 64, ...": kernels.h's list, for an error message
    std::string text;
    for (int d : kernels::kHeadDims) text += (text.empty() ? "" : ", ") + std::to_string(d);
    return text;
}

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
    TORCH_CHECK(kernels::supported_head_dim(static_cast<int>(head_dim)), "head_dim ", head_dim,
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
    if (q.is_cpu()) {
        // Lengths are checked on the CPU only: on CUDA it would cost a device-to-host copy, a wait.
        const int32_t* lens = context_lens.data_ptr<int32_t>();
        for (int64_t b = 0; b < batch; ++b)
            TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "context_lens[", b, "] = ", lens[b],
                        " is outside 1..", max_blocks * block_size, " (the block table's slots)");
        kernels::cpu::paged_decode_attention(out.data_ptr(), q.data_ptr(), q.stride(0), k_pool.data_ptr(),
                                             v_pool.data_ptr(), block_tables.data_ptr<int32_t>(), lens,
                                             workspace.data_ptr<float>(), batch, n_heads, n_kv_heads, head_dim,
                                             block_size, max_blocks, partition_size, static_cast<float>(scale), dtype);
    } else {
#ifdef WITH_CUDA
        const c10::cuda::CUDAGuard guard(q.device());
        check_cuda(kernels::cuda::paged_decode_attention(
                       out.data_ptr(), q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                       block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), workspace.data_ptr<float>(),
                       batch, n_heads, n_kv_heads, head_dim, block_size, max_blocks, partition_size,
                       static_cast<float>(scale), dtype, at::cuda::getCurrentCUDAStream()),
                   "paged_decode_attention");
#endif
    }
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
    if (x.is_cpu()) {
        kernels::cpu::add_rms_norm(out.data_ptr(), x.data_ptr(), d, weight.data_ptr(), x.size(0), x.size(1),
                                   static_cast<float>(eps), dtype);
    } else {
#ifdef WITH_CUDA
        const c10::cuda::CUDAGuard guard(x.device());
        check_cuda(kernels::cuda::add_rms_norm(out.data_ptr(), x.data_ptr(), d, weight.data_ptr(), x.size(0), x.size(1),
                                               static_cast<float>(eps), dtype, at::cuda::getCurrentCUDAStream()),
                   "add_rms_norm");
#endif
    }
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
    if (qk.is_cpu()) {
        kernels::cpu::rope(qk.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), tokens, heads, head_dim,
                           qk.stride(0), dtype);
    } else {
#ifdef WITH_CUDA
        const c10::cuda::CUDAGuard guard(qk.device());
        check_cuda(kernels::cuda::rope(qk.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), tokens, heads,
                                       head_dim, qk.stride(0), dtype, at::cuda::getCurrentCUDAStream()),
                   "rope");
#endif
    }
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
    if (qkv.is_cpu()) {
        // Slots are checked on the CPU only (on CUDA it would cost a device-to-host copy, a wait).
        const int64_t* s = slots.data_ptr<int64_t>();
        for (int64_t t = 0; t < tokens; ++t)
            TORCH_CHECK(s[t] >= 0 && s[t] < slots_total, "slots[", t, "] = ", s[t], " is outside the pool's 0..",
                        slots_total - 1);
        kernels::cpu::rope_cache(qkv.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), k_pool.data_ptr(),
                                 v_pool.data_ptr(), s, tokens, n_heads, n_kv_heads, head_dim, dtype);
    } else {
#ifdef WITH_CUDA
        const c10::cuda::CUDAGuard guard(qkv.device());
        check_cuda(kernels::cuda::rope_cache(qkv.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                             k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr<int64_t>(), tokens,
                                             n_heads, n_kv_heads, head_dim, dtype, at::cuda::getCurrentCUDAStream()),
                   "rope_cache");
#endif
    }
}

// --- quantized linear layers -----------------------------------------------------------------

void check_x(const at::Tensor& x, int64_t n_in) {
    check_supported_device(x);
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [rows, n_in] expected, got ", x.sizes());
    TORCH_CHECK(x.size(1) == n_in, "x has ", x.size(1), " inputs, the weight ", n_in);
}

// A float16 tensor's elements as the raw bits the kernels take (cpu_kernels.h).
const uint16_t* half_bits(const at::Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); }

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min,
                       int64_t group_size) {
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
                "packed: contiguous uint8 [n_out, n_in / 2] expected");
    const int64_t n_out = packed.size(0), n_in = packed.size(1) * 2;
    check_x(x, n_in);
    TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && n_in % group_size == 0, "group_size ", group_size,
                " must be a multiple of 32 that divides n_in ", n_in);
    for (const at::Tensor* t : {&scale, &min}) {
        TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == n_out &&
                        t->size(1) == n_in / group_size,
                    "scale, min: contiguous float16 [n_out, n_in / group_size] expected, got ", t->scalar_type(), " ",
                    t->sizes());
        check_same_device(x, *t, "scale/min");
    }
    check_same_device(x, packed, "packed");
    const DType dtype = dtype_of(x, "x");
    at::Tensor y = at::empty({x.size(0), n_out}, x.options());
    if (y.numel() == 0) return y;
    if (x.is_cpu()) {
        kernels::cpu::int4_linear(y.data_ptr(), x.data_ptr(), packed.data_ptr<uint8_t>(), half_bits(scale),
                                  half_bits(min), x.size(0), n_in, n_out, group_size, dtype);
    } else {
#ifdef WITH_CUDA
        const c10::cuda::CUDAGuard guard(x.device());
        check_cuda(kernels::cuda::int4_linear(y.data_ptr(), x.data_ptr(), packed.data_ptr<uint8_t>(), half_bits(scale),
                                              half_bits(min), x.size(0), n_in, n_out, group_size, dtype,
                                              at::cuda::getCurrentCUDAStream()),
                   "int4_linear");
#endif
    }
    return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
    TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(),
                "q: contiguous int8 [n_out, n_in] expected");
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
    if (x.is_cpu()) {
        kernels::cpu::int8_linear(y.data_ptr(), x.data_ptr(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), x.size(0),
                                  n_in, n_out, dtype);
    } else {
#ifdef WITH_CUDA
        const c10::cuda::CUDAGuard guard(x.device());
        check_cuda(kernels::cuda::int8_linear(y.data_ptr(), x.data_ptr(), q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                                              x.size(0), n_in, n_out, dtype, at::cuda::getCurrentCUDAStream()),
                   "int8_linear");
#endif
    }
    return y;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
                "w: contiguous bfloat16 [n_out, n_in] expected, got ", w.scalar_type(), " ", w.sizes());
    const int64_t n_out = w.size(0), n_in = w.size(1);
    check_x(x, n_in);
    check_same_device(x, w, "w");
    const DType dtype = dtype_of(x, "x");
    at::Tensor y = at::empty({x.size(0), n_out}, x.options());
    if (y.numel() == 0) return y;
    const auto* bits = static_cast<const uint16_t*>(w.data_ptr());  // bf16 as raw bits (cpu_kernels.h)
    if (x.is_cpu()) {
        kernels::cpu::bf16_linear(y.data_ptr(), x.data_ptr(), bits, x.size(0), n_in, n_out, dtype);
    } else {
#ifdef WITH_CUDA
        const c10::cuda::CUDAGuard guard(x.device());
        check_cuda(kernels::cuda::bf16_linear(y.data_ptr(), x.data_ptr(), bits, x.size(0), n_in, n_out, dtype,
                                              at::cuda::getCurrentCUDAStream()),
                   "bf16_linear");
#endif
    }
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
    if (gate_up.is_cpu()) {
        kernels::cpu::silu_mul(out.data_ptr(), gate_up.data_ptr(), rows, inter, dtype);
    } else {
#ifdef WITH_CUDA
        const c10::cuda::CUDAGuard guard(gate_up.device());
        check_cuda(kernels::cuda::silu_mul(out.data_ptr(), gate_up.data_ptr(), rows, inter, dtype,
                                           at::cuda::getCurrentCUDAStream()),
                   "silu_mul");
#endif
    }
    return out;
}

// --- a decoder layer's decode step in one call -------------------------------------------------
// What chapter 06's forward pass does for one layer of a step of decodes, as one call from Python:
// the same functions as above, in the same order, with no Python between them. On a GPU, CUDA
// graphs already take the per-call overhead away; on a CPU this is what does (a decode step of a
// small model is some 300 library calls, each tens of microseconds of Python where the C++ side
// spends one or two).

// A linear layer as the decode step multiplies by it: one of the library's matmuls, and for calls
// of more rows than `max_rows` torch's GEMM on `dense` (chapter 06's qmatmul.PerStepLinear); a
// plain weight with no kernel is `dense` alone.
struct Linear {
    enum class Kind { int4, int8, bf16, dense };
    Kind kind;
    std::vector<at::Tensor> weight;  // int4: packed, scale, min; int8: q, scale; bf16: w; dense: none
    int64_t group_size;              // int4's
    std::optional<at::Tensor> dense;
    int64_t max_rows;

    Linear(const std::string& kind_name, std::vector<at::Tensor> weight_, int64_t group_size_,
           std::optional<at::Tensor> dense_, int64_t max_rows_)
        : kind(kind_of(kind_name)),
          weight(std::move(weight_)),
          group_size(group_size_),
          dense(std::move(dense_)),
          max_rows(max_rows_) {
        const size_t tensors = kind == Kind::int4 ? 3 : kind == Kind::int8 ? 2 : kind == Kind::bf16 ? 1 : 0;
        TORCH_CHECK(weight.size() == tensors, "Linear: ", kind_name, " takes ", tensors, " weight tensors, got ",
                    weight.size());
        TORCH_CHECK(kind != Kind::dense || dense, "Linear: a dense layer needs its dense weight");
    }

    static constexpr const char* kKindNames[] = {"int4", "int8", "bf16", "dense"};  // in Kind's order

    static Kind kind_of(const std::string& name) {
        for (int k = 0; k < 4; ++k)
            if (name == kKindNames[k]) return static_cast<Kind>(k);
        TORCH_CHECK(false, "Linear: kind must be int4, int8, bf16 or dense, got ", name);
        return Kind::dense;  // not reached
    }

    at::Tensor operator()(const at::Tensor& x) const {  // x [rows, n_in] contiguous -> [rows, n_out]
        if (kind == Kind::dense || (dense && x.size(0) > max_rows)) return at::linear(x, *dense);
        if (kind == Kind::int4) return int4_linear(x, weight[0], weight[1], weight[2], group_size);
        if (kind == Kind::int8) return int8_linear(x, weight[0], weight[1]);
        return bf16_linear(x, weight[0]);
    }
};

struct DecoderLayer {
    Linear wqkv, wo, w_gate_up, w_down;  // [out, in] each: q, k, v stacked; o; gate, up stacked; down
    at::Tensor mlp_norm;
    int64_t n_heads, n_kv_heads, head_dim;
    double eps;

    // x: the residual stream [B, hidden], updated in place; h: rms_norm(x) * this layer's input norm.
    // -> rms_norm(x) * next_norm, x having taken this layer's attention and MLP outputs.
    at::Tensor decode(at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, const at::Tensor& next_norm, int64_t partition_size) const {
        const int64_t rows = h.size(0);
        at::Tensor qkv = wqkv(h).view({rows, n_heads + 2 * n_kv_heads, head_dim});
        rope_cache_(qkv, cos, sin, k_pool, v_pool, slots);
        const at::Tensor q = qkv.narrow(1, 0, n_heads);  // [B, n_heads, head_dim], token stride of qkv's
        const at::Tensor attn = paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens,
                                                       std::pow(double(head_dim), -0.5), partition_size);
        const at::Tensor h_mlp = add_rms_norm(x, wo(attn.view({rows, n_heads * head_dim})), mlp_norm, eps);
        return add_rms_norm(x, w_down(silu_mul(w_gate_up(h_mlp))), next_norm, eps);
    }
};

// --- which CPU path runs ---------------------------------------------------------------------

kernels::cpu::Isa isa_from(const std::string& name) {
    using kernels::cpu::Isa;
    for (auto i : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16})
        if (name == kernels::cpu::isa_name(i)) return i;
    TORCH_CHECK(false, "unknown CPU instruction set ", name, ": scalar, avx2, avx512 or avx512_bf16");
}

}  // namespace

// --- the same functions as operators of torch's dispatcher: torch.ops.llm_kernels.* -------------
// torch.compile, torch.export and CUDA graph capture cannot look inside a pybind11 function: to
// them it is an unknown Python call. Registered here with a schema, each kernel is one opaque
// operator they can place in a graph, with the output shapes of its fake implementation
// (kernels/fake.py). The schema says what an operator writes: Tensor(a!) is an argument updated
// in place (the residual stream of add_rms_norm, the q/k heads of rope_, the pools of rope_cache_).
TORCH_LIBRARY(llm_kernels, m) {
    m.def(
        "paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor context_lens, "
        "float scale, int partition_size) -> Tensor");
    m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
    m.def("rope_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
    m.def(
        "rope_cache_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_pool, Tensor(c!) v_pool, Tensor slots) "
        "-> ()");
    m.def("silu_mul(Tensor gate_up) -> Tensor");
    m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor min, int group_size) -> Tensor");
    m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
    m.def("bf16_linear(Tensor x, Tensor w) -> Tensor");
}

// One implementation per operator serves both devices (each function picks the CPU code or the
// CUDA launcher from its tensors), registered under each device's dispatch key.
static void impl_all(torch::Library& m) {
    m.impl("paged_decode_attention", &paged_decode_attention);
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("rope_", &rope_);
    m.impl("rope_cache_", &rope_cache_);
    m.impl("silu_mul", &silu_mul);
    m.impl("int4_linear", &int4_linear);
    m.impl("int8_linear", &int8_linear);
    m.impl("bf16_linear", &bf16_linear);
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) { impl_all(m); }
#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(llm_kernels, CUDA, m) { impl_all(m); }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "Paged decode attention, RMSNorm, RoPE and quantized linear layers: CPU (C++) and CUDA twins";
    m.def("paged_decode_attention", &paged_decode_attention,
          "flash-decoding over a paged KV cache -> [batch, n_heads, head_dim]", py::arg("q"), py::arg("k_pool"),
          py::arg("v_pool"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
          py::arg("partition_size") = 256);
    m.def("add_rms_norm", &add_rms_norm, "x += delta (in place, if given); -> rms_norm(x) * weight", py::arg("x"),
          py::arg("delta"), py::arg("weight"), py::arg("eps"));
    m.def("rope_", &rope_, "rotate q and k heads in place (rotate-half)", py::arg("qk"), py::arg("cos"),
          py::arg("sin"));
    m.def("rope_cache_", &rope_cache_,
          "rotate q heads in place, k heads into k_pool at slots; copy v heads into v_pool at slots", py::arg("qkv"),
          py::arg("cos"), py::arg("sin"), py::arg("k_pool"), py::arg("v_pool"), py::arg("slots"));
    m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up = [gate | up] -> [rows, inter]", py::arg("gate_up"));
    m.def("int4_linear", &int4_linear, "x @ W.T for group-wise int4 W", py::arg("x"), py::arg("packed"),
          py::arg("scale"), py::arg("min"), py::arg("group_size"));
    m.def("int8_linear", &int8_linear, "x @ W.T for per-row int8 W", py::arg("x"), py::arg("q"), py::arg("scale"));
    m.def("bf16_linear", &bf16_linear, "x @ W.T for bfloat16 W, at few rows of x", py::arg("x"), py::arg("w"));
    py::class_<Linear>(m, "Linear", "a linear layer for DecoderLayer: a kernel, torch's GEMM above max_rows")
        .def(py::init<const std::string&, std::vector<at::Tensor>, int64_t, std::optional<at::Tensor>, int64_t>(),
             py::arg("kind"), py::arg("weight"), py::arg("group_size") = 0, py::arg("dense") = py::none(),
             py::arg("max_rows") = INT64_MAX)
        .def("__call__", &Linear::operator(), py::arg("x"))
        .def_property_readonly("kind", [](const Linear& l) { return Linear::kKindNames[static_cast<int>(l.kind)]; });
    py::class_<DecoderLayer>(m, "DecoderLayer", "one decoder layer's weights, for decode steps in one call")
        .def(py::init<Linear, Linear, Linear, Linear, at::Tensor, int64_t, int64_t, int64_t, double>(), py::arg("wqkv"),
             py::arg("wo"), py::arg("w_gate_up"), py::arg("w_down"), py::arg("mlp_norm"), py::arg("n_heads"),
             py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("eps"))
        .def("decode", &DecoderLayer::decode, "the layer's decode step: x updated in place; -> rms_norm(x) * next_norm",
             py::arg("x"), py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("k_pool"), py::arg("v_pool"),
             py::arg("slots"), py::arg("block_tables"), py::arg("context_lens"), py::arg("next_norm"),
             py::arg("partition_size"));
    m.def(
        "head_dims", [] { return std::vector<int>(std::begin(kernels::kHeadDims), std::end(kernels::kHeadDims)); },
        "the head sizes paged_decode_attention serves (CPU and CUDA alike)");
    m.def("cpu_isa", [] { return std::string(kernels::cpu::isa_name(kernels::cpu::isa())); });
    m.def("best_cpu_isa", [] { return std::string(kernels::cpu::isa_name(kernels::cpu::best_isa())); });
    m.def("set_cpu_isa", [](const std::string& name) { kernels::cpu::set_isa(isa_from(name)); }, py::arg("name"));
    m.def(
        "set_batch_invariant", [](bool on) { kernels::cpu::set_batch_invariant(on); }, py::arg("on"),
        "CPU linear kernels: the same instructions for a row of x whatever the number of rows (process-wide)");
    m.def("batch_invariant", [] { return kernels::cpu::batch_invariant(); });
#ifdef WITH_CUDA
    m.attr("with_cuda") = true;
#else
    m.attr("with_cuda") = false;
#endif
}
