"""The core contract of issue 52 (part B), at 1 and 2 gloo ranks:

- finding 2: ``partial_dx=True`` is an explicit option (``LossOptions``, the custom op's params): eager,
  ``torch.compile(backend="eager")`` and the default inductor backend hand back this rank's partial
  dX (their sum over the ranks is dX), and the full dX without it; refused with a DTensor hidden and
  with ``sequence_parallel``; the old ``partial_dx()`` context raises;
- finding 5: under ``torch.compile`` a frozen lm_head forms no dW and a hidden without a gradient
  forms no dX and runs no dX all-reduce (the core's calls and collectives counted);
- finding 6: double backward through the compiled op raises the documented ``RuntimeError``;
- finding 8: a loss call leaves ``torch.distributed.nn.functional`` as it found it;
- the per-call guard: by default no hidden checksum, with ``check_inputs=True`` one (the guard's words).

Each multi-rank test is one fork of 2 ranks (``tests._checks.run_ranks``: killed, not hung, after its
timeout); every rank saves its findings, which the test reads."""

from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch

import flce_dist
from flce_dist import fused_linear_cross_entropy as F
from flce_dist import reference_loss
from tests._checks import SMALL_BLOCKS, rel, run_ranks

H, V, N = 12, 13, 7  # odd shapes: V = 13 splits 7 / 6 over 2 ranks


def _data(n: int = N, h: int = H, v: int = V, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.4
    t = torch.randint(0, v, (n,), generator=g)
    t[2] = -100
    return x, w, t


def _reference_grads(x, w, t, **kw):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    reference_loss(xr, wr, t, **kw).backward()
    return xr.grad, wr.grad


def _run(worker, args: tuple = (), world: int = 2, timeout: float = 600.0) -> list[dict]:
    """``worker(rank, world, dist, *args)`` on ``world`` gloo ranks; each rank's returned dict."""
    import pickle

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "job.pkl"), "wb") as f:
            pickle.dump((worker.__name__, args), f)
        return run_ranks(_entry, world, tmp, timeout=timeout)


def _entry(rank: int, world: int, tmp: str) -> None:
    import pickle

    import torch.distributed as dist

    with open(os.path.join(tmp, "job.pkl"), "rb") as f:
        name, args = pickle.load(f)
    flce_dist.setup_reference_mode()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        with flce_dist.override(blocks=SMALL_BLOCKS):
            res = globals()[name](rank, world, dist, *args)
    except Exception:  # noqa: BLE001  (reported by the test, with the rank's traceback)
        res = {"error": traceback.format_exc()}
    torch.save(res, os.path.join(tmp, f"r{rank}.pt"))
    dist.destroy_process_group()


# finding 2 ------------------------------------------------------------------------------------------

def _partial_worker(rank, world, dist, backends):
    import torch._dynamo

    group = dist.group.WORLD
    x, w, t = _data()
    lo, hi = flce_dist.vocab_shard(V, rank, world)
    out = {}
    for backend in backends:
        for strategy, reduction in (("fused", "mean"), ("recompute", "sum")):
            for partial in (False, True):
                torch._dynamo.reset()

                def step(xx, ww, strategy=strategy, reduction=reduction, partial=partial):
                    return F(xx, ww, t, group=group, vocab_size=V, strategy=strategy, reduction=reduction,
                             partial_dx=partial)

                fn = step if backend == "none" else torch.compile(step, backend=backend, fullgraph=True)
                xs, ws = x.float().requires_grad_(), w[lo:hi].float().requires_grad_()
                loss = fn(xs, ws)
                loss.backward()
                out[(backend, strategy, partial)] = (loss.detach(), xs.grad, ws.grad)
    # logprobs_and_entropy takes it too (eager; the same option underneath)
    xs, ws = x.float().requires_grad_(), w[lo:hi].float().requires_grad_()
    logp, ent = flce_dist.logprobs_and_entropy(xs, ws, t, group=group, vocab_size=V, partial_dx=True)
    (logp.sum() + 0.5 * ent.sum()).backward()
    out["logprobs partial"] = (xs.grad, ws.grad)
    # refusals: a DTensor hidden, sequence parallelism
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    wd = distribute_tensor(w.float(), mesh, [Shard(0)])
    xd = distribute_tensor(x.float(), mesh, [Replicate()])
    errors = {}
    for name, call in {
        "dtensor hidden": lambda: F(xd, wd, t, partial_dx=True),
        "sequence_parallel": lambda: F(x.float()[:6], w[lo:hi].float(), t[:6], group=group, vocab_size=V,
                                       sequence_parallel=True, partial_dx=True),
    }.items():
        try:
            call()
            errors[name] = "no error"
        except ValueError as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    # a DTensor weight with a plain hidden: the partial is meaningful there and allowed
    xs = x.float().requires_grad_()
    F(xs, wd, t, partial_dx=True).backward()
    out["dtensor weight partial"] = xs.grad
    return out


