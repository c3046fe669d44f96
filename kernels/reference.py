"""The maths of every kernel in plain PyTorch: what the tests compare the CPU and CUDA twins with,
and, for attention, the flash-decoding algorithm itself written out step by step.

All in float32, whatever the inputs' dtype, rounded once to that dtype at the end: the kernels
widen to float32 too, so a test's tolerance only has to cover the order of float32 sums and one
final rounding.
"""

from __future__ import annotations

import torch


def paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale) -> torch.Tensor:
    """Softmax attention of each sequence's one query over its first context_lens[b] keys.
    q [B, n_heads, D]; pools [num_blocks, block_size, n_kv_heads, D]; block_tables [B, max_blocks];
    context_lens [B]  -> [B, n_heads, D]"""
    block_size = k_pool.shape[1]
    group = q.shape[1] // k_pool.shape[2]  # query heads per KV head (GQA)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        blocks = block_tables[b, : -(-n // block_size)].long()
        keys = k_pool[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, n_heads, D]
        values = v_pool[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[b].float(), keys) * scale  # [n_heads, n]
        out[b] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
    return out.to(q.dtype)


def flash_decoding(q, k_pool, v_pool, block_tables, context_lens, scale, partition_size: int) -> torch.Tensor:
    """The same result, computed the way the kernels do.

    1. Cut each sequence's keys into partitions of `partition_size`. Each partition, on its own
       (a thread block on a GPU, an OpenMP task on a CPU), reads its keys once and keeps, per
       query head, a running maximum m of the scores, a running sum l of exp(score - m), and a
       running output acc = sum exp(score - m) * value. A new key with a larger score rescales
       the old l and acc by exp(m_old - m_new): the "online softmax" (Milakov & Gimelshein 2018),
       so no partition ever holds all its scores at once.
    2. Merge: with M the largest m over partitions, out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p.

    The partitions are what make decode parallel at batch 1: one sequence's one query would
    otherwise be one task (FlashDecoding, Dao et al. 2023)."""
    block_size = k_pool.shape[1]
    group = q.shape[1] // k_pool.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        partials = []  # (m, l, acc) per partition: [n_heads], [n_heads], [n_heads, D]
        for start in range(0, n, partition_size):
            m = torch.full((q.shape[1],), float("-inf"), device=q.device)
            l = torch.zeros(q.shape[1], device=q.device)
            acc = torch.zeros(q.shape[1:], device=q.device)
            for pos in range(start, min(start + partition_size, n)):  # one key at a time, as a kernel walks them
                block, offset = int(block_tables[b, pos // block_size]), pos % block_size
                k = k_pool[block, offset].float().repeat_interleave(group, dim=0)  # [n_heads, D]
                v = v_pool[block, offset].float().repeat_interleave(group, dim=0)
                s = (q[b].float() * k).sum(-1) * scale  # [n_heads]
                m_new = torch.maximum(m, s)
                rescale = torch.exp(m - m_new)  # exp(-inf) = 0 for the first key
                p = torch.exp(s - m_new)
                l = l * rescale + p
                acc = acc * rescale[:, None] + p[:, None] * v
                m = m_new
            partials.append((m, l, acc))
        ms = torch.stack([m for m, _, _ in partials])  # [partitions, n_heads]
        weights = torch.exp(ms - ms.max(0).values)  # how much each partition's sums count
        total = (weights * torch.stack([l for _, l, _ in partials])).sum(0)  # [n_heads]
        out[b] = (weights[..., None] * torch.stack([a for _, _, a in partials])).sum(0) / total[:, None]
    return out.to(q.dtype)


def chunk_attention(q, k_pool, v_pool, block_tables, query_start, query_lens, context_lens, scale) -> torch.Tensor:
    """Causal attention of prompt chunks over the paged cache: sequence b's queries are rows
    query_start[b] .. + query_lens[b] - 1 of q, at positions context_lens[b] - query_lens[b] ..
    context_lens[b] - 1, and each reads the keys from position 0 up to its own (the chunk's own keys
    are in the pool already). Gather the sequence's keys, mask the ones after each query, softmax.
    q [T, n_heads, D]; pools [num_blocks, block_size, n_kv_heads, D]; block_tables [B, max_blocks];
    the rest [B]  -> [T, n_heads, D], zeros in rows no chunk names"""
    block_size = k_pool.shape[1]
    group = q.shape[1] // k_pool.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(block_tables.shape[0]):
        n, new, first = int(context_lens[b]), int(query_lens[b]), int(query_start[b])
        blocks = block_tables[b, : -(-n // block_size)].long()
        keys = k_pool[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, n_heads, D]
        values = v_pool[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        positions = torch.arange(n - new, n, device=q.device)  # [new]
        causal = torch.arange(n, device=q.device)[None, :] <= positions[:, None]  # [new, n]
        scores = torch.einsum("qhd,khd->hqk", q[first : first + new].float(), keys) * scale  # [n_heads, new, n]
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[first : first + new] = torch.einsum("hqk,khd->qhd", weights, values)
    return out.to(q.dtype)


def add_rms_norm(x, delta, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x + delta rounded to x's dtype: the new residual stream, rms_norm of it times weight)."""
    if delta is not None:
        x = (x.float() + delta.float()).to(x.dtype)
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return x, out.to(x.dtype)


def rope(qk, cos, sin) -> torch.Tensor:
    """Rotate-half RoPE.  qk [tokens, heads, D], cos/sin float32 [tokens, D / 2] -> a new tensor."""
    x1, x2 = qk.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(qk.dtype)


def rope_cache(qkv, cos, sin, k_pool, v_pool, slots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [tokens, n_heads + 2 * n_kv_heads, D]; pools [num_blocks, block_size, n_kv_heads, D].
    -> (qkv with its q heads rotated, k_pool with the rotated k heads at slots, v_pool with the v
    heads there): new tensors."""
    n_kv_heads = k_pool.shape[2]
    n_heads = qkv.shape[1] - 2 * n_kv_heads
    q, k, v = qkv[:, :n_heads], qkv[:, n_heads : n_heads + n_kv_heads], qkv[:, n_heads + n_kv_heads :]
    qkv, k_pool, v_pool = qkv.clone(), k_pool.clone(), v_pool.clone()
    qkv[:, :n_heads] = rope(q, cos, sin)
    k_pool.view(-1, *k_pool.shape[2:])[slots] = rope(k, cos, sin)
    v_pool.view(-1, *v_pool.shape[2:])[slots] = v
    return qkv, k_pool, v_pool


def silu_mul(gate_up) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension, in float32, rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def int4_weight(packed, scale, min_, group_size) -> torch.Tensor:
    """W in float32, [n_out, n_in]: W[o, i] = min[o, i/G] + scale[o, i/G] * code(o, i); codes two
    per byte, element 2j in the low nibble."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).float()  # [n_out, n_in]
    n_out, n_in = codes.shape
    w = min_.float()[..., None] + scale.float()[..., None] * codes.view(n_out, n_in // group_size, group_size)
    return w.view(n_out, n_in)


def int4_linear(x, packed, scale, min_, group_size) -> torch.Tensor:
    """x @ W.T, W as int4_weight gives it."""
    return (x.float() @ int4_weight(packed, scale, min_, group_size).T).to(x.dtype)


def quantize_blocks_int8(x) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, n_in] quantized to int8 per block of 32 inputs of a row, as the CPU's integer product
    takes bf16 x (csrc/cpu/int4_q8_gemm.cpp): dx = max|x| / 127, xq = round(x / dx) (ties to even).
    -> (xq as float32 [rows, n_in], dx [rows, n_in / 32]); x ~ dx * xq."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # 127 / amax as one division: `127.0 / tensor` is computed as 127 * (1 / tensor), rounded twice
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    xq = torch.round(blocks * inv)
    return xq.view(x.shape), (amax / 127.0).squeeze(-1)


def int4_linear_q8(x, packed, scale, min_, group_size) -> torch.Tensor:
    """int4_linear with x quantized per block (quantize_blocks_int8), the codes' sums exact:
    y[r, o] = sum_b scale[o, b] * dx[r, b] * sum_k code[o, k] xq[r, k] + min[o, b] * sum_k x[r, k]
    (k over block b's 32 inputs; scale and min of the block's group)."""
    xq, dx = quantize_blocks_int8(x)
    rows, n_in = x.shape
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).double()  # [n_out, n_in]
    n_out = codes.shape[0]
    per_block = group_size // 32
    block_scale = scale.float().repeat_interleave(per_block, dim=1)  # [n_out, blocks]
    block_min = min_.float().repeat_interleave(per_block, dim=1)
    dots = torch.einsum("rbk,obk->rob", xq.double().view(rows, -1, 32), codes.view(n_out, -1, 32))  # exact
    xsum = x.float().view(rows, -1, 32).sum(dim=-1)  # [rows, blocks]
    y = (dots.float() * block_scale[None] * dx[:, None, :]).sum(-1) + xsum @ block_min.T
    return y.to(x.dtype)


def int8_linear(x, q, scale) -> torch.Tensor:
    return (x.float() @ (q.float() * scale[:, None]).T).to(x.dtype)


def int8_linear_q8(x, q, scale) -> torch.Tensor:
    """int8_linear with x quantized per block (quantize_blocks_int8), the sums exact (csrc/cpu/int8_q8_gemm.cpp):
    y[r, o] = scale[o] * sum_b dx[r, b] * sum_k q[o, k] xq[r, k]   (k over block b's 32 inputs)"""
    xq, dx = quantize_blocks_int8(x)
    rows, n_out = x.shape[0], q.shape[0]
    dots = torch.einsum("rbk,obk->rob", xq.double().view(rows, -1, 32), q.double().view(n_out, -1, 32))  # exact
    y = (dots.float() * dx[:, None, :]).sum(-1) * scale.float()
    return y.to(x.dtype)


def bf16_linear(x, w) -> torch.Tensor:
    return (x.float() @ w.float().T).to(x.dtype)


# --- LoRA: many adapters in one batch (shrink, expand) -------------------------------------------
# A step's rows laid end to end are cut into segments (seg_starts int32 [n_seg + 1], from 0 to rows),
# each with one adapter slot (seg_slots int32 [n_seg], -1: the base model, no delta). A prompt chunk
# is a segment; a decode row is a segment of one. Slot s holds A[s] = a[s, :ranks[s]] ([r, n_in], as
# PEFT's lora_A.weight) and B[s].T = b_t[s, :ranks[s]] ([r, n_out]: lora_B.weight transposed, see
# csrc/cpu/lora.cpp for why); rows past ranks[s] are padding that no kernel reads.
#     y[row] += scale[s] * B[s] @ (A[s] @ x[row])


def lora_segments(row_slots) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment table of a step from each row's slot (int [rows]): runs of equal slots merged.
    -> (seg_starts int32 [n_seg + 1], seg_slots int32 [n_seg])."""
    row_slots = torch.as_tensor(row_slots, dtype=torch.int32).flatten()
    if row_slots.numel() == 0:
        return torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    change = torch.nonzero(row_slots[1:] != row_slots[:-1]).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.long), change, torch.tensor([row_slots.numel()])])
    return starts.to(torch.int32), row_slots[starts[:-1]].to(torch.int32)


def lora_row_slots(seg_starts, seg_slots) -> torch.Tensor:
    """Each row's slot, int64 [rows]: the segment table unrolled."""
    lengths = (seg_starts[1:] - seg_starts[:-1]).long()
    return torch.repeat_interleave(seg_slots.long(), lengths)


def lora_shrink(x, a, ranks, seg_starts, seg_slots) -> torch.Tensor:
    """v = A[s] @ x[row] for each row, float32 [rows, r_max]; zeros past the slot's rank and on
    rows of slot -1."""
    v = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32)
    for i, s in enumerate(seg_slots.tolist()):
        rows = slice(int(seg_starts[i]), int(seg_starts[i + 1]))
        if s >= 0:
            r = int(ranks[s])
            v[rows, :r] = x[rows].float() @ a[s, :r].float().T
    return v


def lora_expand(y, v, b_t, ranks, scale, seg_starts, seg_slots) -> torch.Tensor:
    """y + scale[s] * B[s] @ v[row, :r] for each row, rounded once to y's dtype; rows of slot -1
    as they were (bit for bit). A new tensor."""
    out = y.clone()
    for i, s in enumerate(seg_slots.tolist()):
        rows = slice(int(seg_starts[i]), int(seg_starts[i + 1]))
        if s >= 0:
            r = int(ranks[s])
            delta = v[rows, :r].float() @ b_t[s, :r].float()
            out[rows] = (y[rows].float() + float(scale[s]) * delta).to(y.dtype)
    return out


def lora(y, x, a, b_t, ranks, scale, seg_starts, seg_slots) -> torch.Tensor:
    """Both: y[row] + scale[s] * B[s] @ (A[s] @ x[row]), with v in float32 between them."""
    return lora_expand(y, lora_shrink(x, a, ranks, seg_starts, seg_slots), b_t, ranks, scale, seg_starts, seg_slots)
