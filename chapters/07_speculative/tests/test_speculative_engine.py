"""Speculative decoding inside the batching engine: greedy output token for token what the engine
gives with speculation off (chapter 06's engine), with every proposer, on a mixed workload with
preemption, prefix caching, n = 4, stop strings, penalties and min_tokens; and rollback: no block
held or cached for a rejected draft (float32, SmolLM2: real text, so prompt lookup hits)."""

import random
from types import SimpleNamespace

import pytest
import torch
from block_manager import BlockManager
from engine import Engine, Request, build_engine
from loading import load
from proposers import Draft, DraftModelProposer, NgramProposer
from quant import QuantSpec
from sampling import SamplingParams
from sequence import Status

from common.models import resolve_model
from common.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0)
SYSTEM = "You are a careful assistant. Repeat the user's words where you can."
TOPICS = ["the sea", "bread", "the moon", "rivers", "a compiler", "prime numbers", "Paris", "trains"]
ASKS = [
    "Repeat this sentence twice: {t} is on my mind, {t} is on my mind.",
    "Write the words '{t}' three times, separated by commas.",
    "Say one sentence about {t}.",
    "List three facts about {t}, one per line.",
]


class Guesser:
    """A proposer from a guess per sequence."""

    def describe(self):
        return type(self).__name__

    def propose(self, seqs, ks):
        return [Draft(self.guess(seq.tokens, k)) for seq, k in zip(seqs, ks)]


class Junk(Guesser):
    """Always wrong: proposes a token no reply here contains, k times."""

    def guess(self, tokens, k):
        return [49000] * k


class Oracle(Guesser):
    """Proposes what the reference run generated next: every guess is right."""

    def __init__(self, runs: list[list[int]]):
        self.runs = runs

    def guess(self, tokens, k):
        for full in self.runs:
            if full[: len(tokens)] == tokens:
                return full[len(tokens) : len(tokens) + k]
        return []


def workload(tokenizer) -> tuple[list[Request], list[int]]:
    rng = random.Random(0)
    reqs = []
    for i in range(16):  # n = 4 twice, penalties twice, stop strings and min_tokens three times each
        topic = TOPICS[i % len(TOPICS)]
        messages = [{"role": "system", "content": SYSTEM}] if i % 2 == 0 else []  # a shared prefix
        # numbered, so that no two prompts are equal (the oracle finds each one's run by its tokens)
        messages.append({"role": "user", "content": f"{i}. " + ASKS[i % len(ASKS)].format(t=topic)})
        params = GREEDY
        if i % 7 == 3:
            params = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.3)
        reqs.append(
            Request(
                tokenizer.encode_chat(messages),
                params,
                max_tokens=rng.choice([5, 10, 16]),
                n=4 if i % 8 == 5 else 1,
                stop=[", "] if i % 5 == 1 else [],
                min_tokens=4 if i % 6 == 2 else 0,
            )
        )
    return reqs, [rng.randrange(0, 6) for _ in reqs]  # 16 requests within 6 steps: preemptions


@pytest.fixture(scope="module")
def small():
    """Float32 SmolLM2, speculation off: its model and tokenizer serve every engine here."""
    engine, _ = build_engine(str(resolve_model("smollm2-135m")), "cpu", "float32", num_blocks=64, block_size=4)
    return engine


@pytest.fixture(scope="module")
def runs(small):
    """The workload (16 requests: 32 took twice the time and showed nothing more) through one float32
    SmolLM2 with each proposer. -> {name: (outputs, engine)}"""
    base = small
    draft, _ = load(str(resolve_model("smollm2-135m")), "cpu", "float32", QuantSpec(4, 32))

    def run(proposer, **kw):
        # 12 sequences at most and a pool of 40 blocks of 8: preemptions; speculation up to 12
        engine = Engine(
            base.model,
            base.tokenizer,
            base.generation_config,
            num_blocks=40,
            block_size=8,
            max_num_seqs=12,
            max_num_batched_tokens=64,
            # "draft": the int4 copy drafting for the float32 model, in a pool of its own
            proposer=DraftModelProposer(draft, "int4 self") if proposer == "draft" else proposer,
            num_speculative_tokens=5,
            speculative_max_batch=12,
            **kw,
        )
        reqs, arrivals = workload(base.tokenizer)
        return engine.generate(reqs, arrivals), engine

    out = {"off": run(None)}
    reqs, _ = workload(base.tokenizer)
    finished = [r.prompt_ids + c.token_ids for r, choices in zip(reqs, out["off"][0]) for c in choices]
    out["ngram"] = run(NgramProposer(min_n=1, max_n=3))
    out["oracle"] = run(Oracle(finished))
    out["draft"] = run("draft")
    return out


