"""The per-call cross-rank guard, folded into the statistics all-gather (no extra collective).

Every rank of a group must make the same call: the same options and settings, the same tokens (or
equal slices under sequence parallelism) and the same targets, all inside ``[0, V)``. The shard
check of ``shard.py`` compares the layout and options once per agreed plan (``agree.py``: the plan
every rank issues its collectives by is taken from the group's history of agreed calls, so a rank
whose call differs runs that plan in its place); this guard checks every call, so that a rank that
changes an option, its weights or its token count later, or passes other targets than its peers, or
a shard other than the one that was checked, never yields a finite wrong loss.

Each rank appends ``WORDS`` int32 words to its ``[Nc, 4]`` statistics (as the raw bits of extra
float rows, 32 bytes) in the first statistics all-gather of each call
(``collectives.combine_stats``; the fused strategy's later chunks reuse that verdict, a device
bool, so they carry nothing extra):

    word  what                                                      when
    0, 1  digest of the call: options, settings, global V, hidden   always (a cached device copy,
          size, dtype, gradient need                                 built once per call digest)
    2     1 if this rank's shard is not the one the shard check      always (in that same copy)
          saw for this stated layout (``FLCEParams.stale_layout``);
          + 2 from a stand-in whose own call raises (``agree.py``)
    3     global token count N and rows per chunk                    always (one device fill)
    4     checksum of the (global) targets: sum_n t_n * c_n,         always (3 small kernels)
          wrapping int64, low 32 bits
    5     number of targets outside [0, V) that are not ignored      where a failure raises: CPU
                                                                     tensors, check_finite=True;
                                                                     and with check_inputs=True
    6     raw bits of a float32 checksum of 16 rows of hidden        check_inputs=True only
    7     checksum of the values of ``loss_weights`` (the token        with loss_weights or
          weights, 0 on ignored tokens: their raw bits, as word 4)     num_items_in_batch (2-4
          and of ``num_items_in_batch``                                small kernels each)

Default cost per call with a group of P > 1 ranks: the small kernels that build words 2-4 and read
the verdict, and the extra rows of the one all-gather (no host sync, nothing per token count that
is cached); ``check_inputs=True`` adds the hidden sample and the bad-target count (the behaviour
before issue 52). ``benchmarks/probes/guard_cost.py`` measures both (docs/results.md).
Without word 5 a target outside ``[0, V)`` still makes its token's loss NaN (``kernels/token_loss``).

After the gather every rank holds every rank's words (the same tensor on all ranks), so all ranks
reach the same verdict: ``ok`` = all words equal across ranks, and words 2 and 5 are 0. Without a
host sync (CUDA) a failed guard sets the chunk's global lse to NaN, so the loss and every gradient
are NaN on every rank (never a finite wrong value); where the check costs no sync (CPU tensors) or
the caller already pays one (``check_finite=True``) every rank raises the same ``ValueError`` naming
what differs. Targets and hidden are compared after the sequence-parallel gathers (then they agree
by construction, and only the bad-target count and the call digest can differ).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .shard import call_signature

WORDS = 8
STALE, TOKENS, TARGETS, BAD, HIDDEN, WEIGHTS = 2, 3, 4, 5, 6, 7
# what a difference in a word most likely means (the words compared for equality)
_FIELDS = {
    0: "the call (options, settings, vocabulary size, hidden size, dtype or gradient need)",
    1: "the call",
    TOKENS: "the number of tokens or the chunk plan",
    TARGETS: "the targets",
    HIDDEN: "the hidden states",
    WEIGHTS: "loss_weights or num_items_in_batch",
}
# what a difference in a word most likely means, said after it
_HINTS = {
    TARGETS: " (target holds GLOBAL vocabulary ids in [0, V), the same ids on every rank: not ids local to a "
    "rank's shard, and no rank subtracts its vocab_start)"
}


@lru_cache(maxsize=256)
def call_digest(*fields: object) -> int:
    """The call's digest (cached: the fields are hashable and repeat from step to step)."""
    return call_signature(*fields)


_CACHE_SIZE = 64


def _digest_words(sig: int) -> list[int]:
    """Words 0 and 1: a call digest's low 62 bits as two non-negative int32 words (what every rank of the same
    plan sends; :func:`settle_stand_in` compares them with the predicted plan's)."""
    return [sig & 0x7FFFFFFF, (sig >> 31) & 0x7FFFFFFF]


