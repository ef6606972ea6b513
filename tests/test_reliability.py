"""Reliability: empty batches, extreme logits, NaN/inf propagation, check_finite, property tests."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flce_dist
from flce_dist import reference_loss
from flce_dist import settings as flce_settings
from flce_dist.kernels import launch

from .conftest import SMALL_BLOCKS, rel


@pytest.mark.parametrize("strategy", ["fused", "recompute"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(strategy, reduction):
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.randn(11, 16, requires_grad=True)
    t = torch.zeros(0, dtype=torch.int64)
    loss = flce_dist.fused_linear_cross_entropy(x, w, t, reduction=reduction, strategy=strategy)
    if reduction == "none":
        assert loss.shape == (0,)
        loss.sum().backward()
    else:
        assert loss.item() == 0.0
        loss.backward()
    assert x.grad.shape == (0, 16) and w.grad.shape == (11, 16)
    assert w.grad.abs().sum().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strategy", ["fused", "recompute"])
def test_extreme_logits_stay_finite(small_tiles, dtype, strategy):
    """Logits up to ~1e4 in 16-bit inputs: online max keeps exp() in range; matches float64."""
    g = torch.Generator().manual_seed(5)
    n, h, v = 29, 40, 300
    x = (torch.randn(n, h, generator=g) * 16).to(dtype)
    w = (torch.randn(v, h, generator=g) * 16).to(dtype)  # |z| up to ~1e4
    t = torch.randint(0, v, (n,), generator=g)
    z = x.double() @ w.double().T
    assert z.abs().max() > 5e3
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = flce_dist.fused_linear_cross_entropy(xs, ws, t, strategy=strategy)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(xs.grad).all() and torch.isfinite(ws.grad).all()
    ref = reference_loss(x.double(), w.double(), t)
    assert rel(loss, ref) < 1e-2


@pytest.mark.parametrize("where", ["hidden", "weight"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("strategy", ["fused", "recompute"])
def test_non_finite_inputs_propagate(small_tiles, where, bad, strategy):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(13, 24, generator=g)
    w = torch.randn(50, 24, generator=g)
    t = torch.randint(0, 50, (13,), generator=g)
    (x if where == "hidden" else w)[3, 5] = bad
    loss = flce_dist.fused_linear_cross_entropy(x, w, t, strategy=strategy)
    assert not torch.isfinite(loss), "a non-finite input must not give a finite loss"
    with pytest.raises(FloatingPointError, match="not finite"):
        flce_dist.fused_linear_cross_entropy(x, w, t, strategy=strategy, check_finite=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("how", ["recompute", "auto", "entropy", "logprobs", "weighted"])
def test_non_finite_grad_output_at_ignored_tokens_gives_no_gradient(small_tiles, bad, how):
    """Issue 61, finding 4: ``reduction="none"`` with a NaN or inf ``grad_output`` at an ignored token (a masked
    PPO ratio, ``0 * inf``): ignored tokens get no gradient (docs/api.md), as in torch, so dW and every other dX
    row are those of the same grad_output with 0 there (before: all of dW and that dX row were NaN)."""
    g = torch.Generator().manual_seed(61)
    n, h, v = 19, 24, 70
    x0, w0, b0 = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.3, torch.randn(v, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    t[[2, 11]] = -100
    lw = torch.rand(n, generator=g) + 0.5
    go = torch.randn(n, generator=g)

    def grads(go):
        x, w, b = (u.clone().requires_grad_() for u in (x0, w0, b0))
        if how == "logprobs":
            logp, ent = flce_dist.logprobs_and_entropy(x, w, t, bias=b)
            outs, gos = (logp, ent), (go, torch.where(t == -100, bad, 0.5))
        else:
            kw = dict(strategy="recompute") if how == "recompute" else {}
            if how == "weighted":  # the fused 3-matmul path of per-token losses with weights
                kw = dict(loss_weights=lw)
                go = torch.where(t == -100, go, lw * 0.25)
            out = flce_dist.fused_linear_cross_entropy(x, w, t, bias=b, reduction="none",
                                                       return_entropy=how == "entropy", **kw)
            outs, gos = (out if isinstance(out, tuple) else (out,)), (go, torch.zeros(n))
        torch.autograd.backward(outs[:len(gos)], gos[:len(outs)])
        return x.grad, w.grad, b.grad

    masked = go.clone()
    masked[t == -100] = bad
    gx, gw, gb = grads(masked)
    ok = go.clone()
    ok[t == -100] = 0.0
    rx, rw, rb = grads(ok)
    valid = t != -100
    assert torch.isfinite(gw).all() and torch.isfinite(gb).all() and torch.isfinite(gx[valid]).all()
    assert rel(gw, rw) < 1e-6 and rel(gb, rb) < 1e-6 and rel(gx[valid], rx[valid]) < 1e-6
    assert float(gx[~valid].abs().sum()) == 0.0


def test_check_finite_passes_finite_loss(small_tiles):
    x, w = torch.randn(7, 16), torch.randn(9, 16)
    t = torch.randint(0, 9, (7,))
    assert torch.isfinite(flce_dist.fused_linear_cross_entropy(x, w, t, check_finite=True))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 40), h=st.integers(1, 48), v=st.integers(1, 120),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    ignore_frac=st.sampled_from([0.0, 0.3, 1.0]),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    strategy=st.sampled_from(["fused", "recompute"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_matches_reference(n, h, v, dtype, ignore_frac, reduction, strategy, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) / max(1, h) ** 0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -100
    go = torch.randn(n, generator=g) if reduction == "none" else None
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    with flce_settings.override(blocks=SMALL_BLOCKS, chunk_bytes=8 * max(v, n) * 4):
        loss = flce_dist.fused_linear_cross_entropy(xs, ws, t, reduction=reduction, strategy=strategy)
        loss.backward(go)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = reference_loss(xr, wr, t, reduction=reduction)
    ref.backward(None if go is None else go.double())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in ((loss, ref), (xs.grad, xr.grad), (ws.grad, wr.grad)):
        assert torch.isfinite(a).all()
        if b.abs().max() > 0:
            assert rel(a, b) < tol
        else:
            assert a.abs().max() == 0


def test_chunk_plan_on_cuda_depends_only_on_shapes():
    """The CUDA chunk budget (no GPU needed: it reads only the device type): 1 GiB - 64 MiB of
    headroom beyond the returned gradients, 1/P of it per rank, less the caller's reserved buffers;
    rows a multiple of 128, chunks balanced."""
    from flce_dist.chunking import EXTRA_BYTES, HEADROOM_BYTES
    from flce_dist.chunking import chunk_rows as plan

    def chunk_rows(*args, **kw):  # the call's settings: the current ones, as the loss passes them
        return plan(*args[:4], flce_settings.current(), *args[4:], **kw)

    cuda = torch.device("cuda")
    budget = EXTRA_BYTES - HEADROOM_BYTES
    # bf16 llama3: 3840 rows fit -> 3 chunks of 8192 -> balanced 2731, rounded up to 2816
    assert budget // (128256 * 2) // 128 * 128 == 3840
    assert chunk_rows(8192, 128256, 2, cuda) == 2816
    # TP=2: the same plan (half the row width, half the budget)
    assert chunk_rows(8192, 64128, 2, cuda, share=2) == 2816
    # gemma: 1792 rows fit -> 5 chunks -> 1639 -> 1664
    assert chunk_rows(8192, 262208, 2, cuda) == 1664
    # fp32 llama3 at N=4096: 1920 fit -> 3 chunks of 1366 -> 1408
    assert chunk_rows(4096, 128256, 4, cuda) == 1408
    # the recompute strategy's vocab chunks: the fp32 dX accumulator is charged to the budget
    assert chunk_rows(128256, 8192, 2, cuda, reserved_bytes=8192 * 4096 * 4) == 42752
    # the fused row-scale form's [rows, H] float32 + bf16 buffers: nothing changes at TP=1 / 2, fewer
    # rows at TP=8 (120 MiB per rank: 2048 rows of 16032 bf16 + 24 KiB), and an explicit chunk_bytes
    # stays the logits chunk's own
    extra = 4096 * 6
    assert chunk_rows(8192, 128256, 2, cuda, row_extra_bytes=extra) == 2816
    assert chunk_rows(8192, 64128, 2, cuda, share=2, row_extra_bytes=extra) == 2816
    assert chunk_rows(8192, 16032, 2, cuda, share=8) == 2816
    assert chunk_rows(8192, 16032, 2, cuda, share=8, row_extra_bytes=extra) == 2048
    with flce_settings.override(chunk_bytes=100 * 16032 * 2):
        assert chunk_rows(8192, 16032, 2, cuda, share=8, row_extra_bytes=extra) == 100
    # everything fits: one chunk; a tiny budget: at least 64 MiB
    assert chunk_rows(1000, 128256, 2, cuda) == 1000
    assert chunk_rows(8192, 128256, 2, cuda, reserved_bytes=10 << 30) == (64 << 20) // (128256 * 2) // 128 * 128
    for total in (1, 127, 300, 1000, 4097, 8192, 10000):
        for budget_mb in (1, 3, 64):
            fit = (budget_mb << 20) // 2000  # rows of 1000 bf16 elements in the budget
            fit = fit // 128 * 128 if fit >= 256 else fit
            with flce_settings.override(chunk_bytes=budget_mb << 20):
                rows = chunk_rows(total, 1000, 2, cuda)
            assert 1 <= rows <= min(total, fit), (total, budget_mb, rows)
            assert -(-total // rows) == -(-total // min(total, fit)), (total, budget_mb, rows)  # no extra chunk


def test_config_variant_entry_falls_back(tmp_path, monkeypatch):
    """``lse_forward_store`` entries (the fused strategy's variant) win where present; otherwise the
    kernel's own entry, then the built-in default; a ``<dtype>@h<H>`` shape class first in each."""
    import json

    from flce_dist.kernels.launch import CPU_DEFAULTS as _CPU_DEFAULTS
    from flce_dist.kernels.launch import entry

    (tmp_path / "cpu.json").write_text(json.dumps({
        "lse_forward": {"fp32": {"block": {"block_n": 64}}, "fp32@h2304": {"block": {"block_n": 8}},
                        "fp16@h2304": {"block": {"block_n": 8}}},
        "lse_forward_store": {"fp32": {"block": {"block_n": 32}}, "fp16": {"block": {"block_v": 512}},
                              "fp32@h2304": {"block": {"block_n": 16}}},
    }))
    monkeypatch.setattr(launch, "DEFAULT_CONFIG_DIR", tmp_path)
    launch.load_configs.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert entry("lse_forward", cpu, torch.float32)["block"]["block_n"] == 64
        assert entry("lse_forward", cpu, torch.float32, "store")["block"]["block_n"] == 32
        assert entry("lse_forward", cpu, torch.float16, "store")["block"]["block_v"] == 512
        assert entry("lse_forward", cpu, torch.float16)["block"] == _CPU_DEFAULTS["lse_forward"]["block"]
        # a shape-class entry for one hidden size wins over the dtype's own, for that size only
        assert entry("lse_forward", cpu, torch.float32, "store", h=2304)["block"]["block_n"] == 16
        assert entry("lse_forward", cpu, torch.float32, "store", h=4096)["block"]["block_n"] == 32
        assert entry("lse_forward", cpu, torch.float32, h=2304)["block"]["block_n"] == 8
        # the variant's dtype entry still comes before the kernel's own shape class
        assert entry("lse_forward", cpu, torch.float16, "store", h=2304)["block"]["block_v"] == 512
    finally:
        launch.load_configs.cache_clear()


def test_tune_specs_launch_the_kernels_as_the_loss_does():
    """``python -m flce_dist.tune`` (GPU only) binds each kernel with ``tune.specs``' argument tuples:
    every spec must launch (reference mode here, one candidate's block sizes shrunk to force tiles),
    so a kernel signature change cannot silently make every tuning candidate fail."""
    from flce_dist import tune

    g = torch.Generator().manual_seed(3)
    n, h, v, rows = 40, 48, 100, 24
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.2
    t = torch.randint(0, v, (n,), generator=g).to(torch.int32)
    z = x[:rows] @ w.T
    lse = torch.logsumexp(z, 1)
    for name, kern, args, cands, kind, _ in tune.specs(x, w, t, z, torch.empty(rows, v), lse, torch.rand(rows, generator=g),
                                                      1.0, 1.0, 1.0):
        assert cands, name
        small = {k: 16 if k != "block_n" else 8 for k in launch.BLOCK_ORDER[kind]}
        if kind == "lse_forward":
            small["block_n"] = 16  # hl.dot tiles are at least 16
        kern(*args, *(small[k] for k in launch.BLOCK_ORDER[kind]))


def test_tune_run_keeps_each_candidates_config(monkeypatch):
    """``tune._run`` for two candidates with the same block sizes (one Helion BoundKernel): each returned call runs
    its own compiled config, also after the other was made (a ``set_config`` on the shared bound kernel, as before
    run 31, would run the last candidate's config under both names in ``--rounds``). Fake kernel: compiling needs CUDA."""
    from flce_dist import tune

    ran = []

    class Bound:
        def compile_config(self, cfg):
            return lambda *a: ran.append((cfg.num_warps, a[-1]))

    class Kernel:
        bound = Bound()

        def bind(self, full):
            return self.bound

    cands = [{"block": {"block": 64}, "config": {"num_warps": w, "num_stages": 1}} for w in (4, 8)]
    calls = [tune._run(Kernel(), ("x",), c, ("block",)) for c in cands]
    calls[0]()
    calls[1]()
    calls[0]()
    assert ran == [(4, 64), (8, 64), (4, 64)]


def test_tune_settle_needs_a_win_in_every_round():
    """``tune --rounds``: a candidate replaces the shipped entry only if it is faster in every interleaved round
    (a drift common to a round cancels in the per-round ratio); a candidate that wins on the median but loses one
    round does not, nor does the reference matmul, however fast."""
    from flce_dist import tune

    def run(times):
        calls = {k: 0 for k in times}

        def timer(fn):
            k = fn.label
            i = calls[k]
            calls[k] += 1
            return times[k][i] * 1.1 ** i  # every round 10% slower than the last: cancels per round

        fns = {}
        for k in times:
            f = (lambda: None)
            f.label = k
            fns[k] = f
        return tune.settle(fns, "c0", 3, timer)

    win, stats = run({"matmul": [1.0] * 3, "c0": [2.0] * 3, "c1": [1.9, 1.9, 1.9], "c2": [1.8, 1.8, 1.8]})
    assert win == "c2" and stats["c2"][1] == pytest.approx(0.9) and stats["c0"][1:3] == (1.0, 1.0)
    assert stats["c2"][3] == pytest.approx(1.8) and "matmul" not in stats
    win, stats = run({"matmul": [0.5] * 3, "c0": [2.0] * 3, "c1": [1.5, 1.5, 2.1]})  # median win, one lost round
    assert win == "c0" and stats["c1"][1] == pytest.approx(0.75) and stats["c1"][2] > 1.0


@pytest.mark.parametrize("strategy", ["fused", "recompute"])
def test_double_backward_is_refused(strategy):
    """create_graph=True (a gradient penalty) would get gradients without a graph: refuse it clearly."""
    import flce_dist

    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, 16, generator=g, requires_grad=True)
    w = torch.randn(21, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 21, (9,), generator=g)
    loss = flce_dist.fused_linear_cross_entropy(x, w, t, strategy=strategy)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, x, create_graph=True)
    # a plain backward still works afterwards on a fresh call
    flce_dist.fused_linear_cross_entropy(x, w, t, strategy=strategy).backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kwargs, err, words", [
    (dict(z_loss=float("nan")), ValueError, "z_loss"),
    (dict(z_loss=float("inf")), ValueError, "z_loss"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(label_smoothing=float("nan")), ValueError, "label_smoothing"),
    (dict(num_items_in_batch=-3), ValueError, "num_items_in_batch"),
    (dict(num_items_in_batch=torch.tensor([4, 5])), ValueError, "num_items_in_batch"),
    (dict(num_items_in_batch=float("inf")), ValueError, "num_items_in_batch"),
    (dict(ignore_index=2**70), ValueError, "ignore_index"),
    (dict(ignore_index=True), TypeError, "ignore_index"),
    (dict(deterministic="yes"), TypeError, "deterministic"),
    (dict(vocab_size=0), ValueError, "vocab_size"),
    (dict(vocab_size=22), ValueError, "vocab_size"),
    (dict(settings="fast"), TypeError, "settings"),
])
def test_bad_option_values_name_the_argument(kwargs, err, words):
    import flce_dist

    x, w, t = torch.randn(5, 8), torch.randn(21, 8), torch.randint(0, 21, (5,))
    with pytest.raises(err, match=words):
        flce_dist.fused_linear_cross_entropy(x, w, t, **kwargs)
    if "settings" not in kwargs and "vocab_size" not in kwargs:  # the module checks at construction
        with pytest.raises(err, match=words):
            flce_dist.FusedLinearCrossEntropyLoss(**kwargs)