def as_tuples(outputs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in choices] for choices in outputs]


@pytest.mark.parametrize("proposer", ["ngram", "oracle", "draft"])
def test_greedy_output_equals_speculation_off(runs, proposer):
    off, off_engine = runs["off"]
    on, engine = runs[proposer]
    assert as_tuples(on) == as_tuples(off)
    # the workload did exercise what it is meant to
    assert off_engine.scheduler.n_preemptions > 0 and off_engine.blocks.hit_rate > 0
    assert any(c.finish_reason == "stop" and c.token_ids and c.text for choices in off for c in choices)
    spec = engine.speculator.stats
    assert spec.verifies > 0
    if proposer in ("ngram", "draft"):  # some guesses kept, some not, fewer steps
        assert 0 < spec.accepted < spec.drafted
        assert engine.n_steps < off_engine.n_steps
    if proposer == "oracle":  # every guess kept: verify rows compute exactly what decode steps do
        assert spec.accepted == spec.drafted
        assert engine.n_steps < off_engine.n_steps


def test_stats_report_acceptance(runs):
    stats = runs["ngram"][1].stats()
    spec = runs["ngram"][1].speculator.stats
    assert stats["spec_acceptance_rate"] == round(spec.accepted / spec.drafted, 4)
    assert stats["spec_mean_accepted_length"] == round(spec.gained / spec.verifies, 4)
    assert spec.verifies + spec.accepted >= spec.gained  # a stop cuts a run: its target's token is not gained
    assert runs["off"][1].stats()["spec_draft_tokens"] == 0


def real_blocks(tokens: list[int], block_size: int) -> set[tuple[int, ...]]:
    return {tuple(tokens[i : i + block_size]) for i in range(0, len(tokens) - block_size + 1, block_size)}


def test_rejected_drafts_hold_no_blocks_and_are_never_cached(small):
    engine = Engine(
        small.model, small.tokenizer, {}, num_blocks=64, block_size=4, proposer=Junk(), num_speculative_tokens=6
    )
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Count from one to ten."}])
    rid = engine.add(Request(prompt, GREEDY, max_tokens=24, ignore_eos=True))
    seq = engine.requests[rid].seqs[0]
    steps_after_prefill = 0
    while engine.has_work():
        engine.step()
        if seq.status is Status.RUNNING and seq.n_uncomputed == 1:
            steps_after_prefill += 1
            # what it holds covers its tokens, not the 6 rejected guesses past them
            assert len(seq.block_table) <= engine.blocks.blocks_for(len(seq.tokens))
        b = engine.blocks
        assert b.num_used + b.num_free == b.num_blocks
    assert steps_after_prefill > 5 and engine.speculator.stats.drafted > 0 and engine.speculator.stats.accepted == 0
    plain = small.generate([Request(prompt, GREEDY, max_tokens=24, ignore_eos=True)])[0][0].token_ids
    assert seq.output == plain  # every guess rejected, every token still plain decoding's
    assert engine.blocks.num_used == 0
    # every block the prefix cache names holds real tokens at their real place
    real = real_blocks(seq.tokens, 4)
    assert engine.blocks.num_cached > 0
    assert all(entry.tokens in real for entry in engine.blocks._cached.values())
    # and a prompt made of the real prefix plus the rejected guesses hits only the real blocks
    n_real = len(seq.tokens) - 1
    lookup = engine.blocks.take_prefix([], seq.tokens[:n_real] + [49000] * 6 + [1])
    assert lookup <= n_real


