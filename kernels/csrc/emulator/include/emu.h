// A CUDA emulator for tests: what the kernels of csrc/cuda/ use of CUDA, in plain C++, so that the
// host compiler builds the unchanged .cu files and a launch runs on the CPU. A test tool, not an
// engine: a launch runs its blocks one after another, and each CUDA thread of a block is a fiber
// (its own stack) on one host thread. A fiber runs until it reaches a point where it must wait for
// other threads (a __syncthreads, a warp shuffle or vote), then the next one runs; the scheduler
// (emu.cpp) releases a barrier when every thread of the block is at it, and a shuffle when every
// lane of the warp is, and reports a launch that can never finish (a thread missing from a barrier,
// a lane missing from a shuffle) as an error instead of hanging, as the hardware would.
//
// What it shows: the results of the kernel's arithmetic, its indexing and its synchronisation
// (a missing barrier reads shared memory that another thread has not written yet; shared memory
// starts as NaN bytes). What it cannot show: timing, occupancy, memory coalescing, bank conflicts,
// or the GPU's weak memory model (here every write is seen at once by every later read).
//
// The .cu files include <cuda_runtime.h>, <cuda_bf16.h> and <cuda_fp16.h>; the include/ folder
// beside this file puts these shims in their place. Two constructs are not C++ and are rewritten
// as the file is read (kernels/emulator.py): kernel<<<grid, block, smem, stream>>>(args) becomes a
// call of emu::launch, and `extern __shared__ T name[];` a pointer to the block's dynamic shared
// memory.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// --- qualifiers ----------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Shared memory is a static variable: the blocks of a launch run one after another on one host
// thread, so all threads of the running block see one copy, as on the GPU. (Not thread_local: the
// address sanitizer guards static arrays with red zones, thread-local ones not.)
#define __shared__ static

// --- vector types and launch geometry --------------------------------------------------------------
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

// --- the runtime API the launchers use ---------------------------------------------------------------
enum cudaError_t : int {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorLaunchFailure = 719,  // the emulator's verdict on a launch that broke a rule (emu::last_message())
};
enum cudaFuncAttribute : int { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr : int { cudaDevAttrMultiProcessorCount = 16 };
using cudaStream_t = struct EmuStream*;

namespace emu {

struct Thread;  // one CUDA thread of the running block (emu.cpp)
extern Thread* current;
extern dim3 block_idx, block_dim, grid_dim;
const dim3& thread_idx(const Thread* t);

// The calling thread waits at a block-wide barrier / a warp-wide exchange (emu.cpp). `site`
// names the call in the source, to tell two barriers apart in an error message.
void barrier(const char* file, int line);
// Every lane of `mask` gives `value` and `arg`; returns what the exchange gives this lane:
// kind 0 xor (the value of lane ^ arg), 1 idx (of lane arg), 2 down (of lane + arg, or its own),
// 3 ballot (bit i: lane i's value != 0).
uint32_t warp_exchange(int kind, unsigned mask, uint32_t value, int arg, int width, const char* file, int line);

uint8_t* dynamic_shared(size_t align);
cudaError_t launch_blocks(dim3 grid, dim3 block, size_t smem, void (*run)(void*), void* closure);
cudaError_t set_max_dynamic_shared(const void* kernel, int bytes);
size_t max_dynamic_shared(const void* kernel);
cudaError_t take_error();
cudaError_t refuse(const char* why);  // a launch the GPU would refuse: cudaErrorInvalidValue, kept for cudaGetLastError

// kernel<<<grid, block, smem, stream>>>(args...): the arguments are copied, as a launch copies
// them to the GPU, and every thread of every block calls kernel with them.
template <typename... Params, typename... Args>
cudaError_t launch(dim3 grid, dim3 block, size_t smem, cudaStream_t, void (*kernel)(Params...), Args&&... args) {
    if (smem > 48 * 1024 && smem > max_dynamic_shared(reinterpret_cast<const void*>(kernel))) {
        return refuse("over 48 KB of dynamic shared memory without cudaFuncSetAttribute");
    }
    struct Closure {
        void (*kernel)(Params...);
        std::tuple<std::decay_t<Params>...> args;
    } closure{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
    return launch_blocks(
        grid, block, smem,
        [](void* c) {
            auto* self = static_cast<Closure*>(c);
            std::apply(self->kernel, self->args);
        },
        &closure);
}

}  // namespace emu

#define threadIdx (::emu::thread_idx(::emu::current))
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)

namespace emu {
extern int sm_count;  // what the emulated device reports (an H100 SXM's 132 unless a test sets it)
}
inline cudaError_t cudaGetLastError() { return emu::take_error(); }
inline cudaError_t cudaGetDevice(int* device) {
    *device = 0;
    return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
    if (attribute != cudaDevAttrMultiProcessorCount || device != 0) return cudaErrorInvalidValue;
    *value = emu::sm_count;
    return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel kernel, cudaFuncAttribute attribute, int value) {
    if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
    return emu::set_max_dynamic_shared(reinterpret_cast<const void*>(kernel), value);
}

// --- synchronisation: a barrier and the warp-wide exchanges ---------------------------------------------
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    emu::barrier(file, line);
}

namespace emu {
template <typename T>
uint32_t bits_of(T v) {
    static_assert(sizeof(T) == 4, "the emulated shuffles move 32-bit values");
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
}
template <typename T>
T from_bits(uint32_t u) {
    T v;
    std::memcpy(&v, &u, 4);
    return v;
}
}  // namespace emu

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, const char* file = __builtin_FILE(),
                  int line = __builtin_LINE()) {
    return emu::from_bits<T>(emu::warp_exchange(0, mask, emu::bits_of(v), lane_mask, width, file, line));
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32, const char* file = __builtin_FILE(),
              int line = __builtin_LINE()) {
    return emu::from_bits<T>(emu::warp_exchange(1, mask, emu::bits_of(v), src_lane, width, file, line));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, const char* file = __builtin_FILE(),
                   int line = __builtin_LINE()) {
    return emu::from_bits<T>(emu::warp_exchange(2, mask, emu::bits_of(v), static_cast<int>(delta), width, file, line));
}
inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
    return emu::warp_exchange(3, mask, predicate != 0, 0, 32, file, line);
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return __ballot_sync(mask, predicate, file, line) != 0;
}
inline int __all_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return __ballot_sync(mask, predicate, file, line) == mask;
}

// --- arithmetic intrinsics ------------------------------------------------------------------------
inline float __uint_as_float(unsigned u) { return emu::from_bits<float>(u); }
inline unsigned __float_as_uint(float f) { return emu::bits_of(f); }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
using std::fmaf;
using std::fmaxf;
using std::fminf;
// CUDA's device min and max for integers (std:: ones need equal argument types: so do these).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
// Byte n of the result is byte (selector nibble n & 7) of the 8 bytes a[0..3], b[4..7].
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned selector) {
    const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n)
        r |= static_cast<unsigned>((bytes >> (8 * ((selector >> (4 * n)) & 7))) & 0xFF) << (8 * n);
    return r;
}
template <typename T>
T __ldg(const T* p) {
    return *p;  // the read-only cache path: on the CPU, a load
}
