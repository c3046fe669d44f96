// What the two integer products share (int4_q8_gemm.cpp: int4 weights, int8_q8_gemm.cpp: int8
// weights, both times x quantized to int8 per block of 32 inputs): the arguments of a call, the
// walk over the tiles (a thread takes tile rows of F outputs; each runs every row of x through
// them, MR rows at a time, then a tail of 1..MR-1), and the stores of a tile's float sums.
// What differs, a tile's layout and its dot products, is each file's q8_tile.
#pragma once

#include <omp.h>

#include <optional>

#include <algorithm>
#include <vector>

#include "cpu_kernels.h"
#include "vec.h"

#define KERNELS_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

namespace kernels::cpu::q8 {

constexpr int kBlock = 32;  // inputs of a block: x's quantization step and a tile's
// Rows of x a tile of F outputs takes at a time: 4 on AVX2 (16 registers), 8 with VNNI (32: a
// tile's codes then unpacked once for twice the rows).
template <int F>
constexpr int kRows = F == 16 ? 8 : 4;

struct Args {
    void* y;                // [rows, n_out] in dtype
    const int8_t* xq;       // [rows, n_in]
    const float* dx;        // [rows, blocks] x's scales
    const float* xsum;      // [rows, blocks] sums of x over each block (int4: the mins' term)
    const int32_t* xq_sum;  // [rows, blocks] sums of xq over each block (int8 on VNNI), or null
    const uint8_t* tiles;   // [ceil(n_out / F), blocks, block_bytes F]
    const float* scale;     // [n_out] a factor per output applied at the store (int8's), or null
    int rows, n_in, n_out, blocks;
    DType dtype;
};

// y[r0 + r, o0 .. o0 + F - 1] from a tile's float sums (times the output's scale, where there is one).
template <int F, DType D>
void store_rows(const Args& a, const float* sums, int r0, int mr, int o0) {
    const int no = std::min(F, a.n_out - o0);
    for (int r = 0; r < mr; ++r)
        for (int f = 0; f < no; ++f) {
            const float s = a.scale ? sums[r * F + f] * a.scale[o0 + f] : sums[r * F + f];
            store_from_float<D>(a.y, int64_t(r0 + r) * a.n_out + o0 + f, s);
        }
}

template <int F>
void store_outputs(const Args& a, const float* sums, int r0, int mr, int o0) {
    if (a.dtype == DType::bf16) return store_rows<F, DType::bf16>(a, sums, r0, mr, o0);
    if (a.dtype == DType::f16) return store_rows<F, DType::f16>(a, sums, r0, mr, o0);
    store_rows<F, DType::f32>(a, sums, r0, mr, o0);
}

// A tile row's weights come from memory once, for the first MR rows of x; the rows after take them
// from the caches. Those first rows would wait on every load (the layers' tiles are tens of MB,
// the hardware prefetcher does not run far enough ahead), so they also ask for the same block of
// the next tile row (the next in memory, and the thread's next under a static schedule) while they
// compute: a step of 16 rows then costs its loads or its arithmetic, not the two added up.
KERNELS_INLINE void prefetch_next_tile_row(const Args& a, const uint8_t* block, int block_bytes, int r0) {
    if (r0 != 0) return;
    const uint8_t* next = block + int64_t(a.blocks) * block_bytes;
    for (int i = 0; i < block_bytes; i += 64) __builtin_prefetch(next + i);
}

// A tile's sums for MR rows of x from r0: one per row count 1..kRows<F> (an entry of each file's ISA).
using TileFn = void (*)(const Args&, const uint8_t*, int, float*);
// Every 16 rows of x against tile row t on the AMX tiles, with a thread's buffers (below).
struct AmxWork;
using AmxFn = void (*)(const Args&, int, AmxWork&);

// AMX. A CPU with AMX-INT8 has eight tile registers of up to 16 rows of 64 bytes and one
// instruction that multiplies two of them into a third: tdpbsud C, A, B adds to C[m][n] (int32)
// the products of A[m][4i .. 4i + 3] (signed bytes) with B[i][4n .. 4n + 3] (unsigned), for every
// row i of B. With A = 16 rows of x's block (32 bytes each) and B = a VNNI tile's block (8 rows of
// 4 inputs of 16 outputs: its layout already), C is the block's 16 x 16 integer sums: what 128
// vpdpbusd make, in one instruction. The sums are exact, so the float scaling after them, the same
// instructions as the VNNI tile's, gives the same bits. A tile's configuration (each register's
// rows and bytes) belongs to the thread; each thread of a product loads it before its first tile.
constexpr int kAmxRows = kQ8AmxRows;
#ifdef KERNELS_X86
KERNELS_VECTOR_CODE_BEGIN

// Tile registers: the sums of four blocks in flight (0-3), x's block and the codes for two (4, 5;
// 6, 7: a tile load waits for the product before it that reads the same register).
constexpr int kAmxDepth = 4;
template <int I>
constexpr int kAmxSumsTile = I;
template <int I>
constexpr int kAmxXTile = 4 + I % 2;
template <int I>
constexpr int kAmxCodesTile = 6 + I % 2;

KERNELS_AVX512_VNNI inline void amx_configure() {
    struct alignas(64) {
        uint8_t palette = 1, start_row = 0, reserved[14] = {};
        uint16_t bytes[16] = {};
        uint8_t rows[16] = {};
    } config;
    for (int i = 0; i < kAmxDepth; ++i) config.rows[i] = kAmxRows, config.bytes[i] = 64;  // 16 int32 sums a row
    for (int i = 4; i < 6; ++i) config.rows[i] = kAmxRows, config.bytes[i] = kBlock;      // a block of x a row
    for (int i = 6; i < 8; ++i) config.rows[i] = kBlock / 4, config.bytes[i] = 64;        // 4 inputs of 16 outputs
    // The tile instructions are written out as asm rather than taken from GCC's intrinsics, which
    // tell the compiler less than the instructions do (GCC 12: its _tile_loadconfig reads 8 bytes of
    // the 64, and the rows and widths above were dropped as stores nobody reads: unconfigured tiles,
    // SIGILL; its _tile_loadd reads no memory, so a buffer's stores could move past the load), and
    // need GCC 11 for their target: the asm needs only an assembler that knows them (binutils 2.36).
    __asm__ volatile("ldtilecfg %0" : : "m"(config));
}

KERNELS_AVX512_VNNI inline void amx_release() { __asm__ volatile("tilerelease" ::: "memory"); }

using AmxSums = int32_t[kAmxRows * 16];  // C: 16 rows of 16 int32
constexpr int kAmxCodeBytes = kBlock / 4 * 64;  // a block's B: 8 rows of 64 bytes

// Each asm names what it reads and writes ("m" operands), not "memory": with that clobber GCC kept
// the scaling's 16 accumulators in memory, a load and a store each per row and block.
template <int T>  // 16 rows of x's 32 bytes, stride apart: x is written before the product, never in it
KERNELS_INLINE void tile_load_x(const int8_t* x, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" : : "r"(x), "r"(stride), "i"(T));
}
template <int T>
KERNELS_INLINE void tile_load_codes(const uint8_t* codes) {
    __asm__ volatile("tileloadd (%1,%2,1), %%tmm%c3"
                     :
                     : "m"(*reinterpret_cast<const uint8_t(*)[kAmxCodeBytes]>(codes)), "r"(codes), "r"(int64_t(64)),
                       "i"(T));
}
template <int T>
KERNELS_INLINE void tile_store_sums(AmxSums& sums) {
    __asm__ volatile("tilestored %%tmm%c3, (%1,%2,1)" : "=m"(sums) : "r"(&sums[0]), "r"(int64_t(64)), "i"(T));
}
template <int T>
KERNELS_INLINE void tile_zero() {
    __asm__ volatile("tilezero %%tmm%c0" : : "i"(T));
}
template <int C, int A, int B>  // C += A (signed bytes) . B (unsigned bytes)
KERNELS_INLINE void tile_dpbsud() {
    __asm__ volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(C), "i"(A), "i"(B));
}

