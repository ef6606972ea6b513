"""Process-group helpers: every function takes the group explicitly (None: a single rank).

Importing this module (the package does) also imports ``torch.distributed.nn.functional`` while no
process group exists yet, and changes nothing in it. That torch module declares ``group=group.WORLD``
defaults, evaluated when it is imported: imported after ``init_process_group`` (``import
torch._dynamo`` imports it, via fsdp and sharded_tensor; Helion, which flce_dist's first loss call
imports, imports torch._dynamo) they hold the live default group for the life of the process, which
``destroy_process_group`` then cannot free: its gloo worker threads outlive ``main`` and can abort
the interpreter at exit ("terminate called without an active exception", issue #31). Imported
before any group exists, the defaults are None (the default group at call time). So import
flce_dist before ``init_process_group``, as scripts do; docs/guarantees.md ("Process exit") states
the case flce_dist cannot cover without changing torch's objects, which it does not do.
"""

from __future__ import annotations

import torch.distributed as dist

if dist.is_available() and not dist.is_initialized():
    import torch.distributed.nn.functional  # noqa: F401


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)
