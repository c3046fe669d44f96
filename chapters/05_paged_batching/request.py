"""The request side of the engine: what a client asks for, what it may ask for, and how each new
token becomes text or ends a choice.

    Request        prompt ids, sampling params, max/min tokens, n choices, stop rules
    RequestLimits  validate(): every refusal a client can get, with the reason; how many tokens a
                   request may generate, and how many KV blocks it holds at its longest
    RequestState   a running request: its n sequences and its stop tokens
    append_token   one new token of a sequence through the stop rules -> an Event
                   (EOS / stop_token_ids / stop strings / max_tokens, as in chapter 03)
    append_tokens  a step's new tokens of a sequence -> one Event (a server streams one chunk per step)

Nothing here runs the model or touches the KV pool: the engine (engine.py) owns the step, the
model runner (runner.py) the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from block_manager import BlockManager
from common.errors import FieldError, UserError
from detokenizer import IncrementalDetokenizer
from sampling import NoTokenError, SamplingParams, TokenLogprob
from sequence import Sequence
from stopping import MAX_STOP_CHARS, StopStringMatcher

# What a request that sets no max_tokens may generate. Up to the end of the context would let one
# chat without max_tokens hold the worker for 8192 tokens (minutes on a CPU) when most replies
# end far sooner; a client that wants more says so.
DEFAULT_MAX_TOKENS = 1024


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


@dataclass
class Output:
    """A choice as its events arrive: `generate`'s result, a server's non-streaming reply."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, event: Event) -> None:
        self.text += event.text
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs
        self.finish_reason = event.finish_reason or self.finish_reason


@dataclass
class RequestState:
    request: Request
    seqs: list[Sequence]
    stop_ids: set[int]  # EOS (unless ignore_eos) and the request's stop_token_ids
    n_finished: int = 0
    _stop_mask: torch.Tensor | None = field(default=None, repr=False, compare=False)  # built on first use

    @property
    def done(self) -> bool:
        return self.n_finished == len(self.seqs)

    def too_early_to_stop(self, seq: Sequence) -> int:
        """How many more tokens `seq` must generate before a stop token may end it (min_tokens)."""
        return max(0, self.request.min_tokens - len(seq.output)) if self.stop_ids else 0

    def stop_mask(self, vocab_size: int, device) -> torch.Tensor:
        """[vocab] bool, True at the stop tokens: what min_tokens bans while it is too early."""
        if self._stop_mask is None:
            self._stop_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._stop_mask[list(self.stop_ids)] = True
        return self._stop_mask


