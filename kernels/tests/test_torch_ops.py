"""The kernels as operators of torch's dispatcher (torch.ops.llm_kernels.*): each one's schema,
fake implementation and registration pass torch.library.opcheck, and a traced program sees each
call as one operator (no graph break) and computes what the eager calls compute."""

import pytest
import torch

from conftest import assert_close
from test_chunk_attention import make_chunks
from test_norm_rope import rope_cache_case
from test_paged_attention import make_case
from test_quant_linear import int4_weight

OPS = torch.ops.llm_kernels


def samples(device):
    """Arguments for each operator, small enough that opcheck's repeated runs cost little."""
    x = torch.randn(3, 64)
    packed, scale, min_ = int4_weight(48, 64, 32)  # packed [48, 32]: not square, so a shape mix-up shows
    q8 = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    qk = torch.randn(3, 5, 64)  # [tokens, q + k heads, head_dim]
    angles = torch.rand(3, 32)
    attn = make_case(2, 4, 2, 64, 16, [7, 20], torch.float32, "cpu")
    on = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return {
        "add_rms_norm": (*on(x, torch.randn(3, 64), torch.rand(64)), 1e-5),
        "add_rms_norm (no delta)": (on(x)[0], None, on(torch.rand(64))[0], 1e-5),
        "rope_": tuple(on(qk, angles.cos(), angles.sin())),
        "rope_cache_": tuple(rope_cache_case(3, 4, 2, 64, torch.float32, device)),
        "silu_mul": tuple(on(torch.randn(3, 2 * 48))),
        "int4_linear": (*on(x, packed, scale, min_), 32),
        "int8_linear": tuple(on(x, q8, torch.rand(32))),
        "bf16_linear": tuple(on(x, (torch.randn(40, 64) * 0.05).bfloat16())),
        "paged_decode_attention": (*on(*attn), 0.125, 16),
        "chunk_attention": (*on(*make_chunks([(5, 7), (0, 3)], 4, 2, 64, 16, torch.float32)), 0.125),
    }


@pytest.mark.parametrize(
    "case",
    [
        "add_rms_norm",
        "add_rms_norm (no delta)",
        "rope_",
        "rope_cache_",
        "silu_mul",
        "int4_linear",
        "int8_linear",
        "bf16_linear",
        "paged_decode_attention",
        "chunk_attention",
    ],
)
def test_opcheck(ops, device, case):
    # schema (what the op writes is declared), fake tensors (shapes, dtypes, strides of the
    # output), and AOT dispatch with dynamic shapes: what torch.compile needs of an operator.
    args = samples(device)[case]
    torch.library.opcheck(getattr(OPS, case.split()[0]), args)


def test_the_pybind_functions_and_the_operators_are_the_same_kernels(ops):
    args = samples("cpu")
    for name in ("silu_mul", "int4_linear", "int8_linear", "bf16_linear", "paged_decode_attention", "chunk_attention"):
        assert torch.equal(getattr(OPS, name)(*args[name]), getattr(ops, name)(*args[name])), name
    x, delta, weight, eps = args["add_rms_norm"]
    x2 = x.clone()
    assert torch.equal(OPS.add_rms_norm(x, delta, weight, eps), ops.add_rms_norm(x2, delta, weight, eps))
    assert torch.equal(x, x2)  # both updated the residual stream in place


def decode_block(x, norm_w, packed, scale, min_, cos, sin):
    """A piece of a decoder layer through the operators: norm (in place on x), an int4 projection,
    RoPE in place on its output, another norm. -> (h, x as updated)."""
    h = OPS.add_rms_norm(x, None, norm_w, 1e-5)
    qk = OPS.int4_linear(h, packed, scale, min_, 32).view(h.shape[0], 2, 64)
    OPS.rope_(qk, cos, sin)
    return OPS.add_rms_norm(x, qk.view(h.shape[0], -1), norm_w, 1e-5), x


def test_a_traced_program_keeps_each_kernel_as_one_operator(ops):
    # aot_eager: dynamo's capture (fullgraph: a call it could not place would be an error) and AOT
    # autograd's functionalization of the in-place operators, without Inductor's code generation.
    torch._dynamo.reset()
    packed, scale, min_ = int4_weight(128, 128, 32)
    angles = torch.rand(4, 32)
    args = (torch.randn(4, 128), torch.rand(128), packed, scale, min_, angles.cos(), angles.sin())
    eager_h, eager_x = decode_block(args[0].clone(), *args[1:])
    compiled = torch.compile(decode_block, backend="aot_eager", fullgraph=True)
    x = args[0].clone()
    h, x_out = compiled(x, *args[1:])
    assert_close(h, eager_h)
    assert_close(x, eager_x)  # the in-place update of x survives functionalization


class Block(torch.nn.Module):
    def __init__(self, norm_w, packed, scale, min_):
        super().__init__()
        for name, t in (("norm_w", norm_w), ("packed", packed), ("scale", scale), ("min_", min_)):
            self.register_buffer(name, t)

    def forward(self, x, cos, sin):
        return decode_block(x, self.norm_w, self.packed, self.scale, self.min_, cos, sin)[0]


def test_torch_export_records_the_operators(ops):
    packed, scale, min_ = int4_weight(128, 128, 32)
    angles = torch.rand(4, 32)
    block, x = Block(torch.rand(128), packed, scale, min_), torch.randn(4, 128)
    exported = torch.export.export(block, (x.clone(), angles.cos(), angles.sin()))
    code = exported.graph_module.code
    for name in ("add_rms_norm", "int4_linear", "rope_"):
        assert f"llm_kernels.{name}" in code, code
    assert_close(exported.module()(x.clone(), angles.cos(), angles.sin()), block(x.clone(), angles.cos(), angles.sin()))
