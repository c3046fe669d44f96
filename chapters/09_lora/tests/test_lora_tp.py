"""Adapters under tensor parallelism (real processes, gloo on CPU, the tiny model in float32):
column-parallel projections hold their rows of B, row-parallel ones their columns of A, and the
tokens equal TP=1's, with more adapters than slots (every rank swaps the same slot) and an unload."""

import pytest

from engine import Request
from parallel import build_engine
from sampling import SamplingParams
from peft_adapters import EVERY, hf_base, make_adapter

REACHES = ["parallel.py"]  # the workers run it as a script (common/tools/carried.py)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root, base = tmp_path_factory.mktemp("adapters"), hf_base()
    return {
        "every": make_adapter(root / "every", 8, EVERY, seed=1, size=0.1, base=base),
        "o-down": make_adapter(root / "o-down", 4, ["o_proj", "down_proj"], seed=2, size=0.2, base=base),
        "kv-up": make_adapter(root / "kv-up", 16, ["k_proj", "v_proj", "up_proj"], seed=3, size=0.1, base=base),
    }


def test_tp2_with_adapters_equals_tp1(paths):
    names = [*paths, None]
    prompts = [[1, 100 + i, 2000 + 9 * i, 4000 + i, 77] for i in range(8)]

    def outputs(tp):
        engine, _ = build_engine(
            "tiny-llama3", "cpu", "float32", tensor_parallel_size=tp, lora_modules=paths, max_loras=2, num_blocks=64
        )
        try:
            reqs = [
                Request(p, SamplingParams(temperature=0), max_tokens=8, ignore_eos=True, adapter=names[i % 4])
                for i, p in enumerate(prompts)
            ]
            first = [o[0].token_ids for o in engine.generate(reqs, arrivals=[i // 3 for i in range(8)])]
            engine.adapters.unregister("every")  # its slot emptied on every rank
            rest = [o[0].token_ids for o in engine.generate([r for r in reqs if r.adapter != "every"])]
            return first, rest, engine.stats()
        finally:
            if tp > 1:
                engine.tensor_parallel.close()

    want = outputs(1)
    got = outputs(2)
    assert got[:2] == want[:2]
    assert got[2]["lora_waits"] > 0 and got[2]["lora_loads"] > 2  # 3 adapters through 2 slots
    by_adapter = {}
    for i, t in enumerate(want[0]):
        by_adapter.setdefault(names[i % 4], []).append(tuple(t))
    assert len({ts[0] for ts in by_adapter.values()}) >= 3  # the adapters change the tokens


def test_a_name_loaded_again_in_place_from_its_own_folder_keeps_each_rank_on_the_same_weights(paths, tmp_path):
    # The other ranks read an adapter's files when a slot was filled: a sequence of the old
    # registration that got its slot after the folder was overwritten and loaded again in place ran
    # with the old weights on rank 0 and the new ones on rank 1. They read them when rank 0 does now.
    import shutil

    folder = tmp_path / "x"

    def outputs(tp):
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(paths["o-down"], folder)
        engine, _ = build_engine(
            "tiny-llama3", "cpu", "float32", tensor_parallel_size=tp, lora_modules={"x": folder, "y": paths["kv-up"]},
            max_loras=1, num_blocks=64,
        )  # fmt: skip

        def request(adapter, max_tokens=8):
            return Request([1, 100, 2000, 4000, 77], SamplingParams(temperature=0), max_tokens=max_tokens,
                           ignore_eos=True, adapter=adapter)  # fmt: skip

        try:
            ids = [engine.add(request("y", 6))]
            engine.step()
            ids.append(engine.add(request("x")))  # waits: y holds the only slot
            engine.step()
            shutil.rmtree(folder)
            shutil.copytree(paths["every"], folder)  # other weights in the same folder, loaded in place
            engine.adapters.register("x", folder, replace=True)
            ids.append(engine.add(request("x")))
            out = {rid: [] for rid in ids}
            while engine.has_work():
                for rid, events, _ in engine.step():
                    out[rid] += [t for e in events for t in e.token_ids]
            return [out[rid] for rid in ids], engine.stats()["lora_waits"]
        finally:
            if tp > 1:
                engine.tensor_parallel.close()

    want, waits = outputs(1)
    assert waits > 0 and want[1] != want[2]  # the old x waited for the slot; old and new weights differ
    assert outputs(2)[0] == want


def test_files_changed_while_the_ranks_read_them_are_refused_not_loaded_apart(paths, tmp_path):
    # Rank 0 reads an adapter's files, then tells the other ranks to read them: files rewritten in
    # between put different weights on the ranks (each layer's sum then mixes two adapters). Every
    # rank now says what it read, and rank 0 refuses a difference; the engine goes on.
    import shutil

    import pytest

    from common.errors import UserError

    folder = tmp_path / "x"
    shutil.copytree(paths["o-down"], folder)
    engine, _ = build_engine("tiny-llama3", "cpu", "float32", tensor_parallel_size=2, max_loras=1, num_blocks=64)
    try:
        read = engine.runner.inner.read_lora

        def read_then_overwrite(path):
            adapter = read(path)
            if path == folder:  # after rank 0's read, before rank 1's
                for name in ("adapter_model.safetensors", "adapter_config.json"):
                    shutil.copy(paths["kv-up"] / name, folder / name)
            return adapter

        engine.runner.inner.read_lora = read_then_overwrite
        with pytest.raises(UserError, match="changed while the ranks read them; load it again"):
            engine.adapters.register("x", folder)
        assert "x" not in engine.adapters.names()
        engine.adapters.register("y", paths["kv-up"])  # the group is whole: the next load and step work
        reqs = [
            Request([1, 100, 2000, 4000, 77], SamplingParams(temperature=0), max_tokens=4, ignore_eos=True, adapter=a)
            for a in (None, "y")
        ]
        assert [len(o[0].token_ids) for o in engine.generate(reqs)] == [4, 4]
    finally:
        engine.tensor_parallel.close()
