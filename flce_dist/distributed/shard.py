"""Vocabulary partition across a tensor-parallel group.

Uneven shards: with ``V = q * P + r`` the first ``r`` ranks own ``q + 1`` rows, the others ``q``
(Megatron/torchtitan use even shards and pad the vocabulary; we do not pad). Rank ``i`` owns the
global ids ``[start_i, start_i + V_i)`` with ``start_i = i * q + min(i, r)``.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, end)`` of ``rank``'s rows when ``vocab_size`` rows are split over ``world_size``."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    q, r = divmod(vocab_size, world_size)
    start = rank * q + min(rank, r)
    return start, start + q + (1 if rank < r else 0)


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


@lru_cache(maxsize=256)
def _resolve_cached(group: dist.ProcessGroup, v_local: int, vocab_start: int | None, device: str) -> tuple[int, int]:
    # One all-gather of (start, size) per (group, shard) — a host sync, once per distinct shape.
    from .collectives import all_gather_rows

    me = torch.tensor([[-1 if vocab_start is None else vocab_start, v_local]], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    rows = all_gather_rows(me, group).cpu().tolist()
    explicit = [s for s, _ in rows]
    if any(s >= 0 for s in explicit) and any(s < 0 for s in explicit):
        raise ValueError("vocab_start must be given on every rank of the group or on none")
    if explicit[0] < 0:
        starts, acc = [], 0
        for _, n in rows:
            starts.append(acc)
            acc += n
    else:
        starts = explicit
    order = sorted(range(world), key=lambda i: starts[i])
    pos = 0
    for i in order:
        if starts[i] != pos:
            raise ValueError(
                f"vocab shards do not tile [0, V): rank {i} starts at {starts[i]}, expected {pos} "
                f"(shards (start, size) per rank: {[(starts[j], rows[j][1]) for j in range(world)]})"
            )
        pos += rows[i][1]
    return starts[dist.get_rank(group)], pos


def resolve_shard(group: dist.ProcessGroup | None, v_local: int, vocab_start: int | None, device: torch.device) -> tuple[int, int]:
    """``(vocab_start, vocab_size)`` of this rank; checks once per shape that the ranks' shards
    tile ``[0, V)`` exactly (raises ``ValueError`` otherwise)."""
    if group is None or dist.get_world_size(group) == 1:
        if vocab_start not in (None, 0):
            raise ValueError(f"vocab_start must be 0 or None without a tensor-parallel group, got {vocab_start}")
        return 0, v_local
    dev = str(device) if dist.get_backend(group) == "nccl" else "cpu"
    return _resolve_cached(group, v_local, vocab_start, dev)
