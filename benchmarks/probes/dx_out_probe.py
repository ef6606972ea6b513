"""Does the row-scale form's float32 ``E' @ W`` output cost cuBLAS time? (run 31)

    python3 benchmarks/probes/dx_out_probe.py [--rounds 7]

The fused strategy's dX matmul per token chunk is ``E' @ W`` with a float32 output (``rowscale.py``:
dX is rounded once, after the row scale c). Run 31's event probe at 32768 x 4096 x 32000 put that
matmul at 12.86 ms per call against 12.36 ms for the dW matmuls of the same FLOPs. This times, per
default chunk shape (llama3-like 11008 x 32000 at N = 32768, qwen3's 2816 x 151936, gemma's
1664 x 262208), ``torch.mm(E, W)`` into a float32 output against the same into bf16, in interleaved
rounds (``_timing.interleaved_ms``, steady timing), on E uniform in (0, 1) and W ~ N(0, 0.02) (never
zeros). Prints the median per-round ratio fp32 / bf16 and its spread.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flce_dist._timing import interleaved_ms, paired_ratios

CHUNKS = {"32000@11008": (11008, 4096, 32000), "qwen3@2816": (2816, 4096, 151936), "gemma@1664": (1664, 2304, 262208)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name())
    for name, (n, h, v) in CHUNKS.items():
        e = torch.rand(n, v, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        o32 = torch.empty(n, h, device="cuda", dtype=torch.float32)
        o16 = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
        fns = {"fp32": lambda: torch.mm(e, w, out_dtype=torch.float32, out=o32), "bf16": lambda: torch.mm(e, w, out=o16)}
        per = interleaved_ms(fns, args.rounds)
        med, lo, hi = paired_ratios(per, "bf16")["fp32"]
        print(f"{name:12} E[{n}, {v}] @ W[{v}, {h}]: fp32 out {statistics.median(per['fp32']):.3f} ms, bf16 out "
              f"{statistics.median(per['bf16']):.3f} ms: fp32 / bf16 {med:.3f} (rounds {lo:.3f}..{hi:.3f})", flush=True)
        del e, w, o32, o16
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
