"""Interim main job: one fused linear cross entropy forward+backward at a realistic shape.

    python launch/demo.py [--device cuda|cpu] [--n N] [--h H] [--v V] [--dtype bf16|fp16|fp32]

Defaults: on CUDA the llama3 lm_head (N=8192, H=4096, V=128256, bf16); on the CPU a shape that
Helion's reference mode finishes in seconds (N=512, H=512, V=32000, fp32, one thread). Prints the
loss, the time, and the memory the fused loss avoids versus materialised logits (the [N, V]
logits plus their float32 gradient). On the CPU (or with --check) the loss and gradients are
compared with ``flce_dist.reference_loss`` in float64.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flce_dist  # noqa: E402
from flce_dist._timing import DTYPES  # noqa: E402

log = logging.getLogger("flce_dist.demo")
DEFAULTS = {"cuda": dict(n=8192, h=4096, v=128256, dtype="bf16"), "cpu": dict(n=512, h=512, v=32000, dtype="fp32")}
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-2, 1e-2)}


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, help="tokens (B*T)")
    ap.add_argument("--h", type=int, help="hidden size")
    ap.add_argument("--v", type=int, help="vocabulary size")
    ap.add_argument("--dtype", choices=sorted(DTYPES))
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions after a warm-up call (CUDA)")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                    help="compare with the float64 reference (default: on for CPU, off for CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    d = DEFAULTS[dev.type]
    n, h, v = args.n or d["n"], args.h or d["h"], args.v or d["v"]
    dtype = DTYPES[args.dtype or d["dtype"]]
    check = (dev.type == "cpu") if args.check is None else args.check
    if dev.type == "cpu":
        flce_dist.setup_reference_mode()  # Helion kernels as eager torch code (no CUDA here)
        torch.set_num_threads(1)  # Helion reference mode is much faster single-threaded

    g = torch.Generator(device=dev).manual_seed(args.seed)
    x = torch.randn(n, h, device=dev, dtype=torch.float32, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device=dev, dtype=torch.float32, generator=g) * h**-0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    t[torch.rand(n, device=dev, generator=g) < 0.05] = -100  # a few padding tokens
    log.info("device=%s N=%d H=%d V=%d dtype=%s", dev, n, h, v, str(dtype).removeprefix("torch."))

    def step() -> torch.Tensor:
        x.grad = w.grad = None
        loss = flce_dist.fused_linear_cross_entropy(x, w, t)
        loss.backward()
        return loss

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    loss = step()
    sync(dev)
    first = time.perf_counter() - t0
    log.info("first call (includes kernel compile/warm-up): %.3f s" if dev.type == "cuda"
             else "fwd+bwd (Helion reference mode): %.3f s", first)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) - base
        times = []
        for _ in range(max(1, args.reps)):
            t0 = time.perf_counter()
            loss = step()
            sync(dev)
            times.append(time.perf_counter() - t0)
        times.sort()
        log.info("fwd+bwd: %.2f ms (median of %d)", 1e3 * times[len(times) // 2], len(times))
        log.info("peak memory above inputs (incl. dX, dW): %s", gib(peak))

    logits_bytes = n * v * torch.empty((), dtype=dtype).element_size()
    grad_bytes = n * v * 4
    log.info("loss = %.6f", loss.item())
    log.info("avoided: materialised logits %s + their fp32 gradient %s = %s",
             gib(logits_bytes), gib(grad_bytes), gib(logits_bytes + grad_bytes))

    if check:
        xr = x.detach().double().requires_grad_()
        wr = w.detach().double().requires_grad_()
        ref = flce_dist.reference_loss(xr, wr, t)
        ref.backward()
        errs = {"loss": rel(loss, ref), "dx": rel(x.grad, xr.grad), "dw": rel(w.grad, wr.grad)}
        tl, tg = TOL[dtype]
        ok = errs["loss"] <= tl and errs["dx"] <= tg and errs["dw"] <= tg
        log.info("reference loss = %.6f; relative error loss %.2e dx %.2e dw %.2e (tolerance %.0e / %.0e): %s",
                 ref.item(), errs["loss"], errs["dx"], errs["dw"], tl, tg, "OK" if ok else "FAIL")
        if not ok:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
