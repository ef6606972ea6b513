"""Two training runs' loss curves side by side (e.g. exact vs ``model.grad_filter_eps="auto"``).

    python benchmarks/compare_losses.py runs/a/losses.json runs/b/losses.json [--every 20] [--tail 50]

Prints the losses every ``--every`` steps, then the summary: the largest and the mean difference
over the last ``--tail`` steps against the run-to-run noise scale of the first run (the std of its
step-to-step loss changes over the same steps), and both runs' tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics


def summary(a: list[float], b: list[float], tail: int) -> dict:
    n = min(len(a), len(b))
    d = [y - x for x, y in zip(a[:n], b[:n])]
    t = d[-tail:]
    steps = [a[i + 1] - a[i] for i in range(max(0, n - tail), n - 1)]
    noise = statistics.pstdev(steps) if len(steps) > 1 else 0.0
    return dict(steps=n, max_abs_diff=max(abs(x) for x in d), tail_mean_diff=statistics.fmean(t),
                tail_max_abs_diff=max(abs(x) for x in t), noise=noise,
                final=(a[n - 1], b[n - 1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--tail", type=int, default=50)
    args = ap.parse_args()
    ra, rb = (json.load(open(p)) for p in (args.a, args.b))
    a, b = ra["losses"], rb["losses"]
    print(f"{'step':>5} {'A':>8} {'B':>8} {'B-A':>8}")
    for i in range(0, min(len(a), len(b)), args.every):
        print(f"{i + 1:5d} {a[i]:8.4f} {b[i]:8.4f} {b[i] - a[i]:+8.4f}")
    s = summary(a, b, args.tail)
    print(f"{s['steps']} steps: final A {s['final'][0]:.4f}  B {s['final'][1]:.4f}; max |B-A| {s['max_abs_diff']:.4f}; "
          f"last {args.tail}: mean B-A {s['tail_mean_diff']:+.4f}, max |B-A| {s['tail_max_abs_diff']:.4f}, "
          f"step-to-step noise of A {s['noise']:.4f}; tok/s A {ra.get('tokens_per_s_steady', 0):.0f} "
          f"B {rb.get('tokens_per_s_steady', 0):.0f}")


if __name__ == "__main__":
    main()
