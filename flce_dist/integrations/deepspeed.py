"""DeepSpeed integration: flce_dist as the fused loss of AutoTP's vocabulary-parallel lm_head.

DeepSpeed 0.19.8 AutoTP training (``"tensor_parallel": {"autotp_size": N, "vocab_parallel_lm_head":
true, "vocab_parallel_ce_backend": "torch" | "liger"}``) replaces ``lm_head`` by a
``deepspeed.module_inject.layers.VocabParallelLinear`` (a no-gather column-parallel linear holding
rows ``[vocab_start_index, vocab_end_index)``, group ``mp_group``) and installs
``deepspeed.sequence.cross_entropy.VocabParallelCausalLMLoss`` as ``model.loss_function``
(``runtime/engine.py``, ``finalize_autotp`` -> ``configure_vocab_parallel_loss``). Both backends still
run the model's forward, i.e. materialise the local ``[B, T, V_local]`` logits (and "torch" keeps a
float32 ``exp`` copy of them for backward). The backend name is a pydantic ``Literal["torch",
"liger"]`` in a config model with ``extra="forbid"`` (``runtime/tensor_parallel/config.py``), so a
third value cannot be registered there without patching DeepSpeed.

flce_dist therefore takes that slot from its own top-level section of the same JSON (DeepSpeed
ignores unknown top-level keys)::

    "tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": true, "vocab_parallel_ce_backend": "torch"},
    "flce_dist": {"enabled": true, "label_smoothing": 0.0, "z_loss": 0.0}

and :func:`initialize` is a drop-in for ``deepspeed.initialize``: it calls DeepSpeed unchanged, then
applies :func:`flce_dist.integrations.transformers.apply` to ``engine.module``. The patched forward
runs the base model, then calls the (DeepSpeed-replaced) lm_head module with the labels; the head's
shard, ``mp_group`` and ``vocab_start_index`` feed ``fused_linear_cross_entropy``, so no logits are
formed, dX is all-reduced over the TP group by flce_dist (DeepSpeed's ``ColumnParallel`` identity /
all-reduce is not needed) and dW lands in the shard's ``.grad`` for ZeRO to reduce over the
data-parallel group as usual. Without labels the DeepSpeed forward (local logits) runs unchanged.

Section keys (all optional): ``enabled`` (default true) and the loss options that every integration
accepts (``LossOptions.keywords("math")``; ``tests/test_integrations.py`` keeps this list in step):
``ignore_index``, ``label_smoothing``, ``z_loss``, ``softcap`` (default: the model's, e.g. Gemma2's
``final_logit_softcapping``), ``temperature``, ``strategy`` (``"auto" | "fused" | "recompute"``),
``deterministic``, ``grad_filter_eps``, ``check_finite``, ``check_inputs``.

The config may be what ``deepspeed.initialize`` takes: a dict, the path of a JSON (hjson) file, or
that JSON as a URL-safe base64 string (DeepSpeed 0.19.8, ``runtime/config.py``:
``base64.urlsafe_b64decode`` then ``hjson.loads``); also through ``config_params=`` or
``args.deepspeed_config``.

With ``"vocab_parallel_lm_head": false`` AutoTP follows the HF ``tp_plan`` (``lm_head:
colwise_gather_output``: a column-parallel ``LinearLayer`` that all-gathers full logits); flce_dist
uses that layer's shard and group the same way, so the loss is fused there as well.

ZeRO: stages 1 and 2 need nothing. Stage 3 works too: the loss is computed inside the lm_head
module's call, so ZeRO-3's module hooks gather the (TP-sharded) head weight for it exactly as for
the stock forward (and re-gather it in backward for the ``recompute`` strategy).

Users who do not call ``deepspeed.initialize`` themselves (e.g. the Hugging Face Trainer) can call
``flce_dist.integrations.transformers.apply(model, **options_from_config(ds_config))`` before
handing the model over: the lm_head is resolved at every call, so the DeepSpeed head is picked up.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import warnings
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from ..distributed import group_size
from ..options import LossOptions
from . import transformers as _hf
from .heads import HeadShard, head_shard, register_head_shard

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["SECTION", "enable", "initialize", "load_config", "options_from_config", "skip_cpu_shm_comm_build"]

SECTION = "flce_dist"
_KEYS = ("enabled", *LossOptions.keywords("math"))


@register_head_shard
def _autotp_head(head: Any) -> HeadShard | None:  # Any: a DeepSpeed layer (deepspeed is untyped)
    """DeepSpeed AutoTP: ``VocabParallelLinear`` (module_inject/layers.py) or a column-parallel
    ``LinearLayer``: its rows, ``mp_group`` and ``vocab_start_index`` (else the partition sizes)."""
    if not (hasattr(head, "mp_group") and hasattr(head, "_partition_sizes") and hasattr(head, "tp_index")):
        return None
    bias = getattr(head, "bias", None)
    group = head.mp_group
    if group is None or group_size(group) == 1:
        return HeadShard(head.weight, bias)
    start = getattr(head, "vocab_start_index", None)
    if start is None:
        start = sum(int(s) for s in head._partition_sizes[: head.tp_index])
    return HeadShard(head.weight, bias, group, int(start), sum(int(s) for s in head._partition_sizes))


def _loads(text: str) -> object:
    try:
        import hjson
    except ImportError:
        return json.loads(text)
    return hjson.loads(text)


def load_config(config: str | os.PathLike | dict | None) -> dict:
    """The DeepSpeed config as a dict, from what ``deepspeed.initialize`` accepts: a dict, the path of
    a JSON file (read with hjson like DeepSpeed, else json), or the JSON as a URL-safe base64 string."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        with open(config) as f:
            parsed = _loads(f.read())
        if isinstance(parsed, dict):
            return dict(parsed)
        raise ValueError(f"the DeepSpeed config file {config!r} does not hold a JSON object")
    if isinstance(config, str):  # DeepSpeed's third form: base64 of the JSON text
        try:
            parsed = _loads(base64.urlsafe_b64decode(config).decode("utf-8"))
        except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(
                f"config is a string but neither an existing file nor the base64 of a DeepSpeed JSON "
                f"config (what deepspeed.initialize accepts): {config!r}"
            ) from exc
        if isinstance(parsed, dict):
            return dict(parsed)
        raise ValueError(f"config is the base64 of {type(parsed).__name__}, not of a JSON object: {config!r}")
    raise ValueError(f"config must be a dict, the path of a DeepSpeed JSON file or its base64 string, got {config!r}")


