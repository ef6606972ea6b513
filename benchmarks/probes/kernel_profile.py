"""Where the fused loss spends its time: a kernel-level breakdown from ``torch.profiler``.

    python benchmarks/probes/kernel_profile.py [--shapes llama3,gemma] [--n 8192] [--dtype bf16] [--mode fb|fwd] [--strategy auto] [--out DIR]
        [--data random,realistic]
    torchrun --nproc_per_node=2 benchmarks/probes/kernel_profile.py ...   (vocab-parallel over NCCL; rank 0 reports)

Per shape and data mode (``--data``, bench.py's inputs; rows of a mode other than ``random`` are
labelled ``shape/mode``): the bare ``x @ W.T`` matmul (CUDA events, this run), then ``--iters`` profiled
forward+backward calls of ``fused_linear_cross_entropy``. Kernels are grouped into classes
(cuBLAS matmul, each Helion kernel, other torch kernels), each reported as ms per call and as a
fraction of the floor (3 matmuls for ``--mode fb``, 1 for ``--mode fwd``, the no-grad forward);
"idle" is the wall time (CUDA events, each call from an idle GPU) not covered by any kernel (the
"kernel gaps" lines: the profiled timeline's gaps between consecutive kernels, by the pair around
each gap), and
"idle steady" the same with calls back to back (host work overlapping the previous call), which
is what a training loop sees. Under torchrun each rank holds its ``flce_dist.vocab_shard`` and the floor adds one dX all-reduce ([N, H], timed in this run). Writes
``profile_<mode>_<dtype>[_tp<P>].csv``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import common  # noqa: E402  (first: puts the repository's flce_dist on the path where none is)
import data as bench_data  # noqa: E402
import flce_dist  # noqa: E402
from flce_dist._timing import DTYPES, cuda_steady_ms, cuda_time_ms  # noqa: E402

CLASSES = [("matmul (cuBLAS)", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_", re.I)),
           ("lse_forward (Helion)", re.compile(r"lse_forward", re.I)),
           ("chunk_grad (Helion)", re.compile(r"chunk_grad", re.I)),
           ("chunk_stats (Helion)", re.compile(r"chunk_stats", re.I)),
           ("nccl", re.compile(r"nccl", re.I))]


def classify(name: str) -> str:
    for label, rx in CLASSES:
        if rx.search(name):
            return label
    return "other torch kernels"


def main() -> None:
    ap = argparse.ArgumentParser()
    common.add_case_args(ap, shapes="llama3,gemma", timed=False)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--mode", default="fb", choices=["fb", "fwd"])
    ap.add_argument("--pyprof", action="store_true", help="also print a cProfile of the host side")
    args = ap.parse_args()
    common.check_case_args(ap, args)
    rows, top = [], []
    tp, rank, group = int(os.environ.get("WORLD_SIZE", "1")), 0, None
    if tp > 1:
        rank = int(os.environ["RANK"])
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl")
        group = dist.group.WORLD
    dt = DTYPES[args.dtype]
    nmm = 3 if args.mode == "fb" else 1
    for name, mode, h, v in common.cases(args):
        shape = name if mode == "random" else f"{name}/{mode}"  # the rows' label (random: as before run 20)
        # bench.py's inputs (random: bit for bit the profiles of runs 7-19)
        x, w, t = bench_data.make_inputs(args.n, h, v, mode=mode, dtype=dt, device="cuda", seed=0,
                                         sorted_vocab=args.sorted_vocab, fixture=args.fixture or None)
        x.requires_grad_()
        w.requires_grad_()
        g = torch.Generator(device="cuda").manual_seed(1)
        start, ar = 0, 0.0
        if tp > 1:  # this rank's vocab rows; the floor gains one dX all-reduce
            start, end = flce_dist.vocab_shard(v, rank, tp)
            w = w.detach()[start:end].clone().requires_grad_()
            buf = torch.randn(args.n, h, device="cuda", dtype=dt, generator=g)
            ar = cuda_time_ms(lambda: dist.all_reduce(buf), 10, before=dist.barrier)
        mm = cuda_time_ms(lambda: x.detach() @ w.detach().T, 10)
        floor = nmm * mm + (ar if args.mode == "fb" else 0.0)
        kw = dict(group=group, vocab_start=start) if tp > 1 else {}

        def fb():
            x.grad = w.grad = None
            if args.mode == "fwd":
                with torch.no_grad():
                    flce_dist.fused_linear_cross_entropy(x, w, t, strategy=args.strategy, **kw)
            else:
                flce_dist.fused_linear_cross_entropy(x, w, t, strategy=args.strategy, **kw).backward()

        wall = cuda_time_ms(fb, 10)
        steady = cuda_steady_ms(fb, 5)
        host = []  # host time to issue one call (no sync after it; a sync inside shows up here)
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fb()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        if args.pyprof:  # where the host time goes (Python functions, by own time)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(5):
                fb()
            torch.cuda.synchronize()
            pr.disable()
            text = io.StringIO()
            pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(14)
            top.append(f"{shape:7} cProfile of 5 calls:\n" + "\n".join(text.getvalue().splitlines()[6:24]))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fb()
            torch.cuda.synchronize()
        per_class: dict[str, float] = defaultdict(float)
        per_kernel: dict[str, float] = defaultdict(float)
        runtime_calls = []
        for ev in prof.key_averages():
            if ev.key.startswith("cuda") and ev.key != "cudaLaunchKernel" and ev.device_type == torch.autograd.DeviceType.CPU:
                runtime_calls.append(f"{ev.key} x{ev.count / args.iters:g} {ev.cpu_time_total / 1e3 / args.iters:.3f} ms")
            dt_us = getattr(ev, "device_time_total", None)
            if dt_us is None:
                dt_us = ev.cuda_time_total
            if dt_us <= 0 or ev.key.startswith("ProfilerStep"):
                continue
            ms = dt_us / 1e3 / args.iters
            if ev.key in ("cudaDeviceSynchronize",) or ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            per_class[classify(ev.key)] += ms
            per_kernel[ev.key] += ms
        busy = sum(per_class.values())
        # where the GPU waits: gaps between consecutive kernels on the timeline, by the kernel after the gap
        kern = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                       and not e.name.startswith(("ProfilerStep", "Memcpy", "Memset"))), key=lambda e: e.time_range.start)
        gaps: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for a, b in zip(kern, kern[1:]):
            gap = (b.time_range.start - a.time_range.end) / 1e3
            if gap > 0:
                gaps[f"{classify(a.name)} -> {b.name[:60]}"][0] += gap / args.iters
                gaps[f"{classify(a.name)} -> {b.name[:60]}"][1] += 1 / args.iters
        top.append(f"{shape:7} kernel gaps per call: {sum(g for g, _ in gaps.values()):.3f} ms over {len(kern) / args.iters:.0f} kernels")
        for k, (ms, cnt) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:8]:
            top.append(f"{shape:7}   gap {ms:7.3f} ms x{cnt:4.1f}  {k}")
        per_class["idle (wall - kernels)"] = max(0.0, wall - busy)
        top.append(f"{shape:7} host ms to issue one call: {statistics.median(host):.3f}; CUDA runtime calls per call: "
                   + ("; ".join(runtime_calls) or "none"))
        for label, ms in sorted(per_class.items(), key=lambda kv: -kv[1]):
            rows.append(dict(shape=shape, part=label, ms=ms, frac_of_floor=ms / floor))
        rows.append(dict(shape=shape, part=f"TOTAL wall ({args.mode})", ms=wall, frac_of_floor=wall / floor))
        rows.append(dict(shape=shape, part="idle steady (back to back)", ms=max(0.0, steady - busy), frac_of_floor=max(0.0, steady - busy) / floor))
        rows.append(dict(shape=shape, part=f"TOTAL steady ({args.mode})", ms=steady, frac_of_floor=steady / floor))
        if ar:
            rows.append(dict(shape=shape, part="dX all-reduce (in the floor)", ms=ar, frac_of_floor=ar / floor))
        rows.append(dict(shape=shape, part=f"floor: {nmm} x matmul{' + all-reduce' if ar else ''}", ms=floor, frac_of_floor=1.0))
        if args.mode == "fwd" and tp == 1:  # the logits+stats kernel alone vs the matmul, both back to back (CUDA events, no profiler)
            from flce_dist.kernels import launch
            from flce_dist.settings import current

            xd, wd, tl = x.detach(), w.detach(), t.to(torch.int32)
            mm_st = cuda_steady_ms(lambda: xd @ wd.T, 5)
            k_st = cuda_steady_ms(lambda: launch.lse_forward(xd, wd, None, tl, 1.0, 0.0, False, current()), 5)
            rows.append(dict(shape=shape, part="bare matmul, back to back", ms=mm_st, frac_of_floor=mm_st / mm))
            rows.append(dict(shape=shape, part="launch.lse_forward, b2b", ms=k_st, frac_of_floor=k_st / mm))
        for k, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:8]:
            top.append(f"{shape:7} {ms:8.3f} ms  {k[:110]}")
        del x, w, t
        torch.cuda.empty_cache()
    if rank == 0:
        common.save(rows, f"profile_{args.mode}_{args.dtype}{f'_tp{tp}' if tp > 1 else ''}.csv", args)
        print("\ntop kernels per call:")
        print("\n".join(top))
        print(f"\n{torch.cuda.get_device_name()} TP={tp} {args.dtype} N={args.n} mode={args.mode} strategy={args.strategy}: ms per call, and x the floor")
        print(f"{'shape':7} {'part':28} {'ms':>8} {'x floor':>8}")
        for r in rows:
            print(f"{r['shape']:7} {r['part']:28} {r['ms']:8.2f} {r['frac_of_floor']:8.3f}")
    if tp > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