def _check_partial(results, backends):
    x, w, t = _data()
    for strategy, reduction in (("fused", "mean"), ("recompute", "sum")):
        ref_dx, ref_dw = _reference_grads(x, w, t, reduction=reduction)
        for backend in backends:
            summed = sum(res[(backend, strategy, True)][1].double() for res in results)
            for r, res in enumerate(results):
                lo, hi = flce_dist.vocab_shard(V, r, len(results))
                full, part = res[(backend, strategy, False)], res[(backend, strategy, True)]
                where = f"rank {r} {backend} {strategy}"
                assert rel(full[1], ref_dx) < 1e-5, f"{where}: full dX"
                assert rel(part[1], ref_dx) > 1e-2, f"{where}: partial dX is the full dX"
                assert rel(part[0], full[0]) < 1e-6 and rel(part[2], full[2]) < 1e-6, f"{where}: loss / dW changed"
                assert rel(full[2], ref_dw[lo:hi]) < 1e-5, f"{where}: dW"
            assert rel(summed, ref_dx) < 1e-5, f"{backend} {strategy}: the partials do not sum to dX"


@pytest.mark.dist
def test_partial_dx_keyword_eager_and_compiled():
    backends = ("none", "eager")
    results = _run(_partial_worker, (backends,))
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res.get('error')}"
    _check_partial(results, backends)
    x, w, t = _data()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = flce_dist.reference_logprobs_and_entropy(xr, wr, t)
    (lp.sum() + 0.5 * ent.sum()).backward()
    assert rel(sum(res["logprobs partial"][0].double() for res in results), xr.grad) < 1e-5
    ref_dx, _ = _reference_grads(x, w, t)
    for r, res in enumerate(results):
        lo, hi = flce_dist.vocab_shard(V, r, 2)
        assert rel(res["logprobs partial"][1], wr.grad[lo:hi]) < 1e-5
        assert "plain-tensor hidden" in res["errors"]["dtensor hidden"], res["errors"]
        assert "sequence_parallel" in res["errors"]["sequence_parallel"], res["errors"]
    assert rel(sum(res["dtensor weight partial"].double() for res in results), ref_dx) < 1e-5


@pytest.mark.dist
def test_partial_dx_keyword_inductor():
    """The default backend (inductor) on CPU: the same partial dX (one strategy pair; compiling is slow)."""
    backends = ("inductor",)
    results = _run(_partial_worker, (backends,), timeout=900)
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res.get('error')}"
    _check_partial(results, backends)


def test_partial_dx_context_is_gone():
    from flce_dist.autograd import partial_dx

    with pytest.raises(RuntimeError, match="partial_dx=True"):
        partial_dx()
    assert "partial_dx" in flce_dist.LossOptions.keywords("call")


# finding 5 ------------------------------------------------------------------------------------------

