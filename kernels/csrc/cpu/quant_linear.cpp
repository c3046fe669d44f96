// Quantized linear layers for decode: y = x @ W.T with W stored as int4 or int8 codes.
//
// In decode, x has one row per sequence, so each weight is used `rows` times and then never
// again in this step: the kernel is a matrix-vector product, and its speed is how fast it streams
// the weights from memory. Storing W as 4 or 8-bit codes reads 4x or 2x fewer bytes than bf16;
// the price is turning codes back into numbers, in registers, as the bytes arrive, which must
// cost less than the memory system's time to deliver them. Everything here serves that:
//   - each weight row is read once per call and used for every row of x;
//   - x is converted to float, and rearranged for the codes (below), once per call;
//   - several weight rows are handled per step, giving the CPU independent chains of FMAs;
//   - threads take contiguous slices of output rows, and each prefetches its slice well ahead.
//     The hardware prefetchers alone left a third or more of the bandwidth unused (the int8 LM
//     head streamed at 14 GB/s without, 35 with): they stop at every 4 KiB page, and a
//     matrix-vector product has too little work per byte to hide the misses.
//
// int4. Two codes share a byte: element 2j in the low nibble, 2j+1 in the high one. Widening L
// bytes to L 32-bit lanes puts the codes of L even and L odd inputs in one register, in order;
// rather than interleave them (shuffles, per weight, every call), x is deinterleaved once per
// call: in every block of 2L inputs, the L even ones, then the L odd ones.
//
// With one row of x, the fewest instructions per weight win, and two identities remove work
// from the inner loop. Per group of G inputs with scale s and min m,
//     sum_i (m + s * code_i) * x_i  =  s * sum_i code_i * x_i  +  m * sum_i x_i
// so raw codes multiply x, a group's sum is scaled once, and the min term is a short dot product
// of the row's mins with the per-group sums of x (computed once per call). And rather than
// isolate the high nibble, the whole byte b = lo + 16 hi serves: hi = (b - lo) / 16, so
//     lo * x_even + hi * x_odd  =  lo * (x_even - x_odd / 16)  +  b * (x_odd / 16)
// with both factors of x computed once per call. Per byte: a widening, a mask (or a lookup), two
// conversions to float, two FMAs. AVX2 and the portable path use this form for any number of rows.
//
// With several rows of x, each weight is worth turning into a float once and multiplying into
// every row: AVX512 dequantizes through a 16-entry table per group (int4_tile_avx512), and with
// bf16 x, AVX512-BF16 looks up pairs of bf16 weights and multiplies them with vdpbf16ps, 8 rows
// of x to one pass over the weights (int4_dot_tile_bf16): what a verify step of speculative
// decoding (chapter 07) and a decode step of a few sequences spend most of their time in.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "cpu_kernels.h"
#include "vec.h"

KERNELS_VECTOR_CODE_BEGIN

namespace kernels::cpu {

namespace {

// Below this many multiply-adds a call runs on the calling thread.
constexpr int64_t kParallelMacs = int64_t(1) << 15;
// How far ahead of its reads a thread prefetches its slice of the weights (measured: 4-16 KiB
// are alike on a 2-core Zen 4; shorter does not hide DRAM latency, longer evicts from L1).
constexpr int kPrefetchBytes = 8192;

struct LinearArgs {
    void* y;
    const float* xs;              // x as float, [rows, n_in]; for the SIMD int4 kernels rearranged (see the top)
    const uint16_t* x_bf16;       // bf16: x as stored when it is bf16 too (dot_tile_bf16 reads it), else null
    const float* xsum;            // int4: per-group sums of x, [rows, n_in / G]
    const void* w;                // int4: uint8 [n_out, n_in / 2]; int8: int8 [n_out, n_in]; bf16: [n_out, n_in]
    const float* scale;           // int8: float32 [n_out]; bf16: null
    const uint16_t* group_scale;  // int4: float16 bits [n_out, n_in / G], widened one group at a time
    const uint16_t* group_min;
    int rows, n_in, n_out, group_size;
    DType dtype;
    bool invariant = batch_invariant();  // the same form for every row count (cpu_kernels.h)
};

KERNELS_INLINE void prefetch(const void* p) {
#ifdef KERNELS_X86
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#else
    __builtin_prefetch(p);
#endif
}

// Keeps a loaded vector in a register. Left alone, GCC folds the load of x into each FMA that
// uses it, reloading the same x once per weight row; with several rows of x that made the loads,
// not the arithmetic, the bottleneck (Zen 4 loads one 64-byte vector per cycle).
#define KERNELS_IN_REGISTER(v) __asm__("" : "+v"(v))

// --- x, once per call ----------------------------------------------------------------------------

template <DType D>
void convert_x(float* xs, const void* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) xs[i] = load_as_float<D>(x, i);
}

// x as float, deinterleaved in blocks of 2 * lanes, in plain C++.
template <DType D>
void deinterleave_x(float* xs, const void* x, int64_t n, int lanes) {
    for (int64_t i = 0; i < n; i += 2 * lanes)
        for (int j = 0; j < lanes; ++j) {
            xs[i + j] = load_as_float<D>(x, i + 2 * j);
            xs[i + lanes + j] = load_as_float<D>(x, i + 2 * j + 1);
        }
}

#ifdef KERNELS_X86
// x as float, deinterleaved in blocks of 16: 8 even inputs, then 8 odd ones.
template <DType D>
KERNELS_AVX2 void deinterleave_x_avx2(float* xs, const void* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __m256 a = Avx2::load_as<D>(x, i), b = Avx2::load_as<D>(x, i + 8);
        // shuffle_ps picks within 128-bit lanes: [a0 a2 b0 b2 | a4 a6 b4 b6]; the 64-bit permute
        // then puts the pieces in order.
        __m256 even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
        __m256 odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
        even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), _MM_SHUFFLE(3, 1, 2, 0)));
        odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), _MM_SHUFFLE(3, 1, 2, 0)));
        _mm256_storeu_ps(xs + i, even);
        _mm256_storeu_ps(xs + i + 8, odd);
    }
}

