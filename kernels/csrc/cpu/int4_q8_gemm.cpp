// int4 weights times x quantized to int8: the matrix product in integers, as llama.cpp's Q4_1 x Q8
// dot products do it, for bf16 x of any number of rows.
//
// gemm.cpp turns every weight into a float and multiplies in float32: 8 multiply-adds an AVX2
// instruction, 16 an AVX512 one. Integers go further per instruction: vpmaddubsw multiplies 32
// unsigned bytes by 32 signed ones and adds neighbours (32 multiply-adds, AVX2), vpdpbusd (VNNI)
// does 64 on AVX512 and adds them into its sums. A 4-bit code is already a small unsigned integer;
// x becomes one by quantizing each block of 32 inputs of a row to int8 with a scale of its own:
//   dx = max|x| / 127,  xq = round(x / dx),  so  x ~ dx * xq   (|x - dx * xq| <= dx / 2)
// and with W = min + scale * code (Q4_1), one block of 32 inputs of output o and row r sums to
//   sum_k W[o,k] x[k] ~ scale[o] * dx * sum_k code[o,k] xq[k]  +  min[o] * sum_k x[k]
// the first sum exact in integers, the second over x as it is. Only bf16 x takes this road: its
// own rounding (1 part in 256) is of the size of the int8 step; float32 x stays on gemm.cpp's, and
// every engine result in float32 stays what --kernels off computes.
//
// The codes are laid out again, once, into tiles (int4_tiles): F outputs side by side, so that a
// vector holds 4 consecutive inputs of each of F outputs and the multiply-adds land in one output
// per 32-bit lane (an outer product: no horizontal sums), each block's scales and mins as F float16
// beside its codes. F = 8 for AVX2 (vpmaddubsw), 16 for AVX512 with VNNI (vpdpbusd), which every
// CPU with AVX512-BF16 has. A tile of one block, F outputs, kQ8TileBytes (20) * F bytes:
//   codes  16F bytes: part j (0..3) of 4F bytes, byte 4f + t: low nibble code(f, 8j + t),
//          high nibble code(f, 8j + 4 + t); so one load, masked and shifted, gives inputs 8j..8j+3
//          and 8j+4..8j+7 of all F outputs, 4 bytes an output: what vpmaddubsw / vpdpbusd pair
//          with x's 4 bytes broadcast.
//   scale  F float16, then min F float16 (the block's group's, as the checkpoint has them: widened
//          by the tile's one vcvtph2ps; as floats they cost a fifth more bytes, which a decode
//          row, reading every byte once, pays in full).
// AVX2 sums a block's products in 16 bits: each vpmaddubsw lane is at most 2 * 15 * 127 = 3810,
// and 8 of them (a block) at most 30480 < 32767; vpmaddwd then makes them 32-bit outputs.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "q8_tiles.h"
#include "vec.h"

KERNELS_VECTOR_CODE_BEGIN

namespace kernels::cpu {

namespace {

using q8::kBlock;
using Q8Args = q8::Args;

#ifdef KERNELS_X86

// The integer dot products of one ISA, for the tile below: F outputs a vector; dot() adds the
// products of 4 consecutive inputs of each output, codes (unsigned) times x (signed, 4 bytes
// broadcast), into its block sums; block_sums() turns them into F floats.
struct Avx2Dot {  // vpmaddubsw into 16-bit sums (a block's at most 8 x 3810), then vpmaddwd
    static constexpr int F = 8;
    using I = __m256i;
    using V = __m256;
    KERNELS_AVX2 static I zero() { return _mm256_setzero_si256(); }
    KERNELS_AVX2 static void codes(const uint8_t* p, I& lo, I& hi) {
        const I packed = _mm256_loadu_si256(reinterpret_cast<const I*>(p)), low4 = _mm256_set1_epi8(0x0F);
        lo = _mm256_and_si256(packed, low4);
        hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    }
    KERNELS_AVX2 static I dot(I sum, I codes, int32_t x) {
        I s = _mm256_add_epi16(sum, _mm256_maddubs_epi16(codes, _mm256_set1_epi32(x)));
        // An opaque use: the sums stay a chain in registers. Integer adds may be regrouped, and GCC 12
        // made a tree of them, all 32 products of a block first (4 rows), spilled to the stack.
        __asm__("" : "+x"(s));
        return s;
    }
    KERNELS_AVX2 static I add(I a, I b) { return _mm256_add_epi16(a, b); }  // a block's parts: no overflow
    KERNELS_AVX2 static V block_sums(I sum) { return _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, _mm256_set1_epi16(1))); }
};

