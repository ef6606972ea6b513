"""Helion's reference mode on machines without CUDA: ``setup_reference_mode()``.

Called explicitly by CPU entry points and tests (never on import). It

* puts this process's flce_dist kernels in Helion's reference mode (``ref_mode=RefMode.EAGER``:
  Helion runs them as eager torch code, block by block): kernels made later take it from
  ``kernels/common.py``'s settings, kernels already made are switched (and their compiled bindings
  dropped). It leaves the environment alone: no ``HELION_INTERPRET`` is written, so the program's
  own Helion kernels and its child processes are not switched with it; and
* registers a CPU ``aten::mm.dtype`` through ``torch.library``: reference-mode ``hl.dot`` calls
  ``torch.mm(a, b, out_dtype=...)``, which torch 2.13's CPU build lacks. Accumulation is float32
  (float64 for float64 outputs), matching the GPU's float32-accumulating tensor-core dot.

``HELION_INTERPRET=1`` in the environment (CI, the tests' subprocesses; read once, by Helion when a
kernel is made and here at the first check) means the same: a first kernel launch on a CPU tensor
then runs this itself; without either, that launch raises and says to call it.
"""

from __future__ import annotations

import os
import sys

import torch

_LIB: torch.library.Library | None = None
_REQUESTED = False  # setup_reference_mode() was called
_ENV: bool | None = None  # HELION_INTERPRET=1 in the environment (read once)


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
    """Run flce_dist's Helion kernels in reference mode in this (CPU) process. Idempotent; writes no
    environment variable."""
    global _REQUESTED
    if _REQUESTED:
        return
    _REQUESTED = True
    register_cpu_mm_dtype()
    _switch_made_kernels()


def reference_mode_active() -> bool:
    global _ENV
    if _ENV is None:
        _ENV = os.environ.get("HELION_INTERPRET") == "1"
    return _REQUESTED or _ENV


def helion_settings() -> dict:
    """Keyword settings of the package's ``@helion.kernel`` decorators for the current mode."""
    if not reference_mode_active():
        return {}  # Helion's own defaults (it reads HELION_INTERPRET itself)
    from ._helion_compat import helion

    return {"ref_mode": helion.RefMode.EAGER}


def _switch_made_kernels() -> None:
    """Kernels made before reference mode was asked for (their module imported): switch them."""
    if "helion" not in sys.modules:
        return  # no kernel made yet
    from ._helion_compat import helion

    from helion.runtime.kernel import Kernel

    prefix = __name__.rsplit(".", 1)[0] + ".kernels."
    common = sys.modules.get(prefix + "common")
    if common is not None:  # kernel modules imported from now on read it when their kernels are made
        common.SETTINGS["ref_mode"] = helion.RefMode.EAGER
    for name, mod in list(sys.modules.items()):
        if not name.startswith(prefix) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, Kernel) and obj.settings.ref_mode != helion.RefMode.EAGER:
                obj.settings.ref_mode = helion.RefMode.EAGER
                obj.reset()  # bindings compiled for the other mode
