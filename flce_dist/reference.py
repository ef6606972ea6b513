"""Pure-torch reference: full logits, any dtype (use float64 for checks).

``reference_loss(hidden, weight, target, ...)`` takes the FULL ``[V, H]`` weight and computes
exactly what the fused loss promises, so tests and benchmarks compare against one definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``y = softcap(z) / temperature`` with ``z = hidden @ weight.T (+ bias)`` and ``softcap(z) =
    c * tanh(z / c)``: the model's final logits divided by the temperature, as a sampler does."""
    z = F.linear(hidden, weight, bias)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def reference_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    return_lse: bool = False,
    loss_weights: torch.Tensor | None = None,
):
    """Cross entropy of ``hidden @ weight.T (+ bias)`` (logits materialised, computed in the
    inputs' dtype). Mean divides by the non-ignored count (or ``num_items_in_batch``); an all-ignored
    batch gives 0, not NaN. ``loss_weights`` (shaped like target): ``"sum"`` / ``"mean"`` reduce
    ``w_n loss_n``, the mean over the non-ignored tokens' ``sum_n w_n`` (1 where that is 0) or
    ``num_items_in_batch``; ``"none"`` returns the unweighted losses."""
    h = hidden.reshape(-1, hidden.shape[-1])
    z = reference_logits(h, weight, bias, softcap=softcap, temperature=temperature)
    return loss_from_logits(
        z,
        target,
        ignore_index=ignore_index,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        return_lse=return_lse,
        loss_weights=loss_weights,
    )


def loss_from_logits(
    z: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    return_lse: bool = False,
    loss_weights: torch.Tensor | None = None,
):
    """The loss of ``reference_loss`` from already transformed logits ``z [N, V]``."""
    t = target.reshape(-1)
    lse = torch.logsumexp(z, dim=-1)
    valid = t != ignore_index
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    zt = z.gather(1, safe_t[:, None])[:, 0]
    loss = lse - (1.0 - label_smoothing) * zt
    if label_smoothing > 0:  # (not 0 * sum: a -inf logit, e.g. a masked padding row, would make it NaN)
        loss = loss - (label_smoothing / z.shape[1]) * z.sum(1)
    loss = loss + z_loss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    w = None if loss_weights is None else torch.where(valid, loss_weights.reshape(-1).to(loss.dtype), 0.0)
    if reduction == "none":
        out = loss.reshape(target.shape)
    else:
        total = loss.sum() if w is None else (w * loss).sum()
        if reduction == "sum":
            out = total
        elif w is not None and num_items_in_batch is None:
            d = w.sum()
            out = total / torch.where(d == 0, torch.ones_like(d), d)
        else:
            denom = num_items_in_batch if num_items_in_batch is not None else valid.sum()
            out = total / torch.as_tensor(denom, dtype=loss.dtype, device=loss.device).clamp(min=1)
    return (out, lse.reshape(target.shape)) if return_lse else out


def reference_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    temperature: float = 1.0,
):
    """``(logp, entropy)`` per token from the full logits (what :func:`flce_dist.logprobs_and_entropy`
    promises): ``log softmax(y)[target]`` and ``-sum_v p_v log p_v``, both 0 at ``ignore_index``, with
    ``y = softcap(z) / temperature`` (``reference_logits``: the loss's transform too)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    logp_all = torch.log_softmax(reference_logits(h, weight, bias, softcap=softcap, temperature=temperature), dim=-1)
    t = target.reshape(-1)
    valid = t != ignore_index
    logp = logp_all.gather(1, torch.where(valid, t, torch.zeros_like(t))[:, None])[:, 0]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros_like(logp)
    return (torch.where(valid, logp, zero).reshape(target.shape), torch.where(valid, ent, zero).reshape(target.shape))
