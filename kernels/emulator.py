"""The CUDA kernels of csrc/cuda/, compiled by the host C++ compiler and run on the CPU: a test
tool, so that every CUDA kernel executes in `make test` on a machine without a GPU.

    from kernels import emulator
    emu = emulator.load()                          # builds once (kernels/build/emulator/), then loads
    out = emu.paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale)   # CPU tensors

csrc/emulator/include/emu.h is the CUDA this needs (qualifiers, threadIdx and friends,
__syncthreads, warp shuffles and votes, bf16 and half) and says what the emulation shows and what
it cannot (timing, coalescing, the GPU's memory model); csrc/emulator/emu.cpp runs a launch:
blocks one after another, each CUDA thread a fiber. The .cu files are compiled unchanged except
for two constructs that are not C++, rewritten as they are read (translate()): the launch syntax
kernel<<<grid, block, smem, stream>>>(args) and `extern __shared__ T name[];`.

load(plant=...) compiles a variant with a bug planted in one file (a text replacement), so that a
test can show the emulated tests catch it; load(sanitize=True) builds with the address and
undefined-behaviour sanitizers, which need their runtime preloaded into the process
(sanitizer_env() gives the environment for a subprocess).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
CUDA = CSRC / "cuda"
EMU = CSRC / "emulator"
KERNEL_SOURCES = ["paged_attention.cu", "chunk_attention.cu", "norm_rope.cu", "quant_linear.cu", "gemm.cu", "lora.cu"]
FLAGS = ["-std=c++20", "-O1", "-fPIC", "-Wall", "-Wextra", "-Wno-unknown-pragmas", f"-I{EMU / 'include'}", f"-I{CUDA}"]
# Unoptimised: the sanitized build compiles in half the time, and its test cases are small. -g1: line
# tables, all a report's frames need (full -g added 10 % to the compile).
SANITIZE = ["-O0", "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-g1"]
DTYPE_CODES = {"torch.float32": 0, "torch.bfloat16": 1, "torch.float16": 2}  # kernels.h's DType


class EmulatorError(RuntimeError):
    """A launch the emulator refused or stopped: the message says which threads waited where."""


def translate(text: str, path: str) -> str:
    """The two CUDA constructs that are not C++, as calls into the emulator; line numbers kept."""
    text = re.sub(
        r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;",
        r"\1* const \2 = reinterpret_cast<\1*>(::emu::dynamic_shared(alignof(\1)));",
        text,
    )
    # name or name<template args> <<<config>>> ( args )  ->  ::emu::launch(config, name, args)
    launch = re.compile(r"(\b[A-Za-z_]\w*(?:<[^<>;{}]*>)?)\s*<<<(.*?)>>>\s*\(\s*(\)?)", re.S)
    text = launch.sub(lambda m: f"::emu::launch({m[2]}, {m[1]}" + (")" if m[3] else ", "), text)
    return f'#line 1 "{path}"\n{text}'


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise EmulatorError("no C++ compiler found (set CXX): the emulator compiles the .cu files with it")
    return cxx


def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted([*CUDA.glob("*.cuh"), *CUDA.glob("*.h"), *(EMU / "include").glob("*.h"), CSRC / "kernels.h"]):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def build_dir() -> Path:
    from kernels.build import build_root

    return build_root() / "emulator"


def _compile(cxx: str, text: str, flags: list[str], objects: Path) -> Path:
    """One translation unit to an object, cached by the hash of its text, the headers and the flags."""
    key = hashlib.sha256("\0".join([text, _headers_digest(), cxx, *flags]).encode()).hexdigest()[:24]
    obj = objects / f"{key}.o"
    if obj.exists():
        return obj
    # This process's own source and object names: another process may be building the same unit.
    source = objects / f"{key}.{os.getpid()}.cpp"
    tmp = obj.with_suffix(f".{os.getpid()}.tmp")
    source.write_text(text)
    try:
        r = subprocess.run([cxx, *flags, "-c", str(source), "-o", str(tmp)], capture_output=True, text=True)
    finally:
        source.unlink(missing_ok=True)
    if r.returncode != 0:
        raise EmulatorError(f"the emulator's build failed:\n{r.stderr[-4000:]}")
    tmp.replace(obj)  # atomic: a parallel build sees the whole object or none
    return obj


def build(plant: list[tuple[str, str, str]] | None = None, sanitize: bool = False) -> Path:
    """The emulator as a shared library, built if needed: every kernel source (with `plant`'s
    (file, old, new) replacements), the runtime and the C entry points. Returns its path."""
    cxx = compiler()
    flags = FLAGS + (SANITIZE if sanitize else [])
    units = []
    for name in KERNEL_SOURCES:
        text = (CUDA / name).read_text()
        for file, old, new in plant or []:
            if file == name:
                if text.count(old) != 1:
                    raise ValueError(f"plant: {old!r} occurs {text.count(old)} times in {name}, not once")
                text = text.replace(old, new)
        units.append(translate(text, f"kernels/csrc/cuda/{name}"))
    for name in ("emu.cpp", "api.cpp"):
        # Compiled from a copy in the object folder: its includes are made absolute.
        text = (EMU / name).read_text().replace('#include "include/', f'#include "{EMU}/include/')
        text = text.replace('#include "../cuda/', f'#include "{CUDA}/')
        units.append(f'#line 1 "kernels/csrc/emulator/{name}"\n{text}')
    objects = build_dir() / "obj"
    objects.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, min(len(units), os.cpu_count() or 1))) as pool:
        objs = list(pool.map(lambda text: _compile(cxx, text, flags, objects), units))
    key = hashlib.sha256("\0".join(o.name for o in objs).encode() + str(sanitize).encode()).hexdigest()[:24]
    lib = build_dir() / f"emu-{key}{'-asan' if sanitize else ''}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        link = [cxx, "-shared", *(SANITIZE[:1] if sanitize else []), *map(str, objs), "-o", str(tmp)]
        r = subprocess.run(link, capture_output=True, text=True)
        if r.returncode != 0:
            raise EmulatorError(f"the emulator's link failed:\n{r.stderr[-4000:]}")
        tmp.replace(lib)
    return lib


def sanitizer_env() -> dict[str, str]:
    """The environment in which a Python process can load a sanitize=True build: the sanitizers'
    runtimes preloaded (they must come before any other library), leak checks off (Python and
    torch keep memory to the end on purpose), and the first error fatal."""
    cxx = compiler()
    libs = [
        subprocess.run([cxx, f"-print-file-name={n}"], capture_output=True, text=True).stdout.strip()
        for n in ("libasan.so", "libubsan.so")
    ]
    return os.environ | {
        "LD_PRELOAD": ":".join(libs),
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    }


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _unwritten(shape, dtype):
    """An output tensor filled with NaN, as dynamic shared memory is: an element the kernel fails
    to write then fails the comparison with the reference, even where torch.empty would have
    handed back freed memory that held the right values (a reference result of the same shape)."""
    import torch

    return torch.full(tuple(shape), float("nan"), dtype=dtype)


class _LoraCalls:
    """The LoRA launchers (lora.cu), mixed into Emulated: the extension's lora_shrink and lora_expand_."""

    def _lora_argtypes(self) -> None:
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self.lib.emu_lora_shrink.argtypes = [p, i64, p, i64, p, p, p, p] + [i] * 7
        self.lib.emu_lora_expand.argtypes = [p, i64, p, i64, p, p, p, p, p] + [i] * 7

    def lora_shrink(self, x, a, ranks, seg_starts, seg_slots):
        """v float32 [rows, r_max] (NaN where the kernel writes nothing)."""
        import torch

        v = _unwritten((x.shape[0], a.shape[1]), torch.float32)
        err = self.lib.emu_lora_shrink(
            _ptr(v), v.stride(0), _ptr(x), x.stride(0), _ptr(a), _ptr(ranks), _ptr(seg_starts), _ptr(seg_slots),
            x.shape[0], seg_slots.numel(), a.shape[0], x.shape[1], a.shape[1], DTYPE_CODES[str(x.dtype)],
            DTYPE_CODES[str(a.dtype)],
        )  # fmt: skip
        self._check(err, "lora_shrink")
        return v

    def lora_expand_(self, y, v, b_t, ranks, scale, seg_starts, seg_slots):
        err = self.lib.emu_lora_expand(
            _ptr(y), y.stride(0), _ptr(v), v.stride(0), _ptr(b_t), _ptr(ranks), _ptr(scale), _ptr(seg_starts),
            _ptr(seg_slots), y.shape[0], seg_slots.numel(), b_t.shape[0], y.shape[1], b_t.shape[1],
            DTYPE_CODES[str(y.dtype)], DTYPE_CODES[str(b_t.dtype)],
        )  # fmt: skip
        self._check(err, "lora_expand")


