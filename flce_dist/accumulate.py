"""The fused strategy's dW accumulator across token chunks: float32 for 16-bit weights.

The fused strategy forms dW as a sum over token chunks, ``dW = sum_c dz_c.T @ x_c``. Added into a
bf16 buffer, every chunk rounds the running sum once more: with K chunks the relative error of dW
grows with K (the measured ratios are in docs/results.md; ``tests/test_real_setups.py`` checks the
end-to-end bound). A float32 accumulator keeps it at the one-chunk error at any K.

Memory. The accumulator is two float32 halves of the shard's rows, ``[ceil(V_r/2), H]`` and
``[floor(V_r/2), H]``: the first half's storage (``4 * ceil(V_r/2) * H`` bytes) is exactly large
enough for the returned ``[V_r, H]`` 16-bit dW, so :meth:`finish` converts both halves into it in
place (row blocks in increasing order: each block is read before the bytes it overlaps are written)
and frees the second. Extra memory beyond the returned gradient: ``2 * V_r * H`` bytes during the
loop (the second half), none afterwards. Cost: each chunk's dW matmul reads and writes float32
instead of 16-bit C (``2 * 2 * V_r * H`` more bytes of traffic per chunk) and one conversion pass.

Matmuls: cuBLAS ``addmm`` with bf16 operands and a float32 C (``out_dtype``) on CUDA; on CPU (no
``aten::addmm.dtype``) a float32 matmul of the operands added into the accumulator.
"""

from __future__ import annotations

import torch

from .settings import Settings

_SIXTEEN = (torch.bfloat16, torch.float16)
# Token chunks from which "auto" accumulates in float32. Measured on the H200 (benchmarks/NOTES.md,
# run 25, llama3 N=8192, bf16, chunks forced by chunk_bytes; ratio to the one-chunk dW error): bf16
# accumulation 1.03 / 1.05 / 1.06 / 1.06 / 1.07 / 1.07x at 2 / 3 / 4 / 5 / 6 / 8 chunks on random
# data, 1.10 / 1.13 / 1.15 / 1.20 / 1.22 / 1.26x on realistic data; float32 1.00x at every count.
# So bf16 stays within issue 34's 1.2x bar up to 4 chunks and float32 takes over from 5. The
# float32 halves cost 2 V_r H bytes (1 GiB at llama3, TP=1) and 3-10% time (run 23). Where the budget's
# plan has 5+ chunks, core.fused_plan_for takes 4 balanced chunks instead (bf16 dW) wherever they hold no
# more than the chunk plus that half: gemma at N=8192 (1.03 GiB instead of 1.98), llama3 / qwen3 up to
# N ~ 27k / 26k, gemma up to ~16k (TP=1); longer sequences keep the budget's chunks and the float32 half.
AUTO_MIN_CHUNKS = 5
_BLOCK_BYTES = 32 << 20  # the in-place conversion's row blocks (a temporary of this size)


def float32_extra_bytes(v: int, h: int) -> int:
    """Bytes the float32 accumulator of a ``[v, h]`` dW holds beyond the returned dW during the loop:
    its second half (``Float32DW``)."""
    return 4 * (v // 2) * h


def uses_float32(dtype: torch.dtype, chunks: int, settings: Settings) -> bool:
    """Whether the fused strategy accumulates dW in float32 for a ``dtype`` weight and ``chunks`` token chunks."""
    if dtype not in _SIXTEEN or settings.dw_accumulate == "native":
        return False
    return settings.dw_accumulate == "float32" or chunks >= AUTO_MIN_CHUNKS


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    if acc.device.type == "cuda":
        if first:
            torch.mm(a, b, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif first:
        torch.mm(a.float(), b.float(), out=acc)
    else:
        acc.addmm_(a.float(), b.float())


class Float32DW:
    """dW of a ``[v, h]`` 16-bit shard accumulated in float32 halves; :meth:`finish` returns it in ``dtype``."""

    def __init__(self, v: int, h: int, dtype: torch.dtype, device: torch.device) -> None:
        self.v, self.h, self.dtype = v, h, dtype
        self.split = -(-v // 2)
        self.halves = [
            torch.empty(self.split, h, dtype=torch.float32, device=device),
            torch.empty(v - self.split, h, dtype=torch.float32, device=device),
        ]

    def add(self, dz: torch.Tensor, x: torch.Tensor, first: bool) -> None:
        """``dW += dz.T @ x`` (``dz`` [rows, v], ``x`` [rows, h]); ``first``: write instead of add."""
        s = self.split
        for acc, cols in ((self.halves[0], slice(0, s)), (self.halves[1], slice(s, self.v))):
            if acc.numel():
                _addmm_f32_(acc, dz[:, cols].T, x, first)

    def finish(self) -> torch.Tensor:
        """The ``[v, h]`` dW in ``dtype``, in the first half's storage; the second half is freed."""
        lo, hi = self.halves
        self.halves = []
        out = torch.empty(0, dtype=self.dtype, device=lo.device)
        out.set_(lo.untyped_storage(), 0, (self.v, self.h), (self.h, 1))
        rows = max(1, _BLOCK_BYTES // max(1, 2 * self.h))
        # out rows [a, b) overlap lo's rows [a/2, b/2): all read by then (earlier blocks, or this
        # block's copy taken before the write)
        for a in range(0, self.split, rows):
            b = min(self.split, a + rows)
            out[a:b] = lo[a:b].to(self.dtype)
        if hi.numel():  # out rows [split, v) overlap lo's rows [split/2, v/2): all consumed above
            out[self.split :].copy_(hi)  # converts in the copy: no temporary of hi's size
        return out
