"""Chapter 06's engine with kernels/ against chapter 05's, and against itself with --kernels off."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from common.models import resolve_model
from common.tokenizer import Tokenizer
from common.tools.testing import CPU_ISAS, cpu_isa, dequantized_once, load_neighbour  # noqa: F401  (cpu_isa: a fixture)
from common.tools.warm_python import run_python
from batch import Work, build_step
from cuda_graphs import DecodeGraphs
from engine import Engine, Request, build_engine
from loading import load
from model import forward_sequence, load_model
from ops import KernelFlags, KernelOps, TorchOps, resolve
from paged_cache import PagedKVCache
from quant import QuantSpec
from sampling import SamplingParams

HERE = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0)
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
]


def greedy_tokens(engine, prompt_ids, n):
    req = Request(prompt_ids, GREEDY, max_tokens=n)
    return [t for events in engine.stream(req) for ev in events for t in ev.token_ids]


# tiny-llama3 in float32, exact on both paths. SmolLM2 (heads of 64, as against 32 here) runs with the
# kernels on against chapter 05 in tests/test_chapters.py and in prompt chunks at every instruction-set
# level (test_chunked_prompts_through_the_chunk_kernel_give_chapter_05s_tokens), and against the
# kernels off below.
@pytest.mark.parametrize("name", ["tiny-llama3"])
def test_greedy_output_equals_chapter_05_on_every_test_prompt(name):
    ch05 = load_neighbour(5, "engine")
    d = resolve_model(name)
    ours, _ = build_engine(str(d), "cpu", "float32", kernels="on", num_blocks=256)
    theirs, _ = ch05.engine.build_engine(str(d), "cpu", "float32", num_blocks=256)
    assert isinstance(ours.model.ops, KernelOps)
    tok = Tokenizer(d)
    for text in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": text}])
        req = ch05.engine.Request(ids, ch05.engine.SamplingParams(temperature=0), max_tokens=24)
        expected = [t for events in theirs.stream(req) for ev in events for t in ev.token_ids]
        assert greedy_tokens(ours, ids, 24) == expected, text


@pytest.fixture(scope="module")
def smollm2_dir():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    return Tokenizer(smollm2_dir)


@pytest.mark.parametrize("quant", [None, QuantSpec(bits=4), QuantSpec(bits=8)], ids=["fp32", "int4", "int8"])
def test_kernels_on_and_off_give_the_same_logits(smollm2_dir, smollm2_tokenizer, quant):
    # Every position of a prompt (the prefill path: norms, RoPE, the int matmuls for <= 16 rows are
    # not used there, so decode them too) on both paths, float32 activations.
    ids = smollm2_tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    on = load_model(smollm2_dir, "cpu", torch.float32, quant, "fast", resolve("on", CPU))
    # dequantize-and-multiply on PyTorch's ops, each weight dequantized once rather than at every step
    off = dequantized_once(load_model(smollm2_dir, "cpu", torch.float32, quant, "reference", resolve("off", CPU)))
    assert isinstance(off.ops, TorchOps)
    torch.testing.assert_close(forward_sequence(on, ids), forward_sequence(off, ids), atol=2e-3, rtol=1e-3)
    e_on = Engine(on, smollm2_tokenizer, {}, num_blocks=64)
    e_off = Engine(off, smollm2_tokenizer, {}, num_blocks=64)
    assert greedy_tokens(e_on, ids[:20], 16) == greedy_tokens(e_off, ids[:20], 16)


def test_bf16_weights_decode_through_the_bf16_kernel_as_accurately_as_torch(smollm2_dir, smollm2_tokenizer):
    # A bf16 model with the kernels on: every matrix (the tied head too) is the library's bf16
    # matmul at every row count, on the weight tensor itself (no copy). A step of a few tokens runs
    # its matrix-vector form in every layer, a longer one its matrix product (gemm.cpp; on a CPU
    # with AMX-BF16 the library hands that one to torch's GEMM on the tiles): both give logits as
    # close to float32's as torch's bf16 GEMM's are. Close in the mean error over all logits, summed
    # over a few texts: one text's error swings either way between CPUs (on a Zen 5 its largest 1.04
    # against torch's 0.67, another's 0.64 against 0.81; one text's mean 0.42-1.47x torch's), the sum
    # over three texts 0.79-1.04x at every level there, torch capped at AVX2 or not.
    import kernels
    from ops import KernelBf16Linear

    on = load_model(smollm2_dir, "cpu", torch.bfloat16, None, "fast", resolve("on", CPU))
    off = load_model(smollm2_dir, "cpu", torch.bfloat16, None, "fast", resolve("off", CPU))
    exact = load_model(smollm2_dir, "cpu", torch.float32, None, "fast", resolve("off", CPU))
    for w in [on.lm_head, on.layers[0].wqkv, on.layers[-1].w_down]:
        assert isinstance(w, KernelBf16Linear)
    assert on.dense_copy_bytes == 0 and isinstance(off.lm_head, torch.Tensor)
    texts = [
        "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods to hide.",
        "What is the capital of France? Answer in one sentence, and then explain why it became the capital.",
        "Once upon a time there was a small village by the sea where fishermen told stories every night.",
    ]
    texts_ids = [smollm2_tokenizer.encode(text) for text in texts]
    assert min(map(len, texts_ids)) > kernels.load().gemm_min_rows
    for n in (6, None):  # the matrix-vector form, then the matrix product
        err_on = err_off = 0.0
        for ids in (all_ids[:n] for all_ids in texts_ids):
            want = forward_sequence(exact, ids)
            err_on += (forward_sequence(on, ids).float() - want).abs().mean().item()
            err_off += (forward_sequence(off, ids).float() - want).abs().mean().item()
        assert err_on <= 1.15 * err_off, (n, err_on, err_off)  # an output truncated to bf16: 1.2-1.4x


def test_padded_static_decode_steps_equal_the_eager_engine():
    # What the CUDA graphs replay, run eagerly on a CPU: decode steps padded to their bucket, on
    # fixed buffers, with fixed-width block tables; everything but the capture itself.
    d = resolve_model("tiny-llama3")
    model, tok = load_model(d, ops=resolve("on", CPU)), Tokenizer(d)
    rng = random.Random(0)
    reqs = [
        Request(
            [rng.randrange(3, 250) for _ in range(rng.choice([1, 5, 17, 40]))],
            GREEDY,
            max_tokens=rng.randrange(1, 25),
            ignore_eos=True,
        )
        for _ in range(11)
    ]
    arrivals = [rng.randrange(0, 12) for _ in reqs]
    eager = Engine(model, tok, {}, num_blocks=128, max_num_seqs=16)
    padded = Engine(model, tok, {}, num_blocks=128, max_num_seqs=16)
    assert eager.runner.graphs is None and padded.runner.graphs is None  # no graphs on a CPU
    # As the runner sets them up on CUDA: one block more than the block manager hands out, for padding rows.
    runner = padded.runner
    runner.cache = PagedKVCache(model.config, 129, 16, model.device, model.dtype)
    runner.graphs = DecodeGraphs(model, runner.cache, 16, -(-padded.context // 16), 128, capture=False)
    assert runner.graphs.buckets[:4] == [1, 2, 4, 8]
    ran = []
    run = runner.graphs.run
    runner.graphs.run = lambda work: ran.append(len(work)) or run(work)
    assert padded.generate(reqs, arrivals) == eager.generate(reqs, arrivals)
    assert any(n not in runner.graphs.buckets for n in ran)  # some steps were padded to a larger bucket


def test_decode_graphs_only_where_the_ops_can_capture_them():
    import kernels

    assert KernelOps(kernels.load(), torch.device("cuda")).can_capture_graphs
    assert not resolve("on", CPU).can_capture_graphs and not TorchOps().can_capture_graphs
    d = resolve_model("tiny-llama3")
    for ops in (resolve("on", CPU), resolve("off", CPU)):
        engine = Engine(load_model(d, ops=ops), Tokenizer(d), {}, num_blocks=8)
        assert engine.runner.graphs is None and engine.runner.cache.num_blocks == 8  # no spare block for padding either


def test_kernels_where_they_cannot_run(capsys):
    mps = torch.device("mps")
    ops = resolve("auto", mps)
    assert isinstance(ops, TorchOps) and ops.describe() == "kernels: off (kernels/ has no mps implementation)"
    with pytest.raises(ValueError, match="--kernels on: kernels/ has no mps implementation"):
        resolve("on", mps)
    with pytest.raises(ValueError, match="kernels must be 'auto', 'on' or 'off'"):
        resolve("yes", CPU)
    # What the entry points get: --kernels auto says why it falls back, --kernels off does not.
    assert isinstance(KernelFlags("auto").ops(mps), TorchOps)
    assert (
        "note: kernels off (kernels/ has no mps implementation): chapter 05's PyTorch path runs"
        in capsys.readouterr().err
    )
    assert KernelFlags("off").ops(mps).describe() == "kernels: off (--kernels off)" and capsys.readouterr().err == ""
    assert KernelFlags("on").ops(CPU).describe().startswith("kernels: on (cpu, ")


def test_a_failed_build_is_one_startup_line_and_a_note_with_the_compilers_lines(monkeypatch, capsys):
    import kernels

    def failed_build():
        raise kernels.KernelBuildError("building kernels/ failed (14 sources for cpu)\nninja: line 1\nerror: line 2")

    monkeypatch.setattr(kernels, "load", failed_build)
    ops = KernelFlags("auto").ops(CPU)
    assert ops.describe() == "kernels: off (building kernels/ failed (14 sources for cpu))"
    assert capsys.readouterr().err.splitlines() == [
        "note: kernels off (building kernels/ failed (14 sources for cpu)): chapter 05's PyTorch path runs",
        "  ninja: line 1",
        "  error: line 2",
    ]


def test_a_head_size_the_kernels_do_not_serve_falls_back_to_pytorch_and_says_why(tmp_path, capsys):
    why = "kernels/ decodes heads of 32, 64, 96, 128, 256 values; this model's have 80"
    assert resolve("auto", CPU, head_dim=80).describe() == f"kernels: off ({why})"
    with pytest.raises(UserError, match=f"--kernels on: {why}"):
        resolve("on", CPU, head_dim=80)
    assert isinstance(resolve("auto", CPU, head_dim=32), KernelOps)  # tiny-llama3's
    # A whole model: tiny-llama3 with 2 query heads of 80 values instead of 8 of 32, loaded
    # the way every entry point loads one, answers through PyTorch and says why.
    cfg = json.loads((resolve_model("tiny-llama3") / "config.json").read_text())
    cfg |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 80}
    d = tmp_path / "wide-heads"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(resolve_model("tiny-llama3") / f, d / f)
    engine, _ = build_engine(str(d), "cpu", "float32", kernels="auto", num_blocks=16)
    assert isinstance(engine.model.ops, TorchOps) and why in capsys.readouterr().err
    assert len(greedy_tokens(engine, [1, 2, 3, 4], 4)) > 0


@pytest.mark.reaches("generate.py")  # a script run in a subprocess (common/tools/carried.py)
@pytest.mark.parametrize("flag", ["on", "off"])
def test_generate_with_and_without_kernels(flag):
    r = run_python(
        [
            str(HERE / "generate.py"),
            "--chat",
            "--prompt",
            "What is the capital of France?",
            "--max-new-tokens",
            "12",
            "--dtype",
            "float32",
            "--kernels",
            flag,
        ],
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run slurm/gpu_check.sh on a GPU node)")
def test_cuda_graphs_replay_equals_eager_on_cuda():
    d = resolve_model("tiny-llama3")
    model, tok = load_model(d, "cuda", torch.float32, ops=resolve("on", torch.device("cuda"))), Tokenizer(d)
    rng = random.Random(1)
    reqs = [
        Request([rng.randrange(3, 250) for _ in range(rng.choice([1, 9, 33]))], GREEDY, max_tokens=20, ignore_eos=True)
        for _ in range(7)
    ]
    graphs = Engine(model, tok, {}, num_blocks=64, max_num_seqs=8)
    assert graphs.runner.graphs is not None and graphs.runner.graphs.capture
    eager = Engine(model, tok, {}, num_blocks=64, max_num_seqs=8, cuda_graphs=False)
    assert graphs.generate(reqs, [0, 0, 1, 2, 3, 5, 8]) == eager.generate(reqs, [0, 0, 1, 2, 3, 5, 8])
    assert graphs.runner.graphs.graphs, "no decode step was captured"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run slurm/gpu_check.sh on a GPU node)")
@pytest.mark.parametrize("quant", [None, QuantSpec(bits=4), QuantSpec(bits=8)], ids=["bf16", "int4", "int8"])
def test_cuda_kernels_are_as_close_to_float32_as_torch_on_cuda(quant):
    # The CUDA half on a GPU, through the model: a prompt's logits (the int4 and int8 products,
    # norms, RoPE) in bfloat16 with the kernels on and off, each against the same weights in
    # float32. On CUDA a prompt's attention is gather + SDPA and a bf16 weight's product cuBLAS, with
    # the kernels on as off (their CUDA kernels are checked in kernels/tests). The CUDA int4 kernel
    # takes bfloat16 activations only, hence bfloat16 throughout.
    d, cuda = resolve_model("tiny-llama3"), torch.device("cuda")
    ids = Tokenizer(d).encode_chat([{"role": "user", "content": PROMPTS[3]}])
    on = load_model(d, cuda, torch.bfloat16, quant, "fast", resolve("on", cuda))
    off = load_model(d, cuda, torch.bfloat16, quant, "fast", resolve("off", cuda))
    exact = dequantized_once(load_model(d, cuda, torch.float32, quant, "reference", resolve("off", cuda)))
    assert isinstance(on.ops, KernelOps) and isinstance(off.ops, TorchOps)
    want = forward_sequence(exact, ids)
    err_on = (forward_sequence(on, ids).float() - want).abs().max().item()
    err_off = (forward_sequence(off, ids).float() - want).abs().max().item()
    assert err_on <= 2 * err_off + 1e-3, f"kernels on: {err_on:.4f} from float32, torch: {err_off:.4f}"


# Blocks of 24 on every instruction-set level of the library this CPU has, the others at the level in use.
@pytest.mark.parametrize(
    "block_size, cpu_isa", [(24, isa) for isa in CPU_ISAS] + [(n, None) for n in (1, 48, 512)], indirect=["cpu_isa"]
)
def test_any_block_size_decodes_as_pytorch_does(block_size, cpu_isa):
    # Partitions are whole blocks: 256 keys with 16-token blocks, 240 with 24 or 48, one block of 512.
    assert KernelOps.partition_size(block_size) % block_size == 0
    d = resolve_model("tiny-llama3")
    ids = Tokenizer(d).encode_chat(
        [{"role": "user", "content": PROMPTS[3]}]
    )  # 41 tokens, 61 with the answer: three blocks of 24
    tokens = {}
    for flag in ("on", "off"):
        engine, _ = build_engine(str(d), "cpu", "float32", kernels=flag, num_blocks=64, block_size=block_size)
        tokens[flag] = greedy_tokens(engine, ids, 20)
    assert tokens["on"] == tokens["off"] and len(tokens["on"]) == 20


def test_a_block_size_the_decode_kernel_cannot_read_is_refused_at_startup():
    d = resolve_model("tiny-llama3")
    with pytest.raises(UserError, match="at most 4096 tokens"):
        build_engine(str(d), "cpu", "float32", kernels="on", num_blocks=2, block_size=8192)
    build_engine(str(d), "cpu", "float32", kernels="off", num_blocks=2, block_size=8192)  # PyTorch reads any size


# --- prompt chunks through the chunk attention kernel (csrc/cpu/chunk_attention.cpp) ---------------


def mixed_step(seed: int, head_dim: int, dtype, decodes: bool = True, block_size: int = 16):
    """A step of decodes, whole prompts, and chunks after cached keys (starting at a block's start
    and inside one), over a pool scattered at random -> (q, k_pool, v_pool, step)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    k_pool, v_pool = (torch.randn(64, block_size, 2, head_dim, generator=g).to(dtype) for _ in range(2))
    free = list(range(64))
    rng.shuffle(free)
    work = []
    for start, new in [(0, 23), (37, 1), (16, 9), (21, 40), (5, 1), (rng.randrange(0, 60), rng.randrange(2, 30))]:
        if new == 1 and not decodes:
            continue
        work.append(Work([0] * new, start, [free.pop() for _ in range(-(-(start + new) // block_size))]))
    step = build_step(work, block_size, "cpu")
    return torch.randn(len(step.tokens), 6, head_dim, generator=g).to(dtype), k_pool, v_pool, step


@pytest.mark.parametrize("cpu_isa", CPU_ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_mixed_step_takes_the_chunk_kernel_and_equals_gather_and_sdpa(cpu_isa, dtype, monkeypatch):
    ops = resolve("on", CPU)
    served = []
    chunks = ops.chunks
    monkeypatch.setattr(ops, "chunks", lambda *a: served.append(a[-1]) or chunks(*a))
    for seed in range(3):
        q, k_pool, v_pool, step = mixed_step(seed, 64, dtype)
        expected = TorchOps.attention(q, k_pool, v_pool, step.groups)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(ops.attention(q, k_pool, v_pool, step.groups), expected, rtol=tol, atol=tol)
    assert len(served) == 3 and all(not g.decodes for g in served)


def test_a_shape_the_chunk_kernel_does_not_serve_falls_back_to_sdpa_with_a_note(capsys):
    # Heads of 48 values (a KernelOps made for another model's heads): gather + SDPA, the same result,
    # one note for the whole run.
    ops = resolve("on", CPU)
    for seed in range(2):
        q, k_pool, v_pool, step = mixed_step(seed, 48, torch.float32, decodes=False)
        expected = TorchOps.attention(q, k_pool, v_pool, step.groups)
        torch.testing.assert_close(ops.attention(q, k_pool, v_pool, step.groups), expected, rtol=1e-5, atol=1e-5)
    err = capsys.readouterr().err
    assert err.count("note: prompt chunks through gather + SDPA: the chunk kernel does not serve heads of 48") == 1


@pytest.fixture(scope="module")
def chapter_05_chunked(smollm2_dir, smollm2_tokenizer):
    """Chapter 05's greedy tokens for three chat prompts arriving at steps 0, 2 and 5, in steps of at
    most 8 new tokens (prompt chunks starting at a block's start and inside one, beside decodes),
    the system prompt a prefix-cache hit from the second on."""
    ch05 = load_neighbour(5, "engine")
    tok = smollm2_tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS[:3]]
    engine, _ = ch05.engine.build_engine(str(smollm2_dir), "cpu", "float32", num_blocks=128, max_num_batched_tokens=8)
    reqs = [ch05.engine.Request(ids, ch05.engine.SamplingParams(temperature=0), max_tokens=10) for ids in prompts]
    return prompts, [[c.token_ids for c in out] for out in engine.generate(reqs, [0, 2, 5])]


@pytest.fixture(scope="module")
def smollm2_kernels_on(smollm2_dir):
    """SmolLM2 in float32 with the kernels on, as build_engine loads it, once for every level (the
    library reads its level at every call)."""
    model, _ = load(str(smollm2_dir), "cpu", "float32", kernel_flags="on")
    assert isinstance(model.ops, KernelOps)
    return model


@pytest.mark.parametrize("cpu_isa", CPU_ISAS, indirect=True)
def test_chunked_prompts_through_the_chunk_kernel_give_chapter_05s_tokens(
    smollm2_dir, smollm2_tokenizer, smollm2_kernels_on, chapter_05_chunked, cpu_isa, monkeypatch
):
    prompts, expected = chapter_05_chunked
    generation_config = Engine.read_generation_config(smollm2_dir)
    engine = Engine(smollm2_kernels_on, smollm2_tokenizer, generation_config, num_blocks=128, max_num_batched_tokens=8)
    served = []
    ops = engine.model.ops
    chunks = ops.chunks
    monkeypatch.setattr(ops, "chunks", lambda *a: served.append(a[-1]) or chunks(*a))
    outputs = engine.generate([Request(ids, GREEDY, max_tokens=10) for ids in prompts], [0, 2, 5])
    assert [[c.token_ids for c in out] for out in outputs] == expected
    assert served and any(bool((g.context_lens > g.valid.sum(1)).any()) for g in served)  # chunks after cached keys
