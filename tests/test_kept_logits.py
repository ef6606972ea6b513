"""The recompute strategy with the forward's logits kept for the backward (``core.kept_columns``, issue 53).

A per-token loss (``reduction="none"``) or the RL head (``logprobs_and_entropy``) takes the recompute strategy:
its gradient is known only in the backward. Where all N rows of the shard's logits fit one chunk of the budget
the eager Function's forward stores them (the fused strategy's logits-storing pass) and the backward forms dz
in place: 3 matmuls instead of 4; else it stores the backward's first vocab chunk and the backward recomputes
the rest only. Checked here in float64 against ``reference.py`` at odd shapes, with every
option that reaches the gradient, against the explicit ``strategy="recompute"`` (which never keeps), and for
when the logits are *not* kept (over the budget, the gradient filter, no gradient, the compiled op).
"""

import pytest
import torch

import flce_dist
from flce_dist import FLCEParams, LossOptions, core, reference_loss, settings
from flce_dist.kernels import launch as K
from flce_dist.reference import reference_logprobs_and_entropy

from .conftest import rel


def _inputs(seed, n=37, h=48, v=301, dtype=torch.float64, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=dtype)
    w = torch.randn(v, h, generator=g, dtype=dtype) * 0.3
    b = torch.randn(v, generator=g, dtype=dtype) * 0.1 if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    return x, w, b, t


class _Spy:
    """Counts the recompute backward's logits matmuls (``K.logits``) and the forward's stored passes."""

    def __init__(self, monkeypatch):
        self.logits = self.stored = 0
        logits, lse_forward = K.logits, K.lse_forward

        def spy_logits(*a, **k):
            self.logits += 1
            return logits(*a, **k)

        def spy_lse(*a, **k):
            self.stored += k.get("z_out") is not None
            return lse_forward(*a, **k)

        monkeypatch.setattr(K, "logits", spy_logits)
        monkeypatch.setattr(K, "lse_forward", spy_lse)


OPTIONS = [dict(), dict(temperature=0.7), dict(softcap=4.0, temperature=1.3), dict(label_smoothing=0.1),
           dict(z_loss=1e-3), dict(bias=True)]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_per_token_loss_keeps_logits_and_matches_reference(monkeypatch, opts):
    """reduction="none" with a per-token grad_output: loss, dX, dW (db) within 1e-10 of the float64 reference;
    the kept path issues no logits matmul in the backward; explicit "recompute" does (and agrees)."""
    opts = dict(opts)
    x, w, b, t = _inputs(1, bias=opts.pop("bias", False))
    go = torch.randn(x.shape[0], dtype=x.dtype, generator=torch.Generator().manual_seed(9))
    ref_leaves = [v.clone().requires_grad_() for v in (x, w) + ((b,) if b is not None else ())]
    want = reference_loss(ref_leaves[0], ref_leaves[1], t, bias=ref_leaves[2] if b is not None else None,
                          reduction="none", **opts)
    (want * go).sum().backward()
    for strategy, stored, logits in (("auto", 1, 0), ("recompute", 0, 1)):
        spy = _Spy(monkeypatch)
        leaves = [v.clone().requires_grad_() for v in (x, w) + ((b,) if b is not None else ())]
        loss = flce_dist.fused_linear_cross_entropy(leaves[0], leaves[1], t, bias=leaves[2] if b is not None else None,
                                                    reduction="none", strategy=strategy, **opts)
        spy.logits = 0  # (the float64 forward takes cuBLAS-style logits itself): the backward's only
        (loss * go).sum().backward()
        assert (spy.stored, spy.logits) == (stored, logits), strategy
        assert rel(loss, want) < 1e-10
        for got, ref in zip(leaves, ref_leaves):
            assert rel(got.grad, ref.grad) < 1e-10, strategy
        monkeypatch.undo()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_and_entropy_keep_logits(monkeypatch, temperature):
    """The RL head: logp and entropy both used (PPO's objective), 3 matmuls, within 1e-10 of the reference."""
    x, w, _, t = _inputs(2, n=53, v=211)
    adv = torch.randn(x.shape[0], dtype=x.dtype, generator=torch.Generator().manual_seed(4))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = reference_logprobs_and_entropy(xr, wr, t, temperature=temperature)
    ((adv * lp).sum() + 0.01 * ent.sum()).backward()
    spy = _Spy(monkeypatch)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    glp, gent = flce_dist.logprobs_and_entropy(xg, wg, t, temperature=temperature)
    spy.logits = 0
    ((adv * glp).sum() + 0.01 * gent.sum()).backward()
    assert (spy.stored, spy.logits) == (1, 0)
    assert rel(glp, lp) < 1e-10 and rel(gent, ent) < 1e-10
    assert rel(xg.grad, xr.grad) < 1e-10 and rel(wg.grad, wr.grad) < 1e-10


def test_second_backward_recomputes(monkeypatch):
    """The kept logits become dz in the first backward; a second one (retain_graph) recomputes them: same grads."""
    x, w, _, t = _inputs(3)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = flce_dist.fused_linear_cross_entropy(xg, wg, t, reduction="none")
    go = torch.linspace(-1, 2, x.shape[0], dtype=x.dtype)
    loss.backward(go, retain_graph=True)
    g1 = xg.grad.clone(), wg.grad.clone()
    xg.grad = wg.grad = None
    spy = _Spy(monkeypatch)
    loss.backward(go)
    assert spy.logits == 1
    assert rel(xg.grad, g1[0]) < 1e-12 and rel(wg.grad, g1[1]) < 1e-12


