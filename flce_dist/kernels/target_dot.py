"""The logits passes' target logits from their own launch, bit for bit the pass's.

A logits pass (``lse_forward.py``: the forward-only pass, the fused logits store and the row-scale
exponential store) would otherwise find each row's target logit by comparing every column index of
every tile with the row's target: an int compare, a select and an add per element in the pass's
epilogue (its cost, and this launch's gain: docs/results.md, "Per-call small kernels"). Here each token tile's rows meet their gathered target rows of W:

    for each token tile n                                   # ceil(N / BN) programs
        acc[BN, BN] = sum over H tiles h of x[n, h] @ W[t[n], h].T   # the pass's K blocks, in its
                                                            # order, float32 from zero
        y_t[n] = round(acc[i, i], dtype of x) * scale       # the diagonal: each row with its target
        y_t[n] = softcap * tanh(y_t[n] / softcap)           # softcap > 0 only, the pass's transform
                 (0 where the row has no target in this shard)

On the H200 (sm_90, wgmma) the diagonal equals the pass's target logit bit for bit when ``block_h``
is the pass's: every output element of a tensor-core dot is the same sequence of products and adds,
whatever the tile's width (``tests/test_gpu.py`` checks eight cases over the three passes). So the loss and the accuracy output
are unchanged. ``launch.lse_forward`` uses it on sm_90 for every pass without a bias (target_dot adds
none), where this is checked for all three passes; other GPUs and reference mode
(CPU, whose matmul blocking may round a [BN, BN] product apart from the pass's [BN, BV] one) keep the
pass's own compare. Extra work: BN times the dot products needed, 2 N BN H flop, and one read of x and of the N
gathered rows of W.

Shapes: x [N, H], w [V, H], target_local [N] int32 (-1: not in this shard); returns ptgt [1, N]
float32 (a one-row target partial, which ``launch.merge`` sums on its own).
"""

from __future__ import annotations

import torch

from .._helion_compat import helion
from ..formulas import transform
from .common import SETTINGS

import helion.language as hl


@helion.kernel(static_shapes=False, dot_precision="ieee", **SETTINGS)  # N, V at run time: kernels/README
def target_dot(
    x: torch.Tensor,
    w: torch.Tensor,
    target_local: torch.Tensor,
    scale: float,
    softcap: hl.constexpr,
    block_n: hl.constexpr,
    block_h: hl.constexpr,
) -> torch.Tensor:
    n = x.size(0)
    h = hl.specialize(x.size(1))  # the model's hidden size: a static K loop
    out = torch.empty([1, n], dtype=torch.float32, device=x.device)
    for tile_n in hl.tile(n, block_size=block_n):
        t = target_local[tile_n]
        tc = torch.where(t >= 0, t, 0)
        acc = hl.zeros([tile_n, tile_n], dtype=torch.float32)
        for tile_h in hl.tile(h, block_size=block_h):
            acc = hl.dot(x[tile_n, tile_h], w[tc, tile_h].T, acc=acc)
        zq = acc.to(x.dtype).to(torch.float32) * scale
        diag = tile_n.index[:, None] == tile_n.index[None, :]
        yt = torch.sum(torch.where(diag, zq, 0.0), dim=1)  # one term per row: exactly the diagonal
        if softcap > 0:
            yt = softcap * torch.tanh(yt / softcap)  # as lse_forward_partials writes formulas.transform
        out[0, tile_n] = torch.where(t >= 0, yt, 0.0)
    return out


def target_dot_reference(
    x: torch.Tensor, w: torch.Tensor, target_local: torch.Tensor, scale: float, softcap: float = 0.0
) -> torch.Tensor:
    """The kernel's math in torch: [1, N] target logits (rounded to x's dtype, times ``scale``, then
    the softcap), 0 where ``target_local`` < 0."""
    has = target_local >= 0
    wt = w[torch.where(has, target_local, 0).long()]
    y = transform((x.to(torch.float32) * wt.to(torch.float32)).sum(1).to(x.dtype).to(torch.float32), scale, softcap)
    return torch.where(has, y, torch.zeros_like(y))[None]
