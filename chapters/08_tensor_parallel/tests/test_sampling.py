"""sampling.py: each transform on hand-made logits, the draw against the distribution it should
follow, seeds, logprobs and parameter validation."""

import math

import pytest
import torch

from sampling import (
    NoTokenError,
    SamplingError,
    SamplingParams,
    TokenLogprob,
    apply_penalties,
    choice_seed,
    filter_probs,
    make_generator,
    row_max,
    sample,
)


def logits_of(probs, device="cpu") -> torch.Tensor:
    """A [1, vocab] row whose softmax is `probs`."""
    return torch.tensor(probs, dtype=torch.float32, device=device).log()[None]


def run(logits, params, generators=None, prompt=None, output=None):
    """`sample` with one params object for every row and no history unless given."""
    batch = logits.shape[0]
    return sample(
        logits,
        [params] * batch,
        generators if generators is not None else [None] * batch,
        prompt if prompt is not None else [[]] * batch,
        output if output is not None else [[]] * batch,
    )


def kept(probs, top_k=-1, top_p=1.0, min_p=0.0) -> list[float]:
    """filter_probs on one row; returns the filtered, renormalised probabilities."""
    p = torch.tensor([probs])
    vocab = p.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    out = filter_probs(p, torch.tensor([k]), torch.tensor([top_p]), torch.tensor([min_p]))
    return out[0].tolist()


def nonzero(probs) -> list[int]:
    return [i for i, p in enumerate(probs) if p > 0]


# --- greedy -----------------------------------------------------------------------------------


def test_temperature_zero_is_argmax_even_with_extreme_logits():
    greedy = SamplingParams(temperature=0.0)
    assert run(torch.tensor([[-1e30, -1e4, -5.0, -3.0, -1e9]]), greedy)[0] == [3]
    assert run(torch.tensor([[1e30, 3e38, 0.0, float("-inf"), 1.0]]), greedy)[0] == [1]
    assert run(torch.tensor([[1.0, 5.0, 5.0, 2.0, 5.0]]), greedy)[0] == [1]  # ties: the lowest id


