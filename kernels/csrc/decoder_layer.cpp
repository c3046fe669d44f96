#include "decoder_layer.h"

#include <array>
#include <cmath>
#include <utility>

#include "dispatch.h"
#include "ops.h"

namespace kernels::ops {

Linear::Linear(const std::string& kind_name, std::vector<at::Tensor> weight_, int64_t group_size_,
               std::optional<at::Tensor> dense_)
    : kind(kind_of(kind_name)), weight(std::move(weight_)), group_size(group_size_), dense(std::move(dense_)) {
    const size_t tensors = kind == Kind::int4 ? 3 : kind == Kind::int8 ? 2 : kind == Kind::bf16 ? 1 : 0;
    // int4: packed, scale, min, and its tiles; int8: q, scale, and its tiles
    const bool with_tiles = (kind == Kind::int4 || kind == Kind::int8) && weight.size() == tensors + 1;
    TORCH_CHECK(weight.size() == tensors || with_tiles, "Linear: ", kind_name, " takes ", tensors,
                kind == Kind::int4   ? " weight tensors (or 4: with its tiles), got "
                : kind == Kind::int8 ? " weight tensors (or 3: with its tiles), got "
                                     : " weight tensors, got ",
                weight.size());
    TORCH_CHECK(kind != Kind::dense || dense, "Linear: a dense layer needs its dense weight");
}

Linear::Kind Linear::kind_of(const std::string& name) {
    for (int k = 0; k < 4; ++k)
        if (name == kKindNames[k]) return static_cast<Kind>(k);
    TORCH_CHECK(false, "Linear: kind must be int4, int8, bf16 or dense, got ", name);
}

at::Tensor Linear::operator()(const at::Tensor& x) const { return (*this)(x, nullptr); }

at::Tensor Linear::operator()(const at::Tensor& x, cpu::LoraGroup* lora) const {
    if (kind == Kind::dense) return at::linear(x, *dense);
    if (kind == Kind::int4)
        return int4_linear_lora(x, weight[0], weight[1], weight[2], group_size,
                                weight.size() == 4 ? std::optional<at::Tensor>(weight[3]) : std::nullopt, lora);
    if (kind == Kind::int8)
        return int8_linear_lora(x, weight[0], weight[1],
                                weight.size() == 3 ? std::optional<at::Tensor>(weight[2]) : std::nullopt, lora);
    return bf16_linear(x, weight[0]);
}

// The LoRA tables are checked once, when built (a layer's once per engine, a step's once per step):
// the decode step then runs the kernels without checking them again, 14 calls a layer.
LoraProjection::LoraProjection(at::Tensor a_, at::Tensor b_t_, at::Tensor ranks_)
    : a(std::move(a_)), b_t(std::move(b_t_)), ranks(std::move(ranks_)) {
    check_lora_weights(a, a, "a", ranks);
    TORCH_CHECK(b_t.dim() == 3 && b_t.size(0) == a.size(0) && b_t.size(1) == a.size(1), "LoraProjection: a is ",
                a.sizes(), ", b_t ", b_t.sizes(), ": the same slots and r_max expected");
    check_lora_weights(a, b_t, "b_t", ranks);
}

LayerLora::LayerLora(std::vector<LoraProjection> qkv_, std::vector<LoraProjection> o_,
                     std::vector<LoraProjection> gate_up_, std::vector<LoraProjection> down_, at::Tensor scale_)
    : qkv(std::move(qkv_)), o(std::move(o_)), gate_up(std::move(gate_up_)), down(std::move(down_)),
      scale(std::move(scale_)) {
    TORCH_CHECK(qkv.size() == 3 && o.size() == 1 && gate_up.size() == 2 && down.size() == 1,
                "LayerLora: 3 (q, k, v), 1 (o), 2 (gate, up) and 1 (down) projections expected, got ", qkv.size(),
                ", ", o.size(), ", ", gate_up.size(), ", ", down.size());
    for (const auto* group : {&qkv, &o, &gate_up, &down})
        for (const LoraProjection& p : *group) {
            TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == p.a.size(0) &&
                            scale.is_contiguous(),
                        "LayerLora: scale must be contiguous float32 [slots] (", p.a.size(0), " slots), got ",
                        scale.scalar_type(), " ", scale.sizes());
            check_same_device(p.a, scale, "scale");
        }
}

