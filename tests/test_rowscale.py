"""The fused strategy's row-scaled gradient form (``flce_dist/rowscale.py``) against the float64
reference: the form itself, its device-side fallback (natural and forced), the target entry's
precision on confident rows, the kernels' exponential store and gates, and where the form applies."""

from __future__ import annotations

import pytest
import torch

from flce_dist import fused_linear_cross_entropy, rowscale, settings
from flce_dist.kernels import launch
from flce_dist.kernels.chunk_grad import chunk_grad_reference_
from flce_dist.options import FLCEParams, LossOptions

from .conftest import SMALL_BLOCKS, rel
from .test_single_rank import _seed, check_all, make_inputs, run_flce, run_ref


class _Spy:
    """Records the gate of every chunk that took the row-scale form."""

    def __init__(self, monkeypatch):
        self.gates = []
        real = rowscale.prepare_

        def prepare_(*a, **k):
            c, gate = real(*a, **k)
            self.gates.append(int(gate.item()))
            return c, gate

        monkeypatch.setattr(rowscale, "prepare_", prepare_)


# n = 33 rows in chunks of 16: two full chunks and a 1-row chunk (the kernels' torch fallbacks)
N, H, V = 33, 40, 601  # V > SAMPLE: the references come from a strided sample of the shard
CHUNK = {torch.float32: 16 * V * 4, torch.bfloat16: 16 * V * 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("opts", [{}, {"z_loss": 1e-3, "temperature": 0.8}])
def test_rowscale_matches_reference(small_tiles, request, monkeypatch, dtype, reduction, opts):
    hidden, weight, _, target = make_inputs(_seed(request), N, H, V, dtype, ignore_frac=0.2)
    spy = _Spy(monkeypatch)
    got = run_flce(hidden, weight, None, target, strategy="fused", reduction=reduction, chunk_bytes=CHUNK[dtype],
                   grad_output=torch.tensor(0.75), **opts)
    assert spy.gates == [0, 0, 0]  # three chunks, each in the row-scale form (no fallback)
    check_all(got, run_ref(hidden, weight, None, target, reduction=reduction, grad_output=torch.tensor(0.75), **opts),
              dtype)
    with settings.override(grad_form="chunk_grad"):  # the other form on the same inputs: the same numbers
        other = run_flce(hidden, weight, None, target, strategy="fused", reduction=reduction, chunk_bytes=CHUNK[dtype],
                         grad_output=torch.tensor(0.75), **opts)
    assert len(spy.gates) == 3
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    check_all(got, [t.double() if t is not None else None for t in other], dtype, loss_tol=tol, grad_tol=tol)


def test_rowscale_fallback_on_a_wide_row(small_tiles, request, monkeypatch):
    """Rows whose max logit is far (> MAX_SPREAD) above the sampled reference (a vocab row outside
    the sample, aligned with a token of the second chunk): that chunk alone falls back to dz_gated,
    and every result stays exact."""
    hidden, weight, _, target = make_inputs(_seed(request), N, H, V, torch.float32)
    step = -(-V // rowscale.SAMPLE)
    assert step > 1
    hot = 1  # not a multiple of step: outside the sample
    weight[hot] = hidden[18] / hidden[18].norm() * (100.0 / hidden[18].norm())  # logit ~ 100 at row 18
    target[20] = hot
    spy = _Spy(monkeypatch)
    got = run_flce(hidden, weight, None, target, strategy="fused", chunk_bytes=CHUNK[torch.float32])
    assert spy.gates == [0, 1, 0]
    check_all(got, run_ref(hidden, weight, None, target), torch.float32)


def test_rowscale_fallback_on_an_ignored_wide_row(small_tiles, request, monkeypatch):
    """The spread bound holds for ignored rows too (their E would be inf against c = 0 in the dW
    matmul: NaN): an ignored token with a logit ~100 nats above the sample opens its chunk's gate."""
    hidden, weight, _, target = make_inputs(_seed(request), N, H, V, torch.float32)
    weight[1] = hidden[18] * (100.0 / hidden[18].norm() ** 2)  # row 1 is outside the strided sample
    target[18] = -100
    spy = _Spy(monkeypatch)
    got = run_flce(hidden, weight, None, target, strategy="fused", chunk_bytes=CHUNK[torch.float32])
    assert spy.gates == [0, 1, 0]
    check_all(got, run_ref(hidden, weight, None, target), torch.float32)


def _shard_case(seed: int, zl: float = 0.0):
    """A vocab shard (rows [100, 400) of 601) as a rank of a TP group sees it: local stats from the
    store pass, global stats from the whole vocabulary, local targets (-1: on another rank)."""
    g = torch.Generator().manual_seed(seed)
    n, h, v, lo, hi = 29, 40, 601, 100, 400
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * 2 / h**0.5
    t = torch.randint(0, v, (n,), generator=g)
    s = settings.Settings(blocks=SMALL_BLOCKS)
    tl = torch.where((t >= lo) & (t < hi), t - lo, -1).to(torch.int32)
    ws = w[lo:hi].contiguous()
    r = rowscale.reference(x, ws, 1.0)
    e = torch.empty(n, hi - lo)
    local = launch.lse_forward(x, ws, None, tl, 1.0, 0.0, False, s, z_out=e, exp_ref=r)
    full = launch.lse_forward(x, w, None, t.to(torch.int32), 1.0, 0.0, False, s)  # global lse, target logit
    gw = torch.rand(n, generator=g)
    p = FLCEParams(lo, v, LossOptions(z_loss=zl), s)
    return x, ws, tl, r, e, local, full, gw, p


@pytest.mark.parametrize("zl", [0.0, 1e-3])
def test_rowscale_under_tp_statistics(zl):
    """prepare_ with this shard's local stats and the global ones (another rank holds most targets):
    c E' is chunk_grad_'s dz of the shard against the global lse, and the gate stays closed."""
    x, ws, tl, r, e, local, full, gw, p = _shard_case(7, zl)
    assert (tl < 0).any() and (tl >= 0).any()
    c, gate = rowscale.prepare_(e, local, full, r, tl, gw, p)
    assert gate.item() == 0
    want = chunk_grad_reference_(x @ ws.T, tl, full[:, 0], gw, 1.0, 0.0, 1.0, 2 * zl, 0.0)
    assert rel(c[:, None] * e, want) < 1e-5


@pytest.mark.parametrize("zl", [0.0, 1e-3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_prepare_kernel_matches_torch(zl, dtype):
    """kernels/row_prepare.py (reference mode, several row tiles, a partial last one) against
    rowscale.prepare_reference: the same c, target entries and gate, with the gate closed, opened by
    one wide row in the last tile, and by a NaN lse."""
    g = torch.Generator().manual_seed(11 + int(zl > 0))
    n, v = 37, 53
    e = torch.rand(n, v, generator=g).to(dtype)
    local, st = torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g)
    st[:, 0] = st[:, 1].abs() + 2.0  # lse above the target logit
    r = local[:, 3] - torch.rand(n, generator=g)
    tl = torch.randint(-1, v, (n,), generator=g).to(torch.int32)
    gw = torch.rand(n, generator=g)
    gw[3] = 0.0
    p = FLCEParams(0, v, LossOptions(z_loss=zl), settings.Settings(blocks={"row_prepare": {"block_n": 8}}))
    for case in ("closed", "wide", "nan"):
        lc, sc = local.clone(), st.clone()
        if case == "wide":
            lc[34, 3] = r[34] + rowscale.MAX_SPREAD + 1.0
        elif case == "nan":
            sc[7, 0] = float("nan")
        e1, e2 = e.clone(), e.clone()
        c1, g1 = rowscale.prepare_(e1, lc, sc, r, tl, gw, p)
        c2, g2 = rowscale.prepare_reference(e2, lc, sc, r, tl, gw, p)
        assert g1.item() == g2.item() == (0 if case == "closed" else 1), case
        torch.testing.assert_close(c1, c2, rtol=1e-6, atol=0)
        torch.testing.assert_close(e1, e2, rtol=1e-6, atol=0, equal_nan=True)
        if case == "closed":
            assert not torch.equal(e1, e)  # the target entries were written


def test_rowscale_bounds_each_open_the_gate(monkeypatch):
    """Each bound alone opens the gate (and the same case without it keeps it closed): the scale c
    of a row with a gradient (a shard ~75 nats below the global lse: c x would round to 0 in bf16),
    the target entry (z-loss with 1 + 2 zl lse = 0; the c bound switched off, since c = 0 there
    fails it too) and the spread."""
    x, ws, tl, r, e, local, full, gw, p = _shard_case(8)
    _, gate = rowscale.prepare_(e.clone(), local, full, r, tl, gw, p)
    assert gate.item() == 0
    j = int(torch.nonzero(tl < 0)[0])  # a row whose target is on another rank: only c is bounded
    far = full.clone()
    far[j, 0] += 75.0  # c ~ g e^-75 < 2^-100
    _, gate = rowscale.prepare_(e.clone(), local, far, r, tl, gw, p)
    assert gate.item() == 1
    gz = gw.clone()
    gz[j] = 0.0  # the same row ignored (g = 0): no bound on its c
    _, gate = rowscale.prepare_(e.clone(), local, far, r, tl, gz, p)
    assert gate.item() == 0
    i = int(torch.nonzero(tl >= 0)[0])  # a row with its target here
    zl = FLCEParams(p.vocab_start, p.vocab_size, LossOptions(z_loss=1.0), p.settings)
    lse1 = full.clone()
    lse1[i, 0] = -0.5  # 1 + 2 zl lse = 0: E'_t = (...) / (1 + a) is inf
    monkeypatch.setattr(rowscale, "MIN_C", 0.0)
    _, gate = rowscale.prepare_(e.clone(), local, lse1, r, tl, gw, zl)
    assert gate.item() == 1
    monkeypatch.setattr(rowscale, "MAX_TARGET", float("inf"))
    _, gate = rowscale.prepare_(e.clone(), local, lse1, r, tl, gw, zl)
    assert gate.item() == 0  # (inf <= inf: the target bound was the one that opened it)
    wide = local.clone()
    wide[5, 3] = r[5] + rowscale.MAX_SPREAD + 1.0
    _, gate = rowscale.prepare_(e.clone(), wide, full, r, tl, gw, p)
    assert gate.item() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowscale_fallback_forced(small_tiles, request, monkeypatch, dtype):
    """With the bound at -1 every chunk takes the gated fallback (dz_gated): the chunk_grad_ form's
    numbers (dX leaves its matmul in float32 before the row scale, hence a bf16 ulp here and there)."""
    hidden, weight, _, target = make_inputs(_seed(request), N, H, V, dtype, ignore_frac=0.2)
    with settings.override(grad_form="chunk_grad"):
        want = run_flce(hidden, weight, None, target, strategy="fused", chunk_bytes=CHUNK[dtype], z_loss=1e-3)
    monkeypatch.setattr(rowscale, "MAX_SPREAD", -1.0)
    spy = _Spy(monkeypatch)
    got = run_flce(hidden, weight, None, target, strategy="fused", chunk_bytes=CHUNK[dtype], z_loss=1e-3)
    assert spy.gates == [1, 1, 1]
    for a, b in zip(got[:3], want[:3]):
        assert rel(a, b) <= (1e-6 if dtype == torch.float32 else 1e-3)


def test_rowscale_target_entry_on_confident_rows():
    """bf16, p_t ~ 0.999: the target entry c E'_t carries p_t - 1 to bf16 precision. Written as the
    stored exponential times c minus the one-hot, the same entry would be off by ~100% (the check
    below that it is: the test can fail)."""
    g = torch.Generator().manual_seed(5)
    n, h, v = 40, 64, 300
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.3 / h**0.5
    t = torch.randperm(v, generator=g)[:n]  # distinct: each target row aligned with its one token
    w[t] += 12.0 * x / x.norm(dim=1, keepdim=True) ** 2 * 1.0  # target logit ~ +12: p_t ~ 1 - V e^-12
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    tl = t.to(torch.int32)
    s = settings.Settings(blocks=SMALL_BLOCKS)
    p = FLCEParams(0, v, LossOptions(), s)
    gw = torch.full((n,), 1.0 / n)
    r = rowscale.reference(x, w, 1.0)
    e = torch.empty(n, v, dtype=torch.bfloat16)
    local = launch.lse_forward(x, w, None, tl, 1.0, 0.0, False, s, z_out=e, exp_ref=r)
    stored = e.clone()
    c, gate = rowscale.prepare_(e, local, local, r, tl, gw, p)
    assert gate.item() == 0
    z = torch.empty(n, v, dtype=torch.bfloat16)
    launch.lse_forward(x, w, None, tl, 1.0, 0.0, False, s, z_out=z)
    dz_ref = chunk_grad_reference_(z.double(), tl, local[:, 0].double(), gw.double(), 1.0, 0.0, 1.0, 0.0, 0.0)
    rows = torch.arange(n)
    want = dz_ref[rows, t]
    assert (want.abs() < 0.05 * gw.double()).all()  # confident: |p_t - 1| < 0.05
    got = c.double() * e[rows, t].double()
    assert ((got - want).abs() / want.abs()).max() < 2e-2
    naive = c.double() * stored[rows, t].double() - gw.double()
    assert ((naive - want).abs() / want.abs()).max() > 0.1
    other = torch.ones(n, v, dtype=torch.bool)
    other[rows, t] = False  # every other entry: c E = p g to bf16 rounding
    dz = c.double()[:, None] * e.double()
    assert ((dz - dz_ref).abs()[other] / dz_ref.abs()[other].clamp(min=1e-30)).max() < 1e-2


def test_kernel_exp_store_and_gate():
    """lse_forward's exponential store (against the torch formula, statistics unchanged) and the
    fallback kernel dz_gated: untouched output when closed, the chunk_grad_ formula when open."""
    from flce_dist.kernels.dz_gated import dz_gated_reference

    g = torch.Generator().manual_seed(11)
    n, h, v = 37, 70, 101
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * h**-0.5 * 3
    tl = torch.randint(-1, v, (n,), generator=g).to(torch.int32)
    s = settings.Settings(blocks=SMALL_BLOCKS)
    r = torch.randn(n, generator=g)
    e = torch.empty(n, v)
    st = launch.lse_forward(x, w, None, tl, 0.8, 0.0, False, s, z_out=e, exp_ref=r)
    torch.testing.assert_close(e, torch.exp((x @ w.T) * 0.8 - r[:, None]), rtol=1e-5, atol=0)
    torch.testing.assert_close(st, launch.lse_forward(x, w, None, tl, 0.8, 0.0, False, s), rtol=1e-6, atol=1e-6)
    lse, gw = st[:, 0].contiguous(), torch.rand(n, generator=g)
    closed, opened = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    dz = torch.full((n, v), 3.0)
    launch.dz_gated(x, w, dz, tl, lse, gw, closed, 0.8, 2e-3, s)
    assert (dz == 3.0).all()
    launch.dz_gated(x, w, dz, tl, lse, gw, opened, 0.8, 2e-3, s)
    want = chunk_grad_reference_(x @ w.T, tl, lse, gw, 0.8, 0.0, 1.0, 2e-3, 0.0)
    torch.testing.assert_close(dz, want, rtol=1e-5, atol=1e-7)
    for gate in (closed, opened):  # the torch form (size-1 dims) agrees
        got = dz_gated_reference(x, w, torch.full((n, v), 3.0), tl, lse, gw, gate, 0.8, 2e-3)
        torch.testing.assert_close(got, want if gate.item() else torch.full((n, v), 3.0), rtol=1e-5, atol=1e-7)


def test_rowscale_applies_where_it_can():
    def ok(dtype=torch.float32, bias=False, helion=True, filtered=False, s=settings.Settings(), **opts):
        return rowscale.applies(dtype, bias, FLCEParams(0, 16, LossOptions(**opts), s), helion, filtered)

    assert ok() and ok(torch.bfloat16) and ok(z_loss=1e-4, temperature=0.5)
    assert not ok(torch.float16)
    assert not ok(bias=True)
    assert not ok(softcap=30.0)
    assert not ok(label_smoothing=0.1)
    assert not ok(filtered=True)
    assert not ok(helion=False)
    assert not ok(s=settings.Settings(grad_form="chunk_grad"))
    with pytest.raises(ValueError, match="grad_form"):
        settings.Settings(grad_form="fast")


def test_row_scale_kernel_matches_torch():
    """kernels/row_scale.py (reference mode, several tiles, odd shape) against its torch form."""
    from flce_dist.kernels.row_scale import row_scale_reference

    g = torch.Generator().manual_seed(3)
    n, h = 37, 70
    acc, c = torch.randn(n, h, generator=g), torch.randn(n, generator=g)
    s = settings.Settings(blocks=SMALL_BLOCKS)
    assert SMALL_BLOCKS["row_scale"]["block_n"] < n and SMALL_BLOCKS["row_scale"]["block_h"] < h
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, h, generator=g).to(dtype)
        got = launch.row_scale(acc, x, c, torch.empty(n, h, dtype=dtype), torch.empty(n, h, dtype=dtype), s)
        want = row_scale_reference(acc, x, c, torch.empty(n, h, dtype=dtype), torch.empty(n, h, dtype=dtype))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
