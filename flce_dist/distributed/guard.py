"""The per-call cross-rank guard, folded into the statistics all-gather (no extra collective).

Every rank of a group must make the same call: the same options and settings, the same tokens (or
equal slices under sequence parallelism) and the same targets, all inside ``[0, V)``. The shard
check of ``shard.py`` compares the layout and options once per layout (not per token count: that
is this guard's word 2); this guard checks every call, so that a rank that changes an option or its
token count later, or passes other hidden states or targets than its peers, or a target outside
``[0, V)`` under sequence parallelism, never yields a finite wrong loss.

Each rank appends ``WORDS`` int32 words to its ``[Nc, 4]`` statistics (as the raw bits of one or two
extra float rows, 32 bytes) in the first statistics all-gather of each call
(``collectives.combine_stats``; the fused strategy's later chunks reuse that verdict, a device
bool, so they carry nothing extra):

    0, 1   digest of the call: options, settings, global V, hidden size, dtype (host, cached per call digest)
    2      global token count N and rows per chunk (N * 2**16 + rows, 31 bits; a device fill)
    3      checksum of the (global) targets: sum_n t_n * c_n, wrapping int64, low 31 bits (device)
    4      raw bits of a float32 checksum of 16 rows of hidden  (device)
    5      number of targets outside [0, V) that are not ignore_index  (device)
    6, 7   0 (reserved)

After the gather every rank holds every rank's words (the same tensor on all ranks), so all ranks
reach the same verdict: ``ok`` = all words equal across ranks and no bad target. Without a host
sync (CUDA) a failed guard sets the chunk's global lse to NaN, so the loss and every gradient are
NaN on every rank (never a finite wrong value); where the check costs no sync (CPU tensors) or the
caller already pays one (``check_finite=True``) every rank raises the same ``ValueError`` naming what
differs. Targets and hidden are compared after the sequence-parallel gathers (then they agree by
construction, and only the bad-target count and the call digest can differ).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .shard import call_signature

WORDS = 8
_FIELDS = ("the call (options, settings, vocabulary size, hidden size or dtype)", "the call",
           "the number of tokens or the chunk plan", "the targets", "the hidden states")
# what a difference in a word most likely means, said after it
_HINTS = {3: " (target holds GLOBAL vocabulary ids in [0, V), the same ids on every rank: not ids local to a rank's "
             "shard, and no rank subtracts its vocab_start)"}


@lru_cache(maxsize=256)
def call_digest(*fields: object) -> int:
    """The call's digest (cached: the fields are hashable and repeat from step to step)."""
    return call_signature(*fields)


_CACHE_SIZE = 64


@lru_cache(maxsize=_CACHE_SIZE)
def _digest_words(sig: int, device: torch.device) -> torch.Tensor:
    """Words 0-1 on the device: one host-to-device copy per distinct call digest (cached, bounded;
    a copy from pageable memory waits for the stream, so never per step). Nothing here is per token
    count: RL and evaluation change N every call."""
    return torch.tensor([sig & 0x7FFFFFFF, (sig >> 31) & 0x7FFFFFFF], dtype=torch.int32, device=device)


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


def call_guard(x: torch.Tensor, target: torch.Tensor, bad: torch.Tensor, vocab_size: int, rows: int,
               fields: tuple) -> torch.Tensor:
    """This rank's ``[WORDS]`` int32 guard for a call on ``x [N, H]``, ``target [N]`` (global ids),
    ``bad [N]`` (bool: the targets outside ``[0, V)`` that are not ignored, as the core marks them);
    ``fields``: what else every rank must agree on (options, settings, bias, gradient need).
    About 10 small kernels per call, no host sync in steady state, and none for a new token count:
    word 2 is a device fill (a kernel argument, not a copy), the 16 sampled rows a device linspace."""
    sig = call_digest(*fields, vocab_size, tuple(x.shape[1:]), str(x.dtype))
    n = x.shape[0]
    head = torch.cat([_digest_words(sig, x.device),
                      torch.full((1,), ((n % 32768) << 16) + rows % 65536, dtype=torch.int32, device=x.device)])
    if not n:
        return torch.cat([head, head.new_zeros(WORDS - 3)])
    coef = _coefficients(n, x.device)
    sample = torch.linspace(0, n - 1, min(n, 16), device=x.device).long()
    # int64 products and sums wrap identically on every rank (modular arithmetic is order-free)
    checksum = (target.to(torch.int64) * coef).sum().to(torch.int32)
    hidden = x.index_select(0, sample).float().sum().view(torch.int32)
    tail = torch.stack([checksum & 0x7FFFFFFF, hidden, bad.sum().to(torch.int32)])
    return torch.cat([head, tail, tail.new_zeros(WORDS - 6)])


def verdict(guards: torch.Tensor) -> torch.Tensor:
    """0-d bool on the device: every rank made the same call and no target is outside [0, V)."""
    return (guards == guards[0]).all() & (guards[0, 5] == 0)


def raise_if_failed(guards: torch.Tensor) -> None:
    """The same ``ValueError`` on every rank (a host sync: only where it is free or already paid)."""
    g = guards.cpu()
    if bool((g == g[0]).all()) and int(g[0, 5]) == 0:
        return
    for word, what in enumerate(_FIELDS):
        col = g[:, word].tolist()
        if any(c != col[0] for c in col):
            ranks = [r for r, c in enumerate(col) if c != col[0]]
            raise ValueError(f"ranks {ranks} of the group differ from rank 0 in {what}{_HINTS.get(word, '')}: every "
                             "rank of a tensor-parallel group must make the same call (the same hidden and target "
                             "without sequence parallelism)")
    bad = g[:, 5].tolist()
    raise ValueError(f"{max(bad)} target(s) outside [0, V) that are not ignore_index (counts per rank: {bad})")