class RequestLimits:
    """What a request may ask of this engine: the context, the vocabulary, the KV pool."""

    def __init__(self, context: int, max_tokens_default: int, vocab_size: int, eos_ids: set[int], blocks: BlockManager):
        if max_tokens_default < 1:
            raise UserError(f"max_tokens_default must be at least 1, got {max_tokens_default}")
        self.context = context
        self.max_tokens_default = max_tokens_default
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.blocks = blocks

    def stop_ids(self, req: Request) -> set[int]:
        return set(req.stop_token_ids) | (set() if req.ignore_eos else self.eos_ids)

    def max_tokens_for(self, req: Request) -> int:
        """How many tokens `req` may generate: its max_tokens, or the default within the context and
        within what the KV pool holds for all its choices at once (see pool_blocks_for)."""
        if req.max_tokens is not None:
            return req.max_tokens
        n_prompt, bs, shared = len(req.prompt_ids), self.blocks.block_size, self.shared_blocks(req)
        fits = (shared + (self.blocks.num_blocks - shared) // max(req.n, 1)) * bs - n_prompt + 1  # see pool_blocks_for
        return max(1, min(self.max_tokens_default, self.context - n_prompt, fits))

    def shared_blocks(self, req: Request) -> int:
        """The prompt blocks `req`'s choices share (they fork from one prefill). They fork before the
        prompt's last token (each computes it for its own logits: scheduler.py), so the block that
        holds it is each choice's own even when the prompt fills it."""
        return (len(req.prompt_ids) - 1) // self.blocks.block_size

    def pool_blocks_for(self, req: Request) -> int:
        """KV blocks `req` holds when all its choices are at their longest: the shared prompt blocks
        once, the rest for each choice. A choice's last token is never cached (nothing reads it:
        generation ends there), so a choice caches its prompt and all but one of its tokens."""
        shared, cached = self.shared_blocks(req), len(req.prompt_ids) + self.max_tokens_for(req) - 1
        return shared + req.n * (self.blocks.blocks_for(cached) - shared)

    def validate(self, req: Request) -> None:
        """Raises UserError with a message fit for the client."""
        req.params.validate(self.vocab_size)
        n_prompt = len(req.prompt_ids)
        if n_prompt == 0:
            raise FieldError("the prompt is empty", "prompt")
        # the tokenizer may know more ids than the model has rows of embedding for
        outside = [t for t in req.prompt_ids if not 0 <= t < self.vocab_size]
        if outside:
            raise FieldError(
                f"prompt token ids {outside[:5]} are outside the model's vocabulary (0..{self.vocab_size - 1})",
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
        bad = [t for t in req.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            vocab = f"0..{self.vocab_size - 1}"
            raise FieldError(f"stop_token_ids {bad} are outside the vocabulary ({vocab})", "stop_token_ids")
        if req.min_tokens > 0 and len(self.stop_ids(req)) >= self.vocab_size:
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
        # The whole request must fit the pool at once: a choice that fits alone while all n do not
        # would be preempted again and again, and the requests behind it starve.
        n_new = self.max_tokens_for(req)
        n_cached, slots = n_prompt + n_new - 1, self.blocks.num_blocks * self.blocks.block_size  # see pool_blocks_for
        if self.blocks.blocks_for(n_cached) > self.blocks.num_blocks:
            raise FieldError(
                f"this request needs room for {n_cached} tokens ({n_prompt} in the prompt, "
                f"{n_new - 1} of the {n_new} to generate: the last is never cached), but this server's KV cache "
                f"holds {slots} tokens: lower max_tokens or the prompt's length",
                "max_tokens",
            )
        if self.pool_blocks_for(req) > self.blocks.num_blocks:
            raise FieldError(
                f"this request's {req.n} choices need {self.pool_blocks_for(req)} blocks of {self.blocks.block_size} "
                f"tokens at once ({n_prompt} prompt tokens shared, up to {self.max_tokens_for(req)} each to "
                f"generate), but this server's KV cache holds {self.blocks.num_blocks}: lower n or max_tokens",
                "n",
            )


def append_token(
    seq: Sequence, token: int, logprob: TokenLogprob | None, stop_ids: set[int], min_tokens: int = 0
) -> Event:
    """`token` is `seq`'s next: through the stop rules into the sequence and its text."""
    lps = [logprob] if logprob is not None else []
    if token in stop_ids:
        # The stop token is not part of the text; what the matcher held back is.
        return Event(seq.index, _remaining_text(seq.detokenizer, seq.matcher), [token], lps, "stop")
    seq.append(token)
    delta = seq.detokenizer.add(token)
    # No stop rule before min_tokens, stop strings included (vLLM's rule): that text is not searched.
    text, hit = (delta, False) if len(seq.output) < min_tokens else seq.matcher.feed(delta)
    if hit:
        return Event(seq.index, text, [token], lps, "stop")
    if len(seq.output) >= seq.max_tokens:
        text += _remaining_text(seq.detokenizer, seq.matcher)
        # flush() may still find a stop string that only the end of the text could confirm
        return Event(seq.index, text, [token], lps, "stop" if seq.matcher.stopped else "length")
    return Event(seq.index, text, [token], lps)


def append_tokens(seq: Sequence, tokens: list[int], logprobs: list, stop_ids: set[int], min_tokens: int = 0) -> Event:
    """A step's new tokens of `seq` (one, or a run of verified guesses) through the stop rules, as
    one Event; a stop ends the choice there and drops the tokens after it."""
    step = Event(seq.index, "", [], [])
    for token, logprob in zip(tokens, logprobs):
        event = append_token(seq, token, logprob, stop_ids, min_tokens)
        step.text += event.text
        step.token_ids += event.token_ids
        step.logprobs += event.logprobs
        step.finish_reason = event.finish_reason
        if event.finish_reason is not None:
            break
    return step


def no_token_error(seq: Sequence) -> NoTokenError:
    """What ends a request whose logits row had no finite logit (a row sample() cannot draw from: an
    overflow, float16's on a GPU say). Its request alone fails; a step's other rows are computed row
    by row, and go on."""
    return NoTokenError("the model gave this request no finite logit: nothing can be sampled")


def _remaining_text(detok: IncrementalDetokenizer, matcher: StopStringMatcher) -> str:
    """At the end of a choice: what the detokenizer still holds (an unfinished character), passed
    through the stop-string matcher like any other text, then what the matcher held back."""
    text, hit = matcher.feed(detok.flush())
    return text if hit else text + matcher.flush()
