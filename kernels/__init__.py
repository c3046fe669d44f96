"""A kernel library for the chapter engines: paged decode attention, RMSNorm, RoPE and quantized
linear layers, each written twice, as a CUDA kernel (csrc/cuda/) and as its C++ CPU twin
(csrc/cpu/), with a PyTorch reference of the same maths (reference.py).

    import kernels
    ops = kernels.load()          # builds on first use (kernels/build/), then loads
    out = ops.paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale)
"""

from kernels.build import KernelBuildError, load

__all__ = ["KernelBuildError", "load"]
