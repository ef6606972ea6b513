"""The fused backward's grad_output pass: ``kernels.scale_`` against ``torch._foreach_mul_`` (the
previous route) on a llama3-sized dW (128256 x 4096 bf16, 1 GiB), grad_output 1 and 0.5, CUDA
events, median of 20 after warm-up, plus a bit-exactness check at that size.

    python3 benchmarks/scale_probe.py
"""

from __future__ import annotations

import torch

from flce_dist._timing import cuda_time_ms
from flce_dist.kernels import launch
from flce_dist.settings import Settings


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn(128256, 4096, device="cuda", generator=g).to(torch.bfloat16)
    gb = t.numel() * t.element_size() * 2 / 1e9  # read + write
    for go in (1.0, 0.5):
        gt = torch.tensor(go, device="cuda")
        want = t * gt.to(t.dtype)
        got = launch.scale_(t.clone(), gt, Settings())
        fe = cuda_time_ms(lambda: torch._foreach_mul_([t], gt.to(t.dtype)), 20)
        ms = cuda_time_ms(lambda: launch.scale_(t, gt, Settings()), 20)
        print(f"grad_output {go}: foreach_mul_ {fe:.3f} ms ({gb / fe:.2f} TB/s)   scale_ {ms:.3f} ms"
              f" ({gb / ms:.2f} TB/s if streamed)   bit-exact {torch.equal(got, want)}", flush=True)
        t.copy_(want)  # keep the values bounded (0.5^k over many timed calls underflows otherwise)
        del want, got


if __name__ == "__main__":
    main()
