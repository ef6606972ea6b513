"""GPU tests (marker ``gpu``; run on the H200: ``pytest -m gpu tests/test_gpu.py``)."""

import pytest
import torch

import flce_dist
from flce_dist import reference_loss

from .conftest import rel

pytestmark = pytest.mark.gpu
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1e-2)}


def _case(b, t, h, v, dtype, seed=0, ignore_frac=0.1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, t, h, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).to(dtype)
    tg = torch.randint(0, v, (b, t), device="cuda", generator=g)
    tg[torch.rand(b, t, device="cuda", generator=g) < ignore_frac] = -100
    return x, w, tg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 1024, 4096, 32000), (3, 423, 1000, 10000), (1, 1, 64, 1), (1, 77, 100, 50)])
@pytest.mark.parametrize("strategy", ["fused", "recompute"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_matches_float64_reference(dtype, shape, strategy, reduction):
    x, w, t = _case(*shape, dtype)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = flce_dist.fused_linear_cross_entropy(xs, ws, t, reduction=reduction, strategy=strategy)
    go = torch.randn_like(loss) if reduction == "none" else torch.ones_like(loss)
    loss.backward(go)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = reference_loss(xr, wr, t, reduction=reduction)
    ref.backward(go.double())
    for out in (loss, xs.grad, ws.grad):
        assert torch.isfinite(out).all()
    tl, tg = TOL[dtype]
    assert rel(loss, ref) <= tl
    assert rel(xs.grad, xr.grad) <= tg
    assert rel(ws.grad, wr.grad) <= tg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_only_matches(dtype):
    x, w, t = _case(3, 423, 1000, 10000, dtype)
    with torch.no_grad():
        loss = flce_dist.fused_linear_cross_entropy(x, w, t)
    ref = reference_loss(x.double(), w.double(), t)
    assert rel(loss, ref) <= TOL[dtype][0]


def test_peak_memory_is_o_chunk():
    """llama3-sized shard at N=8192: peak extra memory must be far below the [N, V] logits."""
    n, h, v = 8192, 4096, 128256
    x, w, t = _case(1, n, h, v, torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    flce_dist.fused_linear_cross_entropy(x, w, t).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = x.numel() * 2 + w.numel() * 2
    logits = n * v * 2
    assert extra - grads < logits / 2, (extra, grads, logits)
    assert extra < 1.5 * 2**30
