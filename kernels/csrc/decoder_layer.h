// A decoder layer's decode step in one call: what chapter 06's forward pass does for one layer of
// a step of decodes, the same operators (ops.h) in the same order, with no Python between them.
// On a GPU, CUDA graphs already take the per-call overhead away; on a CPU this is what does (a
// decode step of a small model is some 300 library calls, each tens of microseconds of Python
// where the C++ side spends one or two).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "shm_channel.h"

namespace kernels::ops {

// A linear layer as the decode step multiplies by it: one of the library's matmuls, or for a plain
// weight with no kernel (float32), torch's GEMM on `dense`.
struct Linear {
    enum class Kind { int4, int8, bf16, dense };
    Kind kind;
    std::vector<at::Tensor> weight;  // int4: packed, scale, min; int8: q, scale (each + tiles); bf16: w; dense: none
    int64_t group_size;              // int4's
    std::optional<at::Tensor> dense;  // dense's weight

    Linear(const std::string& kind_name, std::vector<at::Tensor> weight_, int64_t group_size_,
           std::optional<at::Tensor> dense_);

    static constexpr const char* kKindNames[] = {"int4", "int8", "bf16", "dense"};  // in Kind's order
    static Kind kind_of(const std::string& name);

    at::Tensor operator()(const at::Tensor& x) const;  // x [rows, n_in] contiguous -> [rows, n_out]
    // The same, and where its integer product runs (int4 or int8 with tiles, bf16 x on a CPU) that
    // product's team adds `lora`'s deltas into the output too, lora->y set then (else left null).
    at::Tensor operator()(const at::Tensor& x, cpu::LoraGroup* lora) const;
    int64_t n_out() const { return kind == Kind::dense ? dense->size(0) : weight[0].size(0); }
    bool has_tiles() const {
        return (kind == Kind::int4 && weight.size() == 4) || (kind == Kind::int8 && weight.size() == 3);
    }
};

// LoRA (chapter 09): one projection's tables in one layer, the slots' A [slots, r_max, n_in], B
// transposed [slots, r_max, n_out] and ranks [slots] (lora.py's LoraWeights; views, so a slot loaded
// later is seen here).
struct LoraProjection {
    at::Tensor a, b_t, ranks;
    LoraProjection(at::Tensor a_, at::Tensor b_t_, at::Tensor ranks_);  // checks them, once
};

// A layer's LoRA: per matmul its projections in the order of the matmul's outputs (q, k, v; o;
// gate, up; down), and the slots' scales.
struct LayerLora {
    std::vector<LoraProjection> qkv, o, gate_up, down;
    at::Tensor scale;  // float32 [slots]
    LayerLora(std::vector<LoraProjection> qkv_, std::vector<LoraProjection> o_, std::vector<LoraProjection> gate_up_,
              std::vector<LoraProjection> down_, at::Tensor scale_);
};

// A step's rows by adapter slot (lora.py's StepLora): segments of rows, each segment's slot (-1: the
// base model), and which of the seven projections (q, k, v, o, gate, up, down) an adapter of the step
// changes: the others are skipped, as the Python loop skips them.
struct StepLora {
    at::Tensor seg_starts, seg_slots;
    std::vector<bool> adapted;
    StepLora(at::Tensor seg_starts_, at::Tensor seg_slots_, std::vector<bool> adapted_);
};

// y [rows, the group's outputs side by side] += each row's delta for the projections of `group` the
// step adapts (step.adapted[first + j] for the j-th: `first` is the group's first projection of the
// seven, 0 for q; the segments and the scales checked here), as DecoderLayer.decode adds them after
// a fused matmul: on a CPU one team of threads for the group (cpu::lora_group).
void lora_group_(at::Tensor& y, const at::Tensor& x, const std::vector<LoraProjection>& group, const at::Tensor& scale,
                 const StepLora& step, int64_t first);

struct DecoderLayer {
    Linear wqkv, wo, w_gate_up, w_down;  // [out, in] each: q, k, v stacked; o; gate, up stacked; down
    at::Tensor mlp_norm;
    int64_t n_heads, n_kv_heads, head_dim;
    double eps;
    // Tensor parallelism: wo and w_down hold this rank's inputs, so their outputs are partial sums;
    // when set, all_reduce(partial) returns the whole sum (the caller's collective, e.g. Python's).
    // With `shm` too, a partial sum that fits its slots goes through it instead, without Python.
    std::function<at::Tensor(const at::Tensor&)> all_reduce;
    std::shared_ptr<ShmChannel> shm;

    // x: the residual stream [B, hidden], updated in place; h: rms_norm(x) * this layer's input norm.
    // -> rms_norm(x) * next_norm, x having taken this layer's attention and MLP outputs. With `lora`
    // and `step`, each matmul adds its projections' LoRA deltas right after it runs.
    at::Tensor decode(at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, const at::Tensor& next_norm, int64_t partition_size,
                      const LayerLora* lora = nullptr, const StepLora* step = nullptr) const;
};

}  // namespace kernels::ops