struct VnniDot {  // vpdpbusd adds into 32-bit sums itself
    static constexpr int F = 16;
    using I = __m512i;
    using V = __m512;
    KERNELS_AVX512_VNNI static I zero() { return _mm512_setzero_si512(); }
    KERNELS_AVX512_VNNI static void codes(const uint8_t* p, I& lo, I& hi) {
        const I packed = _mm512_loadu_si512(p), low4 = _mm512_set1_epi8(0x0F);
        lo = _mm512_and_si512(packed, low4);
        hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
    }
    KERNELS_AVX512_VNNI static I dot(I sum, I codes, int32_t x) {
        return _mm512_dpbusd_epi32(sum, codes, _mm512_set1_epi32(x));
    }
    KERNELS_AVX512_VNNI static I add(I a, I b) { return _mm512_add_epi32(a, b); }
    KERNELS_AVX512_VNNI static V block_sums(I sum) { return _mm512_cvtepi32_ps(sum); }
};

// MR rows of x against one tile row (D::F outputs, every block): sums[r * F + f]. S: the float
// vectors of the same width (vec.h). A block's 8 integer dot products of a row would each wait for
// the one before (5 cycles a vpdpbusd); with a row or two in the tile, nothing else fills that
// time, so those rows sum the low and the high nibbles' inputs apart and add the two at the end:
// integers, so the same sums to the bit (a row's result does not depend on its tile).
template <class D, class S, int MR>
KERNELS_INLINE void q8_tile(const Q8Args& a, const uint8_t* tile, int r0, float* sums) {
    constexpr int F = D::F, C = MR <= 2 ? 2 : 1;  // C: a row's chains of dot products
    typename S::V acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = S::zero();
    for (int b = 0; b < a.blocks; ++b, tile += kQ8TileBytes * F) {
        q8::prefetch_next_tile_row(a, tile, kQ8TileBytes * F, r0);
        typename D::I isum[MR][C];
        for (int r = 0; r < MR; ++r)
            for (int c = 0; c < C; ++c) isum[r][c] = D::zero();
        for (int j = 0; j < 4; ++j) {  // inputs 8j .. 8j + 3 (low nibbles) and 8j + 4 .. 8j + 7 (high)
            typename D::I w_lo, w_hi;
            D::codes(tile + 4 * F * j, w_lo, w_hi);
            for (int r = 0; r < MR; ++r) {
                const int8_t* x = a.xq + int64_t(r0 + r) * a.n_in + b * kBlock + 8 * j;
                int32_t x_lo, x_hi;
                std::memcpy(&x_lo, x, 4);
                std::memcpy(&x_hi, x + 4, 4);
                isum[r][0] = D::dot(isum[r][0], w_lo, x_lo);
                isum[r][C - 1] = D::dot(isum[r][C - 1], w_hi, x_hi);
            }
        }
        const typename S::V scale = S::template load_as<DType::f16>(tile + 16 * F, 0);
        const typename S::V min = S::template load_as<DType::f16>(tile + 18 * F, 0);
        for (int r = 0; r < MR; ++r) {
            const int64_t rb = int64_t(r0 + r) * a.blocks + b;
            const typename D::I block = C == 2 ? D::add(isum[r][0], isum[r][C - 1]) : isum[r][0];
            acc[r] = S::fma(D::block_sums(block), S::mul(scale, S::set1(a.dx[rb])), acc[r]);
            acc[r] = S::fma(min, S::set1(a.xsum[rb]), acc[r]);
        }
    }
    for (int r = 0; r < MR; ++r) S::store(sums + r * F, acc[r]);
}

