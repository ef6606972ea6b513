"""Issue 30: the per-call fixed cost of flce_dist at small token counts, and CUDA-graph replay as
the lever against it (one GPU, bf16, random data).

    python benchmarks/probes/fixed_cost.py [--ns 1024,2048,4096] [--shapes 4096x32000,4096x151936]
        [--reps 30] [--out DIR]

Per (N, H, V) and mode, all in one process, in this order, each timed steady (``cuda_steady_ms``:
5 back-to-back calls per sample, median of ``--reps``):
  floor      the bare cuBLAS matmuls the mode needs: fwd 1 (x @ W.T), loss 3, rl 4 (as bench_rl counts)
  eager      flce_dist as a user calls it
  graphed    the same call replayed from a CUDA graph (``torch.cuda.make_graphed_callables`` for the
             differentiable modes, ``torch.cuda.graph`` for the forward-only one): host work and
             launch gaps removed, the kernels unchanged
  liger      Liger FLCE (loss mode only; ``LigerFusedLinearCrossEntropyLoss``), when importable
and per eager call: host us (the Python/launch time until the call returns, measured with the GPU
idle, no sync inside) and the number of CUDA kernels (torch.profiler, one call).
Modes: ``fwd`` the forward-only per-token log-probs (``logprobs_and_entropy`` under no_grad:
the RL reference / old-policy pass), ``loss`` fwd+bwd of the mean loss, ``rl`` fwd+bwd of
(adv * logp).sum() + 0.01 * entropy.sum() with ``logprobs_and_entropy``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an A/B tree there wins
import flce_dist  # noqa: E402
from flce_dist._timing import cuda_steady_ms, write_csv  # noqa: E402


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def host_us(fn, reps: int = 20) -> float:
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def floor_fn(x, w, k: int):
    """k bare matmuls of the layer's shapes: [N,H]x[H,V], [N,V]x[V,H], [V,N]x[N,H], and a 4th [N,V]x[V,H]."""
    dy = torch.randn(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    y, dx, dw, dx2 = torch.empty_like(dy), torch.empty_like(x), torch.empty_like(w), torch.empty_like(x)

    def run():
        torch.mm(x, w.T, out=y)
        if k > 1:
            torch.mm(dy, w, out=dx)
            torch.mm(dy.T, x, out=dw)
        if k > 3:
            torch.mm(dy, w, out=dx2)
    return run


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="1024,2048,4096")
    ap.add_argument("--shapes", default="4096x32000,4096x151936")
    ap.add_argument("--modes", default="fwd,loss,rl")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
    except Exception:  # noqa: BLE001
        liger = None
    rows = []
    for shape in args.shapes.split(","):
        h, v = map(int, shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(v, h, device=dev, generator=g) * h**-0.5).to(torch.bfloat16).requires_grad_()
        for n in map(int, args.ns.split(",")):
            x = torch.randn(n, h, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
            t = torch.randint(0, v, (n,), device=dev, generator=g)
            adv = torch.randn(n, device=dev, generator=g)
            for mode in args.modes.split(","):
                if mode == "fwd":
                    def eager():
                        with torch.no_grad():
                            return flce_dist.logprobs_and_entropy(x, w, t)[0]
                    k = 1
                elif mode == "loss":
                    def eager():
                        flce_dist.fused_linear_cross_entropy(x, w, t).backward()
                    k = 3
                else:
                    def eager():
                        lp, ent = flce_dist.logprobs_and_entropy(x, w, t)
                        ((adv * lp).sum() + 0.01 * ent.sum()).backward()
                    k = 4
                floor = cuda_steady_ms(floor_fn(x.detach(), w.detach(), k), args.reps)
                ms = cuda_steady_ms(eager, args.reps)
                hus = host_us(eager)
                nk = kernels_per_call(eager)
                # the graphed call: capture once, replay
                graphed_ms, gnote = float("nan"), ""
                try:
                    if mode == "fwd":
                        static = [None]
                        s = torch.cuda.Stream()
                        s.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(s):
                            for _ in range(2):
                                eager()
                        torch.cuda.current_stream().wait_stream(s)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            static[0] = eager()
                        graphed_ms = cuda_steady_ms(graph.replay, args.reps)
                    else:
                        xs = x.detach().clone().requires_grad_()
                        if mode == "loss":
                            fn = torch.cuda.make_graphed_callables(
                                lambda a, b: flce_dist.fused_linear_cross_entropy(a, b, t), (xs, w))
                            graphed = lambda: fn(xs, w).backward()  # noqa: E731
                        else:
                            fn = torch.cuda.make_graphed_callables(
                                lambda a, b: flce_dist.logprobs_and_entropy(a, b, t), (xs, w))

                            def graphed():
                                lp, ent = fn(xs, w)
                                ((adv * lp).sum() + 0.01 * ent.sum()).backward()
                        graphed_ms = cuda_steady_ms(graphed, args.reps)
                except Exception as e:  # noqa: BLE001 - a capture failure is a finding
                    gnote = f"graph failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
                lig = float("nan")
                if liger is not None and mode == "loss":
                    lig = cuda_steady_ms(lambda: liger(w, x, t).backward(), args.reps)
                row = dict(n=n, h=h, v=v, mode=mode, floor_ms=floor, eager_ms=ms, ratio=ms / floor, host_us=hus,
                           kernels=nk, graphed_ms=graphed_ms, graphed_ratio=graphed_ms / floor, liger_ms=lig, note=gnote)
                rows.append(row)
                print(f"[{mode:4s} N={n:5d} H={h} V={v:6d}] floor {floor:7.3f}  eager {ms:7.3f} ({ms / floor:.2f}x)  "
                      f"host {hus:6.0f} us  {nk:3d} kernels  graphed {graphed_ms:7.3f} ({graphed_ms / floor:.2f}x)  "
                      f"liger {lig:7.3f} {gnote}", flush=True)
                x.grad = w.grad = None
    if args.out:
        write_csv(rows, "fixed_cost.csv", [args.out])
    return rows


if __name__ == "__main__":
    main()
