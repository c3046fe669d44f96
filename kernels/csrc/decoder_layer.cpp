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

at::Tensor DecoderLayer::decode(at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                const at::Tensor& next_norm, int64_t partition_size) const {
    const int64_t rows = h.size(0);
    at::Tensor qkv = wqkv(h).view({rows, n_heads + 2 * n_kv_heads, head_dim});
    rope_cache_(qkv, cos, sin, k_pool, v_pool, slots);
    const at::Tensor q = qkv.narrow(1, 0, n_heads);  // [B, n_heads, head_dim], token stride of qkv's
    const at::Tensor attn = paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens,
                                                   std::pow(double(head_dim), -0.5), partition_size);
    const at::Tensor h_mlp = add_rms_norm(x, wo(attn.view({rows, n_heads * head_dim})), mlp_norm, eps);
    return add_rms_norm(x, w_down(silu_mul(w_gate_up(h_mlp))), next_norm, eps);
}

}  // namespace kernels::ops
