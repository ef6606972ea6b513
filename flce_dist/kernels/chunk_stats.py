"""Per-row statistics of a materialised logits chunk, as partials over vocab splits.

Algorithm, for a chunk ``z [Nc, V]`` of raw logits (cuBLAS ``x_chunk @ W.T (+ b)``) and the
transform ``y = T(z)`` (scale, then softcap: increasing, so ``max y = T(max z)``):

    for each (token tile n, vocab split s)           # grid: (Nc/BN) x (V/BS) programs
        acc_m[BN, BV] = -inf                         # sweep 1, lane-wise (no cross-lane work in the loop)
        for each vocab tile v of the split:  acc_m = max(acc_m, z[n, v])
        m = T(max over lanes of acc_m)               # the split's max of y, one reduction
        acc_s = acc_sy = acc_e = 0                   # sweep 2 (the split re-read: from L2)
        for each vocab tile v of the split:
            y = T(z[n, v]);  p = exp(y - m)             # as exp2((y - m) log2 e): kernels/common.py
            acc_s += p;  acc_sy += y (label smoothing);  acc_e += p * (y - m) (entropy)
        pmax[s, n], psum[s, n], psumy[s, n], pent[s, n] = m, sum(acc_s), sum(acc_sy), sum(acc_e)

The target logit is one element per row: the caller gathers it (``launch.chunk_stats``) instead of
comparing every column with the target. The partials (``[ceil(V/BS), Nc]`` each, float32; float64 for
float64 chunks so that float64 gradchecks run through the same kernels) have ``lse_forward``'s layout
and meaning (relative to the split's max), so ``lse_forward.merge_partials`` combines them.

Why this shape (benchmarks/NOTES.md, run 16): the pass is a stream over the chunk and, on the H200,
instruction-bound before it is memory-bound; an online softmax pays a max, an exp-rescale and two
sums across lanes per tile. Lane-wise accumulators leave one reduction per split, the second sweep
reads the split back from L2 (``BN x BS`` elements per program), and the splits give a
2816-row chunk enough programs for 132 SMs. ``block_s`` must be a multiple of ``block_v``
(``launch.chunk_stats`` rounds it). The split's tiles are loaded at explicit column indices
(``begin + j * BV + arange(BV)``, masked), so every tile has the accumulators' full ``[BN, BV]``
shape, in reference mode too. Out-of-bounds columns are -inf for the max and 0 for the sums;
out-of-bounds rows are not stored.
"""

from __future__ import annotations

import torch

from .._helion_compat import helion
from ..formulas import acc_dtype, transform
from .common import LN2, LOG2E, SETTINGS

import helion.language as hl


@helion.kernel(static_shapes=False, **SETTINGS)
def chunk_stats_partials(
    z: torch.Tensor,
    scale: float,
    softcap: hl.constexpr,
    with_sum: hl.constexpr,
    with_ent: hl.constexpr,
    block_n: hl.constexpr,
    block_s: hl.constexpr,
    block_v: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, v = z.size()
    ct = torch.float64 if z.dtype == torch.float64 else torch.float32  # compute dtype
    n_s = (v + block_s - 1) // block_s
    pmax = torch.empty([n_s, n], dtype=ct, device=z.device)
    psum = torch.empty([n_s, n], dtype=ct, device=z.device)
    psumy = torch.empty([n_s if with_sum else 1, n], dtype=ct, device=z.device)
    pent = torch.empty([n_s if with_ent else 1, n], dtype=ct, device=z.device)
    for tile_n, tile_s in hl.tile([n, v], block_size=[block_n, block_s]):
        in_n = (tile_n.index < n)[:, None]
        acc_m = hl.full([tile_n, block_v], float("-inf"), dtype=ct)
        for j in hl.grid(block_s // block_v):  # sweep 1: the split's tiles, max lane by lane
            c = tile_s.begin + j * block_v + hl.arange(block_v)
            valid = (c < v)[None, :]
            zt = hl.load(z, [tile_n.index, c], extra_mask=in_n & valid).to(ct)
            acc_m = torch.maximum(acc_m, torch.where(valid, zt, float("-inf")))
        m = torch.amax(acc_m, dim=1) * scale
        if softcap > 0:
            m = softcap * torch.tanh(m / softcap)
        m2 = torch.where(m > float("-inf"), m, 0.0) * LOG2E  # a split of -inf logits: exponentials against 0
        acc_s = hl.zeros([tile_n, block_v], dtype=ct)
        acc_sy = hl.zeros([tile_n, block_v], dtype=ct)
        acc_e = hl.zeros([tile_n, block_v], dtype=ct)
        for j in hl.grid(block_s // block_v):  # sweep 2: the same tiles again (from L2)
            c = tile_s.begin + j * block_v + hl.arange(block_v)
            valid = (c < v)[None, :]
            y = hl.load(z, [tile_n.index, c], extra_mask=in_n & valid).to(ct) * scale
            if softcap > 0:
                y = softcap * torch.tanh(y / softcap)
            d2 = y * LOG2E - m2[:, None]  # (y - m) in log2 units
            p = torch.where(valid, torch.exp2(d2), 0.0)
            acc_s = acc_s + p
            if with_sum:
                acc_sy = acc_sy + torch.where(valid, y, 0.0)
            if with_ent:  # p = 0 where y = -inf (d2 = -inf): no 0 * inf
                acc_e = acc_e + torch.where(p > 0, p * d2, 0.0)
        pmax[tile_s.id, tile_n] = m
        psum[tile_s.id, tile_n] = torch.sum(acc_s, dim=1)
        if with_sum:
            psumy[tile_s.id, tile_n] = torch.sum(acc_sy, dim=1)
        if with_ent:
            pent[tile_s.id, tile_n] = torch.sum(acc_e, dim=1) * LN2
    return pmax, psum, psumy, pent


def target_logit(z: torch.Tensor, target_local: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """``T(z[n, target_local[n]])`` per row, 0 where ``target_local`` is -1 (no target in this shard)."""
    hit = target_local >= 0
    zt = z.gather(1, target_local.clamp(min=0).long()[:, None])[:, 0]
    return torch.where(hit, transform(zt, scale, softcap), torch.zeros((), dtype=acc_dtype(z.dtype), device=z.device))


def chunk_stats_reference(
    z: torch.Tensor, target_local: torch.Tensor, scale: float, softcap: float, with_sum: bool, with_ent: bool = False
) -> tuple[torch.Tensor, ...]:
    """The kernel's math in torch: ``(lse, tgt, sumy, ymax, ent)`` of ``z [Nc, V]``. Used where the
    kernel cannot run (Helion 1.4 mis-compiles size-1 dims) and by the tests. An empty chunk or shard
    gives lse = max = -inf and zero sums and entropy."""
    ct = acc_dtype(z.dtype)
    if z.numel() == 0:
        inf = torch.full((z.shape[0],), float("-inf"), dtype=ct, device=z.device)
        zero = torch.zeros(z.shape[0], dtype=ct, device=z.device)
        return inf, zero, zero.clone(), inf.clone(), zero.clone()
    y = transform(z, scale, softcap)
    t = target_logit(z, target_local, scale, softcap)
    sy = y.sum(1) if with_sum else torch.zeros_like(t)
    lse = torch.logsumexp(y, 1)
    ent = torch.zeros_like(t)
    if with_ent:  # p = 0 where y = -inf: no 0 * inf
        pe = torch.exp(y - lse[:, None])
        ent = torch.where(pe > 0, pe * (lse[:, None] - y), 0.0).sum(1)
    return lse, t, sy, y.amax(1), ent
