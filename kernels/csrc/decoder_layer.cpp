#include "decoder_layer.h"

#include <cmath>
#include <utility>

#include "ops.h"

namespace kernels::ops {

Linear::Linear(const std::string& kind_name, std::vector<at::Tensor> weight_, int64_t group_size_,
               std::optional<at::Tensor> dense_)
    : kind(kind_of(kind_name)), weight(std::move(weight_)), group_size(group_size_), dense(std::move(dense_)) {
    const size_t tensors = kind == Kind::int4 ? 3 : kind == Kind::int8 ? 2 : kind == Kind::bf16 ? 1 : 0;
    TORCH_CHECK(weight.size() == tensors, "Linear: ", kind_name, " takes ", tensors, " weight tensors, got ",
                weight.size());
    TORCH_CHECK(kind != Kind::dense || dense, "Linear: a dense layer needs its dense weight");
}

Linear::Kind Linear::kind_of(const std::string& name) {
    for (int k = 0; k < 4; ++k)
        if (name == kKindNames[k]) return static_cast<Kind>(k);
    TORCH_CHECK(false, "Linear: kind must be int4, int8, bf16 or dense, got ", name);
}

at::Tensor Linear::operator()(const at::Tensor& x) const {
    if (kind == Kind::dense) return at::linear(x, *dense);
    if (kind == Kind::int4) return int4_linear(x, weight[0], weight[1], weight[2], group_size);
    if (kind == Kind::int8) return int8_linear(x, weight[0], weight[1]);
    return bf16_linear(x, weight[0]);
}

namespace {

// y [rows, the group's outputs side by side] += each row's delta for the group's projections (the
// first of them being projection `first` of the seven), through the library's shrink and expand.
void add_lora_(at::Tensor& y, const at::Tensor& x, const std::vector<LoraProjection>& group, size_t first,
               const LayerLora& lora, const StepLora& step) {
    int64_t col = 0;
    for (size_t j = 0; j < group.size(); ++j) {
        const LoraProjection& p = group[j];
        const int64_t n_out = p.b_t.size(2);
        if (step.adapted.at(first + j)) {
            at::Tensor part = y.narrow(1, col, n_out);  // a view: the delta lands in y
            const at::Tensor v = lora_shrink(x, p.a, p.ranks, step.seg_starts, step.seg_slots);
            lora_expand_(part, v, p.b_t, p.ranks, lora.scale, step.seg_starts, step.seg_slots);
        }
        col += n_out;
    }
}

}  // namespace

at::Tensor DecoderLayer::decode(at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                const at::Tensor& next_norm, int64_t partition_size, const LayerLora* lora,
                                const StepLora* step) const {
    TORCH_CHECK((lora == nullptr) == (step == nullptr), "DecoderLayer.decode: lora and step come together");
    // matmul, then (with adapters) its LoRA deltas for the rows that use one
    auto linear = [&](const Linear& w, const at::Tensor& in, const std::vector<LoraProjection>* group, size_t first) {
        at::Tensor out = w(in);
        if (lora != nullptr) add_lora_(out, in, *group, first, *lora, *step);
        return out;
    };
    const int64_t rows = h.size(0);
    at::Tensor qkv = linear(wqkv, h, lora ? &lora->qkv : nullptr, 0).view({rows, n_heads + 2 * n_kv_heads, head_dim});
    rope_cache_(qkv, cos, sin, k_pool, v_pool, slots);
    const at::Tensor q = qkv.narrow(1, 0, n_heads);  // [B, n_heads, head_dim], token stride of qkv's
    const at::Tensor attn = paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens,
                                                   std::pow(double(head_dim), -0.5), partition_size);
    // a row-parallel matmul's partial sum (its LoRA delta's too), then the sum over the ranks
    auto whole = [&](at::Tensor partial) { return all_reduce ? all_reduce(partial) : partial; };
    const at::Tensor o = whole(linear(wo, attn.view({rows, n_heads * head_dim}), lora ? &lora->o : nullptr, 3));
    const at::Tensor h_mlp = add_rms_norm(x, o, mlp_norm, eps);
    const at::Tensor act = silu_mul(linear(w_gate_up, h_mlp, lora ? &lora->gate_up : nullptr, 4));
    return add_rms_norm(x, whole(linear(w_down, act, lora ? &lora->down : nullptr, 6)), next_norm, eps);
}

}  // namespace kernels::ops
