"""From logits to the next token: penalties, temperature, top-k / top-p / min-p, a seeded draw.

Per row of logits, in this order:

    logprobs = log_softmax(raw logits)                 # what the reply reports: the model's own view
    x = raw logits                                     # then shaped by the request:
    x[seen]    = x / r  where x > 0, x * r where x <= 0     # repetition penalty, seen = prompt + output
    x[out]    -= presence + frequency * count(out)          # OpenAI penalties, output tokens only
    x[bias]   += logit_bias
    x[banned]  = -inf                                       # stop tokens before min_tokens (the engine's)
    x          = -inf where NaN, the largest float where +inf   # non-finite logits, see below
    temperature == 0:  token = argmax(x)                    # greedy (so is temperature < 1e-5)
    otherwise:         p = softmax(x / temperature)
                       keep the top_k most likely,
                       then the smallest set whose mass (renormalised) reaches top_p,
                       then those with p >= min_p * max(p)
                       token ~ multinomial(p kept, renormalised)

Everything runs in float32 whatever the model's dtype: a bf16 softmax over 49k tokens loses
the tail, and top-p sums that tail.

Valid parameters (SamplingParams.validate) keep these steps finite on finite logits. A model can
still produce NaN or inf (an fp16 overflow, a broken checkpoint): NaN counts as impossible (-inf),
+inf as certain (the largest float, so ties split evenly), and a row where no token is possible
raises NoTokenError rather than drawing from NaNs: it is the model's failure, and an error says
so where a token made up by a fallback would hide it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from common.config import ConfigError
from common.errors import RunError, UserError

# Below this temperature sampling is argmax in all but name (a logit gap of 1e-3 becomes e^100),
# while logits / temperature heads for overflow: such rows are decoded greedily, as vLLM does.
GREEDY_BELOW = 1e-5
# top-p compares float32 running sums with top_p: [0.5, 0.3, 0.2] may sum to 0.49999997 after the
# first token. A mass within this slack of top_p counts as having reached it.
TOP_P_SLACK = 1e-6
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
# Far beyond any useful setting (at 10 a distribution is already close to flat), well inside
# float32 (1e300 would become inf there, and -inf / inf is NaN).
MAX_TEMPERATURE = 100.0
# The repetition penalty divides or multiplies logits: a value near 0 (1e-40 is 0 in float32) or
# huge (1e300 is inf) would make them inf or NaN. The bounds are far past useful settings (~1.1):
# at 100, a seen token's logit of 20 becomes 0.2.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# Seeds are those torch.Generator.manual_seed takes; it reads a negative one modulo 2**64, and
# choice_seed wraps the same way, so every accepted seed works for every choice.
SEED_MODULUS = 2**64


class SamplingError(UserError):
    """A sampling parameter out of range; the message names it and what is allowed, `param` the
    request field it came from (an OpenAI error object's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NoTokenError(RunError):
    """A row of logits where every token is impossible (all -inf or NaN): nothing to sample. (A
    RunError: a script ends on it with one line, not a traceback; a server fails the request alone.)"""


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 => greedy; at most MAX_TEMPERATURE
    top_k: int = -1  # -1 or 0 => off
    top_p: float = 1.0  # in (0, 1]; 1 => off
    min_p: float = 0.0  # in [0, 1]; 0 => off
    repetition_penalty: float = 1.0  # in [0.01, 100]; 1 => off
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    seed: int | None = None  # in [-2**63, 2**64)
    logprobs: int | None = None  # None => none; k => the chosen token's logprob and the top k

    def validate(self, vocab_size: int) -> None:
        """Raises SamplingError naming the first parameter that is out of range."""
        _number(
            self.temperature,
            "temperature",
            f"a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)",
            lambda v: 0 <= v <= MAX_TEMPERATURE,
        )
        _integer(self.top_k, "top_k", "an integer >= -1 (-1 or 0 turn it off)", lambda v: v >= -1)
        _number(self.top_p, "top_p", "a number in (0, 1] (1 turns it off)", lambda v: 0 < v <= 1)
        _number(self.min_p, "min_p", "a number in [0, 1] (0 turns it off)", lambda v: 0 <= v <= 1)
        low, high = REPETITION_PENALTY_RANGE
        _number(
            self.repetition_penalty,
            "repetition_penalty",
            f"a number in [{low:g}, {high:g}] (1 turns it off)",
            lambda v: low <= v <= high,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _number(
                getattr(self, name),
                name,
                f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                lambda v: -MAX_PENALTY <= v <= MAX_PENALTY,
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingError(
                    f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}", "logit_bias"
                )
            for token, bias in self.logit_bias.items():
                _integer(
                    token,
                    "logit_bias key",
                    f"a token id in [0, {vocab_size - 1}]",
                    lambda v: 0 <= v < vocab_size,
                    param="logit_bias",
                )
                _number(
                    bias,
                    f"logit_bias[{token}]",
                    f"a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                    lambda v: -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS,
                    param="logit_bias",
                )
        if self.seed is not None:
            # The range torch.Generator.manual_seed accepts.
            _integer(self.seed, "seed", "an integer in [-2**63, 2**64)", lambda v: -(2**63) <= v < SEED_MODULUS)
        if self.logprobs is not None:
            _integer(self.logprobs, "logprobs", f"an integer in [0, {MAX_LOGPROBS}]", lambda v: 0 <= v <= MAX_LOGPROBS)

    def override(self, **values) -> SamplingParams:
        """A copy with every value that is not None taken from `values`: how a request's (or a
        command line's) settings apply over the model's defaults. The one place they merge."""
        return dataclasses.replace(self, **{name: v for name, v in values.items() if v is not None})

    @classmethod
    def from_generation_config(cls, cfg: dict, where: str = "generation_config.json") -> SamplingParams:
        """Defaults from a model's generation_config.json: the values its authors tuned it with.
        Keys that are absent (or null) keep our defaults; do_sample: false means greedy. A value
        that is no number in range is the model's error (ConfigError naming `where`): unchecked,
        it failed every request, and a server blamed the client."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"{where} must hold a JSON object, got {type(cfg).__name__}")
        params = cls()
        for name, cast in (
            ("temperature", float),
            ("top_k", int),
            ("top_p", float),
            ("min_p", float),
            ("repetition_penalty", float),
        ):
            value = cfg.get(name)
            if value is None:
                continue
            number = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not number or not (cast is float or float(value).is_integer()):
                raise ConfigError(f"{where}: {name} must be a {'whole ' if cast is int else ''}number, got {value!r}")
            setattr(params, name, cast(value))
        if cfg.get("do_sample") is False:
            params.temperature = 0.0
        try:
            params.validate(vocab_size=1)  # (the vocabulary only bounds logit_bias, which no config sets)
        except SamplingError as e:
            raise ConfigError(f"{where}: {e}") from None
        return params


def _number(value, name: str, allowed: str, ok, param: str | None = None) -> None:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and ok(value)):
        raise SamplingError(f"{name} must be {allowed}, got {value!r}", param or name)


def _integer(value, name: str, allowed: str, ok, param: str | None = None) -> None:
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and ok(value)):
        raise SamplingError(f"{name} must be {allowed}, got {value!r}", param or name)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # log p(token_id) under the raw logits
    top: list[tuple[int, float]]  # (token id, logprob) of the k most likely tokens, most likely first


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed` (None: unseeded). Choice 0 keeps
    the request's seed, the others count up from it, wrapping at 2**64 so that the largest seed
    works for every n. Negative seeds come out as the non-negative seed torch reads them as."""
    return None if seed is None else (seed + index) % SEED_MODULUS


def make_generator(seed: int | None, device) -> torch.Generator | None:
    """A random stream of its own for a seeded request (on the device that draws), else None: the
    global one. A private stream makes a seeded request reproducible whatever else is running.
    Any integer seed works: it is taken modulo 2**64, as manual_seed does with negative ones."""
    if seed is None:
        return None
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed % SEED_MODULUS)
    return generator


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    prompt_tokens: list[list[int]],
    output_tokens: list[list[int]],
    banned: torch.Tensor | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of `logits` ([batch, vocab], left unchanged), and its logprobs when the
    row's params ask for them. banned: [batch, vocab] bool, tokens a row may not draw now (the stop
    tokens before min_tokens); like the penalties they shape the draw, not the reported logprobs.
    Parameters are assumed valid (SamplingParams.validate)."""
    batch, vocab = logits.shape
    if not len(params) == len(generators) == len(prompt_tokens) == len(output_tokens) == batch:
        raise ValueError(f"sample: {batch} rows of logits need one params, generator, prompt and output each")
    device = logits.device

    x = logits.to(torch.float32, copy=True)  # [batch, vocab]: ours to change
    for i, p in enumerate(params):
        apply_penalties(x[i], p, prompt_tokens[i], output_tokens[i])
    if banned is not None:
        x.masked_fill_(banned, float("-inf"))
    # Greedy rows take the argmax (the first one on ties); it is computed for every row because one
    # batched argmax is cheaper than picking rows out, and sampled rows overwrite theirs.
    best, tokens = row_max(x)  # [batch] each
    if not bool(torch.isfinite(best).all()):  # the one device-to-host transfer before the tokens'
        # A row's max is a NaN if the row has one, +inf if it has one, -inf if no token is possible:
        # only then does finite_logits change x (-inf stays -inf), so every other step skips it. The
        # penalties keep finite logits finite, but turn a NaN into NaN and never fix one.
        x = finite_logits(x)
        check_some_token_possible(x)
        tokens = x.argmax(dim=-1)  # [batch]
    rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    if rows:
        r = torch.tensor(rows, device=device)
        ps = [params[i] for i in rows]
        temperature = torch.tensor([p.temperature for p in ps], device=device)  # [rows]
        # softmax(x / T) = softmax((x - max x) / T). Shifted, the max is 0 and the rest <= 0, so a
        # small T can only push logits to -inf (probability 0), never to +inf (a NaN softmax).
        shifted = x[r] - x[r].max(dim=-1, keepdim=True).values  # [rows, vocab]
        probs = torch.softmax(shifted / temperature[:, None], dim=-1)  # [rows, vocab]
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in ps):
            # Off is top_k = vocab, top_p = 1, min_p = 0: every row goes through the same ops.
            top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in ps], device=device)
            top_p = torch.tensor([p.top_p for p in ps], device=device)
            min_p = torch.tensor([p.min_p for p in ps], device=device)
            probs = filter_probs(probs, top_k, top_p, min_p)
        tokens[r] = draw(probs, [generators[i] for i in rows])

    token_list = tokens.tolist()  # the one device-to-host transfer of the tokens
    return token_list, token_logprobs(logits, params, token_list)


def apply_penalties(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> None:
    """Repetition, presence and frequency penalties and logit_bias on one row ([vocab], float32),
    in place."""
    if p.repetition_penalty != 1.0 and (prompt or output):
        # CTRL's penalty makes every seen token less likely: dividing a positive logit by r > 1
        # lowers it, but dividing a negative one would raise it, so negative logits are multiplied.
        seen = torch.tensor(sorted(set(prompt) | set(output)), device=row.device)
        logit = row[seen]
        row[seen] = torch.where(logit > 0, logit / p.repetition_penalty, logit * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output:
        # OpenAI's: a flat cost for having appeared in the reply, plus a cost per appearance.
        ids, counts = torch.tensor(output, device=row.device).unique(return_counts=True)
        row[ids] -= p.presence_penalty + p.frequency_penalty * counts
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and the index of its first occurrence (torch.max over the last dimension).
    On a CPU through NumPy's argmax, which runs in vector instructions where torch's reduction with
    indices does not: on 16 rows of SmolLM2's 49152 logits 0.1 ms against 0.33 (torch.argmax 1 ms),
    a millisecond of a batched decode step in the engine, where the logits come in cold."""
    if x.device.type != "cpu" or x.dtype != torch.float32:  # (NumPy has no bfloat16)
        return x.max(dim=-1)
    tokens = torch.from_numpy(np.argmax(x.numpy(), axis=-1))  # [rows] int64
    return x.gather(-1, tokens[:, None]).squeeze(-1), tokens


