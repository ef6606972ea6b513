"""``FLCEFunction``: the eager autograd adapter over ``core.py`` (``compile_op.py`` is the other)."""

from __future__ import annotations

import torch

from .core import flce_forward, recompute_grads, scale_precomputed, scale_weighted

DOUBLE_BACKWARD = (
    "fused_linear_cross_entropy does not support double backward (a backward with create_graph=True, "
    "e.g. a gradient penalty): its gradients are formed by kernels, not by differentiable torch ops. "
    "Compute such a term with flce_dist.reference_loss (full logits) or without create_graph."
)


def refuse_double_backward() -> None:
    """Called at the start of every backward: with ``create_graph=True`` autograd runs it with grad
    mode on, and the gradients returned here would silently carry no graph."""
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD)


def partial_dx():
    """Removed: ``with partial_dx():`` was ambient state that a compiled call could not see. Pass
    ``partial_dx=True`` to :func:`flce_dist.fused_linear_cross_entropy` or
    :func:`flce_dist.logprobs_and_entropy` instead. Calling this raises ``RuntimeError``."""
    raise RuntimeError(
        "flce_dist.autograd.partial_dx() was removed: pass partial_dx=True to "
        "fused_linear_cross_entropy / logprobs_and_entropy (an explicit option, seen by "
        "torch.compile and compared across ranks)"
    )


class FLCEFunction(torch.autograd.Function):
    """Vocab-parallel fused linear cross entropy.

    Inputs: hidden [N_in, H] (N_in = N / P under sequence parallelism), weight [V_r, H],
    bias [V_r] or None, target [N_in] global ids, num_items (0-d tensor or None), the call's
    ``FLCEParams`` and process group, and loss_weights [N_in] or None (constants: no gradient).
    Outputs: loss (scalar, or [N_in] for reduction="none"), lse [N_in] (global), correct [N_in]
    (bool: target == argmax over all shards; False for ignored tokens), both not differentiable,
    and entropy [N_in] (differentiable; an empty tensor without ``return_entropy``).
    Gradients of unused outputs arrive as None (no zero tensors are made): an unused entropy adds
    nothing to the backward, an unused loss contributes a zero row weight.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, num_items, p, group, loss_weights=None):
        need = ctx.needs_input_grad
        needs_grad = any(need[:3])
        # only the gradients some input needs: a frozen lm_head (LoRA / PEFT) skips the dW matmul
        # and buffer, a hidden without a gradient the dX matmul and its all-reduce
        ctx.need_dx, ctx.need_dw = bool(need[0]), bool(need[1] or need[2])
        # keep_logits: a recompute-strategy call keeps its forward's logits for the backward: all of them where they
        # fit one chunk (3 matmuls, not 4), else the backward's first vocab chunk (core.kept_columns)
        loss, lse, correct, ent, pre, (x, tl, lse_all, valid, ent_all, ctx.tw, kept) = flce_forward(
            hidden,
            weight,
            bias,
            target,
            num_items,
            p,
            group,
            needs_grad,
            ctx.need_dx,
            ctx.need_dw,
            loss_weights,
            copy_lse=p.return_lse,
            keep_logits=True,
        )  # the API returns lse only with return_lse: no copy otherwise
        if needs_grad:
            # inputs cost nothing to keep (x is this rank's hidden, also under sequence parallelism);
            # they let a second backward (retain_graph, gradcheck) of the fused strategy recompute,
            # once its precomputed gradients were handed out
            ctx.save_for_backward(x, weight, bias, tl, lse_all, valid, num_items, ent_all)
        ctx.set_materialize_grads(False)
        if ent is None:
            ent = loss.new_empty(0)
            ctx.mark_non_differentiable(ent)
        # Precomputed gradients and kept logits live on ctx, not in saved_tensors: the backward drops ctx's
        # reference so that autograd can take dW without a copy (a copy would double its memory), and the
        # kept logits become dz in place, once (a second backward recomputes them).
        ctx.pre, ctx.kept, ctx.p, ctx.group, ctx.w_dtype = pre, kept, p, group, weight.dtype
        ctx.mark_non_differentiable(lse, correct)
        ctx.loss_shape = loss.shape
        return loss, lse, correct, ent

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse, _grad_correct, grad_ent):
        refuse_double_backward()
        need = ctx.needs_input_grad
        x, w, b, tl, lse, valid, num_items, ent = ctx.saved_tensors
        if grad_loss is None:  # only the entropy is used
            grad_loss = lse.new_zeros(ctx.loss_shape)
        if ctx.pre is not None:  # fused strategy: gradients formed in the forward
            dx, dw, db = ctx.pre
            ctx.pre = None
            pre = (dx if need[0] else None, dw if need[1] else None, db if need[2] else None)
            if ctx.tw is None or ctx.p.reduction != "none":
                scaled = scale_precomputed(*pre, grad_loss, ctx.w_dtype, settings=ctx.p.settings)
            else:  # None where the gradient is not c * loss_weights: recomputed below
                scaled = scale_weighted(pre, grad_loss, ctx.tw, valid, ctx.p, ctx.group, ctx.w_dtype)
            if scaled is not None:
                return *scaled, None, None, None, None, None
        kept, ctx.kept = ctx.kept, None
        dx, dw, db = recompute_grads(
            x,
            w,
            b,
            tl,
            lse,
            valid,
            num_items,
            grad_loss,
            ctx.p,
            ctx.group,
            ent,
            grad_ent,
            ctx.need_dx,
            ctx.need_dw,
            ctx.tw,
            kept,
        )
        return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None, None, None, None, None, None)
