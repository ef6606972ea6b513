"""GPU probe for the gradient filter (issue 15 item 3): how much a block mask can skip on realistic
logits, and how fast block-sparse Helion matmuls run per kept block, against cuBLAS in the same run.

    python benchmarks/probes/filter_probe.py [--shapes llama3,qwen3,gemma] [--rows 2816] [--reps 10] [--out DIR]

Part 1 (mask statistics, per shape, one chunk of ``--rows`` tokens of the realistic data mode):
fraction of (BN tokens x BV vocab) blocks of ``|dz|`` (per unit row weight) that hold an entry
>= 2^-12, for the vocabulary in id order and sorted by the mean logit ``W @ mean(x)`` (as CCE does),
with the target's ``-1`` (onehot) counted in the mask or handled apart (``noh``), and the fraction a
per-token-tile prefix cut-off covers (sorted, ``noh``: every block up to the last kept one), and the
L1 gradient mass per row that the skipped 128 x 64 blocks hold (``dropped_l1_*``).

Part 2 (timings at llama3, one chunk): cuBLAS ``dz @ W`` and ``dz.T @ x`` against the ``masked_mm``
kernel (an ``if keep`` around the K loop's dot) with a full mask, the realistic sorted mask of part 1
and a scattered mask of the same density, for a few block configs. Prints a table last.
(A prefix-bounded K loop was considered and dropped: on realistic data the last kept block of a
token tile sits at ~77% of the sorted vocabulary, so a prefix skips little.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import common  # noqa: E402,F401  (first: puts the repository's flce_dist on the path where none is)
import data as bench_data  # noqa: E402
from flce_dist._timing import SHAPES, cuda_time_ms  # noqa: E402

EPS = 2.0 ** -12


def block_any(hot: torch.Tensor, bn: int, bv: int) -> torch.Tensor:
    """[N, V] bool -> [ceil(N/bn), ceil(V/bv)] any."""
    n, v = hot.shape
    hot = torch.nn.functional.pad(hot, (0, -v % bv, 0, -n % bn))
    return hot.view(hot.shape[0] // bn, bn, -1, bv).any(3).any(1)


def prefix_of(keep: torch.Tensor) -> torch.Tensor:
    """per row of tiles: index of the last kept tile + 1 (0 if none)."""
    idx = torch.arange(1, keep.shape[1] + 1, device=keep.device)
    return (keep * idx).amax(1)


def mask_stats(shape: str, rows: int, device, keep_hot: dict) -> dict:
    h, v = SHAPES[shape]
    x, w, t = bench_data.make_inputs(rows, h, v, mode="realistic", device=device, seed=1)
    z = (x @ w.T).float()
    p = torch.softmax(z, 1)
    loss = (torch.logsumexp(z, 1) - z.gather(1, t[:, None])[:, 0]).mean().item()
    onehot = torch.zeros_like(p, dtype=torch.bool).scatter_(1, t[:, None], True)
    hot_oh = (p - onehot.float()).abs() >= EPS
    hot_noh = p >= EPS
    order = torch.argsort((w.float() @ x.float().mean(0)), descending=True)
    out = {"shape": shape, "loss": round(loss, 3), "hot_entries_noh": round(hot_noh.float().mean().item(), 5)}
    for bn, bv in ((128, 64), (128, 128), (128, 256), (64, 128)):
        for name, hot in (("oh", hot_oh), ("noh", hot_noh)):
            out[f"id_{name}_{bn}x{bv}"] = round(block_any(hot, bn, bv).float().mean().item(), 4)
            ks = block_any(hot[:, order], bn, bv)
            out[f"sorted_{name}_{bn}x{bv}"] = round(ks.float().mean().item(), 4)
            if name == "noh":
                out[f"prefix_noh_{bn}x{bv}"] = round((prefix_of(ks).float() / ks.shape[1]).mean().item(), 4)
    # what the filter drops: the L1 gradient mass per row (|softmax - onehot|) in the skipped blocks of
    # the shipped mask shape (128 x 64, sorted), against the row's total L1 mass
    bn, bv = 128, 64
    ks = block_any(hot_oh[:, order], bn, bv)
    kept = ks.repeat_interleave(bn, 0)[:rows].repeat_interleave(bv, 1)[:, :v]
    absd = (p - onehot.float()).abs()[:, order]
    dropped = (absd * ~kept).sum(1)
    out.update(dropped_l1_mean=round(dropped.mean().item(), 4), dropped_l1_median=round(dropped.median().item(), 4),
               dropped_l1_max=round(dropped.max().item(), 4), row_l1_mean=round(absd.sum(1).mean().item(), 4))
    del ks, kept, absd
    if shape == "llama3":
        keep_hot["sorted"] = hot_noh[:, order].contiguous()
    del z, p, onehot, hot_oh, hot_noh
    torch.cuda.empty_cache()
    return out


def timings(rows: int, reps: int, hot: torch.Tensor | None, device, cfgs: list) -> list[dict]:
    import helion

    from flce_dist.kernels.masked_mm import compact, expand_keep, masked_mm

    h, v = SHAPES["llama3"]
    g = torch.Generator(device=device).manual_seed(0)
    dz = (torch.randn(rows, v, device=device, generator=g) * 1e-3).bfloat16()
    w = (torch.randn(v, h, device=device, generator=g) * h**-0.5).bfloat16()
    x = torch.randn(rows, h, device=device, generator=g).bfloat16()
    out_x = torch.empty(rows, h, device=device, dtype=torch.bfloat16)
    out_w = torch.empty(v, h, device=device, dtype=torch.bfloat16)
    res = []
    mm_x = cuda_time_ms(lambda: torch.mm(dz, w, out=out_x), reps)
    mm_w = cuda_time_ms(lambda: torch.mm(dz.T, x, out=out_w), reps)
    res += [dict(op="dX", impl="cublas", mask="dense", kept=1.0, ms=mm_x, vs_cublas=1.0),
            dict(op="dW", impl="cublas", mask="dense", kept=1.0, ms=mm_w, vs_cublas=1.0)]
    for op, (bn, bv, bh), cfg in cfgs:
        tag = f"{bn}x{bv}x{bh} " + ",".join(f"{k}={v}" for k, v in cfg.items())
        nmt, nvt = -(-rows // bn), -(-v // bv)
        masks = {"full": torch.ones(nmt, nvt, dtype=torch.bool, device=device)}
        if hot is not None:
            masks["realistic"] = block_any(hot[:rows], bn, bv)
        for mname, keep in masks.items():
            kept = keep.float().mean().item()
            try:
                if op == "dX":
                    a, b, kk, out, bm, bk, base = dz, w, keep, out_x, bn, bv, mm_x
                else:
                    a, b, kk, out, bm, bk, base = dz.T, x, keep.T, out_w, bv, bn, mm_w
                args = (a, b, *compact(kk), out, False, bm, bk, bh)
                bound = masked_mm.bind(args)
                bound.set_config(helion.Config(**cfg))
                bound(*args)
                ref = torch.mm(torch.where(expand_keep(kk, *a.shape, bm, bk), a, 0).float(), b.float())
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ms = cuda_time_ms(lambda: bound(*args), reps)
                res.append(dict(op=op, impl="masked_mm " + tag, mask=mname, kept=round(kept, 3), ms=ms,
                                vs_cublas=ms / base, per_kept=ms / base / max(kept, 1e-6), err=err, cfg=cfg))
                del ref
            except Exception as e:  # noqa: BLE001
                print(f"FAILED masked_mm {op} {tag} {mname}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        print(f"done {op} {tag}", flush=True)
    return res


CFGS = [(op, blk, cfg) for op in ("dX", "dW") for blk, cfg in (  # run 15's third list (the first two: NOTES)
    ((128, 64, 256), dict(num_warps=8, num_stages=5)),
    ((128, 64, 256), dict(num_warps=8, num_stages=4, l2_groupings=[8])),
    ((128, 64, 256), dict(num_warps=8, num_stages=5, l2_groupings=[8])),
    ((128, 64, 128), dict(num_warps=8, num_stages=5)),
    ((128, 64, 128), dict(num_warps=8, num_stages=6)),
    ((64, 128, 256), dict(num_warps=8, num_stages=4)),
    ((64, 128, 128), dict(num_warps=8, num_stages=5)),
    ((128, 128, 256), dict(num_warps=8, num_stages=4)),
)]


# run 15's fourth list: the shipped dX entry (to pair with) and dW variants around the shipped one,
# persistent programs for dW's many short K loops (~3.5 kept token tiles per vocab tile per chunk)
CFGS_DW = [("dX", (128, 64, 256), dict(num_warps=8, num_stages=5))] + [("dW", (128, 64, 256), c) for c in (
    dict(num_warps=8, num_stages=4, l2_groupings=[8]),
    dict(num_warps=8, num_stages=4, l2_groupings=[8], pid_type="persistent_interleaved"),
    dict(num_warps=8, num_stages=4, pid_type="persistent_blocked"),
    dict(num_warps=8, num_stages=3, l2_groupings=[8], pid_type="persistent_interleaved"),
    dict(num_warps=8, num_stages=4, l2_groupings=[16]),
    dict(num_warps=8, num_stages=4, l2_groupings=[4]),
    dict(num_warps=4, num_stages=4, l2_groupings=[8]),
)]
CANDIDATES = {"all": CFGS, "dw": CFGS_DW}


def write_config(res: list[dict], path: str) -> None:
    """The mask block (block_n, block_v) with the least dX + dW time on the realistic mask, and for each
    op its fastest block_h and Helion config at that block, as the ``masked_mm`` (dX) and
    ``masked_mm_dw`` entries."""
    best: dict = {}
    for r in res:
        if r.get("mask") != "realistic" or not r["impl"].startswith("masked_mm"):
            continue
        blk, cfg = r["impl"].split(" ", 2)[1:]
        bn, bv, bh = (int(t) for t in blk.split("x"))
        key = (bn, bv, r["op"])
        if key not in best or r["ms"] < best[key][0]:
            best[key] = (r["ms"], bh, r["cfg"], r["vs_cublas"], r["kept"])
    pairs = {(bn, bv) for bn, bv, _ in best if (bn, bv, "dX") in best and (bn, bv, "dW") in best}
    if not pairs:
        return
    bn, bv = min(pairs, key=lambda k: best[(*k, "dX")][0] + best[(*k, "dW")][0])
    table = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
    for op, name in (("dX", "masked_mm"), ("dW", "masked_mm_dw")):
        ms, bh, cfg, ratio, kept = best[(bn, bv, op)]
        block = {"block_n": bn, "block_v": bv, "block_h": bh}
        table[name] = {"bf16": {"block": block, "config": cfg, "how": (
            f"filter_probe.py ({sum(1 for r in res if r['op'] == op and r.get('mask') == 'realistic')} candidates, realistic llama3 mask of {kept:.3f} kept blocks, "
            f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}): {op} {ms:.3f} ms = {ratio:.3f}x the dense "
            "cuBLAS matmul")}}
    Path(path).write_text(json.dumps(table, indent=2) + "\n")
    print(f"wrote masked_mm entries (mask blocks {bn}x{bv}) to {path}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama3,qwen3,gemma")
    ap.add_argument("--rows", type=int, default=2816)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skip-stats", action="store_true")
    ap.add_argument("--candidates", default="all", choices=list(CANDIDATES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--write-config", default=None, help="flce_dist/configs/helion/<arch>.json: store the fastest masked_mm "
                    "entries (one mask block shape for dX and dW, each op its own block_h and config)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    keep_hot: dict = {}
    stats = [] if a.skip_stats else [mask_stats(s, a.rows, dev, keep_hot) for s in a.shapes.split(",")]
    for s in stats:
        print(json.dumps(s), flush=True)
    res = timings(a.rows, a.reps, keep_hot.get("sorted"), dev, CANDIDATES[a.candidates])
    if a.write_config and any(r.get("mask") == "realistic" for r in res):
        write_config(res, a.write_config)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "filter_probe.json").write_text(json.dumps({"stats": stats, "timings": res}, indent=1))
    print(f"{'op':3} {'impl':70} {'mask':9} {'kept':>6} {'ms':>8} {'x cublas':>8} {'per kept':>8} {'rel err':>8}")
    for r in res:
        print(f"{r['op']:3} {r['impl'][:70]:70} {r['mask']:9} {r['kept']:6.3f} {r['ms']:8.3f} {r['vs_cublas']:8.3f} "
              f"{r.get('per_kept', 1.0):8.3f} {r.get('err', 0.0):8.1e}")


if __name__ == "__main__":
    main()
