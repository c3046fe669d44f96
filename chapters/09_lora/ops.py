"""The hot operations of a decoder layer, from the kernel library or from PyTorch.

The engine's inner loops run on the kernels of kernels/ (a CUDA kernel on a GPU, its C++ twin on
a CPU) where they can, and on chapter 05's PyTorch elsewhere. The forward pass (model.py) calls the
five operations below through one of two objects with the same methods:

    KernelOps   kernels/: fused residual-add + RMSNorm, RoPE fused with the KV cache write, paged
                decode attention (flash-decoding, reading K/V where they lie in the pool) and, on a
                CPU, prompt-chunk attention (tiles of queries x keys, the same way), SwiGLU's
                silu(gate) * up in one pass, int4/int8 matmuls, bf16 matmuls on a CPU,
                and on a CPU each layer of a decode step as one call (DecoderLayer)
    TorchOps    chapter 05's PyTorch code, for `--kernels off` and for devices the library lacks (mps)

Both compute the same maths; what differs is how many passes over memory it takes. Per layer
and decode token, chapter 05 launches about 25 small PyTorch operations (each reading and writing
its whole input); the kernels make that about 10, and attention stops copying each sequence's
context out of the pool.

The library's int4 and int8 matmuls (csrc/cpu/quant_linear.cpp, csrc/cuda/quant_linear.cu) read
our codes as stored, two per byte, with the float16 scales and mins of the checkpoint (0.625 bytes
a weight, as Q4_1): no repacking into a private tile layout, and no private torch op whose
signature may change. They are this file's linears (KernelInt4Linear, KernelInt8Linear, and
KernelBf16Linear for plain bf16 weights), built where the model is loaded (`quant_linear`,
`dense_linear`); qmatmul.py keeps torch's packed ops, which TorchOps uses.

The choice is made once, where the model is loaded: `--kernels` (add_arguments) becomes a
`KernelFlags` value that the entry points hand on unread, and loading.load turns it into one of the
two objects for its device. Past that point nothing asks which it got: the model builds its weights
through `quant_linear` and `dense_linear`, the engine asks `can_capture_graphs`, the startup line
`describe()`. Only this file holds the compiled library; the linears it builds keep the one function
they call.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from batch import AttentionGroup, DecodeGroup, one_query_each
from common.errors import UserError
from lora import GROUPS, PROJECTIONS, LoraWeights, StepLora, torch_delta_
from paged_attention import paged_attention
from paged_cache import PagedKVCache
from qmatmul import PerStepLinear, aligned, prepare
from quant import Int4Weight, Int8Weight, QuantWeight
from rope import apply_rope, cos_sin


class Ops(Protocol):
    """What the forward pass, load_model and the engine ask of either implementation."""

    @property
    def can_capture_graphs(self) -> bool:
        """Whether decode steps may replay as CUDA graphs (cuda_graphs.py)."""

    def angles(self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]: ...
    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor: ...
    def rope_cache_(self, qkv: torch.Tensor, cos, sin, cache: PagedKVCache, layer: int, slots: torch.Tensor) -> None:
        """RoPE on the q and k heads of qkv ([tokens, n_heads + 2 * n_kv_heads, head_dim]), q in place;
        the rotated k and the v heads stored in `layer`'s pool at `slots`."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def attention(self, q, k_pool, v_pool, groups: list[AttentionGroup | DecodeGroup]) -> torch.Tensor: ...
    def lora_(self, y, x, a, b_t, ranks, scale, step: StepLora) -> None:
        """y [rows, n_out] += scale[s] * B[s] (A[s] x[row]) for each row's slot s (lora.py), in place;
        rows of slot -1 untouched. y may be a column slice of a wider matmul output."""

    def lora_group_(self, y, x, lora: LoraWeights, layer: int, group: str, step: StepLora) -> None:
        """The deltas of the projections of `group` (lora.GROUPS) of `layer` added into y, the output of
        their fused matmul (LoraWeights.add_: lora_ for each projection an adapter of the step changes)."""

    def quant_linear(
        self, w: QuantWeight, device: torch.device, dtype: torch.dtype, path: str
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A quantized weight as the forward pass will multiply by it (x -> x @ W.T on `device`), for
        the matmul path `path` ("auto", "fast" or "reference": --matmul, see qmatmul.prepare)."""

    def dense_linear(self, w: torch.Tensor) -> torch.Tensor | Callable[[torch.Tensor], torch.Tensor]:
        """A plain weight as the forward pass will multiply by it: the tensor (torch's GEMM), or a
        callable that picks per step between this implementation's matvec and that GEMM."""

    def build_one_call_layer(self, layer, config) -> object | None:
        """A model.Layer's weights in the form that runs its decode steps in one call
        (run_one_call_layer), or None: each operation is then called from Python."""

    def run_one_call_layer(
        self, layer, i: int, x, h, cos, sin, cache: PagedKVCache, step, next_norm, lora: LoraWeights | None
    ) -> torch.Tensor:
        """Layer i of a step of decodes (model.forward's loop body) in one call; layer.one_call is set.
        With adapter rows in the step (step.lora), `lora` holds the model's resident adapters."""

    def check_block_size(self, block_size: int) -> None:
        """Raises UserError, naming the limit, for a KV block size this implementation cannot read."""

    def describe(self) -> str:
        """For the startup line, e.g. "kernels: on (cpu, avx512)"."""


class TorchOps:
    """Chapter 05's operations. `why_off`: why the kernels are not used, for the startup line."""

    can_capture_graphs = False  # the decode kernel is what reads fixed-width block tables

    def __init__(self, why_off: str = "--kernels off"):
        self.why_off = why_off

    @staticmethod
    def angles(inv_freq: torch.Tensor, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's tokens, in the form rope_cache_ takes: [tokens, 1, head_dim] in `dtype`
        (angles in float32, then cast: the reference's rounding)."""
        cos, sin = cos_sin(inv_freq, positions)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += delta (the residual stream, in place); -> rms_norm(x) * weight."""
        if delta is not None:
            x.add_(delta)
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)

    @staticmethod
    def rope_cache_(qkv, cos, sin, cache: PagedKVCache, layer: int, slots) -> None:
        nkv = cache.shape[2]
        nh = qkv.shape[1] - 2 * nkv
        qk = qkv[:, : nh + nkv]  # q and k heads sit side by side in qkv: rotated together, in place
        qk.copy_(apply_rope(qk, cos, sin))
        cache.write(layer, slots, qkv[:, nh : nh + nkv], qkv[:, nh + nkv :])

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """[tokens, 2 * inter] (gate, then up) -> silu(gate) * up, [tokens, inter]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def attention(q, k_pool, v_pool, groups: list[AttentionGroup]) -> torch.Tensor:
        return paged_attention(q, k_pool, v_pool, groups)

    @staticmethod
    def lora_(y, x, a, b_t, ranks, scale, step: StepLora) -> None:
        torch_delta_(y, x, a, b_t, ranks, scale, step)

    def lora_group_(self, y, x, lora: LoraWeights, layer: int, group: str, step: StepLora) -> None:
        lora.add_(y, x, layer, group, step, self)

    @staticmethod
    def quant_linear(w: QuantWeight, device: torch.device, dtype: torch.dtype, path: str):
        """torch's packed int ops where they serve (qmatmul.py)."""
        return prepare(w, device, dtype, path)

    @staticmethod
    def dense_linear(w: torch.Tensor) -> torch.Tensor:
        return w

    @staticmethod
    def build_one_call_layer(layer, config) -> None:
        return None

    @staticmethod
    def check_block_size(block_size: int) -> None:
        return None  # gather + SDPA reads blocks of any size

    def describe(self) -> str:
        # A failed build's reason ends with the compiler's last lines: the startup line takes its
        # first line, the note at startup (KernelFlags.ops) the whole of it.
        return f"kernels: off ({self.why_off.splitlines()[0]})"


class KernelOps:
    """The kernel library's operations on `device`."""

    # Flash-decoding cuts a sequence's keys into partitions of whole blocks, about PARTITION_KEYS
    # keys each. The CUDA kernel keeps a partition's pool rows in shared memory (4 bytes a key,
    # beside up to 33 KB of its merge, opting in past the 48 KB a block gets): at most MAX_BLOCK_SIZE keys.
    PARTITION_KEYS = 256
    MAX_BLOCK_SIZE = 4096

    def __init__(
        self, ext, device: torch.device = torch.device("cpu"), batch_invariant: bool = False, int8_x: bool = False
    ):
        """batch_invariant: every row of every step computed as it would be alone (--batch-invariant):
        the linear kernels in one form for any number of rows (a switch of the library, process-wide
        like torch.use_deterministic_algorithms), at any number of rows (no dense GEMM for big steps),
        and prompt chunks' attention through the decode kernel, one query at a time. int8_x: int4 and
        int8 weights meet bf16 x as int8 at every row count, on a CPU (--int8-activations, the tiles of
        KernelInt4Linear and KernelInt8Linear)."""
        self._ext, self.device, self.batch_invariant = ext, torch.device(device), batch_invariant
        self.int8_x = int8_x and self.device.type == "cpu" and not batch_invariant  # invariant: matvec only
        self.tile_bytes = 0  # of the weights' tiles built so far (describe() says it)
        self._chunk_note_given = False
        if self.device.type == "cpu":
            ext.set_batch_invariant(batch_invariant)

    @classmethod
    def partition_size(cls, block_size: int) -> int:
        """Keys per partition for blocks of `block_size`: a whole number of blocks, at least one."""
        return block_size * max(1, cls.PARTITION_KEYS // block_size)

    def check_block_size(self, block_size: int) -> None:
        if block_size > self.MAX_BLOCK_SIZE:
            raise UserError(
                f"--block-size {block_size}: the decode kernel reads blocks of at most {self.MAX_BLOCK_SIZE} tokens "
                "(its partition's rows live in shared memory); use a smaller block size or --kernels off"
            )

    @property
    def can_capture_graphs(self) -> bool:
        return self.device.type == "cuda"

    @staticmethod
    def angles(inv_freq: torch.Tensor, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as the RoPE kernel takes them: float32 [tokens, head_dim / 2], computed once per
        step for all layers; the kernel rotates in float32 and rounds once."""
        angles = positions.to(torch.float32)[:, None] * inv_freq
        return angles.cos(), angles.sin()

    def add_rms_norm(self, x, delta, weight, eps) -> torch.Tensor:
        return self._ext.add_rms_norm(x, delta, weight, eps)

    def rope_cache_(self, qkv, cos, sin, cache: PagedKVCache, layer: int, slots) -> None:
        """One pass where PyTorch takes three: rotates q in place and k on its way into the pool, copies v
        (vLLM's rotary embedding and reshape_and_cache, in one kernel). qkv's k heads stay unrotated."""
        self._ext.rope_cache_(qkv, cos, sin, cache.k[layer], cache.v[layer], slots)

    def silu_mul(self, gate_up) -> torch.Tensor:
        """One pass instead of torch's silu, then product (and a call instead of three)."""
        return self._ext.silu_mul(gate_up)

    def attention(self, q, k_pool, v_pool, groups: list[AttentionGroup]) -> torch.Tensor:
        """Decodes (one query per sequence) through the paged decode kernel. Prompt chunks on a CPU
        through the chunk kernel (csrc/cpu/chunk_attention.cpp: tiles of queries x tiles of keys read
        where they lie in the pool, no gather copy, no mask); on a GPU through chapter 05's gather +
        SDPA, whose fused kernels are good at it, until the chunk kernel's CUDA twin has run on a GPU.
        A mixed step keeps the decode kernel for its one-query rows: it splits one query's long
        context over threads (partitions), where the chunk kernel's tasks are tiles of queries, of
        which a decode row would make one per kv head.
        Batch-invariant, prompt chunks go through the decode kernel, each query as if it were decoded
        alone. The chunk kernel's rows do not depend on the chunk split either, but a prompt's row
        can also come as a chunk of one (its last token after a prefix-cache hit, or a cut of
        --chunk-size), which build_step makes a decode: the decode kernel merges its partitions in
        another order than the chunk kernel's tiles, so the same row would round two ways."""
        if self.batch_invariant:
            groups = [g if g.decodes else one_query_each(g) for g in groups]
        elif any(not g.decodes for g in groups) and self._chunk_kernel_serves(q, k_pool):
            (prompts,) = [g for g in groups if not g.decodes]  # build_step makes one group of chunks
            out = self.chunks(q, k_pool, v_pool, prompts)
            for g in groups:
                if g.decodes:  # a mixed step's decode rows (zeros in `out` so far)
                    rows = g.token_index[:, 0]
                    out[rows] = self.decode(q[rows], k_pool, v_pool, g)
            return out
        return paged_attention(q, k_pool, v_pool, groups, decode=self.decode)

    def lora_(self, y, x, a, b_t, ranks, scale, step: StepLora) -> None:
        """The library's shrink, then expand in place (csrc/cpu/lora.cpp, csrc/cuda/lora.cu): one call
        each over every segment of the step, v [rows, r_max] in float32 between them. Weights the
        kernels do not read (float16) go through torch, by slot."""
        if a.dtype not in (torch.float32, torch.bfloat16) or y.dtype != a.dtype:
            return torch_delta_(y, x, a, b_t, ranks, scale, step)
        v = self._ext.lora_shrink(x, a, ranks, step.seg_starts, step.seg_slots)
        self._ext.lora_expand_(y, v, b_t, ranks, scale, step.seg_starts, step.seg_slots)

    def lora_group_(self, y, x, lora: LoraWeights, layer: int, group: str, step: StepLora) -> None:
        """On a CPU, the group's projections in one call, as the one-call layer adds them after a decode
        step's matmul (a prompt chunk's deltas one projection at a time were 14 calls a layer from
        Python: one adapter added 3.6 ms to a 16-token prompt of SmolLM2, this call saves 0.8 of
        them); elsewhere one projection at a time."""
        served = (torch.float32, torch.bfloat16)
        if self.device.type != "cpu" or lora.dtype not in served or not x.dtype == y.dtype == lora.dtype:
            return lora.add_(y, x, layer, group, step, self)
        groups, _, step_form = self._library_lora(lora, layer, step)
        self._ext.lora_group_(y, x, groups[group], lora.scale, step_form, PROJECTIONS.index(GROUPS[group][0]))

    def _chunk_kernel_serves(self, q, k_pool) -> bool:
        """Whether the chunk kernel takes this step's prompt chunks; where it cannot on a CPU, a note
        (once) and chapter 05's gather + SDPA, never a wrong result."""
        if self.device.type != "cpu":
            return False
        why = None
        if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            why = f"{str(q.dtype).removeprefix('torch.')} activations"
        elif q.shape[-1] not in self._ext.head_dims() or q.shape[1] % k_pool.shape[2]:
            why = f"heads of {q.shape[-1]} values, {q.shape[1]} query heads over {k_pool.shape[2]} kv heads"
        if why is not None and not self._chunk_note_given:
            self._chunk_note_given = True
            print(f"note: prompt chunks through gather + SDPA: the chunk kernel does not serve {why}", file=sys.stderr)
        return why is None

    def chunks(self, q: torch.Tensor, k_pool, v_pool, g: AttentionGroup) -> torch.Tensor:
        """q: [T, n_heads, head_dim], the step's queries -> [T, n_heads, head_dim], the rows of g's
        chunks attended (causally, over their sequences' cached keys and their own), zeros elsewhere.
        A sequence's queries sit side by side in the step (build_step lays them end to end)."""
        starts = g.token_index[:, 0].to(torch.int32)
        lens = g.valid.sum(dim=1, dtype=torch.int32)
        scale = q.shape[-1] ** -0.5
        return self._ext.chunk_attention(q, k_pool, v_pool, g.block_tables, starts, lens, g.context_lens, scale)

    def decode(self, q: torch.Tensor, k_pool, v_pool, g: AttentionGroup | DecodeGroup) -> torch.Tensor:
        """q: [B, n_heads, head_dim], one query per sequence of the group -> the same shape."""
        return self._ext.paged_decode_attention(
            q, k_pool, v_pool, g.block_tables, g.context_lens, q.shape[-1] ** -0.5, self.partition_size(k_pool.shape[1])
        )

    def quant_linear(self, w: QuantWeight, device: torch.device, dtype: torch.dtype, path: str):
        """The library's int4 or int8 matmul. On a CPU alone at every row count: the library turns a
        call of many rows (a prompt chunk, a batched step) into a matrix product itself
        (csrc/cpu/gemm.cpp), so the weights stay quantized in memory. On a GPU, "auto" keeps a dense
        copy for steps above KERNEL_MAX_ROWS rows (PerStepLinear), for cuBLAS, which the GPU check
        measured faster than the library's CUDA matrix product (csrc/cuda/gemm.cu) there. "reference"
        (and an unknown path's error) as qmatmul.prepare."""
        if path not in ("fast", "auto"):
            return prepare(w, device, dtype, path)
        tiles = self.int8_x and dtype == torch.bfloat16
        if isinstance(w, Int8Weight):
            kernel = KernelInt8Linear(w, self._ext, device, tiles=tiles)
        else:
            kernel = KernelInt4Linear(w, self._ext, device, tiles=tiles)
        self.tile_bytes += kernel.tile_bytes
        if path == "fast" or self.device.type == "cpu":
            return kernel
        return PerStepLinear(kernel, w.dequantize(dtype).to(device), KERNEL_MAX_ROWS[type(w)])

    def dense_linear(self, w: torch.Tensor):
        """A bf16 weight on a CPU: the library's bf16 matmul at every row count, on the weight tensor
        itself (torch's bf16 GEMM reads a decode step's weights at a third of the memory bandwidth,
        and runs at a quarter of float32's speed on a CPU without bf16 instructions; on a CPU with
        AMX-BF16 the library hands bf16 x of 16 rows or more to it, on the tiles: kernels/README).
        Other dtypes, and any weight on a GPU: torch (cuBLAS)."""
        if w.dtype == torch.bfloat16 and self.device.type == "cpu":
            return KernelBf16Linear(w, self._ext)
        if self.batch_invariant:
            raise UserError(
                f"--batch-invariant: {str(w.dtype).removeprefix('torch.')} weights would go through torch's GEMM, "
                "whose rounding of a row may depend on the rows beside it; use bfloat16 weights (--dtype "
                "bfloat16) or --quant int4/int8"
            )
        return w

    def build_one_call_layer(self, layer, config):
        """The layer as the library's DecoderLayer (csrc/decoder_layer.cpp): its decode steps in one C++ call,
        the same kernels in the same order as model.forward's loop body, with no Python between them.
        None on a GPU, where CUDA graphs replay whole decode steps (cuda_graphs.py), and where a weight
        has no kernel of the library (--matmul reference)."""
        if self.device.type != "cpu":
            return None
        linears = [self._library_linear(w) for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
        if None in linears:
            return None
        shape = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        return self._ext.DecoderLayer(*linears, layer.mlp_norm, *shape, config.rms_norm_eps)

    def _library_linear(self, w):
        """A weight as load_model prepared it -> the library's Linear: the same kernel, or torch's GEMM
        for a plain float weight; None for a form it lacks."""
        if isinstance(w, torch.Tensor):
            return self._ext.Linear("dense", [], dense=w)
        if not hasattr(w, "library_form"):
            return None  # dequantize-and-multiply (qmatmul.ReferenceLinear)
        return self._ext.Linear(*w.library_form())

    def run_one_call_layer(self, layer, i: int, x, h, cos, sin, cache: PagedKVCache, step, next_norm, lora):
        g, partition = step.groups[0], self.partition_size(cache.block_size)
        where = step.slots, g.block_tables, g.context_lens
        adapters = () if step.lora is None else self._library_lora(lora, i, step.lora)[1:]
        return layer.one_call.decode(x, h, cos, sin, cache.k[i], cache.v[i], *where, next_norm, partition, *adapters)

    def _library_lora(self, lora: LoraWeights, i: int, step: StepLora) -> tuple:
        """(layer i's adapter tables by matmul group, the same as the library's DecoderLayer takes them,
        the step's rows by slot): the tables once (views of the slot table: later loads show through),
        the rows once a step."""
        if lora.library_form is None:
            lora.library_form = []
            for tables in lora.per_layer:
                projection = lambda p: self._ext.LoraProjection(*tables[p], lora.ranks[p])  # noqa: E731
                groups = {g: [projection(p) for p in ps] for g, ps in GROUPS.items()}
                lora.library_form.append((groups, self._ext.LayerLora(*groups.values(), lora.scale)))
        if step.library_form is None:
            adapted = [lora.adapts(p, step) for group in GROUPS.values() for p in group]
            step.library_form = self._ext.StepLora(step.seg_starts, step.seg_slots, adapted)
        groups, layer_form = lora.library_form[i]
        return groups, layer_form, step.library_form

    def describe(self) -> str:
        where = self.device.type
        if where == "cpu":
            where = f"cpu, {self._ext.cpu_isa()}; gemm: {self._ext.cpu_gemm()}"
            if self.tile_bytes:  # int4 or int8 weights with bf16 activations, --int8-activations
                product = self._ext.cpu_int8_product()
                where += f"; int8 activations: {product}, {self.tile_bytes / 1e6:.0f} MB of tiles"
        # (--batch-invariant runs on a CPU only, where the gemm part says so: "gemm: off (batch-invariant)")
        return f"kernels: on ({where})"


# --- the library's linears: what KernelOps.quant_linear and dense_linear build -------------------

# On a GPU, up to how many rows a step runs the library's int matmuls before cuBLAS on a dense copy
# takes over. Measured on an H200 (slurm/gpu_check.sh, bench/results/gpu/gpu_check.log, SmolLM2's
# matrices): at 1-4 rows the int kernels take 11-18 us against the dense copy's 15-22 (both mostly
# launch); from 16 rows the library's matrix product (csrc/cuda/gemm.cu) runs at 0.4-0.85x cuBLAS.
KERNEL_MAX_ROWS = {Int4Weight: 8, Int8Weight: 8}


class KernelInt4Linear:
    """kernels/' int4 matmul; of the library `lib` it keeps int4_linear. With `tiles` (KernelOps: bf16
    activations on a CPU), the weight also laid out as the library's tiles (lib.int4_tiles): every call
    then quantizes each row of x to int8 per block of 32 and multiplies in integers
    (csrc/cpu/int4_q8_gemm.cpp), llama.cpp's Q4_1 x Q8 product, a row's result the same whatever
    shares its call. Their price: 0.625 bytes a weight beside the same of codes and scales, and x's
    rounding (the README measures both)."""

    def __init__(self, w: Int4Weight, lib, device: torch.device, tiles: bool = False):
        self.matmul, self.group_size = lib.int4_linear, w.group_size
        self.packed = aligned(w.packed.to(device).contiguous())  # uint8 [out, in / 2]
        self.scale, self.min = w.scale.to(device).contiguous(), w.min.to(device).contiguous()  # float16 [out, in / G]
        self.tiles = None  # uint8 [out / width, in / 32, 20 * width], width 8 (AVX2) or 16 (AVX512 VNNI)
        if tiles and device.type == "cpu":
            tiles = lib.int4_tiles(self.packed, self.scale, self.min, self.group_size)
            self.tiles = tiles if tiles.numel() else None  # empty: no integer path on this CPU
        self.tile_bytes = self.tiles.numel() if self.tiles is not None else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = self.matmul(x2, self.packed, self.scale, self.min, self.group_size, self.tiles)
        return y.view(*x.shape[:-1], -1)

    def library_form(self) -> tuple[str, list[torch.Tensor], int]:
        """(kind, weight tensors, group size) as the library's Linear takes them (KernelOps.build_one_call_layer)."""
        tiles = [self.tiles] if self.tiles is not None else []
        return "int4", [self.packed, self.scale, self.min, *tiles], self.group_size


class KernelInt8Linear:
    """kernels/' int8 matmul; of the library `lib` it keeps int8_linear. With `tiles`, as
    KernelInt4Linear's: q laid out again (lib.int8_tiles, one more byte a weight) for bf16 x
    quantized to int8 per block of 32 and multiplied in integers (csrc/cpu/int8_q8_gemm.cpp),
    llama.cpp's Q8_0 x Q8_0: for an int4 model, its LM head."""

    def __init__(self, w: Int8Weight, lib, device: torch.device, tiles: bool = False):
        self.matmul = lib.int8_linear
        self.q, self.scale = aligned(w.q.to(device).contiguous()), w.scale.float().to(device)
        self.tiles = None  # uint8 [out / width, in / 32, 32 * width]
        if tiles and device.type == "cpu":
            tiles = lib.int8_tiles(self.q)
            self.tiles = tiles if tiles.numel() else None  # empty: no integer path here, or in % 32 != 0
        self.tile_bytes = self.tiles.numel() if self.tiles is not None else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1]).contiguous(), self.q, self.scale, self.tiles)
        return y.view(*x.shape[:-1], -1)

    def library_form(self) -> tuple[str, list[torch.Tensor], int]:
        tiles = [self.tiles] if self.tiles is not None else []
        return "int8", [self.q, self.scale, *tiles], 0


class KernelBf16Linear:
    """kernels/' bf16 matmul for a plain bf16 weight; of the library `lib` it keeps
    bf16_linear. It reads the weight tensor as it is: no copy."""

    def __init__(self, w: torch.Tensor, lib):
        self.matmul, self.weight = lib.bf16_linear, w.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1]).contiguous(), self.weight)
        return y.view(*x.shape[:-1], -1)

    def library_form(self) -> tuple[str, list[torch.Tensor], int]:
        return "bf16", [self.weight], 0


def resolve(
    choice: str, device: torch.device, head_dim: int | None = None, batch_invariant: bool = False, int8_x: bool = False
) -> Ops:
    """choice: "on" (the kernels, an error where they cannot run), "off" (PyTorch), or "auto"
    (the kernels where they run on this device, else PyTorch, which then says why). head_dim: the
    model's, when known: the decode kernel is built for a few sizes (kernels.head_dims()).
    batch_invariant: the kernels in their batch-invariant form (KernelOps), an error where they cannot.
    int8_x: KernelOps' (--int8-activations)."""
    if choice not in ("auto", "on", "off"):
        raise UserError(f"kernels must be 'auto', 'on' or 'off', got {choice!r}")
    if batch_invariant and (choice == "off" or device.type != "cpu"):
        raise UserError(
            "--batch-invariant runs the CPU kernels (kernels/ with --kernels auto or on, on a CPU): chapter 05's "
            "PyTorch picks its matmul by row count, and the CUDA kernels tile by it"
        )
    if choice == "off":
        return TorchOps()
    if device.type not in ("cpu", "cuda"):
        why = f"kernels/ has no {device.type} implementation"
    else:
        import kernels  # builds the library on first use (a minute), with a message

        try:
            ext = kernels.load()
            why = None if device.type == "cpu" or ext.with_cuda else "kernels/ was built without CUDA here"
            if why is None and device.type == "cuda":
                why = kernels.gpu_not_covered(ext, device)
            served = ext.head_dims()
            if why is None and head_dim is not None and head_dim not in served:
                why = f"kernels/ decodes heads of {', '.join(map(str, served))} values; this model's have {head_dim}"
        except kernels.KernelBuildError as e:
            why = str(e)
        if why is None:
            return KernelOps(ext, device, batch_invariant, int8_x)
    if choice == "on" or batch_invariant:
        raise UserError(f"--kernels {choice}{' --batch-invariant' if batch_invariant else ''}: {why}")
    return TorchOps(why)


# --- the flags: everything a kernels option touches outside the forward pass is below -------------


@dataclass(frozen=True)
class KernelFlags:
    """The kernel flags as parsed, before there is a device to resolve them for: what the entry
    points hand to loading.load and engine.build_engine without reading it."""

    choice: str = "auto"  # --kernels
    batch_invariant: bool = False  # --batch-invariant
    int8_x: bool = True  # --int8-activations (--no-int8-activations: the float product)

    def ops(self, device: torch.device, head_dim: int | None = None, note: bool = True) -> Ops:
        """The operations for `device` (and a model's head size); where "auto" falls back to
        PyTorch, a note says why (note False: the caller only checks the flags, its ranks will say it)."""
        if not self.int8_x and (self.choice == "off" or device.type != "cpu"):  # it was taken, and changed nothing
            raise UserError(
                "--no-int8-activations is for the CPU kernels (--kernels auto or on, on a CPU): chapter 05's PyTorch "
                "and the CUDA kernels multiply int weights in floats already"
            )
        ops = resolve(self.choice, device, head_dim, self.batch_invariant, self.int8_x)
        if self.choice == "auto" and isinstance(ops, TorchOps):
            first, *details = ops.why_off.splitlines()
            if not self.int8_x:  # as --kernels off: chapter 05's PyTorch takes it, and changes nothing
                raise UserError(f"--no-int8-activations is for the CPU kernels, which cannot run here: {first}")
            if not note:
                return ops
            print(f"note: kernels off ({first}): chapter 05's PyTorch path runs", file=sys.stderr)
            for line in details:
                print(f"  {line}", file=sys.stderr)
        return ops


def add_arguments(ap) -> None:
    k = ap.add_argument_group("kernels")
    k.add_argument(
        "--kernels",
        choices=["auto", "on", "off"],
        default="auto",
        help="kernels/ for norms, RoPE, decode attention and int matmuls: auto (default: where they run on "
        "this device, built on first use), on (an error where they cannot), off (chapter 05's PyTorch)",
    )
    k.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens at temperature 0 independent of what else runs (the batch, prefix-cache "
        "hits, n): every row through the same kernel in the same order; slower (see the README); CPU, kernels on",
    )
    k.add_argument(
        "--int8-activations",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a CPU, int4 and int8 weights meet bf16 activations as int8 per block of 32, multiplied in integers as "
        "llama.cpp does, at every row count (default): 1.5-3x faster prompts and batched steps, a little less "
        "exact (perplexity +1.5 %%), and a row's result the same whatever shares its step; "
        "--no-int8-activations multiplies in floats (see chapter 06's README)",
    )


def from_args(args) -> KernelFlags:
    return KernelFlags(args.kernels, args.batch_invariant, args.int8_activations)
