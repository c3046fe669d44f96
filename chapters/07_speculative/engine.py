"""Many requests in, one stream of events per request out: the engine behind continuous batching.

Requests come and go; the engine never runs "a request". Each `step()`:

    drafts  = proposer.propose(tokens, k) per decoding sequence   # chapter 07: proposers.py
    plan    = scheduler.schedule()                       # scheduler.py: who runs, how many tokens each
    logits  = forward(model, plan's tokens, pool)         # model.py: one pass for every scheduled sequence
    for each sequence whose tokens are all computed now:  # prefill done, or a decode step
        token = sample(its logits row, its params, ...)   # sampling.py, one batched call
    for each sequence that ran a draft:                   # chapter 07: its pending token + k drafts
        tokens = accept(its k + 1 logits rows, draft)     # speculative.py: kept drafts + one more
        K/V of rejected drafts rolled back                # block_manager.truncate
    each new token: stop on EOS / stop_token_ids / stop string / max_tokens, as in chapter 03
        an Event for its request                          # text, token ids, logprobs, finish_reason

Speculative decoding (chapter 07) gives a decoding sequence k + 1 rows in a step instead of one:
its pending token and k guesses of what follows, each row a decode at the next position. The step
reads the weights once for all of them, and the sequence keeps as many guesses as the model agrees
with, plus the model's own next token. Sequences with and without drafts share a step. Above
`speculative_max_batch` running sequences nobody speculates: a batch already reads each weight
once for many tokens, and the rejected guesses would only add work.

A request with n choices is n sequences (sequence.py) that share the prompt's blocks. The KV
cache is one pool of blocks allocated at start (paged_cache.py, block_manager.py); a request
that could never fit it is refused in `validate`. Operator limits: `max_model_len` caps the
context, `max_tokens_default` bounds a request that sets no max_tokens, `max_num_seqs` and
`max_num_batched_tokens` shape each step.

`add`, `abort` and `step` are all a server needs (worker.py drives them from one thread);
`stream` runs a single request to the end and `generate` a list of them, for scripts and tests.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from batch import Work, build_step
from block_manager import BlockManager
from common.errors import UserError
from common.tokenizer import Tokenizer
from cuda_graphs import DecodeGraphs
from detokenizer import IncrementalDetokenizer
from loading import load
from memory import GiB, default_kv_bytes
from model import Model, forward
from ops import Kernels
from paged_cache import PagedKVCache
from proposers import DraftModelProposer, check_draft, make_proposer
from qmatmul import DEFAULT_PATH
from quant import QuantSpec
from sampling import SamplingParams, TokenLogprob, choice_seed, make_generator, sample, token_logprobs
from scheduler import Scheduler
from sequence import Sequence
from speculative import accept, target_logits
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
    token_ids: list[int]  # tokens this event accounts for (chapter 07: several when drafts were kept)
    logprobs: list[TokenLogprob]  # one per token in token_ids, when requested
    finish_reason: str | None = None  # "stop" or "length" on the last event of a choice


# What a request that sets no max_tokens may generate. Up to the end of the context would let one
# chat without max_tokens hold the worker for 8192 tokens (minutes on a CPU) when most replies
# end far sooner; a client that wants more says so.
DEFAULT_MAX_TOKENS = 1024


@dataclass
class Output:
    """A finished choice, for `generate`."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class RequestState:
    request: Request
    seqs: list[Sequence]
    stop_ids: set[int]  # EOS (unless ignore_eos) and the request's stop_token_ids
    n_finished: int = 0

    @property
    def done(self) -> bool:
        return self.n_finished == len(self.seqs)


