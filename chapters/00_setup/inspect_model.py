"""Everything worth knowing about a checkpoint before running it: its config, where its
parameters live, what its weights and its KV cache cost in memory, and how its tokenizer
splits text.

Usage, from this chapter's folder:

    python inspect_model.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from common.checkpoint import DTYPE_SIZES, checkpoint_files, read_header
from common.cli import run_main
from common.config import LlamaConfig, load_config
from common.models import resolve_model
from common.tokenizer import Tokenizer

CONTEXTS = {"2k": 2048, "8k": 8192, "128k": 131072}
SAMPLE_TEXT = "Hello world!  Héllo 世界 🙂\n"


def parameter_counts(config: LlamaConfig) -> dict[str, int]:
    """Parameters per component, from the config alone (a tied LM head adds nothing)."""
    h, hd, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    attention = h * hd * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)  # q, o + k, v
    mlp = 3 * h * config.intermediate_size  # gate, up, down
    counts = {
        "embedding": config.vocab_size * h,
        "attention": layers * attention,
        "mlp": layers * mlp,
        "norms": (2 * layers + 1) * h,
        "lm_head": 0 if config.tie_word_embeddings else config.vocab_size * h,
    }
    counts["total"] = sum(counts.values())
    return counts


def weight_bytes_by_dtype(model_dir: Path) -> dict[str, tuple[int, int]]:
    """{stored dtype: (number of elements, bytes)} from the safetensors headers, without loading data."""
    elements: Counter = Counter()
    for f in checkpoint_files(model_dir):
        header, _ = read_header(f)
        for info in header.values():
            n = 1
            for d in info["shape"]:
                n *= d
            elements[info["dtype"]] += n
    return {dt: (n, n * DTYPE_SIZES[dt]) for dt, n in elements.items()}


def kv_cache_table(config: LlamaConfig) -> list[tuple[str, int, dict[str, int]]]:
    """(dtype, bytes per token, {context: bytes}) for fp16 and fp32 caches."""
    rows = []
    for dtype, size in (("fp16/bf16", 2), ("fp32", 4)):
        per_token = config.kv_bytes_per_token(size)
        rows.append((dtype, per_token, {name: per_token * n for name, n in CONTEXTS.items()}))
    return rows


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def print_report(model_dir: Path) -> None:
    config = load_config(model_dir)
    print(f"# {model_dir}\n\n## config")
    fields = [
        ("vocab_size", config.vocab_size),
        ("hidden_size", config.hidden_size),
        ("intermediate_size", config.intermediate_size),
        ("num_hidden_layers", config.num_hidden_layers),
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", config.num_key_value_heads),
        ("  -> query heads per KV head", config.n_rep),
        ("head_dim", config.head_dim),
        ("rms_norm_eps", config.rms_norm_eps),
        ("rope_theta", config.rope_theta),
        ("rope_scaling", config.rope_scaling),
        ("max_position_embeddings", config.max_position_embeddings),
        ("tie_word_embeddings", config.tie_word_embeddings),
        ("bos_token_id", config.bos_token_id),
        ("eos_token_ids", list(config.eos_token_ids)),
        ("stored dtype", config.torch_dtype),
    ]
    for key, value in fields:
        print(f"  {key:<30} {value}")

    print("\n## parameters")
    counts = parameter_counts(config)
    for key, n in counts.items():
        note = " (tied: reuses the embedding matrix)" if key == "lm_head" and config.tie_word_embeddings else ""
        print(f"  {key:<12} {n:>15,}  {n / counts['total']:6.1%}{note}")

    print("\n## weight bytes on disk, by stored dtype")
    for dtype, (n, nbytes) in weight_bytes_by_dtype(model_dir).items():
        print(f"  {dtype:<6} {n:>15,} elements  {human(nbytes)}")

    print("\n## KV cache (2 x layers x kv_heads x head_dim x bytes per token)")
    print(f"  {'dtype':<10} {'per token':>12}" + "".join(f" {name:>10}" for name in CONTEXTS))
    for dtype, per_token, by_ctx in kv_cache_table(config):
        print(f"  {dtype:<10} {human(per_token):>12}" + "".join(f" {human(b):>10}" for b in by_ctx.values()))
    if config.n_rep > 1:
        saved = config.num_attention_heads / config.num_key_value_heads
        print(
            f"  GQA: {config.num_key_value_heads} KV heads instead of {config.num_attention_heads}: {saved:.0f}x less cache"
        )

    print("\n## tokenizer round trip")
    tok = Tokenizer(model_dir)
    ids = tok.encode(SAMPLE_TEXT)
    print(f"  text   {SAMPLE_TEXT!r}")
    print(f"  ids    {ids}")
    print(f"  pieces {[tok.id_to_token(i) for i in ids]}")
    print(
        f"  decode {tok.decode(ids)!r}  (round trip {'ok' if tok.decode(ids, skip_special_tokens=True) == SAMPLE_TEXT else 'DIFFERS'})"
    )
    print(
        f"  special: bos={tok.bos_token!r} ({tok.bos_id}), eos={tok.eos_token!r} ({tok.eos_id}), vocab {tok.vocab_size:,}"
    )
    if tok.chat_template:
        chat = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
        print(f"  chat template renders [user: 'Hi!'] as {chat!r}")
        print(f"  -> {len(tok.encode(chat, add_special_tokens=False))} tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a name (smollm2-135m, tiny-llama3) or a checkpoint directory")
    args = ap.parse_args()
    print_report(resolve_model(args.model))
    return 0


if __name__ == "__main__":
    run_main(main)
