"""Many requests in, one stream of events per request out: the engine behind continuous batching.

Requests come and go; the engine never runs "a request". Each `step()`:

    drafts  = proposer.propose(...) per decoding sequence # speculative.py, proposers.py
    plan    = scheduler.schedule()                       # scheduler.py: who runs, how many tokens each
    logits  = runner.run(plan's tokens)                   # runner.py: one forward pass over the pool
    for each sequence whose tokens are all computed now:  # prefill done, or a decode step
        token = sample(its logits row, its params, ...)   # sampling.py, one batched call
    for each sequence that ran a draft:                   # its pending token + k drafts as k + 1 rows
        tokens = accept(its k + 1 logits rows, draft)     # speculative.py: kept drafts + one more
    each new token: stop on EOS / stop_token_ids / stop string / max_tokens   # request.py, as in chapter 03
    an Event per sequence with news                       # text, token ids, logprobs, finish_reason

The engine is the step and the bookkeeping around it; the request side (what a client may ask,
how a token becomes text or ends a choice) is request.py, the model and its KV pool are the model
runner's (runner.py). A request with n choices is n sequences (sequence.py) that share the
prompt's blocks. The KV cache is one pool of blocks allocated at start (paged_cache.py,
block_manager.py); a request that could never fit it is refused in `validate`. Operator limits:
`max_model_len` caps the context, `max_tokens_default` bounds a request that sets no max_tokens,
`max_num_seqs` and `max_num_batched_tokens` shape each step.

Speculative decoding (speculative.py's Speculator) gives a decoding sequence k + 1 rows in a step:
its pending token and k guesses, verified at the price of reading the weights once.

`add`, `abort` and `step` are all a server needs (worker.py drives them from one thread);
`stream` runs a single request to the end and `generate` a list of them, for scripts and tests.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Callable, Iterator

import torch

from batch import Work
from block_manager import BlockManager
from common.errors import UserError
from common.tokenizer import Tokenizer
from detokenizer import IncrementalDetokenizer
from loading import load
from memory import GiB
from model import Model
from ops import KernelFlags
from proposers import DRAFT_DEFAULT, DraftModelProposer, build_proposer, check_draft, check_proposer_name
from qmatmul import DEFAULT_PATH
from quant import QuantSpec
from request import (
    DEFAULT_MAX_TOKENS,
    Event,
    Output,
    Request,
    RequestLimits,
    RequestState,
    append_tokens,
    no_token_error,
)
from runner import ModelRunner, pool_size
from sampling import NoTokenError, SamplingParams, choice_seed, make_generator, sample
from scheduler import Scheduler
from sequence import Sequence
from speculative import Speculator
from stopping import StopStringMatcher

# (sequence, its new tokens, their logprobs or Nones): what a step decided for each sequence
NewTokens = tuple[Sequence, list[int], list]


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
        cuda_graphs: replay decode steps as CUDA graphs (runner.py) where the model's ops can.
        proposer: guesses drafts for speculative decoding (proposers.py; None: off), up to
        num_speculative_tokens per sequence and step, while at most speculative_max_batch run."""
        self.model = model
        self.tokenizer = tokenizer
        self.generation_config = generation_config or {}
        eos = self.generation_config.get("eos_token_id", list(model.config.eos_token_ids))
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | set(model.config.eos_token_ids)
        self.context = _context(model.config.max_position_embeddings, max_model_len)
        _at_least_one(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        if num_blocks is None:
            most = max_num_seqs * -(-self.context // block_size)  # more could never be used at once
            num_blocks = pool_size(model, block_size, most, kv_cache_bytes)
        max_blocks = -(-self.context // block_size)
        self.runner = ModelRunner(model, num_blocks, block_size, max_num_seqs, max_blocks, cuda_graphs)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.limits = RequestLimits(
            self.context, max_tokens_default, model.config.vocab_size, self.eos_ids, self.blocks
        )
        self.max_tokens_default = max_tokens_default
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs,
            max_num_batched_tokens if chunked_prefill else max(max_num_batched_tokens, self.context),
            chunked_prefill,
        )
        self.requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.n_steps = 0
        self.last_plan = None
        # A draft is k + 1 rows of one step: past the step's token budget the scheduler would cut what a
        # draft model spent k sequential steps guessing.
        max_k = min(num_speculative_tokens, max(1, self.scheduler.max_num_batched_tokens - 1))
        if isinstance(proposer, DraftModelProposer):  # built here, not by load_draft: its ids must be ours too
            check_draft(proposer.model, model)
        self.speculator = Speculator(proposer, self.blocks, max_k, speculative_max_batch)

    @staticmethod
    def read_generation_config(model_dir: str | Path) -> dict:
        path = Path(model_dir) / "generation_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        SamplingParams.from_generation_config(config, str(path))  # its sampling defaults checked once, here
        return config

    def default_params(self) -> SamplingParams:
        """What a request gets for every value it leaves out: the model's generation_config.json."""
        return SamplingParams.from_generation_config(self.generation_config)

    def describe_pool(self) -> str:
        return (
            f"KV cache: {self.blocks.num_blocks} blocks of {self.blocks.block_size} tokens = "
            f"{self.blocks.num_blocks * self.blocks.block_size} tokens in {self.runner.cache.nbytes / GiB:.2f} GiB"
        )

    def validate(self, req: Request) -> None:
        """Raises UserError with a message fit for the client (request.RequestLimits)."""
        self.limits.validate(req)

    # --- the server's interface -----------------------------------------------------------------

    def add(self, req: Request, request_id: str | None = None) -> str:
        """Queues a request (validated first: UserError for the client). -> its id."""
        self.validate(req)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already running")
        max_tokens = self.limits.max_tokens_for(req)
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
                    generator=make_generator(choice_seed(req.params.seed, i), self.model.device),
                    detokenizer=IncrementalDetokenizer(self.tokenizer, req.skip_special_tokens, req.prompt_ids),
                    matcher=StopStringMatcher(req.stop, req.include_stop_str_in_output),
                    parent=seqs[0] if seqs else None,
                )
            )
        self.requests[rid] = RequestState(req, seqs, self.limits.stop_ids(req))
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
    def step(self) -> list[tuple[str, list[Event] | Exception, bool]]:
        """schedule -> run -> sample -> update. -> per request with news: (request id, its events,
        whether it is finished); for a request whose logits had no token to give (NaN logits: an
        overflow, float16's on a GPU say), (request id, the error that ends it, True), the others unharmed."""
        self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        self.runner.copy_blocks(plan.copies)
        if not plan.work:
            return []
        self.n_steps += 1
        self.last_plan = plan  # for the notebook and the bench: who ran what in the latest step
        plain = [(seq, n) for seq, n in plan.work if not seq.draft]
        drafted = [seq for seq, _ in plan.work if seq.draft]
        work = [Work(seq.tokens[seq.n_computed : seq.n_computed + n], seq.n_computed, seq.block_table) for seq, n in plain]
        logits = self.runner.run(work + self.speculator.verify_rows(drafted))  # [rows, vocab]
        ready = [(row, seq) for row, (seq, n) in enumerate(plain) if self._computed(seq, n)]
        failed: dict[str, Exception] = {}  # request id -> what ends it, this step
        verified = self.speculator.verify(logits[len(plain) :], drafted, self.requests, failed)
        new_tokens = [t for t in self._sample(logits, ready, failed) + verified if t[0].request_id not in failed]
        return self._emit(new_tokens) + self._end_failed(failed)

    def _computed(self, seq: Sequence, n: int) -> bool:
        """`seq`'s n tokens of this step have K/V now. -> whether it samples its next token."""
        seq.n_computed += n
        if seq.n_computed // self.blocks.block_size > (seq.n_computed - n) // self.blocks.block_size:
            self.blocks.register(seq.block_table, seq.tokens, seq.n_computed)  # a block filled up: share it
        return seq.n_uncomputed == 0

    def _sample(self, logits: torch.Tensor, ready: list[tuple[int, Sequence]], failed: dict) -> list[NewTokens]:
        """One token for each ready sequence, from its logits row; a row with none to give fails its
        request (into `failed`) and the others are sampled without it."""
        if not ready:
            return []
        rows = [row for row, _ in ready]
        # A decode step's rows are the first ones, in order: a view then, not a gather.
        if rows == list(range(len(rows))):
            x = logits[: len(rows)]  # [ready, vocab]
        else:
            x = logits[torch.tensor(rows, device=logits.device)]  # [ready, vocab]
        seqs = [seq for _, seq in ready]
        banned = None  # [ready, vocab] bool: min_tokens makes the stop tokens impossible for now
        for i, seq in enumerate(seqs):
            state = self.requests[seq.request_id]
            if state.too_early_to_stop(seq):
                banned = torch.zeros(x.shape, dtype=torch.bool, device=x.device) if banned is None else banned
                banned[i] = state.stop_mask(x.shape[-1], x.device)
        try:
            tokens, logprobs = sample(
                x, [s.params for s in seqs], [s.generator for s in seqs], [s.prompt for s in seqs], [s.output for s in seqs],
                banned,
            )  # fmt: skip
        except NoTokenError:  # raised before any draw, so each row again on its own: the row at fault fails
            if len(ready) == 1:  # (its logits, or a penalty, left no finite one)
                failed[seqs[0].request_id] = no_token_error(seqs[0])
                return []
            return [new for one in ready for new in self._sample(logits, [one], failed)]
        return [(seq, [token], [logprob]) for seq, token, logprob in zip(seqs, tokens, logprobs)]

    def _end_failed(self, failed: dict[str, Exception]) -> list[tuple[str, Exception, bool]]:
        """The failed requests leave (their blocks freed), each with its error as its news."""
        for rid in failed:
            self.abort(rid)
        return [(rid, error, True) for rid, error in failed.items()]

    def _emit(self, new_tokens: list[NewTokens]) -> list[tuple[str, list[Event], bool]]:
        """Each sequence's new tokens through the stop rules (request.append_tokens: one Event per
        sequence and step). -> per request with news: (request id, its events, whether it is finished)."""
        news: dict[str, list[Event]] = {}
        for seq, tokens, logprobs in new_tokens:
            state = self.requests[seq.request_id]
            event = append_tokens(seq, tokens, logprobs, state.stop_ids, state.request.min_tokens)
            # A stop inside a run of kept guesses (the guesses, then the target's token): the guesses
            # after it were never given, so they do not count as kept (a kept guess is a token gained).
            self.speculator.stats.drop(len(tokens) - 1 - len(event.token_ids))
            if event.finish_reason is not None:
                self.scheduler.finish(seq)
                state.n_finished += 1
            news.setdefault(seq.request_id, []).append(event)
        out = []
        for rid, events in news.items():
            done = self.requests[rid].done
            if done:
                del self.requests[rid]
            out.append((rid, events, done))
        return out

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
                        if isinstance(events, Exception):
                            raise events
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
        try:
            while pending or self.has_work():
                while pending and arrivals[pending[0]] <= step:
                    i = pending.pop(0)
                    ids[self.add(requests[i])] = i
                for rid, events, _ in self.step():
                    if isinstance(events, Exception):
                        raise events
                    for ev in events:
                        outputs[ids[rid]][ev.index].add(ev)
                step += 1
        finally:  # a failed or refused request ends the call: the rest of its batch leaves the engine too
            for rid in ids:
                self.abort(rid)
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
            **self.speculator.stats.report(),
        }


