"""Helion kernels of flce_dist (one kernel per file; no torch.distributed here).

Importing this package on a machine without CUDA switches Helion to its reference mode
(``HELION_INTERPRET=1``) and registers the CPU ``aten::mm.dtype`` that ref-mode ``hl.dot`` needs.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("HELION_INTERPRET", "1")

from .._cpu import register_cpu_mm_dtype  # noqa: E402

register_cpu_mm_dtype()

from .chunk_grad import chunk_grad_  # noqa: E402
from .chunk_stats import chunk_stats  # noqa: E402
from .lse_forward import lse_forward_partials  # noqa: E402

__all__ = ["chunk_grad_", "chunk_stats", "lse_forward_partials"]
