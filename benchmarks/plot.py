"""Plot benchmark CSVs: time (ratio to the floor) and peak memory per implementation and shape.

    python benchmarks/plot.py benchmarks/results/run20/bench_bf16_86662b2.csv benchmarks/results/run12/bench_tp2.csv \
        --out benchmarks/results/summary.png [--data realistic]

CSVs with a ``data`` column (bench.py / bench_tp.py with data modes) get one row of panels per data
mode (``--data`` keeps only the listed modes); older CSVs count as ``random``.

    python benchmarks/plot.py --chunk-sweep benchmarks/results/run21/chunk_sweep_53377e1.csv \
        --out benchmarks/results/chunk_budget.png

plots instead a chunk-budget sweep (``ab_flce.py`` CSVs of several ``FLCE_CHUNK_MB``, e.g. ``device.sh
chunksweep``): per data mode, flce exact and the chunk plan's cuBLAS work (``_timing.chunked_matmuls``),
each relative to the three distinct matmuls, against the memory beyond the returned gradients.

    python benchmarks/plot.py --loss-curves runs/a/losses.json runs/b/losses.json --out curves.png

plots training loss curves (the launcher's ``losses.json``: its ``losses`` list), one line per
file named by its stem, on a log scale, with a second panel of each file's difference to the first
of its group (files named ``<group>_<variant>...``: e.g. ``losses1b_exact_s0`` vs ``losses1b_auto_s0``).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _load(path: Path, modes: list[str] | None = None) -> list[tuple[str, list[dict]]]:
    """[(title, rows)] per data mode in the CSV (in order of appearance), filtered to ``modes``."""
    rows = list(csv.DictReader(open(path)))
    tp = "P" in rows[0]
    title = f"TP={rows[0]['P']}" if tp else "TP=1"
    out = []
    for mode in dict.fromkeys(r.get("data") or "random" for r in rows):
        if modes and mode not in modes:
            continue
        out.append((f"{title} {mode}", [r for r in rows if (r.get("data") or "random") == mode]))
    return out


def plot_chunk_sweep(paths: list[str], out: str) -> None:
    """flce exact (solid) and its chunk plan's cuBLAS work (dashed), x the three distinct matmuls,
    against the GiB beyond the returned gradients: one panel per data mode, one colour per shape."""
    rows = [r for p in paths for r in csv.DictReader(open(p))]
    modes = list(dict.fromkeys(r["data"] for r in rows))
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for k, shape in enumerate(dict.fromkeys(r["shape"] for r in rows)):
            pts = sorted((float(r["extra_gib"]), float(r["ratio_dist3"]), float(r["plan_vs_dist3"]))
                         for r in rows if r["shape"] == shape and r["data"] == mode)
            if not pts:
                continue
            c = f"C{k}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=c, label=f"{shape}: flce exact")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", color=c, alpha=0.6,
                    label=f"{shape}: its chunks as cuBLAS alone")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("GiB beyond the returned gradients (dotted: the 1 GiB bar)")
        ax.set_ylabel("fwd+bwd time / the 3 distinct matmuls")
        ax.set_title(f"TP=1 {mode}: chunk budget against time")
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def plot_loss_curves(paths: list[str], out: str) -> None:
    """Loss per step of each ``losses.json`` (log y), and each file's difference to the file of the
    same seed suffix (``_s<k>``) that comes first: ``auto - exact`` per seed, next to the seed spread
    (the first file of each seed against the first file overall)."""
    import json

    loaded = {Path(p).stem: json.load(open(p)) for p in paths}
    curves = {k: v["losses"] if isinstance(v, dict) else v for k, v in loaded.items()}
    fig, (ax, ad) = plt.subplots(1, 2, figsize=(13, 4.2))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.legend(fontsize=7)
    first_of_seed: dict[str, str] = {}
    names = list(curves)
    for name in names:
        seed = name.rsplit("_", 1)[-1]
        base = first_of_seed.setdefault(seed, name)
        if base != name:
            d = [b - a for a, b in zip(curves[base], curves[name])]
            ad.plot(range(1, len(d) + 1), d, lw=1, label=f"{name} - {base}")
    bases = list(first_of_seed.values())
    for other in bases[1:]:
        d = [b - a for a, b in zip(curves[bases[0]], curves[other])]
        ad.plot(range(1, len(d) + 1), d, lw=1, ls=":", color="grey", label=f"seed spread: {other} - {bases[0]}")
    ad.axhline(0.0, color="k", lw=0.8)
    ad.set_xlabel("step")
    ad.set_ylabel("loss difference (nats)")
    ad.legend(fontsize=7)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--out", default="benchmarks/results/summary.png")
    ap.add_argument("--data", default="", help="comma list of data modes to plot (default: all in the CSVs)")
    ap.add_argument("--chunk-sweep", action="store_true", help="the CSVs are ab_flce.py chunk-budget sweeps")
    ap.add_argument("--loss-curves", action="store_true", help="the files are the launcher's losses.json")
    args = ap.parse_args()
    if args.loss_curves:
        plot_loss_curves(args.csv, args.out)
        return
    if args.chunk_sweep:
        plot_chunk_sweep(args.csv, args.out)
        return
    modes = [m for m in args.data.split(",") if m]
    sets = [s for p in args.csv for s in _load(Path(p), modes)]
    if not sets:
        raise SystemExit(f"no rows of data mode(s) {modes} in {args.csv}")
    fig, axes = plt.subplots(len(sets), 2, figsize=(13, 3.6 * len(sets)), squeeze=False)
    for (title, rows), (ax_t, ax_m) in zip(sets, axes):
        # the distinct-matmul floor where the CSV has it (run 20 on), else three of one matmul
        ratio_key = next(k for k in ("ratio3", "ratio", "ratio_fb3", "ratio_fb") if k in rows[0])
        distinct = ratio_key in ("ratio3", "ratio_fb3")
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        impls = [i for i in dict.fromkeys(r["impl"] for r in rows) if i not in ("matmul", "3mm", "floor")]
        width = 0.8 / max(1, len(impls))
        for k, impl in enumerate(impls):
            xs, ts, ms = [], [], []
            for j, s in enumerate(shapes):
                r = next((r for r in rows if r["shape"] == s and r["impl"] == impl), None)
                if r:
                    xs.append(j + k * width)
                    ts.append(float(r[ratio_key]))
                    ms.append(float(r["mem_gib"]))
            ax_t.bar(xs, ts, width, label=impl)
            ax_m.bar(xs, ms, width, label=impl)
        for ax in (ax_t, ax_m):
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
        ax_t.axhline(1.0, color="k", lw=0.8)
        ax_t.set_ylabel("fwd+bwd time / floor")
        floor = ("3 distinct " if distinct else "3 ") + ("matmuls" if title.startswith("TP=1 ") else
                                                          "shard matmuls + dX all-reduce")
        ax_t.set_title(f"{title}: time relative to {floor}")
        ax_m.set_ylabel("peak GiB (grads included)")
        ax_m.set_yscale("log")
        ax_m.set_title(f"{title}: peak memory per rank")
        ax_t.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
