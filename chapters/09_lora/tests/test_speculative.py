"""The pieces of speculative decoding on their own: prompt lookup's guesses, and the acceptance
rule, greedy and sampled, checked against the target distribution on a tiny vocabulary."""

import math

import pytest
import torch
from proposers import NgramProposer, make_proposer
from sampling import NoTokenError, SamplingParams, apply_penalties, filter_probs
from speculative import Verdict, accept, target_logits, target_probs

# --- prompt lookup ---------------------------------------------------------------------------------


def test_ngram_guesses_what_followed_the_latest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # "1 2 3" occurred at 0 (followed by 9 9) and at 5 (followed by 7 8 5): the latest wins
    assert NgramProposer(min_n=1, max_n=3).guess(tokens, 3) == [7, 8, 5]
    assert NgramProposer(min_n=1, max_n=3).guess(tokens, 10) == [7, 8, 5, 1, 2, 3]  # up to the end


def test_ngram_prefers_the_longest_match():
    tokens = [3, 5, 4, 10, 5, 4, 20, 3, 5, 4]
    # 3-gram "3 5 4" matches at 0 (-> 10); 2-gram "5 4" would match later at 4 (-> 20)
    assert NgramProposer(min_n=1, max_n=3).guess(tokens, 1) == [10]
    assert NgramProposer(min_n=1, max_n=2).guess(tokens, 1) == [20]


def test_ngram_proposes_nothing_without_a_match():
    assert NgramProposer(min_n=2, max_n=3).guess([1, 2, 3, 4, 5], 4) == []
    assert NgramProposer(min_n=1, max_n=3).guess([7], 4) == []
    assert NgramProposer().guess([1, 2, 1, 2], 0) == []
    # min_n = 2: a single repeated token is not enough
    assert NgramProposer(min_n=2, max_n=3).guess([4, 8, 9, 4], 2) == []
    assert NgramProposer(min_n=1, max_n=3).guess([4, 8, 9, 4], 2) == [8, 9]


def test_unknown_proposer_and_bad_ngram_sizes_are_errors():
    assert make_proposer("off") is None
    with pytest.raises(ValueError, match="unknown proposer 'eagle'"):
        make_proposer("eagle")
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=3, max_n=2)


# --- greedy acceptance -----------------------------------------------------------------------------


def rows_with_argmax(best: list[int], vocab: int = 8) -> torch.Tensor:
    x = torch.zeros(len(best), vocab)
    x[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return x


GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize(
    "draft, best, kept, tokens",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4]),  # all kept, plus the bonus token
        ([1, 2, 3], [1, 5, 3, 4], 1, [1, 5]),  # stops at the first disagreement
        ([1, 2, 3], [6, 2, 3, 4], 0, [6]),  # none kept: plain decoding's token
        ([1, 2, 3], [1, 2, 7, 4], 2, [1, 2, 7]),
    ],
)
def test_greedy_keeps_the_agreeing_prefix_and_one_more(draft, best, kept, tokens):
    assert accept(rows_with_argmax(best), draft, GREEDY, None) == Verdict(tokens, kept)


def test_rows_see_the_drafts_before_them_as_output():
    """Row j is shaped with output + draft[:j]: a repetition penalty on row 2 hits draft tokens 0
    and 1, on row 0 neither."""
    params = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5)
    logits = torch.randn(3, 16)
    prompt, output, draft = [1, 2], [3], [4, 5]
    x = target_logits(logits, params, prompt, output, draft, None)
    for j in range(3):
        expect = logits[j].clone()
        apply_penalties(expect, params, prompt, output + draft[:j])
        torch.testing.assert_close(x[j], expect, rtol=0, atol=0)
    assert not torch.equal(x[0], x[2])


def test_banned_rows_cannot_pick_the_banned_tokens():
    logits = rows_with_argmax([2, 2, 2])
    banned = torch.zeros(3, 8, dtype=torch.bool)
    banned[:2, 2] = True  # min_tokens still forbids the stop token 2 on rows 0 and 1
    x = target_logits(logits, GREEDY, [], [], [2, 2], banned)
    assert accept(x, [2, 2], GREEDY, None).tokens[0] != 2
    x = target_logits(logits, GREEDY, [], [], [5, 5], banned)
    assert x[2].argmax() == 2  # the last row is past min_tokens


def test_non_finite_rows_are_made_finite_and_a_row_with_no_token_raises():
    """target_logits cleans a NaN (to -inf) and +inf (to the largest float) as sample() does, and
    only where a row has one; greedy then never picks the NaN; a row all -inf raises."""
    logits = torch.randn(3, 8)
    logits[0, 3] = float("nan")
    logits[1, 5] = float("inf")
    x = target_logits(logits, GREEDY, [], [], [1, 1], None)
    assert not bool(x.isnan().any()) and bool(torch.isfinite(x.max(dim=-1).values).all())
    assert x[0, 3] == float("-inf") and x[1, 5] == torch.finfo(torch.float32).max
    assert torch.equal(x[2], logits[2])
    assert accept(x, [1, 1], GREEDY, None).tokens[:2] != [3, 3]
    assert accept(x, [x[0].argmax().item(), 9], GREEDY, None).tokens[1] == 5  # +inf is certain
    banned = torch.zeros(3, 8, dtype=torch.bool)
    banned[2] = True
    with pytest.raises(NoTokenError):
        target_logits(torch.randn(3, 8), GREEDY, [], [], [1, 1], banned)


