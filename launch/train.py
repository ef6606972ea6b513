"""Train a small Llama-shaped decoder whose lm_head and loss are ``flce_dist`` (the project's main job).

    torchrun --nproc_per_node=N launch/train.py --config configs/train/tiny_cpu.toml [--set key=value ...]
    python launch/train.py --config configs/train/tiny_cpu.toml --head torch       # single-process baseline
    NGPU=2 CONFIG=configs/train/llama_small_gpu.toml bash launch/train.sh          # the same, torchtitan-style

Model: ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (random init, nothing is
downloaded). Its ``lm_head`` is replaced by ``flce_dist.VocabParallelLMHead`` sharded over the
whole torchrun world, which is the tensor-parallel group: rank r owns vocab rows
``vocab_shard(V, r, P)``, initialised by slicing the ``nn.Linear`` that the model drew, so every
world size starts from the same weights. The loss is the fused, vocab-parallel cross entropy:
``hidden = model.model(ids).last_hidden_state``, labels shifted by one, ``loss = lm_head(hidden,
labels)``; no rank ever holds ``[tokens, V]`` logits. The decoder body is **replicated** on every
rank (same init, same data, identical dX from the head's all-reduce, so the replicas stay identical;
this is checked at each checkpoint). A tensor-parallel body, and data parallelism, are out of scope:
each rank sees the same batch.

``--head torch`` (config ``model.head = "torch"``) keeps the model's plain ``nn.Linear`` lm_head and
``F.cross_entropy`` on materialised logits, on a single process: the comparison baseline
(``tests/test_train.py`` checks that both give the same per-step losses).

Data: a real English corpus that every CPython ships offline, ``pydoc_data.topics`` (the text of
the ``help()`` topics, ~470 KB). Tokenizer ``bpe`` (a byte-level BPE of ``data.vocab_size`` trained
on that corpus with the ``tokenizers`` package) or ``byte`` (raw UTF-8 bytes, 256 ids); tokenizer and
token ids are cached under ``data.cache_dir``. ``model.vocab_size`` larger than the tokenizer's pads the
model's vocabulary with rows that no target uses (as Megatron pads; ``llama_small_gpu`` does this
to give the head a realistic size). The token stream is cut into fixed-length sequences
that are visited in a per-epoch permutation drawn from ``job.seed``: the data position (sequences
consumed) alone determines every later batch.

Checkpoints (``checkpoint.ckpt_every`` steps, under ``checkpoint.ckpt_dir``): one file per rank in
``step_<N>/`` (model state incl. the rank's head shard, optimizer state, step, data position, torch /
CUDA / Python RNG states, the loss history), then a ``complete.json`` marker by rank 0 once every
rank has written. ``--resume`` (or ``checkpoint.resume = true``) continues from the latest complete
checkpoint when there is one; a worker restarted by torchrun (``TORCHELASTIC_RESTART_COUNT`` > 0)
always does. A fresh start removes older checkpoints from ``ckpt_dir``. On the CPU, resuming
reproduces the uninterrupted run's losses bit for bit (tests/test_train.py).

Fault injection (for the fault-tolerance test): ``FAIL_AT_STEP=S`` (or ``fault.fail_at_step``)
makes rank ``fault.fail_rank`` SIGKILL itself after step S, on the first attempt only.

Per-step losses go to ``job.losses_file`` (JSON; default ``<out_dir>/losses.json``). Rank 0 logs
and shows a tqdm bar with loss and tokens/s. CPU: gloo, fp32, one thread per rank. CUDA: NCCL,
``cuda:LOCAL_RANK``, ``training.dtype = "bf16"`` for bf16 autocast (fp32 master weights; the
fused loss then runs in bf16).

Config: TOML (see ``configs/train/``), sections ``job data model training checkpoint fault``.
``--set section.key=value`` (or ``key=value`` when the key is unique) overrides a value; the value
is read as TOML, else as a string.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

log = logging.getLogger("flce_dist.train")

DEFAULTS: dict[str, dict[str, Any]] = {
    "job": {
        "seed": 0,
        "out_dir": "runs/train",
        "losses_file": "",        # "" -> <out_dir>/losses.json
        "log_every": 10,
        "progress": "auto",       # tqdm bar on rank 0: "auto" (when stderr is a terminal), "on", "off"
        "device": "auto",         # "auto" (cuda if available), "cpu", "cuda"
        "threads": 1,             # torch threads per rank on the CPU
    },
    "data": {
        "tokenizer": "bpe",       # "bpe" (trained on the corpus, cached) or "byte"
        "vocab_size": 2048,       # BPE target vocabulary (the model uses the tokenizer's actual size)
        "seq_len": 64,
        "cache_dir": "runs/cache",
    },
    "model": {
        "head": "flce",           # "flce": VocabParallelLMHead over the world; "torch": nn.Linear + F.cross_entropy
        "vocab_size": 0,          # 0: the tokenizer's size; larger: padded with rows no target uses (as Megatron pads)
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        "attn_implementation": "sdpa",
    },
    "training": {
        "steps": 50,
        "batch_size": 4,
        "lr": 3e-3,
        "min_lr_ratio": 0.1,      # cosine decay to lr * min_lr_ratio at the last step
        "warmup_steps": 5,
        "weight_decay": 0.1,
        "betas": [0.9, 0.95],
        "grad_clip": 1.0,         # global grad-norm clip (head shards all-reduced); 0 disables
        "dtype": "fp32",          # "fp32" or "bf16" (autocast on the body, bf16 loss, fp32 master weights)
    },
    "checkpoint": {
        "ckpt_every": 25,         # 0 disables checkpoints
        "ckpt_dir": "",           # "" -> <out_dir>/checkpoints
        "keep": 2,                # most recent complete checkpoints kept
        "resume": False,
    },
    "fault": {
        "fail_at_step": 0,        # >0: rank fail_rank SIGKILLs itself after this step (first attempt only); env FAIL_AT_STEP
        "fail_rank": 1,           # -1: the last rank
    },
}

CORPUS_NAME = "pydoc_data.topics"
EOT = "<|endoftext|>"


# --------------------------------------------------------------------------------------------- config


def _merge(base: dict, over: dict, where: str = "") -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in over.items():
        if k not in out:
            raise ValueError(f"unknown config key {where}{k!r} (known: {sorted(out)})")
        if isinstance(out[k], dict):
            if not isinstance(v, dict):
                raise ValueError(f"config key {where}{k!r} must be a table")
            out[k] = _merge(out[k], v, f"{where}{k}.")
        else:
            out[k] = v
    return out


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _apply_set(cfg: dict, item: str) -> None:
    if "=" not in item:
        raise ValueError(f"--set expects key=value, got {item!r}")
    key, text = item.split("=", 1)
    key = key.strip()
    if "." in key:
        section, name = key.split(".", 1)
    else:
        owners = [s for s, table in cfg.items() if key in table]
        if len(owners) != 1:
            why = "unknown key" if not owners else f"ambiguous, say one of {[f'{s}.{key}' for s in owners]}"
            raise ValueError(f"--set {key}: {why}")
        section, name = owners[0], key
    if section not in cfg or name not in cfg[section]:
        raise ValueError(f"--set {key}: unknown config key")
    cfg[section][name] = _parse_value(text.strip())


def load_config(path: str | None, sets: list[str]) -> dict:
    cfg = _merge(DEFAULTS, {})
    if path:
        with open(path, "rb") as f:
            cfg = _merge(cfg, tomllib.load(f))
    for item in sets:
        _apply_set(cfg, item)
    if os.environ.get("FAIL_AT_STEP"):
        cfg["fault"]["fail_at_step"] = int(os.environ["FAIL_AT_STEP"])
    out = Path(cfg["job"]["out_dir"])
    cfg["job"]["losses_file"] = cfg["job"]["losses_file"] or str(out / "losses.json")
    cfg["checkpoint"]["ckpt_dir"] = cfg["checkpoint"]["ckpt_dir"] or str(out / "checkpoints")
    if cfg["model"]["head"] not in ("flce", "torch"):
        raise ValueError(f"model.head must be 'flce' or 'torch', got {cfg['model']['head']!r}")
    if cfg["training"]["dtype"] not in ("fp32", "bf16"):
        raise ValueError(f"training.dtype must be 'fp32' or 'bf16', got {cfg['training']['dtype']!r}")
    if cfg["data"]["tokenizer"] not in ("bpe", "byte"):
        raise ValueError(f"data.tokenizer must be 'bpe' or 'byte', got {cfg['data']['tokenizer']!r}")
    return cfg


# ----------------------------------------------------------------------------------------------- data


def corpus_documents() -> list[str]:
    """The ``help()`` topic texts CPython ships in ``pydoc_data.topics``, in sorted topic order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def build_tokens(cfg: dict) -> tuple[torch.Tensor, int]:
    """Token ids of the whole corpus (documents joined by an end-of-text token) and the vocab size.
    Cached under ``data.cache_dir``; concurrent builders write identical files atomically."""
    docs = corpus_documents()
    digest = hashlib.sha1("\0".join(docs).encode()).hexdigest()[:10]
    kind, target = cfg["data"]["tokenizer"], int(cfg["data"]["vocab_size"])
    cache = Path(cfg["data"]["cache_dir"])
    tag = f"{kind}-{target}-{digest}" if kind == "bpe" else f"byte-{digest}"
    tok_file = cache / f"tokens-{tag}.pt"
    if tok_file.is_file():
        blob = torch.load(tok_file, weights_only=True)
        return blob["ids"].long(), int(blob["vocab_size"])
    t0 = time.perf_counter()
    if kind == "byte":
        eot = 0  # NUL never occurs in the text: it separates documents
        ids: list[int] = []
        for d in docs:
            ids.extend(d.encode("utf-8"))
            ids.append(eot)
        vocab = 256
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=target, min_frequency=2, special_tokens=[EOT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(docs, trainer=trainer)
        _atomic_write(cache / f"tokenizer-{tag}.json", lambda p: tok.save(str(p)))
        eot = tok.token_to_id(EOT)
        ids = []
        for enc in tok.encode_batch(docs):
            ids.extend(enc.ids)
            ids.append(eot)
        vocab = tok.get_vocab_size()
    t = torch.tensor(ids, dtype=torch.int32)
    _atomic_write(tok_file, lambda p: torch.save({"ids": t, "vocab_size": vocab}, p))
    log.info("tokenised %s with %s (vocab %d): %d tokens in %.1f s, cached in %s",
             CORPUS_NAME, kind, vocab, t.numel(), time.perf_counter() - t0, tok_file)
    return t.long(), vocab


class SequenceData:
    """Fixed-length sequences of the token stream in a seeded per-epoch order.

    ``batch(position, b)`` returns sequences ``position .. position + b - 1`` of the infinite
    stream epoch 0 permutation, epoch 1 permutation, ...: the position is the whole data state."""

    def __init__(self, ids: torch.Tensor, seq_len: int, seed: int) -> None:
        n = ids.numel() // seq_len
        if n < 1:
            raise ValueError(f"corpus of {ids.numel()} tokens is shorter than seq_len={seq_len}")
        self.seqs = ids[: n * seq_len].view(n, seq_len)
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.seqs.shape[0]

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self), generator=g)}
        return self._perms[epoch]

    def batch(self, position: int, batch_size: int) -> torch.Tensor:
        rows = []
        for k in range(position, position + batch_size):
            epoch, j = divmod(k, len(self))
            rows.append(int(self._perm(epoch)[j]))
        return self.seqs[rows]


