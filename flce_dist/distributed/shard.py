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

import weakref
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import agree
from .collectives import all_gather_rows
from .dtensor import chunk_span
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
        start, rows = chunk_span(vocab_size, world_size, rank)
        return start, start + rows
    if split != "balanced":
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    q, r = divmod(vocab_size, world_size)
    start = rank * q + min(rank, r)
    return start, start + q + (1 if rank < r else 0)


def shard_sizes(vocab_size: int, world_size: int, *, split: str = "balanced") -> list[int]:
    """Rows of every rank under :func:`vocab_shard` with ``split``."""
    return [e - s for s, e in (vocab_shard(vocab_size, r, world_size, split=split) for r in range(world_size))]


def local_rows(value: torch.Tensor, vocab_size: int, shard: tuple[int, int], local_shape: tuple) -> torch.Tensor:
    """For loading a checkpoint into a shard of ``shard = (start, end)``: the full ``[vocab_size, ...]``
    rows of ``value`` sliced to this rank's, any other ``value`` (this rank's rows already, or a
    mismatch that ``load_state_dict`` reports) as it is."""
    if value.dim() >= 1 and value.shape[0] == vocab_size and tuple(value.shape) != tuple(local_shape):
        return value[shard[0] : shard[1]]
    return value


# checked layouts per process group, the group held weakly: a group the program drops (a test's or a
# job's short-lived group) is not kept alive, with its backend's threads, by this cache
_SHARD_CACHE: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, tuple]] = weakref.WeakKeyDictionary()


def clear_shard_cache() -> None:
    """Forget every checked layout and every group's history of agreed calls (``agree.py``): the next call
    on each group runs the handshake. Each rank must call it at the same point of its program."""
    _SHARD_CACHE.clear()
    agree.clear()


_FULL_WEIGHT = (
    "every rank passed {v} rows, the whole vocabulary: with group= each rank passes only its own "
    "vocabulary rows, weight[start:end] with (start, end) = flce_dist.vocab_shard(V, rank, world_size) "
    "(the full [V, H] weight on every rank gives a loss ln({p}) too high)"
)


def _handshake(
    group: dist.ProcessGroup,
    v_local: int,
    vocab_start: int | None,
    device: str,
    n_tokens: int,
    fields: tuple,
    vocab_size: int | None,
) -> tuple[int, int]:
    # One all-gather of (start, size, tokens, call signature, stated V) per stated layout: one host
    # sync (the .cpu() of the gathered rows), never on the steady-state hot path.
    head = torch.tensor(
        [
            [
                -1 if vocab_start is None else vocab_start,
                v_local,
                n_tokens,
                call_signature(*fields),
                -1 if vocab_size is None else vocab_size,
            ]
        ],
        dtype=torch.int64,
        device=device,
    )
    world = dist.get_world_size(group)
    rows = all_gather_rows(head, group).cpu().tolist()
    if any(r[2] >= 0 for r in rows) and any(r[2] != rows[0][2] for r in rows):  # -1: not known (traced)
        raise ValueError(
            f"ranks disagree on the number of tokens in hidden: {[r[2] for r in rows]} per rank "
            "(every rank of the group must pass the same tokens, or equal slices with sequence_parallel)"
        )
    if any(r[3] != rows[0][3] for r in rows):
        bad = [i for i, r in enumerate(rows) if r[3] != rows[0][3]]
        raise ValueError(
            f"ranks {bad} call the loss with a different hidden size, dtype, bias, gradient need, "
            "loss options or settings than rank 0 (every rank of the group must make the same call)"
        )
    if any(r[4] != rows[0][4] for r in rows):
        raise ValueError(f"ranks disagree on vocab_size: {[None if r[4] < 0 else r[4] for r in rows]} per rank")
    explicit = [r[0] for r in rows]
    if any(s >= 0 for s in explicit) and any(s < 0 for s in explicit):
        raise ValueError("vocab_start must be given on every rank of the group or on none")
    full = rows[0][4] >= 0 and rows[0][4] > 1 and all(r[1] == rows[0][4] for r in rows)
    full_msg = _FULL_WEIGHT.format(v=rows[0][1], p=world)
    starts = explicit
    if explicit[0] < 0:  # vocab_size stated, the shards in rank order
        starts, acc = [], 0
        for row in rows:
            starts.append(acc)
            acc += row[1]
    layout = f"(shards (start, size) per rank: {[(starts[j], rows[j][1]) for j in range(world)]})"
    order = sorted(range(world), key=lambda i: (starts[i], rows[i][1]))
    pos = 0
    for i in order:
        if starts[i] != pos:
            raise ValueError(
                (full_msg + "; " if full else "") + f"vocab shards do not tile [0, V): rank {i} "
                f"starts at {starts[i]}, expected {pos} {layout}"
            )
        pos += rows[i][1]
    if rows[0][4] >= 0 and pos != rows[0][4]:
        raise ValueError(
            (full_msg + "; " if full else "")
            + f"vocab shards hold {pos} rows in all but vocab_size is {rows[0][4]} {layout}"
        )
    return starts[dist.get_rank(group)], pos