StepLora::StepLora(at::Tensor seg_starts_, at::Tensor seg_slots_, std::vector<bool> adapted_)
    : seg_starts(std::move(seg_starts_)), seg_slots(std::move(seg_slots_)), adapted(std::move(adapted_)) {
    check_lora_segments(seg_starts, seg_starts, seg_slots, -1, -1);
    TORCH_CHECK(adapted.size() == 7, "StepLora: adapted has one flag per projection (7), got ", adapted.size());
}

namespace {

// A group's LoRA tables against its matmul, x [rows, n_in] -> [rows, n_out]: checked once a call.
void check_group_fits(const at::Tensor& x, int64_t n_out, const std::vector<LoraProjection>& group) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "DecoderLayer.decode: a LoRA delta needs contiguous rows of x");
    TORCH_CHECK(group.size() <= 7, "DecoderLayer.decode: a matmul holds at most 7 projections, got ", group.size());
    int64_t col = 0;
    for (const LoraProjection& p : group) {
        const int64_t n_part = p.b_t.size(2);
        TORCH_CHECK(p.a.size(2) == x.size(1) && col + n_part <= n_out, "DecoderLayer.decode: LoRA tables for ",
                    p.a.size(2), " inputs and ", n_part, " outputs do not fit a ", x.size(1), " -> ", n_out,
                    " matmul");
        TORCH_CHECK(p.a.size(1) == group[0].a.size(1) && p.a.scalar_type() == group[0].a.scalar_type(),
                    "DecoderLayer.decode: a group's LoRA tables share r_max and dtype");
        col += n_part;
    }
}

// The deltas of the group's projections that the step adapts (the first of the group being
// projection `first` of the seven), as the CPU kernels take them: parts in `parts`, each with its
// share of v (float32 scratch between shrink and expand, grown here); n_parts 0 where the step
// adapts none. y is the caller's to set: the matmul's output, which may not exist yet.
cpu::LoraGroup cpu_lora_group(const at::Tensor& x, const std::vector<LoraProjection>& group, size_t first,
                              const at::Tensor& scale, const StepLora& step, at::Tensor& v,
                              std::array<cpu::LoraPart, 7>& parts) {
    int n_parts = 0;
    int64_t col = 0;
    for (size_t j = 0; j < group.size(); ++j) {
        const LoraProjection& p = group[j];
        if (step.adapted[first + j])
            parts[n_parts++] = {p.a.data_ptr(), p.b_t.data_ptr(), p.ranks.data_ptr<int32_t>(), nullptr, col,
                                static_cast<int>(p.b_t.size(2))};
        col += p.b_t.size(2);
    }
    const int64_t rows = x.size(0), r_max = group[0].a.size(1);
    if (n_parts > 0 && (!v.defined() || v.numel() < int64_t(group.size()) * rows * r_max))
        v = at::empty({int64_t(group.size()), rows, r_max}, x.options().dtype(at::kFloat));
    for (int j = 0; j < n_parts; ++j) parts[j].v = v.data_ptr<float>() + j * rows * r_max;
    return {nullptr, 0, x.data_ptr(), x.stride(0), parts.data(), n_parts, scale.data_ptr<float>(),
            step.seg_starts.data_ptr<int32_t>(), step.seg_slots.data_ptr<int32_t>(), int(rows),
            int(step.seg_slots.size(0)), int(scale.size(0)), int(x.size(1)), int(r_max), dtype_of(x, "x"),
            lora_weight_dtype(group[0].a)};
}

