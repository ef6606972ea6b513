"""Before/after timing of the fused loss alone (a refactor must not slow it down).

    PYTHONPATH=<tree> python3 benchmarks/ab_flce.py --tag NAME [--shapes llama3,gemma] [--reps 20]
        [--grad-forms chunk_grad,rowscale] [--data random,realistic] [--fixture PATH]

Imports whichever ``flce_dist`` is first on ``PYTHONPATH`` (e.g. an exported older commit) and times,
at N=8192 bf16, per data mode (``--data``, default ``random,realistic``: ``random`` is this script's
0.02-scaled inputs of every A/B since run 13, the others benchmarks/data.py's), fwd+bwd of
``fused_linear_cross_entropy`` (steady state: back-to-back calls), its forward alone under
``torch.no_grad()`` and the bare cuBLAS matmul ``x @ W.T`` in the same process, then prints one line
per shape and data mode: ms, ratio to three matmuls (fwd+bwd) and to one (forward), and the ratio to the layer's three
distinct matmuls run back to back (``_timing.three_matmuls``: x @ W.T, dy @ W, dy.T @ x), with the
energy per call of both where NVML can be read (``_timing.energy_j``), and the ratio to the same three
matmuls as the loss's own token chunks issue them (``_timing.chunked_matmuls`` at ``core.fused_plan``'s
rows: what the 1 GiB chunk plan leaves to the Helion passes and small kernels), and the call's peak memory
beyond its returned gradients. ``FLCE_CHUNK_MB`` (``Settings.from_env``) sets another chunk budget. Run it
for both trees in one device call and compare the ratios (the matmul normalises machine drift).

``--fwd-rounds K`` (run 22) also times the forward against the bare matmul *interleaved*: K rounds of
(matmul, forward), each steady, and prints every round's ratio and their median. A single matmul
timing from the start of the case against a forward timed seconds later (the line above) moved the
forward ratio by up to 3% between processes on one machine (run 22: the bare matmul read 14.58 and
15.03 ms at gemma realistic), more than the 5% bar's margin. ``--fwd-only`` skips the fwd+bwd part.

``--shard P`` (run 22) times rank 0's share of a P-way tensor-parallel split on this one GPU: its
ceil(V / P) rows of W, the chunk rows each rank of a P-rank group plans, and the three distinct shard
matmuls as the floor, without the collectives (the TP floor adds the dX all-reduce to both sides). It
is an estimate for a machine without P GPUs, not a TP measurement (``bench_tp.py`` is that).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from typing import Iterator

import torch

import common  # noqa: E402  (first: a flce_dist tree on PYTHONPATH wins, else this repository's)
import data as bench_data  # noqa: E402
import flce_dist  # noqa: E402  (the first on PYTHONPATH: the tree under test)
from flce_dist._timing import SHAPES, cuda_steady_ms, cuda_time_ms, peak_gib  # noqa: E402

try:  # the three distinct matmuls and NVML energy (not in the _timing.py of trees before run 20)
    from flce_dist._timing import energy_j, three_matmuls  # noqa: E402
except ImportError:
    energy_j = three_matmuls = None
try:  # the chunk plan's cuBLAS work alone (run 21)
    from flce_dist._timing import chunked_matmuls  # noqa: E402
except ImportError:
    chunked_matmuls = None


def inputs(n: int, h: int, v: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, h] and w [v, h] (0.02-scaled) bf16 CUDA leaves that require grad, targets [n] int64."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    return x, w, torch.randint(0, v, (n,), device="cuda", generator=g)


def case_inputs(n: int, h: int, v: int, mode: str, sorted_vocab: bool = False,
                fixture: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``random``: :func:`inputs` (every A/B since run 13, bit for bit); the other modes from
    benchmarks/data.py (``realistic``: a trained-like long-tailed head; ``trained``: a fixture), as
    bf16 CUDA leaves that require grad."""
    if mode == "random":
        return inputs(n, h, v)
    x, w, t = bench_data.make_inputs(n, h, v, mode=mode, dtype=torch.bfloat16, device="cuda", seed=0,
                                     sorted_vocab=sorted_vocab, fixture=fixture or None)
    return x.requires_grad_(), w.requires_grad_(), t