// x as float, deinterleaved in blocks of 32: 16 even inputs, then 16 odd ones.
template <DType D>
KERNELS_AVX512 void deinterleave_x_avx512(float* xs, const void* x, int64_t n) {
    const __m512i even_idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd_idx = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int64_t i = 0; i < n; i += 32) {
        __m512 a = Avx512::load_as<D>(x, i), b = Avx512::load_as<D>(x, i + 16);
        _mm512_storeu_ps(xs + i, _mm512_permutex2var_ps(a, even_idx, b));
        _mm512_storeu_ps(xs + i + 16, _mm512_permutex2var_ps(a, odd_idx, b));
    }
}
#endif

template <DType D>
void prepare_x_as(float* xs, const void* x, int64_t n, Isa level, int lanes) {
    if (lanes == 1) return convert_x<D>(xs, x, n);
#ifdef KERNELS_X86
    if (level >= Isa::avx512) return deinterleave_x_avx512<D>(xs, x, n);
    if (level == Isa::avx2) return deinterleave_x_avx2<D>(xs, x, n);
#endif
    (void)level;
    deinterleave_x<D>(xs, x, n, lanes);
}

// xs = x as float, [rows, n_in]; deinterleaved in blocks of 2 * lanes when lanes > 1. With
// `factored`, also: the sum of each group of x into xsum, and each block turned from
// (x_even, x_odd) into (x_even - x_odd / 16, x_odd / 16), the factors of the low nibble and of
// the whole byte.
void prepare_x(float* xs, float* xsum, const void* x, int rows, int n_in, int group_size, DType dtype, Isa level,
               int lanes, bool factored) {
    const int64_t n = int64_t(rows) * n_in;
    switch (dtype) {
        case DType::f32: prepare_x_as<DType::f32>(xs, x, n, level, lanes); break;
        case DType::bf16: prepare_x_as<DType::bf16>(xs, x, n, level, lanes); break;
        case DType::f16: prepare_x_as<DType::f16>(xs, x, n, level, lanes); break;
    }
    if (!factored) return;
    const int groups = n_in / group_size;
    for (int64_t g = 0; g < int64_t(rows) * groups; ++g) {  // a group is whole blocks: its sum is unchanged
        const float* xg = xs + g * group_size;
        float sum = 0.f;
        for (int i = 0; i < group_size; ++i) sum += xg[i];
        xsum[g] = sum;
    }
    for (int64_t i = 0; i < n; i += 2 * lanes)
        for (int j = 0; j < lanes; ++j) {
            const float odd = xs[i + lanes + j] * 0.0625f;  // exact: a power of two
            xs[i + j] -= odd;
            xs[i + lanes + j] = odd;
        }
}

// --- int4 ----------------------------------------------------------------------------------------
// Each SIMD kernel computes a tile: NO consecutive output rows (weight rows) times R rows of x,
// NO * R accumulators, so that one row of x (a decode step of one sequence) still has NO
// independent chains of FMAs, and more rows of x reuse each code vector.

// Portable C++, the factored form on 16 lanes: the loops over a lane array are the shape a
// compiler vectorises by itself (SSE2, NEON), as it cannot a float sum it would have to
// reorder. Each lane's terms are scaled as they come (one more multiply per pair of weights),
// so the lanes are summed once per row rather than once per group.
constexpr int kScalarLanes = 16;

void int4_range_scalar(const LinearArgs& a, int o0, int o1) {
    constexpr int L = kScalarLanes;
    const int n_in = a.n_in, G = a.group_size, groups = n_in / G;
    for (int o = o0; o < o1; ++o) {
        const uint8_t* w = static_cast<const uint8_t*>(a.w) + int64_t(o) * (n_in / 2);
        const uint16_t* scale = a.group_scale + int64_t(o) * groups;
        const uint16_t* min = a.group_min + int64_t(o) * groups;
        for (int r = 0; r < a.rows; ++r) {
            const float* x = a.xs + int64_t(r) * n_in;
            const float* xsum = a.xsum + int64_t(r) * groups;
            float acc[L] = {};
            for (int g = 0; g < groups; ++g) {
                const float s = f16_to_float(scale[g]);
                for (int i = g * G; i < (g + 1) * G; i += 2 * L) {
                    const uint8_t* bytes = w + i / 2;
                    const float* x_lo = x + i;
                    const float* x_byte = x + i + L;
                    for (int j = 0; j < L; ++j)
                        acc[j] += s * (float(bytes[j] & 15) * x_lo[j] + float(bytes[j]) * x_byte[j]);
                }
            }
            float sum = 0.f;
            for (int j = 0; j < L; ++j) sum += acc[j];
            for (int g = 0; g < groups; ++g) sum += f16_to_float(min[g]) * xsum[g];
            store_from_float(a.y, int64_t(r) * a.n_out + o, sum, a.dtype);
        }
    }
}

// A tile's scales and mins as float, each [its rows of W][groups]; rows_from(n) starts at its row n.
struct Widened {
    const float* scale;
    const float* min;
    int groups;
    Widened rows_from(int n) const { return {scale + n * groups, min + n * groups, groups}; }
};

// The calling thread's float copies of one tile's scales and mins (each OpenMP thread has its own).
float* tile_scratch(int64_t n) {
    thread_local std::vector<float> buffer;
    if (int64_t(buffer.size()) < n) buffer.resize(size_t(n));
    return buffer.data();
}

#ifdef KERNELS_X86

