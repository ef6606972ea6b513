"""Vocabulary partition across a tensor-parallel group.

The loss accepts any contiguous split in rank order. Two are named (``vocab_shard``'s ``split``):

* ``"balanced"`` (the default): with ``V = q * P + r`` the first ``r`` ranks own ``q + 1`` rows, the
  others ``q``; rank ``i`` owns ``[start_i, start_i + V_i)`` with ``start_i = i * q + min(i, r)``.
* ``"chunk"``: DTensor's ``Shard(0)`` split (``torch.chunk``): ``c = ceil(V / P)`` rows per rank,
  rank ``i`` owns ``[min(i c, V), min((i + 1) c, V))``, so the last ranks may hold fewer or none.
  ``VocabParallelLMHead`` (``group=`` and ``mesh=``) and ``integrations.transformers.apply(model,
  group=)`` use it: a DTensor must (DTensor's ``full_tensor``, redistribution and distributed
  checkpoints assume it), and one split makes their state dicts interchangeable.

Both equal ``V / P`` rows each when ``P`` divides ``V`` (Megatron and torchtitan pad the vocabulary
to that; we do not pad).
"""

from __future__ import annotations

import warnings
import weakref
import zlib

import torch
import torch.distributed as dist

from .collectives import all_gather_rows
from .groups import group_size


SPLITS = ("balanced", "chunk")


