"""The vocabulary order of the gradient filter (``grad_filter_eps``): the shard's rows sorted by
their mean logit, so that the (token tile x vocab tile) blocks the filter skips cluster.

Why: on a trained model's long-tailed softmax the entries above eps sit on the frequent tokens,
which a tokenizer's ids scatter over the whole vocabulary; in id order nearly every block holds one
(realistic data, 128 x 64 blocks: 78% kept at llama3, 46% at gemma), sorted by mean logit 16% / 7%
(benchmarks/NOTES.md). CCE sorts the same way in its backward.

    score[v] = sum_n w_n (x_n . W_v + b_v)      w_n = the rows' gradient weights (0: ignored rows)
             = W @ (x.T @ w) + b * sum(w)        two matrix-vector products, no [N, V] logits
    perm     = argsort(score, descending, stable)   sorted position -> shard row
    inv      = perm's inverse                       shard row -> sorted position

The core runs the filtered path on ``W[perm]`` (and ``b[perm]``, targets mapped through ``inv``) and
returns the gradients in the shard's own row order (``Settings.filter_order``): with ``"copy"`` on a
sorted copy of the shard (+ |W_r| of memory, and dW restored through ``inv``: + |W_r| more at the end);
with ``"gather"`` (the default) without one: the logits pass loads W's tiles through ``perm32``
(``kernels.launch.lse_forward_gathered``; cuBLAS logits gather blocks of ``chunking.gather_rows`` rows
into one buffer), and the block-sparse dX / dW matmuls read W and write dW through it
(``kernels/masked_mm.py``), in both strategies (the recompute strategy's vocab chunk is a slice of
``perm32``; with "copy" it takes a chunk-sized sorted copy of W, all of W when N is small). The order
only decides which blocks cluster; the loss, dX and the kept blocks' gradient are the same in any order
(summation order aside), and the error bound of the filter holds in any order. Each rank orders its
own shard: no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import torch


@dataclass(frozen=True)
class VocabOrder:
    perm: torch.Tensor  # [V_r] int64, sorted position -> shard row
    inv: torch.Tensor  # [V_r] int64, shard row -> sorted position
    perm32: torch.Tensor  # [V_r] int32: ``perm`` for the kernels that read or write through it

    @classmethod
    def by_mean_logit(
        cls, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, row_weight: torch.Tensor
    ) -> VocabOrder:
        """Rows of ``w`` by descending ``row_weight``-weighted mean logit over the rows of ``x``."""
        rw = row_weight.to(x.dtype)
        score = torch.mv(w, torch.mv(x.T, rw)).float()
        if b is not None:
            score = score + b.float() * rw.float().sum()
        perm = torch.sort(score, descending=True, stable=True).indices
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return cls(perm, inv, perm.to(torch.int32))

    @overload
    def rows(self, t: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor: ...
    @overload
    def rows(self, t: None, start: int = 0, end: int | None = None) -> None: ...
    @overload
    def rows(self, t: torch.Tensor | None, start: int = 0, end: int | None = None) -> torch.Tensor | None: ...

    def rows(self, t: torch.Tensor | None, start: int = 0, end: int | None = None) -> torch.Tensor | None:
        """Rows ``[start, end)`` of the sorted order of ``t`` (``W`` or ``b``): a copy."""
        return None if t is None else t.index_select(0, self.perm[start:end])

    def targets(self, tl: torch.Tensor) -> torch.Tensor:
        """Shard-local target ids (-1: not here) as positions in the sorted order (int32 kept). An
        empty shard (DTensor's split can leave the last rank none) has no targets to map."""
        if self.inv.numel() == 0:
            return tl
        return torch.where(tl >= 0, self.inv[tl.clamp(min=0).long()].to(tl.dtype), tl)

    @overload
    def restore(self, t: torch.Tensor) -> torch.Tensor: ...
    @overload
    def restore(self, t: None) -> None: ...
    @overload
    def restore(self, t: torch.Tensor | None) -> torch.Tensor | None: ...

    def restore(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Rows in the sorted order back to the shard's own order (a new tensor)."""
        return None if t is None else t.index_select(0, self.inv)

    def put(self, out: torch.Tensor, start: int, rows: torch.Tensor) -> None:
        """Write sorted positions ``[start, start + len(rows))`` of a gradient into ``out`` (shard order)."""
        out.index_copy_(0, self.perm[start : start + rows.shape[0]], rows)
