"""TRL integration: ``patch()`` / ``unpatch()`` make TRL 1.16's fused LM head (GRPO's per-token
log-probabilities and entropies) run on :func:`flce_dist.logprobs_and_entropy`.

Usage (before building the trainer or at any time before ``train()``)::

    from flce_dist.integrations import trl as flce_trl
    flce_trl.patch()                       # GRPO's log_probs / entropy now come from flce_dist
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    trainer.train()
    flce_trl.unpatch()                     # back to TRL's own kernel

What TRL does (``trl/trainer/utils.py``, 1.16.0): ``GRPOTrainer`` installs ``add_fused_lm_head(model,
temperature, outputs=("log_probs", "entropy"))``; ``_get_per_token_logps_and_entropies`` calls
``model(..., labels=labels, fused_lm_head=True)``, whose forward runs the backbone and then
``_ChunkedLogProbFunction.apply(hidden [N, H], weight [V, H], bias, targets [N], temperature,
32768, final_logit_softcapping, logit_scale, outputs)``, a module global looked up at every call.
It returns five float32 per-token fields ``(log_probs, entropy, log_sum_sq_probs, mean_logits,
is_top1)`` (None where not requested), which the forward scatters back to ``[B, T]`` with 0 where
the label is -100. The logit transform is ``y = softcap(s * (hidden @ W.T + b)) / T`` with ``s`` the
config's ``logit_scale`` (or ``output_multiplier`` / ``lm_head_multiplier`` / ``1/logits_scaling``),
``softcap(z) = c * tanh(z / c)`` with ``c = final_logit_softcapping`` and ``T`` the temperature.

What ``patch()`` changes (two module globals of ``trl.trainer.utils``, so models patched by TRL
before or after ``patch()`` are both covered, in every trainer that uses ``add_fused_lm_head``):

- ``_ChunkedLogProbFunction`` -> :class:`FlceLogProbFunction`, whose ``apply`` has TRL's signature
  and calls :func:`flce_dist.logprobs_and_entropy` with ``temperature=T / s`` and ``softcap=c / s``
  (``(c/s) tanh(z / (c/s)) / (T/s) = c tanh(s z / c) / T``, TRL's transform exactly; without a
  softcap ``z / (T/s) = s z / T``). ``log_probs`` and ``entropy`` come from flce_dist, with their
  gradients (dX and dW, and dbias). ``log_sum_sq_probs``, ``mean_logits`` and ``is_top1`` are not
  statistics flce_dist keeps: a call that requests any of them runs TRL's original function (GRPO
  never requests them; DPO/SFT/KTO may). TRL's original also runs, for that call only, when
  DeepSpeed ZeRO-3 is enabled (TRL's backward re-gathers the partitioned head; flce_dist's does not),
  when ``logit_scale <= 0`` or when ``final_logit_softcapping <= 0`` (TRL reads 0.0 as 1.0).
- ``DTensor`` (used only by the forward's ``isinstance(weight, DTensor): weight = weight.full_tensor()``)
  -> a check that is False for a weight flce_dist takes as a vocab shard, so that weight reaches
  flce_dist unchanged (no ``full_tensor()``; flce_dist takes the group and ``vocab_start`` from the
  DTensor, gradients come back as DTensors with the same placements). ``dtensor`` of ``patch``:
  ``"auto"`` (default): a weight placed ``Shard(0)`` on one mesh dim and ``Replicate()`` on the
  others stays sharded unless it is an FSDP2 parameter (FSDP2 shards the head over the
  data-parallel ranks, whose tokens differ: it is gathered as TRL does); ``"shard"``: every such
  weight stays sharded (the mesh dim must be one over which the hidden states are replicated:
  tensor parallelism); ``"gather"``: TRL's ``full_tensor()`` for every DTensor. Any other layout is
  gathered as TRL does.

Collectives, per call, on the weight's shard group (none for a plain weight): forward one
``[P, N, 5]`` float32 statistics all-gather; backward one all-reduce of dX (``N * H``, hidden's
dtype). Memory: no ``[N, V]`` logits; the forward keeps per-token statistics (``O(N)``) and one
``[block_n, block_v]`` chunk at a time; the backward recomputes logits chunk by chunk. Under autocast
(TRL computes in the autocast dtype) hidden, weight and bias are cast to that dtype first, as TRL's
tiles are: one cast copy of the local ``[V_r, H]`` weight shard for the call.

``unpatch()`` puts both originals back (the same objects). ``patch()`` is idempotent (a second call
only updates ``dtensor``). Verified against trl 1.16.0.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from ..api import logprobs_and_entropy

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["FlceLogProbFunction", "chunked_logprob", "is_patched", "patch", "unpatch"]

# The fields of TRL's FusedCausalLMOutput, in its return order; flce_dist computes the first two.
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
FLCE_FIELDS = frozenset(("log_probs", "entropy"))
_DTENSOR_MODES = ("auto", "shard", "gather")

_state: dict[str, Any] = {}  # while patched: the originals and the dtensor mode


def _trl_utils():
    try:
        import trl.trainer.utils as utils
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("flce_dist.integrations.trl needs TRL (pip install trl==1.16.0)") from e
    if not hasattr(utils, "_ChunkedLogProbFunction") or not hasattr(utils, "DTensor"):
        raise RuntimeError(
            "flce_dist.integrations.trl: this TRL has no trl.trainer.utils._ChunkedLogProbFunction / "
            "DTensor (the fused LM head of TRL 1.16); installed TRL: "
            f"{getattr(__import__('trl'), '__version__', '?')}"
        )
    return utils


def _original_function():
    return _state["function"] if _state else _trl_utils()._ChunkedLogProbFunction


def _is_fsdp2_param(t: torch.Tensor) -> bool:
    """Whether ``t`` is the sharded parameter of a ``fully_shard`` (FSDP2) module."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - private torch API moved: assume no FSDP2
        return False
    for ref in list(_module_state_mapping.values()):
        state = ref()
        if not isinstance(state, FSDPState):
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        for group in groups:
            if any(p.sharded_param is t for p in group.fsdp_params):
                return True
    return False


