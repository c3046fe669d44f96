// Quantized linear layers for decode, y = x @ W.T with W dequantized in registers: the CUDA twins
// of int4_linear, int8_linear and bf16_linear in cpu/cpu_kernels.h (the formats are described there).
//
// Why this kernel is about reading W. In decode, x has one row per sequence of the step (1..16),
// so every weight is used `rows` times: a matrix-vector product. An H200 can do ~100
// multiply-adds per byte it reads from memory; here there are 2 * rows per int4 byte. The kernel
// is as fast as it streams W (codes, float16 scales and mins), and everything below serves that.
//
// The organisation.
//   grid    one block per kOutPerBlock = 16 output features (rows of W); 256 threads = 8 warps.
//   warp    owns kOutPerWarp = 2 rows of W and reads them in 16-byte chunks (32 int4 codes or 16
//           int8 codes): lane l reads chunk l of each 512-byte stretch of a row, so one load
//           instruction of the warp reads 512 contiguous bytes (coalesced), and each lane issues
//           the loads of several chunks of both rows before using any, so that enough bytes are
//           in flight to cover the memory's latency (~1 us under load).
//   x       is staged in shared memory as float, once per block, for all its 16 rows of W (each
//           warp reading x from global memory itself would read it 8 times). When rows * n_in
//           floats do not fit in 48 KB, x goes through in tiles of the input dimension, with a
//           barrier before and after staging each tile.
//   lane    keeps one partial sum per (row of W, row of x); a warp reduction (shuffles) at the end
//           gives the outputs. The rows of x are a loop inside, so W is read once for all of them.
//
// Why two rows of W per warp: a lane loads the x values of a chunk from shared memory once and
// uses them for both rows. With one row, shared memory would carry 4 bytes of x per int4 code
// (8 bytes per byte of W): ~150 B/clock per SM at an H200's memory bandwidth, more than the
// 128 B/clock shared memory delivers. Two rows halve it.
//
// Codes to floats without conversion instructions. Converting an integer to a float (I2F) runs at
// 16 per clock per SM, an eighth of the multiply-add rate on sm_90, and would be the bottleneck at
// one conversion per weight. Instead: the float 2^23 (bits 0x4B000000) has a mantissa of zeros
// whose last bit is worth exactly 1, so the bit pattern 0x4B0000nn IS the float 2^23 + nn for any
// byte nn. One byte-permute instruction (__byte_perm, PRMT) builds that pattern from one byte of
// a word and the 0x4B byte; one subtraction leaves nn as a float, exactly.
//
// int4, the maths per chunk. A chunk's 32 inputs lie in one group (G is a multiple of 32), so they
// share a scale s and a min m:
//   sum_i x_i (m + s c_i) = m * (sum_i x_i) + s * (sum_i x_i c_i)
// one multiply-add per weight, then two per chunk, instead of dequantizing every weight. The sum
// of x over a chunk is the same for every row of W: the block computes it once, as it stages x.
// The codes of byte j are inputs 2j (low nibble) and 2j + 1 (high nibble): masking a word with
// 0x0F0F0F0F gives its 4 even inputs' codes, one per byte, shifting it right by 4 first its 4 odd
// ones. x is laid out in shared memory so that the 4 matching x values are one 16-byte access,
// and the 32 lanes' accesses 512 consecutive bytes (no bank conflicts): see Int4Slot.
//
// int8: W[o, i] = s_o * q[o, i], so y = s_o * sum_i x_i q_i: the scale is applied once at the end.
// A signed byte q becomes the unsigned q + 128 by flipping its top bit (xor 0x80), then a float by
// the trick above, minus 2^23 + 128.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "dtype.cuh"
#include "launchers.h"

namespace kernels::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kOutPerWarp = 2;                      // rows of W per warp
constexpr int kOutPerBlock = kWarps * kOutPerWarp;  // 16
constexpr int kChunk = 16;                          // bytes of a row of W per lane per load
constexpr int kTileQuantum = 1024;                  // x tiles are multiples of this many inputs (one int4 stretch)
constexpr int kDefaultSmem = 48 * 1024;             // shared memory a block gets without opting in
constexpr int kMaxRowsPerLaunch = 16;               // more rows of x: several launches

