"""Single-rank correctness of ``flce_dist.fused_linear_cross_entropy`` against ``reference_loss``.

Every kernel test runs under the ``small_tiles`` fixture (several Helion tiles per dimension in
reference mode) and ``settings.override(chunk_bytes=...)`` (several materialised logits chunks):
the fused strategy chunks tokens (``rows = chunk_bytes / (V * elem)``), the recompute strategy
chunks the vocabulary with all N rows (``cols = chunk_bytes / (N * elem)``).
The reference is always computed in float64 on the same (possibly bf16-rounded) inputs.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import flce_dist
from flce_dist import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy, reference_loss, settings
from flce_dist.kernels import launch
from flce_dist.reference import reference_logits

from .conftest import rel

STRATEGIES = ("fused", "recompute")
LOSS_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-10}
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float64: 1e-10}

# Medium blocks for the one large shape: still several tiles in every dimension (and not dividing
# 423 / 1000 / 10000), but far fewer reference-mode programs than the 8x32 tiles of small_tiles.
MEDIUM_BLOCKS = {
    "lse_forward": {"block_n": 128, "block_v": 1024, "block_h": 256},
    "chunk_stats": {"block_n": 64, "block_s": 2304, "block_v": 768},
    "chunk_grad": {"block_n": 64, "block_v": 768},
    # the fused strategy's grad_output scale of dW [10000, 1000]: small_tiles' 64-element blocks are 156k
    # reference-mode programs (80 s of CI); 3000 still leaves a partial last block
    "scale": {"block": 3000},
}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _seed(request, salt: str = "") -> int:
    """A distinct, reproducible seed per test (and per parametrisation)."""
    return zlib.crc32((request.node.nodeid + salt).encode()) & 0x7FFFFFFF


def make_inputs(seed: int, n: int, h: int, v: int, dtype=torch.float32, *, bias: bool = False,
                lead: tuple[int, ...] | None = None, ignore_frac: float = 0.0, ignore_index: int = -100,
                wscale: float = 2.0):
    """hidden [*lead or N, H], weight [V, H], bias [V] | None, target [*lead or N] (fresh random)."""
    g = torch.Generator().manual_seed(seed)
    shape = lead if lead is not None else (n,)
    hidden = torch.randn(*shape, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * (wscale / h ** 0.5)).to(dtype)
    b = (torch.randn(v, generator=g, dtype=torch.float64) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, v, shape, generator=g)
    if ignore_frac > 0:
        drop = torch.rand(shape, generator=g) < ignore_frac
        target = torch.where(drop, torch.full_like(target, ignore_index), target)
    return hidden, weight, b, target


def chunk_bytes_for(strategy: str, n: int, v: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 20 * v * elem if strategy == "fused" else 40 * n * elem


def run_flce(hidden, weight, bias, target, *, strategy, reduction="mean", grad_output=None,
             chunk_bytes=None, **opts):
    """Loss (and lse with return_lse) plus grads of hidden / weight / bias."""
    x = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    with settings.override(chunk_bytes=chunk_bytes):
        out = fused_linear_cross_entropy(x, w, target, bias=b, reduction=reduction, strategy=strategy, **opts)
        loss = out[0] if isinstance(out, tuple) else out
        if grad_output is None:
            loss.backward()
        else:
            loss.backward(grad_output)
    return out, x.grad, w.grad, (b.grad if b is not None else None)


def run_ref(hidden, weight, bias, target, *, reduction="mean", grad_output=None, **opts):
    """float64 reference loss and grads on the same inputs, upcast."""
    x = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = bias.detach().double().requires_grad_() if bias is not None else None
    out = reference_loss(x, w, target, bias=b, reduction=reduction, **opts)
    loss = out[0] if isinstance(out, tuple) else out
    if grad_output is None:
        loss.backward()
    else:
        loss.backward(grad_output.double())
    return out, x.grad, w.grad, (b.grad if b is not None else None)


def assert_close(name: str, got, want, tol: float):
    assert got is not None, f"{name}: missing"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got.detach().double()).all(), f"{name}: non-finite values"
    err = rel(got, want)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def check_all(got, want, dtype, *, loss_tol=None, grad_tol=None):
    (loss, gx, gw, gb), (rloss, rx, rw, rb) = got, want
    loss_tol = LOSS_TOL[dtype] if loss_tol is None else loss_tol
    grad_tol = GRAD_TOL[dtype] if grad_tol is None else grad_tol
    assert_close("loss", loss, rloss, loss_tol)
    assert_close("d_hidden", gx, rx, grad_tol)
    assert_close("d_weight", gw, rw, grad_tol)
    if rb is not None:
        assert_close("d_bias", gb, rb, grad_tol)
    else:
        assert gb is None


# --------------------------------------------------------------------------------------------
# the test harness itself: small_tiles + chunk_bytes really reach the kernels
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, grad_form", [("fused", "rowscale"), ("fused", "chunk_grad"), ("recompute", "rowscale")])
def test_kernels_run_tiled_and_chunked(small_tiles, monkeypatch, request, strategy, grad_form):
    n, h, v = 37, 70, 101
    launches = []
    orig = launch._launch

    stores = []

    def spy(name, args, device, dtype, settings, variant="", h=None, blocks=None):
        launches.append((name, tuple(args[0].shape), launch.entry(name, device, dtype, variant, h, settings)["block"]))
        if name == "lse_forward":
            stores.append(args[10])  # the store mode (after x, w, bias, target, z_out, ref, w_perm, scale, softcap, has_bias)
        return orig(name, args, device, dtype, settings, variant, h, blocks)

    monkeypatch.setattr(launch, "_launch", spy)
    hidden, weight, _, target = make_inputs(_seed(request), n, h, v)
    with settings.override(grad_form=grad_form):
        got = run_flce(hidden, weight, None, target, strategy=strategy,
                       chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32))
    check_all(got, run_ref(hidden, weight, None, target), torch.float32)
    names = [name for name, _, _ in launches]
    if grad_form == "rowscale" and strategy == "fused":
        # the row-scale form (rowscale.py): no chunk_grad_ pass; its gated fallback launched (closed) per chunk
        assert "chunk_grad" not in names, names
        gated = [(shape, blk) for name, shape, blk in launches if name == "dz_gated"]
        assert len(gated) >= 2 and all(blk["block_n"] < shape[0] and blk["block_h"] < h and blk["block_v"] < v
                                       for shape, blk in gated), gated
        scaled = [(shape, blk) for name, shape, blk in launches if name == "row_scale"]
        assert len(scaled) == len(gated) and all(blk["block_n"] < shape[0] and blk["block_h"] < h
                                                 for shape, blk in scaled), scaled
        assert stores and all(m == launch.STORE_EXP for m in stores), stores  # exponentials, not logits
        prepared = [(shape, blk) for name, shape, blk in launches if name == "row_prepare"]  # its per-row step
        assert len(prepared) == len(gated) and all(blk["block_n"] < shape[0] // v for shape, blk in prepared), prepared
    elif strategy == "fused":
        assert stores and all(m == launch.STORE_LOGITS for m in stores), stores
    if not (grad_form == "rowscale" and strategy == "fused"):
        grads = [(shape, blk) for name, shape, blk in launches if name == "chunk_grad"]
        assert len(grads) >= 2, f"expected several logits chunks, got launches {names}"
        assert all(blk["block_n"] < shape[0] for shape, blk in grads), grads
        assert any(blk["block_v"] < shape[1] for shape, blk in grads), grads
    merged = [(shape, blk) for name, shape, blk in launches if name == "merge"]  # one per lse_forward launch
    assert len(merged) == names.count("lse_forward"), names
    assert all(blk["block_n"] < shape[1] and blk["block_t"] < shape[0] for shape, blk in merged), merged
    if strategy == "fused":
        # one lse_forward launch per token chunk (logits or exponentials stored + statistics)
        fwd = [(shape, blk) for name, shape, blk in launches if name == "lse_forward"]
        assert len(fwd) >= 2 and all(shape[0] <= 20 + 1 for shape, _ in fwd), fwd
        assert all(b["block_n"] < 37 and b["block_h"] < h and b["block_v"] < v for _, b in fwd)
    else:
        (fwd,) = [(shape, blk) for name, shape, blk in launches if name == "lse_forward"]
        assert fwd[1]["block_n"] < n and fwd[1]["block_h"] < h and fwd[1]["block_v"] < v


# --------------------------------------------------------------------------------------------
# odd shapes
# --------------------------------------------------------------------------------------------

ODD_SHAPES = [
    (37, 70, 101),  # nothing divides anything
    (1, 16, 5),  # N = 1
    (9, 16, 1),  # V = 1
    (13, 24, 7),  # V < tile
    (29, 33, 77),  # H not a multiple of 16
    (2, 3, 2),  # tiny everything
    (64, 48, 64),  # exact multiples of some tiles
]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_odd_shapes(small_tiles, request, strategy, shape, bias):
    n, h, v = shape
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, bias=bias)
    got = run_flce(hidden, weight, b, target, strategy=strategy,
                   chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32))
    check_all(got, run_ref(hidden, weight, b, target), torch.float32)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_large_odd_shape(small_tiles, request, strategy):
    """N=423, H=1000, V=10000: NaN in dW in the original Helion FLCE."""
    n, h, v = 423, 1000, 10000
    hidden, weight, _, target = make_inputs(_seed(request), n, h, v, ignore_frac=0.05)
    # ~5 chunks per strategy (token chunks of 100 rows / vocab chunks of 2000 columns)
    cb = 100 * v * 4 if strategy == "fused" else 2000 * n * 4
    with settings.override(blocks=MEDIUM_BLOCKS):
        got = run_flce(hidden, weight, None, target, strategy=strategy, chunk_bytes=cb)
    check_all(got, run_ref(hidden, weight, None, target), torch.float32)


# --------------------------------------------------------------------------------------------
# dtypes x reductions x bias
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dtype_reduction_bias(small_tiles, request, strategy, dtype, reduction, bias):
    n, h, v = 37, 70, 101
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, dtype, bias=bias, ignore_frac=0.2)
    go = None
    if reduction == "none":
        go = torch.randn(n, generator=torch.Generator().manual_seed(_seed(request, "go")))
    got = run_flce(hidden, weight, b, target, strategy=strategy, reduction=reduction, grad_output=go,
                   chunk_bytes=chunk_bytes_for(strategy, n, v, dtype))
    want = run_ref(hidden, weight, b, target, reduction=reduction, grad_output=go)
    check_all(got, want, dtype)
    # gradients come back in the parameters' dtype
    assert got[1].dtype == dtype and got[2].dtype == dtype
    if bias:
        assert got[3].dtype == dtype


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scalar_grad_output_scales(small_tiles, request, strategy):
    """backward with a non-unit scalar grad_output (e.g. loss * 3.5 or a loss scaler)."""
    n, h, v = 21, 33, 50
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, bias=True)
    go = torch.tensor(-3.5)
    got = run_flce(hidden, weight, b, target, strategy=strategy, reduction="sum", grad_output=go,
                   chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32))
    check_all(got, run_ref(hidden, weight, b, target, reduction="sum", grad_output=go), torch.float32)


@pytest.mark.parametrize("go", [1.0, 2.0, -3.5, 0.37, 0.0, float("inf")], ids=["one", "two", "neg", "frac", "zero", "inf"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("rows", [1, 2, 63, 64, 1000])
def test_scale_kernel_matches_torch(request, rows, dtype, go):
    """``kernels.scale_`` (the fused backward's grad_output pass, several 64-element tiles and a partial
    last one) is bit-identical to torch's ``t * g.to(t.dtype)``; with g == 1 it leaves t as it was."""
    from flce_dist.kernels.scale import scale_reference_

    from .conftest import SMALL_BLOCKS

    gen = torch.Generator().manual_seed(_seed(request))
    t = (torch.randn(rows, 3, generator=gen) * 50).to(dtype)
    g = torch.tensor(go)
    exact = dict(rtol=0, atol=0, equal_nan=True)  # bit for bit, NaN where both are NaN (0 * inf)
    want = scale_reference_(t.clone(), g)
    torch.testing.assert_close(want, t * g.to(dtype), **exact)  # the reference is torch's own product
    got = launch.scale_(t.clone(), g, settings.Settings(blocks=SMALL_BLOCKS))
    torch.testing.assert_close(got, want, **exact)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float16(small_tiles, request, strategy, reduction):
    n, h, v = 37, 70, 101
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, torch.float16, bias=True, ignore_frac=0.1)
    go = torch.randn(n, generator=torch.Generator().manual_seed(_seed(request, "go"))) if reduction == "none" else None
    got = run_flce(hidden, weight, b, target, strategy=strategy, reduction=reduction, grad_output=go,
                   chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float16))
    check_all(got, run_ref(hidden, weight, b, target, reduction=reduction, grad_output=go), torch.float16,
              loss_tol=1e-3, grad_tol=5e-3)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_large_logits(small_tiles, request, strategy):
    """bf16 with logits of std ~5 (trained LMs have far larger ones): still within 1e-2.

    Regression: the recompute backward once formed softmax from bf16-rounded cuBLAS logits against
    the lse of float32 Helion logits (rows did not sum to 1, ~2e-2 error); lse_forward now rounds
    logits to the input dtype first, as the backward sees them."""
    n, h, v = 64, 256, 500
    hidden, weight, _, target = make_inputs(_seed(request), n, h, v, torch.bfloat16, wscale=5.0)
    got = run_flce(hidden, weight, None, target, strategy=strategy,
                   chunk_bytes=chunk_bytes_for(strategy, n, v, torch.bfloat16))
    check_all(got, run_ref(hidden, weight, None, target), torch.bfloat16)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_target_boundaries(small_tiles, request, strategy):
    """targets 0 and V-1 (first / last, partial vocab tile) and an ignore_index outside [0, V)."""
    n, h, v = 30, 33, 75
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, bias=True)
    target[0::3] = 0
    target[1::3] = v - 1
    target[2::9] = v + 5
    for kw in (dict(ignore_index=v + 5), dict(ignore_index=v + 5, reduction="none")):
        go = torch.randn(n, generator=torch.Generator().manual_seed(_seed(request, "go"))) if kw.get("reduction") else None
        got = run_flce(hidden, weight, b, target, strategy=strategy, grad_output=go,
                       chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32), **kw)
        check_all(got, run_ref(hidden, weight, b, target, grad_output=go, **kw), torch.float32)


