"""flce_dist.integrations.torchtitan against torchtitan 0.3.0's OWN loss path (imported, not copied):
``ChunkedLossWrapper`` + ``CrossEntropyLoss`` (``_LossParallelCrossEntropy`` under TP), on the same
hidden states, labels (some ignored) and lm_head: the loss, the hidden-state gradient and the
lm_head gradient, float32, to 1e-5 (loss) / 1e-4 (gradients) relative.

- one rank, in process: the loss path; torchtitan's override mechanism (``apply_overrides``)
  swapping the trainer's loss; torchtitan's llama3 ``debugmodel`` (2 of its layers; its CUDA-only
  flex attention swapped for a causal SDPA, the one change) for AdamW steps with each loss;
- one start of 3 gloo ranks (forked where safe: they inherit the imports): spmd_types TP at 3
  ranks (torchtitan's ceil split, V not divisible by P: a short last shard), then, on 2 of them,
  spmd_types TP at 2 (the hidden gradient all-reduced over tp afterwards as torchtitan's norm
  boundary does, and as torchtitan's own test does), the core's partial dX
  (``partial_dx=True``, both strategies), ``partial_dtensor`` (DTensor weight and
  hidden), and the debugmodel parallelized by torchtitan itself: tp=2 under spmd_types with
  sequence parallelism and type checking (``model.parallelize``: torchtitan's own tp
  reduce-scatter of the hidden gradient is the one under test), and FSDP2 over dp=2
  (``apply_fsdp_to_decoder``: the ``[norm, lm_head]`` unit torchtitan builds, each rank its own
  batch).

Not covered on CPU: FSDP under spmd_types (torchtitan 0.3.0's ``apply_fsdp_to_decoder`` there
hands FSDP ``DataParallelMeshDims`` with plain spmd-typed parameters, which torch 2.13's
``fully_shard`` refuses: "all parameters must be DTensors"), so the FSDP run uses the
``partial_dtensor`` backend; ``full_dtensor`` (its trainer distributes the inputs itself).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import tempfile
import traceback
import types

import pytest
import torch

from tests._checks import run_ranks

pytest.importorskip("torchtitan")
pytest.importorskip("spmd_types")
pytest.importorskip("tyro")  # torchtitan.config imports it

B, L, H, V = 2, 40, 48, 301  # V % 2 and V % 3 != 0: torchtitan's ceil split has a short last shard
CHUNKS = 4


def _tol(key: str) -> float:
    """Relative tolerance: 1e-5 on losses, 1e-4 on gradients and weights after optimizer steps."""
    return 1e-5 if key.startswith("loss") else 1e-4


def _stub_triton_kernels() -> None:
    """torchtitan's model package imports its MoE expert-parallel Triton kernels at import time;
    without Triton (a CPU machine) stand in for that one module (llama3 never calls it)."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return
    mod = types.ModuleType(name)

    def _missing(*_a, **_k):
        raise RuntimeError("Triton is not installed")

    for fn in ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
               "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
               "reduce_topk_slots_kernel", "topk_scores_grad_kernel"):
        setattr(mod, fn, _missing)
    sys.modules[name] = mod


def _rel(a, b) -> float:
    if type(a).__name__ == "DTensor":
        a = a.full_tensor()
    if type(b).__name__ == "DTensor":
        b = b.full_tensor()
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[0, :7] = -100
    labels[1, 30:] = -100
    labels[1, 3] = V - 1  # a target in the short last shard
    return hidden, weight, labels


def _torchtitan_loss(vocab: int, chunks: int = CHUNKS):
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    return ChunkedLossWrapper.Config(num_chunks=chunks,
                                     loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)).build()


def _flce_loss(vocab: int | None):
    from flce_dist.integrations.torchtitan import FusedLinearCrossEntropyLoss

    return FusedLinearCrossEntropyLoss.Config(global_vocab_size=vocab).build()


