"""What tensor parallelism costs and buys here: the all-reduce per call, and decode tok/s at TP=1
against TP=N on the same cores.

    python tp_bench.py                      # both parts; JSON + plot under bench/results/
    python tp_bench.py --parts allreduce    # only the collective

allreduce: two ranks all-reduce [rows, hidden] tensors, as a row-parallel layer does twice per
decoder layer, through gloo, through shared memory (shm_channel.py) and through its C++ twin in the
kernel library (kernels/csrc/shm_channel.h, where it is built), calls interleaved; the
median time per call over --calls calls.
decode: the engine decoding `batch` sequences; TP=1 with all the cores' threads against TP=N with
cores/N threads per rank (SmolLM2 at TP=3: 2 does not divide its 9 heads; the tiny model at TP=2).
Both engines live in one process per case (rank 0 of TP=N is that process), and their runs
alternate, --rounds times: each round's TP=N / TP=1 ratio compares two runs on the same machine
moments apart (this machine's speed moves by half within minutes). Decode tok/s counts the tokens
of the steps after the prefill; the table keeps each engine's median and range, and each ratio's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from common.cli import positive_int, run_main
from common.errors import RunError
from common.tools.bench import RESULTS_DIR, int_list

OUT = RESULTS_DIR / f"ch{Path(__file__).resolve().parent.name[:2]}_tensor_parallel"  # chNN: this chapter


def _allreduce_rank(rank: int, world: int, port: int, shm_path: str, shapes, calls: int, results) -> None:
    import torch.distributed as dist

    from ops import resolve
    from shm_channel import ShmChannel

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    shm = ShmChannel(shm_path, rank, world, timeout_s=60)
    ways = {"gloo": dist.all_reduce, "shm": shm.all_reduce}
    twin = ShmChannel(shm_path, rank, world, timeout_s=60)  # the same file (the flags are shared)
    twin.attach_library(resolve("auto", torch.device("cpu")))
    if twin.native is not None:  # the kernel library's C++ twin
        ways["shm-c++"] = twin.native.all_reduce
    out = {}  # rank 0's: "{way} {rows}x{hidden} {dtype}" -> median microseconds a call
    for rows, hidden, dtype in shapes:
        t = torch.ones(rows, hidden, dtype=dtype)
        times = {name: [] for name in ways}
        for _ in range(20):
            for fn in ways.values():
                fn(t)
        run = min(calls, 50)
        for _ in range(calls // run):  # interleaved in runs of 50: both see the same machine, and
            for name, fn in ways.items():  # a call right after the other way's pays its skew between ranks
                for _ in range(run):
                    t0 = time.perf_counter()
                    fn(t)
                    times[name].append(time.perf_counter() - t0)
        if rank == 0:
            for name in ways:
                out[f"{name} {rows}x{hidden} {str(dtype).removeprefix('torch.')}"] = statistics.median(times[name]) * 1e6
    dist.destroy_process_group()
    if rank == 0:
        results.put(out)


def allreduce_part(calls: int) -> dict:
    import multiprocessing as mp

    from common.tools.serving import free_port

    port = free_port()
    shapes = [(r, h, d) for h in (256, 576) for r in (1, 16) for d in (torch.float32, torch.bfloat16)]
    from shm_channel import ShmChannel

    shm_path = ShmChannel.create("/dev/shm", 2)
    ctx = mp.get_context("spawn")
    # rank 0's figures come back through a pipe (a Manager would start a third interpreter, 1.3 s)
    results = ctx.SimpleQueue()
    try:
        args = (2, port, shm_path, shapes, calls, results)
        procs = [ctx.Process(target=_allreduce_rank, args=(r, *args)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        for rank, p in enumerate(procs):
            if p.exitcode:  # its own traceback is above: the figures would be missing or one-sided
                raise RunError(f"all-reduce part: rank {rank} exited with status {p.exitcode}")
        return results.get()
    finally:
        ShmChannel.remove(shm_path)


def decode_rate(engine, batch: int, new_tokens: int) -> float:
    """Generated tokens per second of `batch` sequences' decode steps (after their prefill)."""
    from engine import Request
    from sampling import SamplingParams

    for i in range(batch):
        prompt = [1 + i] + list(range(100, 115))
        engine.add(Request(prompt, SamplingParams(temperature=0), max_tokens=new_tokens, ignore_eos=True))
    engine.step()  # the prefill
    t0, tokens = time.perf_counter(), 0
    while engine.has_work():
        for _, events, _ in engine.step():
            if isinstance(events, Exception):  # a request that failed alone (engine.step)
                raise events
            tokens += sum(len(ev.token_ids) for ev in events)
    return tokens / (time.perf_counter() - t0)


