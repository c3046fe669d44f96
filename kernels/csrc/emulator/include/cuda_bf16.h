// The emulator's bfloat16: the top 16 bits of a float, converted as the GPU converts (see emu.h).
#pragma once
#include "emu.h"

struct __nv_bfloat16 {
    uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 v) { return emu::from_bits<float>(static_cast<uint32_t>(v.bits) << 16); }

// Round to nearest, ties to even; a NaN stays a (quiet) NaN.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    const uint32_t u = emu::bits_of(f);
    if (std::isnan(f)) return {static_cast<uint16_t>((u >> 16) | 0x40)};
    const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
    return {static_cast<uint16_t>(rounded >> 16)};
}

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 v) { return v.bits; }
