"""A kernel library for the chapter engines: paged decode attention, RMSNorm, RoPE and quantized
linear layers, each written twice, as a CUDA kernel (csrc/cuda/) and as its C++ CPU twin
(csrc/cpu/), with a PyTorch reference of the same maths (reference.py).

    import kernels
    ops = kernels.load()          # builds on first use (kernels/build/), then loads
    out = ops.paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale)
"""

__all__ = ["KernelBuildError", "gpu_not_covered", "load"]


def __getattr__(name):
    # kernels.build is imported on first use, not here: `python -m kernels.build` imports this
    # package first, and runpy warns when the module it is about to run is already imported.
    if name in __all__:
        from kernels import build

        return getattr(build, name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
