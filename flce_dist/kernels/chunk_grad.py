"""dlogits of a materialised logits chunk, written in place (the chunk becomes dz).

With ``y = transform(z)`` (scale ``s``, optional softcap ``c``), ``p = exp(y - lse)`` against the
GLOBAL per-row logsumexp, per-row gradient weight ``g`` (0 for ignored rows), label smoothing
``eps`` over the global vocabulary ``V`` and z-loss coefficient ``zl``:

    dL/dy = g * ((1 + 2*zl*lse) * p - (1 - eps) * onehot(target) - eps / V)
            - gh * p * (y - mu)                          (with_ent: entropy H = lse - mu, mu = sum_v p y)
    dL/dz = dL/dy * s * (1 - (y/c)^2)        (softcap)      or   dL/dy * s   (no softcap)

Grid: (token tile x vocab tile) over ``z [Nc, Vc]``; each element is read once and written once in
``z``'s dtype. Out-of-bounds elements of partial tiles are neither read nor written. With
``with_absmax`` (the gradient filter, ``grad_filter_eps``) each tile also records its per-row
``max |dL/dz|`` in ``absmax [ceil(Vc/BV), Nc]`` (float32), from which the caller builds the
block mask of ``masked_mm.py``.
Per-row inputs: ``lse [Nc]``, ``g [Nc]`` float32, ``target_local [Nc]`` int32 (-1: no target here);
with ``with_ent`` also ``mu [Nc]`` (the global ``sum_v p y``) and ``gh [Nc]`` (dL/dH per row), so the
loss's and the entropy's gradients leave in one pass (``[1]`` dummies without).
"""

from __future__ import annotations

import torch

from .._helion_compat import helion
from ..formulas import transform
from .common import LOG2E, SETTINGS

import helion.language as hl


@helion.kernel(static_shapes=False, **SETTINGS)
def chunk_grad_(
    z: torch.Tensor,
    target_local: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    mu: torch.Tensor,
    gh: torch.Tensor,
    scale: float,
    eps_over_v: float,
    one_minus_eps: float,
    two_zl: float,
    softcap: hl.constexpr,
    with_ent: hl.constexpr,
    with_absmax: hl.constexpr,
    block_n: hl.constexpr,
    block_v: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, v = z.size()
    ct = torch.float64 if z.dtype == torch.float64 else torch.float32  # compute dtype
    absmax = torch.empty([(v + block_v - 1) // block_v if with_absmax else 1, n], dtype=torch.float32, device=z.device)
    for tile_n, tile_v in hl.tile([n, v], block_size=[block_n, block_v]):
        y = z[tile_n, tile_v].to(ct) * scale
        if softcap > 0:
            y = softcap * torch.tanh(y / softcap)
        lse_t = lse[tile_n].to(ct)
        g_t = g[tile_n].to(ct)
        p = torch.exp2(y * LOG2E - (lse_t * LOG2E)[:, None])  # exp(y - lse): kernels/common.py
        hit = tile_v.index[None, :] == target_local[tile_n][:, None]
        dy = (
            (g_t * (1.0 + two_zl * lse_t))[:, None] * p
            - torch.where(hit, (g_t * one_minus_eps)[:, None], 0.0)
            - (g_t * eps_over_v)[:, None]
        )
        if with_ent:
            dy = dy - gh[tile_n].to(ct)[:, None] * p * (y - mu[tile_n].to(ct)[:, None])
        if softcap > 0:
            r = y / softcap
            dy = dy * (1.0 - r * r)
        dz = (dy * scale).to(z.dtype)
        z[tile_n, tile_v] = dz
        if with_absmax:
            inside = (tile_v.index < v)[None, :]
            absmax[tile_v.id, tile_n] = torch.amax(torch.where(inside, torch.abs(dz.to(torch.float32)), 0.0), dim=1)
    return z, absmax


def chunk_grad_reference_(
    z: torch.Tensor,
    target_local: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    eps_over_v: float,
    one_minus_eps: float,
    two_zl: float,
    softcap: float,
    mu: torch.Tensor | None = None,
    gh: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's math in torch, in place on ``z`` (used for size-1 dims and by the tests)."""
    if z.numel() == 0:
        return z
    y = transform(z, scale, softcap)
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == target_local[:, None]
    dy = (
        (g * (1 + two_zl * lse))[:, None] * torch.exp(y - lse[:, None])
        - onehot * (g * one_minus_eps)[:, None]
        - (g * eps_over_v)[:, None]
    )
    if gh is not None:
        assert mu is not None  # the entropy's gradient comes with its mean
        dy = dy - gh[:, None] * torch.exp(y - lse[:, None]) * (y - mu[:, None])
    if softcap > 0:
        dy = dy * (1 - (y / softcap) ** 2)
    return z.copy_(dy * scale)
