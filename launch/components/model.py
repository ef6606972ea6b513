"""The model: ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` (random init, nothing is
downloaded), built on the CPU from ``job.seed`` so every layout starts from identical weights, and
wrapped in ``CausalLM``, whose ``forward(ids)`` returns the mean next-token loss (so that FSDP2's
root hooks cover the lm_head weight, which the flce head uses outside ``lm_head.forward``).

Heads (``model.head``):
- ``flce``: ``flce_dist.fused_linear_cross_entropy(hidden, lm_head.weight, labels)`` with the
  DTensors themselves: the weight ``Shard(0)`` on the tp mesh, hidden replicated or ``Shard(1)``
  (sequence parallel); no rank holds ``[tokens, V]`` logits.
- ``torch``: the torchtitan baseline: ``lm_head`` ``ColwiseParallel(output_layouts=Shard(-1))``
  and ``F.cross_entropy`` on the DTensor logits under ``loss_parallel()`` (at tp=1: ``nn.Linear`` +
  ``F.cross_entropy``).
Labels are the ids shifted by one with ``-100`` (ignored) at the last position, so the sequence
keeps its length (sequence parallelism cuts it into equal slices) and the mean is over ``S - 1``
tokens per row."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .config import Config, TrainingConfig, filter_eps

IGNORE = -100


class CausalLM(torch.nn.Module):
    """``model`` (LlamaModel) + ``lm_head`` of a LlamaForCausalLM (same state-dict keys), with the
    loss in ``forward``. ``tp_mesh``/``sp`` are set by ``parallelize``."""

    def __init__(self, hf, head: str, bf16: bool, grad_filter_eps: float | str | None = None) -> None:
        super().__init__()
        self.model, self.lm_head, self.config = hf.model, hf.lm_head, hf.config
        self.head, self.bf16, self.grad_filter_eps = head, bf16, grad_filter_eps
        self.tp_mesh: DeviceMesh | None = None
        self.sp = False

    def loss_context(self):
        """The context the step (forward AND backward) runs in: torch's ``loss_parallel()`` for the
        torch head on DTensor logits (its backward also needs it, as torchtitan's train_context)."""
        if self.head == "torch" and self.tp_mesh is not None:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # full-length positions under sp too
        amp = torch.autocast(ids.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with amp:
            hidden = self.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        with torch.profiler.record_function(f"head.{self.head}"):  # named in job.profile_step's tables
            if self.head == "flce":
                return flce_loss(hidden, self.lm_head.weight, labels, self.bf16, self.grad_filter_eps)
            with amp:
                logits = self.lm_head(hidden)
            # DTensor logits Shard(-1): F.cross_entropy runs vocab-parallel inside loss_context()
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1), ignore_index=IGNORE)


def flce_loss(hidden, weight, labels: torch.Tensor, bf16: bool, grad_filter_eps: float | str | None = None) -> torch.Tensor:
    """flce_dist's fused, vocab-parallel loss, handed the DTensors themselves: ``weight`` is the
    ``Shard(0)`` lm_head weight on the tp mesh (flce_dist reads the tp group and every shard's
    ``vocab_start`` off it, DTensor's ``torch.chunk`` split included), ``hidden`` is a plain tensor
    (replicated over tp) or a ``Shard(1)`` DTensor (sequence parallelism, detected from the
    placement; flce_dist slices the global ``labels`` like it). Gradients come back as DTensors
    with the inputs' placements; the loss is a plain tensor, the same on every tp rank. At tp=1
    everything is plain and this is the single-rank call. ``grad_filter_eps``: flce_dist's opt-in
    gradient filter (``model.grad_filter_eps``)."""
    import flce_dist

    if bf16:  # the fused loss in bf16; the cast is differentiable, the master weight stays fp32
        hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    return flce_dist.fused_linear_cross_entropy(hidden, weight, labels, ignore_index=IGNORE,
                                                grad_filter_eps=grad_filter_eps)


def build_model(cfg: Config, vocab: int) -> CausalLM:
    """LlamaForCausalLM from a LlamaConfig, seeded random init on the CPU (identical on every rank
    and in every layout), wrapped in ``CausalLM``. Tied embeddings: ``lm_head.weight`` is the
    embedding's Parameter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    lcfg = LlamaConfig(
        vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=cfg.data.seq_len, rope_theta=m.rope_theta, initializer_range=m.initializer_range,
        tie_word_embeddings=m.tie_word_embeddings, use_cache=False, attention_dropout=0.0,
    )
    lcfg._attn_implementation = m.attn_implementation
    torch.manual_seed(cfg.job.seed)
    hf = LlamaForCausalLM(lcfg)
    if m.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    torch.manual_seed(cfg.job.seed + 1)  # the same global RNG state after either head
    return CausalLM(hf, m.head, cfg.training.dtype == "bf16", filter_eps(m))


def _kind(p: torch.Tensor) -> str:
    """Parameters that foreach kernels may not mix: plain tensors, DTensors per mesh."""
    return f"dtensor:{p.device_mesh.mesh_dim_names}" if isinstance(p, DTensor) else "tensor"


def make_optimizer(model: torch.nn.Module, t: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices. Parameters are grouped by kind (plain tensor, DTensor per
    mesh) as well, because the foreach kernels refuse a list mixing them."""
    groups: dict[tuple[bool, str], list] = {}
    for _, p in model.named_parameters():
        groups.setdefault((p.dim() >= 2, _kind(p)), []).append(p)
    pg = [{"params": ps, "weight_decay": t.weight_decay if decay else 0.0} for (decay, _), ps in sorted(groups.items())]
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[t.optimizer_impl]
    return torch.optim.AdamW(pg, lr=t.lr, betas=tuple(t.betas), eps=1e-8, **impl)


def lr_at(step: int, t: TrainingConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    warm, total = t.warmup_steps, t.steps
    if step <= warm:
        return t.lr * step / max(warm, 1)
    frac = (step - warm) / max(total - warm, 1)
    lo = t.lr * t.min_lr_ratio
    return lo + (t.lr - lo) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