// Chunks of a row per lane per step, loaded before any is used: 2 rows x kUnroll x 16 bytes in
// flight per lane. Fewer with many rows of x, whose partial sums need the registers.
template <int MAX_ROWS>
__host__ __device__ constexpr int unroll_for() {
    return MAX_ROWS <= 4 ? 4 : 2;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Byte k of `bytes` (0..255) as a float, minus `bias`, for k = 0..3 (see the top of the file).
// __byte_perm(a, b, selector): byte n of the result is byte (selector nibble n) of the 8 bytes
// (a's 0..3, then b's 4..7). Selector 0x744k: byte k of `bytes`, two zero bytes of kExponent,
// then kExponent's top byte 0x4B.
__device__ __forceinline__ void bytes_to_floats(uint32_t bytes, float bias, float (&f)[4]) {
    constexpr uint32_t kExponent = 0x4B000000u;  // the float 2^23
    f[0] = __uint_as_float(__byte_perm(bytes, kExponent, 0x7440)) - bias;
    f[1] = __uint_as_float(__byte_perm(bytes, kExponent, 0x7441)) - bias;
    f[2] = __uint_as_float(__byte_perm(bytes, kExponent, 0x7442)) - bias;
    f[3] = __uint_as_float(__byte_perm(bytes, kExponent, 0x7443)) - bias;
}
constexpr float kInt4Bias = 8388608.0f;  // 2^23:        byte nn -> nn
constexpr float kInt8Bias = 8388736.0f;  // 2^23 + 128:  byte (q xor 0x80) = q + 128 -> q

// The 16 bytes of W at p, as 4 little-endian words: one 16-byte load through the read-only cache
// when p is 16-byte aligned, else byte by byte (a tensor at an odd offset: correct, and slow).
// Bytes at or past `limit` read as 0 (the end of an int8 row whose length is no multiple of 16).
template <bool ALIGNED>
__device__ __forceinline__ uint4 load_chunk(const uint8_t* p, int limit) {
    if constexpr (ALIGNED) {
        return __ldg(reinterpret_cast<const uint4*>(p));
    } else {
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int b = 0; b < 16; ++b) {
            if (b < limit) w[b / 4] |= static_cast<uint32_t>(__ldg(p + b)) << (8 * (b % 4));
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int k) {
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;  // k is a compile-time constant after unrolling
}

// Where input i of an x tile goes in shared memory (floats from the start of the row's tile).
// A warp-wide load covers a stretch of inputs (32 lanes x 16 bytes: 1024 int4, 512 int8 inputs);
// lane l needs 8 (int4) or 4 (int8) float4s of x for its chunk. Float4 number f of lane l is
// stored at f * 128 + 4 l of its stretch, so the 32 lanes reading their float4 f read 512
// consecutive bytes: every bank of shared memory once per 8 lanes, no conflict.
struct Int4Slot {
    static constexpr int kStretch = 1024;
    // input i: lane (i / 32) % 32, word k = (i / 8) % 4 of the chunk, odd or even; float4
    // f = 2k + odd holds the even (or odd) inputs of word k in order, element (i % 8) / 2.
    __device__ static int of(int i) {
        const int f = 2 * ((i >> 3) & 3) + (i & 1);
        return (i & ~(kStretch - 1)) + f * 128 + ((i >> 5) & 31) * 4 + ((i >> 1) & 3);
    }
};
struct Bf16Slot {
    static constexpr int kStretch = 256;
    // input i: lane (i / 8) % 32, float4 f = (i / 4) % 2 = words 2f and 2f + 1 of the chunk, element i % 4.
    __device__ static int of(int i) {
        return (i & ~(kStretch - 1)) + ((i >> 2) & 1) * 128 + ((i >> 3) & 31) * 4 + (i & 3);
    }
};
struct Int8Slot {
    static constexpr int kStretch = 512;
    // input i: lane (i / 16) % 32, float4 f = (i / 4) % 4 = word f of the chunk, element i % 4.
    __device__ static int of(int i) {
        return (i & ~(kStretch - 1)) + ((i >> 2) & 3) * 128 + ((i >> 4) & 31) * 4 + (i & 3);
    }
};

// Stages x[r, k0 + i] for r < rows, i < kt into xs[r * tile + Slot::of(i)] as float, with zeros
// up to the end of the last chunk (an int8 row may end inside a chunk: its missing codes read as
// 0, and 0 * x must not meet stale shared memory, which could hold a NaN).
// Each thread reads VEC consecutive elements with one load (16 bytes when x allows it), so the
// block stages 256 * VEC elements per round trip to memory: a whole row of 2048 bf16 in one.
// With SUMS, also the sum of x over each chunk of 32 inputs (int4 needs it for the mins, and it
// is the same for every row of W): a chunk is 32 / VEC consecutive lanes of one warp, whose
// partial sums a group_sum adds. chunk_sums[r * (tile / 32) + chunk].
template <int LANES>
__device__ __forceinline__ float group_sum(float v) {  // over LANES consecutive lanes (a power of 2)
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

template <typename T, typename Slot, int CHUNK_INPUTS, bool SUMS, int VEC>
__device__ void stage_x(float* xs, float* chunk_sums, const T* x, int rows, int n_in, int k0, int kt, int tile) {
    const int kt_padded = (kt + CHUNK_INPUTS - 1) / CHUNK_INPUTS * CHUNK_INPUTS;  // <= tile
    const int total = rows * kt_padded;                                           // a multiple of 16
    const int lane = threadIdx.x % 32;
    // The loop runs while the warp's first element is in range, so that all 32 lanes reach the
    // shuffles of group_sum together; lanes past the end stage nothing.
    for (int index = threadIdx.x * VEC; index - lane * VEC < total; index += kThreads * VEC) {
        const int r = index / kt_padded, i = index % kt_padded;  // VEC divides kt_padded: one row
        float v[VEC];
        if (index < total && i < kt) {  // with VEC > 1, kt % VEC == 0: all VEC in range, or none
            load_vec<T, VEC>(x + static_cast<int64_t>(r) * n_in + k0 + i, v);
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) v[e] = 0.f;
        }
        if (index < total) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) xs[r * tile + Slot::of(i + e)] = v[e];
        }
        if constexpr (SUMS) {
            static_assert(CHUNK_INPUTS == 32 && 32 % VEC == 0, "a chunk is 32 / VEC whole lanes");
            float sum = 0.f;
#pragma unroll
            for (int e = 0; e < VEC; ++e) sum += v[e];
            sum = group_sum<32 / VEC>(sum);
            if (index < total && i % 32 == 0) chunk_sums[r * (tile / 32) + i / 32] = sum;
        }
    }
}

