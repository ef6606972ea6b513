"""Megatron-Core integration: the language-model head + cross entropy of ``GPTModel`` and
``HybridModel`` through :func:`flce_dist.fused_linear_cross_entropy`: no ``[s, b, V/P]`` logits, no
float32 softmax kept for backward, the output layer's own tensor-parallel group.

Entry points::

    from flce_dist.integrations import megatron as flce_megatron

    handle = flce_megatron.install(model)          # model: GPTModel / HybridModel, wrapped or a list of chunks
    loss = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)  # [b, s] float32
    logits = model(tokens, position_ids, attention_mask)   # no labels: Megatron's own logits path, unchanged
    handle.remove()                                 # back to exactly what was there before

    # or, per call, Megatron-Core >= 0.18's hook (GPTModel.forward / build_schedule_plan):
    loss = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                 output_processor=flce_megatron.output_processor)

    # RL (per-token log-probabilities and entropies of logits / temperature, with gradients):
    logp, entropy = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                          output_processor=flce_megatron.OutputProcessor(output="logprobs", temperature=0.7))

Contract (Megatron's own, ``LanguageModule.compute_language_model_loss``): the model returns the
per-token loss ``[b, s]`` float32, identical on every rank of the tensor-parallel group, for the
tokens this rank holds (context parallelism: its CP-local tokens; packed sequences: the packed
tokens); the training loop's ``loss_func`` multiplies it by ``loss_mask`` and sums. The numbers are
Megatron's: the padded vocabulary's rows take part in the softmax (Megatron never masks them), the
logits are scaled by ``config.mup_output_mult`` under MuP, ``labels`` are global ids. Tokens whose
``loss_mask`` is 0 are ignored whatever their label (Megatron's data pipelines leave -1, V or padding
ids there): they are mapped to ``ignore_index`` on the device (no host sync) and give loss 0 and no
gradient, where Megatron returns a number that ``loss_func`` multiplies by 0. A label equal to
``ignore_index`` (-100; Megatron's datasets never produce one) gives loss 0 and no gradient, where
Megatron's kernel would return that token's logsumexp.

The output layer's own computation is honoured or refused, never skipped silently: its forward
pre-hooks run on the hidden states as ``nn.Module.__call__`` would run them (Megatron's DDP
registers one on every module for ``overlap_param_gather``; a pre-hook that returns new inputs is
obeyed); a forward *hook* (it would see logits that are never formed) is refused naming the layer;
so is a forward that overrides Megatron's ``ColumnParallelLinear.forward`` (a subclass, or an
instance attribute) unless a probe shows what it computes: the logits unchanged, or Megatron-Bridge's
Gemma final-logit softcapping ``c * tanh(z / c)`` with ``c = config.final_logit_softcapping``
(passed to flce_dist as ``softcap=c``). The probe runs once per layer and forward (at ``install``,
or at the first call of a processor): the layer's forward and Megatron's on one random token
(``[1, 1, h]`` per rank; its sequence-parallel all-gathers on every rank of the tensor-parallel
group), twice with a softcapping config.

Honoured, read from the model at every call: the output layer's tensor-parallel group
(``output_layer.tp_group``: equal shards of the padded V, rank r holding rows ``[r V/P, (r+1) V/P)``,
passed as ``vocab_start`` / ``vocab_size``); sequence parallelism (``output_layer.sequence_parallel``:
the hidden states are ``[s/P, b, h]``, gathered inside flce_dist, dX reduce-scattered; the per-token
outputs of the P slices are all-gathered, ``4 s b`` bytes per output, with Megatron's
``gather_from_sequence_parallel_region``, whose backward hands each rank its slice's gradient);
tied embeddings (the weight Megatron passes, the word embedding's shard); a bias without
``skip_bias_add``; ``calculate_per_token_loss`` (it only changes how the training loop scales the
summed loss: every such gradient is ``c * loss_mask``); frozen output weights. ``true_vocab_size``
(opt-in): rows at or beyond the tokenizer's vocabulary take no part in the softmax and get no
gradient (each rank passes its rows below it: the last ranks' shards shrink, possibly to none).

The 3-matmul path, sync-free: Megatron's upstream gradient of the per-token loss is
``c * loss_mask`` (its ``loss_func`` sums ``loss * loss_mask``; ``c`` is a device scalar: 1 / tokens /
micro-batches, times the loss scale), so ``loss_mask`` is passed as the loss weights: the gradient is
formed in the forward (fused strategy, 3 matmuls, not the recompute strategy's 4) and the backward
only scales it by ``c`` (dW, db) and each dX row by ``g_n / w_n``. ``grad_check="device"`` (default):
``c`` and the check that the gradient really is ``c * loss_mask`` stay on the device: no
``.item()`` / ``.tolist()`` in forward or backward, so the head can be captured in a CUDA graph; a
gradient of another form (a ``loss_func`` that is not ``sum(loss * loss_mask) * c``) makes the
head's gradients NaN on every rank (Megatron's NaN-in-gradient check and loss scaler see it), and
raises ``ValueError`` on CPU tensors. ``grad_check="host"``: the library's own check (one host sync
per backward) and an exact recompute for a gradient of another form. Without ``loss_mask`` (a
training loop that does not pass it to the model) the recompute strategy runs (sync-free too).

Collectives per micro-batch over the tp group (N = s b tokens of this rank's CP slice, H hidden):
forward one all-gather of ``[N, 4]`` float32 statistics (16 P N bytes; the fused strategy: one per
token chunk, same bytes; ``[N, 5]`` with the entropy) where Megatron's ``vocab_parallel_cross_entropy``
runs 3 all-reduces (max, target logit, sum of exponentials) and its fused "native" kernel 2;
backward one all-reduce of dX (``N H`` elements, the activation dtype), the one Megatron's
``ColumnParallelLinear`` runs, plus the gradient check's all-gather of 3 float64 per rank (both
``grad_check`` values). Sequence parallelism: forward all-gathers of the hidden states (Megatron's
output layer does the same), of the targets and of the loss weights, and the per-token outputs'
all-gather (one, also for log-probabilities with entropies); backward one reduce-scatter of dX
instead of the all-reduce (and the recompute strategy re-gathers the hidden states, as Megatron's
sequence-parallel linear does). Once per stated layout (the first call), one all-gather of each
rank's shard and call signature (a host sync: outside a CUDA graph's capture, as Megatron's warm-up
iterations are).

Memory: no ``[s, b, V/P]`` logits (Megatron: the bf16 logits, their float32 copy turned into the
softmax and kept for backward, and a float32 gradient of the same size); flce_dist's chunk budget
(``flce_dist.settings``), ``O(N)`` float32 statistics, and with the fused strategy the gradients dW
``[V/P, H]`` and dX ``[N, H]`` held from the forward to the backward of the micro-batch. Megatron's
pipeline schedules (1F1B, interleaved) run the last stage's forward and backward of a micro-batch
back to back, so the head's rank holds one such pair at a time.

Multi-token prediction (``config.mtp_num_layers``): on the ``output_processor`` route Megatron's
``process_mtp_loss`` runs before the processor, through the output layer and its own cross entropy
(each depth's logits are formed, its loss, scaling and acceptance counts are Megatron's); the main
head is flce_dist's. On the swap route it is refused at ``install`` on every chunk, pipeline stages
without the output layer included (its depths would meet the swapped output layer).

Refused (``ValueError`` naming the Megatron setting or layer), at ``install`` and at every call:
the MXFP8 output layer (``config.fp8_output_proj``: Transformer Engine's
``TELMHeadColumnParallelLinear``), generalized tensor parallelism's split output weight
(``gtp_remat`` groups: ``output_layer.gtp_remat_size > 1``), deferred embedding wgrad
(``config.defer_embedding_wgrad_compute``), ``output_layer.disable_grad_reduce``, an output weight
whose rows are not ``output_layer.output_size / P``, a forward hook or an unknown forward on the
output layer (above); at ``install``, on every chunk: the swap route with ``config.mtp_num_layers``
or ``config.overlap_moe_expert_parallel_comm``.

How :func:`install` attaches (no edit of Megatron's code, no global state):

- ``GPTModel`` whose ``forward`` takes ``output_processor`` (megatron-core >= 0.18): a forward
  pre-hook (``register_forward_pre_hook(with_kwargs=True)``) adds ``output_processor=`` to calls that
  pass ``labels`` (and no processor of their own); Megatron then hands the processor the final
  hidden states, the output layer, the (tied) weight, labels and loss mask. Megatron's combined 1F1B
  schedule (``overlap_moe_expert_parallel_comm``) builds the chunk through
  ``model.build_schedule_plan`` instead of ``forward``: an instance attribute of that name adds the
  processor the same way (Megatron's ``PostProcessNode`` then calls it).
- ``HybridModel`` (no such hook in 0.19) and older ``GPTModel``: the same pre-hook records the call's
  ``labels`` / ``loss_mask``; for calls with labels the output layer's ``forward`` (an instance
  attribute) keeps the hidden states and the weight and returns an empty placeholder instead of
  logits, and the model's ``compute_language_model_loss`` (an instance attribute) returns the fused
  loss for that placeholder. A forward hook clears the call's state (also on an exception). Calls
  without labels run what was there before (the class's methods, or instance attributes set before
  ``install``).

``handle.remove()`` removes the hooks and puts back exactly what was in the instances' ``__dict__``
before (an instance attribute set by someone else before ``install`` is restored, not deleted). The
call runs eagerly (a graph break under a compiled caller).
"""

