"""Megatron-Core: ``flce_dist.integrations.megatron`` inside megatron-core 0.19.2's own code, and the
library's ``loss_weights`` (the fused 3-matmul path for per-token losses) it rests on.

Part 1, ``loss_weights`` (no Megatron needed): against ``reference.py`` in float64 at odd shapes
(and float32 through the Helion kernels, several tiles and token chunks), one rank in process and 2
gloo ranks (an uneven vocabulary split; with and without sequence parallelism): the fused form
(gradient ``c * w``: no recompute), the exact fallback (any other gradient, a gradient at a
zero-weight token, gradients that differ across ranks: every rank falls back, none hangs), the
scalar reductions, the argument errors.

Part 2, Megatron (skipped when ``megatron.core`` is not installed; ``launch/setup.sh`` unpacks the
0.19.2 wheel): tiny ``GPTModel`` / ``HybridModel`` (local specs, float32, padded vocabulary 320 for
301 tokens, a loss mask) built and run by Megatron, at TP=1 (one forked rank) and TP=4 then TP=2
(one start of 4 gloo ranks). The per-token loss and every parameter gradient (this rank's shard)
against Megatron's own ``vocab_parallel_cross_entropy`` path on the same model: with and without
sequence parallelism, tied and untied embeddings, the ``output_processor`` hook and the
output-layer swap (HybridModel's route, also forced on GPTModel), an explicit per-call processor,
logits without labels, MuP's output scaling, ``true_vocab_size`` against a model built with the
unpadded vocabulary (TP=1) and against the float64 reference (TP=4: the last shard empty); a few
AdamW steps through Megatron's training pieces that run on CPU (its ``DistributedDataParallel``
grad buffers, ``schedules.forward_step`` / ``backward_step`` with its loss scaling, with and without
``calculate_per_token_loss``, and its sequence-parallel grad all-reduce); the refused settings.
Context parallelism (TP=2 x CP=2 on 4 gloo ranks; Megatron's local attention refuses CP > 1, so no
model): the output layer built as ``GPTModel`` builds it, each CP rank fed its own tokens by
Megatron's ``get_batch_on_this_cp_rank``, the processor called as ``GPTModel`` calls it, with and
without sequence parallelism: the loss ``[b, s/CP]`` and the gradients of the hidden states and the
weight shard against Megatron's ``vocab_parallel_cross_entropy`` on the same tokens, and the two CP
ranks' losses differ (nothing reduced over CP).

CPU shims, here only (never in the library): a stub for the one module that imports Triton
(``transformer/moe/ops/paged_stash.py``), ``torch.cuda.current_device`` answering ``"cpu"`` (RoPE,
the global buffer, the sequence-parallel gathers allocate on it), the CUDA RNG tracker's ``fork``
as a no-op (dropout is 0), torch's LayerNorm without its sequence-parallel guard (its parameters
marked ``sequence_parallel`` as Megatron's own norms are), an explicit causal mask. Not run on CPU:
``forward_backward_no_pipelining`` and Megatron's optimizer (both allocate on ``"cuda"``), DDP's
bucketed grad sync (CUDA streams): DP=1 here, AdamW from torch on the DDP ``main_grad`` buffers.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import tempfile
import traceback
import types

import pytest
import torch

import flce_dist
from flce_dist.reference import reference_loss
from tests._checks import SMALL_BLOCKS, rel, run_ranks

HAVE_MEGATRON = (importlib.util.find_spec("megatron") is not None
                 and importlib.util.find_spec("megatron.core") is not None)
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (launch/setup.sh)")

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # float32 against Megatron / the float64 reference
F64_TOL = 1e-10


def _tol(key: str) -> float:
    """``f64 ...`` keys: float64 against float64; ``param ...``: weights after AdamW steps (Adam divides
    by sqrt(v), so a gradient entry near 0 turns float32 rounding into an O(lr) update difference:
    1e-3); else float32's bars (loss / gradients)."""
    if key.startswith("f64 "):
        return F64_TOL
    if key.startswith("param "):
        return 1e-3
    return LOSS_TOL if key.startswith("loss") else GRAD_TOL


def _check(errs: dict, where: str = "") -> None:
    """Every relative error within its tolerance; ``flag ...`` entries must be True."""
    bad = {k: e for k, e in errs.items() if not (e is True if k.startswith("flag ") else e <= _tol(k))}
    assert not bad, f"{where}: {bad}"


class _Recomputes:
    """Counts the backward's recompute calls (``flce_dist.autograd.recompute_grads``): 0 means the
    fused form's gradient was used."""

    def __enter__(self):
        import flce_dist.autograd as A

        self._real, self.calls = A.recompute_grads, 0

        def counted(*a, **k):
            self.calls += 1
            return self._real(*a, **k)

        A.recompute_grads = counted
        return self

    def __exit__(self, *exc):
        import flce_dist.autograd as A

        A.recompute_grads = self._real


# ================================================================ part 1: loss_weights

N, H, V = 67, 33, 211  # odd; V split 106 / 105 over 2 ranks


def _lw_data(seed: int, dtype: torch.dtype, n: int = N):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.4
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.1
    target = torch.randint(0, V, (n,), generator=g)
    target[::9] = -100
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.25
    w[1::7] = 0.0
    w[::5] = 1.0
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), target, w


def _grads(fn, hidden, weight, bias, go):
    h, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    out = fn(h, wt, b)
    out.backward(go)
    return [out.detach(), h.grad, wt.grad] + ([] if b is None else [b.grad])


def _errs(got, ref, tag: str, f64: bool) -> dict:
    return {f"{'f64 ' if f64 else ''}{k} {tag}": rel(a, b) for k, a, b in zip(("loss", "dx", "dw", "db"), got, ref)}


def _upstream(kind: str, w: torch.Tensor, target: torch.Tensor, seed: int = 5) -> torch.Tensor:
    """The per-token gradient that arrives: ``c * w`` (Megatron's ``loss * loss_mask`` sum), or not."""
    g = torch.Generator().manual_seed(seed)
    if kind == "cw":
        return 0.37 * w
    if kind == "cw+ignored":  # any value at ignored tokens: they have no gradient either way
        return torch.where(target == -100, torch.full_like(w, 5.0), 0.37 * w)
    if kind == "random":
        return torch.randn(w.shape, generator=g, dtype=w.dtype)
    if kind == "near":  # c * w to 1e-4 per token, 0 at zero weight: not the form (the check is per token)
        return 0.37 * w * (1 + 1e-4 * torch.randn(w.shape, generator=g, dtype=w.dtype))
    if kind == "zero-weight":  # c * w except a gradient at one token of weight 0
        out = 0.37 * w
        out[int((w == 0).nonzero()[0, 0])] = 0.5
        return out
    raise AssertionError(kind)


_FORMS = [("cw", 0), ("cw+ignored", 0), ("random", 1), ("near", 1), ("zero-weight", 1)]


# float64 runs whole-dimension tiles (one tile per kernel in reference mode: seconds less per call);
# float32 runs several tiles in every dimension and 16-row token chunks (SMALL_BLOCKS)
WHOLE = {"chunk_stats": {"block_n": 128, "block_s": 256, "block_v": 256}, "merge": {"block_n": 128, "block_t": 8},
         "target_rows": {"block_n": 128}, "token_rows": {"block_n": 128},
         "chunk_grad": {"block_n": 128, "block_v": 256}}


