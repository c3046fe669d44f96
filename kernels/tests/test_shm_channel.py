"""The shared-memory all-reduce and gather (csrc/shm_channel.h, csrc/shm_channel.cpp): ranks as
threads, each with its own mapping of one file. Every rank must get torch.sum over the ranks' parts
(slot 0 first, float32 accumulation for 16-bit types, one rounding) bit for bit, over calls whose
sizes and dtypes change (the two sets of slots alternate) and with a slow rank (no set rewritten
before everyone has read it); rank 0 gets the parts side by side from gather_last_dim. Then what a
wait does when a rank never comes: the check's exception, the timeout, and other threads running
meanwhile (the wait lets go of the GIL). Chapter 08's test_sharding.py runs it against the Python
channel on one file."""

import mmap
import random
import threading
import time

import pytest
import torch

SLOT = 1 << 17  # 300 rows of 72 float32


def make_file(path, world: int) -> None:
    with open(path, "wb") as f:
        f.truncate(64 * world + 2 * world * SLOT)


def channel(ops, path, rank: int, world: int, timeout_s: float = 30, check=None):
    with open(path, "r+b") as f:
        mem = mmap.mmap(f.fileno(), 0)
    return ops.ShmChannel(torch.frombuffer(mem, dtype=torch.uint8), rank, world, SLOT, timeout_s, check)


def run_ranks(world: int, fn) -> list:
    out, errors = [None] * world, []

    def rank(r):
        try:
            out[r] = fn(r)
        except Exception as e:  # noqa: BLE001  (reported below, with the rank)
            errors.append((r, e))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return out


def part(call: int, rank: int, rows: int, dtype) -> torch.Tensor:
    """Rank r's part in call i: magnitudes that differ by rank, so the order of the sum shows."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    return (torch.randn(rows, 72, generator=g) * 10.0 ** (2 * rank - 2)).to(dtype)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_sum_in_rank_order_and_rank_0_the_gathered_parts(ops, tmp_path, world):
    path = tmp_path / "shm"
    make_file(path, world)
    rng = random.Random(world)
    calls = [(rng.choice([1, 3, 16, 300]), rng.choice([torch.float32, torch.bfloat16, torch.float16])) for _ in range(60)]

    def rank(r):
        ch = channel(ops, path, r, world)
        got = []
        for i, (rows, dtype) in enumerate(calls):
            if r == world - 1 and i % 7 == 0:
                time.sleep(0.003)  # a slow rank: the others must wait for it before they rewrite a set
            got.append(ch.all_reduce(part(i, r, rows, dtype)))
            gathered = ch.gather_last_dim(torch.full((rows % 5 + 1, 3), float(i + r)))
            got.append(gathered.clone())
        return got

    got = run_ranks(world, rank)
    for i, (rows, dtype) in enumerate(calls):
        want = torch.sum(torch.stack([part(i, r, rows, dtype) for r in range(world)]), dim=0)
        parts = [torch.full((rows % 5 + 1, 3), float(i + r)) for r in range(world)]
        for r in range(world):
            assert torch.equal(got[r][2 * i], want), (i, rows, dtype, r)
            assert torch.equal(got[r][2 * i + 1], torch.cat(parts, -1) if r == 0 else parts[r]), (i, r)


def test_a_wait_raises_the_check_s_error_or_times_out_and_lets_other_threads_run(ops, tmp_path):
    path = tmp_path / "shm"
    make_file(path, 2)
    checks = []

    def check():
        checks.append(time.monotonic())
        if len(checks) == 3:
            raise RuntimeError("rank 1 is gone")

    ch = channel(ops, path, 0, 2, timeout_s=30, check=check)
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        ch.all_reduce(torch.ones(4))  # rank 1 never comes
    assert 0.15 < checks[-1] - checks[0] < 2  # about every 0.1 s

    # The other thread notes the time as often as it gets to run. A wait that held the GIL would let
    # it run not once in the middle of the 0.3 s; a count of its runs would be a timing test (on a
    # loaded machine it ran 4 times in the wait, unloaded ~300), so: at least once, well inside.
    ticks = []
    stop = threading.Event()

    def other_thread():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    t = threading.Thread(target=other_thread)
    t.start()
    ch = channel(ops, tmp_path / "shm", 0, 2, timeout_s=0.3)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="did not arrive in 0.3 s"):
            ch.gather_last_dim(torch.ones(2, 2))
        end = time.monotonic()
        inside = [tick for tick in ticks if start + 0.05 < tick < end - 0.05]
        assert inside, f"the other thread never ran during the {end - start:.2f} s wait"
    finally:
        stop.set()
        t.join()


def test_what_a_channel_refuses(ops, tmp_path):
    path = tmp_path / "shm"
    make_file(path, 2)
    with open(path, "r+b") as f:
        file = torch.frombuffer(mmap.mmap(f.fileno(), 0), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="rank 2 of 2 ranks"):
        ops.ShmChannel(file, 2, 2, SLOT, 1.0)
    with pytest.raises(RuntimeError, match="holds no flags and two sets of 3 slots"):
        ops.ShmChannel(file, 0, 3, SLOT, 1.0)
    ch = ops.ShmChannel(file, 0, 1, SLOT, 1.0)  # one rank: its own part is the sum
    assert not ch.fits(torch.ones(SLOT // 4 + 1)) and ch.fits(torch.ones(SLOT // 4))
    assert not ch.fits(torch.ones(8, 8).t()) and not ch.fits(torch.ones(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="of at most 131072 bytes, not Float, 131076 bytes on cpu"):
        ch.all_reduce(torch.ones(SLOT // 4 + 1))
    with pytest.raises(RuntimeError, match="bytes on cpu, strided"):
        ch.all_reduce(torch.ones(8, 8).t())
    with pytest.raises(RuntimeError, match="not Long"):
        ch.gather_last_dim(torch.ones(4, dtype=torch.long))
    x = torch.tensor([1.5, -2.0])
    assert torch.equal(ch.all_reduce(x), torch.tensor([1.5, -2.0]))
