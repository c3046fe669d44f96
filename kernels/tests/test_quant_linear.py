"""int4 group-wise and int8 per-row linear layers against dequantize-then-multiply; bf16 against float32."""

import pytest
import torch

from kernels import reference
from conftest import TOLERANCE, assert_close


def int4_weight(n_out, n_in, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n_out, n_in // 2), generator=g, dtype=torch.uint8)
    scale = torch.rand(n_out, n_in // group_size, generator=g) * 0.02
    min_ = -8 * scale + torch.randn(n_out, n_in // group_size, generator=g) * 0.01
    return packed, scale.half(), min_.half()  # float16, as a checkpoint (and a Q4_1 block) stores them


def assert_int4_close(y, x, packed, scale, min_, group_size, what=""):
    """int4_linear's y against the reference. With bf16 x a kernel may round each dequantized weight
    to bf16 before it multiplies (AVX512-BF16's vdpbf16ps kernel does, as a dense bf16 copy of W
    is rounded): each product w x then moves by a rounding error, uniform in +-2^-9 |w x| and
    independent of the others, so their sum has a standard deviation of 2^-9 / sqrt(3) times
    sqrt(sum (w x)^2). The slack is 6 of those (a worst-case bound, 2^-9 sum |w x|, is ~7x looser
    at n_in = 1536 and would hide real errors)."""
    expected = reference.int4_linear(x, packed, scale, min_, group_size)
    w = reference.int4_weight(packed, scale, min_, group_size)
    if x.dtype != torch.bfloat16:
        return assert_within(y, expected, sum_slack(x, w), what)
    assert_within(y, expected, 6 * 2.0**-9 / 3**0.5 * (x.float().square() @ w.square().T).sqrt(), what)


def assert_int8_close(y, x, q, scale, what=""):
    """int8_linear's y against the reference. Its sums reach |q| ~ 127 before the row's scale."""
    w = q.float() * scale[:, None]
    assert_within(y, reference.int8_linear(x, q, scale), sum_slack(x, w), what)


def sum_slack(x, w):
    """A float32 product and the reference sum a row's products in other orders, which moves a result
    by a few float32 roundings of the products' magnitude, |x| @ |W|.T, not of the result's (a sum of
    large terms can end near zero). 2^-19 is 32 roundings (2^-24 each): a weight or input rounded to
    bf16 (2^-9) or fp16 (2^-11), or a product lost, is far outside it."""
    return 2.0**-19 * (x.float().abs() @ w.abs().T)


def assert_within(y, expected, slack, what=""):
    """assert_close's tolerance of y's dtype, plus slack [rows, n_out]."""
    assert y.dtype == expected.dtype and y.shape == expected.shape, (y.dtype, y.shape, expected.shape)
    rtol, atol = TOLERANCE[y.dtype]
    diff = (y.float().cpu() - expected.float()).abs()
    allowed = rtol * expected.float().abs() + atol + slack
    worst = (diff - allowed).argmax()
    assert (diff <= allowed).all(), (
        f"{what}: |y - expected| {diff.flatten()[worst]:.4g} > {allowed.flatten()[worst]:.4g}"
    )


SHAPES = [(960, 576), (576, 1536), (13, 64), (3072, 576), (40, 128)]  # odd row counts too


@pytest.mark.parametrize("n_out,n_in", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int4_linear(ops, device, n_out, n_in, group_size, rows, dtype):
    if n_in % group_size:
        pytest.skip("the group size must divide the row")
    packed, scale, min_ = int4_weight(n_out, n_in, group_size, seed=n_out + rows)
    x = torch.randn(rows, n_in).to(dtype)
    y = ops.int4_linear(*(t.to(device) for t in (x, packed, scale, min_)), group_size)
    assert_int4_close(y, x, packed, scale, min_, group_size, f"{rows} x {n_in} -> {n_out}, G={group_size}")


def test_int4_group_128(ops, device):
    packed, scale, min_ = int4_weight(64, 512, 128)
    x = torch.randn(2, 512)
    y = ops.int4_linear(*(t.to(device) for t in (x, packed, scale, min_)), 128)
    assert_close(y, reference.int4_linear(x, packed, scale, min_, 128))


@pytest.mark.parametrize("n_out,n_in", SHAPES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int8_linear(ops, device, n_out, n_in, rows, dtype):
    g = torch.Generator().manual_seed(n_in)
    q = torch.randint(-127, 128, (n_out, n_in), generator=g, dtype=torch.int8)
    scale = torch.rand(n_out, generator=g) * 0.01
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    y = ops.int8_linear(*(t.to(device) for t in (x, q, scale)))
    assert_int8_close(y, x, q, scale)


@pytest.mark.parametrize("n_out,n_in", SHAPES + [(21, 100), (7, 33)])  # n_in no multiple of 8, 16 or 32 too
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_bf16_linear(ops, device, n_out, n_in, rows, dtype):
    g = torch.Generator().manual_seed(n_out + n_in + rows)
    w = (torch.randn(n_out, n_in, generator=g) * 0.05).bfloat16()  # a model's scale: sums near 1
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    y = ops.bf16_linear(*(t.to(device) for t in (x, w)))
    assert_close(y, reference.bf16_linear(x, w), f"{rows} x {n_in} -> {n_out}")


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_every_cpu_path(ops, isa, rows):
    packed, scale, min_ = int4_weight(70, 320, 32, seed=rows)
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (70, 320), generator=g, dtype=torch.int8)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, 320, generator=g).to(dtype)
        assert_int4_close(ops.int4_linear(x, packed, scale, min_, 32), x, packed, scale, min_, 32, isa)
        s = scale[:, 0].float().contiguous()
        assert_int8_close(ops.int8_linear(x, q, s), x, q, s, isa)
        for n_in in (320, 100):  # 100: the tails of every step width (8, 16, 32 inputs)
            w = (torch.randn(70, n_in, generator=g) * 0.05).bfloat16()
            xw = torch.randn(rows, n_in, generator=g).to(dtype)
            assert_close(ops.bf16_linear(xw, w), reference.bf16_linear(xw, w), f"{isa} bf16 n_in={n_in}")


def test_bad_arguments_are_clear_errors(ops):
    packed, scale, min_ = int4_weight(16, 64, 32)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        ops.int4_linear(torch.randn(1, 32), packed, scale, min_, 32)
    with pytest.raises(RuntimeError, match="group_size 48 must be a multiple of 32"):
        ops.int4_linear(torch.randn(1, 64), packed, scale, min_, 48)
    with pytest.raises(RuntimeError, match=r"scale, min: contiguous float16 \[n_out, n_in / group_size\]"):
        ops.int4_linear(torch.randn(1, 64), packed, scale.float(), min_, 32)
    with pytest.raises(RuntimeError, match=r"w: contiguous bfloat16 \[n_out, n_in\] expected, got Float"):
        ops.bf16_linear(torch.randn(1, 64), torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        ops.bf16_linear(torch.randn(1, 32), torch.randn(8, 64).bfloat16())


@pytest.fixture
def invariant(ops):
    ops.set_batch_invariant(True)
    yield
    ops.set_batch_invariant(False)


def each_kernel(rows, dtype, seed=0):
    """(name, x, call) for the int4, int8 and bf16 kernels on one [rows, 320] x."""
    g = torch.Generator().manual_seed(seed)
    packed, scale, min_ = int4_weight(36, 320, 32, seed=seed)
    q = torch.randint(-127, 128, (36, 320), generator=g, dtype=torch.int8)
    s = torch.rand(36, generator=g) * 0.01
    w = (torch.randn(36, 320, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, 320, generator=g).to(dtype)
    return x, {
        "int4": lambda ops, x: ops.int4_linear(x, packed, scale, min_, 32),
        "int8": lambda ops, x: ops.int8_linear(x, q, s),
        "bf16": lambda ops, x: ops.bf16_linear(x, w),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_batch_invariant_rows_equal_the_row_alone_on_every_cpu_path(ops, isa, invariant, dtype):
    # Bitwise: each row of a call of 2..17 rows is what a call of that row alone returns.
    for rows in (2, 3, 5, 8, 17):
        x, kernels = each_kernel(rows, dtype, seed=rows)
        for name, call in kernels.items():
            together = call(ops, x)
            for r in range(rows):
                assert torch.equal(together[r], call(ops, x[r : r + 1])[0]), f"{isa} {name} row {r} of {rows}"


def test_without_batch_invariance_a_row_depends_on_its_neighbours(ops, isa):
    # What the switch is for: the fast forms differ by row count (int8 and bf16 on AVX2/AVX512
    # accumulate one row in two chains, several in one; int4 on AVX512 factors one row).
    if isa == "scalar":
        pytest.skip("the portable path has one form for every row count")
    x, kernels = each_kernel(5, torch.float32, seed=1)
    differ = [name for name, call in kernels.items() if not torch.equal(call(ops, x)[0], call(ops, x[:1])[0])]
    assert "int8" in differ and "bf16" in differ, differ
