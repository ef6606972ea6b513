"""Issue 61, the class: a multi-rank property harness. Hypothesis draws a valid call on a group of 2 or 3
gloo ranks, then changes one rank's arguments (a loss option, ``loss_weights`` or ``num_items_in_batch``, one
target, the hidden size, the token count, the leading shape, the dtype, ``requires_grad`` of hidden / weight /
bias, grad mode, ``partial_dx``, how the layout is stated, an empty or otherwise split shard, an output-only
option, or nothing), with the shard check's cache cold, warm from the same call, or warm from another call.
For every example, on both guard paths (the CPU's host verdict; the GPU's device verdict, emulated by
letting ``core.can_raise`` return False), exactly one of:

* every rank raises the same exception type (a ``ValueError`` naming what differs);
* every rank returns a finite result equal to the float64 reference of the unchanged call (loss, lse,
  entropy, dX (summed over the ranks with ``partial_dx``), dW and db shards), which only a change that
  does not change the math may give;
* (device verdict) every rank's loss is NaN (0 at ignored tokens of per-token outputs) and the backward,
  where autograd runs one, ends on every rank;

and never a hang (every collective times out after a few seconds and every example runs under a watchdog),
an abort (a rank process that dies, e.g. gloo's ``EnforceNotMet`` on a collective mismatch), ranks that
leave an example after different collectives, or a finite wrong value.

Not drawn (docs/guarantees.md, "not caught"): a token count that differs on one rank once the group's history
of agreed calls predicts the call (the all-gathers' sizes differ before any verdict: gloo aborts), a rank
that raises before its first collective (an argument error of its own: its peers time out), a rank that
skips the backward its peers run, ``clear_shard_cache()`` on one rank only, ``torch.compile``.

The examples run on long-lived ranks (``tests/_rank_pool.py``): 30-90 ms each. ``FLCE_PROPERTY_EXAMPLES``
sets the examples per (world size, guard path), drawn at random (the default: 300 at 2 ranks and 150 at 3, at
fixed seeds, ~35 s on CI's 2 cores); ``FLCE_PROPERTY_EXAMPLES=2000`` is the long run (8000 examples, ~6 min)."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from tests._rank_pool import Broken, RankPool

EXAMPLES = int(os.environ.get("FLCE_PROPERTY_EXAMPLES", "0")) or None
_DEFAULT = {2: 300, 3: 150}  # per guard path: ~35 s in all on 2 cores
TIMEOUT_S = 10.0
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
TOL = {"float32": (1e-5, 1e-4), "float64": (1e-10, 1e-9), "bfloat16": (2e-2, 5e-2)}
_OPTION_CHANGES = {"reduction": ["mean", "sum", "none"], "strategy": ["auto", "fused", "recompute"],
                   "label_smoothing": [0.0, 0.1], "z_loss": [0.0, 1e-3], "softcap": [None, 5.0],
                   "temperature": [1.0, 0.7], "ignore_index": [-100, 3], "deterministic": [False, True],
                   "sequence_parallel": [False, True], "partial_dx": [False, True],
                   "grad_filter_eps": [None, "auto"], "return_entropy": [False, True], "check_finite": [False, True]}


# ---------------------------------------------------------------------------------------------- examples

def _valid(opts: dict, n_in: int, world: int, lw: bool, num_items) -> bool:
    """Whether one rank's call passes its own argument checks (a rank that raises alone before its first
    collective strands its peers: not drawn)."""
    from flce_dist import LossOptions

    try:
        LossOptions(**opts)
    except (TypeError, ValueError):
        return False
    if num_items is not None and opts.get("reduction", "mean") != "mean":
        return False
    return True


@st.composite
def examples(draw, world: int):
    """One example: the base call (``base``) and what rank ``odd`` changes (``change``)."""
    sp = draw(st.booleans())
    opts = dict(reduction=draw(st.sampled_from(["mean", "sum", "none"])),
                strategy=draw(st.sampled_from(["auto", "fused", "recompute"])),
                label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1])), z_loss=draw(st.sampled_from([0.0, 1e-3])),
                softcap=draw(st.sampled_from([None, None, 5.0])), temperature=draw(st.sampled_from([1.0, 0.7])),
                ignore_index=draw(st.sampled_from([-100, -100, 3])), deterministic=draw(st.booleans()),
                sequence_parallel=sp, partial_dx=not sp and draw(st.integers(0, 4)) == 0,
                grad_filter_eps=draw(st.sampled_from([None, None, "auto"])),
                return_entropy=draw(st.integers(0, 3)) == 0, check_finite=draw(st.integers(0, 5)) == 0)
    if opts["grad_filter_eps"] is not None:
        opts["label_smoothing"] = 0.0
    lw = draw(st.integers(0, 3)) == 0
    num_items = draw(st.sampled_from([None, None, None, 7])) if opts["reduction"] == "mean" else None
    n_in = draw(st.integers(1, 6)) if sp else draw(st.integers(1, 12))
    base = dict(world=world, seed=draw(st.integers(0, 2**20)), n_in=n_in, h=draw(st.integers(1, 20)),
                v=draw(st.integers(1, 40)), dtype=draw(st.sampled_from(["float32"] * 6 + ["float64", "bfloat16"])),
                bias=draw(st.booleans()), layout=draw(st.sampled_from(["size", "size", "start", "both"])),
                split=draw(st.sampled_from(["balanced", "chunk"])), opts=opts, lw=lw, num_items=num_items,
                grad=dict(x=draw(st.integers(0, 5)) > 0, w=draw(st.integers(0, 5)) > 0, b=draw(st.booleans())),
                no_grad=draw(st.integers(0, 9)) == 0, warm=draw(st.sampled_from(["cold", "same", "same", "other"])),
                leading=draw(st.booleans()))
    assume(_valid(opts, n_in, world, lw, num_items))
    # the changes that keep this rank's own call valid (one that raises alone before its first collective: not drawn)
    kinds = ["option", "lw", "target", "h", "lead", "dtype", "requires_grad", "no_grad", "layout", "shard",
             "output", "none"] + ["num_items"] * (opts["reduction"] == "mean") + ["n"] * (base["warm"] == "cold")
    kind = draw(st.sampled_from(kinds))
    change: dict = {"kind": kind}
    if kind == "option":
        name = draw(st.sampled_from(sorted(_OPTION_CHANGES)))
        value = draw(st.sampled_from([v for v in _OPTION_CHANGES[name] if v != opts[name]]))
        change.update(name=name, value=value)
        mine = {**opts, name: value}
        assume(name != "sequence_parallel" or sp or n_in % world == 0)  # the same token count, sliced
        assume(_valid(mine, n_in, world, lw, num_items if mine["reduction"] == "mean" else None))
    elif kind == "lw":
        change["how"] = draw(st.sampled_from(["values", "toggle"]))
    elif kind == "num_items":
        change["value"] = draw(st.sampled_from([v for v in (None, 7, 9, 7.5) if v != num_items]))
    elif kind == "dtype":
        change["value"] = draw(st.sampled_from([d for d in DTYPES if d != base["dtype"]]))
    elif kind == "requires_grad":
        change["which"] = draw(st.sampled_from(["x", "w", "b"] if base["bias"] else ["x", "w"]))
    elif kind == "layout":
        change["how"] = draw(st.sampled_from([h for h in ("size", "start", "both", "size+1") if h != base["layout"]]))
    elif kind == "shard":
        change["how"] = draw(st.sampled_from(["empty", "other_split"]))
    elif kind == "output":
        change["name"] = draw(st.sampled_from(["return_lse", "return_token_accuracy"]))
    change["odd"] = draw(st.integers(0, world - 1))
    return base, change


def problem(base: dict) -> dict:
    """The full problem every rank (and the test) builds from the example's seed, in float64."""
    g = torch.Generator().manual_seed(base["seed"])
    p, n_in, h, v = base["world"], base["n_in"], base["h"], base["v"]
    n = n_in * p if base["opts"]["sequence_parallel"] else n_in
    x = torch.randn(n + 1, h + 1, generator=g, dtype=torch.float64)  # one more token and feature: changes
    w = torch.randn(v, h + 1, generator=g, dtype=torch.float64) * (h + 1) ** -0.5 * 2
    b = torch.randn(v, generator=g, dtype=torch.float64)
    t = torch.randint(0, v, (n + 1,), generator=g)
    t[torch.rand(n + 1, generator=g) < 0.25] = base["opts"]["ignore_index"]
    lw = torch.rand(n + 1, generator=g, dtype=torch.float64) + 0.25
    go = torch.randn(n + 1, generator=g, dtype=torch.float64)
    return dict(n=n, x=x, w=w, b=b, t=t, lw=lw, other_lw=lw.flip(0) * 1.5, go=go)


