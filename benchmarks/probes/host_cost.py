"""Issue 53: the host cost of one flce fwd+bwd call, and where it goes.

    python benchmarks/probes/host_cost.py [--ns 1024,2048,4096] [--shape llama3] [--reps 30] [--out DIR]
    python benchmarks/probes/host_cost.py --trace [--n 1024 --h 128 --v 4096]   # the per-phase op list (CPU or CUDA)
    python benchmarks/probes/host_cost.py --smoke [--out DIR]                    # CPU reference mode, tiny, seconds
    python benchmarks/probes/host_cost.py --counts                               # GPU-equivalent op counts (CPU, seconds)

Per N (default the llama3 head H=4096, V=128256, bf16, random data), in one process:

1. **single vs steady** (``common.Timers``): one ``fused_linear_cross_entropy(x, W, t).backward()`` from an idle
   GPU (a sync and ``--idle-ms`` of sleep before it) and K back to back behind one untimed call, per call;
   ``single - steady`` is the call's host prologue. The three distinct matmuls (``3mm``) in both modes beside.
2. **launches per fwd+bwd**: the CUDA kernels of one call (torch.profiler, after a warm-up) by class: cuBLAS,
   Helion (Triton kernels named ``_helion_<kernel>``), other torch kernels, memset / memcpy; and flce's own
   Helion launches counted at ``kernels/launch._launch`` (the two Helion counts should agree).
3. **host time per phase**: flce has no ``record_function`` ranges, so the phase functions of the call
   (``PHASE_HOOKS``: the API prologue, the autograd apply, targets, plan, the logits pass, merge, the stats
   combine, row_prepare, dz_gated, row_scale, token rows, the backward scale, every Helion launch ...) are
   wrapped for the probe's calls (restored after) and timed with ``time.perf_counter``, each phase's time
   exclusive of the phases inside it. The call runs while the GPU is busy behind a queue of long matmuls
   (``--busy-ms``; ``CUDA_LAUNCH_BLOCKING`` unset), so no launch waits on the GPU and the wall time is host
   work only; a rep whose queue drained before the call returned (an event recorded after the queue had
   completed: a host sync or too short a queue) is counted and reported, not used. The wrappers cost ~1 us
   each: the total beside the same call's wall time without them says how much.

``--trace`` (CPU in Helion's reference mode, or CUDA): one warm fwd+bwd under a ``TorchDispatchMode`` with the
same phase wrappers: every Helion launch (``[name]``) and every aten op outside the launches, in order,
grouped by phase and classed ``kernel`` (a CUDA kernel on the GPU), ``cuBLAS``, ``alloc`` (no kernel),
``view`` (no kernel) or ``SYNC`` (``_local_scalar_dense``: a host sync). The op list of
``benchmarks/probes/HOST_COST.md`` comes from it.

``--counts`` (CPU reference mode, seconds; ``op_counts`` / ``call_counts``, which the tests lock): per fwd+bwd, what it
would launch on the GPU, split into the **prologue** (everything before the first ``lse_forward`` launch: GPU idle
time from an idle GPU) and the total: Helion launches (H), torch kernels (k) and cuBLAS matmuls (c); allocations and
views launch nothing and are not counted. To count what the GPU runs, the trace forces two vocabulary tiles in the
logits pass (so the merge is its Helion launch, not reference mode's torch path of a one-tile pass) and leaves out
the API's CPU-only target range check; ``sm90`` emulates sm_90's split target logits (``launch.split_targets``:
``kernels/target_dot.py`` after the pass). Shapes: N=1024 (one chunk: llama3 up to N=3581 on the GPU) and N=2048 in
2 chunks (``chunk_bytes``), H=128, V=4096, bf16.

Prints a table last; writes ``host_cost[_smoke].csv``, ``host_cost_phases[_smoke].csv`` (and with a trace
``host_cost_trace[_smoke].csv``) to ``--out`` (and, on CUDA without ``--smoke``, to ``benchmarks/results/``).

Reference mode (CPU) runs the same host path as CUDA except: the API's target range check (CPU tensors only: 6
small ops and a host sync), the merge of the logits pass's partials (one Helion launch on the GPU; in
reference mode the pass is one tile, so the merge takes its torch path, 13 ops) and ``target_dot`` (an
extra Helion launch on sm_90). Its phase times are reference-mode times (the Helion kernels run as torch code):
only the op and launch lists carry over.
"""

