"""Helion's reference mode on machines without CUDA: ``setup_reference_mode()``.

Called explicitly by CPU entry points and tests (never on import). It

* sets ``HELION_INTERPRET=1`` (Helion then runs kernels as eager torch code, block by block; it
  must happen before the first kernel is created, which ``kernels/launch.py`` defers to the first
  launch), and
* registers a CPU ``aten::mm.dtype`` through ``torch.library``: reference-mode ``hl.dot`` calls
  ``torch.mm(a, b, out_dtype=...)``, which torch 2.13's CPU build lacks. Accumulation is float32
  (float64 for float64 outputs), matching the GPU's float32-accumulating tensor-core dot.

A first kernel launch on a CPU tensor with ``HELION_INTERPRET=1`` already in the environment (CI, the
tests' subprocesses) runs this itself; without it, that launch raises and says to call it.
"""

from __future__ import annotations

import os

import torch

_LIB: torch.library.Library | None = None


def _mm_dtype_cpu(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    acc = torch.float64 if torch.float64 in (a.dtype, b.dtype, out_dtype) else torch.float32
    return torch.mm(a.to(acc), b.to(acc)).to(out_dtype)


def register_cpu_mm_dtype() -> None:
    """Register ``aten::mm.dtype`` for CPU if this torch build lacks it (idempotent)."""
    global _LIB
    if _LIB is not None:
        return
    a = torch.ones(2, 2, dtype=torch.bfloat16)
    try:
        torch.mm(a, a, out_dtype=torch.float32)
        return  # the build has it
    except (NotImplementedError, RuntimeError, TypeError):
        pass
    _LIB = torch.library.Library("aten", "IMPL")
    _LIB.impl("mm.dtype", _mm_dtype_cpu, "CPU")


def setup_reference_mode() -> None:
    """Run flce_dist's Helion kernels in reference mode on this (CPU) process. Idempotent."""
    os.environ["HELION_INTERPRET"] = "1"
    register_cpu_mm_dtype()


def reference_mode_active() -> bool:
    return os.environ.get("HELION_INTERPRET") == "1"