def test_kept_guesses_after_a_stop_are_not_counted_as_kept(small):
    # A run of right guesses that a stop token cuts: the guesses after it were counted as kept
    # ("drafts kept 6/6" for a reply of 2 tokens), though no client ever saw them.
    prompt = small.tokenizer.encode_chat([{"role": "user", "content": "Count from one to ten."}])
    plain = small.generate([Request(prompt, GREEDY, max_tokens=16, ignore_eos=True)])[0][0].token_ids
    stop = plain[2]
    assert stop not in plain[:2]
    engine = Engine(
        small.model, small.tokenizer, {}, num_blocks=64, block_size=4, proposer=Oracle([prompt + plain]), num_speculative_tokens=5
    )
    out = engine.generate([Request(prompt, GREEDY, max_tokens=16, ignore_eos=True, stop_token_ids=[stop])])[0][0]
    assert out.token_ids == plain[:3] and out.finish_reason == "stop"
    stats = engine.speculator.stats
    # the prompt's step gave plain[0]; one verify of 5 right guesses gave plain[1] and the stop
    assert (stats.verifies, stats.drafted, stats.accepted, stats.gained) == (1, 5, 2, 2)
    assert engine.stats()["spec_mean_accepted_length"] == 2.0  # not 3: the target's 6th token was never given


def test_truncate_gives_back_the_blocks_past_the_kept_tokens():
    blocks = BlockManager(num_blocks=8, block_size=4)
    table = []
    blocks.grow(table, 13)  # 4 blocks
    blocks.truncate(table, 6)  # 2 blocks hold 6 tokens
    assert len(table) == 2 and blocks.num_free == 6
    blocks.truncate(table, 8)  # nothing to give back
    assert len(table) == 2
    blocks.free(table)
    assert blocks.num_free == 8


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_a_seeded_sampled_request_gives_its_text_alone_amid_others_and_without_speculation(small, proposer):
    """Its text depends on its seed and parameters, not on the load: above speculative_max_batch
    nobody speculates, and a verify spends the generator differently from a plain step, so a seeded
    sampled request decodes without drafts (speculative.is_seeded_sampling). Before, alone and amid
    three other streams gave different text (0 of 3 alike)."""
    chat = lambda text: small.tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    seeded = Request(
        chat("Repeat: red, green, red, green, red."), SamplingParams(temperature=0.8, top_p=0.9, seed=1234), max_tokens=12, n=2
    )
    others = [Request(chat(f"{i}. Repeat: one, two, one, two."), GREEDY, max_tokens=12) for i in range(3)]

    def run(with_others: bool, speculate: bool = True):
        draft = DraftModelProposer(small.model, "itself") if proposer == "draft" else NgramProposer(1, 3)
        engine = Engine(small.model, small.tokenizer, {}, num_blocks=96, block_size=4, proposer=draft if speculate else None)
        out = engine.generate([seeded] + (others if with_others else []))
        return [c.token_ids for c in out[0]], engine.speculator.stats

    alone, stats = run(False)
    assert alone == run(True)[0] == run(False, speculate=False)[0]
    assert stats.verifies == 0  # alone it could have speculated: it did not
    greedy_alone = Engine(small.model, small.tokenizer, {}, num_blocks=64, block_size=4, proposer=NgramProposer(1, 3))
    greedy_alone.generate(others[:1])
    assert greedy_alone.speculator.stats.verifies > 0  # greedy requests still speculate


def test_bad_speculation_settings_are_clear_errors(small):
    from common.errors import UserError

    with pytest.raises(UserError, match="num_speculative_tokens"):
        Engine(small.model, small.tokenizer, {}, num_blocks=8, proposer=Junk(), num_speculative_tokens=0)
    with pytest.raises(ValueError, match="unknown proposer"):
        build_engine("does-not-matter", speculative="medusa")


def test_a_step_gives_one_event_per_choice_with_every_kept_token(small):
    """A server streams one chunk per step, one entry per choice: kept drafts arrive together."""
    reference = small.generate([Request([5, 6, 7, 8], GREEDY, max_tokens=16, n=2, ignore_eos=True)])[0][0].token_ids
    engine = Engine(
        small.model, small.tokenizer, {}, num_blocks=64, block_size=4, proposer=Oracle([[5, 6, 7, 8] + reference])
    )
    engine.add(Request([5, 6, 7, 8], GREEDY, max_tokens=16, n=2, ignore_eos=True), "r")
    streamed, sizes = {0: [], 1: []}, []
    while engine.has_work():
        for _, events, _ in engine.step():
            assert len({e.index for e in events}) == len(events)
            for e in events:
                assert len(e.logprobs) in (0, len(e.token_ids))
                streamed[e.index] += e.token_ids
                sizes.append(len(e.token_ids))
    assert streamed[0] == streamed[1] == reference
    assert max(sizes) > 1


