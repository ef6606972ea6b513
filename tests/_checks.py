"""Shared by the multi-rank check scripts (tests/dist_checks.py, tests/dtensor_checks.py, run by
torchrun) and the pytest files that launch them: small Helion blocks, the relative error, a
collecting checker, the torchrun launcher with its summary parsing, and the rank exit / spawn
helpers (no interpreter teardown in a rank: issue #31's exit abort)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, NoReturn

import torch

ROOT = Path(__file__).resolve().parent.parent

# Small blocks so that reference mode runs several tiles in every tiled dimension.
SMALL_BLOCKS = {
    "lse_forward": {"block_n": 16, "block_v": 32, "block_h": 32},
    "chunk_stats": {"block_n": 8, "block_s": 64, "block_v": 32},
    "chunk_grad": {"block_n": 8, "block_v": 32},
    "masked_mm": {"block_n": 8, "block_v": 16, "block_h": 32},  # the gradient filter's blocks
    "scale": {"block": 64},
    "dz_gated": {"block_n": 16, "block_v": 32, "block_h": 32},  # the row-scale form's fallback
    "row_scale": {"block_n": 8, "block_h": 16},
    "merge": {"block_n": 8, "block_t": 2},  # the partial merge (kernels/merge.py)
    "row_prepare": {"block_n": 8},  # the row-scale form's per-row step
    "target_rows": {"block_n": 8},  # per-token bookkeeping (kernels/targets.py, kernels/token_loss.py)
    "token_rows": {"block_n": 8},
}


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


class Checker:
    """Collects failures instead of stopping at the first (each rank prints its summary line)."""

    def __init__(self, rank):
        self.rank, self.failures, self.count = rank, [], 0

    def close(self, name, got, ref, tol):
        self.count += 1
        if type(got).__name__ == "DTensor":
            self.failures.append(f"{name}: expected local values, got a DTensor")
            return
        if tuple(got.shape) != tuple(ref.shape):
            self.failures.append(f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
            return
        if not torch.isfinite(got).all():
            self.failures.append(f"{name}: non-finite values")
            return
        e = rel(got, ref) if ref.numel() and ref.abs().max() > 0 else (got.abs().max().item() if got.numel() else 0.0)
        if not e <= tol:
            self.failures.append(f"{name}: rel err {e:.3e} > {tol:.1e}")

    def true(self, name, cond):
        self.count += 1
        if not cond:
            self.failures.append(name)

    def raises(self, name, exc_type, words, fn):
        self.count += 1
        try:
            fn()
        except exc_type as exc:
            if not all(w in str(exc) for w in words):
                self.failures.append(f"{name}: message {str(exc)!r} lacks {words}")
            return
        except Exception as exc:  # noqa: BLE001
            self.failures.append(f"{name}: raised {type(exc).__name__}: {exc}")
            return
        self.failures.append(f"{name}: did not raise")

    def report(self):
        for f in self.failures:
            print(f"[rank {self.rank}] FAIL {f}", flush=True)
        print(f"[rank {self.rank}] {self.count - len(self.failures)} passed, {len(self.failures)} failed", flush=True)


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank process (a torchrun script's ``__main__``, an ``mp.spawn`` worker) without interpreter
    teardown, after its own ``destroy_process_group``. Groups that torch keeps alive past
    ``destroy_process_group`` (DTensor's sharding caches and meshes, a compiled graph's guards,
    DeepSpeed's objects) keep their gloo worker threads; one still releasing its last collective's
    tensors (a decref that takes the GIL) once ``Py_FinalizeEx`` has begun aborts the rank with
    "terminate called without an active exception" (``tests/test_exit.py``; flce_dist itself no longer
    pins the default group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawned(rank: int, fn: Callable, *args) -> None:
    fn(rank, *args)
    exit_rank(0)  # an exception above takes mp.spawn's usual path instead (reported; the test fails)


def spawn(fn: Callable, nprocs: int, *args) -> None:
    """``torch.multiprocessing.spawn`` of ``fn(rank, *args)`` on ``nprocs`` ranks, each ending through
    :func:`exit_rank` once ``fn`` returns."""
    import torch.multiprocessing as mp

    mp.start_processes(_spawned, args=(fn, *args), nprocs=nprocs, join=True, start_method="spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, world: int, *args: str, timeout: int = 600) -> tuple[int, str, list[tuple[str, str, str]]]:
    """Run ``tests/<script>`` on ``world`` gloo ranks (reference mode, one thread each): exit code,
    output (without torch's op-registration noise) and the ``[rank r] n passed, f failed`` lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "tests" / script), *args]
    env = {**os.environ, "HELION_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = "\n".join(line for line in (res.stdout + res.stderr).splitlines() if "registered at" not in line)
    return res.returncode, out, re.findall(r"\[rank (\d+)\] (\d+) passed, (\d+) failed", out)


def run_ranks(fn: Callable, world: int, tmp: str, timeout: float = 600.0) -> list:
    """Start ``fn(rank, world, tmp)`` on ``world`` processes and return each rank's
    ``torch.load(tmp/r<rank>.pt)`` (what ``fn`` saved). Forks where that is safe (no other Python
    thread, no CUDA): the ranks inherit this process's imports and warm caches (a spawned rank
    re-imports torch and the frameworks: ~6-10 s each on 2 cores); else spawns. Kills the ranks and
    fails the test after ``timeout`` seconds instead of hanging."""
    import threading
    import time

    import torch
    import torch.multiprocessing as mp

    fork = threading.active_count() == 1 and not torch.cuda.is_initialized()
    ctx = mp.start_processes(fn, args=(world, tmp), nprocs=world, join=False, start_method="fork" if fork else "spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            import pytest

            pytest.fail(f"the ranks did not finish within {timeout:.0f} s")
    return [torch.load(os.path.join(tmp, f"r{r}.pt")) for r in range(world)]
