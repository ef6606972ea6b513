"""torchtitan's loss vs flce_dist's torchtitan loss, one GPU: does torchtitan import here, and what do
the two losses cost as torchtitan's trainer calls them.

torchtitan 0.3.0's llama3 default, ``ChunkedLossWrapper(num_chunks=8, CrossEntropyLoss)``: the
post-norm hidden states ``[B, L, H]`` in 8 sequence chunks, each ``lm_head(chunk)`` -> float32
``[B, L/8, V]`` logits -> cross entropy (backward through each chunk's logits), against
``flce_dist.integrations.torchtitan.FusedLinearCrossEntropyLoss`` (no logits). Both on the same
bf16 hidden, labels (1/16 ignored) and ``nn.Linear(H, V, bias=False)`` in bf16, loss summed / the
valid-token count as torchtitan's trainer passes ``global_valid_tokens``; fwd+bwd timed with CUDA
events (median of ``--reps`` after warm-up), peak memory above the inputs, and the loss / gradient
agreement. If torchtitan does not import, the error is printed and written (exit 0).

    python benchmarks/bench_torchtitan.py --out /tmp/out
"""

from __future__ import annotations

import argparse
import traceback

import torch

import common  # noqa: F401  (puts the repository root on sys.path)
from flce_dist._timing import cuda_time_ms, write_csv

SHAPES = {"llama1b": (2048, 128256), "llama3": (4096, 128256), "qwen3": (4096, 151936)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama1b,llama3,qwen3")
    ap.add_argument("--bl", default="4x2048", help="B x L tokens per call")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    try:
        import torchtitan
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

        from flce_dist.integrations.torchtitan import FusedLinearCrossEntropyLoss
        print(f"torchtitan {getattr(torchtitan, '__version__', '?')} imports under torch {torch.__version__}")
    except Exception:  # noqa: BLE001 - the report is the point
        err = traceback.format_exc()
        print(f"torchtitan does not import under torch {torch.__version__}:\n{err}")
        if args.out:
            open(f"{args.out}/torchtitan_import.txt", "w").write(err)
        return
    b, seq = (int(v) for v in args.bl.split("x"))
    rows = []
    for name in args.shapes.split(","):
        h, v = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(b, seq, h, device="cuda", generator=g).bfloat16()
        head = torch.nn.Linear(h, v, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            head.weight.normal_(0, 0.02, generator=g)
        labels = torch.randint(0, v, (b, seq), device="cuda", generator=g)
        labels[:, :: 16] = -100
        gvt = (labels != -100).sum()
        losses = {
            "torchtitan": ChunkedLossWrapper.Config(num_chunks=8, loss_fn=CrossEntropyLoss.Config()).build(),
            "flce": FusedLinearCrossEntropyLoss.Config().build(),
        }
        got = {}
        for label, fn in losses.items():
            fn.set_lm_head(head)
            x = hidden.clone().requires_grad_()

            def step():
                x.grad = head.weight.grad = None
                loss, _ = fn(x, labels, gvt)
                loss.backward()
                return loss

            loss = step()
            got[label] = (loss.detach().float(), x.grad.float(), head.weight.grad.float())
            ms = cuda_time_ms(step, args.reps)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            rows.append(dict(shape=name, loss_impl=label, b=b, l=seq, h=h, v=v, ms=ms, peak_gib=peak,
                             loss=got[label][0].item()))
            print(f"[{name}] {label}: {ms:.2f} ms, peak {peak:.2f} GiB, loss {got[label][0].item():.5f}", flush=True)
        (la, xa, wa), (lb, xb, wb) = got["torchtitan"], got["flce"]
        rel = lambda a, r: ((a - r).norm() / r.norm()).item()  # noqa: E731
        errs = dict(rel_loss=rel(lb, la), rel_dx=rel(xb, xa), rel_dw=rel(wb, wa))  # flce vs torchtitan
        rows[-2].update({k: 0.0 for k in errs})
        rows[-1].update(errs)
        del hidden, head, losses, got, x
        torch.cuda.empty_cache()
    write_csv(rows, "torchtitan_loss.csv", [args.out] if args.out else [])
    print(f"\n=== torchtitan summary (B x L = {args.bl}, bf16; ratio = torchtitan / flce)")
    for a, f in zip(rows[::2], rows[1::2]):
        print(f"{a['shape']:8} H={a['h']} V={a['v']}: torchtitan {a['ms']:7.2f} ms {a['peak_gib']:5.2f} GiB | flce "
              f"{f['ms']:7.2f} ms {f['peak_gib']:5.2f} GiB | x{a['ms'] / f['ms']:.2f} | rel loss {f['rel_loss']:.1e} "
              f"dx {f['rel_dx']:.1e} dw {f['rel_dw']:.1e}")


if __name__ == "__main__":
    main()
