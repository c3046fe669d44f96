// What the CPU and the CUDA halves of the library share: plain types, no torch.
//
// Every kernel in this library comes twice, as the same algorithm: a C++ function for the CPU
// (cpu/) and a CUDA kernel with its launcher (cuda/). Both take raw pointers, sizes and strides;
// neither includes a torch header. The torch glue in csrc/ (ops.cpp, the decoder layer, and
// bindings.cpp, which registers them) is the only code that knows about at::Tensor: it checks
// the tensors, takes their pointers (and the current CUDA stream) and calls one half.
#pragma once

#include <cstdint>

namespace kernels {

// The element type of activations, the KV cache and norm weights. bf16 and f16 travel as their
// 16 raw bits (uint16_t); every kernel widens them to float to compute and rounds once to store.
enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };

// The head sizes paged decode attention is built for, on both halves: the CUDA kernel is a
// template on the head size (a key's vector split over a power-of-two number of lanes), and the
// CPU twin accepts the same set so that a model runs on either or on neither.
constexpr int kHeadDims[] = {32, 64, 96, 128, 256};

constexpr bool supported_head_dim(int head_dim) {
    for (int d : kHeadDims)
        if (d == head_dim) return true;
    return false;
}

// Each size is a whole number of vectors of 16 floats (so of 8, and of 1): the CPU attention
// kernels' loops over head_dim have no tails.
constexpr bool head_dims_are_whole_vectors() {
    for (int d : kHeadDims)
        if (d % 16) return false;
    return true;
}
static_assert(head_dims_are_whole_vectors());

// From how many rows of x a linear layer (int4, int8, bf16 weights) is a matrix product instead
// of a matrix-vector product, on both halves: the CPU functions hand such calls to cpu/gemm.cpp
// (cpu_kernels.h says when), the CUDA operators (ops.cpp) launch cuda/gemm.cu. Below it each
// weight serves a few rows and reading W is the time, which the matrix-vector kernels minimise;
// from it on the multiply-adds are, and tiles that reuse each weight from fast memory win.
constexpr int kGemmMinRows = 16;

}  // namespace kernels
