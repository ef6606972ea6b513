"""Logging (rank 0 at INFO, through tqdm when the bar is shown), the losses file, and the
step timer/throughput bookkeeping."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

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


def write_losses(path: Path, losses: list[float], extra: dict) -> None:
    atomic_write(path, lambda p: p.write_text(json.dumps({**extra, "losses": losses}, indent=1)))