def test_zero_hidden_size_is_refused():
    import flce_dist

    x = torch.randn(4, 0, requires_grad=True)
    w = torch.randn(0, 0, requires_grad=True)
    with pytest.raises(ValueError, match="H=0"):
        flce_dist.fused_linear_cross_entropy(x, torch.randn(7, 0), torch.randint(0, 7, (4,)))
    with pytest.raises(ValueError, match="H=0"):
        flce_dist.fused_linear_cross_entropy(x, w, torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("strategy", ["fused", "recompute"])
def test_misaligned_views_are_copied(small_tiles, strategy, monkeypatch):
    """Issue 61, finding 5, on the CPU: ``flce_dist/aligned.py`` copies an input whose base pointer is not 16-byte
    aligned (a view at an odd offset into a flat buffer) where the kernels may build tensor descriptors (CUDA; here
    the CPU stands in): the kernels see aligned tensors only, the results equal the aligned call's, and the
    gradients reach the views. (On the GPU, where such a view killed the CUDA context: tests/test_gpu.py,
    ``test_misaligned_inputs_are_copied_not_a_cuda_error``.)"""
    from flce_dist import aligned
    from flce_dist.kernels import launch

    monkeypatch.setattr(aligned, "DEVICE_TYPES", ("cuda", "cpu"))
    seen = []
    real = launch._launch

    def spy(name, args, *a, **k):
        seen.extend(u.data_ptr() % 16 for u in args if isinstance(u, torch.Tensor) and u.numel())
        return real(name, args, *a, **k)

    monkeypatch.setattr(launch, "_launch", spy)
    g = torch.Generator().manual_seed(5)
    n, h, v = 21, 24, 53
    x, w, b = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.3, torch.randn(v, generator=g)
    t = torch.randint(0, v, (n,), generator=g)

    def odd(u):
        flat = torch.zeros(u.numel() + 8, dtype=u.dtype)
        view = flat[1:1 + u.numel()].view(u.shape)
        view.copy_(u)
        assert view.data_ptr() % 16
        return view

    def run(xx, ww, bb, tt):
        xs, ws, bs = xx.detach().requires_grad_(), ww.detach().requires_grad_(), bb.detach().requires_grad_()
        loss = flce_dist.fused_linear_cross_entropy(xs, ws, tt, bias=bs, strategy=strategy)
        loss.backward()
        return loss.detach(), xs.grad, ws.grad, bs.grad

    want = run(x, w, b, t)
    seen.clear()
    got = run(odd(x), odd(w), odd(b), odd(t))
    assert seen and not any(seen), "a kernel saw a misaligned tensor"
    for a, c in zip(want, got):
        assert torch.equal(a, c)
    assert aligned.aligned(x) is x  # an aligned contiguous input: no copy
