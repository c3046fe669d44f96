// What every operator of ops.cpp does around its kernel: the checks they all share, and the one
// place that runs the CPU function or the CUDA launcher for the device of the tensors.
//
// The CPU functions (cpu/cpu_kernels.h) and the CUDA launchers (cuda/launchers.h) take the same
// arguments in the same order, the launchers then a stream; so an operator checks its tensors,
// allocates its outputs through torch (on CUDA a caching allocator: no call pays a cudaMalloc)
// and hands run_kernel one argument list for both. Nothing here waits for the GPU.
#pragma once

#include <ATen/ATen.h>
#include <torch/version.h>

#include "cpu/cpu_kernels.h"
#include "kernels.h"
#ifdef WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/launchers.h"
#endif

namespace kernels::ops {

inline DType dtype_of(const at::Tensor& t, const char* name) {
    switch (t.scalar_type()) {
        case at::kFloat: return DType::f32;
        case at::kBFloat16: return DType::bf16;
        case at::kHalf: return DType::f16;
        default: TORCH_CHECK(false, name, ": float32, bfloat16 or float16 expected, got ", t.scalar_type());
    }
}

// A LoRA table's dtype: float32 or bfloat16, as check_lora_weights allows.
inline DType lora_weight_dtype(const at::Tensor& w) { return w.scalar_type() == at::kFloat ? DType::f32 : DType::bf16; }

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* name) {
    TORCH_CHECK(a.device() == b.device(), name, " is on ", b.device(), ", expected ", a.device());
}

// Every operator calls this on its first tensor before anything else: past it, a tensor that is
// not on the CPU is on a GPU this build has code for, which run_kernel relies on.
inline void check_supported_device(const at::Tensor& t) {
    TORCH_CHECK(t.is_cpu() || t.is_cuda(), "kernels run on cpu or cuda tensors, got ", t.device());
#ifndef WITH_CUDA
    TORCH_CHECK(t.is_cpu(), "this build of kernels/ has no CUDA half (torch ", TORCH_VERSION,
                " is a CPU build, or nvcc was not found when it was built); got a tensor on ", t.device());
#endif
}

// A CUDA launcher of cuda/launchers.h by name; in a build without the CUDA half, where the
// launchers are not declared, nothing (run_kernel never reaches it there).
#ifdef WITH_CUDA
#define KERNELS_LAUNCHER(name) (&::kernels::cuda::name)
#else
#define KERNELS_LAUNCHER(name) nullptr
#endif

// cpu_fn(args...) when `on` is a CPU tensor; else launcher(args..., stream) on `on`'s GPU and
// its current stream, and a launch error as a Python error naming the kernel.
template <class CpuFn, class Launcher, class... Args>
void run_kernel(const char* name, const at::Tensor& on, CpuFn cpu_fn, Launcher launcher, Args... args) {
    if (on.is_cpu()) {
        cpu_fn(args...);
        return;
    }
#ifdef WITH_CUDA
    const c10::cuda::CUDAGuard guard(on.device());
    const cudaError_t err = launcher(args..., at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, name, ": ", cudaGetErrorString(err));
#else
    (void)name;
    (void)launcher;
#endif
}

}  // namespace kernels::ops