# ---------------------------------------------------------------------------------------------- model


def build_model(cfg: dict, vocab: int, device: torch.device, group: dist.ProcessGroup | None):
    """LlamaForCausalLM from a LlamaConfig (seeded random init, on the CPU, then moved). With
    ``model.head = "flce"`` its lm_head becomes a VocabParallelLMHead holding this rank's rows of
    the nn.Linear the model drew."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m, seq = cfg["model"], int(cfg["data"]["seq_len"])
    lcfg = LlamaConfig(
        vocab_size=vocab, hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
        max_position_embeddings=seq, rope_theta=m["rope_theta"], initializer_range=m["initializer_range"],
        tie_word_embeddings=False, use_cache=False, attention_dropout=0.0,
    )
    lcfg._attn_implementation = m["attn_implementation"]
    torch.manual_seed(int(cfg["job"]["seed"]))
    model = LlamaForCausalLM(lcfg)
    if m["head"] == "flce":
        import flce_dist

        full = model.lm_head.weight.detach()
        head = flce_dist.VocabParallelLMHead(m["hidden_size"], vocab, group=group, bias=False, dtype=torch.float32)
        start, end = head.shard
        with torch.no_grad():
            head.weight.copy_(full[start:end])
        model.lm_head = head
    torch.manual_seed(int(cfg["job"]["seed"]) + 1)  # the same global RNG state after either head
    return model.to(device)


def is_head_param(name: str) -> bool:
    return name.startswith("lm_head.")


def make_optimizer(model: torch.nn.Module, t: dict) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": float(t["weight_decay"])}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=float(t["lr"]), betas=tuple(t["betas"]), eps=1e-8)


def lr_at(step: int, t: dict) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    lr, warm, total = float(t["lr"]), int(t["warmup_steps"]), int(t["steps"])
    if step <= warm:
        return lr * step / max(warm, 1)
    frac = (step - warm) / max(total - warm, 1)
    lo = lr * float(t["min_lr_ratio"])
    return lo + (lr - lo) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def clip_grad_norm_(model: torch.nn.Module, max_norm: float, group: dist.ProcessGroup | None) -> float:
    """Global gradient norm of the full model: the replicated body counted once, the head's shards
    summed over the group. Scales every gradient by ``min(1, max_norm / norm)`` when ``max_norm > 0``."""
    body, head = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (head if is_head_param(name) else body).append(p.grad)
    dev = (body or head)[0].device

    def sq(grads: list[torch.Tensor]) -> torch.Tensor:
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        return torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum() if grads else zero

    sq_body, sq_head = sq(body), sq(head)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq_head, group=group)
    norm = float((sq_body + sq_head).sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in body + head:
            g.mul_(scale)
    return norm


def compute_loss(model, ids: torch.Tensor, head: str, bf16: bool) -> torch.Tensor:
    """Mean next-token cross entropy: hidden states from the decoder body, labels shifted by one."""
    device_type = ids.device.type
    amp = torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with amp:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    hidden, labels = hidden[:, :-1, :], ids[:, 1:]
    lm_head = model.lm_head
    if head == "flce":
        if bf16:  # the fused loss in bf16; the cast is differentiable, the master weight stays fp32
            return lm_head.loss(hidden.to(torch.bfloat16), lm_head.weight.to(torch.bfloat16), labels,
                                vocab_start=lm_head.shard[0])
        return lm_head(hidden.float(), labels)
    with amp:
        logits = lm_head(hidden)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


# ----------------------------------------------------------------------------------------- checkpoint


def _step_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step_{step:08d}"


def complete_checkpoints(ckpt_dir: Path) -> list[int]:
    steps = []
    if ckpt_dir.is_dir():
        for d in ckpt_dir.iterdir():
            if d.name.startswith("step_") and (d / "complete.json").is_file():
                steps.append(int(d.name[5:]))
    return sorted(steps)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_dir: Path, step: int, position: int, model, opt, losses: list[float], meta: dict,
                    rank: int, world: int, keep: int) -> None:
    d = _step_dir(ckpt_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "position": position, "model": model.state_dict(), "optim": opt.state_dict(),
             "rng": rng_state(), "losses": list(losses), "meta": meta}
    _atomic_write(d / f"rank_{rank}.pt", lambda p: torch.save(state, p))
    if world > 1:
        dist.barrier()
    if rank == 0:
        _atomic_write(d / "complete.json", lambda p: p.write_text(json.dumps({"step": step, "world_size": world, **meta})))
        kept = set(complete_checkpoints(ckpt_dir)[-max(keep, 1):])
        for old in ckpt_dir.glob("step_*"):  # older complete ones beyond `keep`, and incomplete leftovers
            if old.name[5:].isdigit() and int(old.name[5:]) < step and int(old.name[5:]) not in kept:
                shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint: step %d -> %s", step, d)


def load_checkpoint(ckpt_dir: Path, step: int, rank: int, model, opt, meta: dict, device: torch.device) -> dict:
    done = json.loads((_step_dir(ckpt_dir, step) / "complete.json").read_text())
    for key in ("world_size", "head", "vocab_size"):
        if done.get(key) != meta.get(key):
            raise ValueError(f"checkpoint {ckpt_dir} step {step} has {key}={done.get(key)!r}, this run {meta.get(key)!r}: "
                             f"resharding is not supported, start fresh without --resume or use another ckpt_dir")
    state = torch.load(_step_dir(ckpt_dir, step) / f"rank_{rank}.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    set_rng_state(state["rng"])
    return state


def replicas_identical(model, group: dist.ProcessGroup | None) -> bool:
    """Every rank's decoder body is bitwise the same (one all-gather of a float64 fingerprint)."""
    if group is None or dist.get_world_size(group) == 1:
        return True
    acc = torch.zeros(2, dtype=torch.float64)
    for name, p in model.named_parameters():
        if not is_head_param(name):
            v = p.detach().double().cpu().flatten()
            acc[0] += v.sum()
            acc[1] += (v * torch.arange(1, v.numel() + 1, dtype=torch.float64)).sum()
    dev = next(model.parameters()).device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    acc = acc.to(dev)
    out = [torch.empty_like(acc) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, acc, group=group)
    return all(torch.equal(o, out[0]) for o in out)


