"""Where the fused loss's time goes, by CUDA events alone (no profiler).

    python3 benchmarks/probes/event_probe.py [--shapes llama3,gemma] [--mode fb|fwd] [--n 8192] [--data random,realistic]

Why: ``kernel_profile.py`` finds wall - kernel durations ~2.2 ms at llama3 while the profiled
timeline's gaps add up to ~0.6 ms, and ``launch_probe.py`` found one store kernel 2.3 % faster under
the profiler (4.685 ms) than by CUDA events (4.794 ms) back to back. So the profiler's kernel times
and the benchmark's event times are not one clock. This probe times the loss the way the benchmark
does (CUDA events, calls back to back) and splits it by events recorded around every Helion launch,
every cuBLAS call (``torch.mm``, ``Tensor.addmm_``) and the row-scale form's helpers; the time between
two bracketed ops (torch's small kernels and launch gaps) is reported under the op that follows.
The bare cuBLAS matmul gets the same treatment (plain and bracketed) so that the bracket's own cost
is known, and ``nvidia-smi`` samples the SM clock and power during each phase.

Prints one table per shape and data mode (``--data``: ``random`` is ab_flce.py's inputs, the others
benchmarks/data.py's; ms per call, median over samples of ``--calls`` back-to-back calls).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import common  # noqa: E402  (first: puts the repository's flce_dist on the path where none is)
import flce_dist  # noqa: E402
from ab_flce import case_inputs  # noqa: E402
from flce_dist import rowscale  # noqa: E402
from flce_dist._timing import cuda_steady_ms  # noqa: E402
from flce_dist.kernels import launch  # noqa: E402


class Bracket:
    """Records (label, start event, end event) around the wrapped calls (outermost only)."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.depth = 0
        self.on = False
        self._saved: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, label) -> None:
        real = getattr(owner, name)
        self._saved.append((owner, name, real))
        br = self

        def wrapper(*a, **k):
            if not br.on or br.depth:
                return real(*a, **k)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            br.depth += 1
            s.record()
            try:
                return real(*a, **k)
            finally:
                e.record()
                br.depth -= 1
                br.marks.append((label(a, k) if callable(label) else label, s, e))

        setattr(owner, name, wrapper)

    def restore(self) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)


def _launch_label(a, k) -> str:  # launch._launch(name, args, device, dtype, settings, variant="", ...)
    variant = k.get("variant") or (a[5] if len(a) > 5 else "")
    return f"helion {a[0]}" + (f"_{variant}" if variant else "")


def _mm_label(a, k) -> str:
    return "cuBLAS mm (fp32 out)" if k.get("out_dtype") is not None else "cuBLAS mm"


def attribute(fn, br: Bracket, calls: int, samples: int) -> tuple[dict[str, float], float]:
    """Per-call ms by label (and 'between -> label'), and the bracketed wall per call."""
    per: dict[str, list[float]] = defaultdict(list)
    walls = []
    for _ in range(samples):
        br.marks.clear()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()  # untimed: the sample starts on a busy GPU (as _timing.cuda_steady_ms)
        br.on = True
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        br.on = False
        b.synchronize()
        acc: dict[str, float] = defaultdict(float)
        prev = a
        for label, s, e in br.marks:
            acc["between -> " + label] += prev.elapsed_time(s)
            acc[label] += s.elapsed_time(e)
            prev = e
        acc["between -> end"] += prev.elapsed_time(b)
        for k, v in acc.items():
            per[k].append(v / calls)
        walls.append(a.elapsed_time(b) / calls)
    return {k: statistics.median(v) for k, v in per.items()}, statistics.median(walls)


def smi_sampler(stop: threading.Event, out: list[str]) -> None:
    q = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
    while not stop.is_set():
        try:
            out.append(subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits", "-i", "0"],
                                      capture_output=True, text=True, timeout=5).stdout.strip())
        except Exception as exc:  # noqa: BLE001 (a probe: report, do not fail)
            out.append(f"nvidia-smi: {exc}")
            return
        time.sleep(0.2)


