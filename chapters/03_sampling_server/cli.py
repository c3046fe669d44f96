"""Chat with the model in the terminal, tokens streamed as they are generated.

Usage, from this chapter's folder:

    python cli.py                                     # interactive chat (history kept)
    python cli.py --prompt "Tell me a joke" --temperature 0.7 --seed 1
    python cli.py --raw --prompt "Once upon a time"   # plain completion

In the chat: /reset forgets the history, /quit (or Ctrl-D) leaves. Statistics go to stderr.
"""

from __future__ import annotations

import sys
import time

from common.cli import base_parser, run_main
from common.errors import UserError
from engine import Engine, Request, build_engine
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
    print(
        f"[{len(prompt_ids)} prompt tokens, {n_tokens} generated, TTFT {((first or t0) - t0) * 1e3:.0f} ms, "
        f"{rate:.1f} tok/s, finish: {finish}]",
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
    args = parse_args()
    engine, _ = build_engine(args.model, args.device, args.dtype)
    request_params(args, engine).validate(engine.model.config.vocab_size)  # bad flags fail before any prompt
    if args.prompt is None:
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
