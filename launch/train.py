"""Train a Llama with tensor parallelism (whole model), FSDP2 data parallelism and the flce_dist loss.

    torchrun --nproc_per_node=N launch/train.py --config configs/train/tiny_cpu.toml [--set key=value ...]
    torchrun ... launch/train.py --config ... --head torch           # the torchtitan baseline head
    torchrun --nnodes=2 --node-rank=K --nproc-per-node=M --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT launch/train.py ...
    NGPU=2 CONFIG=configs/train/llama_small_gpu.toml bash launch/train.sh

The torchrun world is a 2-D ``("dp", "tp")`` DeviceMesh (``[parallel]`` dp, tp, sp). The Hugging Face
``LlamaForCausalLM`` (random init from ``job.seed``, identical in every layout) is tensor-parallel
over tp with ``parallelize_module`` the torchtitan way (sequence parallel with ``parallel.sp``) and
FSDP2-sharded over dp; ``training.batch_size`` is the global batch, dp rank d reads rows
``[d*B/dp, (d+1)*B/dp)``, and the logged loss is the dp mean (= the loss of the whole batch).
Heads (``--head``/``model.head``): ``flce`` = flce_dist's fused vocab-parallel loss on the
``Shard(0)`` lm_head weight (no logits), ``torch`` = ``ColwiseParallel`` lm_head + ``loss_parallel``.
Checkpoints: DCP into ``step_<N>/`` (reshardable: resume on another dp x tp), ``--resume``; a fresh
start refuses a ``ckpt_dir`` that holds checkpoints unless ``--overwrite``. A resume verifies every
file of the checkpoint against the sha256 manifest in its ``complete.json`` before loading (falling
back to the newest intact one, with a warning naming the damaged files), and refuses a changed
learning-rate schedule unless ``training.resume_schedule`` says which one to follow. Replicated
parameters are compared across ranks at every checkpoint (an error names the first that differs);
an error in a step's collectives (e.g. ``job.timeout_s`` expiring) names the step. Workers restarted by
torchrun (``TORCHELASTIC_RESTART_COUNT`` > 0) resume from the latest complete checkpoint;
``FAIL_AT_STEP=S`` makes rank ``fault.fail_rank`` SIGKILL itself after step S on the first attempt.
Pieces: ``launch/components/`` (config, data, model, parallelize, checkpoint, metrics).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from components import checkpoint as ckpt  # noqa: E402
from components.config import load_config  # noqa: E402
from components.data import CORPUS_NAME, SequenceData, build_tokens  # noqa: E402
from components import metrics  # noqa: E402
from components.metrics import setup_logging, write_losses  # noqa: E402
from components.model import build_model, lr_at, make_optimizer  # noqa: E402
from components.parallelize import build_mesh, clip_grad_norm_, parallelize, reduce_partial_grads_  # noqa: E402

log = logging.getLogger("flce_dist.train")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "configs/train/tiny_cpu.toml"),
                    help="TOML config (default: configs/train/tiny_cpu.toml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set training.steps=30 (repeatable)")
    ap.add_argument("--head", choices=("flce", "torch"), help="override model.head")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                    help="continue from the latest complete checkpoint in ckpt_dir if there is one")
    ap.add_argument("--overwrite", action="store_true",
                    help="start fresh even though ckpt_dir holds checkpoints (they are removed)")
    return ap.parse_args(argv)


def init_distributed(cfg, rank: int, world: int, restart: int):
    """Device, and (under torchrun) the process group on a store namespaced per attempt: the store
    that torchrun's agent hosts outlives a worker restart, and the restarted ranks must not find the
    dead ranks' keys in it."""
    want = cfg.job.device
    use_cuda = torch.cuda.is_available() if want == "auto" else want in ("cuda", "cuda-shared")
    shared = want == "cuda-shared"  # testing mode: every rank on cuda:0, gloo (no NCCL: one GPU per rank)
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit(f"job.device = {want!r} but this machine has no CUDA device: use a CPU config "
                         "(configs/train/tiny_cpu.toml) or --set job.device=\"cpu\"")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        device = torch.device("cuda", 0 if shared else local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cfg.job.threads)
        import flce_dist

        flce_dist.setup_reference_mode()  # the Helion kernels as eager torch code (no CUDA here)
    if world > 1:
        from torch.distributed.rendezvous import rendezvous

        store, _, _ = next(rendezvous("env://"))
        store = dist.PrefixStore(f"flce_train/attempt_{restart}", store)
        nccl = use_cuda and not shared
        if shared:
            from components import shared_gpu

            shared_gpu.install()  # gloo's functional all-gather of CUDA tensors crashes (shared_gpu.py)
        dist.init_process_group("nccl" if nccl else "gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg.job.timeout_s),
                                device_id=device if nccl else None)
    return device, use_cuda


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    setup_logging(rank)
    cfg = load_config(args.config, args.set)
    cfg.model.head = args.head or cfg.model.head
    cfg.checkpoint.resume = cfg.checkpoint.resume if args.resume is None else args.resume
    cfg.resolve(world)
    job, t, ck, par = cfg.job, cfg.training, cfg.checkpoint, cfg.parallel
    device, use_cuda = init_distributed(cfg, rank, world, restart)
    pg = dist.group.WORLD if world > 1 else None
    mesh = build_mesh(device.type, par.dp, par.tp) if world > 1 else None
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    if restart:
        log.warning("restart %d of this job (torchelastic): resuming from the latest checkpoint", restart)

    # data: rank 0 builds (or loads) the cache first, the others then load it
    if rank != 0 and pg:
        dist.barrier()
    ids, tok_vocab = build_tokens(cfg.data)
    if rank == 0 and pg:
        dist.barrier()
    data = SequenceData(ids, cfg.data.seq_len, job.seed)
    vocab = cfg.model.vocab_size or tok_vocab
    if vocab < tok_vocab:
        raise ValueError(f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary ({tok_vocab})")

    model = build_model(cfg, vocab).to(device)
    parallelize(model, mesh, par.sp, cfg.model.compile)
    opt = make_optimizer(model, t)
    log.info("model: LlamaForCausalLM %d layers, hidden %d, vocab %d%s; %s head; mesh dp=%d x tp=%d%s over %d rank(s); "
             "%s on %s", cfg.model.num_layers, cfg.model.hidden_size, vocab, " (tied)" if cfg.model.tie_word_embeddings else "",
             cfg.model.head, par.dp, par.tp, " (sp)" if par.sp else "", world, t.dtype, device)
    log.info("data: %s, %d tokens (tokenizer vocab %d), %d sequences of %d, global batch %d (%d per dp rank)", CORPUS_NAME,
             ids.numel(), tok_vocab, len(data), cfg.data.seq_len, t.batch_size, t.batch_size // par.dp)

    # resume / refuse / overwrite: rank 0 looks at ckpt_dir and decides for everyone
    ckpt_dir, meta = Path(ck.ckpt_dir), {"head": cfg.model.head, "vocab_size": vocab,
                                         "tie_word_embeddings": cfg.model.tie_word_embeddings}
    decision: list = [None]
    if rank == 0:
        available = ckpt.complete_checkpoints(ckpt_dir)
        if (ck.resume or restart > 0) and available:
            decision = [available]
        elif ckpt.any_checkpoints(ckpt_dir) and not (ck.resume or restart > 0):
            if args.overwrite:
                log.warning("--overwrite: removing the checkpoints of an earlier run from %s", ckpt_dir)
                for d in ckpt_dir.glob("step_*"):
                    shutil.rmtree(d, ignore_errors=True)
            else:
                decision = ["refuse"]
    if pg:
        dist.broadcast_object_list(decision, src=0, group=pg)
    if decision[0] == "refuse":
        fail(pg, f"{ckpt_dir} already holds checkpoints of an earlier run: pass --resume to continue it "
                 f"or --overwrite to start fresh (removes them)")
    start_step, position, losses, resumed_from = 0, 0, [], None
    schedule = ckpt.schedule_of(t)
    if decision[0] is not None:
        # every file checked against the manifest BEFORE anything is loaded or announced (all ranks take part)
        step, damaged = ckpt.choose_checkpoint(ckpt_dir, decision[0], pg)
        if step is None:
            fail(pg, f"no intact checkpoint in {ckpt_dir} to resume from: " + "; ".join(
                f"{ckpt.step_dir(ckpt_dir, s).name}: {', '.join(p)}" for s, p in damaged.items())
                + ". Move the damaged step_* folders away (then --resume starts from step 0, or from an older "
                  "checkpoint you put back) or start fresh with --overwrite and without --resume (removes them)")
        d = ckpt.step_dir(ckpt_dir, step)
        try:
            state = ckpt.read_train_state(ckpt_dir, step)
            ckpt.check_meta(state, meta, d)
            schedule = ckpt.resume_schedule(state, t, t.resume_schedule, f"checkpoint {d}")
        except ValueError as e:
            fail(pg, f"cannot resume: {e}")
        state = ckpt.load_checkpoint(ckpt_dir, step, model, opt, pg, rank, world, meta)
        start_step, position, losses, resumed_from = state["step"], state["position"], list(state["losses"]), state["step"]
        log.info("resumed from %s (saved at dp=%d x tp=%d) at step %d (data position %d)", d,
                 state["layout"]["dp"], state["layout"]["tp"], start_step, position)
    elif ck.resume or restart > 0:
        log.info("no complete checkpoint in %s: starting from step 0", ckpt_dir)
    sched_t = dataclasses.replace(t, **schedule)  # the learning-rate schedule this run follows

    layout = {**meta, "world_size": world, "dp": par.dp, "tp": par.tp, "sp": par.sp}
    extra = {**layout, "resumed_from": resumed_from, "restart_count": restart, "config": cfg.to_dict()}
    fail_rank = cfg.fault.fail_rank % world
    show = {"on": True, "off": False}.get(job.progress, sys.stderr.isatty())
    from tqdm import tqdm

    bar = tqdm(total=t.steps, initial=start_step, desc="train", unit="step", disable=(rank != 0 or not show),
               dynamic_ncols=True, file=sys.stderr)
    model.train()
    tokens_per_step = t.batch_size * cfg.data.seq_len
    warm_steps = min(job.log_every, max(0, t.steps - start_step - 1))  # compile/warm-up excluded from steady state
    t_start = t_log = t_steady = time.perf_counter()
    window = 0
    pending = metrics.PendingSteps()
    if use_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(start_step + 1, t.steps + 1):
        with step_errors(step, job.timeout_s), \
                metrics.profile_step(step == job.profile_step, Path(job.out_dir), rank, step, use_cuda):
            if step == start_step + 1 + warm_steps:
                if use_cuda:
                    torch.cuda.synchronize(device)
                t_steady = time.perf_counter()
            batch = data.batch(position, t.batch_size, dp_rank, par.dp).to(device, non_blocking=True)
            position += t.batch_size
            lr = lr_at(step, sched_t)
            for g in opt.param_groups:
                g["lr"] = lr
            with model.loss_context():  # loss_parallel() for the torch head under tp
                loss = model(batch)
                loss.backward()
            reduce_partial_grads_(model)  # the norms' Partial grads under sp: one all-reduce, not one per read
            gnorm = clip_grad_norm_(model, t.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            pending.add(step, global_loss(loss, mesh), gnorm)  # read back at log steps (one sync there)
            window += 1
            bar.update(1)
            logging_ = step % job.log_every == 0 or step == t.steps
            saving = ck.ckpt_every > 0 and (step % ck.ckpt_every == 0 or step == t.steps)
            if logging_ or saving:
                value, gn = pending.flush(losses)  # raises FloatingPointError at a non-finite loss
                now = time.perf_counter()
                bar.set_postfix(loss=f"{value:.4f}", refresh=False)
                if logging_:
                    log.info("step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s", step, t.steps, value, lr, gn,
                             window * tokens_per_step / max(now - t_log, 1e-9))
                    t_log, window = now, 0
            if saving:
                ckpt.save_checkpoint(ckpt_dir, step, {"position": position, "losses": losses, "layout": layout,
                                                      "schedule": schedule, "config": cfg.to_dict()},
                                      model, opt, pg, rank, ck.keep)
                if rank == 0:
                    write_losses(Path(job.losses_file), losses, extra)
            if cfg.fault.fail_at_step and step == cfg.fault.fail_at_step and rank == fail_rank and restart == 0:
                pending.flush(losses)
                log.warning("fault injection: rank %d kills itself after step %d (FAIL_AT_STEP)", rank, step)
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGKILL)
    pending.flush(losses)
    bar.close()
    finish(cfg, device, use_cuda, pg, rank, losses, extra, resumed_from, tokens_per_step, t_start, t_steady, warm_steps, start_step)
    return 0


def fail(pg, message: str) -> None:
    """Leave on every rank with ``message`` (the same decision everywhere, no traceback)."""
    if pg:
        dist.destroy_process_group()
    raise SystemExit(message)


@contextlib.contextmanager
def step_errors(step: int, timeout_s: float):
    """Re-raise a ``RuntimeError`` of the step (a collective's timeout or failure: ``DistError`` and
    its subclasses are ``RuntimeError``) as ``RuntimeError("step N: ...")``, so that the error names
    the step where the ranks parted; a timeout also names ``job.timeout_s``."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        hint = ""
        if "timeout" in text.lower() or "timed out" in text.lower():
            hint = (f" [job.timeout_s={timeout_s:g}: a rank did not reach this collective in time; the first error "
                    f"is in the other ranks' output]")
        raise RuntimeError(f"step {step}: {type(e).__name__}: {text}{hint}") from e


def global_loss(loss: torch.Tensor, mesh) -> torch.Tensor:
    """The loss of the whole global batch: the mean of the dp ranks' (equal-sized) batch means, as a
    device scalar (no host sync)."""
    from torch.distributed.tensor import DTensor

    v = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float().reshape(1)
    if mesh is not None and mesh["dp"].size() > 1:
        dist.all_reduce(v, group=mesh["dp"].get_group())  # SUM (gloo has no AVG)
        v = v / mesh["dp"].size()
    return v


def finish(cfg, device, use_cuda, pg, rank, losses, extra, resumed_from, tokens_per_step, t_start, t_steady, warm_steps,
           start_step) -> None:
    """Throughput (whole run and steady state), peak memory (max over ranks), the losses file, teardown."""
    if use_cuda:
        torch.cuda.synchronize(device)
    now = time.perf_counter()
    steps = cfg.training.steps
    steady = (steps - start_step - warm_steps) * tokens_per_step / max(now - t_steady, 1e-9)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if use_cuda else 0.0])
    if pg and use_cuda:
        peak = peak.to(device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=pg)
    if rank == 0:
        extra["tokens_per_s"] = (len(losses) - (resumed_from or 0)) * tokens_per_step / max(now - t_start, 1e-9)
        extra["tokens_per_s_steady"] = steady  # after the first log_every steps (Helion compile, warm-up)
        extra["peak_gib_per_rank"] = float(peak)
        if use_cuda:
            log.info("steady state: %.0f tok/s after %d warm-up steps; peak memory %.2f GiB per rank (max over ranks)",
                     steady, warm_steps, float(peak))
        write_losses(Path(cfg.job.losses_file), losses, extra)
        if losses:
            log.info("done: %d steps, loss %.4f -> %.4f, %.1f s (%.0f tok/s); losses in %s", steps, losses[0], losses[-1],
                     now - t_start, extra["tokens_per_s"], cfg.job.losses_file)
    if pg:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown, as tests/dist_checks.py does: a gloo worker thread that releases the
    # last collective's tensors (which takes the GIL) once finalisation has begun aborts the rank with
    # "terminate called without an active exception" (gdb trace: benchmarks/NOTES.md, run 16).
    os._exit(code)