# --------------------------------------------------------------------------------------------
# ignore_index
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ignore_index_default(small_tiles, request, strategy, reduction):
    n, h, v = 45, 40, 90
    hidden, weight, _, target = make_inputs(_seed(request), n, h, v, ignore_frac=0.4)
    assert (target == -100).any() and (target != -100).any()
    go = torch.randn(n, generator=torch.Generator().manual_seed(_seed(request, "go"))) if reduction == "none" else None
    got = run_flce(hidden, weight, None, target, strategy=strategy, reduction=reduction, grad_output=go,
                   chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32))
    want = run_ref(hidden, weight, None, target, reduction=reduction, grad_output=go)
    check_all(got, want, torch.float32)
    if reduction == "none":
        assert (got[0][target == -100] == 0).all()
    # ignored rows get exactly zero d_hidden
    assert (got[1][target == -100] == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_custom_ignore_index_is_a_valid_id(small_tiles, request, strategy, reduction):
    """ignore_index=7 is also a legal vocab id: tokens with target 7 must be ignored."""
    n, h, v = 40, 24, 30
    hidden, weight, _, target = make_inputs(_seed(request), n, h, v, ignore_frac=0.3, ignore_index=7)
    assert (target == 7).sum() >= 3 and (target != 7).any()
    go = torch.randn(n, generator=torch.Generator().manual_seed(_seed(request, "go"))) if reduction == "none" else None
    got = run_flce(hidden, weight, None, target, strategy=strategy, reduction=reduction, grad_output=go,
                   ignore_index=7, chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32))
    want = run_ref(hidden, weight, None, target, reduction=reduction, grad_output=go, ignore_index=7)
    check_all(got, want, torch.float32)
    # and it differs from NOT ignoring them (the test can tell the two apart)
    not_ignored = run_ref(hidden, weight, None, target, reduction=reduction, grad_output=go)
    assert rel(got[0], not_ignored[0]) > 1e-3
    assert (got[1][target == 7] == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_ignored(small_tiles, request, strategy, reduction):
    n, h, v = 19, 24, 45
    hidden, weight, b, _ = make_inputs(_seed(request), n, h, v, bias=True)
    target = torch.full((n,), -100, dtype=torch.int64)
    go = torch.randn(n, generator=torch.Generator().manual_seed(_seed(request, "go"))) if reduction == "none" else None
    (loss, gx, gw, gb) = run_flce(hidden, weight, b, target, strategy=strategy, reduction=reduction, grad_output=go,
                                  chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32))
    assert torch.isfinite(loss).all()
    assert (loss == 0).all(), loss
    for name, gr in (("d_hidden", gx), ("d_weight", gw), ("d_bias", gb)):
        assert gr is not None, name
        assert torch.isfinite(gr).all(), f"{name} not finite"
        assert (gr == 0).all(), f"{name} not zero"
    rl = reference_loss(hidden.double(), weight.double(), target, bias=b.double(), reduction=reduction)
    assert (rl == 0).all()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_ignored_num_items(small_tiles, request, strategy):
    n, h, v = 11, 20, 33
    hidden, weight, _, _ = make_inputs(_seed(request), n, h, v)
    target = torch.full((n,), -100, dtype=torch.int64)
    loss, gx, gw, _ = run_flce(hidden, weight, None, target, strategy=strategy, num_items_in_batch=0,
                               chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32))
    assert loss.item() == 0.0 and torch.isfinite(gx).all() and torch.isfinite(gw).all()
    assert (gx == 0).all() and (gw == 0).all()


