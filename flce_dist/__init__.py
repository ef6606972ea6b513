"""flce_dist: tensor-parallel, vocab-sharded fused linear cross entropy (Helion kernels).

Importing the package changes nothing in the process: Helion is imported at the first kernel
launch, and CPU machines call :func:`setup_reference_mode` (Helion's reference mode) explicitly.
No loss call changes torch's objects either (``distributed/groups.py``).
"""

from .api import fused_linear_cross_entropy, logprobs_and_entropy
from .distributed import vocab_shard
from .modules import FusedLinearCrossEntropyLoss, VocabParallelLMHead
from .options import FLCEParams, LossOptions
from .reference import reference_logprobs_and_entropy, reference_loss
from .reference_mode import setup_reference_mode
from .settings import Settings, override

__all__ = [
    "FLCEParams",
    "FusedLinearCrossEntropyLoss",
    "LossOptions",
    "Settings",
    "VocabParallelLMHead",
    "fused_linear_cross_entropy",
    "logprobs_and_entropy",
    "override",
    "reference_logprobs_and_entropy",
    "reference_loss",
    "setup_reference_mode",
    "vocab_shard",
]
__version__ = "0.2.0.dev0"  # the one place: pyproject.toml reads it; CHANGELOG.md says what each version holds
