"""``torch.compile`` support: the loss as two ``torch.library`` custom ops over ``core.py``, so that a
compiled model that calls it keeps one graph (no graph break) on a single rank and under tensor
parallelism without sequence parallelism (with a group, the once-per-layout shard check,
``distributed.shard.resolve_call``, runs while TorchDynamo traces, marked ``assume_constant_result``:
its collective and host sync happen at trace time and its result is a constant of the graph;
``tests/test_layout_check.py`` counts the graph breaks at 2 gloo ranks).

    flce_dist::fused_lce(hidden, weight, bias?, target, num_items?, params, need_dx, need_dw, group_name)
        -> (loss, lse, correct, entropy, dX, dW, db)
    flce_dist::fused_lce_backward(hidden, weight, bias?, target, num_items?, lse, entropy, grad_loss,
                                  grad_entropy?, params, need_dx, need_dw, group_name) -> (dX, dW, db)

``params`` is ``FLCEParams.encode()``: the options (``partial_dx`` among them), the vocabulary slice
and the settings travel as one string (custom ops take no objects), so no option is ever passed or
sliced by position, and TorchDynamo guards on it like any constant. ``need_dx`` / ``need_dw``: which
gradients the call forms, from ``requires_grad`` at the call (a frozen lm_head: no dW buffer or
matmul; a hidden without a gradient: no dX matmul and no dX all-reduce), as the eager Function
reads them from ``ctx.needs_input_grad``; a gradient not formed comes back as None. The first
op runs ``core.flce_forward``: with the fused strategy it also returns the unscaled gradients
(``[0]``-sized tensors otherwise; ``entropy`` is ``[0]``-sized without ``return_entropy``), which its
autograd formula scales by grad_output (out of place: a
compiled backward may not mutate a saved forward output, so the compiled fused path holds one more
dW-sized buffer than eager during the backward). The recompute strategy's backward is the second
op. Eager calls never come here: they use ``autograd.FLCEFunction``. The process group travels by
name (``ProcessGroup.group_name``). Both ops have fake implementations, so shapes propagate
without running a kernel.
"""

# no ``from __future__ import annotations`` here: custom_op infers the op schema from the
# annotations, and older torch releases do not evaluate string annotations

import torch
import torch.distributed as dist

from .aligned import aligned
from .autograd import refuse_double_backward
from .core import flce_forward, local_targets, recompute_grads, scale_precomputed, uses_fused
from .formulas import acc_dtype
from .options import FLCEParams

Tensor = torch.Tensor


def _group(name: str) -> dist.ProcessGroup | None:
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # type: ignore[arg-type]  # torch types it GroupName, a NewType of str


@torch.library.custom_op("flce_dist::fused_lce", mutates_args=())
def fused_lce(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    num_items: Tensor | None,
    params: str,
    need_dx: bool,
    need_dw: bool,
    group_name: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    p = FLCEParams.decode(params)
    hidden, weight, bias, target = aligned(hidden), aligned(weight), aligned(bias), aligned(target)  # aligned.py
    loss, lse, correct, ent, pre, _ = flce_forward(
        hidden, weight, bias, target, num_items, p, _group(group_name), need_dx or need_dw, need_dx, need_dw
    )
    dx, dw, db = pre if pre is not None else (None, None, None)
    sd = acc_dtype(hidden.dtype)
    # outputs may not alias each other: a fresh empty tensor for each absent one
    return (
        loss,
        lse,
        correct,
        hidden.new_empty(0, dtype=sd) if ent is None else ent,
        hidden.new_empty(0) if dx is None else dx,
        weight.new_empty(0) if dw is None else dw,
        hidden.new_empty(0, dtype=sd) if db is None else db,
    )


@fused_lce.register_fake
def _(hidden, weight, bias, target, num_items, params, need_dx, need_dw, group_name):
    p = FLCEParams.decode(params)
    n = hidden.shape[0]
    sd = acc_dtype(hidden.dtype)
    loss = hidden.new_empty((n,) if p.reduction == "none" else (), dtype=sd)
    lse = hidden.new_empty((n,), dtype=sd)
    correct = hidden.new_empty((n,), dtype=torch.bool)
    ent = hidden.new_empty((n if p.return_entropy else 0,), dtype=sd)
    if uses_fused(need_dx or need_dw, p.reduction, p.strategy, p.return_entropy):
        db = hidden.new_empty((weight.shape[0] if bias is not None and need_dw else 0,), dtype=sd)
        return (
            loss,
            lse,
            correct,
            ent,
            torch.empty_like(hidden) if need_dx else hidden.new_empty(0),
            torch.empty_like(weight) if need_dw else weight.new_empty(0),
            db,
        )
    return loss, lse, correct, ent, hidden.new_empty(0), weight.new_empty(0), hidden.new_empty(0, dtype=sd)


@torch.library.custom_op("flce_dist::fused_lce_backward", mutates_args=())
def fused_lce_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    num_items: Tensor | None,
    lse: Tensor,
    ent: Tensor,
    grad_loss: Tensor,
    grad_ent: Tensor | None,
    params: str,
    need_dx: bool,
    need_dw: bool,
    group_name: str,
) -> tuple[Tensor, Tensor, Tensor]:
    p = FLCEParams.decode(params)
    hidden, weight, bias, target = aligned(hidden), aligned(weight), aligned(bias), aligned(target)  # aligned.py
    tl = local_targets(target, p, weight.shape[0])
    dx, dw, db = recompute_grads(
        hidden,
        weight,
        bias,
        tl,
        lse,
        target != p.ignore_index,
        num_items,
        grad_loss,
        p,
        _group(group_name),
        ent,
        grad_ent,
        need_dx,
        need_dw,
    )
    # outputs may not alias each other: a fresh empty tensor for each gradient not formed
    return (
        hidden.new_empty(0) if dx is None else dx,
        weight.new_empty(0) if dw is None else dw,
        weight.new_empty(0) if db is None else db,
    )


