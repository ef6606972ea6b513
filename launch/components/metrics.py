"""Logging (rank 0 at INFO, through tqdm when the bar is shown), the losses file, and the
step timer/throughput bookkeeping."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

from .data import atomic_write

log = logging.getLogger("flce_dist.train")


class _TqdmHandler(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001
            self.handleError(record)


def setup_logging(rank: int) -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)


class PendingSteps:
    """Per-step loss and gradient norm kept on the device and read back in one host sync at a log
    step, a checkpoint and the end (torchtitan reads its metrics at log steps only), so a step's
    host work overlaps the previous steps' kernels instead of waiting for them twice per step.
    ``flush`` appends the values to ``losses`` and raises ``FloatingPointError`` naming the first
    step whose loss is not finite (before a checkpoint could save what followed it)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.values: list[torch.Tensor] = []

    def add(self, step: int, loss: torch.Tensor, gnorm: torch.Tensor) -> None:
        self.steps.append(step)
        self.values.append(torch.stack([loss.detach().float().reshape(()), gnorm.detach().float().reshape(())]))

    def flush(self, losses: list[float]) -> tuple[float, float] | None:
        """(last loss, last grad norm) of the pending steps, now appended to ``losses``; None if none."""
        if not self.steps:
            return None
        vals = torch.stack(self.values).cpu().tolist()  # the one sync
        steps, self.steps, self.values = self.steps, [], []
        for step, (value, _) in zip(steps, vals):
            if not math.isfinite(value):
                raise FloatingPointError(f"loss is {value} at step {step}")
            losses.append(value)
        return vals[-1][0], vals[-1][1]


def write_losses(path: Path, losses: list[float], extra: dict) -> None:
    atomic_write(path, lambda p: p.write_text(json.dumps({**extra, "losses": losses}, indent=1)))


def _dev_time(e) -> float:
    return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)


@contextlib.contextmanager
def profile_step(on: bool, out_dir: Path, rank: int, step: int, cuda: bool):
    """``job.profile_step``: ``torch.profiler`` over one whole training step (CPU + CUDA activities),
    the tables written to ``<out_dir>/profile_step<S>_rank<r>.txt``, and one log line on rank 0:
    wall time, GPU busy time (sum of kernels' self device time), host time of the head
    (``record_function("head.<kind>")`` in ``model.py``). Off (a no-op) on every other step."""
    if not on:
        yield
        return
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    ka = prof.key_averages()
    busy = sum(_dev_time(e) for e in ka) / 1e3
    heads = {e.key: (e.cpu_time_total / 1e3, getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)) / 1e3)
             for e in ka if e.key.startswith("head.")}
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    text = (f"step {step}: wall {wall:.1f} ms, GPU kernels busy {busy:.1f} ms, head (host ms, device ms) {heads}\n\n"
            f"by self device time:\n{ka.table(sort_by=sort, row_limit=40)}\n\n"
            f"by self CPU time:\n{ka.table(sort_by='self_cpu_time_total', row_limit=40)}\n")
    path = Path(out_dir) / f"profile_step{step}_rank{rank}.txt"
    atomic_write(path, lambda p: p.write_text(text))
    log.info("profile of step %d: wall %.1f ms, GPU kernels busy %.1f ms, head (host ms, device ms) %s -> %s",
             step, wall, busy, {k: (round(a, 1), round(b, 1)) for k, (a, b) in heads.items()}, path)
