"""Is the fused loss's "idle" time in the Helion launches? (kernel_profile.py: wall - kernels ~2.4 ms
at llama3 while the profiled timeline's gaps between kernels add up to ~0.6 ms.)

    python3 benchmarks/probes/launch_probe.py [--rows 2816] [--h 4096] [--v 128256]

Times one fused-strategy store pass (``launch.lse_forward`` storing exponentials, as rowscale.py runs
it) on a token chunk three ways: CUDA events around 5 back-to-back calls, CUDA events around 5
back-to-back calls of the bound Helion kernel alone (no partial merge), and the kernel's own time in
torch.profiler; the bare cuBLAS chunk matmul is timed beside it. Differences between the first two
and the third are GPU time the profiler does not attribute to the kernel.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from flce_dist import tune
from flce_dist._timing import cuda_steady_ms
from flce_dist.kernels import launch
from flce_dist.settings import current


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2816)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=128256)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(a.rows, a.h, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(a.v, a.h, device="cuda", dtype=torch.bfloat16, generator=g) * a.h**-0.5
    t = torch.randint(0, a.v, (a.rows,), device="cuda", generator=g).to(torch.int32)
    z = torch.empty(a.rows, a.v, device="cuda", dtype=torch.bfloat16)
    r = torch.zeros(a.rows, device="cuda")
    s = current()
    call = lambda: launch.lse_forward(x, w, None, t, 1.0, 0.0, False, s, z_out=z, exp_ref=r)  # noqa: E731
    call()
    kernel_only = tune._run(launch._kernels()["lse_forward"],  # the same entry, bound and configured explicitly
                            (x, w, w.new_zeros(1), t, z, r, t.new_zeros(1), 1.0, 0.0, False, launch.STORE_EXP,
                             False, False, False, False),
                            launch.entry("lse_forward", x.device, x.dtype, "store", a.h, s), launch.BLOCK_ORDER["lse_forward"])
    mm = cuda_steady_ms(lambda: torch.mm(x, w.T, out=z), 10)
    api = cuda_steady_ms(call, 10)
    bare = cuda_steady_ms(kernel_only, 10)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            kernel_only()
        torch.cuda.synchronize()
    kern = sum(ev.device_time_total for ev in prof.key_averages() if "lse_forward" in ev.key) / 1e3 / 10
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    span = (ev[-1].time_range.end - ev[0].time_range.start) / 1e3 / 10 if ev else 0.0
    print(f"chunk [{a.rows}, {a.v}] x H={a.h}: cuBLAS matmul {mm:.3f} ms | launch.lse_forward {api:.3f} ms | "
          f"bound kernel {bare:.3f} ms | profiler: kernel {kern:.3f} ms, timeline span per call {span:.3f} ms")


if __name__ == "__main__":
    main()
