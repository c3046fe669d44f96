"""Tensor parallelism end to end, with real processes (gloo on CPU): greedy tokens at TP=2 (the
tiny model) and TP=3 (SmolLM2) equal TP=1's in float32 through generate.py, the engine with 16
requests at once (speculation on) and the server; refusals; a killed worker; SIGTERM; a port in
use; and no process left behind."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from common.models import resolve_model
from common.tokenizer import Tokenizer
from common.tools.warm_python import run_python, start_python

REACHES = ["generate.py", "cli.py", "server.py", "parallel.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]
PROMPTS = ["The sky is", "Once upon a time, there was"]


def group_of(pid: int) -> list[int]:
    """The live processes of process group `pid` (a started script leads its own group)."""
    out = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def tp1_texts(model: str, prompts: list[str], n: int, quant=None) -> list[str]:
    """Chapter 07's path (TP=1) in this process: generate.py's greedy loop, decoded."""
    from generate import generate_all
    from model import load_model
    from ops import resolve

    d = resolve_model(model)
    tok = Tokenizer(d)
    m = load_model(d, "cpu", torch.float32, quant, ops=resolve("auto", torch.device("cpu"), None))
    outs = generate_all(m, [tok.encode(p) for p in prompts], n)
    return [tok.decode(o, skip_special_tokens=True) for o in outs]


def generate_py(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env or {}))
    return run_python(["generate.py", "--device", "cpu", "--dtype", "float32", *flags], cwd=CHAPTER, env=env, timeout=300)


# float32 through shared memory (the default on one host), int4 through gloo.
@pytest.mark.parametrize("quant, allreduce", [([], "shm"), (["--quant", "int4"], "gloo")], ids=["float32", "int4"])
def test_generate_tp2_equals_tp1_on_the_tiny_model(quant, allreduce):
    from quant import QuantSpec

    flags = [a for p in PROMPTS for a in ("--prompt", p)]
    r = generate_py(
        "--model", "tiny-llama3", *flags, "--max-new-tokens", "8", "--tensor-parallel-size", "2", *quant,
        env={"TP_TRANSPORT": allreduce},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "tensor parallel: 2 ranks (gloo" in r.stderr and "TP=2" in r.stderr
    assert ("in shared memory" in r.stderr) == (allreduce == "shm")
    want = tp1_texts("tiny-llama3", PROMPTS, 8, QuantSpec(4, 32) if quant else None)
    assert r.stdout.splitlines() == [line for text in want for line in text.split("\n")]


def test_generate_tp3_equals_tp1_on_smollm2():
    r = generate_py("--model", "smollm2-135m", "--prompt", PROMPTS[0], "--max-new-tokens", "4", "--tensor-parallel-size", "3")
    assert r.returncode == 0, r.stderr
    assert "tensor parallel: 3 ranks" in r.stderr
    assert r.stdout.rstrip("\n") == tp1_texts("smollm2-135m", PROMPTS[:1], 4)[0]


def test_generate_tp3_from_the_gguf_equals_tp1():
    """A pre-quantized model at N > 1: SmolLM2's Q4_1 GGUF (its codes copied once to int4 G=32),
    each rank keeping its slices of the stored codes, says what TP=1 says on the same codes."""
    from common.prepare_models import find_gguf
    from loading import resolve

    gguf = find_gguf()
    r = generate_py("--model", str(gguf), "--prompt", PROMPTS[0], "--max-new-tokens", "6", "--tensor-parallel-size", "3")
    assert r.returncode == 0, r.stderr
    assert "tensor parallel: 3 ranks" in r.stderr
    assert r.stdout.rstrip("\n") == tp1_texts(str(resolve(str(gguf))), PROMPTS[:1], 6)[0]
    # --quant on it is refused as at size 1 (it was let through when it named the GGUF's own format)
    r = generate_py("--model", str(gguf), "--quant", "int4", "--prompt", "hi", "--tensor-parallel-size", "3")
    assert r.returncode == 2 and "--quant applies to a plain checkpoint; a GGUF file runs as its own Q4_1 codes" in r.stderr


def test_cli_chat_at_tp2_says_what_tp1_says():
    """Two turns and a /reset through the chat CLI: the history and the single sequence's pool
    work the same when every layer is split across two processes."""
    chat = "Hello there\nAnd again?\n/reset\nHi\n/quit\n"
    flags = ["--model", "tiny-llama3", "--temperature", "0", "--max-new-tokens", "6", "--dtype", "float32"]
    runs = [
        run_python(["cli.py", *flags, *tp], input=chat, cwd=CHAPTER, timeout=300)
        for tp in ([], ["--tensor-parallel-size", "2"])
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert "tensor parallel: 2 ranks" in runs[1].stderr
    # the status line's weights and pool are rank 0's, and say so
    assert "MB on rank 0)" in runs[1].stderr and "GiB on each rank;" in runs[1].stderr, runs[1].stderr
    assert "on rank 0" not in runs[0].stderr and "on each rank" not in runs[0].stderr
    assert runs[0].stdout.count("model> ") == 3
    assert runs[1].stdout == runs[0].stdout


def torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`torchrun ARGS` (torch.distributed.run) in this chapter's folder; its stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args], cwd=CHAPTER, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_torchrun_starts_the_ranks_and_generate_says_what_tp1_says():
    flags = [a for p in PROMPTS for a in ("--prompt", p)]
    r = torchrun(
        "--standalone", "--nproc-per-node", "2", "generate.py", "--model", "tiny-llama3", *flags,
        "--max-new-tokens", "8", "--device", "cpu", "--dtype", "float32",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "tensor parallel: 2 ranks" in r.stderr and "TP=2" in r.stderr
    want = tp1_texts("tiny-llama3", PROMPTS, 8)
    assert r.stdout.splitlines() == [line for text in want for line in text.split("\n")]


def test_torchrun_help_ends():
    # rank 0 prints the help and exits 0; the others waited for it to join, forever (argparse takes
    # --hel for --help as well)
    r = torchrun("--standalone", "--nproc-per-node", "2", "cli.py", "--hel", timeout=120)
    assert r.returncode == 0 and "--tensor-parallel-size" in r.stdout, r.stderr[-3000:]


def test_torchrun_with_master_port_0_is_refused_instead_of_hanging():
    r = torchrun("--nproc-per-node", "2", "--master-port", "0", "generate.py", "--model", "tiny-llama3", "--prompt", "hi", timeout=120)
    assert r.returncode != 0  # and within the timeout: a rank said why and stopped
    # (torchrun then stops the other rank, which may not have said it yet, and prints its own report
    # of the failed ranks, a traceback of its agent included)
    assert "error: torchrun passed MASTER_PORT=0 (--master-port 0)" in r.stderr, r.stderr[-3000:]


def test_a_size_that_does_not_split_the_heads_is_refused_before_any_rank_starts():
    r = generate_py("--model", "smollm2-135m", "--prompt", "hi", "--tensor-parallel-size", "2")
    assert r.returncode == 2
    assert "9 query heads do not split into 2 equal parts" in r.stderr and "Traceback" not in r.stderr


def test_a_rendezvous_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        env = dict(os.environ, MASTER_PORT=str(s.getsockname()[1]), MASTER_ADDR="127.0.0.1")
        r = run_python(
            ["generate.py", "--model", "tiny-llama3", "--prompt", "hi", "--tensor-parallel-size", "2"],
            cwd=CHAPTER,
            env=env,
            timeout=300,
        )
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{env['MASTER_PORT']}" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "flag, value", [("--tensor-parallel-size", "0"), *[("--tensor-parallel-timeout", v) for v in ("0", "0.001", "-1", "nan", "1e30")]]
)
def test_a_size_or_timeout_that_means_nothing_is_a_usage_error(flag, value):
    # 0 ranks used to mean 1, unseen; a timeout of 0 or NaN reached gloo's rendezvous as a C++ stack,
    # one of 1 ms failed the rendezvous as if its port were in use
    import argparse

    import parallel

    ap = argparse.ArgumentParser()
    parallel.add_arguments(ap)
    with pytest.raises(SystemExit):
        ap.parse_args([flag, value])
    assert ap.parse_args([flag, "2"]) is not None  # the parser itself is fine


def test_a_transport_that_is_none_is_refused(monkeypatch):
    import parallel

    monkeypatch.setenv("TP_TRANSPORT", "shmem")  # read as gloo, unseen
    with pytest.raises(UserError, match="TP_TRANSPORT='shmem': shm \\(the default\\) or gloo"):
        parallel.transport()
    monkeypatch.setenv("TP_TRANSPORT", "gloo")
    assert parallel.transport() == "gloo"


def test_a_timeout_at_size_1_is_refused_where_it_would_change_nothing():
    import argparse

    import parallel

    ap = argparse.ArgumentParser()
    parallel.add_arguments(ap)
    with pytest.raises(UserError, match="--tensor-parallel-timeout goes with --tensor-parallel-size 2 or more"):
        parallel.size_from(ap.parse_args(["--tensor-parallel-timeout", "30"]))
    assert parallel.size_from(ap.parse_args(["--tensor-parallel-timeout", "30", "--tensor-parallel-size", "2"])) == 2
    assert parallel.size_from(ap.parse_args([])) == 1 and ap.parse_args([]).tensor_parallel_timeout is None


def test_a_quant_flag_that_changes_nothing_is_refused_before_the_ranks_start(monkeypatch):
    # at size 1 loading.load refuses them; the ranks' loading took them and changed nothing
    import parallel
    from ops import KernelFlags
    from quant import QuantSpec

    monkeypatch.setattr(parallel, "start", lambda *args: pytest.fail("a rank started"))
    with pytest.raises(UserError, match=r"^--matmul reference: for quantized weights .*; tiny-llama3 runs unquantized$"):
        parallel.load("tiny-llama3", "cpu", "float32", None, "reference", world=2)
    with pytest.raises(UserError, match=r"^--matmul fast: on a CPU the kernels"):
        parallel.load("tiny-llama3", "cpu", "auto", QuantSpec(8), "fast", KernelFlags("on"), world=2)
    with pytest.raises(UserError, match=r"^--no-int8-activations: with float32 activations"):
        parallel.load("tiny-llama3", "cpu", "float32", QuantSpec(8), "auto", KernelFlags("auto", False, False), world=2)
    with pytest.raises(UserError, match=r"^--no-int8-activations is for the CPU kernels"):  # as KernelFlags.ops
        parallel.load("tiny-llama3", "cpu", "auto", QuantSpec(8), "auto", KernelFlags("off", False, False), world=2)


def test_an_explicit_kv_budget_counts_once_per_rank_on_one_host():
    # --kv-cache-memory-gb is each rank's pool: 2 ranks of 60 % of the free memory do not fit together
    # (256 sequences of tiny-llama3's 131,072 tokens could use all of it)...
    from memory import GiB, free_memory
    from parallel import build_engine

    free = free_memory(torch.device("cpu"))
    args = ["server.py", "--model", "tiny-llama3", "--device", "cpu", "--tensor-parallel-size", "2", "--max-num-seqs"]
    r = run_python([*args, "256", "--kv-cache-memory-gb", f"{0.6 * free / GiB:.2f}"], cwd=CHAPTER, timeout=300)
    assert r.returncode == 2 and "--kv-cache-memory-gb is each rank's: 2 ranks on this host take" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    # ... but a pool is capped first, as at size 1, at what its sequences could ever use: 4 sequences
    # of 1,024 tokens take a few MB of the 60 % (the budget alone was refused)
    engine, _ = build_engine(
        "tiny-llama3", "cpu", "float32", tensor_parallel_size=2, max_num_seqs=4, max_model_len=1024,
        kv_cache_bytes=int(0.6 * free),
    )
    try:
        assert engine.runner.cache.nbytes < free / 100
    finally:
        engine.tensor_parallel.close()


def test_a_rank_0_error_while_loading_is_its_own_one_line_error_as_at_size_1():
    # --batch-invariant refuses float32 weights on every rank: the user's error, not "a collective failed"
    flags = ["--model", "tiny-llama3", "--prompt", "hi", "--max-new-tokens", "2", "--batch-invariant"]
    alone = generate_py(*flags)
    r = generate_py(*flags, "--tensor-parallel-size", "2")
    assert alone.returncode == r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last == alone.stderr.strip().splitlines()[-1] and last.startswith("error: --batch-invariant"), r.stderr
    assert "Traceback" not in r.stderr
    # said once: not again by rank 1, nor as "a collective failed"
    assert r.stderr.count("--batch-invariant: float32") == 1, r.stderr


def test_a_refusal_names_the_ranks_unless_every_rank_said_the_same():
    from parallel import Refused

    assert str(Refused({0: "bad flag", 1: "bad flag"}, 2)) == "bad flag"
    assert str(Refused({1: "shard 1 is corrupt"}, 2)) == "rank 1: shard 1 is corrupt"
    assert str(Refused({0: "a", 2: "b"}, 3)) == "rank 0: a; rank 2: b"


def test_a_worker_dead_before_the_rendezvous_is_reported_not_waited_for():
    """Rank 0 waits for each spawned worker's sign in the store while it watches the process: one
    that died first (the OOM killer, an import that failed) ends the start with its exit status."""
    import parallel

    class Store:  # no worker ever signs in
        def check(self, keys):
            return False

    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    t0 = time.monotonic()
    with pytest.raises(parallel.RankLost, match=rf"rank 1 \(pid {dead.pid}\) exited with status 3 before it joined"):
        parallel._wait_for_workers(Store(), [dead])
    assert time.monotonic() - t0 < 5


def started_tp2(args: list[str], err: Path, ready: str, **popen) -> tuple[subprocess.Popen, int]:
    """A script at --tensor-parallel-size 2, once `ready` is on its stderr (written to `err`) ->
    (the process, its worker's pid). SIGINT as a terminal gives it: a job started in the
    background (make test's suites) inherits it ignored."""
    with open(err, "w") as e:
        p = subprocess.Popen(
            [sys.executable, *args, "--model", "tiny-llama3", "--device", "cpu", "--tensor-parallel-size", "2"],
            cwd=CHAPTER,
            stderr=e,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            **popen,
        )
    deadline = time.monotonic() + 180
    while ready not in err.read_text():
        assert time.monotonic() < deadline and p.poll() is None, err.read_text()
        time.sleep(0.1)
    workers = [c for c in children_of(p.pid) if b"parallel.py" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return p, workers[0]


def test_a_killed_worker_and_ctrl_c_end_generate_in_one_line_at_once(tmp_path):
    # A lost rank: `error: ...` and exit 1, no traceback. Ctrl-C mid-step: the workers, waiting
    # inside a collective, are stopped at once (10 s later before: close() asked them to stop first).
    for how in ("kill the worker", "ctrl-c"):
        err = tmp_path / f"{how}.err"
        args = ["generate.py", "--prompt", "The sky is", "--max-new-tokens", "100000"]
        p, worker = started_tp2(args, err, "tensor parallel: 2 ranks", stdout=subprocess.DEVNULL)
        try:
            time.sleep(1)  # generating
            os.kill(worker if how == "kill the worker" else p.pid, signal.SIGKILL if how == "kill the worker" else signal.SIGINT)
            t0 = time.monotonic()
            p.wait(timeout=60)
            took = time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
        text = err.read_text()
        assert "Traceback" not in text, text[-3000:]
        if how == "kill the worker":
            assert p.returncode == 1 and f"error: rank 1 (pid {worker}) exited with status -9" in text, text
        else:  # mid-step the group is lost at once (and says so); between steps close() stops the workers
            assert p.returncode == 130, text
        assert took < 5, (how, took)
        assert not group_of(p.pid)


def test_a_rank_lost_while_the_chat_waits_for_a_line_ends_the_chat_at_once(tmp_path):
    err = tmp_path / "err"
    p, worker = started_tp2(["cli.py", "--max-new-tokens", "4"], err, "chat with the model", stdin=subprocess.PIPE)
    try:
        os.kill(worker, signal.SIGKILL)  # no line typed: the chat waits in input()
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1 and f"error: rank 1 (pid {worker}) exited with status -9" in err.read_text()
    assert "Traceback" not in err.read_text()


def test_a_master_port_that_is_no_port_is_a_usage_error():
    for port in ("abc", "99999", "-5"):
        r = generate_py("--model", "tiny-llama3", "--prompt", "hi", "--tensor-parallel-size", "2", env={"MASTER_PORT": port})
        assert r.returncode == 2 and f"error: MASTER_PORT='{port}' is not a port number" in r.stderr, r.stderr


def test_a_master_addr_not_of_this_machine_is_refused_at_once():
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): no machine has it. Unchecked, the store retried for minutes.
    for addr, said in (("192.0.2.1", "is not an address of this machine"), ("nosuchhost.invalid", "no such host")):
        start = time.monotonic()
        r = generate_py("--model", "tiny-llama3", "--prompt", "hi", "--tensor-parallel-size", "2", env={"MASTER_ADDR": addr})
        assert r.returncode == 2 and f"error: MASTER_ADDR='{addr}'" in r.stderr and said in r.stderr, r.stderr[-2000:]
        assert time.monotonic() - start < 20 and "Traceback" not in r.stderr

def test_engine_with_16_requests_and_speculation_equals_tp1():
    from engine import Request
    from parallel import build_engine
    from sampling import SamplingParams

    tok = Tokenizer(resolve_model("tiny-llama3"))
    # Repetitive prompts give prompt lookup drafts to verify; arrivals spread over steps.
    prompts = [tok.encode(f"{i} apples and {i} pears, {i} apples and {i} pears, {i} apples") for i in range(16)]
    kw = dict(num_blocks=128, max_num_seqs=16, speculative="ngram", speculative_max_batch=16)

    def outputs(tp):
        engine, _ = build_engine("tiny-llama3", "cpu", "float32", tensor_parallel_size=tp, **kw)
        try:
            reqs = [Request(p, SamplingParams(temperature=0), max_tokens=10) for p in prompts]
            outs = engine.generate(reqs, arrivals=[i // 4 for i in range(16)])
            return [o[0].token_ids for o in outs], engine.stats()
        finally:
            if tp > 1:
                engine.tensor_parallel.close()

    want, _ = outputs(1)
    got, stats = outputs(2)
    assert got == want
    assert stats["spec_draft_tokens"] > 0  # the verify rows went through the ranks too


def test_server_tp2_answers_like_tp1_and_sigterm_stops_every_rank(tmp_path):
    import httpx

    from live_server import http, serve

    prompts = [tok_ids for tok_ids in (Tokenizer(resolve_model("tiny-llama3")).encode(p) for p in PROMPTS)]
    want = tp1_texts("tiny-llama3", PROMPTS, 6)
    with serve(tmp_path, "tiny-llama3", "--tensor-parallel-size", "2") as (url, proc, log):
        assert len(children_of(proc.pid)) == 1  # one worker
        body = lambda ids: {"model": "tiny-llama3", "prompt": ids, "max_tokens": 6, "temperature": 0}  # noqa: E731
        with httpx.Client(timeout=120) as client:
            got = [client.post(url + "/v1/completions", json=body(ids)).json()["choices"][0]["text"] for ids in prompts]
        assert got == want
        pgid = proc.pid
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert "tensor parallel: 2 ranks" in log.read_text()
    serving = next(line for line in log.read_text().splitlines() if line.startswith("serving"))
    assert "MB on rank 0;" in serving and "GiB on each rank;" in serving, serving
    deadline = time.time() + 10
    while group_of(pgid) and time.time() < deadline:
        time.sleep(0.2)
    assert group_of(pgid) == []


def test_a_killed_worker_makes_the_server_answer_503_and_exit(tmp_path):
    import httpx

    from live_server import http, serve

    with serve(tmp_path, "tiny-llama3", "--tensor-parallel-size", "2", "--timeout-graceful-shutdown", "5") as (
        url,
        proc,
        log,
    ):
        (worker,) = children_of(proc.pid)
        os.kill(worker, signal.SIGKILL)
        statuses = []
        deadline = time.time() + 30
        while proc.poll() is None and time.time() < deadline:
            try:
                r = http.post(url + "/v1/completions", json={"model": "tiny-llama3", "prompt": "hi", "max_tokens": 2}, timeout=10)
                statuses.append(r.status_code)
            except httpx.HTTPError:
                pass  # the listening socket is closed once the shutdown has begun
            time.sleep(0.1)
        assert proc.wait(timeout=30) != 0
        pgid = proc.pid
    text = log.read_text()
    assert f"tensor parallel: rank 1 (pid {worker}) exited with status -9" in text, text
    assert "Traceback" not in text, text  # a lost rank is said in sentences, not a stack
    assert text.rstrip().splitlines()[-1] == f"error: tensor parallel: rank 1 (pid {worker}) exited with status -9; the server stopped"
    assert set(statuses) <= {503}, statuses
    assert group_of(pgid) == []


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5 with WORLD_SIZE=2: a rank is 0 to WORLD_SIZE - 1"),  # waited for ever
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a whole number (torchrun sets it)"),
        ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK and WORLD_SIZE are set but MASTER_ADDR is not: start the ranks with torchrun"),
    ],
    ids=["rank past the size", "rank not a number", "size not a number", "no master address"],
)
def test_torchrun_variables_that_make_no_group_are_clear_errors(env, message):
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = run_python(["generate.py", "--model", "tiny-llama3", "--prompt", "hi"], cwd=CHAPTER, env=base | env, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
