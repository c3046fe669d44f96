// Linear layers for many rows of x: y = x @ W.T as a matrix product, for prompt chunks, batched
// decode steps and the verify rows of speculative decoding.
//
// quant_linear.cpp's kernels are matrix-vector products: they turn each weight into a number in
// registers, as the bytes stream in, and use it for the few rows of x in the call. With many rows
// that turning (widening, masking, converting, scaling) is repeated for every few rows, and the
// product, not the memory, sets the time. Here each weight is turned into a number once per call:
//   1. x transposed once per call, in blocks of L rows (L = a vector's lanes): xt[b][k] is the
//      vector of input k of rows bL .. bL + L - 1, one row a lane;
//   2. a panel: NO consecutive weight rows (outputs), dequantized or widened into a small
//      thread-local buffer, [NO][K] floats (or bf16, below), which stays in L1;
//   3. tiles: NO outputs by MV blocks of rows, NO * MV accumulators in registers, each a vector
//      along the rows; per input k, MV vectors of xt and NO weights broadcast from the panel feed
//      NO * MV FMAs (AVX2: 6 x 2, 12 FMAs per 8 loads; AVX512: 12 x 2, 24 per 14), and a sum is
//      whole when the k loop ends: no horizontal sums;
//   4. the sums land in yt, the product transposed, and are written into y row by row at the end;
//   5. threads take panels (OpenMP over outputs), then blocks of rows of y.
// Why x and not W is transposed: the panel stays each weight row as it is stored, dequantized in
// order, and x's transposition is paid once per call, where W's would be paid for every panel.
// Why not tiles of dot products along the inputs (a vector along k, one horizontal sum per output
// and row at the end, as llamafile's tinyBLAS does): SmolLM2's layers have K = 576 inputs, 36
// vectors of 16, and the sums and scattered stores at a tile's end cost as much as a third of its
// products; this layout reached 1.5x their speed on AVX512 (bench/gemm.py, chapter 06's README).
//
// int4 keeps quant_linear.cpp's deinterleaved order: a byte holds inputs 2j and 2j + 1, so a
// vector of W bytes dequantizes to W even inputs and W odd ones, and x is deinterleaved to match,
// once per call (the dot product does not care in which order it meets its terms).
//
// AVX512-BF16 with bf16 x, where the core runs it faster than FMAs (gemm_bf16_pairs, isa.cpp): the
// panel holds bf16 weights, xt holds x's inputs in pairs, and vdpbf16ps adds two products a lane
// per instruction (products exact); a dequantized int4 weight is then rounded to bf16 as a dense
// bf16 copy of W would be.
//
// A row is one lane of every vector it meets, so its sums are the same instructions in every tile
// and at every row count; but they are in another order than the matrix-vector kernels', so
// batch-invariant mode stays with those (quant_linear.cpp decides; cpu_kernels.h says when this runs).
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "vec.h"

KERNELS_VECTOR_CODE_BEGIN

