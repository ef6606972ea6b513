"""Kernel launch: shipped configs, block sizes, chunk sizes, and typed wrappers.

Configs live in ``configs/helion/<arch>.json`` (arch: ``h200`` for sm_90, ``cpu`` for reference
mode): for each kernel and dtype class a ``block`` dict (block sizes, passed to the kernel as
constexpr arguments so that reference mode also runs several tiles) and a ``config`` dict
(``helion.Config`` fields). A first call never autotunes; a shape outside the shipped classes uses
the ``default`` entry. ``python -m flce_dist.tune`` writes new entries.

``override(...)`` changes block sizes and the logits-chunk budget for a block of code (tests
use it to force several tiles and several chunks in every tiled dimension).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import helion
import torch

from . import kernels as K

_CONFIG_DIR = Path(os.environ.get("FLCE_CONFIG_DIR", Path(__file__).resolve().parent.parent / "configs" / "helion"))

# Built-in defaults, used where no config file is found (e.g. an installed wheel without configs/).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "lse_forward": {
        "block": {"block_n": 256, "block_v": 128, "block_h": 64},
        "config": {"num_warps": 8, "num_stages": 3, "indexing": "tensor_descriptor", "l2_groupings": [8]},
    },
    "chunk_stats": {"block": {"block_n": 4, "block_v": 1024}, "config": {"num_warps": 8, "num_stages": 2}},
    "chunk_grad": {"block": {"block_n": 32, "block_v": 256}, "config": {"num_warps": 8, "num_stages": 2}},
}
_CPU_DEFAULTS: dict[str, dict[str, Any]] = {
    "lse_forward": {"block": {"block_n": 512, "block_v": 4096, "block_h": 4096}, "config": {}},
    "chunk_stats": {"block": {"block_n": 512, "block_v": 8192}, "config": {}},
    "chunk_grad": {"block": {"block_n": 512, "block_v": 8192}, "config": {}},
}


@dataclass
class _Overrides:
    blocks: dict[str, dict[str, int]] = field(default_factory=dict)
    chunk_bytes: int | None = None
    # how the fused strategy forms a chunk's logits: "helion" (lse_forward stores them and their
    # statistics in one pass) or "cublas" (cuBLAS matmul, then the chunk_stats kernel)
    fused_logits: str = os.environ.get("FLCE_FUSED_LOGITS", "helion")


_OVR = _Overrides()


@contextlib.contextmanager
def override(*, blocks: dict[str, dict[str, int]] | None = None, chunk_bytes: int | None = None,
             fused_logits: str | None = None) -> Iterator[None]:
    """Temporarily set kernel block sizes (``{"lse_forward": {"block_n": 16, ...}}``), the byte
    budget of one materialised logits chunk, and/or how the fused strategy forms its logits."""
    old = (dict(_OVR.blocks), _OVR.chunk_bytes, _OVR.fused_logits)
    if blocks:
        _OVR.blocks = {**_OVR.blocks, **blocks}
    if chunk_bytes is not None:
        _OVR.chunk_bytes = chunk_bytes
    if fused_logits is not None:
        if fused_logits not in ("helion", "cublas"):
            raise ValueError(f"fused_logits must be 'helion' or 'cublas', got {fused_logits!r}")
        _OVR.fused_logits = fused_logits
    try:
        yield
    finally:
        _OVR.blocks, _OVR.chunk_bytes, _OVR.fused_logits = old


def fused_logits_mode() -> str:
    return _OVR.fused_logits


def arch_of(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return {(9, 0): "h200"}.get((major, minor), f"sm{major}{minor}")


@lru_cache(maxsize=None)
def _load(arch: str) -> dict[str, Any]:
    path = _CONFIG_DIR / f"{arch}.json"
    if path.is_file():
        return json.loads(path.read_text())
    return {}


def dtype_class(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}[dtype]


def entry(kernel: str, device: torch.device, dtype: torch.dtype, variant: str = "", h: int | None = None) -> dict[str, Any]:
    """The shipped entry for ``kernel`` on ``device`` at ``dtype`` (``default`` if none).
    ``variant`` (e.g. ``"store"``: ``lse_forward`` writing the logits too) looks up
    ``<kernel>_<variant>`` first and falls back to the kernel's own entries. ``h`` (the hidden size,
    for ``lse_forward``) selects a shape-class entry ``"<dtype>@h<h>"`` ahead of the dtype's own:
    the K loop's length sets how much of each tile's time the softmax epilogue takes."""
    arch = arch_of(device)
    table = _load(arch).get(kernel, {})
    special = _load(arch).get(f"{kernel}_{variant}", {}) if variant else {}
    fallback = (_CPU_DEFAULTS if arch == "cpu" else _DEFAULTS)[kernel]
    dc = dtype_class(dtype)
    keys = ([f"{dc}@h{h}"] if h is not None else []) + [dc]
    e = (next((special[k] for k in keys if k in special), None) or next((table[k] for k in keys if k in table), None)
         or table.get("default") or fallback)
    block = {**fallback["block"], **e.get("block", {}), **_OVR.blocks.get(kernel, {})}
    return {"block": block, "config": e.get("config", {})}


_CONFIGURED: set[int] = set()
# the kernels' trailing constexpr block-size arguments, in order
BLOCK_ORDER = {"lse_forward": ("block_n", "block_v", "block_h"), "chunk_stats": ("block_n", "block_v"),
               "chunk_grad": ("block_n", "block_v")}


def _launch(kernel: helion.Kernel, name: str, args: tuple[Any, ...], device: torch.device, dtype: torch.dtype,
            variant: str = "", h: int | None = None) -> Any:
    e = entry(name, device, dtype, variant, h)
    block = e["block"]
    full = (*args, *(block[k] for k in BLOCK_ORDER[name]))
    bound = kernel.bind(full)
    if device.type == "cuda" and id(bound) not in _CONFIGURED:
        bound.set_config(helion.Config(**e["config"]))
        _CONFIGURED.add(id(bound))
    return bound(*full)


def _transform(z: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    y = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32) * scale
    return softcap * torch.tanh(y / softcap) if softcap > 0 else y


def _degenerate(*sizes: int) -> bool:
    """Helion 1.4 mis-compiles size-1 dims ("can only unsplat single-element tensors"): shapes with a
    dimension below 2 take a torch path of the same math (CPU reference mode included)."""
    return min(sizes) < 2


def logits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` by cuBLAS, into ``out`` when given."""
    return torch.mm(x, w.T, out=out) if bias is None else torch.addmm(bias, x, w.T, out=out)


