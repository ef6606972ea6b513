"""Bounded config search for the Helion kernels (never a full autotune).

    python -m flce_dist.tune [--n 8192 --h 4096 --v 128256] [--dtype bf16] [--only lse_forward_store] [--shape-class] [--rounds 5] [--out FILE]

Times a short, hand-picked list of block sizes and ``helion.Config`` fields per kernel on
representative inputs (random, never zeros; warm-up, median of CUDA-event timings), prints each
candidate against the bare cuBLAS matmul of the same shape, and merges the winners into the
config file under the dtype class, with a ``how`` note recording the search.

Single timings on the lent machines move by several % from one to the next (run 31: the shipped store
entry read 1.11x and 0.99x its matmul in two lists of one process), so ``--rounds K`` settles each
search: the shipped entry and the ``FINALISTS - 1`` fastest others are timed again, steady, in K
interleaved rounds beside the matmul (``_timing.interleaved_ms``), and a candidate replaces the shipped
entry only where it is faster in every round (:func:`settle`).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
from pathlib import Path

import torch

from ._helion_compat import helion
from ._timing import DTYPES, cuda_steady_ms, cuda_time_ms, interleaved_ms, paired_ratios
from .kernels import launch as L
from .kernels.chunk_grad import chunk_grad_
from .kernels.chunk_stats import chunk_stats_partials
from .kernels.launch import STORE_EXP, STORE_LOGITS, STORE_NONE
from .kernels.lse_forward import lse_forward_partials

LSE_CANDIDATES = [
    dict(
        block=dict(block_n=bn, block_v=bv, block_h=bh),
        config=dict(num_warps=nw, num_stages=ns, indexing="tensor_descriptor", l2_groupings=[g]),
    )
    for (bn, bv, bh), nw, ns, g in itertools.product(
        [(256, 128, 64), (128, 256, 64), (128, 128, 64)], [8], [3, 4], [8, 16]
    )
]
# the fused strategy's variant (logits stored as well, on a token chunk): its own search, since the
# store epilogue changes the balance (run 9: 1.15x cuBLAS with the no-store winner, vs 1.07x without)
LSE_STORE_CANDIDATES = [
    dict(
        block=dict(block_n=bn, block_v=bv, block_h=64),
        config=dict(num_warps=8, num_stages=ns, indexing="tensor_descriptor", l2_groupings=[8], pid_type=pid),
    )
    for (bn, bv), ns, pid in itertools.product(
        [(128, 256), (256, 128), (128, 128)], [3, 4], ["flat", "persistent_interleaved"]
    )
]
# chunk_stats (split-vocab partials, two sweeps, run 16): 256-wide tiles keep a bf16 row tile inside
# one warp; a program's split (BN x BS elements) is read twice, so it should stay in L2; the splits
# also give a 2816-row chunk enough programs
STATS_CANDIDATES = [
    dict(block=dict(block_n=bn, block_s=bs, block_v=bv), config=dict(num_warps=nw, num_stages=2))
    for (bn, bv), bs, nw in itertools.product([(8, 256), (16, 256), (32, 256), (16, 512)], [2048, 4096, 8192], [4, 8])
] + [dict(block=dict(block_n=16, block_s=16384, block_v=256), config=dict(num_warps=8, num_stages=2))]
# run 17: persistent programs whose tile loop is flattened with the K loop (``range_flattens``, Triton's
# ``tl.range(flatten=True)``, as Triton's persistent TMA matmul tutorial does on Hopper), so that the
# software pipeliner can issue the next tile's first loads under this tile's softmax epilogue
# (helion 1.4 offers no warp specialisation below sm_100); the non-flattened twins are the control
PERSISTENT_CANDIDATES = [
    dict(
        block=dict(block_n=bn, block_v=bv, block_h=64),
        config=dict(
            num_warps=8,
            num_stages=ns,
            indexing="tensor_descriptor",
            l2_groupings=[8],
            pid_type="persistent_interleaved",
            range_flattens=[fl, None],
        ),
    )
    for (bn, bv), ns, fl in itertools.product([(128, 256), (256, 128)], [3, 4], [True, None])
]
# (not searched: ``epilogue_subtile=2``. Its generated code splits each row reduction of the tile into
# two vocab halves and stores the halves' partials at vocab offsets into the token-indexed partial
# buffers, i.e. wrong addresses: the illegal memory access that helion 1.5.1 showed, SPEC section 6)
GRAD_CANDIDATES = [
    dict(block=dict(block_n=bn, block_v=bv), config=dict(num_warps=nw, num_stages=2))
    for bn, bv, nw in [
        (8, 1024, 8),
        (16, 256, 4),
        (32, 256, 4),
        (32, 256, 8),
        (64, 256, 8),
        (16, 512, 4),
        (16, 512, 8),
        (8, 512, 4),
        (32, 512, 8),
        (64, 128, 4),
    ]
]


FINALISTS = 4  # --rounds: the shipped entry and the 3 fastest others by single timing


def settle(fns: dict, shipped: str, rounds: int, timer=None) -> tuple[str, dict]:
    """The winner of ``fns`` (label -> callable; ``shipped`` the shipped entry's label, ``"matmul"`` the
    reference matmul, never a winner) over ``rounds`` interleaved rounds: the candidate with the lowest
    median per-round time ratio to the shipped entry, if it is below 1 in every round, else ``shipped``.
    Returns ``(winner, {label: (median ms, median ratio to shipped, max ratio, median ratio to matmul)})``.
    ``timer``: ms of one callable (default steady timing, 3 samples of 5 calls)."""
    per = interleaved_ms(fns, rounds, timer or (lambda fn: cuda_steady_ms(fn, 3)))
    vs_shipped = paired_ratios(per, shipped)
    vs_mm = paired_ratios(per, "matmul") if "matmul" in per else {}
    stats = {
        k: (
            statistics.median(per[k]),
            *(vs_shipped[k][::2] if k != shipped else (1.0, 1.0)),
            vs_mm.get(k, (float("nan"),))[0],
        )
        for k in fns
        if k != "matmul"
    }
    others = [k for k in stats if k != shipped and stats[k][2] < 1.0]
    return (min(others, key=lambda k: stats[k][1]) if others else shipped), stats


def _time(fn, reps=20, warmup=3):
    return cuda_time_ms(fn, reps, warmup)


def _run(kernel, args, cand, order):
    """A call of ``kernel`` on ``args`` and ``cand``'s block sizes that runs ``cand``'s own compiled config (CUDA).
    Candidates with the same block sizes share one Helion BoundKernel, whose ``set_config`` would switch the calls
    of every earlier such candidate too: ``--rounds`` holds several at once, so each call keeps its compiled form."""
    full = (*args, *(cand["block"][k] for k in order))
    compiled = kernel.bind(full).compile_config(helion.Config(**cand["config"]))
    return lambda: compiled(*full)


# the storing pass of the gradient filter's gather order (Settings(filter_order="gather"), run 26): W's tiles come
# through an int32 index, so W takes pointer loads (no TMA): deeper pipelines, narrower vocab tiles and a wider K
# step are the levers a search for TMA loads never tried; the shipped "store" entry (falling back) is timed first
GATHER_STORE_CANDIDATES = [
    dict(
        block=dict(block_n=bn, block_v=bv, block_h=bh),
        config=dict(num_warps=nw, num_stages=ns, indexing="tensor_descriptor", l2_groupings=[8], pid_type=pid),
    )
    for (bn, bv, bh), nw, ns, pid in [
        ((128, 256, 64), 8, 4, "persistent_interleaved"),
        ((128, 128, 64), 8, 4, "flat"),
        ((128, 128, 64), 4, 4, "persistent_interleaved"),
        ((256, 128, 64), 8, 4, "flat"),
        ((128, 256, 32), 8, 5, "persistent_interleaved"),
        ((128, 128, 128), 8, 3, "flat"),
    ]
]

# --candidates: the logits kernels' lists (the chunk kernels always take their own)
CANDIDATE_SETS = {
    "default": (LSE_CANDIDATES, LSE_STORE_CANDIDATES),
    "persistent": (PERSISTENT_CANDIDATES,) * 2,
    "all": (LSE_CANDIDATES + PERSISTENT_CANDIDATES, LSE_STORE_CANDIDATES + PERSISTENT_CANDIDATES),
}


def specs(x, w, t, z, zs, lse, gw, mm, smm, zmm, candidates="default"):
    """(name, kernel, args without the block sizes, candidates, BLOCK_ORDER key, reference matmul) per
    searched kernel; the args match what kernels/launch.py passes (int32 local targets). ``mm``, ``smm``,
    ``zmm``: the cuBLAS matmuls a kernel is timed against (the whole ``x @ W.T``, the storing pass's chunk,
    the chunk kernels' chunk), passed through as given (``search``: callables, timed once each)."""
    rows, store_rows = z.shape[0], zs.shape[0]
    dummy = lse.new_zeros(1)  # the [1] ref of a pass that stores no exponentials
    perm = t.new_zeros(1)  # the [1] w_perm of a pass in the shard's own order
    # the filter's order: a random permutation of the rows (the kernel reads W[wperm[j]] for column j)
    wperm = torch.randperm(w.shape[0], device=w.device, generator=torch.Generator(device=w.device).manual_seed(1)).to(
        torch.int32
    )
    ref = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    lse_cands, store_cands = CANDIDATE_SETS[candidates]
    return [
        # (x, w, bias, target_local, z_out, ref, w_perm, scale, softcap, has_bias, store, with_sum, with_ent,
        # with_tgt, permute_w): as launch.lse_forward on sm_90 (target logits from target_dot); the store pass as the
        # row-scale gradient runs it (exponentials, rowscale.py)
        (
            "lse_forward",
            lse_forward_partials,
            (
                x,
                w,
                w.new_zeros(1),
                t,
                x.new_empty(1, 1),
                dummy,
                perm,
                1.0,
                0.0,
                False,
                STORE_NONE,
                False,
                False,
                False,
                False,
            ),
            lse_cands,
            "lse_forward",
            mm,
        ),
        (
            "lse_forward_store",
            lse_forward_partials,
            (
                x[:store_rows],
                w,
                w.new_zeros(1),
                t[:store_rows],
                zs,
                ref[:store_rows],
                perm,
                1.0,
                0.0,
                False,
                STORE_EXP,
                False,
                False,
                False,
                False,
            ),
            store_cands,
            "lse_forward",
            smm,
        ),
        (
            "lse_forward_store_gather",
            lse_forward_partials,
            (
                x[:store_rows],
                w,
                w.new_zeros(1),
                t[:store_rows],
                zs,
                dummy,
                wperm,
                1.0,
                0.0,
                False,
                STORE_LOGITS,
                False,
                False,
                False,
                True,
            ),
            GATHER_STORE_CANDIDATES,
            "lse_forward",
            smm,
        ),
        ("chunk_stats", chunk_stats_partials, (z, 1.0, 0.0, False, False), STATS_CANDIDATES, "chunk_stats", zmm),
        (
            "chunk_grad",
            chunk_grad_,
            (z.clone(), t[:rows], lse, gw, gw[:1], gw[:1], 1.0, 0.0, 1.0, 0.0, 0.0, False, False),
            GRAD_CANDIDATES,
            "chunk_grad",
            zmm,
        ),
    ]


def current_entry(name: str, device: torch.device, dtype: torch.dtype, h: int) -> dict:
    """The entry a launch at hidden size ``h`` would use now for the searched kernel ``name`` (block
    and config only), so that every search times the shipped config in the same run as its candidates."""
    kernel, variant = {
        "lse_forward_store": ("lse_forward", "store"),
        "lse_forward_store_gather": ("lse_forward", "store_gather"),
    }.get(name, (name, ""))
    e = L.entry(kernel, device, dtype, variant, h=h if kernel == "lse_forward" else None)
    return {"block": {k: e["block"][k] for k in L.BLOCK_ORDER[kernel]}, "config": dict(e["config"])}


def search(n, h, v, dtype, rows=2816, store_rows=2816, only=(), candidates="default", rounds=0):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, h, device=dev, dtype=dtype, generator=g)
    w = torch.randn(v, h, device=dev, dtype=dtype, generator=g) * h**-0.5
    t = torch.randint(0, v, (n,), device=dev, generator=g).to(torch.int32)  # as launch passes local targets
    z = x[:rows] @ w.T
    lse = torch.logsumexp(z.float(), 1)
    gw = torch.rand(rows, device=dev)
    zs = torch.empty(store_rows, v, device=dev, dtype=dtype)  # the fused strategy's chunk
    # each kernel's cuBLAS matmul: timed once here for the ratios, and again beside it in --rounds
    mm, zmm, smm = (lambda: x @ w.T), (lambda: x[:rows] @ w.T), (lambda: x[:store_rows] @ w.T)
    ref_ms = {f: _time(f) for f in (mm, zmm, smm)}
    print(
        f"cuBLAS x@W.T {ref_ms[mm]:.3f} ms;  chunk [{rows}, {v}] matmul {ref_ms[zmm]:.3f} ms;  "
        f"[{store_rows}, {v}] {ref_ms[smm]:.3f} ms"
    )
    best, how = {}, {}
    for name, kern, args, cands, kind, ref_fn in specs(x, w, t, z, zs, lse, gw, mm, smm, zmm, candidates):
        ref = ref_ms[ref_fn]
        if only and name not in only:
            continue
        order = L.BLOCK_ORDER[kind]
        shipped = current_entry(name, dev, dtype, h)
        cands = [shipped] + [c for c in cands if c != shipped]  # the shipped entry first, same run
        results = []
        for c in cands:
            try:
                ms = _time(_run(kern, args, c, order))
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {c} failed: {type(e).__name__}: {str(e)[:160]}")
                continue
            results.append((ms, c))
            moved = (
                {"chunk_stats": 1, "chunk_grad": 2}.get(name, 0) * z.numel() * z.element_size()
            )  # bytes read + written
            bw = f"  {moved / ms / 1e9:5.2f} TB/s" if moved else ""
            print(f"  {name:12} {ms:8.3f} ms  x{ms / ref:5.2f} of its matmul{bw}  {c}")
        if not results:
            print(f"  {name}: every candidate failed; its entry is left as it is")
            continue
        ms, c = min(results, key=lambda r: r[0])
        x_ref, note = ms / ref, ""
        if rounds and any(r[1] == shipped for r in results):
            fin = [shipped] + [r[1] for r in sorted(results, key=lambda r: r[0]) if r[1] != shipped][: FINALISTS - 1]
            labels = {f"c{i}": f for i, f in enumerate(fin)}  # c0: the shipped entry
            win, stats = settle(
                {"matmul": ref_fn, **{k: _run(kern, args, f, order) for k, f in labels.items()}}, "c0", rounds
            )
            for k, f in labels.items():
                med, r_med, r_max, r_mm = stats[k]
                print(
                    f"  {name:12} rounds: {med:8.3f} ms  x{r_mm:5.3f} of its matmul  x{r_med:5.3f} shipped "
                    f"(max {r_max:5.3f}){'  (shipped)' if k == 'c0' else ''}{'  <- winner' if k == win else ''}  {f}"
                )
            c, (ms, _, _, x_ref) = labels[win], stats[win]
            note = (
                f" (median of {rounds} interleaved rounds of the shipped entry, the {len(fin) - 1} fastest others and "
                f"the matmul: {'kept the shipped entry' if win == 'c0' else f'{stats[win][1]:.3f}x the shipped entry, max {stats[win][2]:.3f}'})"
            )
        best[name] = c
        how[name] = (
            f"bounded search of {len(cands)} candidates, N={n} H={h} V={v} {dtype}, rows={args[0].shape[0]}, "
            f"{torch.cuda.get_device_name()}, {datetime.date.today()}: {ms:.3f} ms = {x_ref:.2f}x its cuBLAS matmul{note}"
        )
    return best, how


