"""verl 0.9.1 adapter (``flce_dist.integrations.verl``): the drop-in ``linear_cross_entropy``
against the float64 reference at 1 and 3 gloo ranks (uneven shards, a temperature, values and
gradients, verl's partial-dX convention), against verl's own torch backend, and ``patch()`` /
``unpatch()`` inside verl's code: the kernel module's name, an import-time (Megatron-style)
binding, verl's FSDP forward reaching flce_dist, and verl's external-module hooks.

verl needs ``ray``, ``tensordict`` and ``omegaconf`` to import; the tests that need verl skip
without it. The multi-rank test needs no verl (the function imports none)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
import types

import pytest
import torch

import flce_dist
from flce_dist import reference_logprobs_and_entropy
from flce_dist.integrations import verl as flce_verl
from tests._checks import ROOT, SMALL_BLOCKS, rel, run_ranks

V, H, T = 52, 40, 0.7  # H not a multiple of 128 (verl's kernel asserts H % 128 == 0)


def _inputs(shape=(2, 7), seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, shape, generator=g)
    if ignore:
        labels.view(-1)[[1, 5]] = -100
    n = labels.numel()
    return hidden, weight, labels, torch.randn(n, generator=g), torch.randn(n, generator=g)


def _reference(hidden, weight, labels, g_lp, g_ent):
    """float64 logprobs, entropy [N] and the gradients of ``g_lp . logp + g_ent . entropy``."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    lp, ent = reference_logprobs_and_entropy(h, w, labels, temperature=T)
    lp, ent = lp.reshape(-1), ent.reshape(-1)
    dh, dw = torch.autograd.grad((g_lp.double() * lp).sum() + (g_ent.double() * ent).sum(), (h, w))
    return lp.detach(), ent.detach(), dh, dw


