"""Issue 53: the host cost of one fwd+bwd, locked by its GPU-equivalent op counts
(``benchmarks/probes/host_cost.py --counts``), and the bit-identity of the host-level changes behind them: the
per-token work after the first logits pass (before it on the old path), the fused small ops, the caches."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import flce_dist
from flce_dist import settings

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH / "probes"))
sys.path.insert(0, str(BENCH))
host_cost = pytest.importorskip("host_cost")

F = flce_dist.fused_linear_cross_entropy

# (prologue ops, all ops) per fwd+bwd after issue 53's host levers; before them (03f8505): one chunk 12 / 36 (sm_90:
# 12 / 37), two chunks 12 / 51 (sm_90 12 / 53). Lower is fine (then lower these); higher is a regression.
LOCK = {("1chunk", False): (4, 26), ("1chunk", True): (3, 27), ("2chunks", False): (4, 39), ("2chunks", True): (3, 41)}


@pytest.mark.parametrize("shape,sm90", list(LOCK))
def test_op_counts_do_not_regress(shape, sm90):
    """The ops a default bf16 fwd+bwd launches on the GPU (Helion, torch kernels, cuBLAS), before the first
    ``lse_forward`` launch (the prologue: idle GPU time from an idle GPU) and in all, at one token chunk (N=1024:
    llama3 up to N=3581) and two. On sm_90 the logits pass goes first: the prologue has no Helion launch."""
    n, rows = host_cost.COUNT_SHAPES[shape]
    c = host_cost.call_counts(n, rows=rows, sm90=sm90, log=True)
    pro, total = LOCK[(shape, sm90)]
    assert c["pro_ops"] <= pro and c["all_ops"] <= total, {k: v for k, v in c.items() if k != "log"}
    helion = [item for _, item, kind in c["log"] if kind == "Helion"]
    assert "[merge]" in helion  # the trace counts the GPU's merge launch, not reference mode's torch path
    if sm90:
        assert c["pro_H"] == 0 and helion.index("[lse_forward]") < helion.index("[target_rows]")
        assert helion.count("[target_dot]") == helion.count("[lse_forward]")
    else:
        assert helion[:2] == ["[target_rows]", "[lse_forward]"]
    if shape == "1chunk":  # one chunk: its statistics are the call's (no copy), no returned-lse copy
        assert ("fused pass", "copy_", "kernel") not in c["log"] and ("forward core", "clone", "kernel") not in c["log"]


def _data(n=96, h=40, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * 0.3
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    return x, w, t, torch.rand(n, generator=g)


CASES = [dict(), dict(reduction="sum"), dict(temperature=0.7, z_loss=1e-3), dict(num_items_in_batch=50),
         dict(loss_weights=True), dict(loss_weights=True, reduction="none"), dict(label_smoothing=0.1),
         dict(return_lse=True, return_token_accuracy=True), dict(chunk=48), dict(frozen="w"), dict(frozen="x")]


def _run(kw, dtype, old_order, device="cpu"):
    """Outputs and gradients of one call; ``old_order``: the per-token work (targets, weights) formed before the
    fused pass, as before issue 53."""
    from flce_dist import core

    kw = dict(kw)
    x0, w0, t, lw = (a.to(device) for a in _data())
    frozen, chunk = kw.pop("frozen", ""), kw.pop("chunk", None)
    x, w = x0.to(dtype).requires_grad_(frozen != "x"), w0.to(dtype).requires_grad_(frozen != "w")
    if kw.pop("loss_weights", False):
        kw["loss_weights"] = lw
    real = core.fused_forward_backward

    def upfront(*a, tokens=None, **k):
        tokens.weights()
        return real(*a, tokens=tokens, **k)

    # CPU: several vocabulary tiles (the merge kernel, as on the GPU, where the shipped blocks give several)
    over = dict(blocks={"lse_forward": {"block_v": 128, "block_n": 64}}) if device == "cpu" else {}
    if chunk:
        over["chunk_bytes"] = chunk * w.shape[0] * x.element_size()
    core.fused_forward_backward = upfront if old_order else real
    try:
        with settings.override(**over):
            out = F(x, w, t, **kw)
    finally:
        core.fused_forward_backward = real
    out = out if isinstance(out, tuple) else (out,)
    out[0].float().sum().backward()
    return [o.detach() for o in out] + [x.grad, w.grad]


def _same_bits(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert (u is None) == (v is None)
        if u is not None:
            assert u.dtype == v.dtype and u.shape == v.shape
            nan = u.isnan() if u.is_floating_point() else torch.zeros_like(u, dtype=torch.bool)
            assert torch.equal(nan, v.isnan() if v.is_floating_point() else nan) and torch.equal(u[~nan], v[~nan])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("sm90", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_work_after_the_pass_is_bit_identical(sm90, dtype, device, monkeypatch):
    """The targets (sm_90: after the first logits pass, which does not read them), token weights, the mean's
    denominator and the row weights formed after the pass give the same bits as formed before it, for every
    reduction, weights, num_items, z-loss and temperature, two chunks and frozen inputs. ``sm90``: the pass
    leaves its target logits to ``target_dot`` (on the CPU emulated; on the GPU forced off where False)."""
    from flce_dist.kernels import launch

    monkeypatch.setattr(launch, "split_targets", lambda d: sm90)
    for kw in CASES:
        _same_bits(_run(kw, dtype, old_order=False, device=device), _run(kw, dtype, old_order=True, device=device))


def test_small_op_forms_are_bit_identical():
    """Each torch-level fusion of issue 53 against the ops it replaced: the mean's denominator (a float sum of the
    mask, exact below 2**24), the mean's row weights (bool / denominator), the row-scale reference (row max before
    the float32 cast and the scale), the gate's c = 1 (masked_fill_) and the backward's one cast pair."""
    from flce_dist import core, rowscale
    from flce_dist.formulas import mean_denominator
    from flce_dist.kernels import launch
    from flce_dist.options import FLCEParams, LossOptions

    g = torch.Generator().manual_seed(1)
    for n in (0, 1, 7, 1000, 4099):
        masks = (torch.rand(n, generator=g) < 0.6, torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool))
        for valid in masks:
            for dtype in (torch.float32, torch.float64):
                old = torch.as_tensor(valid.sum()).to(dtype).clamp(min=1)
                new = mean_denominator(valid, None, dtype)
                assert new.dtype == dtype and torch.equal(new, old)
                p = FLCEParams(0, 10, LossOptions(), settings.current())
                for denom in (old, torch.tensor(3.0, dtype=dtype), torch.tensor(7.0, dtype=dtype)):
                    tokens = core._Tokens.of_valid(valid, None, p, None, dtype)
                    tokens.denom = denom  # (formed before: the fused pass's)
                    got = tokens.row_weights()
                    assert got.dtype == dtype and torch.equal(got, valid.to(dtype) / denom)
    x = torch.randn(33, 24, generator=g) * 4
    w = torch.randn(700, 24, generator=g)
    x[3] = float("nan")
    x[4, 0] = float("inf")
    x[5] = 0.0
    w[::3][7] = -0.0  # a sampled row of zeros: -0.0 / 0.0 logits
    for dtype in (torch.bfloat16, torch.float32):
        xd, wd = x.to(dtype), w.to(dtype)
        step = max(1, -(-wd.shape[0] // rowscale.SAMPLE))
        for scale in (1.0, 0.8, 1 / 0.7, 3.0):
            old = (torch.mm(xd, wd[::step].T).to(torch.float32) * scale).amax(1)
            new = rowscale.reference(xd, wd, scale)
            assert new.dtype == torch.float32 and torch.equal(new.isnan(), old.isnan())
            assert torch.equal(new[~new.isnan()], old[~old.isnan()])
    c = torch.rand(9, generator=g)
    for gate in (torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)):
        assert torch.equal(c.clone().masked_fill_(gate != 0, 1.0), torch.where(gate != 0, torch.ones_like(c), c))
    s = settings.current()
    for go in (torch.tensor(0.3719), torch.tensor(1.0), torch.tensor(-2.5e-3)):
        dx, dw = torch.randn(70, 30, generator=g).bfloat16(), torch.randn(50, 30, generator=g).bfloat16()
        want = [launch.scale_(t.clone(), go, s) for t in (dx, dw)]  # one cast pair each
        got = core.scale_precomputed(dx.clone(), dw.clone(), None, go, torch.bfloat16, settings=s)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_call_caches_follow_their_inputs(monkeypatch):
    """The API's options / params caches and the chunk plan's: one object per distinct call signature (0.0 and
    -0.0, 1 and True apart), a bad value raises every time, a memoized option read does not change what a
    params object equals, and the plan follows the budget's module constants and the settings."""
    from flce_dist import api, chunking, core
    from flce_dist.options import FLCEParams, LossOptions

    def opts(ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0,
             sequence_parallel=False, partial_dx=False, strategy="auto", deterministic=False, grad_filter_eps=None,
             return_lse=False, return_token_accuracy=False, return_entropy=False, check_finite=False,
             check_inputs=False):
        def make():  # as the API builds it: one closure cell per keyword
            return LossOptions(ignore_index, reduction, label_smoothing, z_loss, softcap, temperature,
                               sequence_parallel, partial_dx, strategy, deterministic, grad_filter_eps, return_lse,
                               return_token_accuracy, return_entropy, check_finite, check_inputs)
        return api._options(make)

    a, ka = opts()
    assert opts()[0] is a and opts()[1] == ka
    neg = opts(z_loss=-0.0)[0]
    assert neg is not a and math.copysign(1.0, neg.z_loss) == -1.0
    assert opts(ignore_index=1)[0].ignore_index == 1
    with pytest.raises(TypeError):  # True == 1 and hash(True) == hash(1): the key's types keep the check
        opts(ignore_index=True)
    for _ in range(2):
        with pytest.raises(ValueError):
            opts(label_smoothing=2.0)
    s = settings.current()
    p = api._params(0, 10, a, s, False, ka)
    assert api._params(0, 10, a, s, False, ka) is p and api._params(0, 10, a, s, False, None) is not p
    q = FLCEParams(0, 10, a, s)
    assert p.reduction == "mean" and "reduction" in vars(p) and p == q and hash(p) == hash(q)
    x = torch.empty(1000, 64, dtype=torch.bfloat16)
    before = core.fused_plan_for(1000, x, p, 1, False)
    monkeypatch.setattr(chunking, "CPU_CHUNK_BYTES", 300 * (2 * 10 + 6 * 64))
    assert core.fused_plan_for(1000, x, p, 1, False) != before
    monkeypatch.undo()
    assert core.fused_plan_for(1000, x, p, 1, False) == before
    with settings.override(chunk_bytes=200 * 10 * 2):
        assert core.fused_plan_for(1000, x, FLCEParams(0, 10, a, settings.current()), 1, False) == 200