# --------------------------------------------------------------------------------------------
# leading dims
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_leading_dims(small_tiles, request, strategy, reduction):
    bsz, t, h, v = 3, 11, 40, 57
    n = bsz * t
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, bias=True, lead=(bsz, t), ignore_frac=0.15)
    assert hidden.shape == (bsz, t, h) and target.shape == (bsz, t)
    go = None
    if reduction == "none":
        go = torch.randn(bsz, t, generator=torch.Generator().manual_seed(_seed(request, "go")))
    got = run_flce(hidden, weight, b, target, strategy=strategy, reduction=reduction, grad_output=go,
                   chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32))
    want = run_ref(hidden, weight, b, target, reduction=reduction, grad_output=go)
    check_all(got, want, torch.float32)
    if reduction == "none":
        assert got[0].shape == (bsz, t)
    else:
        assert got[0].shape == ()
    assert got[1].shape == (bsz, t, h)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_leading_dims_3d_and_return_lse(small_tiles, request, strategy):
    lead, h, v = (2, 3, 5), 24, 41
    n = 30
    hidden, weight, _, target = make_inputs(_seed(request), n, h, v, lead=lead)
    go = torch.randn(*lead, generator=torch.Generator().manual_seed(_seed(request, "go")))
    (loss, lse), gx, gw, _ = run_flce(hidden, weight, None, target, strategy=strategy, reduction="none",
                                      grad_output=go, return_lse=True,
                                      chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32))
    (rloss, rlse), rx, rw, _ = run_ref(hidden, weight, None, target, reduction="none", grad_output=go,
                                       return_lse=True)
    assert loss.shape == lead and lse.shape == lead
    assert_close("loss", loss, rloss, 1e-5)
    assert_close("lse", lse, rlse, 1e-5)
    assert_close("d_hidden", gx, rx, 1e-4)
    assert_close("d_weight", gw, rw, 1e-4)


# --------------------------------------------------------------------------------------------
# gradcheck (float64)
# --------------------------------------------------------------------------------------------

GRADCHECK_OPTS = {
    "plain": {},
    "all_extras": dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, temperature=0.7),
}