def build_engine(
    model: str | None,
    device: str = "auto",
    dtype: str = "auto",
    quant: QuantSpec | None = None,
    matmul: str = DEFAULT_PATH,
    kernels: KernelFlags | str = KernelFlags(),
    speculative: str = "off",  # a proposer by its --speculative name (proposers.build_proposer)
    draft_model: str | None = None,
    draft_quant: QuantSpec | str | None = DRAFT_DEFAULT,
    **limits,
) -> tuple[Engine, str]:
    """Loads a model (a known name, a checkpoint directory, quantized or not, or a .gguf file),
    quantized on load when `quant` is given, onto a device, with the kernel flags (ops.from_args, or
    a --kernels choice); -> the engine, and the name to call it by. `limits` are Engine's keyword
    arguments (max_model_len, ...)."""
    check_proposer_name(speculative)  # a bad name fails before anything loads
    # An int4 draft of an unquantized target: --matmul and the like are for the draft
    loaded, model_dir = load(model, device, dtype, quant, matmul, kernels, check_quant_flags=speculative != "draft")
    tokenizer = Tokenizer(model_dir)
    proposer = build_proposer(
        speculative, loaded, tokenizer, limits, draft_model or model, device, dtype, draft_quant, matmul, kernels
    )
    engine = Engine(loaded, tokenizer, Engine.read_generation_config(model_dir), proposer=proposer, **limits)
    named = model not in (None, "") and not Path(model).exists()
    return engine, model if named else Path(model or model_dir).name


def _at_least_one(**sizes: int) -> None:
    for name, value in sizes.items():
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")


def _context(model_context: int, max_model_len: int | None) -> int:
    if max_model_len is None:
        return model_context
    if not 2 <= max_model_len <= model_context:
        raise UserError(
            f"max_model_len must be between 2 and the model's context of {model_context} tokens, got {max_model_len}"
        )
    return max_model_len