def vocab_shard(vocab_size: int, rank: int, world_size: int, *, split: str = "balanced") -> tuple[int, int]:
    """``(start, end)`` of ``rank``'s rows when ``vocab_size`` rows are split over ``world_size``
    ranks: ``split="balanced"`` (the first ``V % P`` ranks own one more row) or ``"chunk"``
    (DTensor's ``torch.chunk`` split, the heads' layout); see the module docstring."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if split == "chunk":
        step = -(-vocab_size // world_size)
        return min(rank * step, vocab_size), min((rank + 1) * step, vocab_size)
    if split != "balanced":
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    q, r = divmod(vocab_size, world_size)
    start = rank * q + min(rank, r)
    return start, start + q + (1 if rank < r else 0)


def shard_sizes(vocab_size: int, world_size: int, *, split: str = "balanced") -> list[int]:
    """Rows of every rank under :func:`vocab_shard` with ``split``."""
    return [e - s for s, e in (vocab_shard(vocab_size, r, world_size, split=split) for r in range(world_size))]


# checked layouts per process group, the group held weakly: a group the program drops (a test's or a
# job's short-lived group) is not kept alive, with its backend's threads, by this cache
_SHARD_CACHE: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, tuple[int, int]]]" = weakref.WeakKeyDictionary()
_WARNED: "weakref.WeakKeyDictionary[dist.ProcessGroup, set[tuple]]" = weakref.WeakKeyDictionary()  # layouts
_DIGEST_ROWS = 16  # rows of a shard sampled by its digest


def clear_shard_cache() -> None:
    """Forget every checked layout (each rank must call it at the same point of its program)."""
    _SHARD_CACHE.clear()
    _WARNED.clear()


def shard_digest(weight: torch.Tensor) -> torch.Tensor:
    """A 0-d float64 digest of a weight shard on its device (no host sync): a position-weighted sum
    of ``_DIGEST_ROWS`` evenly spaced rows. Equal shards give bitwise equal digests on every rank
    (the same kernels on the same data); different shards almost never do."""
    v = weight.shape[0]
    if v == 0 or weight.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=weight.device)
    with torch.no_grad():
        idx = torch.linspace(0, v - 1, min(v, _DIGEST_ROWS), device=weight.device).long()
        rows = weight.detach().index_select(0, idx).to(torch.float64)
        pos = torch.arange(1, rows.numel() + 1, dtype=torch.float64, device=weight.device).view(rows.shape)
        return (rows * (1.0 + pos.reciprocal())).sum()


_UNSTATED = ("the group's shards are taken in rank order (rank i's weight holds the global rows after those of "
             "ranks 0..i-1) and V = {v}, their sum; shards passed in another order give a wrong loss that no check "
             "can see; and every new token count costs a handshake (a host sync). Pass vocab_size= (the global "
             "vocabulary size; and slice each rank's rows with flce_dist.vocab_shard, or give vocab_start=) to "
             "state the layout; this is said once per layout")
_SAME_WEIGHT = ("every rank of the group passed the same weight ({p} ranks, {v} rows each, equal digests): with "
                "group= each rank passes only its own vocabulary rows, weight[start:end] with (start, end) = "
                "flce_dist.vocab_shard(V, rank, world_size) (the full [V, H] weight on every rank gives a loss "
                "ln({p}) too high). If the shards are equal on purpose (a constant initialisation), pass "
                "vocab_size= to state the layout")


def _handshake(group: dist.ProcessGroup, v_local: int, vocab_start: int | None, device: str, n_tokens: int,
               fields: tuple, vocab_size: int | None, digest: torch.Tensor | None, layout_key: tuple = ()
               ) -> tuple[int, int]:
    # One all-gather of (start, size, tokens, call signature, expected V, weight digest) per layout:
    # one host sync (the .cpu() of the gathered rows), never on the steady-state hot path.
    head = torch.tensor([[-1 if vocab_start is None else vocab_start, v_local, n_tokens, call_signature(*fields),
                          -1 if vocab_size is None else vocab_size, 0 if digest is None else 1]],
                        dtype=torch.int64, device=device)
    bits = (torch.zeros((), dtype=torch.float64) if digest is None else digest).to(device).view(torch.int64)
    world = dist.get_world_size(group)
    rows = all_gather_rows(torch.cat([head, bits.view(1, 1)], 1), group).cpu().tolist()
    if any(r[2] >= 0 for r in rows) and any(r[2] != rows[0][2] for r in rows):  # -1: not known (traced)
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
    # every rank passed the same rows (the full weight everywhere, most likely): a layout error
    same = (all(r[5] for r in rows) and rows[0][1] > 1 and all(r[1] == rows[0][1] and r[6] == rows[0][6] for r in rows))
    same_msg = _SAME_WEIGHT.format(p=world, v=rows[0][1])
    if explicit[0] < 0:
        starts, acc = [], 0
        for row in rows:
            starts.append(acc)
            acc += row[1]
    else:
        starts = explicit
    layout = f"(shards (start, size) per rank: {[(starts[j], rows[j][1]) for j in range(world)]})"
    order = sorted(range(world), key=lambda i: starts[i])
    pos = 0
    for i in order:
        if starts[i] != pos:
            raise ValueError((same_msg + "; " if same else "") + f"vocab shards do not tile [0, V): rank {i} "
                             f"starts at {starts[i]}, expected {pos} {layout}")
        pos += rows[i][1]
    if rows[0][4] >= 0 and pos != rows[0][4]:
        raise ValueError((same_msg + "; " if same else "")
                         + f"vocab shards hold {pos} rows in all but vocab_size is {rows[0][4]} {layout}")
    if rows[0][4] < 0 and explicit[0] < 0:  # nothing but the shard sizes states the layout
        if same:
            raise ValueError(same_msg)
        warned = _WARNED.setdefault(group, set())
        if layout_key not in warned:
            warned.add(layout_key)
            warnings.warn("fused_linear_cross_entropy with group= and neither vocab_size= nor vocab_start=: "
                          + _UNSTATED.format(v=pos), stacklevel=2)
    return starts[dist.get_rank(group)], pos


def call_signature(*fields: object) -> int:
    """A 62-bit digest of the call's non-shard fields, compared across ranks by ``resolve_shard``."""
    text = repr(fields).encode()
    return zlib.crc32(text) | (zlib.adler32(text) << 31)