// Lane 0 writes y[r, out0 + j] = row_scale[j] * (the warp's sum of acc[j][r]).
template <typename T, int MAX_ROWS>
__device__ void write_outputs(T* y, float (&acc)[kOutPerWarp][MAX_ROWS], const float (&row_scale)[kOutPerWarp],
                              int rows, int out0, int n_out) {
#pragma unroll
    for (int j = 0; j < kOutPerWarp; ++j) {
#pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) {
            if (r >= rows) break;  // the same for every lane: all of them reach the shuffles
            const float sum = warp_sum(acc[j][r]);
            if (threadIdx.x % 32 == 0 && out0 + j < n_out) {
                store(y + static_cast<int64_t>(r) * n_out + out0 + j, row_scale[j] * sum);
            }
        }
    }
}

// --- int4 -----------------------------------------------------------------------------------
// MAX_ROWS: a bound on rows known at compile time, so that the partial sums acc[][MAX_ROWS] are
// registers (an array indexed at run time would live in slow local memory).
template <typename T, int MAX_ROWS, bool ALIGNED>
__global__ void __launch_bounds__(kThreads, 1)
    int4_kernel(T* __restrict__ y, const T* __restrict__ x, const uint8_t* __restrict__ packed,
                const __half* __restrict__ scale, const __half* __restrict__ group_min, int rows, int n_in, int n_out,
                int group_size, int group_shift, int tile) {
    constexpr int U = unroll_for<MAX_ROWS>();
    constexpr int kInputs = 2 * kChunk;                                    // 32 inputs per chunk
    constexpr int X_VEC = ALIGNED ? 16 / static_cast<int>(sizeof(T)) : 1;  // x elements per staging load
    extern __shared__ float4 smem[];                                       // float4: 16-byte aligned
    float* xs = reinterpret_cast<float*>(smem);                            // [rows][tile], in Int4Slot order
    float* x_sums = xs + rows * tile;                                      // [rows][tile / 32]: sum of x per chunk

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int out0 = (blockIdx.x * kWarps + warp) * kOutPerWarp;  // this warp's first row of W
    const int64_t row_bytes = n_in / 2;
    const int groups = n_in / group_size;
    // The group of input i: a shift when G is a power of two (always, in practice), else a division.
    const auto group_of = [&](int i) { return group_shift >= 0 ? i >> group_shift : i / group_size; };

    float acc[kOutPerWarp][MAX_ROWS];
#pragma unroll
    for (int j = 0; j < kOutPerWarp; ++j) {
#pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) acc[j][r] = 0.f;
    }

    for (int k0 = 0; k0 < n_in; k0 += tile) {
        const int kt = min(tile, n_in - k0);  // inputs in this tile, a multiple of 32
        __syncthreads();                      // every warp is done with the previous tile
        stage_x<T, Int4Slot, kInputs, true, X_VEC>(xs, x_sums, x, rows, n_in, k0, kt, tile);
        __syncthreads();

        const int chunks = kt / kInputs;
        for (int c0 = 0; c0 < chunks; c0 += 32 * U) {
            // 1. Loads: U chunks of both rows, with their scales and mins.
            uint4 code[kOutPerWarp][U];
            float s[kOutPerWarp][U], m[kOutPerWarp][U];
#pragma unroll
            for (int j = 0; j < kOutPerWarp; ++j) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = c0 + u * 32 + lane, o = out0 + j;
                    code[j][u] = make_uint4(0u, 0u, 0u, 0u);
                    s[j][u] = 0.f, m[j][u] = 0.f;
                    if (c < chunks && o < n_out) {
                        code[j][u] = load_chunk<ALIGNED>(packed + o * row_bytes + k0 / 2 + kChunk * c, kChunk);
                        const int64_t g = static_cast<int64_t>(o) * groups + group_of(k0 + kInputs * c);
                        s[j][u] = __half2float(scale[g]);
                        m[j][u] = __half2float(group_min[g]);
                    }
                }
            }
            // 2. Arithmetic, chunk by chunk: sum x * code per (row of W, row of x), word by word,
            //    then fold in the scale and, with the chunk's sum of x, the min.
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + u * 32 + lane;
                if (c >= chunks) break;  // past the tile: nothing of this tile in its x slots
                const float* xc = xs + (c / 32) * Int4Slot::kStretch + lane * 4;  // c % 32 == lane
                float dot[kOutPerWarp][MAX_ROWS];
#pragma unroll
                for (int r = 0; r < MAX_ROWS; ++r) {
#pragma unroll
                    for (int j = 0; j < kOutPerWarp; ++j) dot[j][r] = 0.f;
                }
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    float even[kOutPerWarp][4], odd[kOutPerWarp][4];  // word k's codes, as floats
#pragma unroll
                    for (int j = 0; j < kOutPerWarp; ++j) {
                        const uint32_t word = word_of(code[j][u], k);
                        bytes_to_floats(word & 0x0F0F0F0Fu, kInt4Bias, even[j]);
                        bytes_to_floats((word >> 4) & 0x0F0F0F0Fu, kInt4Bias, odd[j]);
                    }
#pragma unroll
                    for (int r = 0; r < MAX_ROWS; ++r) {
                        if (r >= rows) break;
                        const float4 xe = *reinterpret_cast<const float4*>(xc + r * tile + (2 * k) * 128);
                        const float4 xo = *reinterpret_cast<const float4*>(xc + r * tile + (2 * k + 1) * 128);
#pragma unroll
                        for (int j = 0; j < kOutPerWarp; ++j) {
                            float d = dot[j][r];
                            d = fmaf(xe.x, even[j][0], d);
                            d = fmaf(xe.y, even[j][1], d);
                            d = fmaf(xe.z, even[j][2], d);
                            d = fmaf(xe.w, even[j][3], d);
                            d = fmaf(xo.x, odd[j][0], d);
                            d = fmaf(xo.y, odd[j][1], d);
                            d = fmaf(xo.z, odd[j][2], d);
                            d = fmaf(xo.w, odd[j][3], d);
                            dot[j][r] = d;
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < MAX_ROWS; ++r) {
                    if (r >= rows) break;
                    const float x_sum = x_sums[r * (tile / 32) + c];
#pragma unroll
                    for (int j = 0; j < kOutPerWarp; ++j) {
                        acc[j][r] = fmaf(s[j][u], dot[j][r], fmaf(m[j][u], x_sum, acc[j][r]));
                    }
                }
            }
        }
    }
    float ones[kOutPerWarp];