// g's deltas added into y by a team of their own (cpu::lora_group).
void run_lora_group(cpu::LoraGroup g, at::Tensor& y) {
    cpu::lora_group(y.data_ptr(), y.stride(0), g.x, g.x_stride, g.parts, g.n_parts, g.scale, g.seg_starts, g.seg_slots,
                    g.rows, g.n_seg, g.n_slots, g.n_in, g.r_max, g.dtype, g.w_dtype);
}

// y [rows, the group's outputs side by side] += each row's delta for the group's projections, after
// the matmul, through the library's shrink and expand. On a CPU the group's projections run as one
// team of threads (cpu::lora_group: a decode row's delta is too little work to pay for a team per
// call); on a GPU as a shrink and an expand per projection.
void add_lora_(at::Tensor& y, const at::Tensor& x, const std::vector<LoraProjection>& group, size_t first,
               const at::Tensor& scale, const StepLora& step, at::Tensor& v) {
    TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1, "DecoderLayer.decode: a LoRA delta needs contiguous rows of y");
    check_group_fits(x, y.size(1), group);
    if (x.is_cpu()) {
        std::array<cpu::LoraPart, 7> parts;  // no allocation on the decode path
        run_lora_group(cpu_lora_group(x, group, first, scale, step, v, parts), y);
        return;
    }
    int64_t col = 0;
    for (size_t j = 0; j < group.size(); ++j) {
        const LoraProjection& p = group[j];
        if (step.adapted[first + j]) {
            if (!v.defined() || v.size(1) != p.a.size(1))
                v = at::empty({x.size(0), p.a.size(1)}, x.options().dtype(at::kFloat));
            run_lora_shrink(v, x, p.a, p.ranks, step.seg_starts, step.seg_slots);
            run_lora_expand(y, col, v, p.b_t, p.ranks, scale, step.seg_starts, step.seg_slots);
        }
        col += p.b_t.size(2);
    }
}

// The group's tables for the step's adapters, asked into the caches just before the group's matmul,
// so that they arrive while it streams its weight: a decode row's tables are a few short runs per
// projection, which the shrink and expand would otherwise wait on piece by piece (at batch 1 on a
// Zen 5 they read them at a quarter of the rate the matmul reads its weight). Only where they are
// few: the tables of many adapters' rows would push the matmul's weight out of the caches instead.
void prefetch_lora(const std::vector<LoraProjection>& group, size_t first, const StepLora& step) {
    constexpr int64_t kMaxBytes = int64_t(256) << 10;
    const int32_t* slots = step.seg_slots.data_ptr<int32_t>();
    const int64_t n_seg = step.seg_slots.size(0);
    auto each_table = [&](auto visit) {  // visit(first byte, bytes) for every adapted row's A and B
        for (size_t j = 0; j < group.size(); ++j) {
            if (!step.adapted[first + j]) continue;
            const LoraProjection& p = group[j];
            const int64_t size = p.a.element_size(), r_max = p.a.size(1), n_in = p.a.size(2), n_out = p.b_t.size(2);
            for (int64_t s = 0; s < n_seg; ++s) {
                if (slots[s] < 0) continue;
                const int64_t rank = p.ranks.data_ptr<int32_t>()[slots[s]];
                visit(static_cast<const char*>(p.a.data_ptr()) + slots[s] * r_max * n_in * size, rank * n_in * size);
                visit(static_cast<const char*>(p.b_t.data_ptr()) + slots[s] * r_max * n_out * size, rank * n_out * size);
            }
        }
    };
    int64_t bytes = 0;
    each_table([&](const char*, int64_t n) { bytes += n; });
    if (bytes > kMaxBytes) return;
    each_table([](const char* at, int64_t n) {
        for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(at + b);
    });
}

}  // namespace

