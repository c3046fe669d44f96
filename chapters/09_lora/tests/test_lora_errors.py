"""Every adapter the engine cannot serve exactly is refused with one line that says why: at load,
for a request, for an unload. Each bad directory is a good PEFT one (made by peft) with one thing
broken."""

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import UserError
from engine import Request, build_engine
from lora_slots import AdapterNameError, AdapterSlots
from sampling import SamplingParams
from peft_adapters import make_adapter


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("good") / "r8", 8, ["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def engine(good):
    eng, _ = build_engine("tiny-llama3", "cpu", "float32", max_loras=2, max_lora_rank=8, num_blocks=16)
    eng.adapters.register("good", good)
    return eng


def broken(good, tmp_path, config=None, tensors=None, remove=()):
    """A copy of `good` with its config updated by `config`, its tensors changed by `tensors`
    (a function of the dict), or files removed."""
    out = tmp_path / "bad"
    shutil.copytree(good, out)
    if config is not None:
        settings = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps(settings | config))
    if tensors is not None:
        path = str(out / "adapter_model.safetensors")
        save_file(tensors(load_file(path)), path)
    for name in remove:
        (out / name).unlink()
    return out


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B0 = A0.replace("lora_A", "lora_B")


def replaced(key, value):
    return lambda t: t | {key: value}


