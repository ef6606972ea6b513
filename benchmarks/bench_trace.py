"""Token-count traces (issue 60): what RL and padding-free training run, not one warmed-up shape.

    python benchmarks/bench_trace.py [--traces grpo,padfree] [--head loss|rl] [--impls ...] [--calls 200]
        [--shape llama3] [--data random] [--out DIR]          # one GPU; each (trace, impl) in a fresh process
    python benchmarks/bench_trace.py --cpu-smoke               # CPU, Helion reference mode, a tiny head
    (bench.py --trace and bench_rl.py --trace hand their arguments to this script: the loss and RL heads)

Traces (seeded, the same token counts for every impl):
  grpo     GRPO-like micro-batches: 8 completions of one prompt, lengths from a log-normal (median 700 tokens,
           sigma 0.6) clipped to [16, 2048], padded to the batch's longest (N = 8 x max, a multiple of 8; the padded
           positions' targets are ignore_index, as TRL's completion mask does).
  padfree  padding-free packing: N uniform in [512, 16384], every target valid.
Each call is one forward+backward at its N with fresh hidden rows (slices of one pre-made [16384, H] bf16 tensor of
the data mode) and the head's fixed W, timed on the host around the call with a device sync before and after (so a
compile, which is host work, counts). Every impl runs its trace from a fresh process: the first call pays whatever
that impl pays at start (Triton / Helion / CuTe DSL compiles).

Impls, ``--head loss`` (mean cross entropy):
  flce        flce_dist.fused_linear_cross_entropy(x, W, t)
  liger_c16   Liger-Kernel 0.8.5's Triton FLCE with chunk_mem_const=16 (its fastest setting, SPEC section 6)
  liger_cute  Liger 0.8.5's CuTe DSL SM90 FLCE (needs N % 128 == 0: the call pads x with zero rows and t with
              ignore_index to the next multiple of 128; the copy is timed, as a user would pay it)
  torch       F.cross_entropy on materialised float32 logits
``--head rl`` (obj = (adv * logp).sum() + 0.01 * entropy.sum(), temperature 0.7):
  flce_rl     flce_dist.logprobs_and_entropy
  liger_sm90  Liger 0.8.5's LigerFusedScaledCrossEntropySM90Function (CuTe DSL; padded to N % 128 as above)
  torch_rl    log_softmax / softmax on materialised float32 logits

Per (trace, impl) row: total seconds of the trace, p50 / p99 / max / first call (ms), Triton compiles (counted by
Triton's ``jit_cache_hook``: a cache miss of any Triton kernel, Helion's included), flce's Helion bound kernels, GPU
peak memory beyond the inputs (GiB), and the growth of allocated GPU memory and host RSS between call 20 and the
last (a bounded process holds none). CSV: bench_trace_<head>.csv (and under --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import data as bdata  # noqa: E402

MAX_N = 16384
IMPLS = {"loss": ("flce", "liger_c16", "liger_cute", "torch"), "rl": ("flce_rl", "liger_sm90", "torch_rl")}
TEMP, BETA = 0.7, 0.01


def trace(name: str, calls: int, seed: int = 0) -> list[tuple[int, list[int] | None]]:
    """``[(N, completion lengths or None)]`` of ``calls`` calls (lengths: grpo's 8 completions)."""
    g = torch.Generator().manual_seed(seed)
    out: list[tuple[int, list[int] | None]] = []
    for _ in range(calls):
        if name == "grpo":
            lens = (torch.randn(8, generator=g) * 0.6 + torch.log(torch.tensor(700.0))).exp()
            lens = lens.round().clamp(16, 2048).long().tolist()
            out.append((8 * max(lens), lens))
        elif name == "padfree":
            out.append((int(torch.randint(512, MAX_N + 1, (1,), generator=g)), None))
        elif name == "smoke":
            out.append((int(torch.randint(17, 90, (1,), generator=g)), None))
        else:
            raise ValueError(f"trace must be grpo, padfree or smoke, got {name!r}")
    return out


def targets(t_all: torch.Tensor, n: int, lens: list[int] | None) -> torch.Tensor:
    """The call's targets: ``t_all[:n]``, with grpo's padded positions (beyond each completion) ignored."""
    t = t_all[:n].clone()
    if lens is not None:
        per = n // len(lens)
        pos = torch.arange(per, device=t.device)
        pad = torch.cat([pos >= ln for ln in lens])
        t[pad] = -100
    return t


def _pad128(x: torch.Tensor, t: torch.Tensor, extra: torch.Tensor | None = None):
    """The CuTe DSL kernels' N % 128 == 0: zero rows and ignored targets appended (exact for a masked mean)."""
    p = -x.shape[0] % 128
    if not p:
        return x, t, extra
    x = torch.cat([x, x.new_zeros(p, x.shape[1])])
    t = torch.cat([t, t.new_full((p,), -100)])
    return x, t, (None if extra is None else torch.cat([extra, extra.new_zeros(p)]))


def make_impl(name: str, dev: torch.device):
    """``step(x, w, t, adv) -> objective`` for impl ``name`` (x, w require grad; the caller calls backward)."""
    if name == "flce":
        import flce_dist

        return lambda x, w, t, adv: flce_dist.fused_linear_cross_entropy(x, w, t)
    if name == "flce_rl":
        import flce_dist

        def flce_rl(x, w, t, adv):
            lp, ent = flce_dist.logprobs_and_entropy(x, w, t, temperature=TEMP)
            return (adv * lp).sum() + BETA * ent.sum()
        return flce_rl
    if name == "torch":
        return lambda x, w, t, adv: F.cross_entropy((x @ w.T).float(), t)
    if name == "torch_rl":
        import bench_rl

        def torch_rl(x, w, t, adv):
            valid = t != -100
            lp, ent = bench_rl.torch_rl(x, w, torch.where(valid, t, 0), TEMP)
            return (adv * lp * valid).sum() + BETA * (ent * valid).sum()
        return torch_rl
    if name == "liger_c16":
        import bench

        fn = bench.liger_c16_impl()
        if fn is None:
            raise RuntimeError("Liger 0.8.5's chunk_mem_const unavailable")
        return lambda x, w, t, adv: fn(x, w, t)
    if name == "liger_cute":
        import bench

        fn = bench.liger_cute_impls().get("liger_cute")
        if fn is None:
            raise RuntimeError("Liger's CuTe DSL FLCE unavailable (nvidia-cutlass-dsl: benchmarks/quack_wheels.sh)")

        def liger_cute(x, w, t, adv):
            xp, tp, _ = _pad128(x, t)
            return fn(xp, w, tp)
        return liger_cute
    if name == "liger_sm90":
        import bench_rl

        fn, why = bench_rl.liger_sm90_fn(dev, 1, torch.bfloat16, True)
        if fn is None:
            raise RuntimeError(f"Liger's SM90 scaled CE: {why}")

        def liger_sm90(x, w, t, adv):
            xp, tp, ap = _pad128(x, t, adv)
            lp, ent = fn(xp, w, tp, TEMP, None)
            valid = (tp != -100).float()
            return (ap * lp * valid).sum() + BETA * (ent * valid).sum()
        return liger_sm90
    raise ValueError(f"unknown impl {name!r}")


class _Compiles:
    """Triton kernel-cache misses (each a compile), through ``knobs.runtime.jit_cache_hook``."""

    def __init__(self) -> None:
        self.n = 0
        try:
            from triton import knobs

            prev = knobs.runtime.jit_cache_hook

            def hook(*a, **k):
                self.n += 1
                return prev(*a, **k) if prev is not None else False
            knobs.runtime.jit_cache_hook = hook
            self.ok = True
        except (ImportError, AttributeError):
            self.ok = False


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _helion_binds() -> int:
    if "flce_dist.kernels.launch" not in sys.modules:
        return 0
    from flce_dist.kernels import launch

    return sum(len(k._bound_kernels) for k in launch._kernels().values())


def worker(args: argparse.Namespace) -> dict:
    """One (trace, impl) in this process: every call timed."""
    dev = torch.device(args.device)
    if dev.type == "cpu":
        import flce_dist

        flce_dist.setup_reference_mode()
        torch.set_num_threads(1)
    h, v = common.SHAPES[args.shape] if args.shape in common.SHAPES else (32, 1000)
    comp = _Compiles()
    x_all, w0, t_all = bdata.make_inputs(args.max_n, h, v, mode=args.data, device=dev, seed=args.seed)
    w = w0.clone().requires_grad_()
    adv_all = torch.randn(args.max_n, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    step = make_impl(args.impl, dev)
    tr = trace(args.trace, args.calls, args.seed)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    times, mem20, rss20 = [], 0, 0.0
    for i, (n, lens) in enumerate(tr):
        x = x_all[:n].detach().requires_grad_()
        t = targets(t_all, n, lens)
        adv = adv_all[:n]
        sync()
        t0 = time.perf_counter()
        step(x, w, t, adv).backward()
        sync()
        times.append(time.perf_counter() - t0)
        w.grad = None
        if i == min(19, len(tr) - 1):
            mem20 = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
            rss20 = _rss_mib()
    mem_end = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    ms = sorted(1e3 * s for s in times)
    return {"trace": args.trace, "impl": args.impl, "head": args.head, "shape": args.shape, "data": args.data,
            "calls": len(times), "total_s": sum(times), "p50_ms": statistics.median(ms),
            "p99_ms": ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))], "max_ms": ms[-1],
            "first_ms": 1e3 * times[0], "triton_compiles": comp.n if comp.ok else -1, "helion_binds": _helion_binds(),
            "peak_gib": ((torch.cuda.max_memory_allocated() - base) / 2**30) if dev.type == "cuda" else 0.0,
            "mem_growth_mib": (mem_end - mem20) / 2**20, "rss_growth_mib": _rss_mib() - rss20,
            "n_min": min(n for n, _ in tr), "n_max": max(n for n, _ in tr),
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="grpo,padfree")
    ap.add_argument("--head", default="loss", choices=list(IMPLS))
    ap.add_argument("--impls", default="", help="comma list (default: every impl of the head)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--shape", default="llama3", help=f"one of {list(common.SHAPES)}")
    ap.add_argument("--data", default="random", choices=["random", "realistic"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, reference mode, H=32 V=1000, 6 calls per trace")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per (trace, impl) process")
    ap.add_argument("--out", default="")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace", default="", help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="", help=argparse.SUPPRESS)
    ap.add_argument("--max-n", type=int, default=MAX_N, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.device, args.shape, args.calls, args.traces, args.max_n = "cpu", "tiny", 6, "smoke", 96
        args.impls = args.impls or ("flce,torch" if args.head == "loss" else "flce_rl,torch_rl")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return []
    rows = []
    impls = args.impls.split(",") if args.impls else list(IMPLS[args.head])
    for tr in args.traces.split(","):
        for impl in impls:
            cmd = [sys.executable, __file__, "--worker", "--trace", tr, "--impl", impl, "--head", args.head,
                   "--calls", str(args.calls), "--shape", args.shape, "--data", args.data, "--seed", str(args.seed),
                   "--device", args.device, "--max-n", str(args.max_n)]
            t0 = time.perf_counter()
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                got = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
                row = json.loads(got[-1][7:]) if got else {"trace": tr, "impl": impl, "error": (res.stdout + res.stderr)[-600:]}
            except subprocess.TimeoutExpired:
                row = {"trace": tr, "impl": impl, "error": f"timeout after {args.timeout:.0f} s"}
            row["process_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row) if "error" not in row else f"[{tr} {impl}] FAILED: {row['error']}", flush=True)
    print_table(rows)
    common.save(rows, f"bench_trace_{args.head}.csv", args)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n=== bench_trace: {rows[0].get('device', '') if rows else ''}")
    print(f"{'trace':8} {'impl':11} {'total s':>8} {'vs flce':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'first ms':>9} {'triton':>6} {'helion':>6} {'peak GiB':>8} {'dmem MiB':>8} {'drss MiB':>8}")
    flce_total = {r["trace"]: r["total_s"] for r in rows if r.get("impl", "").startswith("flce") and "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"{r['trace']:8} {r['impl']:11} FAILED")
            continue
        ratio = r["total_s"] / flce_total[r["trace"]] if r["trace"] in flce_total else float("nan")
        print(f"{r['trace']:8} {r['impl']:11} {r['total_s']:8.2f} {ratio:7.3f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
              f"{r['max_ms']:8.1f} {r['first_ms']:9.1f} {r['triton_compiles']:6d} {r['helion_binds']:6d} "
              f"{r['peak_gib']:8.2f} {r['mem_growth_mib']:8.1f} {r['rss_growth_mib']:8.1f}")


if __name__ == "__main__":
    main()
