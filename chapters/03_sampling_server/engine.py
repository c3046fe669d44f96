"""A request in, a stream of text out: sampling, stop rules and detokenizing around the model.

One request runs as one batch of `n` rows (its `n` choices share the prompt). The prompt runs
once, batch 1, and its cache rows and logits are copied to the n rows. Then per step:

    logits  = forward(model, last tokens)                     # [n, vocab]
    tokens  = sample(logits, params, ...)                     # sampling.py
    for each row: stop on EOS / stop_token_ids,              # unless ignore_eos, or min_tokens not reached
                  text += detokenizer.add(token)              # detokenizer.py: never half a character
                  stop on a stop string                       # stopping.py: across token boundaries;
                                                              # none before min_tokens either
                  stop at max_tokens or at the context end    # finish_reason "length"

The cache starts at the prompt plus a chunk and doubles when full (memory.py). Operator limits:
`max_model_len` caps the context, `max_tokens_default` bounds a request that sets no
max_tokens, and `memory_budget` refuses (in `validate`, before any work) a request whose
estimated memory exceeds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from common.device import pick_device, pick_dtype
from common.errors import FieldError, UserError
from common.models import resolve_model
from common.tokenizer import Tokenizer
from detokenizer import IncrementalDetokenizer
from kv_cache import KVCache
from memory import MemoryEstimate, estimate, first_capacity, next_capacity, resize, size
from model import Model, forward, load_model
from sampling import SamplingParams, TokenLogprob, choice_seed, make_generator, sample
from stopping import MAX_STOP_CHARS, StopStringMatcher


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: the engine's max_tokens_default, within the context
    min_tokens: int = 0  # EOS and stop_token_ids are blocked until this many tokens exist
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass
class Event:
    """What one step adds to one choice."""

    index: int  # which of the n choices
    text: str  # new text (may be "")
    token_ids: list[int]  # tokens this event accounts for
    logprobs: list[TokenLogprob]  # one per token in token_ids, when requested
    finish_reason: str | None = None  # "stop" or "length" on the last event of a choice


# What a request that sets no max_tokens may generate. Up to the end of the context would let one
# chat without max_tokens hold the worker for 8192 tokens (minutes on a CPU) when most replies
# end far sooner; a client that wants more says so.
DEFAULT_MAX_TOKENS = 1024


class Engine:
    def __init__(
        self,
        model: Model,
        tokenizer,
        generation_config: dict | None = None,
        *,
        max_model_len: int | None = None,
        max_tokens_default: int = DEFAULT_MAX_TOKENS,
        memory_budget: int | None = None,
    ):
        """max_model_len: the context, at most the model's (default: the model's).
        memory_budget: bytes one request may use beyond the weights (None: no check)."""
        self.model = model
        self.tokenizer = tokenizer
        self.generation_config = generation_config or {}
        eos = self.generation_config.get("eos_token_id", list(model.config.eos_token_ids))
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | set(model.config.eos_token_ids)
        self.context = _context(model.config.max_position_embeddings, max_model_len)
        if max_tokens_default < 1:
            raise UserError(f"max_tokens_default must be at least 1, got {max_tokens_default}")
        self.max_tokens_default = max_tokens_default
        self.memory_budget = memory_budget
        self._masks: dict = {}  # (stop ids, device) -> [vocab] bool mask, for min_tokens

    @staticmethod
    def read_generation_config(model_dir: str | Path) -> dict:
        path = Path(model_dir) / "generation_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        SamplingParams.from_generation_config(config, str(path))  # its sampling defaults checked once, here
        return config

    def default_params(self) -> SamplingParams:
        """What a request gets for every value it leaves out: the model's generation_config.json."""
        return SamplingParams.from_generation_config(self.generation_config)

    def max_tokens_for(self, req: Request) -> int:
        """How many tokens `req` may generate: its max_tokens, or the default within the context."""
        if req.max_tokens is not None:
            return req.max_tokens
        return min(self.max_tokens_default, self.context - len(req.prompt_ids))

    def memory_needed(self, req: Request) -> MemoryEstimate:
        return estimate(self.model.config, self.model.dtype, req.n, len(req.prompt_ids), self.max_tokens_for(req))

    def stop_ids(self, req: Request) -> set[int]:
        return set(req.stop_token_ids) | (set() if req.ignore_eos else self.eos_ids)

    def validate(self, req: Request) -> None:
        """Raises UserError with a message fit for the client."""
        req.params.validate(self.model.config.vocab_size)
        n_prompt = len(req.prompt_ids)
        if n_prompt == 0:
            raise FieldError("the prompt is empty", "prompt")
        # the tokenizer may know more ids than the model has rows of embedding for
        outside = [t for t in req.prompt_ids if not 0 <= t < self.model.config.vocab_size]
        if outside:
            raise FieldError(
                f"prompt token ids {outside[:5]} are outside the model's vocabulary "
                f"(0..{self.model.config.vocab_size - 1})",
                "prompt",
            )
        if req.n < 1 or req.n > 16:
            raise FieldError(f"n must be between 1 and 16, got {req.n}", "n")
        if req.max_tokens is not None and req.max_tokens < 1:
            raise FieldError(f"max_tokens must be at least 1, got {req.max_tokens}", "max_tokens")
        if req.min_tokens < 0 or (req.max_tokens is not None and req.min_tokens > req.max_tokens):
            raise FieldError(f"min_tokens must be between 0 and max_tokens, got {req.min_tokens}", "min_tokens")
        if any(not isinstance(s, str) or not s for s in req.stop) or len(req.stop) > 16:
            raise FieldError("stop must be a string or a list of at most 16 non-empty strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in req.stop):
            longest = max(len(s) for s in req.stop)
            said = f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {longest}"
            raise FieldError(said, "stop")
        bad = [t for t in req.stop_token_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            vocab = f"0..{self.model.config.vocab_size - 1}"
            raise FieldError(f"stop_token_ids {bad} are outside the vocabulary ({vocab})", "stop_token_ids")
        stop_ids = self.stop_ids(req)
        if req.min_tokens > 0 and len(stop_ids) >= self.model.config.vocab_size:
            raise FieldError(
                "min_tokens blocks the stop tokens, and stop_token_ids leave no other token to generate", "min_tokens"
            )
        if n_prompt >= self.context:
            raise FieldError(
                f"the prompt has {n_prompt} tokens, but this model's context is {self.context} tokens",
                "prompt",
                "context_length_exceeded",
            )
        if req.max_tokens is not None and n_prompt + req.max_tokens > self.context:
            raise FieldError(
                f"this model's context is {self.context} tokens, but {n_prompt + req.max_tokens} were requested "
                f"({n_prompt} in the prompt, {req.max_tokens} to generate): lower max_tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        self._check_memory(req)

    def _check_memory(self, req: Request) -> None:
        if self.memory_budget is None:
            return
        need = self.memory_needed(req)
        if need.total > self.memory_budget:
            raise UserError(
                f"this request would need about {need.describe()}; this server allows "
                f"{size(self.memory_budget)} per request: lower n ({req.n}), max_tokens "
                f"({self.max_tokens_for(req)}) or the prompt's length ({len(req.prompt_ids)} tokens)"
            )

    @torch.inference_mode()
    def stream(self, req: Request, cancelled: Callable[[], bool] = lambda: False) -> Iterator[list[Event]]:
        """Yields, per decode step, the events of the choices that produced text or finished.
        Stops early, without a final event, when `cancelled()` turns true (client gone)."""
        self.validate(req)
        model, n, prompt = self.model, req.n, req.prompt_ids
        max_tokens = self.max_tokens_for(req)
        n_total = len(prompt) + max_tokens  # the most slots the cache may need
        device = model.device
        # n>1 with a seed: each choice gets its own stream, reproducibly.
        generators = [make_generator(choice_seed(req.params.seed, i), device) for i in range(n)]
        stop_ids = self.stop_ids(req)
        detoks = [IncrementalDetokenizer(self.tokenizer, req.skip_special_tokens, prompt) for _ in range(n)]
        matchers = [StopStringMatcher(req.stop, req.include_stop_str_in_output) for _ in range(n)]
        outputs: list[list[int]] = [[] for _ in range(n)]
        finished = [False] * n

        cache, logits = self._prefill(prompt, n, first_capacity(len(prompt), n_total))
        while not all(finished):
            if cancelled():
                return
            banned = None  # [n, vocab] bool: too early to stop, so the short rows may not draw a stop token
            if req.min_tokens and stop_ids:
                short = torch.tensor([len(o) < req.min_tokens for o in outputs], device=device)
                banned = short[:, None] & self._id_mask(stop_ids, device)
            tokens, logprobs = sample(logits, [req.params] * n, generators, [prompt] * n, outputs, banned)
            events = []
            for i, token in enumerate(tokens):
                if finished[i]:
                    continue
                event = self._advance(
                    i, token, logprobs[i], outputs[i], detoks[i], matchers[i], stop_ids, max_tokens, req.min_tokens
                )
                finished[i] = event.finish_reason is not None
                if event.text or event.finish_reason or event.token_ids:
                    events.append(event)
            if events:
                yield events
            if not all(finished):
                if cache.length == cache.max_seq:
                    resize(cache, n, next_capacity(cache.max_seq, n_total))
                logits = forward(model, torch.tensor(tokens, device=device)[:, None], cache)[:, -1]

    def _prefill(self, prompt: list[int], n: int, capacity: int) -> tuple[KVCache, torch.Tensor]:
        """Runs the prompt once, batch 1, then gives each of the n choices a copy of its cache row
        and last logits: the choices only differ from their first sampled token on, and n passes
        over a long prompt would cost n times the time and the attention memory."""
        model = self.model
        cache = KVCache(model.config, 1, capacity, model.device, model.dtype)
        logits = forward(model, torch.tensor([prompt], device=model.device), cache, last_only=True)[:, -1]
        if n > 1:
            resize(cache, n, capacity)
        return cache, logits.float().repeat(n, 1)  # [n, vocab]: a row for each choice

    def _advance(self, i, token, logprob, output, detok, matcher, stop_ids, max_tokens, min_tokens) -> Event:
        lps = [logprob] if logprob is not None else []
        if token in stop_ids:
            # The stop token is not part of the text; what the matcher held back is.
            return Event(i, _remaining_text(detok, matcher), [token], lps, "stop")
        output.append(token)
        delta = detok.add(token)
        # No stop rule before min_tokens, stop strings included (vLLM's rule): that text is not searched.
        text, hit = (delta, False) if len(output) < min_tokens else matcher.feed(delta)
        if hit:
            return Event(i, text, [token], lps, "stop")
        if len(output) >= max_tokens:
            text += _remaining_text(detok, matcher)
            # flush() may still find a stop string that only the end of the text could confirm
            return Event(i, text, [token], lps, "stop" if matcher.stopped else "length")
        return Event(i, text, [token], lps)

    def _id_mask(self, ids: set[int], device) -> torch.Tensor:
        key = (frozenset(ids), str(device))
        if key not in self._masks:
            mask = torch.zeros(self.model.config.vocab_size, dtype=torch.bool, device=device)
            mask[list(ids)] = True
            self._masks[key] = mask
        return self._masks[key][None, :]


def build_engine(model: str | None, device: str = "auto", dtype: str = "auto", **limits) -> tuple[Engine, str]:
    """Loads a model (a known name or a checkpoint directory) onto a device; -> the engine, and
    the name to call it by. `limits` are Engine's keyword arguments (max_model_len, ...)."""
    model_dir = resolve_model(model)
    dev = pick_device(device)
    engine = Engine(
        load_model(model_dir, dev, pick_dtype(dtype, dev)),
        Tokenizer(model_dir),
        Engine.read_generation_config(model_dir),
        **limits,
    )
    return engine, model_dir.name if model in (None, "") or Path(model).is_dir() else model


def _context(model_context: int, max_model_len: int | None) -> int:
    if max_model_len is None:
        return model_context
    if not 2 <= max_model_len <= model_context:
        raise UserError(
            f"max_model_len must be between 2 and the model's context of {model_context} tokens, got {max_model_len}"
        )
    return max_model_len


def _remaining_text(detok: IncrementalDetokenizer, matcher: StopStringMatcher) -> str:
    """At the end of a choice: what the detokenizer still holds (an unfinished character), passed
    through the stop-string matcher like any other text, then what the matcher held back."""
    text, hit = matcher.feed(detok.flush())
    return text if hit else text + matcher.flush()
