"""The command-line conventions every chapter's entry points share (see ARCHITECTURE.md).

--model NAME_OR_PATH, --prompt, --max-new-tokens, --chat; generated text on stdout, statistics
on stderr, and a one-line `error: ...` (exit 2) instead of a traceback for bad input.
"""

from __future__ import annotations

import argparse
import math
import socket
import sys

from common.checkpoint import CheckpointError
from common.config import ConfigError
from common.errors import RunError, UserError
from common.models import DEFAULT_MODEL, ModelNotFoundError
from common.tokenizer import Tokenizer, TokenizerError

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."

# The errors a user can cause with a bad flag, path, file or prompt; entry points print these
# plainly. Not ValueError as such: one raised by a bug must keep its traceback.
USER_ERRORS = (UserError, ModelNotFoundError, ConfigError, CheckpointError, TokenizerError, MemoryError)


def base_parser(description: str, batch: bool = False) -> argparse.ArgumentParser:
    """`batch`: --prompt may be repeated, and args.prompt is then a list."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="smollm2-135m, tiny-llama3, or a checkpoint directory")
    if batch:
        ap.add_argument("--prompt", action="append", help="repeat for a batch of prompts")
    else:
        ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-new-tokens", type=positive_int, default=64)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    return ap


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (0 would read as "not given" in `x or default`)."""
    return _at_least(int(text), 1)


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number of at least 0 (a timeout of 0: none; -5 was taken)."""
    return _at_least(int(text), 0)


def _at_least(value: int, low: int) -> int:
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (float() takes "nan" and "inf")."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def non_empty(text: str) -> str:
    """An argparse type: a name that is not empty (or all spaces): "" was replaced by a default unseen."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535 (bind() refused more with a traceback)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, 0 to 65535, got {value}")
    return value


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, for a server to accept on once its model has loaded. Bound
    first, so that a port in use or a host this machine does not have is one line at once, not an
    error from uvicorn after the model loaded (and after the server said it was serving). Port 0:
    any free one (getsockname() says which)."""
    sock = None
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = found[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart need not wait
        sock.bind(address)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def prompt_ids(tokenizer: Tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def outside_vocabulary(ids: list[int], vocab_size: int) -> list[int]:
    """The ids, sorted and once each, that the model has no embedding row for (a tokenizer larger
    than the model's vocabulary: an IndexError in the embedding)."""
    return sorted({t for t in ids if not 0 <= t < vocab_size})


def check_prompt(ids: list[int], max_new_tokens: int, config) -> None:
    """A prompt the model (its LlamaConfig) can run: not empty, inside its context, and ids it has
    embedding rows for (a tokenizer larger than the model's vocabulary failed on an IndexError)."""
    n_prompt, max_positions = len(ids), config.max_position_embeddings
    if n_prompt == 0:
        raise UserError("the prompt is empty (0 tokens)")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if n_prompt >= max_positions:
        raise UserError(f"the prompt has {n_prompt} tokens; the model's context is {max_positions} tokens")
    outside = outside_vocabulary(ids, config.vocab_size)
    if outside:
        raise UserError(
            f"prompt token ids {outside[:5]} are outside the model's vocabulary (0..{config.vocab_size - 1}): "
            "is the tokenizer this model's?"
        )


def run_main(main) -> None:
    """Runs main(); a user error becomes `error: message` on stderr and exit status 2, a RunError
    (a lost rank) `error: message` and exit status 1."""
    try:
        sys.exit(main())
    except USER_ERRORS as e:
        print(f"error: {e or type(e).__name__}", file=sys.stderr)  # MemoryError() has no text of its own
        sys.exit(2)
    except RunError as e:  # the run's failure, said whole (a lost rank): no traceback, but not exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # `| head` closed the pipe: the reader has what it wanted
        sys.stderr.close()
        sys.exit(0)
