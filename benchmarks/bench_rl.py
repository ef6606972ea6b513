"""RL / post-training head benchmark (issue #16): per-token log-probs and entropy, with gradients.

    python benchmarks/bench_rl.py [--shapes llama3,qwen3,gemma] [--n 8192] [--data random,realistic]
        [--impls flce_rl,flce_loss,flce_mean,liger,liger_sm90,liger_sm90_noent,torch (default; also
                 flce_rl_filter,flce_rl_gather,flce_rl_recompute,flce_loss_recompute)]
        [--temperature 0.7] [--beta 0.01] [--reps 10] [--steady-calls 4] [--idle-ms 2] [--liger-target-check]
        [--check-n 512] [--out DIR]                                     # TP=1, one GPU
    torchrun --nproc_per_node=2 benchmarks/bench_rl.py [same options]    # TP=2 (NCCL)
    python benchmarks/bench_rl.py --cpu-smoke [--out DIR]                # CPU, Helion reference mode, tiny shape
    torchrun --nproc_per_node=2 benchmarks/bench_rl.py --cpu-smoke       # the same on 2 gloo ranks

Every row times forward+backward of the RL objective  obj = (adv * logp).sum() + beta * entropy.sum()
(``_noent`` rows and ``flce_loss``: obj = (adv * logp).sum(), no entropy)
with z = x @ W.T, p = softmax(z / T) over the GLOBAL vocab, logp = log p[target], entropy = -(p * log p).sum();
adv a fixed float32 N(0, 1) per-token advantage, beta = --beta, T = --temperature (a sampling temperature),
bf16 inputs, target = the data mode's. Rows (``--impls``):
  flce_rl    flce_dist.logprobs_and_entropy(x, W_r, t, group=TP, vocab_size=V, temperature=T) -> (logp, entropy), float32, both
             differentiable.
  flce_rl_filter  flce_rl with grad_filter_eps="auto" (the opt-in gradient filter; bf16: eps 2^-12), the sorted copy
             of W (Settings(filter_order="copy"); the default before run 30).
  flce_rl_gather  the same filter with Settings(filter_order="gather") (the default from run 30): each vocab
             chunk's sorted rows read through the order, no copy of W (at these N the recompute plan's one vocab
             chunk is all of W_r).
  flce_rl_recompute  flce_rl's call through fused_linear_cross_entropy(..., reduction="none", return_entropy=True,
             strategy="recompute"): logp = -loss; the recompute strategy that never keeps the forward's logits (4
             matmuls), against flce_rl's kept logits (3 matmuls where all N rows fit one chunk, issue 53)
  flce_loss_recompute  flce_loss with strategy="recompute"
  flce_loss  the anchor (issue #16: flce_rl <= 1.10 x this row): fused_linear_cross_entropy(..., reduction="none",
             temperature=T), obj = (adv * -loss).sum(); no entropy (reduction="none": the recompute strategy).
  flce_mean  context: the default reduction="mean" loss at temperature T (the fused strategy), obj = loss.
  liger      Liger-Kernel 0.8.5, liger_kernel.ops.fused_linear_scaled_cross_entropy, the same objective as flce_rl:
               TP=1  LigerFusedLinearScaledCrossEntropyFunction.apply(x, W, t, temperature=T, return_entropy=True)
               TP>1  LigerFusedLinearScaledCrossEntropyTPFunction.apply(x, W_r, t, group, temperature=T,
                     return_entropy=True)
             -> (nll float32 [N], entropy [N]), both differentiable; logp = -nll, entropy upcast to float32. Which
             path ran is the row's ``note``: TP=1 on sm90 the CuTe DSL kernel (nvidia-cutlass-dsl; entropy comes
             back in bf16; if its import fails the row calls the module's own fallback _FusedLinearPPOFallbackFunction:
             torch ops in 512-token chunks, entropy in the input dtype); TP>1 the native CUTLASS + NVSHMEM kernel when
             liger_cute_kernels is installed (the group needs an NVSHMEM team), else its 512-token torch fallback.
             The TP function takes vocab_start = rank * V_r: equal shards only (the row is skipped otherwise).
  liger_sm90 Liger-Kernel 0.8.5's CuTe DSL Hopper kernel called directly (issue 53):
             liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90.LigerFusedScaledCrossEntropySM90Function
             .apply(x, W, t, T, -100, 1, True) -> (nll float32 [N], entropy bf16 [N]); forward never writes the logits,
             backward one persistent kernel (dZ, dX, dW in 1024-token waves). TP=1, sm_90, bf16 only (skipped with
             the reason elsewhere). Its forward's target range check (``bool(out_of_range.any())``: a host sync
             every call) is off (LIGER_SCALED_CE_SM90_VALIDATE_TARGETS=0 around the call; flce's own target check
             never syncs on CUDA), unless --liger-target-check. Peer of flce_rl.
  liger_sm90_noent  the same with return_entropy=False (per-token NLL only); peer of flce_loss (flce's per-token
             log-probs without the entropy).
  torch      materialised float32 logits, no chunking. TP=1: z = (x @ W.T).float() / T, logp =
             log_softmax(z).gather(t), entropy = -(softmax(z) * log_softmax(z)).sum(-1). TP>1: Megatron-style on
             the [N, V/P] float32 shard logits (max, then sum exp, sum exp * z and the target logit summed over
             ranks; an autograd Function whose backward is the identity, dX all-reduced). CUDA OOM: row "OOM".
Collectives per call at TP=2 (N tokens, H hidden):
  flce_loss, flce_mean  fwd one all-gather of [N, 4] float32 stats (flce_mean: one per token chunk, same bytes);
                        bwd one all-reduce of dX ([N, H] bf16)
  flce_rl               fwd one all-gather of [N, 5] float32 stats (the entropy: 4 bytes per token and rank more,
                        no extra collective); bwd one all-reduce of dX (one pass for both gradients)
  liger                 fallback: per 512-token chunk an all-reduce MAX [512] + all-reduce SUM [3, 512] float32 (2N/512
                        calls), bwd one dX all-reduce; native: NVSHMEM reductions inside the kernels
  torch                 fwd all-reduce MAX [N] + all-reduce SUM [3, N] float32; bwd one all-reduce of dX
Before timing, on the first (shape, data mode) at --check-n tokens (512; 0: skip): every rank builds the full
inputs in bf16, the reference is the TP=1 torch formula in float32 on the full W (random coefficients on logp and
entropy so both gradients count); flce_rl and torch run in float32, liger in bf16 (its sm90 kernels take bf16
only); the relative error ||got - ref|| / ||ref|| of logp, entropy, dX and dW (the shard) is printed, the max over
ranks; an AssertionError if flce_rl or torch > 1e-3, liger > 2e-2 (bf16 inputs, bf16 entropy / dW); a liger call
that raises there (a missing kernel dependency) is printed and the row left out.
Times (issue 53: both timing modes, ``common.Timers``; CUDA events, CPU: perf_counter; the max over ranks of
each rank's median): ``fwd_bwd_ms`` = ``single_ms``, each call from an idle GPU (a sync, under TP a barrier, then
--idle-ms of sleep); ``steady_ms``, --steady-calls calls back to back behind one untimed call, per call;
``host_ms`` = single - steady (``host_adj_ms``: less the 3mm's own single - steady). ``single_x3mm`` /
``steady_x3mm``: against the three distinct matmuls of this rank's shard (``_timing.three_matmuls``: the
``floor3_ms`` / ``floor3_steady_ms`` columns) timed in the same mode in the same run (the RL head's recompute plan issues 4: forward logits, backward logits, dX, dW). ``ratio`` /
``ratio_steady`` are to the flce_loss row of the same shape and data; ``peer`` names a Liger row's flce
counterpart and ``vs_peer`` / ``vs_peer_steady`` its time over the peer's (> 1: Liger slower). ``mem_gib`` the
per-rank peak above the inputs with the gradients (max over ranks; nan on CPU). ``--rounds K`` (one rank):
every row and the three matmuls again in K interleaved rounds per timing mode (:func:`peer_rounds`), each Liger
row's median per-round ratio to its flce counterpart (``vs_peer_rounds``, ``vs_peer_rounds_single``). Writes ``bench_rl_tp<P>.csv``
(``_n<N>`` for N != 8192, ``_<modes>`` unless --data is the default) to benchmarks/results and --out (--cpu-smoke: ``bench_rl_tp<P>_smoke.csv`` to --out only);
prints the table last. Rows carry the data mode's ``d_*`` numbers as in bench.py.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import common  # noqa: E402  (first: a flce_dist tree on PYTHONPATH wins, else this repository's)
import data as bench_data  # noqa: E402
import flce_dist  # noqa: E402
from flce_dist import vocab_shard  # noqa: E402
from flce_dist._timing import SHAPES, paired_ratios, three_matmuls  # noqa: E402
from bench_tp import _CopyToTP  # noqa: E402

IMPLS = ("flce_rl", "flce_rl_filter", "flce_rl_gather", "flce_rl_recompute", "flce_loss", "flce_loss_recompute", "flce_mean", "liger", "liger_sm90",
         "liger_sm90_noent", "torch")
# the filter rows on request
DEFAULT_IMPLS = ("flce_rl", "flce_loss", "flce_mean", "liger", "liger_sm90", "liger_sm90_noent", "torch")
PEERS = {"liger": "flce_rl", "liger_sm90": "flce_rl", "liger_sm90_noent": "flce_loss"}  # a Liger row's flce counterpart
TABLE = [("shape", "shape", "8"), ("data", "data", "9"), ("impl", "impl", "16"), ("single ms", "fwd_bwd_ms", "9.2f"),
         ("x3mm", "single_x3mm", "6.3f"), ("steady", "steady_ms", "8.2f"), ("x3mm", "steady_x3mm", "6.3f"),
         ("host", "host_ms", "6.2f"), ("x flce_loss", "ratio", "11.3f"), ("/peer", "vs_peer", "6.3f"),
         ("/peer st", "vs_peer_steady", "8.3f"), ("peak GiB/rank", "mem_gib", "14.2f")]
# --rounds: each Liger row's median per-round ratio to its flce counterpart, steady and single (where some row has it)
ROUND_COLUMNS = [("/peer rnd st", "vs_peer_rounds", "12.3f"), ("/peer rnd 1", "vs_peer_rounds_single", "11.3f")]
SM90_CHECK_ENV = "LIGER_SCALED_CE_SM90_VALIDATE_TARGETS"  # Liger's switch for its forward's host-syncing target check
RL_SHAPES = {**SHAPES, "tiny": (32, 1000)}  # tiny: --cpu-smoke
TOL = {"flce_rl": 1e-3, "flce_rl_recompute": 1e-3, "flce_rl_filter": 2e-2, "flce_rl_gather": 2e-2, "torch": 1e-3, "liger": 2e-2, "liger_sm90": 2e-2,
       "liger_sm90_noent": 2e-2}
LIGER = ("liger", "liger_sm90", "liger_sm90_noent")  # bf16-only kernels: checked in bf16


class _SumTP(torch.autograd.Function):
    """All-reduce SUM forward; identity backward (the objective is the same on every rank, so each rank's
    partial sum gets the gradient of the total as is)."""

    @staticmethod
    def forward(ctx, t, group):
        t = t.contiguous().clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, g):
        return g, None


def torch_rl(x, w, t, temp, group=None, start=0, vocab=None):
    """(logp, entropy) float32 from materialised logits; ``group``: Megatron-style over the vocab shards."""
    if group is None:
        z = (x @ w.T).float() / temp
        lsm = z.log_softmax(-1)
        return lsm.gather(1, t[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
    z = (_CopyToTP.apply(x, group) @ w.T).float() / temp
    m = z.detach().amax(-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    ez = (z - m[:, None]).exp()
    tl = t - start
    inside = (tl >= 0) & (tl < z.shape[1])
    zt = torch.where(inside, z.gather(1, torch.where(inside, tl, 0)[:, None])[:, 0], 0.0)
    s, sz, zt = _SumTP.apply(torch.stack([ez.sum(-1), (ez * z).sum(-1), zt]), group).unbind(0)
    lse = m + s.log()
    return zt - lse, lse - sz / s


def flce_rl_fn(filter_order: str | None = None):
    """flce_dist's (logp, entropy) call and its name, or (None, the reason) for an older tree; with
    ``filter_order`` the gradient filter ("auto") in that vocabulary order."""
    if not hasattr(flce_dist, "logprobs_and_entropy"):
        return None, "flce_dist has no logprobs_and_entropy (issue #16 not in this tree)"
    if filter_order is None:
        def rl(x, w, t, temp, group, start, vocab):
            return flce_dist.logprobs_and_entropy(x, w, t, group=group, vocab_size=vocab, temperature=temp)
        return rl, "logprobs_and_entropy"
    from flce_dist.settings import Settings

    try:
        st = Settings(filter_order=filter_order)
    except (TypeError, ValueError) as e:  # a tree before run 26
        return None, f"Settings(filter_order={filter_order!r}): {e}"

    def rl_filter(x, w, t, temp, group, start, vocab):
        return flce_dist.logprobs_and_entropy(x, w, t, group=group, vocab_size=vocab, temperature=temp,
                                              grad_filter_eps="auto", settings=st)
    return rl_filter, f"grad_filter_eps='auto', filter_order={filter_order}"


def flce_rl_recompute_fn():
    """flce_rl's (logp, entropy) through the loss with ``strategy="recompute"`` (never keeps the logits)."""
    def rl(x, w, t, temp, group, start, vocab):
        loss, ent = flce_dist.fused_linear_cross_entropy(x, w, t, group=group, vocab_size=vocab, temperature=temp,
                                                         reduction="none", return_entropy=True, strategy="recompute")
        return -loss, ent
    return rl, "strategy='recompute' (4 matmuls)"


