"""The block-sparse gradient matmul of the opt-in gradient filter (``grad_filter_eps``).

``dz [N, V]`` is a chunk's dlogits; ``keep [ceil(N/BN), ceil(V/BV)]`` (bool) marks the (token tile,
vocab tile) blocks that hold at least one entry at or above the filter threshold; the others are
treated as zero and never read. The mask reaches the kernel compacted, row by row of tiles
(``compact(keep)``: ``kidx [M/BM, K/BK]`` int32, the kept k-tile ids of each m-tile first in
ascending order, and ``kcount [M/BM]`` int32), so the K loop runs over kept blocks only, with a
data-dependent trip count and no branch: Triton pipelines its loads as in a dense matmul (an
``if keep[m, k]`` around the dot did not pipeline: several times cuBLAS per kept block,
benchmarks/NOTES.md). One kernel serves both gradient matmuls:

    masked_mm(a, b, kidx, kcount, out)   out [M, H] (+)= sum over kept (m, k) of a[m, k] @ b[k, :]
                                         grid (M/BM) x (H/BH); loop j < kcount[m]: k = kidx[m, j]
    dX = dz @ W                          a = dz,   keep,    (BM, BK) = (BN, BV)
    dW = dz.T @ x                        a = dz.T, keep.T,  (BM, BK) = (BV, BN)  (transposed views, no copy)

With ``b_perm`` / ``out_perm`` (int32 ``[K]`` / ``[M]``) the rows of ``b`` / ``out`` are taken through an
index (a gather of whole rows, coalesced along H): the filter's sorted vocabulary order without a sorted
copy of the weight shard (``core.VocabOrder``, ``Settings(filter_order="gather")``):

    dX = dz @ W[perm]                    b = W,    b_perm = perm   (row k of the sorted order is W[perm[k]])
    dW[perm] (+)= dz.T @ x               out = dW, out_perm = perm (the gradient lands in the shard's order)

It accumulates in float32 and stores in ``out``'s dtype, adding to ``out`` when ``accumulate`` (the
recompute strategy's float32 dX over vocab chunks, the fused strategy's dW over token chunks). The
block sizes along ``a``'s two dims must be the ones ``keep`` was built with (``block_n``,
``block_v`` of the ``masked_mm`` config entry). The skipped work is what a trained model's
long-tailed softmax makes negligible: a block whose every ``|dL/dz|`` (per unit row weight) is
below eps (once the vocabulary is ordered by mean logit, ``core.VocabOrder``).

Shapes: a [M, K], b [K, H], kidx [ceil(M/BM), ceil(K/BK)] int32, kcount [ceil(M/BM)] int32, out [M, H];
b_perm [K] / out_perm [M] int32 (or a [1] dummy when ``permute_b`` / ``permute_out`` is False).
"""

from __future__ import annotations

import torch

from .._helion_compat import helion
from .common import SETTINGS

import helion.language as hl


@helion.kernel(static_shapes=False, dot_precision="ieee", **SETTINGS)
def masked_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    kidx: torch.Tensor,
    kcount: torch.Tensor,
    out: torch.Tensor,
    b_perm: torch.Tensor,
    out_perm: torch.Tensor,
    accumulate: hl.constexpr,
    permute_b: hl.constexpr,
    permute_out: hl.constexpr,
    block_m: hl.constexpr,
    block_k: hl.constexpr,
    block_h: hl.constexpr,
) -> torch.Tensor:
    m, k = a.size()
    h = b.size(1)
    for tile_m, tile_h in hl.tile([m, h], block_size=[block_m, block_h]):
        acc = hl.zeros([tile_m, tile_h], dtype=torch.float32)
        in_m = tile_m.index < m
        in_h = tile_h.index < h
        for j in hl.grid(kcount[tile_m.id]):
            rk = kidx[tile_m.id, j] * block_k + hl.arange(block_k)
            in_k = rk < k
            a_blk = hl.load(a, [tile_m.index, rk], extra_mask=in_m[:, None] & in_k[None, :])
            if permute_b:  # row rk of the sorted order is b[b_perm[rk]]
                rb = hl.load(b_perm, [rk], extra_mask=in_k)
                b_blk = hl.load(b, [rb, tile_h.index], extra_mask=in_k[:, None] & in_h[None, :])
            else:
                b_blk = hl.load(b, [rk, tile_h.index], extra_mask=in_k[:, None] & in_h[None, :])
            acc = hl.dot(a_blk, b_blk, acc=acc)
        if permute_out:  # row m of the sorted order lands in out[out_perm[m]]
            ro = hl.load(out_perm, [tile_m.index], extra_mask=in_m)
            both = in_m[:, None] & in_h[None, :]
            if accumulate:
                acc = acc + hl.load(out, [ro, tile_h.index], extra_mask=both).to(torch.float32)
            hl.store(out, [ro, tile_h.index], acc.to(out.dtype), extra_mask=both)
        else:
            if accumulate:
                acc = acc + out[tile_m, tile_h].to(torch.float32)
            out[tile_m, tile_h] = acc.to(out.dtype)
    return out


def compact(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keep [Mt, Kt]`` bool as the kernel's ``(kidx [Mt, Kt], kcount [Mt])`` int32: each row's kept
    k-tile ids first, in ascending order (a stable sort of ``~keep``), then the rest (never read)."""
    kcount = keep.sum(1, dtype=torch.int32)
    kidx = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices.to(torch.int32)
    return kidx, kcount


def expand_keep(keep: torch.Tensor, m: int, k: int, block_m: int, block_k: int) -> torch.Tensor:
    """``keep`` as an element mask ``[m, k]`` (for the reference and tests)."""
    return keep.repeat_interleave(block_m, 0)[:m].repeat_interleave(block_k, 1)[:, :k]


def masked_mm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    keep: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    block_m: int,
    block_k: int,
    b_perm: torch.Tensor | None = None,
    out_perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's math in torch: the kept blocks of ``a`` times ``b`` (rows ``b[b_perm]``), into (or
    added to) ``out`` (rows ``out[out_perm]``)."""
    bb = b if b_perm is None else b.index_select(0, b_perm)
    part = torch.mm(
        torch.where(expand_keep(keep, a.shape[0], a.shape[1], block_m, block_k), a, torch.zeros_like(a)), bb
    )
    if out_perm is None:
        return out.add_(part) if accumulate else out.copy_(part)
    if accumulate:
        part = part + out.index_select(0, out_perm)
    return out.index_copy_(0, out_perm.long(), part.to(out.dtype))  # the kernels' int32 index; torch wants int64
