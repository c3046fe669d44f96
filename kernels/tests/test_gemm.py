"""The CPU linears' matrix product (csrc/cpu/gemm.cpp): every row count from 1 to 300 against the
reference, on every instruction-set path, for int4, int8 and bf16 weights and float32 and bf16 x; the
shapes leave tails of every tile (rows of x, outputs of a panel, inputs of a vector step). Below
gemm_min_rows the matrix-vector kernels answer, so the sweep covers the hand-over too. Then bugs
planted in a copy of the source, each of which the same check must catch."""

import ctypes
from pathlib import Path

import pytest
import torch

from conftest import assert_close, build_planted, each_form
from kernels import reference
from test_quant_linear import assert_int4_close, assert_int8_close, int4_weight

ROWS = [*range(1, 20), 23, 31, 32, 33, 47, 64, 65, 127, 128, 129, 255, 300]
# (n_out, n_in): outputs past a panel of 6 / 12 and past a vector of 8 / 16; inputs past a vector of
# 8 / 16 / 32 (int8, bf16), and (int4, 640) rows of inputs taken in two pieces
SHAPES = {
    "int4": [(70, 320), (16, 64), (40, 640)],
    "int8": [(70, 100), (33, 320)],
    "bf16": [(70, 100), (21, 33)],
}


