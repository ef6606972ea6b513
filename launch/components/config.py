"""Typed configuration of the training job: one dataclass per TOML section.

``load_config(path, sets)`` reads a TOML file over the defaults below and applies ``--set
section.key=value`` overrides (``key=value`` when the key names one field of one section; the
value is read as TOML, else as a string). Unknown sections or keys raise ``ValueError`` naming the
key and listing the known ones; every value is checked against its field's type at load time (so
``--set training.steps=ten`` fails there, naming ``training.steps``). ``Config.resolve(world)``
fills the derived values that need the world size (``parallel.dp = -1``) and checks the layout."""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class JobConfig:
    seed: int = 0
    out_dir: str = "runs/train"
    losses_file: str = ""        # "" -> <out_dir>/losses.json
    log_every: int = 10
    progress: str = "auto"       # tqdm bar on rank 0: "auto" (stderr is a terminal), "on", "off"
    device: str = "auto"         # "auto" (cuda if available), "cpu", "cuda"; "cuda-shared": a TESTING mode,
    #                              every rank on cuda:0 with gloo (runs the CUDA code paths of tp/dp > 1 on one
    #                              GPU; gloo moves CUDA tensors through the host: its speed means nothing)
    threads: int = 1             # torch threads per rank on the CPU
    timeout_s: float = 600.0     # process-group timeout (init_process_group)
    profile_step: int = 0        # >0: torch.profiler over that step; tables in <out_dir>/profile_step<S>_rank<r>.txt


@dataclass
class DataConfig:
    tokenizer: str = "bpe"       # "bpe" (trained on the corpus, cached) or "byte"
    vocab_size: int = 2048       # BPE target vocabulary (the model uses the tokenizer's actual size)
    seq_len: int = 64
    cache_dir: str = "runs/cache"


@dataclass
class ModelConfig:
    head: str = "flce"           # "flce": flce_dist on the Shard(0) lm_head weight; "torch": ColwiseParallel + loss_parallel
    vocab_size: int = 0          # 0: the tokenizer's size; larger: padded with rows no target uses (as Megatron pads)
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    attn_implementation: str = "sdpa"
    tie_word_embeddings: bool = False
    # the flce head's opt-in gradient filter (flce_dist grad_filter_eps): "" exact, "auto" (2^-12 for a
    # bf16 loss) or a number, e.g. "1e-4"; the loss value itself is always exact
    grad_filter_eps: str = ""
    # torch.compile each decoder layer after tensor parallelism, before FSDP2 (torchtitan's order):
    # "" (off), "inductor" (the GPU choice) or "aot_eager" (graph capture only: what CPU tests run)
    compile: str = ""


@dataclass
class ParallelConfig:
    dp: int = -1                 # data-parallel (FSDP2) size; -1: world // tp
    tp: int = 1                  # tensor-parallel size (the whole Llama body and the vocab-sharded head)
    sp: bool = False             # sequence parallelism on the tp dim (norms and the head see Shard(1) tokens)


@dataclass
class TrainingConfig:
    steps: int = 50
    batch_size: int = 4          # the GLOBAL batch (sequences per step); dp rank d reads rows [d*B/dp, (d+1)*B/dp)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1    # cosine decay to lr * min_lr_ratio at the last step
    warmup_steps: int = 5
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0       # global grad-norm clip over the whole model; 0 disables
    dtype: str = "fp32"          # "fp32" or "bf16" (autocast on the body, bf16 loss, fp32 master weights)
    # resuming with another steps/warmup_steps/lr/min_lr_ratio than the checkpoint's: "check" fails naming
    # the change, "checkpoint" keeps the stored schedule, "config" takes this run's from the next step on
    resume_schedule: str = "check"
    # AdamW's implementation: "default" (torch's choice), "foreach" (multi-tensor kernels per parameter
    # group) or "fused" (one fused kernel per group, as torchtitan configures it); the same math
    optimizer_impl: str = "default"


@dataclass
class CheckpointConfig:
    ckpt_every: int = 25         # 0 disables checkpoints
    ckpt_dir: str = ""           # "" -> <out_dir>/checkpoints
    keep: int = 2                # most recent complete checkpoints kept (of this run)
    resume: bool = False


@dataclass
class FaultConfig:
    fail_at_step: int = 0        # >0: rank fail_rank SIGKILLs itself after this step (first attempt only); env FAIL_AT_STEP
    fail_rank: int = 1           # -1: the last rank


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def resolve(self, world: int) -> "Config":
        """Derived values that need the world size, and the layout checks."""
        p, t = self.parallel, self.training
        if p.tp < 1:
            raise ValueError(f"parallel.tp must be >= 1, got {p.tp}")
        if world % p.tp:
            raise ValueError(f"parallel.tp={p.tp} does not divide the world size {world}")
        if p.dp == -1:
            p.dp = world // p.tp
        if p.dp < 1 or p.dp * p.tp != world:
            raise ValueError(f"parallel.dp * parallel.tp = {p.dp} * {p.tp} must equal the world size {world}")
        if t.batch_size % p.dp:
            raise ValueError(f"training.batch_size={t.batch_size} must be divisible by parallel.dp={p.dp}")
        if p.sp and p.tp > 1 and self.data.seq_len % p.tp:
            raise ValueError(f"parallel.sp needs data.seq_len={self.data.seq_len} divisible by parallel.tp={p.tp}")
        m = self.model
        for name in ("num_heads", "num_kv_heads"):
            if getattr(m, name) % p.tp:
                raise ValueError(f"model.{name}={getattr(m, name)} must be divisible by parallel.tp={p.tp}")
        if m.intermediate_size % p.tp:
            raise ValueError(f"model.intermediate_size={m.intermediate_size} must be divisible by parallel.tp={p.tp}")
        return self


