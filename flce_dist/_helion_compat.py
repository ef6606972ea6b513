"""Import Helion on the torch the user already has: flce_dist's one compatibility step.

Every module of flce_dist that needs Helion imports it through this module (``from .._helion_compat
import helion``), so the step below runs once, before the first ``import helion`` of the process that
goes through flce_dist, and never at ``import flce_dist`` (Helion is imported at the first kernel
launch).

The supported ranges (``pyproject.toml``; tested combinations in the README's support matrix) are
torch >= 2.11, < 2.16 and helion >= 1.4, < 1.6. Package metadata cannot tie one package's version to
another's, so the one combination that needs help is handled here:

* **helion 1.5.x on a torch without ``IntelGPUError``** (torch 2.11, the GPU image): helion 1.5's
  ``helion/autotuner/logger.py`` runs ``from torch._inductor.runtime.triton_compat import
  IntelGPUError`` at import, a name that torch 2.11's ``triton_compat`` does not define, so ``import
  helion`` raises ``ImportError``. Before importing helion, this module adds exactly that one name to
  ``torch._inductor.runtime.triton_compat``: a plain ``Exception`` subclass, only when the name is
  missing. Helion uses it only in an ``isinstance`` test of autotuner build errors (Intel XPU builds),
  which a CUDA or CPU run never raises; nothing that torch defines is replaced or changed. No file of
  helion or torch is modified and no ``sitecustomize`` is involved.

Any other failure to import Helion is re-raised as an ``ImportError`` that names the installed
versions and the supported ranges.
"""

from __future__ import annotations

import importlib.metadata

import torch

SUPPORTED = {"torch": ">=2.11,<2.16", "helion": ">=1.4,<1.6"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(version: str | None) -> tuple[int, int] | None:
    if not version:
        return None
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def helion_version() -> str | None:
    """The installed helion's version string (from its metadata; helion is not imported)."""
    return _version("helion")


def needs_intel_gpu_error() -> bool:
    """True when the installed helion (>= 1.5) imports ``IntelGPUError`` from a torch that lacks it."""
    hv = _major_minor(helion_version())
    if hv is None or hv < (1, 5):
        return False
    from torch._inductor.runtime import triton_compat

    return not hasattr(triton_compat, "IntelGPUError")


def provide_intel_gpu_error() -> bool:
    """Add the missing ``IntelGPUError`` to torch's ``triton_compat`` (see the module docstring).
    Returns whether it was added. Idempotent; a no-op where torch defines the name."""
    if not needs_intel_gpu_error():
        return False
    from torch._inductor.runtime import triton_compat

    class IntelGPUError(Exception):
        """Stand-in for torch >= 2.12's ``triton_compat.IntelGPUError`` (an Intel GPU build error),
        added by flce_dist so that helion 1.5 imports on torch 2.11."""

    IntelGPUError.__module__ = triton_compat.__name__
    triton_compat.IntelGPUError = IntelGPUError
    return True


def _import_helion():
    provide_intel_gpu_error()
    try:
        import helion as _helion
    except ImportError as e:
        raise ImportError(
            f"flce_dist could not import helion {helion_version()} with torch {torch.__version__}: {e}. "
            f"flce_dist supports torch {SUPPORTED['torch']} and helion {SUPPORTED['helion']} "
            "(the README's support matrix lists the tested combinations); install a helion in that range, "
            "e.g. `pip install 'helion>=1.4,<1.6'`."
        ) from e
    return _helion


helion = _import_helion()