def test_launch_dummies_are_shared_per_role():
    """The logits pass's unused arguments: one tensor per (role, device, dtype), distinct across roles (no tensor
    object twice in one launch), a plain tensor even when first made under inference mode."""
    from flce_dist.kernels import launch

    x = torch.randn(4, 3)
    with torch.inference_mode():
        a = launch._dummy("issue53-test", x, torch.float32, 1)
    assert not a.is_inference() and launch._dummy("issue53-test", x, torch.float32, 1) is a
    assert launch._dummy("issue53-test2", x, torch.float32, 1) is not a


def test_returned_lse_is_a_copy_only_when_returned():
    """With ``return_lse`` the lse handed out is not the tensor the backward saves (changing it changes no
    gradient); without it no copy is made (the op count test) and the gradients are the same."""
    x0, w0, t, _ = _data(seed=3)
    grads = []
    for mutate in (False, True):
        x, w = x0.bfloat16().requires_grad_(), w0.bfloat16().requires_grad_()
        loss, lse = F(x, w, t, return_lse=True, strategy="recompute")
        if mutate:
            lse.add_(5.0)
        loss.backward()
        grads.append((x.grad, w.grad))
    x, w = x0.bfloat16().requires_grad_(), w0.bfloat16().requires_grad_()
    F(x, w, t, strategy="recompute").backward()
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
    assert torch.equal(grads[0][0], x.grad) and torch.equal(grads[0][1], w.grad)


