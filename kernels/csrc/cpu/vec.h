// SIMD vectors of floats, three widths behind one interface, so that a kernel is written once
// and compiled for each instruction set: Scalar (1 lane, portable C++), Avx2 (8 lanes, __m256)
// and Avx512 (16 lanes, __m512). Each loads and stores any DType, widening to float on load and
// rounding once on store, which is how every kernel here computes; and loads the weight codes of
// the quantized linear layers (int8, and the bytes of int4 pairs) as floats.
//
// How one source serves three instruction sets without -march: the library is compiled for
// baseline x86-64, so AVX instructions may only appear in functions marked
// __attribute__((target(...))), and only run after isa() has said the CPU has them. The
// members of Avx2 / Avx512 carry that attribute. A kernel is a template over the vector type,
// marked KERNELS_INLINE (always_inline, no target of its own), and is only ever called from a
// small entry function carrying the target and `flatten`: the template's body is compiled inside
// that entry, with its instruction set, and `flatten` inlines the vector members into it. At -O0
// the members stay calls, but calls between functions of the same target, which is correct.
// (A template with a target attribute would not do: every instantiation would get the same one.)
#pragma once

#include <cmath>
#include <cstdint>

#include "bf16.h"

#if defined(__x86_64__) || defined(_M_X64)
#define KERNELS_X86 1
#include <immintrin.h>
#endif

#define KERNELS_INLINE inline __attribute__((always_inline))
#define KERNELS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KERNELS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
// AVX512 with the BF16 extension (vdpbf16ps: Cooper Lake, Sapphire Rapids, Zen 4 on).
#define KERNELS_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

// Vector code is compiled with three warnings off, between KERNELS_VECTOR_CODE_BEGIN and _END:
// this header's, and each kernel file's after its includes, so that no other code loses them.
// -Wpsabi: an AVX value passed between these functions changes the calling convention compared
// with baseline code; GCC warns about it for the templates above, which never exist outside an
// entry of the right target. -W(maybe-)uninitialized: GCC 12's AVX512 headers build "undefined"
// registers as `__m512 __Y = __Y;`, which -Wall reports wherever such an intrinsic is inlined.
// clang-format off
#define KERNELS_VECTOR_CODE_BEGIN                                  \
    _Pragma("GCC diagnostic push")                                 \
    _Pragma("GCC diagnostic ignored \"-Wpsabi\"")                  \
    _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")          \
    _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define KERNELS_VECTOR_CODE_END _Pragma("GCC diagnostic pop")
// clang-format on

KERNELS_VECTOR_CODE_BEGIN

