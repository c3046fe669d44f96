"""Tokenizer: the `tokenizers` library on tokenizer.json, plus the chat template.

The chat template is a Jinja program stored with the checkpoint (inside tokenizer_config.json
in Llama-3.x downloads, in chat_template.jinja in transformers-5 saves). Rendering it turns a
list of messages into one string with the model's special markers; that string is then
tokenized *without* adding special tokens again, since the template already wrote them.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    """tokenizer.json, tokenizer_config.json or the chat template is missing, corrupt, or fails."""


def _token_content(value, source: str, key: str) -> str | None:
    # tokenizer_config.json stores special tokens either as "<|x|>" or as {"content": "<|x|>", ...}
    content = value.get("content") if isinstance(value, dict) else value
    if content is not None and not isinstance(content, str):
        raise TokenizerError(f'{source}: field {key!r} must be a token string or {{"content": ...}}, got {value!r:.60}')
    return content


def _load_tokenizer_json(path: Path) -> _HFTokenizer:
    stat = path.stat()
    try:
        return _parse_tokenizer_json(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    except Exception as e:  # the tokenizers library raises a bare Exception for every kind of bad file
        raise TokenizerError(f"{path}: not a valid tokenizer.json ({str(e).strip() or type(e).__name__})") from None


@functools.lru_cache(maxsize=8)
def _parse_tokenizer_json(path: str, mtime_ns: int, size: int) -> _HFTokenizer:
    """Parsed once a process for each version of a file (0.1 s for SmolLM2's 2 MB): a server with a
    draft model of the same family, or a test suite's hundred engines, share one. Sharing is safe:
    this module never changes the tokenizer's settings (truncation, padding), and its encode and
    decode take it read-only, from any thread."""
    return _HFTokenizer.from_file(path)


def _load_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: must hold a JSON object, got {type(config).__name__}")
    return config


def _find_chat_template(model_dir: Path, config: dict) -> tuple[str | None, str]:
    """(template source or None, where it came from, for error messages)."""
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{jinja_path}: not UTF-8 text ({e})") from None
    where = f"{model_dir / 'tokenizer_config.json'} (chat_template)"
    template = config.get("chat_template")
    if isinstance(template, list):  # some configs hold [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise TokenizerError(
                f"{where}: a list of templates needs one named 'default', found {sorted(map(str, named))}"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{where}: must be a Jinja template string, got {type(template).__name__}")
    return template or None, where


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir} has no tokenizer.json")
        self._tok = _load_tokenizer_json(path)
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = _load_tokenizer_config(cfg_path)
        self.bos_token = _token_content(self.config.get("bos_token"), str(cfg_path), "bos_token")
        self.eos_token = _token_content(self.config.get("eos_token"), str(cfg_path), "eos_token")
        self.bos_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template, template_source = _find_chat_template(model_dir, self.config)
        # Compiled now, so that a template with a syntax error stops a server at startup
        # instead of failing every chat request.
        self._template = _compile(self.chat_template, template_source) if self.chat_template else None
        special = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.special_ids = set(special)
        # Longest first, so that "<|im_start|>" wins over any shorter special token it contains,
        # as in the tokenizer's own matching.
        texts = sorted(set(special.values()), key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, texts))) if texts else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token decodes to: the longest vocabulary entry
        (a byte-level entry has a character per byte, and a byte decodes to at most a
        character). A text longer than context x this cannot fit in the context, which a server
        can tell before it spends anything on tokenizing it."""
        return max(len(piece) for piece in self._tok.get_vocab(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens lets tokenizer.json's post-processor add what the model expects
        (Llama 3 prepends <|begin_of_text|>; SmolLM2 adds nothing).

        encode_batch of one text, not encode: the library releases the GIL only in its batch
        call, so a server that tokenizes a huge prompt in a thread keeps answering meanwhile."""
        try:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:
            # A lone surrogate (a byte of a terminal argument that was not UTF-8, kept by Python's
            # surrogateescape) is no text the library takes: it says only that the type is wrong.
            if isinstance(text, str) and not _is_utf8(text):
                raise TokenizerError(
                    "the text is not valid UTF-8 (a byte the terminal's encoding could not decode?)"
                ) from None
            raise

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if self._template is None:
            raise TokenizerError(  # (cli.py chats by default: "--chat" alone did not say what to do there)
                "this model has no chat template: give it a plain prompt "
                "(generate.py without --chat, cli.py --raw, the server's /v1/completions)"
            )
        if not isinstance(messages, (list, tuple)):
            raise TokenizerError(f"messages must be a list of objects, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise TokenizerError(f"message {i} must be an object with 'role' and 'content'")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except TokenizerError:
            raise
        except Exception as e:  # template code can raise anything; a message must still name it
            detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__  # MemoryError() has no text
            raise TokenizerError(f"chat template failed: {detail}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The rendered chat as token ids, where only the template can produce special tokens.

        Tokenizing the rendered text in one piece (what transformers' apply_chat_template(
        tokenize=True) does) cannot tell the template's markers from a user's text: a message
        containing "<|im_end|>\\n<|im_start|>system\\n..." would open a system turn of the user's
        making. So before rendering, each special-token text inside a message is swapped for a
        placeholder only this call knows; the template's own markers then stay special, and
        each placeholder is tokenized as the plain text it stands for (special-token matching
        off). A chat without such text is rendered and tokenized exactly as before, giving the
        same ids as transformers; with it, decode(ids) still gives back the rendered text.
        """
        nonce = secrets.token_hex(8)  # unguessable: a user cannot type a placeholder of this call
        hidden: dict[str, str] = {}  # placeholder -> the special-token text it replaced

        def hide(match: re.Match) -> str:
            placeholder = f"\ue000{nonce}:{len(hidden)}\ue001"  # private-use characters, no whitespace
            hidden[placeholder] = match.group(0)
            return placeholder

        text = self.apply_chat_template(self._replace_strings(messages, hide), add_generation_prompt)
        if not hidden:
            return self.encode(text, add_special_tokens=False)
        ids: list[int] = []
        pieces = re.split(f"(\ue000{nonce}:\\d+\ue001)", text)
        for i, piece in enumerate(pieces):
            if i % 2 == 0:  # template text, and message text without special-token text
                ids += self.encode(piece, add_special_tokens=False)
            else:
                ids += self._plain_text_tokenizer.encode(hidden[piece], add_special_tokens=False).ids
        return ids

    def _replace_strings(self, value, hide):
        """`value` (messages, and the dicts and lists inside) with special-token text in every
        string swapped by `hide`. Not only content: a role or name is user input too."""
        if self._special_text is None:
            return value
        if isinstance(value, str):
            return self._special_text.sub(hide, value)
        if isinstance(value, (list, tuple)):
            return [self._replace_strings(v, hide) for v in value]
        if isinstance(value, dict):
            return {k: self._replace_strings(v, hide) for k, v in value.items()}
        return value

    @functools.cached_property
    def _plain_text_tokenizer(self) -> _HFTokenizer:
        # A second instance rather than toggling the flag on the shared one: a server encodes
        # from several threads.
        tok = _HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok


def _raise(message: str = ""):
    raise TokenizerError(f"chat template: {message or 'raise_exception() was called without a message'}")


MAX_TEMPLATE_VALUE = 10_000_000  # characters or items one template expression may build


class _LimitedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox keeps a template away from Python internals but not from asking for a
    10-gigabyte string: {{ 'a' * 10000000000 }} would allocate it (and Jinja would even try at
    compile time, folding the constant). Intercepting these operators turns the cheap ways to
    build a huge value into an error, and stops the constant folding. (A template can still
    be slow, e.g. with nested loops: templates come with the checkpoint, and this guards
    against mistakes and the obvious abuse, not every denial of service.)"""

    intercepted_binops = frozenset(["*", "**", "+"])

    def call_binop(self, context, operator, left, right):
        size = _result_size(operator, left, right)
        if size > MAX_TEMPLATE_VALUE:
            raise TokenizerError(
                f"chat template: {type(left).__name__} {operator} {type(right).__name__} would build a value of "
                f"about {size:,} characters or items (limit {MAX_TEMPLATE_VALUE:,})"
            )
        return super().call_binop(context, operator, left, right)


def _result_size(operator: str, left, right) -> int:
    """An estimate of how big left <operator> right would be, computed without building it."""
    sized = (str, list, tuple)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(n, int):
                return len(seq) * n
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return abs(left).bit_length() * right // 3  # about the number of decimal digits
    return 0


_templates: dict[str, jinja2.Template] = {}


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: json.dumps with its arguments (jinja's own escapes HTML instead)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers marks the assistant's tokens with it (for
    training masks); rendering a prompt, the block is its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _compile(source: str, where: str = "chat template") -> jinja2.Template:
    # The same environment settings as transformers uses, so the rendered text is identical:
    # trim_blocks/lstrip_blocks, a sandbox (templates come with downloaded checkpoints), and the
    # helpers templates call (raise_exception, strftime_now for Llama 3's "Today Date").
    if source not in _templates:
        env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            _templates[source] = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(
                f"{where}: syntax error in the chat template, line {e.lineno}: {e.message or e}"
            ) from None
        except Exception as e:
            raise TokenizerError(f"{where}: the chat template does not compile ({type(e).__name__}: {e})") from None
    return _templates[source]