def call_signature(*fields: object) -> int:
    """A 62-bit digest of the call's non-shard fields, compared across ranks by ``resolve_shard``."""
    text = repr(fields).encode()
    return zlib.crc32(text) | (zlib.adler32(text) << 31)


def resolve_shard(
    group: dist.ProcessGroup | None,
    weight: torch.Tensor | int,
    vocab_start: int | None,
    device: torch.device,
    n_tokens: int = -1,
    fields: tuple = (),
    vocab_size: int | None = None,
    force: bool = False,
) -> tuple[int, int, bool]:
    """``(vocab_start, vocab_size, stale)`` of this rank; ``weight``: this rank's ``[V_local, H]``
    shard (or only its row count ``V_local``).

    With a group of P > 1 ranks the layout must be stated: ``vocab_size`` (the global V; without
    ``vocab_start`` the shards are taken in rank order) and/or ``vocab_start`` (the global id of
    ``weight[0]``; without ``vocab_size`` V is the sum of the shards); the API raises otherwise.

    The shard check runs once per stated layout: its cache key is what every rank of a correct
    program shares (the group, ``vocab_size``, whether ``vocab_start`` is given, the weight's ``H``,
    dtype and device type), never this rank's own row count, start or token count, so every rank
    hits or misses together and a miss (one collective) is a miss on every rank. A miss all-gathers
    each rank's start and size, the token count and the call signature (a digest of ``fields``:
    options, settings, shapes): one collective and one host sync. It raises ``ValueError`` on every
    rank if the shards do not tile ``[0, V)`` exactly (``V`` = ``vocab_size`` when given; every rank
    passing the whole vocabulary is named as such), or the ranks disagree on the token count
    (``n_tokens`` < 0: not compared), ``vocab_size``, or the call signature.

    What the key cannot tell apart is not trusted: a hit whose shard (``V_local``, ``vocab_start``)
    differs from the one that was checked under that key (e.g. two heads of one vocabulary size
    split two ways, or two vocabulary sizes given only by ``vocab_start``) returns ``stale=True``;
    the per-call guard (``guard.py``, word 2) then fails on every rank of the group: the same
    ``ValueError`` on CPU tensors or with ``check_finite``, a NaN loss on every rank otherwise.
    Never a rank alone in a collective, never a finite wrong loss.

    Later calls are checked per call by the guard of the statistics collective (the call signature,
    the token count, the targets), which every rank sees.

    ``force``: run the handshake whatever the cache holds (:func:`agree_call`: a group without a history of
    agreed calls, which every rank of the group is alike)."""
    v_local = int(weight.shape[0]) if isinstance(weight, torch.Tensor) else int(weight)
    if group is None or dist.get_world_size(group) == 1:
        if vocab_start not in (None, 0):
            raise ValueError(f"vocab_start must be 0 or None without a tensor-parallel group, got {vocab_start}")
        if vocab_size is not None and vocab_size != v_local:
            raise ValueError(
                f"vocab_size is {vocab_size} but weight holds {v_local} rows without a tensor-parallel group"
            )
        return 0, v_local, False
    if vocab_size is None and vocab_start is None:
        raise ValueError(
            "with a group of several ranks pass vocab_size= (and/or vocab_start=): the layout is stated, not guessed"
        )
    dev = str(device) if dist.get_backend(group) == "nccl" else "cpu"
    shape = (tuple(weight.shape[1:]), str(weight.dtype)) if isinstance(weight, torch.Tensor) else None
    key = (vocab_size, vocab_start is None, torch.device(dev).type, shape)  # shared by every rank
    checked = _SHARD_CACHE.setdefault(group, {})
    mine = (v_local, vocab_start)
    hit = None if force else checked.get(key)
    if hit is None:
        if len(checked) > 1024:  # every rank clears at the same call (the keys are shared)
            checked.clear()
            agree.clear()  # the agreed plans' layouts are gone: the next call agrees again (every rank)
        start, vocab = _handshake(group, v_local, vocab_start, dev, int(n_tokens), fields, vocab_size)
        checked[key] = hit = (mine, start, vocab)
    seen, start, vocab = hit
    if seen != mine:  # another shard under the same stated layout: the guard fails on every rank
        return (start if vocab_start is None else vocab_start), vocab, True
    return start, vocab, False


