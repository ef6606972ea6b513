"""Helion kernels of flce_dist: one kernel per file, each with a torch reference of its own math
beside it; ``launch.py`` launches them with shipped configs. Nothing here touches
``torch.distributed``, and importing this package has no side effects (Helion itself is imported
when ``launch`` first needs a kernel)."""
