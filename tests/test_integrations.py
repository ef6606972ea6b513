"""Integrations: Hugging Face transformers (``flce_dist.integrations.transformers``) and DeepSpeed
AutoTP (``flce_dist.integrations.deepspeed``), on the CPU (Helion reference mode, gloo).

The multi-rank checks run this same file under torchrun (``python tests/test_integrations.py hf|ds``):

    torchrun --nproc_per_node=2 tests/test_integrations.py hf   # apply(model, group) at TP=2 == TP=1
    DS_ACCELERATOR=cpu torchrun --nproc_per_node=4 tests/test_integrations.py ds 1 2 3
    DS_ACCELERATOR=cuda FLCE_DS_BACKEND=nccl torchrun --nproc_per_node=2 tests/test_integrations.py ds 1 2 3   # GPUs
        # DeepSpeed AutoTP 2 x DP 2, ZeRO 1/2/3 with configs/deepspeed/zero*_autotp2.json:
        # flce_dist == DeepSpeed's "torch" vocab-parallel CE backend over three SGD steps
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SMALL_BLOCKS = {  # several tiles in every dimension (V = 97, H = 32, N = 2 * 9)
    "lse_forward": {"block_n": 8, "block_v": 32, "block_h": 16},
    "chunk_stats": {"block_n": 8, "block_s": 64, "block_v": 32},
    "chunk_grad": {"block_n": 8, "block_v": 32},
}
VOCAB = 97
BODY_PARAM = "model.layers.0.mlp.down_proj.weight"


def tiny_model(model_type: str, tied: bool, seed: int = 0, layers: int = 1):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    if model_type == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif model_type == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif model_type == "gemma2":
        # a small cap so that softcapping changes the loss noticeably
        cfg, cls = tf.Gemma2Config(**common, head_dim=8, final_logit_softcapping=2.0), tf.Gemma2ForCausalLM
    else:
        raise ValueError(model_type)
    torch.manual_seed(seed)
    model = cls(cfg).float()
    # random (not zero/one) norms and a larger lm_head so the logits spread out
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        model.get_output_embeddings().weight.mul_(5.0 if tied else 20.0)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    return model


def batch(seed: int = 1, b: int = 2, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    return ids, labels


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def grads(model):
    return {
        "head": model.get_output_embeddings().weight.grad.clone(),
        "embed": model.get_input_embeddings().weight.grad.clone(),
        "body": dict(model.named_parameters())[BODY_PARAM].grad.clone(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], world: int = 2, extra_env: dict | None = None, timeout: int = 900):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", str(Path(__file__).resolve()), *args]
    env = {**os.environ, "HELION_INTERPRET": "1", "OMP_NUM_THREADS": "1", **(extra_env or {})}
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = "\n".join(line for line in (res.stdout + res.stderr).splitlines() if "registered at" not in line)
    return res.returncode, out, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# single process: apply(model) == the unpatched model


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("num_items", [None, 11], ids=["mean", "num_items"])
def test_transformers_apply_matches_unpatched(model_type, tied, num_items):
    pytest.importorskip("transformers")
    from flce_dist import settings
    from flce_dist.integrations.transformers import apply

    ref = tiny_model(model_type, tied)
    fused = apply(copy.deepcopy(ref))
    ids, labels = batch()
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    out_ref = ref(input_ids=ids, labels=labels, **kw)
    with settings.override(blocks=SMALL_BLOCKS):
        out = fused(input_ids=ids, labels=labels, **kw)
    assert out.logits is None
    assert rel(out.loss, out_ref.loss) <= 1e-5, (out.loss.item(), out_ref.loss.item())
    out_ref.loss.backward()
    with settings.override(blocks=SMALL_BLOCKS):
        out.loss.backward()
    g_ref, g = grads(ref), grads(fused)
    for k in g_ref:
        assert rel(g[k], g_ref[k]) <= 1e-5, (k, rel(g[k], g_ref[k]))
    # without labels the model's own forward runs (full logits)
    with torch.no_grad():
        assert torch.equal(fused(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
@pytest.mark.parametrize("applied", [False, True], ids=["plain", "applied"])
def test_transformers_logprobs_and_entropy(model_type, applied):
    """integrations.transformers.logprobs_and_entropy == log_softmax / entropy of the model's own
    logits (its softcap, then the temperature), next-token shift and attention mask, gradients
    into the body and the head included."""
    pytest.importorskip("transformers")
    from flce_dist import settings
    from flce_dist.integrations.transformers import apply, logprobs_and_entropy

    ref = tiny_model(model_type, tied=False)
    fused = apply(copy.deepcopy(ref)) if applied else copy.deepcopy(ref)
    ids, _ = batch()
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # right padding
    with settings.override(blocks=SMALL_BLOCKS):
        logp, ent = logprobs_and_entropy(fused, ids, attention_mask=mask, temperature=0.8)
    logits = ref(input_ids=ids, attention_mask=mask).logits.double() / 0.8
    lsm = torch.log_softmax(logits, -1)[:, :-1]
    keep = mask[:, 1:].bool()
    want_lp = torch.where(keep, lsm.gather(-1, ids[:, 1:, None])[..., 0], 0.0)
    want_ent = torch.where(keep, -(lsm.exp() * lsm).sum(-1), 0.0)
    assert logp.shape == ent.shape == ids.shape and float(logp[:, -1].abs().sum() + ent[:, -1].abs().sum()) == 0
    assert rel(logp[:, :-1], want_lp) <= 1e-5 and rel(ent[:, :-1], want_ent) <= 1e-5
    adv = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))
    ((adv[:, :-1] * want_lp).sum() + 0.5 * want_ent.sum()).backward()
    with settings.override(blocks=SMALL_BLOCKS):
        ((adv * logp).sum() + 0.5 * ent.sum()).backward()
    for name in ("lm_head.weight", BODY_PARAM):
        a, b = dict(fused.named_parameters())[name].grad, dict(ref.named_parameters())[name].grad
        assert rel(a, b) <= 1e-5, (name, rel(a, b))


def test_transformers_apply_options_and_kwargs():
    pytest.importorskip("transformers")
    from flce_dist.integrations.transformers import apply, unapply

    ref = tiny_model("gemma2", tied=True)
    fused = apply(copy.deepcopy(ref))
    ids, labels = batch()
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    shift[1, 2] = 7  # differs from the shifted labels: shift_labels must win
    # shift_labels, a custom ignore_index and return_dict=False, as transformers passes them
    lab = labels.masked_fill(labels == -100, -1)
    shift_c = shift.masked_fill(shift == -100, -1)
    loss_ref = ref(input_ids=ids, labels=lab, shift_labels=shift_c, ignore_index=-1).loss
    loss = fused(input_ids=ids, labels=lab, shift_labels=shift_c, ignore_index=-1, return_dict=False)[0]
    assert rel(loss, loss_ref) <= 1e-5
    # the model's softcap is applied: without it the loss differs; options reach the loss
    assert rel(apply(fused, softcap=None)(input_ids=ids, labels=labels).loss, loss_ref) > 1e-3
    apply(fused, label_smoothing=0.1)
    assert abs(fused(input_ids=ids, labels=labels).loss.item() - ref(input_ids=ids, labels=labels).loss.item()) > 1e-3
    # generation (no labels) goes through the model's own forward
    gen = dict(max_new_tokens=3, do_sample=False)
    assert torch.equal(fused.generate(ids[:, :4], **gen), ref.generate(ids[:, :4], **gen))
    unapply(fused)
    assert fused(input_ids=ids, labels=labels).logits is not None
    with pytest.raises(TypeError, match="unknown loss option"):
        apply(ref, reduction="sum")
    with pytest.raises(ValueError, match="logits_to_keep"):
        apply(copy.deepcopy(ref))(input_ids=ids, labels=labels, logits_to_keep=1)


def test_transformers_classes_exist():
    tf = pytest.importorskip("transformers")
    from flce_dist.integrations.transformers import SUPPORTED_MODEL_TYPES

    for name in ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                 "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"]:
        cls = getattr(tf, name)
        assert cls.config_class.model_type in SUPPORTED_MODEL_TYPES, name


def test_deepspeed_config_section():
    """The "flce_dist" section of the shipped DeepSpeed configs (no DeepSpeed import needed)."""
    from flce_dist.integrations.deepspeed import options_from_config

    for stage in (1, 2, 3):
        path = ROOT / "configs" / "deepspeed" / f"zero{stage}_autotp2.json"
        opts = options_from_config(str(path))
        assert opts == {"ignore_index": -100, "label_smoothing": 0.0, "z_loss": 0.0, "strategy": "auto"}, opts
    base = {"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}}
    assert options_from_config(base) is None
    assert options_from_config({**base, "flce_dist": {"enabled": False, "z_loss": 1e-4}}) is None
    assert options_from_config({**base, "flce_dist": {"z_loss": 1e-4}}) == {"z_loss": 1e-4}
    with pytest.raises(ValueError, match="unknown key"):
        options_from_config({**base, "flce_dist": {"enabled": True, "zloss": 1e-4}})
    liger = {"tensor_parallel": {"autotp_size": 2, "vocab_parallel_ce_backend": "liger"}, "flce_dist": {}}
    with pytest.raises(ValueError, match="vocab_parallel_ce_backend"):
        options_from_config(liger)


def test_deepspeed_config_forms_and_docstring_keys():
    """Every config form deepspeed.initialize accepts (issue 52 finding 9): a dict, a path, and the
    JSON as a URL-safe base64 string; the module docstring lists every accepted section key."""
    import base64
    import json

    from flce_dist.integrations import deepspeed as fds

    cfg = {"train_micro_batch_size_per_gpu": 2, "flce_dist": {"z_loss": 1e-4, "check_inputs": True}}
    b64 = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    assert fds.load_config(b64) == cfg
    assert fds.options_from_config(b64) == {"z_loss": 1e-4, "check_inputs": True}
    path = ROOT / "configs" / "deepspeed" / "zero1_autotp2.json"
    assert fds.load_config(str(path)) == fds.load_config(path) == json.loads(path.read_text())
    for bad in ("not-a-file-nor-base64", base64.urlsafe_b64encode(b"[1, 2]").decode()):
        with pytest.raises(ValueError, match="base64"):
            fds.load_config(bad)
    doc = fds.__doc__.split("Section keys", 1)[1].split("\n\n", 1)[0]
    missing = [k for k in fds._KEYS if f"``{k}``" not in doc]
    assert not missing, f"the deepspeed module docstring's key list misses {missing}"


@pytest.mark.dist
def test_deepspeed_initialize_takes_a_base64_config():
    """integrations.deepspeed.initialize with the config as base64 (as deepspeed.initialize takes it):
    one CPU rank, a torch optimizer (no JIT-built DeepSpeed one); the section's options reach the model."""
    pytest.importorskip("transformers")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    rc, out, _ = _torchrun(["ds-b64"], world=1, extra_env={"DS_ACCELERATOR": "cpu"}, timeout=600)
    assert rc == 0, out[-6000:]
    assert "[rank 0] ds-b64 ok" in out, out[-4000:]