def liger_fn(dev, p, dtype):
    """Liger's (logp, entropy) call and the note naming the path it takes, or (None, reason)."""
    try:
        from liger_kernel.ops import fused_linear_scaled_cross_entropy as lfs
    except Exception as e:  # noqa: BLE001
        return None, f"liger unavailable: {type(e).__name__}: {e}"
    if p == 1:
        fallback, why = lfs._FusedLinearPPOFallbackFunction, ""
        try:
            impl = lfs._resolve_implementation(dev)  # sm90: imports the CuTe DSL kernel
        except ImportError as e:  # nvidia-cutlass-dsl / cuda-python missing: the module's own fallback, directly
            impl, why = fallback, f" (sm90 kernel import failed: {e})"
        if impl is fallback:
            return (lambda x, w, t, temp, group, *_: _neg(fallback.apply(x, w, t, temp, -100, True))), \
                "fallback 512-token chunks" + why
        fn = lfs.LigerFusedLinearScaledCrossEntropyFunction.apply
        return (lambda x, w, t, temp, group, *_: _neg(fn(x, w, t, temperature=temp, return_entropy=True))), \
            impl.__name__
    try:
        native = lfs._load_native_tp_function()
    except ImportError:
        native = None
    native = native is not None and dtype == torch.bfloat16 and lfs._supports_native_tp_architecture(dev)
    fn = lfs.LigerFusedLinearScaledCrossEntropyTPFunction.apply
    return ((lambda x, w, t, temp, group, *_: _neg(fn(x, w, t, group, temperature=temp, return_entropy=True))),
            "native CUTLASS+NVSHMEM" if native else "TP fallback 512-token chunks")


