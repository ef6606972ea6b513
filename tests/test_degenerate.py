"""Degenerate inputs (issue #31 item 2): each gives the reference's answer (float64, finite, gradients
included) or a ValueError/TypeError that names the argument; never NaN, a ZeroDivisionError or a
leaked state. Cases: an empty weight without a group, N = 0 and all-ignored batches with each
reduction and ``num_items_in_batch``, V = 1, H = 1, non-contiguous / transposed / expanded views,
int32 targets and targets or ignore_index at 2**31 - 1 and beyond, arguments on another device (the
meta device stands in for a second GPU: the same checks), all-meta calls (shapes only), and one
2-rank group with an empty shard and N = 0."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

import flce_dist
from flce_dist import FusedLinearCrossEntropyLoss, VocabParallelLMHead, fused_linear_cross_entropy as flce
from flce_dist import logprobs_and_entropy, reference_loss
from flce_dist.reference import reference_logprobs_and_entropy

from ._checks import SMALL_BLOCKS, rel, spawn

REDUCTIONS = ("mean", "sum", "none")


def _inputs(n, h, v, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    shape = lead if lead is not None else (n,)
    x = torch.randn(*shape, h, generator=g).double()  # float32 values: the reference sees flce's inputs
    w = (torch.randn(v, h, generator=g) / max(h, 1) ** 0.5).double()
    t = torch.randint(0, max(v, 1), shape, generator=g)
    return x, w, t


def _close(got, ref, tol):
    got, ref = got.detach().double(), ref.detach().double()
    assert got.shape == ref.shape and bool(torch.isfinite(got).all())
    if got.numel() and (got - ref).abs().max() > 1e-7:  # float32's floor for the ~1e-4 z-loss terms of V = 1
        assert rel(got, ref) <= tol, rel(got, ref)


def _check(x, w, t, xview=None, wview=None, **kw):
    """float32 flce against the float64 reference: loss, and the gradients of the leaves ``x``, ``w``
    (float64) with a random grad_output; ``xview`` / ``wview`` map a leaf to the tensor passed (a
    transposed, strided or expanded view, applied to the float32 and the float64 leaf alike)."""
    xview, wview = xview or (lambda a: a), wview or (lambda a: a)
    xs, ws = x.float().requires_grad_(), w.float().requires_grad_()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = flce(xview(xs), wview(ws), t, **kw)
    ref = reference_loss(xview(xr), wview(wr), t, **{k: v for k, v in kw.items() if k != "strategy"})
    _close(out, ref, 1e-5)
    g = torch.rand(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    out.backward(g.float())
    ref.backward(g)
    _close(xs.grad, xr.grad, 1e-4)
    _close(ws.grad, wr.grad, 1e-4)
    return out


@pytest.fixture(autouse=True)
def _small_blocks():
    with flce_dist.settings.override(blocks=SMALL_BLOCKS):
        yield


def test_empty_weight_without_group_names_weight():
    with pytest.raises(ValueError, match="weight has 0 rows"):
        flce(torch.randn(4, 8), torch.zeros(0, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="weight has 0 rows"):  # also with no tokens
        flce(torch.randn(0, 8), torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))


@pytest.mark.parametrize("strategy", ["fused", "recompute"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_no_tokens(reduction, strategy):
    x, w, t = _inputs(0, 40, 70)
    out = _check(x, w, t, reduction=reduction, strategy=strategy)
    assert out.shape == ((0,) if reduction == "none" else ())
    x, w, t = _inputs(0, 40, 70, lead=(2, 0))  # [2, 0, H]
    out = _check(x, w, t, reduction=reduction, strategy=strategy)
    assert out.shape == ((2, 0) if reduction == "none" else ())
    logp, ent = logprobs_and_entropy(x.float(), w.float(), t)
    assert logp.shape == ent.shape == (2, 0)
    assert FusedLinearCrossEntropyLoss(reduction=reduction)(x.float(), w.float(), t).shape == out.shape
    head = VocabParallelLMHead(40, 70)
    assert head(x.float(), t, reduction=reduction).shape == out.shape and head(x.float()).shape == (2, 0, 70)


@pytest.mark.parametrize("num_items", [0, 5, torch.tensor(0), torch.tensor(3.0)])
def test_no_tokens_num_items(num_items):
    x, w, t = _inputs(0, 40, 70)
    assert _check(x, w, t, num_items_in_batch=num_items).item() == 0.0


@pytest.mark.parametrize("strategy", ["fused", "recompute"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored(reduction, strategy):
    x, w, t = _inputs(9, 40, 70)
    out = _check(x, w, torch.full_like(t, -100), reduction=reduction, strategy=strategy)
    assert not out.detach().abs().max() if out.numel() else True


@pytest.mark.parametrize("num_items", [0, 7, torch.tensor(0), torch.tensor(7.0)])
def test_all_ignored_num_items(num_items):
    x, w, t = _inputs(9, 40, 70)
    assert _check(x, w, torch.full_like(t, -100), num_items_in_batch=num_items).item() == 0.0
    logp, ent = logprobs_and_entropy(x.float(), w.float(), torch.full_like(t, -100))
    assert not logp.abs().max() and not ent.abs().max()


def test_num_items_zero_with_valid_tokens_is_the_sum():  # the reference's clamp(min=1): no division by 0
    x, w, t = _inputs(9, 40, 70)
    _check(x, w, t, num_items_in_batch=0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_one_class_and_one_feature(reduction):
    x, w, t = _inputs(9, 40, 1)  # V = 1: loss 0, gradients 0
    _check(x, w, t, reduction=reduction)
    _check(x, w, t, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    logp, ent = logprobs_and_entropy(x.float(), w.float(), t)
    assert not logp.abs().max() and not ent.abs().max()
    x, w, t = _inputs(9, 1, 70)  # H = 1
    _check(x, w, t, reduction=reduction)
    x, w, t = _inputs(9, 1, 1)
    _check(x, w, t, reduction=reduction)


def test_zero_features_names_hidden():
    with pytest.raises(ValueError, match="hidden size H=0"):
        flce(torch.zeros(4, 0), torch.zeros(7, 0), torch.zeros(4, dtype=torch.long))


def test_views():
    x, w, t = _inputs(9, 40, 70)
    tr = lambda a: a.t()  # noqa: E731
    _check(x, w.t().contiguous(), t, wview=tr)  # weight stored [H, V], passed as its [V, H] transpose
    _check(x.t().contiguous(), w, t, xview=tr)  # hidden stored [H, N]
    _check(torch.randn(9, 80).double(), w, t, xview=lambda a: a[:, ::2])  # strided hidden
    _check(x, torch.randn(140, 40).double() / 40**0.5, t, wview=lambda a: a[::2])  # strided rows
    _check(x, torch.randn(70, 80).double() / 40**0.5, t, wview=lambda a: a[:, 1::2])  # strided cols
    _check(torch.randn(1, 40).double(), w, t, xview=lambda a: a.expand(9, 40))  # stride 0
    x3 = torch.randn(3, 9, 40).double()  # passed as [9, 3, H]: non-contiguous leading dims
    t3 = torch.randint(0, 70, (3, 9)).t()  # non-contiguous target
    _check(x3, w, t3, xview=lambda a: a.transpose(0, 1), reduction="none")
    _check(x[0], w, t[0], reduction="none")  # one token without a leading dim: hidden [H], target []


def test_target_dtypes_and_large_ids():
    x, w, t = _inputs(9, 40, 70)
    _check(x, w, t.int())
    _check(x, w, torch.where(t > 30, t, -100).int())
    for big in (2**31 - 1, 2**31, 2**40):  # out of [0, V): named, with its position
        bad = t.clone()
        bad[3] = big
        with pytest.raises(ValueError, match=rf"target\[3\] = {big} is outside \[0, 70\)"):
            flce(x.float(), w.float(), bad)
        if big < 2**31:
            with pytest.raises(ValueError, match=rf"target\[3\] = {big} is outside"):
                flce(x.float(), w.float(), bad.int())
        _check(x, w, bad, ignore_index=big)  # ... unless it is the ignore_index
        if big < 2**31:
            _check(x, w, bad.int(), ignore_index=big)
    _check(x, w, t.int(), ignore_index=2**40)  # an ignore_index that int32 targets cannot hold
    for dt in (torch.int16, torch.uint8, torch.bool, torch.float32):
        with pytest.raises(TypeError, match="target must be int64"):
            flce(x.float(), w.float(), t.to(dt))


def test_arguments_on_another_device():
    """The meta device stands in for a second GPU (the same device checks, on CPU)."""
    x, w, t = (a.float() if a.is_floating_point() else a for a in _inputs(9, 40, 70))
    with pytest.raises(ValueError, match="weight is on meta but hidden is on cpu"):
        flce(x, w.to("meta"), t)
    with pytest.raises(ValueError, match="weight is on cpu but hidden is on meta"):
        flce(x.to("meta"), w, t.to("meta"))
    with pytest.raises(ValueError, match="target is on meta but hidden is on cpu"):
        flce(x, w, t.to("meta"))
    with pytest.raises(TypeError, match="bias must be torch.float32 on cpu"):
        flce(x, w, t, bias=torch.zeros(70, device="meta"))
    with pytest.raises(ValueError, match="num_items_in_batch is a meta tensor"):
        flce(x, w, t, num_items_in_batch=torch.tensor(3.0, device="meta"))
    with pytest.raises(ValueError, match="weight is on cpu but hidden is on meta"):
        FusedLinearCrossEntropyLoss()(x.to("meta"), w, t.to("meta"))


def test_meta_tensors_give_shapes_and_leak_no_state():
    """All inputs on meta: shapes from the custom op's fake kernels. Before: Helion's reference mode
    raised (no torch.meta module) inside its context's __enter__, leaving the default device on meta and
    its context marked active, so every later call in the process failed."""
    x = torch.randn(9, 40, device="meta", requires_grad=True)
    w = torch.randn(70, 40, device="meta", requires_grad=True)
    t = torch.zeros(9, dtype=torch.long, device="meta")
    loss, lse, ent = flce(x, w, t, reduction="none", return_lse=True, return_entropy=True)
    assert loss.shape == lse.shape == ent.shape == (9,) and loss.device.type == "meta"
    flce(x, w, t).backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and w.grad.device.type == "meta"
    head = VocabParallelLMHead(40, 70, device="meta")
    assert head(torch.randn(2, 5, 40, device="meta"), torch.zeros(2, 5, dtype=torch.long, device="meta")).shape == ()
    assert torch.zeros(1).device.type == "cpu"  # the default device is still the CPU ...
    xc, wc, tc = _inputs(9, 40, 70)
    _check(xc, wc, tc)  # ... and the kernels still run


def _group_worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    flce_dist.setup_reference_mode()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    try:
        with flce_dist.settings.override(blocks=SMALL_BLOCKS):
            # V = 1 over 2 ranks: rank 1 holds an empty shard; N = 5 and N = 0; all ignored with num_items
            for n, v, ignored, kw in ((5, 1, False, {}), (0, 1, False, {}), (0, 3, False, {}), (6, 3, True, {}),
                                      (6, 3, True, {"num_items_in_batch": 4}), (0, 3, False, {"num_items_in_batch": 0})):
                x, w, t = _inputs(n, 24, v, seed=n + v)
                if ignored:
                    t = torch.full_like(t, -100)
                s, e = flce_dist.vocab_shard(v, rank, 2)
                for red in (("mean",) if kw else REDUCTIONS):
                    xs, ws = x.float().requires_grad_(), w[s:e].float().requires_grad_()
                    out = flce(xs, ws, t, group=dist.group.WORLD, vocab_size=v, reduction=red, **kw)
                    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
                    ref = reference_loss(xr, wr, t, reduction=red, **kw)
                    _close(out, ref, 1e-5)
                    out.backward(torch.ones_like(out))
                    ref.backward(torch.ones_like(ref))
                    _close(xs.grad, xr.grad, 1e-4)
                    _close(ws.grad, wr.grad[s:e], 1e-4)
                logp, ent = logprobs_and_entropy(x.float(), w[s:e].float(), t, group=dist.group.WORLD, vocab_size=v)
                rlogp, rent = reference_logprobs_and_entropy(x, w, t)
                _close(logp, rlogp, 1e-5)
                _close(ent, rent, 1e-5)
            with pytest.raises(ValueError, match="meta tensors"):
                flce(torch.zeros(2, 8, device="meta"), torch.zeros(1, 8, device="meta"),
                     torch.zeros(2, dtype=torch.long, device="meta"), group=dist.group.WORLD, vocab_size=2)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_group_with_an_empty_shard_and_no_tokens():
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_group_worker, 2, tmp)