from __future__ import annotations

import inspect
import math
import numbers
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..aligned import aligned
from ..api import _autocast_cast, _autocast_device, _check_loss_weights, _check_shapes, _check_target_range, _resolve
from ..api import fused_linear_cross_entropy as _flce
from ..api import logprobs_and_entropy as _logprobs_and_entropy
from ..autograd import FLCEFunction, refuse_double_backward
from ..core import scale_precomputed, weight_ratio, weighted_verdict
from ..distributed import resolve_shard
from ..options import FLCEParams, LossOptions
from ..settings import Settings, current

__all__ = ["OutputProcessor", "output_processor", "install", "Installed"]

# ---------------------------------------------------------------- what cannot be honoured


def _refuse_config(config: Any) -> None:
    """Raise ``ValueError`` naming a model-wide Megatron setting the fused head cannot honour (checked on
    every chunk, pipeline stages without the output layer included)."""
    recipe = getattr(config, "fp8_recipe", None)
    recipe = str(getattr(recipe, "value", recipe)).lower()
    if getattr(config, "fp8_output_proj", False) and getattr(config, "fp8", None) and "mxfp8" in recipe:
        raise ValueError(
            "flce_dist's Megatron head does not support the MXFP8 output layer (config.fp8_output_proj "
            "with fp8_recipe='mxfp8': Transformer Engine's TELMHeadColumnParallelLinear)"
        )
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError(
            "flce_dist's Megatron head does not support config.defer_embedding_wgrad_compute (Megatron "
            "defers the output layer's weight gradient to the pipeline flush; flce_dist forms it in the "
            "loss's backward)"
        )


