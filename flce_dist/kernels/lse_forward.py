"""Forward statistics of a vocab shard without materialising its logits.

Algorithm (per rank; ``W`` is this rank's ``[V, H]`` shard):

    for each (vocab tile v, token tile n)          # a matmul-shaped grid: (V/BV) x (N/BN) programs
        z      = x[n, :] @ W[v, :].T  (+ b[v])     # [BN, BV], float32 accumulation over H tiles
        z      = round(z, dtype of x)              # 16-bit inputs: logits in the input dtype, as
                                                   # torch/Liger/CCE have them, so that a backward
                                                   # that recomputes them with cuBLAS is consistent
        z_out[n, v] = z                            # store == 1 (the fused strategy)
        y      = transform(z)                      # z * scale, then softcap * tanh(y / softcap)
        pmax[v_tile, n] = max_v y                  # per-row partials of this tile
        psum[v_tile, n] = sum_v exp(y - pmax)
        ptgt[v_tile, n] = y[n, target_local[n]] if the target falls in this tile else 0
                                                   # only with with_tgt: without it (sm_90, no bias)
                                                   # the target logits come from kernels/target_dot.py,
                                                   # the same bits, with no compare per element
        psumy[v_tile,n] = sum_v y                  # only with label smoothing
        pent[v_tile, n] = sum_v exp(y - pmax) * (y - pmax)   # only with entropy (return_entropy)
        z_out[n, v] = exp(y - ref[n])              # store == 2: the exponentials against a
                                                   # per-row reference (the row-scale gradient,
                                                   # rowscale.py), as exp(y - pmax) * exp(pmax - ref):
                                                   # one multiply per element beyond the statistics

The partials (``[ceil(V/BV), N]`` float32 each, 1/BV of the logits) are merged by the caller
into the shard's logsumexp, target logit and (with entropy) the shard's softmax entropy
``H_r = log S - sum_t a_t (s_t (m_t - M) + e_t) / S`` (``M`` = max of the tile maxima ``m_t``,
``a_t = exp(m_t - M)``, ``S = sum_t a_t s_t``): every term is relative to a maximum, so a peaked
distribution's small entropy is not the difference of two large numbers. A grid over token tiles only gives N/BN programs
(64 at N=8192) for 132 SMs; this grid keeps the matmul's parallelism (measured on the H200: 1.05x cuBLAS, benchmarks/NOTES.md).

With ``permute_w`` the pass runs on the rows ``w[w_perm]`` without a copy of them (``w_perm`` [V] int32:
the gradient filter's vocabulary order, ``Settings(filter_order="gather")``): each W tile is loaded
through the index (a gather of whole rows, coalesced along H; pointer loads where the plain pass may use
TMA), and bias, targets, ``z_out`` and the partials are in the sorted order.

Shapes: x [N, H], w [V, H] (V = len(w_perm) with ``permute_w``; else w_perm is a [1] dummy), bias [V] (or a [1] dummy with ``has_bias=False``),
target_local [N] int32 (-1 where the target is ignored or outside the shard), z_out [N, V] in x's
dtype (or a [1, 1] dummy with store == 0), ref [N] float32 (a [1] dummy unless store == 2); ptgt is
one unwritten row without ``with_tgt``.
Out-of-bounds rows/columns of partial tiles are masked: their logits are set to -inf before the
max, and their stores are dropped. A tile whose logits are all -inf (a -inf bias on padded vocab
rows) gets pmax = -inf and psum = pent = 0 (its exponentials are taken against 0, not -inf).
"""

from __future__ import annotations

import torch

from .._helion_compat import helion
from ..formulas import transform
from .chunk_stats import chunk_stats_reference
from .common import LOG2E, SETTINGS

import helion.language as hl