@pytest.mark.parametrize("opts", list(GRADCHECK_OPTS), ids=list(GRADCHECK_OPTS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradcheck(small_tiles, request, strategy, reduction, opts):
    n, h, v = 5, 6, 7
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, torch.float64, bias=True)
    target[1] = -100
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    bb = b.clone().requires_grad_()
    kw = dict(reduction=reduction, strategy=strategy, **GRADCHECK_OPTS[opts])
    # several chunks even at this size: 2 token rows (fused) / 3 vocab columns (recompute)
    cb = 2 * v * 8 if strategy == "fused" else 3 * n * 8
    # The fused strategy hands out its forward-formed gradients on the first backward and
    # recomputes on later ones (retain_graph): equal up to float64 rounding, not bitwise.
    nondet = 1e-12 if strategy == "fused" else 0.0
    with settings.override(chunk_bytes=cb):
        assert torch.autograd.gradcheck(
            lambda x_, w_, b_: fused_linear_cross_entropy(x_, w_, target, bias=b_, **kw),
            (x, w, bb), eps=1e-6, atol=1e-8, rtol=1e-6, nondet_tol=nondet,
        )
        # and the value itself matches the reference in float64
        got = fused_linear_cross_entropy(x, w, target, bias=bb, **kw)
    want = reference_loss(hidden, weight, target, bias=b, reduction=reduction, **GRADCHECK_OPTS[opts])
    assert rel(got, want) < 1e-12


# --------------------------------------------------------------------------------------------
# forward only
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("strategy", ("auto", *STRATEGIES))
def test_no_grad_forward(small_tiles, request, strategy, reduction):
    n, h, v = 37, 70, 101
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, bias=True, ignore_frac=0.1)
    x, w, bb = (t.clone().requires_grad_() for t in (hidden, weight, b))
    with torch.no_grad(), settings.override(chunk_bytes=chunk_bytes_for("fused", n, v, torch.float32)):
        loss, lse = fused_linear_cross_entropy(x, w, target, bias=bb, reduction=reduction, strategy=strategy,
                                               return_lse=True)
    assert not loss.requires_grad
    rloss, rlse = reference_loss(hidden.double(), weight.double(), target, bias=b.double(), reduction=reduction,
                                 return_lse=True)
    assert_close("loss", loss, rloss, 1e-5)
    assert_close("lse", lse, rlse, 1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forward_without_requires_grad(small_tiles, request, strategy):
    n, h, v = 30, 33, 66
    hidden, weight, _, target = make_inputs(_seed(request), n, h, v)
    with settings.override(chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32)):
        loss = fused_linear_cross_entropy(hidden, weight, target, strategy=strategy)
    assert not loss.requires_grad
    assert_close("loss", loss, reference_loss(hidden.double(), weight.double(), target), 1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_for_weight_only(small_tiles, request, strategy):
    """hidden without requires_grad (a frozen trunk): only dW is produced, and it is right."""
    n, h, v = 30, 33, 66
    hidden, weight, _, target = make_inputs(_seed(request), n, h, v)
    w = weight.clone().requires_grad_()
    with settings.override(chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32)):
        fused_linear_cross_entropy(hidden, w, target, strategy=strategy).backward()
    wd = weight.double().requires_grad_()
    reference_loss(hidden.double(), wd, target).backward()
    assert_close("d_weight", w.grad, wd.grad, 1e-4)


# --------------------------------------------------------------------------------------------
# options: label smoothing, z-loss, softcap, temperature, num_items_in_batch, return_lse
# --------------------------------------------------------------------------------------------

OPTION_SETS = {
    "label_smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(z_loss=1e-3),
    "softcap": dict(softcap=5.0),
    "temperature": dict(temperature=0.7),
    "combined": dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, temperature=0.7),
    "num_items": dict(num_items_in_batch=17),
    "num_items_tensor": dict(num_items_in_batch=torch.tensor(17)),
    "combined_num_items": dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, temperature=0.7,
                               num_items_in_batch=17),
}


@pytest.mark.parametrize("opts", list(OPTION_SETS), ids=list(OPTION_SETS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_options(small_tiles, request, strategy, opts):
    n, h, v = 37, 70, 101
    # larger logits so that the softcap and z-loss terms are not negligible
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, bias=True, ignore_frac=0.1, wscale=6.0)
    kw = OPTION_SETS[opts]
    got = run_flce(hidden, weight, b, target, strategy=strategy,
                   chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32), **kw)
    want = run_ref(hidden, weight, b, target, **kw)
    check_all(got, want, torch.float32)
    # the option actually changes the result (so a silently dropped option fails)
    plain = run_ref(hidden, weight, b, target)
    assert rel(want[0], plain[0]) > 1e-4 or rel(want[2], plain[2]) > 1e-4


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_options_combined_other_reductions(small_tiles, request, strategy, reduction):
    n, h, v = 29, 33, 77
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, bias=True, ignore_frac=0.1, wscale=6.0)
    kw = OPTION_SETS["combined"]
    go = torch.randn(n, generator=torch.Generator().manual_seed(_seed(request, "go"))) if reduction == "none" else None
    got = run_flce(hidden, weight, b, target, strategy=strategy, reduction=reduction, grad_output=go,
                   chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32), **kw)
    check_all(got, run_ref(hidden, weight, b, target, reduction=reduction, grad_output=go, **kw), torch.float32)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_options_combined_bf16(small_tiles, request, strategy):
    n, h, v = 37, 70, 101
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, torch.bfloat16, bias=True, ignore_frac=0.1,
                                            wscale=6.0)
    kw = OPTION_SETS["combined_num_items"]
    got = run_flce(hidden, weight, b, target, strategy=strategy,
                   chunk_bytes=chunk_bytes_for(strategy, n, v, torch.bfloat16), **kw)
    check_all(got, run_ref(hidden, weight, b, target, **kw), torch.bfloat16)


@pytest.mark.parametrize("opts", ["plain", "softcap_temperature"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_return_lse(small_tiles, request, strategy, reduction, opts):
    n, h, v = 37, 70, 101
    kw = {} if opts == "plain" else dict(softcap=5.0, temperature=0.7)
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, bias=True, ignore_frac=0.2, wscale=6.0)
    with settings.override(chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32)):
        out = fused_linear_cross_entropy(hidden.clone().requires_grad_(), weight.clone().requires_grad_(), target,
                                         bias=b, reduction=reduction, strategy=strategy, return_lse=True, **kw)
    assert isinstance(out, tuple) and len(out) == 2
    loss, lse = out
    assert not lse.requires_grad
    logits = reference_logits(hidden.double(), weight.double(), b.double(), **kw)
    want_lse = torch.logsumexp(logits, dim=-1)
    assert lse.shape == target.shape
    # lse is reported for every token, ignored ones included
    assert_close("lse", lse, want_lse, 1e-5)
    assert_close("loss", loss, reference_loss(hidden.double(), weight.double(), target, bias=b.double(),
                                              reduction=reduction, **kw), 1e-5)


