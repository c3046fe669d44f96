// The library's Python faces, and nothing else: its operators (ops.h) registered with torch's
// dispatcher as torch.ops.llm_kernels.*, and the pybind11 module kernels.load() returns, with the
// same functions, the decoder layer (decoder_layer.h) and the CPU switches.
//
// torch's pybind11 casters rather than <torch/extension.h>, which also brings the whole C++
// frontend (modules, optimizers, data loaders): this file then compiles in about two thirds of
// the time, in every first build and in `make kernels-check`.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/functional.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <iterator>
#include <memory>
#include <thread>
#include <optional>
#include <string>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "decoder_layer.h"
#include "kernels.h"
#include "ops.h"
#include "shm_channel.h"

namespace ops = kernels::ops;
using kernels::ops::DecoderLayer;
using kernels::ops::LayerLora;
using kernels::ops::LoraProjection;
using kernels::ops::StepLora;
using kernels::ops::Linear;
using kernels::ops::ShmChannel;

namespace {

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
    m.def(
        "chunk_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor query_start, "
        "Tensor query_lens, Tensor context_lens, float scale) -> Tensor");
    m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
    m.def("rope_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
    m.def(
        "rope_cache_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_pool, Tensor(c!) v_pool, Tensor slots) "
        "-> ()");
    m.def("silu_mul(Tensor gate_up) -> Tensor");
    m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor min, int group_size, Tensor? tiles=None) -> Tensor");
    m.def("int4_tiles(Tensor packed, Tensor scale, Tensor min, int group_size) -> Tensor");
    m.def("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor? tiles=None) -> Tensor");
    m.def("int8_tiles(Tensor q) -> Tensor");
    m.def("bf16_linear(Tensor x, Tensor w) -> Tensor");
}

// One implementation per operator serves both devices (each function picks the CPU code or the
// CUDA launcher from its tensors), registered under each device's dispatch key.
static void impl_all(torch::Library& m) {
    m.impl("paged_decode_attention", &ops::paged_decode_attention);
    m.impl("chunk_attention", &ops::chunk_attention);
    m.impl("add_rms_norm", &ops::add_rms_norm);
    m.impl("rope_", &ops::rope_);
    m.impl("rope_cache_", &ops::rope_cache_);
    m.impl("silu_mul", &ops::silu_mul);
    m.impl("int4_linear", &ops::int4_linear);
    m.impl("int4_tiles", &ops::int4_tiles);
    m.impl("int8_linear", &ops::int8_linear);
    m.impl("int8_tiles", &ops::int8_tiles);
    m.impl("bf16_linear", &ops::bf16_linear);
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) { impl_all(m); }
#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(llm_kernels, CUDA, m) { impl_all(m); }
#endif

// --- LoRA (shrink, expand): a block of its own, registered beside the others ---------------------
TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
    m.def("lora_shrink(Tensor x, Tensor a, Tensor ranks, Tensor seg_starts, Tensor seg_slots) -> Tensor");
    m.def(
        "lora_expand_(Tensor(a!) y, Tensor v, Tensor b_t, Tensor ranks, Tensor scale, Tensor seg_starts, "
        "Tensor seg_slots) -> ()");
}

static void impl_lora(torch::Library& m) {
    m.impl("lora_shrink", &ops::lora_shrink);
    m.impl("lora_expand_", &ops::lora_expand_);
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) { impl_lora(m); }
#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(llm_kernels, CUDA, m) { impl_lora(m); }
#endif

