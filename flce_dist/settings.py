"""Execution settings: how the loss is computed, never what it computes.

``Settings`` is a frozen, hashable object: the byte budget of one materialised logits chunk, the
fused strategy's logits backend, kernel block-size overrides and the Helion config directory. A call
takes it explicitly (``fused_linear_cross_entropy(..., settings=Settings(chunk_bytes=...))``) or uses
the current default: the innermost ``override(...)`` block of the caller's context (a
``contextvars.ContextVar``: each thread and each asyncio task has its own), else the documented
environment defaults below (meant for benchmarks; read once, at the first call that needs them, never
at import; ``reload_env()`` reads them again). Nothing here writes the environment.

=====================  ==========================  ==============================================
field                  environment default          meaning
=====================  ==========================  ==============================================
``chunk_bytes``        ``FLCE_CHUNK_MB`` (MiB)      budget of one logits chunk; None: the plan in
                                                    ``chunking.py`` (CUDA: 1 GiB - 64 MiB over P)
``logits_backend``     ``FLCE_FUSED_LOGITS``        fused strategy and forward-only pass:
                                                    ``"helion"`` (one Helion pass forms the logits
                                                    and their statistics) or ``"cublas"`` (cuBLAS
                                                    chunk matmuls + ``chunk_stats``)
``grad_form``          ``FLCE_GRAD_FORM``           how the fused strategy forms dlogits:
                                                    ``"rowscale"`` (the logits pass stores row-scaled
                                                    exponentials, ``rowscale.py``; where it applies)
                                                    or ``"chunk_grad"`` (logits, then the chunk_grad_
                                                    pass over the chunk)
``blocks``             (none)                       ``{kernel: {block name: size}}`` overrides of the
                                                    shipped block sizes (tests force several tiles)
``config_dir``         ``FLCE_CONFIG_DIR``          directory of ``<arch>.json`` Helion configs
``dw_accumulate``      (none)                       the fused strategy's dW accumulator for a 16-bit
                                                    weight: ``"auto"`` (float32 from 5 token chunks
                                                    on: each chunk added in bf16 rounds dW once more,
                                                    1.13x the one-chunk error at 3 chunks, 1.20x at 5,
                                                    7.5x at 128), ``"float32"`` (always) or ``"native"`` (the
                                                    weight's dtype: no extra memory). float32 costs
                                                    2 bytes x V_local x H beyond the returned dW; so
                                                    under "auto" a plan of 5+ chunks becomes 4 (bf16
                                                    dW) where those hold no more memory than the
                                                    chunk plus that (``core.fused_plan_for``).
``filter_order``       (none)                       how the gradient filter (``grad_filter_eps``)
                                                    reads the shard in its sorted vocabulary order
                                                    (``vocab_order.py``): ``"gather"`` (default: the
                                                    logits pass, dX and dW read W and write dW
                                                    through the order, in both strategies: no copy,
                                                    peak <= exact's) or ``"copy"`` (a sorted copy of
                                                    the shard, + |W_r| memory; fused: 0-3% faster
                                                    than "gather", recompute: slower, run 30)
=====================  ==========================  ==============================================

Every rank of a tensor-parallel group must use the same settings (the chunk plan sets the number of
collectives); the loss compares them across ranks with its other options.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

LOGITS_BACKENDS = ("helion", "cublas")
GRAD_FORMS = ("rowscale", "chunk_grad")
DW_ACCUMULATE = ("auto", "float32", "native")
FILTER_ORDERS = ("copy", "gather")


def _freeze_blocks(blocks: Mapping[str, Mapping[str, int]] | tuple | None) -> tuple:
    if not blocks:
        return ()
    if isinstance(blocks, tuple):
        return blocks
    return tuple(sorted((k, tuple(sorted((n, int(s)) for n, s in v.items()))) for k, v in blocks.items()))


@dataclasses.dataclass(frozen=True)
class Settings:
    chunk_bytes: int | None = None
    logits_backend: str = "helion"
    blocks: tuple = ()
    config_dir: str | None = None
    grad_form: str = "rowscale"
    dw_accumulate: str = "auto"
    filter_order: str = "gather"

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", _freeze_blocks(self.blocks))
        if self.chunk_bytes is not None and (not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1):
            raise ValueError(f"chunk_bytes must be a positive int or None, got {self.chunk_bytes!r}")
        if self.logits_backend not in LOGITS_BACKENDS:
            raise ValueError(f"logits_backend must be one of {LOGITS_BACKENDS}, got {self.logits_backend!r}")
        if self.grad_form not in GRAD_FORMS:
            raise ValueError(f"grad_form must be one of {GRAD_FORMS}, got {self.grad_form!r}")
        if self.dw_accumulate not in DW_ACCUMULATE:
            raise ValueError(f"dw_accumulate must be one of {DW_ACCUMULATE}, got {self.dw_accumulate!r}")
        if self.filter_order not in FILTER_ORDERS:
            raise ValueError(f"filter_order must be one of {FILTER_ORDERS}, got {self.filter_order!r}")

    def block_overrides(self, kernel: str) -> dict[str, int]:
        return dict(next((v for k, v in self.blocks if k == kernel), ()))

    def replace(self, **changes: Any) -> Settings:
        if "blocks" in changes:  # merged per kernel with the current overrides
            merged = {k: dict(v) for k, v in self.blocks}
            for k, v in (changes["blocks"] or {}).items():
                merged[k] = {**merged.get(k, {}), **v}
            changes["blocks"] = merged
        return dataclasses.replace(self, **changes)

    def astuple(self) -> tuple:
        """Plain values in field order (``Settings(*s.astuple()) == s``)."""
        return (
            self.chunk_bytes,
            self.logits_backend,
            self.blocks,
            self.config_dir,
            self.grad_form,
            self.dw_accumulate,
            self.filter_order,
        )

    @classmethod
    def from_env(cls) -> Settings:
        """The documented environment defaults (benchmarks): FLCE_CHUNK_MB, FLCE_FUSED_LOGITS, FLCE_CONFIG_DIR,
        FLCE_GRAD_FORM, read now (``current()`` reads them once: see ``reload_env``)."""
        mb = os.environ.get("FLCE_CHUNK_MB")
        return cls(
            chunk_bytes=int(mb) << 20 if mb else None,
            logits_backend=os.environ.get("FLCE_FUSED_LOGITS", "helion"),
            config_dir=os.environ.get("FLCE_CONFIG_DIR") or None,
            grad_form=os.environ.get("FLCE_GRAD_FORM", "rowscale"),
        )


# The ``override`` blocks of each context, innermost last: a ContextVar, so that threads and asyncio
# tasks each see their own. TorchDynamo cannot trace ``ContextVar.get`` (a graph break), so a traced
# call reads a per-thread mirror of the same stack instead (``_TRACED.stack``, set and restored by
# ``override`` with the ContextVar); Dynamo guards on it, so a compiled function called under other
# overrides recompiles. The two differ only for asyncio tasks that interleave ``override`` blocks on
# one thread around compiled calls: pass ``settings=`` there.
_OVERRIDES: contextvars.ContextVar[tuple[Settings, ...]] = contextvars.ContextVar("flce_dist_overrides", default=())
_TRACED = threading.local()
_ENV: Settings | None = None  # the environment's defaults, read once (``reload_env``)


def reload_env() -> Settings:
    """Read the environment defaults again (``FLCE_*``; a program that changes them after its first
    call) and return them; ``current()`` otherwise reads them once."""
    global _ENV
    _ENV = Settings.from_env()
    return _ENV


def _env() -> Settings:
    return _ENV if _ENV is not None else reload_env()


def current() -> Settings:
    """The settings a call without ``settings=`` uses: the innermost ``override`` of this context, else
    the environment's (read once)."""
    stack = getattr(_TRACED, "stack", ()) if torch.compiler.is_compiling() else _OVERRIDES.get()
    return stack[-1] if stack else _env()