// x's factors of every row and block by group of 16 rows, then block, then row, so that a block's
// 16 are one pointer (indexed as the VNNI tile indexes them, the 16 row offsets took the general
// registers). Gathered once a call, by the calling thread, before its team starts.
struct AmxFactors {
    std::vector<float> dx, xsum;
    std::vector<int32_t> xq_sum;
    void gather(const Args& a) {
        const int groups = a.rows / kAmxRows;
        const size_t n = size_t(groups) * a.blocks * kAmxRows;
        dx.resize(n), xsum.resize(n), xq_sum.resize(a.xq_sum ? n : 0);
        for (int g = 0; g < groups; ++g)
            for (int r = 0; r < kAmxRows; ++r)
                for (int b = 0; b < a.blocks; ++b) {
                    const int64_t rb = int64_t(g * kAmxRows + r) * a.blocks + b;
                    const size_t at = (size_t(g) * a.blocks + b) * kAmxRows + r;
                    dx[at] = a.dx[rb];
                    xsum[at] = a.xsum[rb];
                    if (a.xq_sum) xq_sum[at] = a.xq_sum[rb];
                }
    }
};

// A thread's buffers, kept from call to call: the sums of the blocks in flight as the tiles store
// them, a tile row's codes widened to bytes (int4's). Not the tile function's locals: beside asm
// that writes a buffer of its own frame, GCC kept the accumulators in memory again.
struct AmxWork {
    alignas(64) AmxSums sums[kAmxDepth];
    std::vector<uint8_t> codes;
    const AmxFactors* x = nullptr;  // this call's, the calling thread's
};