def _run_loss(loss_fn, lm_head, hidden, labels, gvt):
    """One call + backward as torchtitan's trainer does it: (loss, hidden grad, weight grad)."""
    lm_head.zero_grad(set_to_none=True)
    h = hidden.detach().clone().requires_grad_(True)
    loss_fn.set_lm_head(lm_head)
    loss, metrics = loss_fn(h, labels, gvt)
    assert metrics == {}
    loss.backward()
    return loss.detach(), h.grad, lm_head.weight.grad


def _errs(got: tuple, ref: tuple, prefix: str = "") -> dict[str, float]:
    return {f"{k}{prefix}": _rel(a, b) for k, a, b in zip(("loss", "dh", "dw"), got, ref)}


def _check(errs: dict, where: str = "") -> None:
    """Every relative error within its tolerance; ``flag ...`` entries (bools) must be True."""
    bad = {k: e for k, e in errs.items() if not (e is True if k.startswith("flag ") else e < _tol(k))}
    assert not bad, f"{where}: {bad}"


# ---------------------------------------------------------------- one rank, in process


def test_single_rank_matches_chunked_loss_wrapper():
    hidden, weight, labels = _data()
    gvt = (labels != -100).sum()
    lm_head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(weight)
    errs, dh_mean = {}, None
    for name, g in (("mean", gvt), ("sum", None)):  # None: the summed loss
        got = _run_loss(_flce_loss(V), lm_head, hidden, labels, g)
        errs.update(_errs(got, _run_loss(_torchtitan_loss(V), lm_head, hidden, labels, g), f" {name}"))
        dh_mean = got[1] if dh_mean is None else dh_mean
    # evaluation: pred without grad, no_grad (torchtitan's validator)
    tt, fl = _torchtitan_loss(V), _flce_loss(V)
    tt.set_lm_head(lm_head)
    fl.set_lm_head(lm_head)
    with torch.no_grad():
        errs["loss eval"] = _rel(fl(hidden, labels)[0], tt(hidden, labels)[0])
    # the upstream gradient is honoured (scaling the loss scales every gradient)
    h = hidden.clone().requires_grad_(True)
    lm_head.zero_grad(set_to_none=True)
    (3.0 * fl(h, labels, gvt)[0]).backward()
    errs["dh x3"] = _rel(h.grad, 3.0 * dh_mean)
    _check(errs)


def test_errors_and_override():
    """Argument errors name the argument; torchtitan's own override mechanism on a config tree
    shaped like ``llama3_debugmodel``'s (``Trainer.Config.loss``; the real trainer module needs
    tensorboard and wandb) swaps the loss, with and without JSON keyword options."""
    from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import Configurable
    from torchtitan.config.override import OverrideConfig, apply_overrides

    from flce_dist.integrations.torchtitan import FusedLinearCrossEntropyLoss

    hidden, _, labels = _data()
    fl = _flce_loss(V)
    with pytest.raises(RuntimeError, match="set_lm_head"):
        fl(hidden, labels)
    with pytest.raises(ValueError, match="global_vocab_size"):
        FusedLinearCrossEntropyLoss.Config(global_vocab_size=0).build()
    with pytest.raises(TypeError, match="lm_head"):
        fl.set_lm_head(torch.nn.ReLU())
    fl.set_lm_head(torch.nn.Linear(H, V - 1, bias=False))  # wrong vocabulary: flce_dist's own check
    with pytest.raises(ValueError, match="vocab_size"):
        fl(hidden, labels)

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Root(Configurable.Config):  # the trainer's Config has ``loss: BaseLoss.Config`` like this
        loss: BaseLoss.Config

    target = "flce_dist.integrations.torchtitan.fused_linear_cross_entropy"
    for imports, z in (([target], 0.0), ([(target, {"z_loss": 1e-4})], 1e-4)):
        root = Root(loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=2048)))
        assert len(apply_overrides(OverrideConfig(imports=imports), root)) == 1
        assert type(root.loss) is FusedLinearCrossEntropyLoss.Config
        assert root.loss.global_vocab_size == 2048 and root.loss.z_loss == z
        assert isinstance(root.loss.build(compile_config=None), ChunkedLossWrapper)  # trainer: set_lm_head
    root = Root(loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=2048)))
    with pytest.raises(TypeError, match="temperature"):
        apply_overrides(OverrideConfig(imports=[(target, {"temperature": 2.0})]), root)