@contextlib.contextmanager
def _env(key, val):
    """``os.environ[key] = val`` inside the block (``val`` None: leave it as it is)."""
    old = os.environ.get(key)
    if val is not None:
        os.environ[key] = val
    try:
        yield
    finally:
        if val is not None:
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def liger_sm90_fn(dev, p, dtype, entropy, target_check=False):
    """Liger 0.8.5's ``LigerFusedScaledCrossEntropySM90Function`` called directly (not through the dispatcher):
    ``(logp, entropy float32)``, or ``(logp, None)`` with ``entropy`` False; (None, reason) where it cannot run
    (TP > 1, not CUDA sm_90, not bf16, the CuTe DSL not importable). ``target_check`` False: the forward's host-
    syncing target range check off for the call (``SM90_CHECK_ENV``)."""
    if p > 1:
        return None, "a single-GPU kernel (TP=1 only)"
    if dev.type != "cuda":
        return None, "needs a CUDA sm_90 GPU"
    if dtype != torch.bfloat16:
        return None, f"bf16 only, not {dtype}"
    if torch.cuda.get_device_capability(dev) != (9, 0):
        return None, f"needs sm_90 (Hopper), this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability(dev)))}"
    try:
        from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import \
            LigerFusedScaledCrossEntropySM90Function as F
    except Exception as e:  # noqa: BLE001  (no nvidia-cutlass-dsl / cuda-python, an older Liger)
        return None, f"unavailable: {type(e).__name__}: {str(e)[:200]}"
    env = None if target_check else "0"

    def rl(x, w, t, temp, group, *_):
        with _env(SM90_CHECK_ENV, env):
            out = F.apply(x, w, t, temp, -100, 1, entropy)
        return _neg(out) if entropy else (-out, None)

    return rl, (f"LigerFusedScaledCrossEntropySM90Function, entropy {'on' if entropy else 'off'}, target check "
                f"{'on (host sync)' if target_check else 'off'}")