// Where a tile's weight rows o .. o + NO - 1 start: their codes, and their widened scales and mins.
template <int NO>
KERNELS_INLINE void tile_rows(const LinearArgs& a, int o, Widened t, const uint8_t* (&w)[NO], const float* (&scale)[NO],
                              const float* (&min)[NO]) {
    for (int n = 0; n < NO; ++n) {
        w[n] = static_cast<const uint8_t*>(a.w) + int64_t(o + n) * (a.n_in / 2);
        scale[n] = t.scale + n * t.groups;
        min[n] = t.min + n * t.groups;
    }
}

// The float16 scales and mins of output rows o .. o + NO - 1, widened once into float, before any
// tile of them runs (a tile is these rows times up to 4 rows of x). The loops below then read
// floats, as when the halves were widened at load time; widening each half where it is used would
// put a conversion into every group of every row, inside the loop that streams the codes.
template <class S, int NO>
KERNELS_INLINE Widened widen_tile(const LinearArgs& a, int o) {
    const int groups = a.n_in / a.group_size, n = NO * groups;
    float* out = tile_scratch(2 * int64_t(n));
    for (int part = 0; part < 2; ++part) {
        const uint16_t* in = (part == 0 ? a.group_scale : a.group_min) + int64_t(o) * groups;
        float* dst = out + part * n;
        int i = 0;
        for (; i + S::W <= n; i += S::W) S::store(dst + i, S::template load_as<DType::f16>(in, i));
        for (; i < n; ++i) dst[i] = f16_to_float(in[i]);
    }
    return {out, out + n, groups};
}

// The factored form on S's vectors (AVX2 for any number of rows of x, AVX512 for one): W bytes,
// 2W inputs, per step; vec.h's load_u8_split gives each byte whole and its low nibble.
template <class S, int NO, int R>
KERNELS_INLINE void int4_factored_tile(const LinearArgs& a, int o, int r0, Widened t) {
    using V = typename S::V;
    constexpr int W = S::W;
    const int n_in = a.n_in, G = a.group_size, groups = n_in / G;
    const uint8_t* w[NO];
    const float *scale[NO], *min[NO];
    tile_rows(a, o, t, w, scale, min);
    const float* x = a.xs + int64_t(r0) * n_in;
    const float* xsum = a.xsum + int64_t(r0) * groups;
    // The tile's codes are one contiguous run (its rows are consecutive), read at NO * W bytes a
    // step, and its scales and mins at NO halves a group: prefetch each at that pace.
    const uint8_t* front = w[0] + kPrefetchBytes;
    const uint16_t* scale_front = a.group_scale + int64_t(o) * groups + kPrefetchBytes * 2 / G;
    const uint16_t* min_front = a.group_min + int64_t(o) * groups + kPrefetchBytes * 2 / G;
    V acc[NO][R];
    for (int n = 0; n < NO; ++n)
        for (int r = 0; r < R; ++r) acc[n][r] = S::zero();

    for (int g = 0; g < groups; ++g) {
        prefetch(scale_front + NO * g);
        prefetch(min_front + NO * g);
        V part[NO][R];  // sum of code * x over the group
        for (int n = 0; n < NO; ++n)
            for (int r = 0; r < R; ++r) part[n][r] = S::zero();
        for (int i = g * G; i < (g + 1) * G; i += 2 * W) {
            prefetch(front + NO * (i / 2));
            V x_lo[R], x_byte[R];
            for (int r = 0; r < R; ++r) {
                x_lo[r] = S::load(x + int64_t(r) * n_in + i);
                KERNELS_IN_REGISTER(x_lo[r]);
                x_byte[r] = S::load(x + int64_t(r) * n_in + i + W);
                KERNELS_IN_REGISTER(x_byte[r]);
            }
            for (int n = 0; n < NO; ++n) {
                V byte, lo;
                S::load_u8_split(w[n] + i / 2, byte, lo);
                for (int r = 0; r < R; ++r) {
                    part[n][r] = S::fma(lo, x_lo[r], part[n][r]);
                    part[n][r] = S::fma(byte, x_byte[r], part[n][r]);
                }
            }
        }
        for (int n = 0; n < NO; ++n)
            for (int r = 0; r < R; ++r) acc[n][r] = S::fma(part[n][r], S::set1(scale[n][g]), acc[n][r]);
    }
    // The min term, sum_g min[g] * xsum[g], folded into the same register before its sum.
    for (int n = 0; n < NO; ++n)
        for (int r = 0; r < R; ++r) {
            const float* xs_r = xsum + int64_t(r) * groups;
            for (int g = 0; g < groups; g += W)
                acc[n][r] = S::fma(S::load_first(min[n] + g, groups - g), S::load_first(xs_r + g, groups - g),
                                   acc[n][r]);
            store_from_float(a.y, int64_t(r0 + r) * a.n_out + o + n, S::reduce_add(acc[n][r]), a.dtype);
        }
}

// Each ISA's int4_factored_tile as a function of its own, compiled for it (its target, all inlined
// into it, itself never inlined). Inlined together into one function per ISA, the same tiles
// measured up to 1.2x slower (AVX2, 4-16 rows of x): in one large function GCC allocated the
// registers of their loops worse (register copies in every step) and spilled around them.
template <class S>
struct Int4Tile;

template <>
struct Int4Tile<Avx2> {
    template <int NO, int R>
    KERNELS_AVX2 __attribute__((flatten, noinline)) static void run(const LinearArgs& a, int o, int r0, Widened t) {
        int4_factored_tile<Avx2, NO, R>(a, o, r0, t);
    }
};

template <>
struct Int4Tile<Avx512> {
    template <int NO, int R>
    KERNELS_AVX512 __attribute__((flatten, noinline)) static void run(const LinearArgs& a, int o, int r0, Widened t) {
        int4_factored_tile<Avx512, NO, R>(a, o, r0, t);
    }
};