def agree_call(
    group: dist.ProcessGroup,
    weight: torch.Tensor | int,
    vocab_start: int | None,
    device: torch.device,
    n_tokens: int,
    fields: tuple,
    vocab_size: int | None,
    digest: int,
    make_plan: Callable[[int, int], object],
) -> tuple:
    """An eager call on a group of P > 1 ranks whose plan (everything that shapes its collectives: ``fields``
    and the stated layout) has the digest ``digest``: ``(vocab_start, vocab_size, stale, stand_in)``
    (``agree.py``).

    ``stand_in`` None: the call's plan is the one every rank predicted from the group's history of agreed
    calls (a hit: the layout from the cache, no collective, no sync), or the group had no history (every
    rank ran the handshake, which raises the same ``ValueError`` on every rank where the calls differ, and
    recorded ``make_plan(vocab_start, vocab_size)``). Else ``stand_in`` is the predicted plan's record and
    ``vocab_start``, ``vocab_size`` None: this rank's call is not the predicted one, and the caller runs
    that plan in its place (``api._stand_in``; on :class:`agree.Replan`, :func:`agree_new`, then the call)."""
    hist = agree.history(group)
    pred = hist.predict()
    if pred is not None and pred != digest:
        hist.advance(pred)  # what every rank runs: the predicted plan (or, where a call differs, its stand-in)
        return None, None, False, hist.plans[pred]
    # cold (every rank is: every rank agrees now) or a hit (the layout cache holds the plan's layout)
    start, vocab, stale = resolve_shard(
        group, weight, vocab_start, device, n_tokens, fields, vocab_size, force=pred is None
    )
    if pred is None:
        hist.record(digest, make_plan(start, vocab))
    hist.advance(digest)
    return start, vocab, stale, None


def agree_new(
    group: dist.ProcessGroup,
    weight: torch.Tensor | int,
    vocab_start: int | None,
    device: torch.device,
    n_tokens: int,
    fields: tuple,
    vocab_size: int | None,
    digest: int,
    make_plan: Callable[[int, int], object],
) -> tuple[int, int, bool]:
    """After :class:`agree.Replan` (every rank of the group stood in for one new plan, ``digest``, with the same
    token count: the stand-ins' guards compared both): the layout from the cache, or, where this stated layout
    is new (the cache is the same on every rank), the handshake on every rank; records the plan and notes that
    it ran: ``(vocab_start, vocab_size, stale)``."""
    start, vocab, stale = resolve_shard(group, weight, vocab_start, device, n_tokens, fields, vocab_size)
    hist = agree.history(group)
    hist.record(digest, make_plan(start, vocab))
    hist.redo(digest)
    return start, vocab, stale


def resolve_call(
    group: dist.ProcessGroup | str | None,
    weight: torch.Tensor | int,
    vocab_start: int | None,
    device: torch.device,
    n_tokens: int,
    fields: tuple,
    vocab_size: int | None = None,
) -> tuple[int, int, str, int, bool]:
    """``(vocab_start, vocab_size, group name, group size, stale)`` of a call: the once-per-layout
    checks of :func:`resolve_shard`, with the call's ``fields`` (options, settings, shapes) compared
    across ranks, and the group's name for the compiled op.

    Eager calls reach it through ``torch._disable_dynamo`` (frames that run eagerly under a
    compiled caller still meet Dynamo's frame hook). Under torch.compile the API calls it directly: it is
    marked ``assume_constant_result``, so TorchDynamo runs it once while tracing (its collective and
    host sync at trace time, once per layout like an eager call) and folds its result into the graph
    as a constant: no graph break. There pass the group by name (``group.group_name``: Dynamo hands
    the function an opaque stand-in for a ProcessGroup object), ``Settings.astuple()`` in ``fields``
    (a frozen dataclass is no Dynamo constant) and ``n_tokens=-1`` (a symbolic token count is no
    constant; the per-call guard compares it)."""
    if isinstance(group, str):  # traced: the group by name (a constant; the group object is opaque there)
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group) if group else None  # type: ignore[arg-type]  # torch types it GroupName, a NewType of str
    size = group_size(group)
    start, vocab, stale = resolve_shard(group, weight, vocab_start, device, n_tokens, fields, vocab_size)
    return start, vocab, group.group_name if group is not None and size > 1 else "", size, stale


# torch._dynamo.assume_constant_result without importing torch._dynamo (~1 s) at import time
resolve_call._dynamo_marked_constant = True  # type: ignore[attr-defined]
