"""Issue 61: when one rank of a group differs, every rank gets the same answer: the same error, the same
correct result, or (the GPU's guard path, no host sync) NaN on every rank. Never a hang, an abort, or a
finite wrong loss. Findings 1-3 at 2 gloo ranks, each on both guard paths: the CPU's (a failed guard
raises; the host reads the verdict for free) and the GPU's (the verdict stays on the device: emulated
here by letting ``core.can_raise`` return False, as ``dist_checks.py --poison`` does).

(1) ``loss_weights`` (or ``num_items_in_batch``) that differ across ranks: before, a finite wrong loss
    on each rank and a dX mixed from both weightings.
(2) a rank-only change of what needs a gradient (hidden, weight), of ``partial_dx`` or of grad mode:
    before, on the GPU path one rank returned and the other waited in the fused forward's dX all-reduce
    (or the deterministic path's) until the group's timeout.
(3) a rank-only change of how the layout is stated (``vocab_start=`` on one rank, ``vocab_size`` V on one
    rank and V + 1 on another) after a call that filled the shard check's cache: before, one rank
    entered the handshake all-gather alone and the process died in ``gloo::EnforceNotMet``.

The property harness (every option, shapes, dtypes, 2 and 3 ranks) is ``tests/test_rank_property.py``;
both use the long-lived ranks of ``tests/_rank_pool.py``."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests._rank_pool import Broken, RankPool

N, H, V = 10, 16, 37
IGNORED = (1, 6)  # the ignored tokens (reduction="none": their loss is 0 on every path)


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, gloo_timeout_s=10.0)
    yield p
    p.close()


@contextlib.contextmanager
def _guard_path(poison: bool):
    """``poison``: the GPU's guard path (a failed guard makes every output NaN; raises only with check_finite)."""
    from flce_dist import core

    real = core.can_raise
    if poison:
        core.can_raise = lambda x, p: p.check_finite
    try:
        yield
    finally:
        core.can_raise = real


@contextlib.contextmanager
def _restore(obj, name: str, value):
    try:
        yield
    finally:
        setattr(obj, name, value)


def _data(rank: int, world: int, seed: int = 0):
    import flce_dist

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    t = torch.randint(0, V, (N,), generator=g)
    t[list(IGNORED)] = -100
    lw = torch.rand(N, generator=g) + 0.5
    lo, hi = flce_dist.vocab_shard(V, rank, world)
    return x, w, t, lw, lo, hi


def _summary(out) -> dict:
    """The loss's values over the non-ignored tokens (NaN-checkable) and whether a backward ran."""
    loss = out[0] if isinstance(out, tuple) else out
    return {"loss": loss.detach().double().flatten().tolist()}


def _case_worker(rank, world, group, payload):
    """One warm-up call that every rank makes alike (it fills the shard check's cache), then the call that
    differs on rank ``payload["odd"]`` (``payload["case"]``), forward and backward."""
    import flce_dist
    from flce_dist import settings
    from flce_dist.distributed.shard import clear_shard_cache
    from tests._checks import SMALL_BLOCKS

    from flce_dist import chunking

    case, poison, strategy = payload["case"], payload["poison"], payload.get("strategy", "auto")
    odd = rank == payload.get("odd", world - 1)
    x, w, t, lw, lo, hi = _data(rank, world)
    dtype = getattr(torch, payload.get("dtype", "float32"))
    x, w = x.to(dtype), w.to(dtype)
    clear_shard_cache()
    budget = chunking.CPU_CHUNK_BYTES
    # a budget that gives several token chunks: the fused plan of a 16-bit call then depends on need_dW
    chunking.CPU_CHUNK_BYTES = payload.get("cpu_chunk_bytes", budget)
    with _guard_path(poison), settings.override(blocks=SMALL_BLOCKS), _restore(chunking, "CPU_CHUNK_BYTES", budget):
        F = flce_dist.fused_linear_cross_entropy
        base = dict(group=group, vocab_size=V, strategy=strategy, reduction=payload.get("reduction", "mean"),
                    deterministic=payload.get("deterministic", False))
        if case in ("loss_weights", "num_items"):
            base.update(loss_weights=lw) if case == "loss_weights" else base.update(num_items_in_batch=9)
        xs, ws = x.clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
        F(xs, ws, t, **base).sum().backward()  # the warm-up: identical on every rank
        kw, xs, ws = dict(base), x.clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
        grad = contextlib.nullcontext()
        if odd:
            if case == "loss_weights":
                kw["loss_weights"] = torch.ones(N)
            elif case == "num_items":
                kw["num_items_in_batch"] = 10
            elif case == "hidden_frozen":
                xs.requires_grad_(False)
            elif case == "weight_frozen":
                ws.requires_grad_(False)
            elif case == "partial_dx":
                kw["partial_dx"] = True
            elif case == "no_grad":
                grad = torch.no_grad()
            elif case == "vocab_start":
                kw["vocab_start"] = lo
            elif case == "vocab_size":
                kw["vocab_size"] = V + 1
        with grad:
            out = F(xs, ws, t, **kw)
        res = _summary(out)
        if out.requires_grad:
            out.sum().backward()
            res["backward"] = True
        return res