def resolve_shard(group: dist.ProcessGroup | None, weight: torch.Tensor | int, vocab_start: int | None,
                  device: torch.device, n_tokens: int = -1, fields: tuple = (),
                  vocab_size: int | None = None) -> tuple[int, int]:
    """``(vocab_start, vocab_size)`` of this rank; ``weight``: this rank's ``[V_local, H]`` shard (or
    only its row count ``V_local``, which skips the weight checks below).

    Once per layout (group, ``V_local``, the weight's ``H`` and dtype, ``vocab_start``,
    ``vocab_size``: not the token count, so a new ``N`` costs nothing; without ``vocab_size=`` once
    per layout and token count, since then nothing that every rank shares tells a new layout from
    an old one, and the ranks' cache hits must agree) it all-gathers the shard's
    start and size, the token count, the call signature (a digest of ``fields``: options, settings,
    shapes; computed only then) and a digest of the shard's rows (``shard_digest``, on the device):
    one collective and one host sync. It raises ``ValueError`` on every rank if the shards do not
    tile ``[0, V)`` exactly (``V`` = ``vocab_size`` when given), or the ranks disagree on the token
    count (``n_tokens`` < 0: not compared) or the call signature, or every rank passed the same
    rows while nothing else states the layout.

    The rule for equal shards (P > 1 ranks, ``V_local`` > 1 rows each, bitwise equal digests), which
    is what the full ``[V, H]`` weight passed on every rank looks like: without ``vocab_size=`` and
    ``vocab_start=`` a ``ValueError`` naming ``weight`` (slice it with ``flce_dist.vocab_shard``);
    with either, the stated layout decides (a wrong one raises the tiling error, with the same
    advice), so a legitimately equal layout (a constant initialisation such as zeros) passes when
    ``vocab_size=`` is given. Tied embeddings are not equal shards (each rank holds its own slice).
    Shards in another rank order cannot be told apart from the weights: without ``vocab_size=`` and
    ``vocab_start=`` a ``UserWarning`` (once per layout) says that the rank order is assumed.

    Later calls are checked per call by the guard of the statistics collective (``guard.py``: the
    call signature, the token count, the targets, a sample of hidden), which every rank sees. A rank
    whose layout or token count changes on its own meets the others in a different or mismatched
    collective: the guard's error (NaN on the GPU), the backend's collective-mismatch error or the
    group's timeout, never a wrong loss."""
    v_local = int(weight.shape[0]) if isinstance(weight, torch.Tensor) else int(weight)
    if group is None or dist.get_world_size(group) == 1:
        if vocab_start not in (None, 0):
            raise ValueError(f"vocab_start must be 0 or None without a tensor-parallel group, got {vocab_start}")
        if vocab_size is not None and vocab_size != v_local:
            raise ValueError(f"vocab_size is {vocab_size} but weight holds {v_local} rows without a tensor-parallel group")
        return 0, v_local
    dev = str(device) if dist.get_backend(group) == "nccl" else "cpu"
    shape = (tuple(weight.shape[1:]), str(weight.dtype)) if isinstance(weight, torch.Tensor) else None
    # the ranks must agree on every hit and miss (a miss is a collective): the key holds this rank's
    # shard and what every rank shares, vocab_size. Without vocab_size no shared value tells a new
    # layout from an old one (V = 7 split 4/3, then V = 8 split 4/4: rank 0 would hit, rank 1 miss,
    # a collective mismatch), so there the token count stays in the key, as it always was
    key = (v_local, vocab_start, dev, vocab_size, shape, int(n_tokens) if vocab_size is None else None)
    checked = _SHARD_CACHE.setdefault(group, {})
    if key not in checked:
        if len(checked) > 1024:
            checked.clear()
        digest = shard_digest(weight) if isinstance(weight, torch.Tensor) else None
        checked[key] = _handshake(group, v_local, vocab_start, dev, int(n_tokens), fields, vocab_size, digest, key[:-1])
    return checked[key]


def resolve_call(group: dist.ProcessGroup | str | None, weight: torch.Tensor | int, vocab_start: int | None,
                 device: torch.device, n_tokens: int, fields: tuple,
                 vocab_size: int | None = None) -> tuple[int, int, str, int]:
    """``(vocab_start, vocab_size, group name, group size)`` of a call: the once-per-layout checks
    of :func:`resolve_shard`, with the call's ``fields`` (options, settings, shapes) compared across
    ranks, and the group's name for the compiled op.

    Eager calls reach it through ``torch._disable_dynamo`` (frames that run eagerly under a compiled
    caller still meet Dynamo's frame hook). Under torch.compile the API calls it directly: it is
    marked ``assume_constant_result``, so TorchDynamo runs it once while tracing (its collective and
    host sync at trace time, once per layout like an eager call) and folds its result into the graph
    as a constant: no graph break. There pass the group by name (``group.group_name``: Dynamo hands
    the function an opaque stand-in for a ProcessGroup object), the weight itself (its real value
    reaches the digest), ``Settings.astuple()`` in ``fields`` (a frozen dataclass is no Dynamo
    constant) and ``n_tokens=-1`` (a symbolic token count is no constant; the per-call guard
    compares it)."""
    if isinstance(group, str):  # traced: the group by name (a constant; the group object is opaque there)
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group) if group else None
    size = group_size(group)
    start, vocab = resolve_shard(group, weight, vocab_start, device, n_tokens, fields, vocab_size)
    return start, vocab, group.group_name if size > 1 else "", size


# torch._dynamo.assume_constant_result without importing torch._dynamo (~1 s) at import time
resolve_call._dynamo_marked_constant = True  # type: ignore[attr-defined]
