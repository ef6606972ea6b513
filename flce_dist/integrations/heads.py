"""How the fused loss finds an lm_head's vocabulary shard: a registry of finders.

``head_shard(head)`` asks each registered finder in turn (newest first); the first that recognises
the module returns a :class:`HeadShard`. Each integration registers the heads it knows
(``transformers.py``: heads it sharded itself and ``VocabParallelLMHead``; ``deepspeed.py``: AutoTP's
vocab-parallel and column-parallel heads). A head that no finder claims is a full, unsharded
``[V, H]`` weight, or a DTensor weight, which carries its own layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn


@dataclasses.dataclass
class HeadShard:
    weight: torch.Tensor
    bias: torch.Tensor | None
    group: dist.ProcessGroup | None = None
    vocab_start: int | None = None
    vocab_size: int | None = None  # the global V: states the layout (the shard check then runs once, not per N)


Finder = Callable[[nn.Module], "HeadShard | None"]
_FINDERS: list[Finder] = []


def register_head_shard(finder: Finder) -> Finder:
    """Register ``finder(head) -> HeadShard | None`` (usable as a decorator; idempotent)."""
    if finder not in _FINDERS:
        _FINDERS.insert(0, finder)
    return finder


def head_shard(head: nn.Module) -> HeadShard:
    for finder in _FINDERS:
        found = finder(head)
        if found is not None:
            return found
    return HeadShard(cast(torch.Tensor, head.weight), getattr(head, "bias", None))