template <class T>
T& thread_buffers() {
    thread_local T buffers;
    return buffers;
}

// Block b's integer sums: 16 rows of x (from x) by its 16 outputs' codes (B's 512 bytes), into
// the sums of slot I (b % kAmxDepth).
template <int I>
KERNELS_INLINE void amx_block_sums(const int8_t* x, int64_t x_stride, const uint8_t* codes, AmxWork& work) {
    tile_load_codes<kAmxCodesTile<I>>(codes);
    tile_load_x<kAmxXTile<I>>(x, x_stride);
    tile_zero<kAmxSumsTile<I>>();
    tile_dpbsud<kAmxSumsTile<I>, kAmxXTile<I>, kAmxCodesTile<I>>();
    tile_store_sums<kAmxSumsTile<I>>(work.sums[I]);
}

template <class Block, int BYTES>
KERNELS_INLINE const uint8_t* amx_codes(const uint8_t* tile, const AmxWork& work, int b) {
    if constexpr (Block::kWidened) return work.codes.data() + int64_t(b) * kAmxCodeBytes;
    return tile + int64_t(b) * BYTES * 16;
}

template <class Block, int BYTES>
KERNELS_INLINE void amx_products(const Args& a, const uint8_t* tile, int r0, int b, AmxWork& work) {
    prefetch_next_tile_row(a, tile + int64_t(b) * BYTES * 16, BYTES * 16, r0);
    const int8_t* x = a.xq + int64_t(r0) * a.n_in + b * kBlock;
    const int64_t x_stride = a.n_in;  // a tile row is a row of x
    const uint8_t* codes = amx_codes<Block, BYTES>(tile, work, b);
    switch (b % kAmxDepth) {
        case 0: return amx_block_sums<0>(x, x_stride, codes, work);
        case 1: return amx_block_sums<1>(x, x_stride, codes, work);
        case 2: return amx_block_sums<2>(x, x_stride, codes, work);
        default: return amx_block_sums<3>(x, x_stride, codes, work);
    }
}

// 16 rows of x from r0 against a tile row (BYTES bytes per output and block) -> out [16][16],
// with a weight kind's Block: Block::kWidened (B is the block's codes widened by Block::widen into
// work.codes, by the first 16 rows for all the others; else the tile's block as it lies),
// Block::factors(block's tile) and Block::add(factors, a row's sums, x's factors of the row and
// block, acc): acc plus the row's block scaled as the VNNI tile scales it. The tiles multiply
// block b + 3 while the vector units scale block b, and block b + 4 is widened: a block's sums
// come out of the tiles long after its loads, and a tile load of bytes just stored waits for the
// stores (with one block in flight AMX was slower than VNNI, with two the same).
template <class Block, int BYTES>
KERNELS_INLINE void amx_rows(const Args& a, const uint8_t* tile, int r0, float* out, AmxWork& work) {
    constexpr int D = kAmxDepth;
    auto block = [&](int b) { return tile + int64_t(b) * BYTES * 16; };
    auto widen = [&](int b) {
        if constexpr (Block::kWidened)
            if (r0 == 0 && b < a.blocks) Block::widen(block(b), work.codes.data() + int64_t(b) * kAmxCodeBytes);
    };
    for (int b = 0; b < D; ++b) widen(b);
    Avx512::V acc[kAmxRows];
    for (int r = 0; r < kAmxRows; ++r) acc[r] = Avx512::zero();
    for (int b = 0; b < std::min(a.blocks, D - 1); ++b) amx_products<Block, BYTES>(a, tile, r0, b, work);
    for (int b = 0; b < a.blocks; ++b) {
        widen(b + D);
        if (b + D - 1 < a.blocks) amx_products<Block, BYTES>(a, tile, r0, b + D - 1, work);
        const auto factors = Block::factors(block(b));
        const int32_t* sums = work.sums[b % D];
        const size_t at = (size_t(r0 / kAmxRows) * a.blocks + b) * kAmxRows;
        const float *dx = work.x->dx.data() + at, *xsum = work.x->xsum.data() + at;
        const int32_t* xq_sum = a.xq_sum ? work.x->xq_sum.data() + at : nullptr;
        for (int r = 0; r < kAmxRows; ++r)
            acc[r] = Block::add(factors, sums + r * 16, dx[r], xsum[r], xq_sum ? xq_sum[r] : 0, acc[r]);
    }
    for (int r = 0; r < kAmxRows; ++r) Avx512::store(out + r * 16, acc[r]);
}

