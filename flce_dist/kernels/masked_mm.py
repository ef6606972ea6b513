"""Block-sparse gradient matmuls of the opt-in gradient filter (``grad_filter_eps``).

``dz [N, V]`` is a chunk's dlogits; ``keep [ceil(N/BN), ceil(V/BV)]`` (bool) marks the (token tile,
vocab tile) blocks that hold at least one entry at or above the filter threshold; the others are
treated as zero and never read:

    dx_masked   dX [N, H] = dz @ W            grid (N/BN) x (H/BH); loop over vocab tiles v:
                    if keep[n, v]: acc += dz[n, v] @ W[v, :]
    dw_masked   dW [V, H] = dz.T @ x (+= acc)  grid (V/BV) x (H/BH); loop over token tiles n:
                    if keep[n, v]: acc += dz[n, v].T @ x[n, :]

Both accumulate in float32 and store in the output's dtype; ``dw_masked`` adds to ``out`` when
``accumulate`` (the fused strategy's later token chunks). Block sizes are constexpr arguments: the
vocab tile must be the one ``keep`` was built with (``block_n``, ``block_v`` of the
``masked_mm`` config entry). The skipped work is what a trained model's long-tailed softmax makes
negligible: a block whose every ``|dL/dz|`` (per unit row weight) is below eps.

Shapes: dz [N, V], w [V, H], x [N, H], keep [ceil(N/BN), ceil(V/BV)] bool, out [N, H] / [V, H].
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from .common import SETTINGS


@helion.kernel(static_shapes=False, dot_precision="ieee", **SETTINGS)
def dx_masked(
    dz: torch.Tensor,
    w: torch.Tensor,
    keep: torch.Tensor,
    out: torch.Tensor,
    block_n: hl.constexpr,
    block_v: hl.constexpr,
    block_h: hl.constexpr,
) -> torch.Tensor:
    n, v = dz.size()
    h = w.size(1)
    for tile_n, tile_h in hl.tile([n, h], block_size=[block_n, block_h]):
        acc = hl.zeros([tile_n, tile_h], dtype=torch.float32)
        for tile_v in hl.tile(v, block_size=block_v):
            if keep[tile_n.id, tile_v.id]:
                acc = hl.dot(dz[tile_n, tile_v], w[tile_v, tile_h], acc=acc)
        out[tile_n, tile_h] = acc.to(out.dtype)
    return out


@helion.kernel(static_shapes=False, dot_precision="ieee", **SETTINGS)
def dw_masked(
    dz: torch.Tensor,
    x: torch.Tensor,
    keep: torch.Tensor,
    out: torch.Tensor,
    accumulate: hl.constexpr,
    block_n: hl.constexpr,
    block_v: hl.constexpr,
    block_h: hl.constexpr,
) -> torch.Tensor:
    n, v = dz.size()
    h = x.size(1)
    for tile_v, tile_h in hl.tile([v, h], block_size=[block_v, block_h]):
        acc = hl.zeros([tile_v, tile_h], dtype=torch.float32)
        for tile_n in hl.tile(n, block_size=block_n):
            if keep[tile_n.id, tile_v.id]:
                acc = hl.dot(dz[tile_n, tile_v].T, x[tile_n, tile_h], acc=acc)
        if accumulate:
            acc = acc + out[tile_v, tile_h].to(torch.float32)
        out[tile_v, tile_h] = acc.to(out.dtype)
    return out


def expand_keep(keep: torch.Tensor, n: int, v: int, block_n: int, block_v: int) -> torch.Tensor:
    """``keep`` as an element mask ``[n, v]`` (for the references and tests)."""
    return keep.repeat_interleave(block_n, 0)[:n].repeat_interleave(block_v, 1)[:, :v]


def dx_masked_reference(dz: torch.Tensor, w: torch.Tensor, keep: torch.Tensor, out: torch.Tensor,
                        block_n: int, block_v: int) -> torch.Tensor:
    """The kernel's math in torch: the kept blocks of ``dz`` times ``w``."""
    m = expand_keep(keep, *dz.shape, block_n, block_v)
    return out.copy_(torch.mm(torch.where(m, dz, torch.zeros_like(dz)), w))


def dw_masked_reference(dz: torch.Tensor, x: torch.Tensor, keep: torch.Tensor, out: torch.Tensor,
                        accumulate: bool, block_n: int, block_v: int) -> torch.Tensor:
    m = expand_keep(keep, *dz.shape, block_n, block_v)
    part = torch.mm(torch.where(m, dz, torch.zeros_like(dz)).T, x)
    return out.add_(part) if accumulate else out.copy_(part)