# --- the sampled rule preserves the target distribution ---------------------------------------------

VOCAB = 6
TRIALS = 4_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of Pearson's test of `counts` against `probs` (cells of probability 0 must stay
    empty: any count there fails outright)."""
    n = counts.sum().item()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    live = probs > 0
    expected = probs[live] * n
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    dof = int(live.sum()) - 1
    # Wilson-Hilferty: chi-square with dof degrees of freedom as a normal, good enough for a test
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def always_accept(x, draft, params, generator, draft_probs=None) -> Verdict:
    """A deliberately wrong rule: keeps every draft."""
    best = torch.multinomial(target_probs(x, params)[len(draft)], 1, generator=generator).item()
    return Verdict(list(draft) + [best], len(draft))


def first_tokens(rule, x, params, draft_for, draft_probs=None, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the rule TRIALS times. -> (counts of the first emitted token, counts of the second
    emitted token among the trials that kept the first draft)."""
    g = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for _ in range(TRIALS):
        draft = draft_for(g)
        verdict = rule(x, draft, params, g, draft_probs)
        first[verdict.tokens[0]] += 1
        if verdict.accepted >= 1:
            second[verdict.tokens[1]] += 1
    return first, second


SHAPES = {
    "temperature": SamplingParams(temperature=0.8),
    "top-k": SamplingParams(temperature=1.0, top_k=3),
    "top-p": SamplingParams(temperature=1.2, top_p=0.7),
    "min-p + penalties": SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.3, frequency_penalty=0.4),
}


def target(params: SamplingParams, logits: torch.Tensor, draft: list[int]) -> torch.Tensor:
    return target_probs(target_logits(logits, params, [0], [1, 1], draft, None), params)


@pytest.mark.parametrize("shape", SHAPES)
def test_prompt_lookup_drafts_keep_the_target_distribution(shape):
    """A deterministic guess (q = 1 on it): the first token is distributed as p_0, whatever the
    guess; the rule that keeps every guess is caught."""
    params = SHAPES[shape]
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0], [0.0, 1.0, 2.0, 0.3, 0.2, 0.1], [1, 1, 1, 1, 1, 1.0]])
    draft = [1, 2]  # a plausible but not the likeliest guess
    x = target_logits(logits, params, [0], [1, 1], draft, None)
    p = target_probs(x, params)
    first, second = first_tokens(accept, x, params, lambda g: draft)
    assert chi_square_p_value(first, p[0]) > 1e-4
    assert chi_square_p_value(second, p[1]) > 1e-4  # after keeping d0, the next is p_1
    wrong, _ = first_tokens(always_accept, x, params, lambda g: draft)
    assert chi_square_p_value(wrong, p[0]) < 1e-6


@pytest.mark.parametrize("shape", ["temperature", "top-k", "top-p"])
def test_model_drafts_keep_the_target_distribution(shape):
    """Drafts drawn from a draft model's own distribution q: the first token is still p_0 and the
    one after a kept draft p_1; keeping every draft is caught."""
    params = SHAPES[shape]  # no penalties: the rows do not depend on the drafts drawn
    logits = torch.tensor([[0.5, 2.0, 1.0, 0.1, -0.5, 0.3], [1.0, 0.0, 0.5, 2.0, 0.2, 0.1], [0.0] * 6])
    q = torch.softmax(torch.tensor([[2.0, 0.0, 1.0, 1.0, 0.0, 0.5], [0.0, 0.0, 0.0, 3.0, 1.0, 0.0]]), dim=-1)
    x = target_logits(logits, params, [0], [1, 1], [0, 0], None)
    p = target_probs(x, params)

    def draft_for(g):
        return [torch.multinomial(q[j], 1, generator=g).item() for j in range(2)]

    first, second = first_tokens(accept, x, params, draft_for, q)
    assert chi_square_p_value(first, p[0]) > 1e-4
    assert chi_square_p_value(second, p[1]) > 1e-4
    wrong, _ = first_tokens(always_accept, x, params, draft_for, q)
    assert chi_square_p_value(wrong, p[0]) < 1e-6


def test_a_seed_gives_the_same_verdicts():
    params = SamplingParams(temperature=1.0)
    x = torch.randn(4, VOCAB)

    def verdicts(seed):
        g = torch.Generator().manual_seed(seed)
        return [accept(x, [1, 2, 3], params, g).tokens for _ in range(50)]

    assert verdicts(7) == verdicts(7)
    assert verdicts(7) != verdicts(8)


def test_filter_matches_sampling():
    """target_probs is sampling.py's temperature and filters, row by row."""
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.8, min_p=0.05)
    x = torch.randn(3, 10)
    expect = filter_probs(
        torch.softmax((x - x.max(-1, keepdim=True).values) / 0.7, -1),
        torch.full((3,), 4),
        torch.full((3,), 0.8),
        torch.full((3,), 0.05),
    )
    torch.testing.assert_close(target_probs(x, params), expect)