def decode_part(model: str, tp: int, batches: list[int], new_tokens: int, quant, rounds: int) -> dict:
    """TP=1 (all cores' threads) and TP=tp (cores/tp threads per rank) in this process, their runs
    alternating -> {batch: {"TP=1": [tok/s per round], "TP=N": [...], "ratio": [TP=N / TP=1 per round]}}."""
    from parallel import build_engine, threads_per_rank

    kw = dict(num_blocks=512, max_num_seqs=32)
    single, _ = build_engine(model, "cpu", "auto", quant, **kw)
    split, _ = build_engine(model, "cpu", "auto", quant, tensor_parallel_size=tp, **kw)
    engines = {"TP=1": (single, threads_per_rank(1)), f"TP={tp}": (split, threads_per_rank(tp))}
    out = {}
    try:
        for batch in batches:
            rates = {name: [] for name in engines}
            for name, (engine, threads) in engines.items():  # warm-up: page-ins, thread pools, shm
                torch.set_num_threads(threads)
                decode_rate(engine, batch, 4)
            for _ in range(rounds):
                for name, (engine, threads) in engines.items():
                    torch.set_num_threads(threads)
                    # a pause first: the other engine's idle threads (OpenMP's, a worker rank's 50 ms of
                    # polling, shm_channel.py) go to sleep instead of taking a core from this run
                    time.sleep(0.2)
                    rates[name].append(decode_rate(engine, batch, new_tokens))
            rates["ratio"] = [n / one for n, one in zip(rates[f"TP={tp}"], rates["TP=1"])]
            out[batch] = rates
    finally:
        split.tensor_parallel.close()
    return out


def parts(text: str) -> list[str]:
    """An argparse type: --parts, each of them a part there is."""
    names = text.split(",")
    if not names or any(n not in ("allreduce", "decode") for n in names):
        raise argparse.ArgumentTypeError(f"the parts are allreduce and decode, got {text!r}")
    return names


def cases(text: str) -> list[tuple[str, int]]:
    """An argparse type: --cases "model:N,..." -> [(model, N)], N at least 2."""
    found = []
    for case in text.split(","):
        model, _, tp = case.rpartition(":")
        if not model or not tp.isdigit() or int(tp) < 2:
            raise argparse.ArgumentTypeError(f"each case is model:N with N at least 2 (tiny-llama3:2), got {case!r}")
        found.append((model, int(tp)))
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=parts, default="allreduce,decode", help="allreduce, decode or both")
    ap.add_argument("--calls", type=positive_int, default=500)
    ap.add_argument("--new-tokens", type=positive_int, default=32)
    ap.add_argument("--batches", default="1,16", help="batch sizes, comma-separated")
    ap.add_argument("--quant", choices=["int4", "none"], default="int4")
    ap.add_argument("--cases", type=cases, default="tiny-llama3:2,smollm2-135m:3", help="model:TP pairs compared with TP=1")
    ap.add_argument("--rounds", type=positive_int, default=7, help="alternating TP=1 / TP=N runs per batch size")
    ap.add_argument("--out", type=Path, default=OUT, help="where the JSON and .png go (default: %(default)s)")
    args = ap.parse_args()
    batches = int_list(args.batches)  # a usage error before any part runs
    from quant import QuantSpec

    quant = QuantSpec(4, 32) if args.quant == "int4" else None
    result = {"machine": f"{len(os.sched_getaffinity(0))} cores, torch {torch.__version__}"}
    if "allreduce" in args.parts:
        result["allreduce_us"] = allreduce_part(args.calls)
        for k, v in result["allreduce_us"].items():
            print(f"all-reduce {k}: {v:.0f} us per call (2 ranks)")
    if "decode" in args.parts:
        result["decode_tok_s"], result["quant"] = {}, args.quant  # the weights of this part (the other has none)
        for model, tp in args.cases:
            # each case in a fresh process: one process group per process, threads set at start
            import subprocess

            code = (
                f"import json; import tp_bench; "  # run in this folder: `python -c` imports from the cwd
                f"from quant import QuantSpec; print(json.dumps(tp_bench.decode_part({model!r}, {int(tp)}, {batches}, "
                f"{args.new_tokens}, {'QuantSpec(4, 32)' if quant else 'None'}, {args.rounds})))"
            )
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent)
            if r.returncode:
                print(r.stderr, file=sys.stderr)
                return 1
            per_batch = json.loads(r.stdout.strip().splitlines()[-1])
            result["decode_tok_s"][f"{model} TP={tp}"] = per_batch
            for b, rates in per_batch.items():
                line = ", ".join(f"{name} {statistics.median(v):.1f} tok/s [{min(v):.1f}-{max(v):.1f}]"
                                 for name, v in rates.items() if name != "ratio")
                ratio = rates["ratio"]
                print(f"{model} batch {b}: {line}; TP={tp} / TP=1 {statistics.median(ratio):.2f}x "
                      f"[{min(ratio):.2f}-{max(ratio):.2f}] over {len(ratio)} rounds")
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_suffix(".json")
    kept = json.loads(path.read_text()) if path.is_file() else {}
    result = kept | result  # a run of one part keeps the other part's figures
    path.write_text(json.dumps(result, indent=2) + "\n")
    if "decode_tok_s" in result:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{case}, batch {b}" for case, per_batch in result["decode_tok_s"].items() for b in per_batch]
        ratios = [per_batch[b]["ratio"] for per_batch in result["decode_tok_s"].values() for b in per_batch]
        ax.boxplot(ratios, orientation="horizontal", tick_labels=labels)
        ax.axvline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("decode tok/s, TP=N / TP=1 (one point per round)")
        ax.set_title(f"TP=N against TP=1 on {result['machine']} ({result['quant']})")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=100)
    print(f"-> {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    run_main(main)