def weights(kind: str, n_out: int, n_in: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "int4":
        return int4_weight(n_out, n_in, 32, seed=seed)
    if kind == "int8":
        q = torch.randint(-127, 128, (n_out, n_in), generator=g, dtype=torch.int8)
        return q, torch.rand(n_out, generator=g) * 0.01
    return ((torch.randn(n_out, n_in, generator=g) * 0.05).bfloat16(),)


def call(ops, kind, x, w):
    if kind == "int4":
        return ops.int4_linear(x, *w, 32)
    return ops.int8_linear(x, *w) if kind == "int8" else ops.bf16_linear(x, *w)


def check(y, kind, x, w, what):
    """y of a `kind` product of x and the weights w (as weights() makes them) against the reference."""
    if kind == "int4":
        packed, scale, min_ = w
        return assert_int4_close(y, x, packed, scale, min_, packed.shape[1] * 2 // scale.shape[1], what)
    if kind == "int8":
        return assert_int8_close(y, x, *w, what)
    assert_close(y, reference.bf16_linear(x, *w), what)


@pytest.mark.parametrize("kind", ["int4", "int8", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_row_count_on_every_cpu_path(ops, isa, kind, dtype):
    for form in each_form(ops, isa):
        for n_out, n_in in SHAPES[kind]:
            w = weights(kind, n_out, n_in, seed=n_out)
            x_all = torch.randn(max(ROWS), n_in, generator=torch.Generator().manual_seed(n_in)).to(dtype)
            for rows in ROWS:
                x = x_all[:rows]
                check(call(ops, kind, x, w), kind, x, w, f"{isa} ({form}) {kind} {rows} x {n_in} -> {n_out}")


def test_a_row_is_the_same_whatever_rows_follow_it_in_the_product(ops, isa):
    # Within the matrix product a row's sums do not depend on the tile it lands in (full or a
    # tail): a row gives the same bits in a call of 16 rows and of 300. (Across the hand-over at
    # gemm_min_rows they may not: that is what --batch-invariant is for.)
    n = ops.gemm_min_rows
    for form in each_form(ops, isa):
        for kind in ("int4", "int8", "bf16"):
            n_out, n_in = SHAPES[kind][0]
            w = weights(kind, n_out, n_in)
            x = torch.randn(300, n_in).bfloat16()
            assert torch.equal(call(ops, kind, x, w)[: n + 3], call(ops, kind, x[: n + 3], w)), f"{isa} ({form}) {kind}"


def test_the_startup_line_names_the_path(ops, isa):
    for form in each_form(ops, isa):
        name = ops.cpu_gemm()
        expected = {"scalar": "off", "avx2": "avx2-fma", "avx512": "avx512-fma"}.get(isa)
        expected = expected or ("avx512-bf16" if form == "pairs" else "avx512-fma (bf16 pairs off")
        assert name.startswith(expected), (form, name)
    ops.set_batch_invariant(True)
    try:
        assert ops.cpu_gemm() == "off (batch-invariant)"
    finally:
        ops.set_batch_invariant(False)


def test_bf16_pairs_are_the_default_on_amd_cpus_only(ops, isa):
    ops.set_cpu_gemm_pairs(None)
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    vendor = next((line.split(":")[1].strip() for line in cpuinfo if line.startswith("vendor_id")), "")
    assert ops.cpu_gemm_pairs() == (isa == "avx512_bf16" and vendor == "AuthenticAMD"), (isa, vendor)
    ops.set_cpu_gemm_pairs(True)
    try:  # a level without the BF16 dot products has no pairs to turn on
        assert ops.cpu_gemm_pairs() == (isa == "avx512_bf16")
    finally:
        ops.set_cpu_gemm_pairs(None)


def has_amx_bf16() -> bool:
    """AMX-BF16 tiles that torch's oneDNN may use: the CPU's flag (torch's cpuinfo), the OS's leave,
    and no ONEDNN_MAX_CPU_ISA below them."""
    import os

    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    allowed = cap in ("", "ALL", "DEFAULT") or "AMX" in cap
    return bool(caps.get("amx_bf16")) and allowed and torch.backends.mkldnn.enabled and torch.cpu._init_amx()


def went_to_torch(ops, x, w) -> bool:
    """Whether bf16_linear(x, w) called torch's GEMM (aten::linear: the AMX route) rather than the
    library's product (whose only torch operator is its output's aten::empty)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.bf16_linear(x, w)
    return any(e.name == "aten::linear" for e in prof.events())


def test_bf16_weights_times_bf16_x_go_to_amx_from_its_rows_where_the_cpu_has_it(ops):
    # The isa fixture keeps AMX off; here the default is on where the CPU has the tiles, at the
    # AVX512-BF16 level only, from gemm_amx_min_rows rows, and never for float32 x or under batch
    # invariance. The route's product is torch's, bit for bit, and within rounding of the reference.
    amx = has_amx_bf16() and ops.best_cpu_isa() == "avx512_bf16"
    n = ops.gemm_amx_min_rows
    (w,) = weights("bf16", 70, 96)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    ops.set_cpu_gemm_amx(None)
    try:
        assert ops.cpu_gemm_amx() == amx and ("amx (oneDNN)" in ops.cpu_gemm()) == amx, ops.cpu_gemm()
        for rows in (1, n - 1, n, 40):
            routed = amx and rows >= n
            assert went_to_torch(ops, x[:rows], w) == routed, rows
            y = ops.bf16_linear(x[:rows], w)
            if routed:
                assert torch.equal(y, torch.nn.functional.linear(x[:rows], w)), rows
            assert_close(y, reference.bf16_linear(x[:rows], w), f"{rows} rows")
        assert not went_to_torch(ops, x.float(), w)  # float32 x: the library's product
        ops.set_cpu_gemm_amx(False)
        assert not ops.cpu_gemm_amx() and not went_to_torch(ops, x, w)
        ops.set_cpu_gemm_amx(None)
        ops.set_batch_invariant(True)
        try:
            assert not ops.cpu_gemm_amx() and not went_to_torch(ops, x[: n + 1], w)
        finally:
            ops.set_batch_invariant(False)
        ops.set_cpu_isa("avx512" if amx else "scalar")
        try:
            assert not ops.cpu_gemm_amx() and not went_to_torch(ops, x[: n + 1], w)
        finally:
            ops.set_cpu_isa(ops.best_cpu_isa())
        if not has_amx_bf16() and ops.cpu_has_amx_int8():  # on: the integer products' tiles only
            ops.set_cpu_gemm_amx(True)
            assert not ops.cpu_gemm_amx() and not went_to_torch(ops, x[: n + 1], w)
        elif not has_amx_bf16():
            with pytest.raises(RuntimeError, match="no AMX-BF16 tiles .* and no AMX-INT8 ones"):
                ops.set_cpu_gemm_amx(True)
    finally:
        ops.set_cpu_gemm_amx(None)


# --- planted bugs: the CPU half compiled on its own (it is torch-free), with a bug put into a copy ---

SHIM = """
#include "cpu_kernels.h"
using namespace kernels;
extern "C" {
int set_isa(int level) { try { cpu::set_isa(cpu::Isa(level)); return 0; } catch (...) { return 1; } }
void int4(void* y, const void* x, const uint8_t* p, const uint16_t* s, const uint16_t* m, int rows, int n_in, int n_out,
          int f32) { cpu::int4_linear(y, x, p, s, m, rows, n_in, n_out, 32, f32 ? DType::f32 : DType::bf16); }
void int8(void* y, const void* x, const int8_t* q, const float* s, int rows, int n_in, int n_out, int f32) {
    cpu::int8_linear(y, x, q, s, rows, n_in, n_out, f32 ? DType::f32 : DType::bf16); }
void bf16(void* y, const void* x, const uint16_t* w, int rows, int n_in, int n_out, int f32) {
    cpu::bf16_linear(y, x, w, rows, n_in, n_out, f32 ? DType::f32 : DType::bf16); }
}
"""
# Each bug shows only in some shapes, row counts or paths (the names say which).
PLANTED = {
    "the last block of rows, alone in its tile, is never computed": [
        ("if (b < blocks) T::template run<1>", "if (b + 1 < blocks) T::template run<1>")
    ],
    "the last output of a partial panel is never filled": [
        (
            "const int no = std::min(NO, a.n_out - o0);",
            "const int no = std::min(NO, a.n_out - o0) - (a.n_out - o0 < NO);",
        )
    ],
    "the outputs past the last whole vector are never stored": [
        (
            "    for (; o < a.n_out; ++o)\n        for (int r = r0;",
            "    for (; o + 1 < a.n_out; ++o)\n        for (int r = r0;",
        )
    ],
    "the inputs past n_in are not zeroed": [
        (
            "for (; k < a.K; ++k) block[int64_t(k) * L + j] = 0.f;",
            "for (; k < a.K; ++k) block[int64_t(k) * L + j] = 1.f;",
        ),
        ("    for (; i < a.K; ++i) p[i] = 0.f;", "    for (; i < a.K; ++i) p[i] = 1.f;"),
    ],
    "a long row's second piece starts its sums from zero": [
        ("k0 == 0 ? S::zero() : S::load(yt + n * ld + v * L)", "S::zero()")
    ],
    "every slice of rows writes over the first's": [
        ("slice.y = static_cast<char*>(a.y) + r0 * a.n_out * size;", "slice.y = static_cast<char*>(a.y);")
    ],
    "int4 scales a group with its neighbour's scale": [
        ("a.group_scale[int64_t(o) * groups + g]));\n            const typename S::V m",
         "a.group_scale[int64_t(o) * groups + (g + 1) % groups]));\n            const typename S::V m")
    ],
}
# Which call shows each bug: (weights, (n_out, n_in), row counts, x's dtype). float32 x: the float
# panels, on every ISA from AVX2 (AVX512-BF16 multiplies bf16 x in bf16 pairs). 16 and 40 rows are
# 1 and 3 blocks of 16 (a lone block in the last tile), 5 blocks of 8; 200 rows two slices.
SHOWN_BY = {
    "the last block of rows, alone in its tile, is never computed": ("int8", (33, 320), [16, 40], torch.float32),
    "the last output of a partial panel is never filled": ("bf16", (21, 33), [40], torch.float32),
    "the outputs past the last whole vector are never stored": ("bf16", (21, 33), [20], torch.float32),
    "the inputs past n_in are not zeroed": ("int8", (70, 100), [20], torch.float32),
    "a long row's second piece starts its sums from zero": ("int4", (40, 640), [20], torch.float32),
    "every slice of rows writes over the first's": ("int8", (33, 320), [200], torch.float32),
    "int4 scales a group with its neighbour's scale": ("int4", (70, 320), [20], torch.float32),
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The CPU half built once with every bug above in its copy of gemm.cpp (their shapes and row
    counts hardly overlap), as a plain shared library; None where there is no compiler."""
    changes = [change for changes in PLANTED.values() for change in changes]
    return build_planted(tmp_path_factory.mktemp("planted"), "gemm.cpp", changes, SHIM, ("quant_linear.cpp", "isa.cpp"))


def planted_call(lib, kind, x, w, n_out):
    y = torch.full((x.shape[0], n_out), float("nan"), dtype=x.dtype)
    f32 = int(x.dtype == torch.float32)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    args = [ptr(t) for t in (y, x, *w)] + [x.shape[0], x.shape[1], n_out, f32]
    getattr(lib, kind)(*args)
    return y


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_fails_the_check(ops, planted, bug):
    kind, (n_out, n_in), rows, dtype = SHOWN_BY[bug]
    level = ["scalar", "avx2", "avx512", "avx512_bf16"].index(ops.best_cpu_isa())
    if level == 0:
        pytest.skip("this CPU has no AVX2: the matrix product does not run")
    w = weights(kind, n_out, n_in, seed=1)
    found = []
    for isa in range(1, level + 1):
        assert planted.set_isa(isa) == 0
        for r in rows:
            x = torch.randn(r, n_in).to(dtype)
            try:
                check(planted_call(planted, kind, x, w, n_out), kind, x, w, bug)
            except AssertionError:
                found.append(isa)
    assert sorted(set(found)) == list(range(1, level + 1)), f"{bug}: caught on ISA levels {found} only"
    # The copy itself, called as above, is right where the bug is not: one row (a matrix-vector kernel).
    x = torch.randn(1, n_in).to(dtype)
    check(planted_call(planted, kind, x, w, n_out), kind, x, w, f"{bug}: one row")


def test_the_fma_peak_is_measured_at_each_level(ops, isa):
    # bench/gemm.py divides by it: a finite, positive rate from a short run (no speed is asserted).
    peak = ops.cpu_fma_peak_gflops(steps=200_000)
    assert 0 < peak < float("inf"), (isa, peak)
