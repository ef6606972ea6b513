"""Single-GPU benchmark: flce_dist vs torch, Liger FLCE (Triton, and its CuTe DSL Hopper kernel), CCE, QuACK,
DeepSpeed's ``vocab_parallel_linear_cross_entropy`` (one-rank group) and the bare matmuls, in one run.

    python benchmarks/bench.py [--shapes llama3,qwen3,gemma] [--n 8192] [--dtype bf16] [--out DIR]
                               [--data random,realistic] [--fixture PATH] [--impls flce,cce,cce_exact,...]
                               [--steady-calls 4] [--idle-ms 2] [--rounds K]

For each shape, every implementation's forward+backward in two timing modes (``common.Timers``, issue 53;
CUDA events, warm-up, gradients set to None before each call):
  single  (``fwd_bwd_ms`` = ``single_ms``) median of ``--reps`` calls, each started on an idle GPU (a sync, then
          ``--idle-ms`` of sleep): the host work before the call's first kernel counts, as in an RL or
          evaluation loop that syncs every call;
  steady  (``steady_ms``) ``--steady-calls`` K calls back to back behind one untimed call, total / K, median of
          max(3, reps / 2) samples: the host work of a call overlaps the GPU work before it (a training loop);
and ``host_ms`` = single - steady (the call's host prologue; ``host_adj_ms`` less the 3mm row's own single -
steady, which is negative where back-to-back work runs at lower clocks: ``common.mode_cols``). Each mode against the three distinct matmuls timed
in the same mode in the same run (the ``3mm`` row: ``x @ W.T``, ``dy @ W``, ``dy.T @ x`` back to back,
``_timing.three_matmuls``, the floor as issue 15 words it): ``single_x3mm`` (= ``ratio_fb3``, ``x3dist``) and
``steady_x3mm``. Beside the times: peak memory above the inputs (``mem_gib``, the returned gradients included;
``extra_gib`` = ``mem_gib`` minus the dX and dW every implementation must return), forward-only (no grad) time
``fwd_ms`` (single mode) and peak ``fwd_mem_gib``. Also against the bare ``x @ W.T`` (the ``matmul`` row, fwd_bwd
= 3 of it): ``ratio_fb``, ``ratio_steady``, ``ratio_f``; and ``ratio_plan`` (``xplan``): fwd+bwd against the three
matmuls as flce's default chunk plan issues them (``_timing.chunked_matmuls`` at ``plan_rows`` rows: cuBLAS alone).
``liger_cute`` (Liger 0.8.5's CuTe DSL SM90 FLCE, :func:`liger_cute_impls`) runs where its constraints allow
(sm_90, bf16, N % 128 == 0, V % 256 == 0, the CuTe DSL importable); elsewhere its line says why it was skipped.
``--rounds K`` (run 28; both timing modes since issue 53) then times the fwd+bwd of the three matmuls and of
every impl again in K interleaved rounds per mode (order rotated per round; steady, then single calls) and
reports each impl's median per-round ratio to flce (``vs_flce``, ``vs_flce_single``, with their spread): a lead of a few % is only real where the rounds agree on it, since the
lent machines drift by several % between two single timings. Writes ``bench_<dtype>[_<data modes>].csv`` under
``benchmarks/results/`` (and ``--out``) and prints a table last.

Data modes (``--data``, default ``random,realistic``; ``benchmarks/data.py``): ``random`` is the
pre-data-mode input (bit-identical), ``realistic`` a synthetic trained-model-like head (Zipf prior,
loss ~2.5 nats), ``trained`` a fixture from ``capture_trained.py`` (``--fixture``; it runs at the
fixture's own H and V, shape name ``trained``). Every row carries its ``data`` mode and the
``describe()`` numbers of its inputs (``d_loss``, ``d_entropy``, ``d_max_logit``, ``d_logit_std``,
``d_skip_frac``, ``d_skip_frac_sorted``: negligible 128x128 softmax blocks, the ones CCE's
``filter_eps`` skips). CCE runs as its default (``cce``: ``filter_eps="high"`` = 2^-12 in bf16,
vocab sorted by mean logit in backward) and exact (``cce_exact``: ``filter_eps=None``).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
import statistics

import torch
import torch.nn.functional as F

import common  # noqa: E402  (first: a flce_dist tree on PYTHONPATH wins, else this repository's)
import data as bench_data  # noqa: E402
import flce_dist  # noqa: E402
from flce_dist._timing import DTYPES, three_matmuls  # noqa: E402

try:  # interleaved rounds (run 28; older trees: no --rounds)
    from flce_dist._timing import interleaved_ms, paired_ratios  # noqa: E402
except ImportError:
    interleaved_ms = paired_ratios = None

try:  # the chunk plan's cuBLAS work alone (run 21; trees before it: no such column)
    from flce_dist._timing import chunked_matmuls  # noqa: E402
except ImportError:
    chunked_matmuls = None


def torch_lce():
    """torch's own chunked linear cross entropy with its default options (torch >= 2.13), or None."""
    if not (hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")):
        return None
    return lambda x, w, t: F.linear_cross_entropy(x, w, t, options=torch.nn.LinearCrossEntropyOptions())


def filter_impls(rt) -> dict:
    """flce's gradient-filter rows (``rt``: the tree's settings module): ``flce_filter`` at CCE's default
    threshold (2^-12 for 16-bit inputs) in the default vocabulary order, ``flce_filter_gather`` /
    ``flce_filter_copy`` in that ``Settings.filter_order`` (trees without the option: no such rows)."""
    impls = {}
    if "grad_filter_eps" in inspect.signature(flce_dist.fused_linear_cross_entropy).parameters:
        impls["flce_filter"] = lambda x, w, t: flce_dist.fused_linear_cross_entropy(x, w, t, grad_filter_eps="auto")
    if "filter_order" in inspect.signature(rt.override).parameters:
        # without the sorted copy of the weight shard ("gather", the default from run 30) and with it ("copy")
        def filter_in(order):
            def run(x, w, t):
                with rt.override(filter_order=order):
                    return flce_dist.fused_linear_cross_entropy(x, w, t, grad_filter_eps="auto")
            return run

        impls["flce_filter_gather"], impls["flce_filter_copy"] = filter_in("gather"), filter_in("copy")
    return impls


def cute_skip(x: torch.Tensor, w: torch.Tensor, tile_m: int = 128, tile_n: int = 256) -> str:
    """Why Liger's CuTe DSL SM90 FLCE cannot run on ``x`` [N, H], ``w`` [V, H] ("" if it can): a Hopper GPU
    (compute capability 9.0), bf16 inputs, N a multiple of its token tile (128), V of its vocab tile (256).
    (No bias, label smoothing or softcap either: bench.py passes none.)"""
    why = []
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        why.append(f"bf16 only (got {x.dtype})")
    if x.shape[0] % tile_m:
        why.append(f"N={x.shape[0]} is not a multiple of {tile_m}")
    if w.shape[0] % tile_n:
        why.append(f"V={w.shape[0]} is not a multiple of {tile_n}")
    if not x.is_cuda:
        why.append("needs a CUDA device (sm_90)")
    elif torch.cuda.get_device_capability(x.device) != (9, 0):
        why.append(f"needs sm_90 (Hopper), this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))}")
    return "; ".join(why)


def liger_cute_impls() -> dict:
    """``{"liger_cute": fn}``: Liger-Kernel 0.8.5's CuTe DSL FLCE for Hopper (issue 53),
    ``liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90.liger_fused_linear_cross_entropy_sm90(x, W,
    t)`` (mean over targets != -100; "gradient in forward": one WGMMA logits GEMM stored once as bf16 [N, V] and
    overwritten in place by dZ, dX in the forward, dW in the backward). Needs ``nvidia-cutlass-dsl`` (``import
    cutlass.cute``; the QuACK wheel route: ``quack_wheels.sh``, ``device.sh quack1 quack2``) and cuda-python's
    ``cuda.bindings``. ``fn.skip(x, w)`` says where it cannot run (:func:`cute_skip`); ``{}`` with the reason
    printed where it does not import."""
    try:
        from liger_kernel.ops.cutedsl.ops import fused_linear_cross_entropy_sm90 as m
    except Exception as e:  # noqa: BLE001  (ImportError: no cutlass DSL / cuda-python; older Liger)
        print(f"liger_cute unavailable: {type(e).__name__}: {str(e)[:200]}")
        return {}
    tile_m, tile_n = getattr(m, "TILE_M", 128), getattr(m, "TILE_N", 256)

    def liger_cute(x, w, t):
        return m.liger_fused_linear_cross_entropy_sm90(x, w, t)

    liger_cute.skip = functools.partial(cute_skip, tile_m=tile_m, tile_n=tile_n)
    return {"liger_cute": liger_cute}


def liger_c16_impl():
    """Liger's fastest setting (SPEC section 6): its Triton FLCE with a 16x larger logits chunk
    (``chunk_mem_const=16``, Liger 0.8.5), as ``fn(x, w, t) -> mean loss``; None (reason printed) where absent."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as LF
    except Exception as e:  # noqa: BLE001
        print("liger chunk_mem_const unavailable:", e)
        return None
    if "chunk_mem_const" not in inspect.signature(LF.forward).parameters:
        print("liger chunk_mem_const unavailable: an older Liger")
        return None

    def liger_c16(x, w, t):
        out = LF.apply(x, w, t, None, None, -100, 0.0, 0.0, "mean", None, False, None, False, False, False,
                       None, None, 16)
        return out[0] if isinstance(out, tuple) else out

    return liger_c16


def _impls():
    try:
        from flce_dist import settings as rt
    except ImportError:  # before flce_dist.runtime became flce_dist.settings
        from flce_dist import runtime as rt

    def flce(strategy, fused_logits="helion", **more):
        def run(x, w, t):
            with rt.override(fused_logits=fused_logits, **more):
                return flce_dist.fused_linear_cross_entropy(x, w, t, strategy=strategy)
        return run

    impls = {"flce": flce("auto"), "flce_cublas": flce("auto", "cublas"), "flce_recompute": flce("recompute")}
    # one chunk of all N rows (a 4200 MiB budget): at N = 8192, 2.1 / 2.5 / 4.1 GiB beyond the gradients at
    # llama3 / qwen3 / gemma, about what QuACK keeps (1.96 / 2.32 / 4.25 GiB, run 20): the same memory
    impls["flce_onechunk"] = flce("auto", chunk_bytes=4200 << 20)
    if "grad_form" in inspect.signature(rt.override).parameters:  # the gradient as logits + chunk_grad_ (before rowscale.py)
        impls["flce_chunkgrad"] = flce("auto", grad_form="chunk_grad")
    impls.update(filter_impls(rt))
    impls["torch"] = lambda x, w, t: F.cross_entropy((x @ w.T).float(), t)
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        lg = LigerFusedLinearCrossEntropyLoss()
        impls["liger"] = lambda x, w, t: lg(w, x, t)
    except Exception as e:  # noqa: BLE001
        print("liger unavailable:", e)
    c16 = liger_c16_impl()
    if c16 is not None:
        impls["liger_c16"] = c16
    impls.update(liger_cute_impls())
    if torch_lce() is not None:
        impls["torch_lce"] = torch_lce()
    try:
        from cut_cross_entropy import linear_cross_entropy

        # CCE 25.1.1: filter_eps="high" (the default: finfo(bf16).eps / 32 = 2^-12, blocks of the
        # gradient below it skipped, vocab sorted by mean logit); None: exact, no sort
        impls["cce"] = lambda x, w, t: linear_cross_entropy(x, w, t, filter_eps="high")
        impls["cce_exact"] = lambda x, w, t: linear_cross_entropy(x, w, t, filter_eps=None)
    except Exception as e:  # noqa: BLE001
        print("cce unavailable:", e)
    try:  # QuACK (quack-kernels 0.6.5, CuTe DSL, SM90): its default entry point (scaled-exp pipeline where
        # eligible: bf16, V % 128 == 0; else its base chunked pipeline); install: benchmarks/NOTES.md, run 16
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        impls["quack"] = lambda x, w, t: chunked_linear_cross_entropy(x, w, t)
        # run 16: the default (chunk_size=4096) raised "operand 'v': m == n makes row/col inference
        # ambiguous" at H=4096 (llama3, qwen3); a chunk other than H avoids m == n (not run yet)
        impls["quack_c2048"] = lambda x, w, t: chunked_linear_cross_entropy(x, w, t, chunk_size=2048)
    except Exception as e:  # noqa: BLE001
        print("quack unavailable:", e)
    try:  # DeepSpeed's fused function needs a TP group: a one-process group here
        import os

        import deepspeed
        import torch.distributed as dist
        from deepspeed.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy

        for k, val in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29541"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, val)
        deepspeed.init_distributed(dist_backend="nccl")
        impls["deepspeed"] = lambda x, w, t: vocab_parallel_linear_cross_entropy(
            x, w, t, tp_group=dist.group.WORLD, vocab_start_index=0, vocab_end_index=w.shape[0])
    except Exception as e:  # noqa: BLE001
        print("deepspeed unavailable:", e)
    return impls


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    common.add_case_args(ap)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--impls", default="", help="comma list, e.g. flce,cce,cce_exact (default: all available)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="after each case, time the fwd+bwd of the three matmuls and of every impl again in K "
                         "interleaved rounds per timing mode (steady, single) and report each impl's median ratio "
                         "to flce in the same round")
    common.add_timing_args(ap)
    args = ap.parse_args(argv)
    common.check_case_args(ap, args)
    common.check_timing_args(ap, args)
    if args.rounds < 0:
        ap.error(f"--rounds must be >= 0, got {args.rounds}")
    if args.rounds and interleaved_ms is None:
        ap.error("--rounds needs a flce_dist tree whose _timing has interleaved_ms (run 28 or later); "
                 f"the one imported is {os.path.dirname(flce_dist.__file__)}")
    if args.rounds and args.impls and "flce" not in args.impls.split(","):
        ap.error(f"--rounds reports each impl against flce: add flce to --impls (got {args.impls!r})")
    return args


def warm_up(dev: torch.device, seconds: float = 3.0) -> None:
    """Matmuls for a few seconds before the first case: in runs 16 and 17 the first case's bare matmul,
    timed on a GPU fresh from idle, ran 10.6-10.9 ms against 11.9-12.5 in every later case (clocks and
    power settle under load), which inflated that case's ratios against it."""
    a = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ b.T
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            break


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--trace"]:  # --trace grpo,padfree [bench_trace.py's options]: the token-count traces
        import bench_trace

        bench_trace.main(["--traces", *argv[1:2], "--head", "loss", *argv[2:]])
        return None
    args = parse_args(argv)
    dt = DTYPES[args.dtype]
    impls = _impls()
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
    rows = []
    dev = torch.device("cuda")
    tm = common.Timers(args.reps, args.steady_calls, args.idle_ms, dev)
    warm_up(dev)
    for name, mode, h, v in common.cases(args):
        x, w, t = bench_data.make_inputs(args.n, h, v, mode=mode, dtype=dt, device=dev, seed=0,
                                         sorted_vocab=args.sorted_vocab, fixture=args.fixture or None)
        print(f"{name} H={h} V={v} data={mode}")
        rows += run_case(name, mode, x, w, t, impls, args, tm)
        del x, w, t
        torch.cuda.empty_cache()
        common.save(rows, common.csv_name(f"bench_{args.dtype}", args.data), args)
    print(f"\n{torch.cuda.get_device_name()}  dtype={args.dtype}  N={args.n}  (matmul row: fwd_bwd = 3 x one matmul;"
          f" 3mm row: the three distinct matmuls; single = one call from an idle GPU ({args.idle_ms:g} ms sleep after a"
          f" sync), steady = {args.steady_calls} calls back to back behind one, per call; host = single - steady)")
    print_table(rows)
    import torch.distributed as dist

    if dist.is_initialized():  # the one-rank group DeepSpeed's function needed
        dist.destroy_process_group()


def _empty_cache(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.empty_cache()


def skip_reason(fn, x: torch.Tensor, w: torch.Tensor) -> str:
    """Why ``fn`` cannot run on these inputs ("" if it can): an impl with constraints carries a ``skip(x, w)``."""
    check = getattr(fn, "skip", None)
    return check(x, w) if check is not None else ""


def run_case(name: str, mode: str, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, impls: dict,
             args: argparse.Namespace, tm: common.Timers) -> list[dict]:
    """One (shape, data mode): the ``matmul`` row (one ``x @ W.T``, fwd_bwd = 3 of it), the ``3mm`` row (the three
    distinct matmuls, both timing modes) and one row per impl that can run here (one that cannot prints why),
    each in both timing modes (``tm``: :class:`common.Timers`) with its peak memory and forward-only time; then
    the interleaved rounds (``--rounds``). ``x``, ``w`` become leaves that require grad."""
    dcols = common.describe_cols(x, w, t)
    _empty_cache(x)
    x.requires_grad_()
    w.requires_grad_()
    xd, wd = x.detach(), w.detach()
    mm = tm.single(lambda: xd @ wd.T)
    mm3_fn = three_matmuls(xd, wd)  # x @ W.T, dy @ W, dy.T @ x back to back
    mm3, mm3s = tm.single(mm3_fn), tm.steady(mm3_fn)
    del mm3_fn
    plan = common.chunk_plan(x, w.shape[0])
    mmc = tm.single(chunked_matmuls(xd, wd, plan)) if plan and chunked_matmuls else float("nan")
    _empty_cache(x)
    print(f"  {'matmul':15} {mm:8.2f} ms  (three distinct matmuls {mm3:.2f} ms single, {mm3s:.2f} steady ="
          f" {mm3 / (3 * mm):.3f}x 3 x this; as flce's {plan}-row chunks {mmc:.2f} ms = {mmc / mm3:.3f}x them)",
          flush=True)
    grads_gib = (x.numel() + w.numel()) * x.element_size() / 2**30
    timing = dict(steady_calls=tm.steady_calls, idle_ms=tm.idle_s * 1e3, floor3_ms=mm3, floor3_steady_ms=mm3s,
                  plan_rows=plan, plan_ms=mmc)
    rows = [dict(shape=name, data=mode, impl="matmul", fwd_bwd_ms=3 * mm, fwd_ms=mm, mem_gib=0.0, ratio_fb=1.0,
                 ratio_f=1.0, steady_ms=3 * mm, ratio_steady=1.0, extra_gib=0.0, fwd_mem_gib=0.0,
                 ratio_fb3=3 * mm / mm3, ratio_plan=3 * mm / mmc, **timing, **dcols),
            dict(shape=name, data=mode, impl="3mm", fwd_bwd_ms=mm3, fwd_ms=mm, mem_gib=float("nan"),
                 ratio_fb=mm3 / (3 * mm), ratio_f=1.0, ratio_steady=mm3s / (3 * mm), extra_gib=float("nan"),
                 fwd_mem_gib=float("nan"), ratio_fb3=1.0, ratio_plan=mm3 / mmc,
                 **common.mode_cols(mm3, mm3s, mm3, mm3s), **timing, **dcols)]
    steps = fwd_bwd_steps(impls, x, w, t)
    for iname, fn in impls.items():
        why = skip_reason(fn, x, w)
        if why:
            print(f"  {iname:15} skipped: {why}", flush=True)
            continue
        fb = steps[iname]

        def fo():
            with torch.no_grad():
                fn(x, w, t)

        try:
            fb_ms = tm.single(fb)
            st_ms = tm.steady(fb)
            mem = tm.peak(fb, x, w)
            x.grad = w.grad = None
            f_ms = tm.single(fo)
            f_mem = tm.peak(fo, x, w)
        except Exception as e:  # noqa: BLE001
            common.failed(f"{name}/{mode}/{iname}", e)
            x.grad = w.grad = None
            _empty_cache(x)
            continue
        rows.append(dict(shape=name, data=mode, impl=iname, fwd_bwd_ms=fb_ms, fwd_ms=f_ms, mem_gib=mem,
                         ratio_fb=fb_ms / (3 * mm), ratio_f=f_ms / mm, ratio_steady=st_ms / (3 * mm),
                         extra_gib=mem - grads_gib, fwd_mem_gib=f_mem, ratio_fb3=fb_ms / mm3, ratio_plan=fb_ms / mmc,
                         **common.mode_cols(fb_ms, st_ms, mm3, mm3s), **timing, **dcols))
        # each row as soon as it is timed (a call cut off at its limit keeps what it measured)
        print(f"  {iname:15} single {fb_ms:8.2f} ms ({fb_ms / mm3:.3f}x 3mm)  steady {st_ms:8.2f} ms"
              f" ({st_ms / mm3s:.3f}x 3mm)  host {fb_ms - st_ms:6.2f} ms (adj {fb_ms - st_ms - (mm3 - mm3s):.2f})  peak {mem:.2f} GiB (extra {mem - grads_gib:.2f})"
              f"  fwd {f_ms:7.2f} ms ({f_ms / mm:.2f}x 1mm)", flush=True)
        _empty_cache(x)
    if args.rounds:
        interleave([r for r in rows[2:]], steps, x, w, args.rounds, tm, plan)
    del steps
    return rows


def fwd_bwd_steps(impls: dict, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> dict:
    """``{impl: step}``, each step one fwd+bwd of that impl on (x, w, t) (``common.fwd_bwd``). Each impl is bound
    when its step is made (``functools.partial``), not looked up when it runs: the interleaved rounds call the
    steps after the loop over impls, where a loop variable in a lambda would name the last impl for all."""
    return {k: common.fwd_bwd(functools.partial(fn, x, w, t), x, w) for k, fn in impls.items()}


def interleave(rows: list[dict], steps: dict, x: torch.Tensor, w: torch.Tensor, rounds: int, tm: common.Timers,
               plan: int = 0) -> None:
    """For ``rows``, one case's impl rows (the impls that ran; ``steps`` from :func:`fwd_bwd_steps`): the fwd+bwd
    of each and of the three distinct matmuls timed again in ``rounds`` interleaved rounds of each timing mode
    (``common.interleaved_modes``: steady, then single calls from an idle GPU). Adds, per mode (suffix ``""`` for
    steady, ``_single`` for single), ``rounds<sfx>_ms`` (median over rounds), ``vs_flce<sfx>`` (median of the
    per-round ratio to flce; > 1 = slower than flce) with its spread ``vs_flce<sfx>_min`` / ``_max``, and
    ``rounds<sfx>_x3dist`` (median per-round ratio to the three matmuls), and prints flce's lead over every
    peer per mode. With ``plan`` (flce's chunk rows, ``common.chunk_plan``; run 31) the plan's cuBLAS work
    alone (``_timing.chunked_matmuls``) is a round entry too and each row gets ``rounds<sfx>_xplan``: what flce
    costs over its own chunk plan, measured as the peers are. Nothing without a flce row."""
    timed = {r["impl"]: steps[r["impl"]] for r in rows}
    if "flce" not in timed:
        return
    fns = {"3mm": three_matmuls(x.detach(), w.detach())}
    if plan and chunked_matmuls is not None:
        fns["plan"] = chunked_matmuls(x.detach(), w.detach(), plan)
    fns.update(timed)
    by_mode = common.interleaved_modes(fns, rounds, tm)
    del fns
    torch.cuda.empty_cache()
    for mode, per_round in by_mode.items():
        sfx = "" if mode == "steady" else f"_{mode}"
        vs_flce = paired_ratios(per_round, "flce")
        vs_mm = paired_ratios(per_round, "3mm")
        vs_plan = paired_ratios(per_round, "plan") if "plan" in per_round else {}
        for r in rows:
            med, lo, hi = vs_flce.get(r["impl"], (1.0, 1.0, 1.0))
            r.update({f"rounds{sfx}_ms": statistics.median(per_round[r["impl"]]), f"vs_flce{sfx}": med,
                      f"vs_flce{sfx}_min": lo, f"vs_flce{sfx}_max": hi, f"rounds{sfx}_x3dist": vs_mm[r["impl"]][0]})
            if r["impl"] in vs_plan:
                r[f"rounds{sfx}_xplan"] = vs_plan[r["impl"]][0]
        print(lead_line(mode, rounds, per_round, vs_flce, vs_mm, vs_plan, plan), flush=True)


def lead_line(mode: str, rounds: int, per_round: dict, vs_flce: dict, vs_mm: dict, vs_plan: dict, plan: int) -> str:
    """One timing mode's rounds in a line: flce against the three matmuls (and its plan's cuBLAS work), then its
    lead over each peer (not the matmuls, not flce's own variants: the filter rows, another chunk budget or
    backend), the closest first, with the spread over rounds."""
    line = f"  interleaved {mode}, {rounds} rounds: flce {statistics.median(per_round['flce']):.2f} ms = " \
           f"{vs_mm['flce'][0]:.3f}x the three matmuls"
    if vs_plan:
        med, lo, hi = vs_plan["flce"]
        line += f" = {med:.3f}x its {plan}-row plan's cuBLAS work ({statistics.median(per_round['plan']):.2f} ms;" \
                f" rounds {lo:.3f}..{hi:.3f})"
    line += "".join(f"; {k} {statistics.median(per_round[k]):.2f} ms" for k in vs_flce
                    if k.startswith("flce") and k != "flce")
    peers = {k: v for k, v in vs_flce.items() if k not in ("3mm", "plan") and not k.startswith("flce")}
    if peers:
        best = min(peers, key=lambda k: peers[k][0])
        med, lo, hi = peers[best]
        line += f"; closest peer {best}: flce ahead by {100 * (med - 1):+.1f}% (rounds {100 * (lo - 1):+.1f}..{100 * (hi - 1):+.1f}%)"
        line += "".join(f"; {k} {100 * (m - 1):+.1f}% ({100 * (a - 1):+.1f}..{100 * (b - 1):+.1f}%)"
                        for k, (m, a, b) in sorted(peers.items()) if k != best)
    return line


TABLE = [("shape", "shape", "8"), ("data", "data", "9"), ("impl", "impl", "15"), ("single ms", "fwd_bwd_ms", "9.2f"),
         ("x3dist", "ratio_fb3", "6.3f"), ("steady", "steady_ms", "8.2f"), ("x3dist", "steady_x3mm", "6.3f"),
         ("host", "host_ms", "6.2f"), ("peak GiB", "mem_gib", "8.2f"), ("extra", "extra_gib", "6.2f"),
         ("fwd ms", "fwd_ms", "8.2f"), ("x1mm", "ratio_f", "6.2f"), ("fwd GiB", "fwd_mem_gib", "8.2f"),
         ("xplan", "ratio_plan", "6.2f")]
# --rounds: per mode (steady, then single) the interleaved median and the median per-round ratio to flce (printed
# only when some row has them)
ROUND_COLUMNS = [("rounds", "rounds_ms", "8.2f"), ("/flce", "vs_flce", "6.3f"), ("rnd 1", "rounds_single_ms", "8.2f"),
                 ("/flce 1", "vs_flce_single", "7.3f")]


def print_table(rows: list[dict]) -> None:
    """The short table: one line per (shape, data mode, impl); the matmul line of each (shape, data)
    carries that data's describe() numbers (loss nats, negligible-block fraction sorted)."""
    cols = TABLE + (ROUND_COLUMNS if any("rounds_ms" in r for r in rows) else [])
    common.print_table(rows, cols, lambda r: common.data_note(r) if r["impl"] == "matmul" else "")


if __name__ == "__main__":
    main()