#pragma unroll
    for (int j = 0; j < kOutPerWarp; ++j) ones[j] = 1.f;
    write_outputs<T, MAX_ROWS>(y, acc, ones, rows, out0, n_out);
}

// --- int8 and bf16: one weight per element, a chunk of 16 bytes --------------------------------
// The same skeleton for both, over a weight format F: a chunk is 16 bytes of one row of W, which
// hold F::kInputs consecutive inputs (16 int8 codes, or 8 bf16 values), lane l reading chunk l of
// each stretch; F::weights turns float4 f of the chunk's x (inputs 4f .. 4f + 3) into the 4
// weights that multiply it. n_in is anything: the last chunk of a row may be partial, its missing
// bytes read as zeros (ALIGNED requires n_in % F::kInputs == 0 as well).
struct Int8Format {
    using W = int8_t;
    using Slot = Int8Slot;
    static constexpr int kInputs = kChunk;  // 16 codes
    // Word f holds inputs 4f .. 4f + 3: flipped to unsigned, then floats by the 2^23 trick; the
    // row's scale multiplies the sum once (see the top).
    __device__ static void weights(const uint4& code, int f, float (&w)[4]) {
        bytes_to_floats(word_of(code, f) ^ 0x80808080u, kInt8Bias, w);
    }
    __device__ static float row_scale(const float* scale, int o) { return scale[o]; }
};
struct Bf16Format {
    using W = uint16_t;
    using Slot = Bf16Slot;
    static constexpr int kInputs = kChunk / 2;  // 8 values
    // A bf16 is the top half of its float: words 2f and 2f + 1 hold inputs 4f .. 4f + 3, the low
    // half of each word first, widened with a shift (the low one) and a mask (the high one).
    __device__ static void weights(const uint4& code, int f, float (&w)[4]) {
        const uint32_t lo = word_of(code, 2 * f), hi = word_of(code, 2 * f + 1);
        w[0] = __uint_as_float(lo << 16);
        w[1] = __uint_as_float(lo & 0xffff0000u);
        w[2] = __uint_as_float(hi << 16);
        w[3] = __uint_as_float(hi & 0xffff0000u);
    }
    __device__ static float row_scale(const float*, int) { return 1.f; }
};

