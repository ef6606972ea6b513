"""CUDA timing and memory helpers shared by benchmarks/ and ``python -m flce_dist.tune``."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from . import accumulate
from .settings import Settings

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# the SPEC's benchmark shapes (H, V) and the dtypes the benchmarks and the tuner take by name
SHAPES = {"llama3": (4096, 128256), "qwen3": (4096, 151936), "gemma": (2304, 262208)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cuda_time_ms(
    fn: Callable[[], object],
    reps: int,
    warmup: int = 3,
    before: Callable[[], object] | None = None,
    calls: int = 1,
    lead: int = 0,
) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn`` after ``warmup`` calls (``before`` runs
    ahead of each timed call, outside the events, e.g. a barrier). With ``calls`` > 1 each sample
    times that many back-to-back calls (no host sync between them) and divides by it; ``lead``
    untimed calls are enqueued first, so that the GPU is busy when the sample starts."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before is not None:
            before()
        for _ in range(lead):
            fn()
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    return statistics.median(ts)


def cuda_steady_ms(fn: Callable[[], object], reps: int, calls: int = 5) -> float:
    """Steady-state ms per call: ``calls`` back-to-back calls per sample, behind one untimed call.
    Unlike a single timed call from an idle GPU, the host work before each call's first kernel
    overlaps the previous call's kernels, as in a training loop (before run 19 the first timed call
    of a sample started on an idle GPU: 1/calls of one call's host prologue was in the figure)."""
    return cuda_time_ms(fn, reps, calls=calls, lead=1)


def interleaved_ms(
    fns: dict[str, Callable[[], object]], rounds: int, timer: Callable[[Callable[[], object]], float] | None = None
) -> dict[str, list[float]]:
    """Per-round times of several callables timed in turn: ``rounds`` rounds, each timing every entry
    of ``fns`` once with ``timer`` (default: ``cuda_steady_ms`` at 3 samples), the order rotated by one
    per round so that no entry always follows the same one. Close calls between implementations (within
    a few %) need this: on the lent machines the clocks drift by several % over the seconds between two
    single timings, while entries timed side by side in one round drift together. Returns
    ``{name: [ms per round]}``; ``paired_ratios`` turns it into per-round ratios against one entry."""
    timer = timer or (lambda fn: cuda_steady_ms(fn, 3))
    names = list(fns)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            out[k].append(timer(fns[k]))
    return out


def paired_ratios(per_round: dict[str, list[float]], ref: str) -> dict[str, tuple[float, float, float]]:
    """``{name: (median, min, max)}`` over the rounds of ``ms[name] / ms[ref]`` in the same round (ref
    itself excluded): > 1 means slower than ``ref``. The spread (min, max) says whether a median lead is
    inside the round-to-round noise."""
    if ref not in per_round:
        raise ValueError(f"ref={ref!r} is not one of the timed entries {sorted(per_round)}")
    base = per_round[ref]
    res = {}
    for k, ts in per_round.items():
        if k != ref:
            q = [a / b for a, b in zip(ts, base, strict=True)]
            res[k] = (statistics.median(q), min(q), max(q))
    return res


def three_matmuls(x: torch.Tensor, w: torch.Tensor, seed: int = 1) -> Callable[[], object]:
    """The fwd+bwd floor as issue 15 defines it: a closure running the layer's three distinct
    matmuls back to back, ``y = x @ W.T`` [N, V], ``dX = dy @ W`` [N, H] (K = V) and
    ``dW = dy.T @ x`` [V, H] (K = N), into preallocated outputs. ``dy`` is a fixed random [N, V]
    tensor (N(0, 1) in x's dtype: not zeros, whose products draw less power; the loss's dz differs
    in value, not in shape). Memory: two [N, V] buffers (y, dy) plus dX and dW."""
    g = torch.Generator(device=x.device).manual_seed(seed)
    dy = torch.randn(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype, generator=g)
    y = torch.empty_like(dy)
    dx = torch.empty_like(x)
    dw = torch.empty_like(w)

    def run() -> None:
        torch.mm(x, w.T, out=y)
        torch.mm(dy, w, out=dx)
        torch.mm(dy.T, x, out=dw)

    run.buffers = (y, dy, dx, dw)  # type: ignore[attr-defined]  # a function attribute, for tests
    return run


