"""The collectives of the vocab-parallel loss. Every function is a no-op at group size 1.

Per training step (group of P ranks, N tokens, H hidden, 4 float32 stats per token; 5 with
``return_entropy``):
  forward   one all-gather of the per-rank stats, ``[P, N, 4]`` float32 = 16*P*N bytes (20*P*N)
            (the fused strategy issues it per token chunk: same bytes, N/Nc calls)
  backward  one all-reduce of dX, ``N*H`` elements of hidden's dtype (async, overlapped with dW)
  SP        plus an all-gather of hidden (``N*H``) and targets, and a reduce-scatter of dX instead
            of the all-reduce.

Deterministic mode (``deterministic=True``): NCCL sums in an order fixed by its algorithm and
protocol choice (ring/tree, channel count), which depend on the message size, topology, NCCL version
and ``NCCL_*`` settings, so NCCL does not promise bitwise-stable sums. There, the dX all-reduce
becomes an all-to-all (each rank receives every rank's partial of its 1/P segment) + a float32 sum
in rank order + an all-gather (same bytes as a ring all-reduce, 2·(P-1)/P·N·H), and the SP
reduce-scatter an all-to-all + ordered sum (same bytes as the reduce-scatter). Both are blocking.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..formulas import acc_dtype
from .groups import group_size

# torch >= 2.13 names the flat collectives *_single (the old names warn); torch 2.11 (the GPU
# image) only has the old ones. Both take a flat output: [P * rows, ...].
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    """``parts [P, ...]`` summed in rank order, in float32 (float64 stays float64)."""
    acc = parts[0].to(acc_dtype(parts.dtype))
    for k in range(1, parts.shape[0]):
        acc += parts[k]
    return acc


def combine_stats(
    stats: torch.Tensor, group: dist.ProcessGroup | None, guard: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge per-rank ``[N, 4]`` stats ``(lse_r, target_logit_r, sum_logits_r, max_logit_r)`` into
    the global ``(lse, target_logit, sum_logits, max_logit)`` with ONE all-gather (16·P·N bytes)
    and a local logsumexp / sum / max. ``[N, 5]`` stats carry the shard's softmax entropy ``H_r``
    too (20·P·N bytes), merged as ``H = sum_r w_r (H_r + lse - lse_r)`` with ``w_r = exp(lse_r -
    lse)`` (each shard's share of the probability mass; every term >= 0, no cancellation).
    ``guard`` (int32 words, ``guard.py``) rides in the same all-gather as the raw bits of extra rows
    (32 bytes per rank, padded to whole rows); returns ``(merged, [P, words] guards of every
    rank)`` (None without a guard or at group size 1).

    Ranks with an empty shard contribute ``lse_r = max_r = -inf`` (and ``H_r = 0``); logsumexp,
    max and the entropy's weights ignore them."""
    p = group_size(group)
    if p == 1:
        return stats, None
    out = all_gather_rows(pack_stats(stats, guard), group).view(p, -1, stats.shape[1])
    return merge_stats(out, stats.shape[0], guard)


def pack_stats(stats: torch.Tensor, guard: torch.Tensor | None) -> torch.Tensor:
    """This rank's all-gather payload: ``stats [Nc, k]`` and, with a guard, its words as the raw
    bits of extra rows (padded to whole rows)."""
    if guard is None:
        return stats
    k = stats.shape[1]
    bits = guard.view(stats.dtype)
    pad = -bits.numel() % k
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return torch.cat([stats, bits.reshape(-1, k)])


