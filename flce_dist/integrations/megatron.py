"""Megatron-Core integration: the language-model head + cross entropy of ``GPTModel`` and
``HybridModel`` through :func:`flce_dist.fused_linear_cross_entropy`: no ``[s, b, V/P]`` logits, no
float32 softmax kept for backward, the output layer's own tensor-parallel group.

Two entry points::

    from flce_dist.integrations import megatron as flce_megatron

    handle = flce_megatron.install(model)          # model: GPTModel / HybridModel, wrapped or a list of chunks
    loss = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)  # [b, s] float32
    logits = model(tokens, position_ids, attention_mask)   # no labels: Megatron's own logits path, unchanged
    handle.remove()                                 # back to Megatron's cross entropy

    # or, per call, Megatron-Core >= 0.18's hook (GPTModel.forward / build_schedule_plan):
    loss = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                 output_processor=flce_megatron.output_processor)

Contract (Megatron's own, ``LanguageModule.compute_language_model_loss``): the model returns the
per-token loss ``[b, s]`` float32, identical on every rank of the tensor-parallel group, for the
tokens this rank holds (context parallelism: its CP-local tokens; packed sequences: the packed
tokens); the training loop's ``loss_func`` multiplies it by ``loss_mask`` and sums. The numbers are
Megatron's: the padded vocabulary's rows take part in the softmax (Megatron never masks them), the
logits are scaled by ``config.mup_output_mult`` under MuP, ``labels`` are global ids. The one
difference: a label equal to ``ignore_index`` (-100; Megatron's datasets never produce one) gives
loss 0 and no gradient, where Megatron's kernel would return that token's logsumexp.

Honoured, read from the model at every call: the output layer's tensor-parallel group
(``output_layer.tp_group``: equal shards of the padded V, rank r holding rows ``[r V/P, (r+1) V/P)``,
passed as ``vocab_start`` / ``vocab_size``); sequence parallelism (``output_layer.sequence_parallel``:
the hidden states are ``[s/P, b, h]``, gathered inside flce_dist, dX reduce-scattered; the per-token
losses of the P slices are all-gathered, ``4 s b`` bytes, with Megatron's
``gather_from_sequence_parallel_region``, whose backward hands each rank its slice's gradient); tied
embeddings (the weight Megatron passes, the word embedding's shard); a bias without
``skip_bias_add``; ``calculate_per_token_loss`` (it only changes how the training loop scales the
summed loss: every such gradient is ``c * loss_mask``); frozen output weights. ``true_vocab_size``
(opt-in): rows at or beyond the tokenizer's vocabulary take no part in the softmax and get no
gradient (each rank passes its rows below it: the last ranks' shards shrink, possibly to none).

The 3-matmul path: Megatron's upstream gradient of the per-token loss is ``c * loss_mask`` (its
``loss_func`` sums ``loss * loss_mask``), so ``loss_mask`` is passed as ``loss_weights``: the gradient
is formed in the forward (fused strategy, 3 matmuls, not the recompute strategy's 4), and the
backward checks that the gradient really is ``c * loss_mask`` (one host sync, one all-gather of 3
numbers per rank over the tp group) and recomputes it exactly if not. Without ``loss_mask`` (a
training loop that does not pass it to the model) the recompute strategy runs.

Collectives per micro-batch over the tp group (N = s b tokens of this rank's CP slice, H hidden):
forward one all-gather of ``[N, 4]`` float32 statistics (16 P N bytes; the fused strategy: one per
token chunk, same bytes) where Megatron's ``vocab_parallel_cross_entropy`` runs 3 all-reduces
(max, target logit, sum of exponentials) and its fused "native" kernel 2; backward one all-reduce
of dX (``N H`` elements, the activation dtype), the one Megatron's ``ColumnParallelLinear`` runs,
plus the check's all-gather of 3 float64 per rank. Sequence parallelism: forward all-gathers of the
hidden states (Megatron's output layer does the same), of the targets and of the loss weights, and
the loss all-gather; backward one reduce-scatter of dX instead of the all-reduce (and the recompute
strategy re-gathers the hidden states, as Megatron's sequence-parallel linear does).

Memory: no ``[s, b, V/P]`` logits (Megatron: the bf16 logits, their float32 copy turned into the
softmax and kept for backward, and a float32 gradient of the same size); flce_dist's chunk budget
(``flce_dist.settings``), ``O(N)`` float32 statistics, and with the fused strategy the gradients dW
``[V/P, H]`` and dX ``[N, H]`` held from the forward to the backward of the micro-batch (interleaved
pipeline schedules that run several forwards first hold one per micro-batch in flight: pass
``strategy="recompute"`` there).

Refused (``ValueError`` naming the Megatron setting): multi-token prediction
(``config.mtp_num_layers``: its heads compute their own losses through the output layer), the MXFP8
output layer (``config.fp8_output_proj``: Transformer Engine's ``TELMHeadColumnParallelLinear``),
generalized tensor parallelism's split output weight (``gtp_remat`` groups:
``output_layer.gtp_remat_size > 1``), deferred embedding wgrad
(``config.defer_embedding_wgrad_compute``), ``output_layer.disable_grad_reduce``, and an output weight
whose rows are not ``output_layer.output_size / P``.

How :func:`install` attaches (no edit of Megatron's code, no global state):

- ``GPTModel`` whose ``forward`` takes ``output_processor`` (megatron-core >= 0.18): a forward
  pre-hook (``register_forward_pre_hook(with_kwargs=True)``) adds ``output_processor=`` to calls that
  pass ``labels`` (and no processor of their own); Megatron then hands the processor the final
  hidden states, the output layer, the (tied) weight, labels and loss mask.
- ``HybridModel`` (no such hook in 0.19) and older ``GPTModel``: the same pre-hook records the call's
  ``labels`` / ``loss_mask``; for calls with labels the output layer's ``forward`` (an instance
  attribute) keeps the hidden states and the weight and returns an empty placeholder instead of
  logits, and the model's ``compute_language_model_loss`` (an instance attribute) returns the fused
  loss for that placeholder. A forward hook clears the call's state (also on an exception). Calls
  without labels run the class's own methods.

``handle.remove()`` removes both hooks and instance attributes. Under Megatron's combined 1F1B
schedule (``overlap_moe_expert_parallel_comm``, ``model.build_schedule_plan``) the forward hooks do
not run: pass ``output_processor=`` to ``build_schedule_plan`` yourself. The call runs eagerly (a
graph break under a compiled caller).
"""