template <int MR>
KERNELS_AVX2 __attribute__((flatten, noinline)) void tile_avx2(const Q8Args& a, const uint8_t* t, int r0, float* s) {
    q8_tile<Avx2Dot, Avx2, MR>(a, t, r0, s);
}

template <int MR>
KERNELS_AVX512_VNNI __attribute__((flatten, noinline)) void tile_vnni(const Q8Args& a, const uint8_t* t, int r0,
                                                                      float* s) {
    q8_tile<VnniDot, Avx512, MR>(a, t, r0, s);
}

// A block on the AMX tiles (q8_tiles.h): the codes widened to bytes in the tile's own order
// (part j's low nibbles are inputs 8j .. 8j + 3, B's row 2j; its high nibbles B's row 2j + 1),
// and each row's sums scaled as the VNNI tile scales them.
struct AmxBlock {
    static constexpr bool kWidened = true;
    KERNELS_AVX512_VNNI static void widen(const uint8_t* tile, uint8_t* codes) {
        for (int j = 0; j < 4; ++j) {
            __m512i lo, hi;
            VnniDot::codes(tile + 4 * 16 * j, lo, hi);
            _mm512_storeu_si512(codes + 128 * j, lo);
            _mm512_storeu_si512(codes + 128 * j + 64, hi);
        }
    }
    struct Factors {
        __m512 scale, min;
    };
    KERNELS_AVX512_VNNI static Factors factors(const uint8_t* tile) {
        return {Avx512::load_as<DType::f16>(tile + 16 * 16, 0), Avx512::load_as<DType::f16>(tile + 18 * 16, 0)};
    }
    KERNELS_AVX512_VNNI static __m512 add(const Factors& f, const int32_t* sums, float dx, float xsum, int32_t,
                                       __m512 acc) {
        const __m512 block = VnniDot::block_sums(_mm512_loadu_si512(sums));
        acc = Avx512::fma(block, Avx512::mul(f.scale, Avx512::set1(dx)), acc);
        return Avx512::fma(f.min, Avx512::set1(xsum), acc);
    }
};

KERNELS_AVX512_VNNI __attribute__((flatten, noinline)) void tile_amx(const Q8Args& a, int t, q8::AmxWork& work) {
    q8::amx_tile_row<AmxBlock, kQ8TileBytes>(a, t, work);
}

const q8::TileFn avx2_tiles[q8::kRows<8> + 1] = {nullptr, tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>};
const q8::TileFn vnni_tiles[q8::kRows<16> + 1] = {nullptr,      tile_vnni<1>, tile_vnni<2>, tile_vnni<3>,
                                                  tile_vnni<4>, tile_vnni<5>, tile_vnni<6>, tile_vnni<7>,
                                                  tile_vnni<8>};

// One row of x -> its blocks' xq, dx, xsum: round() of x * (127 / max|x|) to nearest, ties to
// even (vcvtps2dq under the default rounding mode), as reference.py's torch.round.
template <DType D>
KERNELS_AVX2 __attribute__((flatten, noinline)) void quantize_row(const void* x, int64_t base, int blocks, int8_t* xq,
                                                                  float* dx, float* xsum) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int b = 0; b < blocks; ++b) {
        __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = Avx2::load_as<D>(x, base + b * kBlock + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            sum = _mm256_add_ps(sum, v[i]);
        }
        const float m = Avx2::reduce_max(amax);
        const __m256 inv = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        // packs works within 128-bit lanes: 32-bit groups come out in the order 0 2 4 6 1 3 5 7
        const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        const __m256i q8 = _mm256_permutevar8x32_epi32(q16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock), q8);
        dx[b] = m / 127.f;
        xsum[b] = Avx2::reduce_add(sum);
    }
}

template <DType D>
void quantize_rows(const void* x, int rows, int n_in, int8_t* xq, float* dx, float* xsum) {
    const int blocks = n_in / kBlock;
#pragma omp parallel for schedule(static) if (int64_t(rows) * n_in > (int64_t(1) << 14))
    for (int r = 0; r < rows; ++r)
        quantize_row<D>(x, int64_t(r) * n_in, blocks, xq + int64_t(r) * n_in, dx + int64_t(r) * blocks,
                        xsum + int64_t(r) * blocks);
}

