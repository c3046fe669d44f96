"""UserError: bad input that the person running the program can fix (a flag, a path, a prompt, a
request's field), as opposed to a bug. common.cli.run_main prints it as one line, `error: ...`,
with exit status 2 (any other exception keeps its traceback); a server answers a request's with 400.

It is a ValueError, so code that catches ValueError around a call (a server validating a
request, argparse calling a type function) still catches it.
"""

import math


class UserError(ValueError):
    """Bad input, with a message that says what was wrong and what to do instead."""


class FieldError(UserError):
    """Bad input in one field of a request: `param` names it as the request spells it ("prompt",
    "max_tokens"), `code` says what kind of refusal it is where clients look for one
    ("context_length_exceeded"). The server returns both in its error object."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class RunError(RuntimeError):
    """A run that cannot go on, for a reason its message says whole (a rank of a tensor-parallel
    group was lost): entry points print it as `error: ...` and exit 1, without a traceback, as a
    failure of the run rather than of the user's input (exit 2)."""


def check_logits(logits) -> None:
    """RunError where a step's logits (a torch tensor or a NumPy array) hold NaN or +inf: an
    argmax still picks a token there (NaN's place, or the first), and greedy decoding would go on
    printing tokens the model never chose. The max of all of them is not finite exactly then."""
    top = float(logits.max())
    if not math.isfinite(top):
        raise RunError(
            "the model's logits are not finite (NaN or inf): its activations overflow (in float16? try "
            "--dtype bfloat16 or float32), or its weights hold such values"
        )
