"""Loss features beyond plain CE (issue: token accuracy, torch.compile); the option math itself
(label smoothing, z-loss, softcap, temperature, num_items_in_batch, return_lse) is covered in
test_single_rank.py and, across ranks, in dist_checks.py."""

import pytest
import torch

import flce_dist
from flce_dist import reference_loss
from flce_dist.reference import reference_logits

from .conftest import rel


def _inputs(seed, n=37, h=70, v=101, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * 0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    return x, w, t


@pytest.mark.parametrize("strategy", ["fused", "recompute"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_token_accuracy_matches_argmax(small_tiles, strategy, softcap):
    x, w, t = _inputs(11)
    z = reference_logits(x.double(), w.double(), softcap=softcap)
    # make about half of the targets the argmax so both outcomes occur
    t[::2] = z.argmax(1)[::2]
    t[3] = -100
    x.requires_grad_()
    loss, lse, correct = flce_dist.fused_linear_cross_entropy(
        x, w, t, softcap=softcap, return_lse=True, return_token_accuracy=True, strategy=strategy)
    want = (z.argmax(1) == t) & (t != -100)
    assert correct.dtype == torch.bool and correct.shape == t.shape
    assert torch.equal(correct, want)
    assert 0 < int(correct.sum()) < t.numel()
    assert rel(lse, torch.logsumexp(z, 1)) < 1e-6
    loss.backward()  # extra outputs do not disturb the gradient
    assert torch.isfinite(x.grad).all()


def test_token_accuracy_leading_dims_and_order(small_tiles):
    x, w, t = _inputs(12, n=12)
    loss, correct = flce_dist.fused_linear_cross_entropy(x.view(3, 4, -1), w, t.view(3, 4), return_token_accuracy=True)
    assert correct.shape == (3, 4) and loss.dim() == 0


def test_torch_compile_model_calling_the_loss(small_tiles):
    """A compiled model that calls the loss runs and matches eager."""
    x, w, t = _inputs(13)
    lin = torch.nn.Linear(70, 70)

    def step(inp, weight, target):
        h = torch.nn.functional.gelu(lin(inp))
        return flce_dist.fused_linear_cross_entropy(h, weight, target)

    compiled = torch.compile(step, backend="aot_eager")
    wc = w.clone().requires_grad_()
    lc = compiled(x, wc, t)
    lc.backward()
    we = w.clone().requires_grad_()
    le = step(x, we, t)
    le.backward()
    assert rel(lc, le) < 1e-6
    assert rel(wc.grad, we.grad) < 1e-5
    ref = reference_loss(torch.nn.functional.gelu(lin(x)).double(), w.double(), t)
    assert rel(lc, ref) < 1e-5


@pytest.mark.parametrize("reduction,bias", [("mean", True), ("sum", False), ("none", True)])
def test_torch_compile_fullgraph_custom_op(small_tiles, reduction, bias):
    """Under torch.compile the loss is the flce_dist::fused_lce custom op: fullgraph=True (any graph
    break raises), loss, lse, accuracy and every gradient equal eager, both strategies (fused for
    mean/sum, recompute for "none" with a random grad_output)."""
    x, w, t = _inputs(29)
    g = torch.Generator().manual_seed(5)
    b = torch.randn(w.shape[0], generator=g) if bias else None
    go = torch.randn(t.shape, generator=g) if reduction == "none" else torch.tensor(1.7)
    lin = torch.nn.Linear(70, 70)

    def step(inp, weight, bb, target):
        h = torch.nn.functional.gelu(lin(inp))
        return flce_dist.fused_linear_cross_entropy(h, weight, target, bias=bb, reduction=reduction, label_smoothing=0.1,
                                                    return_lse=True, return_token_accuracy=True)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    outs = []
    for fn in (compiled, step):
        ws = w.clone().requires_grad_()
        bs = b.clone().requires_grad_() if bias else None
        xs = x.clone().requires_grad_()
        loss, lse, correct = fn(xs, ws, bs, t)
        loss.backward(go)
        outs.append((loss, lse, correct, xs.grad, ws.grad, bs.grad if bias else None))
    (lc, sc, cc, *gc), (le, se, ce, *ge) = outs
    assert rel(lc, le) < 1e-6 and rel(sc, se) < 1e-6 and torch.equal(cc, ce)
    for a, e in zip(gc, ge):
        assert (a is None and e is None) or rel(a, e) < 1e-5
    ref = reference_loss(torch.nn.functional.gelu(lin(x)).double(), w.double(), t, bias=None if b is None else b.double(),
                         reduction=reduction, label_smoothing=0.1)
    assert rel(lc, ref) < 1e-5


def test_custom_op_registration_opcheck(small_tiles):
    """torch.library.opcheck: schema, fake (meta) implementation and autograd registration agree
    with the real op."""
    from flce_dist import FLCEParams, LossOptions, settings
    from flce_dist.compile_op import fused_lce

    x, w, t = _inputs(11)
    x.requires_grad_()
    w.requires_grad_()
    for reduction, strategy in (("mean", "fused"), ("none", "recompute")):
        params = FLCEParams.encode(0, w.shape[0], LossOptions(reduction=reduction, strategy=strategy), settings.current())
        args = (x, w, None, t, None, params, True, True, "")
        torch.library.opcheck(fused_lce, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_api_signature_is_the_options():
    """Every LossOptions field is a keyword of fused_linear_cross_entropy with the same default, passed
    on in field order, and nothing else is (the options have one source of truth)."""
    import dataclasses
    import inspect

    from flce_dist import LossOptions, fused_linear_cross_entropy
    from flce_dist.api import NON_OPTIONS

    params = inspect.signature(fused_linear_cross_entropy).parameters
    fields = {f.name: f.default for f in dataclasses.fields(LossOptions)}
    assert set(params) == set(fields) | set(NON_OPTIONS)
    assert all(params[k].default == d for k, d in fields.items())
    src = inspect.getsource(fused_linear_cross_entropy)
    call = src[src.index("LossOptions("):src.index(")", src.index("LossOptions("))]
    # (a trailing comma, as ruff format leaves a call split over lines, is not an argument)
    assert [a.strip() for a in call[len("LossOptions("):].split(",") if a.strip()] == list(fields)