def _frozen_worker(rank, world, dist, backend):
    import torch._dynamo

    from flce_dist import core

    group = dist.group.WORLD
    x, w, t = _data()
    lo, hi = flce_dist.vocab_shard(V, rank, world)
    calls, reduces = [], []
    real = {name: getattr(core, name) for name in ("fused_forward_backward", "recompute_backward", "all_reduce_async")}

    def fused_spy(*a, **k):
        out = real["fused_forward_backward"](*a, **k)
        calls.append(("fused", a[9:11] if len(a) > 9 else (k.get("need_dx", True), k.get("need_dw", True)),
                      out[1] is None, out[2] is None))
        return out

    def recompute_spy(*a, **k):
        out = real["recompute_backward"](*a, **k)
        calls.append(("recompute", a[10:12] if len(a) > 10 else (k.get("need_dx", True), k.get("need_dw", True)),
                      out[0] is None, out[1] is None))
        return out

    def reduce_spy(tensor, grp):
        reduces.append(tuple(tensor.shape))
        return real["all_reduce_async"](tensor, grp)

    core.fused_forward_backward, core.recompute_backward, core.all_reduce_async = fused_spy, recompute_spy, reduce_spy
    out = {}
    try:
        for strategy, reduction in (("fused", "mean"), ("recompute", "sum")):
            for frozen in ("weight", "hidden"):
                torch._dynamo.reset()
                calls.clear()
                reduces.clear()

                def step(xx, ww, strategy=strategy, reduction=reduction):
                    return F(torch.tanh(xx), ww, t, group=group, vocab_size=V, strategy=strategy, reduction=reduction)

                fn = torch.compile(step, backend=backend, fullgraph=True)
                xs = x.float().requires_grad_(frozen != "hidden")
                ws = w[lo:hi].float().requires_grad_(frozen != "weight")
                loss = fn(xs, ws)
                loss.backward()
                out[(strategy, frozen)] = {
                    "calls": list(calls), "reduces": list(reduces), "loss": loss.detach(),
                    "dx": xs.grad, "dw": ws.grad}
    finally:
        core.fused_forward_backward, core.recompute_backward, core.all_reduce_async = real.values()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_path_skips_frozen_inputs(backend):
    """A frozen lm_head: the core is asked for no dW (and returns None), a frozen hidden: no dX and no
    dX all-reduce; the gradients that are asked for are right."""
    results = _run(_frozen_worker, (backend,))
    x, w, t = _data()
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res.get('error')}"
        lo, hi = flce_dist.vocab_shard(V, r, 2)
        for strategy, reduction in (("fused", "mean"), ("recompute", "sum")):
            xr, wr = torch.tanh(x).detach().requires_grad_(), w.clone().requires_grad_()
            reference_loss(xr, wr, t, reduction=reduction).backward()
            ref_dx = xr.grad * (1 - torch.tanh(x) ** 2)
            frozen_w, frozen_h = res[(strategy, "weight")], res[(strategy, "hidden")]
            assert frozen_w["calls"] and frozen_h["calls"], (strategy, res)
            # (need_dx, need_dw) the core was given, and whether dX / dW came back None
            assert all(c[1] == (True, False) and c[3] for c in frozen_w["calls"]), (r, strategy, frozen_w["calls"])
            assert all(c[1] == (False, True) and c[2] for c in frozen_h["calls"]), (r, strategy, frozen_h["calls"])
            assert frozen_h["reduces"] == [], (r, strategy, frozen_h["reduces"])  # no dX all-reduce
            assert frozen_w["dw"] is None and frozen_h["dx"] is None
            assert rel(frozen_w["dx"], ref_dx) < 1e-5, (r, strategy)
            assert rel(frozen_h["dw"], wr.grad[lo:hi]) < 1e-5, (r, strategy)


# finding 6 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy,reduction", [("fused", "mean"), ("recompute", "none")])
def test_compiled_double_backward_raises(small_tiles, strategy, reduction):
    import torch._dynamo

    from flce_dist.autograd import DOUBLE_BACKWARD

    torch._dynamo.reset()
    x, w, t = _data()
    xs, ws = x.float().requires_grad_(), w.float().requires_grad_()

    def step(xx, ww):
        return F(xx, ww, t, strategy=strategy, reduction=reduction).sum()

    loss = torch.compile(step, backend="eager", fullgraph=True)(xs, ws)
    with pytest.raises(RuntimeError, match="double backward") as info:
        gx, = torch.autograd.grad(loss, xs, create_graph=True)
        gx.sum().backward()
    assert DOUBLE_BACKWARD in str(info.value)


