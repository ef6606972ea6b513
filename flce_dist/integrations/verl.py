"""verl integration: :func:`linear_cross_entropy`, a drop-in for verl 0.9.1's fused log-prob /
entropy kernel, and ``patch()`` / ``unpatch()`` that route verl's ``use_fused_kernels`` path to it.

Usage (verl config; every worker imports the module named by ``external_lib``, and its import patches)::

    actor_rollout_ref.model.use_fused_kernels=True \\
    actor_rollout_ref.model.fused_kernel_options.impl_backend=triton \\
    actor_rollout_ref.model.external_lib=flce_dist.integrations.verl_patch
    # or in Python: from flce_dist.integrations import verl as flce_verl; flce_verl.patch()

What verl does (0.9.1): with ``use_fused_kernels`` the FSDP engine's model forward
(``verl/models/transformers/dense_common.py`` and the VLM variants, backend ``triton``) does
``from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy`` at every call; the
Megatron engine's ``verl/models/mcore/model_forward_fused.py`` (and ``model_forward_1f1b_overlap.py``)
bind the name at import and call it with ``dist_process_group`` = Megatron's TP group, after the
sequence-parallel all-gather of the hidden states. verl's kernel is ``LinearCrossEntropy.apply``:
Triton, CUDA only, ``H % 128 == 0``, equal shards only (rank ``r`` owns global ids
``[r * V_local, (r + 1) * V_local)``), no ``ignore_index``.

The contract kept here (verl's, read from its kernel and host code):

- ``hidden [..., H]`` and ``labels`` of any shapes with ``labels.numel() == hidden.numel() / H``: both
  are flattened (``view(-1, H)``, ``view(-1)``) and the outputs are flat ``[N]``, not reshaped back.
- ``logprobs[n] = log softmax(z_n / temperature)[labels_n]`` (= -CE) and ``entropy[n]`` of that
  same tempered distribution over the global vocabulary, both float32 (whatever hidden's dtype).
- ``reduction`` (case-insensitive, as verl lowercases it): ``"none"``: logprobs ``[N]``; ``"sum"``:
  the 0-d sum of the log-probabilities; ``"mean"``: that sum / N (all N tokens). Entropy is
  always per token ``[N]``. Anything else raises ``ValueError`` naming ``reduction``.
- the layout is verl's: equal shards, rank ``r`` of ``P`` owns global ids ``[r * V_local, (r + 1) *
  V_local)`` and ``V = P * V_local``; this adapter states it to flce_dist (``vocab_start``,
  ``vocab_size``), so the once-per-layout shard check runs once, not once per token count. Shards
  of other sizes (beyond verl): pass ``vocab_size=`` (the shards then in rank order) and/or
  ``vocab_start=``; every rank must state the same layout (shards that are not equal without
  them give a ``ValueError`` on every rank at the first call).
- gradients: dW is this rank's rows' gradient; dX follows verl's TP convention: each rank's
  ``d_hidden`` is a *partial* ``dz_r @ W_r`` whose sum over the group is the gradient (verl leaves
  that sum to Megatron's sequence-parallel reduce-scatter / all-reduce): flce_dist's
  ``partial_dx=True``, no dX collective here. ``full_grad_hidden=True`` returns the summed dX on
  every rank instead (flce_dist's default contract, for a caller that does not sum). A DTensor
  weight keeps DTensor semantics (full dX).

Beyond verl: any ``H``; CPU (Helion reference mode) as well as CUDA; any dtype flce_dist takes
(hidden and weight of one dtype, or autocast's rule); uneven shards (stated as above); a
``Shard(0)`` DTensor weight (its mesh gives the group and the split; ``dist_process_group`` must
then be None or that group). ``labels == ignore_index`` (-100): logprob
0, entropy 0, no gradient (verl has no ignore_index; its kernel's output there is undefined). A
label outside ``[0, V)`` otherwise raises ``ValueError`` (CPU) or poisons that token with NaN (GPU).

Collectives, per call, on ``dist_process_group`` (none when it is None or of size 1): forward one
all-gather of ``[N, 5]`` float32 statistics; backward none (the partial dX; with
``full_grad_hidden=True`` one all-reduce of dX, ``N * H`` of hidden's dtype); once per stated
layout (not per token count), one all-gather of the shard sizes and the call's signature. verl's
kernel does three all-reduces of ``[N]``/``[N, splits]`` statistics and leaves dX unreduced too.

Memory: no ``[N, V_local]`` logits, ever: per-token statistics (``O(N)``) and one vocabulary chunk
of logits at a time, recomputed in backward; the saved tensors are hidden, weight, labels and the
per-token statistics. verl's kernel keeps ``[N, V_local / 1024]`` float32 partials in forward.

``patch()`` replaces ``linear_cross_entropy`` in ``verl.utils.kernel.linear_cross_entropy`` (what the
FSDP forwards import at call time, and what a Megatron forward module imported after ``patch()``
binds) and in ``verl.models.mcore.model_forward_fused`` / ``model_forward_1f1b_overlap`` if they
are already imported (their import-time binding). It imports no Megatron module itself.
``unpatch()`` puts verl's function back wherever flce_dist's is bound. Importing this module or
``flce_dist`` changes nothing; importing ``flce_dist.integrations.verl_patch`` calls ``patch()``.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any

import torch
import torch.distributed as dist

from ..api import logprobs_and_entropy
from ..distributed import group_size
from ..distributed.dtensor import is_dtensor

__all__ = ["KERNEL_MODULE", "BOUND_MODULES", "is_patched", "linear_cross_entropy", "patch", "unpatch"]

KERNEL_MODULE = "verl.utils.kernel.linear_cross_entropy"
# verl modules that bind ``linear_cross_entropy`` at import (``from KERNEL_MODULE import linear_cross_entropy``)
BOUND_MODULES = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")
_REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group: dist.ProcessGroup | None = None,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    full_grad_hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy(hidden, weight, labels, temperature, reduction,
    dist_process_group) -> (logprobs, entropy)`` on :func:`flce_dist.logprobs_and_entropy`
    (see the module docstring for the contract, collectives and memory).

    hidden [..., H]; weight [V_local, H] (this rank's rows; the full [V, H] without a group);
    labels: N = hidden.numel() / H global ids; temperature > 0 (divides the logits);
    reduction "none" | "sum" | "mean"; dist_process_group: the vocab shards' group or None.
    Keywords beyond verl's: ``vocab_start`` (global id of ``weight[0]``) and ``vocab_size`` (the
    global V), both None: verl's equal shards (``rank * V_local``, ``P * V_local``); ``ignore_index``;
    ``full_grad_hidden`` (True: the summed dX on every rank).
    Returns ``(logprobs, entropy)``, float32: ``[N]`` and ``[N]`` (``reduction="none"``), or a 0-d
    logprob sum / mean and ``[N]``.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear_cross_entropy: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
        raise ValueError(
            f"linear_cross_entropy: reduction must be 'none', 'sum' or 'mean' (any case), got {reduction!r}"
        )
    reduction = reduction.lower()
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"linear_cross_entropy: temperature must be a positive float, got {type(temperature).__name__}")
    if dist_process_group is not None and not isinstance(dist_process_group, dist.ProcessGroup):
        raise TypeError(
            "linear_cross_entropy: dist_process_group must be a torch.distributed.ProcessGroup or None, "
            f"got {type(dist_process_group).__name__}"
        )
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise ValueError(f"linear_cross_entropy: hidden must have shape [..., H] with H > 0, got {tuple(hidden.shape)}")
    dtensor = any(is_dtensor(t) for t in (hidden, weight, labels))
    if not dtensor:  # verl flattens both; the outputs stay [N]
        h = hidden.shape[-1]
        if labels.numel() * h != hidden.numel():
            raise ValueError(
                f"linear_cross_entropy: labels has {labels.numel()} elements but hidden "
                f"{tuple(hidden.shape)} has {hidden.numel() // h} tokens (N = hidden.numel() / H)"
            )
        hidden, labels = hidden.reshape(-1, h), labels.reshape(-1)
        p = group_size(dist_process_group)
        if dist_process_group is not None and vocab_start is None and vocab_size is None:
            # verl's layout: equal shards in rank order (its kernel's contract)
            v_local = weight.shape[0]
            vocab_start, vocab_size = dist.get_rank(dist_process_group) * v_local, p * v_local
        partial = p > 1 and not full_grad_hidden  # verl's convention: the caller sums the partial dX
    else:
        partial = False
    logprobs, entropy = logprobs_and_entropy(
        hidden,
        weight,
        labels,
        temperature=float(temperature),
        group=dist_process_group,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        ignore_index=ignore_index,
        partial_dx=partial,
    )
    if dtensor:
        logprobs, entropy = logprobs.reshape(-1), entropy.reshape(-1)
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.sum() / max(logprobs.numel(), 1)
    return logprobs, entropy


# (module name) -> verl's original object, for every module where patch() put flce_dist's function
_originals: dict[str, object] = {}


def _kernel_module():
    try:
        import verl.utils.kernel.linear_cross_entropy as mod
    except ImportError as exc:
        raise ImportError(
            "flce_dist.integrations.verl.patch() needs verl (pip install verl==0.9.1; importing verl "
            f"needs ray, tensordict and omegaconf): {exc}"
        ) from exc
    return mod


def patch() -> list[str]:
    """Bind :func:`linear_cross_entropy` in verl's kernel module and in the already-imported
    Megatron forward modules (see the module docstring). Idempotent. Returns the names of the
    modules that now hold flce_dist's function."""
    kernel = _kernel_module()
    original = _originals.get(KERNEL_MODULE, kernel.linear_cross_entropy)
    if original is linear_cross_entropy:  # bound by hand: nothing of verl's to restore
        raise RuntimeError(f"{KERNEL_MODULE}.linear_cross_entropy is already flce_dist's, but not through patch()")
    for name in (KERNEL_MODULE, *BOUND_MODULES):
        mod: Any = kernel if name == KERNEL_MODULE else sys.modules.get(name)
        if mod is None or not hasattr(mod, "linear_cross_entropy"):
            continue  # not imported yet: its import binds the kernel module's (patched) name
        if mod.linear_cross_entropy is not linear_cross_entropy:
            _originals[name] = mod.linear_cross_entropy
            mod.linear_cross_entropy = linear_cross_entropy
    return [
        n
        for n in (KERNEL_MODULE, *BOUND_MODULES)
        if getattr(sys.modules.get(n), "linear_cross_entropy", None) is linear_cross_entropy
    ]


def unpatch() -> None:
    """Put verl's own function back in every module that holds flce_dist's (also in a Megatron
    forward module imported after ``patch()``, which bound the patched name)."""
    if not _originals:
        return
    original = _originals[KERNEL_MODULE]
    for name in (KERNEL_MODULE, *BOUND_MODULES):
        mod: Any = sys.modules.get(name)
        if mod is not None and getattr(mod, "linear_cross_entropy", None) is linear_cross_entropy:
            mod.linear_cross_entropy = _originals.get(name, original)
    _originals.clear()


def is_patched() -> bool:
    mod = sys.modules.get(KERNEL_MODULE)
    return mod is not None and getattr(mod, "linear_cross_entropy", None) is linear_cross_entropy