from __future__ import annotations

import argparse
import collections
import csv
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import common  # noqa: E402  (first: puts the repository's flce_dist on the path where none is)
import data as bench_data  # noqa: E402
import flce_dist  # noqa: E402
from flce_dist import api, autograd, core, rowscale  # noqa: E402
from flce_dist._timing import SHAPES, three_matmuls, write_csv  # noqa: E402
from flce_dist.kernels import launch  # noqa: E402

LAUNCH = "helion launch"
# (owner, attribute, phase): each is looked up at call time by its caller (a module global or a class
# attribute), so replacing it on its owner reaches every call. Top-level frames the probe opens itself:
# "api" (fused_linear_cross_entropy: validation, shard resolution, params, the output reshape) and
# "backward engine" (loss.backward(): autograd's own work around FLCEFunction.backward).
CPU_ONLY = "target check (CPU only)"
PHASE_HOOKS: list[tuple[Any, str, str]] = [
    (api, "_check_target_range", CPU_ONLY),
    (api, "_eager", "autograd apply"),
    (autograd, "flce_forward", "forward core"),
    (launch, "target_rows", "targets"),
    (core._Tokens, "denominator", "mean denominator"),
    (core, "fused_plan", "chunk plan"),
    (core._Tokens, "row_weights", "row weights"),
    (core, "fused_forward_backward", "fused pass"),
    (rowscale, "reference", "rowscale reference"),
    (launch, "lse_forward", "logits pass"),
    (launch, "merge", "merge"),
    (core._Guard, "combine", "stats combine"),
    (rowscale, "prepare_", "row_prepare"),
    (launch, "dz_gated", "dz_gated"),
    (launch, "row_scale", "row_scale"),
    (launch, "token_rows", "token rows"),
    (core._Tokens, "reduce", "reduce loss"),
    (autograd.FLCEFunction, "backward", "FLCEFunction.backward"),
    (autograd, "scale_precomputed", "backward scale"),
    (launch, "_launch", LAUNCH),
    (launch, "_bind", "launch bind (cache)"),  # inside each launch: the launch cache's key and lookup
]
VIEWS = {"view", "_unsafe_view", "alias", "detach", "lift_fresh", "t", "slice", "select", "transpose", "as_strided",
         "expand", "unsqueeze", "squeeze", "reshape", "permute", "unbind", "split", "narrow", "_reshape_alias",
         "diagonal", "view_as", "split_with_sizes"}
