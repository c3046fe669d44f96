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

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

// bf16 pairs in the matrix product by default on AMD's cores only. A vdpbf16ps does twice an FMA's
// multiply-adds, but what a core issues of each decides: Zen 4 and 5 run a 512-bit FMA as two
// 256-bit halves and vdpbf16ps at the same rate, so pairs double the rate (the 2-core EPYC: 1.5-1.9x
// its float product, bench/results/LOG.md); Intel's cores with AVX512-BF16 (Sapphire Rapids on)
// issue two 512-bit FMAs a cycle, and on the Xeon this repo measures on the float product ran
// 1.4x the pairs' (bench/gemm.py, chapter 06's README).
namespace {
std::atomic<int> pairs{-1};

// Asked once: gemm_bf16_pairs runs on every call of the product.
bool pairs_by_default() {
#if defined(__x86_64__) || defined(_M_X64)
    static const bool amd = [] {
        __builtin_cpu_init();
        return bool(__builtin_cpu_is("amd"));
    }();
    return amd;
#else
    return false;
#endif
}
}  // namespace

void set_gemm_bf16_pairs(int mode) { pairs.store(mode < 0 ? -1 : mode > 0, std::memory_order_relaxed); }

bool gemm_bf16_pairs() {
    const int mode = pairs.load(std::memory_order_relaxed);
    return isa() == Isa::avx512_bf16 && (mode < 0 ? pairs_by_default() : mode == 1);
}

// AMX-INT8 in the integer products (q8_tiles.h). The tiles are an extension the OS enables per
// process: Linux (5.16 on) leaves a thread's tile data out of its saved state until the process
// asks for it (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), and a tile instruction before that
// is SIGILL. So the CPU's flags (CPUID leaf 7: AMX-TILE, AMX-INT8) and the OS's leave, asked once.
namespace {
std::atomic<int> amx_mode{-1};

bool amx_int8_by_cpu_and_os() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = edx >> 24 & 1, int8 = edx >> 25 & 1;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // <asm/prctl.h>, the kernel's xfeature number
    return tile && int8 && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
    return false;
#endif
}
}  // namespace

bool amx_int8_supported() {
    static const bool supported = amx_int8_by_cpu_and_os();
    return supported;
}

void set_amx(int mode) {
    if (mode > 0 && !amx_int8_supported())
        throw std::invalid_argument("this CPU has no AMX-INT8 tiles (or the OS does not grant them)");
    amx_mode.store(mode < 0 ? -1 : mode > 0, std::memory_order_relaxed);
}

bool amx_allowed() { return amx_mode.load(std::memory_order_relaxed) != 0; }

bool q8_amx() { return amx_allowed() && isa() == Isa::avx512_bf16 && amx_int8_supported(); }

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
