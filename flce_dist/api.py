"""``fused_linear_cross_entropy``: validation and dispatch to the autograd Function."""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from .autograd import FLCEFunction
from .compile_op import fused_lce
from .distributed import group_size, resolve_shard
from .distributed.dtensor import is_dtensor, unwrap
from .distributed.shard import call_signature
from .params import FLCEParams

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# Eager: the autograd Function. Under torch.compile with sequence parallelism (whose gathers the
# custom op does not cover) this stays a graph break: Helion launches and collectives run eagerly.
_eager = torch.compiler.disable(FLCEFunction.apply)


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


@torch.compiler.disable  # runs once per shape; its collective and host sync stay out of compiled graphs
def _resolve(group: dist.ProcessGroup | None, v_local: int, vocab_start: int | None, device: torch.device,
             n_tokens: int, fields: tuple) -> tuple[int, int, str, int]:
    """``(vocab_start, vocab_size, group name, group size)``: the shard checks of ``resolve_shard``
    (with the call signature compared across ranks), and the group's name for the compiled op."""
    size = group_size(group)
    sig = call_signature(*fields) if size > 1 else 0
    start, vocab = resolve_shard(group, v_local, vocab_start, device, n_tokens, sig)
    return start, vocab, group.group_name if size > 1 else "", size


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    sequence_parallel: bool = False,
    return_lse: bool = False,
    return_token_accuracy: bool = False,
    strategy: str = "auto",
    check_finite: bool = False,
    deterministic: bool = False,
):
    """Cross entropy of ``hidden @ weight.T (+ bias)`` without materialising the logits.

    hidden [..., H] (float32/bfloat16/float16; float64 for checks), weight [V_local, H] (this rank's
    vocab rows; the full [V, H] when ``group`` is None), target [...] int64 GLOBAL ids.
    With ``group`` (a ProcessGroup of P ranks holding the vocab shards), every rank returns the same
    loss, the gradient of its own weight shard, and the full dX. ``sequence_parallel=True``: hidden
    and target are this rank's equal-sized token slice (rank order); the per-token outputs
    (``reduction="none"``, lse) are for that slice too, and dX is reduce-scattered back.
    ``strategy``: ``"auto"`` (default), ``"fused"`` or ``"recompute"`` (see ``autograd.py``).
    Returns the loss; with ``return_lse=True`` also the global per-token logsumexp, and with
    ``return_token_accuracy=True`` also a per-token bool ``target == argmax`` (argmax over all
    shards; a tie with the target counts as correct; ignored tokens are False), each shaped like
    target and not differentiable, in that order: ``loss[, lse][, correct]``.

    ``deterministic=True``: bitwise identical loss and gradients from run to run on every rank. One
    GPU is already reproducible (no atomics; fixed chunk plan); under TP this replaces NCCL's dX
    all-reduce (whose summation order NCCL does not fix) by an all-to-all + float32 sum in rank
    order + all-gather: same bytes, but blocking (no overlap with the last dW matmul).

    ``check_finite=True`` raises ``FloatingPointError`` when the loss is NaN/inf (a host sync; off by
    default). Without it, NaN/inf in hidden, weight or bias propagate to the loss, never masked.

    Collectives per call with a group of P ranks (N tokens, H hidden): forward one all-gather of
    ``[N, 4]`` float32 stats (the fused strategy: one per token chunk, same bytes); backward one
    all-reduce of dX (``N*H``, hidden's dtype); sequence parallel: plus all-gathers of hidden and
    target and a reduce-scatter of dX instead of the all-reduce.
    """
    hidden = _check_tensor("hidden", hidden)
    weight = _check_tensor("weight", weight)
    target = _check_tensor("target", target)
    dt = None  # DTensor inputs: run on the local tensors (distributed/dtensor.py)
    if any(is_dtensor(t_) for t_ in (hidden, weight, bias, target)):
        dt = unwrap(hidden, weight, target, bias, group, vocab_start, sequence_parallel, ignore_index)
        hidden, weight, bias, target, group = dt.hidden, dt.weight, dt.bias, dt.target, dt.group
        sequence_parallel = dt.sequence_parallel
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
        raise ValueError(f"weight hidden size {weight.shape[1]} does not match hidden's last dim {h}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be int64 (or int32) class ids, got {target.dtype}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must equal hidden's leading shape {tuple(hidden.shape[:-1])}")
    if target.device != hidden.device:
        raise ValueError(f"target is on {target.device} but hidden is on {hidden.device}")
    if bias is not None:
        bias = _check_tensor("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}] (V_local), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise TypeError(f"bias must be {hidden.dtype} on {hidden.device}, got {bias.dtype} on {bias.device}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if strategy not in ("auto", "fused", "recompute"):
        raise ValueError(f"strategy must be 'auto', 'fused' or 'recompute', got {strategy!r}")
    if not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if float(z_loss) < 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    if not float(temperature) > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")

    x = hidden.reshape(-1, h)
    needs_grad = torch.is_grad_enabled() and any(
        t_.requires_grad for t_ in (hidden, weight, bias) if t_ is not None)
    if group is None:  # no collective: stays inside a compiled graph
        (start, vocab), group_name, tp = resolve_shard(None, weight.shape[0], vocab_start, hidden.device), "", 1
    else:  # the call's fields, compared across ranks once per shape
        fields = (h, str(hidden.dtype), bias is not None, needs_grad, int(ignore_index), reduction,
                  float(label_smoothing), float(z_loss), float(softcap or 0.0), float(temperature),
                  bool(sequence_parallel), strategy, num_items_in_batch is not None, bool(deterministic))
        start, vocab, group_name, tp = _resolve(group, weight.shape[0], vocab_start, hidden.device, x.shape[0], fields)
    if dt is not None and vocab != dt.vocab_size:
        raise ValueError(f"weight is a DTensor of {dt.vocab_size} vocab rows but its shards along the mesh hold "
                         f"{vocab} rows in all: its local tensors do not match its global shape")
    t = target.reshape(-1).to(torch.int64)
    compiling = torch.compiler.is_compiling()
    if t.device.type == "cpu" and t.numel() and not compiling:
        bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"target[{i}] = {int(t[i])} is outside [0, {vocab}) and is not ignore_index ({ignore_index})")
    num_items = None
    if num_items_in_batch is not None:
        num_items = torch.as_tensor(num_items_in_batch, device=hidden.device).reshape(())
    if not torch.is_grad_enabled():
        strategy = "recompute"  # evaluation: statistics only, one matmul, no gradient work
    params = FLCEParams(
        vocab_start=start, vocab_size=vocab, ignore_index=int(ignore_index), reduction=reduction,
        label_smoothing=float(label_smoothing), z_loss=float(z_loss), softcap=float(softcap or 0.0),
        temperature=float(temperature), sequence_parallel=bool(sequence_parallel) and tp > 1,
        strategy=strategy, deterministic=bool(deterministic),
    )
    if compiling and not params.sequence_parallel and dt is None:
        # under torch.compile: the custom op (compile_op.py), one graph, no break
        loss, lse, correct, *_ = fused_lce(
            x.contiguous(), weight.contiguous(), bias, t.contiguous(), num_items, start, vocab, params.ignore_index,
            reduction, params.label_smoothing, params.z_loss, params.softcap, params.temperature, strategy,
            params.deterministic, needs_grad, group_name)
    else:
        loss, lse, correct = _eager(x.contiguous(), weight.contiguous(), bias, t.contiguous(), num_items, params, group)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    if check_finite and not bool(torch.isfinite(loss.detach()).all()):
        raise FloatingPointError(
            "fused_linear_cross_entropy: the loss is not finite (NaN/inf in hidden, weight or bias, "
            "or a target outside [0, V) on the GPU)")
    extras = ([lse.reshape(target.shape)] if return_lse else []) + ([correct.reshape(target.shape)] if return_token_accuracy else [])
    if dt is not None:  # per-token outputs placed like hidden's leading dims; a scalar loss stays plain
        loss = dt.wrap_tokens(loss) if reduction == "none" else loss
        extras = [dt.wrap_tokens(e) for e in extras]
    return (loss, *extras) if extras else loss