class Emulated(_LoraCalls):
    """The kernel library's calls (as kernels.load() gives them), each running the CUDA kernel in
    the emulator, on CPU tensors. Shapes are checked by the launchers' own checks only: this is a
    test tool, and the extension (csrc/ops.cpp) is where the user-facing checks live."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.lib.emu_last_message.restype = ctypes.c_char_p
        self.lib.emu_blocks_run.restype = ctypes.c_int64
        f, i, i64 = ctypes.c_float, ctypes.c_int, ctypes.c_int64
        self.lib.emu_paged_decode_attention.argtypes = (
            [ctypes.c_void_p, ctypes.c_void_p, i64] + [ctypes.c_void_p] * 5 + [i] * 7 + [f, i]
        )
        self.lib.emu_chunk_attention.argtypes = [ctypes.c_void_p] * 2 + [i64] + [ctypes.c_void_p] * 6 + [i] * 7 + [f, i]
        self.lib.emu_add_rms_norm.argtypes = [ctypes.c_void_p] * 4 + [i, i, f, i]
        self.lib.emu_rope.argtypes = [ctypes.c_void_p] * 3 + [i, i, i, i64, i]
        self.lib.emu_rope_cache.argtypes = [ctypes.c_void_p] * 6 + [i] * 5
        self.lib.emu_silu_mul.argtypes = [ctypes.c_void_p] * 2 + [i] * 3
        self.lib.emu_int4_linear.argtypes = [ctypes.c_void_p] * 5 + [i] * 5
        self.lib.emu_int8_linear.argtypes = [ctypes.c_void_p] * 4 + [i] * 4
        self.lib.emu_bf16_linear.argtypes = [ctypes.c_void_p] * 3 + [i] * 4
        self.lib.emu_int4_gemm.argtypes = self.lib.emu_int4_linear.argtypes
        self.lib.emu_int8_gemm.argtypes = self.lib.emu_int8_linear.argtypes
        self.lib.emu_bf16_gemm.argtypes = self.lib.emu_bf16_linear.argtypes
        self._lora_argtypes()

    def set_sm_count(self, n: int) -> None:
        """The SM count the emulated device reports (132 by default, an H100 SXM's): the attention
        kernel sizes its grid from it."""
        self.lib.emu_set_sm_count(n)

    @property
    def blocks_run(self) -> int:
        """Blocks the emulator has run in this process, all launches together."""
        return self.lib.emu_blocks_run()

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            message = self.lib.emu_last_message().decode()
            raise EmulatorError(f"{what}: cudaError {err}" + (f": {message}" if message else ""))

    def paged_decode_attention(
        self, q, k_pool, v_pool, block_tables, context_lens, scale, partition_size=256, workspace=None
    ):
        """As the extension's; `workspace` (float32, batch * n_heads * n_partitions * (head_dim + 2))
        may be given, to look at the partial results the merge read."""
        import torch

        batch, n_heads, head_dim = q.shape
        block_size, n_kv_heads = k_pool.shape[1], k_pool.shape[2]
        max_blocks = block_tables.shape[1]
        n_partitions = -(-max_blocks * block_size // partition_size)
        if workspace is None:
            workspace = torch.empty(batch * n_heads * n_partitions * (head_dim + 2), dtype=torch.float32)
        out = _unwritten(q.shape, q.dtype)
        err = self.lib.emu_paged_decode_attention(
            _ptr(out),
            _ptr(q),
            q.stride(0),
            _ptr(k_pool),
            _ptr(v_pool),
            _ptr(block_tables),
            _ptr(context_lens),
            _ptr(workspace),
            batch,
            n_heads,
            n_kv_heads,
            head_dim,
            block_size,
            max_blocks,
            partition_size,
            scale,
            DTYPE_CODES[str(q.dtype)],
        )
        self._check(err, "paged_decode_attention")
        return out

    def chunk_attention(self, q, k_pool, v_pool, block_tables, query_start, query_lens, context_lens, scale):
        """As the extension's, except that rows no chunk names are NaN (the extension zeroes them first)."""
        tokens, n_heads, head_dim = q.shape
        block_size, n_kv_heads = k_pool.shape[1], k_pool.shape[2]
        out = _unwritten(q.shape, q.dtype)
        err = self.lib.emu_chunk_attention(
            *map(_ptr, (out, q)), q.stride(0), *map(_ptr, (k_pool, v_pool, block_tables, query_start, query_lens)),
            _ptr(context_lens), tokens, block_tables.shape[0], n_heads, n_kv_heads, head_dim, block_size,
            block_tables.shape[1], scale, DTYPE_CODES[str(q.dtype)],
        )  # fmt: skip
        self._check(err, "chunk_attention")
        return out

    def add_rms_norm(self, x, delta, weight, eps):
        out = _unwritten(x.shape, x.dtype)
        err = self.lib.emu_add_rms_norm(
            _ptr(out), _ptr(x), _ptr(delta), _ptr(weight), x.shape[0], x.shape[1], eps, DTYPE_CODES[str(x.dtype)]
        )
        self._check(err, "add_rms_norm")
        return out

    def rope_(self, qk, cos, sin):
        tokens, heads, head_dim = qk.shape
        err = self.lib.emu_rope(
            _ptr(qk), _ptr(cos), _ptr(sin), tokens, heads, head_dim, qk.stride(0), DTYPE_CODES[str(qk.dtype)]
        )
        self._check(err, "rope")

    def rope_cache_(self, qkv, cos, sin, k_pool, v_pool, slots):
        tokens, heads, head_dim = qkv.shape
        n_kv_heads = k_pool.shape[2]
        err = self.lib.emu_rope_cache(
            *map(_ptr, (qkv, cos, sin, k_pool, v_pool, slots)),
            tokens,
            heads - 2 * n_kv_heads,
            n_kv_heads,
            head_dim,
            DTYPE_CODES[str(qkv.dtype)],
        )
        self._check(err, "rope_cache")

    def silu_mul(self, gate_up):
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = _unwritten((rows, inter), gate_up.dtype)
        err = self.lib.emu_silu_mul(_ptr(out), _ptr(gate_up), rows, inter, DTYPE_CODES[str(gate_up.dtype)])
        self._check(err, "silu_mul")
        return out

    def int4_linear(self, x, packed, scale, min, group_size):
        """The matrix-vector kernel (quant_linear.cu), at any row count: the library launches it below
        kGemmMinRows rows (ops.cpp), int4_gemm from there."""
        return self._int4(self.lib.emu_int4_linear, "int4_linear", x, packed, scale, min, group_size)

    def int8_linear(self, x, q, scale):
        return self._int8(self.lib.emu_int8_linear, "int8_linear", x, q, scale)

    def bf16_linear(self, x, w):
        return self._bf16(self.lib.emu_bf16_linear, "bf16_linear", x, w)

    def int4_gemm(self, x, packed, scale, min, group_size):
        """The tiled matrix product (gemm.cu), at any row count; the same arguments and result."""
        return self._int4(self.lib.emu_int4_gemm, "int4_gemm", x, packed, scale, min, group_size)

    def int8_gemm(self, x, q, scale):
        return self._int8(self.lib.emu_int8_gemm, "int8_gemm", x, q, scale)

    def bf16_gemm(self, x, w):
        return self._bf16(self.lib.emu_bf16_gemm, "bf16_gemm", x, w)

    def _int4(self, fn, what, x, packed, scale, min, group_size):
        import torch

        n_out, n_in = packed.shape[0], packed.shape[1] * 2
        if scale.dtype != torch.float16 or min.dtype != torch.float16:  # the kernel reads their bits as float16
            raise TypeError(f"scale and min must be float16, got {scale.dtype} and {min.dtype}")
        y = _unwritten((x.shape[0], n_out), x.dtype)
        err = fn(
            _ptr(y),
            _ptr(x),
            _ptr(packed),
            _ptr(scale),
            _ptr(min),
            x.shape[0],
            n_in,
            n_out,
            group_size,
            DTYPE_CODES[str(x.dtype)],
        )
        self._check(err, what)
        return y

    def _int8(self, fn, what, x, q, scale):
        import torch

        n_out, n_in = q.shape
        if scale.dtype != torch.float32:  # the kernel reads its bits as float32
            raise TypeError(f"scale must be float32, got {scale.dtype}")
        y = _unwritten((x.shape[0], n_out), x.dtype)
        err = fn(_ptr(y), _ptr(x), _ptr(q), _ptr(scale), x.shape[0], n_in, n_out, DTYPE_CODES[str(x.dtype)])
        self._check(err, what)
        return y

    def _bf16(self, fn, what, x, w):
        import torch

        if w.dtype != torch.bfloat16:  # the kernel reads its bits as bf16
            raise TypeError(f"w must be bfloat16, got {w.dtype}")
        n_out, n_in = w.shape
        y = _unwritten((x.shape[0], n_out), x.dtype)
        err = fn(_ptr(y), _ptr(x), _ptr(w), x.shape[0], n_in, n_out, DTYPE_CODES[str(x.dtype)])
        self._check(err, what)
        return y


def load(plant: list[tuple[str, str, str]] | None = None, sanitize: bool = False) -> Emulated:
    return Emulated(build(plant, sanitize))


class Printed:
    text = ""


@contextlib.contextmanager
def printed():
    """What the kernels printf while the block runs, as `.text`: C's stdout (file descriptor 1) goes
    to a file meanwhile. A notebook shows Python's output, not what a C library writes there.

        with emulator.printed() as out:
            emu.add_rms_norm(x, None, w, 1e-5)
        print(out.text)
    """
    libc = ctypes.CDLL(None)
    result = Printed()
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 1)
        try:
            yield result
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            f.seek(0)
            result.text = f.read().decode(errors="replace")
