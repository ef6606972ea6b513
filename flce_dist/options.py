"""The loss options: ``LossOptions`` is their single source of truth.

Each option is one dataclass field: its default, its meaning (``doc``) and its check live here, and
everything else is derived from the fields: the keyword names that ``fused_linear_cross_entropy``,
``FusedLinearCrossEntropyLoss``, ``VocabParallelLMHead`` and the integrations accept
(``LossOptions.keywords()``), the validation of a call (``__post_init__``: a ``TypeError`` or
``ValueError`` naming the option), the cross-rank call signature (``signature()``), and the
serialised form that the ``torch.compile`` custom op carries (``FLCEParams.encode``).

Adding an option = one field here, its keyword in ``api.fused_linear_cross_entropy``'s signature
(checked against the fields by a test), and its math (``core.py`` or a kernel).

``FLCEParams`` is what travels through the autograd core: the options, this rank's vocabulary slice
and the execution ``Settings``; its attributes read through to the options.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import numbers
from collections.abc import Callable
from functools import cache, lru_cache
from typing import Any

from .settings import Settings


def _int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {v!r}")
    if not -(2**63) <= int(v) < 2**63:
        raise ValueError(f"{name} must fit in int64, got {v}")
    return int(v)


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, (bool, numbers.Integral)) or v not in (0, 1):
        raise TypeError(f"{name} must be a bool, got {v!r}")
    return bool(v)


def _float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {v!r}")
    v = float(v)
    if not abs(v) < math.inf:  # NaN or inf (a comparison: traceable where math.isfinite of a SymFloat breaks the graph)
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def _choice(*allowed: str) -> Callable[[str, Any], str]:
    def check(name: str, v: Any) -> str:
        if v not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {v!r}")
        return v

    return check


def _in(lo: float, hi: float | None, *, lo_open: bool = False, hi_open: bool = True) -> Callable[[str, Any], float]:
    def check(name: str, v: Any) -> float:
        v = _float(name, v)
        ok = (v > lo if lo_open else v >= lo) and (hi is None or (v < hi if hi_open else v <= hi))
        if not ok:
            lb, rb = "(" if lo_open else "[", ")" if hi_open or hi is None else "]"
            raise ValueError(f"{name} must be in {lb}{lo}, {'inf' if hi is None else hi}{rb}, got {v}")
        return v

    return check


def _filter_eps(name: str, v: Any) -> float | str | None:
    if v is None or v == "auto":
        return v
    if isinstance(v, str):
        raise ValueError(f"{name} must be None, 'auto' or a number in [0, 1), got {v!r}")
    return _in(0.0, 1.0)(name, v)


def _softcap(name: str, v: Any) -> float | None:
    return None if v is None else _in(0.0, None, lo_open=True)(name, v)


KINDS = ("math", "call", "output")


def option(default: Any, check: Callable[[str, Any], Any], doc: str, kind: str = "math") -> Any:
    """One option. ``kind``: ``"math"`` (what is computed; every integration accepts it), ``"call"``
    (the call's shape: reduction, sequence parallelism) or ``"output"`` (extra return values)."""
    return dataclasses.field(default=default, metadata={"check": check, "doc": doc, "kind": kind})


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The options of one loss call (see the option table in docs/api.md; ``doc`` of each field)."""

    ignore_index: int = option(-100, _int, "targets equal to it give loss 0 and no gradient")
    reduction: str = option(
        "mean",
        _choice("mean", "sum", "none"),
        "'mean' (over non-ignored tokens, or num_items_in_batch), 'sum', 'none' (per token)",
        "call",
    )
    label_smoothing: float = option(0.0, _in(0.0, 1.0), "loss = lse - (1-eps) y_t - eps/V sum_v y_v (V global)")
    z_loss: float = option(0.0, _in(0.0, None), "adds z_loss * lse**2 per token")
    softcap: float | None = option(None, _softcap, "logits become c * tanh(z / c) (the model's final logits)")
    temperature: float = option(
        1.0,
        _in(0.0, None, lo_open=True),
        "the final (softcapped) logits are divided by it, as a sampler does: y = softcap(z) / temperature",
    )
    sequence_parallel: bool = option(
        False, _bool, "hidden/target are this rank's token slice (all-gathered in, dX reduce-scattered out)", "call"
    )
    partial_dx: bool = option(
        False,
        _bool,
        "the hidden gradient is this rank's partial dz_r @ W_r (no dX all-reduce; "
        "its sum over the group is dX), for a caller that reduces it itself; not with "
        "sequence_parallel or a DTensor hidden",
        "call",
    )
    strategy: str = option(
        "auto",
        _choice("auto", "fused", "recompute"),
        "'fused' (gradient formed in the forward), 'recompute', or 'auto'",
    )
    deterministic: bool = option(False, _bool, "bitwise reproducible dX sums across ranks (rank-ordered)")
    grad_filter_eps: float | str | None = option(
        None,
        _filter_eps,
        "opt-in gradient filter: (token x vocab) blocks whose every |dL/dz| is below eps times "
        "the row's gradient weight are skipped in the dX and dW matmuls (on the shard sorted by mean logit; the loss "
        "stays exact; W read through the order, no copy: Settings.filter_order); 'auto': 2**-12 "
        "for 16-bit inputs, CCE's default (none for 32/64-bit); None: exact",
    )
    return_lse: bool = option(False, _bool, "also return the global per-token lse", "output")
    return_token_accuracy: bool = option(False, _bool, "also return per-token target == argmax (bool)", "output")
    return_entropy: bool = option(
        False,
        _bool,
        "also return the per-token entropy of the (temperature-scaled, "
        "softcapped) softmax over the global vocabulary, with its gradient (0 for "
        "ignored tokens); needs the recompute strategy's backward",
        "call",
    )
    check_finite: bool = option(False, _bool, "raise FloatingPointError if the loss is not finite (a host sync)")
    check_inputs: bool = option(
        False,
        _bool,
        "debugging, with a group: every call also compares a checksum of 16 "
        "sampled rows of hidden across the ranks (a few more small kernels per call; "
        "docs/guarantees.md)",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        if self.partial_dx and self.sequence_parallel:
            raise ValueError(
                "partial_dx=True cannot be combined with sequence_parallel=True: the sequence-parallel "
                "dX is reduce-scattered to this rank's tokens (there is no partial of them to hand back)"
            )
        if self.grad_filter_eps is not None and self.label_smoothing > 0:
            raise ValueError(
                "grad_filter_eps cannot be combined with label_smoothing: the smoothing's uniform "
                "-eps/V gradient on every logit is below any filter threshold and would be dropped"
            )

    @classmethod
    def keywords(cls, *kinds: str) -> tuple[str, ...]:
        """The option names (of the given kinds; all without), in field order."""
        return _keywords(cls, kinds)  # type: ignore[arg-type]  # a class is hashable (mypy reads its instances' __hash__)

    @classmethod
    def check_keywords(cls, given: Any, where: str, *kinds: str) -> None:
        allowed = cls.keywords(*kinds)
        unknown = set(given) - set(allowed)
        if unknown:
            raise TypeError(f"{where}: unknown loss option(s) {sorted(unknown)}; allowed: {list(allowed)}")

    def replace(self, **changes: Any) -> LossOptions:
        """A copy with ``changes`` (validated); ``self`` when nothing changes (no re-validation on the
        per-call path: the API replaces the strategy and sequence_parallel on every call)."""
        if all(type(v) is type(getattr(self, k, None)) and getattr(self, k) == v for k, v in changes.items()):
            return self
        return dataclasses.replace(self, **changes)

    def signature(self) -> tuple:
        """The fields every rank of a group must agree on (all but the extra outputs), in field order.
        Reads a module constant (``_SIGNED``), not ``keywords()``: TorchDynamo traces this on every
        compiled call with a group and cannot trace ``dataclasses.fields`` of a class (a graph break)."""
        return tuple(getattr(self, k) for k in _SIGNED)

    # derived values used by the math
    @property
    def cap(self) -> float:
        """The kernels' cap ``c'`` (0.0 disables). The kernels form ``y = c' tanh(s z / c')`` with
        ``s = logit_scale``; ``c' = softcap / temperature`` and ``s = 1 / temperature`` make it
        ``softcap(z) / temperature`` = ``(c / T) tanh(z / c)``."""
        return 0.0 if self.softcap is None else self.softcap / self.temperature

    @property
    def logit_scale(self) -> float:
        """The kernels' scale ``s = 1 / temperature`` (see ``cap``)."""
        return 1.0 / self.temperature

    @property
    def needs_sum(self) -> bool:
        return self.label_smoothing > 0.0

    def filter_eps(self, dtype: Any) -> float:
        """The gradient filter's threshold for inputs of ``dtype`` (0.0: no filtering)."""
        if self.grad_filter_eps is None:
            return 0.0
        if self.grad_filter_eps == "auto":
            return 2.0**-12 if getattr(dtype, "itemsize", 4) == 2 else 0.0
        return float(self.grad_filter_eps)


