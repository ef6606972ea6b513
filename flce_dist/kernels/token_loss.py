"""Per-token outputs from the global statistics, in one launch: loss, accuracy, lse.

From stats [N, >=4] = (lse, target logit y_t, sum of logits, max logit) after the statistics
all-gather (``eps`` label smoothing, ``zl`` z-loss, V the full vocabulary):

    loss[n]    = lse - (1 - eps) y_t - eps / V sum_v y + zl lse^2     (0 where not valid,
                                                                        NaN where bad)
    correct[n] = valid and y_t >= max logit       (the target is the arg max; ties count)
    lse[n]     = lse                              (a contiguous copy: the API's and the backward's)

``core.token_loss`` and the masks' torch expressions (~13 small kernels) are the reference and the
fallback for size-1 shapes and float64. Shapes: stats [N, k] float32, valid and bad [N] bool;
loss, lse [N] float32, correct [N] bool. Grid: token tiles.
"""

from __future__ import annotations

import torch

from .._helion_compat import helion
from .common import SETTINGS

import helion.language as hl


@helion.kernel(static_shapes=False, **SETTINGS)  # one compile for every batch size
def token_rows(
    stats: torch.Tensor,
    valid: torch.Tensor,
    bad: torch.Tensor,
    loss_out: torch.Tensor,
    correct_out: torch.Tensor,
    lse_out: torch.Tensor,
    one_minus_eps: float,
    eps_over_v: float,
    z_loss: float,
    with_sum: hl.constexpr,
    with_zl: hl.constexpr,
    block_n: hl.constexpr,
) -> torch.Tensor:
    n = stats.size(0)
    for tile_n in hl.tile(n, block_size=block_n):
        lse = stats[tile_n, 0]
        yt = stats[tile_n, 1]
        loss = lse - one_minus_eps * yt
        if with_sum:
            loss = loss - eps_over_v * stats[tile_n, 2]
        if with_zl:
            loss = loss + z_loss * lse * lse
        ok = valid[tile_n]
        loss = torch.where(ok, loss, 0.0)
        loss_out[tile_n] = torch.where(bad[tile_n], float("nan"), loss)
        correct_out[tile_n] = ok & (yt >= stats[tile_n, 3])
        lse_out[tile_n] = lse
    return loss_out


def token_rows_reference(
    stats: torch.Tensor, valid: torch.Tensor, bad: torch.Tensor, one_minus_eps: float, eps_over_v: float, z_loss: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's math in torch (any float dtype): ``(loss, correct, lse)``."""
    lse, yt = stats[:, 0], stats[:, 1]
    loss = lse - one_minus_eps * yt
    if eps_over_v:
        loss = loss - eps_over_v * stats[:, 2]
    if z_loss:
        loss = loss + z_loss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    loss = torch.where(bad, torch.full_like(loss, float("nan")), loss)
    return loss, valid & (yt >= stats[:, 3]), lse.contiguous()