# --------------------------------------------------------------------------------------------
# module
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_matches_function(small_tiles, request, strategy, reduction):
    n, h, v = 25, 33, 61
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, bias=True, ignore_index=3, ignore_frac=0.2)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, strategy=strategy)
    mod = FusedLinearCrossEntropyLoss(ignore_index=3, reduction=reduction, **opts)
    go = torch.randn(n, generator=torch.Generator().manual_seed(_seed(request, "go"))) if reduction == "none" else None
    cb = chunk_bytes_for(strategy, n, v, torch.float32)

    def grads(fn):
        x, w, bb = (t.clone().requires_grad_() for t in (hidden, weight, b))
        with settings.override(chunk_bytes=cb):
            loss = fn(x, w, bb)
            loss.backward(go)
        return loss.detach(), x.grad, w.grad, bb.grad

    a = grads(lambda x, w, bb: mod(x, w, target, bb))
    f = grads(lambda x, w, bb: fused_linear_cross_entropy(x, w, target, bias=bb, ignore_index=3, reduction=reduction,
                                                          **opts))
    for name, u, r in zip(("loss", "d_hidden", "d_weight", "d_bias"), a, f):
        assert torch.equal(u, r), name
    want = run_ref(hidden, weight, b, target, reduction=reduction, grad_output=go, ignore_index=3,
                   label_smoothing=0.1, z_loss=1e-3)
    check_all(a, want, torch.float32)


def test_module_unknown_option():
    with pytest.raises(TypeError, match="label_smothing"):
        FusedLinearCrossEntropyLoss(label_smothing=0.1)


def test_public_names():
    for name in ("fused_linear_cross_entropy", "FusedLinearCrossEntropyLoss", "VocabParallelLMHead",
                 "vocab_shard", "reference_loss"):
        assert hasattr(flce_dist, name), name


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


