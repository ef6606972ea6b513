"""DTensor inputs: read the vocab-parallel layout off ``weight`` and ``hidden`` placements.

The loss itself runs on local tensors (``to_local()``, which is differentiable: autograd hands the
local gradients back as DTensors with the inputs' placements). Nothing here moves data: no
``full_tensor()``, no redistribute; the only collectives are the loss's own (``collectives.py``).

Layouts accepted (mesh of any number of dims; ``d`` = the one dim on which ``weight`` is sharded):

  weight [V, H]  ``Shard(0)`` on mesh dim ``d``, ``Replicate()`` on every other dim (the vocab is
                 split over the ranks of dim ``d``; the other dims hold copies, e.g. ``dp`` after
                 FSDP's all-gather). The split may be DTensor's own (``torch.chunk``: the leading
                 ranks hold ``ceil(V/P)`` rows, the last ones fewer or none) or any contiguous
                 split in rank order such as ``vocab_shard``'s (a DTensor built with
                 ``from_local(..., shape=...)``): every rank's ``vocab_start`` is the sum of the
                 shard sizes of the ranks before it along dim ``d``, checked once per layout to
                 add up to the DTensor's global ``V`` (``resolve_shard``). All-``Replicate`` weight: no
                 vocab parallelism (single-rank math on the local copy).
  bias [V]       a DTensor with exactly the weight's mesh and placements.
  hidden [..., H] a plain tensor (replicated by contract), or a DTensor on the weight's mesh with
                 ``Replicate()`` on every dim, or ``Shard(k)`` on dim ``d`` (``k`` a token dim, not
                 the last): sequence parallelism, chosen from the placement. Uneven token splits
                 (``torch.chunk`` semantics) are padded to ``ceil(T/P)`` rows with ignored targets
                 (a copy of this rank's slice, only when the split is uneven).
  target         a plain tensor of hidden's global leading shape (sliced here like hidden), of its
                 local leading shape, or a DTensor placed like hidden's leading dims.

Outputs: a scalar loss is a plain tensor, identical on every rank; per-token outputs
(``reduction="none"``, lse, token accuracy) are DTensors placed like hidden's leading dims when
hidden is a DTensor, plain tensors otherwise.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor, Placement
    from typing_extensions import TypeIs  # typing's from Python 3.13; torch depends on typing_extensions


def is_dtensor(t: object) -> TypeIs[DTensor]:
    """Without importing DTensor (~1 s): no tensor is a DTensor before its module is loaded."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _dim_name(mesh, d: int) -> str:
    names = mesh.mesh_dim_names
    return repr(names[d]) if names else str(d)


