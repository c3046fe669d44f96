"""What the kernels of kernels/ buy: each one against the PyTorch it replaces, batch-1 decode
against chapter 05 and llama.cpp, and the OpenAI server at 16 streams against chapter 05's.

Usage, from this chapter's folder:

    python bench.py --peers llama.cpp             # every part, on the CPU: the README's figures
    python bench.py --parts kernels,decode --device cuda \
        --out ../../bench/results/ch06_bench_cuda.json   # on a GPU (the CUDA kernels)
    python bench.py --parts decode --quant none   # bf16 weights only

Parts (--parts, comma-separated; all by default):

  kernels     each kernel against the PyTorch it replaces, on --device, in --dtype; microseconds per
              call, the median of many calls after a warm-up (on CUDA, of batches of 10 calls
              between two events):
                paged decode attention (flash-decoding, reading K/V where they lie in the pool)
                  against chapter 05's gather + SDPA (paged_attention.paged_attention on the group
                  batch.build_step makes for decodes), and against F.scaled_dot_product_attention
                  on K/V already gathered (in the dtype chapter 05 hands it: float32 on a CPU);
                  contexts 128..8192 at batch 1 and 16, SmolLM2-135M's heads (9, 3 KV, 64) and on
                  CUDA also Llama-3.2-1B's (32, 8 KV, 64); the kernel's K/V read in GB/s
                add_rms_norm against x += delta then F.rms_norm; rope_cache_ against apply_rope + cache.write
                int4_linear and int8_linear against torch's packed ops (qmatmul.Int4PackedLinear,
                  Int8PackedLinear) and a dense F.linear, on SmolLM2's matrices (qkv, o, gate_up,
                  down; the LM head in int8) at 1, 4 and 16 rows, on CUDA also 32, 128 and 512;
                  weight bytes read in GB/s; on an AVX512-BF16 CPU in bf16, int4 also kept to AVX512
                  (its float tiles, without vdpbf16ps); with bf16 activations, bf16_linear against
                  the same dense F.linear. From gemm_min_rows (16) rows the library's linears are
                  matrix products (csrc/cpu/gemm.cpp, csrc/cuda/gemm.cu): a summary gives their
                  speed against the dense F.linear (on CUDA, cuBLAS on a dense bf16 copy) and GFLOP/s
              --kernel-cases picks some of attention, add_rms_norm, rope, linear (all by default)
  decode      one sequence, greedy, a --prompt-tokens chat prompt then --decode-tokens new tokens
              (ignore_eos), through Engine.stream: decode tok/s (the tokens after the first / their
              time), ms per step (median gap), TTFT. Chapter 06 with the kernels on and off (off is
              chapter 05's PyTorch), chapter 05 itself, with --quant weights and with bf16 weights;
              int4 on a CPU also with --no-int8-activations ("float x"); with --peers llama.cpp, llama.cpp decoding one sequence (peers.py, one slot) on the
              Q4_1 GGUF beside int4 and the BF16 GGUF beside bf16, the same prompt tokens.
  throughput  server.py on a free port, 16 (--concurrency) streaming chat clients at once, one
              request each (greedy, --max-tokens, ignore_eos): aggregate tok/s, TTFT and ITL p50/p99,
              peak KV blocks; chapter 06's server (--kernels on) against chapter 05's, both with
              --quant weights and no prefix cache.

Rounds are interleaved (every engine or server, then again) --repeats times and the median is
reported, because a shared machine drifts. Results: JSON at --out (default
bench/results/ch06_bench.json) and a PNG beside it; tables on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from common.cli import positive_float, positive_int, run_main
from common.errors import UserError
from common.tools.bench import (
    LONG_TEXT,
    RESULTS_DIR,
    check_out,
    command_line,
    fmt,
    int_list,
    isa_line,
    machine,
    median,
    save_json,
    summarize,
)
from common.tools.chapters import chapter_dir, chapter_exists, load_chapter
from common.tools.serving import combine_rounds, servers, throughput_rounds

HERE = Path(__file__).resolve().parent
CH = f"ch{HERE.name[:2]}"  # this chapter's label, from its folder's name: ch06
PARTS = ("kernels", "decode", "throughput")
KERNEL_CASES = ("attention", "add_rms_norm", "rope", "linear")  # part kernels' cases, in the order measured
BLOCK_SIZE = 16  # server.py's default --block-size: the servers and the attention cases use it
GiB = 2**30

# Attention shapes (query heads, KV heads, head_dim) and hidden sizes of the models the kernels serve.
SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-3.2-1B": (32, 8, 64)}
HIDDEN = {"SmolLM2-135M": 576, "Llama-3.2-1B": 2048}
# SmolLM2-135M's matrices, [out, in] (q/k/v and gate/up stacked, as model.py loads them).
LINEAR = "qkv:960x576,o:576x576,gate_up:3072x576,down:576x1536,head:49152x576"

# --- part 1: kernels against PyTorch --------------------------------------------------------------



def budget_seconds(text: str) -> float:
    """--budget-s: a finite number of seconds, 0 included (nan compared false and kept measuring)."""
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, 0 or more, got {text}")
    return value

def time_us(fn, device: torch.device, calls: int, seconds: float) -> float:
    """Microseconds per call of fn(): the median of at least `calls` samples, taken for at least
    `seconds`, after 3 untimed calls. On CUDA a sample is 10 calls between two events, divided:
    launches queue up as they do in a forward pass, and the GPU's time is what is measured."""
    for _ in range(3):
        fn()
    inner = 10 if device.type == "cuda" else 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples, deadline = [], time.perf_counter() + seconds
    while len(samples) < calls or (time.perf_counter() < deadline and len(samples) < 10_000):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / inner)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def measure(impls: dict, timer, nbytes: dict | None = None) -> dict:
    """impls: name -> a callable, or the reason it cannot run here. -> us per call per name (None
    where it cannot run, with the reason under "why"), and GB/s for the names in `nbytes`."""
    us, why = {}, {}
    for name, fn in impls.items():
        try:
            if isinstance(fn, str):
                raise RuntimeError(fn)
            us[name] = timer(fn)
        except (RuntimeError, NotImplementedError) as e:  # a torch op this device or dtype lacks
            us[name], why[name] = None, str(e).strip().splitlines()[0][:200]
    out = {"us": us}
    if nbytes:
        out["bytes"] = nbytes
        out["gb_s"] = {n: b / (us[n] * 1e3) if us.get(n) else None for n, b in nbytes.items()}
    if why:
        out["why"] = why
    return out


