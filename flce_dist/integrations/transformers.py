"""Hugging Face ``transformers`` integration: ``apply(model, group=None, **loss_options)``.

After ``apply``, a ``*ForCausalLM`` called with ``labels`` runs its base model (``model.model``)
for the hidden states and computes the causal-LM loss with :func:`flce_dist.fused_linear_cross_entropy`
on the lm_head weight; the ``[B, T, V]`` logits are never formed and the returned
``CausalLMOutputWithPast`` has ``logits=None``. Without ``labels`` the model's own forward runs
(generation, evaluation with logits). Nothing of the model's forward is copied: the base model and
the lm_head module are called as they are, so the hooks of ZeRO-3, accelerate, etc. still fire.

The loss is the one ``transformers`` computes (``ForCausalLMLoss``):

- labels are shifted by one (``labels[..., 1:]``, the last position ignored), or ``shift_labels``
  is used as given;
- ``ignore_index`` (default -100; a per-call ``ignore_index`` kwarg wins);
- mean over the non-ignored targets, or ``sum / num_items_in_batch`` when the Trainer passes
  ``num_items_in_batch`` (gradient accumulation);
- the model's logit transform: Gemma2/Gemma3 ``final_logit_softcapping`` -> ``softcap``,
  Granite ``logits / logits_scaling`` and Cohere ``logits * logit_scale`` -> ``temperature``.

lm_head weight and tensor parallelism (resolved at every call, so it follows module replacement):

- a plain ``nn.Linear`` lm_head: its weight is the full ``[V, H]`` matrix (tied embeddings included:
  the shared Parameter is used, so its gradient is the sum of both uses);
- ``apply(model, group=tp_group)``: the lm_head becomes a vocab shard of the group, DTensor's split
  (``flce_dist.vocab_shard(V, rank, P, split="chunk")``: ``ceil(V / P)`` rows per rank, the last
  ranks fewer; ``VocabParallelLMHead``'s layout). Its ``weight`` (and bias) is replaced by a
  Parameter holding only this rank's rows. A tied weight is sharded with the input embedding, which
  becomes vocab-parallel (Megatron's ``VocabParallelEmbedding``): each rank looks up the ids it owns
  (zeros for the others) and the outputs are summed over the group, one all-reduce of ``[B, T, H]``
  per forward (identity backward); the shared shard Parameter then gets its two gradients locally,
  with no ``[V, H]`` collective (the embedding must be a plain ``nn.Embedding`` lookup, without
  ``max_norm`` or ``scale_grad_by_freq``).
  Without labels the model's own forward runs and the head's logits are all-gathered to the full
  vocabulary (one uneven all-gather of ``[B, T, V]``); the head's input is taken as replicated
  (Megatron's ``copy_to_tensor_model_parallel_region``): its backward all-reduces the hidden
  gradient (``[B, T, H]``), so a loss of the logits (DPO, distillation, ...) trains the backbone
  with the full gradient, the same on every rank.
  ``state_dict()`` of the model (so ``save_pretrained``) holds the full, unsharded ``lm_head.weight``
  (and the full embedding when tied, one tensor for both keys): one uneven all-gather of ``[V, H]``
  per sharded Parameter, so every rank of the group must call it at the same point (as with
  transformers' own tensor parallelism; a ``[V, H]`` buffer on each rank while the dict lives).
  ``load_state_dict`` takes the full rows (and slices this rank's) or this rank's rows. The saved
  checkpoint loads into the plain model (``from_pretrained``).
- a DeepSpeed AutoTP head (``deepspeed.module_inject.layers.VocabParallelLinear`` or a
  column-parallel ``LinearLayer``): its shard, ``mp_group`` and vocab start are used as they are
  (see :mod:`flce_dist.integrations.deepspeed`);
- a :class:`flce_dist.VocabParallelLMHead`: its shard and group.

RL / post-training: :func:`logprobs_and_entropy(model, input_ids, temperature=...)
<logprobs_and_entropy>` returns the per-token log-probabilities of the next tokens and the policy's
entropies, both differentiable, through the same lm_head shard and logit transform (no logits).

Call ``apply`` before building the optimizer: with a ``group`` the lm_head (and a tied input
embedding) gets a new (shard) Parameter. Not supported: ``logits_to_keep != 0`` together with
labels, and the MoE router aux loss (``output_router_logits=True`` raises). ``torch.save(model)`` of
a patched model does not pickle (the patched forward is a closure); save its ``state_dict``.

``loss_options``: ``ignore_index``, ``label_smoothing``, ``z_loss``, ``softcap`` (overrides the
model's), ``temperature`` (divides the model's final logits, after its softcap; multiplies Granite's
``logits_scaling``), ``strategy``, ``deterministic``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..api import fused_linear_cross_entropy
from ..distributed import (
    CopyToGroup,
    GatherVocab,
    ReduceFromGroup,
    all_gather_rows_uneven,
    group_rank,
    group_size,
    shard_sizes,
    vocab_shard,
)
from ..distributed.shard import local_rows
from ..modules import VocabParallelLMHead
from ..options import LossOptions
from .heads import HeadShard, head_shard, register_head_shard

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["SUPPORTED_MODEL_TYPES", "apply", "is_applied", "logprobs_and_entropy", "unapply"]

# config.model_type -> the transform the model's forward applies to ``lm_head(hidden)`` before the loss
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "none",
    "mistral": "none",
    "qwen2": "none",
    "qwen3": "none",
    "gemma": "none",
    "phi3": "none",
    "qwen3_moe": "none",  # only without output_router_logits (the aux loss is not reproduced)
    "mixtral": "none",  # idem
    "gemma2": "softcap",  # logits = c * tanh(logits / c), c = config.final_logit_softcapping
    "gemma3_text": "softcap",
    "granite": "divide",  # logits = logits / config.logits_scaling
    "cohere": "multiply",  # logits = logits * model.logit_scale
}
_MOE_TYPES = {"qwen3_moe", "mixtral"}
_LOSS_OPTIONS = LossOptions.keywords("math")  # reduction and the extra outputs are the model's business
# per-call kwargs of transformers' loss_function that the base model must not receive
_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


@dataclasses.dataclass
class _State:
    options: dict[str, Any]
    transform: str
    moe: bool
    previous_forward: Any  # an instance-level forward that apply() wrapped, or None


@dataclasses.dataclass
class _HeadTP:
    group: dist.ProcessGroup
    start: int
    end: int
    vocab: int
    tied: bool

    @property
    def sizes(self) -> list[int]:
        return shard_sizes(self.vocab, group_size(self.group), split="chunk")


# --------------------------------------------------------------------------------------------
# the lm_head


@register_head_shard
def _sharded_by_apply(head: nn.Module) -> HeadShard | None:
    """A head that ``apply(model, group=...)`` sharded: its rows (tied or not, the weight is the shard)."""
    tp = head.__dict__.get("_flce_tp")
    if tp is None:
        return None
    return HeadShard(cast(torch.Tensor, head.weight), getattr(head, "bias", None), tp.group, tp.start, tp.vocab)


@register_head_shard
def _vocab_parallel_lm_head(head: nn.Module) -> HeadShard | None:
    if not isinstance(head, VocabParallelLMHead):
        return None
    if head.mesh is not None:  # DTensor parameters: the layout travels with them
        return HeadShard(head.weight, head.bias)
    return HeadShard(head.weight, head.bias, head.group, head.shard[0], head.vocab_size)


def _head_loss(head: nn.Module, hidden: torch.Tensor, target: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
    shard = head_shard(head)
    weight, bias, group, start, vocab = shard.weight, shard.bias, shard.group, shard.vocab_start, shard.vocab_size
    if isinstance(head, VocabParallelLMHead):  # its own loss options, under apply()'s
        options = {**head.loss.options, **options}
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    return fused_linear_cross_entropy(
        hidden, weight, target, bias=bias, group=group, vocab_start=start, **{"vocab_size": vocab, **options}
    )


def _patched_head_forward(self, input, *args, flce_target=None, flce_options=None, **kwargs):
    """lm_head forward: ``head(hidden, flce_target=t, flce_options={...})`` returns the fused loss
    (called through the module so that ZeRO-3 gathers the weight); otherwise the head's own forward."""
    if flce_target is not None:
        return _head_loss(self, input, flce_target, flce_options or {})
    previous = self.__dict__.get("_flce_previous_forward")
    tp = self.__dict__.get("_flce_tp")
    if tp is not None:  # replicated input: the backward sums the shards' hidden gradients over the group
        input = CopyToGroup.apply(input, tp.group)
    out = previous(input, *args, **kwargs) if previous is not None else type(self).forward(self, input, *args, **kwargs)
    if tp is not None:
        out = GatherVocab.apply(out, tp.start, tp.end, tp.sizes, tp.group)
    return out


