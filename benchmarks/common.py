"""What the benchmarks and probes share, so that each states only what it measures.

* the case options: ``--shapes``, ``--n``, ``--reps``, the data modes (``--data``, ``--fixture``,
  ``--sorted-vocab``: ``data.py``) and ``--out`` (:func:`add_case_args`, :func:`check_case_args`),
  and the cases they name, ``(shape, data mode, H, V)`` in run order (:func:`cases`);
* CSV names and the write to ``benchmarks/results/`` and ``--out`` (:func:`csv_name`, :func:`save`);
* the ``d_*`` columns of the inputs' softmax statistics and the note that tables print beside them
  (:func:`describe_cols`, :func:`data_note`), a TP rank's leaves from the full inputs
  (:func:`shard_leaves`), and one table printer (:func:`print_table`);
* a fwd+bwd step of a loss on leaves ``x``, ``w`` (:func:`fwd_bwd`), the line a failed
  implementation prints (:func:`failed`), the max of a per-rank figure over the ranks
  (:func:`max_over_ranks`), and flce's own rows per token chunk (:func:`chunk_plan`);
* the two timing modes every benchmark row reports (:class:`Timers`, issue 53): ``single`` (each call
  from an idle GPU: a sync and a short sleep before it, CUDA events around the one call; the host
  work before its first kernel counts) and ``steady`` (K calls back to back behind one untimed call,
  total / K: the host work of a call overlaps the GPU work before it, as in a training loop), with
  the options that set them (:func:`add_timing_args`).

Timing itself (CUDA events, steady state, memory peaks, the matmul floors) is ``flce_dist._timing``,
which ``python -m flce_dist.tune`` shares. Importing this module puts the repository root on
``sys.path`` unless a ``flce_dist`` is importable already: a tree on ``PYTHONPATH`` wins (``device.sh
ab``/``tpab``: the loss of an older tree against this one).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("flce_dist") is None:
    sys.path.insert(0, str(ROOT))

import data  # noqa: E402  (benchmarks/, this file's folder)
from flce_dist._timing import SHAPES, write_csv  # noqa: E402

DEFAULT_SHAPES = ",".join(SHAPES)  # llama3,qwen3,gemma
DEFAULT_N = 8192


def add_case_args(ap: argparse.ArgumentParser, *, shapes: str | None = DEFAULT_SHAPES, n: int | None = DEFAULT_N,
                  reps: int | None = 10, timed: bool = True, out: bool = True, helps: dict[str, str] | None = None) -> None:
    """The options that name the cases and where the CSV goes: ``--shapes`` (a comma list),
    ``--n`` (tokens), ``--reps`` (timed calls per row; ``timed=False``: no such option), the
    data-mode options (``data.add_data_args``) and ``--out`` (``out=False``: none). ``helps``: help
    texts by option name, for a script whose defaults depend on other options."""
    helps = helps or {}
    ap.add_argument("--shapes", default=shapes, help=helps.get("shapes", f"comma list from {list(SHAPES)} or <H>x<V> (e.g. 4096x32000)"))
    ap.add_argument("--n", type=int, default=n, help=helps.get("n", "tokens"))
    if timed:
        ap.add_argument("--reps", type=int, default=reps, help=helps.get("reps", "timed calls per row (median)"))
    data.add_data_args(ap)
    if out:
        ap.add_argument("--out", default="", help="also write the CSV to this folder (besides benchmarks/results)")


def check_case_args(ap: argparse.ArgumentParser, args: argparse.Namespace,
                    table: dict[str, tuple[int, int]] | None = None) -> None:
    """Split ``--data`` into a list and refuse unknown data modes and shapes (``ap.error``: exit 2);
    ``table``: the shapes by name (default ``_timing.SHAPES``)."""
    data.check_data_args(ap, args)
    table = with_literal_shapes(args.shapes, SHAPES if table is None else table)
    bad = [s for s in args.shapes.split(",") if s not in table]
    if bad:
        ap.error(f"--shapes: unknown {bad} (choose from {list(table)})")


def cases(args: argparse.Namespace, table: dict[str, tuple[int, int]] | None = None) -> list[tuple[str, str, int, int]]:
    """``(shape name, data mode, H, V)`` in run order for the parsed case options (``data.cases``)."""
    return data.cases(args.shapes, args.data, with_literal_shapes(args.shapes, SHAPES if table is None else table),
                      args.fixture)


def with_literal_shapes(shapes: str, table: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """``table`` plus every ``<H>x<V>`` entry of the comma list ``shapes`` (e.g. ``4096x32000``, the
    shapes of issue 30's table that have no model name)."""
    lit = {s: tuple(int(d) for d in s.split("x")) for s in shapes.split(",") if re.fullmatch(r"[1-9]\d*x[1-9]\d*", s)}
    return {**table, **lit}


def csv_suffix(modes: list[str]) -> str:
    """"" for the default data modes (random, realistic), else ``_<mode>_<mode>``, so that runs of
    one mode each (e.g. in separate device calls) do not overwrite each other's CSV."""
    return "" if modes == ["random", "realistic"] else "_" + "_".join(modes)


def csv_name(stem: str, modes: list[str], n: int | None = None) -> str:
    """``<stem>[_n<N>][_<modes>].csv``: ``_n<N>`` where ``n`` is given and not the default 8192."""
    return stem + (f"_n{n}" if n is not None and n != DEFAULT_N else "") + csv_suffix(modes) + ".csv"


def out_dirs(args: argparse.Namespace) -> list[str]:
    """``[--out]`` where one was given (the CSV also goes to ``benchmarks/results/``)."""
    out = getattr(args, "out", "")
    return [out] if out else []


def save(rows: list[dict], name: str, args: argparse.Namespace) -> None:
    """Write ``rows`` as ``name`` under ``benchmarks/results/`` and ``--out`` (``_timing.write_csv``)."""
    write_csv(rows, name, out_dirs(args))


def describe_cols(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> dict:
    """The ``d_*`` columns of a case's inputs (``data.describe``); prints them on one line."""
    d = data.describe(x, w, t)
    print("  data:", data.describe_line(d))
    return {f"d_{k}": d[k] for k in data.DESCRIBE_KEYS}


def shard_leaves(xf: torch.Tensor, wf: torch.Tensor, t: torch.Tensor, start: int, end: int,
                 rank: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A TP rank's inputs from the full ones every rank builds alike: ``x`` and the rank's vocab rows
    ``wf[start:end]`` as fresh leaves that require grad, and the ``d_*`` columns of the full inputs
    (:func:`describe_cols`, printed on rank 0; ``{}`` on the others)."""
    dcols = describe_cols(xf, wf, t) if rank == 0 else {}
    return xf.clone().requires_grad_(), wf[start:end].clone().requires_grad_(), dcols


def data_note(row: dict) -> str:
    """What a table prints beside a case's reference row: the inputs' loss and negligible blocks."""
    return f"   loss {row['d_loss']:.2f} nats, skip {row['d_skip_frac']:.2f} / sorted {row['d_skip_frac_sorted']:.2f}"


def print_table(rows: list[dict], columns: list[tuple[str, str, str]], note: Callable[[dict], str] | None = None) -> None:
    """One line per row: ``columns`` is ``[(header, key, format)]``; a format with a type (``"8.2f"``)
    is a number, right-aligned (a missing key prints nan), one without (``"9"``) a left-aligned string;
    ``note(row)`` is appended to each line."""
    def numeric(fmt: str) -> bool:
        return fmt[-1:].isalpha()

    def width(fmt: str) -> str:
        return fmt.split(".")[0].rstrip("dfegs")

    print(" ".join(f"{h:>{width(f)}}" if numeric(f) else f"{h:{f}}" for h, _, f in columns))
    for r in rows:
        cells = " ".join(f"{r.get(k, float('nan')):{f}}" if numeric(f) else f"{r[k]:{f}}" for _, k, f in columns)
        print(cells + (note(r) if note else ""))


def fwd_bwd(loss: Callable[[], torch.Tensor], x: torch.Tensor, w: torch.Tensor) -> Callable[[], None]:
    """A step that clears the gradients of ``x`` and ``w`` and runs ``loss().backward()``."""
    def step() -> None:
        x.grad = w.grad = None
        loss().backward()

    return step


def failed(label: str, exc: BaseException) -> None:
    """The line an implementation that raised prints before the run goes on without its row."""
    print(f"{label} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


def max_over_ranks(val: float, device: str | torch.device = "cuda", group=None) -> float:
    """``val`` maxed over the ranks of ``group`` (the default group); ``val`` itself without one."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return val
    t = torch.tensor([val], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def chunk_plan(x: torch.Tensor, v: int, group=None, tp: int | None = None) -> int:
    """Token rows per chunk of flce's fused strategy for ``x`` and a vocabulary of ``v`` (the full one;
    ``group``: its TP group, whose ranks each plan with ceil(V / P) columns and 1/P of the budget;
    ``tp``: the plan of each rank of a group of that size, without one: ``core.fused_plan_for``) under
    the current settings, 0 where this tree has no ``core.fused_plan``: the chunks
    ``_timing.chunked_matmuls`` then issues as cuBLAS work alone."""
    try:
        from flce_dist import core
        from flce_dist.options import FLCEParams, LossOptions
        from flce_dist.settings import current
    except ImportError:
        return 0
    p = FLCEParams(0, v, LossOptions(), current())
    if tp is not None:
        return core.fused_plan_for(x.shape[0], x, p, tp, False)
    return core.fused_plan(x.shape[0], x, p, group, False)


# ---- the two timing modes (issue 53) ----

STEADY_CALLS = 4  # calls per steady sample, behind one untimed call (issue 53's table: 4)
IDLE_MS = 2.0  # the sleep after the sync before each single call


def add_timing_args(ap: argparse.ArgumentParser) -> None:
    """``--steady-calls K`` and ``--idle-ms`` (:class:`Timers`)."""
    ap.add_argument("--steady-calls", type=int, default=STEADY_CALLS,
                    help="steady mode: K back-to-back fwd+bwd calls per sample behind one untimed call (ms = total / K)")
    ap.add_argument("--idle-ms", type=float, default=IDLE_MS,
                    help="single mode: ms of sleep after the sync before each timed call (0: sync only)")


def check_timing_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.steady_calls < 1:
        ap.error(f"--steady-calls must be >= 1, got {args.steady_calls}")
    if not 0 <= args.idle_ms <= 1000:
        ap.error(f"--idle-ms must be in [0, 1000], got {args.idle_ms}")


class Timers:
    """The two timing modes of a benchmark row, on CUDA (events) or the CPU (``time.perf_counter``; tests).

    * :meth:`single`: ``warmup`` calls, then per sample a sync (``before`` first, e.g. a TP barrier), a
      sleep of ``idle_ms`` and ONE timed call: from an idle GPU, as an RL or evaluation loop that syncs
      every call, or the first micro-batch after an optimizer step, runs it. The host work before the
      call's first kernel is in the figure. Median of ``reps``.
    * :meth:`steady`: per sample one untimed call then ``steady_calls`` calls back to back with no
      sync between them, timed together and divided by their count: the host work of each call
      overlaps the GPU work before it (a training loop). Median of ``max(3, reps // 2)``.
    * :meth:`peak`: GiB allocated above the inputs during one call, gradients included (CUDA; nan on
      the CPU): ``_timing.peak_gib``.

    ``single - steady`` is the call's host prologue (what the GPU waits for when nothing is queued).
    Never time on zeros (the inputs are the data modes'); the callables set the grads to None first
    (``fwd_bwd``)."""

    def __init__(self, reps: int, steady_calls: int = STEADY_CALLS, idle_ms: float = IDLE_MS,
                 device: str | torch.device = "cuda", before: Callable[[], object] | None = None,
                 warmup: int = 3) -> None:
        self.reps, self.steady_calls, self.idle_s = reps, steady_calls, idle_ms / 1e3
        self.cuda = torch.device(device).type == "cuda"
        self.before, self.warmup = before, warmup

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _sample(self, fn: Callable[[], object], calls: int, lead: int) -> float:
        for _ in range(lead):
            fn()
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls):
                fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e3 / calls

    def _warm(self, fn: Callable[[], object]) -> None:
        for _ in range(self.warmup):
            fn()
        self._sync()

    def single(self, fn: Callable[[], object], reps: int | None = None) -> float:
        """Median ms of one call started on an idle GPU (a sync and ``idle_ms`` of sleep before it)."""
        self._warm(fn)
        ts = []
        for _ in range(reps or self.reps):
            if self.before is not None:
                self.before()
            self._sync()
            if self.idle_s:
                time.sleep(self.idle_s)
            ts.append(self._sample(fn, 1, 0))
        return statistics.median(ts)

    def steady(self, fn: Callable[[], object], reps: int | None = None) -> float:
        """Median ms per call of ``steady_calls`` back-to-back calls behind one untimed call."""
        self._warm(fn)
        ts = []
        for _ in range(reps or max(3, self.reps // 2)):
            if self.before is not None:
                self.before()
            self._sync()
            ts.append(self._sample(fn, self.steady_calls, 1))
        return statistics.median(ts)

    def peak(self, fn: Callable[[], object], *params: torch.Tensor) -> float:
        """GiB above the inputs during one call, gradients included (nan on the CPU)."""
        if not self.cuda:
            return float("nan")
        from flce_dist._timing import peak_gib

        return peak_gib(fn, *params)


def mode_cols(single: float, steady: float, floor_single: float, floor_steady: float) -> dict:
    """A row's timing-mode columns: ``single_ms``, ``steady_ms``, ``host_ms`` (single - steady: the host
    prologue), each mode against the three distinct matmuls timed in the same mode in the same run
    (``single_x3mm``, ``steady_x3mm``), and ``host_adj_ms``: ``host_ms`` less the matmuls' own single - steady.
    The matmuls have no host prologue, yet on the lent H100 their steady figure ran ~10% above their single one at
    N = 1024 (issue 53: 4.79 vs 4.32 ms; back-to-back work runs at lower clocks), so ``host_ms`` understates the
    prologue by about that much; ``host_adj_ms`` compares both modes at the same clocks."""
    return dict(single_ms=single, steady_ms=steady, host_ms=single - steady, single_x3mm=single / floor_single,
                steady_x3mm=steady / floor_steady, host_adj_ms=(single - steady) - (floor_single - floor_steady))


ROUND_MODES = ("steady", "single")
ROUND_SINGLE_REPS = 5  # single calls per entry per round (each from an idle GPU; median)


def interleaved_modes(fns: dict[str, Callable[[], object]], rounds: int, tm: Timers) -> dict[str, dict[str, list[float]]]:
    """``{mode: {name: [ms per round]}}`` for both timing modes (issue 53): ``rounds`` interleaved rounds
    (``_timing.interleaved_ms``: every entry once per round, the order rotated per round) of ``tm.steady``
    (3 samples) and then of ``tm.single`` (``ROUND_SINGLE_REPS`` calls from an idle GPU, median). A lead of a
    few % between two implementations is real only where the per-round ratios (``_timing.paired_ratios``)
    agree on it: the lent machines drift by several % between two single timings of one process."""
    from flce_dist._timing import interleaved_ms

    return {"steady": interleaved_ms(fns, rounds, timer=lambda fn: tm.steady(fn, 3)),
            "single": interleaved_ms(fns, rounds, timer=lambda fn: tm.single(fn, ROUND_SINGLE_REPS))}
