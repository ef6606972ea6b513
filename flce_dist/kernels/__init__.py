"""Helion kernels of flce_dist (one kernel per file; no torch.distributed here).

Importing this package on a machine without CUDA switches Helion to its reference mode
(``HELION_INTERPRET=1``) and registers the CPU ``aten::mm.dtype`` that ref-mode ``hl.dot`` needs.
"""

from __future__ import annotations

import os
import warnings

import helion
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("HELION_INTERPRET", "1")

# Helion 1.4 on torch < 2.13 (no ``is_symm_mem_tensor``) treats every kernel compiled inside an
# initialised process group as a symmetric-memory kernel: it then warns that no process-group
# argument was found and that its autotuner's SM multiplier is capped. These kernels use no
# symmetric memory, take shipped configs and never autotune, so both messages are noise
# (they printed once per kernel and rank in every TP run on the H200).
SETTINGS = dict(ignore_warnings=[helion.exc.ProcessGroupNameNotFound])
warnings.filterwarnings("ignore", message="max_num_sm_multipler is reduced", category=UserWarning)

from .._cpu import register_cpu_mm_dtype  # noqa: E402

register_cpu_mm_dtype()

from .chunk_grad import chunk_grad_  # noqa: E402
from .chunk_stats import chunk_stats  # noqa: E402
from .lse_forward import lse_forward_partials  # noqa: E402

__all__ = ["chunk_grad_", "chunk_stats", "lse_forward_partials"]
