"""Which draft tokens to keep: the acceptance rule of speculative decoding.

A sequence that speculates runs its pending token t0 and k draft tokens d0..d(k-1) in one step,
as k+1 rows at consecutive positions (Speculator.verify_rows). Row j's logits are the target's
next-token distribution after t0 d0 .. d(j-1): rows 0..k-1 judge the drafts, row k is a free
extra token when every draft is kept.

    greedy:   keep d_j while d_j == argmax(row j); then emit argmax of the first row that disagreed
              (or of row k). Exactly the tokens plain greedy decoding would produce.
    sampling: keep d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a
              token drawn from norm(max(0, p_j - q_j)); if all are kept, draw from p_k.

p_j is the target's distribution at row j after every knob of sampling.py that shapes it
(penalties, logit_bias, the min_tokens ban, temperature, top-k, top-p, min-p), computed with the
drafts before j counted as output (they are, if row j is reached). q_j is the proposer's
distribution for d_j; a deterministic proposer (prompt lookup) has q_j = 1 on its guess, so the
rule becomes "keep d_j with probability p_j(d_j), else draw from p_j without d_j". Leviathan et
al. (2023) and Chen et al. (2023) prove the emitted tokens are then distributed exactly as if
drawn from p one at a time: a kept draft and a residual draw together give p_j(x) for every x.

The Speculator below is the engine's one hook for all of it: it asks the proposer for drafts
before a step is scheduled, lays out the verify rows, and after the forward pass applies this rule,
rolls back the K/V of rejected drafts and adapts each sequence's k.

The draws come from the sequence's own generator. A seeded sampled request does not speculate at
all (is_seeded_sampling): its text must not depend on what else runs, and the coin flips of a
verify would make it depend on whether a step speculated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batch import Work
from block_manager import BlockManager
from common.errors import UserError
from request import RequestState, no_token_error
from sampling import (
    GREEDY_BELOW,
    NoTokenError,
    SamplingParams,
    apply_penalties,
    check_some_token_possible,
    finite_logits,
    row_max,
    sampled_probs,
    token_logprobs,
)
from sequence import Sequence


@dataclass
class Verdict:
    """What a verify step decided for one sequence."""

    tokens: list[int]  # the kept drafts, then one token of the target's: len = accepted + 1
    accepted: int  # how many drafts were kept


def target_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    draft: list[int],
    banned: torch.Tensor | None,
) -> torch.Tensor:
    """The k+1 rows of a verify chunk shaped as sampling.sample would shape each one when its
    turn came: row j sees output + draft[:j] as the output so far. banned: [k+1, vocab] bool, the
    tokens min_tokens forbids at each row (None: none).  logits [k+1, vocab] -> float32 [k+1, vocab]"""
    x = logits.to(torch.float32, copy=True)
    for j in range(x.shape[0]):
        apply_penalties(x[j], params, prompt, output + draft[:j])
    if banned is not None:
        x.masked_fill_(banned, float("-inf"))
    # As sample() does: a row's max is finite unless the row has a NaN or +inf or nothing possible,
    # and only then does finite_logits change x (two passes over it per sequence otherwise).
    if not bool(torch.isfinite(row_max(x)[0]).all()):
        x = finite_logits(x)
        check_some_token_possible(x)
    return x


def target_probs(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p_j for every row of target_logits' output, by sampling.py's own temperature and filters.
    [rows, vocab] -> [rows, vocab]"""
    return sampled_probs(x, [params] * x.shape[0])


