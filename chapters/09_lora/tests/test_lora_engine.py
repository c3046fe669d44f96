"""Adapters inside the batching engine (tiny model, float32): 16 requests over 4 adapters and the
base model in one run, with fewer slots than adapters, equal each request run alone; the prefix
cache never crosses adapters; speculation gives the greedy tokens it gives off; load and unload
while requests run."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import Request, build_engine
from proposers import Draft, NgramProposer
from sampling import SamplingParams
from peft_adapters import hf_base, make_adapter

ADAPTERS = {  # name -> (rank, targets)
    "r2": (2, ["q_proj", "v_proj"]),
    "r4": (4, ["k_proj", "o_proj", "down_proj"]),
    "r8": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "r16": (16, ["gate_proj", "up_proj"]),
}
NAMES = [*ADAPTERS, None]  # None: the base model
# A prompt that repeats itself, so that prompt lookup finds drafts; 40 tokens: two full blocks of 16.
PROMPT = [1] + [300, 500, 700, 900, 1100, 1300, 1500] * 5 + [300, 500, 700, 900]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root, base = tmp_path_factory.mktemp("adapters"), hf_base()
    return {
        name: make_adapter(root / name, rank, targets, seed=i, size=0.1, base=base)
        for i, (name, (rank, targets)) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def engine(paths):
    """Two slots for four adapters: requests of the other two wait, and slots swap."""
    eng, _ = build_engine("tiny-llama3", "cpu", "float32", lora_modules=paths, max_loras=2, num_blocks=256)
    return eng


def request(i: int, adapter, max_tokens=12) -> Request:
    prompt = [1, 100 + i, 2000 + 7 * i, 4000 + i, 50 + i] + [300 + i] * (i % 5)
    return Request(prompt, SamplingParams(temperature=0), max_tokens=max_tokens, ignore_eos=True, adapter=adapter)


def tokens(outputs):
    return [out[0].token_ids for out in outputs]


def test_16_requests_over_4_adapters_and_the_base_equal_each_alone(engine):
    reqs = [request(i, NAMES[i % len(NAMES)]) for i in range(16)]
    waits, loads = engine.adapters.n_waits, engine.adapters.n_loads
    together = tokens(engine.generate(reqs, arrivals=[i // 4 for i in range(16)]))
    assert engine.adapters.n_waits > waits  # 4 adapters, 2 slots: some requests waited for one
    assert engine.adapters.n_loads - loads > 2  # ... and slots were refilled (LRU swaps)
    alone = [tokens(engine.generate([r]))[0] for r in reqs]
    assert together == alone
    # the adapter changes the answer: the same prompt through each adapter and the base
    same_prompt = tokens(engine.generate([request(3, name) for name in NAMES]))
    assert len({tuple(t) for t in same_prompt}) == len(NAMES)
    assert engine.stats()["lora_waits"] == engine.adapters.n_waits
    assert engine.stats()["running"] == 0 and not any(engine.adapters.running)  # every slot given back


def test_the_prefix_cache_never_serves_another_adapter(engine):
    """Blocks computed with one adapter hold that adapter's K/V: the same prompt through another
    adapter or the base must compute its own (0 tokens hit), the same adapter again reuses them."""
    b = engine.blocks

    def run(adapter):
        before = b.hit_tokens
        out = tokens(engine.generate([Request(list(PROMPT), SamplingParams(temperature=0), max_tokens=6, adapter=adapter)]))
        return out[0], b.hit_tokens - before

    first, hit = run("r8")
    assert hit == 0
    for other in ("r4", None):
        _, hit = run(other)
        assert hit == 0, other
    again, hit = run("r8")
    assert hit == 32 and again == first  # two full blocks of 16 from the cache, the same tokens


@pytest.fixture(scope="module")
def speculating(paths):
    """Engines with the same adapters, without speculation, with prompt lookup and with a draft
    model (the tiny model itself, unquantized: it drafts with the base model, the verify rows run
    through the request's adapter). Each engine its own model: a model holds one slot table."""

    def make(speculative):
        eng, _ = build_engine(
            "tiny-llama3",
            "cpu",
            "float32",
            speculative=speculative,
            draft_quant=None,
            lora_modules=paths,
            max_loras=2,
            num_blocks=128,
            num_speculative_tokens=4,
            speculative_max_batch=8,
        )
        return eng

    return {name: make(name) for name in ("off", "ngram", "draft")}


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculation_gives_the_greedy_tokens_it_gives_off(speculating, proposer):
    reqs = [Request(list(PROMPT), SamplingParams(temperature=0), max_tokens=16, ignore_eos=True, adapter=n) for n in NAMES]
    off = tokens(speculating["off"].generate(reqs))
    on = tokens(speculating[proposer].generate(reqs))
    assert on == off
    if proposer == "draft":  # (prompt lookup finds no draft in the tiny model's replies: they do not repeat)
        stats = speculating[proposer].speculator.stats
        assert stats.verifies > 0 and stats.accepted < stats.drafted  # base-model drafts: some rejected


class Oracle:
    """Proposes what the run without speculation generated next: every guess is right, if the verify
    rows compute what decode steps compute, through the request's adapter."""

    def __init__(self, runs):
        self.runs = runs

    def describe(self):
        return "oracle"

    def propose(self, seqs, ks):
        drafts = []
        for seq, k in zip(seqs, ks):
            full = self.runs[seq.adapter]
            drafts.append(Draft(full[len(seq.tokens) : len(seq.tokens) + k] if full[: len(seq.tokens)] == seq.tokens else []))
        return drafts


def test_verify_rows_run_through_the_requests_adapter(speculating):
    off = speculating["off"]
    reqs = {n: Request(list(PROMPT), SamplingParams(temperature=0), max_tokens=12, ignore_eos=True, adapter=n) for n in NAMES}
    runs = {n: PROMPT + tokens(off.generate([r]))[0] for n, r in reqs.items()}
    oracle = speculating["ngram"]
    oracle.speculator.proposer, before = Oracle(runs), SimpleNamespace(**vars(oracle.speculator.stats))
    try:
        on = tokens(oracle.generate(list(reqs.values())))
    finally:
        oracle.speculator.proposer = NgramProposer(min_n=1, max_n=3)
    stats = oracle.speculator.stats
    assert on == [runs[n][len(PROMPT) :] for n in NAMES]
    assert stats.drafted > before.drafted and stats.accepted - before.accepted == stats.drafted - before.drafted


def test_load_and_unload_while_requests_run(engine, paths):
    eng = engine
    eng.adapters.register("late", paths["r4"])  # the same files under a second name
    assert "late" in eng.adapters.names()
    want = {name: tokens(eng.generate([request(5, name, 10)]))[0] for name in ("r4", "r2", "r8")}
    got: dict[str, list[int]] = {}

    def step():
        for r, events, _ in eng.step():
            got.setdefault(r, []).extend(t for e in events for t in e.token_ids)

    first = eng.add(request(5, "late", 10))
    old = eng.requests[first].seqs[0].adapter_uid
    while not got.get(first):
        step()
    eng.adapters.unregister("late")  # in use: new requests are refused at once, this one finishes
    with pytest.raises(ValueError, match="unknown LoRA adapter 'late'"):
        eng.add(request(1, "late"))
    eng.adapters.register("late", paths["r2"])  # the name is free at once, for other weights
    second = eng.add(request(5, "late", 10))
    step()
    eng.adapters.register("late", paths["r8"], replace=True)  # in place, while both run
    third = eng.add(request(5, "late", 10))
    while eng.has_work():
        step()
    # each ran to its end with the weights it started with; new requests got the newest
    assert [got[first], got[second], got[third]] == [want["r4"], want["r2"], want["r8"]]
    assert old not in eng.adapters.loads and old not in eng.adapters.slot_of  # dropped with its last request
    assert len(eng.adapters.loads) == len(ADAPTERS) + 1  # the four, and late's newest weights alone
    seq = eng.requests[eng.add(request(2, "late", 2))].seqs[0]
    while eng.has_work():
        eng.step()
    eng.scheduler.finish(seq)  # finished already (an abort of a request whose choice ended): no second leave
    assert eng.adapters.loads[seq.adapter_uid].users == 0
    eng.adapters.unregister("late")
    assert seq.adapter_uid not in eng.adapters.loads and "late" not in eng.adapters.names()


def test_a_hash_collision_across_adapters_is_a_miss(monkeypatch):
    """Even when block names collide (every name the same here), a block computed with one adapter
    is not served to another or to the base: the check compares the adapter too."""
    import block_manager

    monkeypatch.setattr(block_manager, "block_hash", lambda previous, tokens: 0)
    blocks = block_manager.BlockManager(8, 4)
    tokens = [5, 6, 7, 8, 9]
    table = []
    blocks.grow(table, 4)
    blocks.register(table, tokens, 4, adapter=1)
    for adapter, hit in ((2, 0), (None, 0), (1, 4)):
        other = []
        assert blocks.take_prefix(other, tokens, adapter) == hit, adapter
        blocks.free(other)


def test_slots_swap_least_recently_used_idle_first_and_never_a_running_one():
    from lora_slots import AdapterSlots

    writes = []
    slots = AdapterSlots(2, read=lambda path: SimpleNamespace(path=path, digest=""), write=lambda s, a: writes.append((s, a and a.path.name)))
    for name in "abc":
        slots.register(name, f"/x/{name}")
    ua, ub, uc = (slots.current[name] for name in "abc")  # a sequence holds its registration's uid
    a, b = slots.acquire(ua), slots.acquire(ub)
    assert (a, b) == (0, 1) and writes == [(0, "a"), (1, "b")]
    assert slots.acquire(uc) is None  # both running: c waits
    slots.release(b)
    slots.release(a)  # a used last: b is the least recently used idle slot
    assert slots.acquire(uc) == 1 and writes[-1] == (1, "c") and ub not in slots.slot_of
    assert slots.acquire(ua) == 0 and len(writes) == 3  # still resident: no copy
    slots.release(0)
    slots.release(1)
    assert slots.enter("a") == ua
    slots.unregister("a")  # a request of it is still queued: kept until it leaves
    assert ua in slots.slot_of and slots.names() == ["b", "c"]
    slots.leave(ua)
    assert ua not in slots.loads and writes[-1] == (0, None)  # dropped, its slot emptied
    assert slots.acquire(ub) == 0  # the emptied slot is filled first, c stays resident
    assert slots.slot_of == {ub: 0, uc: 1}


def test_the_default_pool_leaves_room_for_the_slot_table(engine, paths, monkeypatch):
    # Without --kv-cache-memory-gb the pool takes a share of free memory: less the slot table's bytes,
    # which the first load allocates. An explicit KV size stays the KV cache's own.
    import runner as runner_module
    from engine import Engine
    from lora import LoraWeights

    model, config = engine.model, engine.model.config
    monkeypatch.setattr(model, "lora", model.lora)  # the engines below replace the fixture's slot table
    block = config.kv_bytes_per_token(model.dtype.itemsize) * 16
    table = LoraWeights.table_bytes(config, 3, 8, model.dtype)
    assert table > 4 * block  # (the tiny model: the table is worth some blocks)
    monkeypatch.setattr(runner_module, "default_kv_bytes", lambda device: 20 * block + table)
    assert Engine(model, engine.tokenizer, max_loras=0).blocks.num_blocks == 20 + table // block
    assert Engine(model, engine.tokenizer, max_loras=3, kv_cache_bytes=20 * block).blocks.num_blocks == 20
    with_slots = Engine(model, engine.tokenizer, max_loras=3, max_lora_rank=8)  # last: the model's table is its
    assert with_slots.blocks.num_blocks == 20
    with_slots.adapters.register("r8", paths["r8"])
    with_slots.generate([request(0, "r8", max_tokens=2)])
    assert model.lora.nbytes == table  # what was set aside is what the first load took


def test_host_copies_beyond_max_cpu_are_dropped_and_read_again(tmp_path):
    from common.errors import UserError
    from lora_slots import AdapterSlots

    reads, folders = [], {}
    for name in "abc":
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "adapter_config.json").write_text("{}")

    def read(path):
        reads.append(path.name)
        return SimpleNamespace(path=path, digest=(path / "adapter_config.json").read_text())

    with pytest.raises(UserError, match="--max-cpu-loras must be at least --max-loras"):
        AdapterSlots(2, read, lambda s, a: None, max_cpu=1)
    forgot = []  # the host copies dropped, as a tensor-parallel runner's other ranks hear of them
    slots = AdapterSlots(1, read, lambda s, a: None, max_cpu=1, forget=lambda adapter: forgot.append(adapter.path.name))
    for name in "abc":
        slots.register(name, folders[name])

    def held(name):  # its host copy, or None
        return slots.loads[slots.current[name]].adapter

    def on_host():
        return [slots.loads[uid].name for uid in slots.on_host]

    assert on_host() == ["c"] and held("a") is None and reads == ["a", "b", "c"] and forgot == ["a", "b"]
    slots.enter("a")  # named again: read from its folder, and kept while a sequence uses it
    assert reads[-1] == "a" and held("a") is not None and held("c") is None
    slots.check("b")  # a check reads nothing (a server's threads call it)
    assert held("b") is None
    slots.enter("b")  # b read again; a is in use, so both stay (over the limit while in use)
    assert on_host() == ["a", "b"]
    slots.leave(slots.current["a"])  # no longer in use: the least recently used copy goes
    assert on_host() == ["b"] and held("a") is None and forgot == ["a", "b", "c", "a"]
    (folders["c"] / "adapter_config.json").write_text('{"r": 4}')  # changed since it was registered
    with pytest.raises(UserError, match="'c': its files in .* changed"):
        slots.enter("c")
    assert slots.loads[slots.current["c"]].users == 0  # refused before anything was counted
    assert slots.stats()["lora_reads"] == 2 and slots.stats()["lora_host_copies"] == 1