def _vocab_shard_layout(t: DTensor) -> bool:
    """``Shard(0)`` on exactly one mesh dim, ``Replicate()`` on the others (flce_dist's weight layout)."""
    from torch.distributed.tensor import Replicate, Shard

    placements = t.placements
    shards = [p for p in placements if isinstance(p, Shard)]
    return (
        len(shards) == 1
        and shards[0].dim == 0
        and type(shards[0]) is Shard
        and all(isinstance(p, (Shard, Replicate)) for p in placements)
    )


def _keeps_shard(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    mode = _state.get("dtensor", "gather")
    if mode == "gather" or not isinstance(t, DTensor) or not _vocab_shard_layout(t):
        return False
    return mode == "shard" or not _is_fsdp2_param(t)


class _GatherCheck(type):
    def __instancecheck__(cls, obj: object) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(obj, DTensor) and not _keeps_shard(obj)

    def __subclasscheck__(cls, sub: type) -> bool:
        from torch.distributed.tensor import DTensor

        return issubclass(sub, DTensor)


class _DTensorToGather(metaclass=_GatherCheck):
    """Stands in for ``DTensor`` in ``trl.trainer.utils``: ``isinstance(w, _DTensorToGather)`` is True
    for the DTensors TRL should still ``full_tensor()``, False for a vocab shard flce_dist takes."""


def _fallback_reason(outputs, temperature, final_logit_softcapping, logit_scale) -> str | None:
    extra = [o for o in outputs if o not in FLCE_FIELDS]
    if extra:
        return f"outputs {extra} are not flce_dist statistics"
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3 (TRL's backward re-gathers the partitioned head)"
    if not logit_scale > 0:
        return f"logit_scale={logit_scale} is not > 0"
    if final_logit_softcapping is not None and not final_logit_softcapping > 0:
        return f"final_logit_softcapping={final_logit_softcapping} is not > 0"
    return None


def chunked_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int = 32768,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = FIELDS[1:],
):
    """TRL's ``_ChunkedLogProbFunction.apply`` (same arguments, same five outputs) on flce_dist.

    ``hidden [N, H]``, ``weight [V, H]`` (or a vocab-sharded DTensor), ``bias [V]`` or None,
    ``targets [N]`` int64 vocab ids (-100: log_prob and entropy 0, no gradient; TRL never passes
    them). Returns ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, float32 ``[N]``
    (``is_top1`` bool), None where ``outputs`` does not ask for it; ``log_probs`` always.
    ``chunk_size`` is TRL's vocab tile width, unused by flce_dist (its own blocks apply).
    """
    outputs = tuple(outputs)
    unknown = [o for o in outputs if o not in FIELDS]
    if unknown:
        raise ValueError(f"outputs: unknown fields {unknown}; TRL's fields are {list(FIELDS)}")
    if not isinstance(targets, torch.Tensor) or targets.dim() != 1:
        raise ValueError(
            f"targets must be a 1-D tensor [N], got "
            f"{tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__}"
        )
    if hidden.dim() != 2 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden must be [N, H] with N = len(targets) = {targets.shape[0]}, got {tuple(hidden.shape)}")
    if _fallback_reason(outputs, temperature, final_logit_softcapping, logit_scale) is not None:
        from torch.distributed.tensor import DTensor

        if isinstance(weight, DTensor):  # TRL's function takes the full head: what unpatched TRL does
            weight = weight.full_tensor()
            bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
        return _original_function().apply(
            hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
        )
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype  # TRL's compute dtype
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    softcap = None if final_logit_softcapping is None else final_logit_softcapping / logit_scale
    with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
        log_probs, entropy = logprobs_and_entropy(
            hidden, weight, targets, temperature=temperature / logit_scale, softcap=softcap, bias=bias
        )
    return log_probs, entropy if "entropy" in outputs else None, None, None, None


class FlceLogProbFunction:
    """Stands in for ``trl.trainer.utils._ChunkedLogProbFunction`` while patched: ``apply`` is
    :func:`chunked_logprob` (TRL's positional signature)."""

    apply = staticmethod(chunked_logprob)


def patch(*, dtensor: str = "auto") -> None:
    """Route TRL's fused LM head through flce_dist (see the module docstring). Idempotent.

    ``dtensor``: ``"auto"`` | ``"shard"`` | ``"gather"``: which DTensor lm_head weights stay vocab-sharded.
    """
    if dtensor not in _DTENSOR_MODES:
        raise ValueError(f"dtensor must be one of {_DTENSOR_MODES}, got {dtensor!r}")
    utils = _trl_utils()
    if not _state:
        _state.update(function=utils._ChunkedLogProbFunction, dtensor_class=utils.DTensor)
        utils._ChunkedLogProbFunction = FlceLogProbFunction
        utils.DTensor = _DTensorToGather
    _state["dtensor"] = dtensor


def unpatch() -> None:
    """Restore TRL's own ``_ChunkedLogProbFunction`` and ``DTensor`` (the objects ``patch`` replaced)."""
    if not _state:
        return
    utils = _trl_utils()
    utils._ChunkedLogProbFunction = _state["function"]
    utils.DTensor = _state["dtensor_class"]
    _state.clear()


def is_patched() -> bool:
    return bool(_state)