def _install_head_forward(head: nn.Module) -> None:
    _install_forward(head, _patched_head_forward)


# --------------------------------------------------------------------------------------------
# apply(model, group=...): a tied head's embedding, and the checkpoint of the sharded rows


def _patched_embedding_forward(self, input, *args, **kwargs):
    """Vocab-parallel lookup (Megatron's ``VocabParallelEmbedding``): the embedding's own forward on
    the ids this rank owns (as local ids), zeros for the others, summed over the group (one
    all-reduce of the output; the backward is the identity, each rank's rows get their tokens' gradient)."""
    tp = self.__dict__["_flce_tp"]
    previous = self.__dict__.get("_flce_previous_forward")
    inside = (input >= tp.start) & (input < tp.end)
    if tp.end > tp.start:
        local = torch.where(inside, input - tp.start, torch.zeros_like(input))
        out = (
            previous(local, *args, **kwargs)
            if previous is not None
            else type(self).forward(self, local, *args, **kwargs)
        )
        out = out.masked_fill(~inside.unsqueeze(-1), 0)
    else:  # an empty shard (DTensor's split can leave the last ranks none)
        out = self.weight.new_zeros((*input.shape, self.weight.shape[-1]))
    return ReduceFromGroup.apply(out, tp.group)


def _install_forward(module: nn.Module, patched) -> None:
    current = module.__dict__.get("forward")
    if getattr(current, "__func__", None) is patched:
        return
    module.__dict__["_flce_previous_forward"] = current
    module.forward = types.MethodType(patched, module)