// All rows of x for output rows o .. o + NO - 1 in the factored form: a tile's NO * R sums and
// NO * R accumulators within AVX2's 16 registers allow NO * R up to 4.
template <class S, int NO>
KERNELS_INLINE void int4_factored_rows(const LinearArgs& a, int o, Widened t) {
    if constexpr (NO == 4) {
        if (a.rows == 1) {
            Int4Tile<S>::template run<4, 1>(a, o, 0, t);
        } else {
            int4_factored_rows<S, 2>(a, o, t);
            int4_factored_rows<S, 2>(a, o + 2, t.rows_from(2));
        }
    } else {
        int r0 = 0;
        for (; r0 + 2 <= a.rows; r0 += 2) Int4Tile<S>::template run<NO, 2>(a, o, r0, t);
        if (r0 < a.rows) Int4Tile<S>::template run<NO, 1>(a, o, r0, t);
    }
}

KERNELS_AVX2 __attribute__((flatten)) void int4_range_avx2(const LinearArgs& a, int o0, int o1) {
    int o = o0;
    for (; o + 4 <= o1; o += 4) int4_factored_rows<Avx2, 4>(a, o, widen_tile<Avx2, 4>(a, o));
    for (; o < o1; ++o) int4_factored_rows<Avx2, 1>(a, o, widen_tile<Avx2, 1>(a, o));
}

// AVX512, several rows of x (on x deinterleaved, not transformed): dequantize each weight once,
// then one FMA per weight per row of x. Per group and weight row, a table of its 16 values,
// table[c] = min + scale * c (one FMA); the low nibble looks up its weight as it stands, the
// high one after a shift. (The factored form costs one FMA more per group and row of x, and
// measured slower from 2 rows on; dequantizing to an L1 buffer for a blocked matrix product
// measured slower still at these sizes.) AVX512's own: the lookup is one vpermps into 16 floats,
// where AVX2's indexes 8.
template <int NO, int R>
KERNELS_AVX512 inline void int4_tile_avx512(const LinearArgs& a, int o, int r0, Widened t) {
    const int n_in = a.n_in, G = a.group_size, groups = n_in / G;
    const uint8_t* w[NO];
    const float *scale[NO], *min[NO];
    tile_rows(a, o, t, w, scale, min);
    const float* x = a.xs + int64_t(r0) * n_in;
    const uint8_t* front = w[0] + kPrefetchBytes;  // as in int4_factored_tile
    const uint16_t* scale_front = a.group_scale + int64_t(o) * groups + kPrefetchBytes * 2 / G;
    const uint16_t* min_front = a.group_min + int64_t(o) * groups + kPrefetchBytes * 2 / G;
    const __m512 nibble_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[NO][R];
    for (int n = 0; n < NO; ++n)
        for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();

    for (int g = 0; g < groups; ++g) {
        prefetch(scale_front + NO * g);
        prefetch(min_front + NO * g);
        __m512 table[NO];
        for (int n = 0; n < NO; ++n)
            table[n] = _mm512_fmadd_ps(nibble_values, _mm512_set1_ps(scale[n][g]), _mm512_set1_ps(min[n][g]));
        for (int i = g * G; i < (g + 1) * G; i += 32) {
            prefetch(front + NO * (i / 2));
            __m512 x_even[R], x_odd[R];
            for (int r = 0; r < R; ++r) {
                x_even[r] = _mm512_loadu_ps(x + int64_t(r) * n_in + i);
                KERNELS_IN_REGISTER(x_even[r]);
                x_odd[r] = _mm512_loadu_ps(x + int64_t(r) * n_in + i + 16);
                KERNELS_IN_REGISTER(x_odd[r]);
            }
            for (int n = 0; n < NO; ++n) {
                __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[n] + i / 2)));
                __m512 lo = _mm512_permutexvar_ps(bytes, table[n]);
                __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table[n]);
                for (int r = 0; r < R; ++r) {
                    acc[n][r] = _mm512_fmadd_ps(lo, x_even[r], acc[n][r]);
                    acc[n][r] = _mm512_fmadd_ps(hi, x_odd[r], acc[n][r]);
                }
            }
        }
    }
    for (int n = 0; n < NO; ++n)
        for (int r = 0; r < R; ++r)
            store_from_float(a.y, int64_t(r0 + r) * a.n_out + o + n, Avx512::reduce_add(acc[n][r]), a.dtype);
}

// All rows of x for output rows o .. o + NO - 1, in tiles of up to 4 (NO * R accumulators,
// 2R vectors of x and NO tables: up to 28 of the 32 registers). A row's sums are the same in a
// tile of any R; batch-invariant, one row is a tile too, not the factored form.
template <int NO>
KERNELS_AVX512 inline void int4_rows_avx512(const LinearArgs& a, int o, Widened t) {
    if (a.rows == 1 && !a.invariant) return Int4Tile<Avx512>::run<NO, 1>(a, o, 0, t);  // the fewest instructions
    int r0 = 0;
    for (; r0 + 4 <= a.rows; r0 += 4) int4_tile_avx512<NO, 4>(a, o, r0, t);
    switch (a.rows - r0) {
        case 3: int4_tile_avx512<NO, 3>(a, o, r0, t); break;
        case 2: int4_tile_avx512<NO, 2>(a, o, r0, t); break;
        case 1: int4_tile_avx512<NO, 1>(a, o, r0, t); break;
        default: break;
    }
}

KERNELS_AVX512 void int4_range_avx512(const LinearArgs& a, int o0, int o1) {
    int o = o0;
    for (; o + 4 <= o1; o += 4) int4_rows_avx512<4>(a, o, widen_tile<Avx512, 4>(a, o));
    for (; o < o1; ++o) int4_rows_avx512<1>(a, o, widen_tile<Avx512, 1>(a, o));
}

