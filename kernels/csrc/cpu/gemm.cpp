// Linear layers for many rows of x: y = x @ W.T as a matrix product, for prompt chunks, batched
// decode steps and the verify rows of speculative decoding.
//
// quant_linear.cpp's kernels are matrix-vector products: they turn each weight into a number in
// registers, as the bytes stream in, and use it for the few rows of x in the call. With many rows
// that turning (widening, masking, converting, scaling) is repeated for every few rows, and the
// product, not the memory, sets the time. Here each weight is turned into a number once per call:
//   1. a panel: kPanel consecutive weight rows (outputs), dequantized or widened into a small
//      thread-local buffer, [kPanel][K] floats (or bf16 pairs, below), which stays in L1/L2;
//   2. tiles: MR rows of x times NO rows of the panel, MR * NO accumulators in registers, each a
//      vector along the inputs; per step, MR vectors of x and NO of the panel feed MR * NO FMAs,
//      so loads stay under the FMAs the core can issue (AVX2: 3 x 4 tiles, 12 FMAs per 7 loads;
//      AVX512: 4 x 4, 16 per 8); a tile's sums are reduced once, at its end;
//   3. threads take panels (OpenMP over output rows), so no two write one output.
// An inner-product tile (vectors along the inputs) and not the outer product of a BLAS (vectors
// along the outputs): the panel is then each weight row as it is stored, dequantized in order,
// where an outer product would need the codes of kPanel rows transposed, or repacked at load time
// beside the layout the matrix-vector kernels read.
//
// int4 keeps quant_linear.cpp's deinterleaved order: a byte holds inputs 2j and 2j + 1, so a
// vector of W bytes dequantizes to W even inputs and W odd ones, and x is deinterleaved to match,
// once per call (the dot product does not care in which order it meets its terms).
//
// AVX512-BF16 with bf16 x: the panel holds bf16 weights, and vdpbf16ps multiplies 32 pairs of
// them with 32 of x per instruction (half the instructions of float FMAs, products exact); a
// dequantized int4 weight is then rounded to bf16 as a dense bf16 copy of W would be.
//
// Every row count takes the same instructions per row here, in a tile of 1..MR rows, but a row's
// sums are in another order than the matrix-vector kernels', so batch-invariant mode stays with
// those (quant_linear.cpp decides; cpu_kernels.h says when this runs).
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "vec.h"

KERNELS_VECTOR_CODE_BEGIN