@torch.inference_mode()
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_verify_rows_report_the_logprobs_plain_decoding_reports(small, proposer):
    """A verify row's logprobs are the model's raw distribution at that position (the min_tokens
    ban shapes the draw, not what is reported): exactly what a plain decode step reports (float32).
    Checked against the whole text scored in one pass, for greedy and sampled requests with every
    knob set."""
    from model import forward_sequence

    fox = small.tokenizer.encode_chat([{"role": "user", "content": "Repeat: the fox, the fox, the fox."}])
    comma = small.tokenizer.token_to_id(",")
    knobs = dict(repetition_penalty=1.2, presence_penalty=0.2, logit_bias={11: 2.0}, logprobs=5)
    # The comma is a stop token that min_tokens bans over the first rows, where the reply (and so
    # prompt lookup's guesses) would put it: rows with much of their mass on a banned token.
    reqs = [
        Request(fox, SamplingParams(temperature=0, **knobs), max_tokens=14, min_tokens=12, stop_token_ids=[comma]),
        Request(fox, SamplingParams(temperature=0.8, top_p=0.9, seed=3, **knobs), max_tokens=10, min_tokens=8, stop_token_ids=[comma]),
    ]
    draft = DraftModelProposer(small.model, "itself") if proposer == "draft" else NgramProposer(min_n=1, max_n=3)
    engine = Engine(small.model, small.tokenizer, {}, num_blocks=64, block_size=4, proposer=draft)
    for req in reqs:
        events = [e for events in engine.stream(req) for e in events]
        tokens = [t for e in events for t in e.token_ids]
        reported = [lp for e in events for lp in e.logprobs]
        assert len(reported) == len(tokens) > req.min_tokens
        logits = forward_sequence(small.model, req.prompt_ids + tokens).float()[len(req.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits, dim=-1)  # [tokens, vocab]
        for i, (token, lp) in enumerate(zip(tokens, reported)):
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(expected[i, token].item(), abs=1e-4), f"token {i}"
            top = expected[i].topk(len(lp.top))
            assert [t for t, _ in lp.top] == top.indices.tolist()
    assert engine.speculator.stats.verifies > 0  # some of the logprobs checked came from verify rows


@torch.inference_mode()
def test_verify_rows_are_decodes_at_consecutive_positions(small):
    """The pending token and the drafts run as one-token rows of the sequence's block table."""
    engine = Engine(small.model, small.tokenizer, {}, num_blocks=64, block_size=4, proposer=Oracle([]))
    rid = engine.add(Request([1, 2, 3, 4, 5], GREEDY, max_tokens=8))
    seq = engine.requests[rid].seqs[0]
    engine.step()
    seq.draft = [7, 8, 9]
    rows = engine.speculator.verify_rows([seq])
    assert [w.tokens for w in rows] == [[seq.tokens[-1]], [7], [8], [9]]
    assert [w.start for w in rows] == [5, 6, 7, 8]
    assert all(w.block_table is seq.block_table for w in rows)


def test_a_draft_model_equal_to_the_target_has_every_guess_kept(small):
    """The model drafting for itself: greedy drafts are the target's own picks (its K/V in the
    draft's pool follow each verify), unless a near tie flips between a chunk and a decode row."""
    itself = DraftModelProposer(small.model, "itself")
    engine = Engine(small.model, small.tokenizer, {}, num_blocks=64, block_size=4, proposer=itself, num_speculative_tokens=4)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Name the planets of the solar system."}])
    out = engine.generate([Request(prompt, GREEDY, max_tokens=40, ignore_eos=True)])[0][0]
    assert out.token_ids == small.generate([Request(prompt, GREEDY, max_tokens=40, ignore_eos=True)])[0][0].token_ids
    assert engine.speculator.stats.drafted > 20 and engine.speculator.stats.accepted >= 0.95 * engine.speculator.stats.drafted
    assert engine.blocks.num_used == 0


def test_a_self_draft_keeps_its_guesses_after_a_preemption(small):
    """A preempted sequence gives up its blocks, so its draft's K/V (addressed through the same
    table) is gone too: the draft must run the sequence again from the start, as the target does,
    or it guesses from another sequence's K/V and its acceptance falls (to 0.6 before the fix)."""
    chat = lambda text: small.tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    reqs = [
        Request(chat(f"{i}. List the planets of the solar system."), GREEDY, max_tokens=24, ignore_eos=True)
        for i in range(3)
    ]

    def run(num_blocks):
        proposer = DraftModelProposer(small.model, "itself")
        engine = Engine(
            small.model, small.tokenizer, {}, num_blocks=num_blocks, block_size=4, proposer=proposer,
            num_speculative_tokens=4, speculative_max_batch=4, prefix_caching=False,
        )  # fmt: skip
        return [c.token_ids for out in engine.generate(reqs) for c in out], engine

    roomy, roomy_engine = run(64)
    tight, tight_engine = run(24)  # three sequences of up to 14 blocks each: preemptions
    assert tight_engine.scheduler.n_preemptions > 0 and roomy_engine.scheduler.n_preemptions == 0
    assert tight == roomy
    rate = [e.speculator.stats.accepted / e.speculator.stats.drafted for e in (roomy_engine, tight_engine)]
    assert rate[0] > 0.9 and rate[1] >= rate[0] - 0.02, rate  # fp32 self-draft: 1.0 and 1.0 here


def test_a_draft_model_catches_up_on_a_long_prompt_in_chunks(small):
    """The draft runs a long prompt in chunks of its token budget, one a step, like the target's
    chunked prefill (one chunk of the whole prompt froze other streams for 46 s at 5,000 tokens),
    and still guesses right once it has caught up."""
    text = " ".join(f"Item {i}: the {TOPICS[i % len(TOPICS)]}." for i in range(40))
    prompt = small.tokenizer.encode_chat([{"role": "user", "content": f"{text}\nRepeat the last item."}])
    req = Request(prompt, GREEDY, max_tokens=16, ignore_eos=True)
    draft = DraftModelProposer(small.model, "itself", catch_up_tokens=64)
    engine = Engine(small.model, small.tokenizer, {}, num_blocks=128, block_size=4, proposer=draft)
    pass_sizes = []  # tokens in each forward pass of the draft
    run = draft.runner.run
    draft.runner.run = lambda work: pass_sizes.append(sum(len(w.tokens) for w in work)) or run(work)
    out = engine.generate([req])[0][0].token_ids
    assert len(prompt) > 4 * 64 and max(pass_sizes) <= 64
    plain = Engine(small.model, small.tokenizer, {}, num_blocks=128, block_size=4)
    assert out == plain.generate([req])[0][0].token_ids
    stats = engine.speculator.stats
    assert stats.drafted > 5 and stats.accepted >= 0.9 * stats.drafted, stats


def test_guesses_take_only_blocks_that_no_running_sequence_needs(small):
    # Guesses are worth running only if they displace nobody: a draft grew the older sequence's table
    # into the block the newer one needed for its next token, which preempted it early, for guesses
    # all rejected here (24 steps against 20 without speculation).
    reqs = [Request([300 + i, 301, 302], GREEDY, max_tokens=13, ignore_eos=True) for i in (0, 10)]
    seen = {}
    for name, proposer in (("off", None), ("junk", Junk())):
        engine = Engine(
            small.model, small.tokenizer, {}, num_blocks=4, block_size=4, proposer=proposer,
            num_speculative_tokens=6, speculative_max_batch=4,
        )  # fmt: skip
        tokens = [outputs[0].token_ids for outputs in engine.generate(reqs)]
        seen[name] = (tokens, engine.n_steps, engine.scheduler.n_preemptions)
    assert seen["junk"] == seen["off"] and seen["off"][2] > 0  # the pool is short: someone waits, once

def test_a_draft_with_another_vocabulary_is_refused(small):
    from common.errors import UserError
    from proposers import check_draft

    other = SimpleNamespace(config=SimpleNamespace(vocab_size=32000))  # a Llama-2-sized vocabulary
    with pytest.raises(UserError, match="vocabulary has 32000 tokens and the target's 49152"):
        check_draft(other, small.model)
    check_draft(small.model, small.model, small.tokenizer, small.tokenizer)

    class Renamed:  # the same size, one token spelled differently
        vocab_size = small.tokenizer.vocab_size

        def id_to_token(self, i):
            return "<other>" if i == 500 else small.tokenizer.id_to_token(i)

    with pytest.raises(UserError, match="token 500 is '<other>'"):
        check_draft(small.model, small.model, Renamed(), small.tokenizer)
    # An engine given the proposer directly (not through load_draft) checks it too: unchecked, the
    # first rejection of a sampled guess failed every request of its step on a shape mismatch.
    with pytest.raises(UserError, match="vocabulary has 32000 tokens and the target's 49152"):
        Engine(small.model, small.tokenizer, {}, num_blocks=16, block_size=4, proposer=DraftModelProposer(other, "x"))


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_speculation_with_the_kernels_on_and_off(kernels):
    """Verify rows through kernels/ (the paged decode kernel, one C++ call per layer) and through
    chapter 05's PyTorch (gather + SDPA): all-right guesses kept, plain decoding's tokens."""
    from model import load_model
    from ops import resolve

    d = resolve_model("tiny-llama3")
    model = load_model(d, ops=resolve(kernels, torch.device("cpu")))
    base = Engine(model, Tokenizer(d), {}, num_blocks=64)
    prompts = [[5, 9, 13, 200, 7], list(range(3, 40))]
    reqs = lambda: [Request(p, GREEDY, max_tokens=10, ignore_eos=True) for p in prompts]  # noqa: E731
    plain = [o[0].token_ids for o in base.generate(reqs())]
    oracle = Oracle([p + o for p, o in zip(prompts, plain)])
    engine = Engine(model, base.tokenizer, {}, num_blocks=64, proposer=oracle)
    assert [o[0].token_ids for o in engine.generate(reqs())] == plain
    assert engine.speculator.stats.drafted > 0 and engine.speculator.stats.accepted == engine.speculator.stats.drafted


def test_speculation_on_each_device(device):
    """On cpu and (where present) cuda, where verify steps replay as CUDA graphs when the kernels
    capture them: guesses that are all right are all
    kept, and the tokens are plain decoding's (tiny random model, float32)."""
    from model import load_model

    d = resolve_model("tiny-llama3")
    model = load_model(d, device=device)
    base = Engine(model, Tokenizer(d), {}, num_blocks=64, block_size=16)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 17, 40)]
    reqs = lambda: [Request(p, GREEDY, max_tokens=12, ignore_eos=True) for p in prompts]  # noqa: E731
    plain = [o[0].token_ids for o in base.generate(reqs())]
    engine = Engine(
        model,
        base.tokenizer,
        {},
        num_blocks=64,
        block_size=16,
        speculative_max_batch=4,
        proposer=Oracle([p + o for p, o in zip(prompts, plain)]),
    )
    assert [o[0].token_ids for o in engine.generate(reqs())] == plain
    assert engine.speculator.stats.drafted > 0 and engine.speculator.stats.accepted == engine.speculator.stats.drafted