def cublas_logits(x: torch.Tensor) -> bool:
    """Inputs whose logits come from cuBLAS/torch matmuls (then ``chunk_stats``), not ``lse_forward``:
    float64 (``hl.dot`` has none) and float32 on CUDA. Helion 1.4's float32 ``hl.dot`` at
    ``dot_precision="ieee"`` ran 57x slower than cuBLAS on the H200 (benchmarks/NOTES.md, run 8),
    and cuBLAS follows the caller's ``torch.backends.cuda.matmul.allow_tf32`` exactly as torch does.
    (CPU float32 keeps the Helion kernel: reference mode is how CI covers it.)"""
    return x.dtype == torch.float64 or (x.dtype == torch.float32 and x.device.type == "cuda")


def lse_forward(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target_local: torch.Tensor,
                scale: float, softcap: float, with_sum: bool, z_out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row ``[N, 4]`` float32 stats (shard lse, target logit, sum of logits, max logit); the logits are
    written to ``z_out`` [N, V] when given (the fused strategy), else never stored."""
    if _degenerate(*x.shape, w.shape[0]) or cublas_logits(x):
        # size-1 dims (Helion 1.4 bug), float64 and CUDA float32: cuBLAS logits + chunk_stats,
        # token chunk by token chunk when nothing asks for the logits (memory O(chunk))
        def stats(xc: torch.Tensor, tc: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            return chunk_stats(logits(xc, w, bias, out), tc, scale, softcap, with_sum)

        n = x.shape[0]
        rows = n if z_out is not None or n == 0 else chunk_rows(n, w.shape[0], x.element_size(), x.device)
        if rows >= n:
            return stats(x, target_local, z_out)
        return torch.cat([stats(x[i:i + rows], target_local[i:i + rows], None) for i in range(0, n, rows)])
    b = bias if bias is not None else w.new_zeros(1)
    zo = z_out if z_out is not None else x.new_empty(1, 1)
    pmax, psum, ptgt, psumy = _launch(
        K.lse_forward_partials, "lse_forward",
        (x, w, b, target_local, zo, float(scale), float(softcap), bool(bias is not None), z_out is not None, bool(with_sum)),
        x.device, x.dtype, "store" if z_out is not None else "", x.shape[1],
    )
    m = pmax.amax(0)
    lse = m + torch.log((psum * torch.exp(pmax - m)).sum(0))
    sumy = psumy.sum(0) if with_sum else torch.zeros_like(m)
    return torch.stack([lse, ptgt.sum(0), sumy, m], dim=1)


def chunk_stats(z: torch.Tensor, target_local: torch.Tensor, scale: float, softcap: float, with_sum: bool) -> torch.Tensor:
    """Per-row ``[Nc, 4]`` stats (lse, target logit, sum, max) of a materialised logits chunk ``z``."""
    if z.numel() == 0:  # empty chunk or empty shard: lse and max -inf, sums 0
        out = torch.zeros(z.shape[0], 4, dtype=torch.float64 if z.dtype == torch.float64 else torch.float32, device=z.device)
        out[:, 0] = float("-inf")
        out[:, 3] = float("-inf")
        return out
    if _degenerate(*z.shape):
        y = _transform(z, scale, softcap)
        hit = target_local >= 0
        t = torch.where(hit, y.gather(1, target_local.clamp(min=0).long()[:, None])[:, 0], torch.zeros_like(y[:, 0]))
        sy = y.sum(1) if with_sum else torch.zeros_like(t)
        return torch.stack([torch.logsumexp(y, 1), t, sy, y.amax(1)], dim=1)
    lse, t, sy, mx = _launch(K.chunk_stats, "chunk_stats", (z, target_local, float(scale), float(softcap), bool(with_sum)), z.device, z.dtype)
    return torch.stack([lse, t, sy, mx], dim=1)


def chunk_grad_(z: torch.Tensor, target_local: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, scale: float,
                eps_over_v: float, one_minus_eps: float, two_zl: float, softcap: float) -> torch.Tensor:
    """Overwrite the logits chunk ``z`` with its dlogits (see kernels/chunk_grad.py)."""
    if z.numel() == 0:
        return z
    if _degenerate(*z.shape):
        y = _transform(z, scale, softcap)
        onehot = torch.arange(z.shape[1], device=z.device)[None, :] == target_local[:, None]
        dy = (g * (1 + two_zl * lse))[:, None] * torch.exp(y - lse[:, None]) - onehot * (g * one_minus_eps)[:, None] - (g * eps_over_v)[:, None]
        if softcap > 0:
            dy = dy * (1 - (y / softcap) ** 2)
        return z.copy_(dy * scale)
    return _launch(K.chunk_grad_, "chunk_grad",
                   (z, target_local, lse, g, float(scale), float(eps_over_v), float(one_minus_eps), float(two_zl), float(softcap)),
                   z.device, z.dtype)


EXTRA_BYTES = 1 << 30  # the loss's own memory beyond its inputs and the gradients it returns (SPEC §5 bar)
HEADROOM_BYTES = 64 << 20  # what lives beside the chunk: per-tile partials (32 MiB at llama3), stats, targets


def chunk_rows(total: int, row_elems: int, elem_size: int, device: torch.device, reserved_bytes: int = 0,
               share: int = 1) -> int:
    """Rows per materialised logits chunk: the byte budget over the row size, then balanced.

    Budget: ``override(chunk_bytes=...)``, else ``FLCE_CHUNK_MB``, else on CUDA
    ``(EXTRA_BYTES - HEADROOM_BYTES) / share - reserved_bytes`` (at least 64 MiB), where
    ``reserved_bytes`` are the caller's other buffers that are not returned gradients (the
    recompute strategy's float32 dX accumulator) and ``share`` is the tensor-parallel size, so that
    each rank holds 1/P of the single-GPU plan's memory; else (CPU) 256 MiB. Rows are a multiple of
    128 where the total allows, and the chunks are balanced: ceil(total / rows) chunks of equal
    size (no small tail chunk, whose matmuls run inefficiently).

    Measured on the H200, bf16, N=8192 (benchmarks/NOTES.md, run 11): 384 MiB / 512 MiB / 1 GiB
    chunks ran gemma at 1.35x / 1.26x / 1.14x three matmuls (llama3 1.13x / 1.09x / 1.08x): every
    chunk re-reads and re-writes the whole dW, and a chunk of few rows gives cuBLAS thin matmuls.

    The result depends only on its arguments (no free-memory query): under tensor parallelism the
    fused strategy issues one collective per token chunk, so every rank must plan the same chunks.
    """
    if _OVR.chunk_bytes is not None:
        budget = _OVR.chunk_bytes
    elif os.environ.get("FLCE_CHUNK_MB"):
        budget = int(os.environ["FLCE_CHUNK_MB"]) << 20
    elif device.type == "cuda":
        budget = max(64 << 20, (EXTRA_BYTES - HEADROOM_BYTES) // max(1, share) - reserved_bytes)
    else:
        budget = 256 << 20
    if total <= 0:
        return 1
    rows = max(1, budget // max(1, row_elems * elem_size))
    if rows >= 256:
        rows = rows // 128 * 128
    if rows >= total:
        return total
    chunks = -(-total // rows)
    even = -(-total // chunks)
    if rows >= 256:  # round up to a multiple of 128: still <= rows, and still `chunks` chunks
        even = -(-even // 128) * 128
    return even
