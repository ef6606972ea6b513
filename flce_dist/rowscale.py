"""The fused strategy's gradient as row-scaled exponentials: no elementwise pass over the chunk.

Without softcap, label smoothing, bias or the gradient filter, a row's dlogits factor into a per-row
scale times exponentials that the logits pass can store before the row's lse is known (``y = s z``,
``p = exp(y - lse)``, gradient weight ``g``, z-loss ``zl``, a = 2 zl lse, reference ``r`` per row):

    dL/dz_ij = g s ((1 + a) p_ij - [j = t_i])
             = c_i E'_ij          c_i   = g s (1 + a) exp(r_i - lse_i)
                                  E_ij  = exp(y_ij - r_i)                   (stored by lse_forward)
                                  E'_ij = E_ij, except at the target:
                                  E'_it = exp(lse_i - r_i) (expm1(y_t - lse_i) + a p_t) / (1 + a)

so, per token chunk, ``dX_c = diag(c) (E' @ W)`` and ``dW += E'^T @ (diag(c) x_c)``: the two cuBLAS
matmuls of the chunk_grad_ form plus two [Nc, H] row scalings, instead of one read and one write of
the [Nc, V] chunk (``chunk_grad_``, 0.03-0.06 of the 3-matmul floor: benchmarks/NOTES.md). The target
entry is written back as dz_t / c_i, computed with expm1 from the fp32 statistics, so ``p_t - 1`` of
a confident row keeps its relative precision (the stored ``E_t`` alone would lose it to cancellation
against the one-hot).

The reference ``r_i`` must be known before the pass: the row max over a strided sample of the
shard's rows (``SAMPLE`` of them, one small cuBLAS matmul per call, no collective), so r <= the
row's max M. The form is exact up to rounding (every quantity stays a normal float) when, per row,

    M_i - r_i <= MAX_SPREAD (60)      E <= e^60: no overflow of bf16 or of the fp32 matmul sums
                                      (every row: an ignored row's inf E would meet c = 0 in dW)
    |c_i| >= MIN_C (2^-100)           c x stays a normal bf16 for |x| >= 2^-26 (rows with g != 0;
                                      under TP a shard far below the global lse fails this)
    |E'_it| <= MAX_TARGET (2^100)     the target entry fits in bf16 (rows with a local target)

Rounding: E is stored in the input dtype as chunk_grad_'s dz is; the dW operand c x adds one more
rounding (bf16 on CPU test inputs: max-relative dX / dW errors against float64 4.5e-3 / 5.1e-3, the
chunk_grad_ form's 3.2e-3 / 2.5e-3; the GPU tests hold both forms within 1e-2 of float64 and of each
other). dX leaves its matmul in float32 and is rounded once after the scale.

Trained-model-like and random logits spread far less than 60 nats above the sample max. A chunk
with any row outside these bounds (or a NaN: the cross-rank guard's poisoned lse) gets its dz the
plain way instead, decided on the device: ``kernels/dz_gated.py`` recomputes the chunk's logits and
writes dz over E' behind a gate that is closed in the common case (each program reads one int and
leaves), and c becomes 1. No host sync and the same collectives; a rank's gate only changes how it
forms its own shard's gradient.
"""

from __future__ import annotations

import torch

from .options import FLCEParams

SAMPLE = 256  # shard rows in the reference's sample
MAX_SPREAD = 60.0  # max (M - r) in nats
MIN_C = 2.0**-100  # min |c| for a row with a gradient
MAX_TARGET = 2.0**100  # max |E'_t|


def applies(dtype: torch.dtype, has_bias: bool, p: FLCEParams, helion_logits: bool, filtered: bool) -> bool:
    """Whether the fused strategy forms a call's gradient as row-scaled exponentials: Helion logits
    in bf16 or float32 (float16's range is too short for the stored exponentials), no bias (its
    gradient would need a column sum of E' weighted by c), no softcap or label smoothing (their
    gradients do not factor per row), no gradient filter (it needs the dz blocks' magnitudes), and
    ``Settings(grad_form="rowscale")`` (the default). The same on every rank of a group (the chunk
    plan counts the form's buffers); a rank with an empty shard or batch still skips the form."""
    return (
        helion_logits
        and p.settings.grad_form == "rowscale"
        and dtype in (torch.bfloat16, torch.float32)
        and not has_bias
        and p.cap == 0
        and p.label_smoothing == 0
        and not filtered
    )