@helion.kernel(static_shapes=False, dot_precision="ieee", **SETTINGS)  # N, V at run time: kernels/README
def lse_forward_partials(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor,
    target_local: torch.Tensor,
    z_out: torch.Tensor,
    ref: torch.Tensor,
    w_perm: torch.Tensor,
    scale: float,
    softcap: hl.constexpr,
    has_bias: hl.constexpr,
    store: hl.constexpr,
    with_sum: hl.constexpr,
    with_ent: hl.constexpr,
    with_tgt: hl.constexpr,
    permute_w: hl.constexpr,
    block_n: hl.constexpr,
    block_v: hl.constexpr,
    block_h: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.size(0)
    h = hl.specialize(x.size(1))  # the model's hidden size: a static K loop
    v = w_perm.size(0) if permute_w else w.size(0)
    n_vt = (v + block_v - 1) // block_v
    pmax = torch.empty([n_vt, n], dtype=torch.float32, device=x.device)
    psum = torch.empty([n_vt, n], dtype=torch.float32, device=x.device)
    ptgt = torch.empty([n_vt if with_tgt else 1, n], dtype=torch.float32, device=x.device)  # not written without
    psumy = torch.empty([n_vt if with_sum else 1, n], dtype=torch.float32, device=x.device)
    pent = torch.empty([n_vt if with_ent else 1, n], dtype=torch.float32, device=x.device)
    for tile_v, tile_n in hl.tile([v, n], block_size=[block_v, block_n]):
        acc = hl.zeros([tile_n, tile_v], dtype=torch.float32)
        if permute_w:  # column j of this pass is row w_perm[j] of w (the gradient filter's sorted order)
            rows = w_perm[tile_v]
            for tile_h in hl.tile(h, block_size=block_h):
                acc = hl.dot(x[tile_n, tile_h], w[rows, tile_h].T, acc=acc)
        else:
            for tile_h in hl.tile(h, block_size=block_h):
                acc = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=acc)
        if has_bias:
            acc = acc + bias[tile_v].to(torch.float32)[None, :]
        zq = acc.to(x.dtype)
        if store == 1:  # launch.STORE_LOGITS (a literal: Helion passes a module constant as a runtime argument)
            z_out[tile_n, tile_v] = zq
        y = zq.to(torch.float32) * scale
        if softcap > 0:
            y = softcap * torch.tanh(y / softcap)
        valid = (tile_v.index < v)[None, :]
        ym = torch.where(valid, y, float("-inf"))
        m = torch.amax(ym, dim=1)
        m_ref = torch.where(m > float("-inf"), m, 0.0)  # a tile of -inf logits (e.g. a -inf bias on padded rows)
        e_ym = torch.exp2(ym * LOG2E - (m_ref * LOG2E)[:, None])  # exp(ym - m): kernels/common.py
        s = torch.sum(e_ym, dim=1)
        if with_tgt:  # else launch.lse_forward takes the target logits from kernels/target_dot.py
            hit = tile_v.index[None, :] == target_local[tile_n][:, None]
            t = torch.sum(torch.where(hit, y, 0.0), dim=1)
        pmax[tile_v.id, tile_n] = m
        psum[tile_v.id, tile_n] = s
        if with_tgt:
            ptgt[tile_v.id, tile_n] = t
        if with_sum:
            psumy[tile_v.id, tile_n] = torch.sum(torch.where(valid, y, 0.0), dim=1)
        if with_ent:
            pent[tile_v.id, tile_n] = torch.sum(torch.where(e_ym > 0, e_ym * (y - m_ref[:, None]), 0.0), dim=1)
        if store == 2:  # launch.STORE_EXP
            f = torch.exp2((m_ref - ref[tile_n]) * LOG2E)  # exp(m - ref) per row
            z_out[tile_n, tile_v] = (e_ym * f[:, None]).to(z_out.dtype)
    return pmax, psum, ptgt, psumy, pent


def merge_partials(
    pmax: torch.Tensor,
    psum: torch.Tensor,
    ptgt: torch.Tensor,
    psumy: torch.Tensor,
    pent: torch.Tensor,
    with_sum: bool,
    with_ent: bool = False,
) -> torch.Tensor:
    """The kernel's ``[ceil(V/BV), N]`` partials merged over vocab tiles into ``[N, 4]`` stats
    (shard lse, target logit, sum of logits, max logit), ``[N, 5]`` with the shard entropy."""
    m = pmax.amax(0)
    a = torch.exp(pmax - torch.where(m > float("-inf"), m, 0.0))  # a shard of -inf logits: a = 0, lse = -inf
    big_s = (psum * a).sum(0)
    lse = m + torch.log(big_s)
    sumy = psumy.sum(0) if with_sum else torch.zeros_like(m)
    cols = [lse, ptgt.sum(0), sumy, m]
    if with_ent:
        # a tile of -inf logits has a = 0 and psum = 0 against pmax - m = -inf: it contributes 0
        part = torch.where(a > 0, a * (psum * (pmax - m) + pent), torch.zeros_like(a))
        cols.append(torch.log(big_s) - part.sum(0) / big_s)
    return torch.stack(cols, dim=1)


def lse_forward_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    target_local: torch.Tensor,
    scale: float,
    softcap: float,
    with_sum: bool,
    z_out: torch.Tensor | None = None,
    with_ent: bool = False,
    exp_ref: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's math in torch (full logits of ``x``, rounded to x's dtype, as the kernel does):
    ``[N, 4]`` stats (``[N, 5]`` with the entropy); the logits go to ``z_out`` when given, or with
    ``exp_ref`` their exponentials ``exp(y - exp_ref)`` (store == 2)."""
    z = torch.mm(x, w.T) if bias is None else torch.addmm(bias, x, w.T)
    if z_out is not None:
        z_out.copy_(z if exp_ref is None else torch.exp(transform(z, scale, softcap) - exp_ref[:, None]))
    cols = chunk_stats_reference(z, target_local, scale, softcap, with_sum, with_ent)
    return torch.stack(cols if with_ent else cols[:4], dim=1)