// Every 16 rows of x against tile row t on the tiles.
template <class Block, int BYTES>
KERNELS_INLINE void amx_tile_row(const Args& a, int t, AmxWork& work) {
    __asm__ volatile("" ::: "memory");  // x's rows (tile_load_x reads them unannounced) are all written
    const uint8_t* tile = a.tiles + int64_t(t) * a.blocks * BYTES * 16;
    if (Block::kWidened && int64_t(work.codes.size()) < int64_t(a.blocks) * kAmxCodeBytes)
        work.codes.resize(size_t(a.blocks) * kAmxCodeBytes);
    float sums[kAmxRows * 16];
    for (int r0 = 0; r0 + kAmxRows <= a.rows; r0 += kAmxRows) {
        amx_rows<Block, BYTES>(a, tile, r0, sums, work);
        store_outputs<16>(a, sums, r0, kAmxRows, t * 16);
    }
}
KERNELS_VECTOR_CODE_END
#endif

// Every row of x against tile row t (BYTES bytes per output and block): every 16 rows on the AMX
// tiles where amx is given, then MR rows at a time, then the last 1..MR-1 (tile_of[rows]).
template <int F, int BYTES>
void tile_row(const Args& a, int t, const TileFn* tile_of, AmxFn amx, AmxWork* work) {
    const uint8_t* tile = a.tiles + int64_t(t) * a.blocks * BYTES * F;
    constexpr int MR = kRows<F>;
    float sums[MR * F];
    int r0 = 0;
    if (amx) {
        amx(a, t, *work);
        r0 = a.rows / kAmxRows * kAmxRows;
    }
    for (; r0 + MR <= a.rows; r0 += MR) {
        tile_of[MR](a, tile, r0, sums);
        store_outputs<F>(a, sums, r0, MR, t * F);
    }
    if (r0 < a.rows) {
        tile_of[a.rows - r0](a, tile, r0, sums);
        store_outputs<F>(a, sums, r0, a.rows - r0, t * F);
    }
}

// The whole product: tile rows over the threads (one thread for a small call), with the entries of
// the tiles' width: 16 outputs (VNNI, and amx_tile for every 16 rows where q8_amx()) or 8 (AVX2).
// With `lora`, the same team then adds the LoRA deltas into y (lora_group_share), their tables asked
// for while the weight streams: SmolLM2 at batch 1 with a rank-16 adapter went from 0.74-0.76x the
// base model's speed to 0.81-0.84x (lora_bench.py on a 2-core Zen 5) against a team of their own
// after the product, their tables asked for by one thread before it.
template <int BYTES>
void run(const Args& a, int width, const TileFn* avx2_tiles, const TileFn* vnni_tiles, AmxFn amx_tile,
         const LoraGroup* lora = nullptr) {
    const int n_tiles = (a.n_out + width - 1) / width;
    const bool parallel = int64_t(a.rows) * a.n_in * a.n_out > (int64_t(1) << 17) && n_tiles > 1;
    const AmxFn amx = width == 16 && a.rows >= kAmxRows && q8_amx() ? amx_tile : nullptr;
#ifdef KERNELS_X86
    AmxFactors* x = amx ? &thread_buffers<AmxFactors>() : nullptr;
    if (x) x->gather(a);
#endif
#pragma omp parallel if (parallel)
    {
        const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
        const int t0 = int(int64_t(n_tiles) * thread / threads), t1 = int(int64_t(n_tiles) * (thread + 1) / threads);
        // the deltas' tables asked for a few lines a tile, so that they arrive while the weight streams
        std::optional<LoraPrefetch> ahead;
        if (lora) ahead.emplace(*lora, thread, threads);
        const int64_t per_tile = ahead && t1 > t0 ? (ahead->lines + (t1 - t0) - 1) / (t1 - t0) : 0;
        if (width == 16) {
            AmxWork* work = nullptr;
#ifdef KERNELS_X86
            if (amx) {
                amx_configure();
                work = &thread_buffers<AmxWork>();
                work->x = x;
            }
#endif
            for (int t = t0; t < t1; ++t) {
                if (ahead) ahead->step(per_tile);
                tile_row<16, BYTES>(a, t, vnni_tiles, amx, work);
            }
#ifdef KERNELS_X86
            if (amx) amx_release();
#endif
        } else {
            for (int t = t0; t < t1; ++t) {
                if (ahead) ahead->step(per_tile);
                tile_row<8, BYTES>(a, t, avx2_tiles, nullptr, nullptr);
            }
        }
        if (lora) lora_group_share(*lora, thread, threads, true);
    }
}

}  // namespace kernels::cpu::q8
