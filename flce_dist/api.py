"""``fused_linear_cross_entropy``: argument checks and dispatch to the autograd core.

The loss options are fields of :class:`flce_dist.options.LossOptions` (defaults, checks, meaning);
this signature lists them as keywords for readers and IDEs (and passes them on in field order), and
``tests/test_features.py::test_api_signature_is_the_options`` keeps the two in step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import core
from .aligned import aligned
from .autograd import FLCEFunction
from .compile_op import fused_lce
from .distributed import resolve_call, resolve_shard
from .distributed.agree import Replan
from .distributed.dtensor import is_dtensor, unwrap
from .distributed.guard import call_digest
from .distributed.shard import agree_call, agree_new
from .options import FLCEParams, LossOptions
from .settings import Settings, current

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Arguments of fused_linear_cross_entropy that are not LossOptions fields.
NON_OPTIONS = (
    "hidden",
    "weight",
    "target",
    "bias",
    "group",
    "vocab_start",
    "vocab_size",
    "num_items_in_batch",
    "settings",
    "loss_weights",
)

# Never traced by TorchDynamo: the eager Function (used whenever the custom op is not: eager calls,
# and under torch.compile with sequence parallelism or DTensor inputs, as a graph break), and the
# eager calls' once-per-layout shard check with a group (a collective and a host sync; a traced call
# runs it at trace time instead, as a graph constant: ``resolve_call``'s assume_constant_result).
# Eager calls must be shielded: frames that run eagerly under a compiled caller still meet Dynamo's
# frame hook. torch._disable_dynamo defers ``import torch._dynamo`` from import time to the first call.
_resolve = torch._disable_dynamo(resolve_call)


def _apply(*args):
    return FLCEFunction.apply(*args)


_eager = torch._disable_dynamo(_apply)
_agree = torch._disable_dynamo(agree_call)
_agree_new = torch._disable_dynamo(agree_new)


class _Plan(NamedTuple):
    """An agreed call's plan as a stand-in runs it (``distributed/agree.py``): ``fields`` (the API's: hidden
    size, dtype, bias, gradient need, num_items given, options, settings, loss_weights' dtype, device type),
    the device and the call's FLCEParams (the effective options: strategy under no_grad, sequence parallelism)."""

    fields: tuple
    device: torch.device
    params: FLCEParams


def _effective(options: LossOptions, tp: int) -> LossOptions:
    """The options the core runs: the API's replacements below (evaluation: statistics only; no sequence
    parallelism on one rank)."""
    if not torch.is_grad_enabled():
        options = options.replace(strategy="recompute")
    return options.replace(sequence_parallel=options.sequence_parallel and tp > 1)