def _check(outs, poison: bool, words: tuple[str, ...] = ()):
    """Every rank raised the same ValueError (CPU path), or every rank's loss is NaN (GPU path); never a
    hang, an abort, or a finite loss."""
    assert not isinstance(outs, Broken), f"{outs.why}: {outs.detail} {outs.outcomes}"
    errors = {o.error for o in outs}
    assert not any("Timed out" in o.message or "timeout" in o.message.lower() for o in outs), [o.message for o in outs]
    if poison:
        assert errors == {None}, [o.message for o in outs]
        for o in outs:
            loss = [v for i, v in enumerate(o.value["loss"]) if len(o.value["loss"]) == 1 or i not in IGNORED]
            assert all(v != v for v in loss), o.value  # NaN, not a finite (wrong) loss
    else:
        assert errors == {"ValueError"}, [(o.error, o.message[:300], o.value) for o in outs]
        messages = {o.message.split("\n")[0] for o in outs}
        assert len(messages) == 1, messages  # the same message on every rank
        assert all(w_ in messages.pop() for w_ in words), (words, outs[0].message)


@pytest.mark.dist
@pytest.mark.parametrize("poison", [False, True], ids=["host-verdict", "device-verdict"])
@pytest.mark.parametrize("case,reduction,strategy", [("loss_weights", "mean", "auto"), ("loss_weights", "sum", "auto"),
                                                     ("loss_weights", "none", "auto"),
                                                     ("loss_weights", "mean", "recompute"),
                                                     ("num_items", "mean", "auto")])
def test_finding1_values_that_differ_across_ranks(pool, poison, case, reduction, strategy):
    """Finding 1: loss_weights of other values on one rank (or another num_items_in_batch): the guard's word 7
    compares their checksum, so the ranks never return a finite wrong loss."""
    outs = pool.run(_case_worker, dict(case=case, poison=poison, reduction=reduction, strategy=strategy))
    _check(outs, poison, ("loss_weights",))


@pytest.mark.dist
@pytest.mark.parametrize("poison", [False, True], ids=["host-verdict", "device-verdict"])
@pytest.mark.parametrize("case,strategy,deterministic", [
    ("hidden_frozen", "fused", False), ("hidden_frozen", "recompute", False), ("hidden_frozen", "fused", True),
    ("weight_frozen", "fused", False), ("weight_frozen_plan", "fused", False), ("partial_dx", "fused", False),
    ("partial_dx", "recompute", False), ("no_grad", "fused", False), ("no_grad", "recompute", False)])
def test_finding2_collectives_never_depend_on_one_ranks_fields(pool, poison, case, strategy, deterministic):
    """Finding 2: a rank that alone changes which gradients it needs, partial_dx or grad mode: before, it
    issued other collectives than its peers (the dX all-reduce of the fused forward, the deterministic
    path, the recompute backward's, a bf16 chunk plan that depends on need_dW: 4 token chunks with dW, 10
    without) and one rank waited until the group's timeout or died of the mismatch."""
    extra = dict(dtype="bfloat16", cpu_chunk_bytes=128) if case == "weight_frozen_plan" else {}
    outs = pool.run(_case_worker, dict(case=case.replace("_plan", ""), poison=poison, strategy=strategy,
                                       deterministic=deterministic, **extra))
    _check(outs, poison, ("call",))


@pytest.mark.dist
@pytest.mark.parametrize("poison", [False, True], ids=["host-verdict", "device-verdict"])
@pytest.mark.parametrize("case,odd", [("vocab_start", 0), ("vocab_start", 1), ("vocab_size", 1)])
def test_finding3_a_cache_miss_on_one_rank_adds_no_collective(pool, poison, case, odd):
    """Finding 3: after a call that filled the shard check's cache, one rank states the layout otherwise
    (vocab_start= on one rank only; vocab_size V on one rank and V + 1 on the other): before, that rank
    missed the cache and entered the handshake all-gather alone (gloo aborted the process)."""
    outs = pool.run(_case_worker, dict(case=case, poison=poison, odd=odd))
    _check(outs, poison, ("call",))