// AVX512-BF16, several rows of bf16 x: a byte of codes holds weights 2j (low nibble) and 2j + 1
// (high), the very pair that vdpbf16ps multiplies with x[2j], x[2j + 1] as stored. So per group
// and weight row a table of its 16 values as bf16 (min + scale * c, in float, rounded once), and
// per byte a 32-bit index, low nibble in its low half and high nibble in its high half: vpermw
// turns it into the pair of weights, and each row of x then costs one vdpbf16ps per 32 weights,
// half the multiply-adds of the float tile above, with x's pairs as stored (no deinterleaving;
// x is only regrouped by steps of 32, int4_linear). Up to 8 rows of x share each dequantized
// vector, and the weights are read once for all of them.
// (The weights are rounded to bf16, as a dense bf16 copy of them is: the kernel is used only for
// bf16 activations, whose products vdpbf16ps computes exactly, summed in float.)
template <int NO, int R>
KERNELS_AVX512_BF16 inline void int4_dot_tile_bf16(const LinearArgs& a, int o, int r0, Widened t) {
    const int n_in = a.n_in, G = a.group_size, groups = n_in / G;
    const uint8_t* w[NO];
    const float *scale[NO], *min[NO];
    tile_rows(a, o, t, w, scale, min);
    const uint16_t* x = a.x_bf16 + int64_t(r0) * 32;  // x in steps (int4_linear): rows r0.. of step 0
    const int64_t x_step = int64_t(a.rows) * 32;
    const uint8_t* front = w[0] + kPrefetchBytes;  // as in int4_factored_tile
    const uint16_t* scale_front = a.group_scale + int64_t(o) * groups + kPrefetchBytes * 2 / G;
    const uint16_t* min_front = a.group_min + int64_t(o) * groups + kPrefetchBytes * 2 / G;
    const __m512 nibble_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i low_nibble = _mm512_set1_epi32(0x0000000f), high_nibble = _mm512_set1_epi32(0x000f0000);
    __m512 acc[NO][R];
    for (int n = 0; n < NO; ++n)
        for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();

    for (int g = 0; g < groups; ++g) {
        prefetch(scale_front + NO * g);
        prefetch(min_front + NO * g);
        __m512i table[NO];  // 16 bf16 values in the low half (vpermw indexes 32 words; ours are < 16)
        for (int n = 0; n < NO; ++n) {
            const __m512 values =
                _mm512_fmadd_ps(nibble_values, _mm512_set1_ps(scale[n][g]), _mm512_set1_ps(min[n][g]));
            table[n] = _mm512_castsi256_si512(__m256i(_mm512_cvtneps_pbh(values)));
        }
        for (int i = g * G; i < (g + 1) * G; i += 32) {
            prefetch(front + NO * (i / 2));
            __m512bh xv[R];
            const uint16_t* x_i = x + (i / 32) * x_step;
            for (int r = 0; r < R; ++r) xv[r] = __m512bh(_mm512_loadu_si512(x_i + r * 32));
            for (int n = 0; n < NO; ++n) {
                const __m512i bytes =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[n] + i / 2)));
                const __m512i index = _mm512_or_si512(_mm512_and_si512(bytes, low_nibble),
                                                      _mm512_and_si512(_mm512_slli_epi32(bytes, 12), high_nibble));
                const __m512bh pairs = __m512bh(_mm512_permutexvar_epi16(index, table[n]));
                for (int r = 0; r < R; ++r) acc[n][r] = _mm512_dpbf16_ps(acc[n][r], pairs, xv[r]);
            }
        }
    }
    for (int n = 0; n < NO; ++n)
        for (int r = 0; r < R; ++r)
            store_from_float(a.y, int64_t(r0 + r) * a.n_out + o + n, Avx512::reduce_add(acc[n][r]), a.dtype);
}

// All rows of x for output rows o .. o + NO - 1, in tiles of up to 8 rows (NO * R accumulators
// and R vectors of x within the 32 registers). Each accumulator sums one row in the same order
// whatever the tile and NO: batch-invariant as it stands, one row included.
template <int NO>
KERNELS_AVX512_BF16 inline void int4_dot_rows_bf16(const LinearArgs& a, int o, Widened t) {
    int r0 = 0;
    for (; r0 + 8 <= a.rows; r0 += 8) int4_dot_tile_bf16<NO, 8>(a, o, r0, t);
    switch (a.rows - r0) {
        case 7: int4_dot_tile_bf16<NO, 7>(a, o, r0, t); break;
        case 6: int4_dot_tile_bf16<NO, 6>(a, o, r0, t); break;
        case 5: int4_dot_tile_bf16<NO, 5>(a, o, r0, t); break;
        case 4: int4_dot_tile_bf16<NO, 4>(a, o, r0, t); break;
        case 3: int4_dot_tile_bf16<NO, 3>(a, o, r0, t); break;
        case 2: int4_dot_tile_bf16<NO, 2>(a, o, r0, t); break;
        case 1: int4_dot_tile_bf16<NO, 1>(a, o, r0, t); break;
        default: break;
    }
}

KERNELS_AVX512_BF16 void int4_dot_range_bf16(const LinearArgs& a, int o0, int o1) {
    int o = o0;
    // Up to 4 rows of x, 4 weight rows a tile: 16 chains of vdpbf16ps, and each vector of x serves
    // 4 (measured at 2-4 rows: 1.0-1.2x the float tiles, where 2 weight rows a tile made 0.8-1.1x);
    // more rows of x, 2 weight rows a tile, to keep 8 rows' accumulators in registers.
    if (a.rows <= 4)
        for (; o + 4 <= o1; o += 4) int4_dot_rows_bf16<4>(a, o, widen_tile<Avx512, 4>(a, o));
    for (; o + 2 <= o1; o += 2) int4_dot_rows_bf16<2>(a, o, widen_tile<Avx512, 2>(a, o));
    for (; o < o1; ++o) int4_dot_rows_bf16<1>(a, o, widen_tile<Avx512, 1>(a, o));
}

#endif  // KERNELS_X86