template <typename F, typename T, int MAX_ROWS, bool ALIGNED>
__global__ void __launch_bounds__(kThreads, 1)
    rows_kernel(T* __restrict__ y, const T* __restrict__ x, const typename F::W* __restrict__ w,
                const float* __restrict__ scale, int rows, int n_in, int n_out, int tile) {
    constexpr int U = unroll_for<MAX_ROWS>();
    constexpr int kInputs = F::kInputs, kFloat4s = kInputs / 4, kBytes = kChunk / kInputs;  // bytes per input
    constexpr int X_VEC = ALIGNED ? 16 / static_cast<int>(sizeof(T)) : 1;
    extern __shared__ float4 smem[];
    float* xs = reinterpret_cast<float*>(smem);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int out0 = (blockIdx.x * kWarps + warp) * kOutPerWarp;
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w);

    float acc[kOutPerWarp][MAX_ROWS];
#pragma unroll
    for (int j = 0; j < kOutPerWarp; ++j) {
#pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) acc[j][r] = 0.f;
    }

    for (int k0 = 0; k0 < n_in; k0 += tile) {
        const int kt = min(tile, n_in - k0);
        __syncthreads();
        stage_x<T, typename F::Slot, kInputs, false, X_VEC>(xs, nullptr, x, rows, n_in, k0, kt, tile);
        __syncthreads();

        const int chunks = (kt + kInputs - 1) / kInputs;
        for (int c0 = 0; c0 < chunks; c0 += 32 * U) {
            uint4 code[kOutPerWarp][U];
#pragma unroll
            for (int j = 0; j < kOutPerWarp; ++j) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = c0 + u * 32 + lane, o = out0 + j;
                    code[j][u] = make_uint4(0u, 0u, 0u, 0u);  // int8 and bf16 zeros alike
                    if (c < chunks && o < n_out) {
                        const int64_t first = static_cast<int64_t>(o) * n_in + k0 + kInputs * c;  // in elements
                        code[j][u] = load_chunk<ALIGNED>(bytes + kBytes * first, kBytes * (kt - kInputs * c));
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + u * 32 + lane;
                if (c >= chunks) break;
                const float* xc = xs + (c / 32) * F::Slot::kStretch + lane * 4;
#pragma unroll
                for (int f = 0; f < kFloat4s; ++f) {
                    float wv[kOutPerWarp][4];
#pragma unroll
                    for (int j = 0; j < kOutPerWarp; ++j) F::weights(code[j][u], f, wv[j]);
#pragma unroll
                    for (int r = 0; r < MAX_ROWS; ++r) {
                        if (r >= rows) break;
                        const float4 xv = *reinterpret_cast<const float4*>(xc + r * tile + f * 128);
#pragma unroll
                        for (int j = 0; j < kOutPerWarp; ++j) {
                            float a = acc[j][r];
                            a = fmaf(xv.x, wv[j][0], a);
                            a = fmaf(xv.y, wv[j][1], a);
                            a = fmaf(xv.z, wv[j][2], a);
                            a = fmaf(xv.w, wv[j][3], a);
                            acc[j][r] = a;
                        }
                    }
                }
            }
        }
    }
    float row_scale[kOutPerWarp];
