"""Which draft tokens to keep: the acceptance rule of speculative decoding.

A sequence that speculates runs its pending token t0 and k draft tokens d0..d(k-1) in one step,
as k+1 rows at consecutive positions (engine._verify_rows). Row j's logits are the target's
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

The draws come from the sequence's own generator, so a seeded request gives the same text every
time with the same proposer and k (not the same text as without speculation: the coin flips are
spent differently).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sampling import (
    GREEDY_BELOW,
    SamplingParams,
    apply_penalties,
    check_some_token_possible,
    finite_logits,
    sampled_probs,
)


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
        best = x.argmax(dim=-1).tolist()  # [k+1]: what greedy decoding would pick at each row
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