#endif  // KERNELS_X86

}  // namespace

Q8Rows quantize_q8(const void* x, int rows, int n_in, DType dtype) {
    Q8Rows q;
#ifdef KERNELS_X86
    const int blocks = n_in / kBlock;
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> scales;
    if (int64_t(xq.size()) < int64_t(rows) * n_in) xq.resize(size_t(rows) * n_in);
    if (int64_t(scales.size()) < 2 * int64_t(rows) * blocks) scales.resize(2 * size_t(rows) * blocks);
    q = {xq.data(), scales.data(), scales.data() + int64_t(rows) * blocks};
    if (dtype == DType::bf16) quantize_rows<DType::bf16>(x, rows, n_in, q.xq, q.dx, q.xsum);
    else if (dtype == DType::f16) quantize_rows<DType::f16>(x, rows, n_in, q.xq, q.dx, q.xsum);
    else quantize_rows<DType::f32>(x, rows, n_in, q.xq, q.dx, q.xsum);
#else
    (void)x, (void)rows, (void)n_in, (void)dtype;
#endif
    return q;
}

int q8_tile_width() {
#ifdef KERNELS_X86
    // VNNI came with AVX512-BF16 on every CPU so far (Cooper Lake, Sapphire Rapids, Zen 4); asked anyway.
    static const bool vnni = __builtin_cpu_supports("avx512vnni");
    if (isa() == Isa::avx512_bf16 && vnni) return 16;
    return isa() >= Isa::avx2 ? 8 : 0;
#else
    return 0;
#endif
}

bool q8_gemm_applies(int rows, DType dtype, int tile_width) {
    return tile_width > 0 && tile_width == q8_tile_width() && dtype == DType::bf16 && rows >= 1 && !batch_invariant();
}

void int4_tiles(uint8_t* tiles, const uint8_t* packed, const uint16_t* scale, const uint16_t* min, int n_in, int n_out,
                int group_size, int width) {
    const int F = width, blocks = n_in / kBlock, groups = n_in / group_size, n_tiles = (n_out + F - 1) / F;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < n_tiles; ++t)
        for (int b = 0; b < blocks; ++b) {
            uint8_t* tile = tiles + (int64_t(t) * blocks + b) * kQ8TileBytes * F;
            std::memset(tile, 0, size_t(kQ8TileBytes) * F);  // outputs past n_out: zero codes, scales and mins
            uint16_t* tile_scale = reinterpret_cast<uint16_t*>(tile + 16 * F);
            uint16_t* tile_min = tile_scale + F;
            for (int f = 0; f < F && t * F + f < n_out; ++f) {
                const int o = t * F + f, g = b * kBlock / group_size;
                auto code = [&](int k) {  // code(o, 32b + k): element 2j in byte j's low nibble
                    const int i = b * kBlock + k;
                    const uint8_t byte = packed[int64_t(o) * (n_in / 2) + i / 2];
                    return i % 2 ? byte >> 4 : byte & 15;
                };
                for (int j = 0; j < 4; ++j)
                    for (int k = 0; k < 4; ++k)
                        tile[4 * F * j + 4 * f + k] = uint8_t(code(8 * j + k) | code(8 * j + 4 + k) << 4);
                tile_scale[f] = scale[int64_t(o) * groups + g];
                tile_min[f] = min[int64_t(o) * groups + g];
            }
        }
}

void int4_q8_gemm(void* y, const void* x, const uint8_t* tiles, int rows, int n_in, int n_out, int width, DType dtype,
                  const LoraGroup* lora) {
#ifdef KERNELS_X86
    const Q8Rows q = quantize_q8(x, rows, n_in, dtype);
    const q8::Args a{y, q.xq, q.dx, q.xsum, nullptr, tiles, nullptr, rows, n_in, n_out, n_in / kBlock, dtype};
    q8::run<kQ8TileBytes>(a, width, avx2_tiles, vnni_tiles, tile_amx, lora);
#else
    (void)y, (void)x, (void)tiles, (void)rows, (void)n_in, (void)n_out, (void)width, (void)dtype, (void)lora;
#endif
}

}  // namespace kernels::cpu

KERNELS_VECTOR_CODE_END
