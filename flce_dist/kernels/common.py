"""Helion settings shared by the kernels.

Helion 1.4 on torch < 2.13 (no ``is_symm_mem_tensor``) treats every kernel compiled inside an
initialised process group as a symmetric-memory kernel and warns that no process-group argument was
found (``ProcessGroupNameNotFound``, ignored here) and that its autotuner's SM multiplier is capped
(filtered by ``launch.py`` around the first compile of each kernel only). These kernels use no
symmetric memory, take shipped configs and never autotune, so both messages are noise.
"""

from __future__ import annotations

import math

from .._helion_compat import helion
from ..reference_mode import helion_settings

# (plus ``ref_mode`` in Helion's reference mode: ``reference_mode.py``, which switches kernels made before it)
SETTINGS = dict(ignore_warnings=[helion.exc.ProcessGroupNameNotFound], **helion_settings())

# Helion 1.4 lowers torch.exp to libdevice's expf (a range-reduced sequence of several instructions)
# and torch.exp2 to one ex2.approx: the elementwise passes are instruction-bound on the H200
# (benchmarks/NOTES.md, run 16), so the kernels write exp(a) as exp2(a * LOG2E).
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
