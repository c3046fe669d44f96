// int8 weights times x quantized to int8: the matrix product in integers, as llama.cpp's Q8_0 x Q8_0
// dot products do it, for bf16 x of any number of rows. int4_q8_gemm.cpp's twin for int8 weights:
// the same x (quantize_q8: per block of 32 inputs of a row, dx = max|x| / 127, xq = round(x / dx)),
// the same tiles of F outputs side by side (a vector holds 4 consecutive inputs of each of F
// outputs; one output per 32-bit lane, no horizontal sums), and per block
//   sum_k W[o,k] x[k] ~ scale[o] * dx * sum_k q[o,k] xq[k]
// with the sum exact in integers and the weight's one scale per output applied at the end. No
// mins here (int8 is symmetric), so a block costs one multiply-add of floats per row and F outputs.
//
// Both operands are signed, and neither x86 instruction multiplies two signed bytes:
//   vpdpbusd (VNNI) multiplies unsigned by signed bytes. The tiles hold q + 128 (0..255, the sign
//     bit flipped), so a block sums to sum (q + 128) xq = sum q xq + 128 * sum xq: x's integer sum
//     over the block, one per row and block, is taken back off before the block's sum is scaled.
//   vpmaddubsw (AVX2) adds two products of unsigned and signed bytes into 16 bits, saturating:
//     255 * 127 * 2 would not fit, so the tiles hold q itself and each multiply takes |q| and x
//     with q's sign (vpsignb): 2 * 128 * 127 = 32512 fits. vpmaddwd then makes them 32-bit lanes,
//     4 inputs each, which add up without overflow.
// The tile of one block, F outputs, 32F bytes: part j (0..7) of 4F bytes, byte 4f + t: weight
// (f, 4j + t) of the block, q ^ 0x80 at width 16 (VNNI), q at width 8 (AVX2).
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "q8_tiles.h"
#include "vec.h"

KERNELS_VECTOR_CODE_BEGIN

namespace kernels::cpu {

namespace {

using q8::kBlock;
using Args = q8::Args;
constexpr int kTileBytes = kQ8Int8TileBytes;

#ifdef KERNELS_X86

// One ISA's integer dot products for the tile below: weights() turns a part of the tile into what
// dot() takes (once for every row of x); dot() adds the products of 4 inputs of each output.
struct Avx2Dot {
    static constexpr int F = 8;
    using I = __m256i;
    struct Weights {
        I magnitude, sign;  // |q| and q (for its sign)
    };
    KERNELS_AVX2 static I zero() { return _mm256_setzero_si256(); }
    KERNELS_AVX2 static Weights weights(const uint8_t* p) {
        const I q = _mm256_loadu_si256(reinterpret_cast<const I*>(p));
        return {_mm256_abs_epi8(q), q};  // |-128| is 0x80: 128 as the unsigned operand
    }
    KERNELS_AVX2 static I dot(I sum, const Weights& w, int32_t x) {
        const I signed_x = _mm256_sign_epi8(_mm256_set1_epi32(x), w.sign);
        const I pairs = _mm256_maddubs_epi16(w.magnitude, signed_x);
        I s = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
        __asm__("" : "+x"(s));  // the sums a chain in registers (int4_q8_gemm.cpp's Avx2Dot says why)
        return s;
    }
    KERNELS_AVX2 static I add(I a, I b) { return _mm256_add_epi32(a, b); }
    KERNELS_AVX2 static __m256 block_sums(I sum, const int32_t*, int64_t) { return _mm256_cvtepi32_ps(sum); }
};

struct VnniDot {
    static constexpr int F = 16;
    using I = __m512i;
    using Weights = I;  // q + 128, as stored
    KERNELS_AVX512_VNNI static I zero() { return _mm512_setzero_si512(); }
    KERNELS_AVX512_VNNI static Weights weights(const uint8_t* p) { return _mm512_loadu_si512(p); }
    KERNELS_AVX512_VNNI static I dot(I sum, const Weights& w, int32_t x) {
        return _mm512_dpbusd_epi32(sum, w, _mm512_set1_epi32(x));
    }
    KERNELS_AVX512_VNNI static I add(I a, I b) { return _mm512_add_epi32(a, b); }
    KERNELS_AVX512_VNNI static __m512 block_sums(I sum, const int32_t* xq_sum, int64_t rb) {
        return _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(128 * xq_sum[rb])));
    }
};

// MR rows of x against one tile row (F outputs, every block) -> sums[r * F + f], before the
// weight's scale. As in int4_q8_gemm.cpp, one or two rows keep two chains of dot products each
// (even and odd parts), so that a chain's latency is not all the tile waits on; integers, so the
// same sums to the bit in either form.
template <class D, class S, int MR>
KERNELS_INLINE void q8_tile(const Args& a, const uint8_t* tile, int r0, float* sums) {
    constexpr int F = D::F, C = MR <= 2 ? 2 : 1;
    typename S::V acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = S::zero();
    for (int b = 0; b < a.blocks; ++b, tile += kTileBytes * F) {
        q8::prefetch_next_tile_row(a, tile, kTileBytes * F, r0);
        typename D::I isum[MR][C];
        for (int r = 0; r < MR; ++r)
            for (int c = 0; c < C; ++c) isum[r][c] = D::zero();
        for (int j = 0; j < 8; ++j) {  // inputs 4j .. 4j + 3 of the block
            const typename D::Weights w = D::weights(tile + 4 * F * j);
            for (int r = 0; r < MR; ++r) {
                int32_t x;
                std::memcpy(&x, a.xq + int64_t(r0 + r) * a.n_in + b * kBlock + 4 * j, 4);
                isum[r][j % C] = D::dot(isum[r][j % C], w, x);
            }
        }
        for (int r = 0; r < MR; ++r) {
            const int64_t rb = int64_t(r0 + r) * a.blocks + b;
            typename D::I block = isum[r][0];
            if constexpr (C == 2) block = D::add(block, isum[r][1]);
            acc[r] = S::fma(D::block_sums(block, a.xq_sum, rb), S::set1(a.dx[rb]), acc[r]);
        }
    }
    for (int r = 0; r < MR; ++r) S::store(sums + r * F, acc[r]);
}