# ---------------------------------------------------------------- torchtitan's llama3 debugmodel


def _causal_sdpa_config():
    """A CPU stand-in for torchtitan's FlexAttention (no backward on CPU): causal SDPA with the
    inner-attention call signature; one document per sequence, so the masks are the same."""
    import torch.nn.functional as F
    from torchtitan.protocols.module import Module

    class CausalSDPA(Module):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config):
            super().__init__()

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **_):
            o = F.scaled_dot_product_attention(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                                               is_causal=True, scale=scale, enable_gqa=enable_gqa)
            return o.transpose(1, 2)

    return CausalSDPA.Config()


def _llama3_debug_model(n_layers: int = 2):
    _stub_triton_kernels()
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:n_layers]
    for layer in cfg.layers:
        layer.attention.inner_attention = _causal_sdpa_config()
    return cfg


def _model_steps(backend: str | None = None, dp: int = 1, tp: int = 1, sp: bool = True, typecheck: bool = False,
                 steps: int = 3, seq: int = 16) -> dict[str, float]:
    """A few AdamW steps of torchtitan's llama3 debugmodel with each loss, torchtitan's way
    (``_skip_lm_head``, ``set_lm_head``, loss / global_valid_tokens summed over dp, the forward
    and backward inside torchtitan's spmd context, the backward outside type checking, as its
    trainer's ``_forward_backward_body``). ``backend`` None: no parallelism; else
    ``ParallelDims(dp_shard=dp, tp=tp)`` with torchtitan's ``model.parallelize`` (tp > 1) and
    ``apply_fsdp_to_decoder`` (dp > 1), float32 params and reductions; ``typecheck``: spmd_types type
    checking on (``--debug.spmd_typechecking``). Returns the relative errors
    of every step's loss, the last step's lm_head / first-layer / embedding gradients (this rank's
    shard) and the final lm_head and norm weights."""
    import torch.distributed as dist

    from torchtitan.components.loss import ChunkedLossWrapper

    cfg = _llama3_debug_model()
    vocab = cfg.vocab_size
    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(1 + (rank // tp if dp > 1 else 0))  # a batch per dp rank
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (2, seq + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[0, :3] = -100
        batches.append((tokens[:, :-1], labels))
    ctx = pdims = None
    if backend is not None:
        import torchtitan.distributed.parallel_dims as tt_pd
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.utils import get_spmd_context, set_spmd_backend
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_spmd_backend(backend)
        tt_pd.device_type = "cpu"  # torchtitan falls back to "cuda" when no accelerator is present
        pdims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=dp * tp,
                             spmd_backend=backend)
        pdims.build_mesh()
        ctx = get_spmd_context(parallel_dims=pdims, spmd_typechecking=typecheck)
        set_llama3_sharding_config(cfg, enable_sp=sp)  # what Llama3Model.Config.update_from_config does
    runs = {}
    for name, loss_fn in (("tt", _torchtitan_loss(vocab, chunks=2)), ("flce", _flce_loss(vocab))):
        torch.manual_seed(0)
        model = dataclasses.replace(cfg).build()
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        if tp > 1:
            model.parallelize(pdims)
        if dp > 1:
            from torch.distributed.fsdp import FSDPModule
            from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

            apply_fsdp_to_decoder(model, pdims.get_mesh(["fsdp"]), param_dtype=torch.float32,
                                  reduce_dtype=torch.float32, pp_enabled=False)
            for m in model.modules():  # gloo has no PREMUL_SUM (torchtitan's divide factor 1): plain sums
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        assert isinstance(loss_fn, ChunkedLossWrapper)
        loss_fn.set_lm_head(model.lm_head)  # what the trainer does for a ChunkedLossWrapper
        model._skip_lm_head = True
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for tokens, labels in batches:
            opt.zero_grad()
            gvt = (labels != -100).sum()
            if dp > 1:
                dist.all_reduce(gvt, group=pdims.get_mesh("batch").get_group())
            if ctx is None:
                loss, _ = loss_fn(model(tokens), labels, gvt)
                loss.backward()
            else:
                import spmd_types as spmd

                if backend == "spmd_types":  # the trainer's post_dataloading_process
                    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

                    tokens, labels, _ = annotate_input_spmd_types(pdims, tokens, labels, {})
                with ctx():
                    loss, _ = loss_fn(model(tokens), labels, gvt)
                    with spmd.no_typecheck():
                        loss.backward()
            losses.append(loss.detach().clone())
            grads = {"dw_head": model.lm_head.weight.grad, "dw_layer0": model.layers["0"].feed_forward.w1.weight.grad,
                     "dw_embed": model.tok_embeddings.weight.grad, "dw_norm": model.norm.weight.grad}
            grads = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in grads.items()}
            opt.step()
        final = {k: (w.to_local() if hasattr(w, "to_local") else w).detach().clone()
                 for k, w in (("w_head_final", model.lm_head.weight), ("w_norm_final", model.norm.weight))}
        runs[name] = (torch.stack(losses), grads, final)
    (lt, gt, wt), (lf, gf, wf) = runs["tt"], runs["flce"]
    err = {"loss_steps": _rel(lf, lt)}
    err.update({k: _rel(gf[k], gt[k]) for k in gt})
    err.update({k: _rel(wf[k], wt[k]) for k in wt})
    return err


def test_llama3_debugmodel_training_steps():
    _check(_model_steps(), "one rank")


# ---------------------------------------------------------------- multi-rank (gloo, one spawn)


def _lm_head_tp(world: int, group_rank: int, mesh) -> dict[str, float]:
    """spmd_types TP on the lm_head alone: flce_dist vs ChunkedLossWrapper (and both vs the
    full-vocabulary single-rank loss), the hidden gradient all-reduced over tp afterwards as
    torchtitan's root-norm boundary (R on tp) does."""
    import torch.distributed as dist
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    from flce_dist.distributed.dtensor import chunk_span

    hidden, weight, labels = _data()
    gvt = (labels != -100).sum()
    set_spmd_backend("spmd_types")
    tp = mesh.get_group("tp")
    start, rows = chunk_span(V, world, group_rank)  # torchtitan's ceil split
    lm_head = torch.nn.Linear(H, rows, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(weight[start:start + rows])
    res = {}
    with set_current_spmd_mesh(mesh):
        for name, fn in (("tt", _torchtitan_loss(V)), ("flce", _flce_loss(V))):
            loss, dh, dw = _run_loss(fn, lm_head, hidden, labels, gvt)
            dh = dh.clone()
            dist.all_reduce(dh, group=tp)  # torchtitan's root-norm boundary (R on tp) all-reduces it
            res[name] = (loss, dh, dw.clone())
    full = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        full.weight.copy_(weight)
    loss, dh, dw = _run_loss(_torchtitan_loss(V), full, hidden, labels, gvt)
    out = _errs(res["flce"], res["tt"], f" tp={world}")
    out.update(_errs(res["flce"], (loss, dh, dw[start:start + rows]), f" tp={world} vs full vocab"))
    return out


def _partial_dx(group) -> dict[str, float]:
    """``partial_dx=True``: each rank's dX is its partial, their sum the full dX, the loss and dW
    unchanged; both strategies. Not with sequence parallelism (ValueError)."""
    import torch.distributed as dist

    import flce_dist

    hidden, weight, labels = _data(seed=3)
    r, p = dist.get_rank(group), dist.get_world_size(group)
    a, b = flce_dist.vocab_shard(V, r, p)
    out = {}
    for strategy in ("fused", "recompute"):
        res = []
        for partial in (False, True):
            h, w = hidden.clone().requires_grad_(), weight[a:b].clone().requires_grad_()
            loss = flce_dist.fused_linear_cross_entropy(h, w, labels, group=group, vocab_size=V, strategy=strategy,
                                                        partial_dx=partial)
            loss.backward()
            dh = h.grad.clone()
            if partial:
                out[f"flag partial dX is not the full dX ({strategy})"] = _rel(dh, res[0][1]) > 0.1
                dist.all_reduce(dh, group=group)
            res.append((loss.detach(), dh, w.grad))
        out.update(_errs(res[1], res[0], f" partial_dx {strategy}"))
    with pytest.raises(ValueError, match="sequence_parallel"):
        flce_dist.fused_linear_cross_entropy(hidden[:, :20].clone().requires_grad_(), weight[a:b], labels[:, :20],
                                             group=group, vocab_size=V, sequence_parallel=True, partial_dx=True)
    return out


def _lm_head_dtensor(world: int) -> dict[str, float]:
    """partial_dtensor: DTensor weight Shard(0) and hidden Replicate, as ChunkedLossWrapper takes them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torchtitan.distributed.utils import set_spmd_backend

    hidden, weight, labels = _data()
    gvt = (labels != -100).sum()
    set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    res = {}
    for name, fn in (("tt", _torchtitan_loss(V)), ("flce", _flce_loss(V))):
        head = torch.nn.Linear(H, V, bias=False)
        head.weight = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
        h = DTensor.from_local(hidden.clone(), mesh, [Replicate()]).detach().requires_grad_(True)
        fn.set_lm_head(head)
        loss, _ = fn(h, labels, gvt)
        loss.backward()
        res[name] = (loss.detach(), h.grad.full_tensor(), head.weight.grad.full_tensor())
    set_spmd_backend("spmd_types")
    return _errs(res["flce"], res["tt"], " partial_dtensor tp=2")


def _worker(rank: int, world: int, tmp: str) -> dict[str, float]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _stub_triton_kernels()
    out = {}
    # 3 ranks: the uneven tp=3 split
    out.update(_lm_head_tp(world, rank, init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("dp", "cp", "tp"))))
    dist.destroy_process_group()
    if rank >= 2:
        return out
    # 2 of them, a new world: tp=2, partial dX, DTensor weights, torchtitan-parallelized models
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store2", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp", "cp", "tp"))
    out.update(_lm_head_tp(2, rank, mesh))
    out.update(_partial_dx(mesh.get_group("tp")))
    out.update(_lm_head_dtensor(2))
    out.update({f"{k} spmd_types tp=2 sp": e for k, e in _model_steps("spmd_types", tp=2, typecheck=True).items()})
    out.update({f"{k} fsdp dp=2": e for k, e in _model_steps("partial_dtensor", dp=2).items()})
    return out


def _run(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    import flce_dist

    flce_dist.setup_reference_mode()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        res = _worker(rank, world, tmp)
    except Exception:  # noqa: BLE001  (reported by the test with the rank's traceback)
        res = {"error": traceback.format_exc()}
    torch.save(res, os.path.join(tmp, f"r{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.dist
def test_multi_rank_matches_torchtitan():
    world = 3
    with tempfile.TemporaryDirectory() as tmp:
        res = run_ranks(_run, world, tmp)
    for r, d in enumerate(res):
        assert "error" not in d, f"rank {r}:\n{d['error']}"
        assert len(d) == (6 if r == 2 else 6 + 6 + 8 + 3 + 7 + 7), (r, sorted(d))
        _check(d, f"rank {r}")