# ---------------------------------------------------------------------------------------------
# multi-rank: TP=2 == TP=1, DeepSpeed AutoTP flce_dist == DeepSpeed "torch"


@pytest.mark.dist
def test_transformers_tp2_matches_tp1():
    pytest.importorskip("transformers")
    rc, out, secs = _torchrun(["hf"])
    assert rc == 0, out[-6000:]
    summary = re.findall(r"\[rank (\d+)\] hf (\d+) checks ok", out)
    assert sorted(int(r) for r, _ in summary) == [0, 1], out[-3000:]


@pytest.mark.dist
def test_deepspeed_autotp_flce_matches_torch_backend():
    pytest.importorskip("transformers")
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: it probes the accelerator
        pytest.skip("deepspeed is not installed")
    # 4 ranks: AutoTP 2 x data parallel 2, so ZeRO really partitions (stage 3: the head weight too)
    rc, out, secs = _torchrun(["ds", "1", "2", "3"], world=4, extra_env={"DS_ACCELERATOR": "cpu"})
    print(f"deepspeed torchrun: {secs:.1f} s")
    assert rc == 0, out[-8000:]
    names = [f"stage {s} tied={t}" for s in (1, 2, 3) for t in (False, True)] + ["stage 1 tied=False colwise"]
    for name in names:
        ranks = re.findall(rf"\[rank (\d+)\] ds {name} ok", out)
        assert sorted(int(r) for r in ranks) == [0, 1, 2, 3], (name, out[-4000:])


