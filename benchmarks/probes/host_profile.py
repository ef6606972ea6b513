"""Issue 30: where the host time of one small-N call goes (cProfile of eager calls on the GPU).

    python benchmarks/probes/host_profile.py [--cases 1024x4096x32000,4096x4096x32000] [--calls 20] [--out DIR]

Per case (N x H x V, bf16, random data) and mode (``loss``: fwd+bwd of the mean loss; ``fwd``: the
forward-only per-token log-probs under no_grad), after a warm-up: each of ``--calls`` calls runs with
the GPU idle (a sync before it, none inside) under cProfile, so the profile is host work only. Prints
the host us per call, the number of CUDA kernels (torch.profiler, one call), the functions with the
most own time and the flce_dist / Helion / Triton entries by cumulative time, and writes the full
stats (``host_profile_<case>_<mode>.txt``) to ``--out``. Nothing here is timed against a peer: the
numbers say which part of the call's host path to shorten (fixed_cost.py measures the effect).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an A/B tree there wins
import flce_dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixed_cost import kernels_per_call  # noqa: E402


def make_call(mode: str, n: int, h: int, v: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    if mode == "loss":
        def call():
            flce_dist.fused_linear_cross_entropy(x, w, t).backward()
    else:
        def call():
            with torch.no_grad():
                flce_dist.logprobs_and_entropy(x, w, t)
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1024x4096x32000,4096x4096x32000")
    ap.add_argument("--modes", default="loss,fwd")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = Path(args.out) if args.out else None
    summary = []
    for case in args.cases.split(","):
        n, h, v = (int(s) for s in case.split("x"))
        for mode in args.modes.split(","):
            call = make_call(mode, n, h, v)
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            kernels = kernels_per_call(call)
            pr = cProfile.Profile()
            walls = []
            for _ in range(args.calls):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                pr.enable()
                call()
                pr.disable()
                walls.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            walls.sort()
            host_us = walls[len(walls) // 2] * 1e6
            s = io.StringIO()
            st = pstats.Stats(pr, stream=s)
            st.sort_stats("tottime").print_stats(args.top)
            st.sort_stats("cumulative").print_stats("flce_dist|helion|triton|autograd", 40)
            text = s.getvalue()
            print(f"=== {case} {mode}: host {host_us:.0f} us/call (profiled), {kernels} kernels\n{text}", flush=True)
            if out:
                out.mkdir(parents=True, exist_ok=True)
                (out / f"host_profile_{case}_{mode}.txt").write_text(text)
            summary.append((case, mode, host_us, kernels))
    print("=== host_profile summary")
    print("| N x H x V | mode | host us / call (under cProfile) | kernels |")
    for case, mode, us, k in summary:
        print(f"| {case} | {mode} | {us:.0f} | {k} |")


if __name__ == "__main__":
    main()