def _neg(out):
    nll, ent = out
    return -nll, ent.float()


def _rl_obj(logp, ent, adv, beta):
    """The objective; ``ent`` None (an entropy-off row): the log-prob term alone."""
    obj = (adv * logp).sum()
    return obj if ent is None else obj + beta * ent.sum()


def _max_over_ranks(val, dev, group):
    return val if group is None else common.max_over_ranks(val, dev, group)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def check(pairs, xf, wf, t, temp, group, s, e, dev):
    """flce_rl / torch (float32) and liger (bf16) vs the TP=1 torch formula in float32 on the full W. A liger
    call that raises (a missing kernel dependency) is printed and its name returned, to be left out."""
    g = torch.Generator(device=dev).manual_seed(2)
    c1, c2 = (torch.randn(t.shape[0], device=dev, generator=g) for _ in range(2))
    xr, wr = xf.float().requires_grad_(), wf.float().requires_grad_()
    lp, en = torch_rl(xr, wr, t, temp)
    # the reference gradients with the entropy term and without it (the entropy-off rows return None for it)
    ref_grads = {True: torch.autograd.grad((c1 * lp).sum() + (c2 * en).sum(), (xr, wr), retain_graph=True),
                 False: torch.autograd.grad((c1 * lp).sum(), (xr, wr))}
    failed = []
    for name, fn in pairs.items():
        dt = torch.float32 if name not in LIGER else xf.dtype
        x = xf.to(dt).clone().requires_grad_()
        w = wf[s:e].to(dt).clone().requires_grad_()
        try:
            lp2, en2 = fn(x, w, t, temp, group, s, wf.shape[0])
            ((c1 * lp2).sum() + (0 if en2 is None else (c2 * en2).sum())).backward()
        except Exception as ex:  # noqa: BLE001
            if name not in LIGER:
                raise
            print(f"  {name} left out: {type(ex).__name__}: {str(ex)[:300]}")
            failed.append(name)
            continue
        gx, gw = ref_grads[en2 is not None]
        errs = dict(logp=_rel(lp2, lp), dX=_rel(x.grad, gx), dW=_rel(w.grad, gw[s:e]))
        if en2 is not None:
            errs["entropy"] = _rel(en2.float(), en)
        errs = {k: _max_over_ranks(v, dev, group) for k, v in errs.items()}
        worst = max(errs.values())
        if group is None or dist.get_rank(group) == 0:
            print(f"  check {name} ({dt}, N={t.shape[0]}): max rel err {worst:.2e} "
                  + " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        if not worst <= TOL[name]:
            raise AssertionError(f"{name} differs from the float32 torch reference: {errs} (tolerance {TOL[name]})")
    return failed


def peer_rounds(by_impl: dict[str, dict], steps: dict, floor, rounds: int, tm: common.Timers) -> None:
    """The rows of one case (``by_impl``, the impls that ran; ``steps`` their fwd+bwd) and the three distinct
    matmuls (``floor``) timed again in ``rounds`` interleaved rounds per timing mode (``common.interleaved_modes``):
    each row gets ``rounds<sfx>_ms`` and ``rounds<sfx>_x3mm`` (suffix ``""`` steady, ``_single`` single), and a
    Liger row whose flce counterpart (``PEERS``) ran also ``vs_peer_rounds<sfx>`` (median per-round ratio to it,
    > 1 = slower than flce) with its spread; one line per mode prints flce's lead over each such peer."""
    by_mode = common.interleaved_modes({"3mm": floor, **steps}, rounds, tm)
    torch.cuda.empty_cache()
    for mode, per_round in by_mode.items():
        sfx = "" if mode == "steady" else f"_{mode}"
        vs_mm = paired_ratios(per_round, "3mm")
        leads = []
        for k, r in by_impl.items():
            r[f"rounds{sfx}_ms"] = statistics.median(per_round[k])
            r[f"rounds{sfx}_x3mm"] = vs_mm[k][0]
            ref = PEERS.get(k)
            if ref in per_round:
                med, lo, hi = paired_ratios({k: per_round[k], ref: per_round[ref]}, ref)[k]
                r.update({f"vs_peer_rounds{sfx}": med, f"vs_peer_rounds{sfx}_min": lo, f"vs_peer_rounds{sfx}_max": hi})
                leads.append(f"{ref} vs {k}: flce ahead by {100 * (med - 1):+.1f}% (rounds {100 * (lo - 1):+.1f}.."
                             f"{100 * (hi - 1):+.1f}%)")
        print(f"  interleaved {mode}, {rounds} rounds: " + "; ".join(
            [f"{k} {statistics.median(v):.2f} ms" for k, v in per_round.items()] + leads), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    common.add_case_args(ap, shapes=None, n=None, reps=None, helps=dict(
        shapes="comma list from SHAPES (default llama3,qwen3,gemma; smoke: tiny)", n="tokens (default 8192; smoke: 64)",
        reps="timed calls per row (default 10; smoke: 2)"))
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS))
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--beta", type=float, default=0.01, help="entropy coefficient of the objective")
    ap.add_argument("--check-n", type=int, default=512, help="tokens of the correctness check (0: skip)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--cpu-smoke", action="store_true", help="--device cpu, shape tiny (H=32, V=1000), N=64")
    ap.add_argument("--liger-target-check", action="store_true",
                    help="liger_sm90 rows: keep Liger's host-syncing target range check on (default: off, as flce)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="after each case, time every impl's fwd+bwd and the three matmuls again in K interleaved "
                         "rounds per timing mode (steady, single) and report each Liger row's median per-round "
                         "ratio to its flce counterpart (one rank only)")
    common.add_timing_args(ap)
    ap.set_defaults(steady_calls=None)
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    args.device = "cpu" if smoke else args.device
    args.shapes = args.shapes or ("tiny" if smoke else common.DEFAULT_SHAPES)
    args.n = args.n or (64 if smoke else common.DEFAULT_N)
    args.reps = args.reps or (2 if smoke else 10)
    args.steady_calls = args.steady_calls or (2 if smoke else common.STEADY_CALLS)
    common.check_case_args(ap, args, RL_SHAPES)
    common.check_timing_args(ap, args)
    if args.rounds < 0:
        ap.error(f"--rounds must be >= 0, got {args.rounds}")
    if args.rounds and "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        ap.error("--rounds times one rank's calls in turn: run it without torchrun (one rank)")
    bad = [i for i in args.impls.split(",") if i not in IMPLS]
    if bad:
        ap.error(f"unknown {bad} (impls: {list(IMPLS)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: pass --device cpu or --cpu-smoke")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--trace"]:  # --trace grpo,padfree [bench_trace.py's options]: the token-count traces
        import bench_trace

        bench_trace.main(["--traces", *argv[1:2], "--head", "rl", *argv[2:]])
        return []
    args = parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cpu":
        flce_dist.setup_reference_mode()
    rank, p = 0, 1
    if "RANK" in os.environ and not dist.is_initialized():
        rank = int(os.environ["RANK"])
        if dev.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    if dist.is_initialized():
        rank, p = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD if p > 1 else None
    say = print if rank == 0 else (lambda *a, **k: None)
    dt, temp, beta = torch.bfloat16, args.temperature, args.beta
    barrier = (lambda: dist.barrier(group=group)) if group is not None else None
    tm = common.Timers(args.reps, args.steady_calls, args.idle_ms, dev, before=barrier,
                       warmup=3 if dev.type == "cuda" else 1)
    rl = {}  # name -> fn(x, w, t, temp, group, vocab_start, vocab_size) -> (logp, entropy)
    notes = {"flce_loss": "anchor: reduction=none, no entropy", "flce_mean": "reduction=mean loss, no entropy"}
    impls = args.impls.split(",")
    tnote = "Megatron fp32 shard logits" if p > 1 else "materialised fp32 logits"
    getters = {"flce_rl": flce_rl_fn, "flce_rl_filter": lambda: flce_rl_fn("copy"),
               "flce_rl_gather": lambda: flce_rl_fn("gather"), "flce_rl_recompute": flce_rl_recompute_fn, "liger": lambda: liger_fn(dev, p, dt),
               "liger_sm90": lambda: liger_sm90_fn(dev, p, dt, True, args.liger_target_check),
               "liger_sm90_noent": lambda: liger_sm90_fn(dev, p, dt, False, args.liger_target_check),
               "torch": lambda: (torch_rl, tnote)}
    for name, get in getters.items():
        if name not in impls:
            continue
        fn, why = get()
        if fn is None:
            say(f"skipping {name}: {why}")
            impls.remove(name)
        else:
            rl[name] = fn
            notes[name] = why
    cases = common.cases(args, RL_SHAPES)
    rows = []
    for ci, (name, mode, h, v) in enumerate(cases):
        s, e = vocab_shard(v, rank, p)
        even = len({vocab_shard(v, r, p)[1] - vocab_shard(v, r, p)[0] for r in range(p)}) == 1
        live = [i for i in impls if i != "liger" or even]
        if len(live) < len(impls):
            say(f"skipping liger at {name}: its TP function needs equal vocab shards (V={v}, P={p})")
        say(f"{name} H={h} V={v} data={mode} P={p} N={args.n} T={temp} beta={beta}")

        def inputs(n):
            return bench_data.make_inputs(n, h, v, mode=mode, dtype=dt, device=dev, seed=0,
                                          sorted_vocab=args.sorted_vocab, fixture=args.fixture or None)

        if ci == 0 and args.check_n > 0:
            xc, wc, tc = inputs(min(args.check_n, args.n))
            failed = check({k: f for k, f in rl.items() if k in live}, xc, wc, tc, temp, group, s, e, dev)
            impls = [i for i in impls if i not in failed]
            live = [i for i in live if i not in failed]
            del xc, wc, tc
        xf, wf, t = inputs(args.n)
        x, w, dcols = common.shard_leaves(xf, wf, t, s, e, rank)
        del xf, wf
        adv = torch.randn(args.n, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
        fl = flce_dist.fused_linear_cross_entropy
        objs = {k: (lambda f: lambda: _rl_obj(*f(x, w, t, temp, group, s, v), adv, beta))(f) for k, f in rl.items()}
        objs["flce_loss"] = lambda: (adv * -fl(x, w, t, group=group, vocab_size=v, reduction="none",
                                                temperature=temp)).sum()
        objs["flce_loss_recompute"] = lambda: (adv * -fl(x, w, t, group=group, vocab_size=v, reduction="none",
                                                          temperature=temp, strategy="recompute")).sum()
        objs["flce_mean"] = lambda: fl(x, w, t, group=group, vocab_size=v, temperature=temp)
        shape_rows = []
        nan = float("nan")
        xd, wd = x.detach(), w.detach()
        floor = three_matmuls(xd, wd)  # this rank's three distinct matmuls, both modes
        f1, f2 = (_max_over_ranks(v, dev, group) for v in (tm.single(floor), tm.steady(floor)))
        floor = xd = wd = None
        say(f"  3mm {f1:.2f} ms single, {f2:.2f} steady")
        steps = {}
        for iname in live:
            fb = steps[iname] = common.fwd_bwd(objs[iname], x, w)
            row = dict(shape=name, data=mode, impl=iname, P=p, N=args.n, T=temp, fwd_bwd_ms=nan, ratio=nan, mem_gib=nan,
                       note=notes.get(iname, ""), single_ms=nan, steady_ms=nan, host_ms=nan, single_x3mm=nan,
                       steady_x3mm=nan, ratio_steady=nan, peer=PEERS.get(iname, ""), vs_peer=nan, vs_peer_steady=nan,
                       floor3_ms=f1, floor3_steady_ms=f2, steady_calls=args.steady_calls, idle_ms=args.idle_ms)
            try:
                single = _max_over_ranks(tm.single(fb), dev, group)
                steady = _max_over_ranks(tm.steady(fb), dev, group)
                row.update(fwd_bwd_ms=single, **common.mode_cols(single, steady, f1, f2))
                if dev.type == "cuda":
                    row["mem_gib"] = _max_over_ranks(tm.peak(fb, x, w), dev, group)
            except torch.OutOfMemoryError:
                row["note"] = "OOM"
            except Exception as ex:  # noqa: BLE001
                if rank == 0:
                    common.failed(f"{name}/{mode}/{iname}", ex)
                continue
            finally:
                x.grad = w.grad = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            say(f"  {iname:16} single {row['single_ms']:8.2f} ms  steady {row['steady_ms']:8.2f} ms  peak "
                f"{row['mem_gib']:.2f} GiB", flush=True)
            shape_rows.append({**row, **dcols})
        by_impl = {r["impl"]: r for r in shape_rows}
        if args.rounds:
            peer_rounds(by_impl, {k: steps[k] for k in by_impl}, three_matmuls(x.detach(), w.detach()), args.rounds, tm)
        steps = None
        anchor = by_impl.get("flce_loss")
        for r in shape_rows:
            if anchor is not None:
                r["ratio"] = r["fwd_bwd_ms"] / anchor["fwd_bwd_ms"]
                r["ratio_steady"] = r["steady_ms"] / anchor["steady_ms"]
            peer = by_impl.get(r["peer"])
            if peer is not None:
                r["vs_peer"] = r["single_ms"] / peer["single_ms"]
                r["vs_peer_steady"] = r["steady_ms"] / peer["steady_ms"]
        rows += shape_rows
        x = w = t = adv = objs = None  # free this shape before the next (the closures see the None)
    if rank == 0 and rows:
        fname = common.csv_name(f"bench_rl_tp{p}", args.data, None if args.cpu_smoke else args.n)
        if args.cpu_smoke and args.out:  # not into benchmarks/results
            Path(args.out).mkdir(parents=True, exist_ok=True)
            with open(Path(args.out) / fname.replace(".csv", "_smoke.csv"), "w", newline="") as f:
                wr = csv.DictWriter(f, fieldnames=list(rows[0]))
                wr.writeheader()
                wr.writerows(rows)
        elif not args.cpu_smoke:
            common.save(rows, fname, args)
        devname = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        print(f"\nTP={p} {devname} bf16 N={args.n} T={temp} beta={beta}  (obj = (adv*logp).sum() + beta*entropy.sum();"
              f" single = one call from an idle GPU, {args.idle_ms:g} ms sleep after a sync; steady = {args.steady_calls}"
              f" calls back to back behind one, per call; host = single - steady; /peer = this row over its flce peer)")
        rnd = ROUND_COLUMNS if any("rounds_ms" in r for r in rows) else []
        common.print_table(rows, TABLE + rnd + [("note", "note", "")], None)
    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown, as tests/dist_checks.py does: a gloo worker thread releasing the last
    # collective's work (its tensors' decref takes the GIL) after finalisation has begun aborts the
    # rank ("terminate called without an active exception"; gdb: gloo's runLoop in
    # ~AsyncAllreduceWork -> take_gil -> pthread_exit; benchmarks/NOTES.md, run 16).
    os._exit(0)