# ---------------------------------------------------------------------------------------------
# torchrun workers


def _check(cond, msg, failures):
    if not cond:
        failures.append(msg)


def _worker_hf(rank: int, world: int, group) -> int:
    from flce_dist import settings, vocab_shard
    from flce_dist.integrations.transformers import apply

    failures, count = [], 0
    ids, labels = batch()
    for model_type, tied in [("llama", False), ("llama", True), ("gemma2", False), ("qwen2", True)]:
        ref = tiny_model(model_type, tied)
        tp = apply(copy.deepcopy(ref), group=group)
        s, e = vocab_shard(VOCAB, rank, world, split="chunk")  # the heads' split (DTensor's)
        kw = {"num_items_in_batch": torch.tensor(9)} if tied else {}
        loss_ref = ref(input_ids=ids, labels=labels, **kw).loss
        with settings.override(blocks=SMALL_BLOCKS):
            loss = tp(input_ids=ids, labels=labels, **kw).loss
        loss_ref.backward()
        with settings.override(blocks=SMALL_BLOCKS):
            loss.backward()
        g_ref, g = grads(ref), grads(tp)
        tag = f"{model_type} tied={tied}"
        count += 4
        _check(rel(loss, loss_ref) <= 1e-5, f"{tag} loss {loss.item()} vs {loss_ref.item()}", failures)
        # tied: the embedding is vocab-parallel too, its weight the head's shard
        head_ref, embed_ref = g_ref["head"][s:e], g_ref["embed"][s:e] if tied else g_ref["embed"]
        _check(tuple(tp.get_output_embeddings().weight.shape) == (e - s, 32), f"{tag} head shape", failures)
        _check(rel(g["head"], head_ref) <= 1e-5, f"{tag} head grad {rel(g['head'], head_ref):.2e}", failures)
        _check(rel(g["embed"], embed_ref) <= 1e-5, f"{tag} embed grad", failures)
        _check(rel(g["body"], g_ref["body"]) <= 1e-5, f"{tag} body grad {rel(g['body'], g_ref['body']):.2e}", failures)
        if not tied:  # per-token log-probs and entropy through the vocab-sharded head
            from flce_dist.integrations.transformers import logprobs_and_entropy

            count += 2
            with settings.override(blocks=SMALL_BLOCKS):
                lp, ent = logprobs_and_entropy(tp, ids, temperature=0.7)
            with torch.no_grad():
                lsm = torch.log_softmax(ref(input_ids=ids).logits.double() / 0.7, -1)[:, :-1]
            _check(rel(lp[:, :-1], lsm.gather(-1, ids[:, 1:, None])[..., 0]) <= 1e-5, f"{tag} TP logprobs", failures)
            _check(rel(ent[:, :-1], -(lsm.exp() * lsm).sum(-1)) <= 1e-5, f"{tag} TP entropy", failures)
        with torch.no_grad():  # no labels: the sharded head's logits are gathered to the full vocabulary
            count += 1
            full, full_ref = tp(input_ids=ids).logits, ref(input_ids=ids).logits
            _check(full.shape == full_ref.shape and rel(full, full_ref) <= 1e-6, f"{tag} logits", failures)
    for f in failures:
        print(f"[rank {rank}] FAIL {f}", flush=True)
    if not failures:
        print(f"[rank {rank}] hf {count} checks ok", flush=True)
    return 1 if failures else 0