def under_load(fn, seconds: float = 2.5) -> str:
    """Run ``fn`` back to back for ``seconds`` while nvidia-smi samples the GPU: median SM MHz, W."""
    stop, rows = threading.Event(), []
    th = threading.Thread(target=smi_sampler, args=(stop, rows), daemon=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    th.start()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
    stop.set()
    th.join()
    try:
        vals = [r.split(",") for r in rows[1:] if r and "nvidia-smi" not in r]  # the first sample may predate the load
        mhz = statistics.median(float(v[0]) for v in vals)
        w = statistics.median(float(v[1]) for v in vals)
        reasons = sorted({v[3].strip() for v in vals})
        return f"SM {mhz:.0f} MHz, {w:.0f} W, throttle reasons {','.join(reasons)} ({len(vals)} samples)"
    except Exception:  # noqa: BLE001
        return "nvidia-smi: " + " | ".join(rows[:3])


def main() -> None:
    ap = argparse.ArgumentParser()
    common.add_case_args(ap, shapes="llama3,gemma", timed=False, out=False)
    ap.add_argument("--mode", default="fb", choices=["fb", "fwd"])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--no-smi", action="store_true")
    args = ap.parse_args()
    common.check_case_args(ap, args)
    br = Bracket()
    br.wrap(launch, "_launch", _launch_label)
    br.wrap(torch, "mm", _mm_label)
    br.wrap(torch.Tensor, "addmm_", "cuBLAS addmm_")
    br.wrap(rowscale, "reference", "rowscale.reference (sample matmul)")
    br.wrap(rowscale, "prepare_", "rowscale.prepare_")
    report = []
    try:
        for name, mode, h, v in common.cases(args):
            x, w, t = case_inputs(args.n, h, v, mode, args.sorted_vocab, args.fixture)  # ab_flce.py's inputs
            xd, wd = x.detach(), w.detach()

            def loss():
                if args.mode == "fwd":
                    with torch.no_grad():
                        flce_dist.fused_linear_cross_entropy(x, w, t)
                else:
                    x.grad = w.grad = None
                    flce_dist.fused_linear_cross_entropy(x, w, t).backward()

            nmm = 3 if args.mode == "fb" else 1

            def floor():
                for _ in range(nmm):
                    xd @ wd.T

            def floor_mm():  # the same matmuls through torch.mm (bracketed when the probe is on)
                for _ in range(nmm):
                    torch.mm(xd, wd.T)

            for f in (loss, floor, floor_mm):
                f()
            torch.cuda.synchronize()
            fl = cuda_steady_ms(floor, args.samples, args.calls)
            plain = cuda_steady_ms(loss, args.samples, args.calls)
            parts, wall = attribute(loss, br, args.calls, args.samples)
            mparts, mwall = attribute(floor_mm, br, args.calls, args.samples)
            lines = [f"{name} {mode} H={h} V={v} N={args.n} mode={args.mode}: floor {nmm} x matmul {fl:.2f} ms (bracketed "
                     f"{mwall:.2f}; its cuBLAS calls {mparts.get('cuBLAS mm', 0):.2f}); loss plain {plain:.2f} ms = "
                     f"{plain / fl:.3f}x, bracketed {wall:.2f} ms = {wall / fl:.3f}x"]
            for k, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
                if ms >= 0.005:
                    lines.append(f"  {k:48} {ms:8.3f} ms  {ms / fl:6.3f}x floor")
            if not args.no_smi:
                lines.append("  under load, bare matmuls: " + under_load(floor))
                lines.append("  under load, the loss:     " + under_load(loss))
            print("\n".join(lines), flush=True)
            report += lines
            del x, w, t, xd, wd
            torch.cuda.empty_cache()
    finally:
        br.restore()
    print("\n=== event_probe summary ===\n" + "\n".join(report))


if __name__ == "__main__":
    main()
