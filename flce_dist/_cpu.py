"""CPU support for Helion's reference mode.

Helion's reference-mode ``hl.dot`` calls ``torch.mm(a, b, out_dtype=...)`` (``aten::mm.dtype``),
which torch 2.13's CPU build does not implement. We register a CPU kernel for it through
``torch.library`` (kernel code stays untouched). Accumulation is float32 (float64 for float64
outputs), matching the GPU's float32-accumulating tensor-core dot.
"""

from __future__ import annotations

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