def _refuse(config: Any, output_layer: nn.Module) -> None:
    """Raise ``ValueError`` naming the Megatron setting the fused head cannot honour."""
    _refuse_config(config)
    if type(output_layer).__name__ == "TELMHeadColumnParallelLinear":
        raise ValueError(
            "flce_dist's Megatron head does not support the MXFP8 output layer (config.fp8_output_proj "
            "with fp8_recipe='mxfp8': Transformer Engine's TELMHeadColumnParallelLinear)"
        )
    if getattr(output_layer, "gtp_remat_size", 1) > 1:
        raise ValueError(
            f"flce_dist's Megatron head does not support a split output weight (generalized tensor "
            f"parallelism, output_layer.gtp_remat_size={output_layer.gtp_remat_size}: the weight is "
            f"rematerialized from gtp_remat shards inside Megatron's linear)"
        )
    if getattr(output_layer, "disable_grad_reduce", False):
        raise ValueError(
            "flce_dist's Megatron head does not support output_layer.disable_grad_reduce (flce_dist "
            "reduces the hidden-state gradient over the tensor-parallel group itself)"
        )


def _refuse_swap(config: Any, model: nn.Module) -> None:
    """What the output-layer swap cannot cover (checked on every chunk at ``install``)."""
    name = type(model).__name__
    if getattr(config, "mtp_num_layers", None):
        raise ValueError(
            f"flce_dist's output-layer swap ({name}: no output_processor hook) does not support "
            f"multi-token prediction (config.mtp_num_layers={config.mtp_num_layers}): Megatron's "
            f"process_mtp_loss calls the output layer and its cross entropy for every depth; use a "
            f"GPTModel with the output_processor hook (megatron-core >= 0.18)"
        )
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        raise ValueError(
            f"flce_dist's output-layer swap ({name}: no output_processor hook) does not support "
            f"config.overlap_moe_expert_parallel_comm (the combined 1F1B schedule builds the chunk with "
            f"build_schedule_plan, whose post-process node never meets the swap's forward hooks)"
        )


# ---------------------------------------------------------------- the output layer's own forward


def _layer_name(layer: nn.Module) -> str:
    cls = type(layer)
    return f"the output layer ({cls.__module__}.{cls.__qualname__})"


def _megatron_forward(layer: nn.Module) -> Callable | None:
    """The forward of the nearest Megatron-Core class in the layer's MRO (``ColumnParallelLinear.forward``)."""
    for cls in type(layer).__mro__:
        if "forward" in cls.__dict__ and cls.__module__.startswith("megatron.core"):
            return cls.__dict__["forward"]
    return None


def _instance_forward(layer: nn.Module) -> Callable | None:
    """The instance attribute ``forward`` that ``nn.Module.__call__`` runs, seen through the swap's own."""
    f = layer.__dict__.get("forward")
    return getattr(f, "_flce_prev", None) if hasattr(f, "_flce_prev") else f


def _refuse_hooks(layer: nn.Module) -> None:
    if layer._forward_hooks:
        raise ValueError(
            f"{_layer_name(layer)} has forward hook(s) {list(layer._forward_hooks.values())}: they see "
            f"(and may change) the logits, which flce_dist's head never forms; remove them, or leave "
            f"this model's cross entropy to Megatron"
        )


_AUDITS: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def _head_softcap(layer: nn.Module, config: Any, weight: torch.Tensor | None) -> float | None:
    """The softcap the output layer's forward applies (None: none), after refusing what flce_dist cannot
    honour (see the module docstring). A forward other than Megatron's is probed once per (layer, forward,
    ``config.final_logit_softcapping``): on every rank of the tensor-parallel group at the same call."""
    _refuse_hooks(layer)
    base, inst, cls_fwd = _megatron_forward(layer), _instance_forward(layer), type(layer).forward
    if inst is None and cls_fwd is base:
        return None
    cap = getattr(config, "final_logit_softcapping", None)
    cap = float(cap) if isinstance(cap, numbers.Real) and not isinstance(cap, bool) and float(cap) > 0 else None
    key = (cls_fwd, inst, cap)
    seen = _AUDITS.get(layer)
    if seen is not None and seen[0] == key:
        return seen[1]
    verdict = _probe(layer, weight, base, inst if inst is not None else cls_fwd.__get__(layer), cap)
    _AUDITS[layer] = (key, verdict)
    return verdict


