"""Before/after timing of the fused loss alone (a refactor must not slow it down).

    PYTHONPATH=<tree> python3 benchmarks/ab_flce.py --tag NAME [--shapes llama3,gemma] [--reps 20]

Imports whichever ``flce_dist`` is first on ``PYTHONPATH`` (e.g. an exported older commit) and times,
at N=8192 bf16 on random inputs (0.02-scaled weights, as bench.py), fwd+bwd of
``fused_linear_cross_entropy`` (steady state: back-to-back calls), its forward alone under
``torch.no_grad()`` and the bare cuBLAS matmul ``x @ W.T`` in the same process, then prints one line
per shape: ms, ratio to three matmuls (fwd+bwd) and to one (forward). Run it
for both trees in one device call and compare the ratios (the matmul normalises machine drift).
"""

from __future__ import annotations

import argparse
import os

import torch

import flce_dist  # noqa: E402  (the first on PYTHONPATH: the tree under test)
from flce_dist._timing import SHAPES, cuda_steady_ms, cuda_time_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", required=True)
    ap.add_argument("--shapes", default="llama3,qwen3,gemma")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    print(f"[{args.tag}] flce_dist from {os.path.dirname(flce_dist.__file__)}")
    for name in args.shapes.split(","):
        h, v = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(args.n, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
        t = torch.randint(0, v, (args.n,), device="cuda", generator=g)

        def step():
            x.grad = w.grad = None
            flce_dist.fused_linear_cross_entropy(x, w, t).backward()

        mm = cuda_time_ms(lambda: x.detach() @ w.detach().T, args.reps)
        ms = cuda_steady_ms(step, args.reps)
        with torch.no_grad():
            fwd = cuda_steady_ms(lambda: flce_dist.fused_linear_cross_entropy(x, w, t), args.reps)
        print(f"[{args.tag}] {name:7} flce {ms:7.2f} ms  matmul {mm:6.2f} ms  {ms / (3 * mm):.3f}x 3mm"
              f"  fwd {fwd:6.2f} ms {fwd / mm:.3f}x 1mm", flush=True)
        del x, w, t
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