namespace kernels::cpu {

// n elements of type D from element `offset` of `base` on, asked for a cache line at a time: a
// hint for reads the hardware prefetchers would miss (short pieces scattered over a pool or a slot
// table); it never faults and changes no result.
template <DType D>
KERNELS_INLINE void prefetch_elements(const void* base, int64_t offset, int64_t n) {
    constexpr int64_t bytes = D == DType::f32 ? 4 : 2;
    const char* at = static_cast<const char*>(base) + offset * bytes;
    for (int64_t b = 0; b < n * bytes; b += 64) __builtin_prefetch(at + b);
}

struct Scalar {
    using V = float;
    static constexpr int W = 1;
    static V zero() { return 0.f; }
    static V set1(float a) { return a; }
    static V load(const float* p) { return *p; }
    static void store(float* p, V v) { *p = v; }
    template <DType D>
    static V load_as(const void* p, int64_t i) {
        return load_as_float<D>(p, i);
    }
    template <DType D>
    static void store_as(void* p, int64_t i, V v) {
        store_from_float<D>(p, i, v);
    }
    // The first min(n, W) floats at p, zeros past them: a loop's last, partial vector.
    static V load_first(const float* p, int n) { return n > 0 ? *p : 0.f; }
    static V load_i8(const int8_t* p) { return float(*p); }
    // W bytes as floats, whole and their low nibble: an int4 byte holds two codes (quant_linear.cpp)
    static void load_u8_split(const uint8_t* p, V& whole, V& low) {
        whole = float(*p);
        low = float(*p & 15);
    }
    static V add(V a, V b) { return a + b; }
    static V mul(V a, V b) { return a * b; }
    static V fma(V a, V b, V c) { return a * b + c; }   // a * b + c
    static V fnma(V a, V b, V c) { return c - a * b; }  // c - a * b
    static float reduce_add(V a) { return a; }
    static V reduce_each(const V* a) { return a[0]; }
    static void transpose(V*) {}  // one lane: a 1 x 1 block is its own transpose
    static V sub(V a, V b) { return a - b; }
    static V div(V a, V b) { return a / b; }
    static V min(V a, V b) { return a < b ? a : b; }
    static V max(V a, V b) { return a > b ? a : b; }
    static float reduce_max(V a) { return a; }
    static V exp(V x) { return std::exp(x); }
};

// e^x in SIMD, for the softmax weights exp(score - max), which are <= 0: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its Taylor polynomial to r^6 (relative error about 1e-7, a float's
// rounding), times 2^n put into the exponent. x is clamped at -87, where e^x (1.6e-38) is still
// a normal float and 2^n needs no special case; a weight that small is 0 to any sum it joins.
namespace exp_consts {
constexpr float lowest = -87.f, log2e = 1.44269504f;
constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;  // ln2_hi * n is exact for |n| < 2^9
constexpr float c2 = 1.f / 2, c3 = 1.f / 6, c4 = 1.f / 24, c5 = 1.f / 120, c6 = 1.f / 720;
}  // namespace exp_consts

#ifdef KERNELS_X86

struct Avx2 {
    using V = __m256;
    static constexpr int W = 8;
    static constexpr int registers = 16;  // vector registers: what sizes a tile of accumulators
    KERNELS_AVX2 static V zero() { return _mm256_setzero_ps(); }
    KERNELS_AVX2 static V set1(float a) { return _mm256_set1_ps(a); }
    KERNELS_AVX2 static V load(const float* p) { return _mm256_loadu_ps(p); }
    // p[0], p[stride], ..., p[7 stride]: a column of a matrix (stride < 2^31 / 8)
    KERNELS_AVX2 static V gather(const float* p, int64_t stride) {
        const __m256i at =
            _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int(stride)));
        return _mm256_i32gather_ps(p, at, 4);
    }
    KERNELS_AVX2 static void store(float* p, V v) { _mm256_storeu_ps(p, v); }

    template <DType D>
    KERNELS_AVX2 static V load_as(const void* p, int64_t i) {
        if constexpr (D == DType::f32) {
            return _mm256_loadu_ps(static_cast<const float*>(p) + i);
        } else {
            __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
            if constexpr (D == DType::f16) return _mm256_cvtph_ps(h);
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16: the top half
        }
    }

    template <DType D>
    KERNELS_AVX2 static void store_as(void* p, int64_t i, V v) {
        if constexpr (D == DType::f32) {
            _mm256_storeu_ps(static_cast<float*>(p) + i, v);
        } else {
            __m128i h;
            if constexpr (D == DType::f16) {
                h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            } else {  // float_to_bf16 (bf16.h), eight at a time
                __m256i u = _mm256_castps_si256(v);
                __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
                __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
                __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
                __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
                __m256i r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(nan),
                                                                 _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
                h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // 32 -> 16 bits
            }
            _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
        }
    }

    KERNELS_AVX2 static V load_first(const float* p, int n) {
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
    }
    KERNELS_AVX2 static V load_i8(const int8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    KERNELS_AVX2 static void load_u8_split(const uint8_t* p, V& whole, V& low) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        whole = _mm256_cvtepi32_ps(bytes);
        low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
    }
    // W bytes as floats, their low nibbles and their high ones (gemm.cpp's dequantized panels)
    KERNELS_AVX2 static void load_u8_nibbles(const uint8_t* p, V& low, V& high) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
        high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    }

    KERNELS_AVX2 static V add(V a, V b) { return _mm256_add_ps(a, b); }
    KERNELS_AVX2 static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    KERNELS_AVX2 static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    KERNELS_AVX2 static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
    KERNELS_AVX2 static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    KERNELS_AVX2 static V div(V a, V b) { return _mm256_div_ps(a, b); }
    KERNELS_AVX2 static V min(V a, V b) { return _mm256_min_ps(a, b); }
    KERNELS_AVX2 static V max(V a, V b) { return _mm256_max_ps(a, b); }
    KERNELS_AVX2 static float reduce_max(V a) {
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    KERNELS_AVX2 static V exp(V x) {
        using namespace exp_consts;
        x = _mm256_max_ps(x, _mm256_set1_ps(lowest));
        const V n =
            _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        V r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ln2_hi), x);
        r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ln2_lo), r);
        V p = _mm256_fmadd_ps(_mm256_set1_ps(c6), r, _mm256_set1_ps(c5));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c4));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c2));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
        // times 2^n: n added to the exponent field
        const __m256i exponent = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
        return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), exponent));
    }
    KERNELS_AVX2 static float reduce_add(V a) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    // W horizontal sums at once, lane j = reduce_add(a[j]): one tree of shuffles and adds for all,
    // 21 instructions instead of ~56. Pairs interleaved by 32-bit elements and added, then by
    // 64-bit ones (each 128-bit lane then holds 4 vectors' partial sums), then the two lanes added.
    KERNELS_AVX2 static V reduce_each(const V* a) {
        V b[4], c[2];
        for (int i = 0; i < 4; ++i)
            b[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
        for (int i = 0; i < 2; ++i) {
            const __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(b[2 * i]), _mm256_castps_pd(b[2 * i + 1]));
            const __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(b[2 * i]), _mm256_castps_pd(b[2 * i + 1]));
            c[i] = _mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));
        }
        return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
    }
    // a[j] lane i <-> a[i] lane j (an 8 x 8 block of floats transposed, in registers): in each 128-bit
    // lane 4 x 4 blocks by unpacks and shuffles, then the lanes swapped across vectors. 24 shuffles,
    // where reading a column takes a gather (8 loads each, slow on AMD's cores).
    KERNELS_AVX2 static void transpose(V* a) {
        V t[8], u[8];
        for (int i = 0; i < 4; ++i) {
            t[2 * i] = _mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]);
        }
        for (int i = 0; i < 2; ++i) {  // u[4 i + k], lane l: column 4 l + k of rows 4 i .. 4 i + 3
            u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
            u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
            u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
            u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
        }
        for (int k = 0; k < 4; ++k) {
            a[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
            a[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
        }
    }
};