class _NaNGradient(torch.autograd.Function):
    """0 (a float32 scalar) whose gradient is NaN for each input: a stand-in's inputs get the gradients its peers'
    failed guard gives theirs, without changing its outputs' values."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.like = [(u.shape, u.dtype, u.device) for u in inputs]
        return torch.zeros((), device=inputs[0].device)

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.full(shape, float("nan"), dtype=dtype, device=dev) for shape, dtype, dev in ctx.like)


def _stand_in(
    plan: _Plan,
    digest: int,
    n: int,
    group: dist.ProcessGroup | None,
    target: torch.Tensor,
    options: LossOptions,
    dt,
    inputs: tuple,
) -> object:
    """Run ``plan`` (the call every rank expected) in place of this rank's call, whose plan has ``digest``
    (``distributed/agree.py``): the core on stand-in inputs of ``n`` tokens (zeros, an empty shard: it
    computes nothing but issues the plan's collectives, forward and, when autograd runs it, backward), its
    guard sending ``digest`` so that every rank's guard fails. Raises the guard's ``ValueError`` where the plan
    raises (CPU tensors, ``check_finite``) or where every rank stood in and one of their own calls would
    (``guard.settle_stand_in``), :class:`Replan` where every rank changed to this call's plan;
    else returns this call's outputs, NaN (a scalar loss always, per-token values where this call's token counts,
    0 where it is ignored), shaped as they would be: the loss's and the entropy's gradients flow into the stand-in's loss and entropy (so that its backward
    runs, with the same gradients present, where its peers' runs), and the ``inputs`` that need a gradient
    get NaN ones (as on its peers, whose guard failed)."""
    h, dtype, has_bias, need_dx, need_dw, num_items, _, _, lw_dtype, _ = plan.fields
    raises = core.can_raise(target, options)  # this call's own guard path: CPU tensors or check_finite
    dev = plan.device
    with torch.enable_grad() if need_dx or need_dw else torch.no_grad():
        x = torch.zeros(n, h, dtype=getattr(torch, dtype.split(".")[-1]), device=dev, requires_grad=need_dx)
        w = torch.zeros(0, h, dtype=x.dtype, device=dev, requires_grad=need_dw)
        b = torch.zeros(0, dtype=x.dtype, device=dev) if has_bias else None
        lw = None if lw_dtype is None else torch.ones(n, dtype=getattr(torch, lw_dtype.split(".")[-1]), device=dev)
        items = torch.ones((), device=dev) if num_items else None
        p = dataclasses.replace(plan.params, stand_in=(digest, raises))
        # this call's targets where the plan takes as many (under sequence parallelism the plan gathers them)
        t = target.reshape(-1).to(torch.int64)
        t = t if t.numel() == n and t.device == dev else torch.zeros(n, dtype=torch.int64, device=dev)
        loss, _, _, ent = _eager(x, w, b, t, items, p, group, lw)
    # NaN as its peers' failed guard gives theirs: a scalar always, a per-token value where this call's token counts
    nan = torch.full(target.shape, float("nan"), device=target.device)
    per_token, scalar = torch.where(target == options.ignore_index, 0.0, nan), nan.new_full((), float("nan"))
    mine = [u for u in inputs if u is not None and u.requires_grad and torch.is_grad_enabled()]
    mine = [_NaNGradient.apply(*mine)] if mine else []

    def linked(value: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        into = into if into is not None and into.requires_grad else None
        if into is None and not mine:
            return value
        with torch.enable_grad():  # also under no_grad here when the plan forms gradients (its backward must run)
            # 0 x the stand-in's output (NaN where its guard failed: not in the value), and NaN x this call's inputs
            parts = ([torch.nan_to_num(into.float() * 0.0).sum()] if into is not None else []) + mine
            for part in parts:
                value = value + part.to(value.device)
            return value

    ent = ent if plan.params.return_entropy else None  # (the plan's entropy output, if it has one)
    out = linked(per_token if options.reduction == "none" else scalar, loss)
    extras = (
        ([nan] if options.return_lse else [])
        + ([torch.zeros(target.shape, dtype=torch.bool, device=target.device)] if options.return_token_accuracy else [])
        + ([linked(per_token, ent)] if options.return_entropy else [])
    )
    if dt is not None:
        out = dt.wrap_tokens(out) if options.reduction == "none" else out
        extras = [dt.wrap_tokens(e) for e in extras]
    return (out, *extras) if extras else out


# The validated LossOptions of the keyword values seen (a frozen object, shared by the calls that pass the same
# values): a call's options are checked once, not per call (their __post_init__ was ~45 % of the API's Python),
# and the FLCEParams built on them (whose option reads memoize on the object). Keyed by each value's type and
# value (1 and True, -100 and -100.0, 0.0 and -0.0 are different keys: LossOptions' own == does not tell the last
# pair apart, so it is never a key); bounded.
_CACHE_MAX = 256
_OPTIONS: dict[tuple, LossOptions] = {}
_PARAMS: dict[tuple, FLCEParams] = {}


def _memo(table: dict, key: tuple, make: Callable[[], object]):
    """``table[key]``, made by ``make()`` on a miss; the table is cleared when it holds ``_CACHE_MAX`` entries."""
    got = table.get(key)
    if got is None:
        got = make()  # may raise (nothing cached)
        if len(table) >= _CACHE_MAX:
            table.clear()
        table[key] = got
    return got


def _options(make: Callable[[], LossOptions]) -> tuple[LossOptions, tuple | None]:
    """(the validated options ``make()`` builds, their cache key; None where a value is unhashable). ``make``: a
    lambda over the API's keyword arguments; the key is the values it closes over (all of them, whatever they are)."""
    key = tuple(
        (float, v, math.copysign(1.0, v)) if type(v) is float else (type(v), v)
        for v in (c.cell_contents for c in make.__closure__ or ())
    )
    try:
        hash(key)
    except TypeError:  # an unhashable value: LossOptions names it
        return make(), None
    return _memo(_OPTIONS, key, make), key