#pragma unroll
    for (int j = 0; j < kOutPerWarp; ++j) row_scale[j] = out0 + j < n_out ? F::row_scale(scale, out0 + j) : 0.f;
    write_outputs<T, MAX_ROWS>(y, acc, row_scale, rows, out0, n_out);
}

// --- launch -----------------------------------------------------------------------------------

// Calls f(std::integral_constant<int, MAX_ROWS>{}) with the smallest instantiated bound >= rows.
template <typename F>
cudaError_t with_max_rows(int rows, F&& f) {
    if (rows <= 1) return f(std::integral_constant<int, 1>{});
    if (rows <= 2) return f(std::integral_constant<int, 2>{});
    if (rows <= 4) return f(std::integral_constant<int, 4>{});
    if (rows <= 8) return f(std::integral_constant<int, 8>{});
    return f(std::integral_constant<int, kMaxRowsPerLaunch>{});
}

// The x tile, in inputs: the whole row (rounded up to kTileQuantum) if `rows` rows of it fit in
// the default 48 KB, else the most that fit, and at least kTileQuantum (at 12 to 16 rows that
// is more than the default: see launch()). A row of the tile takes floats_per_32 floats per 32
// inputs of shared memory (33 for int4: x and one chunk sum).
int tile_for(int rows, int n_in, int floats_per_32) {
    const int whole = (n_in + kTileQuantum - 1) / kTileQuantum * kTileQuantum;
    const int fits = kDefaultSmem / static_cast<int>(sizeof(float)) * 32 / floats_per_32 / rows;
    return std::min(whole, std::max(kTileQuantum, fits / kTileQuantum * kTileQuantum));
}

// Launches kernel on `stream` with `smem` bytes of dynamic shared memory. Beyond 48 KB a kernel
// must be allowed first (sm_80 and sm_90 have 163 and 227 KB per block): a host-side attribute,
// not work queued on the stream, so it neither synchronises nor breaks graph capture.
template <typename Kernel, typename... Args>
cudaError_t launch(Kernel kernel, int blocks, size_t smem, cudaStream_t stream, Args... args) {
    if (smem > static_cast<size_t>(kDefaultSmem)) {
        const cudaError_t err =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
        if (err != cudaSuccess) return err;
    }
    kernel<<<blocks, kThreads, smem, stream>>>(args...);
    return cudaGetLastError();
}

int blocks_for(int n_out) { return (n_out + kOutPerBlock - 1) / kOutPerBlock; }

}  // namespace