def test_a_draft_model_shares_the_kv_budget():
    """--speculative draft: the target's pool and the draft's mirror of it fit the one budget."""
    budget = 64 * 2**20
    engine, _ = build_engine(
        str(resolve_model("smollm2-135m")), "cpu", "float32", speculative="draft", kv_cache_bytes=budget
    )
    target, draft = engine.runner.cache.nbytes, engine.speculator.proposer.runner.cache.nbytes
    assert draft == target  # the same model's K/V per token, in the same dtype
    assert 0.9 * budget <= target + draft <= budget
    assert engine.speculator.proposer.blocks is engine.blocks


@pytest.mark.parametrize("broken", ["inf", "nan"])
def test_a_draft_model_gone_to_inf_or_nan_only_loses_its_guesses(broken):
    """A draft whose logits are inf or NaN (a broken or overflowing draft model): its guesses are
    taken as sample() takes logits (+inf the largest float, NaN no candidate), none where no token
    is left, and the requests go on, a sampled one too, where a draw from NaN probabilities used to
    fail every request of the step."""
    target, _ = build_engine("tiny-llama3", "cpu", "float32", num_blocks=64)
    draft, _ = load("tiny-llama3", "cpu", "float32")
    draft.norm.mul_(1e38) if broken == "inf" else draft.norm.fill_(float("nan"))  # the final norm's weights
    engine = Engine(
        target.model,
        target.tokenizer,
        {},
        num_blocks=64,
        proposer=DraftModelProposer(draft, "broken"),
        speculative_max_batch=4,
    )
    prompt = [1, 300, 500, 700, 900]
    greedy = Request(prompt, SamplingParams(temperature=0), max_tokens=12, ignore_eos=True)
    sampled = Request(prompt, SamplingParams(temperature=1.0), max_tokens=12, ignore_eos=True)
    outs = engine.generate([greedy, sampled])
    assert outs[0][0].token_ids == target.generate([greedy])[0][0].token_ids
    assert len(outs[1][0].token_ids) == 12
    stats = engine.speculator.stats
    assert stats.verifies > 0 if broken == "inf" else stats.drafted == 0  # NaN everywhere: no guess at all