def _ours(hidden, weight, labels, g_lp, g_ent, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = flce_verl.linear_cross_entropy(h, w, labels, T, "none", **kw)
    dh, dw = torch.autograd.grad((g_lp * lp).sum() + (g_ent * ent).sum(), (h, w))
    return lp, ent, dh, dw


# ----------------------------------------------------------------------------- one rank


def test_single_rank_matches_reference(small_tiles):
    hidden, weight, labels, g_lp, g_ent = _inputs()
    lp, ent, dh, dw = _ours(hidden, weight, labels, g_lp, g_ent)
    r_lp, r_ent, r_dh, r_dw = _reference(hidden, weight, labels, g_lp, g_ent)
    assert lp.shape == ent.shape == (14,) and lp.dtype == ent.dtype == torch.float32  # flat [N], as verl
    assert dh.shape == hidden.shape and dw.shape == weight.shape
    assert rel(lp, r_lp) < 1e-5 and rel(ent, r_ent) < 1e-5
    assert rel(dh, r_dh) < 1e-4 and rel(dw, r_dw) < 1e-4
    assert lp[[1, 5]].abs().max() == 0 and ent[[1, 5]].abs().max() == 0  # ignore_index: 0, no gradient


@pytest.mark.parametrize("reduction", ["sum", "MEAN"])
def test_reductions(small_tiles, reduction):
    """verl's sum / mean: a 0-d logprob sum (mean: / N, all N tokens, ignored ones included),
    entropy still per token."""
    hidden, weight, labels, _, g_ent = _inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = flce_verl.linear_cross_entropy(h, w, labels, temperature=T, reduction=reduction)
    assert lp.shape == () and ent.shape == (14,)
    dh, dw = torch.autograd.grad(2.0 * lp + (g_ent * ent).sum(), (h, w))
    scale = 2.0 / 14 if reduction == "MEAN" else 2.0
    r_lp, r_ent, r_dh, r_dw = _reference(hidden, weight, labels, torch.full((14,), scale), g_ent)
    assert rel(lp, r_lp.sum() * scale / 2.0) < 1e-5 and rel(ent, r_ent) < 1e-5
    assert rel(dh, r_dh) < 1e-4 and rel(dw, r_dw) < 1e-4


def test_argument_errors():
    hidden, weight, labels, _, _ = _inputs()
    with pytest.raises(ValueError, match="reduction"):
        flce_verl.linear_cross_entropy(hidden, weight, labels, T, "max")
    with pytest.raises(ValueError, match="labels"):
        flce_verl.linear_cross_entropy(hidden, weight, labels[:, :-1], T)
    with pytest.raises(TypeError, match="temperature"):
        flce_verl.linear_cross_entropy(hidden, weight, labels, torch.tensor(0.7))
    with pytest.raises(ValueError, match="temperature"):
        flce_verl.linear_cross_entropy(hidden, weight, labels, 0.0)
    with pytest.raises(TypeError, match="dist_process_group"):
        flce_verl.linear_cross_entropy(hidden, weight, labels, T, "none", "tp")


def test_matches_verl_torch_backend(small_tiles):
    """verl's own torch implementation of the same contract (``FusedLinearForPPO``, the FSDP
    engine's ``impl_backend=torch``): values and gradients."""
    tf = pytest.importorskip("verl.utils.experimental.torch_functional")
    hidden, weight, labels, g_lp, g_ent = _inputs(shape=(1, 13), seed=3, ignore=False)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    v_lp, v_ent = tf.FusedLinearForPPO(chunk_size=5)(h, w, labels, temperature=T)
    v_dh, v_dw = torch.autograd.grad((g_lp * v_lp.reshape(-1)).sum() + (g_ent * v_ent.reshape(-1)).sum(), (h, w))
    lp, ent, dh, dw = _ours(hidden, weight, labels, g_lp, g_ent)
    assert rel(lp, v_lp.reshape(-1)) < 1e-5 and rel(ent, v_ent.reshape(-1)) < 1e-5
    assert rel(dh, v_dh) < 1e-4 and rel(dw, v_dw) < 1e-4


# ----------------------------------------------------------------------------- 3 gloo ranks


def _tp_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    hidden, weight, labels, g_lp, g_ent = _inputs(seed=1)
    r_lp, r_ent, r_dh, r_dw = _reference(hidden, weight, labels, g_lp, g_ent)
    errs = {}
    splits = {"vocab_shard": [flce_dist.vocab_shard(V, r, world) for r in range(world)],
              "torch.chunk": []}
    start = 0
    for piece in torch.arange(V).chunk(world):
        splits["torch.chunk"].append((start, start + len(piece)))
        start += len(piece)
    assert splits["vocab_shard"] != splits["torch.chunk"]  # 18/17/17 vs 18/18/16
    for name, bounds in splits.items():
        a, b = bounds[rank]
        w_local = weight[a:b]
        # shards of unequal sizes (beyond verl's equal ones): the layout stated by vocab_size (rank
        # order) or vocab_start; a group per layout (the shard check runs once per stated layout)
        for how, kw in (("vocab_size", {"vocab_size": V}), ("vocab_start", {"vocab_start": a})):
            group = dist.new_group(list(range(world)))
            lp, ent, dh, dw = _ours(hidden, w_local, labels, g_lp, g_ent, dist_process_group=group, **kw)
            errs[f"{name} {how} logprobs"] = rel(lp, r_lp)
            errs[f"{name} {how} entropy"] = rel(ent, r_ent)
            errs[f"{name} {how} dW"] = rel(dw, r_dw[a:b])
            errs[f"{name} {how} partial dX is not dX"] = float(rel(dh, r_dh) < 1e-2)
            summed = dh.clone()
            dist.all_reduce(summed, group=group)  # what Megatron's reduce-scatter / all-reduce does with verl's partials
            errs[f"{name} {how} sum of partial dX"] = rel(summed, r_dh)
            _, _, dh_full, _ = _ours(hidden, w_local, labels, g_lp, g_ent, dist_process_group=group,
                                     full_grad_hidden=True, **kw)
            errs[f"{name} {how} full_grad_hidden dX"] = rel(dh_full, r_dh)
    # a Shard(0) DTensor weight (torch.chunk split): group and vocab_start from the mesh, full dX
    mesh = init_device_mesh("cpu", (world,))
    w_dt = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    h = hidden.clone().requires_grad_()
    lp, ent = flce_verl.linear_cross_entropy(h, w_dt, labels, T)
    dh, dw = torch.autograd.grad((g_lp * lp).sum() + (g_ent * ent).sum(), (h, w_dt))
    a, b = splits["torch.chunk"][rank]
    errs["DTensor logprobs"] = rel(lp, r_lp)
    errs["DTensor entropy"] = rel(ent, r_ent)
    errs["DTensor dX"] = rel(dh, r_dh)
    errs["DTensor dW"] = rel(dw.to_local(), r_dw[a:b]) if isinstance(dw, DTensor) else float("inf")
    return errs


def _run(rank, world, tmp, worker=None):
    """One gloo rank: ``worker(rank, world)`` (default ``_tp_worker``) in reference mode with several tiles; its
    result (or the traceback) saved for the test."""
    import torch.distributed as dist

    flce_dist.setup_reference_mode()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        with flce_dist.override(blocks=SMALL_BLOCKS):
            res = (worker or _tp_worker)(rank, world)
    except Exception:  # noqa: BLE001  (reported by the test, with the rank's traceback)
        res = {"error": traceback.format_exc()}
    torch.save(res, os.path.join(tmp, f"r{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.dist
def test_three_ranks_uneven_shards_match_reference():
    world = 3
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_run, world, tmp)
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}:\n{res.get('error')}"
        assert len(res) == 28, res
        bad = {k: e for k, e in res.items() if not e < (1e-5 if "logprobs" in k or "entropy" in k else 1e-4)}
        assert not bad, f"rank {rank}: {bad}"


def _equal_shards_worker(rank, world):
    """verl's own layout (equal shards, nothing stated): 8 RL micro-batches of distinct token counts;
    the shard check's handshakes and every all-reduce counted (issue 52 finding 7: one handshake per
    token count and an all-reduce of dX divided by P before)."""
    import torch.distributed as dist

    from flce_dist.distributed import shard

    counts = {"handshakes": 0, "all_reduce": 0}
    real_gather, real_reduce = shard.all_gather_rows, dist.all_reduce

    def gather(t, group):
        counts["handshakes"] += 1
        return real_gather(t, group)

    def reduce(*a, **k):
        counts["all_reduce"] += 1
        return real_reduce(*a, **k)

    v_eq = 52  # 26 rows per rank: verl's equal split
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(v_eq, H, generator=g) * 0.5
    lo, hi = rank * v_eq // world, (rank + 1) * v_eq // world
    group = dist.new_group(list(range(world)))
    batches = []
    shard.all_gather_rows, dist.all_reduce = gather, reduce
    try:
        for i in range(8):
            hidden = torch.randn(1, 3 + i, H, generator=g)
            labels = torch.randint(0, v_eq, (1, 3 + i), generator=g)
            g_lp, g_ent = torch.randn(3 + i, generator=g), torch.randn(3 + i, generator=g)
            lp, ent, dh, dw = _ours(hidden, weight[lo:hi], labels, g_lp, g_ent, dist_process_group=group)
            batches.append((hidden, labels, g_lp, g_ent, lp, ent, dh, dw))
    finally:
        shard.all_gather_rows, dist.all_reduce = real_gather, real_reduce
    errs = {}
    for i, (hidden, labels, g_lp, g_ent, lp, ent, dh, dw) in enumerate(batches):
        r_lp, r_ent, r_dh, r_dw = _reference(hidden, weight, labels, g_lp, g_ent)
        summed = dh.clone()
        dist.all_reduce(summed, group=group)  # the caller's (Megatron's) sum of verl's partials
        errs[i] = (rel(lp, r_lp), rel(ent, r_ent), rel(dw, r_dw[lo:hi]), rel(summed, r_dh), rel(dh, r_dh))
    return {"counts": counts, "errs": errs}


def _run_equal(rank, world, tmp):
    _run(rank, world, tmp, _equal_shards_worker)


@pytest.mark.dist
def test_equal_shards_one_handshake_and_no_dx_all_reduce():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_run_equal, 2, tmp)
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}:\n{res.get('error')}"
        assert res["counts"]["handshakes"] <= 1, res["counts"]  # verl's layout is stated: not one per token count
        assert res["counts"]["all_reduce"] == 0, res["counts"]  # partial dX (verl's convention): no dX collective
        for i, (lp, ent, dw, summed, partial) in res["errs"].items():
            assert lp < 1e-5 and ent < 1e-5 and dw < 1e-4 and summed < 1e-4, (rank, i, res["errs"][i])
            assert partial > 1e-2, (rank, i)  # each rank's own partial, not the summed dX