def _small(dtype: torch.dtype):
    """The tiles of a call (see WHOLE): float64 whole dimensions (``hl.dot`` has none, so its logits
    come from torch), float32 the Helion kernels on several tiles and token chunks."""
    if dtype == torch.float64:
        return flce_dist.override(blocks=WHOLE)
    return flce_dist.override(blocks=SMALL_BLOCKS, chunk_bytes=16 * V * 4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_loss_weights_single_rank(dtype):
    """Per-token losses with ``loss_weights`` (fused form and fallback), and the weighted scalar
    reductions, against the float64 reference; float32 runs the Helion kernels on several tiles and
    token chunks (the row-scale form without a bias, chunk_grad's with one)."""
    f64 = dtype == torch.float64
    hidden, weight, bias, target, w = _lw_data(1, dtype)
    h64, w64, b64 = hidden.double(), weight.double(), bias.double()
    errs = {}
    with _small(dtype):
        for use_bias in (False, True):
            b, bref = (bias, b64) if use_bias else (None, None)
            tag = "bias" if use_bias else "nobias"
            for kind, recomputes in _FORMS:
                go = _upstream(kind, w, target)
                with _Recomputes() as spy:
                    got = _grads(lambda h, wt, bb: flce_dist.fused_linear_cross_entropy(
                        h, wt, target, bias=bb, reduction="none", loss_weights=w.to(dtype)), hidden, weight, b,
                        go.to(dtype))
                errs[f"flag {kind} {tag}: {recomputes} recompute(s), got {spy.calls}"] = spy.calls == recomputes
                ref = _grads(lambda h, wt, bb: reference_loss(h, wt, target, bias=bb, reduction="none"), h64, w64,
                             bref, go)
                errs.update(_errs(got, ref, f"none {kind} {tag}", f64))
            for red, kw in (("sum", {}), ("mean", {}), ("mean", {"num_items_in_batch": 40})):
                with _Recomputes() as spy:
                    got = _grads(lambda h, wt, bb: flce_dist.fused_linear_cross_entropy(
                        h, wt, target, bias=bb, reduction=red, loss_weights=w.to(dtype), **kw), hidden, weight, b,
                        torch.tensor(1.7, dtype=dtype))
                ref = _grads(lambda h, wt, bb: reference_loss(h, wt, target, bias=bb, reduction=red,
                                                              loss_weights=w, **kw),
                             h64, w64, bref, torch.tensor(1.7, dtype=torch.float64))
                errs[f"flag {red}{kw} {tag}: fused"] = spy.calls == 0
                errs.update(_errs(got, ref, f"{red}{kw} {tag}", f64))
        # the recompute strategy with weights (a scalar reduction: the weights enter its row weights)
        got = _grads(lambda h, wt, bb: flce_dist.fused_linear_cross_entropy(
            h, wt, target, reduction="mean", loss_weights=w.to(dtype), strategy="recompute"), hidden, weight, None,
            torch.tensor(0.6, dtype=dtype))
        ref = _grads(lambda h, wt, bb: reference_loss(h, wt, target, reduction="mean", loss_weights=w), h64, w64, None,
                     torch.tensor(0.6, dtype=torch.float64))
        errs.update(_errs(got, ref, "mean recompute", f64))
        # every weight 0: loss 0, gradients 0 (the mean's denominator is 1, not 0)
        z = torch.zeros_like(w).to(dtype)
        out = flce_dist.fused_linear_cross_entropy(hidden, weight, target, reduction="mean", loss_weights=z)
        errs["flag all-zero weights: loss 0"] = float(out) == 0.0
        # a second backward through the same graph (retain_graph): recomputes, same gradients
        h, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = flce_dist.fused_linear_cross_entropy(h, wt, target, reduction="none", loss_weights=w.to(dtype))
        go = (0.37 * w).to(dtype)
        out.backward(go, retain_graph=True)
        first = (h.grad.clone(), wt.grad.clone())
        h.grad = wt.grad = None
        out.backward(go)
        errs.update({f"{'f64 ' if f64 else ''}dx retain_graph": rel(h.grad, first[0]),
                     f"{'f64 ' if f64 else ''}dw retain_graph": rel(wt.grad, first[1])})
    _check(errs, str(dtype))


def test_device_checked_path_copies_misaligned_views(monkeypatch):
    """The adapter's device-checked weighted path (``_weighted_losses``: the processor with a loss mask) takes its
    inputs as the API's eager call does (``flce_dist/aligned.py``, issue 61 finding 5): a view at an odd offset into
    a flat buffer (Megatron's parameter buffers) is copied where the kernels may build tensor descriptors (CUDA;
    the CPU stands in here), so no kernel sees a misaligned tensor, and losses and gradients equal the aligned
    call's."""
    from flce_dist import aligned
    from flce_dist.integrations import megatron as fm
    from flce_dist.kernels import launch

    monkeypatch.setattr(aligned, "DEVICE_TYPES", ("cuda", "cpu"))
    seen = []
    real = launch._launch

    def spy(name, args, *a, **k):
        seen.extend(u.data_ptr() % 16 for u in args if isinstance(u, torch.Tensor) and u.numel())
        return real(name, args, *a, **k)

    monkeypatch.setattr(launch, "_launch", spy)
    g = torch.Generator().manual_seed(62)
    n, h, v = 21, 24, 53  # rows of 96 bytes: every token chunk of an aligned tensor starts aligned
    hidden, weight, bias = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.3, torch.randn(v, generator=g)
    target = torch.randint(0, v, (n,), generator=g)
    target[::9] = -100
    w = torch.rand(n, generator=g) + 0.25
    w[1::7] = 0.0

    def odd(u):
        flat = torch.zeros(u.numel() + 8, dtype=u.dtype)
        view = flat[1 : 1 + u.numel()].view(u.shape)
        view.copy_(u)
        assert view.data_ptr() % 16
        return view

    def run(xx, ww, bb, tt):
        xs, ws, bs = xx.detach().requires_grad_(), ww.detach().requires_grad_(), bb.detach().requires_grad_()
        opts = flce_dist.LossOptions(reduction="none", strategy="fused")
        loss = fm._weighted_losses(xs, ws, tt, bs, None, None, None, w, opts, None)
        loss.backward(0.37 * w)
        return loss.detach(), xs.grad, ws.grad, bs.grad

    with flce_dist.override(blocks=SMALL_BLOCKS):
        want = run(hidden, weight, bias, target)
        seen.clear()
        got = run(odd(hidden), odd(weight), odd(bias), odd(target))
    assert seen and not any(seen), "a kernel saw a misaligned tensor"
    for a, c in zip(want, got):
        assert torch.equal(a, c)


def test_loss_weights_errors():
    hidden, weight, _, target, w = _lw_data(2, torch.float32, n=12)
    f = flce_dist.fused_linear_cross_entropy
    with pytest.raises(ValueError, match="loss_weights shape"):
        f(hidden, weight, target, loss_weights=w[:5].float())
    with pytest.raises(TypeError, match="floating-point"):
        f(hidden, weight, target, loss_weights=torch.ones(12, dtype=torch.int64))
    with pytest.raises(TypeError, match="loss_weights must be a float tensor"):
        f(hidden, weight, target, loss_weights=[1.0] * 12)
    with pytest.raises(ValueError, match="detach"):
        f(hidden, weight, target, loss_weights=w.float().requires_grad_())
    with pytest.raises(ValueError, match="meta"):
        f(hidden.to("meta"), weight.to("meta"), target.to("meta"), loss_weights=w.float().to("meta"))
    # the module takes them per call, like num_items_in_batch
    loss_fn = flce_dist.FusedLinearCrossEntropyLoss(reduction="sum")
    ref = reference_loss(hidden.double(), weight.double(), target, reduction="sum", loss_weights=w)
    assert rel(loss_fn(hidden, weight, target, loss_weights=w.float()), ref) < LOSS_TOL


def test_loss_weights_under_torch_compile():
    """Under torch.compile a call with loss_weights runs eagerly (a graph break): the same numbers, the
    fused form's gradient; fullgraph=True refuses it (Dynamo's graph-break error)."""
    hidden, weight, _, target, w = _lw_data(4, torch.float64, n=20)
    w = w.float()

    def per_token(h, wt):
        return flce_dist.fused_linear_cross_entropy(h, wt, target, reduction="none", loss_weights=w) * 1.0

    with _small(torch.float64):
        eager = _grads(lambda h, wt, bb: per_token(h, wt), hidden.float(), weight.float(), None, 0.5 * w)
        torch._dynamo.reset()
        with _Recomputes() as spy:
            compiled = _grads(lambda h, wt, bb: torch.compile(per_token, backend="eager")(h, wt), hidden.float(),
                              weight.float(), None, 0.5 * w)
        assert spy.calls == 0
        assert all(rel(a, b) < 1e-6 for a, b in zip(compiled, eager))
        torch._dynamo.reset()
        with pytest.raises(Exception, match="(?i)graph break|skip|disable"):
            torch.compile(per_token, backend="eager", fullgraph=True)(hidden.float(), weight.float())
        torch._dynamo.reset()


def _lw_worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    flce_dist.setup_reference_mode()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        res = _lw_checks(rank, world, dist.group.WORLD)
    except Exception:  # noqa: BLE001  (reported by the test with the rank's traceback)
        res = {"error": traceback.format_exc()}
    torch.save(res, os.path.join(tmp, f"r{rank}.pt"))
    dist.destroy_process_group()


def _lw_checks(rank: int, world: int, group) -> dict:
    """loss_weights at P ranks against the float64 reference of the full vocabulary: replicated and
    sequence-parallel hidden states, the fused form and the fallback (float64; float32 through the
    kernels for the fused form)."""
    errs = {}
    n = N + 1  # even: the sequence-parallel slices are equal
    a, b = flce_dist.vocab_shard(V, rank, world)
    sl = slice(rank * n // world, (rank + 1) * n // world)
    for dtype in (torch.float64, torch.float32):
        f64 = dtype == torch.float64
        hidden, weight, _, target, w = _lw_data(3, dtype, n)
        h64, w64 = hidden.double(), weight.double()
        forms = _FORMS if f64 else _FORMS[:1]
        for sp in (False, True):
            for kind, recomputes in forms:
                go = _upstream(kind, w, target)
                ref = _grads(lambda h, wt, bb: reference_loss(h, wt, target, reduction="none"), h64, w64, None, go)
                rows = sl if sp else slice(None)
                with _small(dtype), _Recomputes() as spy:
                    got = _grads(lambda h, wt, bb: flce_dist.fused_linear_cross_entropy(
                        h, wt, target[rows], group=group, vocab_size=V, reduction="none", sequence_parallel=sp,
                        loss_weights=w[rows].to(dtype)), hidden[rows], weight[a:b], None, go[rows].to(dtype))
                tag = f"P={world}{' sp' if sp else ''} {kind}"
                errs[f"flag {tag}: {recomputes} recompute(s), got {spy.calls}"] = spy.calls == recomputes
                errs.update(_errs(got, [ref[0][rows], ref[1][rows], ref[2][a:b]], tag, f64))
        if not f64:
            continue
        # sequence parallel, rank 1's slice all weight 0 (its c is undetermined: rank 0's decides)
        w0 = w.clone()
        w0[n // world:] = 0.0
        go = 0.37 * w0
        ref = _grads(lambda h, wt, bb: reference_loss(h, wt, target, reduction="none"), h64, w64, None, go)
        with _Recomputes() as spy:
            got = _grads(lambda h, wt, bb: flce_dist.fused_linear_cross_entropy(
                h, wt, target[sl], group=group, vocab_size=V, reduction="none", sequence_parallel=True,
                loss_weights=w0[sl]), hidden[sl], weight[a:b], None, go[sl])
        errs["flag sp, a zero-weight slice: fused"] = spy.calls == 0
        errs.update(_errs(got, [ref[0][sl], ref[1][sl], ref[2][a:b]], "sp zero slice", True))
        # gradients that differ across ranks (c = 0.37 on rank 0, 0.5 on rank 1): every rank falls back
        go = (0.37 if rank == 0 else 0.5) * w
        with _Recomputes() as spy:
            got = _grads(lambda h, wt, bb: flce_dist.fused_linear_cross_entropy(
                h, wt, target, group=group, vocab_size=V, reduction="none", loss_weights=w), hidden, weight[a:b],
                None, go)
        ref = _grads(lambda h, wt, bb: reference_loss(h, wt, target, reduction="none"), h64, w64, None, go)
        errs["flag rank-dependent gradient: recompute on every rank"] = spy.calls == 1
        errs["f64 dw rank-dependent"] = rel(got[2], ref[2][a:b])  # each rank's shard from its own gradient
        # weighted scalar reductions, sequence parallel
        for red in ("sum", "mean"):
            ref = _grads(lambda h, wt, bb: reference_loss(h, wt, target, reduction=red, loss_weights=w), h64, w64,
                         None, torch.tensor(0.8, dtype=torch.float64))
            got = _grads(lambda h, wt, bb: flce_dist.fused_linear_cross_entropy(
                h, wt, target[sl], group=group, vocab_size=V, reduction=red, sequence_parallel=True,
                loss_weights=w[sl]), hidden[sl], weight[a:b], None, torch.tensor(0.8, dtype=torch.float64))
            errs.update(_errs(got, [ref[0], ref[1][sl], ref[2][a:b]], f"sp {red}", True))
    return errs


@pytest.mark.dist
def test_loss_weights_two_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        res = run_ranks(_lw_worker, 2, tmp, timeout=300)
    for r, d in enumerate(res):
        assert "error" not in d, f"rank {r}:\n{d['error']}"
        _check(d, f"rank {r}")


# ================================================================ part 2: Megatron-Core

SEQ, MB = 24, 2  # sequence (divisible by 4: sequence parallelism at TP=4), micro-batch
TRUE_V, PADDED_V = 301, 320  # Megatron pads the vocabulary; the padded rows take part in the softmax


def _megatron_shims() -> None:
    """The CPU stand-ins (see the module docstring); called in the rank processes only."""
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if importlib.util.find_spec("triton") is None and name not in sys.modules:
        mod = types.ModuleType(name)
        mod.GLOBAL_BLOCK_SIZE = 1024

        def _missing(*_a, **_k):
            raise RuntimeError("Triton is not installed")

        mod.paged_stash_copy_kernel = mod.paged_stash_pop_kernel = _missing
        sys.modules[name] = mod
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import torch_norm

    mrandom.CudaRNGStatesTracker.fork = contextlib.contextmanager(lambda self, name=None: (yield))

    def norm(cls, config, hidden_size, eps=1e-5, **_):
        layer = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in layer.parameters():
            p.sequence_parallel = config.sequence_parallel  # as Megatron's own norms (TE, Apex) mark them
        return layer

    torch_norm.WrappedTorchNorm.__new__ = norm
    # the pipeline schedules and the combined-1F1B schedule plan (issue 62): CUDA events and streams as no-ops,
    # Tensor.cuda / record_stream as the identity, the schedules' device="cuda" token counter on the CPU
    class _Event:
        def __init__(self, *_a, **_k):
            pass

        def record(self, *_a, **_k):
            pass

        wait = synchronize = record

        def query(self):
            return True

    class _Stream(_Event):
        def wait_event(self, *_a):
            pass

        wait_stream = wait_event

        def record_event(self, *_a):
            return _Event()

    torch.cuda.Event, torch.cuda.Stream = _Event, _Stream
    torch.cuda.current_stream = lambda *_a, **_k: _Stream()
    torch.cuda.stream = lambda *_a, **_k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *_a, **_k: None
    torch.Tensor.cuda = lambda self, *_a, **_k: self
    torch.Tensor.record_stream = lambda self, *_a, **_k: None
    from megatron.core.pipeline_parallel import schedules

    class _Torch(types.ModuleType):  # schedules' torch: zeros(..., device="cuda") on the CPU
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*a, device=None, **k):
            return torch.zeros(*a, device="cpu" if device is not None and "cuda" in str(device) else device, **k)

    schedules.torch = _Torch("torch")


def _config(tp: int, sp: bool, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                             use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                             tensor_model_parallel_size=tp, sequence_parallel=sp, params_dtype=torch.float32, **kw)


def _gpt(tp: int, sp: bool, tied: bool, vocab: int = PADDED_V, **kw):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(0)
    return GPTModel(_config(tp, sp, **kw), get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=tied)


def _hybrid(tp: int, sp: bool, tied: bool):
    """A HybridModel of one attention and one MLP layer ("*-") from Megatron's local modules (its
    shipped specs are Transformer Engine's); its final norm is the torch norm."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    hybrid_block.TENorm = WrappedTorchNorm  # (CPU shim: the stack's final norm is Transformer Engine's)
    full = get_gpt_layer_local_spec()
    attn = copy.deepcopy(full)
    attn.submodules.mlp, attn.submodules.pre_mlp_layernorm = IdentityOp, IdentityOp
    attn.submodules.mlp_bda = IdentityFuncOp
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=full.submodules.pre_mlp_layernorm, mlp=full.submodules.mlp, mlp_bda=full.submodules.mlp_bda))
    stack = ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(attention_layer=attn, mlp_layer=mlp))
    cfg = _config(tp, sp)
    cfg.num_layers = 2
    torch.manual_seed(0)
    return HybridModel(cfg, stack, vocab_size=PADDED_V, max_sequence_length=SEQ, hybrid_layer_pattern="*-",
                       share_embeddings_and_output_weights=tied, position_embedding_type="learned_absolute")


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TRUE_V, (MB, SEQ), generator=g)
    labels = torch.randint(0, TRUE_V, (MB, SEQ), generator=g)
    labels[0, 3] = TRUE_V - 1
    loss_mask = (torch.rand(MB, SEQ, generator=g) > 0.25).float()
    position_ids = torch.arange(SEQ).expand(MB, SEQ)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)  # True = masked (Megatron's convention)
    return tokens, position_ids, causal, labels, loss_mask


def _step(model, batch, scale: float = 0.37, with_mask: bool = True, **call):
    """One forward + backward as Megatron's loss_func does it (``sum(loss * loss_mask) * c``):
    the per-token loss and every parameter's gradient."""
    tokens, pos, causal, labels, loss_mask = batch
    model.zero_grad(set_to_none=True)
    out = model(tokens, pos, causal, labels=labels, loss_mask=loss_mask if with_mask else None, **call)
    (out * loss_mask).sum().mul(scale).backward()
    # the masked loss (what loss_func sums): flce_dist returns 0 at masked tokens, Megatron a number times 0
    return (out * loss_mask).detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(got, ref, tag: str) -> dict:
    errs = {f"loss {tag}": rel(got[0], ref[0])}
    errs[f"flag {tag}: the same parameters have gradients"] = set(got[1]) == set(ref[1])
    errs.update({f"{k} {tag}": rel(got[1][k], v) for k, v in ref[1].items() if k in got[1]})
    return errs


def _versus_megatron(model, tag: str, route: str = "hook", batch=None, **install) -> dict:
    """flce_dist (``install``) against Megatron's own cross entropy on the same model and batch."""
    from flce_dist.integrations import megatron as fm

    batch = _batch() if batch is None else batch
    ref = _step(model, batch)
    errs = {}
    with flce_dist.override(blocks=SMALL_BLOCKS, chunk_bytes=8 * PADDED_V * 4), _Recomputes() as spy:
        with fm.install(model, **install) as handle:
            got = _step(model, batch)
    errs[f"flag {tag}: fused (no recompute)"] = spy.calls == 0
    errs[f"flag {tag}: route {handle.routes}"] = handle.routes == [route]
    errs.update(_compare(got, ref, tag))
    return errs


def _train(tp: int, sp: bool, per_token: bool, use_flce: bool, steps: int = 3) -> tuple:
    """AdamW steps of a tied GPTModel through Megatron's DDP (grad buffers) and its schedule's
    ``forward_step`` / ``backward_step`` (2 micro-batches, ``loss_func`` as pretrain_gpt's), the
    sequence-parallel grad all-reduce of ``finalize_model_grads``, and ``calculate_per_token_loss``'s
    1 / num_tokens. Returns the reported losses per step and the final parameters."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
    from megatron.core.pipeline_parallel import schedules

    from flce_dist.integrations import megatron as fm

    model = _gpt(tp, sp, tied=True, calculate_per_token_loss=per_token)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    handle = fm.install(ddp) if use_flce else None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = [_batch(10 + i) for i in range(2 * steps)]

    def loss_func(loss_mask, output_tensor):  # pretrain_gpt.py's
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    def forward_step_func(data_iterator, m):
        tokens, pos, causal, labels, loss_mask = next(data_iterator)
        return m(tokens, pos, causal, labels=labels, loss_mask=loss_mask), functools.partial(loss_func, loss_mask)

    reported = []
    it = iter(batches)
    for _ in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad(set_to_none=True)
        store, total = [], torch.zeros([], dtype=torch.int)
        for mb in range(2):
            out, num_tokens = schedules.forward_step(forward_step_func, it, ddp, 2, None, store, model.config, 1,
                                                     is_first_microbatch=mb == 0, current_microbatch=mb)
            schedules.backward_step(None, out, None, model.config)
            total += num_tokens
        _allreduce_non_tensor_model_parallel_grads([ddp], model.config)
        if per_token:
            ddp.scale_gradients(1.0 / total)
        for p in model.parameters():
            p.grad = p.main_grad
        opt.step()
        reported.append(torch.stack([s["lm loss"] for s in store]))
    if handle is not None:
        handle.remove()
    return torch.stack(reported), {n: p.detach().clone() for n, p in model.named_parameters()}


def _training(tp: int, sp: bool, tag: str) -> dict:
    errs = {}
    for per_token in (False, True):
        with _Recomputes() as spy:
            got = _train(tp, sp, per_token, True)
        ref = _train(tp, sp, per_token, False)
        t = f"{tag} per_token={per_token}"
        errs[f"flag train {t}: fused"] = spy.calls == 0
        errs[f"loss train {t}"] = rel(got[0], ref[0])
        errs.update({f"param {k} train {t}": rel(got[1][k], v) for k, v in ref[1].items()})
    return errs


def _single_rank_checks() -> dict:
    from flce_dist.integrations import megatron as fm

    errs = {}
    for tied in (False, True):
        t = "tied" if tied else "untied"
        errs.update(_versus_megatron(_gpt(1, False, tied), f"tp=1 {t} hook"))
        errs.update(_versus_megatron(_gpt(1, False, tied), f"tp=1 {t} swap", "swap", method="swap"))
    errs.update(_versus_megatron(_hybrid(1, False, True), "tp=1 hybrid tied", "swap"))
    # without labels: Megatron's own logits, before, during and after install
    model, batch = _gpt(1, False, False), _batch()
    tokens, pos, causal, labels, loss_mask = batch
    logits = model(tokens, pos, causal)
    with fm.install(model):
        errs["flag logits without labels unchanged"] = torch.equal(model(tokens, pos, causal), logits)
        # a caller's own processor wins over the installed one
        errs["flag explicit processor wins"] = torch.equal(
            model(tokens, pos, causal, labels=labels, output_processor=lambda **kw: kw["labels"].float()),
            labels.float())
    errs["flag logits after remove"] = torch.equal(model(tokens, pos, causal), logits)
    # per call: output_processor= (no install); without loss_mask: the recompute strategy
    ref = _step(model, batch)
    with _Recomputes() as spy:
        got = _step(model, batch, output_processor=fm.output_processor)
    errs.update(_compare(got, ref, "tp=1 per-call processor"))
    with _Recomputes() as spy:
        got = _step(model, batch, with_mask=False, output_processor=fm.output_processor)
    errs["flag no loss_mask: recompute"] = spy.calls == 1
    errs.update(_compare(got, ref, "tp=1 no loss_mask"))
    # MuP: logits scaled by mup_output_mult (flce_dist's temperature 1 / mult)
    model = _gpt(1, False, False)
    model.config.use_mup, model.config.mup_output_mult = True, 0.6
    errs.update(_versus_megatron(model, "tp=1 mup"))
    # true_vocab_size: the padded rows leave the softmax = Megatron on a model built with the true V
    for tied in (False, True):
        padded, exact = _gpt(1, False, tied), _gpt(1, False, tied, vocab=TRUE_V)
        with torch.no_grad():
            for (_, p), (_, q) in zip(padded.named_parameters(), exact.named_parameters()):
                p.copy_(torch.cat([q, p[q.shape[0]:]]) if p.shape != q.shape else q)
        ref = _step(exact, batch)
        with fm.install(padded, true_vocab_size=TRUE_V):
            got = _step(padded, batch)
        vocab_rows = [k for k in ref[1] if ref[1][k].shape != got[1][k].shape]
        errs[f"flag true_vocab_size tied={tied}: padded rows get no gradient"] = all(
            bool((got[1][k][TRUE_V:] == 0).all()) for k in vocab_rows) and bool(vocab_rows)
        got = (got[0], {k: (v[:TRUE_V] if k in vocab_rows else v) for k, v in got[1].items()})
        errs.update(_compare(got, ref, f"tp=1 true_vocab_size tied={tied}"))
    errs.update(_training(1, False, "tp=1"))
    errs.update(_refusals())
    return errs


def _raises(fn, exc, words) -> bool:
    try:
        fn()
    except exc as e:
        return all(w in str(e) for w in words)
    return False


def _refusals() -> dict:
    from flce_dist.integrations import megatron as fm

    out = {}

    def with_setting(obj_attr, value, words, **install):
        model = _gpt(1, False, False)
        obj = model.output_layer if obj_attr[0] == "layer" else model.config
        setattr(obj, obj_attr[1], value)
        out[f"flag refuses {obj_attr[1]}"] = _raises(lambda: fm.install(model, **install), ValueError, words)

    # the output-layer swap only (the hook route leaves the MTP depths to Megatron: part 3)
    with_setting(("config", "mtp_num_layers"), 1, ["mtp_num_layers", "swap"], method="swap")
    with_setting(("config", "defer_embedding_wgrad_compute"), True, ["defer_embedding_wgrad_compute"])
    with_setting(("layer", "gtp_remat_size"), 2, ["gtp_remat"])
    with_setting(("layer", "disable_grad_reduce"), True, ["disable_grad_reduce"])
    model = _gpt(1, False, False)
    model.config.fp8_output_proj, model.config.fp8, model.config.fp8_recipe = True, "e4m3", "mxfp8"
    out["flag refuses the MXFP8 output layer"] = _raises(lambda: fm.install(model), ValueError, ["fp8_output_proj"])
    model = _gpt(1, False, False)
    handle = fm.install(model)
    out["flag refuses a second install"] = _raises(lambda: fm.install(model), ValueError, ["already installed"])
    handle.remove()
    fm.install(model).remove()  # removed: installs again
    out["flag refuses a non-Megatron module"] = _raises(lambda: fm.install(torch.nn.Linear(2, 2)), TypeError,
                                                        ["GPTModel"])
    out["flag hook needs GPTModel's hook"] = _raises(lambda: fm.install(_hybrid(1, False, False), method="hook"),
                                                     ValueError, ["output_processor", "swap"])
    out["flag true_vocab_size checked"] = _raises(lambda: fm.OutputProcessor(true_vocab_size=0), ValueError,
                                                  ["true_vocab_size"])
    # a refused setting turned on after install is caught at the call
    model = _gpt(1, False, False)
    with fm.install(model):
        model.output_layer.gtp_remat_size = 2
        out["flag refuses at the call"] = _raises(lambda: _step(model, _batch()), ValueError, ["gtp_remat"])
    return out


def _tp4_checks(rank: int) -> dict:
    """TP=4, sequence parallel, tied (shards of 80 padded rows), both routes; then true_vocab_size
    through the processor on the model's output layer against the float64 reference of the true
    vocabulary (230: rank 3's shard is empty)."""
    from flce_dist.integrations import megatron as fm

    errs = _versus_megatron(_gpt(4, True, True), "tp=4 sp tied hook")
    errs.update(_versus_megatron(_gpt(4, True, False), "tp=4 sp untied swap", "swap", method="swap"))
    model = _gpt(4, True, False)
    layer = model.output_layer
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(SEQ, MB, 32, generator=g)
    labels = torch.randint(0, 230, (MB, SEQ), generator=g)
    w_full = torch.randn(PADDED_V, 32, generator=g) * 0.3
    rows = slice(rank * 80, (rank + 1) * 80)
    with torch.no_grad():
        layer.weight.copy_(w_full[rows])
    h = hidden[rank * SEQ // 4:(rank + 1) * SEQ // 4].clone().requires_grad_()
    loss = fm.OutputProcessor(true_vocab_size=230).loss(h, layer, None, labels, None, model.config)
    loss.sum().backward()
    h64, w64 = hidden.double().requires_grad_(), w_full[:230].double().requires_grad_()
    ref = reference_loss(h64.reshape(-1, 32), w64, labels.T.reshape(-1), reduction="none")
    ref.sum().backward()
    dw_ref = torch.cat([w64.grad, torch.zeros(PADDED_V - 230, 32, dtype=torch.float64)])[rows]
    errs["loss tp=4 true_vocab_size"] = rel(loss, ref.view(SEQ, MB).T)
    errs["dx tp=4 true_vocab_size"] = rel(h.grad, h64.grad[rank * SEQ // 4:(rank + 1) * SEQ // 4])
    dw = layer.weight.grad
    if rank < 3:
        errs["dw tp=4 true_vocab_size"] = rel(dw, dw_ref)
    else:  # rank 3's shard is all padding: no gradient
        errs["flag tp=4 true_vocab_size: the empty shard's gradient is 0"] = dw is None or not bool(dw.any())
    return errs


def _tp2_checks() -> dict:
    errs = {}
    for sp in (False, True):
        for tied in (False, True):
            errs.update(_versus_megatron(_gpt(2, sp, tied), f"tp=2 {'sp' if sp else 'nosp'} tied={tied} hook"))
    errs.update(_versus_megatron(_gpt(2, True, True), "tp=2 sp tied swap", "swap", method="swap"))
    errs.update(_versus_megatron(_hybrid(2, True, True), "tp=2 sp hybrid tied", "swap"))
    errs.update(_training(2, True, "tp=2 sp"))
    return errs


def _in_megatron_rank(rank: int, world: int, tmp: str, checks) -> None:
    """One gloo rank of ``run_ranks`` with Megatron's CPU shims: ``checks()`` returns the rank's errors (or
    the rank's traceback is reported), saved for the test."""
    import torch.distributed as dist

    flce_dist.setup_reference_mode()
    torch.set_num_threads(1)
    try:
        _megatron_shims()
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        errs = checks()
    except Exception:  # noqa: BLE001  (reported by the test with the rank's traceback)
        errs = {"error": traceback.format_exc()}
    torch.save(errs, os.path.join(tmp, f"r{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


def _check_ranks(res: list, n_checks) -> None:
    """Every rank's results: no error, every check within its tolerance, ``n_checks(rank)`` checks ran."""
    for r, d in enumerate(res):
        assert "error" not in d, f"rank {r}:\n{d['error']}"
        _check(d, f"rank {r}")
        assert len(d) == n_checks(r), (r, len(d))


def _megatron_worker(rank: int, world: int, tmp: str) -> None:
    def checks() -> dict:
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        if world == 1:
            return _single_rank_checks()
        # 4 ranks: TP=4; then ranks 0 and 1 in a new world of 2: TP=2
        errs = _tp4_checks(rank)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        if rank < 2:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store2", rank=rank, world_size=2)
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
            errs.update(_tp2_checks())
        return errs

    _in_megatron_rank(rank, world, tmp, checks)


@needs_megatron
def test_megatron_single_rank():
    """TP=1 in one forked process (Megatron's parallel state stays out of the pytest process)."""
    with tempfile.TemporaryDirectory() as tmp:
        res = run_ranks(_megatron_worker, 1, tmp, timeout=300)
    _check_ranks(res, lambda r: 250)  # every check ran


@needs_megatron
@pytest.mark.dist
def test_megatron_tensor_parallel():
    """TP=4 on 4 gloo ranks, then TP=2 on 2 of them."""
    with tempfile.TemporaryDirectory() as tmp:
        res = run_ranks(_megatron_worker, 4, tmp, timeout=600)
    _check_ranks(res, lambda r: 202 if r < 2 else 44)  # TP=4 on every rank, then TP=2 on ranks 0 and 1


def _cp_checks(rank: int) -> dict:
    """TP=2 x CP=2: the output layer as GPTModel builds it (``ColumnParallelLinear``, the model's
    config with ``context_parallel_size=2``, ``tp_group``), fed this CP rank's tokens (Megatron's own
    zigzag split, ``get_batch_on_this_cp_rank``: different hidden states, labels and loss mask per CP
    rank, the same within a TP pair), called as ``GPTModel._postprocess`` calls the processor;
    against Megatron's ``output_layer`` + ``vocab_parallel_cross_entropy`` on the same CP-local tokens."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.utils import get_batch_on_this_cp_rank

    from flce_dist.integrations import megatron as fm

    tp_group, cp_group = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    errs = {"flag cp: TP pairs {0,1} {2,3}, CP pairs {0,2} {1,3}": (tp, cp) == (2, 2)
            and dist.get_process_group_ranks(tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
            and dist.get_process_group_ranks(cp_group) == [rank % 2, rank % 2 + 2]}
    g = torch.Generator().manual_seed(11)  # the full sequence, the same on every rank
    full = {"cu_seqlens": None, "hidden": torch.randn(MB, SEQ, 32, generator=g),
            "labels": torch.randint(0, TRUE_V, (MB, SEQ), generator=g),
            "loss_mask": (torch.rand(MB, SEQ, generator=g) > 0.25).float()}
    local = get_batch_on_this_cp_rank(full, is_hybrid_cp=False, cp_group=cp_group)  # [b, s/CP, ...]
    hidden, labels, loss_mask = local["hidden"].transpose(0, 1).contiguous(), local["labels"], local["loss_mask"]
    s_cp = SEQ // cp
    errs["flag cp: CP-local shapes"] = hidden.shape == (s_cp, MB, 32) and labels.shape == (MB, s_cp)

    def megatron_loss(labels_, logits):  # LanguageModule.compute_language_model_loss, unfused
        return tensor_parallel.vocab_parallel_cross_entropy(logits, labels_.transpose(0, 1).contiguous(),
                                                            tp_group=tp_group).transpose(0, 1).contiguous()

    def run(layer, h_in, processor):
        layer.zero_grad(set_to_none=True)
        h = h_in.clone().requires_grad_()
        if processor is None:  # GPTModel._postprocess without a processor
            logits, _ = layer(h, weight=None, runtime_gather_output=None)
            out = megatron_loss(labels, logits)
        else:  # GPTModel._postprocess's call of the hook
            out = processor(hidden_states=h, output_layer=layer, output_weight=None, labels=labels,
                            loss_mask=loss_mask, input_ids=None, position_ids=None, attention_mask=None,
                            decoder_input=None, inference_context=None, packed_seq_params=None,
                            runtime_gather_output=None, context=None, compute_language_model_loss=megatron_loss,
                            scale_logits=lambda x: x, config=layer.config)
        (out * loss_mask).sum().mul(0.37).backward()
        return (out * loss_mask).detach(), h.grad.clone(), layer.weight.grad.clone()  # what loss_func sums

    def gathered(t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts

    for sp in (False, True):
        tag = f"cp=2 tp=2 {'sp' if sp else 'nosp'}"
        cfg = _config(tp, sp, context_parallel_size=cp)
        torch.manual_seed(0)  # the same master weight on every rank (CPU init): the TP shards, replicated over CP
        layer = tensor_parallel.ColumnParallelLinear(  # as GPTModel.__init__ builds self.output_layer
            cfg.hidden_size, PADDED_V, config=cfg, init_method=cfg.init_method, bias=False, skip_bias_add=False,
            gather_output=False, skip_weight_param_allocation=False, embedding_activation_buffer=None,
            grad_output_buffer=None, tp_group=tp_group)
        # under SP the decoder's output is also split over the TP pair: [s/(CP TP), b, h]
        h_in = hidden[tp_rank * s_cp // tp:(tp_rank + 1) * s_cp // tp] if sp else hidden
        ref = run(layer, h_in, None)
        with flce_dist.override(blocks=SMALL_BLOCKS, chunk_bytes=8 * PADDED_V * 4), _Recomputes() as spy:
            got = run(layer, h_in, fm.output_processor)
        errs[f"flag {tag}: fused (no recompute)"] = spy.calls == 0
        errs[f"flag {tag}: loss [b, s/CP]"] = got[0].shape == (MB, s_cp)
        errs.update({f"{k} {tag}": rel(a, b) for k, a, b in zip(("loss", "dx", "dw"), got, ref)})
        # the TP pair returns one loss; the CP pair's differ (its tokens do): nothing mixed over CP
        tp_losses, cp_losses = gathered(got[0], tp_group), gathered(got[0], cp_group)
        errs[f"flag {tag}: the same loss on the TP pair"] = torch.equal(tp_losses[0], tp_losses[1])
        errs[f"flag {tag}: the CP ranks' losses differ"] = not torch.allclose(cp_losses[0], cp_losses[1], rtol=1e-2)
        errs[f"flag {tag}: the CP ranks' dW differ"] = not torch.allclose(*gathered(got[2], cp_group), rtol=1e-2)
    return errs


def _cp_worker(rank: int, world: int, tmp: str) -> None:
    def checks() -> dict:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
        return _cp_checks(rank)

    _in_megatron_rank(rank, world, tmp, checks)


@needs_megatron
@pytest.mark.dist
def test_megatron_context_parallel():
    """TP=2 x CP=2 on 4 gloo ranks: the head reduces over the output layer's TP group only."""
    with tempfile.TemporaryDirectory() as tmp:
        res = run_ranks(_cp_worker, 4, tmp, timeout=300)
    _check_ranks(res, lambda r: 18)  # every check ran


@needs_megatron
def test_bench_megatron_smoke():
    """benchmarks/bench_megatron.py --smoke: the GPU benchmark's code on a tiny model on the CPU (Megatron's
    unfused cross entropy and flce_dist, 3 steps from one seed): the same loss curve."""
    import re
    import subprocess

    from tests._checks import ROOT, free_port

    env = {**os.environ, "HELION_INTERPRET": "1", "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_megatron.py"), "--smoke", "--impls",
                          "unfused,flce"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    row = re.search(r"^flce(?:\s+\S+){6}\s+(\S+)$", res.stdout, re.M)  # the last column: max|dloss|
    assert row and float(row.group(1)) < 1e-4, res.stdout[-2000:]


# ================================================================ part 3: Megatron-Core II (issue 62)
#
# Each item of issue 62 inside Megatron's own model and schedules (the numbers in the keys): (1) a custom output
# layer (Megatron-Bridge's Gemma softcapping subclass, hooks, unknown overrides), (2) out-of-range labels at masked
# tokens, (3) the standard loss_mask path without host reads, (4) the combined-1F1B schedule plan
# (build_schedule_plan), (5) multi-token prediction, (6) RL log-probabilities and entropies, (7) remove() restores
# instance attributes, (8) pipeline (PP=2 1F1B, PP=2 x VPP=2 interleaved), MoE and packed sequences (THD).

CAP = 5.0  # final_logit_softcapping of the Gemma-style output layer; its logits are scaled to reach ~4 c


def _softcap_class():
    """Megatron-Bridge's Gemma 2 / 3 output layer: a subclass that keeps the class name ColumnParallelLinear and
    applies ``c * tanh(z / c)`` with ``config.final_logit_softcapping`` in its forward."""
    from megatron.core import tensor_parallel

    class ColumnParallelLinear(tensor_parallel.ColumnParallelLinear):
        def forward(self, input_, weight=None, runtime_gather_output=None):
            logits, bias = super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
            c = self.config.final_logit_softcapping
            return c * torch.tanh(logits / c), bias

    return ColumnParallelLinear


def _softcapped(tp: int, sp: bool, cls=None):
    """An untied GPTModel whose output layer is ``cls`` (default the softcapping one), its weight scaled x30 (logits
    of ~4 c: the cap changes the loss by far more than the tolerance), ``config.final_logit_softcapping = CAP``."""
    model = _gpt(tp, sp, False)
    model.config.final_logit_softcapping = CAP
    model.output_layer.__class__ = cls or _softcap_class()  # as if the provider had built it (same weights)
    with torch.no_grad():
        model.output_layer.weight.mul_(30.0)
    return model


class _HostReads:
    """Host reads of tensor values (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``nonzero``, ``bool`` /
    ``int`` / ``float`` of a tensor: each a host sync on the GPU) made by flce_dist's Python (kernels excluded: they
    run compiled on the GPU) while the block runs, as ``file:line function`` strings. Reads on code paths that run
    only with CPU tensors (the API's target-range check, the guard's raise, the device check's CPU raise) are not
    counted: they never run on the GPU."""

    METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")
    CPU_ONLY = {"_check_target_range", "raise_if_failed", "_raise_on_cpu"}

    def __enter__(self):
        import pathlib

        root = pathlib.Path(flce_dist.__file__).parent
        self.reads, self._saved = [], {}
        pkg, kernels = str(root), str(root / "kernels")

        def wrap(name, real):
            def method(t, *a, **k):
                f = sys._getframe(1)
                code = f.f_code
                if (code.co_filename.startswith(pkg) and not code.co_filename.startswith(kernels)
                        and code.co_name not in self.CPU_ONLY):
                    self.reads.append(f"{code.co_filename[len(pkg) + 1:]}:{f.f_lineno} {code.co_name} .{name}")
                return real(t, *a, **k)
            return method

        for name in self.METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name, getattr(torch.Tensor, name))
            setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)


def _ii_hooks_and_overrides() -> dict:
    """(1) softcapping, forward hooks and pre-hooks, unknown overrides."""
    from flce_dist.integrations import megatron as fm

    errs = {}
    for method in ("hook", "swap"):
        model = _softcapped(1, False)
        ref = _step(model, _batch())
        plain = _gpt(1, False, False)  # the cap matters: Megatron's own loss without it is far off
        with torch.no_grad():
            plain.output_layer.weight.copy_(model.output_layer.weight)
        errs[f"flag 1 softcap changes the loss ({method})"] = rel(_step(plain, _batch())[0], ref[0]) > 1e-2
        errs.update(_versus_megatron(model, f"1 softcap {method}", method, method=method))
    # a forward pre-hook that changes the input runs (as nn.Module.__call__ runs it), on both routes
    for method in ("hook", "swap"):
        model = _gpt(1, False, False)
        model.output_layer.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
        errs.update(_versus_megatron(model, f"1 pre-hook {method}", method, method=method))
    # a forward hook that scales the logits: refused naming the layer, at install and at a call after install
    scale = lambda m, args, out: (out[0] * 0.5, out[1])  # noqa: E731
    for method in ("hook", "swap"):
        model = _gpt(1, False, False)
        h = model.output_layer.register_forward_hook(scale)
        errs[f"flag 1 forward hook refused at install ({method})"] = _raises(
            lambda: fm.install(model, method=method), ValueError, ["output layer", "forward hook"])
        h.remove()
        with fm.install(model, method=method):
            model.output_layer.register_forward_hook(scale)
            errs[f"flag 1 forward hook refused at the call ({method})"] = _raises(
                lambda: _step(model, _batch()), ValueError, ["output layer", "forward hook"])
    # an override that is neither the identity nor the config's softcapping: refused naming the layer
    from megatron.core import tensor_parallel

    class Doubled(tensor_parallel.ColumnParallelLinear):
        def forward(self, input_, weight=None, runtime_gather_output=None):
            logits, bias = super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
            return logits * 2.0, bias

    for cap in (None, CAP):
        model = _softcapped(1, False, Doubled)
        model.config.final_logit_softcapping = cap
        errs[f"flag 1 unknown override refused (cap={cap})"] = _raises(
            lambda: fm.install(model), ValueError, ["output layer", "Doubled", "overrides"])
        errs[f"flag 1 unknown override refused per call (cap={cap})"] = _raises(
            lambda: _step(model, _batch(), output_processor=fm.output_processor), ValueError, ["Doubled"])
    # softcapping with a constant of its own, not config.final_logit_softcapping: nothing states its c
    class HardCap(tensor_parallel.ColumnParallelLinear):
        def forward(self, input_, weight=None, runtime_gather_output=None):
            logits, bias = super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
            return CAP * torch.tanh(logits / CAP), bias

    model = _softcapped(1, False, HardCap)
    model.config.final_logit_softcapping = None
    errs["flag 1 softcapping needs config.final_logit_softcapping"] = _raises(
        lambda: fm.install(model), ValueError, ["HardCap", "final_logit_softcapping"])
    return errs


def _bad_label_batch(seed: int = 1):
    """(2) Megatron's data pipelines leave arbitrary labels where loss_mask is 0: -1, V, a padding id far out."""
    tokens, pos, causal, labels, loss_mask = _batch(seed)
    labels = labels.clone()
    masked = (loss_mask == 0).nonzero()
    for i, (b, s) in enumerate(masked.tolist()):
        labels[b, s] = (-1, PADDED_V, 10**6)[i % 3]
    return tokens, pos, causal, labels, loss_mask


def _ii_host_reads() -> dict:
    """(3) The standard loss_mask path (hook and swap routes, untied and tied): no host read of a tensor in
    forward or backward (after a warm-up step: the once-per-layout shard check), the fused form (no recompute);
    a gradient of another form raises on CPU naming grad_check; grad_check="host" recomputes it exactly."""
    from flce_dist.integrations import megatron as fm

    errs = {}
    for method, tied in (("hook", False), ("swap", True)):
        model = _gpt(1, False, tied)
        with fm.install(model, method=method):
            _step(model, _batch(2))
            with _HostReads() as reads, _Recomputes() as spy:
                _step(model, _batch(3))
        errs[f"flag 3 no host reads ({method}): {reads.reads}"] = not reads.reads
        errs[f"flag 3 fused ({method})"] = spy.calls == 0
    tokens, pos, causal, labels, loss_mask = _batch()
    g = torch.Generator().manual_seed(4)
    other = loss_mask * (1 + torch.rand(loss_mask.shape, generator=g))  # not c * loss_mask

    def objective(model, **call):
        model.zero_grad(set_to_none=True)
        out = model(tokens, pos, causal, labels=labels, loss_mask=loss_mask, **call)
        (out * other).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return (out * loss_mask).detach(), grads

    model = _gpt(1, False, False)
    ref = objective(model)
    with fm.install(model):
        errs["flag 3 another gradient form raises on CPU (grad_check='device')"] = _raises(
            lambda: objective(model), ValueError, ["grad_check", "c * loss_mask"])
    with fm.install(model, grad_check="host"), _Recomputes() as spy:
        got = objective(model)
    errs["flag 3 grad_check='host' recomputes"] = spy.calls == 1
    errs.update(_compare(got, ref, "3 grad_check=host other form"))
    errs["flag 3 grad_check checked"] = _raises(lambda: fm.OutputProcessor(grad_check="sometimes"), ValueError,
                                               ["grad_check"])
    return errs


def _ii_schedule_plan() -> dict:
    """(4) Megatron's combined-1F1B entry, ``build_schedule_plan``, run by its own
    ``TransformerModelChunkSchedulePlan.run`` (forward, then backward with ``c * loss_mask``): the installed
    processor reaches the plan's post-process node; loss and gradients as Megatron's plan; the swap route refuses
    ``overlap_moe_expert_parallel_comm``."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan

    from flce_dist.integrations import megatron as fm

    tokens, pos, causal, labels, loss_mask = _batch()

    def run(model):
        model.zero_grad(set_to_none=True)
        plan = model.build_schedule_plan(tokens, pos, causal, labels=labels, loss_mask=loss_mask)
        proc = plan.state.output_processor
        out = Plan.run(plan, None)
        Plan.run(None, plan, b_grad=0.37 * loss_mask)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return (out * loss_mask).detach(), grads, proc, out.detach()

    model = _gpt(1, False, True)
    ref = run(model)
    with fm.install(model) as handle:
        got = run(model)
        errs = {"flag 4 the plan carries the installed processor": isinstance(got[2], fm.OutputProcessor),
                "flag 4 flce_dist computed it (0 at masked tokens)": bool((got[3][loss_mask == 0] == 0).all())
                and bool((ref[3][loss_mask == 0] != 0).all())}
    errs.update(_compare(got[:2], ref[:2], "4 build_schedule_plan"))
    errs["flag 4 removed"] = "build_schedule_plan" not in model.__dict__ and handle.routes == ["hook"]
    model.config.overlap_moe_expert_parallel_comm = True  # (set after construction: its EP checks need EP > 1)
    errs["flag 4 the swap refuses overlap_moe_expert_parallel_comm"] = _raises(
        lambda: fm.install(model, method="swap"), ValueError, ["overlap_moe_expert_parallel_comm"])
    return errs


def _mtp_gpt(tp: int = 1, sp: bool = False, **kw):
    """A GPTModel with one multi-token-prediction depth (DeepSeek-V3 style, local spec), tied embeddings."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    cfg = _config(tp, sp, mtp_num_layers=1, mtp_loss_scaling_factor=0.3, **kw)
    spec = get_gpt_layer_local_spec()
    torch.manual_seed(0)
    return GPTModel(cfg, spec, vocab_size=PADDED_V, max_sequence_length=SEQ, share_embeddings_and_output_weights=True,
                    mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))


def _ii_mtp() -> dict:
    """(5) Multi-token prediction on the hook route: Megatron's process_mtp_loss (its depth's loss, scaling and
    acceptance counts) and flce_dist's main head: the loss, every gradient (the MTP layer's included) and the MTP
    tracker as Megatron's, with and without calculate_per_token_loss; the swap route refuses it."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from flce_dist.integrations import megatron as fm

    errs = {}
    for per_token in (False, True):
        model = _mtp_gpt(calculate_per_token_loss=per_token)

        def step():
            MTPLossLoggingHelper.clean_metrics_in_tracker()
            out = _step(model, _batch())
            return out, {k: MTPLossLoggingHelper.tracker[k].clone() for k in ("loss_values", "correct_values",
                                                                               "total_values")}

        ref, ref_track = step()
        with fm.install(model) as handle, _Recomputes() as spy:
            got, got_track = step()
        tag = f"5 mtp per_token={per_token}"
        errs[f"flag {tag}: route"] = handle.routes == ["hook"] and spy.calls == 0
        errs[f"flag {tag}: MTP layer gradients"] = any(k.startswith("mtp.") for k in ref[1])
        errs.update(_compare(got, ref, tag))
        errs.update({f"loss {tag} tracker {k}": rel(got_track[k], v) for k, v in ref_track.items()})
    errs["flag 5 the swap refuses MTP"] = _raises(lambda: fm.install(_mtp_gpt(), method="swap"), ValueError,
                                                 ["mtp_num_layers"])
    return errs


T_RL = 0.7  # sampling temperature of the RL checks


def _megatron_logprobs(model, batch, temperature: float = T_RL):
    """Megatron's logits (``model(...)`` without labels: [b, s, V/P] on this rank), gathered over the tensor-parallel
    group, ``log_softmax(logits / T)``: the per-token log-probabilities of the labels and the entropies."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tokens, pos, causal, labels, _ = batch
    logits = model(tokens, pos, causal).float()
    if ps.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)  # [b, s, V] (its backward keeps this rank's part)
    logp_all = torch.log_softmax(logits / temperature, -1)
    logp = logp_all.gather(-1, labels.clamp(0, PADDED_V - 1)[..., None])[..., 0]
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _rl_objective(model, batch, outputs) -> tuple:
    """An advantage-weighted PPO-like objective with an entropy bonus over the unmasked tokens; its value pieces
    and every gradient. ``outputs(model, batch)``: ``(logp, entropy)``."""
    _, _, _, _, loss_mask = batch
    g = torch.Generator().manual_seed(9)
    adv = torch.randn(loss_mask.shape, generator=g)
    model.zero_grad(set_to_none=True)
    logp, ent = outputs(model, batch)
    ratio = torch.exp(logp - logp.detach())
    (-(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * loss_mask).sum()
     - 0.01 * (ent * loss_mask).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack([logp * loss_mask, ent * loss_mask]).detach(), grads


def _ii_rl(model_fn, tag: str, methods=("per-call", "install", "swap")) -> dict:
    """(6) Per-token log-probabilities and entropies (temperature T_RL) with gradients through the hook, against
    Megatron's logits + log_softmax; the backward is the recompute strategy's one pass, no fused forward and no
    host read of a tensor."""
    from flce_dist.integrations import megatron as fm

    errs = {}
    batch = _bad_label_batch(5)
    model = model_fn()
    ref = _rl_objective(model, batch, _megatron_logprobs)
    proc = fm.OutputProcessor(output="logprobs", temperature=T_RL)
    for method in methods:
        def outputs(m, b):
            tokens, pos, causal, labels, loss_mask = b
            kw = {"output_processor": proc} if method == "per-call" else {}
            return m(tokens, pos, causal, labels=labels, loss_mask=loss_mask, **kw)

        with contextlib.ExitStack() as stack:
            if method in ("install", "swap"):
                stack.enter_context(fm.install(model, output="logprobs", temperature=T_RL,
                                               method="swap" if method == "swap" else "auto"))
            _rl_objective(model, batch, outputs)  # warm-up (the once-per-layout shard check)
            with _HostReads() as reads, _Recomputes() as spy:
                got = _rl_objective(model, batch, outputs)
        t = f"6 rl {tag} {method}"
        errs[f"flag {t}: one recompute pass, no host reads {reads.reads}"] = spy.calls == 1 and not reads.reads
        errs.update(_compare(got, ref, t))
    return errs


def _ii_restore() -> dict:
    """(7) An instance-level ``output_layer.forward`` and ``compute_language_model_loss`` set before install():
    calls without labels go through them while installed, and remove() puts back exactly those objects."""
    from megatron.core import tensor_parallel

    from flce_dist.integrations import megatron as fm

    errs = {}
    for method in ("swap", "hook"):
        model = _gpt(1, False, False)
        batch = _batch()
        tokens, pos, causal, *_ = batch
        layer, calls = model.output_layer, []

        def forward(input_, weight=None, runtime_gather_output=None):  # e.g. a profiler's wrapper
            calls.append(1)
            return tensor_parallel.ColumnParallelLinear.forward(layer, input_, weight=weight,
                                                                runtime_gather_output=runtime_gather_output)

        def cross_entropy(labels_, logits):
            calls.append(2)
            return type(model).compute_language_model_loss(model, labels_, logits)

        layer.forward, model.compute_language_model_loss = forward, cross_entropy
        ref = _step(model, batch)
        logits = model(tokens, pos, causal)
        with fm.install(model, method=method):  # (its probe calls the wrapper once: it is not Megatron's forward)
            calls.clear()
            got = _step(model, batch)
            errs[f"flag 7 {method}: no wrapper with labels"] = calls == []
            errs[f"flag 7 {method}: the wrapper without labels"] = torch.equal(model(tokens, pos, causal), logits) \
                and calls == [1]
        errs[f"flag 7 {method}: restored"] = (layer.__dict__.get("forward") is forward
                                              and model.__dict__.get("compute_language_model_loss") is cross_entropy)
        errs.update(_compare(got, ref, f"7 {method}"))
        after = _step(model, batch)
        errs[f"flag 7 {method}: the same iteration after remove"] = torch.equal(after[0], ref[0]) and all(
            torch.equal(after[1][k], v) for k, v in ref[1].items())
    return errs


def _ii_single_rank_checks() -> dict:
    from flce_dist.integrations import megatron as fm

    errs = _ii_hooks_and_overrides()
    for method in ("hook", "swap"):  # (2)
        errs.update(_versus_megatron(_gpt(1, False, False), f"2 masked labels {method}", method,
                                     batch=_bad_label_batch(), method=method))
    errs.update(_versus_megatron(_hybrid(1, False, True), "2 masked labels hybrid", "swap", batch=_bad_label_batch()))
    errs["flag 2 unmasked out-of-range labels still raise"] = _raises(
        lambda: _step(_gpt(1, False, False), _bad_label_batch(), with_mask=False,
                      output_processor=fm.output_processor), ValueError, ["outside"])
    errs.update(_ii_host_reads())
    errs.update(_ii_schedule_plan())
    errs.update(_ii_mtp())
    errs.update(_ii_rl(lambda: _gpt(1, False, False), "tp=1"))
    errs.update(_ii_restore())
    return errs


def _schedule_run(models: list, batches: list, micro: int, vpp: bool = False) -> tuple:
    """One step of Megatron's own schedule (``get_forward_backward_func()``: no pipelining, 1F1B or interleaved)
    over ``models`` (this rank's chunks), ``loss_func`` as pretrain_gpt's, ``micro`` micro-batches: the reported
    ``lm loss`` sums (last stage; empty elsewhere) and every gradient of this rank's chunks."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for m in models:
        m.zero_grad(set_to_none=True)

    def loss_func(loss_mask, output_tensor):  # pretrain_gpt.py's
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    def forward_step(data_iterator, model):
        tokens, pos, causal, labels, loss_mask, *packed = next(data_iterator)
        kw = {"packed_seq_params": packed[0]} if packed else {}
        out = model(tokens, pos, causal, labels=labels, loss_mask=loss_mask, **kw)
        return out, functools.partial(loss_func, loss_mask)

    its = [iter(batches) for _ in models] if vpp else iter(batches)
    reports = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=its, model=models,
                                          num_microbatches=micro, seq_length=batches[0][0].shape[1],
                                          micro_batch_size=batches[0][0].shape[0], forward_only=False)
    rep = torch.stack([r["lm loss"] for r in reports]) if reports else torch.zeros(0)
    grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(models) for n, p in m.named_parameters()
             if p.grad is not None}
    return rep, grads


def _pp_model(layers: int, vp_stage: int | None = None, **kw):
    """This pipeline stage's (virtual stage's) chunk of an untied GPTModel of ``layers`` layers."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = _config(1, False, pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                  pipeline_dtype=torch.float32, **kw)
    cfg.num_layers = layers
    torch.manual_seed(0)
    first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=PADDED_V, max_sequence_length=SEQ, pre_process=first,
                    post_process=last, share_embeddings_and_output_weights=False, vp_stage=vp_stage)


class _InFlight:
    """Counts the fused heads held between their forward and backward (``_DeviceChecked``): the max at once."""

    def __enter__(self):
        from flce_dist.integrations import megatron as fm

        self.cls, self.now, self.max = fm._DeviceChecked, 0, 0
        self._fwd, self._bwd = self.cls.forward, self.cls.backward
        fwd, bwd = self._fwd, self._bwd

        def forward(ctx, *a):
            self.now += 1
            self.max = max(self.max, self.now)
            return fwd(ctx, *a)

        def backward(ctx, *a):
            self.now -= 1
            return bwd(ctx, *a)

        self.cls.forward, self.cls.backward = staticmethod(forward), staticmethod(backward)
        return self

    def __exit__(self, *exc):
        self.cls.forward, self.cls.backward = staticmethod(self._fwd), staticmethod(self._bwd)


def _versus_schedule(models: list, batches: list, micro: int, tag: str, vpp: bool = False) -> dict:
    """(8) flce_dist (``install`` on the chunks) against Megatron's cross entropy through Megatron's schedule."""
    from flce_dist.integrations import megatron as fm

    ref = _schedule_run(models, batches, micro, vpp)
    with fm.install(models), _InFlight() as flight, _Recomputes() as spy:
        got = _schedule_run(models, batches, micro, vpp)
    errs = {f"loss {tag} reported {tuple(ref[0].shape)}": rel(got[0], ref[0]) if ref[0].numel() else 0.0,
            f"flag {tag}: fused, at most one head in flight (max {flight.max})": spy.calls == 0 and flight.max <= 1,
            f"flag {tag}: the same parameters have gradients": set(got[1]) == set(ref[1])}
    errs.update({f"{k} {tag}": rel(got[1][k], v) for k, v in ref[1].items() if k in got[1]})
    return errs


def _packed_spec():
    """The local spec whose core attention takes packed sequences (THD): the CPU stand-in for Transformer Engine's,
    Megatron's DotProductAttention on a block-diagonal causal mask built from ``cu_seqlens_q``."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            cu = packed_seq_params.cu_seqlens_q.tolist()
            t = query.shape[0]
            seq = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
            allowed = (seq[:, None] == seq[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
            out = super().forward(query[:, None], key[:, None], value[:, None], ~allowed[None, None], attn_mask_type,
                                  attention_bias)
            return out[:, 0]

    spec = copy.deepcopy(get_gpt_layer_local_spec())
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec


def _thd_batches(n: int) -> list:
    """Packed micro-batches (b = 1, THD): 3 sequences of lengths 10, 5 and 9 in SEQ tokens, position ids restarting
    per sequence, a loss mask, out-of-range labels at masked tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    out = []
    cu = torch.tensor([0, 10, 15, SEQ], dtype=torch.int32)
    for i in range(n):
        tokens, _, _, labels, loss_mask = _bad_label_batch(20 + i)
        pos = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])[None]
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=10, max_seqlen_kv=10)
        out.append((tokens[:1], pos, None, labels[:1], loss_mask[:1], packed))
    return out