void lora_group_(at::Tensor& y, const at::Tensor& x, const std::vector<LoraProjection>& group, const at::Tensor& scale,
                 const StepLora& step, int64_t first) {
    TORCH_CHECK(!group.empty() && first >= 0 && first + int64_t(group.size()) <= 7,
                "lora_group_: projections first .. first + len(group) - 1 of the seven expected, got first ", first,
                " and ", group.size(), " projections");
    TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.scalar_type() == y.scalar_type(),
                "lora_group_: x [rows, n_in] and y [rows, n_out] of one dtype expected, got ", x.sizes(), " ",
                x.scalar_type(), " and ", y.sizes(), " ", y.scalar_type());
    dtype_of(x, "x");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous() &&
                    scale.size(0) == group[0].a.size(0),
                "lora_group_: scale must be contiguous float32 [slots] (", group[0].a.size(0), " slots)");
    check_lora_segments(y, step.seg_starts, step.seg_slots, y.size(0), scale.size(0));
    at::Tensor v;
    add_lora_(y, x, group, size_t(first), scale, step, v);
}

at::Tensor DecoderLayer::decode(at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                const at::Tensor& next_norm, int64_t partition_size, const LayerLora* lora,
                                const StepLora* step) const {
    TORCH_CHECK((lora == nullptr) == (step == nullptr), "DecoderLayer.decode: lora and step come together");
    const int64_t rows = h.size(0);
    if (lora != nullptr) {
        check_same_device(h, lora->scale, "the LoRA tables");
        check_same_device(h, step->seg_starts, "the step's LoRA segments");
        if (h.is_cpu()) check_lora_segments(h, step->seg_starts, step->seg_slots, rows, lora->scale.size(0));
    }
    at::Tensor v;  // the LoRA shrink's output, one for the layer's 7 projections
    // matmul, then (with adapters) its LoRA deltas for the rows that use one: on a CPU, by the
    // matmul's own team where its integer product runs (cpu::q8::run), else by a team of their own,
    // their tables asked for before the matmul so that they arrive while it streams its weight
    auto linear = [&](const Linear& w, const at::Tensor& in, const std::vector<LoraProjection>* group, size_t first) {
        if (lora == nullptr) return w(in);
        if (!in.is_cpu()) {
            at::Tensor out = w(in);
            add_lora_(out, in, *group, first, lora->scale, *step, v);
            return out;
        }
        check_group_fits(in, w.n_out(), *group);
        std::array<cpu::LoraPart, 7> parts;
        cpu::LoraGroup deltas = cpu_lora_group(in, *group, first, lora->scale, *step, v, parts);
        if (deltas.n_parts == 0) return w(in);
        if (!w.has_tiles()) prefetch_lora(*group, first, *step);
        at::Tensor out = w(in, &deltas);
        if (deltas.y == nullptr) run_lora_group(deltas, out);  // the matmul's team did not add them
        return out;
    };
    at::Tensor qkv = linear(wqkv, h, lora ? &lora->qkv : nullptr, 0).view({rows, n_heads + 2 * n_kv_heads, head_dim});
    rope_cache_(qkv, cos, sin, k_pool, v_pool, slots);
    const at::Tensor q = qkv.narrow(1, 0, n_heads);  // [B, n_heads, head_dim], token stride of qkv's
    const at::Tensor attn = paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens,
                                                   std::pow(double(head_dim), -0.5), partition_size);
    // a row-parallel matmul's partial sum (its LoRA delta's too), then the sum over the ranks
    auto whole = [&](at::Tensor partial) {
        if (shm && shm->fits(partial)) return shm->all_reduce(partial);
        return all_reduce ? all_reduce(partial) : partial;
    };
    const at::Tensor o = whole(linear(wo, attn.view({rows, n_heads * head_dim}), lora ? &lora->o : nullptr, 3));
    const at::Tensor h_mlp = add_rms_norm(x, o, mlp_norm, eps);
    const at::Tensor act = silu_mul(linear(w_gate_up, h_mlp, lora ? &lora->gate_up : nullptr, 4));
    return add_rms_norm(x, whole(linear(w_down, act, lora ? &lora->down : nullptr, 6)), next_norm, eps);
}

}  // namespace kernels::ops
