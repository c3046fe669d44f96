"""Tokenizer: the `tokenizers` library on tokenizer.json, plus the chat template.

The chat template is a Jinja program stored with the checkpoint (inside tokenizer_config.json
in Llama-3.x downloads, in chat_template.jinja in transformers-5 saves). Rendering it turns a
list of messages into one string with the model's special markers; that string is then
tokenized *without* adding special tokens again, since the template already wrote them.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    pass


def _token_content(value) -> str | None:
    # tokenizer_config.json stores special tokens either as "<|x|>" or as {"content": "<|x|>", ...}
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir} has no tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.bos_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.token_to_id(self.eos_token) if self.eos_token else None
        jinja_path = model_dir / "chat_template.jinja"
        self.chat_template = jinja_path.read_text() if jinja_path.is_file() else self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # some configs hold [{"name": "default", "template": ...}, ...]
            self.chat_template = next(t["template"] for t in self.chat_template if t.get("name") == "default")
        self.special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens lets tokenizer.json's post-processor add what the model expects
        (Llama 3 prepends <|begin_of_text|>; SmolLM2 adds nothing)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template: pass a plain prompt instead of --chat")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise TokenizerError(f"message {i} must be an object with 'role' and 'content'")
        return _compile(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _raise(message: str):
    raise TokenizerError(f"chat template: {message}")


_templates: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    # The same environment settings as transformers uses, so the rendered text is identical:
    # trim_blocks/lstrip_blocks, a sandbox (templates come with downloaded checkpoints), and the
    # helpers templates call (raise_exception, strftime_now for Llama 3's "Today Date").
    if source not in _templates:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _templates[source] = env.from_string(source)
    return _templates[source]
