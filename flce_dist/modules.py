"""``FusedLinearCrossEntropyLoss`` and ``VocabParallelLMHead``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .api import _LOGPROB_REFUSED, NON_OPTIONS, _num_items, fused_linear_cross_entropy, logprobs_and_entropy
from .distributed import CopyToGroup, group_rank, group_size, vocab_shard
from .distributed.dtensor import chunk_span, from_local, is_dtensor, sharded_placements
from .distributed.shard import local_rows
from .options import LossOptions


class FusedLinearCrossEntropyLoss(nn.Module):
    """Loss module: ``forward(hidden, weight, target, bias=None)``; options as in
    :func:`fused_linear_cross_entropy` (``ignore_index``, ``reduction``, ``group``, ...)."""

    def __init__(
        self, ignore_index: int = -100, reduction: str = "mean", group: dist.ProcessGroup | None = None, **options: Any
    ) -> None:
        super().__init__()
        self.ignore_index, self.reduction, self.group, self.options = ignore_index, reduction, group, options
        # validate options eagerly so that a typo or a bad value fails at construction
        allowed = set(LossOptions.keywords()) | (set(NON_OPTIONS) - {"hidden", "weight", "target", "bias", "group"})
        unknown = set(options) - allowed
        if unknown:
            raise TypeError(
                f"unknown option(s) for FusedLinearCrossEntropyLoss: {sorted(unknown)} (allowed: {sorted(allowed)})"
            )
        LossOptions(
            ignore_index=ignore_index,
            reduction=reduction,
            **{k: v for k, v in options.items() if k in LossOptions.keywords()},
        )
        if options.get("num_items_in_batch") is not None:
            _num_items(options["num_items_in_batch"], torch.device("cpu"))

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        **overrides: Any,
    ):
        kw = {
            "ignore_index": self.ignore_index,
            "reduction": self.reduction,
            "group": self.group,
            **self.options,
            **overrides,
        }
        return fused_linear_cross_entropy(hidden, weight, target, bias=bias, **kw)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, tp={group_size(self.group)}"


# rows drawn per block while streaming an initialisation (about 16 MiB of float32 at any H)
_INIT_BLOCK_ELEMENTS = 1 << 22


@torch.no_grad()
def uniform_rows_(out: torch.Tensor, start: int, total_rows: int, bound: float) -> torch.Tensor:
    """Fill ``out [n, ...]`` with rows ``[start, start + n)`` of ``torch.empty(total_rows, *out.shape[1:])
    .uniform_(-bound, bound)`` (float32, drawn on the CPU from the default generator), without forming it.

    The draws are made in blocks of about ``_INIT_BLOCK_ELEMENTS`` values in row order, which consumes
    the generator exactly as one ``uniform_`` of the whole matrix does (CPU ``uniform_`` draws one
    value per element, serially; ``tests/test_heads.py`` checks it). Every rank draws all
    ``total_rows`` rows (the time of the full draw) and keeps only its own: peak memory one block
    plus ``out``, and the generator ends where ``nn.Linear``'s initialisation leaves it."""
    per_block = max(1, _INIT_BLOCK_ELEMENTS // max(math.prod(out.shape[1:]), 1))
    end = start + out.shape[0]
    for r0 in range(0, total_rows, per_block):
        r1 = min(total_rows, r0 + per_block)
        block = torch.empty((r1 - r0, *out.shape[1:]), dtype=torch.float32).uniform_(-bound, bound)
        lo, hi = max(r0, start), min(r1, end)
        if lo < hi:
            out[lo - start : hi - start].copy_(block[lo - r0 : hi - r0])
    return out


class VocabParallelLMHead(nn.Module):
    """The lm_head of a vocab-sharded model: this rank owns rows ``shard = (start, end)``.

    Two ways to name the tensor-parallel ranks (P of them):

    * ``group``: a ProcessGroup; ``weight`` is a plain ``[V_local, H]`` Parameter.
    * ``mesh`` (+ ``mesh_dim``, an index or name; optional on a 1-D mesh): a ``DeviceMesh``; the
      parameters are DTensors placed ``Shard(0)`` on that dim and ``Replicate()`` on the others, ready
      for ``fully_shard`` and distributed checkpoints.

    Layout, the same for both: DTensor's split, ``vocab_shard(V, rank, P, split="chunk")``: rank ``r``
    owns ``[min(r c, V), min((r + 1) c, V))`` with ``c = ceil(V / P)`` (the last ranks may hold fewer
    rows, or none). So a ``group=`` head and a ``mesh=`` head of the same ``(V, P)`` hold the same
    rows, and their state dicts interchange: ``load_state_dict`` takes this rank's rows (a plain
    ``[V_local, ...]`` tensor), a ``Shard(0)`` DTensor of the same split, or the full ``[V, ...]``
    tensor (an ``nn.Linear``'s, a gathered checkpoint), whose rows it slices. ``state_dict`` holds
    this rank's rows (plain, or the DTensor): no collective.

    Initialisation: equal to slicing an ``nn.Linear(hidden_size, vocab_size, bias)`` created from the
    same CPU RNG state, at every P (rows drawn in float32 on the CPU, then cast to ``dtype`` and moved
    to ``device``). Each rank streams the full draw in blocks (:func:`uniform_rows_`) and keeps its
    rows: memory ``[V_local, H]`` plus one block, never a ``[V, H]`` matrix; the RNG ends where
    ``nn.Linear``'s leaves it. ``device="meta"`` draws nothing (as ``nn.Linear`` on meta); call
    ``reset_parameters()`` after ``to_empty``.

    ``forward(hidden, target)``: the fused loss (options from ``loss_options``, ``overrides`` per call),
    with the loss's collectives (:func:`flce_dist.fused_linear_cross_entropy`).

    ``forward(hidden)``: this rank's logits ``hidden @ W_r.T (+ b_r)``, ``[..., V_local]`` (with
    ``mesh``: a DTensor ``[..., V]`` placed ``Shard(-1)`` on the mesh dim; ``hidden`` plain or a
    ``Replicate()`` DTensor on the mesh). ``hidden`` is taken as replicated over the group, as
    Megatron's ``ColumnParallelLinear`` takes it: identity forward, and the backward all-reduces its
    gradient (one all-reduce of hidden's size, ``N * H`` elements) so that every rank gets the full
    ``sum_r dz_r @ W_r``, the gradient of a loss of the full logits (``distributed.CopyToGroup``;
    a ``Replicate()`` DTensor hidden gets that sum as its ``Replicate()`` gradient). The loss on the
    logits must be the same on every rank (e.g. computed after gathering the vocabulary, or a
    vocab-parallel loss that reduces over the group).
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        group: dist.ProcessGroup | None = None,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        mesh: Any = None,
        mesh_dim: int | str | None = None,
        **loss_options: Any,
    ) -> None:
        super().__init__()
        if hidden_size < 1 or vocab_size < 1:
            raise ValueError(f"hidden_size and vocab_size must be >= 1, got {hidden_size}, {vocab_size}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.mesh, self.mesh_dim = mesh, None
        if mesh is not None:
            if group is not None:
                raise ValueError("pass either group or mesh, not both (the mesh dim names the group)")
            names = mesh.mesh_dim_names or ()
            if mesh_dim is None and mesh.ndim != 1:
                raise ValueError(
                    f"mesh_dim is required on a {mesh.ndim}-D mesh (one of {names or tuple(range(mesh.ndim))})"
                )
            d = (
                0
                if mesh_dim is None
                else (names.index(mesh_dim) if isinstance(mesh_dim, str) and mesh_dim in names else mesh_dim)
            )
            if not isinstance(d, int) or not 0 <= d < mesh.ndim:
                raise ValueError(f"mesh_dim must be an index in [0, {mesh.ndim}) or one of {names}, got {mesh_dim!r}")
            self.mesh_dim, p, r, self.group = d, mesh.size(d), mesh.get_local_rank(d), mesh.get_group(d)
        else:
            self.group, p, r = group, group_size(group), group_rank(group)
        self.shard = vocab_shard(vocab_size, r, p, split="chunk")
        v_local = self.shard[1] - self.shard[0]
        self.weight = nn.Parameter(self._dist(torch.empty(v_local, hidden_size, dtype=dtype, device=device)))
        self.bias = nn.Parameter(self._dist(torch.empty(v_local, dtype=dtype, device=device))) if bias else None
        self.loss = FusedLinearCrossEntropyLoss(group=None if mesh is not None else group, **loss_options)
        self.register_load_state_dict_pre_hook(_load_rows_hook)
        self.reset_parameters()

    def _dist(self, local: torch.Tensor) -> torch.Tensor:
        if self.mesh is None:
            return local
        assert self.mesh_dim is not None  # set with the mesh
        return from_local(
            local, self.mesh, sharded_placements(self.mesh, self.mesh_dim, 0), (self.vocab_size, *local.shape[1:])
        )

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if is_dtensor(t) else t

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation, this rank's rows only (see the class docstring)."""
        weight = self._local(self.weight)
        if weight.device.type == "meta":
            return
        s, _ = self.shard
        # nn.init.kaiming_uniform_(a=sqrt(5)), as nn.Linear.reset_parameters computes its bound
        gain = nn.init.calculate_gain("leaky_relu", math.sqrt(5))
        bound = math.sqrt(3.0) * (gain / math.sqrt(self.hidden_size))
        uniform_rows_(weight, s, self.vocab_size, bound)
        if self.bias is not None:
            uniform_rows_(self._local(self.bias), s, self.vocab_size, 1 / math.sqrt(self.hidden_size))

    def _rows_for_load(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """What ``load_state_dict`` copies into parameter ``name``: this rank's rows of ``value``
        (this rank's rows already, a Shard(0) DTensor of the chunk split, or the full tensor)."""
        s, e = self.shard
        local_shape = tuple(self._local(getattr(self, name)).shape)
        if is_dtensor(value):
            if tuple(value.shape[:1]) != (self.vocab_size,):
                return value  # load_state_dict reports the shape mismatch
            local = value.to_local()
            if tuple(local.shape) == tuple(value.shape):  # replicated: the full tensor
                local = local[s:e]
            elif not _same_chunk_rows(value, self.shard):
                raise ValueError(
                    f"{name}: the DTensor's rows on this rank are not this head's rows {self.shard} "
                    f"(placements {tuple(value.placements)}); load a DTensor of the same split, the "
                    "full tensor, or this rank's rows"
                )
            value = local
        else:
            value = local_rows(value, self.vocab_size, self.shard, local_shape)
        return self._dist(value) if self.mesh is not None and tuple(value.shape) == local_shape else value

    def forward(self, hidden: torch.Tensor, target: torch.Tensor | None = None, **overrides: Any):
        if target is not None:
            if self.mesh is not None:  # DTensor parameters: the layout comes from them
                return self.loss(hidden, self.weight, target, self.bias, **overrides)
            return self.loss(
                hidden,
                self.weight,
                target,
                self.bias,
                **{"vocab_start": self.shard[0], "vocab_size": self.vocab_size, **overrides},
            )
        if overrides:
            raise TypeError(f"loss options {sorted(overrides)} go with a target; forward(hidden) returns logits")
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's logits; hidden's gradient all-reduced over the group (class docstring)."""
        if self.loss.options.get("sequence_parallel"):
            raise ValueError(
                "forward(hidden) without a target needs the replicated hidden of every token; this "
                "head has sequence_parallel=True: all-gather hidden over the group first"
            )
        if self.mesh is None:
            x = hidden if group_size(self.group) == 1 else CopyToGroup.apply(hidden, self.group)
            return nn.functional.linear(x, self.weight, self.bias)
        from torch.distributed.tensor import Replicate

        if is_dtensor(hidden):
            if hidden.device_mesh != self.mesh:
                raise ValueError(f"hidden is a DTensor on mesh {hidden.device_mesh}, the head's is {self.mesh}")
            if any(not isinstance(pl, Replicate) for pl in hidden.placements):
                raise ValueError(f"logits need a replicated hidden, got placements {tuple(hidden.placements)}")
            hidden = hidden.to_local()  # its gradient comes back Replicate(): CopyToGroup made it the sum
        assert self.mesh_dim is not None  # set with the mesh
        x = CopyToGroup.apply(hidden, self.group)
        local = nn.functional.linear(x, self._local(self.weight), None if self.bias is None else self._local(self.bias))
        return from_local(
            local,
            self.mesh,
            sharded_placements(self.mesh, self.mesh_dim, local.dim() - 1),
            (*local.shape[:-1], self.vocab_size),
        )

    def logprobs_and_entropy(
        self, hidden: torch.Tensor, target: torch.Tensor, temperature: float | None = None, **overrides: Any
    ):
        """``(logp, entropy)`` per token, both differentiable (see :func:`flce_dist.logprobs_and_entropy`),
        over the global vocabulary with this head's group or mesh and the loss's logits ``y =
        softcap(z) / temperature``. ``temperature`` (None: the head's ``loss_options`` value, else
        1.0) and ``overrides`` (``ignore_index``, ``softcap``, ``sequence_parallel``, ...) win over the
        head's ``loss_options``. Options that make the loss something other than a log-probability
        (``label_smoothing``, ``z_loss``, ``num_items_in_batch``, the extra outputs) raise a
        ``ValueError`` naming them when the head's ``loss_options`` set them (pass their default, e.g.
        ``label_smoothing=0.0``, to compute the log-probs without them) and a ``TypeError`` when a
        call passes another value; ``strategy`` (how, not what) is ignored: the entropy's backward is
        the recompute strategy's. Collectives: the loss's (one ``[N, 5]`` all-gather forward, one dX
        all-reduce backward)."""
        kw = {"ignore_index": self.loss.ignore_index, **self.loss.options}
        if temperature is not None:
            kw["temperature"] = temperature
        kw.pop("strategy", None)
        for name in _LOGPROB_REFUSED:
            if name not in kw and name not in overrides:
                continue
            default = LOGPROB_NEUTRAL.get(name)
            if name in overrides and overrides[name] == default:
                overrides = {k: v for k, v in overrides.items() if k != name}
                kw.pop(name, None)
            elif name in kw and name not in overrides:
                if kw[name] != default:
                    raise ValueError(
                        f"VocabParallelLMHead.logprobs_and_entropy: the head's loss_options set "
                        f"{name}={kw[name]!r}, which log-probabilities cannot include; pass "
                        f"{name}={default!r} to compute them without it"
                    )
                kw.pop(name)
        kw.update(overrides)  # a refused option still here: the functional API's TypeError names it
        if self.mesh is None:
            kw = {"group": self.group, "vocab_start": self.shard[0], "vocab_size": self.vocab_size, **kw}
        return logprobs_and_entropy(hidden, self.weight, target, bias=self.bias, **kw)

    def extra_repr(self) -> str:
        where = f", mesh_dim={self.mesh_dim}" if self.mesh is not None else ""
        return (
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, shard={self.shard}, "
            f"bias={self.bias is not None}{where}"
        )


# the value of each option logprobs_and_entropy refuses at which it changes nothing
LOGPROB_NEUTRAL = {
    "reduction": "none",
    "label_smoothing": 0.0,
    "z_loss": 0.0,
    "return_lse": False,
    "return_token_accuracy": False,
    "return_entropy": True,
    "num_items_in_batch": None,
    "strategy": "auto",
}


def _same_chunk_rows(value: Any, shard: tuple[int, int]) -> bool:
    """Whether a Shard(0) DTensor's local rows on this rank are ``shard`` (DTensor's chunk split)."""
    from torch.distributed.tensor import Shard

    mesh = value.device_mesh
    dims = [d for d, pl in enumerate(value.placements) if isinstance(pl, Shard) and pl.dim == 0]
    if len(dims) != 1:
        return False
    start, n = chunk_span(value.shape[0], mesh.size(dims[0]), mesh.get_local_rank(dims[0]))
    return (start, start + n) == tuple(shard) and value.to_local().shape[0] == n


def _load_rows_hook(module: VocabParallelLMHead, state_dict: dict, prefix: str, *args: Any) -> None:
    for name in ("weight", "bias"):
        key = prefix + name
        if getattr(module, name) is not None and isinstance(state_dict.get(key), torch.Tensor):
            state_dict[key] = module._rows_for_load(name, state_dict[key])