def _probe(
    layer: nn.Module, weight: torch.Tensor | None, base: Callable | None, custom: Callable, cap: float | None
) -> float | None:
    where = "an instance attribute 'forward'" if "forward" in layer.__dict__ else f"{type(layer).__qualname__}.forward"
    if base is None:
        raise ValueError(
            f"{_layer_name(layer)} is not a Megatron-Core linear (no megatron.core class in its MRO "
            f"defines forward): flce_dist cannot tell what its forward computes"
        )
    w = cast("torch.Tensor | None", layer.weight) if weight is None else weight
    if w is None:
        raise ValueError(f"{_layer_name(layer)} has no weight and none was passed")
    x = torch.randn(1, 1, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)

    def run(x):
        kw = {"weight": weight, "runtime_gather_output": False}
        return base(layer, x, **kw)[0].float(), custom(x, **kw)[0].float()

    with torch.no_grad():
        zb, zc = run(x)
        if cap is not None and zb.numel():  # logits up to ~3c: tanh is far from the identity there
            m = float(zb.abs().max())
            if m > 0:
                zb, zc = run(x * (3.0 * cap / m))
    if zb.shape != zc.shape:
        raise ValueError(
            f"{_layer_name(layer)}: {where} returns logits of shape {tuple(zc.shape)} where Megatron's "
            f"forward returns {tuple(zb.shape)}: flce_dist cannot honour it"
        )
    tol = 16 * torch.finfo(w.dtype).eps * max(1.0, float(zb.abs().max()) if zb.numel() else 1.0)
    if cap is not None and bool(((zc - cap * torch.tanh(zb / cap)).abs() <= tol).all()):
        return cap
    if bool(((zc - zb).abs() <= tol).all()):
        return None
    known = (
        f"c * tanh(z / c) with config.final_logit_softcapping = {cap}"
        if cap is not None
        else "softcapping needs config.final_logit_softcapping"
    )
    raise ValueError(
        f"{_layer_name(layer)} overrides Megatron's forward ({where}) and changes the logits in a way "
        f"flce_dist cannot honour (neither unchanged logits nor {known}); remove the override, or "
        f"leave this model's cross entropy to Megatron"
    )


def _run_pre_hooks(
    layer: nn.Module, hidden: torch.Tensor, weight: torch.Tensor | None, runtime_gather_output: bool | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output layer's forward pre-hooks (global, then the layer's), as ``nn.Module.__call__`` runs them
    on ``layer(hidden, weight=weight, runtime_gather_output=...)``: their returned inputs are used."""
    from torch.nn.modules import module as nn_module

    args, kwargs = (hidden,), {"weight": weight, "runtime_gather_output": runtime_gather_output}
    hooks = (*nn_module._global_forward_pre_hooks.items(), *layer._forward_pre_hooks.items())
    for hook_id, hook in hooks:
        if hook_id in layer._forward_pre_hooks_with_kwargs:
            out = hook(layer, args, kwargs)
            if out is not None:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise RuntimeError(
                        f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), but got {out}."
                    )
                args, kwargs = out
        else:
            out = hook(layer, args)
            if out is not None:
                args = out if isinstance(out, tuple) else (out,)
    return args[0], cast("torch.Tensor | None", kwargs.get("weight", weight))


# ---------------------------------------------------------------- the sync-free weighted path


class _DeviceChecked(FLCEFunction):
    """``FLCEFunction`` whose fused-strategy backward for per-token losses with loss weights w keeps the
    check ``g == c * w`` and the scale ``c`` on the device (:func:`_scale_on_device`): no host sync. Other
    backwards (a second one through the graph, the recompute strategy) are ``FLCEFunction``'s."""

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, grad_correct, grad_ent):
        if ctx.pre is None or ctx.tw is None or grad_loss is None or ctx.p.reduction != "none":
            return FLCEFunction.backward(ctx, grad_loss, grad_lse, grad_correct, grad_ent)
        refuse_double_backward()
        need = ctx.needs_input_grad
        valid = ctx.saved_tensors[5]
        dx, dw, db = ctx.pre
        ctx.pre = None
        pre = (dx if need[0] else None, dw if need[1] else None, db if need[2] else None)
        return (
            *_scale_on_device(pre, grad_loss, ctx.tw, valid, ctx.p, ctx.group, ctx.w_dtype),
            None,
            None,
            None,
            None,
            None,
        )


_device_checked = torch._disable_dynamo(lambda *args: _DeviceChecked.apply(*args))

_FORM = (
    "the gradient arriving at the per-token loss is not c * loss_mask for one c on every rank (Megatron's "
    "loss_func, sum(loss * loss_mask) * c, gives that form): pass grad_check='host' (install / OutputProcessor) "
    "for a loss function of another form (one host sync per backward; exact)"
)


def _raise_on_cpu(good: torch.Tensor) -> None:
    """CPU tensors only (the host read costs nothing there): ``ValueError`` where the check failed."""
    if not bool(good):
        raise ValueError(_FORM)