def test_row_max_is_torch_max_over_the_last_dimension(device):
    """The greedy path's (max, first index) per row, NumPy's argmax on a CPU, against torch.max:
    ties, a NaN (it wins, as in torch.max), +inf, a row of -inf, and a view that is not contiguous."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 3000, generator=gen) * 4).to(device)
    x[0, [10, 2000]] = 50.0  # a tie far apart
    x[1, 77] = float("nan")
    x[2, [5, 9]] = float("inf")
    x[3] = float("-inf")
    for rows in (x, x[:, ::2], x[::2], x.bfloat16()):
        best, tokens = row_max(rows)
        want_best, want_tokens = rows.max(dim=-1)
        assert tokens.tolist() == want_tokens.tolist()
        assert torch.equal(best.isnan(), want_best.isnan())
        assert torch.equal(best.nan_to_num(), want_best.nan_to_num())


def test_greedy_equals_argmax_on_random_batches(device):
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = (torch.randn(8, 1000, generator=gen) * 5).to(device, dtype)
        before = logits.clone()
        tokens, logprobs = run(logits, SamplingParams(temperature=0.0))
        assert tokens == logits.float().argmax(-1).tolist()
        assert logprobs == [None] * 8
        assert torch.equal(logits, before)  # not modified in place
    # A temperature too small to sample with is greedy too, not a division overflowing to inf.
    assert run(logits, SamplingParams(temperature=1e-9))[0] == logits.float().argmax(-1).tolist()


def test_sampling_survives_huge_logits_and_tiny_temperatures():
    logits = torch.tensor([[3e38, 1e38, 0.0, float("-inf")]])
    for temperature in (0.5, 1e-4):
        params = SamplingParams(temperature=temperature)
        tokens, _ = run(logits.expand(100, -1), params, [make_generator(0, "cpu")] * 100)
        assert set(tokens) == {0}


def test_greedy_rows_mixed_with_sampled_rows():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=3),
    ]
    tokens, _ = sample(logits, params, [None, make_generator(5, "cpu"), None, None], [[]] * 4, [[]] * 4)
    argmax = logits.argmax(-1).tolist()
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
    assert tokens[3] in logits[3].topk(3).indices.tolist()


# --- non-finite logits ------------------------------------------------------------------------

NAN_ROW = [float("nan"), 0.0, float("nan"), 1.0, float("nan")]


def test_a_nan_logit_is_never_chosen(device):
    logits = torch.tensor([NAN_ROW], device=device)
    assert run(logits, SamplingParams(temperature=0.0))[0] == [3]  # argmax alone would pick a NaN
    draws = run(logits.expand(200, -1), SamplingParams(), [make_generator(0, device)] * 200)[0]
    assert set(draws) == {1, 3}


def test_an_infinite_logit_is_certain(device):
    logits = torch.tensor([[0.0, float("inf"), 5.0, float("inf"), float("-inf")]], device=device)
    assert run(logits, SamplingParams(temperature=0.0))[0] == [1]  # ties: the lowest id
    draws = run(logits.expand(200, -1), SamplingParams(top_p=0.9), [make_generator(0, device)] * 200)[0]
    assert set(draws) == {1, 3}  # two certain tokens share the mass


def test_extreme_valid_penalties_on_huge_logits_stay_finite():
    # 3e38 / 0.01 overflows to inf, -3e38 * 100 to -inf: token 0 stays far ahead either way.
    logits = torch.tensor([[3e38, 1.0, -3e38, 0.0]])
    for r in (0.01, 100.0):
        params = SamplingParams(repetition_penalty=r, temperature=0.7)
        tokens, _ = run(logits.expand(50, -1), params, [make_generator(1, "cpu")] * 50, prompt=[[0, 2]] * 50)
        assert set(tokens) == {0}


@pytest.mark.parametrize("row", [[float("-inf")] * 4, [float("nan")] * 4, [float("nan"), float("-inf")] * 2])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_where_no_token_is_possible_raises(row, temperature):
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], row])
    with pytest.raises(NoTokenError, match=r"row\(s\) \[1\]"):
        run(logits, SamplingParams(temperature=temperature), [make_generator(0, "cpu")] * 2)


def test_logprobs_of_a_row_with_nan_are_numbers():
    _, [lp] = run(torch.tensor([NAN_ROW]), SamplingParams(temperature=0.0, logprobs=2))
    assert lp.token_id == 3 and math.isfinite(lp.logprob)
    assert [t for t, _ in lp.top] == [3, 1] and all(math.isfinite(v) for _, v in lp.top)


# --- the filters ------------------------------------------------------------------------------


def test_top_k_keeps_exactly_k():
    probs = [0.1, 0.35, 0.05, 0.3, 0.2]
    for k, expected in [(1, [1]), (2, [1, 3]), (3, [1, 3, 4]), (5, [0, 1, 2, 3, 4]), (50, [0, 1, 2, 3, 4])]:
        out = kept(probs, top_k=k)
        assert nonzero(out) == expected
        assert sum(out) == pytest.approx(1.0)
    assert kept(probs, top_k=2) == pytest.approx([0, 0.35 / 0.65, 0, 0.3 / 0.65, 0])
    for off in (-1, 0):  # both mean "no top-k"
        assert kept(probs, top_k=off) == pytest.approx(probs)
    assert nonzero(kept([0.1, 0.3, 0.3, 0.3], top_k=2)) == [1, 2]  # ties: the lowest ids, deterministically


def test_top_p_keeps_the_token_that_crosses_the_boundary():
    probs = [0.2, 0.5, 0.3]  # sorted: token 1 (0.5), token 2 (0.3), token 0 (0.2)
    assert nonzero(kept(probs, top_p=0.5)) == [1]  # 0.5 alone reaches 0.5
    assert nonzero(kept(probs, top_p=0.6)) == [1, 2]  # 0.5 < 0.6: the 0.3 crosses it and stays
    assert nonzero(kept(probs, top_p=0.8)) == [1, 2]  # 0.5 + 0.3 reaches 0.8 exactly
    assert nonzero(kept(probs, top_p=0.81)) == [0, 1, 2]
    assert nonzero(kept(probs, top_p=1e-9)) == [1]  # the most likely token always survives
    assert kept(probs, top_p=0.6) == pytest.approx([0, 0.625, 0.375])
    # The same through `sample`: over many draws only the kept tokens appear.
    tokens, _ = run(logits_of(probs).expand(500, -1), SamplingParams(top_p=0.6), [make_generator(0, "cpu")] * 500)
    assert set(tokens) == {1, 2}


def test_top_p_applies_to_what_top_k_kept_renormalised():
    probs = [0.4, 0.3, 0.2, 0.1]
    assert nonzero(kept(probs, top_p=0.5)) == [0, 1]  # 0.4 < 0.5
    # top_k=2 leaves [0.4, 0.3] -> [0.571, 0.429]: the first token alone now reaches 0.5.
    assert nonzero(kept(probs, top_k=2, top_p=0.5)) == [0]


def test_min_p_is_relative_to_the_most_likely_token():
    probs = [0.1, 0.5, 0.25, 0.15]
    assert nonzero(kept(probs, min_p=0.4)) == [1, 2]  # threshold 0.2
    assert nonzero(kept(probs, min_p=0.25)) == [1, 2, 3]  # threshold 0.125
    assert nonzero(kept(probs, min_p=1.0)) == [1]
    assert kept(probs, min_p=0.4) == pytest.approx([0, 2 / 3, 1 / 3, 0])
    # After top-p, relative to the max of what is left (the ratio is unchanged by renormalising).
    assert nonzero(kept(probs, top_p=0.7, min_p=0.4)) == [1, 2]


# --- penalties and bias -----------------------------------------------------------------------


def penalised(logits, params, prompt=(), output=()) -> list[float]:
    row = torch.tensor(logits, dtype=torch.float32)
    apply_penalties(row, params, list(prompt), list(output))
    return row.tolist()


def test_repetition_penalty_pushes_seen_tokens_down_whatever_their_sign():
    logits = [2.0, -2.0, 1.0, -1.0, 0.5]
    # Token 0 in the prompt, token 1 in the output, the rest unseen.
    assert penalised(logits, SamplingParams(repetition_penalty=2.0), [0], [1, 1]) == [1.0, -4.0, 1.0, -1.0, 0.5]
    # A penalty below 1 rewards repetition, again whatever the sign.
    assert penalised(logits, SamplingParams(repetition_penalty=0.5), [0], [1]) == [4.0, -1.0, 1.0, -1.0, 0.5]
    # Through `sample`: greedy moves off a token the prompt already holds.
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert run(torch.tensor([[3.0, 2.0, 0.0]]), greedy, prompt=[[0]])[0] == [1]
    assert run(torch.tensor([[3.0, 2.0, 0.0]]), greedy, prompt=[[2]])[0] == [0]


def test_presence_and_frequency_penalties_count_the_output_only():
    logits = [1.0, 1.0, 1.0, 1.0, 1.0]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Token 0 is only in the prompt: untouched. Token 2 twice in the output, token 4 once.
    assert penalised(logits, params, prompt=[0], output=[2, 4, 2]) == [1.0, 1.0, 0.0, 1.0, 0.25]
    assert penalised(logits, SamplingParams(presence_penalty=-1.0), output=[3, 3]) == [1, 1, 1, 2, 1]
    assert penalised(logits, SamplingParams(frequency_penalty=2.0), output=[3, 3, 3]) == [1, 1, 1, -5, 1]


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.tensor([[5.0, 4.0, -3.0, 0.0, 1.0]])
    # +100 on a token 8 logits behind: it wins every draw.
    tokens, _ = run(logits.expand(1000, -1), SamplingParams(logit_bias={2: 100.0}), [make_generator(0, "cpu")] * 1000)
    assert set(tokens) == {2}
    # -100 on the favourite: greedy takes the runner-up, and sampling never draws it.
    assert run(logits, SamplingParams(temperature=0.0, logit_bias={0: -100.0}))[0] == [1]
    tokens, _ = run(logits.expand(1000, -1), SamplingParams(logit_bias={0: -100.0}), [make_generator(0, "cpu")] * 1000)
    assert 0 not in tokens
    assert penalised([0.0, 0.0, 0.0], SamplingParams(logit_bias={1: 2.5, 2: -1.0})) == [0.0, 2.5, -1.0]


def test_penalties_do_not_touch_the_callers_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    before = logits.clone()
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, logit_bias={2: 5.0})
    run(logits, params, prompt=[[0]], output=[[1, 2]])
    assert torch.equal(logits, before)


# --- the draw follows the filtered distribution -----------------------------------------------


def expected_distribution(probs, temperature, top_k, top_p, min_p) -> list[float]:
    """The same filters written out plainly in float64, token by token."""
    q = [p ** (1 / temperature) for p in probs]
    order = sorted(range(len(q)), key=lambda i: -q[i])
    keep = order[:top_k]
    total = sum(q[i] for i in keep)
    mass, after_top_p = 0.0, []
    for i in keep:
        if mass < top_p:
            after_top_p.append(i)
        mass += q[i] / total
    best = max(q[i] for i in after_top_p)
    final = [i for i in after_top_p if q[i] >= min_p * best]
    total = sum(q[i] for i in final)
    return [q[i] / total if i in final else 0.0 for i in range(len(q))]


def test_draws_follow_the_filtered_distribution(device):
    # Seven tokens, shuffled so that rank order is not id order. With these settings each filter
    # removes one token: top_k=6 the 0.04, top_p=0.9 the 0.05, min_p=0.25 the 0.09.
    probs = [0.05, 0.22, 0.09, 0.3, 0.04, 0.12, 0.18]
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.25, seed=1234)
    expected = expected_distribution(probs, 0.8, 6, 0.9, 0.25)
    assert nonzero(expected) == [1, 3, 5, 6]

    n = 20_000  # one batch of n identical rows sharing one seeded generator: one multinomial call
    generator = make_generator(params.seed, device)
    tokens, _ = run(logits_of(probs, device).expand(n, -1), params, [generator] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs))
    assert counts[[0, 2, 4]].tolist() == [0, 0, 0]  # filtered tokens never appear
    for token, e in enumerate(expected):
        # A count is binomial: 5 standard deviations (< 1e-6 two-sided) is a bound that a
        # correct sampler meets, while a missing renormalisation or wrong filter misses it by far.
        sigma = math.sqrt(e * (1 - e) / n)
        assert abs(counts[token].item() / n - e) <= 5 * sigma, (token, counts[token].item() / n, e)


# --- seeds ------------------------------------------------------------------------------------


def draw_sequence(seed, steps=40, device="cpu") -> list[int]:
    logits = torch.zeros(1, 100, device=device)  # uniform over 100 tokens
    generator = make_generator(seed, device)
    return [run(logits, SamplingParams(seed=seed), [generator])[0][0] for _ in range(steps)]


def test_same_seed_same_tokens_different_seed_different_tokens(device):
    assert make_generator(None, device) is None
    first = draw_sequence(7, device=device)
    assert draw_sequence(7, device=device) == first
    assert draw_sequence(8, device=device) != first  # equal with probability 100**-40
    assert len(set(first)) > 1


def test_choice_seeds_count_up_from_the_request_seed_modulo_2_64():
    assert [choice_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert choice_seed(None, 2) is None
    top = 2**64 - 1  # the largest seed accepted: choice 1 of it would overflow manual_seed
    assert [choice_seed(top, i) for i in range(3)] == [top, 0, 1]
    assert choice_seed(-1, 0) == top  # how torch reads a negative seed
    for i in range(16):
        SamplingParams(seed=choice_seed(top, i)).validate(VOCAB)


def test_every_integer_seed_makes_a_generator_torch_reads_modulo_2_64():
    assert draw_sequence(2**64 + 7) == draw_sequence(7)  # the engine's seed + i past the top
    assert draw_sequence(-1) == draw_sequence(2**64 - 1)  # unchanged: what torch did already


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    logits = torch.zeros(1, 100)
    alone = [run(logits, SamplingParams(), [g])[0][0] for g in [make_generator(3, "cpu")] * 10]
    g = make_generator(3, "cpu")
    others = [make_generator(99, "cpu"), None]
    batched = [run(logits.expand(3, -1), SamplingParams(), [others[0], g, others[1]])[0][1] for _ in range(10)]
    assert batched == alone


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits(device):
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    raw = torch.log_softmax(logits.float(), dim=-1)
    # Penalties, bias and temperature shape the draw, never the reported logprobs.
    shaped = dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=1.0, logit_bias={5: 10.0})
    params = [SamplingParams(logprobs=5, **shaped), SamplingParams(logprobs=0), SamplingParams()]
    gens = [make_generator(i, device) for i in range(3)]
    tokens, logprobs = sample(logits, params, gens, [[1, 2, 3]] * 3, [[5, 5]] * 3)

    assert logprobs[2] is None
    for row, k in [(0, 5), (1, 0)]:
        lp = logprobs[row]
        assert isinstance(lp, TokenLogprob) and lp.token_id == tokens[row]
        assert lp.logprob == pytest.approx(raw[row, tokens[row]].item(), abs=1e-6)
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert [t for t, _ in lp.top] == raw[row].topk(k).indices.tolist()
        for t, v in lp.top:
            assert v == pytest.approx(raw[row, t].item(), abs=1e-6)


def test_logprobs_k_larger_than_the_vocabulary_lists_every_token():
    _, [lp] = run(logits_of([0.2, 0.5, 0.3]), SamplingParams(temperature=0.0, logprobs=20))
    assert lp.token_id == 1 and lp.logprob == pytest.approx(math.log(0.5))
    assert [t for t, _ in lp.top] == [1, 2, 0]


# --- validation -------------------------------------------------------------------------------

VOCAB = 100
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "field, value, name",
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", NAN, "temperature"),
        ("temperature", INF, "temperature"),
        ("temperature", "hot", "temperature"),
        ("temperature", 100.5, "temperature"),
        ("temperature", 1e300, "temperature"),
        ("top_k", -2, "top_k"),
        ("top_k", 2.5, "top_k"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.01, "top_p"),
        ("top_p", NAN, "top_p"),
        ("min_p", -0.1, "min_p"),
        ("min_p", 1.5, "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("repetition_penalty", -1.0, "repetition_penalty"),
        ("repetition_penalty", INF, "repetition_penalty"),
        ("repetition_penalty", 1e-40, "repetition_penalty"),
        ("repetition_penalty", 1e-300, "repetition_penalty"),
        ("repetition_penalty", 0.0099, "repetition_penalty"),
        ("repetition_penalty", 100.5, "repetition_penalty"),
        ("repetition_penalty", 1e300, "repetition_penalty"),
        ("presence_penalty", 2.5, "presence_penalty"),
        ("presence_penalty", -2.01, "presence_penalty"),
        ("frequency_penalty", 3.0, "frequency_penalty"),
        ("frequency_penalty", NAN, "frequency_penalty"),
        ("logit_bias", {VOCAB: 1.0}, "logit_bias"),
        ("logit_bias", {-1: 1.0}, "logit_bias"),
        ("logit_bias", {"5": 1.0}, "logit_bias"),
        ("logit_bias", {5: 100.5}, "logit_bias"),
        ("logit_bias", {5: NAN}, "logit_bias"),
        ("logit_bias", [5, 1.0], "logit_bias"),
        ("seed", 2**64, "seed"),
        ("seed", 1.5, "seed"),
        ("logprobs", 21, "logprobs"),
        ("logprobs", -1, "logprobs"),
        ("logprobs", True, "logprobs"),
    ],
)
def test_invalid_values_raise_naming_the_parameter(field, value, name):
    with pytest.raises(SamplingError, match=name) as info:
        SamplingParams(**{field: value}).validate(VOCAB)
    assert isinstance(info.value, ValueError)  # servers map ValueError to HTTP 400
    assert info.value.param == field  # the request field, for the OpenAI error's `param`


def test_valid_values_pass():
    SamplingParams().validate(VOCAB)
    SamplingParams(temperature=0, top_k=0).validate(VOCAB)
    SamplingParams(
        temperature=1.7,
        top_k=VOCAB * 10,
        top_p=1,
        min_p=1,
        repetition_penalty=1.2,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={0: -100, VOCAB - 1: 100.0},
        seed=-5,
        logprobs=20,
    ).validate(VOCAB)
    SamplingParams(logprobs=0, seed=2**64 - 1).validate(VOCAB)
    SamplingParams(temperature=100, repetition_penalty=0.01).validate(VOCAB)
    SamplingParams(temperature=100.0, repetition_penalty=100).validate(VOCAB)


def test_override_takes_every_value_but_none():
    defaults = SamplingParams(temperature=0.6, top_p=0.9, seed=1)
    merged = defaults.override(temperature=0.0, top_p=None, seed=0, logit_bias={3: 1.0})
    assert merged == SamplingParams(temperature=0.0, top_p=0.9, seed=0, logit_bias={3: 1.0})
    assert defaults == SamplingParams(temperature=0.6, top_p=0.9, seed=1)  # a copy, not an update


def test_from_generation_config():
    cfg = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 50,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "eos_token_id": [1, 2],
    }
    p = SamplingParams.from_generation_config(cfg)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.9, 50, 0.05, 1.1)
    assert SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.6}).temperature == 0.0
    # Absent or null keys keep our defaults.
    assert SamplingParams.from_generation_config({"bos_token_id": 1, "top_k": None}) == SamplingParams()


@pytest.mark.parametrize(
    "cfg, said",
    [
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_k": [5]}, "top_k must be a whole number, got [5]"),
        ({"top_k": 5.5}, "top_k must be a whole number"),
        ({"top_k": float("inf")}, "top_k must be a whole number"),
        ({"temperature": float("nan")}, "temperature must be a number in"),
        ({"top_p": True}, "top_p must be a number, got True"),
        ([1], "must hold a JSON object, got list"),
    ],
)
def test_a_generation_config_value_that_is_no_number_in_range_is_the_models_error(cfg, said):
    # it failed every request (a ValueError's traceback in the cli, a 400 blaming the client in the server)
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="^here/generation_config.json") as e:
        SamplingParams.from_generation_config(cfg, "here/generation_config.json")
    assert said in str(e.value)


def test_a_row_with_no_token_to_sample_ends_a_script_in_one_line(capsys):
    # cli.py on a model whose logits went NaN printed a traceback of NoTokenError
    from common.cli import run_main
    from sampling import NoTokenError

    def main():
        raise NoTokenError("no token can be sampled")

    with pytest.raises(SystemExit) as e:
        run_main(main)
    assert e.value.code == 1 and capsys.readouterr().err == "error: no token can be sampled\n"
