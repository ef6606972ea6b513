"""``FusedLinearCrossEntropyLoss`` and ``VocabParallelLMHead``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .api import _LOGPROB_REFUSED, NON_OPTIONS, _num_items, fused_linear_cross_entropy, logprobs_and_entropy
from .distributed import group_rank, group_size, vocab_shard
from .distributed.dtensor import chunk_span, from_local, is_dtensor, sharded_placements
from .options import LossOptions


class FusedLinearCrossEntropyLoss(nn.Module):
    """Loss module: ``forward(hidden, weight, target, bias=None)``; options as in
    :func:`fused_linear_cross_entropy` (``ignore_index``, ``reduction``, ``group``, ...)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", group: dist.ProcessGroup | None = None,
                 **options: Any) -> None:
        super().__init__()
        self.ignore_index, self.reduction, self.group, self.options = ignore_index, reduction, group, options
        # validate options eagerly so that a typo or a bad value fails at construction
        allowed = set(LossOptions.keywords()) | (set(NON_OPTIONS) - {"hidden", "weight", "target", "bias", "group"})
        unknown = set(options) - allowed
        if unknown:
            raise TypeError(f"unknown option(s) for FusedLinearCrossEntropyLoss: {sorted(unknown)} "
                            f"(allowed: {sorted(allowed)})")
        LossOptions(ignore_index=ignore_index, reduction=reduction,
                    **{k: v for k, v in options.items() if k in LossOptions.keywords()})
        if options.get("num_items_in_batch") is not None:
            _num_items(options["num_items_in_batch"], torch.device("cpu"))

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None, **overrides: Any):
        kw = {"ignore_index": self.ignore_index, "reduction": self.reduction, "group": self.group, **self.options, **overrides}
        return fused_linear_cross_entropy(hidden, weight, target, bias=bias, **kw)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, tp={group_size(self.group)}"


class VocabParallelLMHead(nn.Module):
    """The lm_head of a vocab-sharded model: this rank owns rows ``shard = (start, end)``.

    ``forward(hidden, target)`` returns the fused loss (options from ``loss_options``);
    ``forward(hidden)`` returns this rank's logits shard ``[..., V_local]``.
    Initialisation equals slicing an ``nn.Linear(hidden_size, vocab_size, bias)`` created from the
    same RNG state (the full matrix is drawn on the CPU once, then sliced).

    Two ways to name the tensor-parallel ranks:

    * ``group``: a ProcessGroup; plain-tensor parameters split by :func:`vocab_shard` (the first
      ``V % P`` ranks hold one more row).
    * ``mesh`` (+ ``mesh_dim``, an index or name; optional on a 1-D mesh): a ``DeviceMesh``; the
      parameters are DTensors placed ``Shard(0)`` on that dim and ``Replicate()`` on the others,
      with DTensor's own split (``torch.chunk``: ``ceil(V/P)`` rows on the leading ranks), ready for
      ``fully_shard`` and distributed checkpoints. ``forward(hidden)`` then returns DTensor logits
      placed ``Shard(-1)`` on that dim (``hidden`` plain or a replicated DTensor).
    """

    def __init__(self, hidden_size: int, vocab_size: int, group: dist.ProcessGroup | None = None, bias: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None, *,
                 mesh: Any = None, mesh_dim: int | str | None = None, **loss_options: Any) -> None:
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
                raise ValueError(f"mesh_dim is required on a {mesh.ndim}-D mesh (one of {names or tuple(range(mesh.ndim))})")
            d = 0 if mesh_dim is None else (names.index(mesh_dim) if isinstance(mesh_dim, str) and mesh_dim in names
                                            else mesh_dim)
            if not isinstance(d, int) or not 0 <= d < mesh.ndim:
                raise ValueError(f"mesh_dim must be an index in [0, {mesh.ndim}) or one of {names}, got {mesh_dim!r}")
            self.mesh_dim, p, r = d, mesh.size(d), mesh.get_local_rank(d)
            start, n = chunk_span(vocab_size, p, r)
            self.shard, self.group = (start, start + n), mesh.get_group(d)
        else:
            self.group = group
            self.shard = vocab_shard(vocab_size, group_rank(group), group_size(group))
        v_local = self.shard[1] - self.shard[0]
        self.weight = nn.Parameter(self._dist(torch.empty(v_local, hidden_size, dtype=dtype, device=device)))
        self.bias = nn.Parameter(self._dist(torch.empty(v_local, dtype=dtype, device=device))) if bias else None
        self.loss = FusedLinearCrossEntropyLoss(group=None if mesh is not None else group, **loss_options)
        self.reset_parameters()

    def _dist(self, local: torch.Tensor) -> torch.Tensor:
        if self.mesh is None:
            return local
        return from_local(local, self.mesh, sharded_placements(self.mesh, self.mesh_dim, 0),
                          (self.vocab_size, *local.shape[1:]))

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if is_dtensor(t) else t

    @torch.no_grad()
    def reset_parameters(self) -> None:
        full = torch.empty(self.vocab_size, self.hidden_size, dtype=torch.float32)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        s, e = self.shard
        self._local(self.weight).copy_(full[s:e])
        if self.bias is not None:
            b = torch.empty(self.vocab_size, dtype=torch.float32)
            bound = 1 / math.sqrt(self.hidden_size)
            nn.init.uniform_(b, -bound, bound)
            self._local(self.bias).copy_(b[s:e])

    def forward(self, hidden: torch.Tensor, target: torch.Tensor | None = None, **overrides: Any):
        if target is not None:
            if self.mesh is not None:  # DTensor parameters: the layout comes from them
                return self.loss(hidden, self.weight, target, self.bias, **overrides)
            return self.loss(hidden, self.weight, target, self.bias,
                             **{"vocab_start": self.shard[0], "vocab_size": self.vocab_size, **overrides})
        if self.mesh is None:
            return nn.functional.linear(hidden, self.weight, self.bias)
        from torch.distributed.tensor import Replicate

        if is_dtensor(hidden):
            if any(not isinstance(pl, Replicate) for pl in hidden.placements):
                raise ValueError(f"logits need a replicated hidden, got placements {tuple(hidden.placements)}")
            hidden = hidden.to_local()
        local = nn.functional.linear(hidden, self._local(self.weight), None if self.bias is None else self._local(self.bias))
        return from_local(local, self.mesh, sharded_placements(self.mesh, self.mesh_dim, local.dim() - 1),
                          (*local.shape[:-1], self.vocab_size))

    def logprobs_and_entropy(self, hidden: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                             **overrides: Any):
        """``(logp, entropy)`` per token, both differentiable (see :func:`flce_dist.logprobs_and_entropy`),
        over the global vocabulary with this head's group or mesh; the loss options that apply
        (``ignore_index``, ``softcap``, ``sequence_parallel``, ...) come from ``loss_options`` and
        ``overrides``."""
        kw = {k: v for k, v in {"ignore_index": self.loss.ignore_index, "group": self.loss.group, **self.loss.options,
                                **overrides}.items() if k not in _LOGPROB_REFUSED}
        if self.mesh is None:
            kw = {"vocab_start": self.shard[0], "vocab_size": self.vocab_size, **kw}
        return logprobs_and_entropy(hidden, self.weight, target, temperature=temperature, bias=self.bias, **kw)

    def extra_repr(self) -> str:
        where = f", mesh_dim={self.mesh_dim}" if self.mesh is not None else ""
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, shard={self.shard}, "
                f"bias={self.bias is not None}{where}")