def test_an_engine_that_keeps_two_host_copies_gives_the_same_tokens(engine, paths, tmp_path):
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from common.errors import UserError

    copies = {name: Path(shutil.copytree(path, tmp_path / name)) for name, path in paths.items()}
    few, _ = build_engine(
        "tiny-llama3", "cpu", "float32", lora_modules=copies, max_loras=2, max_cpu_loras=2, num_blocks=256
    )
    reqs = [request(i, NAMES[i % len(NAMES)]) for i in range(10)]
    got = [o[0].token_ids for o in few.generate(reqs)]
    assert got == [o[0].token_ids for o in engine.generate(reqs)]
    assert few.stats()["lora_reads"] > 0 and few.stats()["lora_host_copies"] <= 2
    # an adapter whose files changed while its host copy was dropped: the request is refused whole
    # (retrained: the same shapes, so the same size, and copied with its times, as `cp -p` does)
    dropped = next(load.name for load in few.adapters.loads.values() if load.adapter is None)
    file = copies[dropped] / "adapter_model.safetensors"
    before = file.stat()
    save_file({k: -v if "lora_A" in k else v for k, v in load_file(file).items()}, str(file), {"format": "pt"})
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert file.stat().st_size == before.st_size
    with pytest.raises(UserError, match="changed"):
        few.add(request(0, dropped))
    assert not few.requests and not few.has_work()


