"""Multi-rank checks, launched by torchrun (one process per rank):

    torchrun --nproc_per_node=P tests/dist_checks.py [--backend gloo|nccl] [--big]

Each rank builds the same full problem from one seed, takes its vocab shard (uneven when
P does not divide V) and compares the loss, its dW slice, dX, db and per-token losses
(``reduction="none"`` with a random grad_output) against the float64 full-logits reference, and
against the single-rank call on the full weight. Exits non-zero on any failure (pytest reads the
exit code: tests/test_distributed.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flce_dist  # noqa: E402
from flce_dist import FLCEParams, LossOptions, reference_loss, settings, vocab_shard  # noqa: E402
from flce_dist.core import kept_columns  # noqa: E402
from tests._checks import SMALL_BLOCKS, Checker  # noqa: E402

def case(ck, dev, group, *, n, h, v, dtype, strategy, reduction, bias, sp, ignore="some", seed=0, tol=None, **opts):
    p, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h**-0.5
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    if ignore == "some":
        t[torch.rand(n, generator=g) < 0.2] = -100
    elif ignore == "all":
        t[:] = -100
    go = torch.randn(n, generator=g, dtype=torch.float64)
    s, e = vocab_shard(v, r, p)
    name = f"P={p} {dtype} {strategy} {reduction} bias={bias} sp={sp} ignore={ignore} n={n} v={v} {opts or ''}"
    rows = slice(r * (n // p), (r + 1) * (n // p)) if sp else slice(0, n)

    xs = x[rows].to(dev, dtype).clone().requires_grad_()
    ws = w[s:e].to(dev, dtype).clone().requires_grad_()
    bs = b[s:e].to(dev, dtype).clone().requires_grad_() if bias else None
    ts = t[rows].to(dev)
    loss, lse, correct = flce_dist.fused_linear_cross_entropy(
        xs, ws, ts, bias=bs, group=group, vocab_size=v, reduction=reduction, strategy=strategy, sequence_parallel=sp,
        return_lse=True, return_token_accuracy=True, **opts)
    gos = go[rows].to(dev, loss.dtype) if reduction == "none" else torch.ones((), device=dev, dtype=loss.dtype)
    loss.backward(gos)

    # float64 full-logits reference on the quantised inputs
    xr = x.to(dtype).double().clone().requires_grad_()
    wr = w.to(dtype).double().clone().requires_grad_()
    br = b.to(dtype).double().clone().requires_grad_() if bias else None
    ref_opts = {k: v for k, v in opts.items() if k != "deterministic"}
    ref, ref_lse = reference_loss(xr, wr, t, bias=br, reduction=reduction, return_lse=True, **ref_opts)
    ref.backward(go if reduction == "none" else torch.ones((), dtype=torch.float64))
    lt, gt = tol or ((1e-5, 1e-4) if dtype != torch.bfloat16 else (1e-2, 1e-2))
    if ignore == "all":
        ck.true(f"{name}: all-ignored loss is 0", float(loss.detach().abs().sum()) == 0.0)
        ck.true(f"{name}: all-ignored grads are 0", float(xs.grad.abs().sum()) == 0.0 and float(ws.grad.abs().sum()) == 0.0)
        return
    ck.close(f"{name}: loss", loss, ref[rows] if reduction == "none" else ref, lt)
    ck.close(f"{name}: lse (global, this rank's rows)", lse, ref_lse[rows], lt)
    with torch.no_grad():
        from flce_dist.reference import reference_logits
        zr = reference_logits(xr, wr, br, softcap=opts.get("softcap"), temperature=opts.get("temperature", 1.0))
        want = ((zr.argmax(1) == t) & (t != -100))[rows]
    ck.true(f"{name}: token accuracy == argmax over all shards", torch.equal(correct.cpu(), want))
    ck.close(f"{name}: dW shard", ws.grad, wr.grad[s:e], gt)
    ck.close(f"{name}: dX", xs.grad, xr.grad[rows], gt)
    if bias:
        ck.close(f"{name}: db shard", bs.grad, br.grad[s:e], gt)

    # TP result == single-rank result with the full weight (same code path, collectives skipped)
    if not sp and dtype != torch.bfloat16:
        x1 = x.to(dev, dtype).clone().requires_grad_()
        w1 = w.to(dev, dtype).clone().requires_grad_()
        l1 = flce_dist.fused_linear_cross_entropy(x1, w1, t.to(dev), bias=None if b is None else b.to(dev, dtype),
                                                  reduction=reduction, strategy=strategy, **opts)
        l1.backward(go.to(dev, l1.dtype) if reduction == "none" else None)
        ck.close(f"{name}: TP loss == TP1 loss", loss, l1, lt)
        ck.close(f"{name}: TP dW == TP1 dW slice", ws.grad, w1.grad[s:e], gt)


def rowscale_case(ck, dev, group, *, force: bool, **kw):
    """The fused strategy's row-scale form (rowscale.py) under TP: each rank forms its shard's dz as
    c E' against the global lse; with ``force`` the bound is set below 0 so that every chunk takes
    the gated fallback (dz_gated) on every rank. The gates each rank saw are checked too."""
    from flce_dist import rowscale

    gates, real, bound = [], rowscale.prepare_, rowscale.MAX_SPREAD

    def spy(*a, **k):
        c, gate = real(*a, **k)
        gates.append(int(gate.item()))
        return c, gate

    rowscale.prepare_ = spy
    rowscale.MAX_SPREAD = -1.0 if force else bound
    try:
        case(ck, dev, group, strategy="fused", reduction="mean", bias=False, **kw)
    finally:
        rowscale.prepare_, rowscale.MAX_SPREAD = real, bound
    ck.true(f"row-scale form taken, gates {'open' if force else 'closed'} ({kw}): {gates}",
            bool(gates) and all(g == int(force) for g in gates))


def entropy_case(ck, dev, group, *, n, h, v, dtype, sp, bias, use="both", seed=3, tol=None, **opts):
    """logprobs_and_entropy under TP (uneven V), optionally sequence-parallel: per-token log-probs,
    entropies and the gradients of ``sum(a * logp) + beta * sum(entropy)`` (or of one of the two:
    ``use``) against the float64 single-process reference on the full weight."""
    from flce_dist.reference import reference_logprobs_and_entropy

    p, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h**-0.5 * 2
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    beta = {"both": 0.7, "logp": 0.0, "entropy": 1.3}[use]
    a_coef = 0.0 if use == "entropy" else 1.0
    s, e = vocab_shard(v, r, p)
    rows = slice(r * (n // p), (r + 1) * (n // p)) if sp else slice(0, n)
    name = f"entropy P={p} {dtype} sp={sp} bias={bias} use={use} n={n} v={v} {opts or ''}"
    if r == 0:
        print(f"[rank 0] case {name}", flush=True)

    xs = x[rows].to(dev, dtype).clone().requires_grad_()
    ws = w[s:e].to(dev, dtype).clone().requires_grad_()
    bs = b[s:e].to(dev, dtype).clone().requires_grad_() if bias else None
    logp, ent = flce_dist.logprobs_and_entropy(xs, ws, t[rows].to(dev), bias=bs, group=group, vocab_size=v,
                                               sequence_parallel=sp, **opts)
    objective = []
    if use != "entropy":
        objective.append((adv[rows].to(dev, logp.dtype) * logp).sum())
    if use != "logp":
        objective.append(beta * ent.sum())
    sum(objective).backward()

    xr = x.to(dtype).double().clone().requires_grad_()
    wr = w.to(dtype).double().clone().requires_grad_()
    br = b.to(dtype).double().clone().requires_grad_() if bias else None
    rl, re_ = reference_logprobs_and_entropy(xr, wr, t, bias=br, **opts)
    (a_coef * (adv * rl).sum() + beta * re_.sum()).backward()
    lt, gt = tol or ((1e-5, 1e-4) if dtype != torch.bfloat16 else (1e-2, 2e-2))
    ck.close(f"{name}: logp", logp, rl[rows], lt)
    ck.close(f"{name}: entropy", ent, re_[rows], lt)
    ck.true(f"{name}: ignored tokens give 0", float(logp[t[rows] == -100].abs().sum() + ent[t[rows] == -100].abs().sum()) == 0.0)
    ck.close(f"{name}: dW shard", ws.grad, wr.grad[s:e], gt)
    ck.close(f"{name}: dX", xs.grad, xr.grad[rows], gt)
    if bias:
        ck.close(f"{name}: db shard", bs.grad, br.grad[s:e], gt)


def filter_case(ck, dev, group, *, n, h, v, dtype, strategy, eps=5e-2, seed=9, orders=("copy",)):
    """grad_filter_eps under TP (uneven V): the mask is built after the global lse, so the loss is
    the exact one (up to summation order: each shard is sorted by mean logit) and each gradient entry moves by at most the documented bound:
    |dX err| <= eps * g_n * sum_v |W_vh|, |dW err| <= eps * sum_n g_n |x_nh| (g: the mean's weights).
    ``orders``: the ``Settings.filter_order`` values to run ("gather": no sorted copy of the shard)."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * h**-0.5 * 10
    t = torch.randint(0, v, (n,), generator=g)
    s, e = vocab_shard(v, r, p)

    def run(f, order="copy"):
        xs = x.to(dev, dtype).clone().requires_grad_()
        ws = w[s:e].to(dev, dtype).clone().requires_grad_()
        loss = flce_dist.fused_linear_cross_entropy(xs, ws, t.to(dev), group=group, vocab_size=v, strategy=strategy,
                                                    grad_filter_eps=f,
                                                    settings=settings.current().replace(filter_order=order))
        loss.backward()
        return loss.detach().cpu(), xs.grad.cpu().float(), ws.grad.cpu().float()

    l0, gx0, gw0 = run(None)
    for order in orders:
        name = f"grad filter P={p} {dtype} {strategy} {order} eps={eps} n={n} v={v}"
        l1, gx1, gw1 = run(eps, order)
        # the filter runs on each shard sorted by mean logit: the same loss up to summation order
        ck.true(f"{name}: loss unchanged", abs(float(l0) - float(l1)) <= 1e-6 * abs(float(l0)))
        ck.true(f"{name}: something was skipped", float((gx1 - gx0).abs().max()) > 0)
        gr = 1.0 / n
        bx = eps * gr * w.abs().sum(0)[None, :]
        bw = eps * gr * x.abs().sum(0)[None, :]
        ck.true(f"{name}: dX within the bound", bool(((gx1 - gx0).abs() <= bx * 1.01 + 1e-6).all()))
        ck.true(f"{name}: dW shard within the bound", bool(((gw1 - gw0).abs() <= bw * 1.01 + 1e-6).all()))


def determinism(ck, dev, group, dtype):
    """deterministic=True: two runs and every rank give bitwise identical loss and dX; dW too."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(77)
    n, h, v = 11 * p, 40, 12 * p + 5
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * h**-0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    s, e = vocab_shard(v, r, p)
    for strategy in ("fused", "recompute"):
        for sp in (False, True):
            runs = []
            rows = slice(r * (n // p), (r + 1) * (n // p)) if sp else slice(0, n)
            for _ in range(2):
                xs = x[rows].to(dev).clone().requires_grad_()
                ws = w[s:e].to(dev).clone().requires_grad_()
                loss = flce_dist.fused_linear_cross_entropy(xs, ws, t[rows].to(dev), group=group, vocab_size=v,
                                                            strategy=strategy, sequence_parallel=sp, deterministic=True)
                loss.backward()
                runs.append((loss.detach(), xs.grad, ws.grad))
            name = f"P={p} {dtype} {strategy} sp={sp} deterministic"
            ck.true(f"{name}: two runs bitwise equal", all(torch.equal(a, b) for a, b in zip(*runs)))
            if not sp:
                allx = [torch.empty_like(runs[0][1]) for _ in range(p)]
                dist.all_gather(allx, runs[0][1].contiguous(), group=group)
                ck.true(f"{name}: dX bitwise equal on every rank", all(torch.equal(a, allx[0]) for a in allx))
            ref = reference_loss(x.double(), w.double(), t)
            ck.close(f"{name}: loss", runs[0][0], ref, 1e-5 if dtype != torch.bfloat16 else 1e-2)


def compiled(ck, dev, group, dtype):
    """torch.compile of a step calling the loss with a group: the flce_dist::fused_lce op (one graph
    break at the once-per-shape shard check) equals eager, both strategies."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(91)
    n, h, v = 7 * p, 24, 10 * p + 3
    x = torch.randn(n, h, generator=g).to(dev, dtype)
    w = (torch.randn(v, h, generator=g) * h**-0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    s, e = vocab_shard(v, r, p)
    for reduction in ("mean", "none"):
        def step(xx, ww):
            return flce_dist.fused_linear_cross_entropy(torch.tanh(xx), ww, t, group=group, vocab_size=v,
                                                        reduction=reduction)
        outs = []
        for fn in (torch.compile(step, backend="aot_eager"), step):
            xs, ws = x.clone().requires_grad_(), w[s:e].to(dev).clone().requires_grad_()
            loss = fn(xs, ws)
            loss.sum().backward()
            outs.append((loss.detach(), xs.grad, ws.grad))
        name = f"P={p} {dtype} torch.compile {reduction}"
        for what, a, b in zip(("loss", "dX", "dW shard"), *outs):
            ck.close(f"{name}: {what} == eager", a, b, 1e-6 if dtype != torch.bfloat16 else 1e-2)


def dropped_group_is_freed(ck, dev, group):
    """A group the program destroys and drops is not kept alive (with its backend's threads) by the
    shard check's cache (before: a module-level dict keyed by the group object)."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    sub = dist.new_group(dist.get_process_group_ranks(group), backend=dist.get_backend(group))
    v = 5 * p + 1
    s, e = vocab_shard(v, r, p)
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(6, 8, generator=g).to(dev), torch.randn(v, 8, generator=g).to(dev)
    t = torch.randint(0, v, (6,), generator=g).to(dev)
    loss = flce_dist.fused_linear_cross_entropy(x, w[s:e], t, group=sub, vocab_size=v)
    ck.close("loss on a short-lived group", loss, reference_loss(x.double(), w.double(), t), 1e-5)
    ref = weakref.ref(sub)
    dist.destroy_process_group(sub)
    del sub, loss
    gc.collect()
    ck.true("a destroyed, dropped group is freed", ref() is None)


def module_and_errors(ck, dev, group):
    p = dist.get_world_size(group)
    torch.manual_seed(123)
    head = flce_dist.VocabParallelLMHead(24, 53, group=group, bias=True, device=dev)
    torch.manual_seed(123)
    lin = torch.nn.Linear(24, 53, bias=True)
    s, e = head.shard
    ck.true("VocabParallelLMHead init == nn.Linear slice", torch.equal(head.weight.detach().cpu(), lin.weight.detach()[s:e])
            and torch.equal(head.bias.detach().cpu(), lin.bias.detach()[s:e]))
    x = torch.randn(2, 5, 24, device=dev)
    ck.true("VocabParallelLMHead logits shard shape", tuple(head(x).shape) == (2, 5, e - s))
    t = torch.randint(0, 53, (2, 5), device=dev)
    loss = head(x, t)
    ref = reference_loss(x.double().cpu(), lin.weight.double(), t.cpu(), bias=lin.bias.double())
    ck.close("VocabParallelLMHead loss", loss, ref, 1e-5)
    # shards that do not tile [0, V): every rank claims start 0. A fresh group, so that no rank
    # answers from its shard cache (the check runs once per (group, shard) on every rank).
    fresh = dist.new_group(list(range(p)))
    try:
        flce_dist.fused_linear_cross_entropy(x, head.weight, t, group=fresh, vocab_start=0)
        ck.true("overlapping shards raise ValueError", False)
    except ValueError as exc:
        ck.true(f"overlapping shards error names the tiling ({exc})", "tile" in str(exc))
    # ranks that disagree on the token count or on the options: ValueError on every rank, no hang
    r = dist.get_rank(group)
    fresh = dist.new_group(list(range(p)))
    xs = torch.randn(5 + (r == 0), 24, device=dev)
    try:
        flce_dist.fused_linear_cross_entropy(xs, head.weight, torch.randint(0, 53, (xs.shape[0],), device=dev),
                                             group=fresh, vocab_start=s)
        ck.true("ranks disagreeing on N raise ValueError", False)
    except ValueError as exc:
        ck.true(f"disagreeing N error names the tokens ({exc})", "number of tokens" in str(exc))
    fresh = dist.new_group(list(range(p)))
    try:
        flce_dist.fused_linear_cross_entropy(x, head.weight, t, group=fresh, vocab_start=s,
                                             label_smoothing=0.1 if r == p - 1 else 0.0)
        ck.true("ranks disagreeing on options raise ValueError", False)
    except ValueError as exc:
        ck.true(f"disagreeing options error names the ranks ({exc})", f"ranks [{p - 1}]" in str(exc))


def guards(ck, dev, group, raises):
    """The per-call cross-rank guard (flce_dist/distributed/guard.py): after an identical first call
    (the shard check is cached), a rank that changes an option, passes other targets or hidden states,
    or (sequence parallel) a target outside [0, V) in its slice: on CPU every rank raises the same
    ValueError (no rank blocks); on the GPU every rank's loss is NaN, or with check_finite=True every
    rank raises the ValueError. Never a finite wrong loss. Also vocab_size against overlapping shards."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(55)
    n, h, v = 6 * p, 24, 10 * p + 3
    x = torch.randn(n, h, generator=g).to(dev)
    w = (torch.randn(v, h, generator=g) * h**-0.5).to(dev)
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    s, e = vocab_shard(v, r, p)
    ws = w[s:e].clone()

    def call(xx, tt, sp=False, **opts):
        rows = slice(r * (n // p), (r + 1) * (n // p)) if sp else slice(0, n)
        xs = xx[rows].clone().requires_grad_()
        loss = flce_dist.fused_linear_cross_entropy(xs, ws.clone().requires_grad_(), tt[rows], group=group,
                                                    vocab_size=v, sequence_parallel=sp, **opts)
        return loss

    def expect(name, words, fn):
        for strategy in ("fused", "recompute"):
            label = f"guard {strategy}: {name}"
            try:
                loss = fn(strategy)
                bad = not raises and bool(torch.isnan(loss.detach()).all())
                ck.true(f"{label}: every rank's loss is NaN (got {loss.detach().flatten()[:2].tolist()})", bad)
            except ValueError as exc:
                ck.true(f"{label}: ValueError names {words} ({exc})", raises and all(w_ in str(exc) for w_ in words))
            if not raises:  # the GPU: with check_finite the same case raises on every rank
                try:
                    fn(strategy, check_finite=True)
                    ck.true(f"{label}, check_finite: ValueError", False)
                except ValueError as exc:
                    ck.true(f"{label}, check_finite: ValueError names {words} ({exc})", all(w_ in str(exc) for w_ in words))
                except FloatingPointError as exc:
                    ck.true(f"{label}, check_finite: ValueError, got FloatingPointError {exc}", False)

    for strategy in ("fused", "recompute"):  # identical calls: cached shard check, guard passes
        ck.close(f"guard {strategy}: identical call", call(x, t, strategy=strategy),
                 reference_loss(x.double().cpu(), w.double().cpu(), t.cpu()), 1e-5)
    other_t = t.clone()
    other_t[3] = (t[3] + 1) % v
    other_x = x.clone()
    other_x[0, 0] += 1.0
    bad_t = t.clone()
    bad_t[r * (n // p)] = v + 5  # in this rank's sequence-parallel slice
    expect("an option changed on one rank", ["call"],
           lambda st, **k: call(x, t, strategy=st, ignore_index=-1 if r == p - 1 else -100, **k))
    expect("other targets on one rank", ["targets"], lambda st, **k: call(x, other_t if r == p - 1 else t, strategy=st, **k))
    expect("other hidden states on one rank (check_inputs)", ["hidden"],
           lambda st, **k: call(other_x if r == 0 else x, t, strategy=st, check_inputs=True, **k))
    expect("a bad target in one rank's sequence-parallel slice", ["outside [0, V)"],
           lambda st, **k: call(x, bad_t if r == p - 1 else t, sp=True, strategy=st, **k))
    for strategy in ("fused", "recompute"):  # the guard leaves the group usable: a correct call still works
        ck.close(f"guard {strategy}: correct call after the failures", call(x, t, strategy=strategy),
                 reference_loss(x.double().cpu(), w.double().cpu(), t.cpu()), 1e-5)
    # vocab_start=None, every rank passing the FULL weight: the shards overlap; vocab_size catches it
    fresh = dist.new_group(list(range(p)))
    try:
        flce_dist.fused_linear_cross_entropy(x, w, t, group=fresh, vocab_size=v)
        ck.true("overlapping shards with vocab_size raise ValueError", False)
    except ValueError as exc:
        ck.true(f"overlapping shards with vocab_size: error names vocab_size ({exc})", "vocab_size" in str(exc))


def big_memory(ck, dev, group):
    """NCCL only: llama3 shard at N=8192; no rank allocates its [N, V_local] logits."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    n, h, v = 8192, 4096, 128256
    s, e = vocab_shard(v, r, p)
    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(e - s, h, device=dev, dtype=torch.bfloat16) * h**-0.5).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    flce_dist.fused_linear_cross_entropy(x, w, t, group=group, vocab_size=v).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = (x.numel() + w.numel()) * 2
    logits = n * (e - s) * 2
    print(f"[rank {r}] big: peak extra {extra / 2**30:.2f} GiB, grads {grads / 2**30:.2f} GiB, local logits would be {logits / 2**30:.2f} GiB")
    ck.true(f"rank {r}: peak extra minus grads {(extra - grads) / 2**30:.2f} GiB < half the local logits", extra - grads < logits / 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--poison", action="store_true",
                    help="CPU: take the GPU's no-sync guard path (a failed guard poisons with NaN; raises only "
                         "with check_finite), so gloo covers it too")
    ap.add_argument("--device", choices=["auto", "cuda-shared"], default="auto",
                    help="cuda-shared (with --backend gloo): every rank on cuda:0, a testing mode that runs the CUDA "
                         "code paths of P > 1 on one GPU (gloo moves CUDA tensors through the host)")
    ap.add_argument("--only", choices=["all", "entropy", "filter"], default="all",
                    help="entropy: only the log-prob/entropy cases and the guard cases; filter: only the "
                         "gradient filter's cases (a quick check by hand)")
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    group = dist.group.WORLD
    r, p = dist.get_rank(), dist.get_world_size()
    cuda = args.backend == "nccl" or args.device == "cuda-shared"
    if args.device == "cuda-shared":  # gloo's functional all-gather of CUDA tensors crashes: launch/components/shared_gpu.py
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launch"))
        from components import shared_gpu

        shared_gpu.install()
    if cuda:
        dev = torch.device("cuda", 0 if args.device == "cuda-shared" else int(os.environ.get("LOCAL_RANK", r)))
        torch.cuda.set_device(dev)
        ctx = settings.override()
        dtypes = [torch.float32, torch.bfloat16]
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
        ctx = settings.override(blocks=SMALL_BLOCKS, chunk_bytes=4096)
        dtypes = [torch.float32]
    ck = Checker(r)
    everything = args.only == "all"
    poison = args.poison or cuda
    if args.poison:
        import flce_dist.core as core

        core.can_raise = lambda x, p: p.check_finite
    try:
        with ctx:
            odd_v = 10 * p + 3  # never divisible by P
            for dtype in dtypes if everything else []:
                for strategy in ("fused", "recompute"):
                    for reduction in ("mean", "none"):
                        case(ck, dev, group, n=13 * p, h=37, v=odd_v, dtype=dtype, strategy=strategy, reduction=reduction,
                             bias=reduction == "mean", sp=False)
                        case(ck, dev, group, n=5 * p, h=20, v=odd_v, dtype=dtype, strategy=strategy, reduction=reduction,
                             bias=False, sp=True)
                    case(ck, dev, group, n=7, h=16, v=odd_v, dtype=dtype, strategy=strategy, reduction="mean", bias=False,
                         sp=False, ignore="all")
                    case(ck, dev, group, n=3 * p, h=16, v=odd_v, dtype=dtype, strategy=strategy, reduction="sum", bias=True,
                         sp=True, ignore="all")
            # the per-token loss keeping its forward's first vocab chunk on each rank (core.kept_columns below V_r:
            # a budget of 3 columns of [N, V_r]), the other chunks recomputed; uneven V, with and without sp
            for n, sp in ((13 * p, False), (5 * p, True)) if everything else ():
                dt = dtypes[0]
                with settings.override(chunk_bytes=3 * n * torch.empty((), dtype=dt).element_size()):
                    s_, e_ = vocab_shard(odd_v, r, p)
                    pk = FLCEParams(s_, odd_v, LossOptions(reduction="none"), settings.current())
                    cols = kept_columns(torch.empty(n, 24, dtype=dt), torch.empty(e_ - s_, 24, dtype=dt), pk,
                                        group, True, False)
                    ck.true(f"P={p} sp={sp}: the first vocab chunk kept ({cols} of {e_ - s_} columns)",
                            0 < cols < e_ - s_)
                    case(ck, dev, group, n=n, h=24, v=odd_v, dtype=dt, strategy="auto", reduction="none", bias=not sp,
                         sp=sp, temperature=0.8)
            if everything:  # the row-scale form under TP: z-loss and temperature on, gates closed, then forced open
                for force in (False, True):  # (float32 on CUDA takes cuBLAS logits, never the row-scale form)
                    rowscale_case(ck, dev, group, force=force, n=9 * p, h=24, v=odd_v, dtype=dtypes[-1], sp=False,
                                  z_loss=1e-3, temperature=0.7)
                rowscale_case(ck, dev, group, force=False, n=4 * p, h=24, v=odd_v, dtype=dtypes[-1], sp=True)
            # loss features, exact under TP (uneven V), both strategies
            feats = [dict(label_smoothing=0.1), dict(z_loss=1e-3), dict(softcap=4.0), dict(temperature=0.7),
                     dict(num_items_in_batch=50), dict(label_smoothing=0.05, z_loss=1e-4, softcap=6.0, temperature=1.3)]
            if args.quick:  # large world sizes on 2 CPU cores: the combined options only
                feats = feats[-1:]
            if everything:
                for strategy in ("fused", "recompute"):
                    for f in feats:
                        case(ck, dev, group, n=9 * p, h=24, v=odd_v, dtype=dtypes[0], strategy=strategy, reduction="mean",
                             bias=True, sp=False, **f)
                    case(ck, dev, group, n=4 * p, h=24, v=odd_v, dtype=dtypes[0], strategy=strategy, reduction="none",
                         bias=False, sp=True, label_smoothing=0.1, softcap=5.0)
                if cuda:
                    for dtype in dtypes:
                        case(ck, dev, group, n=3 * 423, h=1000, v=10000, dtype=dtype, strategy="auto", reduction="mean", bias=False, sp=False)
                        case(ck, dev, group, n=2 * 1024, h=4096, v=32000, dtype=dtype, strategy="recompute", reduction="none", bias=False, sp=True)
                else:
                    case(ck, dev, group, n=41, h=70, v=3 * p + 1, dtype=torch.float64, strategy="fused", reduction="mean", bias=True, sp=False,
                         tol=(1e-12, 1e-10))
                for strategy in ("fused", "recompute"):
                    case(ck, dev, group, n=9 * p, h=24, v=odd_v, dtype=dtypes[0], strategy=strategy, reduction="mean",
                         bias=True, sp=False, deterministic=True)
                    case(ck, dev, group, n=4 * p, h=24, v=odd_v, dtype=dtypes[0], strategy=strategy, reduction="none",
                         bias=False, sp=True, deterministic=True)
            filters = ("fused",) if args.quick else ("fused", "recompute")
            for strategy in filters if args.only != "entropy" else ():  # the opt-in gradient filter
                filter_case(ck, dev, group, n=8 * p, h=24, v=40 * p + 3, dtype=dtypes[0], strategy=strategy,
                            orders=("copy", "gather"))
            # per-token log-probs and entropy with gradients (issue 16), uneven V, with and without SP
            for dtype in dtypes if args.only != "filter" else []:
                for use in ("both",) if args.quick else ("both", "logp", "entropy"):
                    entropy_case(ck, dev, group, n=6 * p, h=24, v=odd_v, dtype=dtype, sp=False, bias=use == "both",
                                 use=use, temperature=0.7)
                entropy_case(ck, dev, group, n=5 * p, h=20, v=odd_v, dtype=dtype, sp=True, bias=False,
                             temperature=1.3, softcap=3.0)
            if args.only == "filter":
                pass
            elif cuda:
                for dtype in dtypes:
                    entropy_case(ck, dev, group, n=2 * 512, h=1024, v=32001, dtype=dtype, sp=True, bias=False,
                                 temperature=0.7)
            else:
                entropy_case(ck, dev, group, n=4 * p, h=30, v=3 * p + 2, dtype=torch.float64, sp=True, bias=True,
                             temperature=0.8, softcap=4.0, tol=(1e-12, 1e-10))
            if everything:
                for dtype in dtypes:
                    determinism(ck, dev, group, dtype)
                compiled(ck, dev, group, dtypes[0])
                module_and_errors(ck, dev, group)
                dropped_group_is_freed(ck, dev, group)
            if args.only != "filter":
                guards(ck, dev, group, raises=not poison)
            if args.big and cuda:
                big_memory(ck, dev, group)
    except Exception:  # noqa: BLE001
        ck.failures.append("exception:\n" + traceback.format_exc())
    ck.report()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(1 if ck.failures else 0)  # skip interpreter teardown (see tests/test_integrations.py)


if __name__ == "__main__":
    main()