# ----------------------------------------------------------------------------- patch() inside verl


@pytest.fixture
def verl_kernel():
    mod = pytest.importorskip(flce_verl.KERNEL_MODULE)
    original = mod.linear_cross_entropy
    yield mod
    flce_verl.unpatch()
    mod.linear_cross_entropy = original


def _megatron_stand_in(name):
    """A module with Megatron's forward binding (``model_forward_fused.py`` line 35: ``from
    verl.utils.kernel.linear_cross_entropy import linear_cross_entropy`` at import, called with
    verl's positional arguments); the real one needs megatron-core (Python >= 3.12 for 0.17+)."""
    mod = types.ModuleType(name)
    exec("from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy\n"
         "def fused_output_processor(hidden_states, weight, labels, temperature, group):\n"
         "    return linear_cross_entropy(hidden_states, weight, labels, temperature, 'none', group)\n", mod.__dict__)
    return mod


def _tiny_llama(backend):
    """A 1-layer Llama whose class verl patches (``patch_forward_with_backends``: a class-level
    forward swap, so on a subclass of its own)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False)
    model = type(f"TinyLlama_{backend}", (LlamaForCausalLM,), {})(cfg)
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=backend)
    return model


def _fsdp_step(model, ids):
    """verl's FSDP fused call: ``model(input_ids, temperature=..., return_dict=True)`` ->
    ``(log_probs, entropy)``, and the gradients of a PPO-like objective."""
    out = model(input_ids=ids, temperature=T, return_dict=True)
    lp, ent = out.log_probs.reshape(-1), out.entropy.reshape(-1)
    g = torch.Generator().manual_seed(2)
    obj = (torch.randn(lp.shape, generator=g) * lp).sum() + 0.3 * ent.sum()
    return lp, ent, torch.autograd.grad(obj, list(model.parameters()))


def test_patch_swaps_both_bindings_and_verl_reaches_flce(verl_kernel, monkeypatch, small_tiles):
    original = verl_kernel.linear_cross_entropy
    early = _megatron_stand_in(flce_verl.BOUND_MODULES[0])  # imported before patch(): bound to verl's
    monkeypatch.setitem(sys.modules, early.__name__, early)
    assert early.linear_cross_entropy is original

    ids = torch.randint(1, V, (1, 9), generator=torch.Generator().manual_seed(4))
    triton_model, torch_model = _tiny_llama("triton"), _tiny_llama("torch")
    triton_model.load_state_dict(torch_model.state_dict())
    with pytest.raises(Exception):  # noqa: B017  verl's own kernel: CUDA + Triton only
        _fsdp_step(triton_model, ids)

    calls = []
    real = flce_verl.logprobs_and_entropy
    monkeypatch.setattr(flce_verl, "logprobs_and_entropy", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    patched = flce_verl.patch()
    assert patched == [flce_verl.KERNEL_MODULE, early.__name__]
    assert verl_kernel.linear_cross_entropy is flce_verl.linear_cross_entropy
    assert early.linear_cross_entropy is flce_verl.linear_cross_entropy
    assert flce_verl.patch() == patched  # idempotent
    late = _megatron_stand_in(flce_verl.BOUND_MODULES[1])  # imported after patch(): binds flce_dist's
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert late.linear_cross_entropy is flce_verl.linear_cross_entropy

    lp, ent, grads = _fsdp_step(triton_model, ids)  # verl's forward_with_triton_backend, unchanged
    assert calls == [(9, H)], calls
    r_lp, r_ent, r_grads = _fsdp_step(torch_model, ids)  # verl's torch backend, same weights
    assert rel(lp, r_lp) < 1e-5 and rel(ent, r_ent) < 1e-5
    for (name, _), a, b in zip(triton_model.named_parameters(), grads, r_grads):
        assert rel(a, b) < 1e-4, name
    early.fused_output_processor(torch.randn(4, H), torch.randn(V, H), torch.randint(0, V, (4,)), T, None)
    assert len(calls) == 2  # the import-time binding reaches flce_dist too

    flce_verl.unpatch()
    assert verl_kernel.linear_cross_entropy is original
    assert early.linear_cross_entropy is original and late.linear_cross_entropy is original
    assert not flce_verl.is_patched()
    with pytest.raises(Exception):  # noqa: B017  verl's kernel again
        _fsdp_step(triton_model, ids)


def test_external_lib_import_patches(verl_kernel, monkeypatch):
    """``actor_rollout_ref.model.external_lib=flce_dist.integrations.verl_patch``: verl's
    ``HFModelConfig.__post_init__`` calls ``import_external_libs(external_lib)``."""
    from verl.utils.import_utils import import_external_libs

    monkeypatch.delitem(sys.modules, "flce_dist.integrations.verl_patch", raising=False)
    assert not flce_verl.is_patched()
    import_external_libs("flce_dist.integrations.verl_patch")
    assert verl_kernel.linear_cross_entropy is flce_verl.linear_cross_entropy
    flce_verl.unpatch()
    assert not flce_verl.is_patched()


def test_import_is_side_effect_free_and_env_hook_patches():
    """``import flce_dist`` / ``flce_dist.integrations.verl`` import no verl and patch nothing;
    ``VERL_USE_EXTERNAL_MODULES=flce_dist.integrations.verl_patch`` patches at ``import verl``."""
    pytest.importorskip(flce_verl.KERNEL_MODULE)
    code = ("import os, sys\n"
            "import flce_dist, flce_dist.integrations.verl as a\n"
            "assert 'verl' not in sys.modules and 'flce_dist.integrations.verl_patch' not in sys.modules\n"
            "os.environ['VERL_USE_EXTERNAL_MODULES'] = 'flce_dist.integrations.verl_patch'\n"
            "import verl.utils.kernel.linear_cross_entropy as k\n"
            "assert k.linear_cross_entropy is a.linear_cross_entropy, k.linear_cross_entropy\n"
            "print('ENV_HOOK_OK')\n")
    env = {**os.environ, "HELION_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ENV_HOOK_OK" in res.stdout, (res.stdout + res.stderr)[-3000:]
