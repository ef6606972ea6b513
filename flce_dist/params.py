"""The frozen parameter bundle that travels through the autograd Function.

Every non-tensor option lives here so that ``backward`` returns a short tuple and the kernels
receive one object instead of a dozen flags.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Reduction = Literal["mean", "sum", "none"]
Strategy = Literal["auto", "fused", "recompute"]


@dataclasses.dataclass(frozen=True)
class FLCEParams:
    """Options of one fused-linear-cross-entropy call.

    vocab_start / vocab_size: this rank's first global id and the global vocabulary size.
    strategy: ``"fused"`` forms dlogits while each token chunk is hot (gradient in the forward,
      three matmuls; only for scalar reductions), ``"recompute"`` keeps per-token statistics and
      recomputes logits in the backward (four matmuls, the smallest memory); ``"auto"`` picks fused
      when a gradient is needed and the reduction is a scalar.
    """

    vocab_start: int
    vocab_size: int
    ignore_index: int = -100
    reduction: Reduction = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float = 0.0  # 0 disables
    temperature: float = 1.0
    sequence_parallel: bool = False
    strategy: Strategy = "auto"
    deterministic: bool = False  # dX sums across ranks in rank order, not NCCL's (collectives.py)

    @property
    def logit_scale(self) -> float:
        return 1.0 / self.temperature

    @property
    def needs_sum(self) -> bool:
        return self.label_smoothing > 0.0