def test_a_request_whose_verify_rows_go_nan_fails_alone(monkeypatch):
    # As in the sampler (test_engine.py), in speculation's verify rows: the request whose rows have no
    # finite logit ends with its error; the step's other sequences keep their verified tokens.
    from sampling import NoTokenError

    target, _ = build_engine("tiny-llama3", "cpu", "float32", num_blocks=128)
    reqs = [Request([1, 300 + i, 500 + i, 700 + i], GREEDY, max_tokens=10, ignore_eos=True) for i in range(3)]
    alone = [target.generate([r])[0][0].token_ids for r in reqs]
    oracle = Oracle([r.prompt_ids + a for r, a in zip(reqs, alone)])  # drafts every step, all kept
    engine = Engine(
        target.model, target.tokenizer, {}, num_blocks=128, proposer=oracle, num_speculative_tokens=3, speculative_max_batch=8
    )
    ids = {engine.add(r): i for i, r in enumerate(reqs)}
    poisoned = next(engine.requests[rid].seqs[0] for rid, i in ids.items() if i == 1)
    real, poisoned_rows = engine.runner.run, []

    def run(work):  # the poisoned sequence's rows go NaN once it has 2 tokens out
        logits = real(work)
        rows = [row for row, w in enumerate(work) if w.block_table is poisoned.block_table]
        if rows and len(poisoned.output) >= 2:
            poisoned_rows.append(len(rows))
            logits[rows] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "run", run)
    got, errors = {}, {}
    while engine.has_work():
        for rid, events, _ in engine.step():
            if isinstance(events, Exception):
                errors[ids[rid]] = events
            else:
                got.setdefault(ids[rid], []).extend(t for e in events for t in e.token_ids)
    assert poisoned_rows[0] > 1  # a draft's verify rows: the failure came through Speculator.verify
    assert list(errors) == [1] and isinstance(errors[1], NoTokenError) and "no finite logit" in str(errors[1])
    assert got[0] == alone[0] and got[2] == alone[2] and got[1] == alone[1][: len(got[1])]
    assert engine.speculator.stats.accepted > 0 and not engine.requests and engine.blocks.num_used == 0


