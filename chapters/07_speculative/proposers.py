"""Who guesses the next k tokens: the proposers of speculative decoding.

A decode step reads every weight of the model to produce one token. Scoring k+1 tokens in one
step reads the same weights once, so if something cheap can guess what the model would say next,
the model can check k guesses for about the price of one token, and keep the ones it agrees with
(speculative.py). A proposer is that cheap guesser, asked once per step for every sequence that
decodes:

    propose(sequences, ks) -> one Draft per sequence: up to k tokens that would follow its tokens

A draft may be shorter, or empty (that sequence then decodes one token as in chapter 06).

- NgramProposer (prompt lookup): the continuation of an earlier occurrence of the last few
  tokens. No model; deterministic, so its q is all on its guess (Draft.probs None).
- DraftModelProposer: a smaller or cheaper model (the same checkpoint in int4 drafting for its
  bf16 self, or Llama-3.2-1B for Llama-3.1-8B) runs k decode steps of its own. Its K/V live in a
  pool of its own with the target's geometry, addressed through the target's block tables: one
  block manager decides where a token's K/V live in both pools, so a preemption, a fork or a
  rolled-back draft needs no second bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from batch import Work
from block_manager import BlockManager
from common.cli import positive_int
from common.errors import UserError
from common.tokenizer import Tokenizer
from loading import load, resolve
from memory import check_fits, default_kv_bytes
from model import Model
from quant import QuantSpec
from runner import ModelRunner
from sampling import GREEDY_BELOW, draw, finite_logits, row_max
from scheduler import chunk_limit
from sequence import Sequence
from weights import spec_of
from speculative import target_probs


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = (
        None  # [len(tokens), vocab]: q, the distribution each was drawn from; None: a sure guess
    )


class NgramProposer:
    """Prompt lookup: if the last n tokens appeared earlier in the sequence, guess that what
    followed them then follows them now.

    Output that copies its input (a rewrite, a code edit, a summary quoting its source, an answer
    naming the question's terms) is full of such repeats, and the guess costs a scan of the token
    list, no model. The longest n from `max_n` down to `min_n` that matches wins (a longer match is
    a more specific context, so its continuation is more likely right), and of its occurrences the
    most recent (the nearest context; in a rewrite, the place being copied from)."""

    def __init__(self, min_n: int = 2, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def describe(self) -> str:
        return f"prompt lookup ({self.min_n}- to {self.max_n}-grams)"

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(self.guess(seq.tokens, k)) for seq, k in zip(seqs, ks)]

    def guess(self, tokens: list[int], k: int) -> list[int]:
        if k < 1:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._last_earlier_match(tokens, n)
            if start is not None:
                # What followed the match, up to k tokens (it may run into the suffix itself: a
                # repeating pattern then proposes its own continuation).
                return tokens[start + n : start + n + k]
        return []

    @staticmethod
    def _last_earlier_match(tokens: list[int], n: int) -> int | None:
        """The start of the latest occurrence of the last n tokens that ends before the sequence
        does (so something follows it), or None."""
        suffix = tokens[-n:]
        last = suffix[-1]
        # Scan backwards for the suffix's last token, then compare the rest: most positions fail on
        # that one comparison, so the scan is about one list walk per call.
        i = len(tokens) - 2  # where a match's last token may sit: before the sequence's own last
        while i >= n - 1:
            if tokens[i] == last and tokens[i - n + 1 : i + 1] == suffix:
                return i - n + 1
            i -= 1
        return None


class DraftModelProposer:
    """A draft model guesses by decoding: k steps of its own for every speculating sequence at
    once, greedy for greedy requests, else sampled from its own distribution q (the request's
    temperature, top-k, top-p and min-p on the draft's logits), which the acceptance rule needs.

    What the draft has run of a sequence is `seq.draft_computed` tokens, but only those the target
    has computed too are sure to be the sequence's (past them lie guesses the target may have
    rejected, or nothing after a preemption): each propose first runs the tokens from
    min(draft_computed, n_computed) on in one chunk (the prompt, at first; after a verify, the
    target's new token and perhaps the last kept guess), whose last row gives the first guess.

    That catch-up is chunked like the target's prefill: at most `catch_up_tokens` a step over all
    sequences, fewer deep into a long context (scheduler.chunk_limit). A sequence further behind
    runs a chunk and guesses nothing this step, so a long prompt neither stalls the other streams
    nor holds a prompt-sized activation at once."""

    def __init__(self, model: Model, name: str, catch_up_tokens: int = 256):
        self.model = model
        self.name = name
        self.catch_up_tokens = catch_up_tokens
        self.blocks: BlockManager | None = None
        self.runner: ModelRunner | None = None

    def start(self, blocks: BlockManager) -> None:
        """The target's block manager, built with the engine: the draft's pool gets a block for
        each of the target's, and a runner of its own (eager: a draft's steps vary in shape)."""
        self.blocks = blocks
        self.runner = ModelRunner(self.model, blocks.num_blocks, blocks.block_size, 1, 1, cuda_graphs=False)

    def target_share(self, kv_cache_bytes: int | None, target: Model) -> int | None:
        """The part of a KV budget (default: memory.default_kv_bytes) left to the target's pool when
        this draft mirrors it: the two split it in proportion to their bytes per token."""
        budget = kv_cache_bytes or default_kv_bytes(target.device)
        if budget is None:
            return None
        t, d = (m.config.kv_bytes_per_token(m.dtype.itemsize) for m in (target, self.model))
        return budget * t // (t + d)

    def describe(self) -> str:
        quant = self.model.quant.name if self.model.quant else "unquantized"
        gib = self.runner.cache.nbytes / 2**30 if self.runner else 0.0
        return f"draft model {self.name} ({quant} weights, {gib:.2f} GiB KV pool of its own)"

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([], None) for _ in seqs]
        budget = self.catch_up_tokens
        live, work, behind = [], [], []  # guessing now (and its first row); catching up only
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            start = min(seq.draft_computed, seq.n_computed)
            n = len(seq.tokens) - start  # to run before the first guess, the pending token last
            limit = min(budget, chunk_limit(start, self.catch_up_tokens))  # a long context's chunks shrink
            if n > limit:
                take = min(n - 1, limit)  # never the pending token: its row would be a guess
                if take > 0:
                    behind.append(Work(seq.tokens[start : start + take], start, seq.block_table))
                    seq.draft_computed = start + take
                    budget -= take
                continue
            # The draft writes K/V up to position len(tokens) + k - 2 (its last guess is not run):
            # the table must hold them before the scheduler would grow it. Where the pool is short, fewer.
            while k > 0 and not self.blocks.can_grow(seq.block_table, len(seq.tokens) + k - 1):
                k -= 1
            if k > 0:
                budget -= n
                self.blocks.grow(seq.block_table, len(seq.tokens) + k - 1)
                live.append((i, seq, k))
                work.append(Work(seq.tokens[start:], start, seq.block_table))
        if not live:
            if behind:
                self.runner.run(behind)
            return drafts
        pending = live
        rows: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in live}
        while pending:
            logits = self.runner.run(behind + work)[len(behind) :]  # the catch-up chunks ride the first pass
            behind = []
            # what each sequence has run now, and its next guess
            next_pending, next_work = [], []
            for (i, seq, k), w, row in zip(pending, work, logits):
                seq.draft_computed = w.start + len(w.tokens)
                picked = self._pick(row, seq)
                if picked is None:  # the draft's row gave no token: its guesses end here
                    continue
                token, q = picked
                drafts[i].tokens.append(token)
                rows[i].append(q)
                if len(drafts[i].tokens) < k:
                    next_pending.append((i, seq, k))
                    next_work.append(Work([token], seq.draft_computed, seq.block_table))
            pending, work = next_pending, next_work
        for i, seq, _ in live:
            if seq.params.temperature >= GREEDY_BELOW and rows[i]:
                drafts[i].probs = torch.stack(rows[i])
        return drafts

    def _pick(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None] | None:
        """The draft's next token from its logits ([vocab]), and q when the request samples; None
        where they give no token (a draft model gone to inf or NaN: its guess would be noise, and
        a draw from NaN probabilities an error that fails the whole step)."""
        x = logits.float()
        best, token = row_max(x[None])  # one pass: the greedy pick, and whether the row is finite
        if not bool(torch.isfinite(best)):  # NaN or inf somewhere: as sample() takes them
            x = finite_logits(x)
            best, token = row_max(x[None])
            if best.item() == float("-inf"):
                return None
        if seq.params.temperature < GREEDY_BELOW:
            return int(token), None
        q = target_probs(x[None], seq.params)[0]  # [vocab]
        return int(draw(q[None], [seq.generator])[0]), q


PROPOSERS = ("off", "ngram", "draft")
DRAFT_DEFAULT = "default"  # load_draft's quant when --draft-quant is left out


def check_proposer_name(name: str) -> str:
    """`name` if it is a --speculative choice, else a ValueError that lists them."""
    if name not in PROPOSERS:
        raise ValueError(f"unknown proposer {name!r}: choose one of {', '.join(PROPOSERS)}")
    return name


def make_proposer(name: str, draft: DraftModelProposer | None = None):
    """A proposer by its --speculative name: None for "off", prompt lookup for "ngram", and for
    "draft" `draft`, built on a draft model the caller loaded and checked (build_engine does)."""
    if check_proposer_name(name) == "draft" and draft is None:
        raise ValueError("--speculative draft needs its draft model")
    if name == "ngram":
        return NgramProposer()
    return draft


def build_proposer(
    name: str, target: Model, tokenizer: Tokenizer, limits: dict, draft_model: str, device, dtype, quant, matmul, kernels
):
    """The proposer `name` (make_proposer) for `target`. For "draft" it loads `draft_model` first
    (load_draft, quantized with `quant`), which then takes its part of the KV budget in `limits`
    (Engine's keyword arguments, updated) unless they set the pool's size in blocks: one budget
    pays for both pools."""
    draft = None
    if check_proposer_name(name) == "draft":
        draft = load_draft(draft_model, target, tokenizer, device, dtype, quant, matmul, kernels)
        if limits.get("num_blocks") is None:
            if limits.get("kv_cache_bytes") is not None:  # both pools come out of it: all of it must fit
                check_fits(limits["kv_cache_bytes"], target.device)
            limits["kv_cache_bytes"] = draft.target_share(limits.get("kv_cache_bytes"), target)
    return make_proposer(name, draft)


def load_draft(name: str, target: Model, target_tokenizer: Tokenizer, device, dtype, quant, matmul, kernels) -> DraftModelProposer:
    """The draft model `name` loaded like any model (loading.load, quantized with `quant`), checked
    against the target's vocabulary, as a proposer. `quant` DRAFT_DEFAULT: a checkpoint stored
    quantized (a quantized directory, a GGUF) as it is, a plain one as int4 G=32 (int8 head)."""
    stored = spec_of(resolve(name))
    if quant == DRAFT_DEFAULT:
        quant = None if stored is not None else QuantSpec(4, 32, head_bits=8)
    elif quant is not None and stored is not None and quant != stored:
        raise UserError(
            f"the draft model {name} is stored quantized ({stored.name}); --draft-quant re-quantizes only a plain "
            "checkpoint: leave it out to read the draft as stored"
        )
    try:
        # --matmul and the like are for the quantized one of the two: a plain target's load left them to the draft
        draft, draft_dir = load(name, device, dtype, quant, matmul, kernels, check_quant_flags=target.quant is None)
    except UserError as e:  # a load error names the target's flags; the draft's own are --draft-*
        raise UserError(f"the draft model {name}: {str(e).replace('--quant ', '--draft-quant ')}") from None
    check_draft(draft, target, Tokenizer(draft_dir), target_tokenizer)
    return DraftModelProposer(draft, Path(draft_dir).name)


def check_draft(draft: Model, target: Model, draft_tokenizer=None, target_tokenizer=None) -> None:
    """A draft must speak the target's vocabulary: its token ids are the target's. The model
    configs' sizes first, then (given the tokenizers) every id's token string."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise UserError(
            f"the draft model's vocabulary has {draft.config.vocab_size} tokens and the target's "
            f"{target.config.vocab_size}: a draft must use the target's tokenizer"
        )
    if draft_tokenizer is not None and target_tokenizer is not None:
        n = min(draft_tokenizer.vocab_size, target_tokenizer.vocab_size)
        differ = next((i for i in range(n) if draft_tokenizer.id_to_token(i) != target_tokenizer.id_to_token(i)), None)
        if differ is not None or draft_tokenizer.vocab_size != target_tokenizer.vocab_size:
            at = f"token {differ} is {draft_tokenizer.id_to_token(differ)!r} against {target_tokenizer.id_to_token(differ)!r}"
            raise UserError(
                f"the draft model's tokenizer is not the target's ({at if differ is not None else 'sizes differ'}): "
                "a draft must use the target's tokenizer"
            )


DEFAULT_K, DEFAULT_MAX_BATCH = 6, 2  # --num-speculative-tokens, --speculative-max-batch


def add_speculative_args(ap, default: str = "ngram") -> None:
    """The flags of the CLI and the server."""
    group = ap.add_argument_group("speculative decoding")
    group.add_argument(
        "--speculative",
        choices=PROPOSERS,
        default=default,
        help="who proposes draft tokens for the model to verify: ngram = prompt lookup, draft = a draft model "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--draft-model",
        default=None,
        help="with --speculative draft: a model with the same tokenizer (default: the model itself, quantized)",
    )
    group.add_argument(
        "--draft-quant",
        choices=["int4", "int8", "none"],
        default=None,
        help="with --speculative draft: the draft's weights, quantized on load (default: int4, or as stored "
        "for a checkpoint stored quantized or a GGUF)",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=None,
        help=f"draft tokens per sequence and step at most; each sequence adapts below it (default: {DEFAULT_K})",
    )
    group.add_argument(
        "--speculative-max-batch",
        type=positive_int,
        default=None,
        help=f"nobody speculates while more sequences than this run (default: {DEFAULT_MAX_BATCH})",
    )


def speculative_args(args) -> dict:
    """build_engine's keyword arguments from those flags."""
    for flag, value in (("--draft-model", args.draft_model), ("--draft-quant", args.draft_quant)):
        if value is not None and args.speculative != "draft":
            raise UserError(f"{flag} needs --speculative draft")
    k, most = args.num_speculative_tokens, args.speculative_max_batch
    for flag, value in (("--num-speculative-tokens", k), ("--speculative-max-batch", most)):
        if value is not None and args.speculative == "off":  # a flag that would change nothing
            raise UserError(f"{flag} needs --speculative ngram or draft")
    quants = {None: DRAFT_DEFAULT, "none": None, "int4": QuantSpec(4, 32, head_bits=8), "int8": QuantSpec(8, 32, head_bits=8)}
    return {
        "speculative": args.speculative,
        "draft_model": args.draft_model,
        "draft_quant": quants[args.draft_quant],
        "num_speculative_tokens": k or DEFAULT_K,
        "speculative_max_batch": most or DEFAULT_MAX_BATCH,
    }