def _ds_config(stage: int, flce: bool, vocab_parallel_lm_head: bool = True) -> dict:
    """The shipped configs/deepspeed/zero<stage>_autotp2.json, made CPU- and test-sized."""
    import json

    with open(ROOT / "configs" / "deepspeed" / f"zero{stage}_autotp2.json") as f:
        cfg = json.load(f)
    cfg.update({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10 ** 6,
        "bf16": {"enabled": False},  # fp32 on the CPU
        "zero_allow_untested_optimizer": True,  # plain torch SGD: no JIT-built DeepSpeed optimizer
    })
    assert cfg["tensor_parallel"]["vocab_parallel_ce_backend"] == "torch" and cfg["flce_dist"]["enabled"]
    cfg["tensor_parallel"]["vocab_parallel_lm_head"] = vocab_parallel_lm_head
    if not flce:
        del cfg["flce_dist"]  # DeepSpeed's own "torch" vocab-parallel CE backend
    return cfg


def _worker_ds(rank: int, world: int, stages: list[int]) -> int:
    import deepspeed

    from flce_dist import settings
    from flce_dist.integrations import deepspeed as fds
    from flce_dist.integrations.transformers import apply

    failures = []
    # (stage, tied, vocab_parallel_lm_head); False: the HF tp_plan's column-parallel lm_head with gathered
    # logits (deepspeed LinearLayer), where DeepSpeed uses the model's own full-vocabulary loss
    cases = [(s, t, True) for s in stages for t in (False, True)] + [(stages[0], False, False)]
    for stage, tied, vocab_parallel in cases:
        name = f"stage {stage} tied={tied}" + ("" if vocab_parallel else " colwise")
        t0 = time.perf_counter()
        losses = {}
        # "torch": DeepSpeed's backend; "flce": fds.initialize with the "flce_dist" section;
        # "apply": transformers.apply(model) before a plain deepspeed.initialize (how the HF Trainer would do it)
        for how in ("torch", "flce") + (("apply",) if stage == stages[0] and vocab_parallel else ()):
            model = tiny_model("llama", tied=tied)
            opt = torch.optim.SGD(model.parameters(), lr=0.2)
            if how == "apply":
                apply(model)
                engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_ds_config(stage, False))
            else:
                engine, *_ = fds.initialize(model=model, optimizer=opt,
                                            config=_ds_config(stage, how == "flce", vocab_parallel))
            head = engine.module.get_output_embeddings()
            expected = "VocabParallelLinear" if vocab_parallel else "LinearLayer"
            if type(head).__name__ != expected or head.weight.shape[0] >= VOCAB:
                failures.append(f"{name}: lm_head is {type(head).__name__} {tuple(head.weight.shape)}, not a {expected} shard")
            ids, labels = batch(seed=1 + engine.mpu.get_data_parallel_rank())  # the same within a TP group
            ids, labels = ids.to(engine.device), labels.to(engine.device)
            on_cpu = engine.device.type == "cpu"
            run = []
            for _ in range(3):  # three SGD steps: the later losses check the gradients end to end
                with settings.override(blocks=SMALL_BLOCKS) if on_cpu else contextlib.nullcontext():
                    out = engine(input_ids=ids, labels=labels)
                    if (how == "torch") != (out.logits is not None):
                        failures.append(f"{name} {how}: logits {'missing' if how == 'torch' else 'materialised'}")
                    engine.backward(out.loss)
                engine.step()
                run.append(out.loss.detach().clone())
            losses[how] = torch.stack(run)
            engine.destroy()
        for how in losses:
            err = rel(losses[how], losses["torch"])
            if not err <= 1e-5:
                failures.append(f"{name} {how}: {losses[how].tolist()} vs torch "
                                f"{losses['torch'].tolist()} ({err:.2e})")
        print(f"[rank {rank}] ds {name} {'FAILED' if failures else 'ok'}: losses "
              f"{losses['flce'].tolist()} ({time.perf_counter() - t0:.1f} s)", flush=True)
    for f in failures:
        print(f"[rank {rank}] FAIL {f}", flush=True)
    return 1 if failures else 0