// --- int8 and bf16: one weight per element, read as stored ------------------------------------
// The same kernel for both: each weight is widened to float as it arrives and multiplied into x.
// int8 codes are sign-extended and converted (the row's scale is applied once, to the sum); a
// bf16 weight is the top half of its float, so a 16-bit shift widens it, exactly. A format says
// how to widen a vector of its elements on S (Int8Rows, Bf16Rows); the tiles below are written
// once, for every vector width. (Into an argument, not returned: a vector returned from a function
// with no target attribute is an ABI change GCC warns about.)

struct Int8Rows {
    using T = int8_t;
    template <class S>
    KERNELS_INLINE static void load(const T* w, typename S::V& v) {
        v = S::load_i8(w);
    }
};

struct Bf16Rows {
    using T = uint16_t;
    template <class S>
    KERNELS_INLINE static void load(const T* w, typename S::V& v) {
        v = S::template load_as<DType::bf16>(w, 0);
    }
};

// Weight i of a row, widened alone: the portable path's, and a SIMD row's last few.
template <class F>
KERNELS_INLINE float widen(const typename F::T* w, int i) {
    float v;
    F::template load<Scalar>(w + i, v);
    return v;
}

// y[r, o] = sum * scale[o] for int8, the sum itself for bf16 (no scale).
KERNELS_INLINE void store_row_output(const LinearArgs& a, int r, int o, float sum) {
    store_from_float(a.y, int64_t(r) * a.n_out + o, a.scale ? sum * a.scale[o] : sum, a.dtype);
}

// Portable C++ on lanes of 16, as int4_range_scalar, which the compiler vectorises; vec.h's
// Scalar, one lane, would leave it chains of scalar FMAs, summed in another order.
template <class F>
void rows_range_scalar(const LinearArgs& a, int o0, int o1) {
    const int n_in = a.n_in;
    for (int o = o0; o < o1; ++o) {
        const typename F::T* w = static_cast<const typename F::T*>(a.w) + int64_t(o) * n_in;
        for (int r = 0; r < a.rows; ++r) {
            const float* x = a.xs + int64_t(r) * n_in;
            float acc[kScalarLanes] = {};
            int i = 0;
            for (; i + kScalarLanes <= n_in; i += kScalarLanes)
                for (int j = 0; j < kScalarLanes; ++j) acc[j] += widen<F>(w, i + j) * x[i + j];
            float sum = 0.f;
            for (int j = 0; j < kScalarLanes; ++j) sum += acc[j];
            for (; i < n_in; ++i) sum += widen<F>(w, i) * x[i];
            store_row_output(a, r, o, sum);
        }
    }
}

#ifdef KERNELS_X86

// The tile's rows are one contiguous run of NO * n_in elements, read at NO * STEP elements a
// step: its prefetch front moves at that pace, one cache line per 64 bytes.
template <class F, int NO, int STEP>
KERNELS_INLINE void prefetch_step(const char* front, int i) {
    constexpr int bytes = NO * STEP * int(sizeof(typename F::T));
    for (int b = 0; b < bytes; b += 64) prefetch(front + int64_t(NO) * i * int(sizeof(typename F::T)) + b);
}

// One step of W inputs: acc[n][r] += w[n][i..] * x[r][i..].
template <class S, class F, int NO, int R>
KERNELS_INLINE void rows_step(typename S::V (&acc)[NO][R], const typename F::T* const* w, const float* x, int n_in,
                              int i) {
    typename S::V xv[R];
    for (int r = 0; r < R; ++r) {
        xv[r] = S::load(x + int64_t(r) * n_in + i);
        KERNELS_IN_REGISTER(xv[r]);
    }
    for (int n = 0; n < NO; ++n) {
        typename S::V wv;
        F::template load<S>(w[n] + i, wv);
        for (int r = 0; r < R; ++r) acc[n][r] = S::fma(wv, xv[r], acc[n][r]);
    }
}

// With one row of x, two sets of accumulators (alternate steps) keep 2 * NO chains in flight.
template <class S, class F, int NO, int R>
KERNELS_INLINE void rows_tile(const LinearArgs& a, int o, int r0) {
    using V = typename S::V;
    constexpr int W = S::W, A = R == 1 ? 2 : 1;
    const int n_in = a.n_in;
    const typename F::T* w[NO];
    for (int n = 0; n < NO; ++n) w[n] = static_cast<const typename F::T*>(a.w) + int64_t(o + n) * n_in;
    const float* x = a.xs + int64_t(r0) * n_in;
    const char* front = reinterpret_cast<const char*>(w[0]) + kPrefetchBytes;
    V acc[A][NO][R];
    for (int k = 0; k < A; ++k)
        for (int n = 0; n < NO; ++n)
            for (int r = 0; r < R; ++r) acc[k][n][r] = S::zero();
    int i = 0;
    for (; i + W * A <= n_in; i += W * A)
        for (int k = 0; k < A; ++k) {
            prefetch_step<F, NO, W>(front, i + W * k);
            rows_step<S, F, NO, R>(acc[k], w, x, n_in, i + W * k);
        }
    for (; i + W <= n_in; i += W) rows_step<S, F, NO, R>(acc[0], w, x, n_in, i);
    for (int n = 0; n < NO; ++n)
        for (int r = 0; r < R; ++r) {
            const V s = A == 2 ? S::add(acc[0][n][r], acc[A - 1][n][r]) : acc[0][n][r];
            float sum = S::reduce_add(s);
            for (int j = i; j < n_in; ++j) sum += widen<F>(w[n], j) * x[int64_t(r) * n_in + j];
            store_row_output(a, r0 + r, o + n, sum);
        }
}

// Each ISA's rows_tile as a function of its own, compiled for it, as Int4Tile: inlined together,
// the tiles measured up to 1.1x slower on small matrices (AVX512 bf16 and int8), their set-up and
// sums spilling registers, and a tile of a few dozen steps is much of those.
template <class S>
struct RowsTile;

