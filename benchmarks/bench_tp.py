"""Tensor-parallel benchmark (one process per GPU):

    torchrun --nproc_per_node=2 benchmarks/bench_tp.py [--shapes llama3,qwen3,gemma] [--n 8192] [--out DIR]
                                                       [--data random,realistic] [--fixture PATH]

Per shape, each rank holds its vocab shard (uneven split allowed) and the same N tokens:
  flce        flce_dist.fused_linear_cross_entropy(group=TP, vocab_size=V)
  flce_filter the same with grad_filter_eps="auto" (the opt-in gradient filter; trees without it skip the row)
  megatron    Megatron-style: shard logits x @ W_r.T in float32, all-reduce max / sum-exp / target
              logit, softmax-grad backward, dX all-reduced (the same model of work, materialised)
  liger_vp    Liger's LigerVocabParallelCrossEntropy on materialised bf16 shard logits
  deepspeed   deepspeed.sequence.linear_cross_entropy.vocab_parallel_linear_cross_entropy (tp_group)
  floor       3 x the shard matmul + one dX all-reduce ([N, H] in bf16), each timed in this run
              (``ratio3``, ``x floor3``: against the shard's three distinct matmuls run back to back,
              ``_timing.three_matmuls``, + the all-reduce; ``ratio_plan``, ``x plan``: against the same
              three as flce's per-rank chunk plan issues them, ``_timing.chunked_matmuls``, + the all-reduce)
Times are the max over ranks of the per-rank median (CUDA events); memory is the per-rank peak
above the inputs. Writes ``bench_tp<P>.csv`` (``bench_tp<P>_n<N>.csv`` for N != 8192; ``_<data modes>``
appended unless ``--data`` is the default) and prints a
table; ``benchmarks/scaling.py`` turns the CSVs of several P into the scaling efficiency.
Data modes (``--data``, default ``random,realistic``; ``benchmarks/data.py``, as in ``bench.py``):
every rank builds the same full inputs and keeps its vocab shard; each row carries its ``data``
mode and the ``describe()`` numbers (``d_*``) of the full inputs. (CCE has no vocab-parallel
form, so it is not in this benchmark.)
"""

from __future__ import annotations

import argparse
import inspect
import os

import torch
import torch.distributed as dist

import common  # noqa: E402  (first: a flce_dist tree on PYTHONPATH wins, else this repository's)
import data as bench_data  # noqa: E402
import flce_dist  # noqa: E402
from flce_dist import vocab_shard  # noqa: E402
from flce_dist._timing import cuda_time_ms, three_matmuls  # noqa: E402
from flce_dist._timing import peak_gib as _peak_gib  # noqa: E402

try:  # the chunk plan's cuBLAS work alone (run 21)
    from flce_dist._timing import chunked_matmuls  # noqa: E402
