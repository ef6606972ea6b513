"""Per-row statistics of a materialised logits chunk, as partials over vocab splits.

Algorithm, for a chunk ``z [Nc, V]`` of raw logits (cuBLAS ``x_chunk @ W.T (+ b)``):

    for each (token tile n, vocab split s)           # grid: (Nc/BN) x (V/BS) programs
        m, s, t, sy, e = -inf, 0, 0, 0, 0            # running max, sum-exp, target logit, sum,
                                                     # sum_v exp(y - m) * (y - m)  (entropy only)
        for each vocab tile v of the split (BV columns):  # loop, BS/BV iterations
            y  = transform(z[n, v])                  # scale, softcap, as in lse_forward
            m' = max(m, max_v y);  a = exp(m - m')
            e  = a * (e + (m - m') * s) + sum_v exp(y - m') * (y - m')
            s  = s * a + sum_v exp(y - m');  m = m'
            t += y[target] if the target is in this tile;  sy += sum_v y
        pmax[s, n], psum[s, n], ptgt[s, n], psumy[s, n], pent[s, n] = m, s, t, sy, e

The partials (``[ceil(V/BS), Nc]`` each, float32, float64 for float64 chunks so that float64
gradchecks run through the same kernels) have ``lse_forward``'s layout and meaning (relative to the
split's max), so ``lse_forward.merge_partials`` turns them into the ``[Nc, 4]`` / ``[Nc, 5]`` stats.
Why splits: a grid over token tiles alone has Nc/BN programs (88 for a 2816-row chunk at BN=32) for
132 SMs, and a wide vocab tile spreads one row over several warps, so every tile's max and sum
cross warps through shared memory; ``block_v`` = 256 keeps a bf16 row tile inside one warp
(8 elements per lane) and the splits give the grid its parallelism (benchmarks/NOTES.md, run 16).
``block_s`` must be a multiple of ``block_v`` (``launch.chunk_stats`` rounds it). Out-of-bounds
vocab columns are -inf for the max and 0 for the sums; out-of-bounds rows are not stored.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from ..formulas import acc_dtype, transform
from .common import SETTINGS


@helion.kernel(static_shapes=False, **SETTINGS)
def chunk_stats_partials(
    z: torch.Tensor,
    target_local: torch.Tensor,
    scale: float,
    softcap: hl.constexpr,
    with_sum: hl.constexpr,
    with_ent: hl.constexpr,
    block_n: hl.constexpr,
    block_s: hl.constexpr,
    block_v: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, v = z.size()
    ct = torch.float64 if z.dtype == torch.float64 else torch.float32  # compute dtype
    n_s = (v + block_s - 1) // block_s
    pmax = torch.empty([n_s, n], dtype=ct, device=z.device)
    psum = torch.empty([n_s, n], dtype=ct, device=z.device)
    ptgt = torch.empty([n_s, n], dtype=ct, device=z.device)
    psumy = torch.empty([n_s if with_sum else 1, n], dtype=ct, device=z.device)
    pent = torch.empty([n_s if with_ent else 1, n], dtype=ct, device=z.device)
    for tile_n, tile_s in hl.tile([n, v], block_size=[block_n, block_s]):
        m_i = hl.full([tile_n], float("-inf"), dtype=ct)
        s_i = hl.zeros([tile_n], dtype=ct)
        t_i = hl.zeros([tile_n], dtype=ct)
        sy_i = hl.zeros([tile_n], dtype=ct)
        e_i = hl.zeros([tile_n], dtype=ct)
        tgt_t = target_local[tile_n]
        for tile_v in hl.tile(tile_s.begin, tile_s.end, block_size=block_v):
            y = z[tile_n, tile_v].to(ct) * scale
            if softcap > 0:
                y = softcap * torch.tanh(y / softcap)
            valid = (tile_v.index < v)[None, :]
            ym = torch.where(valid, y, float("-inf"))
            m_new = torch.maximum(m_i, torch.amax(ym, dim=1))
            e_ym = torch.exp(ym - m_new[:, None])
            if with_ent:  # (m - m') * s is -inf * 0 on the first tile: 0 there
                shift = torch.where(s_i > 0, (m_i - m_new) * s_i, 0.0)
                e_i = torch.exp(m_i - m_new) * (e_i + shift) + torch.sum(
                    torch.where(valid, e_ym * (y - m_new[:, None]), 0.0), dim=1)
            s_i = s_i * torch.exp(m_i - m_new) + torch.sum(e_ym, dim=1)
            m_i = m_new
            hit = tile_v.index[None, :] == tgt_t[:, None]
            t_i = t_i + torch.sum(torch.where(hit, y, 0.0), dim=1)
            if with_sum:
                sy_i = sy_i + torch.sum(torch.where(valid, y, 0.0), dim=1)
        pmax[tile_s.id, tile_n] = m_i
        psum[tile_s.id, tile_n] = s_i
        ptgt[tile_s.id, tile_n] = t_i
        if with_sum:
            psumy[tile_s.id, tile_n] = sy_i
        if with_ent:
            pent[tile_s.id, tile_n] = e_i
    return pmax, psum, ptgt, psumy, pent


def chunk_stats_reference(z: torch.Tensor, target_local: torch.Tensor, scale: float, softcap: float,
                          with_sum: bool, with_ent: bool = False) -> tuple[torch.Tensor, ...]:
    """The kernel's math in torch: ``(lse, tgt, sumy, ymax, ent)`` of ``z [Nc, V]``. Used where the
    kernel cannot run (Helion 1.4 mis-compiles size-1 dims) and by the tests. An empty chunk or shard
    gives lse = max = -inf and zero sums and entropy."""
    ct = acc_dtype(z.dtype)
    if z.numel() == 0:
        inf = torch.full((z.shape[0],), float("-inf"), dtype=ct, device=z.device)
        zero = torch.zeros(z.shape[0], dtype=ct, device=z.device)
        return inf, zero, zero.clone(), inf.clone(), zero.clone()
    y = transform(z, scale, softcap)
    hit = target_local >= 0
    t = torch.where(hit, y.gather(1, target_local.clamp(min=0).long()[:, None])[:, 0], torch.zeros_like(y[:, 0]))
    sy = y.sum(1) if with_sum else torch.zeros_like(t)
    lse = torch.logsumexp(y, 1)
    ent = (torch.exp(y - lse[:, None]) * (lse[:, None] - y)).sum(1) if with_ent else torch.zeros_like(t)
    return lse, t, sy, y.amax(1), ent