@lru_cache(maxsize=_CACHE_SIZE)
def _head_words(sig: int, stale: int, device: torch.device) -> torch.Tensor:
    """Words 0-2 on the device: one host-to-device copy per distinct call digest (cached, bounded;
    a copy from pageable memory waits for the stream, so never per step). Nothing here is per token
    count: RL and evaluation change N every call."""
    return torch.tensor([*_digest_words(sig), stale], dtype=torch.int32, device=device)


@lru_cache(maxsize=8)
def _zeros(n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=device)


@lru_cache(maxsize=8)
def _keep_mask(device: torch.device) -> torch.Tensor:
    """1 for the words compared for equality, 0 for those that must be 0 on every rank (2, 5)."""
    mask = torch.ones(WORDS, dtype=torch.int32)
    mask[[STALE, BAD]] = 0
    return mask.to(device)


# the target checksum's odd coefficients c_n (they depend on n only, not on N): one buffer per device,
# grown to the next power of two, of which every call takes a prefix (no kernel, no per-N cache)
_COEFFICIENTS: dict[torch.device, torch.Tensor] = {}


def _coefficients(n: int, device: torch.device) -> torch.Tensor:
    buf = _COEFFICIENTS.get(device)
    if buf is None or buf.shape[0] < n:
        size = 1 << max(n - 1, 0).bit_length()
        buf = torch.arange(size, device=device, dtype=torch.int64) * 2654435761 % 2147483647 * 2 + 1
        _COEFFICIENTS[device] = buf
    return buf[:n]


def value_checksum(weights: torch.Tensor | None, num_items: torch.Tensor | None) -> torch.Tensor | None:
    """Word 7 (int32 ``[1]``), or None where neither is given: ``sum_n bits(w_n) * c_n`` (wrapping int64, its low
    32 bits; ``weights`` [N]: the token weights as the loss uses them, 0 on ignored tokens, float32 or float64)
    plus the float32 bits of ``num_items_in_batch`` times an odd constant (50 and 50.0 are one count). 3 small
    kernels for the weights, 2 for the count (float64 weights: 2 more, their bits folded to 32)."""
    total = None
    if weights is not None and weights.numel():
        if weights.element_size() == 8:
            b = weights.view(torch.int64)
            b = b ^ (b >> 32)
        else:
            b = weights.float().view(torch.int32)
        total = (b * _coefficients(weights.numel(), weights.device)).sum().to(torch.int32)
    if num_items is not None:
        item = num_items.reshape(1).to(torch.float32).view(torch.int32) * 0x1E3779B1
        return item if total is None else item + total.to(item.device)
    return None if total is None else total.view(1)


def plan_digest(x: torch.Tensor, vocab_size: int, fields: tuple) -> int:
    """Words 0 and 1 of a call on ``x`` (its hidden size and dtype) with these ``fields`` (options, settings,
    bias, gradient need): what every rank that makes the same call sends."""
    return call_digest(*fields, vocab_size, tuple(x.shape[1:]), str(x.dtype))


def call_guard(
    x: torch.Tensor,
    target: torch.Tensor,
    bad: torch.Tensor,
    vocab_size: int,
    rows: int,
    fields: tuple,
    *,
    stale: bool = False,
    count_bad: bool = True,
    check_inputs: bool = False,
    values: torch.Tensor | None = None,
    digest: int | None = None,
    raises: bool = False,
) -> torch.Tensor:
    """This rank's ``[WORDS]`` int32 guard for a call on ``x [N, H]``, ``target [N]`` (global ids,
    int64), ``bad [N]`` (bool: the targets outside ``[0, V)`` that are not ignored, as the core marks
    them); ``fields``: what else every rank must agree on (options, settings, bias, gradient need).
    ``stale``: this rank's shard is not the one the shard check saw (word 2). ``count_bad``: fill
    word 5 (where a failure raises); ``check_inputs``: words 5 and 6 (the opt-in debugging checks);
    ``values``: word 7, :func:`value_checksum` of the loss weights and ``num_items_in_batch`` (None: 0);
    ``digest``: words 0 and 1 in place of :func:`plan_digest`'s (a stand-in sends its own call's, ``agree.py``),
    ``raises``: a stand-in whose own call would raise on a failed guard (bit 2 of word 2).
    No host sync in steady state, and none for a new token count: word 3 is a device fill (a kernel
    argument, not a copy)."""
    sig = plan_digest(x, vocab_size, fields) if digest is None else digest
    n, dev = x.shape[0], x.device
    parts = [
        _head_words(sig, int(bool(stale)) | (2 if raises else 0), dev),
        torch.full((1,), ((n % 32768) << 16) + rows % 65536, dtype=torch.int32, device=dev),
    ]
    if n:
        # int64 products and sums wrap identically on every rank (modular arithmetic is order-free)
        parts.append((target * _coefficients(n, dev)).sum().to(torch.int32).view(1))
    else:
        parts.append(_zeros(1, dev))
    if n and (count_bad or check_inputs):
        parts.append(bad.sum().to(torch.int32).view(1))
    else:
        parts.append(_zeros(1, dev))
    if n and check_inputs:
        sample = torch.linspace(0, n - 1, min(n, 16), device=dev).long()
        parts.append(x.index_select(0, sample).float().sum().view(torch.int32).view(1))
    else:
        parts.append(_zeros(1, dev))
    parts.append(_zeros(1, dev) if values is None else values)
    return torch.cat(parts)