def default_out(arch: str = "h200") -> Path:
    """Where a search writes by default: the base file under helion 1.4 (which its entries were tuned
    under), else the running series' overlay (``launch.config_files``)."""
    series = L.helion_series()
    name = f"{arch}.json" if series in (None, "1.4") else f"{arch}@helion{series}.json"
    return L.DEFAULT_CONFIG_DIR / name


def main():
    ap = argparse.ArgumentParser(
        prog="python -m flce_dist.tune",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0].rstrip(".") + ": times a dozen hand-picked block sizes / helion.Config "
        "fields per kernel against the cuBLAS matmul (CUDA only) and merges the winners into a config file.",
        epilog="example: python -m flce_dist.tune --h 2304 --v 262208 --shape-class --only lse_forward",
    )
    ap.add_argument("--n", type=int, default=8192, help="tokens (default 8192)")
    ap.add_argument("--h", type=int, default=4096, help="hidden size (default 4096)")
    ap.add_argument("--v", type=int, default=128256, help="vocabulary rows (default 128256)")
    ap.add_argument(
        "--rows",
        type=int,
        default=2816,
        help="token rows of the chunk the chunk kernels and the storing pass run on (default 2816: the "
        "fused strategy's chunk at llama3)",
    )
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="input dtype class (default bf16)")
    ap.add_argument(
        "--out",
        default=str(default_out()),
        help="config file to merge into (default: h200.json under helion 1.4, the series' overlay "
        "h200@helion<series>.json under any other helion: the base entries stay 1.4's)",
    )
    ap.add_argument(
        "--shape-class",
        action="store_true",
        help="store the winners under '<dtype>@h<H>' (used for this hidden size only) instead of '<dtype>'",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated kernel entries to search (default: all); the others keep their entries",
    )
    ap.add_argument(
        "--candidates",
        default="default",
        choices=list(CANDIDATE_SETS),
        help="the logits kernels' candidate list (default: block sizes and stages; persistent: persistent "
        "programs with the tile loop flattened into the K loop; all: both lists); the shipped entry is always timed first",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="settle each search in this many interleaved rounds of the shipped entry and the fastest others "
        "(a candidate wins only if faster in every round; default 0: the fastest single timing wins)",
    )
    args = ap.parse_args()
    if args.rounds < 0:
        ap.error(f"--rounds must be >= 0, got {args.rounds}")
    dt = DTYPES[args.dtype]
    best, how = search(
        args.n,
        args.h,
        args.v,
        dt,
        rows=args.rows,
        store_rows=args.rows,
        only=tuple(filter(None, args.only.split(","))),
        candidates=args.candidates,
        rounds=args.rounds,
    )
    path = Path(args.out)
    table = json.loads(path.read_text()) if path.is_file() else {}
    key = f"{args.dtype}@h{args.h}" if args.shape_class else args.dtype
    for name, c in best.items():
        table.setdefault(name, {})[key] = {**c, "how": how[name]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