struct Avx512 {
    using V = __m512;
    static constexpr int W = 16;
    static constexpr int registers = 32;
    KERNELS_AVX512 static V zero() { return _mm512_setzero_ps(); }
    KERNELS_AVX512 static V set1(float a) { return _mm512_set1_ps(a); }
    KERNELS_AVX512 static V load(const float* p) { return _mm512_loadu_ps(p); }
    // p[0], p[stride], ..., p[15 stride]: a column of a matrix (stride < 2^31 / 16)
    KERNELS_AVX512 static V gather(const float* p, int64_t stride) {
        const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(int(stride)));
        return _mm512_i32gather_ps(at, p, 4);
    }
    KERNELS_AVX512 static void store(float* p, V v) { _mm512_storeu_ps(p, v); }

    template <DType D>
    KERNELS_AVX512 static V load_as(const void* p, int64_t i) {
        if constexpr (D == DType::f32) {
            return _mm512_loadu_ps(static_cast<const float*>(p) + i);
        } else {
            __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
            if constexpr (D == DType::f16) return _mm512_cvtph_ps(h);
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
    }

    template <DType D>
    KERNELS_AVX512 static void store_as(void* p, int64_t i, V v) {
        if constexpr (D == DType::f32) {
            _mm512_storeu_ps(static_cast<float*>(p) + i, v);
        } else {
            __m256i h;
            if constexpr (D == DType::f16) {
                h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            } else {  // float_to_bf16 (bf16.h), sixteen at a time
                __m512i u = _mm512_castps_si512(v);
                __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
                __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
                __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
                __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
                h = _mm512_cvtepi32_epi16(r);  // 32 -> 16 bits (the values fit)
            }
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i), h);
        }
    }

    KERNELS_AVX512 static V load_first(const float* p, int n) {
        return _mm512_maskz_loadu_ps(n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1), p);
    }
    KERNELS_AVX512 static V load_i8(const int8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    // vpermps reads only the low 4 bits of each lane's index: a lookup in (0, 1, .., 15) turns a
    // widened byte into its low nibble as a float in one instruction.
    KERNELS_AVX512 static void load_u8_split(const uint8_t* p, V& whole, V& low) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        whole = _mm512_cvtepi32_ps(bytes);
        low = _mm512_permutexvar_ps(bytes, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    }
    KERNELS_AVX512 static void load_u8_nibbles(const uint8_t* p, V& low, V& high) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
        high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    }

    KERNELS_AVX512 static V add(V a, V b) { return _mm512_add_ps(a, b); }
    KERNELS_AVX512 static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    KERNELS_AVX512 static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    KERNELS_AVX512 static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
    KERNELS_AVX512 static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    KERNELS_AVX512 static V div(V a, V b) { return _mm512_div_ps(a, b); }
    KERNELS_AVX512 static V min(V a, V b) { return _mm512_min_ps(a, b); }
    KERNELS_AVX512 static V max(V a, V b) { return _mm512_max_ps(a, b); }
    KERNELS_AVX512 static float reduce_max(V a) { return _mm512_reduce_max_ps(a); }
    KERNELS_AVX512 static V exp(V x) {
        using namespace exp_consts;
        x = _mm512_max_ps(x, _mm512_set1_ps(lowest));
        const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(log2e)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        V r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ln2_hi), x);
        r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ln2_lo), r);
        V p = _mm512_fmadd_ps(_mm512_set1_ps(c6), r, _mm512_set1_ps(c5));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c4));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c2));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
        return _mm512_scalef_ps(p, n);  // p * 2^n
    }
    KERNELS_AVX512 static float reduce_add(V a) {
        __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    // lane j = reduce_add(a[j]), as Avx2's, then two more levels across the four 128-bit lanes:
    // 45 instructions instead of ~140.
    KERNELS_AVX512 static V reduce_each(const V* a) {
        V b[8], c[4], d[2];
        for (int i = 0; i < 8; ++i)
            b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
        for (int i = 0; i < 4; ++i) {
            const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
            const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
            c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
        }
        // 128-bit lanes 0, 2 and 1, 3 of two vectors side by side, added: neighbouring lanes summed
        constexpr int even = 0b10001000, odd = 0b11011101;
        for (int i = 0; i < 2; ++i)
            d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], even),
                                 _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], odd));
        return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], even), _mm512_shuffle_f32x4(d[0], d[1], odd));
    }
    // a[j] lane i <-> a[i] lane j, 16 x 16 floats: Avx2's 4 x 4 blocks in each 128-bit lane, then
    // the lanes gathered across vectors in two rounds of shuffle_f32x4. 64 shuffles for 256 floats.
    KERNELS_AVX512 static void transpose(V* a) {
        V t[16], u[16];
        for (int i = 0; i < 8; ++i) {
            t[2 * i] = _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]);
        }
        for (int i = 0; i < 4; ++i) {  // u[4 i + k], lane l: column 4 l + k of rows 4 i .. 4 i + 3
            u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
            u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
            u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
            u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
        }
        constexpr int low = 0b01000100, high = 0b11101110, even = 0b10001000, odd = 0b11011101;
        for (int k = 0; k < 4; ++k) {  // column 4 l + k: lane l of u[k], u[4 + k], u[8 + k], u[12 + k]
            const V v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], low), v1 = _mm512_shuffle_f32x4(u[k], u[4 + k], high);
            const V w0 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], low);
            const V w1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], high);
            a[k] = _mm512_shuffle_f32x4(v0, w0, even);
            a[4 + k] = _mm512_shuffle_f32x4(v0, w0, odd);
            a[8 + k] = _mm512_shuffle_f32x4(v1, w1, even);
            a[12 + k] = _mm512_shuffle_f32x4(v1, w1, odd);
        }
    }
};

#endif  // KERNELS_X86

}  // namespace kernels::cpu

KERNELS_VECTOR_CODE_END