def _bad_cases():
    h, v, n = 8, 11, 6
    x = torch.randn(n, h)
    w = torch.randn(v, h)
    t = torch.randint(0, v, (n,))
    t_hi = t.clone()
    t_hi[2] = v
    t_neg = t.clone()
    t_neg[4] = -5
    t_ignored_wrong = t.clone()
    t_ignored_wrong[0] = -100  # -100 is NOT ignored when ignore_index=7
    return [
        ("target_too_large", (x, w, t_hi), {}, ValueError, "target"),
        ("target_negative", (x, w, t_neg), {}, ValueError, "target"),
        ("target_minus100_with_custom_ignore", (x, w, t_ignored_wrong), {"ignore_index": 7}, ValueError, "target"),
        ("weight_hidden_size", (x, torch.randn(v, h + 1), t), {}, ValueError, "hidden size|weight"),
        ("weight_1d", (x, torch.randn(v * h), t), {}, ValueError, "weight"),
        ("dtype_mismatch", (x, w.to(torch.bfloat16), t), {}, TypeError, "dtype"),
        ("target_shape", (x, w, t[:-1]), {}, ValueError, "target"),
        ("target_shape_leading", (x.reshape(2, 3, h), w, t), {}, ValueError, "target"),
        ("bad_reduction", (x, w, t), {"reduction": "avg"}, ValueError, "reduction"),
        ("float_target", (x, w, t.float()), {}, TypeError, "target"),
        ("int_hidden", (torch.ones(n, h, dtype=torch.int64), w, t), {}, TypeError, "hidden"),
        ("bias_shape", (x, w, t), {"bias": torch.randn(v + 1)}, ValueError, "bias"),
        ("bad_strategy", (x, w, t), {"strategy": "magic"}, ValueError, "strategy"),
        ("label_smoothing", (x, w, t), {"label_smoothing": 1.5}, ValueError, "label_smoothing"),
        ("temperature", (x, w, t), {"temperature": 0.0}, ValueError, "temperature"),
        ("softcap", (x, w, t), {"softcap": -1.0}, ValueError, "softcap"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input(case):
    _, args, kw, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        fused_linear_cross_entropy(*args, **kw)


# --------------------------------------------------------------------------------------------
# non-contiguous inputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_noncontiguous_hidden(small_tiles, request, strategy):
    n, h, v = 37, 70, 101
    g = torch.Generator().manual_seed(_seed(request))
    base = torch.randn(h, n, generator=g, requires_grad=True)  # hidden = base.T: a transposed view
    weight = torch.randn(v, h, generator=g) * (2.0 / h ** 0.5)
    target = torch.randint(0, v, (n,), generator=g)
    w = weight.clone().requires_grad_()
    hidden = base.T
    assert not hidden.is_contiguous()
    with settings.override(chunk_bytes=chunk_bytes_for(strategy, n, v, torch.float32)):
        loss = fused_linear_cross_entropy(hidden, w, target, strategy=strategy)
        loss.backward()
    bd = base.detach().double().requires_grad_()
    wd = weight.double().requires_grad_()
    ref = reference_loss(bd.T, wd, target)
    ref.backward()
    assert_close("loss", loss, ref, 1e-5)
    assert_close("d_base", base.grad, bd.grad, 1e-4)
    assert_close("d_weight", w.grad, wd.grad, 1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_noncontiguous_strided_everything(small_tiles, request, strategy):
    """hidden sliced with a step, weight a transposed view, target a strided slice, 3-D leading dims."""
    bsz, t, h, v = 2, 9, 20, 45
    g = torch.Generator().manual_seed(_seed(request))
    hb = torch.randn(bsz, 2 * t, h, generator=g)
    wb = torch.randn(h, v, generator=g) * (2.0 / h ** 0.5)
    tb = torch.randint(0, v, (bsz, 2 * t), generator=g)
    hidden, target = hb[:, ::2], tb[:, ::2]
    assert not hidden.is_contiguous() and not target.is_contiguous()
    x = hidden.detach().requires_grad_()  # still strided
    wleaf = wb.clone().requires_grad_()
    with settings.override(chunk_bytes=chunk_bytes_for(strategy, bsz * t, v, torch.float32)):
        loss = fused_linear_cross_entropy(x, wleaf.T, target, strategy=strategy, reduction="sum")
        loss.backward()
    xd = hidden.double().requires_grad_()
    wd = wb.double().requires_grad_()
    ref = reference_loss(xd, wd.T, target, reduction="sum")
    ref.backward()
    assert_close("loss", loss, ref, 1e-5)
    assert_close("d_hidden", x.grad, xd.grad, 1e-4)
    assert_close("d_weight", wleaf.grad, wd.grad, 1e-4)


@pytest.mark.parametrize("fused_logits", ["helion", "cublas"])
def test_fused_logits_modes_match_reference(small_tiles, request, fused_logits):
    """Both ways of forming a chunk's logits in the fused strategy (Helion lse_forward storing
    them, or cuBLAS + chunk_stats) give the reference loss and gradients, over several chunks."""
    n, h, v = 37, 70, 101
    hidden, weight, b, target = make_inputs(_seed(request), n, h, v, torch.float32, bias=True)
    with settings.override(fused_logits=fused_logits):
        got = run_flce(hidden, weight, b, target, strategy="fused", chunk_bytes=chunk_bytes_for("fused", n, v, torch.float32))
    check_all(got, run_ref(hidden, weight, b, target), torch.float32)


def test_fused_logits_mode_rejects_unknown():
    with pytest.raises(ValueError, match="fused_logits"):
        with settings.override(fused_logits="triton"):
            pass


@pytest.mark.parametrize("bias, softcap, with_sum, with_ent", [(False, 0.0, False, False), (True, 3.0, True, False),
                                                          (False, 0.0, False, True), (True, 3.0, True, True)])
def test_kernels_match_their_torch_references(bias, softcap, with_sum, with_ent):
    """Each Helion kernel (reference mode, several tiles in every dimension, odd shapes) against the
    torch reference in its own file: lse_forward (statistics, and the logits it stores), chunk_stats
    and chunk_grad_."""
    from flce_dist.kernels import launch
    from flce_dist.kernels.chunk_grad import chunk_grad_reference_
    from flce_dist.kernels.chunk_stats import chunk_stats_reference
    from flce_dist.kernels.lse_forward import lse_forward_reference
    from .conftest import SMALL_BLOCKS

    g = torch.Generator().manual_seed(29)
    n, h, v, scale = 37, 70, 101, 0.8
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * h**-0.5 * 3
    b = torch.randn(v, generator=g) if bias else None
    tl = torch.randint(-1, v, (n,), generator=g).to(torch.int32)  # -1: no target in this shard
    s = settings.Settings(blocks=SMALL_BLOCKS)
    for k, bs in SMALL_BLOCKS.items():  # the dims really are tiled several times (scale_: its own test)
        if k == "scale":
            continue
        assert all(size < dim for size, dim in zip(bs.values(), (n, v, h))), k
    z_kernel, z_ref = torch.empty(n, v), torch.empty(n, v)
    got = launch.lse_forward(x, w, b, tl, scale, softcap, with_sum, s, z_out=z_kernel, with_ent=with_ent)
    ref = lse_forward_reference(x, w, b, tl, scale, softcap, with_sum, z_out=z_ref, with_ent=with_ent)
    assert got.shape == ref.shape == (n, 5 if with_ent else 4)
    assert rel(z_kernel, z_ref) < 1e-6
    assert rel(got, ref) < 1e-5, (got[:3], ref[:3])
    # logits never stored
    assert rel(launch.lse_forward(x, w, b, tl, scale, softcap, with_sum, s, with_ent=with_ent), ref) < 1e-5
    k = 5 if with_ent else 4
    assert rel(launch.chunk_stats(z_ref, tl, scale, softcap, with_sum, s, with_ent),
               torch.stack(chunk_stats_reference(z_ref, tl, scale, softcap, with_sum, with_ent)[:k], dim=1)) < 1e-5
    if with_ent:  # the entropy column against its definition -sum p log p, in float64
        y = z_ref.double() * scale
        y = softcap * torch.tanh(y / softcap) if softcap else y
        logp = torch.log_softmax(y, 1)
        assert rel(ref[:, 4].double(), -(logp.exp() * logp).sum(1)) < 1e-5
    lse, gw = ref[:, 0].contiguous(), torch.rand(n, generator=g)
    kw = dict(scale=scale, eps_over_v=0.1 / v, one_minus_eps=0.9, two_zl=2e-3, softcap=softcap)
    ent_kw = dict(mu=(ref[:, 0] - ref[:, 4]).contiguous(), gh=torch.randn(n, generator=g)) if with_ent else {}
    dz = launch.chunk_grad_(z_ref.clone(), tl, lse, gw, settings=s, **kw, **ent_kw)
    dz_ref = chunk_grad_reference_(z_ref.clone(), tl, lse, gw, **kw, **ent_kw)
    assert rel(dz, dz_ref) < 1e-5
    if with_ent:  # the entropy term really is in there
        assert rel(dz, chunk_grad_reference_(z_ref.clone(), tl, lse, gw, **kw)) > 1e-3


@pytest.mark.parametrize("start, v_local", [(0, 50), (20, 17)])
def test_target_and_token_kernels_match_torch(start, v_local):
    """kernels/targets.py and kernels/token_loss.py (reference mode, several tiles, a partial last
    one) against their torch forms: targets ignored, in this shard, on another rank's shard, and
    outside [0, V) (negative and too large); the loss with and without label smoothing and z-loss,
    bad rows NaN, ignored rows 0, ties counted as correct."""
    from flce_dist.kernels import launch
    from flce_dist.kernels.targets import target_rows_reference
    from flce_dist.kernels.token_loss import token_rows_reference

    g = torch.Generator().manual_seed(37)
    n, vocab, ign = 37, 50, -100
    t = torch.randint(-3, vocab + 3, (n,), generator=g)
    t[::5] = ign
    s = settings.Settings(blocks={"target_rows": {"block_n": 8}, "token_rows": {"block_n": 8}})
    got = launch.target_rows(t, start, v_local, vocab, ign, s)
    want = target_rows_reference(t, start, v_local, vocab, ign)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    tl, valid, bad = got
    assert bad.any() and (~valid).any() and (tl >= 0).any()
    assert ((tl < 0) & valid & ~bad).any() == (v_local < vocab)  # another rank's targets
    stats = torch.randn(n, 4, generator=g) * 3
    stats[:, 0] = stats[:, 1].abs() + 1.0
    stats[3, 3] = stats[3, 1]  # a tie: correct
    for ls, zl in ((0.0, 0.0), (0.1, 1e-3)):
        a = launch.token_rows(stats, valid, bad, ls, vocab, zl, s)
        b = token_rows_reference(stats, valid, bad, 1.0 - ls, ls / vocab, zl)
        torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6, equal_nan=True)
        assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
        assert a[0][bad].isnan().all() and (a[0][~valid] == 0).all() and a[1][3] == valid[3]


def test_launch_refuses_one_tensor_in_two_arguments():
    """Helion 1.4 compiles a call with one tensor object in two arguments into one parameter and
    caches it for later calls with distinct tensors (benchmarks/NOTES.md, run 19): every launch
    refuses aliased arguments; two views of one tensor are distinct objects and pass."""
    from flce_dist.kernels import launch

    t = torch.ones(64)
    with pytest.raises(AssertionError, match="scale was passed the same tensor object twice"):
        launch._launch("scale", (t, t), t.device, t.dtype, settings.Settings())
    launch._launch("scale", (t[:], torch.full((1,), 2.0)), t.device, t.dtype, settings.Settings())
    assert (t == 2.0).all()
    launch._launch("scale", (t[:], torch.full((1,), 2.0)), t.device, t.dtype, settings.Settings())  # a cache hit
    assert (t == 4.0).all()
    with pytest.raises(AssertionError, match="scale was passed the same tensor object twice"):  # a hit checks too
        launch._launch("scale", (t, t), t.device, t.dtype, settings.Settings())


def test_launch_cache_maps_to_what_a_full_bind_gives(monkeypatch):
    """The launch cache (kernels/launch.py ``_bind``) skips the config lookup and Helion's bind on a repeat
    call: a hit gives the bound kernel and block sizes a fresh lookup gives; a new token count of the same
    layout hits (issue 60: the kernels take N at run time); a new stride pattern / dtype / scalar / block
    override / ``Settings.blocks`` / ``hl.specialize``d size (``STATIC_DIMS``) is a new key (never another
    call's kernel or blocks), and a full cache is cleared, not grown."""
    from flce_dist.kernels import launch

    s = settings.Settings()
    t, g = torch.randn(300), torch.full((1,), 2.0)
    full, bound, _ = launch._bind("scale", (t, g), t.device, t.dtype, s, "", None, None)
    binds = []
    real_entry = launch.entry
    monkeypatch.setattr(launch, "entry", lambda *a, **k: binds.append(a[0]) or real_entry(*a, **k))
    full2, bound2, first = launch._bind("scale", (t, g), t.device, t.dtype, s, "", None, None)
    assert bound2 is bound and full2[2:] == full[2:] and full2[0] is t and not first and binds == []
    fresh = launch._kernels()["scale"].bind(full)
    assert fresh is bound
    t301 = torch.randn(301)  # another token count: a hit, and the kernel a full bind gives
    f1, b1, _ = launch._bind("scale", (t301, g), t.device, t.dtype, s, "", None, None)
    assert binds == [] and b1 is launch._kernels()["scale"].bind(f1) and f1[0] is t301
    for args, kw in [((t[::2], g), {}), ((t.double(), g.double()), {}), ((t, g), {"blocks": {"block": 64}})]:
        f3, b3, _ = launch._bind("scale", args, args[0].device, args[0].dtype, s, "", None, kw.get("blocks"))
        assert b3 is launch._kernels()["scale"].bind(f3)
        if kw:
            assert f3[-1] == 64 and full[-1] != 64
    s32 = s.replace(blocks={"scale": {"block": 32}})
    f4, _, _ = launch._bind("scale", (t, g), t.device, t.dtype, s32, "", None, None)
    assert f4[-1] == 32 and len(binds) == 4
    # the hidden size is specialised (lse_forward's hl.specialize): two H are two keys, two N one
    x1, x2, x3 = torch.randn(5, 64), torch.randn(7, 64), torch.randn(5, 80)
    key = lambda x: launch._arg_key((x, 1.0), launch.STATIC_DIMS["lse_forward"])  # noqa: E731
    assert key(x1) == key(x2) and key(x1) != key(x3)
    assert launch._arg_key((torch.randn(5, 63),)) != launch._arg_key((torch.randn(5, 64),))  # 16-byte rows or not
    monkeypatch.setattr(launch, "_CACHE_MAX", len(launch._CACHE))
    launch._bind("scale", (torch.randn(302).half(), g), t.device, torch.float16, s, "", None, None)
    assert len(launch._CACHE) == 1


def test_launch_cache_runs_each_settings_own_config(monkeypatch):
    """Two ``Settings(config_dir=...)`` whose entries differ only in the ``helion.Config`` (same block sizes, so
    Helion hands both the same BoundKernel) used in turn in one process: each launch runs its own config. Before
    run 31 the bound kernel kept the config of its first launch and a later config_dir was silently ignored on
    CUDA. A fake kernel stands in for Helion's (``set_config`` is CUDA-only)."""
    from flce_dist import settings
    from flce_dist.kernels import launch

    cfgs = {"A": {"num_warps": 8, "num_stages": 3}, "B": {"num_warps": 4, "num_stages": 2}}
    sets = []

    class Bound:
        def set_config(self, c):
            sets.append(dict(num_warps=c.num_warps, num_stages=c.num_stages))

    bound = Bound()

    class Kernel:
        def bind(self, full):
            return bound

    def entry(name, device, dtype, variant="", h=None, settings=None):
        # a fresh dict per lookup, as a merged entry would be: equal configs must not re-set
        return {"block": {"block_n": 16, "block_t": 256}, "config": dict(cfgs[settings.config_dir])}

    monkeypatch.setattr(launch, "_kernels", lambda: {"merge": Kernel()})
    monkeypatch.setattr(launch, "entry", entry)
    monkeypatch.setattr(launch, "_CACHE", {})
    monkeypatch.setattr(launch, "_CONFIGURED", {})
    cuda = torch.device("cuda")  # only the launch cache's bookkeeping runs: no tensor goes to a device
    a, b = settings.Settings(config_dir="A"), settings.Settings(config_dir="B")
    x = torch.randn(3, 4)
    order = [a, a, b, b, a, a, b]
    firsts = [launch._bind("merge", (x,), cuda, x.dtype, s, "", None, None)[2] for s in order]
    want = [cfgs["A"], cfgs["B"], cfgs["A"], cfgs["B"]]
    assert sets == want
    assert firsts == [True] + [False] * 6
    x2 = torch.randn(5, 4)  # another cache key, same bound kernel, same config as the last: no re-set
    launch._bind("merge", (x2,), cuda, x2.dtype, b, "", None, None)
    assert len(sets) == 4


@pytest.mark.parametrize("softcap", [0.0, 2.5])
def test_target_dot_and_the_pass_without_targets(softcap):
    """kernels/target_dot.py (reference mode, several token tiles, a partial last one, rows without a
    local target, with and without a softcap) against its torch form and against each logits pass's
    own target logits; every pass (no store, logits, exponentials) with ``with_tgt`` False gives the
    same maxima, sums and stored values as with it, and no per-tile target partials (one unwritten row)."""
    from flce_dist import rowscale
    from flce_dist.kernels import launch
    from flce_dist.kernels.lse_forward import lse_forward_partials
    from flce_dist.kernels.target_dot import target_dot_reference

    g = torch.Generator().manual_seed(41)
    n, h, v = 37, 24, 300
    x = torch.randn(n, h, generator=g, dtype=torch.float64).float()
    w = torch.randn(v, h, generator=g, dtype=torch.float64).float() * 0.7
    t = torch.randint(0, v, (n,), generator=g).to(torch.int32)
    t[::6] = -1
    s = settings.Settings(blocks={"target_dot": {"block_n": 16, "block_h": 8}})
    got = launch._launch("target_dot", (x, w, t, 0.75, softcap), x.device, x.dtype, s)
    want = target_dot_reference(x, w, t, 0.75, softcap)
    assert got.shape == (1, n) and (got[0, t < 0] == 0).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if softcap:  # the cap bites: some target logits are beyond it uncapped
        assert (target_dot_reference(x, w, t, 0.75).abs() > softcap).any() and (got.abs() < softcap).all()
    r = rowscale.reference(x, w, 0.75)
    blocks = (16, 128, 8)
    for store in (launch.STORE_NONE, launch.STORE_LOGITS, launch.STORE_EXP):
        if store == launch.STORE_EXP and softcap:
            continue  # the row-scale form runs without a softcap (rowscale.py)
        za, zb = (torch.empty(n, v), torch.empty(n, v)) if store else (x.new_zeros(1, 1), x.new_zeros(1, 1))
        ref = r if store == launch.STORE_EXP else x.new_zeros(1)
        tail = (ref, t.new_zeros(1), 0.75, softcap, False, store, False, False)
        pa = lse_forward_partials(x, w, w.new_zeros(1), t, za, *tail, True, False, *blocks)
        pb = lse_forward_partials(x, w, w.new_zeros(1), t, zb, *tail, False, False, *blocks)
        assert torch.equal(pa[0], pb[0]) and torch.equal(pa[1], pb[1]) and torch.equal(za, zb), store
        assert pa[2].shape[0] == 3 and pb[2].shape == (1, n)
        torch.testing.assert_close(got[0], pa[2].sum(0), rtol=1e-5, atol=1e-5)  # the pass's own target logits


@pytest.mark.parametrize("tgt_rows", ["tiles", "one"])
def test_merge_kernel_matches_torch(tgt_rows):
    """kernels/merge.py (reference mode, several token and tile blocks, a partial last block) against
    lse_forward.merge_partials, with a tile of -inf logits in one row and a row of -inf tiles, every
    with_sum / with_ent combination, and the target partial as per-tile rows (lse_forward) or one
    row (chunk_stats)."""
    from flce_dist.kernels import launch
    from flce_dist.kernels.lse_forward import merge_partials

    g = torch.Generator().manual_seed(31)
    nt, n = 13, 37
    pmax = torch.randn(nt, n, generator=g) * 3
    psum = torch.rand(nt, n, generator=g) * 10 + 1
    pent = torch.rand(nt, n, generator=g)
    psumy = torch.randn(nt, n, generator=g)
    for col, rows in ((3, [1]), (5, list(range(nt)))):  # -inf tiles: psum = pent = 0 there (lse_forward's rule)
        pmax[rows, col] = float("-inf")
        psum[rows, col] = pent[rows, col] = 0.0
    ptgt = torch.randn(nt if tgt_rows == "tiles" else 1, n, generator=g)
    s = settings.Settings(blocks={"merge": {"block_n": 8, "block_t": 4}})
    for with_sum in (False, True):
        for with_ent in (False, True):
            args = (pmax, psum, ptgt, psumy if with_sum else psumy[:1], pent if with_ent else pent[:1], with_sum,
                    with_ent)
            got, want = launch.merge(*args, s), merge_partials(*args)
            assert got.shape == want.shape == (n, 5 if with_ent else 4)
            assert torch.equal(got.isfinite(), want.isfinite())  # the -inf row stays -inf (and its entropy NaN)
            fin = want.isfinite()
            assert (got[fin] - want[fin]).abs().max() < 1e-5
            assert got[5, 0] == float("-inf") and got[5, 3] == float("-inf")
            if with_sum:  # the column is really summed (not the zeros without with_sum)
                assert (got[:, 2] - psumy.sum(0)).abs().max() < 1e-5


@pytest.mark.parametrize("backend", ["helion", "cublas"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_minus_inf_bias_on_whole_tiles(small_tiles, request, backend, strategy):
    """A -inf bias on padded vocab rows (here the last 64 of 160: two whole 32-wide tiles and a whole
    64-wide split) leaves the loss, the gradients and the entropy finite and exact (before: NaN from
    exp(-inf - -inf) in the tiles' and splits' partials)."""
    n, h, v, pad = 37, 70, 160, 64
    hidden, weight, _, target = make_inputs(_seed(request), n, h, v, torch.float32)
    target = target.where(target < v - pad, target % (v - pad)).where(target != -100, target)
    b = torch.zeros(v)
    b[-pad:] = float("-inf")
    with settings.override(logits_backend=backend):
        x = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = fused_linear_cross_entropy(x, w, target, bias=b, strategy=strategy)
        loss.backward()
        lp, ent = flce_dist.logprobs_and_entropy(hidden, weight, target, bias=b)
    xr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = reference_loss(xr, wr, target, bias=b.double())
    ref.backward()
    assert_close("loss", loss, ref, 1e-5)
    assert_close("d_hidden", x.grad, xr.grad, 1e-4)
    assert_close("d_weight", w.grad, wr.grad, 1e-4)
    logp = torch.log_softmax(hidden.double() @ weight.double().T + b.double(), 1)
    ok = target != -100
    assert_close("logp", lp[ok], logp[ok].gather(1, target[ok][:, None])[:, 0], 1e-5)
    want_ent = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(1)
    assert_close("entropy", ent[ok], want_ent[ok], 1e-5)


def test_entry_variant_falls_back_through_its_prefixes(tmp_path, monkeypatch):
    """The gather order's storing pass (``lse_forward`` with ``z_out`` and ``w_perm``) looks up its own
    entry ``lse_forward_store_gather``, then ``lse_forward_store``, then ``lse_forward``'s: a config file
    without the gather entry keeps the storing pass's blocks, one with it takes its own."""
    import json

    from flce_dist.kernels import launch

    s = settings.Settings(config_dir=str(tmp_path))
    store = {"block": {"block_n": 16, "block_v": 32, "block_h": 16}, "config": {}}
    own = {"block": {"block_n": 32, "block_v": 16, "block_h": 32}, "config": {}}
    (tmp_path / "cpu.json").write_text(json.dumps({"lse_forward_store": {"fp32": store}}))
    launch.load_configs.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert launch.entry("lse_forward", cpu, torch.float32, "store_gather", 48, s)["block"] == store["block"]
        assert launch.entry("lse_forward", cpu, torch.float32, "", 48, s)["block"] != store["block"]
        (tmp_path / "cpu.json").write_text(json.dumps({"lse_forward_store": {"fp32": store},
                                                        "lse_forward_store_gather": {"fp32": own}}))
        launch.load_configs.cache_clear()
        assert launch.entry("lse_forward", cpu, torch.float32, "store_gather", 48, s)["block"] == own["block"]
        assert launch.entry("lse_forward", cpu, torch.float32, "store", 48, s)["block"] == store["block"]
        seen = []
        real = launch._launch
        monkeypatch.setattr(launch, "_launch", lambda name, args, *a, **k: seen.append((name, a[3] if len(a) > 3 else k.get("variant", "")))
                            or real(name, args, *a, **k))
        g = torch.Generator().manual_seed(5)
        x, w = torch.randn(20, 48, generator=g), torch.randn(40, 48, generator=g)
        tl = torch.randint(0, 40, (20,), generator=g).to(torch.int32)
        perm = torch.randperm(40, generator=g).to(torch.int32)
        z = torch.empty(20, 40)
        st = launch.lse_forward(x, w, None, tl, 1.0, 0.0, False, s, z_out=z, w_perm=perm)
        assert ("lse_forward", "store_gather") in seen
        torch.testing.assert_close(z, x @ w[perm.long()].T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(st[:, 0], torch.logsumexp(x @ w.T, 1), rtol=1e-5, atol=1e-5)
    finally:
        launch.load_configs.cache_clear()