# finding 8 ------------------------------------------------------------------------------------------

def _torch_untouched_worker(rank, world, dist):
    """Pin the group in torch.distributed.nn.functional's defaults (what an import of that module
    after init_process_group does), run a TP loss call forward and backward, report whether the
    defaults are the same objects afterwards; then restore them."""
    import torch.distributed.nn.functional as fn

    names = [n for n, f in vars(fn).items() if callable(f) and getattr(f, "__module__", None) == fn.__name__
             and getattr(f, "__defaults__", None)]
    saved = {n: getattr(fn, n).__defaults__ for n in names}
    pinned = {n: tuple(dist.group.WORLD if d is None else d for d in saved[n]) for n in ("broadcast", "all_reduce")}
    try:
        for n, d in pinned.items():
            getattr(fn, n).__defaults__ = d
        before = {n: getattr(fn, n).__defaults__ for n in names}
        x, w, t = _data()
        lo, hi = flce_dist.vocab_shard(V, rank, world)
        xs, ws = x.float().requires_grad_(), w[lo:hi].float().requires_grad_()
        F(xs, ws, t, group=dist.group.WORLD, vocab_size=V).backward()
        flce_dist.logprobs_and_entropy(xs.detach(), ws.detach(), t, group=dist.group.WORLD, vocab_size=V)
        after = {n: getattr(fn, n).__defaults__ for n in names}
        return {"same": all(after[n] is before[n] for n in names), "names": names,
                "changed": [n for n in names if after[n] is not before[n]]}
    finally:
        for n in names:
            getattr(fn, n).__defaults__ = saved[n]


@pytest.mark.dist
def test_a_loss_call_leaves_torch_distributed_nn_functional_untouched():
    for r, res in enumerate(_run(_torch_untouched_worker, timeout=300)):
        assert "error" not in res, f"rank {r}:\n{res.get('error')}"
        assert res["names"] and res["same"], f"rank {r}: defaults rewritten: {res['changed']}"


def test_no_unpin_hook_left():
    from flce_dist.distributed import groups

    assert not hasattr(groups, "unpin_default_group")


# the per-call guard's default ---------------------------------------------------------------------

def test_guard_words_default_and_check_inputs():
    """The hidden checksum (word 6) and the bad-target count (word 5) are computed only where asked;
    the default words are the call digest, the stale flag, N and the target checksum."""
    from flce_dist.distributed import guard

    x, _, t = _data(n=20)
    x = x.float()
    bad = torch.zeros(20, dtype=torch.bool)
    bad[3] = True
    lean = guard.call_guard(x, t, bad, V, 8, ("f",), count_bad=False)
    full = guard.call_guard(x, t, bad, V, 8, ("f",), count_bad=True, check_inputs=True)
    assert lean.shape == full.shape == (guard.WORDS,) and lean.dtype == torch.int32
    assert torch.equal(lean[:5], full[:5])
    assert int(lean[guard.BAD]) == 0 and int(lean[guard.HIDDEN]) == 0
    assert int(full[guard.BAD]) == 1 and int(full[guard.HIDDEN]) != 0
    other = x.clone()
    other[0, 0] += 1
    assert int(guard.call_guard(other, t, bad, V, 8, ("f",), check_inputs=True)[guard.HIDDEN]) != int(full[guard.HIDDEN])
    # the verdict: equal rows pass; a stale flag or a bad target fails even when every rank agrees
    ok = torch.stack([lean, lean])
    assert bool(guard.verdict(ok))
    assert not bool(guard.verdict(torch.stack([full, full])))
    stale = guard.call_guard(x, t, bad, V, 8, ("f",), stale=True, count_bad=False)
    assert not bool(guard.verdict(torch.stack([stale, stale])))
    with pytest.raises(ValueError, match="another vocabulary shard"):
        guard.raise_if_failed(torch.stack([lean, stale]))