def _scale_on_device(
    pre: tuple,
    grad_loss: torch.Tensor,
    tw: torch.Tensor,
    valid: torch.Tensor,
    p: FLCEParams,
    group: dist.ProcessGroup | None,
    w_dtype: torch.dtype,
) -> tuple:
    """``core.scale_weighted``'s scaling, decided on the device: ``c`` (least squares over this rank's
    rows, float64) and the form check (to 64 ulps of float32 per token, every rank's ``c`` within the
    same bound of the first rank with weight) are combined by one all-gather of 3 float64 per rank (none
    on one rank); dW and db are scaled by ``c``, each dX row by ``g_n / w_n``. Where the check fails every
    rank's gradients are NaN (CPU tensors: ``ValueError``, a host read that costs nothing there)."""
    dx, dw, db = pre
    g, tw, good, c_ref = weighted_verdict(grad_loss, tw, valid, p, group)
    if g.device.type == "cpu":
        _raise_on_cpu(good)
    poison = torch.where(good, 0.0, math.nan).to(torch.float32)  # 0, or NaN into every gradient
    if dx is not None:  # dX row by row: exactly g_n / w_n times the w_n-weighted row
        dx.mul_((weight_ratio(g, tw).float() + poison)[:, None])
    _, dw, db = scale_precomputed(None, dw, db, c_ref.float() + poison, w_dtype, settings=p.settings)
    return dx, dw, db


def _weighted_losses(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    start: int,
    vocab: int,
    weights: torch.Tensor,
    options: LossOptions,
    settings: Settings | None,
) -> torch.Tensor | None:
    """Per-token losses [N_in] of ``fused_linear_cross_entropy(..., reduction="none", loss_weights=weights)``
    through :class:`_DeviceChecked` (the API's plain-tensor eager dispatch: the same checks, the same
    once-per-layout shard check, autocast's rule for linear); None where no gradient is formed (then the
    API's own call takes the statistics-only path)."""
    need_dx = x.requires_grad
    need_dw = weight.requires_grad or (bias is not None and bias.requires_grad)
    if not torch.is_grad_enabled() or not (need_dx or need_dw):
        return None
    autocast = _autocast_device(x)
    if autocast is not None:  # autocast's rule for linear, as the API applies it (then float32 inside)
        x, weight = _autocast_cast(x, autocast), _autocast_cast(weight, autocast)
        bias = None if bias is None else _autocast_cast(bias, autocast)
        with torch.autocast(x.device.type, enabled=False):
            return _weighted_losses(x, weight, target, bias, group, start, vocab, weights, options, settings)
    settings = current() if settings is None else settings
    _check_shapes(x, weight, target, bias)
    lw = _check_loss_weights(weights, target, x, None)
    n, h = x.shape
    if group is None:
        (start, vocab, stale), tp = resolve_shard(None, weight, start, x.device, vocab_size=vocab), 1
    else:
        fields = (
            h,
            str(x.dtype),
            bias is not None,
            need_dx,
            need_dw,
            False,
            options.signature(),
            settings.astuple(),
            True,
        )
        start, vocab, _, tp, stale = _resolve(group, weight, start, x.device, n, fields, vocab)
    t = target.to(torch.int64)
    if t.device.type == "cpu" and t.numel() and tp == 1:
        _check_target_range(t, vocab, options.ignore_index)
    p = FLCEParams(
        start, vocab, options.replace(sequence_parallel=options.sequence_parallel and tp > 1), settings, stale
    )
    # as the API's eager call: contiguous, and on CUDA 16-byte aligned (Megatron's flat parameter buffers make views
    # at odd offsets: a copy, aligned.py)
    return _device_checked(aligned(x), aligned(weight), aligned(bias), aligned(t), None, p, group, lw)[0]


# ---------------------------------------------------------------- the processor

_OUTPUTS = ("loss", "logprobs")
_CHECKS = ("device", "host")