def options_from_config(config: str | os.PathLike | dict | None) -> dict[str, Any] | None:
    """The loss options of the ``"flce_dist"`` section, or None when it is absent or disabled."""
    cfg = load_config(config)
    section = cfg.get(SECTION)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise TypeError(f'the "{SECTION}" section of the DeepSpeed config must be an object, got {section!r}')
    unknown = set(section) - set(_KEYS)
    if unknown:
        raise ValueError(f'unknown key(s) {sorted(unknown)} in the "{SECTION}" section; allowed: {list(_KEYS)}')
    if not section.get("enabled", True):
        return None
    options = {k: v for k, v in section.items() if k != "enabled"}
    tp = cfg.get("tensor_parallel", cfg.get("tp", {})) or {}
    backend = tp.get("vocab_parallel_ce_backend", "torch")
    if backend != "torch":
        raise ValueError(
            f'"{SECTION}": {{"enabled": true}} replaces the vocabulary-parallel CE backend; set '
            f'tensor_parallel.vocab_parallel_ce_backend to "torch" (its default), not {backend!r}'
        )
    return options


def enable(engine_or_model: Any, **options: Any) -> Any:
    """Make flce_dist compute the labels loss of a DeepSpeed engine (or of its module). Returns the argument."""
    model = getattr(engine_or_model, "module", engine_or_model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a DeepSpeedEngine or an nn.Module, got {type(engine_or_model).__name__}")
    _hf.apply(model, **options)
    autotp = getattr(engine_or_model, "autotp_size", None)
    if callable(autotp) and autotp() > 1:
        if head_shard(cast("PreTrainedModel", model).get_output_embeddings()).group is None:
            warnings.warn(
                "flce_dist: AutoTP is on but the lm_head is not vocabulary-sharded (set "
                "tensor_parallel.vocab_parallel_lm_head to true); every rank computes the full-vocabulary loss",
                stacklevel=2,
            )
    return engine_or_model


def initialize(model: nn.Module | None = None, config: str | os.PathLike | dict | None = None, **kwargs: Any):
    """Drop-in for ``deepspeed.initialize(model=..., config=..., **kwargs)`` that honours the
    ``"flce_dist"`` section of the config. Returns DeepSpeed's ``(engine, optimizer, dataloader, scheduler)``."""
    import deepspeed

    if config is None and kwargs.get("config_params") is not None:
        config = kwargs.pop("config_params")
    source = config
    args = kwargs.get("args")
    for name in ("deepspeed_config", "deepscale_config"):  # DeepSpeed reads both (the second is deprecated)
        if source is None and getattr(args, name, None) is not None:
            source = getattr(args, name)
    options = options_from_config(source)
    result = deepspeed.initialize(model=model, config=config, **kwargs)
    if options is not None:
        enable(result[0], **options)
    return result


def skip_cpu_shm_comm_build() -> None:
    """CPU only (``DS_ACCELERATOR=cpu``): make DeepSpeed's TorchBackend skip JIT-building its
    shared-memory ``deepspeed_shm_comm`` op (~60 s of C++ compilation on first init).

    ``deepspeed.comm.torch.build_shm_op`` only builds it when
    ``deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]`` is true; the op only serves
    ``inference_all_reduce`` (gloo is used instead). Call before ``deepspeed.init_distributed`` /
    ``deepspeed.initialize``."""
    import deepspeed.ops

    ops = deepspeed.ops.__dict__.get("__compatible_ops__")
    if ops is None:
        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    else:
        ops["deepspeed_shm_comm"] = False
