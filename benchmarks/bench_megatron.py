"""Megatron-Core training with its own cross entropy vs flce_dist (``integrations.megatron.install``):
step time, peak memory and the loss curve of a ~1B GPTModel from one seed.

The model: Megatron-Core's ``GPTModel`` with its local spec (no Transformer Engine), Llama-3.2-1B-like
(16 layers, H=2048, 32 heads / 8 KV groups, SwiGLU FFN 8192, RMSNorm, RoPE, tied embeddings, the
V=128256 head), bf16 parameters, TP=1, selective recompute of core attention (the local spec's
attention materialises [s, s] scores). Trained by Megatron's own pieces: ``DistributedDataParallel``,
``get_megatron_optimizer`` (Adam with float32 main parameters), ``get_forward_backward_func`` and a
``loss_func`` as ``pretrain_gpt.py``'s (``sum(loss * loss_mask)``, per-token normalisation by the
schedule). Data: UTF-8 bytes of the corpus CPython ships (``pydoc_data.topics``, as the training
job's ``byte`` tokenizer) in sequences of ``--seq`` tokens, the same batches for every implementation;
``loss_mask`` drops the document separators.

Implementations (``--impls``, default ``native,unfused,flce``: the three in one call), each from the
same seed in this process, one after the other: ``native`` (``cross_entropy_loss_fusion=True,
cross_entropy_fusion_impl="native"``: Megatron's fused vocab-parallel CE), ``unfused``
(``tensor_parallel.vocab_parallel_cross_entropy``), ``flce``
(``flce_dist.integrations.megatron.install(model)``: the fused head, its ``loss_mask`` gradient scaled
on the device, no host sync), ``flce_host`` (``install(model, grad_check="host")``: the library's
check of the gradient's form, one host sync per micro-batch's backward: what that sync costs). Per
implementation: the median step time over
the steps after ``--warmup`` (fwd + bwd + optimizer, synchronised), the loss of every step, and three
memory numbers over those steps (``torch.cuda`` allocator statistics, GiB):

- ``peak_gib``: the whole step's peak (forward, backward, optimizer step); at the default size the
  optimizer step sets it (float32 main parameters and Adam states), the same for every head;
- ``fb_peak_gib``: the peak of the forward-backward function alone (``reset_peak_memory_stats`` right
  before it, ``max_memory_allocated`` right after it, before ``opt.step()``), the max over steps;
- ``fb_extra_gib``: that peak minus ``memory_allocated`` at the forward-backward's start (the resident
  state: parameters, gradient buffers, optimizer states), the max over steps: the activations and the
  head's transients. The forward-backward runs the step's ``--micro`` micro-batches one after the other
  (no pipelining; the gradients accumulate in DDP's resident buffers), so this is the largest of the
  micro-batches' forward + backward footprints, not ``--micro`` times one.

NaN on the CPU (``--smoke``). Prints a table last; writes ``megatron_steps.csv`` (every step) and
``megatron_summary.csv`` under ``--out`` (and ``benchmarks/results/``).

    python benchmarks/bench_megatron.py --steps 300 --out /tmp/out      # one GPU (device.sh megatron)
    python benchmarks/bench_megatron.py --smoke                          # a tiny config on the CPU

``--smoke`` runs on the CPU in Helion's reference mode with gloo, a 2-layer model and a few steps, with
the CPU stand-ins of ``tests/test_megatron.py`` (Megatron's optimizer and its no-pipelining schedule
allocate on CUDA: there the loop calls the schedule's ``forward_step`` / ``backward_step`` and torch's
AdamW on the DDP gradient buffers instead).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import common  # noqa: F401  (puts the repository root on sys.path)
from flce_dist._timing import write_csv

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # launch/ and tests/ (after any tree on PYTHONPATH)
IMPLS = ("native", "unfused", "flce", "flce_host")


def corpus_bytes() -> torch.Tensor:
    """UTF-8 bytes of CPython's ``help()`` topics, documents separated by 0 (launch/components/data.py)."""
    from launch.components.data import corpus_documents

    ids: list[int] = []
    for d in corpus_documents():
        ids.extend(d.encode("utf-8"))
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int64)


