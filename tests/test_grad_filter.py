"""The opt-in gradient filter (``grad_filter_eps``, issue 15 item 3) on one rank; across gloo ranks in
dist_checks.py. Helion kernels in reference mode with several tiles in every dimension."""

import pytest
import torch

import flce_dist
from flce_dist import settings
from flce_dist.kernels import launch as K

from .conftest import SMALL_BLOCKS, rel

BLOCKS = SMALL_BLOCKS  # several filter blocks (8 x 16) in every dimension


@pytest.fixture
def filter_tiles():
    with settings.override(blocks=BLOCKS):
        yield settings.current()


def _inputs(seed, n=53, h=70, v=203, peak=6.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * h**-0.5 * peak).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[5] = -100
    return x, w, t


@pytest.mark.parametrize("accumulate", [False, True])
def test_masked_matmuls_match_their_references(filter_tiles, accumulate):
    """dx_masked / dw_masked (one Helion kernel, reference mode; dW on the transposed views) against
    the torch reference on a random block mask, odd shapes, partial tiles in every dimension."""
    from flce_dist.kernels.masked_mm import expand_keep, masked_mm_reference

    g = torch.Generator().manual_seed(1)
    n, v, h = 45, 83, 70
    bn, bv = K.masked_blocks(torch.device("cpu"), torch.float32, filter_tiles)
    dz, w, x = torch.randn(n, v, generator=g), torch.randn(v, h, generator=g), torch.randn(n, h, generator=g)
    keep = torch.rand(-(-n // bn), -(-v // bv), generator=g) < 0.5
    assert 0 < int(keep.sum()) < keep.numel()
    got = K.dx_masked(dz, w, keep, torch.empty(n, h), False, filter_tiles)
    assert rel(got, masked_mm_reference(dz, w, keep, torch.empty(n, h), False, bn, bv)) < 1e-6
    dense = torch.mm(torch.where(expand_keep(keep, n, v, bn, bv), dz, 0.0), w)
    assert rel(got, dense) < 1e-6 and rel(got, dz @ w) > 1e-2  # the mask really removes blocks
    base_x = torch.randn(n, h, generator=g)
    got = K.dx_masked(dz, w, keep, base_x.clone(), accumulate, filter_tiles)
    assert rel(got, masked_mm_reference(dz, w, keep, base_x.clone(), accumulate, bn, bv)) < 1e-6
    base = torch.randn(v, h, generator=g)
    got = K.dw_masked(dz, x, keep, base.clone(), accumulate, filter_tiles)
    want = masked_mm_reference(dz.T, x, keep.T, base.clone(), accumulate, bv, bn)
    assert rel(got, want) < 1e-6
    dense_w = torch.mm(torch.where(expand_keep(keep, n, v, bn, bv), dz, 0.0).T, x) + (base if accumulate else 0)
    assert rel(got, dense_w) < 1e-6


@pytest.mark.parametrize("accumulate", [False, True])
def test_masked_matmuls_through_an_index(filter_tiles, accumulate):
    """dx_masked reading the rows w[perm] and dw_masked writing dW's rows at perm (the filter's order
    without a sorted copy of the shard) equal the same kernels on the sorted copy, put back in order."""
    g = torch.Generator().manual_seed(2)
    n, v, h = 45, 83, 70
    bn, bv = K.masked_blocks(torch.device("cpu"), torch.float32, filter_tiles)
    dz, w, x = torch.randn(n, v, generator=g), torch.randn(v, h, generator=g), torch.randn(n, h, generator=g)
    perm = torch.randperm(v, generator=g)
    keep = torch.rand(-(-n // bn), -(-v // bv), generator=g) < 0.5
    base_x = torch.randn(n, h, generator=g)
    got = K.dx_masked(dz, w, keep, base_x.clone(), accumulate, filter_tiles, w_perm=perm)
    want = K.dx_masked(dz, w[perm], keep, base_x.clone(), accumulate, filter_tiles)
    assert rel(got, want) < 1e-6 and rel(got, K.dx_masked(dz, w, keep, base_x.clone(), accumulate, filter_tiles)) > 1e-2
    base = torch.randn(v, h, generator=g)
    got = K.dw_masked(dz, x, keep, base.clone(), accumulate, filter_tiles, out_perm=perm)
    sorted_dw = K.dw_masked(dz, x, keep, base[perm].clone(), accumulate, filter_tiles)
    want = torch.empty_like(sorted_dw).index_copy_(0, perm, sorted_dw)
    assert rel(got, want) < 1e-6
    # a slice of the order (the recompute strategy's vocab chunk) writes only its own rows
    part = perm[20:61]
    out = base.clone()
    K.dw_masked(dz[:, 20:61], x, keep[:, :1].expand(-1, -(-41 // bv)).contiguous(), out, accumulate, filter_tiles,
                out_perm=part)
    untouched = torch.ones(v, dtype=torch.bool)
    untouched[part] = False
    assert torch.equal(out[untouched], base[untouched])


def test_filter_mask_is_the_block_max_of_the_gradient(filter_tiles):
    """chunk_grad_filtered_ writes the same dz as chunk_grad_ and keeps exactly the blocks with an
    entry |dz| >= eps * row_scale (rows of scale 0 keep nothing)."""
    x, w, t = _inputs(2)
    z = x @ w.T
    lse = torch.logsumexp(z, 1)
    gw = torch.rand(z.shape[0], generator=torch.Generator().manual_seed(3))
    gw[7] = 0.0
    tl = t.to(torch.int32).where(t >= 0, -1)
    kw = dict(scale=1.0, eps_over_v=0.0, one_minus_eps=1.0, two_zl=0.0, softcap=0.0, settings=filter_tiles)
    dz = K.chunk_grad_(z.clone(), tl, lse, gw, **kw)
    z2 = z.clone()
    keep = K.chunk_grad_filtered_(z2, tl, lse, gw, gw, 3e-2, **kw)
    # the same dz up to rounding: with other tiles, reference mode's torch.exp2 splits its vectorised
    # body and scalar tail differently
    assert rel(z2, dz) < 1e-6
    bn, bv = K.masked_blocks(z.device, z.dtype, filter_tiles)
    hit = (z2.abs() >= 3e-2 * gw[:, None]) & (gw > 0)[:, None]
    n, v = dz.shape
    hit = torch.nn.functional.pad(hit, (0, -v % bv, 0, -n % bn))
    want = hit.view(hit.shape[0] // bn, bn, hit.shape[1] // bv, bv).any(3).any(1)
    assert torch.equal(keep, want)
    assert 0.05 < float(keep.float().mean()) < 0.95  # peaked logits: some blocks skipped, some kept


@pytest.mark.parametrize("strategy", ["fused", "recompute"])
def test_filtered_gradients_within_the_bound(filter_tiles, strategy):
    """The loss is untouched; tiny eps gives the exact gradients; a larger eps changes each gradient
    entry by at most the documented bound (skipped |dz| < eps * row weight):
    |dX_nh err| <= eps * g_n * sum_v |W_vh| and |dW_vh err| <= eps * sum_n g_n |x_nh|."""
    x, w, t = _inputs(4)

    def run(eps):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = flce_dist.fused_linear_cross_entropy(xs, ws, t, grad_filter_eps=eps, strategy=strategy)
        loss.backward()
        return loss.detach(), xs.grad, ws.grad

    l0, gx0, gw0 = run(None)
    l1, gx1, gw1 = run(1e-30)
    # the filter runs on the vocabulary sorted by mean logit: the same loss up to summation order (the
    # default "gather" order tiles its logits pass differently: float32 rounding ~1e-6)
    assert abs(float(l1) - float(l0)) <= 1e-6 * abs(float(l0)) and rel(gx1, gx0) < 1e-5 and rel(gw1, gw0) < 1e-5
    eps = 5e-2
    l2, gx2, gw2 = run(eps)
    assert abs(float(l2) - float(l0)) <= 1e-6 * abs(float(l0))
    assert rel(gx2, gx0) > 1e-5  # something was skipped
    g = (t != -100).float() / (t != -100).sum()  # the mean's row weights
    bound_x = eps * g[:, None] * w.abs().sum(0)[None, :]
    bound_w = eps * (g[:, None] * x.abs()).sum(0)[None, :].expand_as(w)
    assert bool(((gx2 - gx0).abs() <= bound_x * 1.01 + 1e-7).all())
    assert bool(((gw2 - gw0).abs() <= bound_w * 1.01 + 1e-7).all())


def test_filter_with_entropy_and_per_token_grads(filter_tiles):
    """reduction='none' with a random grad_output and the entropy: the filter's row scale is the
    rows' total gradient weight; tiny eps is exact, a moderate eps close."""
    x, w, t = _inputs(5)
    go = torch.randn(t.shape, generator=torch.Generator().manual_seed(6))

    def run(eps):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss, ent = flce_dist.fused_linear_cross_entropy(xs, ws, t, reduction="none", return_entropy=True,
                                                         grad_filter_eps=eps, temperature=0.8)
        ((loss * go).sum() + 0.3 * ent.sum()).backward()
        return xs.grad, ws.grad

    gx0, gw0 = run(None)
    gx1, gw1 = run(1e-30)
    assert rel(gx1, gx0) < 1e-5 and rel(gw1, gw0) < 1e-5  # float32 rounding of the gather order's tiles
    gx2, gw2 = run(5e-2)
    assert 1e-6 < rel(gx2, gx0) < 5e-2 and rel(gw2, gw0) < 5e-2


def test_auto_and_bad_values():
    o = flce_dist.LossOptions(grad_filter_eps="auto")
    assert o.filter_eps(torch.bfloat16) == 2.0**-12 and o.filter_eps(torch.float32) == 0.0
    assert flce_dist.LossOptions().filter_eps(torch.bfloat16) == 0.0
    x, w, t = _inputs(7, n=8, v=20)
    for bad in ("fast", -1e-3, 1.5, float("nan")):
        with pytest.raises((ValueError, TypeError), match="grad_filter_eps"):
            flce_dist.fused_linear_cross_entropy(x, w, t, grad_filter_eps=bad)
    with pytest.raises(ValueError, match="label_smoothing"):
        flce_dist.fused_linear_cross_entropy(x, w, t, grad_filter_eps=1e-3, label_smoothing=0.1)


def _long_tailed(seed, n=96, h=48, v=301, frequent=64):
    """A trained model's shape of softmax: a unigram prior (a constant feature whose weight puts the
    rare 80% of the vocabulary ~12 nats down) and targets drawn from the frequent tokens."""
    x, w, _ = _inputs(seed, n=n, h=h, v=v, peak=2.0)
    x[:, 0] = 1.0
    w[:, 0] = 0.0
    w[frequent:, 0] = -12.0
    t = torch.randint(0, frequent, (n,), generator=torch.Generator().manual_seed(seed + 1))
    return x, w, t


def test_auto_on_bfloat16_trains_like_exact(filter_tiles):
    """bf16 with 'auto' (2**-12) on long-tailed logits: most blocks are skipped, and a few SGD steps
    follow the exact run's losses closely (the CPU stand-in for the loss-curve check)."""
    x, w0, t = _long_tailed(8)
    z = (x @ w0.T).bfloat16()
    lse = torch.logsumexp(z.float(), 1)
    g = torch.full((x.shape[0],), 1.0 / x.shape[0])
    kw = dict(scale=1.0, eps_over_v=0.0, one_minus_eps=1.0, two_zl=0.0, softcap=0.0, settings=filter_tiles)
    keep = K.chunk_grad_filtered_(z, t.to(torch.int32), lse, g, g, 2.0**-12, **kw)
    assert float(keep.float().mean()) < 0.4  # the rare vocabulary's blocks are skipped
    losses = {}
    for eps in (None, "auto"):
        w = w0.clone().bfloat16().requires_grad_()
        out = []
        for _ in range(10):
            loss = flce_dist.fused_linear_cross_entropy(x.bfloat16(), w, t, grad_filter_eps=eps)
            loss.backward()
            with torch.no_grad():
                w -= 1.0 * w.grad
                w.grad = None
            out.append(float(loss))
        losses[eps] = out
    assert losses[None][-1] < losses[None][0] - 0.1  # it trains
    assert max(abs(a - b) for a, b in zip(losses[None], losses["auto"])) < 0.01


def test_vocab_order_maps_rows_targets_and_back():
    """VocabOrder: descending weighted mean logit; rows / targets / restore / put are consistent."""
    from flce_dist.vocab_order import VocabOrder

    x, w, t = _inputs(9, n=40, v=57)
    b = torch.randn(57, generator=torch.Generator().manual_seed(10))
    rw = torch.rand(40, generator=torch.Generator().manual_seed(11))
    o = VocabOrder.by_mean_logit(x, w, b, rw)
    score = (rw[:, None] * (x @ w.T + b)).sum(0)
    assert bool((score[o.perm][1:] <= score[o.perm][:-1] + 1e-4).all())  # sorted, descending
    assert torch.equal(o.perm[o.inv], torch.arange(57)) and torch.equal(o.restore(o.rows(w)), w)
    tl = torch.tensor([0, 56, -1, 13], dtype=torch.int32)
    ts = o.targets(tl)
    assert ts.dtype == torch.int32 and int(ts[2]) == -1
    assert torch.equal(o.perm[ts[[0, 1, 3]].long()], tl[[0, 1, 3]].long())  # the same rows, found in sorted space
    out = torch.zeros_like(w)
    o.put(out, 5, o.rows(w, 5, 20))
    assert torch.equal(out[o.perm[5:20]], w[o.perm[5:20]]) and int((out != 0).any(1).sum()) == 15


@pytest.mark.parametrize("strategy", ["fused", "recompute"])
def test_filter_sorts_a_shuffled_vocabulary(filter_tiles, strategy, monkeypatch):
    """Long-tailed logits whose frequent tokens are scattered over the ids (as a tokenizer's are): in
    id order almost every block holds a frequent token; the filter's mean-logit order clusters them,
    so the masked matmuls see far fewer kept blocks, and the gradients stay within the bound."""
    x, w, t = _long_tailed(12, n=64, v=400, frequent=40)
    shuffle = torch.randperm(400, generator=torch.Generator().manual_seed(13))
    w, t = w[shuffle.argsort()], shuffle[t]  # token id shuffle[r] holds frequency rank r
    seen = []
    real = K.dx_masked

    def spy(dz, ww, keep, *a, **k):
        seen.append(float(keep.float().mean()))
        return real(dz, ww, keep, *a, **k)

    monkeypatch.setattr(K, "dx_masked", spy)
    eps = 1e-3
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    flce_dist.fused_linear_cross_entropy(xs, ws, t, grad_filter_eps=eps, strategy=strategy).backward()
    # the id-order mask of the same call, for comparison
    z = x @ w.T
    g = torch.full((64,), 1 / 64)
    kw = dict(scale=1.0, eps_over_v=0.0, one_minus_eps=1.0, two_zl=0.0, softcap=0.0, settings=filter_tiles)
    id_keep = float(K.chunk_grad_filtered_(z.clone(), t.to(torch.int32), torch.logsumexp(z, 1), g, g, eps,
                                           **kw).float().mean())
    assert id_keep > 0.7 and max(seen) < 0.5 * id_keep, (id_keep, seen)
    x0, w0 = x.clone().requires_grad_(), w.clone().requires_grad_()
    flce_dist.fused_linear_cross_entropy(x0, w0, t, strategy=strategy).backward()
    bound_x = eps * g[:, None] * w.abs().sum(0)[None, :]
    bound_w = eps * (g[:, None] * x.abs()).sum(0)[None, :].expand_as(w)
    assert bool(((xs.grad - x0.grad).abs() <= bound_x * 1.01 + 1e-7).all())
    assert bool(((ws.grad - w0.grad).abs() <= bound_w * 1.01 + 1e-7).all())
    assert rel(ws.grad, w0.grad) > 1e-7  # something was skipped


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_filter_under_torch_compile(filter_tiles, reduction):
    """The filtered path inside the flce_dist::fused_lce custom op (fullgraph=True): the same loss and
    gradients as eager with the same filter (fused strategy for mean, recompute for 'none'), and the
    filter really acts (the gradients differ from the exact ones)."""
    x, w, t = _long_tailed(14, n=48, v=250, frequent=30)
    go = torch.randn(t.shape, generator=torch.Generator().manual_seed(15)) if reduction == "none" else torch.tensor(1.0)

    def step(inp, weight, target, eps):
        return flce_dist.fused_linear_cross_entropy(inp, weight, target, reduction=reduction, grad_filter_eps=eps)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    outs = []
    for fn, eps in ((compiled, 1e-3), (step, 1e-3), (step, None)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xs, ws, t, eps)
        loss.backward(go)
        outs.append((loss.detach(), xs.grad, ws.grad))
    (lc, gxc, gwc), (le, gxe, gwe), (l0, gx0, gw0) = outs
    assert rel(lc, le) < 1e-6 and rel(gxc, gxe) < 1e-6 and rel(gwc, gwe) < 1e-6
    assert rel(lc, l0) < 1e-6 and rel(gxe, gx0) > 1e-5  # the filter acts (here ~4e-4 in dX)


@pytest.fixture
def gather_tiles():
    """SMALL_BLOCKS with coarser filter blocks (16 x 32, still several per dim here): reference mode
    runs a Python step per block, and these tests run the filter a dozen times."""
    with settings.override(blocks={**BLOCKS, "masked_mm": {"block_n": 16, "block_v": 32, "block_h": 64}}):
        yield settings.current()


def _gather_settings(base, chunk_rows, v, itemsize):
    """Settings with several token chunks of ``chunk_rows`` rows and (chunking.gather_rows: 1/8 of the
    budget, at least 64 rows) gathered blocks of 64 sorted rows."""
    return base.replace(chunk_bytes=chunk_rows * v * itemsize, filter_order="gather")


@pytest.mark.parametrize("v, bias, softcap, temperature, z_loss, reduction, backend", [
    (203, False, 0.0, 1.0, 0.0, "mean", "helion"),
    (193, True, 20.0, 0.7, 1e-3, "sum", "helion"),
    (193, True, 20.0, 0.7, 1e-3, "sum", "cublas"),  # 193 = 3 x 64 + 1: the last block of one row takes 8 (56 + 9)
])
def test_filter_order_gather_matches_copy_and_the_reference(gather_tiles, monkeypatch, v, bias, softcap, temperature,
                                                            z_loss, reduction, backend):
    """Settings(filter_order="gather"): the fused strategy's filter without a sorted copy of W gives, with
    a tiny eps, the float64 reference's loss and gradients, and with a larger eps the copy order's, over
    several token chunks (20 rows), odd sizes, a bias, softcap, temperature and z-loss. Spied: the
    order copies and restores vectors only (b, db), never W or dW; the Helion logits pass reads W through
    the order (no index_select of W at all); cuBLAS logits gather 64 sorted rows at a time (3 token
    chunks x 4 blocks)."""
    from flce_dist.vocab_order import VocabOrder

    x, w, t = _inputs(21 + v, v=v)
    b = torch.randn(v, generator=torch.Generator().manual_seed(v)) if bias else None
    kw = dict(softcap=softcap or None, temperature=temperature, z_loss=z_loss, reduction=reduction)
    gather = _gather_settings(gather_tiles, 20, v, 4).replace(logits_backend=backend)
    blocks = K.gather_bounds(v, 64)
    assert len(blocks) == 4 and min(e - s for s, e in blocks) >= 2

    def run(eps, s):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        bs = b.clone().requires_grad_() if b is not None else None
        loss = flce_dist.fused_linear_cross_entropy(xs, ws, t, bias=bs, grad_filter_eps=eps, strategy="fused",
                                                    settings=s, **kw)
        loss.backward()
        return [loss.detach(), xs.grad, ws.grad] + ([bs.grad] if b is not None else [])

    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    ref = flce_dist.reference.reference_loss(x64, w64, t, bias=b64, **kw)
    ref.backward()
    want = [ref.detach(), x64.grad, w64.grad] + ([b64.grad] if b is not None else [])
    calls, gathered = [], []
    rows, restore, index_select = VocabOrder.rows, VocabOrder.restore, torch.index_select
    monkeypatch.setattr(VocabOrder, "rows", lambda self, a, *r: calls.append(a is not None and a.dim()) or
                        rows(self, a, *r))
    monkeypatch.setattr(VocabOrder, "restore", lambda self, a: calls.append(a is not None and a.dim()) or
                        restore(self, a))
    monkeypatch.setattr(torch, "index_select", lambda src, dim, index, *, out=None: gathered.append(index.numel()) or
                        index_select(src, dim, index, out=out))
    got = run(1e-30, gather)
    assert calls and all(d in (False, 1) for d in calls), calls  # vectors (b, db) or None only
    assert sorted(gathered) == (sorted([e - s for s, e in blocks] * 3) if backend == "cublas" else []), gathered
    for g_, r_ in zip(got, want):
        assert rel(g_.double(), r_) < 1e-5, (rel(g_.double(), r_))
    if not bias:
        a, c = run(2e-2, gather), run(2e-2, gather.replace(filter_order="copy"))
        assert rel(a[1], want[1]) > 1e-5  # something was skipped
        for g_, c_ in zip(a, c):
            assert rel(g_, c_) < 1e-6


@pytest.mark.parametrize("bias, backend", [(False, "helion"), (True, "cublas")])
def test_filter_order_gather_in_the_recompute_strategy(gather_tiles, monkeypatch, bias, backend):
    """The recompute strategy (``logprobs_and_entropy``, the RL head's path) with
    Settings(filter_order="gather"): each vocab chunk's sorted rows are read through the order, never
    copied (spied: the order copies vectors only, never W; with Helion logits no index_select of W at all,
    with cuBLAS logits blocks of at most 64 sorted rows), 4 vocab chunks of 48 sorted rows; a tiny eps gives
    the float64 reference's per-token loss, entropy and gradients, a larger eps the copy order's."""
    from flce_dist.vocab_order import VocabOrder

    v = 193
    x, w, t = _inputs(31, v=v)
    b = torch.randn(v, generator=torch.Generator().manual_seed(7)) if bias else None
    go = torch.randn(t.shape, generator=torch.Generator().manual_seed(8))
    # the recompute plan's vocab chunk: chunk_bytes / (n x itemsize) columns = 48, 4 chunks (the last 49)
    s0 = gather_tiles.replace(chunk_bytes=48 * x.shape[0] * 4, filter_order="gather", logits_backend=backend)
    kw = dict(temperature=0.8, softcap=15.0)

    def run(eps, s):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        bs = b.clone().requires_grad_() if b is not None else None
        loss, ent = flce_dist.logprobs_and_entropy(xs, ws, t, bias=bs, grad_filter_eps=eps,
                                                   settings=s, **kw)
        ((loss * go).sum() + 0.3 * ent.sum()).backward()
        return [loss.detach(), ent.detach(), xs.grad, ws.grad] + ([bs.grad] if b is not None else [])

    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    loss64, ent64 = flce_dist.reference_logprobs_and_entropy(x64, w64, t, bias=b64, **kw)
    ((loss64 * go.double()).sum() + 0.3 * ent64.sum()).backward()
    want = [loss64.detach(), ent64.detach(), x64.grad, w64.grad] + ([b64.grad] if b is not None else [])
    calls, gathered = [], []
    rows, index_select = VocabOrder.rows, torch.index_select
    monkeypatch.setattr(VocabOrder, "rows", lambda self, a, *r: calls.append(a is not None and a.dim()) or
                        rows(self, a, *r))
    monkeypatch.setattr(torch, "index_select", lambda src, dim, index, *, out=None: gathered.append(
                        (src.shape[0], index.numel())) or index_select(src, dim, index, out=out))
    got = run(1e-30, s0)
    assert calls and all(d in (False, 1) for d in calls), calls  # b's rows or None only
    w_gathers = [k for rows_, k in gathered if rows_ == v and k > 0]
    if backend == "helion":
        assert not w_gathers, gathered
    else:
        assert w_gathers and max(w_gathers) <= 64, gathered
    for g_, r_ in zip(got, want):
        assert rel(g_.double(), r_) < 1e-5, rel(g_.double(), r_)
    if not bias:
        a, c = run(5e-2, s0), run(5e-2, s0.replace(filter_order="copy"))
        assert rel(a[2], want[2]) > 1e-5  # something was skipped
        for g_, c_ in zip(a, c):
            assert rel(g_, c_) < 1e-6


@pytest.mark.parametrize("order", [None, "copy"])
def test_filter_order_default_reads_w_through_the_order(gather_tiles, monkeypatch, order):
    """The default Settings(filter_order="gather") never copies W in either strategy (the recompute one:
    ``logprobs_and_entropy``, 4 vocab chunks; the fused one: ``reduction="mean"``): no 2-D
    ``VocabOrder.rows`` call (spied: 1 = a vector, 2 = W); "copy" takes W's sorted rows in both. Each
    against the float64 reference's gradients at a tiny eps."""
    from flce_dist.vocab_order import VocabOrder

    x, w, t = _inputs(37, v=131)
    s = gather_tiles.replace(chunk_bytes=40 * x.shape[0] * 4)  # recompute: 4 vocab chunks
    assert settings.Settings().filter_order == s.filter_order == "gather"
    if order is not None:
        s = s.replace(filter_order=order)
    dims = []
    rows = VocabOrder.rows
    monkeypatch.setattr(VocabOrder, "rows", lambda self, a, *r: dims.append(a is not None and a.dim()) or
                        rows(self, a, *r))

    def grads(fn):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xs, ws).backward()
        return xs.grad, ws.grad

    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    lp64, ent64 = flce_dist.reference_logprobs_and_entropy(x64, w64, t)
    (lp64.sum() + 0.3 * ent64.sum()).backward()
    recompute = grads(lambda xs, ws: (lambda lp, ent: lp.sum() + 0.3 * ent.sum())(
        *flce_dist.logprobs_and_entropy(xs, ws, t, grad_filter_eps=1e-30, settings=s)))
    want = [x64.grad, w64.grad]
    recompute_dims, dims[:] = list(dims), []
    x64.grad = w64.grad = None
    flce_dist.reference_loss(x64, w64, t).backward()
    fused = grads(lambda xs, ws: flce_dist.fused_linear_cross_entropy(xs, ws, t, grad_filter_eps=1e-30, settings=s))
    assert recompute_dims and dims
    copies = (2 in recompute_dims, 2 in dims)
    assert copies == ((False, False) if order is None else (True, True)), (recompute_dims, dims)
    for g_, r_ in zip(recompute + fused, want + [x64.grad, w64.grad]):
        assert rel(g_.double(), r_) < 1e-5, rel(g_.double(), r_)


@pytest.mark.parametrize("dtype, n", [(torch.float64, 9), (torch.float32, 1)])
@pytest.mark.parametrize("strategy", ["fused", "recompute"])
def test_filter_gather_order_on_the_torch_reference_path(gather_tiles, strategy, dtype, n):
    """float64 (no ``hl.dot``) and a size-1 dim (one token; Helion 1.4 mis-compiles it) take masked_mm's torch
    reference, which gets the default gather order's int32 index for dW's rows (torch's ``index_copy_`` takes
    int64 only: this raised before): both strategies against the float64 reference at a tiny eps."""
    x, w, t = _inputs(41, n=max(n, 6), v=131, dtype=dtype)
    x, t = x[:n], t[:n].clamp(min=0)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    flce_dist.fused_linear_cross_entropy(xs, ws, t, grad_filter_eps=1e-30, strategy=strategy).backward()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    flce_dist.reference_loss(x64, w64, t).backward()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert rel(xs.grad.double(), x64.grad) < tol and rel(ws.grad.double(), w64.grad) < tol


def test_filter_order_setting_is_checked():
    with pytest.raises(ValueError, match="filter_order"):
        settings.Settings(filter_order="sorted")
    with pytest.raises(ValueError, match="filter_order"):
        settings.Settings(filter_order="auto")
    assert settings.Settings(filter_order="gather").astuple()[-1] == "gather"
    with settings.override(filter_order="gather") as s:
        assert settings.current().filter_order == "gather" and s.filter_order == "gather"
