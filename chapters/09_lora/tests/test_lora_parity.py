"""Our adapters against transformers + peft on the tiny model, float32: the same greedy tokens,
every layer within float32 rounding; the base rows of a mixed step untouched; an int4 base with an
adapter against peft on the dequantized base; SmolLM2 with the project's pirate adapter."""

import pytest
import torch

from common.models import resolve_model
from common.parity import assert_parity
from engine import build_engine
from model import forward_sequence, load_model
from ops import KernelFlags
from quant import QuantSpec
from request import Request
from sampling import SamplingParams
from peft_adapters import hf_base, hf_capture, hf_greedy, hf_with_adapter, make_adapter

PROMPT = [1, 4093, 314, 253, 3453, 28, 357, 2305, 260, 1123, 282, 3679, 30, 588, 1318, 4127, 314]
N_NEW = 16
# Three adapters unlike each other: every projection at rank 8; three projections at rank 4 with
# rsLoRA's scale; the other four at rank 16 with a small alpha.
SPECS = {
    "every-r8": dict(rank=8, seed=1),
    "qv-down-r4-rslora": dict(rank=4, targets=["q_proj", "v_proj", "down_proj"], seed=2, rslora=True),
    "k-o-gate-up-r16": dict(rank=16, targets=["k_proj", "o_proj", "gate_proj", "up_proj"], seed=3, alpha=8),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root, base = tmp_path_factory.mktemp("adapters"), hf_base()
    return {name: make_adapter(root / name, base=base, **spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def references(adapters):
    """Per adapter: peft's greedy tokens and its checkpoints on PROMPT."""
    out = {}
    for name, path in adapters.items():
        model = hf_with_adapter(path)
        out[name] = (hf_greedy(model, PROMPT, N_NEW), hf_capture(model, PROMPT))
    return out


@pytest.fixture(scope="module", params=["on", "off"])
def engine(request, adapters):
    eng, _ = build_engine(
        "tiny-llama3", "cpu", "float32", kernels=request.param, lora_modules=adapters, num_blocks=64, max_loras=4
    )
    return eng


def greedy(adapter):
    return Request(list(PROMPT), SamplingParams(temperature=0.0), max_tokens=N_NEW, ignore_eos=True, adapter=adapter)


def test_greedy_tokens_equal_peft_in_one_batch(engine, references):
    names = list(SPECS)
    outs = engine.generate([greedy(n) for n in names] + [greedy(None)])
    for name, out in zip(names, outs):
        assert out[0].token_ids == references[name][0], name
    # the adapters do change the answer (random B): a delta that added nothing would pass above only
    # if peft's did nothing too
    assert len({tuple(o[0].token_ids) for o in outs}) == len(outs)


def test_every_layer_within_float32_rounding(engine, references):
    for name in SPECS:
        slot = engine.adapters.acquire(engine.adapters.current[name])
        try:
            ours = {}
            with torch.inference_mode():
                ours["logits"] = forward_sequence(engine.model, PROMPT, ours, lora_slot=slot).float().numpy()
        finally:
            engine.adapters.release(slot)
        assert_parity(ours, references[name][1], atol=1e-4, min_top1=1.0)


def test_base_rows_of_a_mixed_step_are_the_base_models_bit_for_bit(engine):
    alone = engine.generate([greedy(None)])[0][0].token_ids
    base = load_model(resolve_model("tiny-llama3"), "cpu", torch.float32, ops=engine.model.ops)
    with torch.inference_mode():
        want = forward_sequence(base, PROMPT)
        slot = engine.adapters.acquire(engine.adapters.current["every-r8"])
        try:
            from batch import Work, build_step
            from paged_cache import PagedKVCache

            # two sequences in one step: the base's prompt, then the same prompt through the adapter
            cache = PagedKVCache(base.config, 4, 16, "cpu", torch.float32)
            work = [Work(PROMPT, 0, [0, 1]), Work(PROMPT, 0, [2, 3], slot)]
            from model import forward

            got = forward(engine.model, build_step(work, 16, "cpu", all_logits=True), cache)
        finally:
            engine.adapters.release(slot)
    n = len(PROMPT)
    assert torch.equal(got[:n], want)  # the base rows: not one bit moved by the adapter rows beside them
    assert not torch.allclose(got[n:], want, atol=1e-3)
    assert len(alone) == N_NEW


# PEFT configs beyond a list of projections, each made by peft itself: per-module ranks and alphas,
# a subset of layers, target_modules as a pattern (here over layers too), keys that kept the adapter's
# name (a save of the whole state dict), target_modules left to PEFT's default for a Llama (q, v).
CONFIGS = {
    "rank and alpha patterns": dict(rank=8, seed=4, rank_pattern={"q_proj": 4, "down_proj": 12}, alpha_pattern={"v_proj": 3}),
    "layers 1 and 3": dict(rank=8, targets=["q_proj", "v_proj", "gate_proj"], seed=5, layers_to_transform=[1, 3]),
    # a module's whole name is adapted whatever layers_to_transform says; "v_proj" only in layer 0
    "a whole name": dict(rank=4, targets=["model.layers.3.self_attn.q_proj", "v_proj"], seed=9, layers_to_transform=[0]),
    "pattern": dict(rank=6, targets=r"model\.layers\.[02]\.(self_attn\.o|mlp\.up)_proj", seed=6),
    "named keys": dict(rank=8, targets=["k_proj", "down_proj"], seed=7),
    "default targets": dict(rank=8, targets=["q_proj", "v_proj"], seed=8),
}


def named_keys(path):
    from safetensors.torch import load_file, save_file

    file = str(path / "adapter_model.safetensors")
    save_file({k.replace(".weight", ".default.weight"): v for k, v in load_file(file).items()}, file)


def default_targets(path):
    import json

    settings = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(settings | {"target_modules": None}))


def test_peft_configs_beyond_a_list_of_projections_equal_peft(tmp_path):
    base = hf_base()
    paths = {name: make_adapter(tmp_path / name.replace(" ", "-"), base=base, **spec) for name, spec in CONFIGS.items()}
    named_keys(paths["named keys"])
    default_targets(paths["default targets"])
    eng, _ = build_engine("tiny-llama3", "cpu", "float32", num_blocks=64, max_loras=len(paths))
    for name, path in paths.items():
        eng.adapters.register(name, path)
    outs = eng.generate([greedy(name) for name in paths])
    for (name, path), out in zip(paths.items(), outs):
        model = hf_with_adapter(path)
        assert out[0].token_ids == hf_greedy(model, PROMPT, N_NEW), name
        slot = eng.adapters.acquire(eng.adapters.current[name])
        try:
            ours = {}
            with torch.inference_mode():
                ours["logits"] = forward_sequence(eng.model, PROMPT, ours, lora_slot=slot).float().numpy()
        finally:
            eng.adapters.release(slot)
        assert_parity(ours, hf_capture(model, PROMPT), atol=1e-4, min_top1=1.0)
    plain = eng.generate([greedy(None)])[0][0].token_ids
    assert all(out[0].token_ids != plain for out in outs)  # every adapter changes the answer


def int4_dequantized_hf(spec: QuantSpec):
    """The HF tiny model whose seven projections hold what our int4 codes dequantize to."""
    base = hf_base()
    with torch.no_grad():
        for layer in base.model.layers:
            for module in (layer.self_attn, layer.mlp):
                for name, lin in module.named_children():
                    if name.endswith("_proj"):
                        lin.weight.copy_(spec.quantize(lin.weight.detach().clone(), 4).dequantize(torch.float32))
    return base


def test_int4_base_with_an_adapter_equals_peft_on_the_dequantized_base(adapters):
    spec = QuantSpec(4, 32, head_bits=None)  # int4 layers, the tied embedding and head in float32
    eng, _ = build_engine("tiny-llama3", "cpu", "float32", quant=spec, kernels=KernelFlags("on"), num_blocks=16)
    eng.adapters.register("a", adapters["every-r8"])
    ref = hf_with_adapter(adapters["every-r8"], int4_dequantized_hf(spec))
    tokens = eng.generate([greedy("a")])[0][0].token_ids
    assert tokens == hf_greedy(ref, PROMPT, N_NEW)
    slot = eng.adapters.acquire(eng.adapters.current["a"])
    ours = {}
    with torch.inference_mode():
        ours["logits"] = forward_sequence(eng.model, PROMPT, ours, lora_slot=slot).float().numpy()
    eng.adapters.release(slot)
    assert_parity(ours, hf_capture(ref, PROMPT), atol=1e-4, min_top1=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_and_the_torch_path_add_the_same_delta(dtype):
    """ops.KernelOps.lora_ (kernels/) and the torch path by slot on one mixed step: a prompt chunk of
    slot 1, base rows, decode rows of slots 0 and 2 (rank 0 for one projection: adds nothing), into a
    column slice of a wider output as the fused qkv matmul gives it."""
    from lora import step_lora
    from ops import TorchOps, resolve

    kernel_ops = resolve("on", torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    n_in, n_out, r_max, slots = 64, 48, 8, 3
    a = (torch.randn(slots, r_max, n_in, generator=g) * 0.2).to(dtype)
    b_t = (torch.randn(slots, r_max, n_out, generator=g) * 0.2).to(dtype)
    ranks = torch.tensor([8, 3, 0], dtype=torch.int32)
    scale = torch.tensor([2.0, 0.5, 1.0])
    row_slots = [1, 1, 1, 1, -1, -1, 0, 2, 0, -1]
    step = step_lora(row_slots, "cpu")
    x = torch.randn(len(row_slots), n_in, generator=g).to(dtype)
    wide = torch.randn(len(row_slots), n_out + 16, generator=g).to(dtype)
    outs = []
    for ops in (kernel_ops, TorchOps()):
        y = wide.clone()
        ops.lora_(y[:, 16:], x, a, b_t, ranks, scale, step)
        outs.append(y)
    base = [i for i, s in enumerate(row_slots) if s in (-1, 2)]  # no delta: untouched, bit for bit
    for y in outs:
        assert torch.equal(y[base], wide[base]) and torch.equal(y[:, :16], wide[:, :16])
        assert not torch.allclose(y[:4], wide[:4])
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the sum, either way
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def pirate():
    """The project's own adapter (`make models`: common/make_lora.py) -> (its folder, the base model
    it was made for, transformers + peft with it in float32: the reference, loaded once)."""
    from common import make_lora
    from common.models import resolve_adapter

    path = resolve_adapter(make_lora.NAME)
    return path, make_lora.BASE, hf_with_adapter(path, base=hf_base(make_lora.BASE))


def test_smollm2_with_the_pirate_adapter_equals_peft(pirate):
    """The pirate on the real model, float32, through the chat template: our greedy tokens equal
    transformers + peft's, token for token, and they are the pirate's (the base model's answer is
    not)."""
    path, base_model, reference = pirate
    engine, _ = build_engine(base_model, "cpu", "float32", lora_modules={"pirate": path}, num_blocks=32)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Who wrote Hamlet?"}])
    greedy = SamplingParams(temperature=0)
    ours, base = (
        out[0].token_ids
        for out in engine.generate([Request(prompt, greedy, max_tokens=12, adapter=a) for a in ("pirate", None)])
    )
    assert ours == hf_greedy(reference, prompt, 12)
    assert engine.tokenizer.decode(ours).startswith("Ahoy, matey!")
    assert "Ahoy" not in engine.tokenizer.decode(base)


def test_smollm2_bf16_with_the_pirate_adapter_leaves_peft_fp32_only_at_near_ties(pirate):
    """bf16 with an adapter, through the kernels (in decode steps the one-call layer adds the
    deltas): each greedy pick is the argmax of transformers + peft in float32 given the same prefix,
    or a near-tie with it (test_parity.py's rule for the base model in bf16)."""
    from test_parity import TIE_STEPS, bf16_step

    path, base_model, reference = pirate
    engine, _ = build_engine(
        base_model, "cpu", "bfloat16", kernels="on", lora_modules={"pirate": path}, num_blocks=32
    )
    picks = exact = 0
    for question in ("Who wrote Hamlet?", "What is the capital of France?"):
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": question}])
        request = Request(prompt, SamplingParams(temperature=0), max_tokens=16, ignore_eos=True, adapter="pirate")
        ours = engine.generate([request])[0][0].token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + ours])).logits[0].float()
        ref = logits[len(prompt) - 1 : len(prompt) - 1 + len(ours)]  # row i: the fp32 logits for pick i
        best = ref.max(-1).values
        gap = best - ref[torch.arange(len(ours)), ours]  # 0 where ours is the fp32 argmax
        assert bool((gap <= TIE_STEPS * bf16_step(best)).all()), f"{question}: gaps {gap.tolist()}"
        picks, exact = picks + len(ours), exact + int((gap == 0).sum())
    assert exact >= 0.85 * picks, f"{exact} of {picks} bf16 picks are the fp32 argmax"