except ImportError:
    chunked_matmuls = None


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient in backward (Megatron's copy_to_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _MegatronVocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, group):
        logits = logits.float()
        m = logits.max(dim=1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        logits = logits - m[:, None]
        tl = target - start
        inside = (tl >= 0) & (tl < logits.shape[1])
        tl = torch.where(inside, tl, 0)
        pred = torch.where(inside, logits.gather(1, tl[:, None])[:, 0], 0.0)
        dist.all_reduce(pred, group=group)
        exp = logits.exp_()
        s = exp.sum(1)
        dist.all_reduce(s, group=group)
        loss = s.log() - pred
        exp.div_(s[:, None])
        ctx.save_for_backward(exp, tl, inside)
        return loss

    @staticmethod
    def backward(ctx, g):
        sm, tl, inside = ctx.saved_tensors
        grad = sm
        grad[torch.arange(grad.shape[0], device=grad.device), tl] -= inside.float()
        grad.mul_(g[:, None])
        return grad.to(torch.bfloat16), None, None, None


def time_ms(fn, reps):
    """Per-rank median (barrier before each timed call), then the max over ranks."""
    return common.max_over_ranks(cuda_time_ms(fn, reps, before=dist.barrier))


def peak_gib(fn, *params):
    """Per-rank peak above the inputs, gradients included; the max over ranks."""
    return common.max_over_ranks(_peak_gib(fn, *params))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    common.add_case_args(ap)
    ap.add_argument("--impls", default="flce,flce_filter,megatron,liger_vp,deepspeed")
    args = ap.parse_args(argv)
    common.check_case_args(ap, args)
    return args


def _with_grad_form(form, x, w, t, group, v):
    with flce_dist.settings.override(grad_form=form):
        return flce_dist.fused_linear_cross_entropy(x, w, t, group=group, vocab_size=v)


TABLE = [("shape", "shape", "8"), ("data", "data", "9"), ("impl", "impl", "10"), ("fwd+bwd ms", "fwd_bwd_ms", "10.2f"),
         ("x floor", "ratio", "8.2f"), ("x floor3", "ratio3", "9.2f"), ("x plan", "ratio_plan", "7.3f"),
         ("peak GiB/rank", "mem_gib", "14.2f")]


def main():
    args = parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    impls = args.impls.split(",")
    if "deepspeed" in impls:
        try:
            import deepspeed
            from deepspeed.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy

            deepspeed.init_distributed(dist_backend="nccl")
        except Exception as e:  # noqa: BLE001
            print("deepspeed unavailable:", e)
            impls.remove("deepspeed")
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    group = dist.group.WORLD
    p = dist.get_world_size()
    lg = None
    if "liger_vp" in impls:
        try:
            from liger_kernel.transformers.vocab_parallel_cross_entropy import LigerVocabParallelCrossEntropy

            lg = LigerVocabParallelCrossEntropy()
        except Exception as e:  # noqa: BLE001
            print("liger unavailable:", e)
            impls.remove("liger_vp")
    rows = []
    for name, mode, h, v in common.cases(args):
        s, e = vocab_shard(v, rank, p)
        # every rank builds the same full inputs (random: the pre-data-mode generator calls, bit for bit)
        xf, wf, t = bench_data.make_inputs(args.n, h, v, mode=mode, dtype=torch.bfloat16, device="cuda", seed=0,
                                           sorted_vocab=args.sorted_vocab, fixture=args.fixture or None)
        if rank == 0:
            print(f"{name} H={h} V={v} data={mode}")
        x, w, dcols = common.shard_leaves(xf, wf, t, s, e, rank)
        del wf, xf
        torch.cuda.empty_cache()
        mm = time_ms(lambda: x.detach() @ w.detach().T, args.reps)
        buf = torch.randn(args.n, h, device="cuda", dtype=torch.bfloat16)
        ar = time_ms(lambda: dist.all_reduce(buf), args.reps)
        floor = 3 * mm + ar
        # the shard's three distinct matmuls back to back (x @ W_r.T, dy @ W_r, dy.T @ x) + the all-reduce
        floor3 = time_ms(three_matmuls(x.detach(), w.detach()), args.reps) + ar
        # the same on flce's own chunk plan (1/P of the 1 GiB budget per rank, ceil(V / P) columns): cuBLAS alone
        plan = common.chunk_plan(x, v, group) if chunked_matmuls else 0
        floorp = time_ms(chunked_matmuls(x.detach(), w.detach(), plan), args.reps) + ar if plan else float("nan")
        torch.cuda.empty_cache()
        rows.append(dict(shape=name, data=mode, impl="floor", P=p, N=args.n, fwd_bwd_ms=floor, ratio=1.0, mem_gib=0.0,
                         mm_ms=mm, allreduce_ms=ar, floor3_ms=floor3, ratio3=floor / floor3, plan_rows=plan,
                         plan_ms=floorp, ratio_plan=floor / floorp, **dcols))
        fns = {
            "flce": lambda: flce_dist.fused_linear_cross_entropy(x, w, t, group=group, vocab_size=v),
            "megatron": lambda: _MegatronVocabParallelCE.apply(_CopyToTP.apply(x, group) @ w.T, t, s, group).mean(),
            "liger_vp": lambda: lg((_CopyToTP.apply(x, group) @ w.T)[:, None, :], t[:, None], tp_group=group).mean(),
        }
        if "grad_form" in inspect.signature(flce_dist.settings.override).parameters:  # the chunk_grad_ form (before rowscale.py)
            fns["flce_chunkgrad"] = lambda: _with_grad_form("chunk_grad", x, w, t, group, v)
        if "grad_filter_eps" in inspect.signature(flce_dist.fused_linear_cross_entropy).parameters:
            fns["flce_filter"] = lambda: flce_dist.fused_linear_cross_entropy(x, w, t, group=group, vocab_size=v,
                                                                              grad_filter_eps="auto")
        if "deepspeed" in impls:
            fns["deepspeed"] = lambda: vocab_parallel_linear_cross_entropy(x, w, t, tp_group=group, vocab_start_index=s,
                                                                           vocab_end_index=e)
        for iname in [i for i in impls if i in fns]:  # an older tree (device.sh tpab) may lack a row
            fb = common.fwd_bwd(fns[iname], x, w)
            try:
                ms = time_ms(fb, args.reps)
                mem = peak_gib(fb, x, w)
            except Exception as ex:  # noqa: BLE001
                common.failed(f"{name}/{mode}/{iname}", ex)
                continue
            finally:
                x.grad = w.grad = None
                torch.cuda.empty_cache()
            rows.append(dict(shape=name, data=mode, impl=iname, P=p, N=args.n, fwd_bwd_ms=ms, ratio=ms / floor,
                             mem_gib=mem, mm_ms=mm, allreduce_ms=ar, floor3_ms=floor3, ratio3=ms / floor3,
                             plan_rows=plan, plan_ms=floorp, ratio_plan=ms / floorp, **dcols))
            if rank == 0:  # each row as soon as it is timed (a call cut off at its limit keeps what it measured)
                print(f"  {iname:10} {ms:8.2f} ms  {ms / floor:.2f}x floor ({floor:.2f} ms), {ms / floor3:.2f}x the "
                      f"distinct-matmul floor ({floor3:.2f} ms), {ms / floorp:.3f}x flce's {plan}-row chunk plan as cuBLAS "
                      f"work ({floorp:.2f} ms)  {mem:.2f} GiB/rank", flush=True)
        del x, w, buf
        torch.cuda.empty_cache()
    if rank == 0:
        common.save(rows, common.csv_name(f"bench_tp{p}", args.data, args.n), args)
        print(f"\nTP={p} {torch.cuda.get_device_name()} bf16 N={args.n}  (floor = 3 x shard matmul + dX all-reduce)")
        common.print_table(rows, TABLE, lambda r: common.data_note(r) if r["impl"] == "floor" else "")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