def interleaved_forward(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, rounds: int,
                        reps: int) -> tuple[list[float], list[float]]:
    """``rounds`` pairs of steady timings, the bare matmul ``x @ W.T`` then the loss's forward under
    ``torch.no_grad()``, alternated so that both see the same clock and power state: ([ms], [ms])."""
    mms, fwds = [], []
    with torch.no_grad():
        for _ in range(rounds):
            mms.append(cuda_steady_ms(lambda: x.detach() @ w.detach().T, reps))
            fwds.append(cuda_steady_ms(lambda: flce_dist.fused_linear_cross_entropy(x, w, t), reps))
    return mms, fwds


def rank_shard(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, p: int) -> tuple[torch.Tensor, ...]:
    """Rank 0's work of a ``p``-way vocab split on this one GPU: ``(x, w_r, t_r, rows)`` with ``w_r``
    the first ceil(V / p) rows of the full head (so a realistic shard keeps its slice of the full
    distribution), targets folded into the shard (``t mod V_r``: where a target falls changes no
    kernel's work) and the token rows per chunk that each rank of a ``p``-rank group plans
    (``core.fused_plan_for``: 1/p of the single-GPU budget, ceil(V / p) columns). The collectives
    (stats all-gather, dX all-reduce) are not emulated."""
    v_r = -(-w.shape[0] // p)
    rows = common.chunk_plan(x, w.shape[0], tp=p)
    w_r = w.detach()[:v_r].clone().requires_grad_()
    return x, w_r, t % v_r, rows


def timed_cases(args) -> Iterator[tuple]:
    """``(shape, mode, h, v, x, w, t)`` per case of ``--shapes`` x ``--data``; with ``--shard P`` one
    rank's shard (:func:`rank_shard`), yielded *inside* ``settings.override(chunk_bytes=...)`` that
    gives the loss that rank's chunk rows (the case runs while this generator is suspended there)."""
    for shape, mode, h, v in common.cases(args, SHAPES):
        x, w, t = case_inputs(args.n, h, v, mode, args.sorted_vocab, args.fixture)
        if args.shard <= 1:
            yield shape, mode, h, v, x, w, t
            continue
        x, w, t, rows = rank_shard(x, w, t, args.shard)
        v_r = w.shape[0]
        with flce_dist.settings.override(chunk_bytes=rows * v_r * x.element_size()):
            got = common.chunk_plan(x, v_r)
            assert got == rows, f"the emulated rank plans {got} rows per chunk, a {args.shard}-rank group {rows}"
            yield f"{shape}/{args.shard}", mode, h, v_r, x, w, t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", required=True)
    common.add_case_args(ap, reps=20, out=False)
    ap.add_argument("--grad-forms", default="", help="e.g. chunk_grad,rowscale: each shape timed with each "
                    "Settings(grad_form=...) in turn, twice (A B A B), in this one process")
    ap.add_argument("--out", default="", help="also write ab_<tag>.csv there (one row per printed line)")
    ap.add_argument("--fwd-rounds", type=int, default=0, help="also time the forward and the bare matmul "
                    "interleaved, this many (matmul, forward) rounds, and print the median ratio")
    ap.add_argument("--shard", type=int, default=1, help="time rank 0's work of a P-way vocab split on this "
                    "GPU (its ceil(V/P) rows of W and the chunk rows each rank of P plans; no collectives)")
    ap.add_argument("--fwd-only", action="store_true", help="only the interleaved forward (needs --fwd-rounds)")
    args = ap.parse_args()
    common.check_case_args(ap, args, SHAPES)
    if args.fwd_only and args.fwd_rounds < 1:
        ap.error("--fwd-only needs --fwd-rounds >= 1")
    if args.shard < 1:
        ap.error(f"--shard must be >= 1, got {args.shard}")
    if args.fwd_rounds < 0:
        ap.error(f"--fwd-rounds must be >= 0, got {args.fwd_rounds}")
    forms = [f for f in args.grad_forms.split(",") if f]
    csv_rows: list[dict] = []
    fwd_rows: list[dict] = []  # --fwd-rounds: their own CSV (other columns)
    stem = args.tag.strip(".") or "old"
    print(f"[{args.tag}] flce_dist from {os.path.dirname(flce_dist.__file__)}")
    for shape, mode, h, v, x, w, t in timed_cases(args):
        name = f"{shape:7} {mode:9}"
        if args.fwd_rounds:
            mms, fwds = interleaved_forward(x, w, t, args.fwd_rounds, args.reps)
            ratios = [f / m for m, f in zip(mms, fwds)]
            print(f"[{args.tag}] {name} fwd interleaved: matmul {statistics.median(mms):6.2f} ms  fwd "
                  f"{statistics.median(fwds):6.2f} ms  median {statistics.median(ratios):.3f}x 1mm  rounds "
                  + " ".join(f"{r:.3f}" for r in ratios), flush=True)
            fwd_rows.append(dict(tag=args.tag, shape=shape, data=mode, mm_ms=statistics.median(mms),
                                 fwd_ms=statistics.median(fwds), ratio_1mm=statistics.median(ratios),
                                 ratio_min=min(ratios), ratio_max=max(ratios), rounds=len(ratios)))
            common.save(fwd_rows, f"ab_{stem}_fwd.csv", args)
            if args.fwd_only:
                continue

        mm = cuda_time_ms(lambda: x.detach() @ w.detach().T, args.reps)
        mm3, e3 = float("nan"), None
        if three_matmuls:
            floor3 = three_matmuls(x.detach(), w.detach())
            mm3, e3 = cuda_steady_ms(floor3, args.reps), energy_j(floor3)
            del floor3
        mmc, rows = float("nan"), common.chunk_plan(x, v) if chunked_matmuls else 0
        if rows:
            floorc = chunked_matmuls(x.detach(), w.detach(), rows)
            mmc = cuda_steady_ms(floorc, args.reps)
            del floorc
        torch.cuda.empty_cache()
        for form in forms * 2 or [None]:
            ctx = flce_dist.settings.override(grad_form=form) if form else contextlib.nullcontext()
            tag = f"{args.tag}:{form}" if form else args.tag
            with ctx:
                step = common.fwd_bwd(lambda: flce_dist.fused_linear_cross_entropy(x, w, t), x, w)
                ms = cuda_steady_ms(step, args.reps)
                ej = energy_j(step) if e3 else None
                grads = (x.numel() * x.element_size() + w.numel() * w.element_size()) / 2**30
                extra = peak_gib(step, x, w) - grads  # the peak beyond the returned gradients
                with torch.no_grad():
                    fwd = cuda_steady_ms(lambda: flce_dist.fused_linear_cross_entropy(x, w, t), args.reps)
            print(f"[{tag}] {name} flce {ms:7.2f} ms  matmul {mm:6.2f} ms  {ms / (3 * mm):.3f}x 3mm"
                  f"  fwd {fwd:6.2f} ms {fwd / mm:.3f}x 1mm  3 distinct {mm3:6.2f} ms {ms / mm3:.3f}x"
                  + (f"  chunked ({rows} rows) {mmc:6.2f} ms {mmc / mm3:.3f}x 3 distinct, flce {ms / mmc:.3f}x"
                     if rows else "") + f"  extra {extra:.2f} GiB"
                  + (f"  energy {ej[0]:.2f} J = {ej[0] / e3[0]:.3f}x the 3 distinct matmuls' ({ej[2]:.0f} vs {e3[2]:.0f} W)"
                     if ej else ""), flush=True)
            csv_rows.append(dict(tag=tag, shape=shape, data=mode, chunk_mb=os.environ.get("FLCE_CHUNK_MB", ""),
                                 flce_ms=ms, mm_ms=mm, ratio_3mm=ms / (3 * mm), fwd_ms=fwd, ratio_1mm=fwd / mm,
                                 dist3_ms=mm3, ratio_dist3=ms / mm3, plan_rows=rows, plan_ms=mmc,
                                 plan_vs_dist3=mmc / mm3, ratio_plan=ms / mmc, extra_gib=extra,
                                 energy_j=ej[0] if ej else float("nan"),
                                 energy_ratio=ej[0] / e3[0] if ej else float("nan")))
            common.save(csv_rows, f"ab_{stem}.csv", args)
        if "rowscale" in forms:  # how many chunks took the gated fallback (one extra call, spied)
            from flce_dist import rowscale

            real, gates = rowscale.prepare_, []

            def spy(*a, **k):
                c, gate = real(*a, **k)
                gates.append(gate)
                return c, gate

            rowscale.prepare_ = spy
            try:
                with flce_dist.settings.override(grad_form="rowscale"):
                    flce_dist.fused_linear_cross_entropy(x, w, t).backward()
            finally:
                rowscale.prepare_ = real
            print(f"[{args.tag}] {name} rowscale fallback chunks: {int(sum(g.item() for g in gates))} of {len(gates)}")
        del x, w, t
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