CASES = {
    "missing config": (dict(remove=["adapter_config.json"]), "no adapter_config.json"),
    "missing weights": (dict(remove=["adapter_model.safetensors"]), "no adapter_model.safetensors"),
    "unknown target": (dict(config={"target_modules": ["q_proj", "lm_head"]}), "unknown target module 'lm_head'"),
    "target pattern that is none": (dict(config={"target_modules": "(q_proj"}), "target_modules '(q_proj' is not a regular expression"),
    "target pattern matching nothing": (dict(config={"target_modules": r"model\.q_proj"}), "adapt none of the decoder layers' projections"),
    # the pattern names every projection, the file holds three
    "target pattern beyond the tensors": (dict(config={"target_modules": ".*proj"}), "mlp.gate_proj.lora_A.weight is missing"),
    "rank over limit": (dict(config={"r": 16}), "rank 16 is over --max-lora-rank 8"),
    "dora": (dict(config={"use_dora": True}), "DoRA (use_dora) is not supported"),
    "bias": (dict(tensors=lambda t: t | {A0.replace("lora_A.weight", "bias"): torch.zeros(256)}), "is a trained bias"),
    "modules_to_save": (dict(config={"modules_to_save": ["lm_head"]}), "fully trained modules"),
    "layers_to_transform past the model": (dict(config={"layers_to_transform": [0, 9]}), "names layer 9; the base model has 4"),
    "a layer that layers_to_transform leaves out": (
        dict(config={"layers_to_transform": [0, 1]}),
        "which the config's target_modules (and layers_to_transform) do not name",
    ),
    "layers_pattern of another model": (
        dict(config={"layers_to_transform": [0], "layers_pattern": "h"}),
        "adapt none of the decoder layers' projections",
    ),
    "rank_pattern unlike the tensors": (
        dict(config={"rank_pattern": {"q_proj": 4}}),
        "(rank 4 from adapter_config.json; q_proj is 256 x 256)",
    ),
    "layers_pattern no pattern": (
        dict(config={"layers_to_transform": [0], "layers_pattern": "layers("}),
        "layers_pattern 'layers(' is not a regular expression",
    ),
    "layers_pattern a number": (dict(config={"layers_to_transform": [0], "layers_pattern": 5}), "layers_pattern must be a name"),
    "rank_pattern key no pattern": (
        dict(config={"rank_pattern": {"(?i)q_proj": 8}}),
        "rank_pattern key '(?i)q_proj' is not a regular expression",
    ),
    "bad rank_pattern": (dict(config={"rank_pattern": {"q_proj": 0}}), "rank_pattern['q_proj'] must be a positive integer"),
    "rank_pattern over limit": (dict(config={"rank_pattern": {"v_proj": 9}}), "rank 9 is over --max-lora-rank 8"),
    "alpha_pattern not finite": (dict(config={"alpha_pattern": {"q_proj": float("nan")}}), "alpha_pattern['q_proj'] must be a finite number"),
    "two adapter names": (
        dict(tensors=lambda t: {k.replace(".weight", ".x.weight") if "layers.0." in k else k: v for k, v in t.items()}),
        "belong to more than one adapter (['None', 'x'])",
    ),
    "not lora": (dict(config={"peft_type": "IA3"}), "peft_type 'IA3' is not LoRA"),
    "bad rank": (dict(config={"r": "eight"}), "r must be a positive integer"),
    "wrong shape": (
        dict(tensors=replaced(A0, torch.zeros(8, 576))),
        f"{A0} is [8, 576], the base model needs [8, 256] (rank 8 from adapter_config.json; q_proj is 256 x 256)",
    ),
    "rank unlike the config": (dict(tensors=replaced(A0, torch.zeros(4, 256))), "is [4, 256], the base model needs [8, 256]"),
    "missing tensor": (
        dict(tensors=lambda t: {k: v for k, v in t.items() if "layers.3.mlp.down_proj.lora_B" not in k}),
        "layers.3.mlp.down_proj.lora_B.weight is missing",
    ),
    "layer past the model": (
        dict(tensors=lambda t: t | {A0.replace("layers.0", "layers.9"): t[A0].clone()}),
        "adapts layer 9; the base model has 4 layers",
    ),
    "untargeted tensor": (
        dict(tensors=lambda t: t | {A0.replace("q_proj", "k_proj"): t[A0].clone()}),
        "adapts layer 0's k_proj, which the config's target_modules",
    ),
    "foreign tensor": (dict(tensors=lambda t: t | {"base_model.model.lm_head.weight": torch.zeros(2, 2)}), "is not a LoRA A or B"),
    "not finite": (dict(tensors=replaced(A0, torch.full((8, 256), float("nan")))), "not finite"),
    # Python's JSON takes NaN and Infinity: a scale that is not a finite float32 makes every logit NaN
    "alpha NaN": (dict(config={"lora_alpha": float("nan")}), "lora_alpha must be a finite number, got nan"),
    "alpha infinite": (dict(config={"lora_alpha": float("inf")}), "lora_alpha must be a finite number, got inf"),
    "alpha past float32": (dict(config={"lora_alpha": 1e300}), "lora_alpha 1e+300 overflows float32 as a scale"),
    "alpha past float64": (dict(config={"lora_alpha": 10**400}), "lora_alpha 1000000000000000000000000000000000000000... (401 characters) overflows"),
    "finite only in float64": (
        dict(tensors=replaced(A0, torch.full((8, 256), 1e300, dtype=torch.float64))),
        f"{A0} is not finite in float32, the model's dtype",
    ),
    "float8 weights": (
        dict(tensors=replaced(A0, torch.zeros(8, 256).to(torch.float8_e4m3fn))),
        f"{A0} is float8_e4m3fn; LoRA weights are read as",
    ),
    "delta past float32": (
        dict(tensors=lambda t: t | {A0: torch.full((8, 256), 1e30), B0: torch.full((256, 8), 1e30)}),
        "layer 0's q_proj delta (scale * B A) reaches inf, past float32's range",
    ),
    # PEFT variants that were served as a plain LoRA (a wrong result), or refused for another reason
    "activated lora": (
        dict(config={"alora_invocation_tokens": [3453, 28]}),
        "Activated LoRA (alora_invocation_tokens) is not supported",
    ),
    "pissa": (dict(config={"init_lora_weights": "pissa"}), "changes the base weights or the LoRA forward"),
    "olora": (dict(config={"init_lora_weights": "olora"}), "(init_lora_weights = 'olora')"),
    "block-diagonal": (dict(config={"use_bdlora": {"nblocks": 2}}), "block-diagonal LoRA (use_bdlora)"),
    "target_parameters": (
        dict(config={"target_modules": [], "target_parameters": ["mlp.down_proj.weight"]}),
        "LoRA on parameters (target_parameters)",
    ),
    "wrong parent": (dict(config={"target_modules": ["mlp.q_proj"]}), "unknown target module 'mlp.q_proj'"),
    "a bare LlamaModel's keys": (
        dict(tensors=lambda t: {k.replace("model.model.", "model.", 1): v for k, v in t.items()}),
        "comes from an adapter saved on a bare LlamaModel",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_adapter_is_refused_at_load_with_the_reason(engine, good, tmp_path, case):
    change, message = CASES[case]
    path = broken(good, tmp_path, **change)
    with pytest.raises(UserError, match="^LoRA adapter .*" + re.escape(message)) as e:
        engine.adapters.register("bad", path)
    assert "\n" not in str(e.value)
    assert "bad" not in engine.adapters.names()  # nothing half-loaded



def test_targets_named_with_their_parent_are_the_same_adapter(engine, good, tmp_path):
    # PEFT matches "mlp.down_proj" by the end of a module's name; it was refused as unknown.
    dotted = broken(good, tmp_path, config={"target_modules": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]})
    engine.adapters.register("dotted", dotted)
    try:
        greedy = SamplingParams(temperature=0)
        reqs = [Request([1, 2, 3, 4, 5], greedy, max_tokens=6, ignore_eos=True, adapter=a) for a in ("good", "dotted", None)]
        good_tokens, dotted_tokens, base_tokens = (outputs[0].token_ids for outputs in engine.generate(reqs))
        assert dotted_tokens == good_tokens != base_tokens
    finally:
        engine.adapters.unregister("dotted")

def test_unreadable_files_are_refused(engine, good, tmp_path):
    path = broken(good, tmp_path)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        engine.adapters.register("bad", path)
    path = broken(good, tmp_path / "2")
    (path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(UserError, match="the safetensors library cannot read it"):
        engine.adapters.register("bad", path)
    with pytest.raises(UserError, match="no such directory"):
        engine.adapters.register("bad", tmp_path / "nowhere")
    path = broken(good, tmp_path / "3")
    (path / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match="JSON nested too deeply"):
        engine.adapters.register("bad", path)
    path = broken(good, tmp_path / "4")  # more digits than Python turns into an int: a ValueError of its own
    (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 1' + "0" * 5000 + "}")
    with pytest.raises(UserError, match="not valid JSON .*Exceeds the limit"):
        engine.adapters.register("bad", path)
    with pytest.raises(UserError, match="not a readable directory"):
        engine.adapters.register("bad", "~no-such-user-here/adapter")  # expanduser raises
    with pytest.raises(UserError, match="not a readable directory"):
        engine.adapters.register("bad", tmp_path / ("x" * 5000))  # the file system's name limit
    assert engine.adapters.names() == ["good"]


def test_names_are_checked(engine, good):
    with pytest.raises(UserError, match=r"unknown LoRA adapter 'nope' \(loaded: good\)"):
        engine.add(Request([1, 2, 3], adapter="nope"))
    with pytest.raises(UserError, match=r"no LoRA adapter named 'nope' is loaded \(loaded: good\)"):
        engine.adapters.unregister("nope")
    with pytest.raises(AdapterNameError, match="'good' is already loaded; unload it first"):
        engine.adapters.register("good", good)
    for name in ("", "   ", "a\x00b", "x" * 100_000):  # the last one came back whole in every 404
        with pytest.raises(AdapterNameError, match="needs a name of 1 to 256 printable characters") as e:
            engine.adapters.register(name, good)
        assert len(str(e.value)) < 200
    assert engine.adapters.names() == ["good"]


def test_a_name_being_unloaded_can_be_loaded_again_at_once(good, tmp_path):
    # It was refused until the name's last request ended: under steady load, never.
    eng, _ = build_engine("tiny-llama3", "cpu", "float32", max_loras=1, max_lora_rank=8, num_blocks=16)
    eng.adapters.register("x", good)
    rid = eng.add(Request([1, 2, 3], max_tokens=4, adapter="x"))
    eng.step()  # the request runs with x
    eng.adapters.unregister("x")
    eng.adapters.register("x", good)
    assert eng.adapters.names() == ["x"] and len(eng.adapters.loads) == 2  # the old weights until it ends
    eng.adapters.register("y", good, replace=True)  # in place of nothing: a plain load
    assert eng.adapters.names() == ["x", "y"]
    while eng.has_work():
        eng.step()
    assert rid not in eng.requests and len(eng.adapters.loads) == 2  # x and y: the first x went with its request
    # a bad adapter loaded in place is refused, and the loaded one stays
    (tmp_path / "bad").mkdir()
    with pytest.raises(UserError):
        eng.adapters.register("x", tmp_path / "bad", replace=True)
    assert [load.path for load in eng.adapters.loads.values() if load.name == "x"] == [Path(good)]


def test_a_slot_whose_write_fails_stays_free():
    # A failed copy into a slot (out of memory, say) must not cost the slot: with every slot lost,
    # every later request of an adapter would wait for ever.
    adapters = {"a": SimpleNamespace(digest="a"), "b": SimpleNamespace(digest="b")}
    failures = [MemoryError("no memory for the slot")]  # the first copy fails

    def write(slot, adapter):
        if adapter is not None and failures:
            raise failures.pop()

    slots = AdapterSlots(1, lambda path: adapters[path.name], write)
    slots.register("a", "a")
    slots.register("b", "b")
    a, b = slots.current["a"], slots.current["b"]
    with pytest.raises(MemoryError):
        slots.acquire(a)
    assert slots.acquire(b) == 0  # the one slot, free again
    slots.release(0)
    assert slots.acquire(a) == 0  # and reused once b no longer runs


def test_a_slot_table_larger_than_memory_is_refused_at_startup():
    too_big = r"LoRA slot table of 2 slots of rank up to 1000000000 takes .* fewer slots or a lower rank \(a server's --max-loras"
    with pytest.raises(UserError, match=too_big):
        build_engine("tiny-llama3", "cpu", "float32", max_loras=2, max_lora_rank=10**9)


def test_an_engine_without_slots_serves_no_adapter(good):
    eng, _ = build_engine("tiny-llama3", "cpu", "float32", max_loras=0, num_blocks=4)
    with pytest.raises(UserError, match="serves no adapters"):
        eng.add(Request([1, 2, 3], adapter="good"))
    with pytest.raises(UserError, match="serves no LoRA adapters"):
        eng.adapters.register("good", good)
    with pytest.raises(UserError, match="--max-lora-rank must be at least 1"):
        build_engine("tiny-llama3", "cpu", "float32", max_lora_rank=0, num_blocks=4)
