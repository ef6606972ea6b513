"""The (dp, tp) device mesh, tensor/sequence parallelism of the whole Llama, FSDP2 over dp, and
the global gradient-norm clip. Follows torchtitan's llama ``parallelize`` (``apply_tp`` then
``apply_fsdp``), adapted to the Hugging Face module names and call conventions:

- ``embed_tokens``: ``RowwiseParallel`` (vocab-sharded ``Shard(0)`` table; output ``Shard(1)``
  under sp, else ``Replicate()``). Under sp the output stays a DTensor (``use_local_output=False``)
  so that ``LlamaModel.forward`` sees the global sequence length for its causal mask (the positions
  are passed explicitly by ``CausalLM``).
- per decoder layer: ``q/k/v_proj``, ``gate/up_proj`` ``ColwiseParallel``, ``o_proj``/``down_proj``
  ``RowwiseParallel`` (output ``Shard(1)`` under sp); HF's attention reshapes to ``(-1, head_dim)``,
  so it finds its local heads itself. Under sp: ``input_layernorm``/``post_attention_layernorm``
  ``SequenceParallel``, and ``PrepareModuleInput`` all-gathers the sequence before attention (which
  HF calls with keyword arguments: ``input_kwarg_layouts={"hidden_states": Shard(1)}``) and the MLP.
- final ``norm``: ``SequenceParallel`` under sp (its output, a ``Shard(1)`` DTensor, is the head's
  hidden); ``lm_head``: ``ColwiseParallel`` (weight ``Shard(0)``; the torch head gets DTensor logits
  ``Shard(-1)``; the flce head never calls ``lm_head.forward``, only its weight is used).
- tied embeddings: after the plan, ``lm_head.weight`` is set to the embedding's ``Shard(0)``
  Parameter again (both plans shard dim 0 with the same split).
- FSDP2: ``fully_shard(layer, mesh=mesh["dp"])`` per decoder layer, then the root ``CausalLM``
  (whose forward computes the loss, so the root's unshard covers embed, final norm and lm_head),
  when dp > 1. FSDP2 runs on CPU/gloo in torch 2.13 (checked: forward, backward, reduce-scatter),
  so no stand-in is needed.
- after each backward, ``reduce_partial_grads_``: the norm weights' ``Partial`` gradients reduced in
  one all-reduce (instead of again at every read by the clip and AdamW)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def build_mesh(device_type: str, dp: int, tp: int) -> DeviceMesh:
    """The 2-D ``("dp", "tp")`` mesh over the default process group (tp ranks are consecutive)."""
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> None:
    """Tensor (and, with ``sp``, sequence) parallelism of the whole model over ``tp_mesh``."""
    body = model.model
    parallelize_module(body, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate(),
                                        use_local_output=not sp),
        **({"norm": SequenceParallel()} if sp else {}),
    })
    rowwise_out = Shard(1) if sp else Replicate()
    for layer in body.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=rowwise_out, use_local_output=not sp),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=rowwise_out, use_local_output=not sp),
        }
        if sp:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, tp_mesh, plan)
    tied = model.lm_head.weight is body.embed_tokens.weight or getattr(model.config, "tie_word_embeddings", False)
    # the flce head only needs the Shard(0) weight; the torch head also gets DTensor logits Shard(-1)
    parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(
        input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1), use_local_output=False))
    if tied:
        model.lm_head.weight = body.embed_tokens.weight
    model.tp_mesh, model.sp = tp_mesh, sp


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype | None = None) -> None:
    """FSDP2 over the dp mesh: each decoder layer, then the root (embed, final norm, lm_head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def apply_compile(model: nn.Module, backend: str) -> None:
    """``torch.compile`` each decoder layer in place (``Module.compile``: the module object, and so
    FSDP2's wrapping and the checkpoint keys, stay the same); graph breaks are allowed (HF layers
    take a cache argument), the loss is outside the compiled layers."""
    for layer in model.model.layers:
        layer.compile(backend=backend)


def parallelize(model: nn.Module, mesh: DeviceMesh | None, sp: bool, compile_backend: str = "") -> nn.Module:
    """Tensor parallelism, then ``torch.compile`` of the layers, then FSDP2 (torchtitan's order);
    ``mesh`` None (a single process): the compile step only."""
    if mesh is not None and mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"], sp)
    if compile_backend:
        apply_compile(model, compile_backend)
    if mesh is not None and mesh["dp"].size() > 1:
        apply_fsdp(model, mesh["dp"])
    return model


def reduce_partial_grads_(model: nn.Module) -> int:
    """Reduce the gradients that tensor parallelism leaves ``Partial`` (the norm weights under
    sequence parallelism: each tp rank holds the sum over its own tokens) once, right after the
    backward, and store them with the parameter's placement (``Replicate`` on those mesh dims).

    Without this the gradient stays ``Partial`` and every later read re-reduces it: the grad-norm
    clip and each AdamW op that reads the gradient (``lerp_``, ``addcmul_``), measured here as ~8
    all-reduces per norm weight per step on the CPU job, i.e. the ~165 small all-reduces per step
    of run 14's tp=2 profile of the 1.2B model (33 norm weights). Here: one all-reduce per bucket of
    gradients that share (mesh, dtype, placements), flattened into one buffer (a ``sum`` Partial is
    summed; an ``avg`` one summed and divided by the group size). Returns the number of gradients
    reduced. Other Partial kinds (none in this model) take DTensor's own ``redistribute``."""
    buckets: dict[tuple, list[nn.Parameter]] = {}
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            buckets.setdefault((id(g.device_mesh), g.dtype, tuple(g.placements)), []).append(p)
    for (_, _, placements), ps in buckets.items():
        mesh = ps[0].grad.device_mesh
        target = [Replicate() if pl.is_partial() else pl for pl in placements]
        ops = {getattr(pl, "reduce_op", None) for pl in placements if pl.is_partial()}
        if not ops <= {"sum", "avg"}:  # e.g. max/min partials: let DTensor reduce each one
            for p in ps:
                p.grad = p.grad.redistribute(placements=target)
            continue
        locals_ = [p.grad.to_local() for p in ps]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, pl in enumerate(placements):
            if pl.is_partial():
                torch.distributed.all_reduce(flat, group=mesh.get_group(dim))
                if pl.reduce_op == "avg":
                    flat /= mesh.size(dim)
        for p, t, part in zip(ps, locals_, flat.split([t.numel() for t in locals_])):
            p.grad = DTensor.from_local(part.view_as(t), mesh, target, run_check=False, shape=p.grad.shape,
                                        stride=p.grad.stride())
    return sum(len(ps) for ps in buckets.values())


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm of the whole model (DTensor gradients count each element once:
    ``get_total_norm`` per kind of gradient, ``.full_tensor()`` of that scalar only, as torchtitan
    does), and, with ``max_norm > 0``, ``clip_grads_with_norm_`` by it; returned as a device scalar. Plain and DTensor gradients
    (and DTensors on different meshes) are normed separately: foreach kernels refuse to mix them."""
    kinds: dict[str, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.grad is not None:
            key = f"{p.grad.device_mesh.mesh_dim_names}:{p.grad.placements}" if isinstance(p.grad, DTensor) else "plain"
            kinds.setdefault(key, []).append(p)
    sq = []
    for ps in kinds.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0)
        sq.append((n.full_tensor() if isinstance(n, DTensor) else n).float() ** 2)
    if not sq:  # no gradients: a zero on the parameters' device (the loop stacks it with the loss)
        return torch.zeros((), device=next((p.device for p in model.parameters()), None))
    total = torch.stack(sq).sum().sqrt()
    if max_norm > 0:
        for ps in kinds.values():
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total  # a device scalar: no host sync here (the loop reads it at log steps)
