"""Per-token log-probs and entropy with gradients (issue 16), on one rank; across gloo ranks (uneven
vocabulary, sequence parallelism) in dist_checks.py ``entropy_case``.

Every value and gradient is checked against ``flce_dist.reference_logprobs_and_entropy`` (full
logits, float64), through the Helion kernels in reference mode with several tiles per dimension."""

import pytest
import torch

import flce_dist
from flce_dist import logprobs_and_entropy, reference_logprobs_and_entropy, reference_loss

from .conftest import rel


def _inputs(seed, n=37, h=70, v=101, dtype=torch.float32, scale=2.0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h**-0.5 * scale
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100
    a = torch.randn(n, generator=g, dtype=torch.float64)
    cast = (lambda u: None if u is None else u.to(dtype).clone().requires_grad_())
    return cast(x), cast(w), cast(b), t, a


OPTS = [dict(), dict(temperature=0.7), dict(softcap=3.0, temperature=1.3)]


@pytest.mark.parametrize("opts", OPTS, ids=["plain", "temperature", "softcap+temperature"])
@pytest.mark.parametrize("use", ["both", "logp", "entropy"])
def test_float64_gradcheck(small_tiles, opts, use):
    """torch.autograd.gradcheck (float64, odd shapes, bias): entropy alone, log-probs alone, both."""
    x, w, b, t, _ = _inputs(1, n=7, h=5, v=11, dtype=torch.float64, bias=True)

    def fn(xx, ww, bb):
        if use == "logp":  # the per-token loss alone (no entropy requested): -log p(target)
            return -flce_dist.fused_linear_cross_entropy(xx, ww, t, bias=bb, reduction="none", **opts)
        logp, ent = logprobs_and_entropy(xx, ww, t, bias=bb, **opts)
        return ent if use == "entropy" else (logp, ent)

    assert torch.autograd.gradcheck(fn, (x, w, b), atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("opts", OPTS, ids=["plain", "temperature", "softcap+temperature"])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_match_reference(small_tiles, opts, bias):
    """float32 through the kernels: logp, entropy and the gradients of an RL objective
    sum(a * logp) + beta * sum(entropy) vs the float64 reference; ignored tokens give 0."""
    x, w, b, t, a = _inputs(2, bias=bias)
    logp, ent = logprobs_and_entropy(x, w, t, bias=b, **opts)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == t.shape
    ((a.float() * logp).sum() + 0.3 * ent.sum()).backward()
    xr, wr, br = (None if u is None else u.detach().double().requires_grad_() for u in (x, w, b))
    rl, re_ = reference_logprobs_and_entropy(xr, wr, t, bias=br, **opts)
    ((a * rl).sum() + 0.3 * re_.sum()).backward()
    assert rel(logp, rl) < 1e-5 and rel(ent, re_) < 1e-5
    assert float(logp.detach()[t == -100].abs().sum() + ent.detach()[t == -100].abs().sum()) == 0.0
    assert 0 < float(ent.min()) or bool((t == -100).any())
    assert rel(x.grad, xr.grad) < 1e-4 and rel(w.grad, wr.grad) < 1e-4
    if bias:
        assert rel(b.grad, br.grad) < 1e-4


def test_entropy_gradient_is_not_the_loss_gradient(small_tiles):
    """The entropy term really reaches the gradient (a test that cannot pass by ignoring it)."""
    x, w, _, t, a = _inputs(3)
    logp, ent = logprobs_and_entropy(x, w, t)
    gx_both, = torch.autograd.grad((a.float() * logp).sum() + 0.5 * ent.sum(), (x,))
    logp, _ = logprobs_and_entropy(x, w, t)
    gx_logp, = torch.autograd.grad((a.float() * logp).sum(), (x,))
    assert rel(gx_both, gx_logp) > 1e-2


def test_peaked_distribution_entropy_is_accurate(small_tiles):
    """Near-one-hot softmaxes (logits ~150, entropies down to 1e-30 nats): the entropy is formed
    relative to the row maximum, not as lse - sum p y of two numbers ~150 (whose float32 difference
    would be off by ~1e-5), so a tiny entropy stays tiny and close."""
    x, w, _, t, _ = _inputs(4, scale=60.0)
    with torch.no_grad():
        _, ent = logprobs_and_entropy(x, w, t)
    _, re_ = reference_logprobs_and_entropy(x.detach().double(), w.detach().double(), t)
    tiny = (re_ < 1e-6) & (t != -100)
    assert float(re_[t != -100].median()) < 1e-2 and int(tiny.sum()) >= 5  # really peaked
    assert float((ent - re_).abs().max()) < 1e-5
    # the tail's probability mass (log S ~ S - 1 < 1e-7) rounds away in float32: a relative error up
    # to ~1/(1 + (max logit - tail logit)), still 1e-7 absolute; lse - sum p y would be ~1e-5 off
    assert float((ent - re_)[tiny].abs().max()) < 1e-7


def test_return_order_and_mean_reduction_with_entropy(small_tiles):
    """All extra outputs at once come as loss, lse, correct, entropy; a mean loss with the entropy
    (recompute strategy forced) has exact gradients for both terms; an unused entropy changes
    nothing in the loss's gradient."""
    x, w, _, t, _ = _inputs(5)
    loss, lse, correct, ent = flce_dist.fused_linear_cross_entropy(
        x, w, t, return_lse=True, return_token_accuracy=True, return_entropy=True, temperature=0.9, strategy="fused")
    assert loss.dim() == 0 and lse.shape == correct.shape == ent.shape == t.shape and correct.dtype == torch.bool
    (loss + 0.2 * ent.sum()).backward()
    xr, wr = (u.detach().double().requires_grad_() for u in (x, w))
    ref, ref_lse = reference_loss(xr, wr, t, temperature=0.9, return_lse=True)
    _, re_ = reference_logprobs_and_entropy(xr, wr, t, temperature=0.9)
    (ref + 0.2 * re_.sum()).backward()
    assert rel(loss, ref) < 1e-5 and rel(ent, re_) < 1e-5 and rel(lse[t != -100], ref_lse[t != -100]) < 1e-5
    assert rel(x.grad, xr.grad) < 1e-4 and rel(w.grad, wr.grad) < 1e-4
    # entropy returned but unused: the loss's gradient alone
    x.grad = None
    loss, _ = flce_dist.fused_linear_cross_entropy(x, w, t, return_entropy=True, temperature=0.9)
    loss.backward()
    gx = x.grad.clone()
    x.grad = None
    flce_dist.fused_linear_cross_entropy(x, w, t, temperature=0.9).backward()
    assert rel(gx, x.grad) < 1e-6


def test_no_grad_and_leading_dims(small_tiles):
    x, w, _, t, _ = _inputs(6, n=12)
    with torch.no_grad():
        logp, ent = logprobs_and_entropy(x.view(3, 4, -1), w, t.view(3, 4))
    assert logp.shape == ent.shape == (3, 4) and not ent.requires_grad
    rl, re_ = reference_logprobs_and_entropy(x.detach().double(), w.detach().double(), t)
    assert rel(logp.reshape(-1), rl) < 1e-5 and rel(ent.reshape(-1), re_) < 1e-5


def test_module_and_head_helpers(small_tiles):
    """VocabParallelLMHead.logprobs_and_entropy and the loss module's return_entropy (one rank)."""
    torch.manual_seed(0)
    head = flce_dist.VocabParallelLMHead(70, 101, bias=True, dtype=torch.float64, softcap=5.0)
    x, _, _, t, _ = _inputs(7, dtype=torch.float64)
    logp, ent = head.logprobs_and_entropy(x, t, temperature=0.8)
    rl, re_ = reference_logprobs_and_entropy(x, head.weight, t, bias=head.bias, softcap=5.0, temperature=0.8)
    assert rel(logp, rl) < 1e-10 and rel(ent, re_) < 1e-10
    loss_fn = flce_dist.FusedLinearCrossEntropyLoss(reduction="none", return_entropy=True)
    # one transform: the loss's softcap and temperature are the log-probs' (softcap(z) / T)
    nll, ent2 = loss_fn(x, head.weight, t, head.bias, softcap=5.0, temperature=0.8)
    assert rel(-nll, rl) < 1e-10 and rel(ent2, re_) < 1e-10


def test_bad_arguments():
    x, w, _, t, _ = _inputs(8)
    with pytest.raises(TypeError, match="label_smoothing"):
        logprobs_and_entropy(x, w, t, label_smoothing=0.1)
    with pytest.raises(TypeError, match="reduction"):
        logprobs_and_entropy(x, w, t, reduction="mean")
    with pytest.raises(TypeError, match="return_entropy"):
        flce_dist.fused_linear_cross_entropy(x, w, t, return_entropy="yes")


def test_double_backward_is_refused(small_tiles):
    x, w, _, t, _ = _inputs(9)
    _, ent = logprobs_and_entropy(x, w, t)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(ent.sum(), (x,), create_graph=True)


def test_torch_compile_fullgraph(small_tiles):
    """Under torch.compile(fullgraph=True) the entropy rides in the custom op: same values and
    gradients as eager."""
    x, w, b, t, a = _inputs(10, bias=True)

    def step(xx, ww, bb):
        logp, ent = logprobs_and_entropy(torch.tanh(xx), ww, t, bias=bb, temperature=0.7)
        return (a.float() * logp).sum() + 0.1 * ent.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (compiled, step):
        xs, ws, bs = (u.detach().clone().requires_grad_() for u in (x, w, b))
        out = fn(xs, ws, bs)
        out.backward()
        grads.append((out, xs.grad, ws.grad, bs.grad))
    for c, e in zip(*grads):
        assert rel(c, e) < 1e-5


def test_custom_op_opcheck_with_entropy(small_tiles):
    from flce_dist import FLCEParams, LossOptions, settings
    from flce_dist.compile_op import fused_lce

    x, w, _, t, _ = _inputs(11)
    params = FLCEParams.encode(0, w.shape[0], LossOptions(reduction="none", return_entropy=True), settings.current())
    torch.library.opcheck(fused_lce, (x, w, None, t, None, params, True, True, ""),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
