"""The benches' shared tools, without a model: common.tools.serving's SSE client on canned streams,
its servers, rounds of concurrent clients and their figures against a stand-in server.py that
streams canned tokens; common.tools.bench's figures, arguments and records."""

from __future__ import annotations

import asyncio
import json
import math
import os
import textwrap

import httpx
import pytest

from common.errors import UserError
from common.tools import bench, serving

# A stand-in for a chapter's server.py: /health with KV figures, and chat completions streamed
# as the chapters' servers stream them (a role chunk, one chunk per token, the usage, [DONE]).
FAKE_SERVER = textwrap.dedent("""
    import argparse, json, os, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--fail", action="store_true")
    args = ap.parse_args()
    if args.fail:
        sys.exit("error: no model here")
    with open(os.path.join(os.path.dirname(__file__), "pid"), "w") as f:
        f.write(str(os.getpid()))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_):
            pass

        def do_GET(self):
            body = json.dumps({"kv_blocks_used": 3, "running": 2, "waiting": 0, "kv_blocks_total": 64}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            n = json.loads(self.rfile.read(int(self.headers["content-length"])))["max_tokens"]
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            chunks = [{"choices": [{"delta": {"role": "assistant"}}]}]
            chunks += [{"choices": [{"delta": {"content": f"t{i}"}, "finish_reason": "length" if i == n - 1 else None}]}
                       for i in range(n)]
            chunks += [{"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}}]
            for c in chunks:
                self.wfile.write(f"data: {json.dumps(c)}\\n\\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\\n\\n")

    print(f"serving a stand-in on port {args.port}", file=sys.stderr, flush=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
""")


@pytest.fixture
def folder(tmp_path):
    """A chapter folder whose server.py is the stand-in."""
    (tmp_path / "server.py").write_text(FAKE_SERVER)
    return tmp_path


def sse(*chunks) -> bytes:
    """A server-sent event stream: each dict (JSON) or str as a data line, bytes as they are."""
    return b"".join(
        c if isinstance(c, bytes) else f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode()
        for c in chunks
    )


def run_stream(content: bytes, status: int = 200, **kwargs) -> dict:
    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=content))
        async with httpx.AsyncClient(transport=transport) as client:
            return await serving.stream(client, "http://test", "/v1/chat/completions", {}, **kwargs)

    return asyncio.run(go())


def test_a_free_port_is_free_and_outside_the_ephemeral_range():
    # Below the range the kernel draws outgoing connections' ports from: in make test a server at
    # TP=2, whose ranks connect before it listens, found its port from bind(0) already taken.
    import socket

    ephemeral = serving.ephemeral_ports()
    ports = {serving.free_port() for _ in range(8)}
    assert len(ports) > 1  # drawn at random: two test processes do not race for one port
    for port in ports:
        assert 1024 <= port < ephemeral.start, (port, ephemeral)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised


def test_no_free_port_is_a_clear_error(monkeypatch):
    import socket

    class Taken(socket.socket):
        def bind(self, address):
            raise OSError(98, "Address already in use")

    monkeypatch.setattr(serving.socket, "socket", Taken)
    with pytest.raises(RuntimeError, match="no free localhost port"):
        serving.free_port()


def test_stream_times_only_the_chunks_that_carry_tokens():
    progress = [0]
    r = run_stream(
        sse(
            {"choices": [{"delta": {"role": "assistant"}}]},  # no text: not a token
            b": a comment, then an event of another kind\n\nevent: ping\n\n",
            {"choices": [{"delta": {"content": "Hel"}}]},
            {"choices": [{"text": "lo"}]},  # the completions endpoint's form
            {"choices": [{"delta": {}, "finish_reason": "stop"}]},  # the finish counts
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
            "[DONE]",
            {"choices": [{"delta": {"content": "after the end"}}]},
        ),
        progress=progress,
    )
    assert len(r["times"]) == 3 and progress == [3] and r["times"] == sorted(r["times"])
    assert r["t_send"] <= r["times"][0]
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 2} and r["finish"] == "stop"


