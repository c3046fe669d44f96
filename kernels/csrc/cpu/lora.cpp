// LoRA for many adapters in one batch: y[row] += scale[s] * B[s] @ (A[s] @ x[row]), s the row's
// adapter slot, as two kernels (Punica's and S-LoRA's split): a shrink, v = A[s] x (r numbers per
// row, float32), and an expand, y += scale B[s] v. The contract is in cpu_kernels.h.
//
// One form for prompt chunks and decode rows. Punica names two kernels, SGMV for segments of rows
// that share an adapter (a prompt chunk) and BGMV for rows that each have their own (decode). Here
// both are one kernel over segments, a decode row being a segment of one: the engine lays a step's
// rows end to end (chunks and decode rows mixed) and passes one table, and the kernel's tiles of
// rows are cut at segment ends, so a decode row gets a 1-row tile (a matrix-vector product, the
// adapter's A read once for it) and a chunk gets full tiles (each A row reused by every row of the
// tile from registers). The two forms of Punica differ in how a GPU block is mapped to rows; on
// the CPU they are the same loops with a different row count, and one kernel means one set of
// tests for both.
//
// Why the two halves have different layouts. The shrink is r dot products of length n_in per row:
// A[s] as PEFT stores it ([r, n_in], lora_A.weight) has each of them contiguous, so it is an
// inner-product tile (as gemm.cpp's): MR rows of x times NO rows of A, vectors along the inputs,
// one horizontal sum per (row, rank) at the end, r * rows of them, few. The expand is n_out dot
// products of length r per row, r being 8..64: as inner products that would be one horizontal sum
// per output, as costly as the products themselves. So the expand runs as an outer product along
// the outputs: per rank k, y[row, o .. o + W) += v[row, k] * B[s][o .. o + W, k], which needs B
// with the outputs contiguous: the slot table stores lora_B.weight transposed, b_t [r, n_out],
// once at load time. No horizontal sums, and y is read and written once per tile.
//
// Ranks. Slots hold up to r_max ranks; an adapter of rank r < r_max leaves rows r.. of its slot as
// padding, which no loop here reaches (the tests fill it with NaN). A rank tile of NO that runs
// past the rank reads the last real row again for the missing ones and drops their sums: the same
// instructions for every rank, no read of padding, and odd ranks cost at most NO - 1 wasted rows.
//
// Threads: the shrink takes tasks of MR rows (cut at segment ends inside), the expand tasks of
// MR rows by kOutTile outputs; one thread below a few tens of thousands of multiply-adds.
#include <omp.h>

#include <algorithm>
#include <tuple>
#include <utility>

#include "cpu_kernels.h"
#include "vec.h"

KERNELS_VECTOR_CODE_BEGIN

namespace kernels::cpu {

namespace {

constexpr int64_t kParallelMacs = int64_t(1) << 15;
constexpr int kOutTile = 256;  // outputs per expand task

struct Segments {
    const int32_t* starts;  // [n + 1]
    const int32_t* slots;   // [n]
    int n;
    int n_slots, r_max;
    // The rank of slot s: 0 for the base model (s = -1) and, defensively, for a slot outside the
    // table; clamped to r_max (cpu_kernels.h).
    int rank(const int32_t* ranks, int s) const {
        return s < 0 || s >= n_slots ? 0 : std::clamp(int(ranks[s]), 0, r_max);
    }
    // The segment holding `row`: the last start <= row (empty segments before it are skipped).
    int first(int row) const { return int(std::upper_bound(starts, starts + n + 1, row) - starts) - 1; }
    int slot(int i) const { return int(slots[i]); }
};

// The runs of rows of one segment each inside rows [r0, r1) of a task:
//     for (Run run{seg, r0, r1}; run.next();) ... run.row .. run.end - 1, all of slot run.slot
// (a loop, not a callback: GCC's flatten did not reach into a lambda's callees, and the vector
// members were left as calls).
struct Run {
    const Segments& seg;
    int row, r1;
    int i = seg.first(row), end = row, slot = -1;
    bool next() {
        row = end;
        for (; row < r1 && i < seg.n; ++i) {
            end = std::min(int(seg.starts[i + 1]), r1);
            if (end > row) {
                slot = seg.slot(i++);
                return true;
            }
        }
        return false;
    }
};

// The slot of the run after `run` inside the task (rows before r1), or -1: its tables are fetched
// while this run computes. With a slot per row (a step of many adapters) each run's tables are a
// few tens of KB somewhere in the slot table, too short for the hardware prefetchers to find:
// asked for, the deltas of 16 adapters on 16 rows took 12.6 ms of a SmolLM2 step instead of 14.4
// (lora_bench.py, chapter 09's README; the expand 1.4x faster alone, the shrink 1.08x).
KERNELS_INLINE int next_slot(const Segments& seg, int i, int r1) {
    for (; i < seg.n && seg.starts[i] < r1; ++i)
        if (seg.starts[i + 1] > seg.starts[i]) return seg.slot(i);
    return -1;
}

// The next run's tables, asked for a few cache lines at a time while this run computes: rows of
// row_bytes each, stride bytes apart. step() asks for the next per_step lines, the tiles calling it
// once per load of their own tables; rest() for whatever is left when the run ends. (All of a run's
// lines asked for at its start, hundreds of prefetches in a row, filled the miss buffers and stalled
// the run behind them: a third of the shrink's samples sat in that loop, a sixth of the expand's.)
struct Ahead {
    const char* row = nullptr;
    int64_t stride = 0, row_bytes = 0, offset = 0;
    int rows = 0, per_step = 0;

