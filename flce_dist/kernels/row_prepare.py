"""The row-scale form's per-row step after a chunk's statistics all-gather, in one launch.

``rowscale.py`` derives, per chunk row, the scale ``c`` of its stored exponentials ``E = exp(y - r)``
and rewrites the target entry from the float32 statistics (``a = 2 zl lse``, ``d = y_t - lse``):

    c[n]      = g s (1 + a) exp(r - lse)
    E'[n, t]  = exp(lse - r) (expm1(d) + a exp(d)) / (1 + a)      # rows with a local target t
    ok[n]     = (M_local - r <= max_spread) and (g == 0 or |c| >= min_c)
                and (no local target or |E'[n, t]| <= max_target)   # NaN anywhere: not ok
    gate[0]   = max(gate[0], any(not ok))                           # one atomic per row tile

``gate`` must be zero on entry; ``c`` is returned as computed (the consumers, ``row_scale`` and
``dz_gated``, read the gate: c counts as 1 where it is open). ``rowscale.prepare_reference`` is
the same in torch (~40 small kernels per chunk: the reason for this one). Grid: row tiles.

Shapes: e_flat [Nc * V] (the chunk's exponentials, in x's dtype), m_local [Nc] float32 (this rank's
max logit: a column view of its stats), st [Nc, >=4] float32 (the global stats: columns 0 lse, 1
target logit), r, g, c [Nc] float32, target_local [Nc] int32 (-1: the target is not in this
shard), gate [1] int32. No two arguments may be the same tensor object: Helion 1.4 compiles
aliased arguments into one and its bind cache does not tell aliased calls from others (run 19: a
kernel first compiled with ``local is st``, as at TP = 1, read ``st`` from ``local`` in a later
call with distinct tensors); a column view is a distinct object.
"""

from __future__ import annotations

import torch

from .._helion_compat import helion
from .common import SETTINGS

import helion.language as hl


@helion.kernel(static_shapes=False, **SETTINGS)  # one compile for every chunk size
def row_prepare(
    e_flat: torch.Tensor,
    m_local: torch.Tensor,
    st: torch.Tensor,
    r: torch.Tensor,
    target_local: torch.Tensor,
    g: torch.Tensor,
    c: torch.Tensor,
    gate: torch.Tensor,
    v: int,
    scale: float,
    two_zl: float,
    max_spread: float,
    min_c: float,
    max_target: float,
    block_n: hl.constexpr,
) -> torch.Tensor:
    n = r.size(0)
    for tile_n in hl.tile(n, block_size=block_n):
        lse = st[tile_n, 0]
        d = st[tile_n, 1] - lse  # log p_t
        rr = r[tile_n]
        gg = g[tile_n]
        tgt = target_local[tile_n]
        a = two_zl * lse
        cn = gg * (scale * (1.0 + a)) * torch.exp(rr - lse)
        et = torch.exp(lse - rr) * (torch.expm1(d) + a * torch.exp(d)) / (1.0 + a)
        has_t = tgt >= 0
        ok_spread = m_local[tile_n] - rr <= max_spread
        ok_c = (gg == 0.0) | (torch.abs(cn) >= min_c)
        ok_t = (tgt < 0) | (torch.abs(et) <= max_target)
        bad = torch.where(ok_spread & ok_c & ok_t, 0, 1).to(torch.int32)
        c[tile_n] = cn
        idx = tile_n.index.to(torch.int64) * v + torch.where(has_t, tgt, 0).to(torch.int64)
        hl.store(e_flat, [idx], et.to(e_flat.dtype), extra_mask=has_t)
        hl.atomic_max(gate, [0], torch.amax(bad, dim=0))  # one atomic per program
    return c
