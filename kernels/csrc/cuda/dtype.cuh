// The element types on the device, and how every kernel reads and writes them.
//
// Activations, the KV cache and norm weights come as float, bf16 or f16 (kernels.h's DType); a
// kernel is a template on the C++ type T (float, __nv_bfloat16, __half), widens every element to
// float as it loads it, computes in float, and rounds once, to nearest even, as it stores.
//
// Two ways to move elements:
//   load / store          one element (any address);
//   load_vec / store_vec  N consecutive elements in ONE memory instruction of N * sizeof(T) bytes
//                         (16 bytes: 8 bf16 or 4 floats). The address must be aligned to that
//                         size; the caller checks it (is_aligned, on the host) or knows it.
//                         N = 1 is a plain element access, so a kernel templated on N has a
//                         fallback for unaligned data for free.
// A 16-byte access moves as many bytes per instruction as a thread can, so a warp reading 512
// consecutive bytes needs one instruction instead of eight 2-byte ones.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../kernels.h"

namespace kernels::cuda {

// --- one element ----------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
    return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
    return __float2half_rn(v);
}

template <typename T>
__device__ __forceinline__ float load(const T* p) {
    return to_float(*p);
}

template <typename T>
__device__ __forceinline__ void store(T* p, float v) {
    *p = from_float<T>(v);
}

// v as it would read back after a store: what the residual stream holds once rounded to T.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
    return to_float(from_float<T>(v));
}

// --- N elements in one access ---------------------------------------------------------------
// The raw bits of N elements, as 32-bit words: one 16-bit element is half a word, element 0 in
// the low half (the GPU is little-endian). Kernels that want a load in flight early (before they
// need the values) keep a Packed in registers and unpack it later.
template <typename T, int N>
struct Packed {
    static constexpr int kBytes = N * static_cast<int>(sizeof(T));
    static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "one access moves 4, 8 or 16 bytes");
    static constexpr int kWords = kBytes / 4;
    uint32_t w[kWords];
};

// READ_ONLY: the data does not change while the kernel runs (a KV pool, weights), so the load
// may go through the read-only data cache (__ldg, LDG.CONSTANT). Never for memory the kernel
// itself writes: that cache is not kept coherent with the kernel's own stores.
template <typename T, int N, bool READ_ONLY = false>
__device__ __forceinline__ Packed<T, N> load_packed(const T* p) {
    Packed<T, N> v;
    if constexpr (Packed<T, N>::kWords == 4) {
        const uint4* q = reinterpret_cast<const uint4*>(p);
        const uint4 u = READ_ONLY ? __ldg(q) : *q;  // one 16-byte load (LDG.128)
        v.w[0] = u.x, v.w[1] = u.y, v.w[2] = u.z, v.w[3] = u.w;
    } else if constexpr (Packed<T, N>::kWords == 2) {
        const uint2* q = reinterpret_cast<const uint2*>(p);
        const uint2 u = READ_ONLY ? __ldg(q) : *q;
        v.w[0] = u.x, v.w[1] = u.y;
    } else {
        const unsigned int* q = reinterpret_cast<const unsigned int*>(p);
        v.w[0] = READ_ONLY ? __ldg(q) : *q;
    }
    return v;
}

template <typename T, int N>
__device__ __forceinline__ Packed<T, N> zero_packed() {
    Packed<T, N> v;
#pragma unroll
    for (int i = 0; i < Packed<T, N>::kWords; ++i) v.w[i] = 0u;
    return v;
}

template <typename T, int N>
__device__ __forceinline__ void unpack(const Packed<T, N>& v, float (&out)[N]) {
#pragma unroll
    for (int i = 0; i < Packed<T, N>::kWords; ++i) {
        const uint32_t w = v.w[i];
        if constexpr (sizeof(T) == 4) {
            out[i] = __uint_as_float(w);
        } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
            // bf16 is the top half of a float: moving its bits up is the whole conversion.
            out[2 * i] = __uint_as_float(w << 16);
            out[2 * i + 1] = __uint_as_float(w & 0xFFFF0000u);
        } else {
            out[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu)));
            out[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
        }
    }
}

template <typename T>
__device__ __forceinline__ uint32_t bits16(float v) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        return __bfloat16_as_ushort(__float2bfloat16_rn(v));
    } else {
        return __half_as_ushort(__float2half_rn(v));
    }
}

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[N]) {
    if constexpr (N == 1) {
        out[0] = load(p);  // a lone element: a plain access (a 16-bit one is no whole word)
    } else {
        unpack<T, N>(load_packed<T, N>(p), out);
    }
}

template <typename T, int N>
__device__ __forceinline__ Packed<T, N> pack(const float (&in)[N]) {
    Packed<T, N> v;
#pragma unroll
    for (int i = 0; i < Packed<T, N>::kWords; ++i) {
        if constexpr (sizeof(T) == 4) {
            v.w[i] = __float_as_uint(in[i]);
        } else {
            v.w[i] = bits16<T>(in[2 * i]) | (bits16<T>(in[2 * i + 1]) << 16);
        }
    }
    return v;
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[N]) {
    if constexpr (N == 1) {
        store(p, in[0]);
    } else {
        const Packed<T, N> v = pack<T, N>(in);
        if constexpr (Packed<T, N>::kWords == 4) {
            *reinterpret_cast<uint4*>(p) = make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]);  // one 16-byte store
        } else if constexpr (Packed<T, N>::kWords == 2) {
            *reinterpret_cast<uint2*>(p) = make_uint2(v.w[0], v.w[1]);
        } else {
            *reinterpret_cast<uint32_t*>(p) = v.w[0];
        }
    }
}

// --- host side: from the runtime DType to the template ---------------------------------------

inline bool is_aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename T>
struct TypeTag {
    using type = T;
};

// Calls f(TypeTag<T>{}) with the C++ type of `dtype`; an unknown dtype is cudaErrorInvalidValue.
//   return dispatch_dtype(dtype, [&](auto tag) { using T = typename decltype(tag)::type; ... });
template <typename F>
cudaError_t dispatch_dtype(DType dtype, F&& f) {
    switch (dtype) {
        case DType::f32: return f(TypeTag<float>{});
        case DType::bf16: return f(TypeTag<__nv_bfloat16>{});
        case DType::f16: return f(TypeTag<__half>{});
    }
    return cudaErrorInvalidValue;
}

}  // namespace kernels::cuda