@dataclass(frozen=True)
class OutputProcessor:
    """Megatron's ``output_processor`` hook (``GPTModel.forward(output_processor=...)``, megatron-core
    >= 0.18): with ``labels``, flce_dist's per-token outputs ``[b, s]`` float32 (see the module
    docstring); without, Megatron's own logits (``output_layer`` + MuP scaling, ``[b, s, V/P]``).

    ``output="loss"`` (default): the per-token cross entropy, Megatron's ``compute_language_model_loss``.
    ``output="logprobs"`` (RL: verl's mcore engine, NeMo-RL-style policies): the log-probability of each
    label under ``softmax(logits / temperature)`` and, with ``entropy=True`` (default), the entropy of that
    distribution, both differentiable, returned as ``(logprobs, entropy)`` (``entropy=False``: the
    log-probabilities alone); ``loss_mask`` 0 gives 0 and no gradient. Any objective of them (PPO's
    clipped ratio, an advantage-weighted sum, an entropy bonus) costs one matmul forward and one pass of
    3 matmuls backward (the recompute strategy, no host sync; no second forward, no fused forward thrown
    away); the logits here are the model's (softcapped, MuP-scaled) divided by ``temperature``.

    ``true_vocab_size``: None (default, Megatron's numbers: every padded row takes part in the
    softmax) or the tokenizer's vocabulary size (rows at or beyond it are excluded). ``strategy``:
    flce_dist's (``"auto"``: fused with a loss mask, else recompute; the loss only). ``settings``: a
    ``flce_dist.Settings`` (chunk budget, ...). ``ignore_index``: labels equal to it give loss 0.
    ``grad_check``: ``"device"`` (default, sync-free) or ``"host"`` (see the module docstring)."""

    true_vocab_size: int | None = None
    strategy: str = "auto"
    settings: Settings | None = None
    ignore_index: int = -100
    grad_check: str = "device"
    output: str = "loss"
    temperature: float = 1.0
    entropy: bool = True

    def __post_init__(self) -> None:
        v = self.true_vocab_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ValueError(f"true_vocab_size must be a positive int or None, got {v!r}")
        LossOptions(strategy=self.strategy, temperature=self.temperature)  # the loss's own checks (naming them)
        if self.settings is not None and not isinstance(self.settings, Settings):
            raise TypeError(f"settings must be a flce_dist.Settings or None, got {type(self.settings).__name__}")
        if self.grad_check not in _CHECKS:
            raise ValueError(f"grad_check must be one of {_CHECKS}, got {self.grad_check!r}")
        if self.output not in _OUTPUTS:
            raise ValueError(f"output must be one of {_OUTPUTS}, got {self.output!r}")
        if self.output == "loss" and self.temperature != 1.0:
            raise ValueError(
                f"temperature={self.temperature} goes with output='logprobs' (the loss is Megatron's "
                f"cross entropy of its logits)"
            )
        if not isinstance(self.entropy, bool):
            raise TypeError(f"entropy must be a bool, got {self.entropy!r}")

    def __call__(
        self,
        *,
        hidden_states: torch.Tensor,
        output_layer: nn.Module,
        output_weight: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        config: Any = None,
        runtime_gather_output: bool | None = None,
        scale_logits: Callable | None = None,
        inference_context: Any = None,
        **_unused: Any,
    ):
        config = output_layer.config if config is None else config
        _refuse(config, output_layer)
        if labels is None:  # Megatron's own logits path (what GPTModel._postprocess does without labels)
            if inference_context is not None:
                raise ValueError(
                    "flce_dist's output_processor computes training/evaluation losses; leave "
                    "output_processor unset for inference (inference_context given, labels None)"
                )
            logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
            if scale_logits is not None:
                logits = scale_logits(logits)
            return logits.transpose(0, 1).contiguous()
        _refuse_hooks(output_layer)
        hidden_states, output_weight = _run_pre_hooks(output_layer, hidden_states, output_weight, runtime_gather_output)
        return self.loss(hidden_states, output_layer, output_weight, labels, loss_mask, config)

    def loss(
        self,
        hidden: torch.Tensor,
        output_layer: nn.Module,
        output_weight: torch.Tensor | None,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        config: Any,
    ):
        """The per-token outputs ``[b, s]`` float32 of ``hidden`` ``[s, b, h]`` (``[s/P, b, h]`` under
        sequence parallelism) through ``output_layer`` (see the module docstring): the loss, or
        ``(logprobs, entropy)`` / ``logprobs`` with ``output="logprobs"``. ``hidden`` is what the layer's
        forward would receive (after its pre-hooks)."""
        _refuse(config, output_layer)
        softcap = _head_softcap(output_layer, config, output_weight)
        weight = cast("torch.Tensor | None", output_layer.weight) if output_weight is None else output_weight
        if weight is None:
            raise ValueError(
                "the output layer has no weight (skip_weight_param_allocation) and Megatron passed no output_weight"
            )
        group = getattr(output_layer, "tp_group", None)
        if group is None:  # releases before the layers kept their group: Megatron's global tensor-parallel group
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = weight.shape[0]
        padded = rows * tp
        expect = getattr(output_layer, "output_size", padded)
        if padded != expect:
            raise ValueError(
                f"the output weight has {rows} rows on each of {tp} tensor-parallel ranks ({padded} in "
                f"all) but output_layer.output_size is {expect}: a split weight, not supported"
            )
        if hidden.dim() != 3 or hidden.shape[-1] != weight.shape[1]:
            raise ValueError(f"hidden_states must be [s, b, h] with h = {weight.shape[1]}, got {tuple(hidden.shape)}")
        sp = bool(getattr(output_layer, "sequence_parallel", False)) and tp > 1
        s_local, b, h = hidden.shape
        s = s_local * tp if sp else s_local
        if tuple(labels.shape) != (b, s):
            raise ValueError(
                f"labels must be [b, s] = [{b}, {s}] for hidden states {tuple(hidden.shape)}"
                f"{' (sequence parallel)' if sp else ''}, got {tuple(labels.shape)}"
            )
        sl = slice(rank * s_local, (rank + 1) * s_local) if sp else slice(None)
        target = labels.transpose(0, 1)[sl].reshape(-1)  # [s, b] token order, this rank's slice under SP
        weights = None
        if loss_mask is not None:
            if tuple(loss_mask.shape) != (b, s):
                raise ValueError(f"loss_mask must be [b, s] = [{b}, {s}] like labels, got {tuple(loss_mask.shape)}")
            weights = loss_mask.detach().transpose(0, 1)[sl].reshape(-1).float()
            # masked tokens are ignored whatever their label (on the device: no host sync)
            target = torch.where(weights != 0, target, torch.full_like(target, self.ignore_index))
        bias = getattr(output_layer, "bias", None)
        if bias is not None and getattr(output_layer, "skip_bias_add", False):
            bias = None  # returned to the caller, never added (GPTModel discards it)
        start, vocab = rank * rows, padded
        if self.true_vocab_size is not None:
            if self.true_vocab_size > padded:
                raise ValueError(
                    f"true_vocab_size={self.true_vocab_size} exceeds the model's padded vocabulary ({padded})"
                )
            keep = min(max(self.true_vocab_size - start, 0), rows)
            if keep < rows:
                weight = weight[:keep]
                bias = None if bias is None else bias[:keep]
            start, vocab = min(start, self.true_vocab_size), self.true_vocab_size  # an empty shard sits at V
        temperature = self.temperature
        mult = getattr(config, "mup_output_mult", 1.0)
        if getattr(config, "use_mup", False) and mult != 1.0:
            temperature = temperature / mult
        x = hidden.reshape(s_local * b, h)
        kw: dict[str, Any] = dict(
            bias=bias,
            group=group if tp > 1 else None,
            vocab_start=start,
            vocab_size=vocab,
            sequence_parallel=sp,
            softcap=softcap,
            ignore_index=self.ignore_index,
            settings=self.settings,
        )
        if self.output == "logprobs":
            if self.entropy:
                out = torch.stack(_logprobs_and_entropy(x, weight, target, temperature=temperature, **kw), -1)
            else:
                out = -_flce(x, weight, target, reduction="none", temperature=temperature, **kw)[:, None]
            out = out.view(s_local, b, -1)
        else:
            loss = None
            if weights is not None and self.strategy != "recompute" and self.grad_check == "device":
                options = LossOptions(
                    ignore_index=self.ignore_index,
                    reduction="none",
                    softcap=softcap,
                    temperature=temperature,
                    sequence_parallel=sp,
                    strategy=self.strategy,
                )
                loss = _weighted_losses(
                    x, weight, target, bias, kw["group"], start, vocab, weights, options, self.settings
                )
            if loss is None:
                fused = weights is not None and self.strategy != "recompute"
                loss = _flce(
                    x,
                    weight,
                    target,
                    reduction="none",
                    temperature=temperature,
                    strategy=self.strategy,
                    loss_weights=weights if fused else None,
                    **kw,
                )
            out = loss.view(s_local, b, 1)
        if sp:  # every rank returns all s tokens; each rank's backward takes its slice's gradient
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False, group=group)
        out = out.transpose(0, 1)  # [b, s, k]
        if out.shape[-1] == 2:
            return out[..., 0].contiguous(), out[..., 1].contiguous()
        return out[..., 0].contiguous()


