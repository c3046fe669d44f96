"""sharding.py in one process: which rank holds what, refusals with the numbers, int4 codes of a
slice, bytes read per rank, and the sharded forward pass against the whole model layer by layer
(ranks as threads, an all-reduce as a barrier and a sum: the arithmetic of the processes' run)."""

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from common.config import load_config
from common.errors import UserError
from common.models import resolve_model
from model import forward_sequence, load_model
from ops import TorchOps
from quant import QuantSpec, quantize_int4
from sharding import ShardPlan, load_shard, read_shard


@pytest.fixture(scope="module")
def tiny():
    return resolve_model("tiny-llama3")


def test_plans_split_heads_mlp_and_vocab(tiny):
    config = load_config(tiny)  # 8 query heads, 2 KV heads, MLP 768, vocabulary 49152
    plans = [ShardPlan.of(config, r, 2) for r in range(2)]
    assert [p.q_heads for p in plans] == [(0, 4), (4, 8)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 2)]
    assert [p.mlp for p in plans] == [(0, 384), (384, 768)]
    assert [p.vocab for p in plans] == [(0, 24576), (24576, 49152)]
    local = plans[1].local_config(config)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (4, 1, 384)
    assert local.vocab_size == config.vocab_size  # rank 0's logits are gathered whole


