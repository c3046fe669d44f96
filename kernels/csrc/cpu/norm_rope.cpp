// RMSNorm with the residual add fused in, RoPE, and SwiGLU's silu(gate) * up: three small
// element-wise kernels.
//
// Both are memory-bound and tiny in decode (one row of a few hundred values per sequence), so the
// point of fusing is fewer passes over memory and fewer calls, not arithmetic. Each is written
// once over a vector type (vec.h) and compiled for scalar, AVX2 and AVX512; the threads only
// join in when a call has enough rows to pay for waking them (a prompt chunk, not a decode step).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_kernels.h"
#include "vec.h"

KERNELS_VECTOR_CODE_BEGIN

namespace kernels::cpu {

namespace {

// Below this many elements a call runs on the calling thread: waking the others costs more.
constexpr int64_t kParallelElements = int64_t(1) << 15;

// --- add_rms_norm ----------------------------------------------------------------------------

struct NormArgs {
    void* out;
    void* x;
    const void* delta;
    const void* weight;
    int hidden;
    float eps;
};

template <class S, DType D>
KERNELS_INLINE void add_rms_norm_row(const NormArgs& a, int64_t row) {
    using V = typename S::V;
    constexpr int W = S::W;
    const int n = a.hidden, vec_end = n - n % W;
    const int64_t base = row * n;

    // Pass 1: the residual add, and the sum of squares of x as stored. The norm must see the
    // rounded residual, the value the next layer will read back, or the two would disagree.
    V ss = S::zero();
    float ss_tail = 0.f;
    int i = 0;
    for (; i < vec_end; i += W) {
        V v = S::template load_as<D>(a.x, base + i);
        if (a.delta) {
            v = S::add(v, S::template load_as<D>(a.delta, base + i));
            S::template store_as<D>(a.x, base + i, v);
            if constexpr (D != DType::f32) v = S::template load_as<D>(a.x, base + i);
        }
        ss = S::fma(v, v, ss);
    }
    for (; i < n; ++i) {
        float v = load_as_float<D>(a.x, base + i);
        if (a.delta) {
            v = round_to<D>(v + load_as_float<D>(a.delta, base + i));
            store_from_float<D>(a.x, base + i, v);
        }
        ss_tail += v * v;
    }
    const float inv_rms = 1.f / std::sqrt((S::reduce_add(ss) + ss_tail) / float(n) + a.eps);

    // Pass 2: normalise and scale, rounding once. The row is still in L1.
    const V vinv = S::set1(inv_rms);
    for (i = 0; i < vec_end; i += W) {
        V v = S::mul(S::template load_as<D>(a.x, base + i), vinv);
        S::template store_as<D>(a.out, base + i, S::mul(v, S::template load_as<D>(a.weight, i)));
    }
    for (; i < n; ++i)
        store_from_float<D>(a.out, base + i, load_as_float<D>(a.x, base + i) * inv_rms * load_as_float<D>(a.weight, i));
}

template <class S>
KERNELS_INLINE void add_rms_norm_rows(const NormArgs& a, DType dtype, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
        switch (dtype) {
            case DType::f32: add_rms_norm_row<S, DType::f32>(a, r); break;
            case DType::bf16: add_rms_norm_row<S, DType::bf16>(a, r); break;
            case DType::f16: add_rms_norm_row<S, DType::f16>(a, r); break;
        }
    }
}

void add_rms_norm_scalar(const NormArgs& a, DType d, int64_t r0, int64_t r1) {
    add_rms_norm_rows<Scalar>(a, d, r0, r1);
}
#ifdef KERNELS_X86
KERNELS_AVX2 __attribute__((flatten)) void add_rms_norm_avx2(const NormArgs& a, DType d, int64_t r0, int64_t r1) {
    add_rms_norm_rows<Avx2>(a, d, r0, r1);
}
KERNELS_AVX512 __attribute__((flatten)) void add_rms_norm_avx512(const NormArgs& a, DType d, int64_t r0, int64_t r1) {
    add_rms_norm_rows<Avx512>(a, d, r0, r1);
}
#endif

// --- rope, and rope_cache ---------------------------------------------------------------------

// Rotates n_heads heads of head_dim values, read at element src_at of src, into dst at dst_at
// (the same place for an in-place rotation); c, s: the token's cos and sin, head_dim / 2 each.
template <class S, DType D>
KERNELS_INLINE void rotate_heads(const void* src, int64_t src_at, void* dst, int64_t dst_at, const float* c,
                                 const float* s, int n_heads, int head_dim) {
    using V = typename S::V;
    constexpr int W = S::W;
    const int half = head_dim / 2, vec_end = half - half % W;
    for (int h = 0; h < n_heads; ++h) {
        const int64_t lo = src_at + int64_t(h) * head_dim, hi = lo + half;
        const int64_t out_lo = dst_at + int64_t(h) * head_dim, out_hi = out_lo + half;
        int i = 0;
        for (; i < vec_end; i += W) {
            V x1 = S::template load_as<D>(src, lo + i), x2 = S::template load_as<D>(src, hi + i);
            V cv = S::load(c + i), sv = S::load(s + i);
            S::template store_as<D>(dst, out_lo + i, S::fnma(x2, sv, S::mul(x1, cv)));  // x1 cos - x2 sin
            S::template store_as<D>(dst, out_hi + i, S::fma(x1, sv, S::mul(x2, cv)));   // x2 cos + x1 sin
        }
        for (; i < half; ++i) {
            float x1 = load_as_float<D>(src, lo + i), x2 = load_as_float<D>(src, hi + i);
            store_from_float<D>(dst, out_lo + i, x1 * c[i] - x2 * s[i]);
            store_from_float<D>(dst, out_hi + i, x2 * c[i] + x1 * s[i]);
        }
    }
}

struct RopeArgs {
    void* qk;
    const float* cos;
    const float* sin;
    int n_heads;
    int head_dim;
    int64_t token_stride;
};

template <class S, DType D>
KERNELS_INLINE void rope_token(const RopeArgs& a, int64_t t) {  // rope's token
    const int64_t at = t * a.token_stride, half = a.head_dim / 2;
    rotate_heads<S, D>(a.qk, at, a.qk, at, a.cos + t * half, a.sin + t * half, a.n_heads, a.head_dim);
}

// One token of rope_cache: its q heads rotated in place, its k heads rotated straight into the
// pool row of its slot, its v heads copied there. The K and V a step writes are a few hundred
// bytes per token: what this saves over rope then two indexed copies is the passes and the calls.
struct RopeCacheArgs {
    void* qkv;
    const float* cos;
    const float* sin;
    void* k_pool;
    void* v_pool;
    const int64_t* slots;
    int n_heads;
    int n_kv_heads;
    int head_dim;
};

template <class S, DType D>
KERNELS_INLINE void rope_token(const RopeCacheArgs& a, int64_t t) {  // rope_cache's
    const int64_t hd = a.head_dim, half = hd / 2, kv_row = int64_t(a.n_kv_heads) * hd;
    const int64_t q_at = t * (a.n_heads + 2 * int64_t(a.n_kv_heads)) * hd, k_at = q_at + a.n_heads * hd,
                  v_at = k_at + kv_row, slot_at = a.slots[t] * kv_row;
    const float *c = a.cos + t * half, *s = a.sin + t * half;
    rotate_heads<S, D>(a.qkv, q_at, a.qkv, q_at, c, s, a.n_heads, a.head_dim);
    rotate_heads<S, D>(a.qkv, k_at, a.k_pool, slot_at, c, s, a.n_kv_heads, a.head_dim);
    constexpr int64_t size = D == DType::f32 ? 4 : 2;
    std::memcpy(static_cast<char*>(a.v_pool) + slot_at * size, static_cast<const char*>(a.qkv) + v_at * size,
                kv_row * size);
}

template <class S, class Args>
KERNELS_INLINE void rope_tokens(const Args& a, DType dtype, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
        switch (dtype) {
            case DType::f32: rope_token<S, DType::f32>(a, t); break;
            case DType::bf16: rope_token<S, DType::bf16>(a, t); break;
            case DType::f16: rope_token<S, DType::f16>(a, t); break;
        }
    }
}

