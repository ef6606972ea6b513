"""flce_dist.integrations.trl inside TRL 1.16's own code, on CPU (Helion reference mode).

- the patched ``_ChunkedLogProbFunction.apply`` vs TRL's own, fields and gradients (temperature,
  softcap, logit scale, bias, -100 targets), and the fallback when TRL-only fields are requested;
- TRL's ``add_fused_lm_head`` forward on a tiny Llama, plain vs patched (labels with -100);
- patch / unpatch: idempotent, the original objects restored;
- a ``GRPOTrainer`` run of 3 steps, plain vs patched from one seed: the same logged losses,
  entropies, grad norms and weight updates, with flce_dist counted as the function that ran;
- 2 gloo ranks: a ``Shard(0)`` DTensor lm_head reaches flce_dist without ``full_tensor()``, an
  FSDP2 head is still gathered as TRL does.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("trl")

import trl.trainer.utils as trl_utils  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from flce_dist.integrations import trl as flce_trl  # noqa: E402
from tests._checks import rel  # noqa: E402

ALL = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
ORIGINAL_FN = trl_utils._ChunkedLogProbFunction
ORIGINAL_DTENSOR = trl_utils.DTensor


@pytest.fixture
def patched():
    flce_trl.patch()
    yield
    flce_trl.unpatch()


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = flce_trl.logprobs_and_entropy

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(flce_trl, "logprobs_and_entropy", counting)
    return calls


def _inputs(n=37, h=24, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(v, h, generator=g)).requires_grad_()
    bias = torch.randn(v, generator=g).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = -100
    return hidden, weight, bias, targets


def _fields_and_grads(fn, hidden, weight, bias, targets, temperature, softcap, scale, outputs):
    out = fn.apply(hidden, weight, bias, targets, temperature, 32768, softcap, scale, outputs)
    valid = targets != -100
    g = torch.Generator().manual_seed(1)
    wl, we = torch.randn(len(targets), generator=g) * valid, torch.randn(len(targets), generator=g) * valid
    objective = (wl * out[0]).sum() + ((we * out[1]).sum() if out[1] is not None else 0)
    grads = torch.autograd.grad(objective, (hidden, weight, bias))
    return [None if o is None else o[valid] for o in out], grads


# TRL's kernel is chained on the model config: logit_scale, then the softcap, then 1 / temperature.
@pytest.mark.parametrize("temperature,softcap,scale", [(0.7, 3.0, 1.7), (1.3, None, 0.6), (1.0, 2.5, 1.0)])
def test_function_matches_trl(patched, spy, small_tiles, temperature, softcap, scale):
    hidden, weight, bias, targets = _inputs()
    ref, ref_g = _fields_and_grads(ORIGINAL_FN, hidden, weight, bias, targets, temperature, softcap, scale,
                                   ("log_probs", "entropy"))
    out, out_g = _fields_and_grads(trl_utils._ChunkedLogProbFunction, hidden, weight, bias, targets, temperature,
                                   softcap, scale, ("log_probs", "entropy"))
    assert len(spy) == 1, "flce_dist did not compute the fields"
    assert out[2:] == [None, None, None]
    for name, a, b in zip(ALL, out[:2], ref[:2]):
        assert a.dtype == torch.float32 and rel(a, b) < 1e-5, name
    for name, a, b in zip(("hidden", "weight", "bias"), out_g, ref_g):
        assert rel(a, b) < 1e-4, name
    # the transform matters at this tolerance: without the logit scale (or the softcap) it is far off
    other, _ = _fields_and_grads(ORIGINAL_FN, hidden, weight, bias, targets, temperature,
                                 None if softcap else 2.0, scale if scale != 1.0 else 1.5, ("log_probs", "entropy"))
    assert rel(other[0], ref[0]) > 1e-3 and rel(other[1], ref[1]) > 1e-3
    # entropy not requested: None, log_probs unchanged
    only = trl_utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets.clamp(min=0), temperature, 32768,
                                                   softcap, scale, ("log_probs",))
    assert only[1] is None and only[0].shape == targets.shape


def test_trl_only_fields_fall_back(patched, spy):
    hidden, weight, bias, targets = _inputs(n=9, v=23)
    targets = targets.clamp(min=0)  # TRL passes no -100 (compact rows or clamped labels)
    ref = ORIGINAL_FN.apply(hidden, weight, bias, targets, 0.8, 32768, 3.0, 1.2, ALL)
    out = trl_utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets, 0.8, 32768, 3.0, 1.2, ALL)
    assert spy == [], "TRL-only fields must run TRL's own function"
    for name, a, b in zip(ALL, out, ref):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="outputs: unknown"):
        trl_utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets, 0.8, 32768, None, 1.0, ("logits",))


def test_patch_unpatch_idempotent():
    assert not flce_trl.is_patched()
    flce_trl.patch()
    flce_trl.patch()
    assert trl_utils._ChunkedLogProbFunction is flce_trl.FlceLogProbFunction
    assert trl_utils.DTensor is not ORIGINAL_DTENSOR
    flce_trl.unpatch()
    flce_trl.unpatch()
    assert trl_utils._ChunkedLogProbFunction is ORIGINAL_FN and trl_utils.DTensor is ORIGINAL_DTENSOR
    assert not flce_trl.is_patched()
    with pytest.raises(ValueError, match="dtensor must be one of"):
        flce_trl.patch(dtensor="replicate")
    assert not flce_trl.is_patched()


def _tiny_llama(vocab=48, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      eos_token_id=2, bos_token_id=None, tie_word_embeddings=False)
    cfg.final_logit_softcapping, cfg.logit_scale = 4.0, 1.5  # read by add_fused_lm_head (Gemma2 / Cohere style)
    return LlamaForCausalLM(cfg)


def _fused_step(model, ids, labels):
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    g = torch.Generator().manual_seed(2)
    obj = (torch.randn(out.log_probs.shape, generator=g) * out.log_probs).sum() + 0.3 * out.entropy.sum()
    grads = torch.autograd.grad(obj, [p for p in model.parameters()])
    return out, grads


def test_fused_lm_head_forward_matches_trl(spy, small_tiles):
    model = _tiny_llama()
    trl_utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ids = torch.randint(3, 48, (2, 9), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :4] = -100
    labels[1, 6:] = -100
    ref, ref_g = _fused_step(model, ids, labels)
    flce_trl.patch()
    try:
        out, out_g = _fused_step(model, ids, labels)
    finally:
        flce_trl.unpatch()
    assert len(spy) == 1
    mask = labels[:, 1:] != -100
    for name in ("log_probs", "entropy"):
        a, b = getattr(out, name), getattr(ref, name)
        assert a.shape == mask.shape and (a[~mask] == 0).all(), name
        assert rel(a, b) < 1e-5, name
    assert rel(out.loss, ref.loss) < 1e-5
    for (name, _), a, b in zip(model.named_parameters(), out_g, ref_g):
        assert rel(a, b) < 1e-4, name


# ---------------------------------------------------------------- GRPOTrainer, plain vs patched


def _tokenizer(vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _grpo_run(seed=0):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = _tiny_llama(seed=seed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(8)]})

    def reward(completions, **kwargs):
        return [c.count("w3") - 0.1 * len(c.split()) for c in completions]

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, use_cpu=True, beta=0.0, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=4, max_steps=3, num_iterations=2, learning_rate=5e-2,
                          temperature=0.7, logging_steps=1, report_to="none", save_strategy="no", seed=seed,
                          bf16=False, dataloader_num_workers=0, disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=_tokenizer(48))
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "entropy" in entry]
    updates = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    return logs, updates


def test_grpo_trainer_plain_vs_patched(spy, small_tiles):
    plain_logs, plain_updates = _grpo_run()
    assert spy == []
    flce_trl.patch()
    try:
        logs, updates = _grpo_run()
    finally:
        flce_trl.unpatch()
    # 3 steps, each scoring its batch (num_iterations=2: old log-probs once per generation, with grad every step)
    assert len(spy) >= 3, len(spy)
    assert all(c["temperature"] == pytest.approx(0.7 / 1.5) and c["softcap"] == pytest.approx(4.0 / 1.5) for c in spy)
    assert len(logs) == len(plain_logs) == 3
    assert any(abs(entry["loss"]) > 1e-4 for entry in plain_logs), "the second iteration has a non-trivial loss"
    for entry, ref in zip(logs, plain_logs):
        assert entry.keys() == ref.keys()
        for key in ("loss", "entropy", "grad_norm") + (("reward",) if "reward" in ref else ()):
            assert entry[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (key, entry, ref)
    for name, upd in updates.items():
        assert upd.abs().max() > 0, f"{name} was not updated"
        assert rel(upd, plain_updates[name]) < 1e-3, name


# ---------------------------------------------------------------- 2 gloo ranks: DTensor heads


def _dtensor_worker(rank, init_file, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import flce_dist

    flce_dist.setup_reference_mode()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = _tiny_llama(vocab=47)  # 47 rows over 2 ranks: 24 + 23
        trl_utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
        model.lm_head.weight = torch.nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)]))
        ids = torch.randint(3, 47, (2, 7), generator=torch.Generator().manual_seed(3))
        labels = ids.masked_fill(torch.arange(7) < 2, -100)
        ref, ref_g = _fused_step(model, ids, labels)  # TRL: full_tensor() of the head
        gathers = []
        real_full = DTensor.full_tensor

        def counting_full(self, *a, **k):
            gathers.append(tuple(self.shape))
            return real_full(self, *a, **k)

        DTensor.full_tensor = counting_full
        flce_trl.patch()
        try:
            out, out_g = _fused_step(model, ids, labels)
        finally:
            flce_trl.unpatch()
            DTensor.full_tensor = real_full
        assert gathers == [], f"the vocab-sharded head was gathered: {gathers}"
        for name in ("log_probs", "entropy"):
            assert rel(getattr(out, name), getattr(ref, name)) < 1e-5, name
        for (name, _), a, b in zip(model.named_parameters(), out_g, ref_g):
            if isinstance(a, DTensor):
                assert a.placements == (Shard(0),), name
                a, b = a.to_local(), b.to_local()
            assert rel(a, b) < 1e-4, name
        # an FSDP2 head (Shard(0) over data-parallel ranks) is gathered as TRL does; "shard" forces the shard path
        from torch.distributed.fsdp import fully_shard

        lin = torch.nn.Linear(16, 47, bias=False)
        fully_shard(lin, mesh=mesh)
        flce_trl.patch()
        try:
            assert isinstance(lin.weight, DTensor) and isinstance(lin.weight, trl_utils.DTensor)
            assert not isinstance(model.lm_head.weight, trl_utils.DTensor)
            flce_trl.patch(dtensor="shard")
            assert not isinstance(lin.weight, trl_utils.DTensor)
            flce_trl.patch(dtensor="gather")
            assert isinstance(model.lm_head.weight, trl_utils.DTensor)
        finally:
            flce_trl.unpatch()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_dtensor_vocab_shard_stays_sharded(tmp_path):
    from tests._checks import spawn

    os.environ.setdefault("HELION_INTERPRET", "1")
    spawn(_dtensor_worker, 2, str(tmp_path / "rdzv"), 2)
