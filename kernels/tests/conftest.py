"""Fixtures for the kernel tests: the built module, each device, each CPU instruction-set path, and
the torch-free build of a CPU source with planted bugs."""

import ctypes
import os
import subprocess
from pathlib import Path

import pytest
import torch

import kernels
from common.tools.testing import (  # noqa: F401  (shared cores; seeded draws; devices used)
    pytest_configure,
    pytest_runtest_setup,
    pytest_terminal_summary,
)


@pytest.fixture(scope="session")
def ops():
    return kernels.load()


DEVICES = [os.environ["DEVICE"]] if os.environ.get("DEVICE") in ("cpu", "cuda") else ["cpu", "cuda"]


@pytest.fixture(params=DEVICES)
def device(request, ops):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device (run on a GPU node: slurm/gpu_check.sh)")
        if not ops.with_cuda:
            pytest.skip("kernels/ was built without its CUDA half (a CPU torch, or no nvcc)")
    return torch.device(request.param)


@pytest.fixture
def cuda(ops):
    """The GPU, for the tests of the CUDA twins against the CPU: skips where there is none."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (run on a GPU node: slurm/gpu_check.sh)")
    if not ops.with_cuda:
        pytest.skip("kernels/ was built without its CUDA half (a CPU torch, or no nvcc)")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def emu():
    """The CUDA kernels built for the CPU by the emulator (kernels/emulator.py)."""
    from kernels import emulator

    try:
        return emulator.load()
    except emulator.EmulatorError as e:
        if "no C++ compiler" in str(e):
            pytest.skip(str(e))
        raise


ISAS = ["scalar", "avx2", "avx512", "avx512_bf16"]


@pytest.fixture(params=ISAS)
def isa(request, ops):
    """Runs a CPU test once per instruction-set path this CPU has (the others skip), restoring the
    default afterwards. ATEN_CPU_CAPABILITY=avx2 caps the default as it caps torch's own kernels
    (=avx512 leaves out the BF16 dot products). The library's own products are what these tests
    check: AMX stays off (torch's GEMM for bf16 weights, which test_gemm.py tests; the integer
    products' tiles, which test_int4_q8_gemm.py and test_int8_q8_gemm.py test against VNNI)."""
    best = ops.best_cpu_isa()
    if ISAS.index(request.param) > ISAS.index(best):
        pytest.skip(f"this CPU (or ATEN_CPU_CAPABILITY) offers {best} at most")
    ops.set_cpu_isa(request.param)
    ops.set_cpu_gemm_amx(False)
    yield request.param
    ops.set_cpu_gemm_amx(None)
    ops.set_cpu_isa(best)


def each_form(ops, isa):
    """At AVX512-BF16 bf16 inputs are multiplied in bf16 pairs or widened to floats, as the CPU's
    maker suggests (cpu_kernels.h; the matrix product and the chunk kernel's scores): yields each
    in turn there (the default put back after), else the one."""
    if isa != "avx512_bf16":
        yield "floats"
        return
    try:
        for on in (True, False):
            ops.set_cpu_gemm_pairs(on)
            yield "pairs" if on else "floats"
    finally:
        ops.set_cpu_gemm_pairs(None)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = ""):
    """float32: to float32 summation order. bf16/fp16: one rounding of the output apart (a kernel
    and the reference can round a value sitting near a half-way point to two neighbours)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        actual.dtype,
        actual.shape,
        expected.shape,
    )
    rtol, atol = TOLERANCE[actual.dtype]
    torch.testing.assert_close(
        actual.float().cpu(), expected.float().cpu(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
    )


TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}  # rtol, atol


CPU_SOURCES = Path(__file__).resolve().parents[1] / "csrc" / "cpu"


def build_planted(folder: Path, source: str, changes, shim: str, also: tuple[str, ...], prologue: str = ""):
    """The CPU half's `source` (e.g. "gemm.cpp") with planted bugs, built torch-free as a plain shared
    library with a test's C shim, from copies of csrc/cpu/ in `folder`. changes: (old, new) text pairs
    for `source`, or (file, old, new) for another file of csrc/cpu/ (a header it includes), each `old`
    found exactly once, so a bug never silently misses its place; also: the other sources it needs;
    prologue: text put before each changed file, or a function of its text. No compiler: the test skips."""
    (folder / "cpu").mkdir()
    for f in CPU_SOURCES.iterdir():
        (folder / "cpu" / f.name).write_bytes(f.read_bytes())
    (folder / "kernels.h").write_bytes((CPU_SOURCES.parent / "kernels.h").read_bytes())
    by_file: dict[str, list[tuple[str, str]]] = {source: []}
    for change in changes:
        file, old, new = change if len(change) == 3 else (source, *change)
        by_file.setdefault(file, []).append((old, new))
    for file, edits in by_file.items():
        text = (folder / "cpu" / file).read_text()
        for old, new in edits:
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        (folder / "cpu" / file).write_text(prologue(text) if callable(prologue) else prologue + text)
    (folder / "cpu" / "shim.cpp").write_text(shim)
    sources = [str(folder / "cpu" / n) for n in ("shim.cpp", source, *also)]
    cxx = os.environ.get("CXX", "c++")
    # -O0: the copy runs a few small cases, and compiles in a half to a third of -O1's time (lora.cpp 2.7
    # against 8.5 s): the planted tests of the kernels' suite took 14 s instead of 27.
    command = [cxx, "-O0", "-std=c++20", "-fopenmp", "-shared", "-fPIC", "-o", str(folder / "planted.so"), *sources]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip(f"no C++ compiler ({cxx}) to build the planted copy")
    except subprocess.CalledProcessError as e:
        pytest.fail(f"the planted copy does not compile: {e.stderr}")
    return ctypes.CDLL(str(folder / "planted.so"))


def assert_caught_where_it_lives(ops, planted, index: int, bug: str, rows, widths, call) -> None:
    """A bug planted in an integer product's tiles (number `index` of a build_planted copy, named
    `bug`): call(r) runs r rows of x through the copy at its current ISA and returns (the tiles'
    width, whether the result passes the check). With the bug on, every ISA level this CPU has
    (AVX2 up) must fail the check exactly at the tile widths in `widths` that it runs; with it off,
    every call must pass."""
    level = ISAS.index(ops.best_cpu_isa())
    if level == 0:
        pytest.skip("this CPU has no AVX2: no integer product")
    caught, ran = set(), set()
    for on in (True, False):  # the bug on; then off: the same calls pass
        planted.set_bug(index if on else -1)
        for isa in range(1, level + 1):
            assert planted.set_isa(isa) == 0
            for r in rows:
                width, passes = call(r)
                ran.add(width)
                if not passes:
                    assert on, f"{bug}: the copy fails with the bug off, at tile width {width}"
                    caught.add(width)
    planted.set_bug(-1)
    expected = ran & set(widths)
    if not expected:
        pytest.skip(f"{bug}: lives in tiles {widths} wide; this CPU runs {sorted(ran)}")
    assert caught == expected, f"{bug}: caught at tile widths {sorted(caught)}, expected {sorted(expected)}"


# --- AMX-INT8 in the integer products (cpu/q8_tiles.h) ---------------------------------------------


def skip_without_amx_int8(ops) -> None:
    """Skips unless the integer products take AMX-INT8 tiles here by default: the CPU has them
    (Sapphire Rapids on), the OS grants them, and the level is AVX512-BF16 (not capped)."""
    ops.set_cpu_gemm_amx(None)
    if not ops.cpu_int8_amx():
        pytest.skip(f"needs AMX-INT8 tiles at the AVX512-BF16 level (this CPU, or its cap: {ops.best_cpu_isa()})")


def assert_amx_gives_vnni_s_bits(ops, linear, check, rows) -> None:
    """linear(x) (an integer product) with AMX on against AMX off, at each row count in rows (x a
    prefix of one draw): the tiles' sums are exact integers scaled by the VNNI tile's instructions,
    so every result is VNNI's to the bit; and each passes check(y, x)."""
    skip_without_amx_int8(ops)
    assert "amx-int8" in ops.cpu_int8_product(), ops.cpu_int8_product()
    try:
        for r in rows:
            ops.set_cpu_gemm_amx(None)
            y, x = linear(r)
            ops.set_cpu_gemm_amx(False)
            vnni, _ = linear(r)
            assert torch.equal(y, vnni), f"{r} rows: AMX differs from VNNI by {(y.float() - vnni.float()).abs().max()}"
            check(y, x)
        assert "amx" not in ops.cpu_int8_product()  # switched off (still)
    finally:
        ops.set_cpu_gemm_amx(None)


def assert_amx_bug_caught(ops, planted, index: int, bug: str, rows, call) -> None:
    """A bug planted in the AMX path of a build_planted copy (its shim's set_amx switches the tiles):
    with them on, caught at tile width 16 and nowhere else (assert_caught_where_it_lives)."""
    skip_without_amx_int8(ops)
    assert planted.set_amx(1) == 0, "the planted copy has no AMX-INT8 where the library has"
    try:
        assert_caught_where_it_lives(ops, planted, index, bug, rows, (16,), call)
    finally:
        planted.set_amx(0)