def _params(
    start: int, vocab: int, options: LossOptions, settings: Settings, stale: bool, okey: tuple | None
) -> FLCEParams:
    """The call's FLCEParams: one object per (vocabulary slice, ``okey`` (the options' key of ``_options``; None:
    made fresh), settings, stale)."""
    if okey is None:
        return FLCEParams(start, vocab, options, settings, stale)
    return _memo(
        _PARAMS, (start, vocab, okey, settings, stale), lambda: FLCEParams(start, vocab, options, settings, stale)
    )


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_shapes(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None) -> None:
    if hidden.dtype not in _FLOATS:
        raise TypeError(f"hidden must be float32, bfloat16, float16 or float64, got {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape [..., H], got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V_local, H], got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    h = hidden.shape[-1]
    if weight.shape[1] != h:
        hint = (
            " (weight looks transposed: pass it as [V, H], like nn.Linear.weight, not [H, V])"
            if weight.shape[0] == h
            else ""
        )
        raise ValueError(f"weight hidden size {weight.shape[1]} does not match hidden's last dim {h}{hint}")
    if h == 0:
        raise ValueError("hidden has hidden size H=0: the logits would all be 0; pass at least one feature")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be int64 (or int32) class ids, got {target.dtype}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        hint = (
            " (the arguments are (hidden, weight, target); Liger's loss modules take (weight, hidden, target), "
            "and weight is [V, H] like nn.Linear.weight)"
            if hidden.dim() == 2 and target.dim() == 1 and target.shape[0] == weight.shape[0]
            else ""
        )
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal hidden's leading shape {tuple(hidden.shape[:-1])}{hint}"
        )
    if target.device != hidden.device:
        raise ValueError(f"target is on {target.device} but hidden is on {hidden.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}] (V_local), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise TypeError(f"bias must be {hidden.dtype} on {hidden.device}, got {bias.dtype} on {bias.device}")


def _check_loss_weights(w: object, target: torch.Tensor, hidden: torch.Tensor, dt) -> torch.Tensor:
    """``loss_weights`` as the core takes them: [N] contiguous, on hidden's device (see the docstring)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"loss_weights must be a float tensor shaped like target, or None, got {type(w).__name__}")
    if is_dtensor(w) or (dt is not None and dt.sequence_parallel):
        raise TypeError(
            "loss_weights must be a plain tensor, with plain or replicated DTensor hidden states (not with "
            "a sequence-sharded DTensor hidden: pass plain tensors and sequence_parallel=True)"
        )
    if not w.is_floating_point():
        raise TypeError(f"loss_weights must be a floating-point tensor, got {w.dtype}")
    if tuple(w.shape) != tuple(target.shape):
        raise ValueError(f"loss_weights shape {tuple(w.shape)} must equal target's shape {tuple(target.shape)}")
    if w.device != hidden.device:
        raise ValueError(f"loss_weights is on {w.device} but hidden is on {hidden.device}")
    if w.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "loss_weights require a gradient, but no gradient flows to them (they are constants of the "
            "loss): pass loss_weights.detach()"
        )
    return w.reshape(-1).contiguous()


def _check_target_range(t: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """CPU targets only (a host sync, free there): ``ValueError`` for a target outside ``[0, vocab)`` that is not
    ``ignore_index`` (on the GPU such a target poisons its loss with NaN instead, and with a group the guard
    raises on every rank)."""
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"target[{i}] = {int(t[i])} is outside [0, {vocab}) and is not ignore_index ({ignore_index})")


def _autocast_device(hidden: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype in force for ``hidden``'s device type, or None."""
    dev = hidden.device.type
    if dev not in ("cuda", "cpu", "xpu", "mps") or not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


def _autocast_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Autocast's cast of a float input (float64 is left alone, as autocast does)."""
    if t.dtype == dtype or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return t
    return t.to(dtype)


def _num_items(num_items_in_batch: object, device: torch.device) -> torch.Tensor | None:
    if num_items_in_batch is None:
        return None
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(
                f"num_items_in_batch must be a number or a 1-element tensor, got shape "
                f"{tuple(num_items_in_batch.shape)}"
            )
        if num_items_in_batch.device.type == "cpu" and not float(num_items_in_batch) >= 0:
            raise ValueError(f"num_items_in_batch must be >= 0, got {float(num_items_in_batch)}")
        if num_items_in_batch.device.type == "meta" and device.type != "meta":
            raise ValueError(f"num_items_in_batch is a meta tensor (no value) but hidden is on {device}")
        return num_items_in_batch.to(device).reshape(())
    if (
        isinstance(num_items_in_batch, bool)
        or not isinstance(num_items_in_batch, numbers.Real)
        or not 0 <= float(num_items_in_batch) < float("inf")
    ):
        # 0 is an all-padding micro-batch under gradient accumulation (its loss is 0)
        raise ValueError(
            f"num_items_in_batch must be a finite number >= 0 or a 1-element tensor, got {num_items_in_batch!r}"
        )
    return torch.as_tensor(num_items_in_batch, device=device).reshape(())


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    loss_weights: torch.Tensor | None = None,
    settings: Settings | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    sequence_parallel: bool = False,
    partial_dx: bool = False,
    strategy: str = "auto",
    deterministic: bool = False,
    grad_filter_eps: float | str | None = None,
    return_lse: bool = False,
    return_token_accuracy: bool = False,
    return_entropy: bool = False,
    check_finite: bool = False,
    check_inputs: bool = False,
):
    """Cross entropy of ``hidden @ weight.T (+ bias)`` without materialising the logits.

    hidden [..., H] (float32/bfloat16/float16; float64 for checks), weight [V_local, H] (this rank's
    vocab rows; the full [V, H] when ``group`` is None), target [...] int64 GLOBAL ids.
    With ``group`` (a ProcessGroup of P ranks holding the vocab shards), every rank returns the same
    loss, the gradient of its own weight shard, and the full dX. ``weight`` (and ``bias``) may be
    DTensors placed ``Shard(0)`` on one mesh dim: the group and every rank's ``vocab_start`` then come
    from them, and ``hidden`` may be a DTensor too (Replicate, or sharded over a token dim = sequence
    parallelism); see ``distributed/dtensor.py``. ``sequence_parallel=True``: hidden and target are
    this rank's equal-sized token slice (rank order); the per-token outputs (``reduction="none"``,
    lse) are for that slice too, and dX is reduce-scattered back.

    The layout is stated, not guessed: with a plain-tensor ``group`` pass ``vocab_size`` (the global
    vocabulary size; the shards are then taken in rank order, e.g. ``flce_dist.vocab_shard``'s) and/or
    ``vocab_start`` (the global id of ``weight[0]``; without ``vocab_size`` V is the shards' sum);
    neither is a ``ValueError``. A DTensor weight states both itself. The layout is checked once
    per stated layout on every rank (``distributed/shard.py``), not per token count.

    Options (``LossOptions``: defaults, checks, meaning): ``ignore_index``, ``reduction``,
    ``label_smoothing``, ``z_loss``, ``softcap``, ``temperature``, ``sequence_parallel``,
    ``partial_dx``, ``strategy`` (``"auto"``, ``"fused"``, ``"recompute"``; see ``core.py``),
    ``deterministic``, ``grad_filter_eps``, ``return_lse``, ``return_token_accuracy``,
    ``return_entropy``, ``check_finite``, ``check_inputs``. ``settings`` (``Settings``: chunk budget,
    logits backend, block sizes, config directory) changes how, never what, is computed; None:
    ``settings.current()``. Every output is of the transformed logits ``y = softcap(z) /
    temperature`` (``z = hidden @ weight.T (+ bias)``, ``softcap(z) = c * tanh(z / c)``): the model's
    final logits divided by the temperature, as a sampler does (and :func:`logprobs_and_entropy`).

    ``partial_dx=True``: the hidden gradient handed back is this rank's partial ``dz_r @ W_r``
    (its sum over the group is dX) and flce_dist runs no dX all-reduce: for a caller that reduces
    the hidden gradient over the group itself (torchtitan's tp boundary, Megatron / verl). An
    option like the others, so ``torch.compile`` and the cross-rank checks see it. ``ValueError``
    with ``sequence_parallel=True`` or a DTensor ``hidden`` (whose gradient is placed like hidden).

    Gradients are formed only for the inputs that need them, eager and compiled: a frozen
    ``weight`` (and ``bias``) costs no dW buffer or matmul, a ``hidden`` without a gradient no dX
    matmul and no dX all-reduce.

    Returns the loss; with ``return_lse=True`` also the global per-token logsumexp, and with
    ``return_token_accuracy=True`` also a per-token bool ``target == argmax`` (argmax over all
    shards; a tie with the target counts as correct; ignored tokens are False), each shaped like
    target and not differentiable; with ``return_entropy=True`` also the per-token entropy
    ``H = lse - sum_v p_v y_v`` of the softmax over the global vocabulary of the transformed logits
    ``y = softcap(z) / temperature``, float32, 0 for ignored tokens, differentiable (its gradient flows
    into hidden, weight and bias with the loss's, in the same backward pass over the vocabulary).
    Always in this order, each present only when asked for: ``loss[, lse][, correct][, entropy]``.
    With ``reduction="none"`` the per-token losses, label smoothing and z-loss included when set;
    without them they are ``-log p(target)``: the log-probabilities with their gradient (see
    :func:`logprobs_and_entropy`). ``num_items_in_batch`` goes with ``reduction="mean"`` only
    (``sum / num_items_in_batch``); with ``"sum"`` or ``"none"`` it raises.

    ``loss_weights``: per-token weights ``w`` (float, shaped like target; constants, no gradient
    flows to them). ``"sum"`` returns ``sum_n w_n loss_n``, ``"mean"`` that over ``sum_n w_n`` (the
    non-ignored tokens'; ``num_items_in_batch`` if given), as ``torch.nn.functional.cross_entropy``'s
    ``weight`` averages: 3 matmuls (fused strategy). ``"none"`` returns the UNWEIGHTED per-token
    losses and declares that the caller weights them by ``w`` (e.g. Megatron's
    ``sum(loss * loss_mask)``): the gradient is formed in the forward with row weights ``w`` (3
    matmuls instead of the recompute strategy's 4), and the backward checks that the per-token
    gradient it receives is ``c * w`` for one ``c`` (on every rank of the group): then dW is ``c``
    times the stored one and each dX row ``g_n / w_n`` times its own; otherwise it recomputes the
    exact gradient (the 3 matmuls again). That check costs one host sync per backward and, with a
    group, one all-gather of 3 numbers per rank. Under sequence parallelism the weights are this
    rank's slice (one more all-gather of ``N`` values). Under torch.compile such a call runs eagerly
    (a graph break, as with sequence parallelism). Not with a sequence-sharded DTensor ``hidden``.

    Autocast: under ``torch.autocast`` the call follows autocast's rule for ``linear``: float
    ``hidden``, ``weight`` and ``bias`` are cast to the autocast dtype (e.g. an fp32 master weight
    with a bf16 hidden), the loss is computed in it, and each input's gradient comes back in its
    own dtype. The entropy needs
    the ``recompute`` strategy's backward (4 matmuls instead of 3; ``strategy`` is then ignored).

    ``deterministic=True``: bitwise identical loss and gradients from run to run on every rank. One
    GPU is already reproducible (no floating-point atomics; fixed chunk plan); under TP this replaces NCCL's dX
    all-reduce (whose summation order NCCL does not fix) by an all-to-all + float32 sum in rank
    order + all-gather: same bytes, but blocking (no overlap with the last dW matmul).

    ``check_finite=True`` raises ``FloatingPointError`` when the loss is NaN/inf (a host sync; off by
    default). Without it, NaN/inf in hidden, weight or bias propagate to the loss, never masked.
    ``check_inputs=True`` (debugging, with a group): the per-call cross-rank guard also compares a
    checksum of hidden and counts targets outside ``[0, V)`` (a few more small kernels per call;
    docs/guarantees.md). Double backward (``create_graph=True``) raises ``RuntimeError``, eager and
    compiled: the gradients are formed by kernels.

    Collectives per call with a group of P ranks (N tokens, H hidden): forward one all-gather of
    ``[N, 4]`` float32 stats (``[N, 5]`` with the entropy; the fused strategy: one per token chunk,
    same bytes); backward one
    all-reduce of dX (``N*H``, hidden's dtype; none with ``partial_dx`` or without a hidden
    gradient); sequence parallel: plus all-gathers of hidden and target and a reduce-scatter of dX
    instead of the all-reduce. Once per agreed plan (the group's first call, or a call that every rank
    changed together), one all-gather of the shard starts and sizes, the token count and the call's
    signature checks the layout and that every rank makes the same call (a host sync); under
    torch.compile it runs while tracing. Every call's first statistics all-gather also carries a 32-byte
    guard per rank (``distributed/guard.py``; no host sync; at N = 0 the fused strategy still sends it,
    one all-gather). Which collectives a rank issues is decided from the group's history of agreed
    calls (``distributed/agree.py``), never from this rank's arguments alone: a call whose plan is not
    the predicted one runs that plan's collectives on stand-in inputs (its peers' and its own guard
    fail: the same ValueError on CPU tensors and with ``check_finite``, NaN outputs and gradients
    otherwise), plus, where every rank changed plans, the handshake (docs/guarantees.md). Sequence
    parallel with ``return_entropy``: the backward all-gathers the entropy's gradient (4N/P bytes per
    rank) whether or not it is used.

    Memory: no ``[N, V_local]`` logits: one logits chunk (``chunking.py``), ``O(N)`` float32
    statistics, and the gradients that are formed (dW ``[V_local, H]``, dX ``[N, H]``).
    """

    def make() -> LossOptions:
        return LossOptions(
            ignore_index,
            reduction,
            label_smoothing,
            z_loss,
            softcap,
            temperature,
            sequence_parallel,
            partial_dx,
            strategy,
            deterministic,
            grad_filter_eps,
            return_lse,
            return_token_accuracy,
            return_entropy,
            check_finite,
            check_inputs,
        )

    compiling = torch.compiler.is_compiling()
    # traced: built as written (a graph constant; no module-level cache inside a traced frame)
    options, okey = (make(), None) if compiling else _options(make)
    given = options
    settings = current() if settings is None else settings
    if not isinstance(settings, Settings):
        raise TypeError(f"settings must be a flce_dist.Settings or None, got {type(settings).__name__}")
    hidden = _check_tensor("hidden", hidden)
    weight = _check_tensor("weight", weight)
    target = _check_tensor("target", target)
    if bias is not None:
        bias = _check_tensor("bias", bias)
    if num_items_in_batch is not None and options.reduction != "mean":
        raise ValueError(
            f"num_items_in_batch goes with reduction='mean' (the sum over it); with "
            f"reduction={options.reduction!r} it would be ignored: leave it None"
        )
    autocast = _autocast_device(hidden)
    if autocast is not None:  # autocast's rule for linear: compute in its dtype, gradients cast back
        hidden, weight = _autocast_cast(hidden, autocast), _autocast_cast(weight, autocast)
        bias = None if bias is None else _autocast_cast(bias, autocast)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    if vocab_size is not None and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size < 1
    ):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    if options.partial_dx and is_dtensor(hidden):
        raise ValueError(
            "partial_dx=True needs a plain-tensor hidden: a DTensor hidden's gradient is placed like "
            "hidden (Replicate: the summed dX on every rank), so a per-rank partial has no placement "
            "there; partial_dx is also refused with sequence_parallel=True"
        )
    dt = None  # DTensor inputs: run on the local tensors (distributed/dtensor.py)
    if any(is_dtensor(t_) for t_ in (hidden, weight, bias, target)):
        dt = unwrap(hidden, weight, target, bias, group, vocab_start, options.sequence_parallel, options.ignore_index)
        hidden, weight, bias, target, group = dt.hidden, dt.weight, dt.bias, dt.target, dt.group
        options = options.replace(sequence_parallel=dt.sequence_parallel)
        if vocab_size is not None and vocab_size != dt.vocab_size:
            raise ValueError(f"vocab_size={vocab_size} but the DTensor weight has {dt.vocab_size} rows")
        vocab_size = dt.vocab_size
    elif group is not None and vocab_size is None and vocab_start is None:
        raise ValueError(
            "group= with plain tensors needs the layout stated: pass vocab_size= (the global vocabulary "
            "size; each rank's weight holds its rows, in rank order, e.g. weight[start:end] with "
            "(start, end) = flce_dist.vocab_shard(vocab_size, rank, world_size)) and/or vocab_start= "
            "(the global id of weight[0]). A DTensor weight states it itself"
        )
    _check_shapes(hidden, weight, target, bias)
    if loss_weights is not None:
        loss_weights = _check_loss_weights(loss_weights, target, hidden, dt)

    h = hidden.shape[-1]
    x = hidden.reshape(-1, h)
    # which gradients the call forms: a frozen lm_head (LoRA / PEFT) skips dW, a hidden without a
    # gradient dX and its all-reduce; the compiled op is told too (it cannot see requires_grad)
    grad_on = torch.is_grad_enabled()
    need_dx = grad_on and hidden.requires_grad
    need_dw = grad_on and (weight.requires_grad or (bias is not None and bias.requires_grad))
    if weight.shape[0] == 0 and (group is None or dist.get_world_size(group) == 1):
        raise ValueError(
            "weight has 0 rows: without a group (or with a group of one rank) it must hold the whole "
            "[V, H] vocabulary (an empty shard is legal only inside a group of several ranks)"
        )
    meta = hidden.device.type == "meta"  # shapes only: the custom op's fake kernels (never Helion's reference mode)
    if meta and (group is not None or loss_weights is not None):
        raise ValueError(
            "meta tensors (shapes only) work without a group or loss_weights (a group's shard check is "
            "a collective; loss_weights run eagerly)"
        )
    stand_in = None
    if group is None:  # no collective: stays inside a compiled graph
        (start, vocab, stale), group_name, tp = (
            resolve_shard(None, weight.shape[0], vocab_start, hidden.device, vocab_size=vocab_size),
            "",
            1,
        )
    else:  # the call's plan: what shapes its collectives, agreed across ranks (distributed/agree.py, shard.py)
        fields = (
            h,
            str(hidden.dtype),
            bias is not None,
            need_dx,
            need_dw,
            num_items_in_batch is not None,
            options.signature(),
            settings.astuple(),
            None if loss_weights is None else str(loss_weights.dtype),
            hidden.device.type,
        )
        if compiling:  # traced: run once at trace time, its result a graph constant (assume_constant_result)
            start, vocab, group_name, tp, stale = resolve_call(
                group.group_name, weight, vocab_start, hidden.device, -1, fields, vocab_size
            )
        elif dist.get_world_size(group) == 1:
            start, vocab, group_name, tp, stale = _resolve(
                group, weight, vocab_start, hidden.device, x.shape[0], fields, vocab_size
            )
        else:  # predicted from the group's agreed calls, or agreed now, or stood in for (agree.py)
            group_name, tp = group.group_name, dist.get_world_size(group)
            dev = hidden.device
            agreed = (
                group,
                weight,
                vocab_start,
                dev,
                x.shape[0],
                fields,
                vocab_size,
                call_digest(*fields, vocab_size, vocab_start is None),  # (cached: the fields repeat)
                lambda s, v: _Plan(fields, dev, FLCEParams(s, v, _effective(options, tp), settings)),
            )
            start, vocab, stale, stand_in = _agree(*agreed)
    t = target.reshape(-1).to(torch.int64)
    if t.device.type == "cpu" and t.numel() and not compiling and tp == 1:  # with a group: the guard, on every rank
        _check_target_range(t, vocab, options.ignore_index)
    num_items = _num_items(num_items_in_batch, hidden.device)
    if not torch.is_grad_enabled():
        options = options.replace(strategy="recompute")  # evaluation: statistics only, one matmul
    options = options.replace(sequence_parallel=options.sequence_parallel and tp > 1)
    # the inputs are in the autocast dtype already; the core's own float32 matmuls must stay float32
    with torch.autocast(hidden.device.type, enabled=False) if autocast is not None else contextlib.nullcontext():
        if (compiling or meta) and not options.sequence_parallel and dt is None and loss_weights is None:
            # under torch.compile: the custom op (compile_op.py), one graph, no break
            loss, lse, correct, ent, *_ = fused_lce(
                x.contiguous(),
                weight.contiguous(),
                bias,
                t.contiguous(),
                num_items,
                FLCEParams.encode(start, vocab, options, settings, stale),
                need_dx,
                need_dw,
                group_name,
            )
        else:
            if stand_in is not None:  # this call is not the plan every rank expects: run that plan in its place
                try:
                    # the same global token count under the plan's sequence parallelism (N = P n with it)
                    n = x.shape[0] * (tp if options.sequence_parallel and tp > 1 else 1)
                    n //= tp if stand_in.params.sequence_parallel else 1
                    return _stand_in(stand_in, agreed[7], n, group, target, options, dt, (hidden, weight, bias))
                except Replan:  # every rank changed to this call's plan: agree on it, then run the call
                    start, vocab, stale = _agree_new(*agreed)
            params = _params(start, vocab, options, settings, stale, okey if options is given else None)
            if not grad_on:  # the Function sees requires_grad, not grad mode: it forms (and the guard compares)
                x, weight, bias = x.detach(), weight.detach(), None if bias is None else bias.detach()  # none
            # contiguous, and on CUDA 16-byte aligned: a view at an odd offset into a flat buffer is copied (aligned.py)
            loss, lse, correct, ent = _eager(
                aligned(x), aligned(weight), aligned(bias), aligned(t), num_items, params, group, loss_weights
            )
    if options.reduction == "none":
        loss = loss.reshape(target.shape)
    if options.check_finite and not bool(torch.isfinite(loss.detach()).all()):
        raise FloatingPointError(
            "fused_linear_cross_entropy: the loss is not finite: NaN/inf in hidden, weight or bias, a target "
            "outside [0, V) on the GPU, or logits that overflow hidden's dtype (float16 tops out at 65504)"
        )
    extras = (
        ([lse.reshape(target.shape)] if options.return_lse else [])
        + ([correct.reshape(target.shape)] if options.return_token_accuracy else [])
        + ([ent.reshape(target.shape)] if options.return_entropy else [])
    )
    if dt is not None:  # per-token outputs placed like hidden's leading dims; a scalar loss stays plain
        loss = dt.wrap_tokens(loss) if options.reduction == "none" else loss
        extras = [dt.wrap_tokens(e) for e in extras]
    return (loss, *extras) if extras else loss