template <>
struct RowsTile<Avx2> {
    template <class F, int NO, int R>
    KERNELS_AVX2 __attribute__((flatten, noinline)) static void run(const LinearArgs& a, int o, int r0) {
        rows_tile<Avx2, F, NO, R>(a, o, r0);
    }
};

template <>
struct RowsTile<Avx512> {
    template <class F, int NO, int R>
    KERNELS_AVX512 __attribute__((flatten, noinline)) static void run(const LinearArgs& a, int o, int r0) {
        rows_tile<Avx512, F, NO, R>(a, o, r0);
    }
};

// The last rows of x, fewer than R + 1: one tile of them.
template <class S, class F, int NO, int R>
KERNELS_INLINE void rows_rest(const LinearArgs& a, int o, int r0) {
    if constexpr (R > 0) {
        if (a.rows - r0 == R) return RowsTile<S>::template run<F, NO, R>(a, o, r0);
        rows_rest<S, F, NO, R - 1>(a, o, r0);
    }
}

// All rows of x for output rows o .. o + NO - 1, in tiles of up to registers / 8 rows (AVX2 2,
// AVX512 4): at NO = 4, the NO * R accumulators, R vectors of x and a weight vector fit.
// Batch-invariant, every row of x is a tile of one row: the form (two accumulators) a lone row gets.
template <class S, class F, int NO>
KERNELS_INLINE void rows_tiles(const LinearArgs& a, int o) {
    constexpr int RM = S::registers / 8;
    int r0 = 0;
    for (; r0 < a.rows && a.invariant; ++r0) RowsTile<S>::template run<F, NO, 1>(a, o, r0);
    for (; r0 + RM <= a.rows; r0 += RM) RowsTile<S>::template run<F, NO, RM>(a, o, r0);
    rows_rest<S, F, NO, RM - 1>(a, o, r0);
}

template <class S, class F>
KERNELS_INLINE void rows_range(const LinearArgs& a, int o0, int o1) {
    int o = o0;
    for (; o + 4 <= o1; o += 4) rows_tiles<S, F, 4>(a, o);
    for (; o < o1; ++o) rows_tiles<S, F, 1>(a, o);
}

template <class F>
KERNELS_AVX2 __attribute__((flatten)) void rows_range_avx2(const LinearArgs& a, int o0, int o1) {
    rows_range<Avx2, F>(a, o0, o1);
}

template <class F>
KERNELS_AVX512 __attribute__((flatten)) void rows_range_avx512(const LinearArgs& a, int o0, int o1) {
    rows_range<Avx512, F>(a, o0, o1);
}

// AVX512-BF16, bf16 weights and bf16 x: vdpbf16ps multiplies 32 pairs of halves as they are
// stored and adds each pair's two products into one of 16 float lanes. No widening, and half the
// multiply-add instructions of the path above; the products are exact (8-bit mantissas), the sums
// float32 as there, in another order. x is read as stored (a.x_bf16), not converted.
template <int NO, int R>
KERNELS_AVX512_BF16 inline void dot_tile_bf16(const LinearArgs& a, int o, int r0) {
    constexpr int A = R == 1 ? 2 : 1;
    const int n_in = a.n_in;
    const uint16_t* w[NO];
    for (int n = 0; n < NO; ++n) w[n] = static_cast<const uint16_t*>(a.w) + int64_t(o + n) * n_in;
    const uint16_t* x = a.x_bf16 + int64_t(r0) * n_in;
    const char* front = reinterpret_cast<const char*>(w[0]) + kPrefetchBytes;
    __m512 acc[A][NO][R];
    for (int k = 0; k < A; ++k)
        for (int n = 0; n < NO; ++n)
            for (int r = 0; r < R; ++r) acc[k][n][r] = _mm512_setzero_ps();
    // A step of 32 inputs; the last one masked (the lanes past n_in load as zeros).
    for (int i = 0, k = 0; i < n_in; i += 32, k = (k + 1) % A) {
        const __mmask32 m = n_in - i >= 32 ? ~__mmask32(0) : __mmask32((1u << (n_in - i)) - 1);
        prefetch_step<Bf16Rows, NO, 32>(front, i);
        __m512bh xv[R];
        for (int r = 0; r < R; ++r) {
            xv[r] = __m512bh(_mm512_maskz_loadu_epi16(m, x + int64_t(r) * n_in + i));
            KERNELS_IN_REGISTER(xv[r]);
        }
        for (int n = 0; n < NO; ++n) {
            const __m512bh wv = __m512bh(_mm512_maskz_loadu_epi16(m, w[n] + i));
            for (int r = 0; r < R; ++r) acc[k][n][r] = _mm512_dpbf16_ps(acc[k][n][r], wv, xv[r]);
        }
    }
    for (int n = 0; n < NO; ++n)
        for (int r = 0; r < R; ++r) {
            __m512 s = A == 2 ? _mm512_add_ps(acc[0][n][r], acc[A - 1][n][r]) : acc[0][n][r];
            store_row_output(a, r0 + r, o + n, Avx512::reduce_add(s));
        }
}

template <int NO>
KERNELS_AVX512_BF16 inline void dot_rows_bf16(const LinearArgs& a, int o) {
    int r0 = 0;
    for (; r0 < a.rows && a.invariant; ++r0) dot_tile_bf16<NO, 1>(a, o, r0);  // as rows_tiles
    for (; r0 + 4 <= a.rows; r0 += 4) dot_tile_bf16<NO, 4>(a, o, r0);
    switch (a.rows - r0) {
        case 3: dot_tile_bf16<NO, 3>(a, o, r0); break;
        case 2: dot_tile_bf16<NO, 2>(a, o, r0); break;
        case 1: dot_tile_bf16<NO, 1>(a, o, r0); break;
        default: break;
    }
}