def test_kv_heads_fewer_than_ranks_are_replicated(tiny):
    config = load_config(tiny)  # 8 query heads over 4 ranks: 2 each; 2 KV heads: each on 2 ranks
    plans = [ShardPlan.of(config, r, 4) for r in range(4)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # every query head of a rank reads the KV head it holds (GQA: head j reads j // (8 / 2))
    for p in plans:
        assert {j // 4 for j in range(*p.q_heads)} == {p.kv_heads[0]}


def test_sizes_that_do_not_divide_are_refused_with_the_numbers():
    config = load_config(resolve_model("smollm2-135m"))  # 9 query heads, 3 KV heads
    with pytest.raises(UserError, match=r"9 query heads do not split into 2.*3 KV heads do not split into 2"):
        ShardPlan.check(config, 2)
    # 9 splits the heads but not the MLP's 1536 features: only sizes that pass every check are offered
    with pytest.raises(UserError, match=r"\(sizes that split it: 1, 3\)"):
        ShardPlan.check(config, 4)
    ShardPlan.check(config, 3)
    with pytest.raises(UserError, match=r"int4 groups of 128 \(sizes that split it: 1, 2\)"):
        ShardPlan.check(load_config(resolve_model("tiny-llama3")), 4, QuantSpec(4, 128))
    with pytest.raises(UserError, match="16 ranks are not a multiple of the 2 KV heads|8 query heads"):
        ShardPlan.check(load_config(resolve_model("tiny-llama3")), 16)


def test_int4_codes_of_a_slice_are_the_slice_of_the_codes():
    """Row-parallel weights split their inputs on whole groups: quantizing rank r's columns gives
    the codes, scales and mins of the whole weight's quantization, cut at the same place."""
    torch.manual_seed(0)
    w = torch.randn(64, 256, dtype=torch.bfloat16)  # [out, in], 8 groups of 32 per row
    whole = quantize_int4(w, 32)
    for r in range(2):
        part = quantize_int4(w[:, r * 128 : (r + 1) * 128], 32)
        assert torch.equal(part.codes(), whole.codes()[:, r * 128 : (r + 1) * 128])
        assert torch.equal(part.scale, whole.scale[:, r * 4 : (r + 1) * 4])
        assert torch.equal(part.min, whole.min[:, r * 4 : (r + 1) * 4])
    # and a cut through a group would not: the check refuses such sizes
    cut = quantize_int4(w[:, 16:144], 32)
    assert not torch.equal(cut.codes(), whole.codes()[:, 16:144])


def test_each_rank_reads_about_its_share(tiny):
    config = load_config(tiny)
    _, whole = read_shard(tiny, config, ShardPlan.of(config, 0, 1))
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size * 4  # float32, on every rank
    for world in (2, 4):
        reads = [read_shard(tiny, config, ShardPlan.of(config, r, world))[1] for r in range(world)]
        for read in reads:
            # 1/N of everything but the norms; with 4 ranks the 2 KV heads are read twice each
            kv = config.num_hidden_layers * 2 * config.hidden_size * config.head_dim * 4
            extra = kv * (1 - config.num_key_value_heads / world) if world > config.num_key_value_heads else 0
            assert read == pytest.approx((whole - norms) / world + norms + extra, rel=1e-9)


class ThreadComm:
    """The collectives of `world` ranks that are threads of this process."""

    def __init__(self, world: int):
        self.world, self.barrier, self.box = world, threading.Barrier(world), [None] * world

    def for_rank(self, rank: int):
        comm = self

        class Rank:
            def all_reduce(self, t):
                comm.box[rank] = t.clone()
                comm.barrier.wait()
                total = sum(comm.box[1:], comm.box[0].clone())  # the same order on every rank
                comm.barrier.wait()
                return t.copy_(total)

            def gather_last_dim(self, t):
                comm.box[rank] = t
                comm.barrier.wait()
                whole = torch.cat(comm.box, dim=-1)
                comm.barrier.wait()
                return whole

        return Rank()


def sharded_run(model_dir, world: int, ids: list[int], quant=None):
    """Every rank's capture of forward_sequence and rank 0's logits."""
    comm, results, errors = ThreadComm(world), [None] * world, []

    def rank(r):
        try:
            model, _ = load_shard(model_dir, r, world, comm.for_rank(r), "cpu", torch.float32, quant, "reference", TorchOps())
            capture = {}
            with torch.inference_mode():
                logits = forward_sequence(model, ids, capture)
            results[r] = (logits, capture)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            comm.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("quant", [None, QuantSpec(4, 32)], ids=["float32", "int4"])
def test_sharded_forward_matches_the_whole_model_layer_by_layer(tiny, quant):
    ids = [1, 450, 4996, 17354, 1701, 29889, 322, 278]
    whole = load_model(tiny, quant=quant, matmul="reference", ops=TorchOps())
    capture = {}
    with torch.inference_mode():
        want = forward_sequence(whole, ids, capture)
    results = sharded_run(tiny, 2, ids, quant)
    logits, got = results[0]
    assert logits.shape == want.shape
    for name in capture:  # every rank's residual stream is the whole one after each all-reduce
        for r in range(2):
            torch.testing.assert_close(
                torch.from_numpy(results[r][1][name]), torch.from_numpy(capture[name]), rtol=1e-4, atol=1e-4
            )
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_the_one_call_layer_sums_o_and_down_through_its_all_reduce(tiny):
    """At TP > 1 a decode step's layers run in one C++ call each (DecoderLayer), which calls the
    all-reduce back on o_proj's and down_proj's partial sums. Here an all-reduce that doubles them,
    as two ranks with equal shares would: the same logits, bit for bit, as a layer whose o and down
    weights are doubled (float32: doubling is exact), and two calls per layer and step."""
    import dataclasses

    from batch import Work, build_step
    from model import forward
    from ops import resolve
    from paged_cache import PagedKVCache

    cpu = torch.device("cpu")
    ops = resolve("on", cpu)
    model = load_model(tiny, cpu, torch.float32, ops=ops)
    reduced = [layer.one_call for layer in model.layers]
    calls = []
    for one_call in reduced:
        one_call.all_reduce = lambda t: calls.append(t.shape) or t + t
    doubled = [
        ops.build_one_call_layer(dataclasses.replace(layer, wo=2 * layer.wo, w_down=2 * layer.w_down), model.config)
        for layer in model.layers
    ]

    def run(one_calls):
        for layer, one_call in zip(model.layers, one_calls):
            layer.one_call = one_call
        cache = PagedKVCache(model.config, 8, 16, cpu, torch.float32)
        prompts, tables = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9]], [[0, 1], [2, 3]]
        forward(model, build_step([Work(q, 0, b) for q, b in zip(prompts, tables)], 16, cpu), cache)  # Python
        return [
            forward(model, build_step([Work([11 + k], len(q) + k, b) for q, b in zip(prompts, tables)], 16, cpu), cache)
            for k in range(2)
        ]

    want = run(doubled)
    got = run(reduced)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert calls == [torch.Size([2, model.config.hidden_size])] * (2 * model.config.num_hidden_layers * 2)