def accept(
    x: torch.Tensor,
    draft: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> Verdict:
    """The verdict on `draft` (k tokens) from the target's shaped logits x ([k+1, vocab],
    target_logits). draft_probs: [k, vocab], the proposer's q_j; None for a deterministic proposer."""
    k = len(draft)
    if params.temperature < GREEDY_BELOW:
        best = row_max(x)[1].tolist()  # [k+1]: what greedy decoding would pick at each row
        m = 0
        while m < k and draft[m] == best[m]:
            m += 1
        return Verdict(draft[:m] + [best[m]], m)

    p = target_probs(x, params)  # [k+1, vocab]
    d = torch.tensor(draft, dtype=torch.long, device=x.device)  # [k]
    p_draft = p[:k].gather(-1, d[:, None]).squeeze(-1)  # [k]: p_j(d_j)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, d[:, None]).squeeze(-1)
    u = torch.rand(k, generator=generator, device=x.device, dtype=p.dtype)  # [k]
    # u < p/q, written as u * q < p: no division by a q of 0 (a draft its own proposer found impossible).
    kept = (u * q_draft < p_draft).tolist()
    m = kept.index(False) if False in kept else k
    if m == k:
        residual = p[k]  # every draft kept: the next token is the target's own
    else:
        q = torch.zeros_like(p[m]).index_fill_(0, d[m : m + 1], 1.0) if draft_probs is None else draft_probs[m]
        residual = (p[m] - q).clamp_(min=0)
        if not bool(residual.sum() > 0):
            # p <= q everywhere means p == q, where a rejection has probability 0; float rounding
            # can still reach it. Then p itself is the right distribution to draw from.
            residual = p[m]
    token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return Verdict(draft[:m] + [token], m)


@dataclass
class SpeculationStats:
    """How well the drafts fared, for /health and the bench."""

    verifies: int = 0  # (sequence, step) pairs that ran a draft
    drafted: int = 0  # draft tokens run
    accepted: int = 0  # ... and kept, up to where the reply stopped
    gained: int = 0  # tokens the verifies gave: the kept drafts and the target's own, up to a stop

    def count(self, drafted: int, accepted: int) -> None:
        self.verifies += 1
        self.drafted += drafted
        self.accepted += accepted
        self.gained += accepted + 1

    def drop(self, n: int) -> None:
        """n of the kept guesses came after a stop (EOS, a stop token or string): never given, and
        neither was the target's token after them."""
        if n > 0:
            self.accepted -= n
            self.gained -= n + 1

    def report(self) -> dict:
        return {
            "spec_acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            # tokens a verifying sequence gains per step
            "spec_mean_accepted_length": round(self.gained / self.verifies, 4) if self.verifies else 0.0,
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
        }


def is_seeded_sampling(params: SamplingParams) -> bool:
    """A seeded request that samples decodes without drafts. Its text must depend on its seed and
    parameters only, and whether a step may speculate depends on load (speculative_max_batch) and
    on the token budget, while a verify spends the request's generator differently from a plain
    step (a coin per draft, then a residual draw). Without drafts it gives the text it gives with
    --speculative off, alone or amid any load. Greedy requests speculate: a greedy verify emits
    exactly plain decoding's tokens."""
    return params.seed is not None and params.temperature >= GREEDY_BELOW


class Speculator:
    """Speculative decoding as the engine sees it, one call per phase of a step:

        propose(running)            before scheduling: a draft for each decoding sequence (seq.draft)
        verify_rows(seqs)           the forward pass's rows for the sequences whose draft was scheduled
        verify(logits, seqs, ...)   after it: kept drafts + one token each; rejected K/V given up

    proposer: proposers.py (None: speculation off). Each sequence asks for at most `max_k` drafts
    and adapts below it; above `max_batch` running sequences nobody speculates: a batch already
    reads each weight once for many tokens, and the rejected guesses would only add work."""

    def __init__(self, proposer, blocks: BlockManager, max_k: int = 6, max_batch: int = 2):
        """blocks: the engine's block manager. Rolled-back drafts give their blocks back to it, and
        a draft model's own pool mirrors its blocks (proposers.DraftModelProposer.start)."""
        if max_k < 1 or max_batch < 1:
            raise UserError(
                f"num_speculative_tokens and speculative_max_batch must be at least 1, got {max_k} and {max_batch}"
            )
        self.proposer = proposer
        self.max_k = max_k
        self.max_batch = max_batch
        self.stats = SpeculationStats()
        self.blocks = blocks
        if hasattr(proposer, "start"):
            proposer.start(blocks)

    def describe(self) -> str:
        if self.proposer is None:
            return "speculative decoding off"
        return (
            f"speculative decoding: {self.proposer.describe()}, up to {self.max_k} draft tokens "
            f"per sequence while at most {self.max_batch} sequences run"
        )

    def propose(self, running: list[Sequence]) -> None:
        """A draft for each decoding sequence, unless the batch is too large to gain."""
        speculate = self.proposer is not None and len(running) <= self.max_batch
        seqs, ks = [], []
        for seq in running:
            seq.draft, seq.draft_probs = [], None
            if not speculate or seq.n_uncomputed != 1 or is_seeded_sampling(seq.params):
                continue  # still in its prompt, recomputing after a preemption, or seeded (below)
            seq.spec_k = seq.spec_k or self.max_k  # a new sequence starts at the most
            # The pending token and the drafts all become output if every draft is kept, plus one
            # more: the drafts may take what max_tokens leaves, less one.
            k = min(seq.spec_k, seq.max_tokens - len(seq.output) - 1)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if seqs:
            seqs, ks = self._fit_pool(running, seqs, ks)
        if seqs:
            for seq, k, draft in zip(seqs, ks, self.proposer.propose(seqs, ks)):
                seq.draft = list(draft.tokens[:k])
                seq.draft_probs = None if draft.probs is None else draft.probs[:k]

    def _fit_pool(self, running: list[Sequence], seqs: list[Sequence], ks: list[int]):
        """Fewer guesses where the pool is short: drafts take only the blocks that no running
        sequence needs for its own next token. Guesses displace nobody: else a draft model's
        early growth (or the scheduler's, oldest first) preempts a newer sequence for guesses that
        may all be rejected. -> the sequences that still guess, and how many tokens each."""
        blocks = self.blocks
        spare = blocks.num_free - sum(max(0, blocks.blocks_for(s.n_computed + 1) - len(s.block_table)) for s in running)
        fitted = []
        for seq, k in zip(seqs, ks):
            own = max(len(seq.block_table), blocks.blocks_for(len(seq.tokens)))  # with its next token's
            while k > 0 and blocks.blocks_for(len(seq.tokens) + k) - own > spare:
                k -= 1
            if k > 0:
                spare -= max(0, blocks.blocks_for(len(seq.tokens) + k) - own)
                fitted.append((seq, k))
        return [seq for seq, _ in fitted], [k for _, k in fitted]

    @staticmethod
    def verify_rows(seqs: list[Sequence]) -> list[Work]:
        """Each sequence's pending token and its k drafts as k + 1 rows of one token each, at
        consecutive positions of its block table. Each row attends to the keys up to its own
        position, which the step writes before any layer reads them: the causal mask of a chunk,
        but as decodes, so the step stays on the decode path (the paged decode kernel, one C++
        call per layer, CUDA graphs) and each row's logits are what a plain decode step at that
        position computes: bit for bit with --batch-invariant, else up to the rounding that the
        number of rows in a step moves (chapter 06)."""
        rows = []
        for seq in seqs:
            tokens = [seq.tokens[seq.n_computed]] + seq.draft
            rows += [Work([t], seq.n_computed + j, seq.block_table) for j, t in enumerate(tokens)]
        return rows

    def verify(
        self, logits: torch.Tensor, seqs: list[Sequence], requests: dict[str, RequestState], failed: dict
    ) -> list[tuple]:
        """logits: [rows, vocab], verify_rows' rows; requests: the engine's, by id. For each sequence, the drafts the target keeps
        and one token of its own; the K/V of the rest is given up, and its k adapts. A sequence whose
        rows have no token to give fails its request (into `failed`: request id -> error).
        -> (sequence, new tokens, their logprobs or Nones) each"""
        out, row = [], 0
        bs = self.blocks.block_size
        for seq in seqs:
            state = requests[seq.request_id]
            k, draft = len(seq.draft), seq.draft
            rows = logits[row : row + k + 1]  # [k + 1, vocab]
            row += k + 1
            banned = None
            too_early = state.too_early_to_stop(seq)  # rows whose token may not stop
            if too_early > 0:
                banned = state.stop_mask(rows.shape[-1], rows.device).expand(k + 1, -1).clone()
                banned[too_early:] = False
            try:
                x = target_logits(rows, seq.params, seq.prompt, seq.output, draft, banned)
            except NoTokenError:
                failed[seq.request_id] = no_token_error(seq)
                continue
            q = None if seq.draft_probs is None else seq.draft_probs[:k]  # the scheduler may have cut the draft
            verdict = accept(x, draft, seq.params, seq.generator, q)
            self.stats.count(k, verdict.accepted)
            # The pending token and the kept drafts now have K/V in the cache; the rejected drafts'
            # slots are past n_computed (run again, so overwritten, when their positions come).
            before = seq.n_computed
            seq.n_computed += 1 + verdict.accepted
            if seq.n_computed // bs > before // bs:
                self.blocks.register(seq.block_table, seq.tokens + draft[: verdict.accepted], seq.n_computed)
            self.blocks.truncate(seq.block_table, seq.n_computed + 1)
            # Fewer guesses after a miss, more after a full hit (the schedule of HF transformers'
            # assisted generation): k follows how far this sequence's guesses tend to hold.
            if verdict.accepted == k:
                seq.spec_k = min(self.max_k, seq.spec_k + 2)
            else:
                seq.spec_k = max(1, seq.spec_k - 1)
            seq.draft, seq.draft_probs = [], None
            # The logprobs plain decoding reports: the model's raw distribution at each row (the
            # min_tokens ban shapes the draw, as the penalties do, not what is reported).
            n = len(verdict.tokens)
            logprobs = token_logprobs(rows[:n], [seq.params] * n, verdict.tokens)
            out.append((seq, verdict.tokens, logprobs))
        return out
