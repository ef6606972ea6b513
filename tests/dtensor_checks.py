"""DTensor inputs under torchrun (one process per rank):

    torchrun --nproc_per_node=P tests/dtensor_checks.py [--backend gloo|nccl]

Every case builds one full float64 problem from a seed, turns this rank's part of it into DTensors
(``weight`` Shard(0) over the tensor-parallel mesh dim: DTensor's own ``torch.chunk`` split, or the
project's ``vocab_shard`` split through ``from_local(shape=...)``), calls the loss and checks the
loss, the gradients' DTensor placements and their local values against the float64 full-logits
reference. Meshes: 1-D over all ranks; with 4 ranks also a 2x2 (dp, tp) mesh in both dim orders.
Hidden: a plain tensor, a Replicate() DTensor, and Shard over the sequence dim (sequence
parallelism, uneven ``torch.chunk`` token split). Also tied embedding / lm_head weights and the
argument errors. Exits non-zero on any failure (pytest: tests/test_dtensor.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flce_dist  # noqa: E402
from flce_dist import reference_loss, settings, vocab_shard  # noqa: E402
from flce_dist.distributed.dtensor import chunk_span  # noqa: E402
from flce_dist.distributed.shard import clear_shard_cache  # noqa: E402
from tests._checks import SMALL_BLOCKS, Checker, exit_rank  # noqa: E402

def _weight(w: torch.Tensor, mesh, tp_dim: int, split: str, dev, dtype) -> DTensor:
    """The full [V, ...] ``w`` as a DTensor Shard(0) on mesh dim ``tp_dim`` (Replicate elsewhere)."""
    p, r = mesh.size(tp_dim), mesh.get_local_rank(tp_dim)
    if split == "chunk":
        s, n = chunk_span(w.shape[0], p, r)
    else:
        s, e = vocab_shard(w.shape[0], r, p)
        n = e - s
    placements = [Replicate()] * mesh.ndim
    placements[tp_dim] = Shard(0)
    local = w[s:s + n].to(dev, dtype).clone()
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=w.shape, stride=w.stride())
    return dt, (s, s + n)


def _token_layout(mesh, tp_dim: int, t: int, hidden_kind: str):
    """hidden's placements and this rank's token rows: replicated, or ("seq") Shard(1) on the tp dim
    with DTensor's torch.chunk split of the t positions."""
    lead = [Replicate()] * mesh.ndim
    if hidden_kind != "seq":
        return lead, slice(0, t)
    lead[tp_dim] = Shard(1)
    ts, tn = chunk_span(t, mesh.size(tp_dim), mesh.get_local_rank(tp_dim))
    return lead, slice(ts, ts + tn)