def _worker_ds_b64() -> int:
    import base64
    import json

    from flce_dist import settings
    from flce_dist.integrations import deepspeed as fds
    from flce_dist.integrations.transformers import apply, is_applied

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
           "zero_allow_untested_optimizer": True, "flce_dist": {"z_loss": 1e-3}}
    b64 = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    model = tiny_model("llama", tied=False)
    ref = apply(copy.deepcopy(model), z_loss=1e-3)
    engine, *_ = fds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=b64)
    ids, labels = batch()
    with settings.override(blocks=SMALL_BLOCKS):
        loss, loss_ref = engine(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss
    ok = is_applied(engine.module) and rel(loss, loss_ref) <= 1e-6
    print(f"[rank 0] ds-b64 {'ok' if ok else 'FAILED'}: applied {is_applied(engine.module)}, loss {loss.item()} vs "
          f"{loss_ref.item()}", flush=True)
    engine.destroy()
    return 0 if ok else 1


def _main(argv: list[str]) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mode = argv[0]
    if mode == "ds-b64":
        import deepspeed

        from flce_dist.integrations.deepspeed import skip_cpu_shm_comm_build

        skip_cpu_shm_comm_build()
        deepspeed.init_distributed(dist_backend="gloo")
        try:
            return _worker_ds_b64()
        finally:
            dist.destroy_process_group()
    if mode == "hf":
        dist.init_process_group("gloo")
        try:
            return _worker_hf(rank, world, dist.group.WORLD)
        finally:
            dist.destroy_process_group()
    if mode == "ds":
        import deepspeed

        from flce_dist.integrations.deepspeed import skip_cpu_shm_comm_build

        # FLCE_DS_BACKEND=nccl (with DS_ACCELERATOR=cuda): the same check on GPUs (benchmarks/device.sh ds)
        backend = os.environ.get("FLCE_DS_BACKEND", "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        else:
            skip_cpu_shm_comm_build()  # no ~60 s JIT build of DeepSpeed's CPU shared-memory op
        deepspeed.init_distributed(dist_backend=backend)
        try:
            return _worker_ds(rank, world, [int(s) for s in argv[1:]])
        finally:
            dist.barrier()
            dist.destroy_process_group()
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    code = _main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a library background thread still joinable at exit aborted one
    # CI run with "terminate called without an active exception" after every check had passed.
    os._exit(code)
