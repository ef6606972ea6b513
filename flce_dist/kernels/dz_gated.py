"""A chunk's dlogits recomputed from x and W, behind a device-side gate (the row-scale form's fallback).

``rowscale.py`` stores exponentials against a sampled per-row reference; a chunk with a row outside
that form's bounds (decided on the device after the statistics all-gather, ``gate [1]`` int32 = 1)
needs its dlogits the plain way. This kernel forms them in one pass, only where the gate is open:

    for each (vocab tile v, token tile n)             # the logits pass's grid
        if gate[0] == 0: skip                         # closed: one scalar read per program
        z  = round(x[n, :] @ W[v, :].T, dtype of x)   # the logits as lse_forward rounds them
        y  = z * scale
        p  = exp(y - lse[n])                          # against the global lse (known now)
        dz[n, v] = g[n] * scale * ((1 + 2 zl lse[n]) * p - [v == target_local[n]])

the ``chunk_grad_`` formula for what the row-scale form covers (no softcap, label smoothing, bias or
entropy term). Shapes: x [Nc, H], w [V, H], dz [Nc, V] in x's dtype (overwritten where the gate is
open, untouched where closed), target_local [Nc] int32 (-1: no target here), lse, g [Nc] float32.
"""

from __future__ import annotations

import torch

from .._helion_compat import helion
from .common import LOG2E, SETTINGS

import helion.language as hl


@helion.kernel(static_shapes=False, dot_precision="ieee", **SETTINGS)  # N, V at run time: kernels/README
def dz_gated(
    x: torch.Tensor,
    w: torch.Tensor,
    dz: torch.Tensor,
    target_local: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    gate: torch.Tensor,
    scale: float,
    two_zl: float,
    block_n: hl.constexpr,
    block_v: hl.constexpr,
    block_h: hl.constexpr,
) -> torch.Tensor:
    n = x.size(0)
    h = hl.specialize(x.size(1))  # the model's hidden size: a static K loop
    v = w.size(0)
    for tile_v, tile_n in hl.tile([v, n], block_size=[block_v, block_n]):
        if gate[0] != 0:
            acc = hl.zeros([tile_n, tile_v], dtype=torch.float32)
            for tile_h in hl.tile(h, block_size=block_h):
                acc = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=acc)
            y = acc.to(x.dtype).to(torch.float32) * scale
            lse_t = lse[tile_n]
            g_t = g[tile_n]
            p = torch.exp2(y * LOG2E - (lse_t * LOG2E)[:, None])  # exp(y - lse): kernels/common.py
            hit = tile_v.index[None, :] == target_local[tile_n][:, None]
            dy = (g_t * (1.0 + two_zl * lse_t))[:, None] * p - torch.where(hit, g_t[:, None], 0.0)
            dz[tile_n, tile_v] = (dy * scale).to(dz.dtype)
    return dz


def dz_gated_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    dz: torch.Tensor,
    target_local: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    gate: torch.Tensor,
    scale: float,
    two_zl: float,
) -> torch.Tensor:
    """The kernel's math in torch (size-1 dims, and the tests); the gate as a select."""
    from .chunk_grad import chunk_grad_reference_

    new = chunk_grad_reference_(torch.mm(x, w.T), target_local, lse, g, scale, 0.0, 1.0, two_zl, 0.0)
    return dz.copy_(torch.where(gate.reshape(()) != 0, new, dz))
