"""Process-group helpers: every function takes the group explicitly (None: a single rank)."""

from __future__ import annotations

import sys

import torch.distributed as dist

if dist.is_available() and not dist.is_initialized():
    # loaded before any group exists, its group=group.WORLD defaults are None (see unpin_default_group)
    import torch.distributed.nn.functional  # noqa: F401


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


_UNPINNED = False


def unpin_default_group() -> bool:
    """Undo torch's pin of the default process group; True once done (then free: one global read).

    ``torch.distributed.nn.functional`` declares ``group=group.WORLD`` defaults, evaluated when it is
    imported: imported after ``init_process_group`` they hold the live default group for the life of
    the process. ``import torch._dynamo`` imports it (via fsdp and sharded_tensor), and
    ``torch._disable_dynamo``, which wraps this package's entry points, does that at the first call,
    typically after ``init_process_group``. A pinned group outlives ``destroy_process_group``: its
    gloo worker threads are never joined, and one that is still releasing the last collective's
    tensors (which takes the GIL) when the interpreter finalizes aborts the process with "terminate
    called without an active exception" (issue #31; a destroyed, re-created default group would also
    be used through the stale default). ``None`` means the default group to every one of those
    functions, so the defaults become ``None``, what they are when the module is imported before any
    group exists: this module imports it at package import when no group exists yet (a 7 ms import),
    which also covers a ``torch.compile`` (whose Dynamo import would pin) after ``init_process_group``."""
    global _UNPINNED
    if _UNPINNED:
        return True
    mod = sys.modules.get("torch.distributed.nn.functional")
    if mod is None:
        return False
    for fn in list(vars(mod).values()):
        defaults = getattr(fn, "__defaults__", None)
        if getattr(fn, "__module__", None) == mod.__name__ and defaults \
                and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
    _UNPINNED = True
    return True
