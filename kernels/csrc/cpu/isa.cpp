// Which vector instructions the kernels use, decided at run time.
//
// The library is compiled once, for baseline x86-64, and must run on any such CPU; the AVX2 and
// AVX512 code paths are compiled in anyway (vec.h) and chosen here, from what the CPU reports.
// ATEN_CPU_CAPABILITY, torch's own switch (default | avx2 | avx512), caps the choice the same
// way it caps torch's kernels, so one variable makes a whole run scalar or AVX2 for comparison.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cpu_kernels.h"

namespace kernels::cpu {

namespace {

Isa cpu_isa() {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq"))
        return __builtin_cpu_supports("avx512bf16") ? Isa::avx512_bf16 : Isa::avx512;
    // f16c (float16 conversions) came with AVX on every CPU that has AVX2; checked for form's sake.
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return Isa::avx2;
#endif
    return Isa::scalar;
}

// "avx512" caps at AVX512 without the BF16 dot products: how an AVX512 CPU without them (Skylake-X,
// Ice Lake) runs the kernels, reproduced on one that has them.
Isa env_cap() {
    const char* env = std::getenv("ATEN_CPU_CAPABILITY");
    if (env == nullptr) return Isa::avx512_bf16;
    std::string s(env);
    if (s == "default") return Isa::scalar;
    if (s == "avx2") return Isa::avx2;
    if (s == "avx512") return Isa::avx512;
    return Isa::avx512_bf16;  // torch's finer avx512_* levels, or a value we do not know: no cap
}

// -1 until first asked: then best_isa(), or what a test set.
std::atomic<int> current{-1};

}  // namespace

Isa best_isa() {
    static const Isa best = Isa(std::min(int(cpu_isa()), int(env_cap())));
    return best;
}

Isa isa() {
    int v = current.load(std::memory_order_relaxed);
    if (v < 0) {
        v = int(best_isa());
        current.store(v, std::memory_order_relaxed);
    }
    return Isa(v);
}

void set_isa(Isa level) {
    if (int(level) < 0 || int(level) > int(Isa::avx512_bf16))
        throw std::invalid_argument("unknown instruction set level " + std::to_string(int(level)));
    if (int(level) > int(cpu_isa()))
        throw std::invalid_argument(std::string("this CPU does not support ") + isa_name(level));
    current.store(int(level), std::memory_order_relaxed);
}

namespace {
std::atomic<bool> invariant{false};
}  // namespace

void set_batch_invariant(bool on) { invariant.store(on, std::memory_order_relaxed); }
bool batch_invariant() { return invariant.load(std::memory_order_relaxed); }

const char* isa_name(Isa level) {
    switch (level) {
        case Isa::scalar: return "scalar";
        case Isa::avx2: return "avx2";
        case Isa::avx512: return "avx512";
        case Isa::avx512_bf16: return "avx512_bf16";
    }
    return "unknown";
}

}  // namespace kernels::cpu