def test_stream_hangs_up_when_told_to_stop():
    async def go():
        stop = asyncio.Event()
        stop.set()
        transport = httpx.MockTransport(
            lambda request: httpx.Response(
                200, content=sse(*({"choices": [{"text": "x"}]} for _ in range(5)), "[DONE]")
            )
        )
        async with httpx.AsyncClient(transport=transport) as client:
            return await serving.stream(client, "http://test", "/v1/completions", {}, stop=stop)

    assert len(asyncio.run(go())["times"]) == 1


def test_stream_raises_on_an_http_error_and_on_an_error_in_the_stream():
    with pytest.raises(RuntimeError, match="HTTP 400: too long"):
        run_stream(b"too long", status=400)
    with pytest.raises(RuntimeError, match="error in the stream: .*out of blocks"):
        run_stream(sse({"choices": [{"text": "a"}]}, {"error": {"message": "out of blocks"}}))


def test_chat_body_is_greedy_streamed_and_ignores_eos():
    body = serving.chat_body("Why?", 8, system="Be brief.")
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    assert body["temperature"] == 0 and body["max_tokens"] == 8 and body["ignore_eos"] and body["stream"]
    assert serving.chat_body("Why?", 8)["messages"] == [{"role": "user", "content": "Why?"}]


def test_servers_start_answer_and_record_then_stop(folder):
    record = {}
    with serving.servers({"fake": (folder, [])}, record, threads=1, timeout=60) as urls:
        assert httpx.get(urls["fake"] + "/health").json()["kv_blocks_total"] == 64
        pid = int((folder / "pid").read_text())
        plan = [("fake", 1), ("fake", 3)]
        runs = serving.throughput_rounds(urls, plan, repeats=2, max_tokens=4, health_interval=0.01)
    with pytest.raises(ProcessLookupError):  # stopped and reaped on the way out
        os.kill(pid, 0)
    assert record["fake"]["banner"].startswith("serving a stand-in on port")
    assert record["fake"]["command"].startswith("python ") and "--port" in record["fake"]["command"]

    assert set(runs) == {("fake", 1), ("fake", 3)} and all(len(r) == 2 for r in runs.values())
    one = runs[("fake", 3)][0]
    assert one["concurrency"] == one["requests"] == 3 and one["tokens"] == 12 and one["chunks"] == 12
    assert one["finish"] == ["length"] and one["prompt_tokens"] == [7, 7, 7]
    assert one["tok_s"] > 0 and one["ttft_ms_p50"] > 0 and one["itl_ms_p50"] >= 0
    assert one["peak_kv_blocks_used"] == 3 and one["peak_running"] == 2 and one["kv_blocks_total"] == 64

    rows = serving.combine_rounds(runs[("fake", 3)])
    assert rows["tok_s"] == bench.median([r["tok_s"] for r in runs[("fake", 3)]])
    assert rows["tok_s_runs"] == [r["tok_s"] for r in runs[("fake", 3)]] and rows["tokens_per_round"] == [12, 12]
    assert rows["peak_kv_blocks_used"] == 3 and rows["finish"] == ["length"]


def test_servers_stop_when_the_body_fails(folder):
    with pytest.raises(ZeroDivisionError):
        with serving.servers({"fake": (folder, [])}, timeout=60):
            pid = int((folder / "pid").read_text())
            1 / 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_server_that_exits_is_reported_with_its_log(folder):
    with pytest.raises(RuntimeError, match=r"(?s)bad server exited with status 1:.*no model here"):
        with serving.servers({"bad": (folder, ["--fail"])}, timeout=60):
            pass