def finite_logits(x: torch.Tensor) -> torch.Tensor:
    """x with NaN as -inf (a logit that cannot be compared is no candidate) and +inf as the
    largest float32 (a certain token). The max of a row is then finite unless the whole row is
    -inf, so x - max(x) has no inf - inf, and a softmax no NaN."""
    return torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))


def check_some_token_possible(x: torch.Tensor) -> None:
    """Raises NoTokenError when a row of x (finite_logits) is all -inf: its softmax would be NaN,
    torch.multinomial would fail (on a GPU, with a device-side assert) and argmax would pick
    token 0 for no reason. One device-to-host transfer, of one bool."""
    possible = (x > float("-inf")).any(dim=-1)  # [batch]
    if not bool(possible.all()):
        rows = (~possible).nonzero().flatten().tolist()
        raise NoTokenError(
            f"no token can be sampled for row(s) {rows}: every logit is -inf or NaN "
            "(the model produced non-finite logits, or every token was banned)"
        )


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """top-k, then top-p on what top-k kept (renormalised), then min-p; returns the kept
    probabilities renormalised.  probs: [rows, vocab]; top_k (long), top_p, min_p: [rows]

    All three are questions about rank, so one sort (most likely first) answers them for the
    whole batch; the result is scattered back to token order.
    """
    vocab = probs.shape[-1]
    # Stable: among equal probabilities the lowest token id ranks first, so ties are deterministic.
    p, order = probs.sort(dim=-1, descending=True, stable=True)  # [rows, vocab], order[:, rank] = token
    rank = torch.arange(vocab, device=probs.device)  # [vocab]

    keep = rank[None, :] < top_k[:, None]  # [rows, vocab]
    p = p * keep
    # A token stays while the tokens ranked above it hold less than top_p of the mass. That keeps
    # the token whose probability carries the sum across top_p: [0.5, 0.3, 0.2] with top_p 0.6
    # keeps two tokens (0.5 < 0.6, so the 0.3 is needed), with top_p 0.5 one.
    renormalised = p / p.sum(dim=-1, keepdim=True)
    mass_above = F.pad(renormalised.cumsum(dim=-1)[:, :-1], (1, 0))  # [rows, vocab]; 0 for the first
    keep &= (mass_above < top_p[:, None] - TOP_P_SLACK) | (top_p[:, None] >= 1)
    # min-p scales with the model's confidence: a peaked distribution keeps few tokens, a flat one
    # many. p[:, 0] is the max; a ratio of probabilities does not care about renormalisation.
    keep &= p >= min_p[:, None] * p[:, :1]
    keep[:, 0] = True  # the most likely token survives any setting

    p = p * keep
    p = p / p.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, p)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs ([rows, vocab]) with torch.multinomial, each row from its own
    generator. Rows sharing a generator (the global one, say) are drawn in one call.  -> [rows]"""
    tokens = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    groups: dict[int, list[int]] = {}  # id(generator) -> rows, in first-seen order: deterministic
    for row, g in enumerate(generators):
        groups.setdefault(id(g), []).append(row)
    for rows in groups.values():
        r = torch.tensor(rows, device=probs.device)
        tokens[r] = torch.multinomial(probs[r], 1, generator=generators[rows[0]]).squeeze(-1)
    return tokens


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[TokenLogprob | None]:
    """The chosen token's logprob and the top-k alternatives, from the raw logits (before any
    penalty, temperature or filter: the model's distribution, not the request's), for the rows
    whose params ask for them."""
    result: list[TokenLogprob | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return result
    r = torch.tensor(rows, device=logits.device)
    # A NaN logit would make every logprob of its row NaN, and NaN is not JSON.
    logprobs = torch.log_softmax(finite_logits(logits[r].float()), dim=-1)  # [rows, vocab]
    chosen_ids = torch.tensor([tokens[i] for i in rows], device=logits.device)  # [rows]
    chosen = logprobs.gather(-1, chosen_ids[:, None]).squeeze(-1)  # [rows]
    k = min(max(params[i].logprobs for i in rows), logprobs.shape[-1])
    top_lp, top_id = logprobs.topk(k, dim=-1)  # [rows, k], most likely first
    chosen, top_lp, top_id = chosen.tolist(), top_lp.tolist(), top_id.tolist()  # one transfer each
    for j, i in enumerate(rows):
        n = params[i].logprobs
        # a row with fewer than n possible tokens: the impossible ones (-inf, not JSON) are no alternatives
        top = [(t, lp) for t, lp in zip(top_id[j][:n], top_lp[j][:n]) if lp != -math.inf]
        result[i] = TokenLogprob(tokens[i], chosen[j], top)
    return result