class _FakeCompiled:
    """What the fast path calls on a repeat: ``run(g0, g1, g2, stream, function, packed, meta, enter, exit,
    *args)``."""

    def __init__(self, tag):
        self.tag, self.function, self.packed_metadata, self.runs = tag, object(), object(), []

    def run(self, *a):
        self.runs.append(a)


class _FakeParam:
    def __init__(self, is_constexpr):
        self.is_constexpr = is_constexpr


class _FakeTritonKernel:
    def __init__(self, nparams, constexpr=()):
        self.params, self.pre_run_hooks = [_FakeParam(i in constexpr) for i in range(nparams)], []


def _stand_in_knobs(monkeypatch, fast_launch):
    """Triton's knobs (``knobs.runtime``, ``knobs.compilation``) as plain namespaces (no Triton on the CPU)."""
    import types

    rt = types.SimpleNamespace(debug=False, add_stages_inspection_hook=None, launch_enter_hook=None,
                               launch_exit_hook=None)
    comp = types.SimpleNamespace(instrumentation_mode="")
    monkeypatch.setattr(fast_launch, "_runtime_knobs", lambda: rt)
    monkeypatch.setattr(fast_launch, "_compilation_knobs", lambda: comp, raising=False)
    return rt, comp


def test_fast_launch_falls_back_when_tritons_knobs_change(monkeypatch):
    """Issue 61, finding 6: Triton's own launcher keys its kernels on per-call knobs (``knobs.runtime.debug``,
    ``knobs.compilation.instrumentation_mode``, a stages inspection hook), the direct launch did not: after one
    changes, every launch takes Triton's path (which compiles the debug or instrumented binary); once they are
    back to their values at the first launch, repeats go straight to the cached kernel again."""
    from flce_dist.kernels import fast_launch

    slow: list = []

    def default(kern, grid, *args, num_warps, num_stages, **kw):
        slow.append(grid)
        return _FakeCompiled(len(slow))

    monkeypatch.setattr(fast_launch, "_default_launcher", lambda: default)
    monkeypatch.setattr(fast_launch, "_hooks_active", lambda: False)
    rt, comp = _stand_in_knobs(monkeypatch, fast_launch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 7, raising=False)
    monkeypatch.setattr(fast_launch, "_COMPILED", {})
    k = _FakeTritonKernel(3)
    a = torch.zeros(16)
    go = lambda: fast_launch.launcher(k, (2,), a, 4096, 1.5, num_warps=4, num_stages=2)  # noqa: E731
    first = go()
    go()
    assert len(slow) == 1 and len(first.runs) == 1  # the repeat took the direct path
    for knob, value in ((rt, ("debug", True)), (comp, ("instrumentation_mode", "fpsan")),
                        (rt, ("add_stages_inspection_hook", lambda: ("k", "h")))):
        before = getattr(knob, value[0])
        setattr(knob, *value)
        n = len(slow)
        go()
        go()
        assert len(slow) == n + 2, value  # every launch: Triton's launcher (never the first binary)
        setattr(knob, value[0], before)
        runs = len(first.runs)
        go()
        assert len(slow) == n + 2 and len(first.runs) == runs + 1, value  # back: the direct path again


