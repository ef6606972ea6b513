"""Issue 52 (part B, finding 3): the cost of the per-call cross-rank guard (flce_dist/distributed/guard.py),
before (every word: the behaviour before issue 52, now ``check_inputs=True``) and after (the default).

    python benchmarks/probes/guard_cost.py [--ns 1024,2048,4096,8192] [--h 4096] [--v 128256]
        [--ranks 2,8] [--backend nccl|gloo] [--reps 50] [--out DIR]
    python benchmarks/probes/guard_cost.py --smoke        # CPU, tiny shapes (what tests/test_benchmarks.py runs)

One process. Two measurements per N (llama3's head by default: H=4096, V=128256, bf16 on CUDA):

  guard   the guard's own work on one rank, isolated with the library's own code (``core._Guard``:
          building the words, ``collectives.pack_stats`` / ``merge_stats`` around the one statistics
          all-gather, the verdict and the per-chunk poison add), the all-gather itself replaced by
          P copies of this rank's payload (every rank agrees; the verdict's work does not depend on
          the data), minus the same with no guard. Per setting: dispatched torch ops, CUDA kernels
          (torch.profiler) and host microseconds per call (median; the GPU idle before each call,
          no sync inside). P = ``--ranks``.
  call    a whole forward + backward of ``fused_linear_cross_entropy`` (mean loss, the default
          strategy) at TP=1 (no group) and with a 1-rank ``--backend`` group (a group of one rank
          builds no guard: the group path's own cost), each with ``check_inputs`` off and on:
          kernels and host microseconds per call.

Prints a short table last. ``--smoke`` runs the same code on the CPU (Helion reference mode) at
N=16,32, H=64, V=257, float32, one rep; kernels are then not counted (no CUDA).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an A/B tree there wins
import flce_dist  # noqa: E402
from flce_dist import core  # noqa: E402
from flce_dist.distributed.collectives import merge_stats, pack_stats  # noqa: E402
from flce_dist.options import FLCEParams, LossOptions  # noqa: E402

SETTINGS = {"before (check_inputs=True)": True, "after (default)": False,
            "default + weights, count": "values"}  # issue 61: word 7 (loss_weights and num_items_in_batch)


class _OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def ops_per_call(fn) -> int:
    with _OpCount() as c:
        fn()
    return c.n


def kernels_per_call(fn, dev: torch.device) -> int | None:
    if dev.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def host_us(fn, dev: torch.device, reps: int) -> float:
    fn()  # warm
    ts = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    _sync(dev)
    return statistics.median(ts)


class _Values:
    """What the guard reads of a call's per-token work for word 7 (``core._Tokens``): token weights and a count."""

    def __init__(self, n: int, dev: torch.device) -> None:
        self.tw, self.num_items = torch.rand(n, device=dev), torch.tensor(1000.0, device=dev)

    def token_weights(self) -> torch.Tensor:
        return self.tw


def guard_round(x, tgt, bad, local, v: int, p_ranks: int, check_inputs: bool | str | None):
    """One call's guard work on this rank, as the core runs it (None: the same without a guard; ``"values"``: the
    default with ``loss_weights`` and ``num_items_in_batch`` given, word 7)."""
    opts = LossOptions(check_inputs=check_inputs is True)
    params = FLCEParams(0, v, opts, flce_dist.settings.current())
    values = _Values(x.shape[0], x.device) if check_inputs == "values" else None
    g = core._Guard(x, tgt, bad, params, None, local.shape[0], False, (True, True, True), values)

    def run():
        words = g.words() if check_inputs is not None else None
        g.ok = None
        payload = pack_stats(local, words)
        out = payload.unsqueeze(0).expand(p_ranks, *payload.shape)  # the all-gather: P equal payloads
        st, guards = merge_stats(out, local.shape[0], words)
        return g.settle(st, guards)
    return run