def case(ck, dev, mesh, tp_dim, *, b=2, t=7, h=40, v=53, split="chunk", hidden_kind="plain", bias=False,
         reduction="mean", target_kind="global", tied=False, dtype=torch.float32, seed=0, **opts):
    # The shard check is cached per rank on (group, local shard, tokens, call): a case that changes only
    # some ranks' shards would split the ranks between cached and handshaking (the cross-rank guard of
    # issue 17); every rank starts each case from an empty cache, in the same order.
    clear_shard_cache()
    name = (f"mesh={tuple(mesh.shape)} tp_dim={tp_dim} split={split} hidden={hidden_kind} target={target_kind} "
            f"bias={bias} {reduction} tied={tied} b={b} t={t} v={v} {opts or ''}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h**-0.5
    bb = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    tgt = torch.randint(0, v, (b, t), generator=g)
    tgt[torch.rand(b, t, generator=g) < 0.2] = -100
    go = torch.randn(b, t, generator=g, dtype=torch.float64)
    ids = torch.randint(0, v, (b, t), generator=g)  # tied: the embedding's input tokens

    wd, (s, e) = _weight(w, mesh, tp_dim, split, dev, dtype)
    wd.requires_grad_()
    bd = None
    if bias:
        bd, _ = _weight(bb, mesh, tp_dim, split, dev, dtype)
        bd.requires_grad_()
    lead, rows = _token_layout(mesh, tp_dim, t, hidden_kind)
    hx = x.to(dev, dtype).clone().requires_grad_()
    if tied:  # hidden = tanh(embedding(ids) + x) where the embedding table IS the lm_head weight
        from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

        emb = torch.nn.Embedding(v, h, device=dev, dtype=dtype)
        with torch.no_grad():
            emb.weight.copy_(w.to(dev, dtype))
        assert mesh.ndim == 1 and split == "chunk"
        parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate(),
                                                      output_layouts=Shard(1) if hidden_kind == "seq" else Replicate()))
        wd = emb.weight  # a Shard(0) DTensor Parameter: the lm_head weight below is the same tensor
        hloc = torch.tanh(emb(ids.to(dev)) + hx[:, rows])
    else:
        hloc = hx[:, rows]
    if hidden_kind == "plain":
        hin = hloc
    else:
        hin = DTensor.from_local(hloc, mesh, lead, run_check=False, shape=torch.Size((b, t, h)),
                                 stride=(t * h, h, 1))
    if target_kind == "global":
        tin = tgt.to(dev)
    elif target_kind == "local":
        tin = tgt[:, rows].to(dev)
    else:
        tin = DTensor.from_local(tgt[:, rows].to(dev), mesh, lead, run_check=False, shape=tgt.shape,
                                 stride=tgt.stride())
    out = flce_dist.fused_linear_cross_entropy(hin, wd, tin, bias=bd, reduction=reduction, return_lse=True, **opts)
    loss, lse = out
    if reduction == "none":
        ck.true(f"{name}: per-token loss is a DTensor placed like hidden's tokens",
                hidden_kind == "plain" and not isinstance(loss, DTensor)
                or isinstance(loss, DTensor) and tuple(loss.placements) == tuple(lead) and tuple(loss.shape) == (b, t))
        loc = loss.to_local() if isinstance(loss, DTensor) else loss
        (loc * go[:, rows].to(dev, loc.dtype)).sum().backward()
    else:
        ck.true(f"{name}: scalar loss is a plain tensor", not isinstance(loss, DTensor) and loss.dim() == 0)
        loss.backward()

    xr = x.to(dtype).double().clone().requires_grad_()
    wr = w.to(dtype).double().clone().requires_grad_()
    br = bb.to(dtype).double().clone().requires_grad_() if bias else None
    hr = torch.tanh(torch.nn.functional.embedding(ids, wr) + xr) if tied else xr
    ref_opts = {k: val for k, val in opts.items() if k not in ("strategy", "deterministic", "grad_filter_eps")}
    ref, ref_lse = reference_loss(hr, wr, tgt, bias=br, reduction=reduction, return_lse=True, **ref_opts)
    ref.backward(go if reduction == "none" else None)
    lt, gt = (1e-5, 1e-4) if dtype != torch.bfloat16 else (1e-2, 1e-2)
    loc_loss = loss.to_local() if isinstance(loss, DTensor) else loss
    ck.close(f"{name}: loss", loc_loss, ref[:, rows] if reduction == "none" else ref, lt)
    loc_lse = lse.to_local() if isinstance(lse, DTensor) else lse
    ck.close(f"{name}: lse", loc_lse, ref_lse[:, rows], lt)
    ck.true(f"{name}: weight.grad is a DTensor with weight's placements",
            isinstance(wd.grad, DTensor) and tuple(wd.grad.placements) == tuple(wd.placements))
    ck.close(f"{name}: dW shard", wd.grad.to_local(), wr.grad[s:e], gt)
    ck.close(f"{name}: dX", hx.grad[:, rows], xr.grad[:, rows], gt)
    if bias:
        ck.true(f"{name}: bias.grad placements", isinstance(bd.grad, DTensor) and tuple(bd.grad.placements) == tuple(bd.placements))
        ck.close(f"{name}: db shard", bd.grad.to_local(), br.grad[s:e], gt)


def entropy_case(ck, dev, mesh, tp_dim, *, b=2, t=6, h=24, v=53, hidden_kind="replicate", seed=11):
    """flce_dist.logprobs_and_entropy with a Shard(0) DTensor weight (DTensor's uneven split) and a
    replicated or sequence-sharded DTensor hidden: per-token outputs placed like hidden's tokens,
    values and gradients of sum(a * logp) + beta * sum(H) against the float64 reference."""
    from flce_dist import logprobs_and_entropy, reference_logprobs_and_entropy

    clear_shard_cache()
    name = f"entropy mesh={tuple(mesh.shape)} tp_dim={tp_dim} hidden={hidden_kind} v={v}"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h**-0.5 * 2
    tgt = torch.randint(0, v, (b, t), generator=g)
    tgt[torch.rand(b, t, generator=g) < 0.2] = -100
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    wd, (s, e) = _weight(w, mesh, tp_dim, "chunk", dev, torch.float32)
    wd.requires_grad_()
    lead, rows = _token_layout(mesh, tp_dim, t, hidden_kind)
    hx = x.to(dev, torch.float32).clone().requires_grad_()
    hin = DTensor.from_local(hx[:, rows], mesh, lead, run_check=False, shape=torch.Size((b, t, h)), stride=(t * h, h, 1))
    logp, ent = logprobs_and_entropy(hin, wd, tgt.to(dev), temperature=0.8, softcap=4.0)
    placed = all(isinstance(o, DTensor) and tuple(o.placements) == tuple(lead) and tuple(o.shape) == (b, t)
                 for o in (logp, ent))
    ck.true(f"{name}: logp and entropy are DTensors placed like hidden's tokens", placed)
    lp, en = logp.to_local(), ent.to_local()
    ((adv[:, rows].to(dev, lp.dtype) * lp).sum() + 0.4 * en.sum()).backward()
    xr, wr = x.float().double().requires_grad_(), w.float().double().requires_grad_()
    rl, re_ = reference_logprobs_and_entropy(xr, wr, tgt, temperature=0.8, softcap=4.0)
    ((adv * rl).sum() + 0.4 * re_.sum()).backward()
    ck.close(f"{name}: logp", lp, rl[:, rows], 1e-5)
    ck.close(f"{name}: entropy", en, re_[:, rows], 1e-5)
    ck.true(f"{name}: weight.grad placements", isinstance(wd.grad, DTensor) and tuple(wd.grad.placements) == tuple(wd.placements))
    ck.close(f"{name}: dW shard", wd.grad.to_local(), wr.grad[s:e], 1e-4)
    ck.close(f"{name}: dX", hx.grad[:, rows], xr.grad[:, rows], 1e-4)


