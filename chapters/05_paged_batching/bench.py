"""What continuous batching and the paged KV cache buy: throughput, latency, prefill stalls, prefix
reuse and KV memory, measured through the OpenAI API and engine to engine.

Usage, from this chapter's folder:

    python bench.py                                   # every part: the README's figures
    python bench.py --parts throughput --concurrency 1,4 --max-tokens 16
    python bench.py --quant int4                      # int4 weights, in both servers and the engine
    python bench.py --parts engine --peers llama.cpp  # plus llama.cpp, batched

Parts (--parts, comma-separated; all by default):

  throughput  server.py on a free port, N concurrent streaming chat clients (N = --concurrency), one
              request each from a fixed set of 32 varied questions: greedy, max_tokens, ignore_eos, so
              every request yields exactly max_tokens tokens. Per N: aggregate tok/s (all tokens / wall
              time), TTFT and ITL (gaps between the SSE chunks of one stream) p50/p99, and the peak of
              /health's kv_blocks_used (polled every 50 ms). Chapter 04's server, one request at a time,
              at --ch04-concurrency. Both servers run with no prefix cache (chapter 04 has none, and a
              repeated round would find its prompts cached): part `prefix` measures the cache alone.
  engine      no HTTP: chapter 05's Engine.generate on 16 of the prompts against HF transformers
              `generate` on a static batch of the same prompts (left padded, greedy, min_new_tokens =
              max_new_tokens), and the time of one engine.step() decoding 16 sequences against 1.
              With --peers llama.cpp (llama-cpp-python, optional; peers.py), llama.cpp decoding N = 1
              and 16 of the prompts together (one llama_decode per step, a sequence id per prompt, as
              llama-server -np 16 does) on the Q4_1 GGUF and a BF16 one, each beside our Engine.generate
              on the same prompts with --quant int4 and with bf16 weights: aggregate tok/s.
  chunked     4 streams decoding, then a --long-prompt-tokens prompt arrives: the ITL of the 4 streams
              while it is prefilled, with chunked prefill (the default) and with --no-chunked-prefill.
  prefix      TTFT of a chat request with a --system-prompt-tokens system prompt: the first request
              with that system prompt, the second (a different question: its blocks are cached), and
              the second on a --no-prefix-caching server; /health's hit rate.
  memory      KV memory of a natural chat workload (every prompt answered until EOS or
              --memory-max-tokens, through our engine): paged blocks, chapter 04's growing contiguous
              cache, a reservation of prompt + max_tokens per request, and a static batch padded to
              the longest prompt (HF style); slots, bytes, the share holding real tokens, and how
              many such requests fit in 1 GiB.

Rounds are interleaved (every N, both servers, both modes, then again) --repeats times and the
median is reported, because a shared machine drifts. Timing is at the client: time.perf_counter()
when a request is sent and when each SSE chunk carrying tokens arrives. Results: JSON at --out
(default bench/results/ch05_bench.json) and a PNG beside it; a table on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from common.cli import run_main
from common.errors import UserError
from common.models import resolve_model
from common.tokenizer import Tokenizer
from common.tools.bench import (
    LONG_TEXT,
    PROMPTS,
    RESULTS_DIR,
    command_line,
    fmt,
    int_list,
    isa_line,
    machine,
    median,
    pct,
)
from common.tools.chapters import chapter_dir, chapter_exists
from common.tools.serving import (
    chat_body,
    combine_rounds,
    concurrent_round,
    new_client,
    servers,
    stream,
    throughput_rounds,
)

HERE = Path(__file__).resolve().parent
CH = f"ch{HERE.name[:2]}"  # this chapter's label, from its folder's name: ch05
PARTS = ("throughput", "engine", "chunked", "prefix", "memory")
BLOCK_SIZE = 16  # server.py's default --block-size: the servers here run with it
GiB = 2**30


# --- servers -----------------------------------------------------------------------------------


def start_servers(args, specs: dict[str, tuple[Path, list[str]]], record: dict):
    """common.tools.serving.servers on `specs` ({label: (a chapter's folder, extra flags)}): each
    server with the bench's model, device, dtype and weights, and this chapter's (folder HERE) with
    its scheduler's settings too (chapter 04's has none)."""
    base = ["--model", args.model, "--device", args.device, "--dtype", args.dtype]
    base += ["--quant", args.quant] if args.quant else []

    def ours(flags: list[str]) -> list[str]:
        own = ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb), "--max-num-seqs", str(args.max_num_seqs)]
        if "--no-chunked-prefill" in flags:  # its step holds a whole prompt: the server refuses a smaller budget
            return own
        return own + ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]

    argv = {}
    for label, (folder, flags) in specs.items():
        argv[label] = (folder, base + (ours(flags) if folder == HERE else []) + flags)
    return servers(argv, record, threads=args.threads, timeout=args.server_timeout)


# --- part 1: throughput against concurrency ------------------------------------------------------


def part_throughput(args, record: dict, with_ch04: bool = True) -> dict:
    ch04 = with_ch04 and bool(args.ch04_concurrency)
    if ch04 and not chapter_exists(4):
        print("[throughput] chapter 04 is not beside this chapter: its server is skipped", file=sys.stderr)
        ch04 = False
    specs = {CH: (HERE, ["--no-prefix-caching"])} | ({"ch04": (chapter_dir(4), [])} if ch04 else {})
    plan = [(CH, n) for n in args.concurrency] + [("ch04", n) for n in args.ch04_concurrency if ch04]
    with start_servers(args, specs, record.setdefault("servers", {}).setdefault("throughput", {})) as urls:
        runs = throughput_rounds(urls, plan, args.repeats, args.max_tokens, args.health_interval)
    result = {
        CH: [combine_rounds(runs[(CH, n)]) for n in args.concurrency],
        "ch04": [combine_rounds(runs[("ch04", n)]) for n in args.ch04_concurrency] if ch04 else [],
    }
    common = sorted({r["concurrency"] for r in result[CH]} & {r["concurrency"] for r in result["ch04"]})
    if common:
        n = 16 if 16 in common else common[-1]
        a = next(r for r in result[CH] if r["concurrency"] == n)["tok_s"]
        b = next(r for r in result["ch04"] if r["concurrency"] == n)["tok_s"]
        result[f"ratio_{CH}_ch04"] = {"concurrency": n, "ratio": a / b}
    return result


# --- part 2: engine to engine ----------------------------------------------------------------------


def build_our_engine(args):
    from engine import build_engine
    from loading import quant_spec

    spec = quant_spec(SimpleNamespace(quant=args.quant, group_size=32, symmetric=False, lm_head="int8"))
    engine, _ = build_engine(
        args.model,
        args.device,
        args.dtype,
        spec,
        "auto",
        kv_cache_bytes=int(args.kv_cache_memory_gb * GiB),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=False,
    )
    return engine


def engine_generate(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from engine import Request
    from sampling import SamplingParams

    reqs = [Request(p, params=SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    dt = time.perf_counter() - t0
    return dt, sum(len(o[0].token_ids) for o in outs)


def decode_step_ms(engine, prompts: list[list[int]], steps: int) -> dict:
    """The time of one engine.step() while every one of len(prompts) sequences decodes (median of `steps`)."""
    from engine import Request
    from sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    rids = [engine.add(Request(p, params=greedy, max_tokens=steps + 256, ignore_eos=True)) for p in prompts]
    try:
        sched = engine.scheduler
        for _ in range(10_000):  # prefill every prompt, until each has sampled a token
            if not sched.waiting and len(sched.running) == len(prompts) and all(s.output for s in sched.running):
                break
            engine.step()
        times, shapes = [], set()
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            shapes.add((len(engine.last_plan.work), max(n for _, n in engine.last_plan.work)))
    finally:
        for rid in rids:
            engine.abort(rid)
    if shapes != {(len(prompts), 1)}:
        raise RuntimeError(f"decode steps of {len(prompts)} sequences ran (sequences, tokens) {shapes}")
    return {"sequences": len(prompts), "step_ms": median(times) * 1e3, "steps": steps}


def hf_static_batch(model, prompts: list[list[int]], max_tokens: int, pad_id: int, device) -> tuple[float, int]:
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad_id,
        )
    dt = time.perf_counter() - t0
    return dt, (out.shape[1] - longest) * len(prompts)


def load_hf(args, engine):
    """HF transformers on the same checkpoint, in the activation dtype the engine runs (unquantized:
    transformers has no CPU kernels for our int formats); None (with the reason on stderr) if it cannot."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(
            str(resolve_model(args.model)), dtype=engine.model.dtype, attn_implementation="sdpa"
        )
        return model.to(engine.model.device).eval()
    except Exception as e:  # a .gguf or quantized directory, or transformers missing
        print(f"[engine] HF transformers skipped: {type(e).__name__}: {e}", file=sys.stderr)
        return None


# llama.cpp's weights -> ours beside them: the Q4_1 GGUF (our smollm2-135m was dequantized from it)
# against our int4 (--quant int4), the BF16 GGUF written from it against our unquantized bfloat16.
PEER_FORMATS = {"Q4_1": "int4", "BF16": None}


def open_peers(args, engine, prompts: list[list[int]]) -> dict | None:
    """For --peers llama.cpp: a batched llama.cpp context per GGUF (len(prompts) slots) and our engine
    in the matching format (`engine` itself where it is the one), all warmed up. None, with the
    reason on stderr, when llama.cpp cannot run here or not on this model."""
    if not args.peers:
        return None
    from peers import BatchedLlamaCpp, gguf_path, llama_cpp_available

    reason = llama_cpp_available()
    if reason is None and Path(args.model).name != "smollm2-135m":
        reason = f"its GGUFs are smollm2-135m's, not {args.model}'s"
    if reason is None and args.device != "cpu":
        reason = "it runs on the CPU here (--device cpu)"
    if reason:
        print(f"[engine] llama.cpp skipped: {reason}", file=sys.stderr, flush=True)
        return None
    ours, llama = {}, {}
    for gguf, quant in PEER_FORMATS.items():
        if quant == args.quant and args.dtype == "bfloat16":
            ours[gguf] = engine
        else:
            print(
                f"[engine] building {CH} with {quant or 'bf16'} weights (beside llama.cpp {gguf})",
                file=sys.stderr,
                flush=True,
            )
            ours[gguf] = build_our_engine(SimpleNamespace(**{**vars(args), "quant": quant, "dtype": "bfloat16"}))
            engine_generate(ours[gguf], prompts[:2], 2)  # warm-up
        llama[gguf] = BatchedLlamaCpp(
            gguf_path(gguf),
            slots=len(prompts),
            ctx_per_seq=max(map(len, prompts)) + args.max_tokens,
            max_batch_tokens=sum(map(len, prompts)),
            threads=args.threads,
        )
        llama[gguf].generate(prompts, 2)  # warm-up: pages the weights in, starts the threads
    return {"ours": ours, "llama": llama, "sizes": sorted({1, len(prompts)}), "runs": {}}


def peer_round(args, state: dict, prompts: list[list[int]]) -> None:
    """One round: per format and N, our Engine.generate then llama.cpp on prompts[:N]."""
    runs = state["runs"]
    for gguf, quant in PEER_FORMATS.items():
        for n in state["sizes"]:
            dt, tokens = engine_generate(state["ours"][gguf], prompts[:n], args.max_tokens)
            runs.setdefault((f"{CH} {quant or 'bf16'}", n), []).append({"tok_s": tokens / dt, "tokens": tokens})
            r = state["llama"][gguf].generate(prompts[:n], args.max_tokens)
            runs.setdefault((f"llama.cpp {gguf}", n), []).append(r)
            print(
                f"[engine] N={n:<3} {CH} {quant or 'bf16':<4} {tokens / dt:7.1f} tok/s  llama.cpp {gguf:<4} "
                f"{r['tok_s']:7.1f} tok/s (decode {fmt(r['decode_tok_s'])})",
                file=sys.stderr,
                flush=True,
            )


def close_peers(args, state: dict, prompts: list[list[int]], check_tokens: int = 8) -> dict:
    """Medians of the rounds; a check that llama.cpp's batched greedy tokens are its batch-1 ones (each
    prompt alone in the same context, untimed, first `check_tokens`); the contexts freed."""
    series = {}
    for (label, n), runs in state["runs"].items():
        point = {
            "n": n,
            "tok_s": median([r["tok_s"] for r in runs]),
            "tok_s_runs": [r["tok_s"] for r in runs],
            "tokens": runs[0].get("new_tokens", runs[0].get("tokens")),
        }
        if label.startswith("llama.cpp"):
            point |= {
                "decode_tok_s": median([r["decode_tok_s"] for r in runs]),
                "decode_tok_s_runs": [r["decode_tok_s"] for r in runs],
                "prefill_ms": median([r["prefill_ms"] for r in runs]),
            }
        series.setdefault(label, []).append(point)
    agreement, info = {}, {}
    n_big = state["sizes"][-1]
    k = min(check_tokens, args.max_tokens)
    try:
        for gguf, peer in state["llama"].items():
            info[gguf] = peer.info()
            batched = state["runs"][(f"llama.cpp {gguf}", n_big)][-1]["ids"]
            alone = [peer.generate([p], k)["ids"][0] for p in prompts[:n_big]]
            agree = [i for i in range(n_big) if batched[i][:k] == alone[i]]
            agreement[gguf] = {
                "prompts": n_big,
                "check_tokens": k,
                "agree": len(agree),
                "differ": [i for i in range(n_big) if i not in agree],
            }
    finally:
        for peer in state["llama"].values():
            peer.close()
    return {
        "sizes": state["sizes"],
        "formats": {gguf: quant or "bf16" for gguf, quant in PEER_FORMATS.items()},
        "llama_cpp": info,
        "series": series,
        "batch1_agreement": agreement,
    }


def part_engine(args) -> dict:
    engine = build_our_engine(args)
    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in PROMPTS[: args.engine_prompts]]
    hf = load_hf(args, engine)
    gen = engine.generation_config
    pad = gen.get("pad_token_id")
    eos = gen.get("eos_token_id", sorted(engine.eos_ids)[0])
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)
    # warm-up: kernel selection, allocator, lazy initialisation on both sides
    engine_generate(engine, prompts[:2], 2)
    if hf is not None:
        hf_static_batch(hf, prompts[:2], 2, pad, engine.model.device)
    peer_state = open_peers(args, engine, prompts)
    ours, theirs, steps = [], [], {1: [], len(prompts): []}
    for r in range(args.repeats):
        ours.append(engine_generate(engine, prompts, args.max_tokens))
        if hf is not None:
            theirs.append(hf_static_batch(hf, prompts, args.max_tokens, pad, engine.model.device))
        for n in steps:
            steps[n].append(decode_step_ms(engine, prompts[:n], args.decode_steps)["step_ms"])
        print(
            f"[engine] round {r + 1}/{args.repeats} {CH} {ours[-1][1] / ours[-1][0]:7.1f} tok/s"
            + (f"  HF static batch {theirs[-1][1] / theirs[-1][0]:7.1f} tok/s" if theirs else "")
            + "  decode step "
            + ", ".join(f"{n} seqs {v[-1]:.1f} ms" for n, v in steps.items()),
            file=sys.stderr,
            flush=True,
        )
        if peer_state:
            peer_round(args, peer_state, prompts)
    n_big = len(prompts)
    dtype = str(engine.model.dtype).removeprefix("torch.")
    result = {
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "prompt_tokens": [len(p) for p in prompts],
        f"{CH}_tokens": ours[0][1],
        f"{CH}_tok_s": median([t / s for s, t in ours]),
        f"{CH}_tok_s_runs": [t / s for s, t in ours],
        "hf": f"transformers generate, static batch, left padding, sdpa, {dtype}"
        + (" (unquantized)" if args.quant else "")
        if hf is not None
        else None,
        "hf_tokens": theirs[0][1] if theirs else None,
        "hf_tok_s": median([t / s for s, t in theirs]) if theirs else None,
        "hf_tok_s_runs": [t / s for s, t in theirs],
        "decode_step_ms": {str(n): median(v) for n, v in steps.items()},
        "decode_step_ms_runs": {str(n): v for n, v in steps.items()},
        "decode_steps_timed": args.decode_steps,
    }
    result[f"ratio_{CH}_hf"] = result[f"{CH}_tok_s"] / result["hf_tok_s"] if result["hf_tok_s"] else None
    result["step_ratio"] = result["decode_step_ms"][str(n_big)] / result["decode_step_ms"]["1"]
    if peer_state:
        result["peers"] = close_peers(args, peer_state, prompts)
    del engine, hf, peer_state
    return result


