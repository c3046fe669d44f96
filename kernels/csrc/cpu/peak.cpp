// The machine's float32 multiply-add peak, measured: what gemm.cpp's figures are a fraction of
// (bench/gemm.py). Each thread runs independent chains of FMAs on registers, enough of them to hide
// the instruction's latency on any core (latency 4-5 cycles, 2 issued per cycle: 10 chains), with
// no memory access in the loop, so their rate is the FMA units' and nothing else's.
#include <omp.h>

#include <chrono>

#include "cpu_kernels.h"
#include "vec.h"

KERNELS_VECTOR_CODE_BEGIN

namespace kernels::cpu {

namespace {

constexpr int kChains = 10;

// FMAs done by `steps` steps of kChains chains of S's vectors; the sum keeps them from being removed.
template <class S>
KERNELS_INLINE float fma_chains(int64_t steps) {
    typename S::V acc[kChains], a = S::set1(0.999f), b = S::set1(1e-3f);
    for (int c = 0; c < kChains; ++c) acc[c] = S::set1(float(c));
    for (int64_t i = 0; i < steps; ++i)
        for (int c = 0; c < kChains; ++c) acc[c] = S::fma(acc[c], a, b);
    float sum = 0.f;
    for (int c = 0; c < kChains; ++c) sum += S::reduce_add(acc[c]);
    return sum;
}

#ifdef KERNELS_X86
KERNELS_AVX2 __attribute__((flatten, noinline)) float fma_avx2(int64_t steps) { return fma_chains<Avx2>(steps); }
KERNELS_AVX512 __attribute__((flatten, noinline)) float fma_avx512(int64_t steps) { return fma_chains<Avx512>(steps); }
#endif
__attribute__((noinline)) float fma_scalar(int64_t steps) { return fma_chains<Scalar>(steps); }

}  // namespace

double fma_peak_gflops(int64_t steps) {
    const Isa level = isa();
    int lanes = 1;
    float (*run)(int64_t) = fma_scalar;
#ifdef KERNELS_X86
    if (level >= Isa::avx512) run = fma_avx512, lanes = 16;
    else if (level == Isa::avx2) run = fma_avx2, lanes = 8;
#endif
    (void)level;
    float total = 0.f;
    int threads = 1;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel
    {
#pragma omp single
        threads = omp_get_num_threads();
        const float s = run(steps);
#pragma omp atomic
        total += s;
    }
    volatile float sink = total;  // the chains' results used: the compiler must run them
    (void)sink;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return 2.0 * double(steps) * kChains * lanes * threads / seconds / 1e9;  // an FMA is 2 flops
}

}  // namespace kernels::cpu

KERNELS_VECTOR_CODE_END
