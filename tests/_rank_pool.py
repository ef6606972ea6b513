"""A pool of long-lived gloo ranks that run many multi-rank examples each (issue 61's property harness and
finding tests): starting ranks costs seconds (a spawn re-imports torch: ~4 s for 2 ranks; a fork ~1 s), one
example a few tens of milliseconds.

``RankPool(world)`` starts ``world`` processes (forked where that is safe, as ``_checks.run_ranks`` does; else
spawned), each in one gloo group (``file://`` rendezvous) whose collectives time out after ``gloo_timeout_s``.
``pool.run(fn, payload)`` runs ``fn(rank, world, group, payload)`` on every rank and returns one
:class:`Outcome` per rank, or a :class:`Broken` (a rank died: an abort, e.g. gloo's ``EnforceNotMet`` on a
collective mismatch; or no answer within the deadline: a hang) after which the pool restarts its ranks.
After each example every rank takes part in one more all-gather of its example count: ranks that left the
example with different numbers of collectives (which a later collective would pair wrongly) are reported as
``Broken`` too, never carried into the next example."""

from __future__ import annotations

import datetime
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class Outcome:
    """What one rank's ``fn`` did: ``value`` (its return value) or ``error`` (the exception's type name) and
    ``message``."""

    value: Any = None
    error: str | None = None
    message: str = ""


@dataclass
class Broken:
    """The example did not end on every rank: ``why`` (``"abort"``, ``"hang"``, ``"misaligned"``) and the
    answers that did come."""

    why: str
    detail: str
    outcomes: dict


def _worker(rank: int, world: int, store: str, inbox, outbox, gloo_timeout_s: float) -> None:
    import torch.distributed as dist

    import flce_dist

    torch.set_num_threads(1)
    flce_dist.setup_reference_mode()
    os.environ.setdefault("HELION_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=gloo_timeout_s))
    group = dist.group.WORLD
    count = 0
    while True:
        item = inbox.get()
        if item is None:
            break
        fn, payload = item
        try:
            out = Outcome(value=fn(rank, world, group, payload))
        except Exception as exc:  # noqa: BLE001  (the harness compares the ranks' exceptions)
            out = Outcome(error=type(exc).__name__, message=f"{exc}\n{traceback.format_exc()[-3000:]}")
        count += 1
        outbox.put(("out", rank, out))  # before the check below: an abort there keeps what this rank did
        try:  # every rank must leave the example after the same collectives
            seen = torch.empty(world, dtype=torch.int64)
            dist.all_gather_into_tensor(seen, torch.tensor([count]), group=group)
            aligned = bool((seen == count).all())
        except Exception:  # noqa: BLE001
            aligned = False
        outbox.put(("aligned", rank, aligned))
    dist.destroy_process_group()
    os._exit(0)


class RankPool:
    """``world`` long-lived gloo ranks (see the module docstring)."""

    def __init__(self, world: int, gloo_timeout_s: float = 15.0) -> None:
        self.world, self.gloo_timeout_s = world, gloo_timeout_s
        self.procs: list = []
        self.restarts = -1
        self._tmp: str | None = None

    def start(self) -> None:
        import torch.multiprocessing as mp

        self.close()
        fork = threading.active_count() == 1 and not torch.cuda.is_initialized()
        ctx = mp.get_context("fork" if fork else "spawn")
        self._tmp = tempfile.mkdtemp(prefix="flce_pool_")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.procs = [ctx.Process(target=_worker, args=(r, self.world, os.path.join(self._tmp, "store"),
                                                         self.inboxes[r], self.outbox, self.gloo_timeout_s),
                                  daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()
        self.restarts += 1

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        self.procs = []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def run(self, fn: Callable, payload: Any, deadline_s: float | None = None) -> list[Outcome] | Broken:
        """``fn(rank, world, group, payload)`` on every rank (``fn`` importable by name for spawned ranks)."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.start()
        deadline = time.monotonic() + (deadline_s or 4 * self.gloo_timeout_s + 120)
        for box in self.inboxes:
            box.put((fn, payload))
        got: dict[int, Outcome] = {}
        aligned: dict[int, bool] = {}
        while len(aligned) < self.world:
            try:
                what, rank, value = self.outbox.get(timeout=0.5)
                (got if what == "out" else aligned)[rank] = value
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in aligned]
            if dead or time.monotonic() > deadline:
                why = "abort" if dead else "hang"
                detail = (f"ranks {dead} died (exit codes {[self.procs[r].exitcode for r in dead]})" if dead
                          else f"no answer from ranks {sorted(set(range(self.world)) - set(aligned))} in time")
                self.close()
                return Broken(why, detail, got)
        outs = [got[r] for r in range(self.world)]
        if not all(aligned.values()):
            self.close()
            return Broken("misaligned", "the ranks left the example after different collectives",
                          dict(enumerate(outs)))
        return outs