def errors(ck, dev, mesh, tp_dim):
    p = mesh.size(tp_dim)
    w = torch.randn(5 * p + 1, 8, dtype=torch.float64)
    wd, _ = _weight(w, mesh, tp_dim, "chunk", dev, torch.float32)
    x = torch.randn(3, 8, device=dev)
    t = torch.randint(0, w.shape[0], (3,), device=dev)
    bad = [Replicate()] * mesh.ndim
    bad[tp_dim] = Shard(1)
    wcol = DTensor.from_local(torch.randn(w.shape[0], 8 // p if 8 % p == 0 else 1, device=dev), mesh, bad, run_check=False)
    ck.raises("weight Shard(1) is refused", ValueError, ["weight", "Shard(0)"],
              lambda: flce_dist.fused_linear_cross_entropy(x, wcol, t))
    ck.raises("vocab_start with a DTensor weight", ValueError, ["vocab_start"],
              lambda: flce_dist.fused_linear_cross_entropy(x, wd, t, vocab_start=0))
    other = dist.new_group(list(range(dist.get_world_size())))
    if p > 1:
        ck.raises("a group other than the weight's mesh dim", ValueError, ["group"],
                  lambda: flce_dist.fused_linear_cross_entropy(x, wd, t, group=other))
    ck.raises("plain bias with a DTensor weight", ValueError, ["bias"],
              lambda: flce_dist.fused_linear_cross_entropy(x, wd, t, bias=torch.zeros(wd.to_local().shape[0], device=dev)))
    xd = DTensor.from_local(torch.randn(3, 8, device=dev), mesh, [Replicate()] * mesh.ndim, run_check=False)
    ck.raises("DTensor hidden with a plain weight", TypeError, ["weight", "DTensor"],
              lambda: flce_dist.fused_linear_cross_entropy(xd, w.float().to(dev), t))
    hl = [Replicate()] * mesh.ndim
    hl[tp_dim] = Shard(1)
    xh = DTensor.from_local(torch.randn(3, 8, device=dev), mesh, hl, run_check=False, shape=(3, 8 * p), stride=(8 * p, 1))
    ck.raises("hidden sharded on its hidden dim", ValueError, ["hidden", "token dim"],
              lambda: flce_dist.fused_linear_cross_entropy(xh, wd, t))
    ck.raises("sequence_parallel=True with a replicated DTensor hidden", ValueError, ["sequence_parallel"],
              lambda: flce_dist.fused_linear_cross_entropy(xd, wd, t, sequence_parallel=True))


def module(ck, dev, mesh, tp_dim):
    """VocabParallelLMHead on a mesh: a Shard(0) DTensor parameter equal to the nn.Linear slice."""
    torch.manual_seed(5)
    head = flce_dist.VocabParallelLMHead(24, 37, mesh=mesh, mesh_dim=tp_dim, bias=True, device=dev)
    torch.manual_seed(5)
    lin = torch.nn.Linear(24, 37, bias=True)
    s, e = head.shard
    ck.true("mesh head: weight is a Shard(0) DTensor", isinstance(head.weight, DTensor)
            and isinstance(head.weight.placements[tp_dim], Shard))
    ck.true("mesh head: init == nn.Linear slice", torch.equal(head.weight.to_local().cpu(), lin.weight.detach()[s:e]))
    x = torch.randn(2, 5, 24, device=dev)
    t = torch.randint(0, 37, (2, 5), device=dev)
    loss = head(x, t)
    ref = reference_loss(x.double().cpu(), lin.weight.double(), t.cpu(), bias=lin.bias.double())
    ck.close("mesh head: loss", loss, ref, 1e-5)
    loss.backward()
    ck.true("mesh head: grad is a DTensor", isinstance(head.weight.grad, DTensor))
    logits = head(x)
    ck.true("mesh head: logits are a DTensor Shard(-1) of [.., V]", isinstance(logits, DTensor)
            and tuple(logits.shape) == (2, 5, 37))
    ck.close("mesh head: logits shard", logits.to_local(), (x.cpu() @ lin.weight.T + lin.bias)[..., s:e].detach(), 1e-5)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--device", choices=["auto", "cuda-shared"], default="auto",
                    help="cuda-shared (with --backend gloo): every rank on cuda:0, a testing mode for the CUDA paths")
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    shared = args.device == "cuda-shared"
    if args.device == "cuda-shared":  # gloo's functional all-gather of CUDA tensors crashes: launch/components/shared_gpu.py
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launch"))
        from components import shared_gpu

        shared_gpu.install()
    dev_type = "cuda" if args.backend == "nccl" or shared else "cpu"
    dev = (torch.device("cuda", 0 if shared else int(os.environ.get("LOCAL_RANK", 0))) if dev_type == "cuda"
           else torch.device("cpu"))
    if dev_type == "cuda":
        torch.cuda.set_device(dev)
    torch.set_num_threads(1)
    ck = Checker(rank)
    meshes = [(init_device_mesh(dev_type, (world,), mesh_dim_names=("tp",)), 0)]
    if world == 4:
        meshes.append((init_device_mesh(dev_type, (2, 2), mesh_dim_names=("dp", "tp")), 1))
        meshes.append((init_device_mesh(dev_type, (2, 2), mesh_dim_names=("tp", "dp")), 0))
    cm = settings.override(blocks=SMALL_BLOCKS) if dev_type == "cpu" else settings.override()
    try:
        with cm:
            for mesh, d in meshes:
                p = mesh.size(d)
                vs = [9 * p + 2, 2 * (p - 1)] if p > 2 else [53]  # 2(p-1) rows over p: an empty last chunk
                full = mesh.ndim == 1
                for v in vs:
                    for split in ("chunk", "vocab_shard"):
                        case(ck, dev, mesh, d, v=v, split=split)
                        case(ck, dev, mesh, d, v=v, split=split, hidden_kind="seq", reduction="none")
                # the gradient filter's path (vocab order, block mask) on every split, the empty last
                # chunk included; a tiny eps keeps every block, so the exact reference applies
                case(ck, dev, mesh, d, v=vs[-1], split="chunk", grad_filter_eps=1e-30, seed=8)
                case(ck, dev, mesh, d, v=vs[-1], split="chunk", hidden_kind="seq", reduction="none",
                     grad_filter_eps=1e-30, seed=8)
                if full:
                    for hk in ("replicate", "seq"):
                        for red in ("mean", "sum", "none"):
                            case(ck, dev, mesh, d, hidden_kind=hk, reduction=red, bias=True, seed=1)
                    case(ck, dev, mesh, d, hidden_kind="seq", target_kind="local", seed=2)
                    case(ck, dev, mesh, d, hidden_kind="seq", target_kind="dtensor", reduction="none", seed=3)
                    case(ck, dev, mesh, d, hidden_kind="seq", t=2 * p, seed=4, label_smoothing=0.1, z_loss=1e-3)
                    case(ck, dev, mesh, d, hidden_kind="replicate", seed=5, softcap=3.0, temperature=0.7,
                         strategy="recompute")
                    case(ck, dev, mesh, d, hidden_kind="seq", t=1, seed=6)  # fewer tokens than ranks
                if full:
                    for hk in ("plain", "replicate", "seq"):
                        case(ck, dev, mesh, d, hidden_kind=hk, tied=True, seed=7)
                for hk in ("replicate", "seq"):
                    entropy_case(ck, dev, mesh, d, hidden_kind=hk, v=9 * p + 2)
                errors(ck, dev, mesh, d)
                module(ck, dev, mesh, d)
    except Exception:  # noqa: BLE001
        # this rank's exception: report and leave now; torchrun then stops the ranks still inside a collective
        # (a barrier here would wait for them until the test's timeout)
        ck.failures.append("exception:\n" + traceback.format_exc())
        ck.report()
        exit_rank(1)
    ck.report()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if ck.failures else 0


if __name__ == "__main__":
    exit_rank(main())  # no interpreter teardown: the mesh groups outlive destroy_process_group