def merge_stats(out: torch.Tensor, nc: int, guard: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gathered payloads ``out [P, Nc (+ guard rows), k]`` -> the merged ``[Nc, k]`` stats and
    the ``[P, words]`` guards (None without a guard)."""
    p, _, k = out.shape
    guards = None
    if guard is not None:
        words = guard.numel() * guard.element_size() // out.element_size()
        guards = out[:, nc:].reshape(p, -1)[:, :words].contiguous().view(torch.int32).reshape(p, -1)
    out = out[:, :nc]
    lse = torch.logsumexp(out[..., 0], dim=0)
    cols = [lse, out[..., 1].sum(0), out[..., 2].sum(0), out[..., 3].amax(0)]
    if k == 5:
        w = torch.exp(out[..., 0] - lse)
        cols.append(torch.where(w > 0, w * (out[..., 4] + lse - out[..., 0]), torch.zeros_like(w)).sum(0))
    return torch.stack(cols, dim=1), guards


def all_reduce_async(t: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work | None:
    """Start summing ``t`` in place across the group; returns the handle (None at size 1)."""
    if group_size(group) == 1:
        return None
    return dist.all_reduce(t, group=group, async_op=True)


def all_reduce_deterministic_(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``t`` across the group in place, bitwise identical on every rank and from run to run:
    all-to-all of 1/P segments, a float32 sum in rank order, an all-gather (blocking)."""
    p = group_size(group)
    if p == 1:
        return t
    flat = t.reshape(-1)
    seg = -(-flat.numel() // p)
    padded = torch.zeros(p * seg, dtype=t.dtype, device=t.device)
    padded[: flat.numel()] = flat
    mine = reduce_scatter_rows(padded, group, deterministic=True)  # this rank's 1/P, summed in rank order
    _all_gather_flat(padded, mine, group=group)
    t.copy_(padded[: flat.numel()].view_as(t))
    return t


def all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's equal-sized ``t`` along dim 0 (rank order)."""
    p = group_size(group)
    if p == 1:
        return t
    t = t.contiguous()
    out = torch.empty((p * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    _all_gather_flat(out, t, group=group)
    return out


def reduce_scatter_rows(t: torch.Tensor, group: dist.ProcessGroup | None, deterministic: bool = False) -> torch.Tensor:
    """Sum ``t [P*n, ...]`` across ranks and keep this rank's ``[n, ...]`` slice.
    ``deterministic``: the sum is taken locally in rank order (all-to-all + float32 sum, same bytes)."""
    p = group_size(group)
    if p == 1:
        return t
    t = t.contiguous()
    if deterministic:
        parts = torch.empty_like(t)
        dist.all_to_all_single(parts, t, group=group)
        return _ordered_sum(parts.view(p, t.shape[0] // p, *t.shape[1:])).to(t.dtype)
    out = torch.empty((t.shape[0] // p, *t.shape[1:]), dtype=t.dtype, device=t.device)
    _reduce_scatter_flat(out, t, group=group)
    return out


def all_gather_rows_uneven(t: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather ``t [sizes[rank], ...]`` from every rank into ``[sum(sizes), ...]`` (rank order):
    each rank pads to ``max(sizes)`` rows, one all-gather, then the padding is dropped."""
    width = max(sizes)
    if t.shape[0] < width:
        t = torch.cat([t, t.new_zeros((width - t.shape[0], *t.shape[1:]))])
    out = all_gather_rows(t.contiguous(), group).view(len(sizes), width, *t.shape[1:])
    return torch.cat([out[r, :n] for r, n in enumerate(sizes)])


class CopyToGroup(torch.autograd.Function):
    """Megatron's ``copy_to_tensor_model_parallel_region``: identity forward; the backward
    all-reduces the gradient over ``group`` (one all-reduce of the input's size, blocking).

    Put it on the replicated input of a vocab-parallel layer (``x`` of ``x @ W_r.T``): each rank's
    gradient ``dz_r @ W_r`` is its shard's part only, and the sum over the group is the gradient of
    the full logits, the same on every rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if group_size(ctx.group) == 1:
            return grad, None
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may share the incoming buffer
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromGroup(torch.autograd.Function):
    """Megatron's ``reduce_from_tensor_model_parallel_region``: the forward all-reduces (sums) ``x``
    over ``group`` (one all-reduce of its size, blocking); the backward is the identity (the sum's
    gradient is replicated downstream, and each rank's input gets it whole)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)  # the sum is taken in place: not on the input
        if group_size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherVocab(torch.autograd.Function):
    """Logits shard ``[..., V_local]`` -> full ``[..., V]`` (one uneven all-gather); the backward
    keeps this rank's columns ``[start, end)`` (everything downstream is replicated across the group)."""

    @staticmethod
    def forward(ctx, logits, start, end, sizes, group):
        ctx.start, ctx.end = start, end
        full = all_gather_rows_uneven(logits.movedim(-1, 0), sizes, group)
        return full.movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.start : ctx.end].contiguous(), None, None, None, None