def _ii_parallel_checks(rank: int, tmp: str) -> dict:
    """2 gloo ranks: TP=2 with and without SP (items 1, 2, 3, 6), then PP=2 (1F1B; the swap refuses MTP on both
    stages), PP=2 x VPP=2 (interleaved), then TP=2 with SP for MoE and packed sequences (THD) through Megatron's
    no-pipelining schedule (item 8)."""
    from megatron.core import parallel_state as ps

    from flce_dist.integrations import megatron as fm

    errs = {}
    for sp in (False, True):
        t = f"tp=2 sp={sp}"
        errs.update(_ii_rl(lambda: _gpt(2, sp, sp), t, methods=("per-call",)))
        errs.update(_versus_megatron(_softcapped(2, sp), f"1 softcap {t}"))
        model = _gpt(2, sp, True)
        errs.update(_versus_megatron(model, f"2 masked labels {t}", batch=_bad_label_batch()))
        with fm.install(model):
            _step(model, _batch(2))
            with _HostReads() as reads:
                _step(model, _batch(3))
        errs[f"flag 3 no host reads {t}: {reads.reads}"] = not reads.reads
    # PP=2: 1F1B over 4 micro-batches of a 2-layer model
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    batches = [_bad_label_batch(10 + i) for i in range(4)]
    errs.update(_versus_schedule([_pp_model(2)], batches, 4, "8 pp=2 1f1b"))
    stage = _pp_model(2)
    stage.config.mtp_num_layers = 1  # (the refusal reads the config: no MTP block needed)
    errs[f"flag 5 pp=2 stage {rank}: the swap refuses MTP on every stage"] = _raises(
        lambda: fm.install(stage, method="swap"), ValueError, ["mtp_num_layers"])
    # PP=2 x VPP=2: the interleaved schedule over 4 chunks of one layer each
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                                 virtual_pipeline_model_parallel_size=2)
    chunks = [_pp_model(4, vp, virtual_pipeline_model_parallel_size=2) for vp in range(2)]
    errs.update(_versus_schedule(chunks, batches, 4, "8 pp=2 vpp=2 interleaved", vpp=True))
    # TP=2 with SP: MoE (4 experts, top-2, aux loss) and packed sequences, Megatron's no-pipelining schedule
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(0)
    moe = GPTModel(_config(2, True, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                           add_bias_linear=False, moe_token_dispatcher_type="alltoall"),
                   get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False), vocab_size=PADDED_V,
                   max_sequence_length=SEQ, share_embeddings_and_output_weights=True)
    errs.update(_versus_schedule([moe], batches[:2], 2, "8 moe tp=2 sp"))
    torch.manual_seed(0)
    thd = GPTModel(_config(2, True), _packed_spec(), vocab_size=PADDED_V, max_sequence_length=SEQ,
                   share_embeddings_and_output_weights=True)
    errs.update(_versus_schedule([thd], _thd_batches(2), 2, "8 thd tp=2 sp"))
    return errs