@cache
def _keywords(cls: type, kinds: tuple[str, ...]) -> tuple[str, ...]:
    # cached: signature() asks for them on every call
    return tuple(f.name for f in dataclasses.fields(cls) if not kinds or f.metadata["kind"] in kinds)


@dataclasses.dataclass(frozen=True)
class FLCEParams:
    """What the autograd core receives: this rank's vocabulary slice, the options and the settings.
    Option attributes read through (``p.reduction`` is ``p.options.reduction``). ``stale_layout``:
    this rank's shard is not the one the once-per-layout check saw for the same stated layout
    (``distributed/shard.py``); the per-call guard then fails on every rank of the group. ``stand_in``
    (``(digest, raises)``, or empty): this call stands in for a call of another plan (``distributed/agree.py``),
    whose digest its guard sends (so the guard fails on every rank) and which raises where a failed guard
    would (CPU tensors, ``check_finite``)."""

    vocab_start: int
    vocab_size: int
    options: LossOptions
    settings: Settings
    stale_layout: bool = False
    stand_in: tuple = ()

    def __getattr__(self, name: str) -> Any:  # only called for names that are not fields
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(self.options, name)
        # memoized on the instance (the options are frozen): later reads are plain attribute reads, not a failed
        # lookup and this call (~0.4 us each, ~30 per fwd+bwd); not a field: eq, hash and replace ignore it
        object.__setattr__(self, name, value)
        return value

    @staticmethod
    def encode(
        vocab_start: int, vocab_size: int, options: LossOptions, settings: Settings, stale_layout: bool = False
    ) -> str:
        """The one string the ``torch.compile`` custom ops carry instead of positional options: the
        ``repr`` of plain values, built without making an FLCEParams, so that TorchDynamo folds it to
        a constant while tracing (it cannot trace ``json``, nor wrap some dataclass objects)."""
        opts = tuple(getattr(options, k) for k in _OPTION_NAMES)
        return repr((vocab_start, vocab_size, opts, settings.astuple(), bool(stale_layout)))

    @staticmethod
    @lru_cache(maxsize=256)
    def decode(text: str) -> FLCEParams:
        start, vocab, opts, settings, stale = ast.literal_eval(text)
        return FLCEParams(start, vocab, LossOptions(*opts), Settings(*settings), stale)


_OPTION_NAMES = LossOptions.keywords()
_SIGNED = LossOptions.keywords("math", "call")  # signature()'s fields, fixed at import (traceable)
