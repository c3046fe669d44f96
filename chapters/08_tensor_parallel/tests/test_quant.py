"""Quantized weight formats: packing, error bounds, and the exactness of a weight already on a grid."""

import pytest
import torch

from quant import (
    Int4Weight,
    QuantSpec,
    cat_rows,
    group_size_for,
    nbytes,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def weights(out=48, n_in=192, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=g) * 0.05
    if outliers:  # a few large weights, as real checkpoints have: they set their row's or group's scale
        w[torch.randint(0, out, (8,), generator=g), torch.randint(0, n_in, (8,), generator=g)] = 0.8
    w[3] = 0.0  # an all-zero row: scale 0, and no division by it
    return w


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (5, 66), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 33) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)
    # element 2j in the low nibble, 2j+1 in the high nibble of byte j
    assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)


def test_int8_error_is_at_most_half_a_step_per_weight():
    w = weights()
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.q.abs().max() <= 127
    assert torch.allclose(q.scale, w.abs().amax(1) / 127)
    err = (q.dequantize() - w).abs()
    assert (err <= q.scale[:, None] / 2 * (1 + 1e-5) + 1e-12).all()
    assert err.max() > 0  # a real loss, not a copy
    assert torch.equal(q.dequantize()[3], torch.zeros(192))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_error_is_at_most_half_a_step_per_group(group_size, symmetric):
    w = weights(n_in=256)
    q = quantize_int4(w, group_size, symmetric)
    assert q.group_size == group_size and q.scale.shape == (48, 256 // group_size) and q.scale.dtype == torch.float16
    codes = q.codes()
    assert codes.max() <= 15
    if symmetric:
        assert codes[q.scale.repeat_interleave(group_size, 1) > 0].min() >= 1  # -7..7 around 8: code 0 is unused
    err = (q.dequantize() - w).abs().view(48, -1, group_size)
    lo = w.view(48, -1, group_size).amin(-1)
    # the bound: half a step, plus (asymmetric) the float16 rounding of the group's min
    bound = q.scale.float() / 2 + (0 if symmetric else (q.min.float() - lo).abs()) + 1e-7
    assert (err.amax(-1) <= bound).all()


def test_larger_groups_and_symmetry_cost_accuracy():
    w = weights(n_in=256, outliers=False)
    rel = {}
    for g in (32, 64, 128):
        for sym in (False, True):
            rel[g, sym] = ((quantize_int4(w, g, sym).dequantize() - w).norm() / w.norm()).item()
    assert rel[32, False] < rel[64, False] < rel[128, False]
    assert all(rel[g, False] < rel[g, True] for g in (32, 64, 128))
    assert ((quantize_int8(w).dequantize() - w).norm() / w.norm()).item() < rel[32, False] / 4


def test_a_weight_on_a_q4_1_grid_is_reproduced_exactly():
    # What the bundled model is: every group of 32 is min + scale * code, both float16.
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (16, 128), generator=g, dtype=torch.uint8)
    codes[:, ::32], codes[:, 1::32] = 0, 15  # each group spans its full range, as Q4_1 blocks do
    scale = (torch.rand(16, 4, generator=g) * 0.01 + 1e-3).half()
    mins = (-torch.rand(16, 4, generator=g) * 0.05).half()
    w = Int4Weight(pack_int4(codes), scale, mins, 32).dequantize()
    q = quantize_int4(w, 32)
    assert torch.equal(q.codes(), codes) and torch.equal(q.scale, scale) and torch.equal(q.min, mins)


def test_group_size_halves_until_it_divides_the_row():
    assert group_size_for(1536, 128) == 128
    assert group_size_for(576, 128) == 64  # SmolLM2's hidden size: 4.5 groups of 128
    assert group_size_for(96, 64) == 32
    with pytest.raises(ValueError, match="groups of 32"):
        group_size_for(48, 32)


def test_stacking_commutes_with_quantizing():
    a, b = weights(seed=1), weights(seed=2, out=16)
    for quantize in (quantize_int8, lambda w: quantize_int4(w, 64)):
        stacked = cat_rows([quantize(a), quantize(b)]).dequantize()
        assert torch.equal(stacked, quantize(torch.cat([a, b])).dequantize())


def test_bytes_per_weight():
    w = weights(out=64, n_in=256)
    assert nbytes(quantize_int8(w)) == 64 * 256 + 64 * 4
    assert nbytes(quantize_int4(w, 32)) == 64 * 128 + 2 * 64 * 8 * 2  # 5 bits per weight, as Q4_1
    assert nbytes(quantize_int4(w, 32, symmetric=True)) == 64 * 128 + 64 * 8 * 2


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"bits": 3}, "bits must be 4 or 8"),
        ({"bits": 4, "group_size": 48}, "group size"),
        ({"bits": 8, "head_bits": 2}, "LM head"),
        # a quantized checkpoint's config.json can hold any JSON: each of these passed an `in` check
        ({"bits": "4"}, r"bits must be 4 or 8, got '4'"),
        ({"bits": True}, r"bits must be 4 or 8, got True"),
        ({"bits": 4, "group_size": 128.0}, r"int4 group size must be one of \(32, 64, 128\), got 128.0"),
        ({"bits": 4, "symmetric": "false"}, r"symmetric must be true or false, got 'false'"),
    ],
)
def test_bad_specs_are_clear_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        QuantSpec(**kw)


@pytest.mark.parametrize(
    "symmetric, edit",
    [(True, {(1, 3): 60000.0}), (False, {(1, 3): 1e6, (1, 4): -1e6}), (False, {(2, 0): float("nan")})],
    ids=["symmetric min past float16", "asymmetric scale past float16", "a NaN weight"],
)
def test_int4_scales_or_mins_past_float16_are_refused(symmetric, edit):
    # -8 x scale, or (max - min) / 15, past 65504 was stored as inf: -inf weights and NaN logits
    # (symmetric from max |w| ~ 57,300, where float16 still holds the weights themselves).
    w = weights(8, 64, outliers=False)
    for (row, col), value in edit.items():
        w[row, col] = value
    with pytest.raises(ValueError, match="past float16's range"):
        quantize_int4(w, 32, symmetric)
    w = weights(8, 64, outliers=False)
    w[1, 3] = 50000.0  # inside the range: quantized, and finite
    assert torch.isfinite(quantize_int4(w, 32, symmetric).dequantize()).all()


def test_int8_of_a_weight_that_is_not_finite_is_refused():
    w = weights(8, 64, outliers=False)
    w[5, 7] = float("inf")
    with pytest.raises(ValueError, match="int8: a weight row holds NaN or infinity"):
        quantize_int8(w)


def test_a_constant_group_keeps_a_scale_of_at_least_zero():
    # float16 rounded the min of a group of 0.30001 past its max: the scale came out -2.6e-6
    q = quantize_int4(torch.full((2, 32), 0.30001), 32)
    assert (q.scale >= 0).all() and torch.allclose(q.dequantize(), torch.full((2, 32), 0.30001), atol=1e-4)


def test_a_spec_names_a_head_other_than_the_default_int8():
    # "int8" was all that quantize.py, cli.py and generate.py said of int8 weights with an int4 head
    assert QuantSpec(8).name == "int8" and QuantSpec(4).name == "int4 G=32"
    assert QuantSpec(8, 64, head_bits=4).name == "int8, int4 G=64 head"
    assert QuantSpec(4, 32, True, head_bits=4).name == "int4 G=32 sym, int4 head"
    assert QuantSpec(4, 32, head_bits=None).name == "int4 G=32, unquantized head"
