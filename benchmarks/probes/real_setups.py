"""Issue 34 on the GPU: the float32 dW accumulator's cost and precision, and a frozen head's time.

    python3 benchmarks/probes/real_setups.py [--out DIR]

bf16, llama3 (N=8192, H=4096, V=128256) and V=32000, random data (the cost is a memory-traffic
question, not a softmax-shape one). Rows, each in one process, same run:
  * exact fwd+bwd with ``dw_accumulate`` "auto" (float32 from 3 chunks) vs "native" (bf16), at the
    default chunk plan and at a 256 MiB chunk budget (many chunks): ms, peak GiB beyond inputs
    (gradients included), dW relative error vs the float64 reference of the same bf16 inputs.
  * frozen head (weight.requires_grad=False): ms vs two matmuls (x @ W.T, dz @ W) and vs full.
Prints a table last; writes CSV to --out.

``--dw-sweep``: instead, the dW error of the fused strategy per token-chunk count (1, 2, 3, 4, 5, 6,
8 chunks of N=8192 at llama3, forced by ``Settings(chunk_bytes=...)``) with bf16 ("native") and
float32 accumulation, on random and realistic data (``benchmarks/data.py``), as a ratio to the
one-chunk error of the same inputs (issue 34 item 1's bar: <= 1.2x at any chunk count).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import flce_dist  # noqa: E402
from flce_dist import Settings  # noqa: E402
from flce_dist._timing import cuda_steady_ms, peak_gib  # noqa: E402


def dw_ref(x, w, t):
    """float64 dW of the sum loss, by vocab chunks (no [N, V] float64 buffer)."""
    xd = x.double()
    lse = torch.empty(x.shape[0], dtype=torch.float64, device=x.device).fill_(-float("inf"))
    for j in range(0, w.shape[0], 8192):
        lse = torch.logaddexp(lse, torch.logsumexp(xd @ w[j:j + 8192].double().T, 1))
    out = torch.empty(w.shape, dtype=torch.float64, device=x.device)
    for j in range(0, w.shape[0], 8192):
        p = torch.exp(xd @ w[j:j + 8192].double().T - lse[:, None])
        m = (t >= j) & (t < j + 8192)
        p[m.nonzero()[:, 0], (t[m] - j)] -= 1
        out[j:j + 8192] = p.T @ xd
    return out


def dw_sweep(out: str, n: int = 8192, h: int = 4096, v: int = 128256) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import data  # noqa: E402  (benchmarks/data.py)
    from flce_dist.chunking import chunk_rows

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a small-shape check of the probe itself
    rows = []
    for mode in ("random", "realistic"):
        x, w, t = data.make_inputs(n, h, v, mode=mode, dtype=torch.bfloat16, device=dev, seed=0)
        w = w.detach().requires_grad_()
        ref = dw_ref(x, w.detach(), t)
        base = None
        for k in (1, 2, 3, 4, 5, 6, 8):
            budget = -(-(-(-n // k)) // 128) * 128 * v * 2
            got_rows = chunk_rows(n, v, 2, x.device, Settings(chunk_bytes=budget))
            chunks = -(-n // got_rows)
            for acc in ("native", "float32"):
                s = Settings(chunk_bytes=budget, dw_accumulate=acc)
                w.grad = None
                flce_dist.fused_linear_cross_entropy(x, w, t, reduction="sum", settings=s, strategy="fused").backward()
                err = ((w.grad.double() - ref).norm() / ref.norm()).item()
                if k == 1 and acc == "native":
                    base = err
                rows.append(dict(data=mode, chunks=chunks, acc=acc, dw_err=f"{err:.4e}", ratio=round(err / base, 3)))
                print(rows[-1], flush=True)
        del x, w, t, ref
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "dw_sweep.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    print(f"=== dW sweep summary (N={n} H={h} V={v} bf16, fused; ratio = error / one-chunk error)")
    print(f"{'data':10} {'chunks':>6} {'native':>8} {'float32':>8}")
    for i in range(0, len(rows), 2):
        print(f"{rows[i]['data']:10} {rows[i]['chunks']:>6} {rows[i]['ratio']:>8} {rows[i + 1]['ratio']:>8}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--dw-sweep", action="store_true", help="the dW error per chunk count (see the docstring)")
    ap.add_argument("--dw-shape", default="8192,4096,128256", help="--dw-sweep: N,H,V")
    a = ap.parse_args()
    if a.dw_sweep:
        return dw_sweep(a.out, *(int(s) for s in a.dw_shape.split(",")))
    rows = []
    for name, n, h, v in (("llama3", 8192, 4096, 128256), ("v32k", 4096, 4096, 32000)):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda", generator=g)
        xg = x.clone().requires_grad_()
        ref = dw_ref(x, w.detach(), t)
        for budget in ((None, 256 << 20) if v > 100000 else (None, 64 << 20)):
            for acc in ("auto", "native"):
                s = Settings(chunk_bytes=budget, dw_accumulate=acc)

                def step():
                    flce_dist.fused_linear_cross_entropy(xg, w, t, settings=s).backward()

                w.grad = xg.grad = None
                flce_dist.fused_linear_cross_entropy(x, w, t, reduction="sum", settings=s).backward()
                err = ((w.grad.double() - ref).norm() / ref.norm()).item()
                ms = cuda_steady_ms(step, reps=10)
                gib = peak_gib(step, w, xg)
                rows.append(dict(shape=name, case=f"exact budget={'default' if budget is None else str(budget >> 20) + 'MiB'} acc={acc}",
                                 ms=round(ms, 3), peak_gib=round(gib, 3), dw_err=f"{err:.3e}"))
                print(rows[-1], flush=True)
        wf = w.detach()
        dz = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g)
        y = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
        dx = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)

        def two():
            torch.mm(x, wf.T, out=y)
            torch.mm(dz, wf, out=dx)

        def frozen():
            flce_dist.fused_linear_cross_entropy(xg, wf, t).backward()

        t2, tf = cuda_steady_ms(two, reps=10), cuda_steady_ms(frozen, reps=10)
        rows.append(dict(shape=name, case="frozen head", ms=round(tf, 3), peak_gib="", dw_err="",
                         two_matmuls_ms=round(t2, 3), ratio=round(tf / t2, 3)))
        print(rows[-1], flush=True)
        del dz, y
    os.makedirs(a.out, exist_ok=True)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(a.out, "real_setups.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, keys)
        wr.writeheader()
        wr.writerows(rows)
    print(f"{'shape':8} {'case':40} {'ms':>8} {'peak':>7} {'dW err':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['shape']:8} {r['case']:40} {r['ms']:>8} {r['peak_gib']!s:>7} {r['dw_err']!s:>10} {r.get('ratio', '')!s:>6}")


if __name__ == "__main__":
    main()
