"""Real PEFT adapters for the tests: made by peft itself on the HF model, so the files, key names
and config are what users bring. PEFT starts B at zero (the adapter adds nothing until trained):
here B is drawn at random, so every adapter moves the logits."""

from __future__ import annotations

from pathlib import Path

import torch

from common.models import resolve_model

EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_base(name: str = "tiny-llama3"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(name)), dtype=torch.float32)
    return model.eval()


def make_adapter(
    out: Path, rank: int, targets=EVERY, seed: int = 0, alpha: float = 16, rslora: bool = False, base=None, size=0.05,
    **config,
) -> Path:
    """A PEFT LoRA directory at `out` for the tiny model, with random non-zero A and B; `targets` a
    list or a pattern, `config` more of LoraConfig's fields (rank_pattern, layers_to_transform, ...)."""
    import peft

    base = base if base is not None else hf_base()
    targets = targets if isinstance(targets, str) else list(targets)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora, **config
    )
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * size)
    model.save_pretrained(str(out))
    model.unload()  # the base modules back as they were: the next adapter starts from the same model
    return out


def hf_with_adapter(path: Path, base=None):
    """transformers + peft: the reference."""
    import peft

    base = base if base is not None else hf_base()
    return peft.PeftModel.from_pretrained(base, str(path)).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long)
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_capture(model, ids: list[int]) -> dict:
    """common.hf_reference's checkpoints (embedding, each layer's output, logits) of an HF model
    with an adapter (a PeftModel), float32 numpy, for common.parity."""
    llama = model.get_base_model().model  # PeftModel -> LlamaForCausalLM -> LlamaModel
    captured, handles = {}, []

    def keep(name):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            captured[name] = out[0].float().numpy().copy()

        return hook

    handles.append(llama.embed_tokens.register_forward_hook(keep("embedding")))
    for i, layer in enumerate(llama.layers):
        handles.append(layer.register_forward_hook(keep(f"layer.{i}")))
    try:
        captured["logits"] = model(torch.tensor([ids])).logits[0].float().numpy()
    finally:
        for h in handles:
            h.remove()
    return captured