def batches(args, device: torch.device) -> list[tuple]:
    """``steps * micro`` micro-batches (tokens, position_ids, attention_mask, labels, loss_mask), drawn
    from the corpus with one generator (the same for every implementation)."""
    data = corpus_bytes()
    g = torch.Generator().manual_seed(args.seed)
    s, b = args.seq, args.mbs
    causal = None if device.type == "cuda" else torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    out = []
    for _ in range(args.steps * args.micro):
        starts = torch.randint(0, data.numel() - s - 1, (b,), generator=g)
        seq = torch.stack([data[i:i + s + 1] for i in starts.tolist()])
        tokens, labels = seq[:, :-1], seq[:, 1:]
        out.append((tokens.to(device), torch.arange(s, device=device).expand(b, s), causal,
                    labels.to(device), (labels != 0).float().to(device)))
    return out


def build(args, impl: str, device: torch.device):
    """The model of one implementation (same seed), wrapped in Megatron's DDP, and its optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.kv_heads, ffn_hidden_size=args.ffn, kv_channels=args.hidden // args.heads,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bf16=cuda, params_dtype=dtype,
        pipeline_dtype=dtype, use_cpu_initialization=not cuda, init_method_std=0.02,
        recompute_granularity="selective" if cuda else None,
        cross_entropy_loss_fusion=impl == "native", cross_entropy_fusion_impl="native",
        calculate_per_token_loss=True)
    torch.manual_seed(args.seed)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=args.vocab,
                     max_sequence_length=args.seq, position_embedding_type="rope", rotary_base=500000,
                     share_embeddings_and_output_weights=True)
    if cuda:  # as Megatron's Float16Module does: every parameter in bf16 (the torch norms are built in float32)
        model.cuda().bfloat16()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    if cuda:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg.finalize_model_grads_func = finalize_model_grads
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.1, bf16=True,
                                                     clip_grad=1.0, use_distributed_optimizer=False), [ddp])
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    handle = None
    if impl in ("flce", "flce_host"):
        from flce_dist.integrations import megatron as flce_megatron

        handle = flce_megatron.install(ddp, grad_check="host" if impl == "flce_host" else "device")
    return model, ddp, opt, handle


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt.py's: the masked sum, the token count, the report."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    tokens, pos, mask, labels, loss_mask = next(data_iterator)
    out = model(tokens, pos, mask, labels=labels, loss_mask=loss_mask)
    return out, functools.partial(loss_func, loss_mask)


def train(args, impl: str, data: list, device: torch.device) -> tuple[list[float], list[float], dict]:
    """Per-step losses (token mean over the step's micro-batches) and times, and the memory numbers of
    the steps after warm-up (``peak_gib``, ``fb_peak_gib``, ``fb_extra_gib``; NaN on the CPU)."""
    cuda = device.type == "cuda"
    model, ddp, opt, handle = build(args, impl, device)
    it = iter(data)
    losses, times = [], []
    first = args.warmup if args.warmup < args.steps else 0  # the measured steps (as the median step time's)
    step_peak = fb_peak = fb_extra = 0  # bytes, max over the measured steps
    if cuda:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
    for step in range(args.steps):
        measured = cuda and step >= first
        lr = args.lr * min(1.0, (step + 1) / max(1, args.lr_warmup))
        for group in opt.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        if cuda:
            if measured:  # the peak is reset only here: the previous measured step's tail first
                if step > first:
                    step_peak = max(step_peak, torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()
            reports = fb(forward_step_func=forward_step, data_iterator=it, model=[ddp], num_microbatches=args.micro,
                         seq_length=args.seq, micro_batch_size=args.mbs, forward_only=False)
            if measured:  # allocator statistics are kept on the host: no synchronisation needed
                peak = torch.cuda.max_memory_allocated()
                fb_peak, fb_extra = max(fb_peak, peak), max(fb_extra, peak - resident)
            opt.step()
            torch.cuda.synchronize()
            if measured:
                step_peak = max(step_peak, torch.cuda.max_memory_allocated())
        else:  # the schedule's per-micro-batch pieces; torch AdamW on the DDP buffers (see the docstring)
            from megatron.core.pipeline_parallel import schedules

            reports, total = [], torch.zeros([], dtype=torch.int)
            for mb in range(args.micro):
                out, n = schedules.forward_step(forward_step, it, ddp, args.micro, None, reports, model.config, 1,
                                                is_first_microbatch=mb == 0, current_microbatch=mb)
                schedules.backward_step(None, out, None, model.config)
                total += n
            ddp.scale_gradients(1.0 / total)
            for p in model.parameters():
                p.grad = p.main_grad
            opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
        rep = torch.stack([r["lm loss"] for r in reports]).sum(0)
        losses.append(float(rep[0] / rep[1]))
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"[{impl}] step {step}: loss {losses[-1]:.4f}, {times[-1]:.1f} ms", flush=True)
    if cuda:
        step_peak = max(step_peak, torch.cuda.max_memory_allocated())  # the last step's tail
    gib = (lambda b: b / 2**30) if cuda else (lambda b: float("nan"))
    memory = {"peak_gib": gib(step_peak), "fb_peak_gib": gib(fb_peak), "fb_extra_gib": gib(fb_extra)}
    if handle is not None:
        handle.remove()
    del model, ddp, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return losses, times, memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", default="native,unfused,flce", help=f"comma list of {','.join(IMPLS)}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10, help="steps before timing and the memory peak")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch size")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--lr-warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="a tiny config on the CPU (reference mode, gloo)")
    args = ap.parse_args()
    impls = args.impls.split(",")
    if set(impls) - set(IMPLS):
        ap.error(f"--impls: unknown {sorted(set(impls) - set(IMPLS))}; choose from {IMPLS}")
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.steps, args.warmup, args.seq, args.mbs, args.micro = min(args.steps, 3), 1, 64, 2, 2
        args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab = 2, 64, 4, 2, 128, 1000
        import flce_dist

        flce_dist.setup_reference_mode()
        torch.set_num_threads(1)
        from tests.test_megatron import _megatron_shims  # the CPU stand-ins stay in the tests

        _megatron_shims()
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    device = torch.device("cuda" if cuda else "cpu")
    data = batches(args, device)
    print(f"GPTModel {args.layers} layers, H={args.hidden}, V={args.vocab}, seq {args.seq} x {args.mbs} x "
          f"{args.micro} micro-batches, {args.steps} steps, {'bf16 on ' + torch.cuda.get_device_name() if cuda else 'CPU'}",
          flush=True)
    rows, summary = [], []
    curves = {}
    for impl in impls:
        losses, times, memory = train(args, impl, data, device)
        curves[impl] = losses
        rows += [{"impl": impl, "step": i, "loss": f"{l:.6f}", "step_ms": f"{t:.2f}"}
                 for i, (l, t) in enumerate(zip(losses, times))]
        timed = times[args.warmup:] or times
        summary.append({"impl": impl, "step_ms": statistics.median(timed), **memory,
                        "loss_first": losses[0], "loss_last10": statistics.mean(losses[-10:])})
    base = curves[impls[0]]
    for s in summary:
        s["max_abs_dloss_vs_" + impls[0]] = max(abs(a - b) for a, b in zip(curves[s["impl"]], base))
    if args.out:
        write_csv(rows, "megatron_steps.csv", [args.out])
        write_csv(summary, "megatron_summary.csv", [args.out])
    print(f"\n=== bench_megatron summary (median step after {args.warmup} warm-up steps; memory of those steps: "
          f"whole step's peak, fwd/bwd's peak, fwd/bwd's peak above its resident start)")
    print(f"{'impl':<9} {'step ms':>9} {'peak GiB':>9} {'fb peak':>8} {'fb extra':>9} {'loss[0]':>8} "
          f"{'loss last10':>12} {'max|dloss| vs ' + impls[0]:>22}")
    for s in summary:
        print(f"{s['impl']:<9} {s['step_ms']:>9.1f} {s['peak_gib']:>9.2f} {s['fb_peak_gib']:>8.2f} "
              f"{s['fb_extra_gib']:>9.2f} {s['loss_first']:>8.4f} {s['loss_last10']:>12.4f} "
              f"{s['max_abs_dloss_vs_' + impls[0]]:>22.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