namespace kernels::cpu {

namespace {

// Inputs of a panel a tile takes at once, at most: 12 rows of 512 floats, 24 KB, stay in L1 beside
// x's vectors. Longer rows (SmolLM2's down projection, 1536 inputs) are cut into equal pieces (a
// multiple of 32), their sums carried in yt from one piece to the next (768 measured no faster).
constexpr int kMaxChunk = 512;

enum class Format { int4, int8, bf16 };

struct GemmArgs {
    void* y;                      // [rows, n_out] in dtype
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

#ifdef KERNELS_X86

// --- panels: a few weight rows, turned into numbers once per call ------------------------------

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

// --- tiles: NO outputs of the panel by MV blocks of L rows of x -----------------------------------

// Float: acc[n][v] holds output n for the L rows of block v, one row a lane. Per input k, MV vectors
// of x (xt is x transposed in blocks: L rows' k-th inputs side by side) and NO broadcast weights
// feed NO * MV FMAs. The sums land in yt, the product transposed ([outputs][rows], ld apart).
template <class S, int NO, int MV>
KERNELS_INLINE void float_tile(const float* xt, int64_t block, const float* panel, int K, int k0, int k1, float* yt,
                               int64_t ld) {
    using V = typename S::V;
    constexpr int L = S::W;
    V acc[NO][MV];
    for (int n = 0; n < NO; ++n)
        for (int v = 0; v < MV; ++v) acc[n][v] = k0 == 0 ? S::zero() : S::load(yt + n * ld + v * L);
    for (int k = k0; k < k1; ++k) {
        V xv[MV];
        for (int v = 0; v < MV; ++v) xv[v] = S::load(xt + v * block + int64_t(k) * L);
        for (int n = 0; n < NO; ++n) {
            const V w = S::set1(panel[int64_t(n) * K + k]);
            for (int v = 0; v < MV; ++v) acc[n][v] = S::fma(w, xv[v], acc[n][v]);
        }
    }
    for (int n = 0; n < NO; ++n)
        for (int v = 0; v < MV; ++v) S::store(yt + n * ld + v * L, acc[n][v]);
}

// y[r, o] = yt[o, r] (int8: times output o's scale) for rows r0 .. r1 - 1: for every L outputs and
// L rows, L vectors of yt (an output's sums for the rows) transposed in registers into the rows'
// vectors, each stored into y. (Gathering a column of yt per row instead took 7 % of a bf16 prompt
// on a Zen 5.) yt's rows are whole blocks of L (ld), so a last, partial block's lanes are there to read.
template <class S, DType DY>
KERNELS_INLINE void store_rows(const GemmArgs& a, const float* yt, int64_t ld, int r0, int r1) {
    using V = typename S::V;
    constexpr int L = S::W;
    int o = 0;
    for (; o + L <= a.n_out; o += L) {
        const V scale = a.scale ? S::load(a.scale + o) : S::set1(1.f);
        for (int rb = r0; rb < r1; rb += L) {
            V block[L];
            for (int i = 0; i < L; ++i) block[i] = S::load(yt + (o + i) * ld + rb);  // output o + i's rows
            S::transpose(block);  // block[j]: row rb + j's outputs o .. o + L - 1
            for (int j = 0; j < std::min(L, r1 - rb); ++j)
                S::template store_as<DY>(a.y, int64_t(rb + j) * a.n_out + o, S::mul(block[j], scale));
        }
    }
    for (; o < a.n_out; ++o)
        for (int r = r0; r < r1; ++r)
            store_from_float<DY>(a.y, int64_t(r) * a.n_out + o, yt[o * ld + r] * (a.scale ? a.scale[o] : 1.f));
}

template <class S>
KERNELS_INLINE void store_y_rows(const GemmArgs& a, const float* yt, int64_t ld, int r0, int r1) {
    if (a.dtype == DType::bf16) return store_rows<S, DType::bf16>(a, yt, ld, r0, r1);
    if (a.dtype == DType::f16) return store_rows<S, DType::f16>(a, yt, ld, r0, r1);
    store_rows<S, DType::f32>(a, yt, ld, r0, r1);
}

// Each ISA's tile as a function of its own (see quant_linear.cpp's Int4Tile: inlined together,
// GCC allocates their registers worse). AVX2 has 16 vector registers: 6 x 2 accumulators, 2 of x,
// 1 broadcast; AVX512 32: 12 x 2, 2, 1.
template <class S>
struct FloatTile;

template <>
struct FloatTile<Avx2> {
    static constexpr int NO = 6, MV = 2;
    template <int M>
    KERNELS_AVX2 __attribute__((flatten, noinline)) static void run(const float* xt, int64_t block, const float* p,
                                                                int K, int k0, int k1, float* yt, int64_t ld) {
        float_tile<Avx2, NO, M>(xt, block, p, K, k0, k1, yt, ld);
    }
    KERNELS_AVX2 __attribute__((flatten, noinline)) static void fill(const GemmArgs& a, int o, float* p) {
        fill_row<Avx2>(a, o, p);
    }
    KERNELS_AVX2 __attribute__((flatten, noinline)) static void store(const GemmArgs& a, const float* yt,
                                                                      int64_t ld, int r0, int r1) {
        store_y_rows<Avx2>(a, yt, ld, r0, r1);
    }
};

template <>
struct FloatTile<Avx512> {
    static constexpr int NO = 12, MV = 2;
    template <int M>
    KERNELS_AVX512 __attribute__((flatten, noinline)) static void run(const float* xt, int64_t block, const float* p,
                                                                  int K, int k0, int k1, float* yt, int64_t ld) {
        float_tile<Avx512, NO, M>(xt, block, p, K, k0, k1, yt, ld);
    }
    KERNELS_AVX512 __attribute__((flatten, noinline)) static void fill(const GemmArgs& a, int o, float* p) {
        fill_row<Avx512>(a, o, p);
    }
    KERNELS_AVX512 __attribute__((flatten, noinline)) static void store(const GemmArgs& a, const float* yt,
                                                                        int64_t ld, int r0, int r1) {
        store_y_rows<Avx512>(a, yt, ld, r0, r1);
    }
};

// bf16 pairs, AVX512-BF16: xt holds x's inputs in pairs (2k, 2k + 1) as one 32-bit lane, and
// vdpbf16ps adds both products of a pair to a float lane: acc[n][v] += w[n][2k] x[2k] + w[n][2k+1]
// x[2k+1], the weight pair broadcast.
template <int NO, int MV>
KERNELS_AVX512_BF16 inline void pair_tile(const uint32_t* xt, int64_t block, const uint16_t* panel, int K, int k0,
                                          int k1, float* yt, int64_t ld) {
    __m512 acc[NO][MV];
    for (int n = 0; n < NO; ++n)
        for (int v = 0; v < MV; ++v) acc[n][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(yt + n * ld + v * 16);
    for (int k = k0 / 2; k < k1 / 2; ++k) {
        __m512bh xv[MV];
        for (int v = 0; v < MV; ++v) xv[v] = __m512bh(_mm512_loadu_si512(xt + v * block + int64_t(k) * 16));
        for (int n = 0; n < NO; ++n) {
            uint32_t pair;
            std::memcpy(&pair, panel + int64_t(n) * K + 2 * k, 4);
            const __m512bh w = __m512bh(_mm512_set1_epi32(int(pair)));
            for (int v = 0; v < MV; ++v) acc[n][v] = _mm512_dpbf16_ps(acc[n][v], w, xv[v]);
        }
    }
    for (int n = 0; n < NO; ++n)
        for (int v = 0; v < MV; ++v) _mm512_storeu_ps(yt + n * ld + v * 16, acc[n][v]);
}

struct PairTile {
    static constexpr int NO = 12, MV = 2;
    template <int M>
    KERNELS_AVX512_BF16 __attribute__((flatten, noinline)) static void run(const uint32_t* xt, int64_t block,
                                                                           const uint16_t* p, int K, int k0, int k1,
                                                                           float* yt, int64_t ld) {
        pair_tile<NO, M>(xt, block, p, K, k0, k1, yt, ld);
    }
    static void fill(const GemmArgs& a, int o, uint16_t* p) { fill_row_bf16(a, o, p); }
    static void store(const GemmArgs& a, const float* yt, int64_t ld, int r0, int r1) {
        FloatTile<Avx512>::store(a, yt, ld, r0, r1);
    }
};

// One panel: its weight rows o0 .. o0 + NO - 1 filled (rows past n_out as zeros), then every block
// of rows of x against it, MV blocks a tile and the last one alone; the sums into yt's rows o0...
// T names the tile, P the panel's element, X xt's (float, or a pair of bf16); a block of xt is
// `block` X's apart from the next.
template <class T, class P, class X, int L>
void run_panel(const GemmArgs& a, const X* xt, int64_t block, int blocks, float* yt, int64_t ld, int o0) {
    constexpr int NO = T::NO, MV = T::MV;
    thread_local std::vector<P> buffer;
    P* panel = scratch(buffer, int64_t(NO) * a.K);
    const int no = std::min(NO, a.n_out - o0);
    for (int n = 0; n < NO; ++n) {
        if (n < no) T::fill(a, o0 + n, panel + int64_t(n) * a.K);
        else std::fill_n(panel + int64_t(n) * a.K, a.K, P(0));
    }
    const int pieces = (a.K + kMaxChunk - 1) / kMaxChunk, chunk = (a.K / pieces + 31) / 32 * 32;
    for (int k0 = 0; k0 < a.K; k0 += chunk) {  // the panel's inputs a piece at a time, in L1
        const int k1 = std::min(a.K, k0 + chunk);
        int b = 0;
        for (; b + MV <= blocks; b += MV)
            T::template run<MV>(xt + b * block, block, panel, a.K, k0, k1, yt + o0 * ld + b * L, ld);
        if (b < blocks) T::template run<1>(xt + b * block, block, panel, a.K, k0, k1, yt + o0 * ld + b * L, ld);
    }
}

#endif  // KERNELS_X86

// --- x in, y out, once per call ---------------------------------------------------------------

// x transposed in blocks of L rows: xt[b][k][j] = x[b L + j][k], the inputs in the panel's order
// (int4 deinterleaved in steps of 2L), zeros past n_in and for the rows past `rows` that
// fill the last block.
// The dtype a template argument, so that each loop compiles to plain conversions; blocks split
// among the threads: one thread widening 128 rows of bf16 took a sixth of a 128-row product on two.
template <DType D>
void prepare_float_rows(float* xt, const void* x, const GemmArgs& a, int L, int blocks) {
    const bool deinterleave = a.format == Format::int4;
#pragma omp parallel for schedule(static) if (int64_t(a.rows) * a.n_in > (int64_t(1) << 14))
    for (int b = 0; b < blocks; ++b) {
        float* block = xt + int64_t(b) * a.K * L;
        for (int j = 0; j < L; ++j) {
            const int r = b * L + j;
            if (r >= a.rows) {
                for (int k = 0; k < a.K; ++k) block[int64_t(k) * L + j] = 0.f;
                continue;
            }
            const int64_t base = int64_t(r) * a.n_in;
            int k = 0;
            if (deinterleave) {
                for (; k < a.n_in; k += 2 * L)
                    for (int i = 0; i < L; ++i) {
                        block[int64_t(k + i) * L + j] = load_as_float<D>(x, base + k + 2 * i);
                        block[int64_t(k + L + i) * L + j] = load_as_float<D>(x, base + k + 2 * i + 1);
                    }
            } else {
                for (; k < a.n_in; ++k) block[int64_t(k) * L + j] = load_as_float<D>(x, base + k);
            }
            for (; k < a.K; ++k) block[int64_t(k) * L + j] = 0.f;
        }
    }
}

void prepare_float_x(float* xt, const void* x, const GemmArgs& a, int L, int blocks) {
    if (a.dtype == DType::bf16) return prepare_float_rows<DType::bf16>(xt, x, a, L, blocks);
    if (a.dtype == DType::f16) return prepare_float_rows<DType::f16>(xt, x, a, L, blocks);
    prepare_float_rows<DType::f32>(xt, x, a, L, blocks);
}

// bf16 x in pairs, blocks of 16 rows: xt[b][k][j] = inputs 2k and 2k + 1 of row 16 b + j (int4:
// deinterleaved in steps of 32 first), zeros past n_in and past `rows`.
void prepare_pair_x(uint32_t* xt, const uint16_t* x, const GemmArgs& a, int blocks) {
#pragma omp parallel for schedule(static) if (int64_t(a.rows) * a.n_in > (int64_t(1) << 14))
    for (int b = 0; b < blocks; ++b) {
        uint32_t* block = xt + int64_t(b) * (a.K / 2) * 16;
        thread_local std::vector<uint16_t> row_buffer;
        uint16_t* row = scratch(row_buffer, a.K);  // one row in the panel's order
        for (int j = 0; j < 16; ++j) {
            const int r = b * 16 + j;
            std::fill(row, row + a.K, uint16_t(0));
            if (r < a.rows) {
                const uint16_t* in = x + int64_t(r) * a.n_in;
                if (a.format == Format::int4) {
                    for (int i = 0; i < a.n_in; i += 32)
                        for (int t = 0; t < 16; ++t) {
                            row[i + t] = in[i + 2 * t];
                            row[i + 16 + t] = in[i + 2 * t + 1];
                        }
                } else {
                    std::copy_n(in, a.n_in, row);
                }
            }
            for (int k = 0; k < a.K / 2; ++k)
                block[int64_t(k) * 16 + j] = uint32_t(row[2 * k]) | uint32_t(row[2 * k + 1]) << 16;
        }
    }
}

// Panels split among the threads, then (after the barrier) the rows of y; one thread below a few
// panels' worth of work.
template <class T, class P, class X, int L>
void run_panels(const GemmArgs& a, const X* xt, int64_t block, int blocks) {
    constexpr int NO = T::NO;
    const int panels = (a.n_out + NO - 1) / NO;
    const int64_t ld = int64_t(blocks) * L;
    thread_local std::vector<float> yt_buffer;
    float* yt = scratch(yt_buffer, int64_t(panels) * NO * ld);
    const bool parallel = int64_t(a.rows) * a.n_in * a.n_out > (int64_t(1) << 17) && panels > 1;
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int p = 0; p < panels; ++p) run_panel<T, P, X, L>(a, xt, block, blocks, yt, ld, p * NO);
        // (the barrier: every panel's sums are in yt) then y, 16 rows at a time
#pragma omp for schedule(static)
        for (int r0 = 0; r0 < a.rows; r0 += 16) T::store(a, yt, ld, r0, std::min(a.rows, r0 + 16));
    }
}

// The product for one slice of the call's rows (gemm, below): x transposed, the panels, then y.
void gemm_rows(GemmArgs a, const void* x) {
    const Isa level = isa();
    thread_local std::vector<float> x_float;
    thread_local std::vector<uint32_t> x_pairs;
#ifdef KERNELS_X86
    if (a.dtype == DType::bf16 && gemm_bf16_pairs()) {
        a.K = (a.n_in + 31) / 32 * 32;
        const int blocks = (a.rows + 15) / 16;
        uint32_t* xt = scratch(x_pairs, int64_t(blocks) * 16 * a.K / 2);
        prepare_pair_x(xt, static_cast<const uint16_t*>(x), a, blocks);
        return run_panels<PairTile, uint16_t, uint32_t, 16>(a, xt, int64_t(a.K / 2) * 16, blocks);
    }
    const int lanes = level >= Isa::avx512 ? 16 : 8;
    a.K = (a.n_in + lanes - 1) / lanes * lanes;
    const int blocks = (a.rows + lanes - 1) / lanes;
    float* xt = scratch(x_float, int64_t(blocks) * lanes * a.K);
    prepare_float_x(xt, x, a, lanes, blocks);
    const int64_t block = int64_t(a.K) * lanes;
    if (level >= Isa::avx512) return run_panels<FloatTile<Avx512>, float, float, 16>(a, xt, block, blocks);
    run_panels<FloatTile<Avx2>, float, float, 8>(a, xt, block, blocks);
#else
    (void)level, (void)x, (void)a;
#endif
}

// The call's rows in slices of at most kMaxRows: the buffers of a slice (x transposed, and the
// product transposed, rows x n_out floats: 25 MB for 128 rows of SmolLM2's LM head) stay that size
// whatever the call, and a panel's work for 128 rows of x keeps them in L2.
constexpr int kMaxRows = 128;

void gemm(GemmArgs a, const void* x) {
    const int64_t size = a.dtype == DType::f32 ? 4 : 2, rows = a.rows;
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        GemmArgs slice = a;
        slice.rows = int(std::min<int64_t>(kMaxRows, rows - r0));
        slice.y = static_cast<char*>(a.y) + r0 * a.n_out * size;
        gemm_rows(slice, static_cast<const char*>(x) + r0 * a.n_in * size);
    }
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
        case Isa::avx512_bf16:
            return gemm_bf16_pairs() ? "avx512-bf16 for bf16 x, avx512-fma for float32"
                                     : "avx512-fma (bf16 pairs off on this CPU: FMAs outrun them)";
    }
    return "unknown";
}

void int4_gemm(void* y, const void* x, const uint8_t* packed, const uint16_t* scale, const uint16_t* min, int rows,
               int n_in, int n_out, int group_size, DType dtype) {
    gemm({y, packed, nullptr, scale, min, rows, n_in, n_out, group_size, 0, dtype, Format::int4}, x);
}

void int8_gemm(void* y, const void* x, const int8_t* q, const float* scale, int rows, int n_in, int n_out,
               DType dtype) {
    gemm({y, q, scale, nullptr, nullptr, rows, n_in, n_out, 0, 0, dtype, Format::int8}, x);
}

void bf16_gemm(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, DType dtype) {
    gemm({y, w, nullptr, nullptr, nullptr, rows, n_in, n_out, 0, 0, dtype, Format::bf16}, x);
}

}  // namespace kernels::cpu

KERNELS_VECTOR_CODE_END