// Args: RopeArgs (rope) or RopeCacheArgs (rope_cache).
template <class Args>
void rope_scalar(const Args& a, DType d, int64_t t0, int64_t t1) {
    rope_tokens<Scalar>(a, d, t0, t1);
}
#ifdef KERNELS_X86
template <class Args>
KERNELS_AVX2 __attribute__((flatten)) void rope_avx2(const Args& a, DType d, int64_t t0, int64_t t1) {
    rope_tokens<Avx2>(a, d, t0, t1);
}
template <class Args>
KERNELS_AVX512 __attribute__((flatten)) void rope_avx512(const Args& a, DType d, int64_t t0, int64_t t1) {
    rope_tokens<Avx512>(a, d, t0, t1);
}
#endif

// The rope path for this CPU's instruction set.
template <class Args>
auto rope_for_isa() {
    auto fn = rope_scalar<Args>;
#ifdef KERNELS_X86
    if (isa() >= Isa::avx512) fn = rope_avx512<Args>;
    else if (isa() == Isa::avx2) fn = rope_avx2<Args>;
#endif
    return fn;
}

// --- silu_mul ----------------------------------------------------------------------------------
// torch spends three passes on it (silu, then the product, each reading and writing a row) and
// two calls; here one pass reads gate and up once and writes the product once.

struct SiluArgs {
    void* out;
    const void* gate_up;
    int inter;
};

