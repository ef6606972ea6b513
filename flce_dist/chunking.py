"""The chunk plan: how many rows of logits one materialised chunk holds.

Both strategies of ``core.py`` materialise the logits one chunk at a time (the fused strategy by
token chunks, the recompute backward by vocabulary chunks); this is the only memory that grows with
V. The plan depends only on its arguments (shapes, dtype, device type, tensor-parallel size and the
call's ``Settings``), never on free memory: under tensor parallelism the fused strategy issues one
collective per token chunk, so every rank must plan the same chunks. (``core.fused_plan_for`` may take
fewer, larger token chunks than the budget gives where the float32 dW accumulator would cost more: see there.)
"""

from __future__ import annotations

import torch

from .settings import Settings

EXTRA_BYTES = (
    1 << 30
)  # the loss's own memory beyond its inputs and the gradients it returns (the quality bar of SPEC section 5, restated in docs/settings.md)
HEADROOM_BYTES = 64 << 20  # what lives beside the chunk: per-tile partials (32 MiB at llama3), stats, targets
CPU_CHUNK_BYTES = 256 << 20
GATHER_SHARE = 8  # the gradient filter's gathered block of the weight shard: 1/8 of the chunk budget
GATHER_ALIGN = 64  # its rows: a multiple of the filter's vocab tile (and of 8: 16-byte aligned logits columns)


def chunk_budget(device: torch.device, settings: Settings, share: int = 1, reserved_bytes: int = 0) -> int:
    """Bytes of one materialised logits chunk (see :func:`chunk_rows`)."""
    if settings.chunk_bytes is not None:
        return settings.chunk_bytes
    if device.type == "cuda":
        return max(64 << 20, (EXTRA_BYTES - HEADROOM_BYTES) // max(1, share) - reserved_bytes)
    return CPU_CHUNK_BYTES


def gather_rows(v: int, row_bytes: int, device: torch.device, settings: Settings, share: int = 1) -> int:
    """Rows of the weight shard per gathered block (``Settings(filter_order="gather")`` where the logits
    come from cuBLAS: the gradient filter's sorted order read block by block, no sorted copy of the whole
    shard; the Helion pass reads W through the order and needs no block): 1/8 of the
    chunk budget, a multiple of 64 rows, at least 64, at most ``v``. At llama3 (H = 4096, bf16, the CUDA
    budget) 15,360 rows = 120 MiB: 9 blocks per token chunk; under TP both the budget and the shard are 1/P."""
    rows = chunk_budget(device, settings, share) // GATHER_SHARE // max(1, row_bytes)
    return max(1, min(v, max(GATHER_ALIGN, rows // GATHER_ALIGN * GATHER_ALIGN)))


def chunk_rows(
    total: int,
    row_elems: int,
    elem_size: int,
    device: torch.device,
    settings: Settings,
    reserved_bytes: int = 0,
    share: int = 1,
    row_extra_bytes: int = 0,
) -> int:
    """Rows per materialised logits chunk: the byte budget over the row size, then balanced.

    Budget: ``settings.chunk_bytes``, else on CUDA ``(EXTRA_BYTES - HEADROOM_BYTES) / share -
    reserved_bytes`` (at least 64 MiB), where ``reserved_bytes`` are the caller's other buffers that
    are not returned gradients (the recompute strategy's float32 dX accumulator) and ``share`` is the
    tensor-parallel size, so that each rank holds 1/P of the single-GPU plan's memory; else (CPU)
    256 MiB. ``row_extra_bytes``: the caller's other buffers per chunk row (the fused strategy's
    row-scale form: [rows, H] float32 and [rows, H]), counted against that default budget only (an
    explicit ``chunk_bytes`` is the logits chunk's own). Rows are a multiple of 128 where the total allows, and the chunks are balanced:
    ceil(total / rows) chunks of equal size (no small tail chunk, whose matmuls run inefficiently).

    Measured on the H200, bf16, N=8192 (benchmarks/NOTES.md, run 11): 384 MiB / 512 MiB / 1 GiB
    chunks ran gemma at 1.35x / 1.26x / 1.14x three matmuls (llama3 1.13x / 1.09x / 1.08x): every
    chunk re-reads and re-writes the whole dW, and a chunk of few rows gives cuBLAS thin matmuls.
    """
    budget = chunk_budget(device, settings, share, reserved_bytes)
    if total <= 0:
        return 1
    per_row = row_elems * elem_size + (row_extra_bytes if settings.chunk_bytes is None else 0)
    rows = max(1, budget // max(1, per_row))
    if rows >= 256:
        rows = rows // 128 * 128
    if rows >= total:
        return total
    return even_rows(total, -(-total // rows), align=rows >= 256)


def even_rows(total: int, chunks: int, align: bool) -> int:
    """Rows per chunk of ``total`` rows in ``chunks`` balanced chunks: ceil(total / chunks), with
    ``align`` rounded up to a multiple of 128 (at most ``chunks`` chunks still, possibly fewer)."""
    even = -(-total // max(1, chunks))
    if align:
        even = -(-even // 128) * 128
    return even