from __future__ import annotations

import functools
import inspect
import numbers
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
import torch.distributed as dist
from torch import nn

from ..api import fused_linear_cross_entropy as _flce
from ..options import LossOptions
from ..settings import Settings

__all__ = ["OutputProcessor", "output_processor", "install", "Installed"]

# ---------------------------------------------------------------- what cannot be honoured


def _refuse(config: Any, output_layer: nn.Module) -> None:
    """Raise ``ValueError`` naming the Megatron setting the fused head cannot honour."""
    mtp = getattr(config, "mtp_num_layers", None)
    if mtp:
        raise ValueError(f"flce_dist's Megatron head does not support multi-token prediction (config.mtp_num_layers="
                         f"{mtp}): the MTP heads compute their own losses through the output layer's logits")
    recipe = getattr(config, "fp8_recipe", None)
    recipe = str(getattr(recipe, "value", recipe)).lower()
    if type(output_layer).__name__ == "TELMHeadColumnParallelLinear" or (
            getattr(config, "fp8_output_proj", False) and getattr(config, "fp8", None) and "mxfp8" in recipe):
        raise ValueError("flce_dist's Megatron head does not support the MXFP8 output layer (config.fp8_output_proj "
                         "with fp8_recipe='mxfp8': Transformer Engine's TELMHeadColumnParallelLinear)")
    if getattr(output_layer, "gtp_remat_size", 1) > 1:
        raise ValueError(f"flce_dist's Megatron head does not support a split output weight (generalized tensor "
                         f"parallelism, output_layer.gtp_remat_size={output_layer.gtp_remat_size}: the weight is "
                         f"rematerialized from gtp_remat shards inside Megatron's linear)")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError("flce_dist's Megatron head does not support config.defer_embedding_wgrad_compute (Megatron "
                         "defers the output layer's weight gradient to the pipeline flush; flce_dist forms it in the "
                         "loss's backward)")
    if getattr(output_layer, "disable_grad_reduce", False):
        raise ValueError("flce_dist's Megatron head does not support output_layer.disable_grad_reduce (flce_dist "
                         "reduces the hidden-state gradient over the tensor-parallel group itself)")


# ---------------------------------------------------------------- the processor