def chunked_matmuls(x: torch.Tensor, w: torch.Tensor, rows: int) -> Callable[[], object]:
    """The fused strategy's cuBLAS work alone, as its token chunks issue it (``core.py``'s row-scale
    form, no Helion kernel, no small op): per chunk of ``rows`` rows, ``E = x_c @ W.T`` into the one
    [rows, V] chunk buffer, ``dX_c = E @ W`` with a float32 output, and ``dW = E.T @ x_c`` (the first
    chunk writes dW, later chunks ``addmm_`` into it). What the 1 GiB chunk plan costs over
    :func:`three_matmuls` (thin chunks, W re-read per chunk, dW read-modify-written) is the difference
    of the two; what the loss costs over this is its Helion passes and small kernels. ``E`` holds the
    chunk's logits here (random-like values, not the loss's exponentials)."""
    n, v = x.shape[0], w.shape[0]
    if not 0 < rows:
        raise ValueError(f"rows must be positive, got {rows}")
    buf = torch.empty(min(rows, n), v, device=x.device, dtype=x.dtype)
    # the loss's dW accumulator (accumulate.py): float32 halves where the loss uses them (accumulate.uses_float32)
    acc32 = accumulate.uses_float32(w.dtype, -(-n // rows), Settings())
    dw = None if acc32 else torch.empty_like(w)

    def run() -> None:
        acc = accumulate.Float32DW(v, w.shape[1], w.dtype, w.device) if acc32 else None
        for i, s in enumerate(range(0, n, rows)):
            xc = x[s : s + rows]
            e = buf[: xc.shape[0]]
            torch.mm(xc, w.T, out=e)
            # float32 out, as the loss's (whose row_scale then reads it); the CPU has no mm.dtype (tests)
            torch.mm(e, w, out_dtype=torch.float32) if e.is_cuda else torch.mm(e, w).float()
            if acc is not None:
                acc.add(e, xc, i == 0)
            elif i == 0:
                torch.mm(e.T, xc, out=dw)
            else:
                assert dw is not None  # no float32 accumulator: dw was allocated above
                dw.addmm_(e.T, xc)
        if acc is not None:
            acc.finish()

    run.buffers = (buf, dw)  # type: ignore[attr-defined]  # a function attribute, for tests
    return run


def energy_j(fn: Callable[[], object], calls: int = 20, warmup: int = 3) -> tuple[float, float, float] | None:
    """``(joules per call, ms per call, mean watts)`` of ``calls`` back-to-back calls of ``fn``, from
    NVML's total-energy counter of the board (mJ) read on an idle GPU before and after them; None
    where NVML cannot be read (no ``pynvml``, no CUDA). How often the counter advances is up to the
    driver (not measured here): give it a window of about a second. At the power cap (~690 W on the lent H200s, benchmarks/NOTES.md
    run 19) time is energy over the cap, so J per call says what a variant costs where a kernel's time
    alone does not."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(torch.cuda.current_device()))
        read = lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # noqa: E731
        read()
    except Exception:  # noqa: BLE001  (ImportError, NVMLError, no CUDA)
        return None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0 = read()
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    e1 = read()
    ms = a.elapsed_time(b) / calls
    j = (e1 - e0) / 1e3 / calls
    return j, ms, j / (ms / 1e3)


def peak_gib(fn: Callable[[], object], *params: torch.Tensor) -> float:
    """Peak memory above the inputs during one call of ``fn``, INCLUDING the gradients it returns
    (the grads of ``params`` are cleared first, so they are not counted in the baseline)."""
    for t in params:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def write_csv(rows: list[dict], filename: str, out_dirs: Iterable[str | Path] = ()) -> None:
    """Write ``rows`` to benchmarks/results/<filename> and to each of ``out_dirs``. The columns are the
    union of the rows' keys in first-seen order (rows may add columns, e.g. bench.py's ``--rounds``);
    a row without a column leaves it empty."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    for d in [RESULTS, *map(Path, out_dirs)]:
        d.mkdir(parents=True, exist_ok=True)
        with open(d / filename, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=fields)
            wr.writeheader()
            wr.writerows(rows)
