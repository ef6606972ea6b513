"""A small search for the partial merge's config (``kernels/merge.py``) at the benchmark shapes.

    python3 benchmarks/probes/merge_probe.py [--out flce_dist/configs/helion/h200.json]

Why: run 19's event probe timed the first config (64 columns x 32 tiles per step) at 0.07 ms per
forward at llama3 (torch's ~12 kernels: 0.12) but 0.13 ms per chunk at gemma (torch: 0.08): a
gemma chunk has 1664 rows, i.e. 26 programs of 64 columns, each walking 1025 tiles. Times each
candidate (CUDA events, 20 calls back to back) on the partials of the fused strategy's chunks and
of the forward at llama3, qwen3 and gemma, checks it against ``merge_partials``, and writes the
candidate with the lowest total over the shapes to ``--out`` (entry ``merge`` / ``fp32``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

import torch

from flce_dist import tune
from flce_dist._timing import SHAPES, cuda_steady_ms
from flce_dist.chunking import chunk_rows
from flce_dist.kernels import launch
from flce_dist.kernels.lse_forward import merge_partials
from flce_dist.rowscale import row_bytes
from flce_dist.settings import Settings

CANDIDATES = [  # (block_n, block_t, num_warps, num_stages); the first is the shipped default
    (64, 32, 4, 2), (32, 64, 4, 2), (16, 128, 4, 2), (16, 64, 4, 3), (32, 128, 8, 2), (16, 256, 8, 2),
    (8, 256, 4, 2), (32, 32, 4, 3), (16, 128, 8, 3),
]


def cases(n: int) -> list[tuple[str, int, int]]:
    """(label, tiles, rows): the forward's partials over all N rows and one fused chunk's."""
    s, out = Settings(), []
    for name, (h, v) in SHAPES.items():
        fwd_bv = launch.entry("lse_forward", torch.device("cuda"), torch.bfloat16, "", h, s)["block"]["block_v"]
        st_bv = launch.entry("lse_forward", torch.device("cuda"), torch.bfloat16, "store", h, s)["block"]["block_v"]
        rows = chunk_rows(n, v, 2, torch.device("cuda"), s, row_extra_bytes=row_bytes(h, torch.bfloat16))
        out += [(f"{name} fwd", math.ceil(v / fwd_bv), n), (f"{name} chunk", math.ceil(v / st_bv), rows)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    totals = [0.0] * len(CANDIDATES)
    torch_total = 0.0
    lines = []
    for label, nt, n in cases(a.n):
        pmax = torch.randn(nt, n, device="cuda", generator=g) * 2
        psum = torch.rand(nt, n, device="cuda", generator=g) * 100 + 1
        ptgt = torch.zeros(nt, n, device="cuda")
        ptgt[torch.randint(0, nt, (n,), device="cuda", generator=g), torch.arange(n, device="cuda")] = 1.5
        dummy, dummy2 = pmax.new_zeros(1, n), pmax.new_zeros(1, n)  # distinct objects (kernels/row_prepare.py)
        want = merge_partials(pmax, psum, ptgt, dummy, dummy2, False, False)
        t_torch = cuda_steady_ms(lambda: merge_partials(pmax, psum, ptgt, dummy, dummy2, False, False), 10, 20)
        torch_total += t_torch
        row = [f"{label:13} T={nt:5} rows={n:5}  torch {t_torch * 1e3:7.1f} us"]
        for i, (bn, bt, nw, ns) in enumerate(CANDIDATES):
            out = torch.empty(n, 4, device="cuda")
            cand = {"block": {"block_n": bn, "block_t": bt}, "config": {"num_warps": nw, "num_stages": ns}}
            try:
                run = tune._run(launch._kernels()["merge"], (pmax, psum, ptgt, dummy, dummy2, out, False, False), cand,
                                launch.BLOCK_ORDER["merge"])
                run()
                err = (out - want).abs().max().item()
                ms = cuda_steady_ms(run, 10, 20) if err < 1e-3 else float("inf")
            except Exception as exc:  # noqa: BLE001 (a search: a failing candidate is reported and skipped)
                print(f"  candidate {cand} failed: {type(exc).__name__}: {str(exc)[:120]}")
                ms = float("inf")
            totals[i] += ms
            row.append(f"{ms * 1e3:7.1f}")
        lines.append(" ".join(row))
        print(lines[-1], flush=True)
    best = min(range(len(CANDIDATES)), key=lambda i: totals[i])
    print("\ncandidates (block_n, block_t, warps, stages):", "; ".join(f"{i}: {c}" for i, c in enumerate(CANDIDATES)))
    print("\n".join(lines))
    print(f"total over the shapes: torch {torch_total * 1e3:.1f} us; " +
          ", ".join(f"{i}: {t * 1e3:.1f}" for i, t in enumerate(totals)) + f"; best {best}: {CANDIDATES[best]}")
    if a.out:
        bn, bt, nw, ns = CANDIDATES[best]
        path = Path(a.out)
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        cfg.setdefault("merge", {})["fp32"] = {
            "block": {"block_n": bn, "block_t": bt}, "config": {"num_warps": nw, "num_stages": ns},
            "how": f"benchmarks/probes/merge_probe.py, best of {len(CANDIDATES)} candidates by the total over the forward's "
                   f"and one fused chunk's partials at llama3, qwen3, gemma (N={a.n}), "
                   f"{torch.cuda.get_device_name()}, {datetime.date.today()}: {totals[best] * 1e3:.0f} us "
                   f"(torch merge_partials {torch_total * 1e3:.0f} us, the first config {totals[0] * 1e3:.0f} us)"}
        path.write_text(json.dumps(cfg, indent=2) + "\n")
        print(f"wrote merge/fp32 to {path}")


if __name__ == "__main__":
    main()