def chunk_span(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` of ``torch.chunk(range(size), parts)`` (DTensor's
    ``Shard`` split): pieces of ``ceil(size / parts)``, the last ones shorter or empty."""
    step = -(-size // parts) if size else 0
    start = min(index * step, size)
    return start, max(0, min(size - start, step))


def from_local(local: torch.Tensor, mesh, placements, global_shape) -> torch.Tensor:
    """``DTensor.from_local`` with the global shape and its contiguous stride given (uneven splits
    allowed; no collective)."""
    from torch.distributed.tensor import DTensor

    shape = torch.Size(global_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def sharded_placements(mesh, mesh_dim: int, tensor_dim: int) -> list[Placement]:
    """``Shard(tensor_dim)`` on ``mesh_dim``, ``Replicate()`` on every other mesh dim."""
    from torch.distributed.tensor import Replicate, Shard

    placements: list[Placement] = [Replicate()] * mesh.ndim
    placements[mesh_dim] = Shard(tensor_dim)
    return placements


@dataclasses.dataclass
class LocalCall:
    """Local tensors and the layout facts the loss needs, plus how to wrap per-token outputs."""

    hidden: torch.Tensor  # [..., H] local (padded under uneven sequence parallelism)
    weight: torch.Tensor  # [V_r, H] local rows
    bias: torch.Tensor | None
    target: torch.Tensor  # local leading shape of ``hidden``
    group: dist.ProcessGroup | None
    vocab_size: int | None  # the DTensor's global V, checked against the resolved shards
    sequence_parallel: bool
    wrap_tokens: Callable[[torch.Tensor], torch.Tensor]  # [N_padded] per-token -> output tensor


def _weight_layout(weight) -> int | None:
    """The mesh dim on which ``weight`` is ``Shard(0)`` (None: replicated everywhere)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, dims = weight.device_mesh, []
    for d, pl in enumerate(weight.placements):
        if isinstance(pl, Shard) and pl.dim == 0:
            dims.append(d)
        elif not isinstance(pl, Replicate):
            raise ValueError(
                f"weight must be a DTensor placed Shard(0) on one mesh dim and Replicate() on the others, got "
                f"{tuple(weight.placements)} on mesh dims {mesh.mesh_dim_names or tuple(range(mesh.ndim))}"
            )
    if len(dims) > 1:
        raise ValueError(
            f"weight is sharded on the vocab dim over several mesh dims {dims}: shard it over one "
            f"(the tensor-parallel dim) and replicate it over the others, got {tuple(weight.placements)}"
        )
    return dims[0] if dims else None


def unwrap(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    vocab_start: int | None,
    sequence_parallel: bool,
    ignore_index: int,
) -> LocalCall:
    """Resolve a call with DTensor ``weight`` (and optionally ``hidden``/``bias``/``target``) into
    local tensors, the tensor-parallel group, and an output wrapper. See the module docstring."""
    from torch.distributed.tensor import Replicate, Shard

    if not is_dtensor(weight):
        for name, t in (("hidden", hidden), ("bias", bias), ("target", target)):
            if is_dtensor(t):
                raise TypeError(
                    f"{name} is a DTensor but weight is not: pass weight as a DTensor placed Shard(0) "
                    f"on the tensor-parallel mesh dim (the group comes from its mesh)"
                )
        raise AssertionError("unwrap() called without a DTensor")  # api.py only calls it with one
    mesh = weight.device_mesh
    d = _weight_layout(weight)
    tp_group = None if d is None else mesh.get_group(d)
    if group is not None and group is not tp_group:
        raise ValueError(
            "group must be None when weight is a DTensor: the group is the mesh dim on which weight is "
            "Shard(0)" + ("" if d is None else f" (mesh dim {_dim_name(mesh, d)})")
        )
    if vocab_start is not None:
        raise ValueError(
            "vocab_start must be None when weight is a DTensor: each rank's start comes from the shard "
            "sizes along the mesh"
        )
    w_local = weight.to_local()
    b_local = None
    if bias is not None:
        if not is_dtensor(bias) or bias.device_mesh != mesh or tuple(bias.placements) != tuple(weight.placements):
            got = (
                f"{tuple(bias.placements)} on another mesh"
                if is_dtensor(bias) and bias.device_mesh != mesh
                else tuple(bias.placements)
                if is_dtensor(bias)
                else "a plain tensor"
            )
            raise ValueError(
                f"bias must be a DTensor on weight's mesh with weight's placements "
                f"{tuple(weight.placements)}, got {got}"
            )
        b_local = bias.to_local()
    p = 1 if d is None else mesh.size(d)
    rank = 0 if d is None else mesh.get_local_rank(d)

    if not is_dtensor(hidden):
        if is_dtensor(target):
            raise TypeError("target is a DTensor but hidden is not: pass both as DTensors, or both as plain tensors")
        return LocalCall(
            hidden, w_local, b_local, target, tp_group, weight.shape[0], bool(sequence_parallel), lambda t: t
        )

    # ---- hidden is a DTensor: sequence parallelism from its placement
    if hidden.device_mesh != mesh:
        raise ValueError(f"hidden is a DTensor on mesh {hidden.device_mesh} but weight is on {mesh}: use one mesh")
    seq_dim = None
    for e, pl in enumerate(hidden.placements):
        if isinstance(pl, Replicate):
            continue
        if e == d and isinstance(pl, Shard) and pl.dim % hidden.dim() < hidden.dim() - 1:
            seq_dim = pl.dim % hidden.dim()
            continue
        raise ValueError(
            f"hidden must be a DTensor with Replicate() on every mesh dim, or Shard(k) over a token dim k on the "
            f"weight's sharded dim {_dim_name(mesh, d) if d is not None else '(none)'}: got {tuple(hidden.placements)}"
        )
    if sequence_parallel and seq_dim is None:
        raise ValueError(
            "sequence_parallel=True but hidden is a replicated DTensor: sequence parallelism is taken "
            "from hidden's placement (Shard over a token dim)"
        )
    lead_placements = [Shard(pl.dim) if isinstance(pl, Shard) else pl for pl in hidden.placements]
    global_lead = tuple(hidden.shape[:-1])
    h_local = hidden.to_local()
    local_lead = tuple(h_local.shape[:-1])

    # target: DTensor placed like hidden, plain global shape (sliced like hidden), or plain local shape
    if is_dtensor(target):
        if target.device_mesh != mesh or tuple(target.placements) != tuple(lead_placements):
            raise ValueError(
                f"target must be placed like hidden's leading dims {tuple(lead_placements)} on its mesh, "
                f"got {tuple(target.placements)}"
            )
        t_local = target.to_local()
    elif tuple(target.shape) == global_lead:
        t_local = target
        if seq_dim is not None:
            s, n = chunk_span(global_lead[seq_dim], p, rank)
            t_local = target.narrow(seq_dim, s, n)
    elif tuple(target.shape) == local_lead:
        t_local = target
    else:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal hidden's global leading shape {global_lead} "
            f"or its local leading shape {local_lead}"
        )

    def wrap(rows: torch.Tensor) -> torch.Tensor:
        n = 1
        for s in local_lead:
            n *= s
        return from_local(rows[:n].reshape(local_lead), mesh, lead_placements, global_lead)

    if seq_dim is None or p == 1:
        return LocalCall(h_local, w_local, b_local, t_local, tp_group, weight.shape[0], False, wrap)
    # sequence parallel: every rank must pass the same number of rows; pad an uneven torch.chunk split
    others = 1
    for i, s in enumerate(local_lead):
        others *= 1 if i == seq_dim else s
    n_local, n_pad = others * local_lead[seq_dim], others * -(-global_lead[seq_dim] // p)
    h2, t2 = h_local.reshape(n_local, h_local.shape[-1]), t_local.reshape(n_local)
    if n_pad != n_local:
        h2 = torch.cat([h2, h2.new_zeros(n_pad - n_local, h2.shape[1])])
        t2 = torch.cat([t2, t2.new_full((n_pad - n_local,), ignore_index)])
    return LocalCall(h2, w_local, b_local, t2, tp_group, weight.shape[0], True, wrap)
