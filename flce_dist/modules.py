"""``FusedLinearCrossEntropyLoss`` and ``VocabParallelLMHead``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .api import fused_linear_cross_entropy
from .distributed import group_rank, group_size, vocab_shard


class FusedLinearCrossEntropyLoss(nn.Module):
    """Loss module: ``forward(hidden, weight, target, bias=None)``; options as in
    :func:`fused_linear_cross_entropy` (``ignore_index``, ``reduction``, ``group``, ...)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", group: dist.ProcessGroup | None = None,
                 **options: Any) -> None:
        super().__init__()
        self.ignore_index, self.reduction, self.group, self.options = ignore_index, reduction, group, options
        # validate options eagerly so that a typo fails at construction
        import inspect
        allowed = set(inspect.signature(fused_linear_cross_entropy).parameters) - {"hidden", "weight", "target", "bias"}
        unknown = set(options) - allowed
        if unknown:
            raise TypeError(f"unknown option(s) for FusedLinearCrossEntropyLoss: {sorted(unknown)}")

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
    """

    def __init__(self, hidden_size: int, vocab_size: int, group: dist.ProcessGroup | None = None, bias: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 **loss_options: Any) -> None:
        super().__init__()
        if hidden_size < 1 or vocab_size < 1:
            raise ValueError(f"hidden_size and vocab_size must be >= 1, got {hidden_size}, {vocab_size}")
        self.hidden_size, self.vocab_size, self.group = hidden_size, vocab_size, group
        self.shard = vocab_shard(vocab_size, group_rank(group), group_size(group))
        v_local = self.shard[1] - self.shard[0]
        self.weight = nn.Parameter(torch.empty(v_local, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(v_local, dtype=dtype, device=device)) if bias else None
        self.loss = FusedLinearCrossEntropyLoss(group=group, **loss_options)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        full = torch.empty(self.vocab_size, self.hidden_size, dtype=torch.float32)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        s, e = self.shard
        self.weight.copy_(full[s:e])
        if self.bias is not None:
            b = torch.empty(self.vocab_size, dtype=torch.float32)
            bound = 1 / math.sqrt(self.hidden_size)
            nn.init.uniform_(b, -bound, bound)
            self.bias.copy_(b[s:e])

    def forward(self, hidden: torch.Tensor, target: torch.Tensor | None = None, **overrides: Any):
        if target is None:
            return nn.functional.linear(hidden, self.weight, self.bias)
        return self.loss(hidden, self.weight, target, self.bias, vocab_start=self.shard[0], **overrides)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, shard={self.shard}, bias={self.bias is not None}"