def _cuda_graph_checks(capture: bool = True) -> dict:
    """(3) on the GPU (``tests/test_gpu.py::test_megatron_head_cuda_graph``): the head's forward + backward (the
    processor on Megatron's own ``ColumnParallelLinear`` as ``GPTModel`` calls it, bf16, then ``loss_func``'s masked
    sum times a device scalar, 1 / tokens) captured in one ``torch.cuda.CUDAGraph``: a replay gives the eager loss
    and gradients, and so does a replay after a new batch (hidden states, labels with out-of-range ids at masked
    tokens, mask) is copied into the captured inputs. The steady-state eager step also runs under
    ``torch.cuda.set_sync_debug_mode("error")`` (any host sync raises). For the loss (fused, the device check) and for
    the RL outputs (log-probabilities + entropies at temperature 0.7, the recompute strategy). ``capture=False``: the
    same code without CUDA (a CPU check of the test itself)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from flce_dist.integrations import megatron as fm

    cuda = capture and torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    s, b, h, v = 512, 2, 256, 4096
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=4, use_cpu_initialization=not cuda,
                            params_dtype=dtype, bf16=cuda, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    layer = tensor_parallel.ColumnParallelLinear(h, v, config=cfg, init_method=cfg.init_method, bias=False,
                                                 gather_output=False, skip_bias_add=False).to(dev)

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(s, b, h, generator=g).to(dev, dtype)
        mask = (torch.rand(b, s, generator=g) > 0.25).float()
        labels = torch.randint(0, v, (b, s), generator=g)
        labels[mask == 0] = torch.tensor([-1, v, 10**6]).repeat(s * b)[:int((mask == 0).sum())]
        adv = torch.randn(b, s, generator=g)
        return x, labels.to(dev), mask.to(dev), adv.to(dev)

    x0, labels, mask, adv = batch(1)
    hidden = x0.clone().requires_grad_()
    errs = {}
    for name, proc in (("loss", fm.output_processor), ("logprobs", fm.OutputProcessor(output="logprobs",
                                                                                       temperature=0.7))):
        def step():
            out = proc(hidden_states=hidden, output_layer=layer, output_weight=None, labels=labels, loss_mask=mask,
                       config=cfg, runtime_gather_output=None, scale_logits=None)
            c = 1.0 / mask.sum()  # loss_func's normalisation: a device scalar
            val = ((out[0] * adv + 0.01 * out[1]) if isinstance(out, tuple) else out) * mask
            val = val.sum() * c
            val.backward()
            return val.detach()

        def eager():
            hidden.grad = layer.weight.grad = None
            val = step()
            return val.clone(), hidden.grad.clone(), layer.weight.grad.clone()

        ref = eager()  # the first call: compiles, checks the layout once (a host sync)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                eager()
                errs[f"flag {name}: no host sync in the steady-state step"] = True
            except RuntimeError as e:
                errs[f"flag {name}: no host sync in the steady-state step ({str(e)[:200]})"] = False
            finally:
                torch.cuda.set_sync_debug_mode("default")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    eager()
            torch.cuda.current_stream().wait_stream(side)
            hidden.grad = layer.weight.grad = None
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = step()
            grads = (hidden.grad, layer.weight.grad)
            graph.replay()
            torch.cuda.synchronize()
            got = (static.clone(), grads[0].clone(), grads[1].clone())
        else:
            got = eager()
        errs.update({f"{'loss' if k == 'value' else k} {name} replay": rel(a, r)
                     for k, a, r in zip(("value", "dx", "dw"), got, ref)})
        # a new batch copied into the captured inputs, replayed, against eager on it
        x1, labels1, mask1, adv1 = batch(2)
        with torch.no_grad():
            hidden.copy_(x1)
        labels.copy_(labels1), mask.copy_(mask1), adv.copy_(adv1)
        if cuda:
            graph.replay()
            torch.cuda.synchronize()
            got = (static.clone(), grads[0].clone(), grads[1].clone())
        ref = eager()
        if not cuda:
            got = eager()
        errs.update({f"{'loss' if k == 'value' else k} {name} replay new batch": rel(a, r)
                     for k, a, r in zip(("value", "dx", "dw"), got, ref)})
        errs[f"flag {name}: finite"] = all(bool(torch.isfinite(t).all()) for t in got)
        with torch.no_grad():  # back to the first batch for the next output
            hidden.copy_(x0)
        _, labels_, mask_, adv_ = batch(1)
        labels.copy_(labels_), mask.copy_(mask_), adv.copy_(adv_)
    return errs


def _cuda_graph_worker(rank: int, world: int, tmp: str) -> None:
    """One process on GPU 0 (nccl, Megatron's parallel state at TP=1, its CUDA RNG tracker): no CPU shims."""
    import torch.distributed as dist

    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        parallel_state.initialize_model_parallel(1)
        model_parallel_cuda_manual_seed(0)
        errs = _cuda_graph_checks()
    except Exception:  # noqa: BLE001  (reported by the test with the rank's traceback)
        errs = {"error": traceback.format_exc()}
    torch.save(errs, os.path.join(tmp, f"r{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


def _ii_worker(rank: int, world: int, tmp: str) -> None:
    def checks() -> dict:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        return _ii_single_rank_checks() if world == 1 else _ii_parallel_checks(rank, tmp)

    _in_megatron_rank(rank, world, tmp, checks)


@needs_megatron
def test_megatron_ii_single_rank():
    """Issue 62 items 1-7 at TP=1 in one forked process."""
    with tempfile.TemporaryDirectory() as tmp:
        res = run_ranks(_ii_worker, 1, tmp, timeout=400)
    _check_ranks(res, lambda r: 395)  # every check ran


@needs_megatron
@pytest.mark.dist
def test_megatron_ii_parallel():
    """Issue 62 at 2 gloo ranks: TP=2 with and without SP, PP=2 (1F1B), PP=2 x VPP=2 (interleaved), MoE and THD."""
    with tempfile.TemporaryDirectory() as tmp:
        res = run_ranks(_ii_worker, 2, tmp, timeout=500)
    _check_ranks(res, lambda r: (211, 213)[r])  # every check ran (the pipeline stages hold different parameters)