_LOGPROB_REFUSED = (
    "reduction",
    "label_smoothing",
    "z_loss",
    "return_lse",
    "return_token_accuracy",
    "return_entropy",
    "num_items_in_batch",
    "strategy",
)


def logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    partial_dx: bool = False,
    **kwargs,
):
    """Per-token log-probabilities of ``target`` and entropies of the policy, both differentiable:
    the RL / post-training head (PPO, GRPO: ``logp`` in the ratio, ``entropy`` as a bonus).

    ``logp[n] = log softmax(y_n)[target_n]`` and ``entropy[n] = -sum_v p_nv log p_nv`` over the
    global vocabulary (with ``group``: vocab-parallel, no gather of the vocabulary or of logits),
    both float32, shaped like ``target``, 0 at ``ignore_index`` targets (no gradient there).
    ``y = softcap(z) / temperature`` with ``z = hidden @ weight.T (+ bias)`` and ``softcap(z) =
    c * tanh(z / c)`` (none without ``softcap``): the model's final logits divided by the sampling
    temperature, as vLLM, HF ``generate``, verl and TRL do; the same transform as the loss's
    (``fused_linear_cross_entropy`` with the same ``softcap`` and ``temperature``).

    One call is :func:`fused_linear_cross_entropy` with ``reduction="none", return_entropy=True``
    (``logp = -loss``): forward one matmul and one ``[N, 5]`` statistics all-gather; backward one
    pass over the vocabulary chunks (3 matmuls and the dX all-reduce, or reduce-scatter under
    sequence parallelism) whatever mix of the two outputs the objective uses, e.g.
    ``(adv * logp).sum() + beta * entropy.sum()``.

    ``partial_dx=True`` (with ``group``, plain tensors, not with ``sequence_parallel``): the hidden
    gradient handed back is this rank's partial ``dz_r @ W_r`` (no dX all-reduce; the caller sums it
    over the group, as verl's and Megatron's tensor-parallel conventions do).

    ``kwargs``: ``bias``, ``group``, ``vocab_start``, ``vocab_size``, ``settings``, ``ignore_index``,
    ``softcap``, ``sequence_parallel``, ``deterministic``, ``grad_filter_eps``, ``check_finite``,
    ``check_inputs``; DTensor inputs as in :func:`fused_linear_cross_entropy`. Options that would
    make ``-loss`` something other than a log-probability (label smoothing, z-loss, a reduction)
    are refused.
    """
    refused = sorted(set(kwargs) & set(_LOGPROB_REFUSED))
    if refused:
        raise TypeError(
            f"logprobs_and_entropy: {refused} cannot be set here (log-probabilities are per token, "
            "without label smoothing or z-loss); call fused_linear_cross_entropy for the loss"
        )
    nll, entropy = fused_linear_cross_entropy(
        hidden,
        weight,
        target,
        temperature=temperature,
        reduction="none",
        partial_dx=partial_dx,
        return_entropy=True,
        **kwargs,
    )
    return -nll, entropy