def run_steps(eng, reqs, between=lambda step: None):
    """reqs through eng.step() directly (generate() raises on the first failed request). ->
    {index: token ids} for the requests that finished, {index: error} for those that failed."""
    ids = {eng.add(r): i for i, r in enumerate(reqs)}
    out, errors, step = {i: [] for i in range(len(reqs))}, {}, 0
    while eng.has_work():
        for rid, events, _ in eng.step():
            if isinstance(events, Exception):
                errors[ids[rid]] = events
            else:
                out[ids[rid]] += [t for ev in events for t in ev.token_ids]
        step += 1
        between(step)
    return {i: t for i, t in out.items() if i not in errors}, errors


@pytest.mark.parametrize("where", ["sampled row", "verify rows"])
def test_an_adapter_whose_rows_go_nan_fails_its_request_alone(paths, monkeypatch, where):
    """An adapter that passed every check at load can still give NaN logits (a delta that reaches inf
    on some input): its request ends with an error that names it, and the requests that shared its
    steps (the base model's, another adapter's) give what they give alone. Both places a row is
    turned into tokens: the sampler (a prompt's last row) and speculation's verify rows."""
    import speculative

    eng, _ = build_engine(
        "tiny-llama3",
        "cpu",
        "float32",
        lora_modules={"good": paths["r4"], "bad": paths["r8"]},
        max_loras=2,
        num_blocks=128,
        speculative="ngram",
        num_speculative_tokens=4,
        speculative_max_batch=8,
    )
    greedy = SamplingParams(temperature=0)
    reqs = [Request(list(PROMPT), greedy, max_tokens=12, ignore_eos=True, adapter=n) for n in (None, "bad", "good")]
    alone = {i: tokens(eng.generate([r]))[0] for i, r in enumerate(reqs)}  # both adapters now in their slots
    eng.speculator.proposer = Oracle({r.adapter: PROMPT + alone[i] for i, r in enumerate(reqs)})  # drafts every step
    through_verify, real = [], speculative.no_token_error
    monkeypatch.setattr(speculative, "no_token_error", lambda seq: through_verify.append(seq.adapter) or real(seq))

    @torch.inference_mode()  # the tables are inference tensors
    def poison():  # the resident tables of "bad", as an overflow would leave its delta
        eng.runner.model.lora.a["q_proj"][:, eng.adapters.slot_of[eng.adapters.current["bad"]]].fill_(float("nan"))

    if where == "sampled row":
        poison()
    done, errors = run_steps(eng, reqs, between=lambda step: poison() if where == "verify rows" and step == 1 else None)
    assert list(errors) == [1] and "(through LoRA adapter 'bad')" in str(errors[1])
    assert done == {0: alone[0], 2: alone[2]}
    assert through_verify == (["bad"] if where == "verify rows" else [])
    assert not eng.has_work() and eng.blocks.num_used == 0  # its blocks went back too
