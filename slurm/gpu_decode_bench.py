"""Batch-1 bf16 decode speed of chapter 06 on a GPU, on a random Llama-3.2-1B-shaped checkpoint
made on the spot (no download): tokens/s and the share of the GPU's memory bandwidth it reaches.

    .venv/bin/python slurm/gpu_decode_bench.py [--out bench/results/gpu_decode.json] [--tokens 128]
    PYTHONPATH=. python3 slurm/gpu_decode_bench.py     # without `make setup` (as slurm/gpu_check.sh runs it)

A decode step reads every weight once (2 bytes each in bf16) plus the KV cache so far, so
bytes per step / seconds per step is the bandwidth the engine achieves. What bounds it is measured
on the spot (a device-to-device copy: what this GPU's memory sustains, reading and writing) and
shown beside the vendor's figure for the model the GPU's name matches (a PCIe H100 is not an SXM one).
Three ways to run the same steps, interleaved: CUDA graphs + kernels (chapter 06's default on a
GPU), kernels without graphs, and chapter 05's PyTorch path (--kernels off, no graphs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from common.tools.chapters import load_chapter
except ModuleNotFoundError:
    sys.exit(
        "error: the package `common` is not importable: use .venv/bin/python after `make setup`, "
        "or run from the repository's root with PYTHONPATH=. (slurm/gpu_check.sh does)"
    )

LLAMA_32_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=128001,
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    torch_dtype="bfloat16",
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
# The vendors' memory bandwidth, GB/s, by what the device name contains: the more specific first.
NOMINAL_GBS = [
    (("H200",), 4800),
    (("H100", "NVL"), 3900),
    (("H100", "PCIe"), 2000),
    (("H100",), 3350),  # SXM5 (named "H100 80GB HBM3")
    (("A100", "80GB", "PCIe"), 1935),
    (("A100", "80GB"), 2039),  # SXM4
    (("A100",), 1555),  # 40 GB, PCIe and SXM4
]


def nominal_gbs(name: str) -> float | None:
    return next((gbs for words, gbs in NOMINAL_GBS if all(w in name for w in words)), None)


def copy_gbs(gib: float = 1.0, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy of `gib` GiB, counting its read and its write: the most a
    kernel that streams memory can expect on this GPU (the best of `repeats`)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return 2 * src.numel() / best / 1e9


def make_checkpoint(out: Path) -> None:
    """Random weights of Llama-3.2-1B's shapes (std 0.02), saved as bf16 safetensors."""
    from safetensors.torch import save_file

    c = LLAMA_32_1B
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {
        name: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g, device="cuda") * 0.02)
        .to(torch.bfloat16)
        .cpu()
        for name, s in shapes.items()
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(c, indent=1))


def decode_ms(ch, model, graphs: bool, prompt: list[int], n: int) -> float:
    """Median ms per decode step of one sequence after a len(prompt) prefill."""
    bs = 16
    blocks = list(range(-(-(len(prompt) + n + 1) // bs)))
    cache = ch.paged_cache.PagedKVCache(model.config, len(blocks) + 1, bs, model.device, model.dtype)
    runner = ch.cuda_graphs.DecodeGraphs(model, cache, 1, len(blocks), len(blocks), capture=True) if graphs else None
    with torch.inference_mode():
        step = ch.batch.build_step([ch.batch.Work(prompt, 0, blocks)], bs, model.device)
        token = int(ch.model.forward(model, step, cache).argmax(-1)[0])
        times = []
        for pos in range(len(prompt), len(prompt) + n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            work = [ch.batch.Work([token], pos, blocks)]
            logits = (
                runner.run(work)
                if runner
                else ch.model.forward(model, ch.batch.build_step(work, bs, model.device), cache)
            )
            token = int(logits.argmax(-1)[0])  # the engine's sampler waits for the step the same way
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[3:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/gpu_decode.json")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA device", file=sys.stderr)
        return 0
    ch = load_chapter(6, "model", "batch", "paged_cache", "cuda_graphs", "ops")
    name = torch.cuda.get_device_name()
    nominal, measured = nominal_gbs(name), copy_gbs()
    print(f"[gpu-bench] {name}: device copy {measured:.0f} GB/s, nominal {nominal or '?'} GB/s", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        make_checkpoint(Path(tmp))
        print(f"[gpu-bench] random Llama-3.2-1B-shaped checkpoint in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        cuda = torch.device("cuda")
        models = {k: ch.model.load_model(tmp, cuda, torch.bfloat16, ops=ch.ops.resolve(k, cuda)) for k in ("on", "off")}
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    modes = {
        "kernels + CUDA graphs": ("on", True),
        "kernels, no graphs": ("on", False),
        "chapter 05 path (kernels off)": ("off", False),
    }
    runs = {m: [] for m in modes}
    for _ in range(args.repeats):  # interleaved: a drifting GPU clock affects every mode alike
        for mode, (kernels, graphs) in modes.items():
            runs[mode].append(decode_ms(ch, models[kernels], graphs, prompt, args.tokens))
    m = models["on"]
    c = m.config
    kv_bytes = (args.prompt_tokens + args.tokens / 2) * c.kv_bytes_per_token(2)  # the average context's K and V
    step_bytes = m.weight_bytes + kv_bytes
    result = {"gpu": name, "copy_GBps": measured, "nominal_GBps": nominal, "weight_bytes": m.weight_bytes, "modes": {}}
    print(
        f"\n{name}: batch-1 bf16 decode, Llama-3.2-1B shapes, {args.prompt_tokens}-token prompt, {args.tokens} tokens"
    )
    print(f"{'mode':32} {'ms/token':>9} {'tok/s':>8} {'GB/s':>8} {'of copy':>8} {'of nominal':>11}")
    for mode, ms in runs.items():
        ms = statistics.median(ms)
        gbs = step_bytes / (ms / 1000) / 1e9
        of_copy, of_nominal = gbs / measured, (gbs / nominal if nominal else None)
        result["modes"][mode] = {
            "ms_per_token": ms,
            "tok_s": 1000 / ms,
            "GBps": gbs,
            "share_of_copy": of_copy,
            "share_of_nominal": of_nominal,
        }
        nominal_text = f"{of_nominal:.0%}" if of_nominal else "-"
        print(f"{mode:32} {ms:9.2f} {1000 / ms:8.1f} {gbs:8.0f} {of_copy:8.0%} {nominal_text:>11}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