def row_bytes(h: int, dtype: torch.dtype) -> int:
    """The form's memory per chunk row beside the chunk: the float32 ``E' @ W`` row and the ``c x``
    row (``chunking.chunk_rows``' ``row_extra_bytes``; the references add [N] float32 per call)."""
    return h * (4 + dtype.itemsize)


def reference(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """r [N] float32: each row's max transformed logit over every ``ceil(V / SAMPLE)``-th shard row
    (at most ``SAMPLE`` rows, all of them on a small shard: then r is the exact max)."""
    step = max(1, -(-w.shape[0] // SAMPLE))
    # the row max before the float32 cast and the scale: both are monotone (the cast exact, the scale > 0 and
    # rounded monotonically), so max(round(s z)) = round(s max(z)), NaN rows NaN either way: the same bits
    # as (mm.float() * s).amax(1) in 2 (scale 1) or 3 small kernels instead of 3, over [N] instead of [N, 256]
    r = torch.mm(x, w[::step].T).amax(1).to(torch.float32)
    return r if scale == 1.0 else r.mul_(scale)


def prepare_(
    e: torch.Tensor,
    local: torch.Tensor,
    st: torch.Tensor,
    r: torch.Tensor,
    tl: torch.Tensor,
    g: torch.Tensor,
    p: FLCEParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For one chunk after its statistics all-gather: writes the target entries E'_it into ``e``
    (the stored exponentials [Nc, V]) and returns ``(c, gate)``: the row scales [Nc] float32 and the
    fallback gate [1] int32 (1 where some row is outside the bounds above; c is then 1 in every row,
    since ``dz_gated`` writes the final dz). ``local``, ``st``: this
    rank's and the global [Nc, >=4] stats; ``r`` the references, ``tl`` local targets (-1: none
    here), ``g`` the gradient weights. One launch (``kernels/row_prepare.py``) and the gate's
    ``where``; ``prepare_reference`` (torch) for size-1 dims."""
    from .kernels import launch

    if launch.degenerate(*e.shape):
        return prepare_reference(e, local, st, r, tl, g, p)
    c, gate = launch.row_prepare(
        e, local, st, r, tl, g, p.logit_scale, 2.0 * p.z_loss, MAX_SPREAD, MIN_C, MAX_TARGET, p.settings
    )
    return c.masked_fill_(gate != 0, 1.0), gate  # c = 1 where the gate is open (in place: no ones_like, no where)


def prepare_reference(
    e: torch.Tensor,
    local: torch.Tensor,
    st: torch.Tensor,
    r: torch.Tensor,
    tl: torch.Tensor,
    g: torch.Tensor,
    p: FLCEParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prepare_`` in torch (``kernels/row_prepare.py``'s math)."""
    lse, yt, m = st[:, 0], st[:, 1], local[:, 3]
    d = yt - lse  # log p_t
    if p.z_loss > 0:
        a = 2.0 * p.z_loss * lse
        c = g * (p.logit_scale * (1.0 + a)) * torch.exp(r - lse)
        et = torch.exp(lse - r) * (torch.expm1(d) + a * torch.exp(d)) / (1.0 + a)
    else:
        c = g * p.logit_scale * torch.exp(r - lse)
        et = torch.exp(lse - r) * torch.expm1(d)
    has_t = tl >= 0
    ok = (m - r <= MAX_SPREAD) & ((g == 0) | (c.abs() >= MIN_C)) & (~has_t | (et.abs() <= MAX_TARGET))
    gate = (~ok).any().to(torch.int32).reshape(1)  # NaN anywhere fails every comparison: the fallback
    c = torch.where(gate != 0, torch.ones_like(c), c)
    flat = e.view(-1)
    idx = torch.arange(e.shape[0], device=e.device) * e.shape[1] + tl.clamp(min=0).to(torch.int64)
    flat[idx] = torch.where(has_t, et.to(e.dtype), flat[idx])  # rows without a local target: unchanged
    return c, gate


def scaled_rows(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The dW operand ``round(x * c[:, None])`` alone (``kernels/row_scale.py``'s second output), for
    a call whose hidden needs no gradient: no ``E' @ W`` matmul, no dX."""
    return (x.to(c.dtype) * c[:, None]).to(x.dtype)
