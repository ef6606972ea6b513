"""The logits passes' per-tile partials merged into per-row statistics, in one launch.

``lse_forward`` and ``chunk_stats`` leave ``[T, N]`` float32 partials (T vocab tiles or splits): the
tile max ``pmax``, the sum of exponentials against it ``psum``, the target logit ``ptgt`` (0 outside
the target's tile; ``chunk_stats`` gives it as one ``[1, N]`` row), and optionally the sum of logits
``psumy`` and the entropy partial ``pent``. Per row, with ``a_t = exp(pmax_t - M)``:

    M    = max_t pmax_t                                 # pass 1 over the tiles
    S    = sum_t a_t psum_t                             # pass 2
    lse  = M + log S
    tgt  = sum_t ptgt_t,  sumy = sum_t psumy_t
    H    = log S - sum_t a_t (psum_t (pmax_t - M) + pent_t) / S     # with_ent
    out[n] = (lse, tgt, sumy, M[, H])                  # [N, 4] or [N, 5] float32

``lse_forward.merge_partials`` (torch, ~12 kernels: the reference and the fallback for size-1 dims)
has the same math; a row whose tiles are all -inf (a -inf bias on padded rows) gets lse = M = -inf,
as there. Grid: token tiles; each program reads its columns of the partials twice (1/BV of the
logits' bytes: 16 MB per partial at N = 8192, V = 128256). Shapes: pmax, psum, pent [T, N] (pent,
psumy: [1, N] dummies without with_ent / with_sum), ptgt [T or 1, N], out [N, 4 + with_ent].
"""

from __future__ import annotations

import torch

from .._helion_compat import helion
from .common import LOG2E, SETTINGS

import helion.language as hl


@helion.kernel(static_shapes=False, **SETTINGS)  # one compile for every chunk size
def merge_stats(
    pmax: torch.Tensor,
    psum: torch.Tensor,
    ptgt: torch.Tensor,
    psumy: torch.Tensor,
    pent: torch.Tensor,
    out: torch.Tensor,
    with_sum: hl.constexpr,
    with_ent: hl.constexpr,
    block_n: hl.constexpr,
    block_t: hl.constexpr,
) -> torch.Tensor:
    nt, n = pmax.size()
    nt_tgt = ptgt.size(0)
    for tile_n in hl.tile(n, block_size=block_n):
        m = hl.full([tile_n], float("-inf"), dtype=torch.float32)
        for tile_t in hl.tile(nt, block_size=block_t):
            pm = torch.where((tile_t.index < nt)[:, None], pmax[tile_t, tile_n], float("-inf"))
            m = torch.maximum(m, torch.amax(pm, dim=0))
        m_ref = torch.where(m > float("-inf"), m, 0.0)
        s = hl.zeros([tile_n], dtype=torch.float32)
        sumy = hl.zeros([tile_n], dtype=torch.float32)
        part = hl.zeros([tile_n], dtype=torch.float32)
        for tile_t in hl.tile(nt, block_size=block_t):
            ok = (tile_t.index < nt)[:, None]
            pm = torch.where(ok, pmax[tile_t, tile_n], float("-inf"))
            a = torch.exp2((pm - m_ref[None, :]) * LOG2E)  # exp(pmax - M): kernels/common.py; 0 for -inf tiles
            ps = torch.where(ok, psum[tile_t, tile_n], 0.0)
            s = s + torch.sum(a * ps, dim=0)
            if with_sum:
                sumy = sumy + torch.sum(torch.where(ok, psumy[tile_t, tile_n], 0.0), dim=0)
            if with_ent:
                pe = torch.where(ok, pent[tile_t, tile_n], 0.0)
                part = part + torch.sum(torch.where(a > 0, a * (ps * (pm - m_ref[None, :]) + pe), 0.0), dim=0)
        tgt = hl.zeros([tile_n], dtype=torch.float32)
        for tile_t in hl.tile(nt_tgt, block_size=block_t):
            tgt = tgt + torch.sum(torch.where((tile_t.index < nt_tgt)[:, None], ptgt[tile_t, tile_n], 0.0), dim=0)
        log_s = torch.log(s)
        out[tile_n, 0] = m + log_s
        out[tile_n, 1] = tgt
        out[tile_n, 2] = sumy
        out[tile_n, 3] = m
        if with_ent:
            out[tile_n, 4] = log_s - part / s
    return out