@dataclass(frozen=True)
class OutputProcessor:
    """Megatron's ``output_processor`` hook (``GPTModel.forward(output_processor=...)``, megatron-core
    >= 0.18): with ``labels``, the per-token loss ``[b, s]`` float32 from flce_dist (see the module
    docstring); without, Megatron's own logits (``output_layer`` + MuP scaling, ``[b, s, V/P]``).

    ``true_vocab_size``: None (default, Megatron's numbers: every padded row takes part in the
    softmax) or the tokenizer's vocabulary size (rows at or beyond it are excluded). ``strategy``:
    flce_dist's (``"auto"``: fused with a loss mask, else recompute). ``settings``: a
    ``flce_dist.Settings`` (chunk budget, ...). ``ignore_index``: labels equal to it give loss 0."""

    true_vocab_size: int | None = None
    strategy: str = "auto"
    settings: Settings | None = None
    ignore_index: int = -100

    def __post_init__(self) -> None:
        v = self.true_vocab_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ValueError(f"true_vocab_size must be a positive int or None, got {v!r}")
        LossOptions(strategy=self.strategy)  # the loss's own check of the value (ValueError naming strategy)
        if self.settings is not None and not isinstance(self.settings, Settings):
            raise TypeError(f"settings must be a flce_dist.Settings or None, got {type(self.settings).__name__}")

    def __call__(self, *, hidden_states: torch.Tensor, output_layer: nn.Module,
                 output_weight: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                 loss_mask: torch.Tensor | None = None, config: Any = None,
                 runtime_gather_output: bool | None = None, scale_logits: Callable | None = None,
                 inference_context: Any = None, **_unused: Any) -> torch.Tensor:
        config = output_layer.config if config is None else config
        _refuse(config, output_layer)
        if labels is None:  # Megatron's own logits path (what GPTModel._postprocess does without labels)
            if inference_context is not None:
                raise ValueError("flce_dist's output_processor computes training/evaluation losses; leave "
                                 "output_processor unset for inference (inference_context given, labels None)")
            logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
            if scale_logits is not None:
                logits = scale_logits(logits)
            return logits.transpose(0, 1).contiguous()
        return self.loss(hidden_states, output_layer, output_weight, labels, loss_mask, config)

    def loss(self, hidden: torch.Tensor, output_layer: nn.Module, output_weight: torch.Tensor | None,
             labels: torch.Tensor, loss_mask: torch.Tensor | None, config: Any) -> torch.Tensor:
        """The per-token loss ``[b, s]`` float32 of ``hidden`` ``[s, b, h]`` (``[s/P, b, h]`` under
        sequence parallelism) through ``output_layer`` (see the module docstring)."""
        weight = cast("torch.Tensor | None", output_layer.weight) if output_weight is None else output_weight
        if weight is None:
            raise ValueError("the output layer has no weight (skip_weight_param_allocation) and Megatron passed no "
                             "output_weight")
        group = getattr(output_layer, "tp_group", None)
        if group is None:  # releases before the layers kept their group: Megatron's global tensor-parallel group
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = weight.shape[0]
        padded = rows * tp
        expect = getattr(output_layer, "output_size", padded)
        if padded != expect:
            raise ValueError(f"the output weight has {rows} rows on each of {tp} tensor-parallel ranks ({padded} in "
                             f"all) but output_layer.output_size is {expect}: a split weight, not supported")
        if hidden.dim() != 3 or hidden.shape[-1] != weight.shape[1]:
            raise ValueError(f"hidden_states must be [s, b, h] with h = {weight.shape[1]}, got {tuple(hidden.shape)}")
        sp = bool(getattr(output_layer, "sequence_parallel", False)) and tp > 1
        s_local, b, h = hidden.shape
        s = s_local * tp if sp else s_local
        if tuple(labels.shape) != (b, s):
            raise ValueError(f"labels must be [b, s] = [{b}, {s}] for hidden states {tuple(hidden.shape)}"
                             f"{' (sequence parallel)' if sp else ''}, got {tuple(labels.shape)}")
        sl = slice(rank * s_local, (rank + 1) * s_local) if sp else slice(None)
        target = labels.transpose(0, 1)[sl].reshape(-1)  # [s, b] token order, this rank's slice under SP
        weights = None
        if loss_mask is not None:
            if tuple(loss_mask.shape) != (b, s):
                raise ValueError(f"loss_mask must be [b, s] = [{b}, {s}] like labels, got {tuple(loss_mask.shape)}")
            weights = loss_mask.detach().transpose(0, 1)[sl].reshape(-1).float()
        bias = getattr(output_layer, "bias", None)
        if bias is not None and getattr(output_layer, "skip_bias_add", False):
            bias = None  # returned to the caller, never added (GPTModel discards it)
        start, vocab = rank * rows, padded
        if self.true_vocab_size is not None:
            if self.true_vocab_size > padded:
                raise ValueError(f"true_vocab_size={self.true_vocab_size} exceeds the model's padded vocabulary "
                                 f"({padded})")
            keep = min(max(self.true_vocab_size - start, 0), rows)
            if keep < rows:
                weight = weight[:keep]
                bias = None if bias is None else bias[:keep]
            start, vocab = min(start, self.true_vocab_size), self.true_vocab_size  # an empty shard sits at V
        temperature = 1.0
        mult = getattr(config, "mup_output_mult", 1.0)
        if getattr(config, "use_mup", False) and mult != 1.0:
            temperature = 1.0 / mult
        loss = _flce(hidden.reshape(s_local * b, h), weight, target, bias=bias,
                     group=group if tp > 1 else None, vocab_start=start, vocab_size=vocab, reduction="none",
                     loss_weights=weights, sequence_parallel=sp, temperature=temperature,
                     ignore_index=self.ignore_index, strategy=self.strategy, settings=self.settings)
        loss = loss.view(s_local, b)
        if sp:  # every rank returns all s tokens; each rank's backward takes its slice's gradient
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            loss = gather_from_sequence_parallel_region(loss, tensor_parallel_output_grad=False, group=group)
        return loss.transpose(0, 1).contiguous()


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
            raise TypeError(f"install() takes a Megatron-Core GPTModel / HybridModel (or a wrapper or list of them), "
                            f"got {type(m).__name__}")
        out.append(inner)
    return out