def test_figures_and_arguments():
    assert bench.median([3, None, float("nan"), 1, 2]) == 2 and bench.median([None]) is None
    assert bench.pct([1, 2, 3], 50) == 2 and math.isnan(bench.pct([], 50))
    assert bench.fmt(1.234) == "1.2" and bench.fmt(None) == "-" and bench.fmt(float("nan"), none="?") == "?"
    assert bench.int_list("16, 1,4,1") == [1, 4, 16]
    for bad in ("", "1,x", "0,2"):
        with pytest.raises(UserError):  # a bad flag: `error: ...`, exit status 2
            bench.int_list(bad)


def test_command_line_names_the_script_from_the_repository():
    script = bench.ROOT / "chapters" / "06_cuda_kernel" / "bench.py"
    assert bench.command_line(script, ["--parts", "decode"]) == "python chapters/06_cuda_kernel/bench.py --parts decode"
    outside = "/elsewhere/06_cuda_kernel/bench.py"
    assert bench.command_line(outside, []) == f"python {outside}"


def test_save_json_replaces_the_file_whole_or_not_at_all(tmp_path):
    # chapter 06's kernel part saves after every case and may be stopped mid-write by a timeout:
    # whoever reads the file then must find the last complete record, never a truncated one.
    out = tmp_path / "sub" / "k.json"
    bench.save_json(out, {"complete": False, "cases": [1]})
    assert json.loads(out.read_text()) == {"complete": False, "cases": [1]}

    half_written = {"complete": False, "cases": [1, 2], "late": object()}  # json.dump fails partway
    with pytest.raises(TypeError):
        bench.save_json(out, half_written)
    assert json.loads(out.read_text()) == {"complete": False, "cases": [1]}
    assert [p.name for p in out.parent.iterdir()] == ["k.json"], "a temporary file was left behind"

    bench.save_json(out, {"complete": True})
    assert json.loads(out.read_text()) == {"complete": True}


def test_the_vector_level_each_side_ran_is_read_from_llama_cpp_and_the_library():
    # A ratio against llama.cpp counts where both ran the same level: an AVX2 build of llama.cpp
    # against our kernels capped by ATEN_CPU_CAPABILITY=avx2, a native one against ours uncapped.
    native = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | AVX512_BF16 = 1 | "
    assert bench.isa_from_system_info(native) == "avx512_bf16"
    assert bench.isa_from_system_info(native.replace("AVX512_BF16 = 1", "AVX512_BF16 = 0")) == "avx512"
    assert bench.isa_from_system_info("CPU : AVX = 1 | AVX2 = 1 | AVX512 = 0 | FMA = 1 |") == "avx2"
    assert bench.isa_from_system_info("CPU : SSE3 = 1 | AVX = 0 |") == "scalar"
    report = bench.isa_report()
    assert report["ours"] in bench.ISA_LEVELS  # the library builds on every machine the suite runs on
    if report["llama.cpp"] is None:
        assert "same_level" not in report
    else:
        assert report["same_level"] == (report["ours"] == report["llama.cpp"])
    # What every bench prints beside its ratios against llama.cpp
    same = {"ours": "avx2", "llama.cpp": "avx2", "same_level": True}
    assert bench.isa_line(same) == "vector instructions: ours avx2, llama.cpp avx2"
    assert bench.isa_line(same | {"ours": "avx512_bf16", "same_level": False}).endswith(
        "llama.cpp avx2 (not the same level: the ratios compare builds, not engines)"
    )


def test_an_out_path_no_bench_could_write_is_refused_before_the_measuring(tmp_path):
    # a folder (chapters 07-09's --out names a file) or a place no file can be made (/proc) failed
    # after the whole run, with a traceback
    from pathlib import Path

    from common.tools.bench import check_out

    with pytest.raises(UserError, match="is a folder: give the file's name"):
        check_out(tmp_path)
    with pytest.raises(UserError, match="cannot write there"):
        check_out(Path("/proc/no-bench-here/x.json"))
    check_out(tmp_path / "new" / "x.json")  # a folder that does not exist yet is made, as save_json does
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())