def test_shared_memory_all_reduce_sums_in_one_order_on_every_rank(tmp_path):
    """Two ranks as threads, each with its own mapping of the file: many calls of changing sizes
    and dtypes (the slots alternate), every rank gets slot 0 + slot 1, bit for bit the same."""
    from shm_channel import ShmChannel

    path = ShmChannel.create(str(tmp_path), 2)
    calls = [(torch.randn(rows, 64, generator=torch.Generator().manual_seed(i)), dtype) for i, (rows, dtype) in
             enumerate([(1, torch.float32), (16, torch.bfloat16), (3, torch.float32)] * 20)]
    got = [[], []]

    def rank(r):
        shm = ShmChannel(path, r, 2, timeout_s=60)
        for x, dtype in calls:
            got[r].append(shm.all_reduce((x * (r + 1)).to(dtype)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (x, dtype), a, b in zip(calls, *got):
        assert torch.equal(a, b)
        assert torch.equal(a, x.to(dtype) + (2 * x).to(dtype))


def test_shared_memory_carries_plans_all_reduces_and_gathers_in_a_step_s_order(tmp_path, monkeypatch):
    """Three ranks as threads run what steps run: rank 0 sends a plan (pickled), every rank
    all-reduces twice, the logits' slices are gathered on rank 0; a plan too big for a slot says so
    on both sides (the process group carries it then). The workers read plans slowly, and three go
    out in a row first: rank 0 must not rewrite a set before every rank has read it."""
    import pickle

    import shm_channel
    from shm_channel import TOO_BIG, ShmChannel

    loads = pickle.loads
    monkeypatch.setattr(shm_channel.pickle, "loads", lambda b: time.sleep(0.002) or loads(b))
    path = ShmChannel.create(str(tmp_path), 3)
    plans = [("run", i, list(range(i * 7))) for i in range(30)]
    got = [[], [], []]

    def rank(r):
        ch = ShmChannel(path, r, 3, timeout_s=10)
        firsts = [("copy", i) for i in range(3)]
        got[r].append([ch.send(m) and m for m in firsts] if r == 0 else [ch.recv() for _ in firsts])
        for i, plan in enumerate(plans):
            got[r].append(plan if r == 0 and ch.send(plan) else ch.recv() if r else None)
            x = torch.full((2, 8), float(r + i))
            got[r].append(ch.all_reduce(x).clone())
            got[r].append(ch.all_reduce(torch.full((1, 8), 1.0 + r, dtype=torch.bfloat16)).clone())
            got[r].append(ch.gather_last_dim(torch.arange(5.0).expand(2, 5) + 10 * r).clone())
        big = b"x" * shm_channel.SLOT_BYTES
        got[r].append(ch.send(big) if r == 0 else ch.recv() is TOO_BIG)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0][0] == got[1][0] == got[2][0] == [("copy", i) for i in range(3)]
    for i, plan in enumerate(plans):
        p, reduced, reduced_bf16, gathered = zip(*(got[r][1 + 4 * i : 5 + 4 * i] for r in range(3)))
        assert p[1] == p[2] == plan
        for r in range(3):
            assert torch.equal(reduced[r], torch.full((2, 8), float(3 * i + 3)))
            assert torch.equal(reduced_bf16[r], torch.full((1, 8), 6.0, dtype=torch.bfloat16))
        assert torch.equal(gathered[0], torch.cat([torch.arange(5.0).expand(2, 5) + 10 * r for r in range(3)], -1))
        assert torch.equal(gathered[1], torch.arange(5.0).expand(2, 5) + 10)  # its own slice elsewhere
    assert got[0][-1] is False and got[1][-1] is True and got[2][-1] is True


def test_the_kernel_library_s_channel_and_the_python_one_take_turns_on_one_file(tmp_path):
    """What a step does when the kernels are loaded: the plan goes through the Python channel, the
    all-reduces and the gather through the library's C++ twin (kernels/csrc/shm_channel.h), on one
    file, the flags shared. Here each rank switches side every call, so that every pairing meets:
    the same sums and parts as the Python channel alone, bit for bit."""
    from ops import resolve
    from shm_channel import ShmChannel

    path = ShmChannel.create(str(tmp_path), 2)
    ops = resolve("on", torch.device("cpu"))
    parts = lambda i, r: (torch.randn(3, 40, generator=torch.Generator().manual_seed(i)) * 10.0 ** (4 * r - 2))  # noqa: E731
    got = [[], []]

    def rank(r):
        ch = ShmChannel(path, r, 2, timeout_s=30)
        twin = ShmChannel(path, r, 2, timeout_s=30)
        twin.attach_library(ops)
        native = twin.native
        for i in range(24):
            way = native if (i + r) % 2 else ch  # rank 0 and rank 1 on different sides, then swapped
            got[r].append(ch.send(("run", i)) and ("run", i) if r == 0 else ch.recv())
            got[r].append(way.all_reduce(parts(i, r).to(torch.bfloat16 if i % 3 else torch.float32)).clone())
            got[r].append(way.gather_last_dim(parts(i, r)[:1]).clone())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(24):
        dtype = torch.bfloat16 if i % 3 else torch.float32
        want = torch.sum(torch.stack([parts(i, r).to(dtype) for r in range(2)]), dim=0)
        for r in range(2):
            plan, reduced, gathered = got[r][3 * i : 3 * i + 3]
            assert plan == ("run", i)
            assert torch.equal(reduced, want), (i, r)
            assert torch.equal(gathered, torch.cat([parts(i, 0)[:1], parts(i, 1)[:1]], -1) if r == 0 else parts(i, 1)[:1])


@pytest.mark.reaches()  # its subprocess is flock(1), no script of the chapter (common/tools/carried.py)
def test_the_shared_memory_file_is_reserved_whole_and_orphans_are_removed(tmp_path, monkeypatch):
    import errno
    import signal
    import subprocess

    import shm_channel
    from shm_channel import ShmChannel

    # A file of a rank 0 killed while its ranks loaded (nothing unlinked it, and its lock went with
    # it) goes at the next start; one whose rank 0 runs (holds its lock) stays, whatever its pid says
    # (a container sharing /dev/shm sees none of another's pids).
    orphan, alive = tmp_path / "llm-tp-999999999-1", tmp_path / "llm-tp-999999999-2"
    orphan.write_bytes(b"x")
    alive.write_bytes(b"x")
    # -o: flock itself holds the lock, not its sleep; a session of their own, to end both
    holder = subprocess.Popen(["flock", "-o", str(alive), "sleep", "60"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the holder has its lock
            if subprocess.run(["flock", "-n", str(alive), "true"]).returncode != 0:
                break
            time.sleep(0.05)
        path = ShmChannel.create(str(tmp_path), 2)
        assert not orphan.exists() and alive.exists()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the lock goes with flock
        holder.wait()
    # ... and with its child, killed too, which may hold the lock's descriptor a moment after flock
    # is reaped (forked, not yet at the exec before which -o closes it): a busy machine showed it
    deadline = time.monotonic() + 10
    while subprocess.run(["flock", "-n", str(alive), "true"]).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.stat(path).st_blocks * 512 >= ShmChannel.size(2)[1]  # reserved, not sparse
    second = ShmChannel.create(str(tmp_path), 2)  # this process holds the first: it stays
    assert Path(path).exists()
    ShmChannel.remove(path)
    assert not Path(path).exists()

    # No room (a small /dev/shm), or no folder to write in: one line, and no file left
    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shm_channel.os, "posix_fallocate", no_room)
    with pytest.raises(UserError, match=r"has no room for the ranks' shared memory \(16 MiB for 2 ranks: No space"):
        ShmChannel.create(str(tmp_path), 2)
    # (the file whose holder has gone since went with this sweep; the failed one left nothing)
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(second).name]
    ShmChannel.remove(second)
    with pytest.raises(UserError, match=r"cannot make the ranks' shared-memory file in /nonexistent .*TP_TRANSPORT=gloo"):
        ShmChannel.create("/nonexistent", 2)


def test_shared_memory_all_reduce_gives_up_when_a_rank_is_gone(tmp_path):
    from shm_channel import ShmChannel

    path = ShmChannel.create(str(tmp_path), 2)
    gone = RuntimeError("rank 1 is gone")

    def check():
        raise gone

    shm = ShmChannel(path, 0, 2, timeout_s=30, check=check)
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        shm.all_reduce(torch.ones(4))
    shm = ShmChannel(path, 0, 2, timeout_s=0.3)
    with pytest.raises(TimeoutError, match="did not arrive in 0.3 s"):
        shm.all_reduce(torch.ones(4))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_directory_is_sliced_to_tp1s_codes(tiny, tmp_path, bits):
    # quantize.py's output (and a converted .gguf) at N > 1: each rank reads the codes whole and keeps
    # its slices, whole int4 groups and every row's own scales: the same logits as TP=1 on them.
    from quantize import quantize_dir

    qdir = tmp_path / f"tiny-int{bits}"
    quantize_dir(str(tiny), QuantSpec(bits, 32), qdir)
    ids = [1, 450, 4996, 17354, 1701, 29889, 322, 278]
    whole = load_model(qdir, matmul="reference", ops=TorchOps())
    with torch.inference_mode():
        want = forward_sequence(whole, ids)
    logits, _ = sharded_run(qdir, 2, ids)[0]
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_smollm2_at_tp3_holds_a_third_of_the_weights_per_rank():
    """The issue's bound: per-rank weight bytes at most 1/N + 5 % of TP=1's (SmolLM2, bf16, N=3)."""
    d = resolve_model("smollm2-135m")
    from math import prod

    from common.checkpoint import expected_shapes

    whole = 2 * sum(prod(shape) for shape in expected_shapes(load_config(d)).values())  # TP=1's, bf16
    held = [load_shard(d, r, 3, None, "cpu", torch.bfloat16, None, "reference", TorchOps())[0].weight_bytes for r in range(3)]
    for h in held:
        assert whole / 3 <= h <= whole * (1 / 3 + 0.05), (h, whole)