def _has_hook(m: nn.Module) -> bool:
    return "output_processor" in inspect.signature(type(m).forward).parameters


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

    def __enter__(self) -> "Installed":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


_MARK = "_flce_dist_installed"


def install(model: Any, *, true_vocab_size: int | None = None, strategy: str = "auto",
            settings: Settings | None = None, ignore_index: int = -100, method: str = "auto") -> Installed:
    """Route ``model(..., labels=..., loss_mask=...)`` through flce_dist (see the module docstring).

    ``model``: a ``GPTModel`` / ``HybridModel``, a wrapper of one (Megatron's DDP, Float16Module),
    or a list of model chunks; chunks without an output layer (``post_process=False``) are left
    alone. ``method``: ``"auto"`` (the ``output_processor`` hook where ``forward`` has it, else the
    output-layer swap), ``"hook"`` or ``"swap"``. Raises ``ValueError`` naming a Megatron setting it
    cannot honour, and when ``install`` was already applied to a chunk. Returns an
    :class:`Installed` handle (``remove()``)."""
    if method not in ("auto", "hook", "swap"):
        raise ValueError(f"method must be 'auto', 'hook' or 'swap', got {method!r}")
    proc = OutputProcessor(true_vocab_size=true_vocab_size, strategy=strategy, settings=settings,
                           ignore_index=ignore_index)
    chunks = [m for m in _language_modules(model) if getattr(m, "post_process", True)]
    for m in chunks:
        if not isinstance(getattr(m, "output_layer", None), nn.Module):
            raise TypeError(f"{type(m).__name__} has no output_layer module")
        if getattr(m, _MARK, False):
            raise ValueError(f"flce_dist is already installed on this {type(m).__name__}: remove() the first handle")
        _refuse(m.config, m.output_layer)
        if method == "hook" and not _has_hook(m):
            raise ValueError(f"{type(m).__name__}.forward has no output_processor argument (megatron-core >= 0.18 "
                             f"GPTModel): use method='swap'")
    handle = Installed()
    try:
        for m in chunks:
            route = "hook" if method == "hook" or (method == "auto" and _has_hook(m)) else "swap"
            (_install_hook if route == "hook" else _install_swap)(m, proc, handle)
            setattr(m, _MARK, True)
            handle._undo.append(functools.partial(delattr, m, _MARK))
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


def _install_swap(m: Any, proc: OutputProcessor, handle: Installed) -> None:  # m: a Megatron GPTModel chunk
    state = _SwapState()
    layer = m.output_layer
    layer_cls, model_cls = type(layer), type(m)
    sig = inspect.signature(model_cls.forward)

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict):
        call = _call_args(sig, module, args, kwargs)
        state.stash = None
        state.pending = None if call.get("labels") is None else (call.get("loss_mask"),)
        return None

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any):
        state.pending = state.stash = None
        return None

    def layer_forward(input_: torch.Tensor, weight: torch.Tensor | None = None,
                      runtime_gather_output: bool | None = None):
        if state.pending is None:
            return layer_cls.forward(layer, input_, weight=weight, runtime_gather_output=runtime_gather_output)
        state.stash = (input_, weight)
        return input_.new_empty(0), None  # the "logits" the model scales and hands to compute_language_model_loss

    def compute_language_model_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if state.stash is None or state.pending is None:
            return model_cls.compute_language_model_loss(m, labels, logits)
        (hidden, weight), (loss_mask,) = state.stash, state.pending
        state.stash = None
        return proc.loss(hidden, layer, weight, labels, loss_mask, m.config)

    handle._undo.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True).remove)
    handle._undo.append(m.register_forward_hook(post_hook, with_kwargs=True, always_call=True).remove)
    layer.forward = layer_forward
    handle._undo.append(lambda: layer.__dict__.pop("forward", None))
    m.compute_language_model_loss = compute_language_model_loss
    handle._undo.append(lambda: m.__dict__.pop("compute_language_model_loss", None))