# ------------------------------------------------------------------------------------------------ run


class _TqdmHandler(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001
            self.handleError(record)


def setup_logging(rank: int) -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def write_losses(path: Path, losses: list[float], extra: dict) -> None:
    _atomic_write(path, lambda p: p.write_text(json.dumps({**extra, "losses": losses}, indent=1)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "configs/train/tiny_cpu.toml"),
                    help="TOML config (default: configs/train/tiny_cpu.toml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set training.steps=30 (repeatable)")
    ap.add_argument("--head", choices=("flce", "torch"), help="override model.head")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                    help="continue from the latest complete checkpoint in ckpt_dir if there is one")
    args = ap.parse_args(argv)

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    setup_logging(rank)
    cfg = load_config(args.config, args.set)
    if args.head:
        cfg["model"]["head"] = args.head
    if args.resume is not None:
        cfg["checkpoint"]["resume"] = args.resume
    job, t, ck = cfg["job"], cfg["training"], cfg["checkpoint"]
    head = cfg["model"]["head"]
    if head == "torch" and world > 1:
        raise SystemExit("--head torch is the single-process baseline: run it without torchrun (or with --nproc_per_node=1)")

    want = job["device"]
    use_cuda = torch.cuda.is_available() if want == "auto" else want == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(job["threads"]))
    group = None
    if world > 1:
        # The store that torchrun's agent hosts outlives a worker restart: namespace this attempt's
        # keys, or the restarted ranks find the dead ranks' addresses and counters in it.
        from torch.distributed.rendezvous import rendezvous

        store, _, _ = next(rendezvous("env://"))
        store = dist.PrefixStore(f"flce_train/attempt_{restart}", store)
        dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world,
                                device_id=device if use_cuda else None)
        group = dist.group.WORLD
    bf16 = t["dtype"] == "bf16"
    if restart:
        log.warning("restart %d of this job (torchelastic): resuming from the latest checkpoint", restart)

    # data: rank 0 builds (or loads) the cache first, the others then load it
    if rank != 0 and world > 1:
        dist.barrier()
    ids, tok_vocab = build_tokens(cfg)
    if rank == 0 and world > 1:
        dist.barrier()
    data = SequenceData(ids, int(cfg["data"]["seq_len"]), int(job["seed"]))
    vocab = int(cfg["model"]["vocab_size"]) or tok_vocab
    if vocab < tok_vocab:
        raise ValueError(f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary ({tok_vocab})")

    model = build_model(cfg, vocab, device, group)
    opt = make_optimizer(model, t)
    n_params = sum(p.numel() for p in model.parameters())
    shard = getattr(model.lm_head, "shard", (0, vocab))
    log.info("model: LlamaForCausalLM %d layers, hidden %d, vocab %d; %s head over %d rank(s) (this rank's rows %s); "
             "%d params on rank 0; %s on %s", cfg["model"]["num_layers"], cfg["model"]["hidden_size"], vocab,
             head, world, shard, n_params, t["dtype"], device)
    log.info("data: %s, %d tokens (tokenizer vocab %d), %d sequences of %d, batch %d", CORPUS_NAME, ids.numel(),
             tok_vocab, len(data), cfg["data"]["seq_len"], t["batch_size"])

    meta = {"world_size": world, "head": head, "vocab_size": vocab}
    ckpt_dir = Path(ck["ckpt_dir"])
    steps, bs, every = int(t["steps"]), int(t["batch_size"]), int(ck["ckpt_every"])
    start_step, position, losses, resumed_from = 0, 0, [], None
    # rank 0 looks at ckpt_dir and decides for everyone (the ranks must not race on the listing)
    decision: list[int | None] = [None]  # the step to resume from
    if rank == 0:
        available = complete_checkpoints(ckpt_dir)
        decision = [available[-1] if (ck["resume"] or restart > 0) and available else None]
        if decision[0] is None and available:
            log.warning("fresh start: removing %d checkpoint(s) of an earlier run from %s (use --resume to continue)",
                        len(available), ckpt_dir)
            for s in available:
                shutil.rmtree(_step_dir(ckpt_dir, s), ignore_errors=True)
    if world > 1:
        dist.broadcast_object_list(decision, src=0, group=group)
    if decision[0] is not None:
        state = load_checkpoint(ckpt_dir, decision[0], rank, model, opt, meta, device)
        start_step, position, losses, resumed_from = state["step"], state["position"], list(state["losses"]), state["step"]
        log.info("resumed from %s at step %d (data position %d)", _step_dir(ckpt_dir, start_step), start_step, position)
    elif ck["resume"] or restart > 0:
        log.info("no complete checkpoint in %s: starting from step 0", ckpt_dir)

    fail_at = int(cfg["fault"]["fail_at_step"])
    fail_rank = int(cfg["fault"]["fail_rank"]) % world
    losses_path = Path(job["losses_file"])
    extra = {"head": head, "world_size": world, "vocab_size": vocab, "resumed_from": resumed_from,
             "restart_count": restart, "config": cfg}

    show = {"on": True, "off": False}.get(str(job["progress"]), sys.stderr.isatty())
    from tqdm import tqdm

    bar = tqdm(total=steps, initial=start_step, desc="train", unit="step", disable=(rank != 0 or not show),
               dynamic_ncols=True, file=sys.stderr)
    model.train()
    tokens_per_step = bs * int(cfg["data"]["seq_len"])
    t_start, t_log, window = time.perf_counter(), time.perf_counter(), 0
    warm_steps = min(int(job["log_every"]), max(0, steps - start_step - 1))  # compile/warm-up excluded below
    t_steady = t_start
    if use_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(start_step + 1, steps + 1):
        if step == start_step + 1 + warm_steps:
            if use_cuda:
                torch.cuda.synchronize(device)
            t_steady = time.perf_counter()
        t0 = time.perf_counter()
        batch = data.batch(position, bs).to(device, non_blocking=True)
        position += bs
        lr = lr_at(step, t)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = compute_loss(model, batch, head, bf16)
        loss.backward()
        gnorm = clip_grad_norm_(model, float(t["grad_clip"]), group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"loss is {value} at step {step}")
        losses.append(value)
        window += 1
        dt = time.perf_counter() - t0
        bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{tokens_per_step / max(dt, 1e-9):,.0f}", refresh=False)
        bar.update(1)
        if step % int(job["log_every"]) == 0 or step == steps:
            now = time.perf_counter()
            log.info("step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s", step, steps, value, lr, gnorm,
                     window * tokens_per_step / max(now - t_log, 1e-9))
            t_log, window = now, 0
        if every > 0 and (step % every == 0 or step == steps):
            if not replicas_identical(model, group):
                log.warning("step %d: the replicated decoder body differs across ranks", step)
            save_checkpoint(ckpt_dir, step, position, model, opt, losses, meta, rank, world, int(ck["keep"]))
            if rank == 0:
                write_losses(losses_path, losses, extra)
        if fail_at and step == fail_at and rank == fail_rank and restart == 0:
            log.warning("fault injection: rank %d kills itself after step %d (FAIL_AT_STEP)", rank, step)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
    bar.close()
    if use_cuda:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t_start
    steady = (steps - start_step - warm_steps) * tokens_per_step / max(time.perf_counter() - t_steady, 1e-9)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if use_cuda else 0.0])
    if world > 1 and use_cuda:
        peak = peak.to(device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    if rank == 0:
        done = len(losses) - (resumed_from or 0)
        extra["tokens_per_s"] = done * tokens_per_step / max(elapsed, 1e-9)
        extra["tokens_per_s_steady"] = steady  # after the first log_every steps (Helion compile, warm-up)
        extra["peak_gib_per_rank"] = float(peak)
        if use_cuda:
            log.info("steady state: %.0f tok/s after %d warm-up steps; peak memory %.2f GiB per rank (max over ranks)",
                     steady, warm_steps, float(peak))
        write_losses(losses_path, losses, extra)
        if losses:
            log.info("done: %d steps, loss %.4f -> %.4f, %.1f s (%.0f tok/s); losses in %s", steps, losses[0], losses[-1],
                     elapsed, extra["tokens_per_s"], losses_path)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
