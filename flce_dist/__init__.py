"""flce_dist: tensor-parallel, vocab-sharded fused linear cross entropy (Helion kernels)."""

from .api import fused_linear_cross_entropy
from .distributed import vocab_shard
from .modules import FusedLinearCrossEntropyLoss, VocabParallelLMHead
from .params import FLCEParams
from .reference import reference_loss

__all__ = [
    "FLCEParams",
    "FusedLinearCrossEntropyLoss",
    "VocabParallelLMHead",
    "fused_linear_cross_entropy",
    "reference_loss",
    "vocab_shard",
]
__version__ = "0.1.0"
