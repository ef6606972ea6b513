"""The benchmark helpers that need no GPU: the TP scaling-efficiency arithmetic."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
scaling = pytest.importorskip("scaling")


def _write(path: Path, p: int, n: int, flce_ms: float, ar_ms: float) -> None:
    rows = [dict(shape="llama3", impl="floor", P=p, N=n, fwd_bwd_ms=1.0, ratio=1.0, mem_gib=0.0, mm_ms=0.3, allreduce_ms=ar_ms),
            dict(shape="llama3", impl="flce", P=p, N=n, fwd_bwd_ms=flce_ms, ratio=1.2, mem_gib=1.0 / p, mm_ms=0.3, allreduce_ms=ar_ms)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_scaling_efficiency(tmp_path):
    _write(tmp_path / "bench_tp1.csv", 1, 8192, 40.0, 0.0)
    _write(tmp_path / "bench_tp2.csv", 2, 8192, 22.0, 1.0)
    _write(tmp_path / "bench_tp8.csv", 8, 8192, 8.0, 1.5)
    _write(tmp_path / "bench_tp4_n32768.csv", 4, 32768, 30.0, 2.0)  # no P=1 at this N: skipped
    rows = scaling.efficiency(scaling.load([str(tmp_path)], "flce"))
    got = {(r["N"], r["P"]): r for r in rows}
    assert set(got) == {(8192, 1), (8192, 2), (8192, 8)}
    assert got[(8192, 1)]["efficiency"] == pytest.approx(1.0)
    assert got[(8192, 2)]["ideal_ms"] == pytest.approx(40.0 / 2 + 1.0)
    assert got[(8192, 2)]["efficiency"] == pytest.approx(21.0 / 22.0)
    assert got[(8192, 8)]["efficiency"] == pytest.approx((5.0 + 1.5) / 8.0)


def test_scaling_plot(tmp_path):
    pytest.importorskip("matplotlib")  # the .[bench] extra
    _write(tmp_path / "bench_tp1.csv", 1, 8192, 40.0, 0.0)
    _write(tmp_path / "bench_tp4.csv", 4, 8192, 11.0, 1.0)
    scaling.plot(scaling.efficiency(scaling.load([str(tmp_path)], "flce")), tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").stat().st_size > 0
