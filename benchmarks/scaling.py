"""Tensor-parallel scaling efficiency from ``bench_tp.py`` CSVs of several group sizes.

    python benchmarks/scaling.py DIR [DIR ...] [--impl flce] [--data random] [--out benchmarks/results]

Reads every ``bench_tp<P>[_n<N>][_<data modes>].csv`` under the given folders (P = 1, 2, 4, 8 from runs of
``torchrun --nproc_per_node=P benchmarks/bench_tp.py [--n N]``). For each shape, N and P:

    ideal(P)      = T(1) / P + allreduce(P)     T(1): the impl's time at P = 1 (same shape and N),
                                                allreduce(P): the [N, H] bf16 dX all-reduce timed in
                                                the P-rank run
    efficiency(P) = ideal(P) / T(P)             1.0 = ideal scaling; issue target at P = 8: >= 0.90

Writes ``scaling.csv`` and ``scaling.png`` (time and efficiency against P) and prints the table.
A (shape, N) without a P = 1 run is skipped with a note. Only rows of one data mode (``--data``,
default ``random``; CSVs from before data modes count as ``random``) are used.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict
from pathlib import Path

import common

_NAME = re.compile(r"bench_tp(\d+)(?:_n(\d+))?(?:_[a-z_]+)?\.csv$")  # optional _<data modes> suffix


def load(dirs: list[str], impl: str, data: str = "random") -> dict[tuple[str, int], dict[int, dict]]:
    """{(shape, N): {P: row}} for ``impl`` on data mode ``data``; the row carries the P-rank
    all-reduce time."""
    table: dict[tuple[str, int], dict[int, dict]] = defaultdict(dict)
    for d in dirs:
        for path in sorted(Path(d).glob("bench_tp*.csv")):
            m = _NAME.search(path.name)
            if not m:
                continue
            rows = [r for r in csv.DictReader(open(path)) if (r.get("data") or "random") == data]
            ar = {r["shape"]: float(r["allreduce_ms"]) for r in rows if r["impl"] == "floor" and r.get("allreduce_ms")}
            for r in rows:
                if r["impl"] != impl:
                    continue
                n = int(r.get("N") or m.group(2) or 8192)
                p = int(r["P"])
                if r["shape"] not in ar:
                    print(f"{path}: no all-reduce time for {r['shape']} (a CSV from before bench_tp.py recorded it)")
                    continue
                table[(r["shape"], n)][p] = dict(ms=float(r["fwd_bwd_ms"]), mem=float(r["mem_gib"]), ar=ar[r["shape"]])
    return table


def efficiency(table: dict[tuple[str, int], dict[int, dict]]) -> list[dict]:
    out = []
    for (shape, n), by_p in sorted(table.items()):
        if 1 not in by_p:
            print(f"{shape} N={n}: no P=1 run, skipped")
            continue
        t1 = by_p[1]["ms"]
        for p in sorted(by_p):
            r = by_p[p]
            ideal = t1 / p + (r["ar"] if p > 1 else 0.0)
            out.append(dict(shape=shape, N=n, P=p, ms=r["ms"], ideal_ms=ideal, efficiency=ideal / r["ms"],
                            mem_gib=r["mem"], allreduce_ms=r["ar"] if p > 1 else 0.0))
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key in sorted({(r["shape"], r["N"]) for r in rows}):
        rs = [r for r in rows if (r["shape"], r["N"]) == key]
        ps = [r["P"] for r in rs]
        line = ax_t.plot(ps, [r["ms"] for r in rs], marker="o", label=f"{key[0]} N={key[1]}")[0]
        ax_t.plot(ps, [r["ideal_ms"] for r in rs], ls="--", color=line.get_color())
        ax_e.plot(ps, [r["efficiency"] for r in rs], marker="o", color=line.get_color(), label=f"{key[0]} N={key[1]}")
    ax_t.set(xscale="log", yscale="log", xlabel="TP size P", ylabel="fwd+bwd ms (dashed: ideal)", title="time")
    ax_e.axhline(0.9, color="k", lw=0.8)
    ax_e.set(xscale="log", xlabel="TP size P", ylabel="ideal / measured", title="scaling efficiency", ylim=(0, 1.1))
    for ax in (ax_t, ax_e):
        ax.set_xticks(sorted({r["P"] for r in rows}), labels=[str(p) for p in sorted({r["P"] for r in rows})])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--impl", default="flce")
    ap.add_argument("--data", default="random", help="the data mode whose rows are used (bench_tp.py --data)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = efficiency(load(args.dirs, args.impl, args.data))
    if not rows:
        raise SystemExit("no (shape, N) with a P=1 run found")
    common.save(rows, "scaling.csv", args)
    png = Path(args.out or Path(__file__).resolve().parent / "results") / "scaling.png"
    plot(rows, png)
    print(f"\n{args.impl}: ideal = T(1)/P + dX all-reduce(P); efficiency = ideal / measured  (wrote {png})")
    print(f"{'shape':7} {'N':>6} {'P':>2} {'ms':>9} {'ideal ms':>9} {'eff':>5} {'GiB/rank':>9}")
    for r in rows:
        print(f"{r['shape']:7} {r['N']:6d} {r['P']:2d} {r['ms']:9.2f} {r['ideal_ms']:9.2f} {r['efficiency']:5.2f} {r['mem_gib']:9.2f}")


if __name__ == "__main__":
    main()
