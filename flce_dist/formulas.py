"""Small formulas shared by the kernels' torch references, the autograd core and the reference.

``transform``         the kernels' logit transform ``y = c' tanh(s z / c')``; the options pass ``s = 1 / T``
                      and ``c' = c / T`` (``LossOptions.cap``), which is ``softcap_c(z) / T``
``acc_dtype``         the dtype statistics and accumulators use: float64 for float64 inputs, else float32
``mean_denominator``  the unweighted mean's divisor: ``num_items_in_batch`` if given, else the number of
                      non-ignored tokens; at least 1 (an all-ignored batch has loss 0). What each reduction
                      divides by, weighted or not, is stated once, in ``core._Tokens``
"""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def transform(z: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """``z * scale`` then ``softcap * tanh(. / softcap)`` (``softcap`` 0: none), in ``acc_dtype``."""
    y = z.to(acc_dtype(z.dtype)) * scale
    return softcap * torch.tanh(y / softcap) if softcap > 0 else y


def mean_denominator(valid: torch.Tensor, num_items: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if num_items is None and valid.dtype == torch.bool and valid.numel() < 2**24:
        # the count summed in ``dtype``: exact below 2**24 (float32's integers), the same bits, one kernel less
        return valid.sum(dtype=dtype).clamp_(min=1)
    denom = num_items if num_items is not None else valid.sum()
    return torch.as_tensor(denom, device=valid.device).to(dtype).clamp(min=1)