    // The table at element `first` of `base`, `n_rows` rows of `n` elements `stride` elements apart,
    // spread over about `steps` calls of step().
    template <DType D>
    static Ahead of(const void* base, int64_t first, int n_rows, int64_t n, int64_t stride, int64_t steps) {
        constexpr int64_t bytes = D == DType::f32 ? 4 : 2;
        const int64_t row_bytes = n * bytes, lines = n_rows * ((row_bytes + 63) / 64);
        const int per_step = int(std::max<int64_t>(1, (lines + steps - 1) / std::max<int64_t>(steps, 1)));
        return {static_cast<const char*>(base) + first * bytes, stride * bytes, row_bytes, 0, n_rows, per_step};
    }
    KERNELS_INLINE void one() {
        __builtin_prefetch(row + offset);
        if ((offset += 64) >= row_bytes) offset = 0, row += stride, --rows;
    }
    KERNELS_INLINE void step() {
        for (int n = 0; n < per_step && rows > 0; ++n) one();
    }
    KERNELS_INLINE void rest() {
        while (rows > 0) one();
    }
};

struct ShrinkArgs {
    float* v;
    int64_t v_stride;
    const void* x;
    int64_t x_stride;
    const void* a;
    const int32_t* ranks;
    Segments seg;
    int rows, n_in, r_max;
};

struct ExpandArgs {
    void* y;
    int64_t y_stride;
    const float* v;
    int64_t v_stride;
    const void* b;
    const int32_t* ranks;
    const float* scale;
    Segments seg;
    int rows, n_out, r_max;
};

// Register tiles per instruction set: MR rows by NO ranks (shrink) or NO vectors of outputs
// (expand). AVX2 has 16 vector registers: 3 x 4 accumulators, 3 broadcasts or rows, 1 weight vector.
// A tile of one row (a decode row, its adapter its own) is NO1 wide instead: with one row there is
// no reuse of a table's vector to gain, only its bytes to bring in from memory, and a wider tile
// keeps more of them in flight at once (the shrink reads all 16 rows of a rank-16 A side by side,
// the expand 16 rows of B^T in pieces of 512 bytes, not 128). SmolLM2's 30 layers of deltas for 16
// rank-16 adapters on 16 decode rows, 156 MB of tables, on one thread of a Zen 5: 15 GB/s with NO = 4,
// 19-20 GB/s with NO1 = 16, 24-25 with the next run's tables asked for along the way (Ahead below).
template <class S>
struct Tile {
    static constexpr int MR = 4, NO = 4, NO1 = 16;
};
#ifdef KERNELS_X86
template <>
struct Tile<Avx2> {
    static constexpr int MR = 3, NO = 4, NO1 = 8;
};
#endif
template <class S, int MR>
constexpr int kNo = MR == 1 ? Tile<S>::NO1 : Tile<S>::NO;  // ranks or output vectors of a tile of MR rows

// --- shrink ----------------------------------------------------------------------------------------

// MR rows of x (from r0) times NO rows of A (from element a0; rows past nk repeat row nk - 1),
// over all n_in inputs -> sums[r * NO + n].
template <class S, DType DX, DType DW, int MR, int NO>
KERNELS_INLINE void shrink_tile(const ShrinkArgs& p, int r0, int64_t a0, int nk, float* sums, Ahead& ahead) {
    using V = typename S::V;
    int64_t xo[MR], ao[NO];
    for (int r = 0; r < MR; ++r) xo[r] = int64_t(r0 + r) * p.x_stride;
    for (int n = 0; n < NO; ++n) ao[n] = a0 + int64_t(std::min(n, nk - 1)) * p.n_in;
    V acc[MR][NO];
    for (int r = 0; r < MR; ++r)
        for (int n = 0; n < NO; ++n) acc[r][n] = S::zero();
    int i = 0;
    for (; i + S::W <= p.n_in; i += S::W) {
        ahead.step();
        V xv[MR];
        for (int r = 0; r < MR; ++r) xv[r] = S::template load_as<DX>(p.x, xo[r] + i);
        for (int n = 0; n < NO; ++n) {
            const V w = S::template load_as<DW>(p.a, ao[n] + i);
            for (int r = 0; r < MR; ++r) acc[r][n] = S::fma(xv[r], w, acc[r][n]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int n = 0; n < NO; ++n) sums[r * NO + n] = S::reduce_add(acc[r][n]);
    for (; i < p.n_in; ++i)  // n_in past the last whole vector (AVX512 at n_in = 8 mod 16)
        for (int r = 0; r < MR; ++r)
            for (int n = 0; n < NO; ++n)
                sums[r * NO + n] += load_as_float<DX>(p.x, xo[r] + i) * load_as_float<DW>(p.a, ao[n] + i);
}

// Ranks k0 .. k0 + nk - 1 (nk <= NO) of v for rows r0 .. r0 + MR - 1 of slot s.
template <class S, DType DX, DType DW, int MR, int NO>
KERNELS_INLINE void shrink_ranks(const ShrinkArgs& p, int r0, int s, int k0, int nk, Ahead& ahead) {
    float sums[MR * NO];
    shrink_tile<S, DX, DW, MR, NO>(p, r0, (int64_t(s) * p.r_max + k0) * p.n_in, nk, sums, ahead);
    for (int r = 0; r < MR; ++r)
        for (int n = 0; n < nk; ++n) p.v[int64_t(r0 + r) * p.v_stride + k0 + n] = sums[r * NO + n];
}

// Rows r0 .. r0 + MR - 1, all of slot s (rank rk >= 1), ranks k_lo .. k_hi - 1 of v: the rank tiles
// below rk (the last one cut at rk or k_hi), zeros from rk on.
template <class S, DType DX, DType DW, int MR>
KERNELS_INLINE void shrink_rows(const ShrinkArgs& p, int r0, int s, int rk, int k_lo, int k_hi, Ahead& ahead) {
    constexpr int NO = Tile<S>::NO, NO_FIRST = kNo<S, MR>;
    const int k_end = std::min(rk, k_hi);
    int k0 = k_lo;
    if constexpr (NO_FIRST != NO)  // wide tiles only where all their ranks are wanted: no wasted rows
        for (; k0 + NO_FIRST <= k_end; k0 += NO_FIRST)
            shrink_ranks<S, DX, DW, MR, NO_FIRST>(p, r0, s, k0, NO_FIRST, ahead);
    for (; k0 < k_end; k0 += NO) shrink_ranks<S, DX, DW, MR, NO>(p, r0, s, k0, std::min(NO, k_end - k0), ahead);
    if (rk < k_hi)
        for (int r = 0; r < MR; ++r) {
            float* row = p.v + int64_t(r0 + r) * p.v_stride;
            std::fill(row + std::max(rk, k_lo), row + k_hi, 0.f);
        }
}

// A tile of the last rows of a run: fewer than MR.
template <class S, DType DX, DType DW, int R>
KERNELS_INLINE void shrink_rest(const ShrinkArgs& p, int rows, int r0, int s, int rk, int k_lo, int k_hi,
                                Ahead& ahead) {
    if constexpr (R > 0) {
        if (rows == R) return shrink_rows<S, DX, DW, R>(p, r0, s, rk, k_lo, k_hi, ahead);
        shrink_rest<S, DX, DW, R - 1>(p, rows, r0, s, rk, k_lo, k_hi, ahead);
    }
}

// Rows t0 .. t1 - 1, ranks k_lo .. k_hi - 1 of v.
template <class S, DType DX, DType DW>
KERNELS_INLINE void shrink_range(const ShrinkArgs& p, int t0, int t1, int k_lo, int k_hi) {
    constexpr int MR = Tile<S>::MR;
    for (Run run{p.seg, t0, t1}; run.next();) {
        const int s = run.slot, rk = p.seg.rank(p.ranks, s), end = run.end;
        const int s_next = next_slot(p.seg, run.i, t1), rk_next = p.seg.rank(p.ranks, s_next);
        int row = run.row;
        // the next run's rows of A (ranks k_lo .. on), asked for over this run's tiles of rows by
        // ranks (wide for one row), n_in / W loads each
        const int rows = end - row, k_tile = rows == 1 ? Tile<S>::NO1 : Tile<S>::NO;
        const int64_t tiles = int64_t((rows + MR - 1) / MR) * ((std::min(rk, k_hi) - k_lo + k_tile - 1) / k_tile);
        const int k_next = std::max(0, std::min(rk_next, k_hi) - k_lo);
        Ahead ahead = Ahead::of<DW>(p.a, (int64_t(std::max(s_next, 0)) * p.r_max + k_lo) * p.n_in, k_next, p.n_in,
                                    p.n_in, tiles * (p.n_in / S::W));
        if (rk == 0) {
            for (; row < end; ++row) std::fill_n(p.v + int64_t(row) * p.v_stride + k_lo, k_hi - k_lo, 0.f);
        } else {
            for (; row + MR <= end; row += MR) shrink_rows<S, DX, DW, MR>(p, row, s, rk, k_lo, k_hi, ahead);
            if (row < end) shrink_rest<S, DX, DW, MR - 1>(p, end - row, row, s, rk, k_lo, k_hi, ahead);
        }
        ahead.rest();
    }
}

// --- expand ----------------------------------------------------------------------------------------

// MR rows (from r0) of slot s by NO vectors of outputs from o: acc = sum_k v[row, k] * b_t[s, k, o..],
// then y = y + scale * acc, rounded once.
template <class S, DType DY, DType DW, int MR, int NO>
KERNELS_INLINE void expand_tile(const ExpandArgs& p, int r0, int s, int rk, int o, Ahead& ahead) {
    using V = typename S::V;
    constexpr int W = S::W;
    V acc[MR][NO];
    for (int r = 0; r < MR; ++r)
        for (int n = 0; n < NO; ++n) acc[r][n] = S::zero();
    const int64_t b0 = int64_t(s) * p.r_max * p.n_out + o;
    for (int k = 0; k < rk; ++k) {
        ahead.step();
        V vk[MR];
        for (int r = 0; r < MR; ++r) vk[r] = S::set1(p.v[int64_t(r0 + r) * p.v_stride + k]);
        for (int n = 0; n < NO; ++n) {
            const V w = S::template load_as<DW>(p.b, b0 + int64_t(k) * p.n_out + n * W);
            for (int r = 0; r < MR; ++r) acc[r][n] = S::fma(vk[r], w, acc[r][n]);
        }
    }
    const V scale = S::set1(p.scale[s]);
    for (int r = 0; r < MR; ++r)
        for (int n = 0; n < NO; ++n) {
            const int64_t at = int64_t(r0 + r) * p.y_stride + o + n * W;
            S::template store_as<DY>(p.y, at, S::fma(scale, acc[r][n], S::template load_as<DY>(p.y, at)));
        }
}

// Outputs o0 .. o1 - 1 of rows r0 .. r0 + MR - 1 (slot s): whole tiles of NO vectors (first of NO1
// for one row), single vectors, then the last outputs one by one.
template <class S, DType DY, DType DW, int MR>
KERNELS_INLINE void expand_rows(const ExpandArgs& p, int r0, int s, int rk, int o0, int o1, Ahead& ahead) {
    constexpr int W = S::W, NO = Tile<S>::NO, NO_FIRST = kNo<S, MR>;
    int o = o0;
    if constexpr (NO_FIRST != NO)
        for (; o + NO_FIRST * W <= o1; o += NO_FIRST * W) expand_tile<S, DY, DW, MR, NO_FIRST>(p, r0, s, rk, o, ahead);
    for (; o + NO * W <= o1; o += NO * W) expand_tile<S, DY, DW, MR, NO>(p, r0, s, rk, o, ahead);
    for (; o + W <= o1; o += W) expand_tile<S, DY, DW, MR, 1>(p, r0, s, rk, o, ahead);
    const int64_t b0 = int64_t(s) * p.r_max * p.n_out;
    for (; o < o1; ++o)
        for (int r = 0; r < MR; ++r) {
            float sum = 0.f;
            for (int k = 0; k < rk; ++k)
                sum += p.v[int64_t(r0 + r) * p.v_stride + k] * load_as_float<DW>(p.b, b0 + int64_t(k) * p.n_out + o);
            const int64_t at = int64_t(r0 + r) * p.y_stride + o;
            store_from_float<DY>(p.y, at, load_as_float<DY>(p.y, at) + p.scale[s] * sum);
        }
}

template <class S, DType DY, DType DW, int R>
KERNELS_INLINE void expand_rest(const ExpandArgs& p, int rows, int r0, int s, int rk, int o0, int o1,
                                Ahead& ahead) {
    if constexpr (R > 0) {
        if (rows == R) return expand_rows<S, DY, DW, R>(p, r0, s, rk, o0, o1, ahead);
        expand_rest<S, DY, DW, R - 1>(p, rows, r0, s, rk, o0, o1, ahead);
    }
}

template <class S, DType DY, DType DW>
KERNELS_INLINE void expand_range(const ExpandArgs& p, int t0, int t1, int o0, int o1) {
    constexpr int MR = Tile<S>::MR;
    for (Run run{p.seg, t0, t1}; run.next();) {
        const int s = run.slot, rk = p.seg.rank(p.ranks, s), end = run.end;
        const int s_next = next_slot(p.seg, run.i, t1), rk_next = p.seg.rank(p.ranks, s_next);
        int row = run.row;
        // the next run's rows of B^T (outputs o0 .. o1 - 1), asked for over this run's tiles of rows
        // by outputs (wide for one row), rk loads each
        const int rows = end - row, o_tile = (rows == 1 ? Tile<S>::NO1 : Tile<S>::NO) * S::W;
        const int64_t tiles = int64_t((rows + MR - 1) / MR) * ((o1 - o0 + o_tile - 1) / o_tile);
        Ahead ahead = Ahead::of<DW>(p.b, int64_t(std::max(s_next, 0)) * p.r_max * p.n_out + o0, rk_next, o1 - o0,
                                    p.n_out, tiles * rk);
        if (rk > 0) {  // the base model's rows (and an empty slot's) are left as they are
            for (; row + MR <= end; row += MR) expand_rows<S, DY, DW, MR>(p, row, s, rk, o0, o1, ahead);
            if (row < end) expand_rest<S, DY, DW, MR - 1>(p, end - row, row, s, rk, o0, o1, ahead);
        }
        ahead.rest();
    }
}

// --- each instruction set's entries: the templates above compiled inside its target -------------

template <class S>
struct Entry {
    template <DType DX, DType DW>
    static void shrink(const ShrinkArgs& p, int t0, int t1, int k_lo, int k_hi) {
        shrink_range<S, DX, DW>(p, t0, t1, k_lo, k_hi);
    }
    template <DType DY, DType DW>
    static void expand(const ExpandArgs& p, int t0, int t1, int o0, int o1) {
        expand_range<S, DY, DW>(p, t0, t1, o0, o1);
    }
};

#ifdef KERNELS_X86
template <>
struct Entry<Avx2> {
    template <DType DX, DType DW>
    KERNELS_AVX2 __attribute__((flatten)) static void shrink(const ShrinkArgs& p, int t0, int t1, int k_lo, int k_hi) {
        shrink_range<Avx2, DX, DW>(p, t0, t1, k_lo, k_hi);
    }
    template <DType DY, DType DW>
    KERNELS_AVX2 __attribute__((flatten)) static void expand(const ExpandArgs& p, int t0, int t1, int o0, int o1) {
        expand_range<Avx2, DY, DW>(p, t0, t1, o0, o1);
    }
};

template <>
struct Entry<Avx512> {
    template <DType DX, DType DW>
    KERNELS_AVX512 __attribute__((flatten)) static void shrink(const ShrinkArgs& p, int t0, int t1, int k_lo,
                                                               int k_hi) {
        shrink_range<Avx512, DX, DW>(p, t0, t1, k_lo, k_hi);
    }
    template <DType DY, DType DW>
    KERNELS_AVX512 __attribute__((flatten)) static void expand(const ExpandArgs& p, int t0, int t1, int o0, int o1) {
        expand_range<Avx512, DY, DW>(p, t0, t1, o0, o1);
    }
};
#endif

using ShrinkFn = void (*)(const ShrinkArgs&, int, int, int, int);
using ExpandFn = void (*)(const ExpandArgs&, int, int, int, int);

// The entry of this ISA for x's (y's) dtype and the weights' (f32 or bf16).
template <class S>
std::pair<ShrinkFn, ExpandFn> entries_of(DType dtype, DType w_dtype) {
    using E = Entry<S>;
    constexpr DType f32 = DType::f32, bf16 = DType::bf16, f16 = DType::f16;
    const bool wf = w_dtype == f32;
    switch (dtype) {
        case f32:
            return wf ? std::pair{&E::template shrink<f32, f32>, &E::template expand<f32, f32>}
                      : std::pair{&E::template shrink<f32, bf16>, &E::template expand<f32, bf16>};
        case bf16:
            return wf ? std::pair{&E::template shrink<bf16, f32>, &E::template expand<bf16, f32>}
                      : std::pair{&E::template shrink<bf16, bf16>, &E::template expand<bf16, bf16>};
        case f16:
            return wf ? std::pair{&E::template shrink<f16, f32>, &E::template expand<f16, f32>}
                      : std::pair{&E::template shrink<f16, bf16>, &E::template expand<f16, bf16>};
    }
    return {nullptr, nullptr};
}

std::pair<ShrinkFn, ExpandFn> entries(DType dtype, DType w_dtype) {
#ifdef KERNELS_X86
    const Isa level = isa();
    if (level >= Isa::avx512) return entries_of<Avx512>(dtype, w_dtype);
    if (level == Isa::avx2) return entries_of<Avx2>(dtype, w_dtype);
#endif
    return entries_of<Scalar>(dtype, w_dtype);
}

int row_tile() {
#ifdef KERNELS_X86
    if (isa() == Isa::avx2) return Tile<Avx2>::MR;
#endif
    return Tile<Scalar>::MR;  // AVX512's too
}

}  // namespace

void lora_shrink(float* v, int64_t v_stride, const void* x, int64_t x_stride, const void* a, const int32_t* ranks,
                 const int32_t* seg_starts, const int32_t* seg_slots, int rows, int n_seg, int n_slots, int n_in,
                 int r_max, DType dtype, DType w_dtype) {
    if (rows <= 0) return;
    const Segments seg{seg_starts, seg_slots, n_seg, n_slots, r_max};
    const ShrinkArgs p{v, v_stride, x, x_stride, a, ranks, seg, rows, n_in, r_max};
    const ShrinkFn fn = entries(dtype, w_dtype).first;
    const int mr = row_tile(), tasks = (rows + mr - 1) / mr;
    const bool parallel = int64_t(rows) * n_in * r_max > kParallelMacs && tasks > 1;
#pragma omp parallel for schedule(static) if (parallel)
    for (int t = 0; t < tasks; ++t) fn(p, t * mr, std::min(rows, (t + 1) * mr), 0, r_max);
}

void lora_expand(void* y, int64_t y_stride, const float* v, int64_t v_stride, const void* b_t, const int32_t* ranks,
                 const float* scale, const int32_t* seg_starts, const int32_t* seg_slots, int rows, int n_seg,
                 int n_slots, int n_out, int r_max, DType dtype, DType w_dtype) {
    if (rows <= 0 || n_out <= 0) return;
    const Segments seg{seg_starts, seg_slots, n_seg, n_slots, r_max};
    const ExpandArgs p{y, y_stride, v, v_stride, b_t, ranks, scale, seg, rows, n_out, r_max};
    const ExpandFn fn = entries(dtype, w_dtype).second;
    const int mr = row_tile(), row_tasks = (rows + mr - 1) / mr, out_tiles = (n_out + kOutTile - 1) / kOutTile;
    const int tasks = row_tasks * out_tiles;
    const bool parallel = int64_t(rows) * n_out * r_max > kParallelMacs && tasks > 1;
#pragma omp parallel for schedule(static) if (parallel)
    for (int t = 0; t < tasks; ++t) {
        const int rt = t / out_tiles, ot = t % out_tiles;
        fn(p, rt * mr, std::min(rows, (rt + 1) * mr), ot * kOutTile, std::min(n_out, (ot + 1) * kOutTile));
    }
}

namespace {

// A group's tasks (cpu_kernels.h's LoraGroup). With a tile of rows for every thread, a task is a
// tile of rows through every part's shrink and then every part's expand (16 adapters on 16 rows:
// 10-15 % faster than with a barrier between the halves, where a thread done early waited). With
// fewer tiles than threads ("few"), a shrink task is some ranks of one part and an expand task some
// outputs of one part, the expands after a barrier (every v complete). Tasks of 8 ranks and 256
// outputs: with 4 and 64, a batch-1 step of SmolLM2 ran some 3,000 tasks, their set-up a good part
// of the deltas' time.
struct GroupPlan {
    const LoraGroup& g;
    ShrinkFn shrink;
    ExpandFn expand;
    int mr, row_tasks, k_tiles, shrink_tasks, expand_tasks;
    static constexpr int k_step = 8, o_step = 256;
    struct Task {
        int part, r0, r1, lo, hi;  // rows r0 .. r1 - 1, ranks (shrink) or outputs (expand) lo .. hi - 1
    };

    explicit GroupPlan(const LoraGroup& g_) : g(g_) {
        std::tie(shrink, expand) = entries(g.dtype, g.w_dtype);
        mr = row_tile();
        row_tasks = (g.rows + mr - 1) / mr;
        k_tiles = (g.r_max + k_step - 1) / k_step;
        shrink_tasks = g.n_parts * row_tasks * k_tiles;
        expand_tasks = 0;
        for (int j = 0; j < g.n_parts; ++j) expand_tasks += row_tasks * ((g.parts[j].n_out + o_step - 1) / o_step);
    }
    Segments seg() const { return {g.seg_starts, g.seg_slots, g.n_seg, g.n_slots, g.r_max}; }
    ShrinkArgs shrink_args(int j) const {
        return ShrinkArgs{g.parts[j].v, g.r_max, g.x, g.x_stride, g.parts[j].a, g.parts[j].ranks, seg(), g.rows,
                          g.n_in, g.r_max};
    }
    ExpandArgs expand_args(int j) const {
        const LoraPart& part = g.parts[j];
        void* y_at = static_cast<char*>(g.y) + part.y_col * (g.dtype == DType::f32 ? 4 : 2);
        return ExpandArgs{y_at, g.y_stride, part.v, g.r_max, part.b_t, part.ranks, g.scale, seg(), g.rows,
                          part.n_out, g.r_max};
    }
    Task shrink_task(int t) const {
        const int j = t / (row_tasks * k_tiles), rt = t / k_tiles % row_tasks, kt = t % k_tiles;
        return Task{j, rt * mr, std::min(g.rows, (rt + 1) * mr), kt * k_step, std::min(g.r_max, (kt + 1) * k_step)};
    }
    Task expand_task(int t) const {
        int j = 0;
        for (int n; t >= (n = row_tasks * ((g.parts[j].n_out + o_step - 1) / o_step)); ++j) t -= n;
        const int o_tiles = (g.parts[j].n_out + o_step - 1) / o_step, rt = t / o_tiles, ot = t % o_tiles;
        return Task{j, rt * mr, std::min(g.rows, (rt + 1) * mr), ot * o_step,
                    std::min(g.parts[j].n_out, (ot + 1) * o_step)};
    }
    bool few(int threads) const { return row_tasks < threads; }
};

// Thread `thread`'s tasks of n: a contiguous share, [begin, end).
std::pair<int, int> share(int n, int thread, int threads) {
    return {int(int64_t(n) * thread / threads), int(int64_t(n) * (thread + 1) / threads)};
}

}  // namespace

void lora_group_share(const LoraGroup& g, int thread, int threads, bool y_pending) {
    if (g.rows <= 0 || g.n_parts <= 0) return;
    const GroupPlan plan(g);
    if (!plan.few(threads)) {
        // a row tile's v is its own task's: no barrier between the halves, only one before them
        // where other threads may still be writing y's outputs
        if (y_pending) {
#pragma omp barrier
        }
        const auto [t0, t1] = share(plan.row_tasks, thread, threads);
        for (int t = t0; t < t1; ++t) {
            const int r0 = t * plan.mr, r1 = std::min(g.rows, r0 + plan.mr);
            for (int j = 0; j < g.n_parts; ++j) plan.shrink(plan.shrink_args(j), r0, r1, 0, g.r_max);
            for (int j = 0; j < g.n_parts; ++j) plan.expand(plan.expand_args(j), r0, r1, 0, g.parts[j].n_out);
        }
        return;
    }
    const auto [s0, s1] = share(plan.shrink_tasks, thread, threads);
    for (int t = s0; t < s1; ++t) {
        const auto k = plan.shrink_task(t);
        plan.shrink(plan.shrink_args(k.part), k.r0, k.r1, k.lo, k.hi);
    }
#pragma omp barrier  // every part's v whole (and y's outputs, where they were pending)
    const auto [e0, e1] = share(plan.expand_tasks, thread, threads);
    for (int t = e0; t < e1; ++t) {
        const auto k = plan.expand_task(t);
        plan.expand(plan.expand_args(k.part), k.r0, k.r1, k.lo, k.hi);
    }
}

// Only for few rows: many rows' tasks ask for their next run's tables themselves (Ahead), and all of
// their tables would push the matmul's weight out of the caches.
LoraPrefetch::LoraPrefetch(const LoraGroup& g, int thread, int threads) {
    if (g.rows <= 0 || g.n_parts <= 0) return;
    const GroupPlan plan(g);
    if (!plan.few(threads)) return;
    const Segments seg = plan.seg();
    const int64_t size = g.w_dtype == DType::f32 ? 4 : 2;
    auto add = [&](const void* at, int64_t bytes) {
        const char* p = static_cast<const char*>(at);
        if (n_ranges > 0 && ranges[n_ranges - 1].first + ranges[n_ranges - 1].second == p) {
            ranges[n_ranges - 1].second += bytes;
        } else if (n_ranges < kMaxRanges) {
            ranges[n_ranges++] = {p, bytes};
        } else {
            return;  // the rest is read unasked
        }
        lines += (bytes + 63) / 64;
    };
    const auto [s0, s1] = share(plan.shrink_tasks, thread, threads);
    for (int t = s0; t < s1; ++t) {
        const auto k = plan.shrink_task(t);
        const LoraPart& part = g.parts[k.part];
        for (Run run{seg, k.r0, k.r1}; run.next();) {
            const int rk = std::min(seg.rank(part.ranks, run.slot), k.hi);
            if (rk > k.lo)
                add(static_cast<const char*>(part.a) + (int64_t(run.slot) * g.r_max + k.lo) * g.n_in * size,
                    int64_t(rk - k.lo) * g.n_in * size);
        }
    }
    const auto [e0, e1] = share(plan.expand_tasks, thread, threads);
    for (int t = e0; t < e1; ++t) {
        const auto k = plan.expand_task(t);
        const LoraPart& part = g.parts[k.part];
        for (Run run{seg, k.r0, k.r1}; run.next();) {
            const int rk = seg.rank(part.ranks, run.slot);
            for (int r = 0; r < rk; ++r)
                add(static_cast<const char*>(part.b_t) + ((int64_t(run.slot) * g.r_max + r) * part.n_out + k.lo) * size,
                    int64_t(k.hi - k.lo) * size);
        }
    }
}

void LoraPrefetch::step(int64_t n) {
    for (; n > 0 && i < n_ranges; --n) {
        __builtin_prefetch(ranges[i].first + offset, 0, 2);  // into L2: the matmul streams through L1
        if ((offset += 64) >= ranges[i].second) offset = 0, ++i;
    }
}

// One fused matmul's projections at once (cpu_kernels.h): a decode step's delta is so little work
// per projection (q's rank-16 tables are 36 KB) that a team of threads per call costs as much as it
// saves, and one thread alone cannot pull the tables from memory as fast as the base matmul pulls
// its weight (serial, the deltas added 40 % to a batch-1 step of SmolLM2). So one team runs the group
// (and where it can, the matmul's own team: q8::run).
void lora_group(void* y, int64_t y_stride, const void* x, int64_t x_stride, const LoraPart* parts, int n_parts,
                const float* scale, const int32_t* seg_starts, const int32_t* seg_slots, int rows, int n_seg,
                int n_slots, int n_in, int r_max, DType dtype, DType w_dtype) {
    if (rows <= 0 || n_parts <= 0) return;
    const LoraGroup g{y, y_stride, x, x_stride, parts, n_parts, scale, seg_starts, seg_slots,
                      rows, n_seg, n_slots, n_in, r_max, dtype, w_dtype};
    int64_t macs = 0;
    for (int j = 0; j < n_parts; ++j) macs += int64_t(rows) * r_max * (n_in + parts[j].n_out);
    const bool parallel = macs > kParallelMacs && omp_get_max_threads() > 1;
#pragma omp parallel if (parallel)
    lora_group_share(g, omp_get_thread_num(), omp_get_num_threads(), false);
}

}  // namespace kernels::cpu

KERNELS_VECTOR_CODE_END
