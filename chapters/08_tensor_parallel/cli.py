"""Chat with the model in the terminal, tokens streamed as they are generated.

Usage, from this chapter's folder:

    python cli.py                                     # interactive chat (history kept)
    python cli.py --prompt "Tell me a joke" --temperature 0.7 --seed 1
    python cli.py --raw --prompt "Once upon a time"   # plain completion
    python cli.py --quant int4 --group-size 32        # int4 weights, quantized on load
    python cli.py --tensor-parallel-size 2 --model tiny-llama3   # every layer split across 2 processes

In the chat: /reset forgets the history, /quit (or Ctrl-D) leaves. Statistics go to stderr.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from common.cli import base_parser, run_main
from common.errors import UserError
from engine import Engine, Request
from loading import add_quant_args, quant_spec
import ops
import parallel
from parallel import build_engine
from proposers import add_speculative_args, speculative_args
from sampling import SamplingParams

# request setting -> its type; the flag is --top-k for top_k
SAMPLING_FLAGS = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "seed": int,
}


def parse_args():
    ap = base_parser(__doc__)
    ap.set_defaults(prompt=None, max_new_tokens=256)
    ap.add_argument("--raw", action="store_true", help="complete --prompt as plain text, without the chat template")
    ap.add_argument("--system", default=None, help="a system message (the template may add a default one)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    add_quant_args(ap)
    add_speculative_args(ap)
    parallel.add_arguments(ap)
    for name, kind in SAMPLING_FLAGS.items():
        ap.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=None, help="default: the model's generation_config.json"
        )
    ap.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    args = ap.parse_args()
    # --raw is a plain completion of --prompt: with the chat's settings it would drop them unseen
    if args.raw and args.prompt is None:
        ap.error("--raw completes a --prompt (the interactive chat always uses the chat template)")
    if args.raw and (args.chat or args.system is not None):
        ap.error(f"{'--chat' if args.chat else '--system'} goes into the chat template, which --raw leaves out")
    return args


def request_params(args, engine: Engine) -> SamplingParams:
    """The model's defaults, with the sampling flags that were given over them."""
    return engine.default_params().override(**{name: getattr(args, name) for name in SAMPLING_FLAGS})


def stream_reply(engine: Engine, prompt_ids: list[int], args) -> str:
    """Prints the reply as it is generated; returns its text."""
    req = Request(prompt_ids, request_params(args, engine), max_tokens=args.max_new_tokens, stop=args.stop)
    # Fit max_tokens into what is left of the context, so a long chat ends its reply instead of failing.
    req.max_tokens = min(req.max_tokens, engine.context - len(prompt_ids)) if len(prompt_ids) < engine.context else 1
    drafted, accepted = engine.speculator.stats.drafted, engine.speculator.stats.accepted
    t0 = time.perf_counter()
    first = None
    text, n_tokens, finish = "", 0, None
    for events in engine.stream(req):
        for ev in events:
            first = first or time.perf_counter()
            n_tokens += len(ev.token_ids)
            text += ev.text
            finish = ev.finish_reason or finish
            print(ev.text, end="", flush=True)
    print()
    elapsed = time.perf_counter() - (first or t0)
    rate = (n_tokens - 1) / elapsed if n_tokens > 1 and elapsed > 0 else float("nan")
    drafted, accepted = engine.speculator.stats.drafted - drafted, engine.speculator.stats.accepted - accepted
    kept = f", drafts kept {accepted}/{drafted}" if drafted else ""
    print(
        f"[{len(prompt_ids)} prompt tokens, {n_tokens} generated, TTFT {((first or t0) - t0) * 1e3:.0f} ms, "
        f"{rate:.1f} tok/s{kept}, finish: {finish}]",
        file=sys.stderr,
        flush=True,
    )
    return text


def chat_loop(engine: Engine, args) -> None:
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    if sys.stdin is None:  # started with stdin closed (`<&-`): input() raised "lost sys.stdin"
        raise UserError("the chat reads its lines from stdin, which is closed: give --prompt, or run it in a terminal")
    print("chat with the model: /reset to forget, /quit to leave", file=sys.stderr)
    # A line of bytes that are not UTF-8 (a terminal in another encoding) is refused alone; strict
    # decoding ended the whole chat on it.
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if any("\udc80" <= ch <= "\udcff" for ch in line):  # bytes that are not UTF-8 (surrogateescape)
            print("error: that line is not UTF-8 text; the chat goes on without it", file=sys.stderr)
            continue
        if line.strip() in ("/quit", "/exit"):
            return
        if line.strip() == "/reset":
            history = list(base)
            print("(history cleared)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt_ids = engine.tokenizer.encode_chat(history)
        if len(prompt_ids) >= engine.context:
            history.pop()
            print(
                f"error: the conversation is {len(prompt_ids)} tokens, over the {engine.context}-token context: "
                f"/reset to start again",
                file=sys.stderr,
            )
            continue
        print("model> ", end="", flush=True)
        history.append({"role": "assistant", "content": stream_reply(engine, prompt_ids, args)})


def main() -> int:
    parallel.become_worker_if_torchrun()
    args = parse_args()
    # One conversation, one sequence: a pool for one full context (a server sizes it for many).
    engine, name = build_engine(
        args.model,
        args.device,
        args.dtype,
        quant_spec(args),
        args.matmul,
        ops.from_args(args),
        max_num_seqs=1,
        tensor_parallel_size=parallel.size_from(args),
        tensor_parallel_timeout=args.tensor_parallel_timeout,
        **speculative_args(args),
    )
    m = engine.model
    dense = f" + {m.dense_copy_bytes / 1e6:.0f} MB of dense copies" if m.dense_copy_bytes else ""
    # with tensor parallelism the figures are rank 0's: every rank holds its own share of both
    rank0, each = (" on rank 0", " on each rank") if getattr(engine, "tensor_parallel", None) else ("", "")
    print(
        f"[{name}: {m.quant.name if m.quant else 'unquantized'} weights ({m.weight_bytes / 1e6:.0f} MB{dense}{rank0}), "
        f"{m.device.type} {str(m.dtype).removeprefix('torch.')} activations, {m.ops.describe()}; {engine.describe_pool()}{each}; {engine.speculator.describe()}]",
        file=sys.stderr,
        flush=True,
    )
    request_params(args, engine).validate(engine.model.config.vocab_size)  # bad flags fail before any prompt
    if args.prompt is None:
        group = getattr(engine, "tensor_parallel", None)
        if group is not None:  # a rank lost while the chat waits for a line ends the chat then, not at its next line

            def lost_while_waiting(signum, frame):
                raise group.error()  # out of input(): one line, exit status 1 (common.cli.run_main)

            def wake_the_chat(reason: str) -> None:  # from the watch thread: a signal interrupts input()'s read
                if threading.current_thread() is not threading.main_thread():
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

            signal.signal(signal.SIGUSR1, lost_while_waiting)  # its own signal: SIGINT may be ignored (a background job)
            group.on_lost.append(wake_the_chat)
        chat_loop(engine, args)
        return 0
    if args.raw:
        prompt_ids = engine.tokenizer.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt_ids = engine.tokenizer.encode_chat(messages)
    if len(prompt_ids) >= engine.context:
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {engine.context} tokens")
    stream_reply(engine, prompt_ids, args)
    return 0


if __name__ == "__main__":
    run_main(main)
