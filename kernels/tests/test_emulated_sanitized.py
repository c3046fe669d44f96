"""The emulated CUDA kernels (kernels/emulator.py) under the address and undefined-behaviour
sanitizers, once in `make test`: every kernel runs clean, and out-of-bounds accesses of global
and of shared memory fail. A sanitized build must be loaded by a process that starts with the
sanitizers' runtimes (emulator.sanitizer_env()), so each case is a subprocess."""

import subprocess
import sys
import textwrap
from pathlib import Path

from kernels import emulator

ATTENTION = "paged_attention.cu"

# --- under the address and undefined-behaviour sanitizers ------------------------------------------------
SANITIZED = textwrap.dedent(
    """
    import math, sys, torch
    sys.path[:0] = [{tests!r}]
    from kernels import emulator, reference
    from conftest import assert_close
    from test_paged_attention import make_case
    from test_chunk_attention import make_chunks
    from test_quant_linear import int4_weight
    from test_norm_rope import rope_cache_case
    emu = emulator.load(plant={plant!r}, sanitize=True)
    torch.manual_seed(0)
    what = {what!r}
    if what == "every kernel":
        for lens, bs in (([1, 300, 64, 513], 16), ([5, 33], 1)):
            case = make_case(len(lens), 9, 3, 64, bs, lens, torch.bfloat16, "cpu", width=40)
            assert_close(emu.paged_decode_attention(*case, 0.125, 64), reference.paged_decode_attention(*case, 0.125))
        x, d, w = torch.randn(3, 100), torch.randn(3, 100), torch.rand(100)
        new_x, expected = reference.add_rms_norm(x.clone(), d, w, 1e-5)
        assert_close(emu.add_rms_norm(x, d, w, 1e-5), expected)
        qk, cos, sin = torch.randn(5, 4, 32), torch.rand(5, 16), torch.rand(5, 16)
        expected = reference.rope(qk, cos, sin)
        emu.rope_(qk, cos, sin)
        assert_close(qk, expected)
        case = rope_cache_case(5, 6, 2, 32, torch.bfloat16, "cpu")
        expected = reference.rope_cache(*case)
        emu.rope_cache_(*case)
        assert_close(case[3], expected[1])
        for rows, n_in in ((1, 576), (16, 2048), (3, 320)):
            packed, scale, mn = int4_weight(24, n_in, 32)
            x = torch.randn(rows, n_in).bfloat16()  # bf16: the memory is checked here, float32 maths above
            assert_close(emu.int4_linear(x, packed, scale, mn, 32), reference.int4_linear(x, packed, scale, mn, 32))
            q = torch.randint(-127, 128, (24, n_in + 3), dtype=torch.int8)
            x = torch.randn(rows, n_in + 3).bfloat16()
            s = scale[:, 0].float().contiguous()
            assert_close(emu.int8_linear(x, q, s), reference.int8_linear(x, q, s))
            w = (torch.randn(24, n_in + 3) * 0.05).bfloat16()
            assert_close(emu.bf16_linear(x, w), reference.bf16_linear(x, w))
        # the matrix product (gemm.cu): partial tiles of rows, outputs and inputs; element-wise loads of
        # W at 100 inputs (no multiple of 8), 16-byte ones at 104
        packed, scale, mn = int4_weight(70, 320, 32)
        x = torch.randn(33, 320).bfloat16()
        assert_close(emu.int4_gemm(x, packed, scale, mn, 32), reference.int4_linear(x, packed, scale, mn, 32))
        for n_in in (100, 104):
            x = torch.randn(17, n_in).bfloat16()
            q, s = torch.randint(-127, 128, (70, n_in), dtype=torch.int8), torch.rand(70) * 0.01
            assert_close(emu.int8_gemm(x, q, s), reference.int8_linear(x, q, s))
            w = (torch.randn(70, n_in) * 0.05).bfloat16()
            assert_close(emu.bf16_gemm(x, w), reference.bf16_linear(x, w))
        # prompt-chunk attention (chunk_attention.cu): row and key tiles with tails, heads of 64 and 256
        for head_dim in (64, 256):
            case = make_chunks([(0, 19), (21, 27), (3, 1)], 10, 2, head_dim, 16, torch.bfloat16)
            out = emu.chunk_attention(*case, 0.125)
            assert_close(out[:47], reference.chunk_attention(*case, 0.125)[:47])
    elif what == "a table naming a block past the pool":
        q, k, v, tables, lens = make_case(1, 4, 2, 64, 16, [40], torch.float32, "cpu")
        tables[0, 1] = k.shape[0]  # one block past the end of the pool
        emu.paged_decode_attention(q, k, v, tables, lens, 0.125, 64)
    else:
        case = make_case(1, 4, 2, 64, 16, [64], torch.float32, "cpu")
        emu.paged_decode_attention(*case, 0.125, 64)
    print("sanitized run: clean")
    """
)


def sanitized(what: str, plant=None):
    tests = str(Path(__file__).parent)
    code = SANITIZED.format(tests=tests, plant=plant, what=what)
    return subprocess.run(
        [sys.executable, "-c", code], env=emulator.sanitizer_env(), capture_output=True, text=True, timeout=600
    )


def test_every_kernel_is_clean_under_the_sanitizers():
    r = sanitized("every kernel")
    assert r.returncode == 0 and "sanitized run: clean" in r.stdout, r.stderr[-3000:]


def test_the_sanitizers_catch_out_of_bounds_accesses():
    # global memory: a block table that names a block past the end of the pool
    r = sanitized("a table naming a block past the pool")
    assert r.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in r.stderr, r.stderr[-3000:]
    # shared memory: one key's row written one slot further, past the end at the partition's last key
    shifted = (ATTENTION, "            key_rows[k] = table", "            key_rows[k + 1] = table")
    r = sanitized("a shared-memory write past the end", plant=[shifted])
    assert r.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in r.stderr, r.stderr[-3000:]