# --- part 3: chunked prefill --------------------------------------------------------------------


def long_prompt_ids(tokenizer: Tokenizer, n: int, tag: str) -> list[int]:
    """Exactly n tokens of text that starts with `tag` (a different tag: nothing in common to cache)."""
    ids = tokenizer.encode(f"{tag}. ")
    body = tokenizer.encode(LONG_TEXT, add_special_tokens=False)
    while len(ids) < n:
        ids += body
    return ids[:n]


def text_of_tokens(tokenizer: Tokenizer, n: int, tag: str) -> str:
    body = tokenizer.encode(LONG_TEXT, add_special_tokens=False)
    while len(body) < n:
        body += body
    return f"{tag}. " + tokenizer.decode(body[:n])


async def chunked_round(url: str, long_ids: list[int], args) -> dict:
    """4 streams decode; once each has `--warm-tokens` chunks, the long prompt is sent (max_tokens 1).
    -> the streams' gaps that overlap its prefill, and before it."""
    n_streams = 4
    async with new_client(n_streams + 1) as client:
        stop = asyncio.Event()
        counts = [[0] for _ in range(n_streams)]
        tasks = [
            asyncio.create_task(
                stream(client, url, "/v1/chat/completions", chat_body(PROMPTS[i], args.stream_tokens), counts[i], stop)
            )
            for i in range(n_streams)
        ]

        async def until(condition, what: str, timeout: float = 300.0):
            deadline = time.perf_counter() + timeout
            while not condition():
                for t in tasks:
                    if t.done():
                        t.result()  # raises what the stream raised
                        raise RuntimeError(f"a stream ended while waiting for {what}: raise --stream-tokens")
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"timed out waiting for {what}")
                await asyncio.sleep(0.002)

        try:
            await until(lambda: min(c[0] for c in counts) >= args.warm_tokens, "the streams to start")
            body = {
                "prompt": long_ids,
                "max_tokens": 1,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            long = await stream(client, url, "/v1/completions", body)
            after = [c[0] for c in counts]
            await until(lambda: all(c[0] >= a + 3 for c, a in zip(counts, after)), "the streams after the prefill")
        finally:
            stop.set()
            streams = await asyncio.gather(*tasks, return_exceptions=True)
    for s in streams:
        if isinstance(s, BaseException):
            raise s
    t_send, t_first = long["t_send"], long["times"][0]
    during, before = [], []
    for s in streams:
        for a, b in zip(s["times"], s["times"][1:]):
            if b > t_send and a < t_first:
                during.append((b - a) * 1e3)
            elif b <= t_send:
                before.append((b - a) * 1e3)
    return {
        "long_prompt_tokens": long["usage"]["prompt_tokens"] if long["usage"] else len(long_ids),
        "long_ttft_ms": (t_first - t_send) * 1e3,
        "itl_before_ms_p50": pct(before, 50),
        "itl_during_ms_p50": pct(during, 50),
        "itl_during_ms_p99": pct(during, 99),
        "itl_during_ms_max": max(during) if during else float("nan"),
        "gaps_during": len(during),
        "gaps_during_ms": [round(g, 2) for g in during],
    }


def part_chunked(args, tokenizer: Tokenizer, record: dict) -> dict:
    modes = {"chunked": (HERE, []), "unchunked": (HERE, ["--no-chunked-prefill"])}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with start_servers(args, modes, record.setdefault("servers", {}).setdefault("chunked", {})) as urls:

        async def go():
            for url in urls.values():
                await concurrent_round(url, 2, 4, watch=None)
            for r in range(args.repeats):
                for mode, url in urls.items():
                    run = await chunked_round(
                        url, long_prompt_ids(tokenizer, args.long_prompt_tokens, f"Report {r} of {mode}"), args
                    )
                    runs[mode].append(run)
                    print(
                        f"[chunked] round {r + 1}/{args.repeats} {mode:<9} long TTFT {run['long_ttft_ms']:7.0f} ms  "
                        f"stream ITL before {run['itl_before_ms_p50']:6.1f} ms, during p50 "
                        f"{run['itl_during_ms_p50']:6.1f} max {run['itl_during_ms_max']:7.1f} ms",
                        file=sys.stderr,
                        flush=True,
                    )

        asyncio.run(go())
    result = {
        "streams": 4,
        "long_prompt_tokens": args.long_prompt_tokens,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    for mode, rs in runs.items():
        result[mode] = {
            k: median([r[k] for r in rs])
            for k in (
                "long_ttft_ms",
                "itl_before_ms_p50",
                "itl_during_ms_p50",
                "itl_during_ms_p99",
                "itl_during_ms_max",
                "gaps_during",
            )
        }
        result[mode]["runs"] = rs
    return result


# --- part 4: prefix caching ---------------------------------------------------------------------


def part_prefix(args, tokenizer: Tokenizer, record: dict) -> dict:
    modes = {"cached": (HERE, []), "uncached": (HERE, ["--no-prefix-caching"])}
    ttft: dict[str, list[float]] = {
        "cached_first": [],
        "cached_second": [],
        "uncached_first": [],
        "uncached_second": [],
    }
    prompt_tokens = []
    health = {}
    with start_servers(args, modes, record.setdefault("servers", {}).setdefault("prefix", {})) as urls:

        async def go():
            async with new_client(2) as client:
                for url in urls.values():  # warm-up, with a prompt unlike the system prompts below
                    await stream(client, url, "/v1/chat/completions", chat_body("Hello!", 2))
                for r in range(args.repeats):
                    system = text_of_tokens(tokenizer, args.system_prompt_tokens, f"Session {r}")
                    q1, q2 = PROMPTS[(2 * r) % len(PROMPTS)], PROMPTS[(2 * r + 1) % len(PROMPTS)]
                    for mode, url in urls.items():
                        for which, q in (("first", q1), ("second", q2)):
                            s = await stream(client, url, "/v1/chat/completions", chat_body(q, 1, system))
                            ttft[f"{mode}_{which}"].append((s["times"][0] - s["t_send"]) * 1e3)
                            if s["usage"]:
                                prompt_tokens.append(s["usage"]["prompt_tokens"])
                    print(
                        f"[prefix] round {r + 1}/{args.repeats} TTFT first {ttft['cached_first'][-1]:6.0f} ms, "
                        f"second (cached) {ttft['cached_second'][-1]:6.0f} ms, second with --no-prefix-caching "
                        f"{ttft['uncached_second'][-1]:6.0f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
                for mode, url in urls.items():
                    health[mode] = (await client.get(url + "/health")).json()

        asyncio.run(go())
    result = {"system_prompt_tokens": args.system_prompt_tokens, "prompt_tokens": prompt_tokens}
    for key, values in ttft.items():
        result[f"ttft_ms_{key}"] = median(values)
        result[f"ttft_ms_{key}_runs"] = values
    result["speedup_cached"] = result["ttft_ms_cached_first"] / result["ttft_ms_cached_second"]
    result["hit_rate"] = health["cached"]["prefix_cache_hit_rate"]
    result["hit_rate_uncached_server"] = health["uncached"]["prefix_cache_hit_rate"]
    result["kv_blocks_cached"] = health["cached"]["kv_blocks_cached"]
    return result


# --- part 5: KV memory --------------------------------------------------------------------------


def ch04_capacity(n_prompt: int, n_generated: int, max_tokens: int) -> int:
    """Slots chapter 04's cache held at the end of a request: prompt + 256, doubled while full,
    never past prompt + max_tokens (chapter 04's memory.first_capacity / next_capacity)."""
    total = n_prompt + max_tokens
    capacity = min(n_prompt + 256, total)
    while capacity < n_prompt + n_generated:
        capacity = min(2 * capacity, total)
    return capacity


def part_memory(args) -> dict:
    """KV memory of a natural chat workload: every prompt answered greedily until it ends (EOS)
    or reaches --memory-max-tokens, run through our engine to get the real lengths. Each scheme's
    bytes if all the requests were in memory at once."""
    from engine import Request
    from sampling import SamplingParams

    engine = build_our_engine(args)
    m = args.memory_max_tokens
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in PROMPTS]
    outputs = engine.generate([Request(p, SamplingParams(temperature=0), max_tokens=m) for p in prompts])
    lengths = [(len(p), len(out[0].token_ids)) for p, out in zip(prompts, outputs)]
    per_token = engine.model.config.kv_bytes_per_token(engine.model.dtype.itemsize)
    held = sum(p + g for p, g in lengths)  # tokens whose K/V exist at the end
    slots = {  # slots each scheme holds for the whole workload
        "paged": sum(-(-(p + g) // BLOCK_SIZE) * BLOCK_SIZE for p, g in lengths),
        "ch04_growing": sum(ch04_capacity(p, g, m) for p, g in lengths),
        "reserve_max_tokens": sum(p + m for p, _ in lengths),
        "static_padded": len(lengths) * (max(p for p, _ in lengths) + m),
    }
    schemes = {
        k: {
            "slots": v,
            "bytes": v * per_token,
            "used": held / v,
            "requests_per_gib": GiB / (v * per_token / len(lengths)),
        }
        for k, v in slots.items()
    }
    return {
        "kv_bytes_per_token": per_token,
        "block_size": BLOCK_SIZE,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "max_tokens": m,
        "requests": len(lengths),
        "prompt_tokens": [p for p, _ in lengths],
        "generated_tokens": [g for _, g in lengths],
        "tokens_held": held,
        "schemes": schemes,
    }


# --- output ------------------------------------------------------------------------------------


def print_tables(result: dict) -> None:
    tp = result.get("throughput")
    if tp:
        print(
            f"throughput: chat, max_tokens {result['max_tokens']}, ignore_eos, greedy; median of "
            f"{result['repeats']} rounds"
        )
        print(
            f"{'server':<6} {'N':>3} {'tokens':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
            f"{'ITL p99':>8} {'KV blocks':>9} {'running':>7}"
        )
        for label in (CH, "ch04"):
            for r in tp[label]:
                print(
                    f"{label:<6} {r['concurrency']:>3} {r['tokens']:>6} {fmt(r['tok_s']):>8} "
                    f"{fmt(r['ttft_ms_p50'], '.0f'):>9} {fmt(r['ttft_ms_p99'], '.0f'):>9} "
                    f"{fmt(r['itl_ms_p50']):>8} {fmt(r['itl_ms_p99']):>8} "
                    f"{fmt(r['peak_kv_blocks_used'], 'd'):>9} {fmt(r['peak_running'], 'd'):>7}"
                )
        if f"ratio_{CH}_ch04" in tp:
            q = tp[f"ratio_{CH}_ch04"]
            print(f"{CH} / ch04 aggregate tok/s at N={q['concurrency']}: {q['ratio']:.2f}x")
        print(f"(ms; KV blocks and running: peaks of /health, polled every {result['health_interval_ms']:g} ms)")
    en = result.get("engine")
    if en:
        n = en["prompts"]
        hf = (
            f", HF generate static batch {fmt(en['hf_tok_s'])} tok/s -> {fmt(en[f'ratio_{CH}_hf'], '.2f')}x"
            if en["hf_tok_s"]
            else ", HF transformers skipped"
        )
        print(
            f"\nengine, no HTTP, {n} prompts x {en['max_tokens']} tokens: {CH} Engine.generate "
            f"{fmt(en[f'{CH}_tok_s'])} tok/s{hf}"
        )
        s = en["decode_step_ms"]
        print(
            f"decode step: 1 sequence {fmt(s['1'], '.2f')} ms, {n} sequences {fmt(s[str(n)], '.2f')} ms "
            f"({en['step_ratio']:.2f}x the time for {n}x the tokens)"
        )
        pe = en.get("peers")
        if pe:
            sizes = pe["sizes"]
            version = next(iter(pe["llama_cpp"].values()), {}).get("llama_cpp_version", "?")
            print(
                f"\nengine vs llama.cpp {version}, batched (one llama_decode per step, a sequence id per prompt), "
                f"{en['max_tokens']} tokens per sequence:\naggregate tok/s (prefill + decode), median of "
                f"{result['repeats']}; llama.cpp's decode-only tok/s in brackets"
            )
            print(f"{'':<16}" + "".join(f"{'N=' + str(n):>18}" for n in sizes))
            for fmt_, quant in pe["formats"].items():
                for label in (f"{CH} {quant}", f"llama.cpp {fmt_}"):
                    cells = []
                    for pt in pe["series"].get(label, []):
                        dec = f" ({fmt(pt['decode_tok_s'])})" if "decode_tok_s" in pt else ""
                        cells.append(f"{fmt(pt['tok_s']) + dec:>18}")
                    print(f"{label:<16}" + "".join(cells))
            agree = ", ".join(f"{f} {a['agree']}/{a['prompts']}" for f, a in pe["batch1_agreement"].items())
            k = next(iter(pe["batch1_agreement"].values()), {}).get("check_tokens")
            print(f"llama.cpp at N={sizes[-1]}: first {k} greedy tokens = each prompt's alone for {agree} prompts")
            print(isa_line(result["machine"]["isa"]))
    ch = result.get("chunked")
    if ch:
        print(
            f"\nchunked prefill: {ch['streams']} streams decoding, a {ch['long_prompt_tokens']}-token prompt arrives "
            f"(step budget {ch['max_num_batched_tokens']} tokens)"
        )
        print(f"{'mode':<10} {'long TTFT':>9} {'ITL before':>10} {'during p50':>10} {'p99':>8} {'max':>8}")
        for mode in ("chunked", "unchunked"):
            r = ch[mode]
            print(
                f"{mode:<10} {fmt(r['long_ttft_ms'], '.0f'):>9} {fmt(r['itl_before_ms_p50']):>10} "
                f"{fmt(r['itl_during_ms_p50']):>10} {fmt(r['itl_during_ms_p99']):>8} {fmt(r['itl_during_ms_max']):>8}"
            )
    px = result.get("prefix")
    if px:
        print(f"\nprefix caching: a {px['system_prompt_tokens']}-token system prompt, TTFT (ms, median)")
        print(f"first request (nothing cached)              {fmt(px['ttft_ms_cached_first'], '.0f'):>7}")
        print(
            f"second request, system prompt cached        {fmt(px['ttft_ms_cached_second'], '.0f'):>7}  "
            f"({px['speedup_cached']:.1f}x faster)"
        )
        print(f"second request, --no-prefix-caching server  {fmt(px['ttft_ms_uncached_second'], '.0f'):>7}")
        print(
            f"hit rate (/health): {px['hit_rate']:.2f} (the server with --no-prefix-caching: "
            f"{px['hit_rate_uncached_server']:.2f})"
        )
    mem = result.get("memory")
    if mem:
        gen = mem["generated_tokens"]
        print(
            f"\nKV memory of {mem['requests']} chat replies run to their end (max_tokens {mem['max_tokens']}; replies "
            f"{min(gen)}-{max(gen)} tokens, {sum(gen) / len(gen):.0f} on average), all held at once "
            f"({mem['dtype']}, {mem['kv_bytes_per_token']} bytes/token): {mem['tokens_held']} tokens of K/V exist"
        )
        print(f"{'scheme':<20} {'slots':>7} {'MiB':>8} {'used':>6} {'requests/GiB':>13}")
        for name, x in mem["schemes"].items():
            print(
                f"{name:<20} {x['slots']:>7} {x['bytes'] / 2**20:>8.1f} {x['used']:>6.1%} {x['requests_per_gib']:>13.0f}"
            )


def plot(result: dict, path: Path) -> bool:
    tp, en = result.get("throughput"), result.get("engine")
    if not tp and not en:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax, lat) = plt.subplots(1, 2, figsize=(11, 4.3))
    if tp:
        xs = [r["concurrency"] for r in tp[CH]]
        ax.plot(xs, [r["tok_s"] for r in tp[CH]], "o-", color="tab:blue", label=f"{CH} server (continuous batching)")
        if tp["ch04"]:
            ax.plot(
                [r["concurrency"] for r in tp["ch04"]],
                [r["tok_s"] for r in tp["ch04"]],
                "s",
                color="tab:orange",
                ms=8,
                label="ch04 server (one request at a time)",
            )
        for key, color, name in (("ttft_ms_p50", "tab:red", "TTFT p50"), ("itl_ms_p50", "tab:green", "ITL p50")):
            lat.plot(xs, [r[key] for r in tp[CH]], "o-", color=color, label=f"{CH} {name}")
            if tp["ch04"]:
                lat.plot(
                    [r["concurrency"] for r in tp["ch04"]],
                    [r[key] for r in tp["ch04"]],
                    "s",
                    color=color,
                    mfc="none",
                    ms=8,
                    label=f"ch04 {name}",
                )
    if en:
        ax.plot(
            en["prompts"],
            en[f"{CH}_tok_s"],
            "D",
            color="tab:blue",
            mfc="none",
            ms=8,
            label=f"{CH} Engine.generate, {en['prompts']} prompts (no HTTP)",
        )
        if en["hf_tok_s"]:
            ax.plot(
                en["prompts"],
                en["hf_tok_s"],
                "^",
                color="tab:purple",
                ms=9,
                label=f"HF generate, static batch of {en['prompts']}",
            )
        styles = {
            f"{CH} int4": ("v", ":", "tab:cyan"),
            f"{CH} bf16": ("d", ":", "tab:blue"),
            "llama.cpp Q4_1": ("P", "--", "black"),
            "llama.cpp BF16": ("X", "--", "tab:gray"),
        }
        for label, pts in (en.get("peers") or {}).get("series", {}).items():
            marker, line, color = styles.get(label, ("o", ":", "tab:gray"))
            ax.plot(
                [p["n"] for p in pts],
                [p["tok_s"] for p in pts],
                marker=marker,
                ls=line,
                color=color,
                ms=7,
                label=f"{label}, Engine.generate" if label.startswith(CH) else f"{label}, batched",
            )
    ticks = sorted(
        {r["concurrency"] for label in (CH, "ch04") for r in (tp or {}).get(label, [])}
        | ({en["prompts"]} if en else set())
        | set((en or {}).get("peers", {}).get("sizes", []))
    )
    for a in (ax, lat):
        a.set_xscale("log", base=2)
        a.set_xticks(ticks, [str(t) for t in ticks])
        a.minorticks_off()
        a.set_xlabel("concurrent requests")
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=7)
    ax.set_ylabel("aggregate output tok/s")
    ax.set_title("Throughput against concurrency", fontsize=10)
    lat.set_yscale("log")
    lat.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    lat.set_ylabel("ms")
    lat.set_title("Latency a client sees", fontsize=10)
    quant = f", {result['quant']} weights" if result["quant"] else ""
    fig.suptitle(
        f"{Path(result['model']).name}{quant}, {result['dtype']}, {result['threads']} threads, "
        f"max_tokens {result['max_tokens']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quant", choices=["int4", "int8"], default=None, help="weights quantized on load (default: none)")
    ap.add_argument("--dtype", default="bfloat16", help="activations and KV cache (default: %(default)s)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32", help=f"concurrent clients of the {CH} server")
    ap.add_argument("--ch04-concurrency", default="1,16", help="concurrent clients of the ch04 server ('' for none)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request in parts 1 and 2")
    ap.add_argument(
        "--memory-max-tokens",
        type=int,
        default=512,
        help="part 5: max_tokens of the chat requests whose replies run to their end (default: %(default)s)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, here and in each server")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help=f"the {CH} servers' and engine's KV pool")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument(
        "--peers",
        default="",
        help="llama.cpp: also run llama.cpp, batched, in part engine "
        "(llama-cpp-python, optional; smollm2-135m on the CPU)",
    )
    ap.add_argument(
        "--out",
        default=str(RESULTS_DIR / f"{CH}_bench.json"),
        help=f"the JSON (a .png is written beside it); a directory: {CH}_bench.json in it",
    )
    # sizes, smaller in the tests
    ap.add_argument("--long-prompt-tokens", type=int, default=1500, help=argparse.SUPPRESS)
    ap.add_argument("--system-prompt-tokens", type=int, default=1000, help=argparse.SUPPRESS)
    ap.add_argument("--stream-tokens", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--warm-tokens", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--engine-prompts", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--decode-steps", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--server-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    ap.add_argument("--health-interval", type=float, default=0.05, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.concurrency = int_list(args.concurrency)
    args.ch04_concurrency = int_list(args.ch04_concurrency) if args.ch04_concurrency.strip() else []
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise UserError(f"unknown part(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}")
    for name in (
        "max_tokens",
        "repeats",
        "threads",
        "long_prompt_tokens",
        "system_prompt_tokens",
        "engine_prompts",
        "decode_steps",
        "warm_tokens",
    ):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.peers not in ("", "llama.cpp"):
        raise UserError(f"--peers takes llama.cpp, got {args.peers!r}")
    if not 1 <= args.engine_prompts <= len(PROMPTS):
        raise UserError(f"--engine-prompts must be between 1 and {len(PROMPTS)}")
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / f"{CH}_bench.json"
    # A SIGTERM (a test's timeout, a scheduler) unwinds like an exception, so the servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer(resolve_model(args.model))

    result = {
        "model": args.model,
        "quant": args.quant,
        "dtype": args.dtype,
        "device": args.device,
        "machine": machine(),
        "threads": args.threads,
        "command": command_line(__file__, sys.argv[1:]),
        "parts": parts,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": BLOCK_SIZE,
        "health_interval_ms": args.health_interval * 1e3,
    }
    t_start = time.perf_counter()
    if "throughput" in parts:
        result["throughput"] = part_throughput(args, result)
    if "engine" in parts:
        result["engine"] = part_engine(args)
    if "chunked" in parts:
        result["chunked"] = part_chunked(args, tokenizer, result)
    if "prefix" in parts:
        result["prefix"] = part_prefix(args, tokenizer, result)
    if "memory" in parts:
        result["memory"] = part_memory(args)
    result["seconds"] = round(time.perf_counter() - t_start, 1)

    print_tables(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = out.with_suffix(".png")
    saved = plot(result, png)
    print(f"saved {out}" + (f" and {png.name}" if saved else "") + f" ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    run_main(main)