output_processor = OutputProcessor()
"""The default processor: Megatron's numbers (padded rows in the softmax), ``strategy="auto"``."""


# ---------------------------------------------------------------- install


def _language_modules(model: Any) -> list[Any]:  # Megatron's modules (megatron is untyped)
    """The ``LanguageModule`` chunks of ``model`` (a list of chunks for virtual pipelining, each
    possibly wrapped by Megatron's DDP / Float16Module / torch DDP through ``.module``)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out = []
    for m in chunks:
        inner = m
        while not isinstance(inner, LanguageModule) and isinstance(getattr(inner, "module", None), nn.Module):
            inner = inner.module
        if not isinstance(inner, LanguageModule):
            raise TypeError(
                f"install() takes a Megatron-Core GPTModel / HybridModel (or a wrapper or list of them), "
                f"got {type(m).__name__}"
            )
        out.append(inner)
    return out


def _has_hook(m: nn.Module, method: str = "forward") -> bool:
    fn = getattr(type(m), method, None)
    return fn is not None and "output_processor" in inspect.signature(fn).parameters


def _call_args(sig: inspect.Signature, m: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (``labels`` and ``loss_mask`` may come positionally)."""
    try:
        return sig.bind_partial(m, *args, **kwargs).arguments
    except TypeError:  # a call the model itself will refuse
        return kwargs


@dataclass
class _SwapState:
    pending: tuple | None = None  # (loss_mask,) of a call with labels, between the pre- and post-hook
    stash: tuple | None = None  # (hidden, weight) kept by the output layer for compute_language_model_loss