class Engine:
    def __init__(
        self,
        model: Model,
        tokenizer,
        generation_config: dict | None = None,
        *,
        max_model_len: int | None = None,
        max_tokens_default: int = DEFAULT_MAX_TOKENS,
        kv_cache_bytes: int | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 256,
        chunked_prefill: bool = True,
        prefix_caching: bool = True,
        cuda_graphs: bool = True,
        proposer=None,
        num_speculative_tokens: int = 6,
        speculative_max_batch: int = 2,
    ):
        """max_model_len: the context, at most the model's (default: the model's).
        The pool: `num_blocks` blocks of `block_size` tokens, or as many as `kv_cache_bytes` hold
        (default: memory.default_kv_bytes), never more than max_num_seqs full contexts.
        Steps: at most `max_num_seqs` sequences and `max_num_batched_tokens` new tokens each;
        without chunked prefill a prompt runs whole, so the token budget becomes the context.
        cuda_graphs: replay decode steps as CUDA graphs (cuda_graphs.py) where the model's ops can
        (on CUDA, with the kernels); False: every step eagerly.
        proposer: guesses drafts for speculative decoding (proposers.py; None: off), up to
        num_speculative_tokens per sequence and step, while at most speculative_max_batch
        sequences run."""
        self.model = model
        self.tokenizer = tokenizer
        self.generation_config = generation_config or {}
        eos = self.generation_config.get("eos_token_id", list(model.config.eos_token_ids))
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | set(model.config.eos_token_ids)
        self.context = _context(model.config.max_position_embeddings, max_model_len)
        if max_tokens_default < 1:
            raise UserError(f"max_tokens_default must be at least 1, got {max_tokens_default}")
        self.max_tokens_default = max_tokens_default
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if value < 1:
                raise UserError(f"{name} must be at least 1, got {value}")
        model.ops.check_block_size(block_size)
        if num_blocks is None:
            most = max_num_seqs * -(-self.context // block_size)  # more could never be used at once
            budget = kv_cache_bytes if kv_cache_bytes is not None else default_kv_bytes(model.device)
            num_blocks = (
                most
                if budget is None
                else min(most, PagedKVCache.blocks_in(budget, model.config, block_size, model.dtype))
            )
        if num_blocks < 1:
            raise UserError(f"the KV cache budget holds no block of {block_size} tokens: raise --kv-cache-memory-gb")
        graphs = cuda_graphs and model.ops.can_capture_graphs
        # With graphs, one block more than the block manager knows: padding sequences write there.
        self.cache = PagedKVCache(
            model.config, num_blocks + 1 if graphs else num_blocks, block_size, model.device, model.dtype
        )
        self.graphs = (
            DecodeGraphs(model, self.cache, max_num_seqs, -(-self.context // block_size), num_blocks, capture=True)
            if graphs
            else None
        )
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs,
            max_num_batched_tokens if chunked_prefill else max(max_num_batched_tokens, self.context),
            chunked_prefill,
        )
        if num_speculative_tokens < 1 or speculative_max_batch < 1:
            raise UserError(
                "num_speculative_tokens and speculative_max_batch must be at least 1, got "
                f"{num_speculative_tokens} and {speculative_max_batch}"
            )
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.speculative_max_batch = speculative_max_batch
        self.spec = SpeculationStats()
        self.requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.n_steps = 0
        self.last_plan = None
        self._masks: dict = {}  # (stop ids, device) -> [vocab] bool mask, for min_tokens

    @staticmethod
    def read_generation_config(model_dir: str | Path) -> dict:
        path = Path(model_dir) / "generation_config.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def default_params(self) -> SamplingParams:
        """What a request gets for every value it leaves out: the model's generation_config.json."""
        return SamplingParams.from_generation_config(self.generation_config)

    def max_tokens_for(self, req: Request) -> int:
        """How many tokens `req` may generate: its max_tokens, or the default within the context and
        within what the KV pool holds for all its choices at once (see pool_blocks_for)."""
        if req.max_tokens is not None:
            return req.max_tokens
        n_prompt, bs = len(req.prompt_ids), self.blocks.block_size
        shared = n_prompt // bs
        fits = (shared + (self.blocks.num_blocks - shared) // max(req.n, 1)) * bs - n_prompt
        return max(1, min(self.max_tokens_default, self.context - n_prompt, fits))

    def pool_blocks_for(self, req: Request) -> int:
        """KV blocks `req` holds when all its choices are at their longest: the prompt's full blocks
        are shared (the choices fork from one prefill), the rest is each choice's own."""
        n_prompt = len(req.prompt_ids)
        shared = n_prompt // self.blocks.block_size
        return shared + req.n * (self.blocks.blocks_for(n_prompt + self.max_tokens_for(req)) - shared)

    def describe_pool(self) -> str:
        return (
            f"KV cache: {self.blocks.num_blocks} blocks of {self.blocks.block_size} tokens = "
            f"{self.blocks.num_blocks * self.blocks.block_size} tokens in {self.cache.nbytes / GiB:.2f} GiB"
        )

    def describe_speculation(self) -> str:
        if self.proposer is None:
            return "speculative decoding off"
        return (
            f"speculative decoding: {self.proposer.describe()}, up to {self.num_speculative_tokens} draft tokens "
            f"per sequence while at most {self.speculative_max_batch} sequences run"
        )

    def validate(self, req: Request) -> None:
        """Raises UserError with a message fit for the client."""
        req.params.validate(self.model.config.vocab_size)
        n_prompt = len(req.prompt_ids)
        if n_prompt == 0:
            raise UserError("the prompt is empty")
        if req.n < 1 or req.n > 16:
            raise UserError(f"n must be between 1 and 16, got {req.n}")
        if req.max_tokens is not None and req.max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1, got {req.max_tokens}")
        if req.min_tokens < 0 or (req.max_tokens is not None and req.min_tokens > req.max_tokens):
            raise UserError(f"min_tokens must be between 0 and max_tokens, got {req.min_tokens}")
        if any(not isinstance(s, str) or not s for s in req.stop) or len(req.stop) > 16:
            raise UserError("stop must be a string or a list of at most 16 non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in req.stop):
            longest = max(len(s) for s in req.stop)
            raise UserError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {longest}")
        bad = [t for t in req.stop_token_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise UserError(f"stop_token_ids {bad} are outside the vocabulary (0..{self.model.config.vocab_size - 1})")
        if req.min_tokens > 0 and len(self._stop_ids(req)) >= self.model.config.vocab_size:
            raise UserError("min_tokens blocks the stop tokens, and stop_token_ids leave no other token to generate")
        if n_prompt >= self.context:
            raise UserError(f"the prompt has {n_prompt} tokens, but this model's context is {self.context} tokens")
        if req.max_tokens is not None and n_prompt + req.max_tokens > self.context:
            raise UserError(
                f"this model's context is {self.context} tokens, but {n_prompt + req.max_tokens} were requested "
                f"({n_prompt} in the prompt, {req.max_tokens} to generate): lower max_tokens"
            )
        # The whole request must fit the pool at once: a choice that fits alone while all n do not
        # would be preempted again and again, and the requests behind it starve.
        n_tokens = n_prompt + self.max_tokens_for(req)
        slots = self.blocks.num_blocks * self.blocks.block_size
        if self.blocks.blocks_for(n_tokens) > self.blocks.num_blocks:
            raise UserError(
                f"this request needs room for {n_tokens} tokens ({n_prompt} in the prompt, "
                f"{self.max_tokens_for(req)} to generate), but this server's KV cache holds {slots} "
                f"tokens: lower max_tokens or the prompt's length"
            )
        if self.pool_blocks_for(req) > self.blocks.num_blocks:
            raise UserError(
                f"this request's {req.n} choices need {self.pool_blocks_for(req)} blocks of {self.blocks.block_size} "
                f"tokens at once ({n_prompt} prompt tokens shared, up to {self.max_tokens_for(req)} each to "
                f"generate), but this server's KV cache holds {self.blocks.num_blocks}: lower n or max_tokens"
            )

    # --- the server's interface -----------------------------------------------------------------

    def add(self, req: Request, request_id: str | None = None) -> str:
        """Queues a request (validated first: UserError for the client). -> its id."""
        self.validate(req)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already running")
        device = self.model.device
        max_tokens = self.max_tokens_for(req)
        seqs = []
        for i in range(req.n):
            seqs.append(
                Sequence(
                    seq_id=next(self._ids),
                    request_id=rid,
                    index=i,
                    prompt=list(req.prompt_ids),
                    max_tokens=max_tokens,
                    params=req.params,
                    # n>1 with a seed: each choice gets its own stream, reproducibly.
                    generator=make_generator(choice_seed(req.params.seed, i), device),
                    detokenizer=IncrementalDetokenizer(self.tokenizer, req.skip_special_tokens, req.prompt_ids),
                    matcher=StopStringMatcher(req.stop, req.include_stop_str_in_output),
                    parent=seqs[0] if seqs else None,
                    spec_k=self.num_speculative_tokens,
                )
            )
        self.requests[rid] = RequestState(req, seqs, self._stop_ids(req))
        for seq in seqs:
            self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        """The client is gone: its sequences leave the queues and their blocks are freed now."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for seq in state.seqs:
                self.scheduler.finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @torch.inference_mode()
    def step(self) -> list[tuple[str, list[Event], bool]]:
        """One forward pass over the scheduled sequences. -> per request with news:
        (request id, its events, whether it is finished)."""
        self._propose()
        plan = self.scheduler.schedule()
        for src, dst in plan.copies:
            self.cache.copy_block(src, dst)
        if not plan.work:
            return []
        self.n_steps += 1
        self.last_plan = plan  # for the notebook and the bench: who ran what in the latest step
        bs = self.blocks.block_size
        work = []
        for seq, n in plan.work:
            if seq.draft:
                work += self._verify_rows(seq)
            else:
                work.append(Work(seq.tokens[seq.n_computed : seq.n_computed + n], seq.n_computed, seq.block_table))
        if self.graphs is not None and all(len(w.tokens) == 1 for w in work) and self.graphs.bucket(len(work)):
            logits = self.graphs.run(work)  # a decode step: one replay
        else:
            logits = forward(self.model, build_step(work, bs, self.model.device), self.cache)  # [rows, vocab]
        ready, verify = [], []  # (first logits row, sequence): sequences that sample / that verify a draft
        row = 0
        for seq, n in plan.work:
            if seq.draft:
                verify.append((row, seq))  # its n_computed moves by what is kept (_verify)
                row += 1 + len(seq.draft)
                continue
            seq.n_computed += n
            if seq.n_computed // bs > (seq.n_computed - n) // bs:  # a block filled up: share it
                self.blocks.register(seq.block_table, seq.tokens, seq.n_computed)
            if seq.n_uncomputed == 0:
                ready.append((row, seq))
            row += 1
        new_tokens = (self._sample(logits, ready) if ready else []) + self._verify(logits, verify)
        return self._emit(new_tokens)

    def _propose(self) -> None:
        """Chapter 07: a draft for each decoding sequence, unless the batch is too large to gain."""
        running = self.scheduler.running
        speculate = self.proposer is not None and len(running) <= self.speculative_max_batch
        seqs, ks = [], []
        for seq in running:
            seq.draft, seq.draft_probs = [], None
            if not speculate or seq.n_uncomputed != 1:
                continue  # still in its prompt, or recomputing after a preemption
            # The pending token and the drafts all become output if every draft is kept, plus one
            # more: the drafts may take what max_tokens leaves, less one.
            k = min(seq.spec_k, seq.max_tokens - len(seq.output) - 1)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if seqs:
            for seq, k, draft in zip(seqs, ks, self.proposer.propose(seqs, ks)):
                seq.draft = list(draft.tokens[:k])
                seq.draft_probs = None if draft.probs is None else draft.probs[:k]

    @staticmethod
    def _verify_rows(seq: Sequence) -> list[Work]:
        """Chapter 07: a sequence's pending token and its k drafts as k + 1 rows of one token each,
        at consecutive positions of its block table. Each row attends to the keys up to its own
        position, which the step writes before any layer reads them: the causal mask of a chunk,
        but as decodes, so the step stays on the decode path (the paged decode kernel, one C++
        call per layer, CUDA graphs) and each row's logits are what a plain decode step at that
        position computes: bit for bit with --batch-invariant, else up to the rounding that the
        number of rows in a step moves (chapter 06)."""
        tokens = [seq.tokens[seq.n_computed]] + seq.draft
        return [Work([t], seq.n_computed + j, seq.block_table) for j, t in enumerate(tokens)]

    def _sample(self, logits: torch.Tensor, ready: list[tuple[int, Sequence]]) -> list[tuple[Sequence, list, list]]:
        """One token for each ready sequence. -> (sequence, [token], [its logprob or None])"""
        rows = torch.tensor([row for row, _ in ready], device=logits.device)
        x = logits[rows].float()  # [ready, vocab]
        for i, (_, seq) in enumerate(ready):
            state = self.requests[seq.request_id]
            if len(seq.output) < state.request.min_tokens and state.stop_ids:
                # Too early to stop: make the stop tokens impossible for this choice.
                x[i].masked_fill_(self._id_mask(state.stop_ids, x.device)[0], float("-inf"))
        seqs = [seq for _, seq in ready]
        tokens, logprobs = sample(
            x, [s.params for s in seqs], [s.generator for s in seqs], [s.prompt for s in seqs], [s.output for s in seqs]
        )
        return [(seq, [token], [logprob]) for seq, token, logprob in zip(seqs, tokens, logprobs)]

    def _verify(self, logits: torch.Tensor, verify: list[tuple[int, Sequence]]) -> list[tuple[Sequence, list, list]]:
        """Chapter 07: for each sequence that ran its pending token and a draft of k tokens, the
        drafts the target keeps and one token of its own (speculative.py); the K/V of the rest is
        given up. -> (sequence, new tokens, their logprobs or Nones)"""
        out = []
        bs = self.blocks.block_size
        for row, seq in verify:
            k, draft = len(seq.draft), seq.draft
            state = self.requests[seq.request_id]
            rows = logits[row : row + k + 1]  # [k + 1, vocab]
            banned = None
            too_early = state.request.min_tokens - len(seq.output)  # rows whose token may not stop
            if too_early > 0 and state.stop_ids:
                banned = self._id_mask(state.stop_ids, rows.device).expand(k + 1, -1).clone()
                banned[too_early:] = False
            x = target_logits(rows, seq.params, seq.prompt, seq.output, draft, banned)
            q = None if seq.draft_probs is None else seq.draft_probs[:k]  # the scheduler may have cut the draft
            verdict = accept(x, draft, seq.params, seq.generator, q)
            self.spec.count(k, verdict.accepted)
            # The pending token and the kept drafts now have K/V in the cache; the rejected drafts'
            # slots are past n_computed (run again, so overwritten, when their positions come).
            before = seq.n_computed
            seq.n_computed += 1 + verdict.accepted
            kept = seq.tokens + draft[: verdict.accepted]
            if seq.n_computed // bs > before // bs:
                self.blocks.register(seq.block_table, kept, seq.n_computed)
            self.blocks.truncate(seq.block_table, seq.n_computed + 1)
            # Fewer guesses after a miss, more after a full hit (the schedule of HF transformers'
            # assisted generation): k follows how far this sequence's guesses tend to hold.
            if verdict.accepted == k:
                seq.spec_k = min(self.num_speculative_tokens, seq.spec_k + 2)
            else:
                seq.spec_k = max(1, seq.spec_k - 1)
            seq.draft, seq.draft_probs = [], None
            logprobs = token_logprobs(rows[: len(verdict.tokens)], [seq.params] * len(verdict.tokens), verdict.tokens)
            out.append((seq, verdict.tokens, logprobs))
        return out

    def _emit(self, new_tokens: list[tuple[Sequence, list, list]]) -> list[tuple[str, list[Event], bool]]:
        """Each sequence's new tokens through the stop rules, one Event per sequence and step (as a
        server streams it: one chunk per step); a stop inside an accepted run ends the choice there
        and drops the tokens after it."""
        news: dict[str, list[Event]] = {}
        for seq, tokens, logprobs in new_tokens:
            state = self.requests[seq.request_id]
            step = Event(seq.index, "", [], [])
            for token, logprob in zip(tokens, logprobs):
                event = self._advance(seq, token, logprob, state.stop_ids)
                step.text += event.text
                step.token_ids += event.token_ids
                step.logprobs += event.logprobs
                step.finish_reason = event.finish_reason
                if event.finish_reason is not None:
                    self.scheduler.finish(seq)
                    state.n_finished += 1
                    break
            news.setdefault(seq.request_id, []).append(step)
        out = []
        for rid, events in news.items():
            done = self.requests[rid].done
            if done:
                del self.requests[rid]
            out.append((rid, events, done))
        return out

    def _advance(self, seq: Sequence, token: int, logprob, stop_ids: set[int]) -> Event:
        lps = [logprob] if logprob is not None else []
        if token in stop_ids:
            # The stop token is not part of the text; what the matcher held back is.
            return Event(seq.index, _remaining_text(seq.detokenizer, seq.matcher), [token], lps, "stop")
        seq.append(token)
        text, hit = seq.matcher.feed(seq.detokenizer.add(token))
        if hit:
            return Event(seq.index, text, [token], lps, "stop")
        if len(seq.output) >= seq.max_tokens:
            text += _remaining_text(seq.detokenizer, seq.matcher)
            # flush() may still find a stop string that only the end of the text could confirm
            return Event(seq.index, text, [token], lps, "stop" if seq.matcher.stopped else "length")
        return Event(seq.index, text, [token], lps)

    def _stop_ids(self, req: Request) -> set[int]:
        return set(req.stop_token_ids) | (set() if req.ignore_eos else self.eos_ids)

    def _id_mask(self, ids: set[int], device) -> torch.Tensor:
        key = (frozenset(ids), str(device))
        if key not in self._masks:
            mask = torch.zeros(self.model.config.vocab_size, dtype=torch.bool, device=device)
            mask[list(ids)] = True
            self._masks[key] = mask
        return self._masks[key][None, :]

    # --- for scripts and tests ------------------------------------------------------------------

    def stream(self, req: Request, cancelled: Callable[[], bool] = lambda: False) -> Iterator[list[Event]]:
        """Runs one request to its end (with whatever else was added), yielding its events per
        step. Stops early, without a final event, when `cancelled()` turns true."""
        rid = self.add(req)
        try:
            while rid in self.requests:
                if cancelled():
                    return
                for r, events, _ in self.step():
                    if r == rid:
                        yield events
        finally:
            self.abort(rid)

    def generate(self, requests: list[Request], arrivals: list[int] | None = None) -> list[list[Output]]:
        """Runs `requests` together; request i joins at step arrivals[i] (default: all at once).
        -> per request, its n choices' outputs."""
        arrivals = arrivals or [0] * len(requests)
        pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
        outputs = [[Output() for _ in range(r.n)] for r in requests]
        ids: dict[str, int] = {}
        step = 0
        while pending or self.has_work():
            while pending and arrivals[pending[0]] <= step:
                i = pending.pop(0)
                ids[self.add(requests[i])] = i
            for rid, events, _ in self.step():
                for ev in events:
                    out = outputs[ids[rid]][ev.index]
                    out.text += ev.text
                    out.token_ids += ev.token_ids
                    out.finish_reason = ev.finish_reason or out.finish_reason
            step += 1
        return outputs

    def stats(self) -> dict:
        """What /health reports."""
        running = {seq.request_id for seq in self.scheduler.running}
        waiting = {seq.request_id for seq in self.scheduler.waiting} - running
        b = self.blocks
        return {
            "running": len(running),
            "waiting": len(waiting),
            "kv_blocks_total": b.num_blocks,
            "kv_blocks_used": b.num_used,
            "kv_blocks_free": b.num_free,
            "kv_blocks_cached": b.num_cached,
            "prefix_cache_hit_rate": round(b.hit_rate, 4),
            "preemptions": self.scheduler.n_preemptions,
            **self.spec.report(),
        }


@dataclass
class SpeculationStats:
    """Chapter 07: how well the drafts fared, for /health and the bench."""

    verifies: int = 0  # (sequence, step) pairs that ran a draft
    drafted: int = 0  # draft tokens run
    accepted: int = 0  # ... and kept

    def count(self, drafted: int, accepted: int) -> None:
        self.verifies += 1
        self.drafted += drafted
        self.accepted += accepted

    def report(self) -> dict:
        return {
            "spec_acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            # tokens a verifying sequence gains per step: the kept drafts and the target's own
            "spec_mean_accepted_length": round(1 + self.accepted / self.verifies, 4) if self.verifies else 0.0,
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
        }


def build_engine(
    model: str | None,
    device: str = "auto",
    dtype: str = "auto",
    quant: QuantSpec | None = None,
    matmul: str = DEFAULT_PATH,
    kernels: Kernels | str = Kernels(),
    speculative: str = "off",
    draft_model: str | None = None,
    draft_quant: QuantSpec | None = QuantSpec(4, 32),
    **limits,
) -> tuple[Engine, str]:
    """Loads a model (a known name, a checkpoint directory, quantized or not, or a .gguf file),
    quantized on load when `quant` is given, onto a device, with the kernel flags (ops.from_args, or
    a --kernels choice), and a proposer by its --speculative name (proposers.py): for "draft",
    `draft_model` (default: the model itself) quantized on load with `draft_quant`; -> the engine,
    and the name to call it by. `limits` are Engine's keyword arguments (max_model_len, ...)."""
    proposer = make_proposer(speculative)  # a bad name fails before the model loads
    loaded, model_dir = load(model, device, dtype, quant, matmul, kernels)
    tokenizer = Tokenizer(model_dir)
    if speculative == "draft":
        draft, draft_dir = load(draft_model or model, device, dtype, draft_quant, matmul, kernels)
        check_draft(draft, loaded, Tokenizer(draft_dir), tokenizer)
        if limits.get("num_blocks") is None:
            # The draft's pool has a block for every block of the target's: one KV budget pays for
            # both, shared in proportion to their bytes per token.
            budget = limits.get("kv_cache_bytes") or default_kv_bytes(loaded.device)
            if budget is not None:
                t, d = (m.config.kv_bytes_per_token(m.dtype.itemsize) for m in (loaded, draft))
                limits["kv_cache_bytes"] = budget * t // (t + d)
    engine = Engine(loaded, tokenizer, Engine.read_generation_config(model_dir), proposer=proposer, **limits)
    if speculative == "draft":
        engine.proposer = DraftModelProposer(draft, engine.blocks, Path(draft_dir).name)
    named = model not in (None, "") and not Path(model).exists()
    return engine, model if named else Path(model or model_dir).name


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