@contextlib.contextmanager
def override(
    *,
    blocks: Mapping[str, Mapping[str, int]] | None = None,
    chunk_bytes: int | None = None,
    fused_logits: str | None = None,
    logits_backend: str | None = None,
    config_dir: str | None = None,
    grad_form: str | None = None,
    dw_accumulate: str | None = None,
    filter_order: str | None = None,
) -> Iterator[Settings]:
    """Within the block, calls without ``settings=`` use the current settings with these changes
    (``blocks`` merged per kernel; ``fused_logits`` is the older name of ``logits_backend``)."""
    changes: dict[str, Any] = {}
    if blocks:
        changes["blocks"] = blocks
    if chunk_bytes is not None:
        changes["chunk_bytes"] = chunk_bytes
    backend = logits_backend if logits_backend is not None else fused_logits
    if backend is not None:
        if backend not in LOGITS_BACKENDS:
            raise ValueError(f"fused_logits must be 'helion' or 'cublas', got {backend!r}")
        changes["logits_backend"] = backend
    if config_dir is not None:
        changes["config_dir"] = config_dir
    if grad_form is not None:
        changes["grad_form"] = grad_form
    if dw_accumulate is not None:
        changes["dw_accumulate"] = dw_accumulate
    if filter_order is not None:
        changes["filter_order"] = filter_order
    new = current().replace(**changes)
    _OVERRIDES.set(_OVERRIDES.get() + (new,))
    _TRACED.stack = getattr(_TRACED, "stack", ()) + (new,)
    try:
        yield new
    finally:  # this block's entry, by identity (blocks left out of order leave the others in place)
        _OVERRIDES.set(_drop(_OVERRIDES.get(), new))
        _TRACED.stack = _drop(getattr(_TRACED, "stack", ()), new)


def _drop(stack: tuple[Settings, ...], entry: Settings) -> tuple[Settings, ...]:
    i = max((j for j, s in enumerate(stack) if s is entry), default=None)
    return stack if i is None else stack[:i] + stack[i + 1 :]