// e^-g with -g capped at 88: vec.h's exp has no overflow path, and e^88 (1.7e38) is still a
// float, where silu(g) = g / (1 + e^-g) is 0 to float precision anyway.
constexpr float kSiluCap = 88.f;

template <class S, DType D>
KERNELS_INLINE void silu_mul_row(const SiluArgs& a, int64_t row) {
    using V = typename S::V;
    constexpr int W = S::W;
    const int n = a.inter, vec_end = n - n % W;
    const int64_t gate = row * 2 * n, up = gate + n, out = row * n;
    const V one = S::set1(1.f), cap = S::set1(kSiluCap);
    int i = 0;
    for (; i < vec_end; i += W) {
        const V g = S::template load_as<D>(a.gate_up, gate + i);
        const V e = S::exp(S::min(S::sub(S::zero(), g), cap));
        const V silu = S::div(g, S::add(one, e));
        S::template store_as<D>(a.out, out + i, S::mul(silu, S::template load_as<D>(a.gate_up, up + i)));
    }
    for (; i < n; ++i) {
        const float g = load_as_float<D>(a.gate_up, gate + i);
        const float silu = g / (1.f + std::exp(std::min(-g, kSiluCap)));
        store_from_float<D>(a.out, out + i, silu * load_as_float<D>(a.gate_up, up + i));
    }
}

template <class S>
KERNELS_INLINE void silu_mul_rows(const SiluArgs& a, DType dtype, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
        switch (dtype) {
            case DType::f32: silu_mul_row<S, DType::f32>(a, r); break;
            case DType::bf16: silu_mul_row<S, DType::bf16>(a, r); break;
            case DType::f16: silu_mul_row<S, DType::f16>(a, r); break;
        }
    }
}

void silu_mul_scalar(const SiluArgs& a, DType d, int64_t r0, int64_t r1) { silu_mul_rows<Scalar>(a, d, r0, r1); }
#ifdef KERNELS_X86
KERNELS_AVX2 __attribute__((flatten)) void silu_mul_avx2(const SiluArgs& a, DType d, int64_t r0, int64_t r1) {
    silu_mul_rows<Avx2>(a, d, r0, r1);
}
KERNELS_AVX512 __attribute__((flatten)) void silu_mul_avx512(const SiluArgs& a, DType d, int64_t r0, int64_t r1) {
    silu_mul_rows<Avx512>(a, d, r0, r1);
}
#endif

// Runs fn(args, dtype, begin, end) over [0, n) items of `item_elements` each: on this thread
// when the whole is small, else split in equal contiguous ranges over the OpenMP threads.
template <class Fn, class Args>
void run_rows(Fn fn, const Args& args, DType dtype, int64_t n, int64_t item_elements) {
    if (n * item_elements <= kParallelElements || omp_get_max_threads() == 1) {
        fn(args, dtype, 0, n);
        return;
    }
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t begin = n * t / nt, end = n * (t + 1) / nt;
        if (begin < end) fn(args, dtype, begin, end);
    }
}

}  // namespace

void add_rms_norm(void* out, void* x, const void* delta, const void* weight, int rows, int hidden, float eps,
                  DType dtype) {
    const NormArgs args{out, x, delta, weight, hidden, eps};
    auto fn = add_rms_norm_scalar;
#ifdef KERNELS_X86
    if (isa() >= Isa::avx512) fn = add_rms_norm_avx512;
    else if (isa() == Isa::avx2) fn = add_rms_norm_avx2;
#endif
    run_rows(fn, args, dtype, rows, hidden);
}

void rope(void* qk, const float* cos, const float* sin, int tokens, int n_heads, int head_dim, int64_t token_stride,
          DType dtype) {
    const RopeArgs args{qk, cos, sin, n_heads, head_dim, token_stride};
    run_rows(rope_for_isa<RopeArgs>(), args, dtype, tokens, int64_t(n_heads) * head_dim);
}

void rope_cache(void* qkv, const float* cos, const float* sin, void* k_pool, void* v_pool, const int64_t* slots,
                int tokens, int n_heads, int n_kv_heads, int head_dim, DType dtype) {
    const RopeCacheArgs args{qkv, cos, sin, k_pool, v_pool, slots, n_heads, n_kv_heads, head_dim};
    run_rows(rope_for_isa<RopeCacheArgs>(), args, dtype, tokens, (int64_t(n_heads) + 2 * n_kv_heads) * head_dim);
}

void silu_mul(void* out, const void* gate_up, int rows, int inter, DType dtype) {
    const SiluArgs args{out, gate_up, inter};
    auto fn = silu_mul_scalar;
#ifdef KERNELS_X86
    if (isa() >= Isa::avx512) fn = silu_mul_avx512;
    else if (isa() == Isa::avx2) fn = silu_mul_avx2;
#endif
    run_rows(fn, args, dtype, rows, 2 * int64_t(inter));
}

}  // namespace kernels::cpu

KERNELS_VECTOR_CODE_END