template <int MR>
KERNELS_AVX2 __attribute__((flatten, noinline)) void tile_avx2(const Args& a, const uint8_t* t, int r0, float* s) {
    q8_tile<Avx2Dot, Avx2, MR>(a, t, r0, s);
}

template <int MR>
KERNELS_AVX512_VNNI __attribute__((flatten, noinline)) void tile_vnni(const Args& a, const uint8_t* t, int r0,
                                                                      float* s) {
    q8_tile<VnniDot, Avx512, MR>(a, t, r0, s);
}

// A block on the AMX tiles (q8_tiles.h): the VNNI tile's block is already what tdpbsud takes as B
// (8 rows of 4 inputs of 16 outputs, unsigned: q + 128), so it is loaded as it lies; x's sums take
// the 128s back off, and each row's block is scaled as the VNNI tile scales it.
struct AmxBlock {
    static constexpr bool kWidened = false;
    struct Factors {};
    KERNELS_AVX512_VNNI static Factors factors(const uint8_t*) { return {}; }
    KERNELS_AVX512_VNNI static __m512 add(const Factors&, const int32_t* sums, float dx, float, int32_t xq_sum,
                                       __m512 acc) {
        const __m512i block = _mm512_sub_epi32(_mm512_loadu_si512(sums), _mm512_set1_epi32(128 * xq_sum));
        return Avx512::fma(_mm512_cvtepi32_ps(block), Avx512::set1(dx), acc);
    }
};

KERNELS_AVX512_VNNI __attribute__((flatten, noinline)) void tile_amx(const Args& a, int t, q8::AmxWork& work) {
    q8::amx_tile_row<AmxBlock, kTileBytes>(a, t, work);
}

const q8::TileFn avx2_tiles[q8::kRows<8> + 1] = {nullptr, tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>};
const q8::TileFn vnni_tiles[q8::kRows<16> + 1] = {nullptr,      tile_vnni<1>, tile_vnni<2>, tile_vnni<3>,
                                                  tile_vnni<4>, tile_vnni<5>, tile_vnni<6>, tile_vnni<7>,
                                                  tile_vnni<8>};

#endif  // KERNELS_X86

}  // namespace

void int8_tiles(uint8_t* tiles, const int8_t* q, int n_in, int n_out, int width) {
    const int F = width, blocks = n_in / kBlock, n_tiles = (n_out + F - 1) / F;
    const uint8_t flip = F == 16 ? 0x80 : 0;  // VNNI's unsigned operand: q + 128
#pragma omp parallel for schedule(static)
    for (int t = 0; t < n_tiles; ++t)
        for (int b = 0; b < blocks; ++b) {
            uint8_t* tile = tiles + (int64_t(t) * blocks + b) * kTileBytes * F;
            // outputs past n_out: weight 0 (0x80 at width 16), their sums never stored
            std::memset(tile, flip, size_t(kTileBytes) * F);
            for (int f = 0; f < F && t * F + f < n_out; ++f)
                for (int j = 0; j < 8; ++j)
                    for (int k = 0; k < 4; ++k)
                        tile[4 * F * j + 4 * f + k] =
                            uint8_t(q[int64_t(t * F + f) * n_in + b * kBlock + 4 * j + k]) ^ flip;
        }
}

void int8_q8_gemm(void* y, const void* x, const uint8_t* tiles, const float* scale, int rows, int n_in, int n_out,
                  int width, DType dtype, const LoraGroup* lora) {
#ifdef KERNELS_X86
    const int blocks = n_in / kBlock;
    const Q8Rows q = quantize_q8(x, rows, n_in, dtype);
    thread_local std::vector<int32_t> xq_sum;  // VNNI's correction only: AVX2's tiles hold q itself
    if (width == 16) {
        if (int64_t(xq_sum.size()) < int64_t(rows) * blocks) xq_sum.resize(size_t(rows) * blocks);
        for (int64_t rb = 0; rb < int64_t(rows) * blocks; ++rb) {
            int32_t sum = 0;
            for (int k = 0; k < kBlock; ++k) sum += q.xq[rb * kBlock + k];
            xq_sum[rb] = sum;
        }
    }
    const Args a{y,    q.xq,  q.dx,   q.xsum, width == 16 ? xq_sum.data() : nullptr, tiles, scale, rows,
                 n_in, n_out, blocks, dtype};
    q8::run<kTileBytes>(a, width, avx2_tiles, vnni_tiles, tile_amx, lora);
#else
    (void)y, (void)x, (void)tiles, (void)scale, (void)rows, (void)n_in, (void)n_out, (void)width, (void)dtype,
        (void)lora;
#endif
}

}  // namespace kernels::cpu

KERNELS_VECTOR_CODE_END
