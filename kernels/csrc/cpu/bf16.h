// The 16-bit float formats, one element at a time, in portable C++.
//
// bf16 is the top half of a float32: widening is a shift, narrowing rounds the low 16 bits away
// (to nearest, ties to even, as torch does). f16 has its own exponent range, so both directions
// rebias the exponent and handle subnormals. The SIMD versions live in vec.h; these serve the
// scalar path, loop tails, and anything too small to vectorise.
#pragma once

#include <cstdint>
#include <cstring>

#include "../kernels.h"

namespace kernels::cpu {

inline float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint32_t float_to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
    uint32_t u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
    // Adding 0x7fff rounds up when the low half is above one half; the kept bit's parity (lsb)
    // breaks the tie towards an even result. A carry into the exponent is correct rounding too.
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

inline float f16_to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float32
        float f = float(mant) * 5.9604644775390625e-8f;
        return bits_to_float(float_to_bits(f) | sign);
    }
    if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));  // inf, NaN
    return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));        // rebias 15 -> 127
}

inline uint16_t float_to_f16(float f) {
    uint32_t u = float_to_bits(f);
    uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u >= 0x7f800000u) return sign | (u > 0x7f800000u ? 0x7e00 : 0x7c00);  // NaN, inf
    if (u >= 0x477ff000u) return sign | 0x7c00;                               // at or past 65520: rounds to inf
    if (u < 0x38800000u) {
        // Below the smallest normal f16 (2^-14): a subnormal counts steps of 2^-24. Adding 0.5,
        // whose float32 ulp is exactly 2^-24, makes the FPU round |f| to that step (ties to
        // even); the step count is then the difference of the bit patterns.
        float a = bits_to_float(u) + 0.5f;
        return sign | uint16_t(float_to_bits(a) - 0x3f000000u);
    }
    // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest
    // even, as in float_to_bf16; a carry out of the mantissa bumps the exponent, as it should.
    u += 0xc8000fffu + ((u >> 13) & 1u);
    return sign | uint16_t(u >> 13);
}

// Element i of an array of `dtype`, widened to float.
inline float load_as_float(const void* p, int64_t i, DType dtype) {
    switch (dtype) {
        case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
        case DType::f16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
        default: return static_cast<const float*>(p)[i];
    }
}

// Rounds v to `dtype` and stores it as element i.
inline void store_from_float(void* p, int64_t i, float v, DType dtype) {
    switch (dtype) {
        case DType::bf16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
        case DType::f16: static_cast<uint16_t*>(p)[i] = float_to_f16(v); break;
        default: static_cast<float*>(p)[i] = v;
    }
}

// The same with the dtype known at compile time, for inner loops.
template <DType D>
inline float load_as_float(const void* p, int64_t i) {
    if constexpr (D == DType::bf16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    else if constexpr (D == DType::f16) return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    else return static_cast<const float*>(p)[i];
}

template <DType D>
inline void store_from_float(void* p, int64_t i, float v) {
    if constexpr (D == DType::bf16) static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
    else if constexpr (D == DType::f16) static_cast<uint16_t*>(p)[i] = float_to_f16(v);
    else static_cast<float*>(p)[i] = v;
}

// v as `D` would hold it: what a value looks like after a store and a load.
template <DType D>
inline float round_to(float v) {
    if constexpr (D == DType::bf16) return bf16_to_float(float_to_bf16(v));
    else if constexpr (D == DType::f16) return f16_to_float(float_to_f16(v));
    else return v;
}

}  // namespace kernels::cpu