@pytest.mark.reaches("quantize.py")
def test_a_draft_stored_quantized_is_read_as_stored_unless_draft_quant_asks_otherwise(tmp_path):
    # --draft-quant's default (int4) used to re-quantize every draft, and refuse one stored quantized
    # (a quantized directory, the model drafting for itself) with a message about --quant.
    from argparse import Namespace
    from pathlib import Path

    from common.errors import UserError
    from common.tools.warm_python import run_python
    from proposers import speculative_args

    stored = tmp_path / "tiny-int8"
    quantize = ["quantize.py", "--model", "tiny-llama3", "--bits", "8", "--out", str(stored)]
    r = run_python(quantize, cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert r.returncode == 0, r.stderr

    def engine(model, **flags):
        given = dict(speculative="draft", draft_model=None, draft_quant=None, num_speculative_tokens=4, speculative_max_batch=2)
        return build_engine(model, "cpu", "float32", num_blocks=64, **speculative_args(Namespace(**given | flags)))[0]

    assert engine("tiny-llama3", draft_model=str(stored)).speculator.proposer.model.quant.name == "int8"
    assert engine(str(stored)).speculator.proposer.model.quant.name == "int8"  # drafting for itself
    assert engine("tiny-llama3").speculator.proposer.model.quant.name.startswith("int4")  # a plain draft
    with pytest.raises(UserError, match=r"stored quantized \(int8\); --draft-quant re-quantizes only a plain checkpoint"):
        engine("tiny-llama3", draft_model=str(stored), draft_quant="int4")
    with pytest.raises(UserError, match="--draft-quant needs --speculative draft"):
        engine("tiny-llama3", speculative="ngram", draft_quant="int8")


def test_speculation_limits_without_a_proposer_are_refused():
    # --num-speculative-tokens or --speculative-max-batch with --speculative off changed nothing, silently
    from argparse import Namespace

    from common.errors import UserError
    from proposers import DEFAULT_K, DEFAULT_MAX_BATCH, speculative_args

    plain = dict(draft_model=None, draft_quant=None, num_speculative_tokens=None, speculative_max_batch=None)
    for flag in ("--num-speculative-tokens", "--speculative-max-batch"):
        key = flag[2:].replace("-", "_")
        with pytest.raises(UserError, match=f"{flag} needs --speculative ngram or draft"):
            speculative_args(Namespace(**plain | {"speculative": "off", key: 3}))
        assert speculative_args(Namespace(**plain | {"speculative": "ngram", key: 3}))[key] == 3
    defaults = speculative_args(Namespace(**plain | {"speculative": "off"}))
    assert (defaults["num_speculative_tokens"], defaults["speculative_max_batch"]) == (DEFAULT_K, DEFAULT_MAX_BATCH)


def test_a_draft_load_error_names_the_draft_and_its_own_flags():
    # --batch-invariant refuses float32 weights; for a float32 draft of an int4 target the refusal
    # told the user to give --quant int4/int8, which they had: the draft's flag is --draft-quant.
    from common.errors import UserError
    from ops import KernelFlags

    kernels = KernelFlags(batch_invariant=True)
    with pytest.raises(UserError, match=r"^the draft model tiny-llama3: --batch-invariant: float32 .* --draft-quant int4/int8$"):
        build_engine("tiny-llama3", "cpu", "float32", QuantSpec(4, 32), kernels=kernels, speculative="draft", draft_quant=None)


def test_a_matmul_path_for_the_int4_draft_of_a_plain_target_is_taken():
    # --matmul applies to a draft's int4 weights too: refusing it for the float32 target would refuse
    # the one model it is for
    from qmatmul import ReferenceLinear

    engine, _ = build_engine("tiny-llama3", "cpu", "float32", None, "reference", speculative="draft")
    assert isinstance(engine.speculator.proposer.model.layers[0].wqkv, ReferenceLinear)
    # ...and refused where the draft is plain too: then it is for neither model
    from common.errors import UserError

    with pytest.raises(UserError, match=r"^the draft model tiny-llama3: --matmul reference: for quantized weights"):
        build_engine("tiny-llama3", "cpu", "float32", None, "reference", speculative="draft", draft_quant=None)
    # ...and a quantized target's load checks them as without a draft (they are for it too)
    from ops import KernelFlags

    with pytest.raises(UserError, match=r"^--matmul fast: on a CPU the kernels"):
        build_engine("tiny-llama3", "cpu", "auto", QuantSpec(8), "fast", KernelFlags("on"), speculative="draft")


def test_a_kv_budget_over_the_free_memory_is_refused_with_a_draft_model_too():
    # The target's share alone was checked: a draft's pool, most of the budget, went unchecked.
    from memory import free_memory

    too_much = int(1.5 * free_memory(torch.device("cpu")))
    with pytest.raises(MemoryError, match="lower --kv-cache-memory-gb"):
        build_engine("tiny-llama3", "cpu", "float32", speculative="draft", kv_cache_bytes=too_much)


def test_drafts_never_ask_for_more_than_a_step_can_verify():
    # k guesses and the pending token are k + 1 rows of one step: a k past the step's token budget
    # only had the draft model run steps whose guesses the scheduler then cut.
    engine, _ = build_engine(
        "tiny-llama3", "cpu", "float32", num_blocks=64, speculative="draft", num_speculative_tokens=1000,
        max_num_batched_tokens=64,
    )
    assert engine.speculator.max_k == 63 and "up to 63 draft tokens" in engine.speculator.describe()
