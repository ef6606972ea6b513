"""The row-scale form's two [Nc, H] row scalings in one streaming pass (``rowscale.py``).

After the chunk's ``E' @ W`` matmul (float32 out) the row-scale form needs

    dx[n, :] = round(acc[n, :] * c[n])       # dX of the chunk: c (E' @ W), rounded once
    xw[n, :] = round(x[n, :] * c[n])         # the dW matmul's operand: dW += E'^T (c x)

Two torch multiplies by a broadcast [Nc, 1] float32 column take torch's strided (non-vectorised)
elementwise kernel; this kernel reads acc, x, c once and writes both in one launch.

Shapes: acc [Nc, H] float32, x [Nc, H] (bf16 / fp32), c [Nc] float32, dx and xw [Nc, H] in x's dtype.
"""

from __future__ import annotations

import torch

from .._helion_compat import helion
from .common import SETTINGS

import helion.language as hl


@helion.kernel(static_shapes=False, **SETTINGS)  # one compile for every chunk size
def row_scale(
    acc: torch.Tensor,
    x: torch.Tensor,
    c: torch.Tensor,
    dx: torch.Tensor,
    xw: torch.Tensor,
    block_n: hl.constexpr,
    block_h: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, h = x.size()
    for tile_n, tile_h in hl.tile([n, h], block_size=[block_n, block_h]):
        cn = c[tile_n][:, None]
        dx[tile_n, tile_h] = (acc[tile_n, tile_h] * cn).to(dx.dtype)
        xw[tile_n, tile_h] = (x[tile_n, tile_h].to(torch.float32) * cn).to(xw.dtype)
    return dx, xw


def row_scale_reference(
    acc: torch.Tensor, x: torch.Tensor, c: torch.Tensor, dx: torch.Tensor, xw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's math in torch (size-1 dims)."""
    dx.copy_(acc * c[:, None])
    xw.copy_(x.to(c.dtype) * c[:, None])
    return dx, xw
