"""The fused backward's grad_output pass: ``kernels.scale_`` against ``torch._foreach_mul_`` (the
previous route) on a llama3-sized dW (128256 x 4096 bf16, 1 GiB), grad_output 1 and 0.5, CUDA
events, median of 20 after warm-up, plus a bit-exactness check at that size; ``--blocks`` also
times other tile sizes (elements per program : warps) against the shipped one.

    python3 benchmarks/probes/scale_probe.py [--blocks 16384:8,8192:8]
"""

from __future__ import annotations

import argparse

import torch

from flce_dist._timing import cuda_time_ms
from flce_dist.kernels import launch
from flce_dist.settings import Settings


def _launcher(t: torch.Tensor, gt: torch.Tensor, variant: tuple[int, int] | None):
    """A call of the scale pass on ``t``: the shipped launch (``variant`` None) or the kernel bound
    with another (elements per program, warps), as ``python -m flce_dist.tune`` binds its candidates."""
    if variant is None:
        return lambda: launch.scale_(t, gt, Settings())
    from flce_dist.kernels.scale import scale_
    from flce_dist.tune import _run

    cand = {"block": {"block": variant[0]}, "config": {"num_warps": variant[1], "num_stages": 1}}
    return _run(scale_, (t.view(-1), gt.reshape(1).to(t.dtype).to(torch.float32)), cand, launch.BLOCK_ORDER["scale"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="", help="extra variants, e.g. 16384:8,8192:8 (elements per program:warps)")
    args = ap.parse_args()
    variants = [None] + [tuple(int(v) for v in spec.split(":")) for spec in filter(None, args.blocks.split(","))]
    g = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn(128256, 4096, device="cuda", generator=g).to(torch.bfloat16)
    gb = t.numel() * t.element_size() * 2 / 1e9  # read + write
    base = t.clone()  # t before any timed call (each scales it again)
    for go in (1.0, 0.5):
        gt = torch.tensor(go, device="cuda")
        fe = cuda_time_ms(lambda: torch._foreach_mul_([t], gt.to(t.dtype)), 20)
        t.copy_(base)
        line = [f"grad_output {go}: foreach_mul_ {fe:.3f} ms ({gb / fe:.2f} TB/s)"]
        for var in variants:
            got = base.clone()
            _launcher(got, gt, var)()
            ok = torch.equal(got, base * gt.to(t.dtype))
            del got
            ms = cuda_time_ms(_launcher(t, gt, var), 20)
            t.copy_(base)
            name = "shipped" if var is None else f"{var[0]}:{var[1]}"
            line.append(f"{name} {ms:.3f} ms ({gb / ms:.2f} TB/s if streamed, bit-exact {ok})")
        print("   ".join(line), flush=True)


if __name__ == "__main__":
    main()
