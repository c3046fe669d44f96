"""Compare an engine's per-layer outputs with the HF reference and print where they part ways.

Both sides are dicts {"embedding", "layer.0", ..., "logits"} of fp32 arrays shaped [seq, dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Row:
    name: str
    max_abs: float
    rel: float  # ||ours - ref|| / ||ref||, over the whole tensor
    top1: float | None  # fraction of positions with the same argmax (logits only)


def compare(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> list[Row]:
    rows = []
    for name, r in ref.items():
        if name not in ours:
            raise KeyError(f"engine output lacks {name!r} (it has {', '.join(ours)})")
        o = np.asarray(ours[name], dtype=np.float64)
        r = np.asarray(r, dtype=np.float64)
        if o.shape != r.shape:
            raise ValueError(f"{name}: shape {o.shape} vs reference {r.shape}")
        diff = o - r
        top1 = float(np.mean(o.argmax(-1) == r.argmax(-1))) if name == "logits" else None
        rows.append(Row(name, float(np.abs(diff).max()), float(np.linalg.norm(diff) / np.linalg.norm(r)), top1))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = [f"{'output':<12} {'max |err|':>11} {'rel err':>11} {'top-1 agree':>12}"]
    for row in rows:
        top1 = "" if row.top1 is None else f"{row.top1:.1%}"
        lines.append(f"{row.name:<12} {row.max_abs:>11.3e} {row.rel:>11.3e} {top1:>12}")
    return "\n".join(lines)


def assert_parity(
    ours: dict[str, np.ndarray],
    ref: dict[str, np.ndarray],
    atol: float | None = None,
    rtol: float | None = None,
    min_top1: float = 1.0,
) -> list[Row]:
    """Fails with the whole table when any output exceeds `atol` (max abs) or `rtol` (relative),
    or the logits' argmax agrees at fewer than `min_top1` of positions."""
    rows = compare(ours, ref)
    bad = [
        r.name
        for r in rows
        if (atol is not None and r.max_abs > atol)
        or (rtol is not None and r.rel > rtol)
        or (r.top1 is not None and r.top1 < min_top1)
    ]
    if bad:
        limits = f"atol={atol} rtol={rtol} min_top1={min_top1}"
        raise AssertionError(f"parity failed first at {bad[0]} ({limits}):\n{format_table(rows)}")
    return rows