def _shard(v: int, rank: int, world: int, split: str) -> tuple[int, int]:
    from flce_dist import vocab_shard

    return vocab_shard(v, rank, world, split=split)


def rank_shard(base: dict, change: dict | None, rank: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` rank ``rank`` passes (its change applied where it is the odd rank)."""
    mine = change if change is not None and change["odd"] == rank else {"kind": "none"}
    split = base["split"]
    if mine["kind"] == "shard" and mine["how"] == "other_split":
        split = "chunk" if split == "balanced" else "balanced"
    lo, hi = _shard(base["v"], rank, base["world"], split)
    return (lo, lo) if mine["kind"] == "shard" and mine["how"] == "empty" else (lo, hi)


def rank_rows(base: dict, change: dict | None, rank: int) -> slice:
    """The rows of the problem's tokens rank ``rank`` passes (its change applied where it is the odd rank)."""
    mine = change if change is not None and change["odd"] == rank else {"kind": "none"}
    sp = base["opts"]["sequence_parallel"]
    if mine["kind"] == "option" and mine["name"] == "sequence_parallel":
        sp = mine["value"]
    n_in, world, extra = base["n_in"], base["world"], int(mine["kind"] == "n")
    if sp and base["opts"]["sequence_parallel"]:
        return slice(rank * n_in, (rank + 1) * n_in + extra)
    if sp:  # sequence parallelism on this rank alone: its slice of the call's tokens
        per = n_in // world
        return slice(rank * per, (rank + 1) * per + extra)
    return slice(0, n_in * (world if base["opts"]["sequence_parallel"] else 1) + extra)  # all the call's tokens


def rank_valid(base: dict, change: dict, rank: int) -> torch.Tensor:
    """Which of rank ``rank``'s own tokens count (its targets and ``ignore_index``, its change applied)."""
    t = problem(base)["t"][rank_rows(base, change, rank)].clone()
    ignore = base["opts"]["ignore_index"]
    if change["odd"] == rank:
        if change["kind"] == "target":
            t[0] = (t[0] + 1) % base["v"] if t[0] >= 0 else 0
        if change["kind"] == "option" and change["name"] == "ignore_index":
            ignore = change["value"]
    return t != ignore


def vocabulary(base: dict, change: dict) -> int:
    """The call's vocabulary size: the base's, or, where the layout is stated by ``vocab_start`` alone and the last
    rank passes an empty shard, the rows before it (a valid layout of a smaller vocabulary: every rank agrees)."""
    world = base["world"]
    if (base["layout"] == "start" and change["kind"] == "shard" and change["how"] == "empty"
            and change["odd"] == world - 1):
        return rank_shard(base, change, world - 1)[0]
    return base["v"]


# ---------------------------------------------------------------------------------------------- a rank

@contextlib.contextmanager
def _device_verdict(on: bool):
    from flce_dist import core

    real = core.can_raise
    if on:
        core.can_raise = lambda x, p: p.check_finite
    try:
        yield
    finally:
        core.can_raise = real


def _call(rank: int, world: int, group, base: dict, change: dict | None, poison: bool) -> dict:
    """This rank's call of ``base`` (with ``change`` where this rank is the odd one), forward and backward."""
    import flce_dist

    mine = change if change is not None and change["odd"] == rank else {"kind": "none"}
    kind = mine["kind"]
    pr = problem(base)
    opts = dict(base["opts"])
    if kind == "option":
        opts[mine["name"]] = mine["value"]
    if kind == "output":
        opts[mine["name"]] = True
    dtype = DTYPES[mine["value"] if kind == "dtype" else base["dtype"]]
    h = base["h"] + (kind == "h")
    rows = rank_rows(base, change, rank)
    lo, hi = rank_shard(base, change, rank)
    grad = dict(base["grad"])
    if kind == "requires_grad":
        grad[mine["which"]] = not grad[mine["which"]]
    x = pr["x"][rows, :h].to(dtype).clone().requires_grad_(grad["x"])
    w = pr["w"][lo:hi, :h].to(dtype).clone().requires_grad_(grad["w"])
    b = pr["b"][lo:hi].to(dtype).clone().requires_grad_(grad["b"]) if base["bias"] else None
    t = pr["t"][rows].clone()
    if kind == "target":
        t[0] = (t[0] + 1) % base["v"] if t[0] >= 0 else 0
    lw_on = base["lw"] != (kind == "lw" and mine["how"] == "toggle")
    lw = (pr["other_lw"] if kind == "lw" and mine["how"] == "values" else pr["lw"])[rows].float() if lw_on else None
    num_items = mine["value"] if kind == "num_items" else base["num_items"]
    if opts["reduction"] != "mean":
        num_items = None
    layout = mine["how"] if kind == "layout" else base["layout"]
    kw = {}
    if layout in ("size", "both", "size+1"):
        kw["vocab_size"] = base["v"] + (layout == "size+1")
    if layout in ("start", "both"):
        kw["vocab_start"] = lo
    lead = base["leading"] != (kind == "lead")
    xs, ts = (x[None], t[None]) if lead else (x, t)
    lw = lw[None] if lead and lw is not None else lw
    no_grad = base["no_grad"] != (kind == "no_grad")
    out = {}
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        res = flce_dist.fused_linear_cross_entropy(xs, w, ts, bias=b, group=group, loss_weights=lw,
                                                   num_items_in_batch=num_items, **kw, **opts)
    res = res if isinstance(res, tuple) else (res,)
    loss, names = res[0], ["lse"] * opts.get("return_lse", False) + ["acc"] * opts.get("return_token_accuracy", False)
    names += ["ent"] * opts["return_entropy"]
    extras = dict(zip(names, res[1:]))
    out["loss"] = loss.detach().double().flatten().tolist()
    out["ent"] = extras["ent"].detach().double().flatten().tolist() if "ent" in extras else None
    objective = []
    if loss.requires_grad:
        go = pr["go"][rows].to(loss.dtype)
        objective.append((loss.flatten() * go).sum() if opts["reduction"] == "none" else loss)
    if "ent" in extras and extras["ent"].requires_grad:
        objective.append(0.3 * extras["ent"].sum())
    if objective:
        sum(objective).backward()
        out["backward"] = True
    for name, u in (("dx", x), ("dw", w), ("db", b)):
        out[name] = None if u is None or u.grad is None else u.grad.double().flatten().tolist()
    return out


def _example_worker(rank: int, world: int, group, payload) -> dict:
    from flce_dist import settings
    from flce_dist.distributed.shard import clear_shard_cache
    from tests._checks import SMALL_BLOCKS

    base, change, poison = payload
    clear_shard_cache()  # every rank: each example starts cold
    with _device_verdict(poison), settings.override(blocks=SMALL_BLOCKS):
        if base["warm"] == "same":
            _call(rank, world, group, base, None, poison)
        elif base["warm"] == "other":  # a call of another plan first: z-loss on, another reduction
            other = {**base, "opts": {**base["opts"], "z_loss": 2e-3,
                                      "reduction": "sum" if base["opts"]["reduction"] != "sum" else "mean"}}
            other["num_items"] = None
            _call(rank, world, group, other, None, poison)
        return _call(rank, world, group, base, change, poison)


# ---------------------------------------------------------------------------------------------- the property

def reference(base: dict, change: dict) -> dict:
    """The call's outputs and gradients, float64 on the full logits: loss, entropy, dX (all ranks' rows, summed
    over the group's shards), dW, db. The unchanged call's, except under sequence parallelism, where a rank's
    targets and loss weights are its own slice of the call's (gathered by every rank: one call, changed)."""
    from flce_dist import reference_loss
    from flce_dist.reference import reference_logits

    pr, o = problem(base), base["opts"]
    n, h, v = pr["n"], base["h"], vocabulary(base, change)
    cast = DTYPES[base["dtype"]]
    x = pr["x"][:n, :h].to(cast).double().requires_grad_()
    w = pr["w"][:v, :h].to(cast).double().requires_grad_()
    b = pr["b"][:v].to(cast).double().requires_grad_() if base["bias"] else None
    t = pr["t"][:n].clone()
    lw = pr["lw"][:n].float().double() if base["lw"] else None
    if o["sequence_parallel"]:
        first = change["odd"] * base["n_in"]
        if change["kind"] == "target":
            t[first] = (t[first] + 1) % base["v"] if t[first] >= 0 else 0
        if change["kind"] == "lw" and change["how"] == "values" and lw is not None:
            rows = slice(first, first + base["n_in"])
            lw[rows] = pr["other_lw"][:n][rows].float().double()
    outside = bool(((t != o["ignore_index"]) & ((t < 0) | (t >= v))).any())  # a target outside [0, V)
    t = torch.where((t >= 0) & (t < v), t, o["ignore_index"]) if outside else t
    loss = reference_loss(x, w, t, bias=b, ignore_index=o["ignore_index"], reduction=o["reduction"],
                          num_items_in_batch=base["num_items"], label_smoothing=o["label_smoothing"],
                          z_loss=o["z_loss"], softcap=o["softcap"], temperature=o["temperature"], loss_weights=lw)
    z = reference_logits(x, w, b, softcap=o["softcap"], temperature=o["temperature"])
    logp = torch.log_softmax(z, -1)
    ent = torch.where(t != o["ignore_index"], -(logp.exp() * logp).sum(-1), 0.0)
    obj = (loss * pr["go"][:n]).sum() if o["reduction"] == "none" else loss
    if o["return_entropy"]:
        obj = obj + 0.3 * ent.sum()
    obj.backward()
    return dict(loss=loss.detach(), ent=ent.detach(), dx=x.grad, dw=w.grad, db=None if b is None else b.grad,
                valid=t != o["ignore_index"], outside=outside)


def _rel(got: list, want: torch.Tensor) -> float:
    g = torch.tensor(got, dtype=torch.float64).reshape(want.shape)
    if not torch.isfinite(g).all():
        return math.inf
    # relative, against at least 0.1 per element: a value near 0 by cancellation (V = 1, label smoothing) is
    # held to an absolute bound, as its parts (O(1) logits) set its rounding
    return float((g - want).norm()) / max(float(want.norm()), 0.1 * max(1, want.numel()) ** 0.5)


def check(base: dict, change: dict, poison: bool, outs) -> None:
    """The property (module docstring) for one example's per-rank outcomes."""
    where = f"base={base} change={change} poison={poison}"
    assert not isinstance(outs, Broken), f"{outs.why}: {outs.detail}\n{where}\n{outs.outcomes}"
    for r, o in enumerate(outs):
        assert not (o.error and ("Timed out" in o.message or "timeout" in o.message.lower())), \
            f"rank {r} timed out (a rank was alone in a collective): {o.message[:2000]}\n{where}"
    errors = [o.error for o in outs]
    if any(errors):
        assert len(set(errors)) == 1, f"ranks raised different errors {errors}: {[o.message[:600] for o in outs]}\n{where}"
        assert errors[0] in ("ValueError", "TypeError"), f"{outs[0].message[:2000]}\n{where}"
        return
    o = base["opts"]
    ref = reference(base, change)
    nan = [any(v != v for v in out.value["loss"]) for out in outs]
    if any(nan):
        assert poison, f"NaN on the host-verdict path: {[out.value['loss'][:4] for out in outs]}\n{where}"
        for r, out in enumerate(outs):
            loss = torch.tensor(out.value["loss"], dtype=torch.float64)
            mine = change if change["odd"] == r else {"kind": "none"}
            per_token = (mine.get("value") if mine["kind"] == "option" and mine["name"] == "reduction"
                         else o["reduction"]) == "none"  # (this rank's own reduction)
            keep = None if per_token else torch.ones_like(loss, dtype=torch.bool)
            if keep is None:
                keep = rank_valid(base, change, r)
                keep = keep if keep.numel() == loss.numel() else torch.ones_like(loss, dtype=torch.bool)
            assert bool(torch.isnan(loss[keep]).all()) or not bool(keep.any()), \
                f"rank {r}: a finite value beside NaN ({loss.tolist()})\n{where}"
        return
    assert not ref["outside"], f"a finite result with a target outside [0, V)\n{where}"
    lt, gt = TOL[base["dtype"]]

    def poisoned(values: list) -> bool:
        """A gradient all NaN beside a correct loss: a failed guard's (device verdict) where no token counts
        (the loss is 0, and so is the reference's), never a finite wrong value."""
        return poison and bool(values) and all(u != u for u in values)

    for r, out in enumerate(outs):
        v = out.value
        rows = rank_rows(base, change, r)
        want = ref["loss"][rows] if o["reduction"] == "none" else ref["loss"]
        assert _rel(v["loss"], want) <= lt, f"rank {r}: loss {v['loss'][:4]} vs {want.flatten()[:4].tolist()}\n{where}"
        if v["ent"] is not None and o["return_entropy"]:
            assert _rel(v["ent"], ref["ent"][rows]) <= lt, f"rank {r}: entropy\n{where}"
        lo, hi = rank_shard(base, change, r)
        if v["dw"] is not None and not poisoned(v["dw"]):
            assert _rel(v["dw"], ref["dw"][lo:hi]) <= gt, f"rank {r}: dW shard\n{where}"
        if v["db"] is not None and not poisoned(v["db"]):
            assert _rel(v["db"], ref["db"][lo:hi]) <= gt, f"rank {r}: db shard\n{where}"
    dxs = [out.value["dx"] for out in outs]
    if all(d is not None and not poisoned(d) for d in dxs):
        if o["partial_dx"]:
            total = torch.stack([torch.tensor(d, dtype=torch.float64) for d in dxs]).sum(0).tolist()
            assert _rel(total, ref["dx"]) <= gt, f"partial dX summed over the ranks\n{where}"
        else:
            for r, d in enumerate(dxs):
                rows = rank_rows(base, change, r)
                assert _rel(d, ref["dx"][rows]) <= gt, f"rank {r}: dX\n{where}"


# ---------------------------------------------------------------------------------------------- tests

_POOLS: dict[int, RankPool] = {}


@pytest.fixture(scope="module")
def pools():
    yield _POOLS
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()


def _pool(world: int) -> RankPool:
    for w in list(_POOLS):  # one pool at a time: CI has 2 cores
        if w != world:
            _POOLS.pop(w).close()
    if world not in _POOLS:
        _POOLS[world] = RankPool(world, gloo_timeout_s=TIMEOUT_S)
    return _POOLS[world]


SEEN: dict = {}  # per (world, poison): how many examples ended in each way (printed; CI asserts a minimum)


def _run(world: int, poison: bool, base: dict, change: dict) -> None:
    outs = _pool(world).run(_example_worker, (base, change, poison), deadline_s=6 * TIMEOUT_S + 120)
    check(base, change, poison, outs)
    how = ("raised " + outs[0].error if outs[0].error
           else "nan" if any(v != v for v in outs[0].value["loss"]) else "result")
    tally = SEEN.setdefault((world, poison), {})
    tally[how] = tally.get(how, 0) + 1
    tally[change["kind"]] = tally.get(change["kind"], 0) + 1


def _property(world: int, poison: bool):
    count = EXAMPLES or _DEFAULT[world]

    @settings(max_examples=count, deadline=None, database=None, derandomize=EXAMPLES is None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(ex=examples(world))
    def prop(ex):
        _run(world, poison, *ex)

    return prop


@pytest.mark.dist
@pytest.mark.parametrize("poison", [False, True], ids=["host-verdict", "device-verdict"])
@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_differs_every_rank_gets_the_same_answer(pools, world, poison):
    """The property (module docstring) over hypothesis-drawn calls and one rank's change, at ``world`` gloo
    ranks, on one guard path. Fixed seeds in CI (``derandomize``); ``FLCE_PROPERTY_EXAMPLES`` draws more,
    at random."""
    SEEN.pop((world, poison), None)
    _property(world, poison)()
    tally = SEEN.get((world, poison), {})
    ran = sum(v for k, v in tally.items() if k in ("result", "nan") or k.startswith("raised"))
    print(f"\n[world {world}, {'device' if poison else 'host'} verdict] {ran} examples: {tally}")
    assert ran >= (EXAMPLES or _DEFAULT[world]) // 2, tally  # the generator's assume() did not starve it
