"""Which torch ops and CUDA kernels one fused fwd+bwd call issues besides its matmuls and Helion passes.

    python3 benchmarks/probes/op_trace.py [--shapes llama3,gemma] [--data random,realistic] [--n 8192]

Run 19's profile counted ~218 kernels per llama3 call, 107 of them one torch elementwise kernel
(0.2 ms of gaps alone), where the chunk loop launches ~30 Helion and cuBLAS kernels. This script
names them, per shape and data mode, for one ``fused_linear_cross_entropy(x, w, t).backward()``
after a warm-up call:

1. every aten op dispatched outside a Helion launch (``kernels/launch._launch`` is wrapped; the ops
   its host code runs are listed under the kernel's name), counted, with the order of one call;
2. every CUDA kernel of one call from ``torch.profiler``, counted by name, with its total time.

No timing claim: the profiler's kernel times under-count the Helion launches (NOTES, run 18).
Works on the CPU in reference mode too (then there are no CUDA kernels: part 2 is empty).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import common  # noqa: E402  (first: puts the repository's flce_dist on the path where none is)
import data as bench_data  # noqa: E402
import flce_dist  # noqa: E402
from flce_dist._timing import SHAPES  # noqa: E402
from flce_dist.kernels import launch  # noqa: E402


class OpLog(TorchDispatchMode):
    """Counts aten ops by (where, op): ``where`` is "" outside Helion launches, else the kernel name."""

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = []
        self.counts: collections.Counter = collections.Counter()
        self.order: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        where = self.where[-1] if self.where else ""
        self.counts[(where, str(func))] += 1
        if not where:
            self.order.append(str(func).replace("aten.", ""))
        return func(*args, **(kwargs or {}))


def trace(step, log: OpLog):
    """Run ``step`` once under ``log`` with every Helion launch marked in ``log.order``."""
    real = launch._launch

    def marked(name, *a, **k):
        log.order.append(f"[{name}]")
        log.where.append(name)
        try:
            return real(name, *a, **k)
        finally:
            log.where.pop()

    launch._launch = marked
    try:
        with log:
            step()
    finally:
        launch._launch = real


def cuda_kernels(step) -> list[tuple[str, int, float]]:
    """(name, count, total us) of every CUDA kernel of one ``step``, most frequent first."""
    if not torch.cuda.is_available():
        return []
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            agg[ev.name][0] += 1
            agg[ev.name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return sorted(((k, int(c), t) for k, (c, t) in agg.items()), key=lambda r: (-r[1], -r[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_case_args(ap, shapes="llama3,gemma", timed=False, out=False)
    ap.add_argument("--cpu-small", action="store_true", help="CPU reference mode at H=64, V=1000, N=700 (a check)")
    a = ap.parse_args()
    common.check_case_args(ap, a)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        flce_dist.setup_reference_mode()
    shapes = {"small": (64, 1000)} if a.cpu_small else SHAPES
    n = 700 if a.cpu_small else a.n
    for shape, mode, h, v in bench_data.cases("small" if a.cpu_small else a.shapes, a.data, shapes, a.fixture):
        x, w, t = bench_data.make_inputs(n, h, v, mode=mode, dtype=torch.bfloat16, device=dev, seed=0,
                                         fixture=a.fixture or None)
        x.requires_grad_()
        w.requires_grad_()

        step = common.fwd_bwd(lambda: flce_dist.fused_linear_cross_entropy(x, w, t), x, w)
        step()  # compiles, warms the caches
        log = OpLog()
        trace(step, log)
        outside = sum(c for (where, _), c in log.counts.items() if not where)
        print(f"=== {shape}/{mode} N={n} H={h} V={v}: {outside} aten ops outside Helion launches")
        for (where, op), c in sorted(log.counts.items(), key=lambda r: (r[0][0], -r[1])):
            print(f"  {c:4d}  {where or '-':14} {op}")
        print("  one call, in order:", " ".join(log.order))
        kern = cuda_kernels(step)
        if kern:
            print(f"  CUDA kernels of one call: {sum(k[1] for k in kern)}")
            for name, c, us in kern:
                print(f"  {c:4d}  {us:9.1f} us  {name[:150]}")
        del x, w, t
        if dev == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
