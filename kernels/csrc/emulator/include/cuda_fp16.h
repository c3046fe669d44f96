// The emulator's half: IEEE binary16 through the compiler's _Float16 (round to nearest even).
#pragma once
#include "emu.h"

struct __half {
    uint16_t bits;
};

inline float __half2float(__half v) {
    _Float16 h;
    std::memcpy(&h, &v.bits, 2);
    return static_cast<float>(h);
}

inline __half __float2half_rn(float f) {
    const _Float16 h = static_cast<_Float16>(f);
    __half v;
    std::memcpy(&v.bits, &h, 2);
    return v;
}

inline unsigned short __half_as_ushort(__half v) { return v.bits; }
inline __half __ushort_as_half(unsigned short bits) { return {bits}; }