namespace kernels::cpu {

namespace {

constexpr int kPanel = 16;  // weight rows per panel (a multiple of every NO below)

enum class Format { int4, int8, bf16 };

struct GemmArgs {
    void* y;                      // [rows, n_out] in dtype
    const void* x;                // prepared x: float [rows, K], or (bf16 dot) uint16 [rows, K]
    const void* w;                // as the format stores it (cpu_kernels.h)
    const float* scale;           // int8: [n_out]
    const uint16_t* group_scale;  // int4: float16 [n_out, n_in / G]
    const uint16_t* group_min;
    int rows, n_in, n_out, group_size;
    int K;  // n_in rounded up to the step of the tiles (zeros past n_in in x and in the panel)
    DType dtype;
    Format format;
};

template <class T>
T* scratch(std::vector<T>& buffer, int64_t n) {
    if (int64_t(buffer.size()) < n) buffer.resize(size_t(n));
    return buffer.data();
}

// y[r, o] for the sums of a tile: int8 scales them by its row's scale.
void store_sums(const GemmArgs& a, const float* sums, int r0, int mr, int o0, int no) {
    for (int r = 0; r < mr; ++r)
        for (int n = 0; n < no; ++n) {
            const int o = o0 + n;
            const float s = sums[r * kPanel + n];
            store_from_float(a.y, int64_t(r0 + r) * a.n_out + o, a.scale ? s * a.scale[o] : s, a.dtype);
        }
}

#ifdef KERNELS_X86

// --- float panels ----------------------------------------------------------------------------

// Weight row o as floats into p[0, K): int4 dequantized (min + scale * code) in the deinterleaved
// order, int8 as its codes (the scale comes at the end), bf16 widened; zeros past n_in.
template <class S>
KERNELS_INLINE void fill_row(const GemmArgs& a, int o, float* p) {
    constexpr int W = S::W;
    const int n_in = a.n_in;
    int i = 0;
    if (a.format == Format::int4) {
        const int G = a.group_size, groups = n_in / G;
        const uint8_t* codes = static_cast<const uint8_t*>(a.w) + int64_t(o) * (n_in / 2);
        for (int g = 0; g < groups; ++g) {
            const typename S::V s = S::set1(f16_to_float(a.group_scale[int64_t(o) * groups + g]));
            const typename S::V m = S::set1(f16_to_float(a.group_min[int64_t(o) * groups + g]));
            for (i = g * G; i < (g + 1) * G; i += 2 * W) {
                typename S::V lo, hi;
                S::load_u8_nibbles(codes + i / 2, lo, hi);
                S::store(p + i, S::fma(lo, s, m));
                S::store(p + i + W, S::fma(hi, s, m));
            }
        }
    } else if (a.format == Format::int8) {
        const int8_t* q = static_cast<const int8_t*>(a.w) + int64_t(o) * n_in;
        for (; i + W <= n_in; i += W) S::store(p + i, S::load_i8(q + i));
        for (; i < n_in; ++i) p[i] = float(q[i]);
    } else {
        const uint16_t* w = static_cast<const uint16_t*>(a.w) + int64_t(o) * n_in;
        for (; i + W <= n_in; i += W) S::store(p + i, S::template load_as<DType::bf16>(w, i));
        for (; i < n_in; ++i) p[i] = bf16_to_float(w[i]);
    }
    for (; i < a.K; ++i) p[i] = 0.f;
}

// MR rows of x times NO rows of the panel, over all K inputs; sums[r * kPanel + n].
template <class S, int MR, int NO>
KERNELS_INLINE void float_tile(const float* x, const float* panel, int K, float* sums) {
    using V = typename S::V;
    V acc[MR][NO];
    for (int r = 0; r < MR; ++r)
        for (int n = 0; n < NO; ++n) acc[r][n] = S::zero();
    for (int k = 0; k < K; k += S::W) {
        V xv[MR];
        for (int r = 0; r < MR; ++r) {
            xv[r] = S::load(x + int64_t(r) * K + k);
            __asm__("" : "+v"(xv[r]));  // kept in a register (quant_linear.cpp's KERNELS_IN_REGISTER)
        }
        for (int n = 0; n < NO; ++n) {
            const V w = S::load(panel + int64_t(n) * K + k);
            for (int r = 0; r < MR; ++r) acc[r][n] = S::fma(xv[r], w, acc[r][n]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int n = 0; n < NO; ++n) sums[r * kPanel + n] = S::reduce_add(acc[r][n]);
}

// Each ISA's tile as a function of its own (see quant_linear.cpp's Int4Tile: inlined together,
// GCC allocates their registers worse).
template <class S>
struct FloatTile;

template <>
struct FloatTile<Avx2> {
    static constexpr int MR = 3, NO = 4;
    template <int R>
    KERNELS_AVX2 __attribute__((flatten, noinline)) static void run(const float* x, const float* p, int K, float* s) {
        for (int n = 0; n < kPanel; n += NO) float_tile<Avx2, R, NO>(x, p + int64_t(n) * K, K, s + n);
    }
    KERNELS_AVX2 __attribute__((flatten, noinline)) static void fill(const GemmArgs& a, int o, float* p) {
        fill_row<Avx2>(a, o, p);
    }
};

template <>
struct FloatTile<Avx512> {
    static constexpr int MR = 4, NO = 4;
    template <int R>
    KERNELS_AVX512 __attribute__((flatten, noinline)) static void run(const float* x, const float* p, int K, float* s) {
        for (int n = 0; n < kPanel; n += NO) float_tile<Avx512, R, NO>(x, p + int64_t(n) * K, K, s + n);
    }
    KERNELS_AVX512 __attribute__((flatten, noinline)) static void fill(const GemmArgs& a, int o, float* p) {
        fill_row<Avx512>(a, o, p);
    }
};

// A tile of the last rows of x: fewer than MR.
template <class T, int R>
void run_rest(int rows, const float* x, const float* p, int K, float* s) {
    if constexpr (R > 0) {
        if (rows == R) return T::template run<R>(x, p, K, s);
        run_rest<T, R - 1>(rows, x, p, K, s);
    }
}

// One panel: its weight rows o0 .. o0 + kPanel - 1 filled (rows past n_out as zeros), then every
// row of x against it.
template <class S>
void float_panel(const GemmArgs& a, int o0) {
    using T = FloatTile<S>;
    thread_local std::vector<float> buffer;
    float* panel = scratch(buffer, int64_t(kPanel) * a.K);
    const int no = std::min(kPanel, a.n_out - o0);
    for (int n = 0; n < kPanel; ++n) {
        if (n < no) T::fill(a, o0 + n, panel + int64_t(n) * a.K);
        else std::fill_n(panel + int64_t(n) * a.K, a.K, 0.f);
    }
    const float* x = static_cast<const float*>(a.x);
    float sums[T::MR * kPanel];
    int r0 = 0;
    for (; r0 + T::MR <= a.rows; r0 += T::MR) {
        T::template run<T::MR>(x + int64_t(r0) * a.K, panel, a.K, sums);
        store_sums(a, sums, r0, T::MR, o0, no);
    }
    if (r0 < a.rows) {
        run_rest<T, T::MR - 1>(a.rows - r0, x + int64_t(r0) * a.K, panel, a.K, sums);
        store_sums(a, sums, r0, a.rows - r0, o0, no);
    }
}

// --- bf16 panels, AVX512-BF16 ------------------------------------------------------------------

// Weight row o as bf16 into p[0, K), in the order x is prepared in (int4: deinterleaved by 32,
// each 32-input step's 16 even weights then its 16 odd ones, which is how vcvtne2ps2bf16 packs
// two vectors; int8 and bf16: as stored); zeros past n_in. Each weight rounded once.
KERNELS_AVX512_BF16 __attribute__((flatten, noinline)) void fill_row_bf16(const GemmArgs& a, int o, uint16_t* p) {
    const int n_in = a.n_in;
    int i = 0;
    if (a.format == Format::int4) {
        const int G = a.group_size, groups = n_in / G;
        const uint8_t* codes = static_cast<const uint8_t*>(a.w) + int64_t(o) * (n_in / 2);
        for (int g = 0; g < groups; ++g) {
            const __m512 s = _mm512_set1_ps(f16_to_float(a.group_scale[int64_t(o) * groups + g]));
            const __m512 m = _mm512_set1_ps(f16_to_float(a.group_min[int64_t(o) * groups + g]));
            for (i = g * G; i < (g + 1) * G; i += 32) {
                __m512 lo, hi;
                Avx512::load_u8_nibbles(codes + i / 2, lo, hi);
                const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s, m), _mm512_fmadd_ps(lo, s, m));
                _mm512_storeu_si512(p + i, __m512i(w));
            }
        }
    } else if (a.format == Format::int8) {  // |code| <= 127: exact in bf16
        const int8_t* q = static_cast<const int8_t*>(a.w) + int64_t(o) * n_in;
        for (; i + 32 <= n_in; i += 32) {
            const __m512 lo = Avx512::load_i8(q + i), hi = Avx512::load_i8(q + i + 16);
            _mm512_storeu_si512(p + i, __m512i(_mm512_cvtne2ps_pbh(hi, lo)));
        }
        for (; i < n_in; ++i) p[i] = float_to_bf16(float(q[i]));
    } else {
        const uint16_t* w = static_cast<const uint16_t*>(a.w) + int64_t(o) * n_in;
        std::memcpy(p, w, size_t(n_in) * 2);
        i = n_in;
    }
    for (; i < a.K; ++i) p[i] = 0;
}

template <int MR, int NO>
KERNELS_AVX512_BF16 inline void bf16_tile(const uint16_t* x, const uint16_t* panel, int K, float* sums) {
    __m512 acc[MR][NO];
    for (int r = 0; r < MR; ++r)
        for (int n = 0; n < NO; ++n) acc[r][n] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        __m512bh xv[MR];
        for (int r = 0; r < MR; ++r) {
            xv[r] = __m512bh(_mm512_loadu_si512(x + int64_t(r) * K + k));
            __asm__("" : "+v"(xv[r]));
        }
        for (int n = 0; n < NO; ++n) {
            const __m512bh w = __m512bh(_mm512_loadu_si512(panel + int64_t(n) * K + k));
            for (int r = 0; r < MR; ++r) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], w, xv[r]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int n = 0; n < NO; ++n) sums[r * kPanel + n] = Avx512::reduce_add(acc[r][n]);
}

struct Bf16Tile {
    static constexpr int MR = 4, NO = 4;
    template <int R>
    KERNELS_AVX512_BF16 __attribute__((flatten, noinline)) static void run(const uint16_t* x, const uint16_t* p, int K,
                                                                           float* s) {
        for (int n = 0; n < kPanel; n += NO) bf16_tile<R, NO>(x, p + int64_t(n) * K, K, s + n);
    }
};

template <int R>
void run_rest_bf16(int rows, const uint16_t* x, const uint16_t* p, int K, float* s) {
    if constexpr (R > 0) {
        if (rows == R) return Bf16Tile::run<R>(x, p, K, s);
        run_rest_bf16<R - 1>(rows, x, p, K, s);
    }
}

void bf16_panel(const GemmArgs& a, int o0) {
    using T = Bf16Tile;
    thread_local std::vector<uint16_t> buffer;
    uint16_t* panel = scratch(buffer, int64_t(kPanel) * a.K);
    const int no = std::min(kPanel, a.n_out - o0);
    for (int n = 0; n < kPanel; ++n) {
        if (n < no) fill_row_bf16(a, o0 + n, panel + int64_t(n) * a.K);
        else std::fill_n(panel + int64_t(n) * a.K, a.K, uint16_t(0));
    }
    const uint16_t* x = static_cast<const uint16_t*>(a.x);
    float sums[T::MR * kPanel];
    int r0 = 0;
    for (; r0 + T::MR <= a.rows; r0 += T::MR) {
        T::run<T::MR>(x + int64_t(r0) * a.K, panel, a.K, sums);
        store_sums(a, sums, r0, T::MR, o0, no);
    }
    if (r0 < a.rows) {
        run_rest_bf16<T::MR - 1>(a.rows - r0, x + int64_t(r0) * a.K, panel, a.K, sums);
        store_sums(a, sums, r0, a.rows - r0, o0, no);
    }
}

#endif  // KERNELS_X86

// --- x, once per call ------------------------------------------------------------------------

// x as float, [rows, K]: int4 deinterleaved in blocks of 2 * lanes (its panel's order), zeros
// past n_in.
// The dtype a template argument, so that each loop compiles to plain conversions; rows split among
// the threads: one thread widening 128 rows of bf16 took a sixth of a 128-row product on two.
template <DType D>
void prepare_float_rows(float* xs, const void* x, const GemmArgs& a, int lanes) {
    const bool deinterleave = a.format == Format::int4;
#pragma omp parallel for schedule(static) if (int64_t(a.rows) * a.n_in > (int64_t(1) << 14))
    for (int r = 0; r < a.rows; ++r) {
        float* row = xs + int64_t(r) * a.K;
        const int64_t base = int64_t(r) * a.n_in;
        if (deinterleave) {
            for (int i = 0; i < a.n_in; i += 2 * lanes)
                for (int j = 0; j < lanes; ++j) {
                    row[i + j] = load_as_float<D>(x, base + i + 2 * j);
                    row[i + lanes + j] = load_as_float<D>(x, base + i + 2 * j + 1);
                }
        } else {
            for (int i = 0; i < a.n_in; ++i) row[i] = load_as_float<D>(x, base + i);
        }
        std::fill(row + a.n_in, row + a.K, 0.f);
    }
}

void prepare_float_x(float* xs, const void* x, const GemmArgs& a, int lanes) {
    if (a.dtype == DType::bf16) return prepare_float_rows<DType::bf16>(xs, x, a, lanes);
    if (a.dtype == DType::f16) return prepare_float_rows<DType::f16>(xs, x, a, lanes);
    prepare_float_rows<DType::f32>(xs, x, a, lanes);
}

// bf16 x as stored, [rows, K]: int4 deinterleaved in blocks of 32, zeros past n_in.
void prepare_bf16_x(uint16_t* xs, const uint16_t* x, const GemmArgs& a) {
#pragma omp parallel for schedule(static) if (int64_t(a.rows) * a.n_in > (int64_t(1) << 14))
    for (int r = 0; r < a.rows; ++r) {
        uint16_t* row = xs + int64_t(r) * a.K;
        const uint16_t* in = x + int64_t(r) * a.n_in;
        if (a.format == Format::int4) {
            for (int i = 0; i < a.n_in; i += 32)
                for (int j = 0; j < 16; ++j) {
                    row[i + j] = in[i + 2 * j];
                    row[i + 16 + j] = in[i + 2 * j + 1];
                }
        } else {
            std::copy_n(in, a.n_in, row);
        }
        std::fill(row + a.n_in, row + a.K, uint16_t(0));
    }
}

// Panels split among the threads; one thread below a few panels' worth of work.
void run_panels(void (*panel)(const GemmArgs&, int), const GemmArgs& a) {
    const int panels = (a.n_out + kPanel - 1) / kPanel;
    const bool parallel = int64_t(a.rows) * a.n_in * a.n_out > (int64_t(1) << 17) && panels > 1;
#pragma omp parallel for schedule(static) if (parallel)
    for (int p = 0; p < panels; ++p) panel(a, p * kPanel);
}

void gemm(GemmArgs a, const void* x) {
    const Isa level = isa();
    thread_local std::vector<float> x_float;
    thread_local std::vector<uint16_t> x_bf16;
#ifdef KERNELS_X86
    if (level == Isa::avx512_bf16 && a.dtype == DType::bf16) {
        a.K = (a.n_in + 31) / 32 * 32;
        uint16_t* xs = scratch(x_bf16, int64_t(a.rows) * a.K);
        prepare_bf16_x(xs, static_cast<const uint16_t*>(x), a);
        a.x = xs;
        return run_panels(bf16_panel, a);
    }
    const int lanes = level >= Isa::avx512 ? 16 : 8;
    a.K = (a.n_in + lanes - 1) / lanes * lanes;
    float* xs = scratch(x_float, int64_t(a.rows) * a.K);
    prepare_float_x(xs, x, a, lanes);
    a.x = xs;
    run_panels(level >= Isa::avx512 ? float_panel<Avx512> : float_panel<Avx2>, a);
#else
    (void)level, (void)x, (void)a;
#endif
}

}  // namespace