def _check_tied_embedding(emb: nn.Module) -> None:
    if not isinstance(emb, nn.Embedding):
        raise ValueError(
            f"apply(model, group=...) with a tied lm_head shards the input embedding too, which must be "
            f"an nn.Embedding; got {type(emb).__name__}"
        )
    if emb.max_norm is not None or emb.scale_grad_by_freq:
        raise ValueError(
            "apply(model, group=...) with a tied lm_head: the input embedding's max_norm / "
            "scale_grad_by_freq need every row's lookups on one rank; the vocab-parallel embedding "
            "does not support them"
        )


def _load_shard_rows(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook of a sharded head / embedding: full ``[V, ...]`` rows -> this rank's."""
    tp = module.__dict__.get("_flce_tp")
    if tp is None:
        return
    for name in ("weight", "bias"):
        key, param = prefix + name, getattr(module, name, None)
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and isinstance(param, torch.Tensor):
            state_dict[key] = local_rows(value, tp.vocab, (tp.start, tp.end), tuple(param.shape))


def _gather_shards_on_save(model: PreTrainedModel, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict post-hook of a model with a sharded head: each sharded Parameter's entries become
    its full ``[V, ...]`` rows, one uneven all-gather per Parameter (weight, bias), in module order
    on every rank; a tied weight's keys share the one gathered tensor."""
    head = model.get_output_embeddings()
    tp = None if head is None else head.__dict__.get("_flce_tp")
    if tp is None:
        return
    owners = [m for m in (head, model.get_input_embeddings()) if m is not None and m.__dict__.get("_flce_tp") is tp]
    found: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if any(module is o for o in owners):
            for pname in ("weight", "bias"):
                p = getattr(module, pname, None)
                if isinstance(p, torch.Tensor):
                    found.setdefault(id(p), (p, []))[1].append(f"{prefix}{name}.{pname}" if name else prefix + pname)
    for p, keys in found.values():
        keys = [k for k in keys if k in state_dict]
        if keys:  # the same structure on every rank: the same gathers
            full = all_gather_rows_uneven(p.detach(), tp.sizes, tp.group)
            for k in keys:
                state_dict[k] = full


def _shard_model(model: PreTrainedModel, head: nn.Linear, group: dist.ProcessGroup) -> None:
    """apply(model, group=...)'s sharding of the lm_head (and of a tied input embedding)."""
    if head.__dict__.get("_flce_tp") is not None or hasattr(head, "mp_group") or hasattr(head, "shard"):
        raise ValueError("the lm_head is already vocab-sharded; call apply(model) without group")
    vocab, p = head.weight.shape[0], group_size(group)
    if vocab < p:
        raise ValueError(f"vocabulary of {vocab} rows is smaller than the group size {p}")
    start, end = vocab_shard(vocab, group_rank(group), p, split="chunk")
    emb = model.get_input_embeddings()
    tied = emb is not None and getattr(emb, "weight", None) is head.weight
    if tied:
        _check_tied_embedding(emb)
    tp = _HeadTP(group=group, start=start, end=end, vocab=vocab, tied=tied)
    with torch.no_grad():
        head.weight = nn.Parameter(head.weight.detach()[start:end].clone(), requires_grad=head.weight.requires_grad)
        bias = getattr(head, "bias", None)
        if bias is not None:
            head.bias = nn.Parameter(bias.detach()[start:end].clone(), requires_grad=bias.requires_grad)
    if hasattr(head, "out_features"):
        head.out_features = end - start
    head.__dict__["_flce_tp"] = tp
    head.register_load_state_dict_pre_hook(_load_shard_rows)
    if tied:
        emb.weight = head.weight
        emb.num_embeddings = end - start
        pad = emb.padding_idx
        emb.padding_idx = pad - start if pad is not None and start <= pad < end else None
        emb.__dict__["_flce_tp"] = tp
        emb.register_load_state_dict_pre_hook(_load_shard_rows)
        _install_forward(emb, _patched_embedding_forward)
    model.register_state_dict_post_hook(_gather_shards_on_save)


# --------------------------------------------------------------------------------------------
# the model


def _transform_options(model: PreTrainedModel, transform: str, options: dict[str, Any]) -> dict[str, Any]:
    cfg = model.config
    opts = dict(options)
    if transform == "softcap" and "softcap" not in options:
        opts["softcap"] = getattr(cfg, "final_logit_softcapping", None)
    temperature = float(options.get("temperature", 1.0))
    if transform == "divide":
        temperature *= float(cfg.logits_scaling)
    elif transform == "multiply":
        temperature /= float(getattr(model, "logit_scale", cfg.logit_scale))
    opts["temperature"] = temperature
    return opts


def _output_class():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast


def _fused_forward(self, *args, **kwargs):
    state: _State = self.__dict__["_flce_state"]
    original = (
        state.previous_forward if state.previous_forward is not None else types.MethodType(type(self).forward, self)
    )
    sig = inspect.signature(original)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)  # let the model's own forward report the bad call
    call = dict(bound.arguments)
    var_kw = next((n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD), None)
    extra = dict(call.pop(var_kw, {})) if var_kw else {}
    labels = call.get("labels")
    if labels is None:
        return original(*args, **kwargs)

    call.pop("labels")
    logits_to_keep = call.pop("logits_to_keep", 0)
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError("flce_dist: logits_to_keep must be 0 when labels are given (the loss covers every position)")
    return_dict = extra.pop("return_dict", None)
    num_items = extra.pop("num_items_in_batch", None)
    ignore_index = extra.pop("ignore_index", state.options.get("ignore_index", -100))
    shift_labels = extra.pop("shift_labels", None)
    if state.moe and (
        call.get("output_router_logits")
        or extra.get("output_router_logits")
        or getattr(self.config, "output_router_logits", False)
    ):
        raise NotImplementedError(
            "flce_dist.integrations.transformers does not add the MoE router aux loss; "
            "set output_router_logits=False or use the unpatched model"
        )

    base = getattr(self, self.base_model_prefix)
    base_sig = inspect.signature(base.forward)
    base_var_kw = any(p.kind is p.VAR_KEYWORD for p in base_sig.parameters.values())
    base_kwargs = {}
    for name, value in {**call, **extra}.items():
        if name in base_sig.parameters or base_var_kw:
            base_kwargs[name] = value
        elif value is not None:
            raise TypeError(f"flce_dist: {type(base).__name__}.forward does not take {name!r}")
    outputs = base(**base_kwargs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]

    if shift_labels is None:
        target = _next_tokens(labels, ignore_index)
    else:
        target = shift_labels
    target = target.to(device=hidden.device)
    options = _transform_options(self, state.transform, state.options)
    options["ignore_index"] = ignore_index
    if num_items is not None:
        options["num_items_in_batch"] = num_items.to(hidden.device) if torch.is_tensor(num_items) else num_items

    head = self.get_output_embeddings()
    _install_head_forward(head)
    loss = head(hidden, flce_target=target.contiguous(), flce_options=options)

    cls = _output_class()
    fields = {f.name for f in dataclasses.fields(cls)}
    out = {"loss": loss, "logits": None}
    for name in ("past_key_values", "cache", "hidden_states", "attentions"):
        if name in fields:
            out[name] = getattr(outputs, name, None)
    result = cls(**out)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return result if return_dict else result.to_tuple()


def _next_tokens(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The causal-LM targets of every position: ``labels`` shifted left by one, ``ignore_index`` last."""
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _model_type(model: PreTrainedModel) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} ({type(model).__name__}) is not supported; "
            f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def _logical_shape(p: torch.Tensor) -> tuple[int, ...]:
    """Shape of a parameter, also when ZeRO-3 has partitioned it away (``ds_shape``)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def _check_options(options: dict[str, Any]) -> None:
    LossOptions.check_keywords(options, "flce_dist.integrations.transformers.apply", "math")


def _is_pretrained_model(model: object) -> bool:
    """What apply() needs of a transformers model (a check, not an isinstance narrowing of ``model``'s type)."""
    return isinstance(model, nn.Module) and hasattr(model, "get_output_embeddings") and hasattr(model, "config")


def is_applied(model: PreTrainedModel) -> bool:
    return "_flce_state" in model.__dict__


def apply(model: PreTrainedModel, group: dist.ProcessGroup | None = None, **loss_options: Any) -> PreTrainedModel:
    """Make ``model`` (a supported ``*ForCausalLM``, see ``SUPPORTED_MODEL_TYPES``) compute its
    ``labels`` loss with the fused loss. ``group``: tensor-parallel group whose ranks each keep a
    vocab shard of the lm_head (see the module docstring). Returns the same ``model`` (patched in place).
    Calling it again updates the loss options (``group`` only on the first call)."""
    _check_options(loss_options)
    if not _is_pretrained_model(model):
        raise TypeError(f"model must be a transformers PreTrainedModel (*ForCausalLM), got {type(model).__name__}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    if model.get_output_embeddings() is None and hasattr(model, "layers"):
        raise TypeError(
            f"model is a bare {type(model).__name__} (no lm_head): pass a *ForCausalLM "
            f"(e.g. {type(model).__name__.replace('Model', '')}ForCausalLM), whose lm_head the loss uses"
        )
    model_type = _model_type(model)
    if not isinstance(getattr(model, getattr(model, "base_model_prefix", ""), None), nn.Module):
        raise ValueError(f"{type(model).__name__} has no base model attribute {model.base_model_prefix!r}")
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None or len(_logical_shape(head.weight)) != 2:
        raise ValueError(f"{type(model).__name__}.get_output_embeddings() must be a module with a 2-D weight")
    LossOptions(**loss_options)  # validate the values now, not at the first forward

    if is_applied(model):
        if group is not None:
            raise ValueError("flce_dist: apply() was already called on this model; pass group only on the first call")
        model.__dict__["_flce_state"].options = dict(loss_options)
        return model

    if group is not None and group_size(group) > 1:
        _shard_model(model, head, group)

    model.__dict__["_flce_state"] = _State(
        options=dict(loss_options),
        transform=SUPPORTED_MODEL_TYPES[model_type],
        moe=model_type in _MOE_TYPES,
        previous_forward=model.__dict__.get("forward"),
    )
    original = model.__dict__.get("forward") or type(model).forward

    @functools.wraps(original)  # keeps the model's forward signature visible (generate() inspects it)
    def forward(self, *args, **kwargs):
        return _fused_forward(self, *args, **kwargs)

    model.forward = types.MethodType(forward, model)
    _install_head_forward(head)
    return model


_LOGPROB_OPTIONS = ("ignore_index", "softcap", "deterministic")  # what apply()'s options may add to log-probs


def logprobs_and_entropy(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position ``(logp, entropy)`` of a supported ``*ForCausalLM`` (``apply`` called or not),
    float32 ``[B, T]``, both differentiable, without the ``[B, T, V]`` logits:

    - ``logp[b, t] = log p(next[b, t] | input_ids[b, :t+1])`` with ``next = labels[:, 1:]`` (the
      causal shift; ``labels`` defaults to ``input_ids``), and ``entropy[b, t]`` the entropy of
      that next-token distribution; 0 (and no gradient) at the last position, where the shifted
      target is ``ignore_index``, and where ``attention_mask`` is 0 for the next token;
    - the model's logit transform (Gemma2 softcap, Granite/Cohere scaling) applies, then
      ``temperature`` (a sampling temperature, as in PPO/GRPO rollouts);
    - a vocab-sharded head (``apply(model, group=...)``, DeepSpeed AutoTP, ``VocabParallelLMHead``)
      is used in place: vocab-parallel, one statistics all-gather forward, one dX all-reduce backward.

    ``model_kwargs`` go to the base model (``position_ids``, ...)."""
    model_type = _model_type(model)
    base = getattr(model, model.base_model_prefix)
    outputs = base(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    target = _next_tokens(input_ids if labels is None else labels, ignore_index)
    if attention_mask is not None:
        keep = nn.functional.pad(attention_mask, (0, 1), value=0)[..., 1:].bool()
        target = torch.where(keep, target, torch.full_like(target, ignore_index))
    state = model.__dict__.get("_flce_state")
    applied = {k: v for k, v in (state.options if state is not None else {}).items() if k in _LOGPROB_OPTIONS}
    options = _transform_options(model, SUPPORTED_MODEL_TYPES[model_type], applied)
    # the sampling temperature divides the final logits, after the model's softcap (the loss's meaning)
    options["temperature"] = options["temperature"] * temperature
    options.update(ignore_index=ignore_index, reduction="none", return_entropy=True)
    head = model.get_output_embeddings()
    _install_head_forward(head)
    nll, entropy = head(hidden, flce_target=target.to(hidden.device).contiguous(), flce_options=options)
    return -nll, entropy


def unapply(model: PreTrainedModel) -> PreTrainedModel:
    """Restore the model's own forward (a vocab-sharded lm_head, and a tied vocab-parallel embedding,
    stay sharded; ``state_dict`` still gathers them)."""
    state = model.__dict__.pop("_flce_state", None)
    if state is None:
        return model
    if state.previous_forward is not None:
        model.forward = state.previous_forward
    else:
        model.__dict__.pop("forward", None)
    return model