def measure_guard(n: int, h: int, v: int, dtype, dev, p_ranks: int, reps: int) -> list[dict]:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dev, dtype)
    tgt = torch.randint(0, v, (n,), generator=g).to(dev)
    bad = torch.zeros(n, dtype=torch.bool, device=dev)
    rows = min(n, 2048)  # the first chunk's statistics (the fused strategy's chunk rows at llama3)
    local = torch.randn(rows, 4, generator=g).to(dev)
    base = guard_round(x, tgt, bad, local, v, p_ranks, None)
    b_us, b_ops, b_k = host_us(base, dev, reps), ops_per_call(base), kernels_per_call(base, dev)  # warm first
    out = []
    for name, ci in SETTINGS.items():
        fn = guard_round(x, tgt, bad, local, v, p_ranks, ci)
        us = host_us(fn, dev, reps)  # warm: the cached device words exist before anything is counted
        k = kernels_per_call(fn, dev)
        out.append(dict(what="guard", setting=name, N=n, P=p_ranks, ops=ops_per_call(fn) - b_ops,
                        kernels=None if k is None else k - b_k, host_us=us - b_us))
    return out


def measure_calls(n: int, w: torch.Tensor, group, reps: int) -> list[dict]:
    v, h = w.shape
    dev = w.device
    g = torch.Generator(device=dev).manual_seed(n)
    x = torch.randn(n, h, generator=g, device=dev).to(w.dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g, device=dev)
    out = []
    for where, grp in (("TP=1", None), ("1-rank group", group)):
        for name, ci in SETTINGS.items():
            if ci == "values":
                continue

            def fn(grp=grp, ci=ci):
                kw = {} if grp is None else {"group": grp, "vocab_size": v}
                flce_dist.fused_linear_cross_entropy(x, w, t, check_inputs=ci, **kw).backward()
                x.grad = w.grad = None
            us = host_us(fn, dev, reps)
            out.append(dict(what=f"call {where}", setting=name, N=n, P=1, ops=None,
                            kernels=kernels_per_call(fn, dev), host_us=us))
    return out


def table(rows: list[dict]) -> str:
    head = f"{'what':<18} {'setting':<27} {'N':>6} {'P':>3} {'ops':>5} {'kernels':>8} {'host us':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['what']:<18} {r['setting']:<27} {r['N']:>6} {r['P']:>3} "
                     f"{'' if r['ops'] is None else r['ops']:>5} {'' if r['kernels'] is None else r['kernels']:>8} "
                     f"{r['host_us']:>9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", default="1024,2048,4096,8192")
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--ranks", default="2,8", help="P emulated for the guard's verdict")
    ap.add_argument("--backend", default=None, help="the 1-rank group's backend (default: nccl on CUDA, else gloo)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, one rep")
    ap.add_argument("--out", default=None, help="also write guard_cost.csv into this directory")
    args = ap.parse_args(argv)
    if args.smoke:
        dev, dtype, ns, h, v, reps = torch.device("cpu"), torch.float32, [16, 32], 64, 257, 1
        flce_dist.setup_reference_mode()
    else:
        if not torch.cuda.is_available():
            raise SystemExit("guard_cost.py measures on CUDA; --smoke runs the CPU form")
        dev, dtype, h, v, reps = torch.device("cuda"), torch.bfloat16, args.h, args.v, args.reps
        ns = [int(s) for s in args.ns.split(",")]
    import torch.distributed as dist

    backend = args.backend or ("nccl" if dev.type == "cuda" else "gloo")
    tmp = tempfile.mkdtemp()
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend=backend)
        gen = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(v, h, generator=gen, device=dev) * h**-0.5).to(dtype).requires_grad_()
        rows = []
        for n in ns:
            for p_ranks in (int(s) for s in args.ranks.split(",")):
                rows += measure_guard(n, h, v, dtype, dev, p_ranks, reps)
            rows += measure_calls(n, w, group, reps)
    finally:
        if own:
            dist.destroy_process_group()
    if args.out:  # only there (the smoke run of a test writes nothing into benchmarks/results/)
        import csv

        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "guard_cost.csv", "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
    print(f"\nguard cost per call ({dev.type}, {dtype}, H={h}, V={v}; guard rows: minus the same round without a guard)")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