@fused_lce_backward.register_fake
def _(hidden, weight, bias, target, num_items, lse, ent, grad_loss, grad_ent, params, need_dx, need_dw, group_name):
    db = weight.new_empty((weight.shape[0],)) if bias is not None and need_dw else weight.new_empty(0)
    return (
        torch.empty_like(hidden) if need_dx else hidden.new_empty(0),
        torch.empty_like(weight) if need_dw else weight.new_empty(0),
        db,
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, num_items, params, need_dx, need_dw, group_name = inputs
    p = FLCEParams.decode(params)
    _, lse, _, ent, dx, dw, db = output
    ctx.params, ctx.group_name = params, group_name
    ctx.need_dx, ctx.need_dw = need_dx, need_dw
    ctx.fused = uses_fused(need_dx or need_dw, p.reduction, p.strategy, p.return_entropy)
    ctx.entropy = p.return_entropy
    ctx.loss_shape, ctx.loss_device = output[0].shape, output[0].device
    ctx.has_bias = bias is not None
    ctx.w_dtype = weight.dtype
    ctx.mark_non_differentiable(lse, output[2])
    if ctx.fused:
        ctx.save_for_backward(
            dx if need_dx else None, dw if need_dw else None, db if bias is not None and need_dw else None
        )
    else:
        ctx.save_for_backward(hidden, weight, bias, target, num_items, lse, ent)


def _backward(ctx, grad_loss, _grad_lse, _grad_correct, grad_ent, *_):
    # a backward with create_graph=True (double backward) runs this with grad mode on: refuse it, as
    # the eager Function does, instead of returning gradients that carry no graph
    refuse_double_backward()
    if grad_loss is None:  # only the entropy is used
        grad_loss = torch.zeros(ctx.loss_shape, device=ctx.loss_device)
    if ctx.fused:
        dx, dw, db = ctx.saved_tensors
        dx, dw, db = scale_precomputed(dx, dw, db, grad_loss, ctx.w_dtype, inplace=False)
    else:
        hidden, weight, bias, target, num_items, lse, ent = ctx.saved_tensors
        dx, dw, db = fused_lce_backward(
            hidden,
            weight,
            bias,
            target,
            num_items,
            lse,
            ent,
            grad_loss,
            grad_ent if ctx.entropy else None,
            ctx.params,
            ctx.need_dx,
            ctx.need_dw,
            ctx.group_name,
        )
    return (
        dx if ctx.need_dx else None,
        dw if ctx.need_dw else None,
        db if ctx.has_bias and ctx.need_dw else None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


torch.library.register_autograd("flce_dist::fused_lce", _backward, setup_context=_setup_context)