def test_frozen_weight_and_frozen_hidden(monkeypatch):
    """Only the gradients asked for: a frozen lm_head (LoRA) or a hidden without a gradient, both kept."""
    x, w, _, t = _inputs(5)
    go = torch.randn(x.shape[0], dtype=x.dtype)
    for need_x in (True, False):
        xr, wr = x.clone().requires_grad_(need_x), w.clone().requires_grad_(not need_x)
        (reference_loss(xr, wr, t, reduction="none") * go).sum().backward()
        spy = _Spy(monkeypatch)
        xg, wg = x.clone().requires_grad_(need_x), w.clone().requires_grad_(not need_x)
        loss = flce_dist.fused_linear_cross_entropy(xg, wg, t, reduction="none")
        spy.logits = 0
        (loss * go).sum().backward()
        assert spy.stored == 1 and spy.logits == 0
        got, ref = (xg.grad, xr.grad) if need_x else (wg.grad, wr.grad)
        assert rel(got, ref) < 1e-10 and (wg.grad if need_x else xg.grad) is None
        monkeypatch.undo()


def test_not_kept_where_it_does_not_apply():
    """With an explicit "recompute", the gradient filter, without a gradient, with the fused strategy (a scalar
    loss) or an empty batch nothing is kept; else all V_r columns where all N rows fit one chunk."""
    x, w, _, t = _inputs(6, dtype=torch.float32)
    xg = x.clone().requires_grad_()
    p = lambda **o: FLCEParams(0, w.shape[0], LossOptions(**o), settings.current())  # noqa: E731
    assert core.kept_columns(xg, w, p(reduction="none"), None, True, False) == w.shape[0]
    assert core.kept_columns(xg, w, p(reduction="none", strategy="recompute"), None, True, False) == 0
    assert core.kept_columns(xg, w, p(reduction="none", grad_filter_eps=1e-3), None, True, False) == 0
    assert core.kept_columns(xg, w, p(reduction="none"), None, False, False) == 0
    assert core.kept_columns(xg, w, p(), None, True, True) == 0
    assert core.kept_columns(xg[:0], w, p(reduction="none"), None, True, False) == 0


@pytest.mark.parametrize("opts", OPTIONS + [dict(entropy=True, temperature=0.8), dict(dtype=torch.float32),
                                   dict(dtype=torch.float32, entropy=True)],
                         ids=lambda o: ",".join(str(o[k])[6:] if k == "dtype" else k for k in o) or "plain")
def test_first_chunk_kept_over_the_budget(monkeypatch, opts):
    """Over the budget (all N rows do not fit one chunk) the forward keeps the backward's first vocab chunk (a
    storing pass over W[:cols], a plain one over the rest, merged): the backward recomputes the other chunks only,
    and loss (entropy), dX, dW (db) stay within 1e-10 of the float64 reference (float32: the Helion passes in
    reference mode, 2e-5). Targets fall in both parts."""
    opts = dict(opts)
    entropy, dtype = opts.pop("entropy", False), opts.pop("dtype", torch.float64)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    x, w, b, t = _inputs(8, n=41, v=307, bias=opts.pop("bias", False))
    t[1], t[2] = 0, w.shape[0] - 1  # the first and the last column
    go = torch.randn(x.shape[0], dtype=x.dtype, generator=torch.Generator().manual_seed(3))
    ge = torch.randn(x.shape[0], dtype=x.dtype, generator=torch.Generator().manual_seed(4))
    leaves = lambda: [v.clone().requires_grad_() for v in (x, w) + ((b,) if b is not None else ())]  # noqa: E731

    def run(ls, fn, spy=None):
        if entropy:
            lp, ent = fn(ls[0], ls[1], t, **opts)
            out, total = torch.stack([lp, ent]), (go * lp).sum() + (ge * ent).sum()
        else:
            out = fn(ls[0], ls[1], t, bias=ls[2] if b is not None else None, reduction="none", **opts)
            total = (out * go).sum()
        if spy is not None:
            spy.logits = 0  # (the float64 forward takes cuBLAS-style logits itself): count the backward's
        total.backward()
        return out

    ref = leaves()
    want = run(ref, reference_logprobs_and_entropy if entropy else reference_loss)
    ours = flce_dist.logprobs_and_entropy if entropy else flce_dist.fused_linear_cross_entropy
    x, w, b = (v if v is None else v.to(dtype) for v in (x, w, b))
    row = x.shape[0] * x.element_size()  # one vocab column of the [N, V] logits
    with settings.override(chunk_bytes=row * 100):  # 100 columns a chunk: 307 in 4 balanced chunks of 77
        p = FLCEParams(0, w.shape[0], LossOptions(reduction="none", return_entropy=entropy), settings.current())
        assert core.kept_columns(x, w, p, None, True, False) == 77
        spy = _Spy(monkeypatch)
        got = leaves()
        out = run(got, ours, spy)
        # one storing pass (the kept chunk) and three recomputed chunks in the backward
        assert spy.stored == 1 and spy.logits == 3, (spy.stored, spy.logits)
        monkeypatch.undo()
    assert rel(out, want) < tol
    for g, r in zip(got, ref):
        assert rel(g.grad, r.grad) < tol