bool gemm_applies(int rows) {
#ifdef KERNELS_X86
    return rows >= kGemmMinRows && isa() >= Isa::avx2 && !batch_invariant();
#else
    (void)rows;
    return false;
#endif
}

const char* gemm_name() {
    if (batch_invariant()) return "off (batch-invariant)";
    switch (isa()) {
        case Isa::scalar: return "off (portable C++)";
        case Isa::avx2: return "avx2-fma";
        case Isa::avx512: return "avx512-fma";
        case Isa::avx512_bf16: return "avx512-bf16 for bf16 x, avx512-fma for float32";
    }
    return "unknown";
}

void int4_gemm(void* y, const void* x, const uint8_t* packed, const uint16_t* scale, const uint16_t* min, int rows,
               int n_in, int n_out, int group_size, DType dtype) {
    gemm({y, nullptr, packed, nullptr, scale, min, rows, n_in, n_out, group_size, 0, dtype, Format::int4}, x);
}

void int8_gemm(void* y, const void* x, const int8_t* q, const float* scale, int rows, int n_in, int n_out,
               DType dtype) {
    gemm({y, nullptr, q, scale, nullptr, nullptr, rows, n_in, n_out, 0, 0, dtype, Format::int8}, x);
}

void bf16_gemm(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, DType dtype) {
    gemm({y, nullptr, w, nullptr, nullptr, nullptr, rows, n_in, n_out, 0, 0, dtype, Format::bf16}, x);
}

}  // namespace kernels::cpu

KERNELS_VECTOR_CODE_END