_CHOICES = {("model", "head"): ("flce", "torch"), ("training", "dtype"): ("fp32", "bf16"),
            ("training", "resume_schedule"): ("check", "checkpoint", "config"),
            ("training", "optimizer_impl"): ("default", "foreach", "fused"),
            ("model", "compile"): ("", "inductor", "aot_eager"),
            ("data", "tokenizer"): ("bpe", "byte"), ("job", "device"): ("auto", "cpu", "cuda", "cuda-shared"),
            ("job", "progress"): ("auto", "on", "off")}


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """``value`` as field type ``tp`` (int -> float is allowed), else ValueError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError(f"config key {key} must be a list of {inner.__name__}, got {value!r}")
        return [_check_type(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ValueError(f"config key {key} must be {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _fields(obj: Any) -> dict[str, dataclasses.Field]:
    hints = typing.get_type_hints(type(obj))
    return {f.name: hints[f.name] for f in dataclasses.fields(obj)}


def _set(cfg: Config, section: str, name: str, value: Any) -> None:
    sections = _fields(cfg)
    if section not in sections:
        raise ValueError(f"unknown config section {section!r} (known: {sorted(sections)})")
    sub = getattr(cfg, section)
    known = _fields(sub)
    if name not in known:
        raise ValueError(f"unknown config key {section}.{name!r} (known keys of [{section}]: {sorted(known)})")
    value = _check_type(f"{section}.{name}", value, known[name])
    choices = _CHOICES.get((section, name))
    if choices and value not in choices:
        raise ValueError(f"config key {section}.{name} must be one of {choices}, got {value!r}")
    setattr(sub, name, value)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_set(cfg: Config, item: str) -> None:
    if "=" not in item:
        raise ValueError(f"--set expects key=value, got {item!r}")
    key, text = (s.strip() for s in item.split("=", 1))
    if "." in key:
        section, name = key.split(".", 1)
    else:
        owners = [s for s in _fields(cfg) if key in _fields(getattr(cfg, s))]
        if len(owners) != 1:
            if not owners:
                known = sorted(f"{s}.{k}" for s in _fields(cfg) for k in _fields(getattr(cfg, s)))
                raise ValueError(f"--set {key}: unknown config key (known: {known})")
            raise ValueError(f"--set {key}: ambiguous, say one of {[f'{s}.{key}' for s in owners]}")
        section, name = owners[0], key
    _set(cfg, section, name, _parse_value(text))


def filter_eps(m: ModelConfig) -> float | str | None:
    """``model.grad_filter_eps`` as flce_dist's ``grad_filter_eps`` (None, "auto" or a float), checked
    by flce_dist's own option check; a ValueError names the config key."""
    text = m.grad_filter_eps.strip()
    if not text:
        return None
    try:
        value = text if text == "auto" else float(text)
        from flce_dist import LossOptions

        LossOptions(grad_filter_eps=value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config key model.grad_filter_eps must be '', 'auto' or a number in [0, 1), got "
                         f"{m.grad_filter_eps!r} ({e})") from None
    if m.head != "flce":
        raise ValueError(f"config key model.grad_filter_eps needs model.head = 'flce', got {m.head!r}")
    return value


def load_config(path: str | None, sets: list[str] = (), environ: dict[str, str] | None = None) -> Config:
    """Defaults, then the TOML file, then ``--set`` items, then ``FAIL_AT_STEP`` from the environment."""
    cfg = Config()
    if path:
        with open(path, "rb") as f:
            table = tomllib.load(f)
        for section, values in table.items():
            if not isinstance(values, dict):
                raise ValueError(f"config key {section!r} must be a table (known sections: {sorted(_fields(cfg))})")
            for name, value in values.items():
                _set(cfg, section, name, value)
    for item in sets:
        apply_set(cfg, item)
    env = os.environ if environ is None else environ
    if env.get("FAIL_AT_STEP"):
        cfg.fault.fail_at_step = int(env["FAIL_AT_STEP"])
    out = Path(cfg.job.out_dir)
    cfg.job.losses_file = cfg.job.losses_file or str(out / "losses.json")
    cfg.checkpoint.ckpt_dir = cfg.checkpoint.ckpt_dir or str(out / "checkpoints")
    filter_eps(cfg.model)  # a bad model.grad_filter_eps fails here, before any model is built
    if cfg.training.batch_size < 1:
        raise ValueError(f"training.batch_size must be >= 1, got {cfg.training.batch_size}")
    if cfg.training.steps < 0:
        raise ValueError(f"training.steps must be >= 0, got {cfg.training.steps}")
    if cfg.parallel.dp == 0 or cfg.parallel.dp < -1:
        raise ValueError(f"parallel.dp must be >= 1 or -1 (world // tp), got {cfg.parallel.dp}")
    if cfg.parallel.tp < 1:
        raise ValueError(f"parallel.tp must be >= 1, got {cfg.parallel.tp}")
    if cfg.parallel.dp > 0 and cfg.training.batch_size % cfg.parallel.dp:
        raise ValueError(f"training.batch_size={cfg.training.batch_size} must be divisible by parallel.dp={cfg.parallel.dp}")
    return cfg