def attention_case(ext, dims, batch: int, context: int, device, dtype, timer, partition_size: int) -> dict:
    """One decode query per sequence over `context` keys each, its blocks scattered over the pool."""
    from batch import Work, build_step
    from paged_attention import gather, paged_attention

    nh, nkv, hd = dims
    n_blocks = -(-context // BLOCK_SIZE)
    g = torch.Generator().manual_seed(batch * 100_003 + context)
    k_pool, v_pool = (
        torch.randn(batch * n_blocks, BLOCK_SIZE, nkv, hd, generator=g).to(device, dtype) for _ in range(2)
    )
    tables = torch.randperm(batch * n_blocks, generator=g).view(batch, n_blocks).tolist()  # as after hours of serving
    q = torch.randn(batch, nh, hd, generator=g).to(device, dtype)
    step = build_step([Work([0], context - 1, t) for t in tables], BLOCK_SIZE, device)  # what the engine builds
    group = step.groups[0]
    # The same K/V gathered once, in the dtype chapter 05 hands SDPA (it widens bf16 to float32 on a CPU).
    sdpa_dtype = torch.float32 if device.type == "cpu" else dtype
    keys, values = (gather(p, group.block_tables)[:, :, :context].to(sdpa_dtype).contiguous() for p in (k_pool, v_pool))
    q4 = q[:, :, None].to(sdpa_dtype)
    scale = hd**-0.5
    impls = {
        "kernel": lambda: ext.paged_decode_attention(
            q, k_pool, v_pool, group.block_tables, group.context_lens, scale, partition_size
        ),
        "ch05 gather+SDPA": lambda: paged_attention(q, k_pool, v_pool, step.groups),
        "SDPA gathered": lambda: F.scaled_dot_product_attention(q4, keys, values, enable_gqa=nh != nkv),
    }
    r = measure(impls, timer, {"kernel": 2 * batch * context * nkv * hd * k_pool.element_size()})
    diff = (impls["kernel"]().float() - impls["SDPA gathered"]()[:, :, 0].float()).abs().max().item()
    return {
        "batch": batch,
        "context": context,
        "sdpa_dtype": str(sdpa_dtype).removeprefix("torch."),
        "max_abs_diff": diff,
    } | r


def norm_case(ext, hidden: int, rows: int, device, dtype, timer) -> dict:
    from ops import TorchOps

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(device, dtype)
    delta = (torch.randn(rows, hidden, generator=g) * 1e-2).to(device, dtype)  # both add it to x, in place
    w = (torch.rand(hidden, generator=g) + 0.5).to(device, dtype)
    return {"hidden": hidden, "rows": rows} | measure(
        {
            "kernel": lambda: ext.add_rms_norm(x, delta, w, 1e-5),
            "torch": lambda: TorchOps.add_rms_norm(x, delta, w, 1e-5),
        },
        timer,
    )


def rope_case(ext, dims, rows: int, device, dtype, timer) -> dict:
    """RoPE and the step's K/V into the paged pool: the fused kernel against rope then two indexed copies."""
    from types import SimpleNamespace

    from ops import KernelOps, TorchOps
    from paged_cache import PagedKVCache

    nh, nkv, hd = dims
    qkv = torch.randn(rows, nh + 2 * nkv, hd, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
    shape = SimpleNamespace(num_key_value_heads=nkv, head_dim=hd, num_hidden_layers=1)
    cache = PagedKVCache(shape, -(-2 * rows // 16), 16, device, dtype)
    slots = torch.randperm(cache.num_blocks * 16, device=device)[:rows]  # a step's tokens land anywhere in the pool
    inv_freq = (1.0 / 500_000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)).to(device)
    positions = torch.arange(1000, 1000 + rows, device=device)
    (ck, sk), (ct, st) = KernelOps.angles(inv_freq, positions, dtype), TorchOps.angles(inv_freq, positions, dtype)
    return {"heads": nh + 2 * nkv, "head_dim": hd, "rows": rows} | measure(
        {
            "kernel": lambda: ext.rope_cache_(qkv, ck, sk, cache.k[0], cache.v[0], slots),
            "torch": lambda: TorchOps.rope_cache_(qkv, ct, st, cache, 0, slots),
        },
        timer,
    )


def on_isa(ext, isa: str, op, x):
    """op(x) with the library's CPU path set to `isa` for the call."""
    best = ext.cpu_isa()
    ext.set_cpu_isa(isa)
    try:
        return op(x)
    finally:
        ext.set_cpu_isa(best)


def linear_cases(ext, name: str, n_out: int, n_in: int, rows: list[int], device, dtype, timer) -> list[dict]:
    """x @ W.T for one matrix, quantized as the engine quantizes it (int4 G=32 and int8; the LM head int8
    only), through the kernels, torch's packed ops and a dense matmul. Bytes: the weight tensors each reads."""
    from ops import KernelBf16Linear, KernelInt4Linear, KernelInt8Linear
    from qmatmul import Int4PackedLinear, Int8PackedLinear, fast_path_missing
    from quant import quantize_int4, quantize_int8

    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    w = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(n_out * n_in)) * 0.02
    ops, sizes = {}, {}
    if name != "head":
        w4 = quantize_int4(w, 32)
        ops["int4 kernel"] = k4 = KernelInt4Linear(w4, ext, device)
        sizes["int4 kernel"] = nbytes(k4.packed, k4.scale, k4.min)
        if device.type == "cpu" and dtype == torch.bfloat16 and ext.cpu_isa() == "avx512_bf16":
            # The same kernel kept to AVX512: its float tiles at 2+ rows, against the vdpbf16ps tiles.
            ops["int4 kernel avx512"], sizes["int4 kernel avx512"] = (
                (lambda x: on_isa(ext, "avx512", k4, x)),
                sizes["int4 kernel"],
            )
        why = fast_path_missing(w4, device, dtype)
        ops["int4 torch"] = t4 = why or Int4PackedLinear(w4, device, dtype)
        if not why:
            sizes["int4 torch"] = nbytes(t4.packed, t4.scale_zero)
    w8 = quantize_int8(w)
    ops["int8 kernel"] = k8 = KernelInt8Linear(w8, ext, device)
    sizes["int8 kernel"] = nbytes(k8.q, k8.scale)
    why = fast_path_missing(w8, device, dtype)
    ops["int8 torch"] = t8 = why or Int8PackedLinear(w8.to(device), dtype)
    if not why:
        sizes["int8 torch"] = nbytes(t8.q, t8.scale)
    dense = w.to(device, dtype)
    ops["dense"], sizes["dense"] = (lambda x: F.linear(x, dense)), nbytes(dense)
    if dtype == torch.bfloat16:  # the bf16 matvec, on the same dense weight
        ops["bf16 kernel"], sizes["bf16 kernel"] = KernelBf16Linear(dense, ext), nbytes(dense)
    out = []
    for n in rows:
        x = torch.randn(n, n_in, generator=torch.Generator().manual_seed(n)).to(device, dtype)
        impls = {k: op if isinstance(op, str) else (lambda op=op: op(x)) for k, op in ops.items()}
        out.append({"layer": name, "n_out": n_out, "n_in": n_in, "rows": n} | measure(impls, timer, sizes))
    return out


def part_kernels(args, saved) -> dict:
    """Kernel by kernel against the PyTorch it replaces; saved(partial result) after every case."""
    import kernels

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    try:
        ext = kernels.load()
    except kernels.KernelBuildError as e:
        raise UserError(str(e)) from None
    if device.type == "cuda" and not ext.with_cuda:
        raise UserError(
            "kernels/ was built without its CUDA half here: --device cuda needs a CUDA build of torch and nvcc"
        )
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"kernels/ runs on cpu or cuda, not {device.type}")
    timer = lambda fn: time_us(fn, device, args.calls, args.min_seconds)  # noqa: E731
    models = ["SmolLM2-135M"] + (["Llama-3.2-1B"] if device.type == "cuda" else [])
    result = {
        "device": device.type,
        "dtype": args.dtype,
        "cpu_isa": ext.cpu_isa(),
        "min_calls": args.calls,
        "min_seconds": args.min_seconds,
        "partition_size": args.partition_size,
        "block_size": BLOCK_SIZE,
        "gemm_min_rows": ext.gemm_min_rows,
        "cpu_gemm": ext.cpu_gemm(),
        "attention": [],
        "add_rms_norm": [],
        "rope": [],
        "linear": [],
    }

    # Every case as (list, label, measurement), then measured in order: each result is saved as it
    # comes (`saved`), and a --budget-s that runs out leaves the rest unmeasured, said in the result.
    cases = []
    for m in models:
        for batch in args.batches:
            for ctx in args.contexts:
                cases.append(
                    (
                        "attention",
                        f"attention {m} B={batch} ctx={ctx}",
                        {"model": m, "shape": list(SHAPES[m])},
                        lambda m=m, b=batch, c=ctx: attention_case(
                            ext, SHAPES[m], b, c, device, dtype, timer, args.partition_size
                        ),
                    )
                )
    for m in models:
        for rows in args.norm_rows:
            cases.append(
                (
                    "add_rms_norm",
                    f"add_rms_norm {m} rows={rows}",
                    {"model": m},
                    lambda m=m, r=rows: norm_case(ext, HIDDEN[m], r, device, dtype, timer),
                )
            )
            cases.append(
                (
                    "rope",
                    f"rope_cache_ {m} rows={rows}",
                    {"model": m},
                    lambda m=m, r=rows: rope_case(ext, SHAPES[m], r, device, dtype, timer),
                )
            )
    for spec in args.linear_shapes.split(","):
        name, dims = spec.split(":")
        n_out, n_in = map(int, dims.split("x"))
        cases.append(
            (
                "linear",
                f"linear {name} {n_out}x{n_in}",
                {},
                lambda name=name, o=n_out, i=n_in: linear_cases(ext, name, o, i, args.rows, device, dtype, timer),
            )
        )

    cases = [c for c in cases if c[0] in args.kernel_cases]
    start = time.perf_counter()
    with torch.inference_mode():
        for done, (kind, label, fields, run) in enumerate(cases):
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                result["stopped"] = (
                    f"--budget-s {args.budget_s:g} spent: {len(cases) - done} of {len(cases)} cases not measured"
                )
                print(f"[kernels] {result['stopped']}", file=sys.stderr, flush=True)
                break
            measured = run() if kind == "linear" else [run()]
            result[kind] += [fields | r for r in measured]
            saved(result)  # before the log line: whoever sees the line finds the file
            for r in measured:
                cells = "  ".join(f"{k} {fmt(v)}" for k, v in r["us"].items())
                what = label + (f" rows={r['rows']}" if kind == "linear" else "")
                print(f"[kernels] {what:<36} us: {cells}", file=sys.stderr, flush=True)
    return result


# --- part 2: batch-1 decode, engine to engine -----------------------------------------------------


def chapter_modules(number: int | None = None) -> SimpleNamespace:
    """A chapter's engine, loading and sampling modules: this chapter's (None) by their plain names,
    another's under its own (common.tools.chapters), so both run in one process."""
    if number is None:
        import engine
        import loading
        import ops
        import sampling

        return SimpleNamespace(engine=engine, loading=loading, sampling=sampling, ops=ops)
    return load_chapter(number, "engine", "loading", "sampling")


def build_decoder(mods, args, quant: str | None, num_blocks: int, kernels=None):
    """An engine for one sequence at a time (no prefix cache: every round prefills its prompt)."""
    spec = mods.loading.quant_spec(SimpleNamespace(quant=quant, group_size=32, symmetric=False, lm_head="int8"))
    extra = {} if kernels is None else {"kernels": kernels}  # chapter 05 has no kernels
    engine, _ = mods.engine.build_engine(
        args.model,
        args.device,
        args.dtype,
        spec,
        "auto",
        **extra,
        num_blocks=num_blocks,
        max_num_seqs=1,
        prefix_caching=False,
    )
    return engine


def our_decode(engine, mods, prompt: list[int], n: int) -> dict:
    """Greedy, n tokens (ignore_eos), one step per token, timed as each step's event arrives."""
    req = mods.engine.Request(
        list(prompt), params=mods.sampling.SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True
    )
    ids, times = [], []
    t0 = time.perf_counter()
    for events in engine.stream(req):
        ids += [t for ev in events for t in ev.token_ids]
        times.append(time.perf_counter())
    s = summarize(t0, times, len(prompt))
    return {
        "decode_tok_s": s["decode_tok_s"],
        "step_ms": median(s["step_ms"]),
        "ttft_ms": s["ttft_ms"],
        "tok_s": len(ids) / (times[-1] - t0),
        "ids": ids,
    }


def llama_decode(peer, prompt: list[int], n: int) -> dict:
    r = peer.generate([prompt], n)
    return {
        "decode_tok_s": r["decode_tok_s"],
        "step_ms": median(r["step_ms"]),
        "ttft_ms": r["prefill_ms"],
        "tok_s": r["tok_s"],
        "ids": r["ids"][0],
    }


def decode_prompt(tokenizer, n_tokens: int) -> list[int]:
    """A chat prompt of n_tokens (or one or two more): "Summarize: " and the start of LONG_TEXT."""

    def chat(k: int) -> list[int]:
        return tokenizer.encode_chat([{"role": "user", "content": "Summarize: " + tokenizer.decode(body[:k])}])

    body = tokenizer.encode(LONG_TEXT * (1 + n_tokens // 100), add_special_tokens=False)
    k = max(n_tokens - len(chat(0)), 1)
    while len(chat(k)) < n_tokens and k < len(body):  # text re-tokenized in a template can come out shorter
        k += 1
    return chat(k)


# Our weights -> the GGUF llama.cpp runs beside them: the Q4_1 file our smollm2-135m was dequantized
# from beside our int4 (group 32 with a min, Q4_1's format), a BF16 one written from it beside bf16.
PEER_GGUF = {"int4": "Q4_1", "bf16": "BF16"}


def peer_reason(args) -> str | None:
    from peers import llama_cpp_available

    reason = llama_cpp_available()
    if reason is None and Path(args.model).name != "smollm2-135m":
        reason = f"its GGUFs are smollm2-135m's, not {args.model}'s"
    if reason is None and args.device != "cpu":
        reason = "it runs on the CPU here (--device cpu)"
    return reason


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def part_decode(args) -> dict:
    from common.tokenizer import Tokenizer
    from loading import resolve

    prompt = decode_prompt(Tokenizer(resolve(args.model)), args.prompt_tokens)
    n = args.decode_tokens
    num_blocks = -(-(len(prompt) + n) // BLOCK_SIZE)
    weights = list(dict.fromkeys([args.quant, "bf16"]))  # --quant's, then bf16 (once when --quant none)
    with_ch05 = chapter_exists(5)
    if not with_ch05:
        print("[decode] chapter 05 is not beside this chapter: its engine is skipped", file=sys.stderr)
    peers_skipped = peer_reason(args) if args.peers else "not asked (--peers llama.cpp)"
    if args.peers and peers_skipped:
        print(f"[decode] llama.cpp skipped: {peers_skipped}", file=sys.stderr, flush=True)
    ours = chapter_modules()
    runners, closers = {}, []  # label -> (weights, a function running one decode)
    try:
        for w in weights:
            quant = None if w == "bf16" else w
            for kernels in ("on", "off"):
                print(f"[decode] loading {CH} {w} kernels {kernels}", file=sys.stderr, flush=True)
                e = build_decoder(ours, args, quant, num_blocks, kernels)
                runners[f"{CH} {w} kernels {kernels}"] = (w, lambda k, e=e: our_decode(e, ours, prompt, k))
            if w == "int4" and args.device == "cpu" and args.dtype in ("bfloat16", "auto"):  # int8 x against float x
                print(f"[decode] loading {CH} {w} --no-int8-activations", file=sys.stderr, flush=True)
                e = build_decoder(ours, args, quant, num_blocks, ours.ops.KernelFlags("on", False, False))
                runners[f"{CH} {w} float x"] = (w, lambda k, e=e: our_decode(e, ours, prompt, k))
            if with_ch05:
                print(f"[decode] loading ch05 {w}", file=sys.stderr, flush=True)
                ch05 = chapter_modules(5)
                e = build_decoder(ch05, args, quant, num_blocks)
                runners[f"ch05 {w}"] = (w, lambda k, e=e, m=ch05: our_decode(e, m, prompt, k))
            if w in PEER_GGUF and not peers_skipped:
                from peers import BatchedLlamaCpp, gguf_path

                gguf = PEER_GGUF[w]
                peer = BatchedLlamaCpp(
                    gguf_path(gguf),
                    slots=1,
                    ctx_per_seq=len(prompt) + n,
                    max_batch_tokens=len(prompt),
                    threads=args.threads,
                )
                closers.append(peer.close)
                runners[f"llama.cpp {gguf}"] = (w, lambda k, p=peer: llama_decode(p, prompt, k))
        for _, run in runners.values():  # warm-up: allocations, threads, pages of the weights
            run(min(n, 4))
        runs: dict[str, list[dict]] = {label: [] for label in runners}
        for r in range(args.repeats):
            for label, (_, run) in runners.items():
                runs[label].append(run(n))
                print(
                    f"[decode] round {r + 1}/{args.repeats} {label:<22} {runs[label][-1]['decode_tok_s']:7.1f} tok/s "
                    f"({runs[label][-1]['step_ms']:.2f} ms/step)",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for close in closers:
            close()
    series = {}
    for label, rs in runs.items():
        w = runners[label][0]
        reference = runs[f"{CH} {w} kernels off"][0]["ids"]  # chapter 05's maths, on these weights
        series[label] = {
            "weights": w,
            "decode_tok_s": median([x["decode_tok_s"] for x in rs]),
            "decode_tok_s_runs": [x["decode_tok_s"] for x in rs],
            "step_ms": median([x["step_ms"] for x in rs]),
            "ttft_ms": median([x["ttft_ms"] for x in rs]),
            "tok_s": median([x["tok_s"] for x in rs]),
            "same_tokens_as_kernels_off": common_prefix(rs[0]["ids"], reference),
        }
    ratios = {}
    for w in weights:
        on = series[f"{CH} {w} kernels on"]["decode_tok_s"]
        ratios[f"{w}: kernels on / off"] = on / series[f"{CH} {w} kernels off"]["decode_tok_s"]
        if f"{CH} {w} float x" in series:  # int8 activations (the default) / --no-int8-activations
            ratios[f"{w}: int8 activations / float x"] = on / series[f"{CH} {w} float x"]["decode_tok_s"]
        if f"ch05 {w}" in series:
            ratios[f"{w}: {CH} kernels on / ch05"] = on / series[f"ch05 {w}"]["decode_tok_s"]
        if f"llama.cpp {PEER_GGUF.get(w)}" in series:
            ratios[f"{w}: {CH} kernels on / llama.cpp {PEER_GGUF[w]}"] = (
                on / series[f"llama.cpp {PEER_GGUF[w]}"]["decode_tok_s"]
            )
    result = {"prompt_tokens": len(prompt), "decode_tokens": n, "weights": weights, "series": series, "ratios": ratios}
    if args.peers and peers_skipped:
        result["llama_cpp"] = {"skipped": peers_skipped}
    elif args.peers:
        import llama_cpp

        result["llama_cpp"] = {
            "version": llama_cpp.__version__,
            "threads": args.threads,
            "slots": 1,
            "flash_attn": True,
        }
    return result


# --- part 3: the server under 16 streams (common.tools.serving's harness) ------------------------


def start_servers(args, specs: dict[str, tuple[Path, list[str]]], record: dict):
    """common.tools.serving.servers on `specs` ({label: (a chapter's folder, extra flags)}): each
    server with the bench's model, device, dtype, weights and scheduler settings."""
    base = [
        "--model",
        args.model,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--kv-cache-memory-gb",
        str(args.kv_cache_memory_gb),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    base += ["--quant", args.quant] if args.quant != "bf16" else []
    argv = {label: (folder, base + flags) for label, (folder, flags) in specs.items()}
    return servers(argv, record, threads=args.threads, timeout=args.server_timeout)


def part_throughput(args, record: dict) -> dict:
    specs = {CH: (HERE, ["--no-prefix-caching", "--kernels", "on"])}
    if chapter_exists(5):
        specs["ch05"] = (chapter_dir(5), ["--no-prefix-caching"])
    else:
        print("[throughput] chapter 05 is not beside this chapter: its server is skipped", file=sys.stderr)
    plan = [(label, n) for n in args.concurrency for label in specs]
    with start_servers(args, specs, record.setdefault("servers", {})) as urls:
        runs = throughput_rounds(urls, plan, args.repeats, args.max_tokens, args.health_interval)
    result = {label: [combine_rounds(runs[(label, n)]) for n in args.concurrency] for label in specs}
    if "ch05" in result:
        result[f"ratio_{CH}_ch05"] = {
            str(a["concurrency"]): a["tok_s"] / b["tok_s"] for a, b in zip(result[CH], result["ch05"])
        }
    return result


# --- output ------------------------------------------------------------------------------------


def ratio(a, b) -> float | None:
    return a / b if a and b else None


def print_tables(result: dict) -> None:
    kr = result.get("kernels")
    if kr:
        where = f"{kr['dtype']} on {kr['device']}" + (f" ({kr['cpu_isa']} kernels)" if kr["device"] == "cpu" else "")
        print(f"kernels against PyTorch, {where}: us per call, median of >= {kr['min_calls']} calls")
        for m in dict.fromkeys(r["model"] for r in kr["attention"]):
            nh, nkv, hd = SHAPES[m]
            rows = [r for r in kr["attention"] if r["model"] == m]
            print(
                f"\npaged decode attention, {m} ({nh} heads, {nkv} KV heads, head_dim {hd}); SDPA on K/V gathered "
                f"in {rows[0]['sdpa_dtype']}"
            )
            print(
                f"{'batch':>5} {'context':>7} {'kernel':>9} {'ch05 gather+SDPA':>17} {'SDPA gathered':>14} "
                f"{'x ch05':>7} {'x SDPA':>7} {'kernel GB/s':>11}"
            )
            for r in rows:
                us = r["us"]
                print(
                    f"{r['batch']:>5} {r['context']:>7} {fmt(us['kernel']):>9} {fmt(us['ch05 gather+SDPA']):>17} "
                    f"{fmt(us['SDPA gathered']):>14} "
                    f"{fmt(ratio(us['ch05 gather+SDPA'], us['kernel']), '.2f'):>7} "
                    f"{fmt(ratio(us['SDPA gathered'], us['kernel']), '.2f'):>7} {fmt(r['gb_s']['kernel']):>11}"
                )
        print(f"\n{'op':<13} {'model':<13} {'rows':>5} {'kernel':>8} {'PyTorch':>8} {'speedup':>8}")
        for op in ("add_rms_norm", "rope"):
            for r in kr[op]:
                print(
                    f"{op + ('_cache_' if op == 'rope' else ''):<13} {r['model']:<13} {r['rows']:>5} "
                    f"{fmt(r['us']['kernel'], '.2f'):>8} {fmt(r['us']['torch'], '.2f'):>8} "
                    f"{fmt(ratio(r['us']['torch'], r['us']['kernel']), '.2f'):>7}x"
                )
        impls = list(dict.fromkeys(k for r in kr["linear"] for k in r["us"]))
        names = [f"{kr['dtype']} dense" if k == "dense" else k for k in impls]
        print(f"\nmatmuls x @ W.T ({kr['dtype']} activations): us per call (weight GB/s); int4 group 32")
        print(f"{'layer':<8} {'out x in':>11} {'rows':>4} " + " ".join(f"{n:>16}" for n in names))
        for r in kr["linear"]:
            cells = [f"{fmt(r['us'].get(k))} ({fmt(r['gb_s'].get(k))})" if r["us"].get(k) else "-" for k in impls]
            print(
                f"{r['layer']:<8} {str(r['n_out']) + 'x' + str(r['n_in']):>11} {r['rows']:>4} "
                + " ".join(f"{c:>16}" for c in cells)
            )
        gemm = [r for r in kr["linear"] if r["rows"] >= kr["gemm_min_rows"] and r["us"].get("dense")]
        kinds = [k for k in ("int4 kernel", "int8 kernel", "bf16 kernel") if any(r["us"].get(k) for r in gemm)]
        if gemm and kinds:
            where = "cuda/gemm.cu, against cuBLAS" if kr["device"] == "cuda" else f"cpu/gemm.cpp: {kr['cpu_gemm']}"
            print(
                f"\nfrom {kr['gemm_min_rows']} rows the kernels are matrix products ({where});\nagainst the "
                f"{kr['dtype']} dense weight's F.linear: dense us / kernel us (above 1: the kernel is faster), "
                f"then the kernel's GFLOP/s"
            )
            print(f"{'layer':<8} {'out x in':>11} {'rows':>4} " + " ".join(f"{k:>22}" for k in kinds))
            for r in gemm:
                flop = 2 * r["rows"] * r["n_out"] * r["n_in"]
                cells = [
                    f"{fmt(ratio(r['us']['dense'], r['us'][k]), '.2f')}x {fmt(flop / (r['us'][k] * 1e3), '.0f')}"
                    if r["us"].get(k)
                    else "-"
                    for k in kinds
                ]
                print(
                    f"{r['layer']:<8} {str(r['n_out']) + 'x' + str(r['n_in']):>11} {r['rows']:>4} "
                    + " ".join(f"{c:>22}" for c in cells)
                )
        why = {f"{k}: {v}" for r in kr["linear"] + kr["attention"] for k, v in r.get("why", {}).items()}
        for line in sorted(why):
            print(f"  not run: {line}")
    de = result.get("decode")
    if de:
        print(
            f"\ndecode, batch 1: a {de['prompt_tokens']}-token chat prompt, {de['decode_tokens']} new tokens "
            f"(greedy, ignore_eos), median of {result['repeats']} rounds;\ndecode tok/s = the tokens after the first / "
            f"their time; '= kernels off': greedy tokens equal to the kernels-off engine's on the same weights"
        )
        print(
            f"{'engine':<24} {'decode tok/s':>12} {'ms/step':>8} {'TTFT ms':>8} {'end-to-end tok/s':>16} "
            f"{'= kernels off':>13}"
        )
        for label, s in de["series"].items():
            print(
                f"{label:<24} {fmt(s['decode_tok_s']):>12} {fmt(s['step_ms'], '.2f'):>8} "
                f"{fmt(s['ttft_ms'], '.0f'):>8} {fmt(s['tok_s']):>16} "
                f"{s['same_tokens_as_kernels_off']:>8}/{de['decode_tokens']}"
            )
        for name, x in de["ratios"].items():
            goal = " (goal >= 1.3x)" if name.startswith("int4") and "llama.cpp" in name else ""
            print(f"{name}: {x:.2f}x{goal}")
        if any("llama.cpp" in name for name in de["ratios"]):
            print(isa_line(result["machine"]["isa"]))
        if de.get("llama_cpp", {}).get("skipped"):
            print(f"llama.cpp skipped: {de['llama_cpp']['skipped']}")
    tp = result.get("throughput")
    if tp:
        print(
            f"\nthroughput: the OpenAI server, chat, max_tokens {result['max_tokens']}, ignore_eos, greedy, "
            f"{result['quant']} weights; median of {result['repeats']} rounds"
        )
        print(
            f"{'server':<6} {'N':>3} {'tokens':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
            f"{'ITL p99':>8} {'KV blocks':>9}"
        )
        for label in (CH, "ch05"):
            for r in tp.get(label, []):
                print(
                    f"{label:<6} {r['concurrency']:>3} {r['tokens']:>6} {fmt(r['tok_s']):>8} "
                    f"{fmt(r['ttft_ms_p50'], '.0f'):>9} {fmt(r['ttft_ms_p99'], '.0f'):>9} "
                    f"{fmt(r['itl_ms_p50']):>8} {fmt(r['itl_ms_p99']):>8} {fmt(r['peak_kv_blocks_used'], 'd'):>9}"
                )
        for n, x in tp.get(f"ratio_{CH}_ch05", {}).items():
            print(f"{CH} / ch05 aggregate tok/s at N={n}: {x:.2f}x")


COLORS = {
    "kernel": "tab:blue",
    "ch05 gather+SDPA": "tab:orange",
    "SDPA gathered": "tab:green",
    "int4 kernel": "tab:blue",
    "int4 kernel avx512": "tab:red",
    "int4 torch": "tab:cyan",
    "int8 kernel": "tab:purple",
    "int8 torch": "tab:pink",
    "bf16 kernel": "tab:olive",
    "dense": "tab:gray",
}


def plot(result: dict, path: Path) -> bool:
    kr, de, tp = result.get("kernels"), result.get("decode"), result.get("throughput")
    panels = (
        [(kind, kr) for kind in ("attention", "linear") if kr and kr[kind]]  # a spent --budget-s leaves some empty
        + ([("decode", de)] if de else [])
        + ([("throughput", tp)] if tp else [])
    )
    if not panels:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cols = min(len(panels), 2)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.6 * rows), squeeze=False)
    for ax, (kind, data) in zip(axes.flat, panels):
        if kind == "attention":
            # colour: the implementation; marker: the model's shape; faint: the larger batch
            batches = sorted({r["batch"] for r in data["attention"]})
            for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in data["attention"]):
                rows = [r for r in data["attention"] if r["model"] == model and r["batch"] == batch]
                for impl, line in (("kernel", "-"), ("ch05 gather+SDPA", "--"), ("SDPA gathered", ":")):
                    ax.plot(
                        [r["context"] for r in rows],
                        [r["us"][impl] for r in rows],
                        ls=line,
                        color=COLORS[impl],
                        marker="o" if model == "SmolLM2-135M" else "s",
                        ms=4,
                        alpha=1.0 if batch == batches[0] else 0.5,
                        label=f"{impl}, {model}, B={batch}",
                    )
            ax.set_xscale("log", base=2)
            contexts = sorted({r["context"] for r in data["attention"]})
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.set_yscale("log")
            ax.minorticks_off()
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("us per call")
            ax.set_title("Paged decode attention (one layer)", fontsize=10)
        elif kind == "linear":
            rows = [r for r in data["linear"] if r["rows"] == min(x["rows"] for x in data["linear"])]
            impls = list(dict.fromkeys(k for r in rows for k in r["us"]))
            width = 0.8 / len(impls)
            for j, impl in enumerate(impls):
                ax.bar(
                    [i + j * width for i in range(len(rows))],
                    [r["gb_s"].get(impl) or 0 for r in rows],
                    width,
                    color=COLORS.get(impl),
                    label=f"{data['dtype']} dense" if impl == "dense" else impl,
                )
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [r["layer"] for r in rows])
            ax.set_ylabel("weight GB/s")
            ax.set_title(f"Matmuls at {rows[0]['rows']} row(s): weight bytes read per second", fontsize=10)
        elif kind == "decode":
            labels = list(data["series"])
            colors = [
                "tab:blue"
                if "kernels on" in lb
                else "tab:orange"
                if "off" in lb
                else "black"
                if "llama" in lb
                else "tab:gray"
                for lb in labels
            ]
            ax.barh(labels, [data["series"][lb]["decode_tok_s"] for lb in labels], color=colors)
            ax.invert_yaxis()
            ax.set_xlabel("decode tok/s")
            ax.set_title(f"Batch-1 decode ({data['prompt_tokens']}-token prompt)", fontsize=10)
        else:
            labels = [lb for lb in (CH, "ch05") if lb in data]
            ns = [r["concurrency"] for r in data[CH]]
            for j, lb in enumerate(labels):
                ax.bar(
                    [i + j * 0.4 for i in range(len(ns))],
                    [r["tok_s"] for r in data[lb]],
                    0.4,
                    color="tab:blue" if lb == CH else "tab:orange",
                    label=f"{lb} server",
                )
            ax.set_xticks([i + 0.2 * (len(labels) - 1) for i in range(len(ns))], [f"N={n}" for n in ns])
            ax.set_ylabel("aggregate output tok/s")
            ax.set_title(f"OpenAI server, concurrent streams, {result['quant']} weights", fontsize=10)
        ax.grid(alpha=0.3, which="both", axis="x" if kind == "decode" else "y")
        if kind != "decode":
            ax.legend(fontsize=6 if kind == "attention" else 7)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"{Path(result['model']).name}, {result['dtype']} activations, {result['device']}, {result['threads']} threads",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --- main --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--quant",
        choices=["int4", "int8", "none"],
        default="int4",
        help="weights of the decode part (beside bf16) and of the servers (default: %(default)s)",
    )
    ap.add_argument("--dtype", default="bfloat16", help="activations and KV cache (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="interleaved rounds of parts decode and throughput (median reported)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads, here and in each server, and llama.cpp's",
    )
    ap.add_argument(
        "--peers",
        default="",
        help="llama.cpp: also llama.cpp in part decode (llama-cpp-python, optional; smollm2-135m on the CPU)",
    )
    ap.add_argument("--prompt-tokens", type=int, default=128, help="part decode: the prompt (default: %(default)s)")
    ap.add_argument("--decode-tokens", type=int, default=128, help="part decode: new tokens (default: %(default)s)")
    ap.add_argument("--concurrency", default="16", help="part throughput: concurrent clients (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="part throughput: tokens per request")
    ap.add_argument("--kv-cache-memory-gb", type=positive_float, default=1.0, help="the servers' KV pool")
    ap.add_argument("--max-num-seqs", type=positive_int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=256)
    ap.add_argument(
        "--out",
        default=str(RESULTS_DIR / f"{CH}_bench.json"),
        help=f"the JSON (a .png is written beside it); a directory: {CH}_bench.json in it",
    )
    # part kernels: what is measured and how long (smaller in the tests)
    ap.add_argument("--contexts", default="128,512,1024,2048,4096,8192", help=argparse.SUPPRESS)
    ap.add_argument("--batches", default="1,16", help=argparse.SUPPRESS)
    # the linears' rows: on CUDA also the matrix product's sizes (prompt chunks), against cuBLAS
    ap.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--norm-rows", default="1,16,256", help=argparse.SUPPRESS)
    ap.add_argument("--linear-shapes", default=LINEAR, help=argparse.SUPPRESS)
    ap.add_argument(
        "--kernel-cases",
        default=",".join(KERNEL_CASES),
        help="part kernels: which of its cases, comma-separated (default: all, %(default)s)",
    )
    ap.add_argument("--calls", type=int, default=20, help=argparse.SUPPRESS)
    ap.add_argument("--min-seconds", type=float, default=0.5, help=argparse.SUPPRESS)
    ap.add_argument("--partition-size", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument(
        "--budget-s",
        type=budget_seconds,
        default=None,
        help="part kernels: stop starting new cases after this many seconds (the JSON says which were left)",
    )
    ap.add_argument("--server-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    ap.add_argument("--health-interval", type=float, default=0.05, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.quant = "bf16" if args.quant == "none" else args.quant
    if args.rows is None:
        args.rows = "1,4,16,32,128,512" if args.device.startswith("cuda") else "1,4,16"
    args.kernel_cases = [c.strip() for c in args.kernel_cases.split(",") if c.strip()]
    if not args.kernel_cases or any(c not in KERNEL_CASES for c in args.kernel_cases):
        raise UserError(f"--kernel-cases takes some of {', '.join(KERNEL_CASES)}, got {','.join(args.kernel_cases)!r}")
    for name in ("concurrency", "contexts", "batches", "rows", "norm_rows"):
        setattr(args, name, int_list(getattr(args, name)))
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise UserError(f"unknown part(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}")
    for name in ("max_tokens", "repeats", "threads", "prompt_tokens", "decode_tokens", "calls"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.decode_tokens < 2:
        raise UserError("--decode-tokens must be at least 2 (decode tok/s times the tokens after the first)")
    if args.peers not in ("", "llama.cpp"):
        raise UserError(f"--peers takes llama.cpp, got {args.peers!r}")
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / f"{CH}_bench.json"
    check_out(out)
    # A SIGTERM (a test's timeout, a scheduler) unwinds like an exception, so the servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)

    result = {
        "model": args.model,
        "quant": args.quant,
        "dtype": args.dtype,
        "device": args.device,
        "machine": machine(),
        "threads": args.threads,
        "command": command_line(__file__, sys.argv[1:]),
        "parts": parts,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    t_start = time.perf_counter()

    def save_partial(kernels_so_far: dict) -> None:
        # Written as it goes: a run cut short by a timeout still leaves what it measured.
        save_json(out, result | {"kernels": kernels_so_far, "complete": False})

    if "kernels" in parts:
        result["kernels"] = part_kernels(args, save_partial)
    if "decode" in parts:
        result["decode"] = part_decode(args)
    if "throughput" in parts:
        result["throughput"] = part_throughput(args, result)
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    result["complete"] = True

    print_tables(result)
    save_json(out, result)
    png = out.with_suffix(".png")
    saved = plot(result, png)
    print(f"saved {out}" + (f" and {png.name}" if saved else "") + f" ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    run_main(main)