KERNELS_AVX512_BF16 void dot_range_bf16(const LinearArgs& a, int o0, int o1) {
    int o = o0;
    for (; o + 4 <= o1; o += 4) dot_rows_bf16<4>(a, o);
    for (; o < o1; ++o) dot_rows_bf16<1>(a, o);
}

#endif  // KERNELS_X86

// Splits the output rows in contiguous slices, one per thread, in whole tiles of 4 rows.
void run_linear(void (*fn)(const LinearArgs&, int, int), const LinearArgs& a) {
    const int64_t macs = int64_t(a.rows) * a.n_in * a.n_out;
    if (macs <= kParallelMacs || omp_get_max_threads() == 1) {
        fn(a, 0, a.n_out);
        return;
    }
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t tiles = (a.n_out + 3) / 4;
        const int begin = int(std::min<int64_t>(a.n_out, tiles * t / nt * 4));
        const int end = int(std::min<int64_t>(a.n_out, tiles * (t + 1) / nt * 4));
        if (begin < end) fn(a, begin, end);
    }
}

// The calling thread's float scratch for x: grown once, then reused by every call.
float* x_scratch(int64_t n) {
    thread_local std::vector<float> buffer;
    if (int64_t(buffer.size()) < n) buffer.resize(size_t(n));
    return buffer.data();
}

// int8 and bf16 (F: Int8Rows, Bf16Rows) on x widened to float: the tiles of this CPU's level.
template <class F>
void rows_linear(void* y, const void* x, const typename F::T* w, const float* scale, int rows, int n_in, int n_out,
                 DType dtype) {
    const Isa level = isa();
    float* xs = x_scratch(int64_t(rows) * n_in);
    prepare_x(xs, nullptr, x, rows, n_in, 0, dtype, level, 1, false);
    const LinearArgs args{y, xs, nullptr, nullptr, w, scale, nullptr, nullptr, rows, n_in, n_out, 0, dtype};
    auto fn = rows_range_scalar<F>;
#ifdef KERNELS_X86
    if (level >= Isa::avx512) fn = rows_range_avx512<F>;
    else if (level == Isa::avx2) fn = rows_range_avx2<F>;
#endif
    run_linear(fn, args);
}

}  // namespace

void int4_linear(void* y, const void* x, const uint8_t* packed, const uint16_t* scale, const uint16_t* min, int rows,
                 int n_in, int n_out, int group_size, DType dtype) {
    if (gemm_applies(rows)) return int4_gemm(y, x, packed, scale, min, rows, n_in, n_out, group_size, dtype);
    const Isa level = isa();
#ifdef KERNELS_X86
    // bf16 x with AVX512-BF16: several rows (or, batch-invariant, any) take the bf16 dot kernel,
    // on x's bf16 pairs as they come; one row keeps the float factored form, the fastest at one row.
    if (level == Isa::avx512_bf16 && dtype == DType::bf16 && (rows > 1 || batch_invariant())) {
        // x rearranged by steps of 32 inputs, [n_in / 32][rows][32]: a tile's rows of one step are
        // one contiguous run, addressed from one pointer (8 row pointers crowded the registers).
        uint16_t* x_steps = reinterpret_cast<uint16_t*>(x_scratch((int64_t(rows) * n_in + 1) / 2));
        const auto* x_bf16 = static_cast<const uint16_t*>(x);
        for (int r = 0; r < rows; ++r)
            for (int i = 0; i < n_in; i += 32)
                std::copy_n(x_bf16 + int64_t(r) * n_in + i, 32, x_steps + (int64_t(i / 32) * rows + r) * 32);
        const LinearArgs args{y,   nullptr, x_steps, nullptr, packed,     nullptr, scale,
                              min, rows,    n_in,    n_out,   group_size, dtype};
        return run_linear(int4_dot_range_bf16, args);
    }
#endif
    const int lanes = level >= Isa::avx512 ? 16 : level == Isa::avx2 ? 8 : kScalarLanes;
    const int64_t n = int64_t(rows) * n_in;
    float* xs = x_scratch(n + int64_t(rows) * (n_in / group_size));
    float* xsum = xs + n;
    const LinearArgs args{y, xs, nullptr, xsum, packed, nullptr, scale, min, rows, n_in, n_out, group_size, dtype};
    // The factored form everywhere but in AVX512's kernel for several rows of x (or, batch-invariant,
    // for any: the switch read once, into args, so that x is prepared for the form the kernel takes).
    const bool factored = level < Isa::avx512 || (rows == 1 && !args.invariant);
    prepare_x(xs, xsum, x, rows, n_in, group_size, dtype, level, lanes, factored);
    auto fn = int4_range_scalar;
#ifdef KERNELS_X86
    if (level >= Isa::avx512) fn = int4_range_avx512;
    else if (level == Isa::avx2) fn = int4_range_avx2;
#endif
    run_linear(fn, args);
}

void int8_linear(void* y, const void* x, const int8_t* q, const float* scale, int rows, int n_in, int n_out,
                 DType dtype) {
    if (gemm_applies(rows)) return int8_gemm(y, x, q, scale, rows, n_in, n_out, dtype);
    rows_linear<Int8Rows>(y, x, q, scale, rows, n_in, n_out, dtype);
}

void bf16_linear(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, DType dtype) {
    if (gemm_applies(rows)) return bf16_gemm(y, x, w, rows, n_in, n_out, dtype);
#ifdef KERNELS_X86
    if (isa() == Isa::avx512_bf16 && dtype == DType::bf16) {
        const auto* x_bf16 = static_cast<const uint16_t*>(x);
        const LinearArgs args{y, nullptr, x_bf16, nullptr, w, nullptr, nullptr, nullptr, rows, n_in, n_out, 0, dtype};
        return run_linear(dot_range_bf16, args);
    }
#endif
    rows_linear<Bf16Rows>(y, x, w, nullptr, rows, n_in, n_out, dtype);
}

}  // namespace kernels::cpu

KERNELS_VECTOR_CODE_END
