// What the two integer products share (int4_q8_gemm.cpp: int4 weights, int8_q8_gemm.cpp: int8
// weights, both times x quantized to int8 per block of 32 inputs): the arguments of a call, the
// walk over the tiles (a thread takes tile rows of F outputs; each runs every row of x through
// them, MR rows at a time, then a tail of 1..MR-1), and the stores of a tile's float sums.
// What differs, a tile's layout and its dot products, is each file's q8_tile.
#pragma once

#include <omp.h>

#include <algorithm>

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

// Every row of x against tile row t (BYTES bytes per output and block), MR rows at a time, then the
// last 1..MR-1 (tile_of[rows]).
template <int F, int BYTES>
void tile_row(const Args& a, int t, const TileFn* tile_of) {
    const uint8_t* tile = a.tiles + int64_t(t) * a.blocks * BYTES * F;
    constexpr int MR = kRows<F>;
    float sums[MR * F];
    int r0 = 0;
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
// the tiles' width: 16 outputs (VNNI) or 8 (AVX2).
template <int BYTES>
void run(const Args& a, int width, const TileFn* avx2_tiles, const TileFn* vnni_tiles) {
    const int n_tiles = (a.n_out + width - 1) / width;
    const bool parallel = int64_t(a.rows) * a.n_in * a.n_out > (int64_t(1) << 17) && n_tiles > 1;
    if (width == 16) {
#pragma omp parallel for schedule(static) if (parallel)
        for (int t = 0; t < n_tiles; ++t) tile_row<16, BYTES>(a, t, vnni_tiles);
    } else {
#pragma omp parallel for schedule(static) if (parallel)
        for (int t = 0; t < n_tiles; ++t) tile_row<8, BYTES>(a, t, avx2_tiles);
    }
}

}  // namespace kernels::cpu::q8
