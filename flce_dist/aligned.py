"""Inputs the kernels can take: contiguous, with a 16-byte aligned base pointer (issue 61, finding 5).

Helion's tensor-descriptor (TMA) configs build a descriptor from each tensor's base pointer, which must be
16-byte aligned; the bound kernel is chosen by shapes, dtypes and strides, so a view at an odd offset into a
flat buffer (``buf[1:1 + N * H].view(N, H)``: FSDP's, DeepSpeed's and Megatron's flat parameter and gradient
buffers make such views) after aligned calls of the same shape ran the TMA binary on it: ``CUDA error:
misaligned address``, and every later CUDA call of the process failed. torch's own matmul takes such a tensor.

:func:`aligned` copies such an input to a fresh tensor (the caching allocator's blocks are 512-byte aligned):
a host-side check of ``data_ptr()`` (no sync, no kernel) on every CUDA input, a copy only for a misaligned one.
A row stride that is not a multiple of 16 bytes is Helion's to handle (its layout guard takes a non-TMA path);
no copy would change it. The copy is differentiable (its gradient flows to the view)."""

from __future__ import annotations

from typing import overload

import torch

DEVICE_TYPES = ("cuda",)  # where the kernels may build tensor descriptors (a test adds "cpu" to run the copies there)


@overload
def aligned(t: torch.Tensor) -> torch.Tensor: ...
@overload
def aligned(t: None) -> None: ...
def aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` contiguous, and on CUDA with a 16-byte aligned base pointer (a copy where it is not)."""
    if t is None:
        return None
    t = t.contiguous()
    if t.device.type in DEVICE_TYPES and t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    return t
