"""Issue 53: what one Helion launch costs the host, and what ``kernels/fast_launch.py`` takes off it (CUDA).

    python3 benchmarks/probes/launch_cost.py [--ns 1024,4096] [--shape llama3] [--reps 40] [--out DIR]

Per N (llama3 head by default, bf16, random data), in one process:

1. **The call, A/B** (``launch.FAST_LAUNCH`` off = Helion's default launcher every time, on = the direct
   ``CompiledKernel.run`` on a repeat): loss, dX and dW compared bit for bit between the two; then in
   interleaved rounds the single-call and steady times (``common.Timers``) and the call's host ms behind a
   busy GPU (``host_cost.busy_queue``: no launch waits on the GPU).
2. **Per launch** (every Helion launch of one fwd+bwd, captured at ``launch._launch`` and re-issued with its
   own arguments, the GPU kept busy): host us per launch of ``_launch`` with the launcher off / on, of the
   bound kernel's host function with a launcher that does nothing (Helion's generated host code: its
   allocations and grid), and of Triton's ``JITFunction.run`` alone (the default launcher's work).
3. A cProfile of the ``lse_forward`` launch with the default launcher (top functions by own time), and of
   whole fwd+bwd calls with the fast launcher (by own and by cumulative time).

Prints a table last; writes ``launch_cost.csv`` and ``launch_cost_kernels.csv`` to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/probes/
import common  # noqa: E402
import host_cost  # noqa: E402
import flce_dist  # noqa: E402
from flce_dist._timing import SHAPES, write_csv  # noqa: E402
from flce_dist.kernels import fast_launch, launch  # noqa: E402


def call(x, w, t) -> None:
    x.grad = w.grad = None
    flce_dist.fused_linear_cross_entropy(x, w, t).backward()


def bits(x, w, t) -> tuple[torch.Tensor, ...]:
    x.grad = w.grad = None
    loss = flce_dist.fused_linear_cross_entropy(x, w, t)
    loss.backward()
    return loss.detach().clone(), x.grad.clone(), w.grad.clone()


def host_ms(fn, enqueue, reps: int) -> float:
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        ev = enqueue()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if not ev.query():
            ts.append(dt * 1e3)
    return statistics.median(ts) if ts else float("nan")


def capture(x, w, t) -> list[tuple]:
    """Every ``_launch`` of one warm fwd+bwd: (name, args, device, dtype, settings, variant, h, blocks)."""
    got, orig = [], launch._launch

    def rec(name, args, device, dtype, settings, variant="", h=None, blocks=None):
        got.append((name, args, device, dtype, settings, variant, h, blocks))
        return orig(name, args, device, dtype, settings, variant, h, blocks)

    launch._launch = rec
    try:
        call(x, w, t)
    finally:
        launch._launch = orig
    torch.cuda.synchronize()
    return got


def per_launch(recs: list[tuple], enqueue, reps: int) -> list[dict]:
    rows, seen = [], set()
    for rec in recs:
        name, args, device, dtype, settings, variant, h, blocks = rec
        if (name, variant) in seen:
            continue
        seen.add((name, variant))
        full, bound, _ = launch._bind(name, args, device, dtype, settings, variant, h, blocks)
        tk: list = []

        def noop(triton_kernel, grid, *a, **kw):
            tk[:] = [triton_kernel, grid, a, kw]

        bound._run(*full, _launcher=noop)
        kern, grid, targs, kw = tk

        def us(fn) -> float:
            torch.cuda.synchronize()
            ev = enqueue()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            dt = (time.perf_counter() - t0) / reps * 1e6
            return dt if not ev.query() else float("nan")

        out = {"kernel": name + (f"[{variant}]" if variant else "")}
        for fast in (False, True):
            launch.FAST_LAUNCH = fast
            out["launch_fast" if fast else "launch_default"] = statistics.median(
                us(lambda: launch._launch(*rec)) for _ in range(3))
        launch.FAST_LAUNCH = True
        out["helion_host_only"] = statistics.median(us(lambda: bound._run(*full, _launcher=noop)) for _ in range(3))
        out["triton_run"] = statistics.median(
            us(lambda: kern.run(*targs, grid=grid, warmup=False, **kw)) for _ in range(3))
        out["n_triton_args"] = len(targs)
        rows.append(out)
    return rows


def profile_launch(recs: list[tuple], reps: int) -> str:
    rec = next(r for r in recs if r[0] == "lse_forward")
    launch.FAST_LAUNCH = False
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        launch._launch(*rec)
    pr.disable()
    launch.FAST_LAUNCH = True
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    return s.getvalue()


def profile_call(x, w, t, reps: int) -> str:
    """cProfile of whole fwd+bwd calls with the fast launcher (where the rest of the host time goes)."""
    pr = cProfile.Profile()
    call(x, w, t)
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(reps):
        call(x, w, t)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(45)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", default="1024,4096")
    ap.add_argument("--shape", default="llama3", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy-ms", type=float, default=60.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    h, v = SHAPES[a.shape]
    enqueue = host_cost.busy_queue(a.busy_ms, dev)
    print(f"fast path supported: {fast_launch.fast_path_supported()}", flush=True)
    rows, krows = [], []
    for n in (int(s) for s in a.ns.split(",")):
        x, w, t = host_cost.make_inputs(n, h, v, dev)
        for fast in (False, True):
            launch.FAST_LAUNCH = fast
            call(x, w, t)
            call(x, w, t)
        launch.FAST_LAUNCH = False
        ref = bits(x, w, t)
        launch.FAST_LAUNCH = True
        got = bits(x, w, t)
        same = all(torch.equal(p, q) for p, q in zip(ref, got))
        print(f"N={n}: loss/dX/dW bit-identical with the fast launcher: {same}; cached kernels "
              f"{len(fast_launch._COMPILED)}", flush=True)
        tm = common.Timers(a.reps, device=dev)
        per: dict[str, dict[str, list[float]]] = {"default": {}, "fast": {}}
        for _ in range(a.rounds):
            for mode in ("default", "fast"):
                launch.FAST_LAUNCH = mode == "fast"
                step = lambda: call(x, w, t)  # noqa: E731
                d = per[mode]
                d.setdefault("single", []).append(tm.single(step))
                d.setdefault("steady", []).append(tm.steady(step))
                d.setdefault("host", []).append(host_ms(step, enqueue, max(5, a.reps // 2)))
        launch.FAST_LAUNCH = True
        for mode, d in per.items():
            r = {"N": n, "shape": a.shape, "launcher": mode, "bit_identical": same,
                 **{k + "_ms": statistics.median(vs) for k, vs in d.items()}}
            r["single_over_steady"] = r["single_ms"] / r["steady_ms"]
            rows.append(r)
        recs = capture(x, w, t)
        for r in per_launch(recs, enqueue, 20):
            krows.append({"N": n, **r})
        if n == int(a.ns.split(",")[0]):
            print(profile_launch(recs, 30))
            print("=== cProfile of whole calls (fast launcher)")
            print(profile_call(x, w, t, 20))
        del x, w, t, recs
        torch.cuda.empty_cache()
    if a.out:
        write_csv(rows, "launch_cost.csv", [a.out])
        write_csv(krows, "launch_cost_kernels.csv", [a.out])
    print(f"\n=== launch_cost summary ({torch.cuda.get_device_name()}, {a.shape}, bf16 random; ms; host = the call's "
          f"host time behind a busy GPU; per-launch host us)")
    print(f"{'N':>6} {'launcher':>9} {'single':>8} {'steady':>8} {'s/st':>6} {'host':>7} {'bits':>5}")
    for r in rows:
        print(f"{r['N']:>6} {r['launcher']:>9} {r['single_ms']:8.3f} {r['steady_ms']:8.3f} "
              f"{r['single_over_steady']:6.3f} {r['host_ms']:7.3f} {str(r['bit_identical']):>5}")
    print(f"{'N':>6} {'kernel':<22} {'default':>8} {'fast':>8} {'helion':>8} {'triton':>8} {'args':>5}")
    for r in krows:
        print(f"{r['N']:>6} {r['kernel']:<22} {r['launch_default']:8.1f} {r['launch_fast']:8.1f} "
              f"{r['helion_host_only']:8.1f} {r['triton_run']:8.1f} {r['n_triton_args']:5d}")


if __name__ == "__main__":
    main()