def test_fast_launch_key_and_fallbacks(monkeypatch):
    """``kernels/fast_launch.launcher`` without a GPU (Triton and CUDA stood in for): a repeat launch with the
    same specialisation goes straight to the compiled kernel with Triton's positional layout; a pointer that is
    not 16-byte aligned, an int of another class (Triton specialises on == 1 and % 16; a constexpr on its value),
    dtype, grid rank or num_warps takes Triton's path (a compile there), another token count or grid does not; extra launcher keywords, an argument of another type, pre-run hooks,
    a registered launch hook and a kernel with more parameters than arguments never use the cache."""
    from flce_dist.kernels import fast_launch

    slow: list = []

    def default(kern, grid, *args, num_warps, num_stages, **kw):
        slow.append((grid, args, kw))
        return _FakeCompiled(len(slow))

    monkeypatch.setattr(fast_launch, "_default_launcher", lambda: default)
    monkeypatch.setattr(fast_launch, "_hooks_active", lambda: False)
    _stand_in_knobs(monkeypatch, fast_launch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 7, raising=False)
    monkeypatch.setattr(fast_launch, "_COMPILED", {})
    k = _FakeTritonKernel(5, constexpr=(4,))
    buf = torch.zeros(64, dtype=torch.bfloat16)
    a = buf[:16]
    assert a.data_ptr() % 16 == 0
    go = lambda *args, **kw: fast_launch.launcher(k, (3, 2), *args, num_warps=4, num_stages=2, **kw)  # noqa: E731

    c1 = go(a, buf[16:32], 2.5, 4096, True)
    assert len(slow) == 1
    c2 = go(buf[32:48], buf[:16], 0.5, 4096, True)  # other pointers, same alignment, another float: cached
    assert len(slow) == 1 and c2 is c1 and len(c1.runs) == 1
    g0, g1, g2, stream, fn, packed, meta, enter, exit_, *args = c1.runs[0]
    assert (g0, g1, g2, stream, fn, packed, meta, enter, exit_) == (3, 2, 1, 7, c1.function, c1.packed_metadata,
                                                                    None, None, None)
    assert args[2] == 0.5 and args[3] == 4096 and args[0].data_ptr() == buf[32:48].data_ptr()
    for other in [(buf[1:17], buf[16:32], 2.5, 4096, True),  # 2 bytes past an aligned pointer
                  (a, buf[16:32], 2.5, 4097, True), (a, buf[16:32], 2.5, 1, True),  # ints: % 16, == 1
                  (a, buf[16:32], 2.5, 4096, False), (a.float(), buf[16:32], 2.5, 4096, True)]:
        n = len(slow)
        go(*other)
        assert len(slow) == n + 1, other
    # a run-time int enters by its class only (a new token count that is a multiple of 16 hits), the grid is an
    # argument of the launch (another grid of the same rank hits and is launched with its own sizes)
    n = len(slow)
    go(a, buf[16:32], 2.5, 8192 + 16, True)
    c1.runs.clear()
    fast_launch.launcher(k, (5, 9), a, buf[16:32], 2.5, 1040, True, num_warps=4, num_stages=2)
    assert len(slow) == n and c1.runs[-1][:3] == (5, 9, 1) and c1.runs[-1][12] == 1040
    k2 = _FakeTritonKernel(5, constexpr=(3, 4))  # the same int as a constexpr: its exact value is the key
    fast_launch.launcher(k2, (3, 2), a, a, 2.5, 4096, True, num_warps=4, num_stages=2)
    fast_launch.launcher(k2, (3, 2), a, a, 2.5, 4112, True, num_warps=4, num_stages=2)
    assert len(slow) == n + 2
    n = len(slow)
    fast_launch.launcher(k, (4,), a, a, 2.5, 4096, True, num_warps=4, num_stages=2)  # another grid rank
    fast_launch.launcher(k, (3, 2), a, a, 2.5, 4096, True, num_warps=8, num_stages=2)  # another num_warps
    assert len(slow) == n + 2
    for call in [lambda: go(a, buf[16:32], 2.5, 4096, True, ptx_options="x"),  # launcher keywords
                 lambda: go(a, buf[16:32], 2.5, 4096, (1, 2)),  # a tuple argument
                 lambda: fast_launch.launcher(_FakeTritonKernel(6), (3, 2), a, a, 2.5, 4096, True,
                                              num_warps=4, num_stages=2)]:  # a defaulted parameter
        for _ in range(2):
            n = len(slow)
            call()
            assert len(slow) == n + 1
    k.pre_run_hooks = [print]
    n = len(slow)
    go(a, buf[16:32], 2.5, 4096, True)
    assert len(slow) == n + 1
    k.pre_run_hooks = []
    monkeypatch.setattr(fast_launch, "_hooks_active", lambda: True)  # a profiler's launch hook
    n = len(slow)
    go(a, buf[16:32], 2.5, 4096, True)
    assert len(slow) == n + 1
