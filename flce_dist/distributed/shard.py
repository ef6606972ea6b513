"""Vocabulary partition across a tensor-parallel group.

Uneven shards: with ``V = q * P + r`` the first ``r`` ranks own ``q + 1`` rows, the others ``q``
(Megatron/torchtitan use even shards and pad the vocabulary; we do not pad). Rank ``i`` owns the
global ids ``[start_i, start_i + V_i)`` with ``start_i = i * q + min(i, r)``.
"""

from __future__ import annotations

import weakref
import zlib

import torch
import torch.distributed as dist

from .collectives import all_gather_rows
from .groups import group_size


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


def shard_sizes(vocab_size: int, world_size: int) -> list[int]:
    """Rows of every rank under :func:`vocab_shard`."""
    return [e - s for s, e in (vocab_shard(vocab_size, r, world_size) for r in range(world_size))]


# checked shards per process group, the group held weakly: a group the program drops (a test's or a
# job's short-lived group) is not kept alive, with its backend's threads, by this cache
_SHARD_CACHE: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, tuple[int, int]]]" = weakref.WeakKeyDictionary()


def clear_shard_cache() -> None:
    """Forget every checked shard (each rank must call it at the same point of its program)."""
    _SHARD_CACHE.clear()


def _handshake(group: dist.ProcessGroup, v_local: int, vocab_start: int | None, device: str, n_tokens: int,
               fields: tuple, vocab_size: int | None) -> tuple[int, int]:
    # One all-gather of (start, size, tokens, call signature, expected V) per distinct (group, shard,
    # tokens, V): a host sync, once per shape, never on the steady-state hot path.
    me = torch.tensor([[-1 if vocab_start is None else vocab_start, v_local, n_tokens, call_signature(*fields),
                        -1 if vocab_size is None else vocab_size]], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    rows = all_gather_rows(me, group).cpu().tolist()
    if any(r[2] != rows[0][2] for r in rows):
        raise ValueError(f"ranks disagree on the number of tokens in hidden: {[r[2] for r in rows]} per rank "
                         "(every rank of the group must pass the same tokens, or equal slices with sequence_parallel)")
    if any(r[3] != rows[0][3] for r in rows):
        bad = [i for i, r in enumerate(rows) if r[3] != rows[0][3]]
        raise ValueError(f"ranks {bad} call the loss with a different hidden size, dtype, bias, gradient need, "
                         "loss options or settings than rank 0 (every rank of the group must make the same call)")
    if any(r[4] != rows[0][4] for r in rows):
        raise ValueError(f"ranks disagree on vocab_size: {[None if r[4] < 0 else r[4] for r in rows]} per rank")
    explicit = [r[0] for r in rows]
    if any(s >= 0 for s in explicit) and any(s < 0 for s in explicit):
        raise ValueError("vocab_start must be given on every rank of the group or on none")
    if explicit[0] < 0:
        starts, acc = [], 0
        for row in rows:
            starts.append(acc)
            acc += row[1]
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
    if rows[0][4] >= 0 and pos != rows[0][4]:
        raise ValueError(f"vocab shards hold {pos} rows in all but vocab_size is {rows[0][4]} "
                         f"(shards (start, size) per rank: {[(starts[j], rows[j][1]) for j in range(world)]})")
    return starts[dist.get_rank(group)], pos


def call_signature(*fields: object) -> int:
    """A 62-bit digest of the call's non-shard fields, compared across ranks by ``resolve_shard``."""
    text = repr(fields).encode()
    return zlib.crc32(text) | (zlib.adler32(text) << 31)


def resolve_shard(group: dist.ProcessGroup | None, v_local: int, vocab_start: int | None, device: torch.device,
                  n_tokens: int = 0, fields: tuple = (), vocab_size: int | None = None) -> tuple[int, int]:
    """``(vocab_start, vocab_size)`` of this rank.

    Once per distinct (group, shard, token count, vocab_size) it all-gathers them with the call
    signature (a digest of ``fields``: options, settings, shapes; computed only then) and raises
    ``ValueError`` on every rank if the shards do not tile ``[0, V)`` exactly (``V`` =
    ``vocab_size`` when given), or the ranks disagree on the token count or the call signature. The signature is not part of the cache key: a later call that changes an option on
    one rank only meets the per-call guard of the statistics collective (``guard.py``), which every
    rank sees. A rank whose shard or token count changes on its own meets the others in a different
    collective: the backend's collective-mismatch error or the group's timeout, never a wrong loss."""
    if group is None or dist.get_world_size(group) == 1:
        if vocab_start not in (None, 0):
            raise ValueError(f"vocab_start must be 0 or None without a tensor-parallel group, got {vocab_start}")
        if vocab_size is not None and vocab_size != v_local:
            raise ValueError(f"vocab_size is {vocab_size} but weight holds {v_local} rows without a tensor-parallel group")
        return 0, v_local
    dev = str(device) if dist.get_backend(group) == "nccl" else "cpu"
    key = (v_local, vocab_start, dev, int(n_tokens), vocab_size)
    checked = _SHARD_CACHE.setdefault(group, {})
    if key not in checked:
        if len(checked) > 1024:
            checked.clear()
        checked[key] = _handshake(group, v_local, vocab_start, dev, int(n_tokens), fields, vocab_size)
    return checked[key]


def resolve_call(group: dist.ProcessGroup | None, v_local: int, vocab_start: int | None, device: torch.device,
                 n_tokens: int, fields: tuple, vocab_size: int | None = None) -> tuple[int, int, str, int]:
    """``(vocab_start, vocab_size, group name, group size)`` of a call: the shard checks of
    :func:`resolve_shard`, with the call's ``fields`` (options, settings, shapes) compared across
    ranks, and the group's name for the compiled op. Under torch.compile the API calls it through
    ``torch._disable_dynamo``: its collective and host sync stay out of compiled graphs."""
    size = group_size(group)
    start, vocab = resolve_shard(group, v_local, vocab_start, device, n_tokens, fields, vocab_size)
    return start, vocab, group.group_name if size > 1 else "", size
