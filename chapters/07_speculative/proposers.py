"""Who guesses the next k tokens: the proposers of speculative decoding.

A decode step reads every weight of the model to produce one token. Scoring k+1 tokens in one
step reads the same weights once, so if something cheap can guess what the model would say next,
the model can check k guesses for about the price of one token, and keep the ones it agrees with
(speculative.py). A proposer is that cheap guesser:

    propose(tokens, k) -> up to k draft tokens that would follow `tokens` (prompt + output)

It may return fewer, or none (then the sequence decodes one token as in chapter 06). A proposer
that returns its guesses as plain tokens is deterministic: its "distribution" q is all on the
guess, which is what speculative.accept assumes when it is given no draft probabilities.
"""

from __future__ import annotations


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

    def propose(self, tokens: list[int], k: int) -> list[int]:
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


PROPOSERS = ("off", "ngram")


def make_proposer(name: str):
    """A proposer by its --speculative name; None for "off"."""
    if name == "off":
        return None
    if name == "ngram":
        return NgramProposer()
    raise ValueError(f"unknown proposer {name!r}: choose one of {', '.join(PROPOSERS)}")


def add_speculative_args(ap, default: str = "ngram") -> None:
    """The flags of the CLI and the server."""
    group = ap.add_argument_group("speculative decoding")
    group.add_argument(
        "--speculative",
        choices=PROPOSERS,
        default=default,
        help="who proposes draft tokens for the model to verify: ngram = prompt lookup (default: %(default)s)",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=6,
        help="draft tokens per sequence and step at most; each sequence adapts below it (default: %(default)s)",
    )
    group.add_argument(
        "--speculative-max-batch",
        type=int,
        default=4,
        help="nobody speculates while more sequences than this run (default: %(default)s)",
    )


def speculative_args(args) -> dict:
    """build_engine's keyword arguments from those flags."""
    return {
        "speculative": args.speculative,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_max_batch": args.speculative_max_batch,
    }
