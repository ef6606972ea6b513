"""``torch.compile`` support: the loss as two ``torch.library`` custom ops, so that a compiled model
that calls it keeps one graph (no graph break) on a single rank and under tensor parallelism
without sequence parallelism.

    flce_dist::fused_lce(hidden, weight, bias?, target, num_items?, <options>, group_name)
        -> (loss, lse, correct, dX, dW, db)
    flce_dist::fused_lce_backward(hidden, weight, bias?, target, num_items?, lse, grad_loss, <options>, group_name)
        -> (dX, dW, db)

The first runs ``autograd.flce_forward``: with the fused strategy it also returns the unscaled
gradients (``[0]``-sized tensors otherwise), which its autograd formula scales by grad_output
(out of place: a compiled backward may not mutate a saved forward output, so the compiled fused
path holds one more dW-sized buffer than eager during the backward). The recompute strategy's
backward is the second op. Eager calls never come here: they use ``autograd.FLCEFunction``.
The process group travels by name (``ProcessGroup.group_name``) since custom ops take no objects.
Both ops have fake implementations, so shapes propagate without running a kernel.
"""

# no ``from __future__ import annotations`` here: custom_op infers the op schema from the
# annotations, and older torch releases do not evaluate string annotations
from typing import Optional

import torch
import torch.distributed as dist

from .autograd import stat_dtype, flce_forward, local_targets, recompute_grads, scale_precomputed, uses_fused
from .params import FLCEParams

Tensor = torch.Tensor


def _group(name: str) -> Optional[dist.ProcessGroup]:
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _params(vocab_start: int, vocab_size: int, ignore_index: int, reduction: str, label_smoothing: float,
            z_loss: float, softcap: float, temperature: float, strategy: str, deterministic: bool) -> FLCEParams:
    return FLCEParams(vocab_start=vocab_start, vocab_size=vocab_size, ignore_index=ignore_index, reduction=reduction,
                      label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, temperature=temperature,
                      sequence_parallel=False, strategy=strategy, deterministic=deterministic)


@torch.library.custom_op("flce_dist::fused_lce", mutates_args=())
def fused_lce(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, num_items: Optional[Tensor],
              vocab_start: int, vocab_size: int, ignore_index: int, reduction: str, label_smoothing: float,
              z_loss: float, softcap: float, temperature: float, strategy: str, deterministic: bool,
              needs_grad: bool, group_name: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    p = _params(vocab_start, vocab_size, ignore_index, reduction, label_smoothing, z_loss, softcap, temperature,
                strategy, deterministic)
    loss, lse, correct, pre, _ = flce_forward(hidden, weight, bias, target, num_items, p, _group(group_name), needs_grad)
    dx, dw, db = pre if pre is not None else (None, None, None)
    # outputs may not alias each other: a fresh empty tensor for each absent one
    return (loss, lse, correct, hidden.new_empty(0) if dx is None else dx, weight.new_empty(0) if dw is None else dw,
            hidden.new_empty(0, dtype=stat_dtype(hidden)) if db is None else db)


@fused_lce.register_fake
def _(hidden, weight, bias, target, num_items, vocab_start, vocab_size, ignore_index, reduction, label_smoothing,
      z_loss, softcap, temperature, strategy, deterministic, needs_grad, group_name):
    n = hidden.shape[0]
    sd = stat_dtype(hidden)
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=sd)
    lse = hidden.new_empty((n,), dtype=sd)
    correct = hidden.new_empty((n,), dtype=torch.bool)
    if uses_fused(needs_grad, reduction, strategy):
        db = hidden.new_empty((weight.shape[0] if bias is not None else 0,), dtype=sd)
        return loss, lse, correct, torch.empty_like(hidden), torch.empty_like(weight), db
    return loss, lse, correct, hidden.new_empty(0), weight.new_empty(0), hidden.new_empty(0, dtype=sd)


@torch.library.custom_op("flce_dist::fused_lce_backward", mutates_args=())
def fused_lce_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                       num_items: Optional[Tensor], lse: Tensor, grad_loss: Tensor, vocab_start: int,
                       vocab_size: int, ignore_index: int, reduction: str, label_smoothing: float, z_loss: float,
                       softcap: float, temperature: float, strategy: str, deterministic: bool,
                       group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    p = _params(vocab_start, vocab_size, ignore_index, reduction, label_smoothing, z_loss, softcap, temperature,
                strategy, deterministic)
    tl = local_targets(target, p, weight.shape[0])
    dx, dw, db = recompute_grads(hidden, weight, bias, tl, lse, target != ignore_index, num_items, grad_loss, p,
                                 _group(group_name))
    return dx, dw, weight.new_empty(0) if db is None else db


@fused_lce_backward.register_fake
def _(hidden, weight, bias, target, num_items, lse, grad_loss, *options):
    db = weight.new_empty((weight.shape[0],)) if bias is not None else weight.new_empty(0)
    return torch.empty_like(hidden), torch.empty_like(weight), db


_OPTIONS = slice(5, 17)  # vocab_start, ..., deterministic, needs_grad, group_name among fused_lce's inputs


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, num_items = inputs[:5]
    options = list(inputs[_OPTIONS])
    _, lse, _, dx, dw, db = output
    ctx.options = options[:10] + options[11:]  # fused_lce_backward's options: no needs_grad
    ctx.fused = uses_fused(options[10], options[3], options[8])
    ctx.has_bias = bias is not None
    ctx.w_dtype = weight.dtype
    ctx.mark_non_differentiable(lse, output[2])
    if ctx.fused:
        ctx.save_for_backward(dx, dw, db if bias is not None else None)
    else:
        ctx.save_for_backward(hidden, weight, bias, target, num_items, lse)


def _backward(ctx, grad_loss, *_):
    if ctx.fused:
        dx, dw, db = ctx.saved_tensors
        dx, dw, db = scale_precomputed(dx, dw, db, grad_loss, ctx.w_dtype, inplace=False)
    else:
        hidden, weight, bias, target, num_items, lse = ctx.saved_tensors
        dx, dw, db = fused_lce_backward(hidden, weight, bias, target, num_items, lse, grad_loss, *ctx.options)
    return (dx, dw, db if ctx.has_bias else None) + (None,) * 14


torch.library.register_autograd("flce_dist::fused_lce", _backward, setup_context=_setup_context)
