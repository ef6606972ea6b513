"""Testing mode ``job.device = "cuda-shared"``: every rank on ``cuda:0`` with gloo, so that the CUDA
code paths of tp/dp > 1 run on ONE GPU (NCCL needs a GPU per rank). gloo moves CUDA tensors through
the host: nothing measured in this mode means anything for speed.

torch 2.11's gloo crashes (SIGSEGV in a gloo thread, found by ``tests/gloo_cuda_probe.py`` on an
H200, 2026-12-02) in one collective on CUDA tensors: the functional all-gather
``_c10d_functional::all_gather_into_tensor``, which DTensor's ``Shard -> Replicate`` (sequence
parallelism's all-gather, in the model body and in the ``loss_parallel`` head alike) calls. The
in-place ``dist.all_gather_into_tensor``, the functional reduce-scatter and all-reduce and every
other collective the probe runs work. :func:`install` re-registers the functional all-gather's CUDA
kernel (this process only) as a host-staged ``dist.all_gather_into_tensor``; nothing else changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_LIBS: list = []  # the registrations live as long as their Library object


def _gather(t: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    from torch.distributed.distributed_c10d import _resolve_process_group

    src = t.detach().contiguous().cpu()
    out = src.new_empty((src.shape[0] * group_size, *src.shape[1:]))
    dist.all_gather_into_tensor(out, src, group=_resolve_process_group(group_name))
    return out.to(t.device)


def install() -> None:
    """Route the functional all-gather of CUDA tensors through the host (idempotent; gloo only)."""
    if _LIBS:
        return
    import warnings

    lib = torch.library.Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        lib.impl("all_gather_into_tensor", _gather, "CUDA")
        lib.impl("all_gather_into_tensor_out",
                 lambda t, group_size, group_name, *, out: out.copy_(_gather(t, group_size, group_name)), "CUDA")
    _LIBS.append(lib)
