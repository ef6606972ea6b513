"""A call's targets, per token, in one launch: shard-local ids, the valid mask and the bad mask.

    valid[n] = target[n] != ignore_index
    tl[n]    = target[n] - vocab_start  if valid and 0 <= that < v_local,  else -1      (int32)
    bad[n]   = valid and not 0 <= target[n] < vocab_size   (its loss becomes NaN: no device assert)

``core.local_targets`` and the masks' torch expressions (about a dozen small kernels; measured in
docs/results.md, "Per-call small kernels") are the reference and the fallback for size-1 shapes. The kernels compare shard-local ids with int32 tile indices, hence int32 ``tl``.
Shapes: target [N] int64, tl [N] int32, valid and bad [N] bool. Grid: token tiles.
"""

from __future__ import annotations

import torch

from .._helion_compat import helion
from .common import SETTINGS

import helion.language as hl


@helion.kernel(static_shapes=False, **SETTINGS)  # one compile for every batch size
def target_rows(
    target: torch.Tensor,
    tl_out: torch.Tensor,
    valid_out: torch.Tensor,
    bad_out: torch.Tensor,
    vocab_start: int,
    v_local: int,
    vocab_size: int,
    ignore_index: int,
    block_n: hl.constexpr,
) -> torch.Tensor:
    n = target.size(0)
    for tile_n in hl.tile(n, block_size=block_n):
        t = target[tile_n]
        ok = t != ignore_index
        loc = t - vocab_start
        here = (loc >= 0) & (loc < v_local) & ok
        tl_out[tile_n] = torch.where(here, loc, -1).to(torch.int32)
        valid_out[tile_n] = ok
        bad_out[tile_n] = ok & ((t < 0) | (t >= vocab_size))
    return tl_out


def target_rows_reference(
    target: torch.Tensor, vocab_start: int, v_local: int, vocab_size: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's math in torch: ``(tl, valid, bad)``."""
    valid = target != ignore_index
    loc = target - vocab_start
    here = (loc >= 0) & (loc < v_local) & valid
    tl = torch.where(here, loc, torch.full_like(loc, -1)).to(torch.int32)
    return tl, valid, valid & ((target < 0) | (target >= vocab_size))