ALLOCS = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
MATMULS = {"mm", "addmm", "addmm_", "bmm", "matmul", "_scaled_mm", "baddbmm"}
KERNEL_CLASSES = [("cuBLAS", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|cublas", re.I)),
                  ("Helion", re.compile(r"^_helion_")),
                  ("memset/memcpy", re.compile(r"^Mem(set|cpy)", re.I))]


def op_kind(func) -> str:
    """``kernel`` / ``cuBLAS`` / ``alloc`` / ``view`` / ``SYNC`` for an aten OpOverload (what it costs on the GPU)."""
    base = func._opname
    if base == "_local_scalar_dense":
        return "SYNC"
    if base in MATMULS:
        return "cuBLAS"
    if base in ALLOCS:
        return "alloc"
    if base in VIEWS or getattr(func, "is_view", False):
        return "view"
    return "kernel"


def kernel_class(name: str) -> str:
    for label, rx in KERNEL_CLASSES:
        if rx.search(name):
            return label
    return "torch"


class Phases:
    """Wraps ``PHASE_HOOKS`` (:meth:`install`, :meth:`restore`: only around the trace and the hooked timing, so
    the single / steady timings and the plain host time run the library untouched); while ``on``, each wrapped call is a frame
    on a stack: ``excl[phase]`` its host seconds less those of the frames inside it, ``calls[phase]``, and
    ``log`` (``tracing``) the ordered ``(phase, item, kind)`` of Helion launches and aten ops (``OpLog``)."""

    def __init__(self) -> None:
        self.on = self.tracing = False
        self.stack: list[list[Any]] = []
        self.excl: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.log: list[tuple[str, str, str]] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def reset(self) -> None:
        self.excl.clear()
        self.calls.clear()
        self.log.clear()

    def enter(self, label: str) -> None:
        self.stack.append([label, time.perf_counter(), 0.0])

    def exit(self) -> None:
        label, t0, child = self.stack.pop()
        dt = time.perf_counter() - t0
        self.excl[label] += dt - child
        self.calls[label] += 1
        if self.stack:
            self.stack[-1][2] += dt

    def phase(self) -> str:
        """The innermost phase that is not a Helion launch."""
        for label, _, _ in reversed(self.stack):
            if label != LAUNCH:
                return label
        return "-"

    def in_launch(self) -> bool:
        return any(f[0] == LAUNCH for f in self.stack)

    def _wrap(self, fn: Callable, label: str) -> Callable:
        def wrapped(*a, **k):
            if not self.on:
                return fn(*a, **k)
            if label == LAUNCH and self.tracing and not self.in_launch():
                self.log.append((self.phase(), f"[{a[0]}]", "Helion"))
            self.enter(label)
            try:
                return fn(*a, **k)
            finally:
                self.exit()

        return wrapped

    def install(self) -> "Phases":
        if self._saved:  # installed already
            return self
        for owner, name, label in PHASE_HOOKS:
            raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            self._saved.append((owner, name, raw))
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            new = self._wrap(fn, label)
            setattr(owner, name, staticmethod(new) if isinstance(raw, staticmethod) else new)
        return self

    def restore(self) -> None:
        for owner, name, raw in reversed(self._saved):
            setattr(owner, name, raw)
        self._saved.clear()


class OpLog(TorchDispatchMode):
    """Appends every aten op outside a Helion launch to ``phases.log`` as (phase, op, kind)."""

    def __init__(self, phases: Phases) -> None:
        super().__init__()
        self.phases = phases

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.phases.in_launch():
            self.phases.log.append((self.phases.phase(), func._opname, op_kind(func)))
        return func(*args, **(kwargs or {}))


def make_inputs(n: int, h: int, v: int, dev: torch.device):
    x, w, t = bench_data.make_inputs(n, h, v, mode="random", dtype=torch.bfloat16, device=dev, seed=0)
    return x.requires_grad_(), w.requires_grad_(), t


def one_call(ph: Phases, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> None:
    """One fwd+bwd with the probe's two top-level frames ("api", "backward engine") open while ``ph.on``."""
    x.grad = w.grad = None
    if ph.on:
        ph.enter("api")
    loss = flce_dist.fused_linear_cross_entropy(x, w, t)
    if ph.on:
        ph.exit()
        ph.enter("backward engine")
    loss.backward()
    if ph.on:
        ph.exit()


def trace(ph: Phases, x, w, t) -> list[tuple[str, str, str]]:
    """The ordered (phase, item, kind) of one warm fwd+bwd (Helion launches and aten ops outside them)."""
    one_call(ph, x, w, t)  # warm: compiles, fills the launch cache
    ph.reset()
    ph.install()
    ph.on = ph.tracing = True
    try:
        with OpLog(ph):
            one_call(ph, x, w, t)
    finally:
        ph.on = ph.tracing = False
        ph.restore()
    return list(ph.log)


def print_trace(log: list[tuple[str, str, str]], title: str) -> dict[str, collections.Counter]:
    """Per phase (in order of first appearance): its items in order, runs compressed (``name x3``), and the
    count per kind; returns {phase: Counter(kind)}."""
    phases: dict[str, list[tuple[str, str]]] = {}
    for phase, item, kind in log:
        phases.setdefault(phase, []).append((item, kind))
    print(f"=== trace {title}: {sum(1 for e in log if e[2] == 'Helion')} Helion launches, "
          f"{sum(1 for e in log if e[2] in ('kernel', 'cuBLAS'))} kernel-launching aten ops, "
          f"{sum(1 for e in log if e[2] == 'SYNC')} host syncs, {len(log)} items")
    kinds = {}
    for phase, items in phases.items():
        runs: list[list[Any]] = []
        for item, kind in items:
            tag = item if kind in ("Helion",) else f"{item}({kind[0] if kind != 'SYNC' else 'SYNC'})"
            if runs and runs[-1][0] == tag:
                runs[-1][1] += 1
            else:
                runs.append([tag, 1])
        kinds[phase] = collections.Counter(k for _, k in items)
        counts = ", ".join(f"{k} {c}" for k, c in sorted(kinds[phase].items()))
        print(f"  {phase:22} [{counts}]  " + " ".join(f"{tag}x{c}" if c > 1 else tag for tag, c in runs))
    print("  (kinds: H Helion launch, k = kernel, c = cuBLAS, a = alloc, v = view, SYNC = host sync)")
    return kinds


def op_counts(log: list[tuple[str, str, str]]) -> dict[str, int]:
    """GPU-equivalent counts of one fwd+bwd's trace: ``pro_*`` before the first ``[lse_forward]`` launch (the
    prologue), ``all_*`` in all; ``*_H`` Helion launches, ``*_k`` torch kernels, ``*_c`` cuBLAS, ``*_ops`` their sum.
    The CPU-only target check (``CPU_ONLY``) is left out; allocations, views and syncs launch no kernel."""
    key = {"Helion": "H", "kernel": "k", "cuBLAS": "c"}
    c = dict.fromkeys([f"{w}_{k}" for w in ("pro", "all") for k in ("H", "k", "c", "ops")], 0)
    pro = True
    for phase, item, kind in log:
        if phase == CPU_ONLY or kind not in key:
            continue
        if pro and item == "[lse_forward]":
            pro = False
        for w in (("pro", "all") if pro else ("all",)):
            c[f"{w}_{key[kind]}"] += 1
            c[f"{w}_ops"] += 1
    return c


COUNT_SHAPES = {"1chunk": (1024, 1024), "2chunks": (2048, 1024)}  # name: (N, rows per chunk)


def call_counts(n: int = 1024, h: int = 128, v: int = 4096, rows: int | None = None, sm90: bool = False,
                log: bool = False) -> dict[str, Any]:
    """``op_counts`` of one warm default fwd+bwd (bf16, CPU reference mode) at ``n`` tokens, in chunks of ``rows``
    (``Settings(chunk_bytes=...)``; None: the default plan), with the logits pass in two vocabulary tiles (so its
    merge is one Helion launch, as on the GPU); ``sm90``: sm_90's split target logits. ``log``: also the trace."""
    from flce_dist import settings

    flce_dist.setup_reference_mode()
    x, w, t = make_inputs(n, h, v, torch.device("cpu"))
    over = dict(blocks={"lse_forward": {"block_v": max(2, v // 2)}})
    if rows is not None:
        over["chunk_bytes"] = rows * v * x.element_size()
    saved = launch.split_targets
    if sm90:
        launch.split_targets = lambda device: True
    try:
        with settings.override(**over):
            got = trace(Phases(), x, w, t)
    finally:
        launch.split_targets = saved
    out: dict[str, Any] = dict(op_counts(got))
    if log:
        out["log"] = got
    return out


def print_counts() -> list[dict]:
    rows = []
    for name, (n, r) in COUNT_SHAPES.items():
        for sm90 in (False, True):
            c = call_counts(n, rows=r, sm90=sm90)
            rows.append(dict(shape=name, N=n, sm90=sm90, **c))
    print("=== GPU-equivalent ops per fwd+bwd (H Helion, k torch kernels, c cuBLAS; prologue = before lse_forward)")
    common.print_table(rows, [("shape", "shape", "8s"), ("N", "N", "6d"), ("sm90", "sm90", "5d")]
                       + [(k, k, "6d") for k in ("pro_ops", "pro_H", "pro_k", "pro_c", "all_ops", "all_H", "all_k",
                                                  "all_c")])
    return rows


def cuda_kernels(step: Callable[[], None]) -> collections.Counter:
    """{name: count} of the CUDA kernels (and memsets / memcpys) of one ``step``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def host_syncs(step: Callable[[], None]) -> list[str]:
    """The host-sync warnings of one ``step`` (``torch.cuda.set_sync_debug_mode("warn")``): a sync inside the
    call would make its host time GPU time (empty: none)."""
    import warnings

    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's one-time notice on the first switch to the debug mode ("Synchronization debug mode is a prototype
    # feature ...") is no sync: run 33 counted it as one at the first N
    return [str(w.message)[:160] for w in ws
            if "synchroniz" in str(w.message).lower() and "prototype feature" not in str(w.message)]


def busy_queue(ms: float, dev: torch.device) -> Callable[[], torch.cuda.Event]:
    """A callable that enqueues ~``ms`` of matmuls and returns an event recorded right after them."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(3):
        a @ a
    e.record()
    e.synchronize()
    per = s.elapsed_time(e) / 3
    k = max(1, math.ceil(ms / per))

    def enqueue() -> torch.cuda.Event:
        for _ in range(k):
            a @ a
        ev = torch.cuda.Event()
        ev.record()
        return ev

    return enqueue


def host_phases(ph: Phases, x, w, t, reps: int, busy_ms: float) -> tuple[dict, float, float, int]:
    """Per phase ``{us, calls}``: mean exclusive host us and calls per fwd+bwd (each call behind a busy GPU, the
    hooks on); the mean host ms of the call with the hooks and without them; the reps left out because their busy
    queue had completed before the call returned (then the call may have waited on the GPU)."""
    dev = x.device
    enqueue = busy_queue(busy_ms, dev) if dev.type == "cuda" else (lambda: None)
    drained = 0

    def timed(on: bool) -> list[float]:
        nonlocal drained
        ts = []
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            excl, calls = ph.excl.copy(), ph.calls.copy()
            ev = enqueue()
            ph.on = on
            t0 = time.perf_counter()
            one_call(ph, x, w, t)
            dt = time.perf_counter() - t0
            ph.on = False
            if ev is not None and ev.query():  # this rep does not count: its phases are taken back out
                drained += 1
                ph.excl, ph.calls = excl, calls
                continue
            ts.append(dt * 1e3)
        return ts

    one_call(ph, x, w, t)  # warm
    plain = timed(False)  # the hooks not installed: the plain call
    ph.reset()
    ph.install()
    try:
        hooked = timed(True)
    finally:
        ph.restore()
    used = max(1, len(hooked))
    res = {k: dict(us=ph.excl[k] / used * 1e6, calls=ph.calls[k] / used) for k in ph.excl}
    mean = lambda ts: statistics.mean(ts) if ts else float("nan")  # noqa: E731
    return res, mean(hooked), mean(plain), drained


def run_n(n: int, h: int, v: int, dev: torch.device, args: argparse.Namespace, ph: Phases) -> tuple[dict, dict]:
    x, w, t = make_inputs(n, h, v, dev)
    tm = common.Timers(args.reps, args.steady_calls, args.idle_ms, dev, warmup=3 if dev.type == "cuda" else 1)
    step = lambda: one_call(ph, x, w, t)  # noqa: E731  (ph.on is False: plain calls)
    single, steady = tm.single(step), tm.steady(step)
    mm3 = three_matmuls(x.detach(), w.detach())
    f1, f2 = tm.single(mm3), tm.steady(mm3)
    del mm3
    row = dict(N=n, H=h, V=v, device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               **common.mode_cols(single, steady, f1, f2), floor3_ms=f1, floor3_steady_ms=f2,
               steady_calls=args.steady_calls, idle_ms=args.idle_ms)
    kern = cuda_kernels(step) if dev.type == "cuda" else collections.Counter()
    syncs = host_syncs(step) if dev.type == "cuda" else []
    for m in syncs:
        print(f"    host sync in the call: {m}")
    by_class = collections.Counter()
    for name, c in kern.items():
        by_class[kernel_class(name)] += c
    phases, hooked_ms, plain_ms, drained = host_phases(ph, x, w, t, args.host_reps, args.busy_ms)
    row.update(kernels=sum(by_class.values()), cublas=by_class["cuBLAS"], helion=by_class["Helion"],
               torch_kernels=by_class["torch"], memsets=by_class["memset/memcpy"],
               helion_launches=phases.get(LAUNCH, {}).get("calls", float("nan")),
               call_host_ms=plain_ms, call_host_hooked_ms=hooked_ms, drained=drained, syncs=len(syncs))
    print(f"N={n}: single {single:.3f} ms, steady {steady:.3f} ms (host prologue {single - steady:.3f} ms; 3mm "
          f"{f1:.3f} / {f2:.3f}); kernels {row['kernels']} (cuBLAS {row['cublas']}, Helion {row['helion']}, torch "
          f"{row['torch_kernels']}, memset/memcpy {row['memsets']}); Helion launches {row['helion_launches']:.0f}; "
          f"host {plain_ms:.3f} ms per call behind a busy GPU ({hooked_ms:.3f} with the phase hooks; "
          f"{drained} reps left out: queue drained)", flush=True)
    if kern:
        for name, c in kern.most_common():
            print(f"    {c:3d}  {kernel_class(name):13} {name[:120]}")
    for label, d in sorted(phases.items(), key=lambda r: -r[1]["us"]):
        print(f"    {d['us']:8.1f} us  {d['calls']:5.1f} calls  {label}")
    del x, w, t
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row, phases


def save(rows: list[dict], name: str, args: argparse.Namespace) -> None:
    if not rows:
        return
    if args.smoke or not torch.cuda.is_available():  # a test's or a CPU run: --out only, never benchmarks/results
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            with open(Path(args.out) / name, "w", newline="") as f:
                wr = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
                wr.writeheader()
                wr.writerows(rows)
        return
    write_csv(rows, name, [args.out] if args.out else [])


TABLE = [("N", "N", "6d"), ("single", "single_ms", "8.3f"), ("steady", "steady_ms", "8.3f"),
         ("prologue", "host_ms", "9.3f"), ("adj", "host_adj_ms", "6.3f"), ("x3mm s", "single_x3mm", "7.3f"), ("x3mm st", "steady_x3mm", "8.3f"),
         ("kernels", "kernels", "8d"), ("cuBLAS", "cublas", "7d"), ("Helion", "helion", "7d"),
         ("launch()", "helion_launches", "9.0f"), ("torch", "torch_kernels", "6d"), ("memset", "memsets", "7d"),
         ("call host", "call_host_ms", "10.3f"), ("hooked", "call_host_hooked_ms", "7.3f"), ("syncs", "syncs", "6d")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", default="1024,2048,4096", help="token counts")
    ap.add_argument("--shape", default="llama3", help=f"one of {list(SHAPES)} or <H>x<V>")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per mode (median)")
    ap.add_argument("--host-reps", type=int, default=20, help="calls behind a busy GPU per N (mean)")
    ap.add_argument("--busy-ms", type=float, default=40.0, help="ms of queued matmuls ahead of each host-timed call")
    common.add_timing_args(ap)
    ap.add_argument("--trace", action="store_true", help="print the per-phase op list of one call (--n, --h, --v)")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--h", type=int, default=128)
    ap.add_argument("--v", type=int, default=4096)
    ap.add_argument("--counts", action="store_true", help="GPU-equivalent op counts per fwd+bwd (CPU, seconds)")
    ap.add_argument("--smoke", action="store_true", help="CPU reference mode, N=64,128, H=32, V=512, 2 reps, and a trace")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    common.check_timing_args(ap, args)
    if args.smoke:
        args.ns, args.shape, args.reps, args.host_reps, args.steady_calls = "64,128", "32x512", 2, 2, 2
        args.n, args.h, args.v, args.trace = 128, 32, 512, True
    table = common.with_literal_shapes(args.shape, SHAPES)
    if args.shape not in table:
        ap.error(f"--shape: unknown {args.shape!r} (choose from {list(SHAPES)} or <H>x<V>)")
    args.hv = table[args.shape]
    try:
        args.n_list = [int(s) for s in args.ns.split(",")]
    except ValueError:
        ap.error(f"--ns must be a comma list of ints, got {args.ns!r}")
    if min(args.n_list) < 1 or args.reps < 1 or args.host_reps < 1:
        ap.error("--ns, --reps and --host-reps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.counts:
        return print_counts()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if dev.type == "cpu":
        flce_dist.setup_reference_mode()
    ph = Phases()  # its hooks are installed only around the trace and the hooked host timing
    rows, prow = [], []
    sfx = "_smoke" if args.smoke else ""
    try:
        if args.trace:
            x, w, t = make_inputs(args.n, args.h, args.v, dev)
            log = trace(ph, x, w, t)
            print_trace(log, f"N={args.n} H={args.h} V={args.v} ({dev.type}; chunk rows "
                             f"{common.chunk_plan(x, args.v)})")
            save([dict(order=i, phase=p, item=it, kind=k) for i, (p, it, k) in enumerate(log)], f"host_cost_trace{sfx}.csv",
                 args)
            del x, w, t
        h, v = args.hv
        for n in ([] if args.trace and not args.smoke else args.n_list):  # --trace alone: the op list only
            row, phases = run_n(n, h, v, dev, args, ph)
            rows.append(row)
            prow += [dict(N=n, phase=k, us=d["us"], calls=d["calls"]) for k, d in phases.items()]
    finally:
        ph.restore()
    if not rows:
        return rows
    save(rows, f"host_cost{sfx}.csv", args)
    save(prow, f"host_cost_phases{sfx}.csv", args)
    print(f"\n=== host_cost summary ({rows[0]['device'] if rows else dev.type}, H={args.hv[0]} V={args.hv[1]} bf16 random;"
          f" single = from an idle GPU, steady = {args.steady_calls} back to back; prologue = single - steady, adj = less the 3mm's own single - steady; call host ="
          " the call's wall time behind a busy GPU, hooked = with the phase wrappers)")
    common.print_table(rows, TABLE)
    if prow:
        ns = [r["N"] for r in rows]
        labels = sorted({r["phase"] for r in prow}, key=lambda k: -max(r["us"] for r in prow if r["phase"] == k))
        print(f"{'phase (us per call, exclusive)':32}" + "".join(f"{'N=' + str(n):>10}" for n in ns))
        for k in labels:
            got = {r["N"]: r["us"] for r in prow if r["phase"] == k}
            print(f"{k:32}" + "".join(f"{got.get(n, float('nan')):10.1f}" for n in ns))
    return rows


if __name__ == "__main__":
    main()
