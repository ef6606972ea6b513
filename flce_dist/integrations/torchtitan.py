"""torchtitan 0.3.0 integration: :class:`FusedLinearCrossEntropyLoss`, a drop-in for torchtitan's
``ChunkedLossWrapper`` that computes ``lm_head`` + cross entropy with
:func:`flce_dist.fused_linear_cross_entropy` (no ``[tokens, V]`` logits, no sequence chunks).

Switch a torchtitan llama3 run to it without editing torchtitan (``config/override.py``: the
override replaces the trainer's root ``loss`` config before anything is built, keeping its
``global_vocab_size``; optional JSON keyword options)::

    torchrun --nproc_per_node=8 -m torchtitan.train --module llama3 --config llama3_8b \\
        --parallelism.tensor_parallel_degree 8 \\
        --override.imports flce_dist.integrations.torchtitan.fused_linear_cross_entropy

    # with options: 'flce_dist.integrations.torchtitan.fused_linear_cross_entropy={"z_loss": 1e-4}'

Contract (the one ``ChunkedLossWrapper`` + ``CrossEntropyLoss`` has; the class subclasses
``ChunkedLossWrapper`` so that the trainer calls ``set_lm_head(model.lm_head)`` and sets
``model._skip_lm_head = True``): ``loss(pred, labels, global_valid_tokens=None, **kw) -> (loss,
metrics)`` with ``pred`` the post-norm hidden states ``[B, L, D]``, ``labels`` ``[B, L]`` already
shifted (``ignore_index`` -100 ignored), ``loss`` = this rank's summed token loss /
``global_valid_tokens`` (the summed loss when it is None), float32, and ``metrics`` = ``{}``. Extra
keyword inputs (``positions``) are ignored, as torchtitan's ``CrossEntropyLoss`` does. Unlike
``ChunkedLossWrapper`` (whose backward ignores the upstream gradient), the loss is an ordinary
autograd output: ``(c * loss).backward()`` scales every gradient by ``c``, and the lm_head backward
runs inside the trainer's ``loss.backward()`` (as in the unchunked path), not inside the call.

The lm_head layouts torchtitan produces (resolved at every call):

- no tensor parallelism: a plain ``[V, H]`` weight; one rank's math, no collective.
- ``spmd_types`` backend (the default) with ``tp > 1``: the weight is this rank's plain
  ``[V_r, H]`` rows of torchtitan's ceil split (``_LossParallelCrossEntropy``'s: ranks hold
  ``ceil(V/P)`` rows, the last ones fewer), so ``Config.global_vocab_size`` is required (the
  override copies it from ``CrossEntropyLoss.Config``); the group is the current spmd mesh's
  ``"tp"`` axis. torchtitan types the root norm's output ``R`` on tp, so it all-reduces
  (reduce-scatters under sequence parallelism) the hidden gradient the loss hands back, exactly
  as after ``ChunkedLossWrapper``: the call passes ``partial_dx=True``, so flce_dist hands back
  this rank's partial ``dz_r @ W_r`` and skips its own dX all-reduce. The hidden gradient is
  reduced once, by torchtitan.
- ``partial_dtensor`` / ``full_dtensor`` backends: where the weight is a DTensor ``Shard(0)``
  (DTensor's ``torch.chunk`` split = the same ceil split), it gives the group and every rank's
  vocab start, and ``pred``'s gradient comes back as a DTensor with ``pred``'s own placements
  (``Replicate`` on tp: reduced by flce_dist, so torchtitan does not reduce it again).
- FSDP2 (torchtitan always wraps ``[norm, lm_head]`` in one ``fully_shard`` unit): the lm_head
  module is CALLED (its forward temporarily replaced by the fused loss), so fully_shard's hooks
  fire as for ``lm_head(h)``: the pre-forward all-gather (unshard, a no-op when the unit was not
  resharded after the model's forward), the post-backward reduce-scatter of the weight gradient.
  torchtitan's own forward wrapper of the module (the spmd/DTensor redistributions of its input
  and output) is bypassed: the layouts above are handled here.

Collectives per call (N = B*L tokens of this rank, H hidden, P tp ranks): forward one all-gather of
``[N, 4]`` float32 statistics over tp (16*P*N bytes), plus, once per stated layout (not per token
count), a small shard-size and call-signature check; backward none of flce_dist's own under ``spmd_types`` (torchtitan's one
all-reduce / reduce-scatter of the ``[N, H]`` hidden gradient, which it runs after
``ChunkedLossWrapper`` too); with DTensor weights one all-reduce of dX by flce_dist. torchtitan's
``_LossParallelCrossEntropy`` runs 3 all-reduces of ``[N/num_chunks]`` per chunk (3*num_chunks
calls, 12*N bytes) and the same torchtitan dX reduction. FSDP's all-gather / reduce-scatter of the
weight are FSDP's, one each, as for ``lm_head(h)``.

Memory: no ``[N, V_r]`` logits (ChunkedLossWrapper holds ``[N / num_chunks, V_r]`` float32 logits,
their log-softmax and their gradient per chunk); flce_dist's chunk budget (``flce_dist.settings``),
``O(N)`` float32 statistics, dW ``[V_r, H]`` and dX ``[N, H]``.

Not supported (raise): ``Config`` options of flce_dist beyond ``ignore_index``, ``label_smoothing``,
``z_loss``, ``softcap`` (use ``flce_dist.fused_linear_cross_entropy`` directly); a hidden-state
layout sharded on tp other than through DTensors. ``compile_config`` is accepted and not applied:
the call always runs eagerly (a graph break under a compiled caller; torchtitan compiles the
model's blocks, not the lm_head or the chunked loss).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, cast

import spmd_types as spmd
import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.loss import IGNORE_INDEX, BaseLoss, ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.config import CompileConfig, override
from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
from torchtitan.distributed.utils import get_spmd_backend

from ..api import fused_linear_cross_entropy as _flce
from ..distributed.dtensor import chunk_span, is_dtensor

__all__ = ["FusedLinearCrossEntropyLoss", "fused_linear_cross_entropy"]

_MISSING = object()
_OPTIONS = ("ignore_index", "label_smoothing", "z_loss", "softcap")


class FusedLinearCrossEntropyLoss(ChunkedLossWrapper):
    """torchtitan loss: fused, vocab-parallel ``lm_head`` + cross entropy (see the module docstring).

    ``Config`` fields: ``global_vocab_size`` (the full V; required under ``spmd_types`` tensor
    parallelism, checked against the shards otherwise), ``ignore_index`` (-100), ``label_smoothing``,
    ``z_loss``, ``softcap`` (flce_dist's meanings; the defaults are torchtitan's plain CE).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        global_vocab_size: int | None = None
        """Full vocabulary size: locates this rank's rows under spmd_types loss parallelism."""

        ignore_index: int = IGNORE_INDEX
        """Label value that contributes no loss (torchtitan's IGNORE_INDEX)."""

        label_smoothing: float = 0.0
        """flce_dist label smoothing (exact under TP)."""

        z_loss: float = 0.0
        """Coefficient of ``lse**2`` added per token."""

        softcap: float | None = None
        """``c * tanh(z / c)`` applied to every logit, or None."""

    config: Config
    global_vocab_size: int | None

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        # ChunkedLossWrapper.__init__ is not called: there is no inner loss and no chunking.
        v = config.global_vocab_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ValueError(
                f"FusedLinearCrossEntropyLoss.Config.global_vocab_size must be a positive int or None, got {v!r}"
            )
        if isinstance(config.ignore_index, bool) or not isinstance(config.ignore_index, numbers.Integral):
            raise TypeError(
                f"FusedLinearCrossEntropyLoss.Config.ignore_index must be an int, got {config.ignore_index!r}"
            )
        self.config = config
        self.global_vocab_size = v
        self.num_chunks = 1
        self.loss_fn = None
        self.lm_head: nn.Module | None = None
        del compile_config  # the call runs eagerly (see the module docstring)

    def set_lm_head(self, lm_head: nn.Module) -> None:
        """Set the lm_head module (torchtitan's trainer calls this). Must precede the first call."""
        if not isinstance(lm_head, nn.Module) or not isinstance(getattr(lm_head, "weight", None), torch.Tensor):
            raise TypeError(
                f"set_lm_head: lm_head must be an nn.Module with a .weight tensor [V_local, H], "
                f"got {type(lm_head).__name__}"
            )
        self.lm_head = lm_head

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **loss_inputs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(sum of this rank's token losses / global_valid_tokens, {})``; see the module docstring."""
        del loss_inputs  # e.g. positions: unused by cross entropy (as in torchtitan's CrossEntropyLoss)
        if self.lm_head is None:
            raise RuntimeError(
                "FusedLinearCrossEntropyLoss: call set_lm_head(model.lm_head) before the first call "
                "(torchtitan's trainer does this for ChunkedLossWrapper subclasses)"
            )
        if not isinstance(pred, torch.Tensor) or pred.dim() < 2:
            raise ValueError(
                f"pred must be the hidden states [B, L, D] (model run with _skip_lm_head=True), got "
                f"{type(pred).__name__ if not isinstance(pred, torch.Tensor) else tuple(pred.shape)}"
            )
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a tensor [B, L], got {type(labels).__name__}")
        if global_valid_tokens is not None and not isinstance(global_valid_tokens, (torch.Tensor, numbers.Real)):
            raise TypeError(
                f"global_valid_tokens must be a tensor, a number or None, got {type(global_valid_tokens).__name__}"
            )
        typed = get_spmd_backend() == "spmd_types" and spmd.is_type_checking()
        with spmd.no_typecheck():
            loss = _eager_call(self, pred, labels, global_valid_tokens)
        if typed:  # what ChunkedLossWrapper / CrossEntropyLoss declare for their loss
            spmd.assert_type(loss, {"dp": spmd.P, "cp": spmd.P, "tp": spmd.I})
        return loss, {}

    def _call(
        self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | numbers.Real | None
    ) -> torch.Tensor:
        lm_head = self.lm_head
        assert lm_head is not None  # __call__ checked it

        def fused_forward(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return self._loss(lm_head, hidden, target, global_valid_tokens)

        # Call the module (not its weight) so that FSDP2's hooks unshard / reduce-scatter as for
        # lm_head(h). torchtitan's parallelize() set an instance ``forward`` (its redistributions):
        # saved and put back.
        saved = lm_head.__dict__.get("forward", _MISSING)
        lm_head.__dict__["forward"] = fused_forward  # an instance attribute, as nn.Module.__setattr__ sets a function
        try:
            return lm_head(pred, labels)
        finally:
            if saved is _MISSING:
                del lm_head.__dict__["forward"]
            else:
                lm_head.__dict__["forward"] = saved

    def _loss(
        self,
        lm_head: nn.Module,
        hidden: torch.Tensor,
        target: torch.Tensor,
        global_valid_tokens: torch.Tensor | numbers.Real | None,
    ) -> torch.Tensor:
        c = self.config
        weight, bias = cast(torch.Tensor, lm_head.weight), getattr(lm_head, "bias", None)  # set_lm_head checked it
        kw: dict[str, Any] = {k: getattr(c, k) for k in _OPTIONS}
        if global_valid_tokens is None:
            kw["reduction"] = "sum"
        else:
            kw.update(reduction="mean", num_items_in_batch=global_valid_tokens)
        if is_dtensor(weight):  # partial_dtensor / full_dtensor: flce_dist reads the layout off the DTensors
            return _flce(hidden, weight, target, bias=bias, vocab_size=self.global_vocab_size, **kw)
        if is_dtensor(hidden):
            raise TypeError(
                "pred is a DTensor but lm_head.weight is a plain tensor: expected the layouts of one "
                "torchtitan spmd backend (DTensor weight with partial_dtensor/full_dtensor)"
            )
        if get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1:
            group = current_spmd_mesh().get_group("tp")
            v = self.global_vocab_size
            if v is None:
                raise ValueError(
                    "FusedLinearCrossEntropyLoss.Config.global_vocab_size is required under "
                    "spmd_types tensor parallelism (lm_head.weight holds only this rank's rows)"
                )
            p, r = dist.get_world_size(group), dist.get_rank(group)
            start, rows = chunk_span(v, p, r)
            if weight.shape[0] != rows:
                raise ValueError(
                    f"lm_head.weight has {weight.shape[0]} rows on tp rank {r} of {p}, but "
                    f"global_vocab_size={v} split as torchtitan does (ceil(V/P) rows per rank) gives "
                    f"{rows}"
                )
            # torchtitan reduces the hidden gradient over tp at its norm boundary: hand back the partial
            return _flce(
                hidden, weight, target, bias=bias, group=group, vocab_start=start, vocab_size=v, partial_dx=True, **kw
            )
        return _flce(hidden, weight, target, bias=bias, vocab_size=self.global_vocab_size, **kw)


# Always eager: FSDP's hooks (the module call) are eager-only; under a compiled caller this is a graph
# break (torchtitan compiles the model's blocks, not the loss).
_eager_call = torch._disable_dynamo(FusedLinearCrossEntropyLoss._call)


@override(
    target=BaseLoss.Config,
    fqns=["loss"],
    description="flce_dist: fused vocab-parallel linear cross entropy (no logits)",
)
def fused_linear_cross_entropy(cfg: BaseLoss.Config, **options: Any) -> FusedLinearCrossEntropyLoss.Config:
    """torchtitan override (``--override.imports flce_dist.integrations.torchtitan.fused_linear_cross_entropy``):
    replaces the trainer's ``loss`` (a ``ChunkedLossWrapper`` around ``CrossEntropyLoss``, or a plain
    ``CrossEntropyLoss``) by :class:`FusedLinearCrossEntropyLoss` with the same ``global_vocab_size``.
    ``options`` (from ``'...fused_linear_cross_entropy={"z_loss": 1e-4}'``): ``ignore_index``,
    ``label_smoothing``, ``z_loss``, ``softcap``."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"fused_linear_cross_entropy override: unknown options {unknown}; accepted: {list(_OPTIONS)}")
    if isinstance(cfg, FusedLinearCrossEntropyLoss.Config):
        return dataclasses.replace(cfg, **options)
    inner = cfg.loss_fn if isinstance(cfg, ChunkedLossWrapper.Config) else cfg
    if type(inner) is not CrossEntropyLoss.Config:
        raise ValueError(
            f"flce_dist.integrations.torchtitan.fused_linear_cross_entropy replaces a cross-entropy loss "
            f"(CrossEntropyLoss, or ChunkedLossWrapper around it); the config's loss is "
            f"{type(cfg).__qualname__} around {type(inner).__qualname__}"
        )
    return FusedLinearCrossEntropyLoss.Config(global_vocab_size=inner.global_vocab_size, **options)