cudaError_t int4_linear(void* y, const void* x, const uint8_t* packed, const uint16_t* scale, const uint16_t* min,
                        int rows, int n_in, int n_out, int group_size, DType dtype, cudaStream_t stream) {
    // A chunk (32 inputs) must lie in one group: G a multiple of 32, as the contract says.
    if (rows < 0 || n_in < 0 || n_out < 0 || group_size <= 0 || group_size % 32 != 0 || n_in % group_size != 0) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0 || n_out == 0) return cudaSuccess;
    const int group_shift = (group_size & (group_size - 1)) == 0 ? __builtin_ctz(group_size) : -1;
    // ALIGNED: 16-byte loads of W and x (their rows, n_in / 2 bytes and n_in elements, keep the
    // alignment of the first); else byte and element loads, slow but correct at any address.
    const bool aligned = is_aligned(packed, 16) && is_aligned(x, 16);
    const auto* scales = reinterpret_cast<const __half*>(scale);  // float16 bits, as the contract says
    const auto* mins = reinterpret_cast<const __half*>(min);
    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        for (int r0 = 0; r0 < rows; r0 += kMaxRowsPerLaunch) {
            const int chunk = std::min(kMaxRowsPerLaunch, rows - r0);
            const int tile = tile_for(chunk, n_in, 33);
            const size_t smem = static_cast<size_t>(chunk) * (tile + tile / 32) * sizeof(float);  // x, chunk sums
            T* yc = static_cast<T*>(y) + static_cast<int64_t>(r0) * n_out;
            const T* xc = static_cast<const T*>(x) + static_cast<int64_t>(r0) * n_in;
            const cudaError_t err = with_max_rows(chunk, [&](auto max_rows) {
                constexpr int R = decltype(max_rows)::value;
                auto kernel = aligned ? int4_kernel<T, R, true> : int4_kernel<T, R, false>;
                return launch(kernel, blocks_for(n_out), smem, stream, yc, xc, packed, scales, mins, chunk, n_in, n_out,
                              group_size, group_shift, tile);
            });
            if (err != cudaSuccess) return err;
        }
        return cudaSuccess;
    });
}

namespace {

// int8_linear and bf16_linear: rows_kernel for format F, in launches of up to kMaxRowsPerLaunch rows.
template <typename F>
cudaError_t launch_rows(void* y, const void* x, const typename F::W* w, const float* scale, int rows, int n_in,
                        int n_out, DType dtype, cudaStream_t stream) {
    if (rows < 0 || n_in < 0 || n_out < 0) return cudaErrorInvalidValue;
    if (rows == 0 || n_out == 0) return cudaSuccess;
    // ALIGNED: 16-byte loads of W and x; with whole chunks per row every row keeps the first's alignment.
    const bool aligned = is_aligned(w, 16) && is_aligned(x, 16) && n_in % F::kInputs == 0;
    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        for (int r0 = 0; r0 < rows; r0 += kMaxRowsPerLaunch) {
            const int chunk = std::min(kMaxRowsPerLaunch, rows - r0);
            const int tile = tile_for(chunk, n_in, 32);
            const size_t smem = static_cast<size_t>(chunk) * tile * sizeof(float);
            T* yc = static_cast<T*>(y) + static_cast<int64_t>(r0) * n_out;
            const T* xc = static_cast<const T*>(x) + static_cast<int64_t>(r0) * n_in;
            const cudaError_t err = with_max_rows(chunk, [&](auto max_rows) {
                constexpr int R = decltype(max_rows)::value;
                auto kernel = aligned ? rows_kernel<F, T, R, true> : rows_kernel<F, T, R, false>;
                return launch(kernel, blocks_for(n_out), smem, stream, yc, xc, w, scale, chunk, n_in, n_out, tile);
            });
            if (err != cudaSuccess) return err;
        }
        return cudaSuccess;
    });
}

}  // namespace

cudaError_t int8_linear(void* y, const void* x, const int8_t* q, const float* scale, int rows, int n_in, int n_out,
                        DType dtype, cudaStream_t stream) {
    return launch_rows<Int8Format>(y, x, q, scale, rows, n_in, n_out, dtype, stream);
}

cudaError_t bf16_linear(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, DType dtype,
                        cudaStream_t stream) {
    return launch_rows<Bf16Format>(y, x, w, nullptr, rows, n_in, n_out, dtype, stream);
}

}  // namespace kernels::cuda