static void bind_lora(py::module_& m) {
    m.def("lora_shrink", &ops::lora_shrink,
          "LoRA shrink over segments of rows: v[row] = A[slot] @ x[row] -> float32 [rows, r_max]", py::arg("x"),
          py::arg("a"), py::arg("ranks"), py::arg("seg_starts"), py::arg("seg_slots"));
    m.def("lora_expand_", &ops::lora_expand_,
          "LoRA expand over segments of rows, in place: y[row] += scale[slot] * B[slot] @ v[row]", py::arg("y"),
          py::arg("v"), py::arg("b_t"), py::arg("ranks"), py::arg("scale"), py::arg("seg_starts"),
          py::arg("seg_slots"));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "Paged decode attention, RMSNorm, RoPE and quantized linear layers: CPU (C++) and CUDA twins";
    m.def("paged_decode_attention", &ops::paged_decode_attention,
          "flash-decoding over a paged KV cache -> [batch, n_heads, head_dim]", py::arg("q"), py::arg("k_pool"),
          py::arg("v_pool"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
          py::arg("partition_size") = 256);
    m.def("chunk_attention", &ops::chunk_attention,
          "causal attention of prompt chunks over a paged KV cache -> [tokens, n_heads, head_dim]", py::arg("q"),
          py::arg("k_pool"), py::arg("v_pool"), py::arg("block_tables"), py::arg("query_start"), py::arg("query_lens"),
          py::arg("context_lens"), py::arg("scale"));
    m.def("add_rms_norm", &ops::add_rms_norm, "x += delta (in place, if given); -> rms_norm(x) * weight", py::arg("x"),
          py::arg("delta"), py::arg("weight"), py::arg("eps"));
    m.def("rope_", &ops::rope_, "rotate q and k heads in place (rotate-half)", py::arg("qk"), py::arg("cos"),
          py::arg("sin"));
    m.def("rope_cache_", &ops::rope_cache_,
          "rotate q heads in place, k heads into k_pool at slots; copy v heads into v_pool at slots", py::arg("qkv"),
          py::arg("cos"), py::arg("sin"), py::arg("k_pool"), py::arg("v_pool"), py::arg("slots"));
    m.def("silu_mul", &ops::silu_mul, "silu(gate) * up for gate_up = [gate | up] -> [rows, inter]", py::arg("gate_up"));
    m.def("int4_linear", &ops::int4_linear, "x @ W.T for group-wise int4 W (bf16 x of many rows in integers with tiles)",
          py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("min"), py::arg("group_size"),
          py::arg("tiles") = py::none());
    m.def("int4_tiles", &ops::int4_tiles,
          "an int4 weight laid out for the CPU's integer product (int4_linear's tiles); empty where it has none",
          py::arg("packed"), py::arg("scale"), py::arg("min"), py::arg("group_size"));
    m.def("int8_linear", &ops::int8_linear, "x @ W.T for per-row int8 W (bf16 x in integers with tiles)", py::arg("x"),
          py::arg("q"), py::arg("scale"), py::arg("tiles") = py::none());
    m.def("int8_tiles", &ops::int8_tiles,
          "an int8 weight laid out for the CPU's integer product (int8_linear's tiles); empty where it has none",
          py::arg("q"));
    m.def("bf16_linear", &ops::bf16_linear, "x @ W.T for bfloat16 W", py::arg("x"), py::arg("w"));
    py::class_<Linear>(m, "Linear", "a linear layer for DecoderLayer: a kernel, or torch's GEMM on a dense weight")
        .def(py::init<const std::string&, std::vector<at::Tensor>, int64_t, std::optional<at::Tensor>>(),
             py::arg("kind"), py::arg("weight"), py::arg("group_size") = 0, py::arg("dense") = py::none())
        .def("__call__", py::overload_cast<const at::Tensor&>(&Linear::operator(), py::const_), py::arg("x"))
        .def_property_readonly("kind", [](const Linear& l) { return Linear::kKindNames[static_cast<int>(l.kind)]; });
    py::class_<DecoderLayer>(m, "DecoderLayer", "one decoder layer's weights, for decode steps in one call")
        .def(py::init<Linear, Linear, Linear, Linear, at::Tensor, int64_t, int64_t, int64_t, double>(), py::arg("wqkv"),
             py::arg("wo"), py::arg("w_gate_up"), py::arg("w_down"), py::arg("mlp_norm"), py::arg("n_heads"),
             py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("eps"))
        .def("decode", &DecoderLayer::decode, "the layer's decode step: x updated in place; -> rms_norm(x) * next_norm",
             py::arg("x"), py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("k_pool"), py::arg("v_pool"),
             py::arg("slots"), py::arg("block_tables"), py::arg("context_lens"), py::arg("next_norm"),
             py::arg("partition_size"), py::arg("lora") = py::none(), py::arg("step") = py::none())
        .def_readwrite("all_reduce", &DecoderLayer::all_reduce,
                       "tensor parallelism: o_proj's and down_proj's partial sums -> their sums (None: one rank)")
        .def_readwrite("shm", &DecoderLayer::shm,
                       "tensor parallelism: a ShmChannel that sums the partial sums it fits, before all_reduce");
    py::class_<ShmChannel, std::shared_ptr<ShmChannel>>(
        m, "ShmChannel", "the all-reduce and the gather of CPU ranks of one host through a shared file (shm_channel.h)")
        .def(py::init([](at::Tensor file, int64_t rank, int64_t world, int64_t slot_bytes, double timeout_s,
                         std::function<void()> check) {
                 auto channel = std::make_shared<ShmChannel>(std::move(file), rank, world, slot_bytes, timeout_s);
                 channel->check = std::move(check);
                 // a long wait holds the GIL no longer than a moment: the server's other threads go on
                 channel->pause = [] {
                     py::gil_scoped_release released;
                     std::this_thread::sleep_for(std::chrono::microseconds(100));
                 };
                 return channel;
             }),
             py::arg("file"), py::arg("rank"), py::arg("world"), py::arg("slot_bytes"), py::arg("timeout_s"),
             py::arg("check") = py::none())
        .def("fits", &ShmChannel::fits, py::arg("t"))
        .def("all_reduce", &ShmChannel::all_reduce, "t summed over the ranks, in place; -> t", py::arg("t"))
        .def("gather_last_dim", &ShmChannel::gather_last_dim,
             "[..., cols] -> on rank 0 [..., world * cols], the ranks' parts in rank order; t elsewhere", py::arg("t"));
    py::class_<LoraProjection>(m, "LoraProjection", "one projection's LoRA tables in one layer: a, b_t, ranks")
        .def(py::init<at::Tensor, at::Tensor, at::Tensor>(), py::arg("a"), py::arg("b_t"), py::arg("ranks"));
    py::class_<LayerLora>(m, "LayerLora", "a layer's LoRA tables per matmul (q, k, v; o; gate, up; down), scales")
        .def(py::init<std::vector<LoraProjection>, std::vector<LoraProjection>, std::vector<LoraProjection>,
                      std::vector<LoraProjection>, at::Tensor>(),
             py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("scale"));
    py::class_<StepLora>(m, "StepLora", "a step's rows by adapter slot, and which projections its adapters change")
        .def(py::init<at::Tensor, at::Tensor, std::vector<bool>>(), py::arg("seg_starts"), py::arg("seg_slots"),
             py::arg("adapted"));
    m.def("lora_group_", &ops::lora_group_,
          "a fused matmul's LoRA deltas in place, as the one-call layer adds them (step.adapted's flags from "
          "`first`, the group's first projection of the seven: 0 q, 3 o, 4 gate, 6 down)",
          py::arg("y"), py::arg("x"), py::arg("group"), py::arg("scale"), py::arg("step"), py::arg("first") = 0);
    m.def(
        "head_dims", [] { return std::vector<int>(std::begin(kernels::kHeadDims), std::end(kernels::kHeadDims)); },
        "the head sizes paged_decode_attention serves (CPU and CUDA alike)");
    m.def("cpu_isa", [] { return std::string(kernels::cpu::isa_name(kernels::cpu::isa())); });
    m.def(
        "cpu_gemm",
        [] {
            std::string name = kernels::cpu::gemm_name();
            if (kernels::ops::cpu_gemm_amx())
                name += "; bf16 weights from " + std::to_string(kernels::ops::kAmxMinRows) + " rows: amx (oneDNN)";
            return name;
        },
        "what the CPU linear kernels run for many rows of x (gemm.cpp, or AMX), at this ISA and batch-invariance");
    m.def("cpu_fma_peak_gflops", &kernels::cpu::fma_peak_gflops, py::arg("steps") = 20'000'000,
          "the float32 FMA peak of this CPU at the current ISA and thread count, measured (GFLOP/s)");
    m.attr("gemm_min_rows") = kernels::kGemmMinRows;  // the linears' matrix product from this many rows (CPU, CUDA)
    m.def("cpu_int8_product", [] {  // int4/int8 weights times int8-quantized x (cpu/int4_q8_gemm.cpp, int8_q8_gemm.cpp)
        const int width = kernels::cpu::q8_tile_width();
        std::string name = width == 16 ? "avx512-vnni" : width == 8 ? "avx2-vpmaddubsw" : "none";
        if (width == 16 && kernels::cpu::q8_amx())
            name += ", amx-int8 from " + std::to_string(kernels::cpu::kQ8AmxRows) + " rows";
        return name;
    });
    m.def("best_cpu_isa", [] { return std::string(kernels::cpu::isa_name(kernels::cpu::best_isa())); });
    m.def("set_cpu_isa", [](const std::string& name) { kernels::cpu::set_isa(isa_from(name)); }, py::arg("name"));
    m.def(
        "set_batch_invariant", [](bool on) { kernels::cpu::set_batch_invariant(on); }, py::arg("on"),
        "CPU linear kernels: the same instructions for a row of x whatever the number of rows (process-wide)");
    m.def("batch_invariant", [] { return kernels::cpu::batch_invariant(); });
    m.def(
        "set_cpu_gemm_pairs",
        [](std::optional<bool> on) { kernels::cpu::set_gemm_bf16_pairs(on ? int(*on) : -1); },
        py::arg("on") = py::none(),
        "AVX512-BF16: the matrix product multiplies bf16 x (and the chunk attention bf16 queries and keys) in "
        "bf16 pairs (True) or as floats (False); None: as this CPU's maker suggests (pairs on AMD)");
    m.def("cpu_gemm_pairs", [] { return kernels::cpu::gemm_bf16_pairs(); },
          "whether the matrix product (and the chunk attention) multiplies bf16 in bf16 pairs at the current ISA "
          "level");
    m.def(
        "set_cpu_gemm_amx", [](std::optional<bool> on) { kernels::ops::set_cpu_gemm_amx(on ? int(*on) : -1); },
        py::arg("on") = py::none(),
        "AMX tiles: bf16 weights times bf16 x from gemm_amx_min_rows rows to torch's GEMM (AMX-BF16), and the "
        "int4/int8 weights' integer products int8_amx_rows rows at a time on AMX-INT8 (True: each where it can, an "
        "error where neither can), the library's VNNI and float products (False), or None: AMX where the CPU and "
        "the OS have it");
    m.def("cpu_gemm_amx", &kernels::ops::cpu_gemm_amx,
          "whether bf16 weights times bf16 x go to AMX (torch's oneDNN) from gemm_amx_min_rows rows, now");
    m.def("cpu_int8_amx", &kernels::cpu::q8_amx,
          "whether the int4 and int8 weights' integer products run 16 rows of x at a time on AMX-INT8 tiles, now");
    m.def("cpu_has_amx_int8", &kernels::cpu::amx_int8_supported,
          "whether this CPU has AMX-INT8 tiles and the OS lets this process use them (at any ISA level)");
    m.attr("int8_amx_rows") = kernels::cpu::kQ8AmxRows;
    m.attr("gemm_amx_min_rows") = kernels::ops::kAmxMinRows;
#ifdef WITH_CUDA
    m.attr("with_cuda") = true;
#else
    m.attr("with_cuda") = false;
#endif
    bind_lora(m);
}
