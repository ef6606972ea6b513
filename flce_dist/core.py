"""The forward/backward core: the only place where kernels and collectives meet.

Two thin adapters call it: ``autograd.FLCEFunction`` (eager) and the ``torch.library`` ops of
``compile_op.py`` (under ``torch.compile``).

Notation (per rank of a TP group of size P): x [N, H] (all tokens; under sequence parallelism the
gathered ones), W [V_r, H] this rank's shard, stats [N, 4] = (lse, target logit, sum of logits,
max logit), [N, 5] with ``return_entropy`` (plus the softmax entropy H).

Entropy (``return_entropy``): H = lse - mu with mu = sum_v p_v y_v rides in the same statistics
all-gather (a 5th column); its gradient dH/dy = -p (y - mu) joins the loss's in the recompute
backward's one pass over the vocab chunks (the chunk_grad_ kernel takes mu and dL/dH per row), so
an RL objective sum_n a_n logp_n + beta sum_n H_n costs the same 4 matmuls as the per-token loss.

Two strategies share every kernel and collective. Around the logits pass every per-token step is
one launch: the targets' shard-local ids and masks before it (``kernels/targets.py``), the merge of
its per-tile partials (``kernels/merge.py``), the loss, accuracy and lse rows after the statistics
all-gather (``kernels/token_loss.py``) and, in the row-scale form, each chunk's scales and target
entries (``kernels/row_prepare.py``), instead of chains of small torch kernels (docs/results.md,
"Per-call small kernels"). On sm_90 the logits passes without a bias (forward-only, logits store,
row-scale store) take their target logits from their own launch (``kernels/target_dot.py``, the
pass's bits) instead of a compare per element inside the pass; such a pass reads no targets, so the
fused strategy enqueues it first and the targets' launch after it (issue 53: from an idle GPU the host work
before the first long kernel is the call's idle time). The mean's denominator and the row weights come after
the first pass's statistics on every path (``_Tokens``).

* ``recompute`` (any reduction; forward-only / evaluation):
    forward   lse_forward kernel (x @ W.T tile by tile, never stored; or cuBLAS token chunks +
              chunk_stats, ``Settings(logits_backend="cublas")``) -> local stats
              -> ONE all-gather of stats -> global lse, loss        1 matmul
    backward  per vocab chunk c: z = x @ W_c.T (cuBLAS) -> chunk_grad_ kernel (dz in place)
              -> dW_c = dz.T @ x (local) and dX += dz @ W_c          3 matmuls
              -> dX all-reduce started before the last chunk's dW matmul, so it overlaps it.
    kept logits (:func:`kept_columns`: a gradient, not an explicit "recompute", no filter; the eager
    Function): where all N rows of [N, ceil(V / P)] fit one chunk of the budget the forward's pass
    stores z [N, V_r] (the fused strategy's storing pass, entropy column included) and the backward
    forms dz in it in place: chunk_grad_ -> dX = dz @ W, dW = dz.T @ x   3 matmuls in all; else it
    stores the backward's first vocab chunk [N, cols] (a storing pass over W[:cols], a plain one over
    the rest, merged locally) and the backward recomputes the others only. Same collectives.
* ``fused`` (scalar reductions with a gradient; the default there): per token chunk n:
    lse_forward kernel: z = x_n @ W.T stored + its stats in one pass (or cuBLAS + chunk_stats,
    ``Settings(logits_backend="cublas")``) -> all-gather of the chunk's stats -> global lse
    -> chunk_grad_ kernel -> dX_n = dz @ W (async all-reduce of the chunk) and dW += dz.T @ x_n
    3 matmuls in all. Where ``rowscale.py`` applies (no bias/softcap/label smoothing/filter: the
    default there) the pass stores exponentials E against a per-row reference instead of z, and
    dz = diag(c) E' replaces the chunk_grad_ pass: dX_n = c * (E' @ W), dW += E'.T @ (c * x_n)
    (one small sample matmul per call for the references; a device-side gate recomputes the dz
    of a chunk whose rows leave the form's bounds, kernels/dz_gated.py); backward only scales the stored dX, dW by grad_output (in place, by the
    scale_ kernel, which reads and writes nothing when grad_output is 1; a second backward through
    the same graph recomputes). All ranks plan the same chunks.

Gradient filter (``grad_filter_eps``, opt-in): both strategies first sort this rank's shard by mean
logit (``vocab_order.py``: W[perm], b[perm], targets through inv; no collective), record per
(row, vocab tile) max |dz| in the chunk_grad_ pass, build the block mask against eps x the row's
gradient weight (after the global lse: the same decision under TP), run dX and dW as block-sparse
Helion matmuls over the kept blocks (``kernels/masked_mm.py``) and return dW, db in the shard's
own row order. Same collectives and matmul count. ``Settings(filter_order="gather")`` (the default):
the logits pass loads W's tiles through the order (``launch.lse_forward_gathered``; cuBLAS logits:
blocks of rows gathered into a buffer of 1/8 of the chunk budget) and the dX / dW matmuls read W and
write dW through it (``kernels/masked_mm.py``): no sorted copy, no restore of dW. ``filter_order="copy"``: memory + one
sorted copy of W_r (fused) or of a vocab chunk (recompute: all of W_r at RL token counts).

Memory: one logits chunk (``chunking.chunk_rows``) plus dX/dW; never [N, V_r].

Determinism: no floating-point atomics (the one atomic, the row-scale gate's integer max in
kernels/row_prepare.py, is order-independent); every reduction is a fixed-order tile reduction, a torch
reduction or a cuBLAS matmul, and the chunk plan depends only on the call's shapes, so one GPU is
bitwise reproducible run to run. Across ranks the only order not fixed by this code is NCCL's
all-reduce / reduce-scatter of dX; ``deterministic=True`` replaces them (see ``collectives.py``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from . import accumulate, chunking, rowscale
from .chunking import chunk_rows, even_rows, gather_rows
from .distributed import (
    all_gather_rows,
    all_reduce_async,
    all_reduce_deterministic_,
    combine_stats,
    group_size,
    reduce_scatter_rows,
)
from .distributed.collectives import merge_stats
from .distributed.guard import call_guard, plan_digest, raise_if_failed, settle_stand_in, value_checksum, verdict
from .formulas import acc_dtype, mean_denominator
from .kernels import launch as K
from .options import FLCEParams, LossOptions
from .settings import Settings
from .vocab_order import VocabOrder


def local_targets(target: torch.Tensor, p: FLCEParams, v_local: int) -> torch.Tensor:
    """Shard-local target ids (int32: the kernels compare them with int32 tile indices; int64
    compares are emulated on the GPU); -1 where the target is ignored or owned by another rank."""
    return K.target_rows(target, p.vocab_start, v_local, p.vocab_size, p.ignore_index, p.settings)[0]


def uses_fused(needs_grad: bool, reduction: str, strategy: str, entropy: bool = False, weighted: bool = False) -> bool:
    """Whether a call takes the fused strategy (gradient formed in the forward). Not with the
    entropy: its per-token gradient is only known in the backward. ``reduction="none"`` only with
    ``loss_weights`` (``weighted``): the per-token gradient is expected to be ``c * w`` and checked
    in the backward (:func:`scale_weighted`)."""
    return needs_grad and (reduction != "none" or weighted) and strategy in ("auto", "fused") and not entropy


def _grad_kw(p: FLCEParams) -> dict:
    return dict(
        scale=p.logit_scale,
        eps_over_v=p.label_smoothing / p.vocab_size,
        one_minus_eps=1.0 - p.label_smoothing,
        two_zl=2.0 * p.z_loss,
        softcap=p.cap,
        settings=p.settings,
    )


def can_raise(x: torch.Tensor, p: FLCEParams | LossOptions) -> bool:
    """Whether a failed guard raises (a host sync: free on CPU tensors, already paid with
    ``check_finite``) rather than only poisoning the loss with NaN (CUDA)."""
    return x.device.type == "cpu" or p.check_finite


class _Tokens:
    """The call's per-token bookkeeping, each part formed once, on first use: the targets (:meth:`targets`:
    shard-local ids, the valid and bad masks, ``kernels/targets.py``, into buffers made up front), the token
    weights (:meth:`token_weights`), the mean's denominator (:meth:`denominator`), the row weights
    (:meth:`row_weights`) and the reduction (:meth:`reduce`). With ``w_n`` = ``loss_weights[n]`` where given, else
    1, and 0 on every ignored token:

        reduction   loss                         row weight g_n = dLoss/dloss_n (before grad_output)
        "none"      w_n * loss_n per token       w_n
        "sum"       sum_n w_n * loss_n           w_n
        "mean"      sum_n w_n * loss_n / D       w_n / D,   D = num_items_in_batch (at least 1) if given,
                                                            else sum_n w_n with loss_weights (1 where that is 0:
                                                            every weight 0, the loss is 0), else the number of
                                                            non-ignored tokens (at least 1)

    The fused strategy forms the targets after its first logits pass is enqueued where that pass does not read
    them (sm_90 without a bias: ``launch.lse_forward``'s ``prepare``) and the weights after that pass's
    statistics in every case: from an idle GPU their launches then overlap the pass instead of delaying it
    (issue 53). Same values, same collectives in the same order (``lw``, this call's token weights, are
    all-gathered by the caller before). :meth:`of_valid`: the same bookkeeping from a valid mask formed before
    (the recompute backward)."""

    def __init__(
        self,
        tgt: torch.Tensor | None,
        lw: torch.Tensor | None,
        p: FLCEParams,
        v_local: int,
        num_items: torch.Tensor | None,
        acc: torch.dtype,
    ) -> None:
        self.tgt, self.lw, self.p, self.v_local, self.num_items, self.acc = tgt, lw, p, v_local, num_items, acc
        self.tw: torch.Tensor | None = None
        self.denom: torch.Tensor | None = None
        self.g: torch.Tensor | None = None
        self.formed = tgt is None
        if tgt is not None:
            n, dev = tgt.shape[0], tgt.device
            self.tl = torch.empty(n, dtype=torch.int32, device=dev)
            self.valid = torch.empty(n, dtype=torch.bool, device=dev)
            self.bad = torch.empty(n, dtype=torch.bool, device=dev)

    @classmethod
    def of_valid(
        cls,
        valid: torch.Tensor,
        lw: torch.Tensor | None,
        p: FLCEParams,
        num_items: torch.Tensor | None,
        acc: torch.dtype,
    ) -> _Tokens:
        """The weights of tokens whose valid mask was formed before (no targets here)."""
        t = cls(None, lw, p, 0, num_items, acc)
        t.valid = valid
        return t

    def targets(self) -> None:
        if not self.formed:
            p = self.p
            assert self.tgt is not None
            K.target_rows(
                self.tgt,
                p.vocab_start,
                self.v_local,
                p.vocab_size,
                p.ignore_index,
                p.settings,
                out=(self.tl, self.valid, self.bad),
            )
            self.formed = True

    def token_weights(self) -> torch.Tensor | None:
        """``w_n``: ``loss_weights`` in the accumulation dtype, 0 on ignored tokens (None without them; then every
        ``w_n`` is 1 and no tensor is made). The guard's checksum and the loss read the same tensor."""
        if self.tw is None and self.lw is not None:
            self.targets()
            zero = torch.zeros((), dtype=self.acc, device=self.valid.device)
            self.tw = torch.where(self.valid, self.lw.to(self.acc), zero)
        return self.tw

    def denominator(self) -> torch.Tensor | None:
        """``D`` of the mean (the table above; None for "none" and "sum"), in the accumulation dtype."""
        if self.denom is None and self.p.reduction == "mean":
            tw = self.token_weights()
            if tw is None or self.num_items is not None:
                self.denom = mean_denominator(self.valid if tw is None else tw, self.num_items, self.acc)
            else:
                d = tw.sum()
                self.denom = torch.where(d == 0, torch.ones_like(d), d)
        return self.denom

    def row_weights(self) -> torch.Tensor:
        """``g_n`` (the table above) in the accumulation dtype."""
        self.targets()
        tw, denom = self.token_weights(), self.denominator()
        if denom is None:
            return self.valid.to(self.acc) if tw is None else tw
        if (
            tw is None and denom.dtype == self.acc
        ):  # valid / D: one kernel (bool -> dtype in the division, the same bits)
            return torch.div(self.valid, denom)
        return (self.valid.to(self.acc) if tw is None else tw) / denom

    def weights(self) -> torch.Tensor:
        """The row weights, formed once (after the targets, the token weights and the denominator)."""
        if self.g is None:
            self.g = self.row_weights()
        return self.g

    def reduce(self, loss: torch.Tensor, poison: torch.Tensor | None = None) -> torch.Tensor:
        """The reduced loss of the per-token losses ``loss`` (float32; multiplied by ``w_n`` here where
        ``loss_weights`` are given). ``poison`` (0-d, the guard's 0 or NaN: :class:`_Guard`): added to a scalar
        loss, so that a failed guard makes it NaN also on a rank none of whose tokens counts (its per-token losses
        are 0, whatever the lse). The mean adds it in its division's kernel (``addcdiv``), the sum in one more."""
        tw = self.token_weights()
        loss = loss if tw is None else loss * tw
        if self.p.reduction == "none":
            return loss
        total = loss.sum()
        if self.p.reduction == "sum":
            return total if poison is None else total + poison
        denom = self.denominator()
        assert denom is not None
        return total / denom if poison is None else torch.addcdiv(poison.to(total.dtype), total, denom)


class _Guard:
    """The call's cross-rank guard (``distributed/guard.py``), sent with the call's first statistics
    all-gather; a failed verdict (kept on the device for the fused strategy's later chunks) makes
    every chunk's lse NaN (so the loss and all gradients are NaN on every rank) and, where a host sync
    is free (CPU) or already paid (``check_finite``), raises the same ValueError on every rank at that
    first all-gather. Its words are built at that first all-gather, after the first chunk's matmul
    kernel is enqueued, so their few small launches and the call digest overlap it on the GPU
    instead of delaying it. ``bad``: the call's targets outside ``[0, V)`` that are not
    ``ignore_index`` (``kernels/targets.py``; their loss becomes NaN)."""

    def __init__(
        self,
        x: torch.Tensor,
        tgt: torch.Tensor,
        bad: torch.Tensor,
        p: FLCEParams,
        group: dist.ProcessGroup | None,
        rows: int,
        has_bias: bool,
        needs_grad: bool | tuple,
        tokens: _Tokens | None = None,
    ) -> None:
        self.x, self.tgt, self.bad, self.p, self.rows = x, tgt, bad, p, rows
        self.has_bias, self.needs_grad, self.tokens = has_bias, needs_grad, tokens
        self.raise_ok = can_raise(x, p)
        self.group = group
        self.ok: torch.Tensor | None = None  # the verdict's 0 / NaN, once the first chunk's guards are in

    def words(self) -> torch.Tensor:
        """This rank's guard words (``guard.call_guard``)."""
        tk = self.tokens
        values = None if tk is None else value_checksum(tk.token_weights(), tk.num_items)
        return call_guard(
            self.x,
            self.tgt,
            self.bad,
            self.p.vocab_size,
            self.rows,
            self.fields(),
            stale=self.p.stale_layout,
            count_bad=self.raise_ok,
            check_inputs=self.p.check_inputs,
            values=values,
            digest=self.p.stand_in[0] if self.p.stand_in else None,
            raises=bool(self.p.stand_in) and self.p.stand_in[1],
        )

    def fields(self) -> tuple:
        return (self.p.options.signature(), self.p.settings.astuple(), self.has_bias, self.needs_grad)

    def combine(self, local: torch.Tensor) -> torch.Tensor:
        # a single rank has no peers to agree with: nothing to build
        first = self.ok is None and group_size(self.group) > 1
        st, guards = combine_stats(local, self.group, self.words() if first else None)
        return self.settle(st, guards)

    def settle(self, st: torch.Tensor, guards: torch.Tensor | None) -> torch.Tensor:
        """The verdict of the gathered ``guards`` (the first chunk's; None later) applied to ``st``."""
        if guards is not None:
            if self.p.stand_in:  # this rank runs the predicted plan in place of its call (distributed/agree.py)
                settle_stand_in(guards, plan_digest(self.x, self.p.vocab_size, self.fields()))
            if self.raise_ok:
                raise_if_failed(guards)
            # 0 where every rank agrees, else NaN: one add per chunk poisons the lse
            self.ok = torch.where(verdict(guards), 0.0, float("nan")).to(st.dtype)
        if self.ok is not None:
            st[:, 0] += self.ok
        return st


def forward_stats(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tl: torch.Tensor, p: FLCEParams, guard: _Guard
) -> torch.Tensor:
    """Global per-token stats [N, 4] ([N, 5] with the entropy) without keeping logits (one
    collective). An empty batch or shard gets (-inf, 0, 0, -inf, 0) rows from the empty-chunk path
    of ``kernels.launch.lse_forward``."""
    return guard.combine(
        K.lse_forward(x, w, b, tl, p.logit_scale, p.cap, p.needs_sum, p.settings, with_ent=p.return_entropy)
    )


def _helion_logits(x: torch.Tensor, p: FLCEParams) -> bool:
    return p.settings.logits_backend == "helion" and not K.cublas_logits(x)


def _row_scale_form(x: torch.Tensor, has_bias: bool, p: FLCEParams) -> bool:
    """Whether the fused strategy takes the row-scale form (rowscale.py): the same on every rank."""
    return rowscale.applies(x.dtype, has_bias, p, _helion_logits(x, p), bool(p.options.filter_eps(x.dtype)))


def fused_plan(
    n: int, x: torch.Tensor, p: FLCEParams, group: dist.ProcessGroup | None, has_bias: bool, need_dw: bool = True
) -> int:
    """Token rows per chunk of the fused strategy on ``group``: :func:`fused_plan_for` its size."""
    return fused_plan_for(n, x, p, group_size(group), has_bias, need_dw)


def fused_plan_for(n: int, x: torch.Tensor, p: FLCEParams, tp: int, has_bias: bool, need_dw: bool = True) -> int:
    """Token rows per chunk of the fused strategy on each rank of a ``tp``-rank group. Every rank must
    plan the same token chunks (one stats all-gather per chunk): plan with the largest shard of an even
    split, ceil(V / P), not this rank's own size, and 1/P of the budget. dX and dW are the returned
    gradients, so they are not charged to the budget; the row-scale form's two [rows, H] buffers are.
    (Apart from :func:`fused_plan` only benchmarks call it: one rank's plan emulated on one GPU.)

    Fewer chunks where they cost less memory: where the budget's plan has ``AUTO_MIN_CHUNKS`` (5) or
    more chunks, ``dw_accumulate="auto"`` would add the float32 dW accumulator's second half (``2 V_r H``
    bytes, accumulate.py) to it. If ``AUTO_MIN_CHUNKS - 1`` (4) balanced chunks, whose dW stays in the
    weight's dtype within the precision bar, hold no more than the chunk plus that half, the plan takes
    them: less memory, fewer and larger matmuls, no float32 read-modify-write of dW. E.g. gemma (H = 2304,
    V = 262208, bf16, TP=1, CUDA budget) at N = 8192: 5 chunks of 1664 rows (0.83 GiB) + 1.13 GiB of
    float32 half, or 4 of 2048 rows (1.03 GiB): 4. llama3 takes 4 up to N ~ 27k and keeps the float32
    plan beyond (4 chunks would outgrow it). Not with an explicit ``chunk_bytes`` (the chunk is then
    the caller's choice), the gradient filter (its dW never accumulates in float32) or without dW.
    Cached per (shape, dtype, device type, options, settings, group size, bias, dW and the budget's module
    constants): the plan depends on nothing else."""
    consts = (chunking.CPU_CHUNK_BYTES, chunking.EXTRA_BYTES, chunking.HEADROOM_BYTES, accumulate.AUTO_MIN_CHUNKS)
    return _plan(
        n, x.shape[1], x.dtype, x.device.type, p.vocab_size, p.options, p.settings, tp, has_bias, need_dw, consts
    )


@functools.lru_cache(maxsize=1024)
def _plan(
    n: int,
    h: int,
    dtype: torch.dtype,
    device_type: str,
    vocab_size: int,
    options,
    settings: Settings,
    tp: int,
    has_bias: bool,
    need_dw: bool,
    consts: tuple,
) -> int:
    p = FLCEParams(0, vocab_size, options, settings)
    helion = settings.logits_backend == "helion" and not K.cublas_dtype(dtype, device_type)
    form = rowscale.applies(dtype, has_bias, p, helion, bool(options.filter_eps(dtype)))
    extra = rowscale.row_bytes(h, dtype) if form else 0
    v = -(-vocab_size // tp)
    size = dtype.itemsize
    rows = chunk_rows(n, v, size, torch.device(device_type), settings, share=tp, row_extra_bytes=extra)
    if (
        need_dw
        and n > 0
        and settings.chunk_bytes is None
        and settings.dw_accumulate == "auto"
        and not options.filter_eps(dtype)
        and accumulate.uses_float32(dtype, -(-n // rows), settings)
    ):
        k = accumulate.AUTO_MIN_CHUNKS - 1
        fewer = even_rows(n, k, align=-(-n // k) >= 256)
        per_row = v * size + extra
        if fewer * per_row <= rows * per_row + accumulate.float32_extra_bytes(v, h):
            return fewer
    return rows


def _gathered(order: VocabOrder, w: torch.Tensor, p: FLCEParams, group: dist.ProcessGroup | None) -> tuple:
    """The gradient filter's ``filter_order="gather"`` inputs: the order's int32 index and the rows per
    gathered block of W (``chunking.gather_rows``, for cuBLAS logits)."""
    return order.perm32, gather_rows(
        w.shape[0], w.shape[1] * w.element_size(), w.device, p.settings, share=group_size(group)
    )


def fused_forward_backward(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    tl: torch.Tensor,
    g: torch.Tensor | None,
    p: FLCEParams,
    group: dist.ProcessGroup | None,
    rows: int,
    guard: _Guard,
    need_dx: bool = True,
    need_dw: bool = True,
    tokens: _Tokens | None = None,
):
    """Stats, dX (summed over the group, not yet reduce-scattered), dW and db in one pass over
    token chunks. ``g`` [N]: per-row gradient weights (grad_output excluded). ``need_dx`` False (a
    hidden that needs no gradient): no dX matmul and no dX all-reduce, dX is None; ``need_dw`` False
    (a frozen lm_head: LoRA / PEFT): no dW matmul and no dW buffer, dW and db are None;
    ``p.partial_dx``: dX is this rank's partial ``dz_r @ W_r`` (no all-reduce; the caller sums it).
    ``tokens`` (``flce_forward``): ``tl`` is its buffer and ``g`` None, formed here (:class:`_Tokens`)
    where the first chunk's logits pass is enqueued. One chunk (``rows >= N``): its statistics are the
    call's (no copy)."""
    reduce_dx = not p.partial_dx
    n, _ = x.shape
    v = w.shape[0]
    eps = p.options.filter_eps(x.dtype)
    if tokens is not None and eps:  # the filter's order needs the row weights before the pass
        g = tokens.weights()
    order = perm = None
    if eps and n:  # the gradient filter works on the shard sorted by mean logit (vocab_order.py)
        assert g is not None
        order = VocabOrder.by_mean_logit(x, w, b, g.abs())
        if p.settings.filter_order == "gather":  # no sorted copy of W: read and written through perm
            perm, grows = _gathered(order, w, p, group)
        else:
            w = order.rows(w)
        b, tl = order.rows(b), order.targets(tl)
    single = 0 < n <= rows
    stats = None if single else torch.empty(n, 4, dtype=acc_dtype(x.dtype), device=x.device)
    dx = torch.empty_like(x) if need_dx else None
    # a 16-bit dW over several token chunks accumulates in float32 (accumulate.py); the filter's
    # block-sparse dW kernel accumulates in the weight's dtype
    acc32 = need_dw and not eps and n > 0 and accumulate.uses_float32(w.dtype, -(-n // max(1, rows)), p.settings)
    acc = accumulate.Float32DW(v, w.shape[1], w.dtype, w.device) if acc32 else None
    # the first chunk writes dW (no zero fill), later chunks accumulate; allocated right before the first dW
    # matmul, after the first chunk's temporaries (the pass's partials, the row-scale form's float32 [rows, H]
    # product) are freed: at a single chunk the peak is the chunk, dW, dX and the dW operand only
    dw = torch.zeros_like(w) if need_dw and acc is None and n == 0 else None
    db = torch.zeros(v, dtype=acc_dtype(x.dtype), device=x.device) if b is not None and need_dw else None
    kw = _grad_kw(p)
    handles = []
    sp = p.sequence_parallel
    helion_logits = _helion_logits(x, p)
    rs = _row_scale_form(x, b is not None, p) and n > 0 and v > 0
    ref = rowscale.reference(x, w, p.logit_scale) if rs else None
    if n == 0:  # no token chunk: the call's guard still goes round (one all-gather of the guard words alone), so
        # that a call differing on one rank is seen on every rank at N = 0 too (distributed/agree.py's stand-ins)
        guard.combine(torch.empty(0, 4, dtype=acc_dtype(x.dtype), device=x.device))
    # one chunk buffer for the whole loop (a fresh chunk per iteration would briefly hold two)
    zbuf = torch.empty(min(rows, n), v, dtype=x.dtype, device=x.device)
    for i in range(0, n, rows):
        xc, tc = x[i : i + rows], tl[i : i + rows]
        # the first chunk's targets: formed by the logits pass's launch (lse_forward's prepare) or right here
        pre = tokens.targets if tokens is not None and i == 0 else None
        z = zbuf[: xc.shape[0]]
        dxc = dx[i : i + rows] if dx is not None else None
        xw = xc  # the dW matmul's x operand (the row-scale form's: c x)
        if ref is not None:  # (rs) the chunk's exponentials E and statistics in one pass; dz = c E' (rowscale.py)
            rc = ref[i : i + rows]
            local = K.lse_forward(
                xc, w, b, tc, p.logit_scale, p.cap, p.needs_sum, p.settings, z_out=z, exp_ref=rc, prepare=pre
            )
        elif perm is not None:  # the filter's sorted logits, block by block of gathered rows of W
            local = K.lse_forward_gathered(xc, w, b, perm, tc, p.logit_scale, p.cap, p.needs_sum, p.settings, z, grows)
        elif helion_logits:  # one Helion pass: the chunk's logits (stored) and their statistics
            local = K.lse_forward(xc, w, b, tc, p.logit_scale, p.cap, p.needs_sum, p.settings, z_out=z, prepare=pre)
        else:  # cuBLAS logits, then one read of them for the statistics
            K.logits(xc, w, b, out=z)
            if pre is not None:
                pre()
            local = K.chunk_stats(z, tc, p.logit_scale, p.cap, p.needs_sum, p.settings)
        if tokens is not None:
            tokens.targets()  # (formed already: the guard's words read the bad-target mask)
        st = guard.combine(local)
        if g is None:  # the row weights, after the first pass (their launches overlap it)
            assert tokens is not None
            g = tokens.weights()
        gc = g[i : i + rows]
        if single and st.dtype == acc_dtype(x.dtype) and st.is_contiguous():
            stats = st
        else:
            if stats is None:
                stats = torch.empty(n, 4, dtype=acc_dtype(x.dtype), device=x.device)
            stats[i : i + rows] = st
        lse = st[:, 0].contiguous()
        keep = None
        if rs:
            c, gate = rowscale.prepare_(z, local, st, rc, tc, gc, p)
            # a row outside the form's bounds: this chunk's dz recomputed the plain way (gated on the device)
            K.dz_gated(xc, w, z, tc, lse, gc, gate, p.logit_scale, 2.0 * p.z_loss, p.settings)
            # E' @ W in float32, then dX = c (E' @ W) rounded once (p_t - 1 is not cancelled in bf16),
            # and the dW operand c x, in one pass
            if dxc is not None:
                xw = torch.empty_like(xc)
                K.row_scale(torch.mm(z, w, out_dtype=torch.float32), xc, c, dxc, xw, p.settings)
            else:  # frozen hidden: only the dW operand c x (rowscale.scaled_rows: no E' @ W matmul)
                xw = rowscale.scaled_rows(xc, c)
        elif eps:  # the opt-in gradient filter: block-sparse dX and dW over the blocks that matter
            keep = K.chunk_grad_filtered_(z, tc, lse, gc, gc.abs(), eps, **kw)
            if dxc is not None:
                K.dx_masked(z, w, keep, dxc, False, p.settings, w_perm=perm)
        else:
            K.chunk_grad_(z, tc, lse, gc, **kw)
            if dxc is not None:
                torch.mm(z, w, out=dxc)
        if dxc is not None and reduce_dx and not sp and not p.deterministic:
            h = all_reduce_async(dxc, group)
            if h is not None:
                handles.append(h)
        if acc is not None:  # (a 16-bit dW over several chunks, no filter: keep is None)
            acc.add(z, xw, i == 0)
        elif need_dw:
            if dw is None:
                dw = torch.empty_like(w)
            if keep is not None:
                K.dw_masked(z, xc, keep, dw, i > 0, p.settings, out_perm=perm)
            elif i == 0:
                torch.mm(z.T, xw, out=dw)
            else:
                dw.addmm_(z.T, xw)
        if db is not None:
            db += z.sum(0, dtype=db.dtype)
    del zbuf
    if acc is not None:
        dw = acc.finish()
    if order is not None:  # back to the shard's row order (the sorted copy of W is released first)
        del w, b
        dw, db = (dw if perm is not None else order.restore(dw)), order.restore(db)
    for h in handles:
        h.wait()
    if dx is not None and reduce_dx and p.deterministic and not sp:
        all_reduce_deterministic_(dx, group)
    return stats, dx, dw, db


def recompute_backward(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    tl: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    p: FLCEParams,
    group: dist.ProcessGroup | None,
    mu: torch.Tensor | None = None,
    gh: torch.Tensor | None = None,
    need_dx: bool = True,
    need_dw: bool = True,
    kept: torch.Tensor | None = None,
):
    """dX (summed over the group unless sequence-parallel or ``p.partial_dx``: then this rank's
    partial), dW, db by vocab chunks; with ``mu``,
    ``gh`` [N] the entropy's gradient in the same pass. ``need_dx`` / ``need_dw`` False: that
    gradient is None and its matmuls (and, for dX, the all-reduce and the float32 accumulator) are
    skipped: a frozen lm_head costs 2 matmuls, a hidden without a gradient 3 and no collective.
    ``kept`` [N, cols] (the forward's logits of the shard's first ``cols`` columns, :func:`kept_columns`):
    the first vocab chunk, dz formed in place in it (no logits matmul for it). All ``V_r`` columns: one
    chunk, dX = dz @ W straight in x's dtype (no float32 accumulator); fewer: chunks of ``cols``."""
    reduce_dx = not p.partial_dx
    n, _ = x.shape
    v = w.shape[0]
    acc = acc_dtype(x.dtype)
    # kept: its columns are the first chunk (all of V_r: no float32 accumulator, dX = dz @ W in x's dtype)
    whole = kept is not None and kept.shape[1] >= v
    cols = kept.shape[1] if kept is not None else recompute_columns(x, w, p, group, need_dx)
    dx = torch.zeros(x.shape, dtype=acc, device=x.device) if need_dx and not whole else None
    dw = torch.empty_like(w) if need_dw else None
    db = torch.empty(v, dtype=acc_dtype(x.dtype), device=x.device) if b is not None and need_dw else None
    kw = _grad_kw(p)
    handle = None
    out = dx
    eps = p.options.filter_eps(x.dtype)
    order = perm = z = None
    if eps and n:  # the gradient filter's row scale (the rows' total gradient weight) and vocab order
        row_scale = g.abs() if gh is None else g.abs() + gh.abs()
        order = VocabOrder.by_mean_logit(x, w, b, row_scale)
        tl = order.targets(tl)
        if p.settings.filter_order == "gather":  # no copy of the chunk's sorted rows of W: read through perm
            perm, grows = _gathered(order, w, p, group)
            no_tgt = torch.full((n,), -1, dtype=tl.dtype, device=x.device)  # its statistics are not used
    if n == 0:
        v = 0
        if dw is not None:
            dw.zero_()
        if db is not None:
            db.zero_()
    for j in range(0, v, cols):
        pc = None
        if perm is not None:  # this chunk's sorted rows read through perm (their logits pass's stats unused)
            assert order is not None
            wc, pc, bc = w, perm[j : j + cols], order.rows(b, j, j + cols)
            z = x.new_empty(n, pc.numel())
            K.lse_forward_gathered(x, w, bc, pc, no_tgt, p.logit_scale, p.cap, False, p.settings, z, grows)
        else:
            if order is None:
                wc, bc = w[j : j + cols], None if b is None else b[j : j + cols]
            else:  # this chunk's rows of the sorted shard (a chunk-sized copy)
                wc, bc = order.rows(w, j, j + cols), order.rows(b, j, j + cols)
            if j == 0 and kept is not None:
                z, kept = kept, None
            else:  # into the last chunk's buffer where the shapes agree (balanced chunks): one chunk, not two
                z = K.logits(x, wc, bc, out=z if z is not None and z.shape[1] == wc.shape[0] else None)
        keep = None
        if order is not None:
            keep = K.chunk_grad_filtered_(z, tl - j, lse, g, row_scale, eps, **kw, mu=mu, gh=gh)
            if dx is not None:
                K.dx_masked(z, wc, keep, dx, True, p.settings, w_perm=pc)
        else:
            K.chunk_grad_(z, tl - j, lse, g, **kw, mu=mu, gh=gh)  # tl - j stays int32
            if dx is not None:  # (need_dx and not whole)
                dx += torch.mm(z, wc)
        if need_dx and j + cols >= v:  # last chunk: start the dX reduction, then overlap it with this dW
            out = dx.to(x.dtype) if dx is not None else torch.mm(z, wc)  # (dx is None: whole)
            if reduce_dx and not p.sequence_parallel and not p.deterministic:
                handle = all_reduce_async(out, group)
        if dw is None:  # (not need_dw)
            pass
        elif keep is not None and pc is not None:  # sorted rows written straight to their rows of dW
            K.dw_masked(z, x, keep, dw, False, p.settings, out_perm=pc)
        elif keep is not None and order is not None:  # sorted rows, written back to the shard's order
            order.put(dw, j, K.dw_masked(z, x, keep, torch.empty_like(wc), False, p.settings))
        else:
            torch.mm(z.T, x, out=dw[j : j + cols])
        if db is not None:
            dbc = z.sum(0, dtype=db.dtype)
            if order is not None:
                order.put(db, j, dbc)
            else:
                db[j : j + cols] = dbc
    if need_dx and v == 0:  # no vocab chunk (an empty shard or batch): this rank's dX partial is zero
        out = dx.to(x.dtype) if dx is not None else torch.zeros_like(x)
        if reduce_dx and not p.sequence_parallel and not p.deterministic:
            handle = all_reduce_async(out, group)
    if handle is not None:
        handle.wait()
    if out is not None and reduce_dx and p.deterministic and not p.sequence_parallel:  # (out is None: not need_dx)
        all_reduce_deterministic_(out, group)
    return (out if need_dx else None), dw, db


def recompute_columns(
    x: torch.Tensor, w: torch.Tensor, p: FLCEParams, group: dist.ProcessGroup | None, need_dx: bool = True
) -> int:
    """Vocab columns per chunk of the recompute strategy's backward on this rank: the chunk budget over the
    ``[N, cols]`` logits chunk, less the float32 dX accumulator (the one buffer besides the chunk that is not
    a returned gradient), balanced over the shard's ``V_r`` rows (``chunking.chunk_rows``). Local to the rank:
    no collective depends on it."""
    acc = acc_dtype(x.dtype)
    return chunk_rows(
        w.shape[0],
        x.shape[0],
        x.element_size(),
        x.device,
        p.settings,
        reserved_bytes=x.numel() * acc.itemsize if need_dx else 0,
        share=group_size(group),
    )


def kept_columns(
    x: torch.Tensor,
    w: torch.Tensor,
    p: FLCEParams,
    group: dist.ProcessGroup | None,
    needs_grad: bool,
    fused: bool,
    need_dx: bool = True,
) -> int:
    """How many of the shard's vocab columns a recompute-strategy call keeps from its forward's logits for the
    backward (``flce_forward``'s ``keep_logits``; 0: none). Kept only where a gradient is needed, the strategy is
    not an explicit ``"recompute"`` (which keeps the least memory: one vocab chunk, only in the backward), no
    gradient filter (its sorted order is formed in the backward) and the batch and shard are not empty. Then:

    - all ``V_r`` columns where all N rows of ``[N, ceil(V / P)]`` logits fit one chunk of the budget
      (``chunking.chunk_rows``, as the fused strategy plans: at llama3 on one GPU N <= 3968 of bf16): the
      backward runs no logits matmul (3 matmuls instead of 4);
    - else the backward's first vocab chunk (:func:`recompute_columns`: ``cols`` of ``V_r``): the backward
      recomputes the other ``V_r - cols`` columns only (at llama3, N = 8192: 1 of its 3 chunks kept, 3 2/3
      matmuls).

    Either way at most one chunk of the budget is held from the forward to the backward (as the fused strategy
    holds its dW), and the backward's peak is unchanged (the kept chunk is its first chunk's buffer). The
    decision depends only on shapes, dtype, options and settings; it changes no collective."""
    if fused or not needs_grad or p.strategy == "recompute" or p.options.filter_eps(x.dtype):
        return 0
    n, v, tp = x.shape[0], w.shape[0], group_size(group)
    if n == 0 or v == 0:
        return 0
    if chunk_rows(n, max(v, -(-p.vocab_size // tp)), x.element_size(), x.device, p.settings, share=tp) >= n:
        return v
    return min(v, recompute_columns(x, w, p, group, need_dx))


def _stored_forward(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tokens: _Tokens, p: FLCEParams, kept: torch.Tensor
) -> torch.Tensor:
    """This rank's local stats with the logits of the shard's first ``c = kept.shape[1]`` vocab columns stored in
    ``kept`` (:func:`kept_columns`): all columns in one storing pass, or the storing pass over ``[0, c)`` and
    the plain pass over ``[c, V_r)`` merged as two shards are (``merge_stats``: logsumexp, sum, max, entropy
    weighted by each part's mass), each part with the targets outside it masked (-1)."""
    c, v = kept.shape[1], w.shape[0]
    kw = dict(with_ent=p.return_entropy)
    if c >= v:
        return K.lse_forward(
            x, w, b, tokens.tl, p.logit_scale, p.cap, p.needs_sum, p.settings, z_out=kept, prepare=tokens.targets, **kw
        )
    tokens.targets()
    tl = tokens.tl
    head = K.lse_forward(
        x,
        w[:c],
        None if b is None else b[:c],
        torch.where(tl < c, tl, -1),
        p.logit_scale,
        p.cap,
        p.needs_sum,
        p.settings,
        z_out=kept,
        **kw,
    )
    tail = K.lse_forward(
        x,
        w[c:],
        None if b is None else b[c:],
        torch.where(tl >= c, tl - c, -1),
        p.logit_scale,
        p.cap,
        p.needs_sum,
        p.settings,
        **kw,
    )
    return merge_stats(torch.stack([head, tail]), x.shape[0], None)[0]


def flce_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    num_items: torch.Tensor | None,
    p: FLCEParams,
    group: dist.ProcessGroup | None,
    needs_grad: bool,
    need_dx: bool = True,
    need_dw: bool = True,
    loss_weights: torch.Tensor | None = None,
    copy_lse: bool = True,
    keep_logits: bool = False,
):
    """The forward of both strategies (shared by ``FLCEFunction`` and the ``flce_dist::fused_lce`` op).

    Returns ``loss, lse, correct, ent, pre, saved``: ``ent`` the per-token entropy (0 for ignored
    tokens; None without ``return_entropy``); ``pre`` = (dX, dW, db) formed by the fused strategy
    (not yet scaled by grad_output) or None; ``saved`` = (x, tl, lse of all rows, valid, entropy of
    all rows or None, the token weights of all rows or None, the kept logits or None), what the backward
    needs. ``keep_logits`` (the eager Function): where the recompute strategy's backward will run and
    :func:`kept_columns` is not 0, the forward's pass stores the logits of those columns (the fused
    strategy's logits-storing pass, with the entropy column when asked: all of ``V_r`` where all N rows fit
    one chunk of the budget, else the backward's first vocab chunk) and the backward forms dz from them in
    place: 3 matmuls instead of 4 (or the kept chunk's share of the 4th saved), at most one chunk of the
    budget held from forward to backward (as the fused strategy holds its dW); under
    sequence parallelism ``x`` is this rank's ``hidden`` (not the gathered ``[P n, H]``):
    :func:`recompute_grads` gathers it again, as
    Megatron's sequence-parallel linears do. ``need_dx`` / ``need_dw``: which gradients the fused
    strategy forms (the others are None in ``pre``). ``p.partial_dx`` (the ``partial_dx=True``
    option): dX stays this rank's partial sum ``dz_r @ W_r``, for a caller that reduces it itself
    (torchtitan all-reduces the hidden gradient at its tp boundary, verl leaves it to Megatron); not
    with sequence parallelism (``LossOptions`` refuses the pair).

    ``loss_weights`` [N_in] (this rank's rows under sequence parallelism: all-gathered here, one
    more all-gather of N values): per-token weights w. ``"sum"`` / ``"mean"`` reduce ``w_n loss_n``
    (the mean over ``sum_n w_n`` or ``num_items``); ``"none"`` returns the unweighted per-token
    losses and takes the fused strategy with row weights w: its backward (:func:`scale_weighted`)
    checks that the arriving gradient is ``c * w``. ``copy_lse`` False (the caller drops the returned
    lse): the returned lse is the saved one itself, not a copy."""
    sp = p.sequence_parallel and group_size(group) > 1
    x = all_gather_rows(hidden, group) if sp else hidden
    tgt = all_gather_rows(target, group) if sp else target
    n_in = hidden.shape[0]
    acc = acc_dtype(x.dtype)
    lw = None if loss_weights is None else (all_gather_rows(loss_weights, group) if sp else loss_weights)
    # shard-local ids, the valid and bad-target masks (one launch, kernels/targets.py), the token weights, the
    # mean's denominator and the row weights: formed where the fused pass needs them (_Tokens), else here
    tokens = _Tokens(tgt, lw, p, weight.shape[0], num_items, acc)
    pre = kept = None
    fused = uses_fused(needs_grad, p.reduction, p.strategy, p.return_entropy, lw is not None)
    rows = fused_plan(x.shape[0], x, p, group, bias is not None, need_dw) if fused else 0
    # which gradients are formed is part of what every rank must agree on (the dX all-reduce)
    guard = _Guard(
        x, tgt, tokens.bad, p, group, rows, bias is not None, (needs_grad, need_dx, need_dw, lw is not None), tokens
    )
    if fused:
        stats, dx, dw, db = fused_forward_backward(
            x, weight, bias, tokens.tl, None, p, group, rows, guard, need_dx, need_dw, tokens=tokens
        )
        if sp and dx is not None:
            dx = reduce_scatter_rows(dx, group, p.deterministic)
        pre = (dx, dw, db)
    elif keep_logits and (cols := kept_columns(x, weight, p, group, needs_grad, fused, need_dx)):
        kept = x.new_empty(x.shape[0], cols)
        stats = guard.combine(_stored_forward(x, weight, bias, tokens, p, kept))
    else:
        tokens.targets()
        stats = forward_stats(x, weight, bias, tokens.tl, p, guard)
    tokens.targets()
    tokens.denominator()
    tl, valid, bad, tw = tokens.tl, tokens.valid, tokens.bad, tokens.tw
    # Per-token loss, accuracy (the target's logit is the row max over all shards; ties count) and
    # lse in one launch (kernels/token_loss.py). A target outside [0, V) that is not ignore_index
    # poisons its loss with NaN (no device assert, no host sync; the API raises instead where the
    # check is free, on CPU without a group, and the guard on every rank of a group).
    loss_rows, correct_all, lse_all = K.token_rows(
        stats, valid, bad, p.label_smoothing, p.vocab_size, p.z_loss, p.settings
    )
    rank_slice = slice(0, n_in)
    if sp:
        r = dist.get_rank(group)
        rank_slice = slice(r * n_in, (r + 1) * n_in)
    if p.reduction == "none":
        loss = loss_rows[rank_slice].to(acc_dtype(hidden.dtype))
    else:
        loss = tokens.reduce(loss_rows, guard.ok)
    # the returned lse: not the tensor the backward saves (none where the caller drops it: ``copy_lse`` False)
    lse = lse_all[rank_slice].clone() if copy_lse or sp else lse_all
    correct = correct_all[rank_slice]
    ent_all = ent = None
    if p.return_entropy:
        ent_all = torch.where(valid, stats[:, 4], torch.zeros_like(stats[:, 4]))
        ent = ent_all[rank_slice].clone()
    return loss, lse, correct, ent, pre, (hidden if sp else x, tl, lse_all, valid, ent_all, tw, kept)


def scale_precomputed(
    dx: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
    grad_loss: torch.Tensor,
    w_dtype: torch.dtype,
    inplace: bool = True,
    settings: Settings = Settings(),
):
    """The fused strategy's backward: its dX, dW, db times grad_output (in place unless ``inplace=False``).
    In place, ``kernels.scale_`` decides on the device whether grad_output is 1 (``loss.backward()``),
    and then reads and writes nothing: no host sync either way."""
    ref = dx if dx is not None else dw
    go = grad_loss.to(acc_dtype(ref.dtype) if ref is not None else torch.float32)
    scaled = [t for t in (dx, dw) if t is not None and t.numel()]
    if scaled and inplace:
        # one scale_ launch per gradient, not torch._foreach_mul_ or a mul_ by a 0-d CUDA tensor
        # (both slower, even when grad_output is 1: docs/results.md, "Per-call small kernels")
        rounded: dict = {}  # grad_output rounded to each gradient's dtype (scale_'s operand): once per dtype
        for t in scaled:
            K.scale_(t, go, settings, rounded)
    elif scaled:
        dx, dw = (None if t is None else t * go.to(t.dtype) for t in (dx, dw))
    db = (db * go).to(w_dtype) if db is not None else None
    return dx, dw, db


def weighted_verdict(
    grad_loss: torch.Tensor, tw: torch.Tensor, valid: torch.Tensor, p: FLCEParams, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whether the arriving per-token gradient is ``c * w`` (the fused strategy's weighted backward), decided
    on the device and the same on every rank: ``(g, tw, good, c)`` with ``g`` [N_in] this rank's gradient
    (0 on ignored rows), ``tw`` this rank's token weights, ``good`` a 0-d bool (every non-ignored token within 64
    ulps of ``c * w_n`` of g's dtype, every rank's ``c`` within that bound of the first rank with weight) and
    ``c`` that first rank's least-squares scale (float64; 0 where no rank has weight). Each rank computes
    its ``c`` over its rows; one all-gather of 3 float64 per rank (none on a single rank) combines them."""
    acc = tw.dtype
    g = grad_loss.reshape(-1).to(acc)
    n = g.shape[0]
    if p.sequence_parallel and group_size(group) > 1:  # this rank's slice of the gathered rows
        r = dist.get_rank(group)
        tw, valid = tw[r * n : (r + 1) * n], valid[r * n : (r + 1) * n]
    g = torch.where(valid, g, torch.zeros((), dtype=acc, device=g.device))  # ignored rows have no gradient
    g64, w64 = g.double(), tw.double()
    s1, s2 = (g64 * w64).sum(), (w64 * w64).sum()
    has = s2 > 0
    c = torch.where(has, s1 / torch.where(has, s2, torch.ones_like(s2)), torch.zeros_like(s2))
    tol = 64 * torch.finfo(acc).eps
    cw = c * w64
    ok = ((g64 - cw).abs() <= tol * cw.abs()).all()
    info = torch.stack([c, has.double(), ok.double()])[None]
    if group_size(group) > 1:
        info = all_gather_rows(info, group)  # [P, 3]: the same verdict on every rank
    hs = info[:, 1] > 0
    c_ref = info[hs.to(torch.int32).argmax(), 0] * hs.any()  # the first rank with weight's c (or 0)
    agree = ((info[:, 0] - c_ref).abs() <= tol * c_ref.abs()) | ~hs
    return g, tw, (info[:, 2] > 0).all() & agree.all(), c_ref


def weight_ratio(g: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
    """``g_n / w_n`` per row, 0 where ``w_n`` is 0: the factor that turns the fused forward's ``w_n``-weighted dX
    row into the arriving gradient's (:func:`scale_weighted`, and ``integrations/megatron.py`` on the device)."""
    nz = tw != 0
    return torch.where(nz, g / torch.where(nz, tw, torch.ones_like(tw)), torch.zeros_like(tw))


def scale_weighted(
    pre: tuple,
    grad_loss: torch.Tensor,
    tw: torch.Tensor,
    valid: torch.Tensor,
    p: FLCEParams,
    group: dist.ProcessGroup | None,
    w_dtype: torch.dtype,
):
    """The fused strategy's backward for per-token losses with ``loss_weights``: ``pre`` = (dX, dW,
    db) was formed in the forward with row weights w (``tw``, all rows). Exact when the arriving
    gradient ``g`` [N_in] (this rank's rows) is ``c * w`` on every non-ignored token, one ``c`` on
    every rank of the group (to 64 ulps of g's dtype per token): then dW and db are ``c`` times
    theirs and each dX row ``g_n / w_n`` times its own (0 where ``w_n`` is 0). Returns the scaled
    (dX, dW, db), or None when ``g`` is not of that form (the caller then recomputes exactly).

    Every rank decides the same way (:func:`weighted_verdict`: one all-gather of 3 numbers per rank, none
    on a single rank), and one host sync reads the verdict and ``c`` (``integrations/megatron.py`` reads
    them on the device instead, for CUDA-graph capture)."""
    dx, dw, db = pre
    g, tw, good, c_ref = weighted_verdict(grad_loss, tw, valid, p, group)
    verdict, c_host = torch.stack([good.double(), c_ref]).tolist()  # host sync
    if not verdict:
        return None
    if dx is not None:  # dX row by row: exactly g_n / w_n times the w_n-weighted row
        dx.mul_(weight_ratio(g, tw)[:, None])
    if c_host != 1.0:  # float32 arithmetic for 16-bit dW, rounded once (c is not rounded to dW's dtype first)
        for t in (dw, db):
            if t is not None:
                t.mul_(c_host)
    return dx, dw, None if db is None else db.to(w_dtype)


def recompute_grads(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    tl: torch.Tensor,
    lse: torch.Tensor,
    valid: torch.Tensor,
    num_items: torch.Tensor | None,
    grad_loss: torch.Tensor,
    p: FLCEParams,
    group: dist.ProcessGroup | None,
    ent: torch.Tensor | None = None,
    grad_ent: torch.Tensor | None = None,
    need_dx: bool = True,
    need_dw: bool = True,
    loss_weights: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
):
    """The recompute strategy's backward: (dX of this rank's rows, dW, db in the weight's dtype;
    None for a gradient not needed). ``x``: this rank's hidden under sequence parallelism
    (all-gathered here again: one more all-gather, instead of keeping [P n, H] between forward and
    backward). ``ent`` [N] (all rows) and ``grad_ent`` [N_in] (this rank's rows): the entropy and
    its incoming gradient, when the entropy was returned and used. ``p.partial_dx``: this rank's
    partial dX (see :func:`flce_forward`). ``loss_weights`` [N] (all rows): the token weights
    of a scalar reduction (``"none"`` returns unweighted losses: its gradient is grad_output alone).
    ``kept`` [N, cols]: the forward's logits of the shard's first ``cols`` columns, all rows
    (:func:`kept_columns`), overwritten by dz here."""
    sp = p.sequence_parallel and group_size(group) > 1
    if sp:
        x = all_gather_rows(x, group)
    acc = acc_dtype(x.dtype)
    if p.reduction == "none":  # each row's own grad_output; an ignored token has no gradient, whatever it is
        go = grad_loss.reshape(-1).to(acc)  # (a NaN or inf there, e.g. a masked PPO ratio, must not reach dW)
        go = all_gather_rows(go.contiguous(), group) if sp else go
        g = torch.where(valid, go, torch.zeros((), dtype=acc, device=go.device))
    else:
        g = _Tokens.of_valid(valid, loss_weights, p, num_items, acc).row_weights() * grad_loss.to(acc)
    mu = gh = None
    if sp and ent is not None and grad_ent is None:  # the gather below is issued whether or not this rank's
        # objective uses the entropy (a collective must not depend on it: a peer's may; distributed/agree.py)
        all_gather_rows(torch.zeros(x.shape[0] // group_size(group), dtype=g.dtype, device=x.device), group)
    if grad_ent is not None:
        assert ent is not None  # (a gradient of the entropy: the forward returned it)
        gh = grad_ent.reshape(-1).to(g.dtype)
        gh = all_gather_rows(gh.contiguous(), group) if sp else gh
        gh = torch.where(valid, gh, torch.zeros_like(gh)).contiguous()
        mu = (lse - ent).contiguous()
    dx, dw, db = recompute_backward(x, w, b, tl, lse, g.contiguous(), p, group, mu, gh, need_dx, need_dw, kept)
    if sp and dx is not None:
        dx = reduce_scatter_rows(dx, group, p.deterministic)
    return dx, dw, None if db is None else db.to(w.dtype)