def verdict(guards: torch.Tensor) -> torch.Tensor:
    """0-d bool on the device: every rank made the same call on the checked shard, and no target is
    outside [0, V). One compare against rank 0's row with words 2 and 5 zeroed: equal on every rank
    (rank 0 included) means equal across ranks and those words 0."""
    return (guards == guards[0] * _keep_mask(guards.device)).all()


def settle_stand_in(guards: torch.Tensor, predicted: int) -> None:
    """A stand-in's reading of the gathered ``guards`` (a host sync; ``agree.py``). Where every rank stood in
    (no rank sent ``predicted``, the plan every rank expected): for the same call and token count,
    :class:`agree.Replan`; for other token counts, or for different calls where one of them raises on a failed
    guard (CPU tensors, ``check_finite``: bit 2 of word 2), the same ``ValueError`` on every rank, as each rank
    read the guards. Else nothing here: the guard fails on every rank, and each rank, stand-ins included, raises
    or poisons as the predicted plan does."""
    from .agree import Replan

    g = guards.cpu()
    head = g[:, :2]
    want = torch.tensor(_digest_words(predicted), dtype=head.dtype)
    if bool((head == want).all(1).any()):
        return
    tokens = bool((g[:, TOKENS] == g[0, TOKENS]).all())
    if tokens and bool((head == head[0]).all()):
        raise Replan()
    if not tokens or bool((g[:, STALE] & 2).any()):
        raise_if_failed(g)


def raise_if_failed(guards: torch.Tensor) -> None:
    """The same ``ValueError`` on every rank (a host sync: only where it is free or already paid)."""
    g = guards.cpu()
    keep = _keep_mask(g.device)
    if bool((g == g[0] * keep).all()):
        return
    differs = [w for w in _FIELDS if any(c != g[0, w] for c in g[:, w].tolist())]
    same_call = (
        "every rank of a tensor-parallel group must make the same call (the same hidden and target "
        "without sequence parallelism)"
    )
    if differs and differs[0] in (0, 1):
        raise ValueError(
            f"ranks {_ranks(g, differs[0])} of the group differ from rank 0 in {_FIELDS[differs[0]]}: " + same_call
        )
    stale = (g[:, STALE] & 1).tolist()
    if any(stale):
        raise ValueError(
            f"ranks {[r for r, s in enumerate(stale) if s]} pass another vocabulary shard (rows or "
            "vocab_start) than the one checked for this group and stated layout (the shard check runs "
            "once per group, vocab_size, vocab_start given or not, hidden size, dtype and device): pass "
            "vocab_size= (a new vocabulary size is a new layout), or call "
            "flce_dist.distributed.shard.clear_shard_cache() on every rank when the layout changes"
        )
    if differs:
        w = differs[0]
        raise ValueError(
            f"ranks {_ranks(g, w)} of the group differ from rank 0 in {_FIELDS[w]}{_HINTS.get(w, '')}: " + same_call
        )
    bad = g[:, BAD].tolist()
    raise ValueError(f"{max(bad)} target(s) outside [0, V) that are not ignore_index (counts per rank: {bad})")


def _ranks(g: torch.Tensor, word: int) -> list[int]:
    col = g[:, word].tolist()
    return [r for r, c in enumerate(col) if c != col[0]]