class Installed:
    """What :func:`install` attached; ``remove()`` (or leaving a ``with`` block) detaches it."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self.routes: list[str] = []  # per chunk with an output layer: "hook" or "swap"

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> Installed:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


_MARK = "_flce_dist_installed"


def _set_attr(obj: nn.Module, name: str, value: Any, handle: Installed) -> None:
    """``obj.name = value`` as an instance attribute; ``remove()`` puts back exactly what was in
    ``obj.__dict__`` (the entry, or its absence)."""
    had, prev = name in obj.__dict__, obj.__dict__.get(name)
    obj.__dict__[name] = value

    def undo() -> None:
        if had:
            obj.__dict__[name] = prev
        else:
            obj.__dict__.pop(name, None)

    handle._undo.append(undo)


def _route(m: nn.Module, method: str) -> str:
    return "hook" if method == "hook" or (method == "auto" and _has_hook(m)) else "swap"


def install(
    model: Any,
    *,
    true_vocab_size: int | None = None,
    strategy: str = "auto",
    settings: Settings | None = None,
    ignore_index: int = -100,
    method: str = "auto",
    grad_check: str = "device",
    output: str = "loss",
    temperature: float = 1.0,
    entropy: bool = True,
) -> Installed:
    """Route ``model(..., labels=..., loss_mask=...)`` through flce_dist (see the module docstring).

    ``model``: a ``GPTModel`` / ``HybridModel``, a wrapper of one (Megatron's DDP, Float16Module),
    or a list of model chunks; chunks without an output layer (``post_process=False``) get no hooks
    but are checked like the others. ``method``: ``"auto"`` (the ``output_processor`` hook where
    ``forward`` has it, else the output-layer swap), ``"hook"`` or ``"swap"``. The other keywords are
    :class:`OutputProcessor`'s. Raises ``ValueError`` naming a Megatron setting or layer it cannot
    honour, on every chunk before anything is attached (the output layer's probe, if its forward is not
    Megatron's, runs here: every rank of its tensor-parallel group calls ``install`` together), and
    when ``install`` was already applied to a chunk. Returns an :class:`Installed` handle
    (``remove()``)."""
    if method not in ("auto", "hook", "swap"):
        raise ValueError(f"method must be 'auto', 'hook' or 'swap', got {method!r}")
    proc = OutputProcessor(
        true_vocab_size=true_vocab_size,
        strategy=strategy,
        settings=settings,
        ignore_index=ignore_index,
        grad_check=grad_check,
        output=output,
        temperature=temperature,
        entropy=entropy,
    )
    every = _language_modules(model)
    for m in every:  # every chunk, pipeline stages without the output layer included: fail before the first step
        _refuse_config(m.config)
        if method == "hook" and not _has_hook(m):
            raise ValueError(
                f"{type(m).__name__}.forward has no output_processor argument (megatron-core >= 0.18 "
                f"GPTModel): use method='swap'"
            )
        if _route(m, method) == "swap":
            _refuse_swap(m.config, m)
    chunks = [m for m in every if getattr(m, "post_process", True)]
    for m in chunks:
        if not isinstance(getattr(m, "output_layer", None), nn.Module):
            raise TypeError(f"{type(m).__name__} has no output_layer module")
        if getattr(m, _MARK, False):
            raise ValueError(f"flce_dist is already installed on this {type(m).__name__}: remove() the first handle")
        _refuse(m.config, m.output_layer)
        tied = getattr(m, "share_embeddings_and_output_weights", False)
        _head_softcap(m.output_layer, m.config, m.shared_embedding_or_output_weight() if tied else None)
    handle = Installed()
    try:
        for m in chunks:
            route = _route(m, method)
            (_install_hook if route == "hook" else _install_swap)(m, proc, handle)
            _set_attr(m, _MARK, True, handle)
            handle.routes.append(route)
    except BaseException:
        handle.remove()
        raise
    return handle


def _install_hook(m: nn.Module, proc: OutputProcessor, handle: Installed) -> None:
    sig = inspect.signature(type(m).forward)

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict):
        call = _call_args(sig, module, args, kwargs)
        if call.get("labels") is None or call.get("output_processor") is not None:
            return None  # no labels: Megatron's logits path; a caller's own processor wins
        return args, {**kwargs, "output_processor": proc}

    handle._undo.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True).remove)
    if _has_hook(m, "build_schedule_plan"):  # the combined 1F1B schedule's entry (overlap_moe_expert_parallel_comm)
        cls: Any = type(m)  # a Megatron GPTModel class (untyped)
        plan_sig = inspect.signature(cls.build_schedule_plan)
        prev = m.__dict__.get("build_schedule_plan")
        build = prev if prev is not None else cls.build_schedule_plan.__get__(m)

        def build_schedule_plan(*args: Any, **kwargs: Any):
            call = _call_args(plan_sig, m, args, kwargs)
            if call.get("labels") is not None and call.get("output_processor") is None:
                kwargs = {**kwargs, "output_processor": proc}
            return build(*args, **kwargs)

        _set_attr(m, "build_schedule_plan", build_schedule_plan, handle)


def _install_swap(m: Any, proc: OutputProcessor, handle: Installed) -> None:  # m: a Megatron GPTModel chunk
    state = _SwapState()
    layer = m.output_layer
    layer_cls, model_cls = type(layer), type(m)
    sig = inspect.signature(model_cls.forward)
    prev_forward = layer.__dict__.get("forward")
    prev_loss = m.__dict__.get("compute_language_model_loss")

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict):
        call = _call_args(sig, module, args, kwargs)
        state.stash = None
        state.pending = None if call.get("labels") is None else (call.get("loss_mask"),)
        return None

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any):
        state.pending = state.stash = None
        return None

    def layer_forward(
        input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ):
        if state.pending is None:
            if prev_forward is not None:
                return prev_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
            return layer_cls.forward(layer, input_, weight=weight, runtime_gather_output=runtime_gather_output)
        _refuse_hooks(layer)  # before its forward hooks meet the placeholder
        state.stash = (input_, weight)  # after the layer's pre-hooks (nn.Module.__call__ ran them)
        return input_.new_empty(0), None  # the "logits" the model scales and hands to compute_language_model_loss

    layer_forward._flce_prev = prev_forward  # type: ignore[attr-defined]  # what the audit of the layer's forward looks through to

    def compute_language_model_loss(labels: torch.Tensor, logits: torch.Tensor):
        if state.stash is None or state.pending is None:
            if prev_loss is not None:
                return prev_loss(labels, logits)
            return model_cls.compute_language_model_loss(m, labels, logits)
        (hidden, weight), (loss_mask,) = state.stash, state.pending
        state.stash = None
        return proc.loss(hidden, layer, weight, labels, loss_mask, m.config)

    handle._undo.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True).remove)
    handle._undo.append(m.register_forward_hook(post_hook, with_kwargs=True, always_call=True).remove)
    _set_attr(layer, "forward", layer_forward, handle)
    _set_attr(m, "compute_language_model_loss", compute_language_model_loss, handle)
