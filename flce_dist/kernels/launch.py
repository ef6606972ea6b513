"""Kernel launch: shipped configs, block sizes, and the typed entry points the autograd core calls.

Configs live in ``flce_dist/configs/helion/<arch>.json`` (arch: ``h200`` for sm_90, ``sm<major><minor>`` for
other GPUs, ``cpu`` for reference mode; another directory through ``Settings.config_dir``), with an overlay
``<arch>@helion<series>.json`` per helion series whose generated code needs other configs (``config_files``): for each
kernel and dtype class a ``block`` dict (block sizes, passed to the kernel as constexpr arguments so
that reference mode also runs several tiles) and a ``config`` dict (``helion.Config`` fields). A first
call never autotunes; a shape outside the shipped classes uses the ``default`` entry; missing files
or entries fall back to ``DEFAULTS`` below. ``python -m flce_dist.tune`` writes new entries.

Entry points (each falls back to its kernel file's torch reference where the kernel cannot run):

    logits(x, w, bias, out)          cuBLAS x @ w.T (+ bias)
    lse_forward(x, w, b, tl, ...)    [N, 4] stats of x @ w.T, never stored (or stored to z_out, or
                                     their exponentials against exp_ref); on sm_90 without a bias
                                     the target logits from target_dot; [N, 5] with_ent (5th
                                     column: the shard's softmax entropy)
    chunk_stats(z, tl, ...)          [Nc, 4] (or [Nc, 5]) stats of a materialised chunk
    chunk_grad_(z, tl, lse, g, ...)  the chunk overwritten with its dlogits (with mu, gh: plus the
                                     entropy's gradient)
    dz_gated(x, w, dz, tl, lse, ...) dz = the chunk's dlogits from x, W, only where a device-side
                                     gate is open (the row-scale form's fallback)
    row_scale(acc, x, c, dx, xw)     dx = acc * c, xw = x * c per row, one pass (the row-scale form)
    merge(pmax, psum, ptgt, ...)     the logits passes' [T, N] partials -> [N, 4] (or [N, 5]) stats
    row_prepare(e, local, st, ...)   the row-scale form's c, target entries and gate for a chunk
    target_rows(target, ...)         shard-local target ids, valid and bad masks [N]
    token_rows(stats, valid, bad...) per-token loss, accuracy and lse from the global stats
    scale_(t, g)                     t *= grad_output in place, skipped on the device when it is 1

Helion is imported on the first launch, not with this module. On a CPU tensor the first launch
needs Helion's reference mode (``flce_dist.setup_reference_mode()``).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ..chunking import chunk_rows
from ..settings import Settings
from . import fast_launch

# lse_forward's ``store`` constexpr (literals in the kernel)
STORE_NONE, STORE_LOGITS, STORE_EXP = 0, 1, 2

DEFAULT_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "helion"  # package data (pyproject)

# Built-in defaults, used where no config file is found (e.g. an installed wheel without configs/).
DEFAULTS: dict[str, dict[str, Any]] = {
    "lse_forward": {
        "block": {"block_n": 256, "block_v": 128, "block_h": 64},
        "config": {"num_warps": 8, "num_stages": 3, "indexing": "tensor_descriptor", "l2_groupings": [8]},
    },
    "chunk_stats": {
        "block": {"block_n": 16, "block_s": 2048, "block_v": 512},
        "config": {"num_warps": 8, "num_stages": 2},
    },
    "chunk_grad": {"block": {"block_n": 32, "block_v": 256}, "config": {"num_warps": 8, "num_stages": 2}},
    # the gradient filter's block-sparse matmuls (not tuned yet: a first guess for sm90)
    # (block_n, block_v: the filter's mask blocks, which the dX and dW launches map onto block_m, block_k)
    "masked_mm": {
        "block": {"block_n": 128, "block_v": 64, "block_h": 128},
        "config": {"num_warps": 8, "num_stages": 3},
    },
    # a streaming pass, one tile per program: 128 bf16 per thread; run 18 (scale_probe), 1 GiB bf16:
    # grad_output 1 0.103 ms (4096-element tiles: 0.202), other values 0.548 ms = 3.84 TB/s (4096:
    # 0.672; torch._foreach_mul_ 0.781)
    "scale": {"block": {"block": 16384}, "config": {"num_warps": 4, "num_stages": 1}},
    # the row-scale form's two row scalings: a streaming pass, 32 elements per thread
    "row_scale": {"block": {"block_n": 4, "block_h": 1024}, "config": {"num_warps": 4, "num_stages": 1}},
    # the partial merge: 16 token columns per program (104 programs on a 1664-row gemma chunk), 256
    # tiles per step; run 19 (merge_probe.py): 204 us over six shapes vs 886 for torch, 519 for 64 x 32
    "merge": {"block": {"block_n": 16, "block_t": 256}, "config": {"num_warps": 8, "num_stages": 2}},
    # the row-scale form's per-row step: 23 programs at 2816 rows (~20 float32 loads/stores per row)
    "row_prepare": {"block": {"block_n": 128}, "config": {"num_warps": 4, "num_stages": 1}},
    # per-token bookkeeping around the logits pass ([N] vectors: 8 programs at N = 8192)
    "target_rows": {"block": {"block_n": 1024}, "config": {"num_warps": 4, "num_stages": 1}},
    "token_rows": {"block": {"block_n": 1024}, "config": {"num_warps": 4, "num_stages": 1}},
    # the row-scale form's fallback, closed in the common case: persistent programs (a closed gate
    # costs a scalar read per tile step), the store pass's blocks when open
    "dz_gated": {
        "block": {"block_n": 128, "block_v": 256, "block_h": 64},
        "config": {
            "num_warps": 8,
            "num_stages": 3,
            "indexing": "tensor_descriptor",
            "l2_groupings": [8],
            "pid_type": "persistent_interleaved",
        },
    },
    # the logits passes' target logits: 64 programs at a 8192-row call; block_h is always the calling
    # pass's own (the bits depend on it), set by lse_forward below
    "target_dot": {"block": {"block_n": 128, "block_h": 64}, "config": {"num_warps": 8, "num_stages": 3}},
}
CPU_DEFAULTS: dict[str, dict[str, Any]] = {
    "lse_forward": {"block": {"block_n": 512, "block_v": 4096, "block_h": 4096}, "config": {}},
    "chunk_stats": {"block": {"block_n": 512, "block_s": 65536, "block_v": 8192}, "config": {}},
    "chunk_grad": {"block": {"block_n": 512, "block_v": 8192}, "config": {}},
    "masked_mm": {"block": {"block_n": 512, "block_v": 1024, "block_h": 4096}, "config": {}},
    "scale": {"block": {"block": 1 << 20}, "config": {}},
    "dz_gated": {"block": {"block_n": 512, "block_v": 4096, "block_h": 4096}, "config": {}},
    "row_scale": {"block": {"block_n": 512, "block_h": 4096}, "config": {}},
    "merge": {"block": {"block_n": 4096, "block_t": 4096}, "config": {}},
    "row_prepare": {"block": {"block_n": 4096}, "config": {}},
    "target_rows": {"block": {"block_n": 1 << 16}, "config": {}},
    "token_rows": {"block": {"block_n": 1 << 16}, "config": {}},
    "target_dot": {"block": {"block_n": 512, "block_h": 4096}, "config": {}},
}
# the kernels' trailing constexpr block-size arguments, in order
BLOCK_ORDER = {
    "lse_forward": ("block_n", "block_v", "block_h"),
    "chunk_stats": ("block_n", "block_s", "block_v"),
    "chunk_grad": ("block_n", "block_v"),
    "masked_mm": ("block_m", "block_k", "block_h"),
    "scale": ("block",),
    "dz_gated": ("block_n", "block_v", "block_h"),
    "row_scale": ("block_n", "block_h"),
    "merge": ("block_n", "block_t"),
    "row_prepare": ("block_n",),
    "target_rows": ("block_n",),
    "token_rows": ("block_n",),
    "target_dot": ("block_n", "block_h"),
}


def arch_of(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return {(9, 0): "h200"}.get((major, minor), f"sm{major}{minor}")


_SPLIT: dict[torch.device, bool] = {}


def split_targets(device: torch.device) -> bool:
    """Whether a logits pass without a bias leaves its target logits to ``kernels/target_dot.py`` (sm_90):
    then the pass does not read the targets (the probes and tests emulate it on the CPU by replacing this).
    Cached per device (a capability query per call otherwise)."""
    got = _SPLIT.get(device)
    if got is None:
        got = _SPLIT[device] = arch_of(device) == "h200"
    return got


# Per-device dummies for the arguments a launch does not read (an absent bias, logits output, reference or
# index: constexpr flags keep the kernels from touching them): made once per (role, device, dtype), not per
# call (two small fill kernels per logits pass). One object per role: no tensor object twice in one launch.
_DUMMIES: dict[tuple[Any, ...], torch.Tensor] = {}


def _dummy(role: str, like: torch.Tensor, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    if type(like) not in (torch.Tensor, torch.nn.Parameter):  # a tensor subclass or mode (e.g. fake): made fresh
        return like.new_zeros(shape, dtype=dtype)
    key = (role, like.device, dtype, shape)
    t = _DUMMIES.get(key)
    if t is None:
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor whatever mode the first call ran in
            t = _DUMMIES[key] = torch.zeros(shape, dtype=dtype, device=like.device)
    return t


def helion_series() -> str | None:
    """``"<major>.<minor>"`` of the installed helion (from its metadata, without importing it)."""
    from .._helion_compat import _major_minor, helion_version

    mm = _major_minor(helion_version())
    return None if mm is None else f"{mm[0]}.{mm[1]}"


def config_files(arch: str, config_dir: str | None = None, helion: str | None = None) -> list[Path]:
    """The config files read for ``arch``, in the order they are merged: ``<arch>.json`` (the entries
    tuned under helion 1.4), then ``<arch>@helion<series>.json`` for the running helion series
    (e.g. ``h200@helion1.5.json``), whose entries replace the base file's entry by entry (per kernel
    and shape-class key) where the same ``helion.Config`` ran slower under that series."""
    root = Path(config_dir or DEFAULT_CONFIG_DIR)
    series = helion if helion is not None else helion_series()
    names = [f"{arch}.json"] + ([f"{arch}@helion{series}.json"] if series else [])
    return [root / n for n in names if (root / n).is_file()]


@cache
def load_configs(arch: str, config_dir: str | None = None, helion: str | None = None) -> dict[str, Any]:
    """The merged config table for ``arch`` (``config_files``): ``{kernel: {class key: entry}}``.
    ``helion`` names the series whose overlay is read (default: the installed helion's)."""
    merged: dict[str, Any] = {}
    for path in config_files(arch, config_dir, helion):
        for kernel, table in json.loads(path.read_text()).items():
            merged[kernel] = {**merged.get(kernel, {}), **table} if isinstance(table, dict) else table
    return merged


def dtype_class(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}[dtype]


def entry(
    kernel: str,
    device: torch.device,
    dtype: torch.dtype,
    variant: str = "",
    h: int | None = None,
    settings: Settings = Settings(),
) -> dict[str, Any]:
    """The shipped entry for ``kernel`` on ``device`` at ``dtype`` (``default`` if none).
    ``variant`` (e.g. ``"store"``: ``lse_forward`` writing the logits too) looks up
    ``<kernel>_<variant>`` first and falls back to the kernel's own entries; a variant with an
    underscore falls back through its prefixes (``"store_gather"``: the storing pass reading W
    through the gradient filter's order, then ``"store"``). ``h`` (the hidden size,
    for ``lse_forward``) selects a shape-class entry ``"<dtype>@h<h>"`` ahead of the dtype's own:
    the K loop's length sets how much of each tile's time the softmax epilogue takes.
    ``settings.blocks`` overrides the block sizes."""
    arch = arch_of(device)
    configs = load_configs(arch, settings.config_dir)
    table = configs.get(kernel, {})
    # "store_gather" looks up <kernel>_store_gather, then <kernel>_store, then the kernel's own entries
    parts = variant.split("_") if variant else []
    specials = [configs.get(f"{kernel}_{'_'.join(parts[:i])}", {}) for i in range(len(parts), 0, -1)]
    fallback = (CPU_DEFAULTS if arch == "cpu" else DEFAULTS)[kernel]
    dc = dtype_class(dtype)
    keys = ([f"{dc}@h{h}"] if h is not None else []) + [dc]
    e = (
        next((sp[k] for sp in specials for k in keys if k in sp), None)
        or next((table[k] for k in keys if k in table), None)
        or table.get("default")
        or fallback
    )
    block = {**fallback["block"], **e.get("block", {}), **settings.block_overrides(kernel)}
    return {"block": block, "config": e.get("config", {})}


@cache
def _kernels() -> dict[str, Any]:
    """The Helion kernels, imported on first use (Helion reads HELION_INTERPRET when they are made)."""
    from .chunk_grad import chunk_grad_
    from .chunk_stats import chunk_stats_partials
    from .dz_gated import dz_gated
    from .lse_forward import lse_forward_partials
    from .masked_mm import masked_mm
    from .merge import merge_stats
    from .row_prepare import row_prepare
    from .row_scale import row_scale
    from .scale import scale_
    from .target_dot import target_dot
    from .targets import target_rows
    from .token_loss import token_rows

    return {
        "lse_forward": lse_forward_partials,
        "target_dot": target_dot,
        "chunk_stats": chunk_stats_partials,
        "chunk_grad": chunk_grad_,
        "masked_mm": masked_mm,
        "scale": scale_,
        "dz_gated": dz_gated,
        "row_scale": row_scale,
        "merge": merge_stats,
        "row_prepare": row_prepare,
        "target_rows": target_rows,
        "token_rows": token_rows,
    }


# id(bound kernel) -> the config dict it runs (CUDA; None on CPU, where reference mode takes no config). Helion
# binds one BoundKernel per specialisation key, and the block sizes are arguments, so two entries that differ only
# in their helion.Config (another Settings(config_dir=...) in the same process) share one: each launch re-sets the
# config where the last launch of that bound kernel ran another (a compile-cache hit after the first time).
_CONFIGURED: dict[int, Any] = {}


def _configure(bound: Any, device: torch.device, cfg: dict[str, Any] | None) -> None:
    """Make ``bound`` run ``cfg`` (CUDA; None elsewhere) unless it already does."""
    if device.type != "cuda":
        _CONFIGURED[id(bound)] = None
        return
    cur = _CONFIGURED.get(id(bound))
    if cur is cfg or cur == cfg:
        return
    from .._helion_compat import helion

    assert cfg is not None  # every CUDA entry has a config
    bound.set_config(helion.Config(**cfg))
    _CONFIGURED[id(bound)] = cfg


def _ensure_mode(device: torch.device) -> None:
    if device.type == "cpu":
        from ..reference_mode import reference_mode_active, setup_reference_mode

        if not reference_mode_active():
            raise RuntimeError(
                "flce_dist kernels on CPU tensors run in Helion's reference mode: call "
                "flce_dist.setup_reference_mode() first (or set HELION_INTERPRET=1)"
            )
        setup_reference_mode()  # idempotent: the CPU aten::mm.dtype that reference-mode hl.dot needs


# The kernels' sizes fixed at compile time (``hl.specialize`` in the kernel file): (argument index, dim). Every
# other size is a run-time value (``static_shapes=False``): one bound kernel and a handful of Triton binaries
# serve every token count and vocabulary chunk (issue 60: a compile per new N cost 2-4 s).
STATIC_DIMS: dict[str, tuple[tuple[int, int], ...]] = {
    "lse_forward": ((0, 1),),
    "target_dot": ((0, 1),),
    "dz_gated": ((0, 1),),  # x's hidden size
}

# The launch cache: (kernel, device, dtype, variant, h, config_dir, block overrides, blocks, argument layout) ->
# (block values, bound kernel, config). A repeat call skips the config lookup and Helion's specialisation key
# (~15-20 us per launch on the host). The layout key (:func:`_arg_key`) holds what Helion keys a dynamic-shape
# kernel on, and more: per tensor its dtype, rank, whether each stride is 1 and 16-byte aligned (Helion's
# tensor-descriptor layout guard), whether it needs 64-bit indexing, and the exact ``STATIC_DIMS`` sizes; per
# scalar its type and value. No token count is in it, so a new N hits. Bounded: cleared at _CACHE_MAX entries.
_CACHE: dict[tuple[Any, ...], tuple[tuple[int, ...], Any, dict[str, Any]]] = {}
_CACHE_MAX = 1024
_INT32_MAX = 2**31 - 1  # Helion's 64-bit indexing threshold (numel above it)


def _arg_key(
    args: tuple[Any, ...], static: tuple[tuple[int, int], ...] = (), exact: bool = False
) -> tuple[Any, ...] | None:
    """The launch cache's argument key; ``exact``: every size and stride (a ``static_shapes=True`` kernel)."""
    key: list[Any] = []
    for a in args:
        t = type(a)
        if t is torch.Tensor or t is torch.nn.Parameter:
            if exact:
                key.append((a.dtype, a.device, a.shape, a.stride()))
                continue
            es = a.element_size()
            key.append(
                (a.dtype, a.device, tuple((st == 1, st * es % 16 == 0) for st in a.stride()), a.numel() > _INT32_MAX)
            )
        elif t is int or t is float or t is bool:
            key.append((t, a))
        elif a is None:
            key.append(None)
        else:  # a tensor subclass or another type: the full bind() path
            return None
    for i, d in static:
        key.append(args[i].shape[d])
    return tuple(key)


@cache
def _static_shapes(name: str) -> bool:
    """Whether kernel ``name`` specialises on every size (then the launch cache keys on exact shapes)."""
    return bool(_kernels()[name].settings.static_shapes)


def _bind(
    name: str,
    args: tuple[Any, ...],
    device: torch.device,
    dtype: torch.dtype,
    settings: Settings,
    variant: str,
    h: int | None,
    blocks: dict[str, int] | None,
) -> tuple[tuple[Any, ...], Any, bool]:
    """(the full argument tuple, its bound kernel, whether this is its first call)."""
    arg_key = _arg_key(args, STATIC_DIMS.get(name, ()), _static_shapes(name))
    key = (
        None
        if arg_key is None
        else (
            name,
            device,
            dtype,
            variant,
            h,
            settings.config_dir,
            settings.blocks,
            None if not blocks else tuple(sorted(blocks.items())),
            arg_key,
        )
    )
    hit = None if key is None else _CACHE.get(key)
    if hit is not None:
        if _CONFIGURED.get(id(hit[1])) is not hit[2]:  # another config ran on this bound kernel since
            _configure(hit[1], device, hit[2])
        return (*args, *hit[0]), hit[1], False
    _ensure_mode(device)
    e = entry(name, device, dtype, variant, h, settings)
    block = {**e["block"], **(blocks or {})}
    tail = tuple(block[k] for k in BLOCK_ORDER[name])
    full = (*args, *tail)
    bound = _kernels()[name].bind(full)
    first = id(bound) not in _CONFIGURED
    cfg = e["config"] if device.type == "cuda" else None
    _configure(bound, device, cfg)
    if key is not None:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = (tail, bound, _CONFIGURED[id(bound)])
    return full, bound, first


def _launch(
    name: str,
    args: tuple[Any, ...],
    device: torch.device,
    dtype: torch.dtype,
    settings: Settings,
    variant: str = "",
    h: int | None = None,
    blocks: dict[str, int] | None = None,
) -> Any:
    """Bind and run kernel ``name`` with its shipped entry (through the launch cache above). No tensor
    object may appear twice in ``args``: Helion 1.4 compiles aliased arguments into one parameter and its
    bind cache does not tell such a call from one with distinct tensors (a later call would read one
    argument through the other's pointer; benchmarks/NOTES.md, run 19). Views are distinct objects."""
    tensors = [id(a) for a in args if isinstance(a, torch.Tensor)]
    if len(set(tensors)) != len(tensors):
        raise AssertionError(f"kernels/launch.py: {name} was passed the same tensor object twice")
    full, bound, first = _bind(name, args, device, dtype, settings, variant, h, blocks)
    if device.type == "cuda":
        _triton_allocator()
        run = bound._run
        if FAST_LAUNCH and run is not None and not first and fast_launch.fast_path_supported():
            return run(*full, _launcher=fast_launch.launcher)  # kernels/fast_launch.py: no re-bind in Triton
    if first:
        with warnings.catch_warnings():  # the first call compiles: see kernels/common.py
            warnings.filterwarnings("ignore", message="max_num_sm_multipler is reduced", category=UserWarning)
            return bound(*full)
    return bound(*full)


def _triton_allocator() -> None:
    """Triton's allocator for a config whose kernel builds TMA descriptors on the device (``tensor_descriptor``
    indexing) is a context variable: set in the thread that first ran such a kernel, unset in another, e.g.
    autograd's backward thread, where the recompute strategy's logits pass runs (run 30: "Kernel requires a
    runtime memory allocation, but no allocator was set" from the gathered logits pass in backward). Helion's
    own setter, a no-op where one is set (a context-variable read per launch)."""
    global _SET_ALLOCATOR
    if _SET_ALLOCATOR is None:
        from helion.runtime import set_triton_allocator as _SET_ALLOCATOR
    _SET_ALLOCATOR()  # type: ignore[misc]  # set by the import above (mypy does not narrow a global there)


_SET_ALLOCATOR: Callable[[], None] | None = None

# Repeat CUDA launches through kernels/fast_launch.py (the compiled kernel's run, without Triton's per-call
# bind; the same kernel and the same bits). False: Helion's default launcher every time (the probes' A/B).
FAST_LAUNCH = True


def degenerate(*sizes: int) -> bool:
    """Helion 1.4 mis-compiles size-1 dims ("can only unsplat single-element tensors"): shapes with a
    dimension below 2 take the kernel file's torch reference (CPU reference mode included)."""
    return min(sizes) < 2


def logits(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` by cuBLAS, into ``out`` when given."""
    return torch.mm(x, w.T, out=out) if bias is None else torch.addmm(bias, x, w.T, out=out)


def cublas_logits(x: torch.Tensor) -> bool:
    """Inputs whose logits come from cuBLAS/torch matmuls (then ``chunk_stats``), not ``lse_forward``:
    float64 (``hl.dot`` has none) and float32 on CUDA. Helion 1.4's float32 ``hl.dot`` at
    ``dot_precision="ieee"`` ran 57x slower than cuBLAS on the H200 (benchmarks/NOTES.md, run 8),
    and cuBLAS follows the caller's ``torch.backends.cuda.matmul.allow_tf32`` exactly as torch does.
    (CPU float32 keeps the Helion kernel: reference mode is how CI covers it.)"""
    return cublas_dtype(x.dtype, x.device.type)


def cublas_dtype(dtype: torch.dtype, device_type: str) -> bool:
    """:func:`cublas_logits` of inputs of ``dtype`` on a device of ``device_type``."""
    return dtype == torch.float64 or (dtype == torch.float32 and device_type == "cuda")


def _torch_logits(x: torch.Tensor, v: int, settings: Settings) -> bool:
    """Whether a logits pass over ``v`` rows of W takes cuBLAS logits + ``chunk_stats`` (or, storing
    exponentials, the torch reference) rather than the Helion pass: size-1 dims (Helion 1.4 bug),
    float64, CUDA float32 (:func:`cublas_logits`) and ``Settings(logits_backend="cublas")``."""
    return degenerate(*x.shape, v) or cublas_logits(x) or settings.logits_backend == "cublas"


def lse_forward(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    target_local: torch.Tensor,
    scale: float,
    softcap: float,
    with_sum: bool,
    settings: Settings,
    z_out: torch.Tensor | None = None,
    with_ent: bool = False,
    exp_ref: torch.Tensor | None = None,
    w_perm: torch.Tensor | None = None,
    prepare: Callable[[], Any] | None = None,
) -> torch.Tensor:
    """Per-row ``[N, 4]`` stats (shard lse, target logit, sum of logits, max logit) in float32
    (float64 for float64), ``[N, 5]`` with ``with_ent`` (plus the shard's softmax entropy); the logits
    are written to ``z_out`` [N, V] when given (the fused strategy), else never stored. With
    ``exp_ref`` [N] (float32) ``z_out`` receives ``exp(y - exp_ref)`` instead of the logits (the
    row-scale gradient, ``rowscale.py``). With ``w_perm`` [V] (int32) the pass runs on the rows
    ``w[w_perm]``, read through the index (no copy; ``bias`` and ``target_local`` in that order).
    ``prepare`` (the fused strategy's first chunk): a callable that writes ``target_local`` (its values may
    not be there yet), called before the first launch that reads them: after the logits pass itself where
    that pass leaves its target logits to ``target_dot`` (sm_90 without a bias: the pass goes first, its
    targets' host work then overlaps it on an idle GPU), else first."""
    if prepare is not None and not (
        bias is None and split_targets(x.device) and w_perm is None and not _torch_logits(x, w.shape[0], settings)
    ):
        prepare()
        prepare = None
    if w_perm is not None and _torch_logits(x, w_perm.numel(), settings):
        w, w_perm = w.index_select(0, w_perm), None  # the torch paths take a copy (lse_forward_gathered: by blocks)
    store = STORE_EXP if exp_ref is not None else (STORE_LOGITS if z_out is not None else STORE_NONE)
    if _torch_logits(x, w.shape[0], settings):
        # size-1 dims (Helion 1.4 bug), float64, CUDA float32 and Settings(logits_backend="cublas"):
        # cuBLAS logits + chunk_stats, token chunk by token chunk when nothing asks for the logits
        # (memory O(chunk))
        if store == STORE_EXP:  # (the fused strategy takes it on Helion logits only: here for size-1 dims)
            from .lse_forward import lse_forward_reference

            return lse_forward_reference(x, w, bias, target_local, scale, softcap, with_sum, z_out, with_ent, exp_ref)

        def stats(xc: torch.Tensor, tc: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            return chunk_stats(logits(xc, w, bias, out), tc, scale, softcap, with_sum, settings, with_ent)

        n = x.shape[0]
        rows = n if z_out is not None or n == 0 else chunk_rows(n, w.shape[0], x.element_size(), x.device, settings)
        if rows >= n:
            return stats(x, target_local, z_out)
        return torch.cat([stats(x[i : i + rows], target_local[i : i + rows], None) for i in range(0, n, rows)])
    b = bias if bias is not None else _dummy("bias", w, w.dtype, 1)
    zo = z_out if z_out is not None else _dummy("z", x, x.dtype, 1, 1)
    ref = exp_ref if exp_ref is not None else _dummy("ref", x, torch.float32, 1)
    # on sm_90 a pass without a bias leaves its target logits to kernels/target_dot.py (the same bits,
    # without a compare per element); elsewhere (other GPUs, reference mode) the pass finds them itself
    nt = bias is None and split_targets(x.device)
    # the pass that reads W through an index has its own entry (pointer loads for W, not TMA), else "store"'s
    variant = ("store_gather" if w_perm is not None else "store") if z_out is not None else ""
    perm = w_perm.to(torch.int32) if w_perm is not None else _dummy("perm", target_local, torch.int32, 1)
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] = _launch(
        "lse_forward",
        (
            x,
            w,
            b,
            target_local,
            zo,
            ref,
            perm,
            float(scale),
            float(softcap),
            bool(bias is not None),
            store,
            bool(with_sum),
            bool(with_ent),
            not nt,
            w_perm is not None,
        ),
        x.device,
        x.dtype,
        settings,
        variant,
        x.shape[1],
    )
    if prepare is not None:  # the pass does not read the targets (nt): their host work now overlaps it
        prepare()
    if nt:
        # the pass's own block_h (the bits depend on it)
        block_h = entry("lse_forward", x.device, x.dtype, variant, x.shape[1], settings)["block"]["block_h"]
        wrows = target_local  # target_dot gathers the targets' rows of w: in w's own order
        if w_perm is not None:
            wrows = torch.where(target_local >= 0, perm[target_local.clamp(min=0).long()], target_local)
        ptgt = _launch(
            "target_dot",
            (x, w, wrows, float(scale), float(softcap)),
            x.device,
            x.dtype,
            settings,
            blocks={"block_h": block_h},
        )
        parts = (parts[0], parts[1], ptgt, parts[3], parts[4])
    return merge(*parts, with_sum, with_ent, settings)


def gather_bounds(v: int, rows: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the blocks of ``rows`` rows that cover ``v`` sorted positions; a last block
    of one row takes 8 from the one before (a size-1 dim takes the torch path; columns stay 8-aligned)."""
    bounds = [(s, min(v, s + rows)) for s in range(0, v, max(1, rows))]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1 and rows > 8:
        (s0, _), (_, e) = bounds[-2], bounds[-1]
        bounds[-2:] = [(s0, e - 9), (e - 9, e)]
    return bounds


def lse_forward_gathered(
    x: torch.Tensor,
    w: torch.Tensor,
    bias_sorted: torch.Tensor | None,
    perm: torch.Tensor,
    target_sorted: torch.Tensor,
    scale: float,
    softcap: float,
    with_sum: bool,
    settings: Settings,
    z_out: torch.Tensor,
    block_rows: int,
    with_ent: bool = False,
) -> torch.Tensor:
    """:func:`lse_forward` with ``z_out`` on the rows ``w[perm]`` without a copy of ``w[perm]`` (the
    gradient filter's sorted order, ``Settings(filter_order="gather")``): ``perm`` [V] (int32),
    ``bias_sorted`` = ``bias[perm]``, ``target_sorted`` the targets as sorted positions (-1: none here);
    column ``j`` of ``z_out`` [N, V] receives the logits of row ``perm[j]``.

    Helion logits: one pass that loads W's tiles through ``perm`` (``lse_forward_partials``'
    ``permute_w``): no extra traffic. Where the forward takes cuBLAS (float64, CUDA float32,
    ``Settings(logits_backend="cublas")``, size-1 dims), block by block of ``block_rows`` sorted
    positions (:func:`gather_bounds`)::

        wb = w[perm[s:e]]                       # index_select into one [block_rows, H] buffer
        z_out[:, s:e] = x @ wb.T (+ b)          # cuBLAS, into the column block
    then one ``chunk_stats`` over ``z_out``."""
    v = perm.numel()
    if not (degenerate(*x.shape, v) or cublas_logits(x) or settings.logits_backend == "cublas"):
        return lse_forward(
            x,
            w,
            bias_sorted,
            target_sorted,
            scale,
            softcap,
            with_sum,
            settings,
            z_out=z_out,
            with_ent=with_ent,
            w_perm=perm,
        )
    bounds = gather_bounds(v, block_rows)
    wbuf = w.new_empty(max((e - s for s, e in bounds), default=0), w.shape[1])
    for s, e in bounds:
        wb = torch.index_select(w, 0, perm[s:e], out=wbuf[: e - s])
        logits(x, wb, bias_sorted[s:e] if bias_sorted is not None else None, out=z_out[:, s:e])
    return chunk_stats(z_out, target_sorted, scale, softcap, with_sum, settings, with_ent)


def chunk_stats(
    z: torch.Tensor,
    target_local: torch.Tensor,
    scale: float,
    softcap: float,
    with_sum: bool,
    settings: Settings,
    with_ent: bool = False,
) -> torch.Tensor:
    """Per-row ``[Nc, 4]`` stats (lse, target logit, sum, max) of a materialised logits chunk ``z``;
    ``[Nc, 5]`` with ``with_ent`` (plus the chunk's softmax entropy)."""
    k = 5 if with_ent else 4
    if z.numel() == 0 or degenerate(*z.shape):
        from .chunk_stats import chunk_stats_reference

        return torch.stack(chunk_stats_reference(z, target_local, scale, softcap, with_sum, with_ent)[:k], dim=1)
    from .chunk_stats import target_logit

    blk = entry("chunk_stats", z.device, z.dtype, settings=settings)["block"]
    bs = max(blk["block_v"], blk["block_s"] // blk["block_v"] * blk["block_v"])
    pmax, psum, psumy, pent = _launch(
        "chunk_stats",
        (z, float(scale), float(softcap), bool(with_sum), bool(with_ent)),
        z.device,
        z.dtype,
        settings,
        blocks={"block_s": bs},
    )  # split: a multiple of the tile
    return merge(
        pmax, psum, target_logit(z, target_local, scale, softcap)[None], psumy, pent, with_sum, with_ent, settings
    )


def merge(
    pmax: torch.Tensor,
    psum: torch.Tensor,
    ptgt: torch.Tensor,
    psumy: torch.Tensor,
    pent: torch.Tensor,
    with_sum: bool,
    with_ent: bool,
    settings: Settings,
) -> torch.Tensor:
    """The ``[T, N]`` partials of ``lse_forward`` / ``chunk_stats`` merged into ``[N, 4]`` stats
    (``[N, 5]`` with ``with_ent``) in one launch (kernels/merge.py); float64 and size-1 dims take
    ``lse_forward.merge_partials`` (torch). ``ptgt`` may be one row (``chunk_stats``' target logit):
    the kernel sums its rows on their own."""
    if pmax.dtype != torch.float32 or degenerate(*pmax.shape):
        from .lse_forward import merge_partials

        return merge_partials(pmax, psum, ptgt, psumy, pent, with_sum, with_ent)
    out = torch.empty(pmax.shape[1], 5 if with_ent else 4, dtype=torch.float32, device=pmax.device)
    return _launch(
        "merge", (pmax, psum, ptgt, psumy, pent, out, bool(with_sum), bool(with_ent)), pmax.device, pmax.dtype, settings
    )


def chunk_grad_(
    z: torch.Tensor,
    target_local: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    eps_over_v: float,
    one_minus_eps: float,
    two_zl: float,
    softcap: float,
    settings: Settings,
    mu: torch.Tensor | None = None,
    gh: torch.Tensor | None = None,
) -> torch.Tensor:
    """Overwrite the logits chunk ``z`` with its dlogits (see kernels/chunk_grad.py); with ``mu``
    and ``gh`` [Nc] (the global ``sum_v p y`` and dL/dentropy per row) the entropy's gradient too."""
    if z.numel() == 0:
        return z
    if degenerate(*z.shape):
        from .chunk_grad import chunk_grad_reference_

        return chunk_grad_reference_(z, target_local, lse, g, scale, eps_over_v, one_minus_eps, two_zl, softcap, mu, gh)
    return _chunk_grad(z, target_local, lse, g, scale, eps_over_v, one_minus_eps, two_zl, softcap, settings, mu, gh)[0]


def _chunk_grad(
    z,
    target_local,
    lse,
    g,
    scale,
    eps_over_v,
    one_minus_eps,
    two_zl,
    softcap,
    settings,
    mu,
    gh,
    block_v: int | None = None,
):
    with_ent = gh is not None
    return _launch(
        "chunk_grad",
        (
            z,
            target_local,
            lse,
            g,
            mu if with_ent else g[:1],
            gh if with_ent else g[:1],
            float(scale),
            float(eps_over_v),
            float(one_minus_eps),
            float(two_zl),
            float(softcap),
            with_ent,
            block_v is not None,
        ),
        z.device,
        z.dtype,
        settings,
        blocks=None if block_v is None else {"block_v": block_v},
    )


def dz_gated(
    x: torch.Tensor,
    w: torch.Tensor,
    dz: torch.Tensor,
    target_local: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    gate: torch.Tensor,
    scale: float,
    two_zl: float,
    settings: Settings,
) -> torch.Tensor:
    """``dz`` [Nc, V] overwritten with the chunk's dlogits recomputed from ``x``, ``w`` where ``gate``
    (a [1] int32 device tensor) is nonzero, left as it is where it is 0 (kernels/dz_gated.py)."""
    if dz.numel() == 0:
        return dz
    if degenerate(*x.shape, w.shape[0]):
        from .dz_gated import dz_gated_reference

        return dz_gated_reference(x, w, dz, target_local, lse, g, gate, scale, two_zl)
    return _launch(
        "dz_gated", (x, w, dz, target_local, lse, g, gate, float(scale), float(two_zl)), x.device, x.dtype, settings
    )


def row_scale(
    acc: torch.Tensor, x: torch.Tensor, c: torch.Tensor, dx: torch.Tensor, xw: torch.Tensor, settings: Settings
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx = round(acc * c[:, None])`` and ``xw = round(x * c[:, None])`` in one pass
    (kernels/row_scale.py: the row-scale form's dX and dW operand)."""
    if x.numel() == 0 or degenerate(*x.shape):
        from .row_scale import row_scale_reference

        return row_scale_reference(acc, x, c, dx, xw)
    return _launch("row_scale", (acc, x, c, dx, xw), x.device, x.dtype, settings)


def row_prepare(
    e: torch.Tensor,
    local: torch.Tensor,
    st: torch.Tensor,
    r: torch.Tensor,
    target_local: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    two_zl: float,
    max_spread: float,
    min_c: float,
    max_target: float,
    settings: Settings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-scale form's step for one chunk (kernels/row_prepare.py): the target entries of ``e``
    [Nc, V] rewritten in place; returns the row scales ``c`` [Nc] float32 (as computed) and the gate
    [1] int32 (1 where a row is outside the bounds)."""
    c = torch.empty(r.shape[0], dtype=torch.float32, device=r.device)
    gate = torch.zeros(1, dtype=torch.int32, device=r.device)
    # local[:, 3] (a view: never the same object as st, which it is at TP = 1; kernels/row_prepare.py)
    _launch(
        "row_prepare",
        (
            e.view(-1),
            local[:, 3],
            st,
            r,
            target_local,
            g,
            c,
            gate,
            e.shape[1],
            float(scale),
            float(two_zl),
            float(max_spread),
            float(min_c),
            float(max_target),
        ),
        e.device,
        e.dtype,
        settings,
    )
    return c, gate


def target_rows(
    target: torch.Tensor,
    vocab_start: int,
    v_local: int,
    vocab_size: int,
    ignore_index: int,
    settings: Settings,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tl, valid, bad)`` for int64 ``target`` [N] (kernels/targets.py): shard-local ids (int32,
    -1 where ignored or on another rank), ``target != ignore_index``, and the valid targets outside
    ``[0, vocab_size)``; written into ``out`` (three [N] tensors of those dtypes) when given."""
    if degenerate(target.shape[0]):
        from .targets import target_rows_reference

        got = target_rows_reference(target, vocab_start, v_local, vocab_size, ignore_index)
        if out is None:
            return got
        for o, g in zip(out, got, strict=True):
            o.copy_(g)
        return out
    n = target.shape[0]
    if out is not None:
        tl, valid, bad = out
    else:
        tl = torch.empty(n, dtype=torch.int32, device=target.device)
        valid = torch.empty(n, dtype=torch.bool, device=target.device)
        bad = torch.empty(n, dtype=torch.bool, device=target.device)
    _launch(
        "target_rows",
        (target, tl, valid, bad, int(vocab_start), int(v_local), int(vocab_size), int(ignore_index)),
        target.device,
        torch.float32,
        settings,
    )
    return tl, valid, bad


def token_rows(
    stats: torch.Tensor,
    valid: torch.Tensor,
    bad: torch.Tensor,
    label_smoothing: float,
    vocab_size: int,
    z_loss: float,
    settings: Settings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, correct, lse)`` per token from the global stats [N, >=4] (kernels/token_loss.py)."""
    one_minus_eps, eps_over_v = 1.0 - label_smoothing, label_smoothing / vocab_size
    if stats.dtype != torch.float32 or degenerate(stats.shape[0]):
        from .token_loss import token_rows_reference

        return token_rows_reference(stats, valid, bad, one_minus_eps, eps_over_v, z_loss)
    n = stats.shape[0]
    loss, lse = (torch.empty(n, dtype=torch.float32, device=stats.device) for _ in range(2))
    correct = torch.empty(n, dtype=torch.bool, device=stats.device)
    _launch(
        "token_rows",
        (
            stats,
            valid,
            bad,
            loss,
            correct,
            lse,
            float(one_minus_eps),
            float(eps_over_v),
            float(z_loss),
            bool(label_smoothing > 0),
            bool(z_loss > 0),
        ),
        stats.device,
        stats.dtype,
        settings,
    )
    return loss, correct, lse


def scale_(t: torch.Tensor, g: torch.Tensor, settings: Settings, rounded: dict | None = None) -> torch.Tensor:
    """``t *= g`` in place (``g`` a 1-element tensor, e.g. grad_output), a no-op decided on the device
    when ``g == 1`` (kernels/scale.py). 16-bit and float32 contiguous tensors of under 2**31 elements
    (the kernel's int32 offsets) take the kernel; others, and size-0/1 shapes, torch's ``mul_``."""
    n = t.numel()
    if (
        t.dtype not in (torch.bfloat16, torch.float16, torch.float32)
        or not t.is_contiguous()
        or n >= 2**31
        or degenerate(n)
    ):
        from .scale import scale_reference_

        return scale_reference_(t, g)
    # g rounded to t's dtype first: bit-identical to torch's t * g.to(t.dtype); ``rounded`` ({dtype: operand}, the
    # caller's, for one g): one cast pair for several gradients of one dtype
    gr = None if rounded is None else rounded.get(t.dtype)
    if gr is None:
        gr = g.reshape(1).to(t.dtype).to(torch.float32)
        if rounded is not None:
            rounded[t.dtype] = gr
    _launch("scale", (t.view(-1), gr), t.device, t.dtype, settings)
    return t


def masked_blocks(device: torch.device, dtype: torch.dtype, settings: Settings) -> tuple[int, int]:
    """(block_n, block_v) of the gradient filter's block mask: the ``masked_mm`` entry's, which the
    dX and dW matmuls and the ``chunk_grad_`` pass that records the mask use."""
    b = entry("masked_mm", device, dtype, settings=settings)["block"]
    return b["block_n"], b["block_v"]


def _torch_masked(dtype: torch.dtype, *sizes: int) -> bool:
    """float64 (``hl.dot`` has none) and size-1 dims (Helion 1.4) take the torch references."""
    return dtype == torch.float64 or degenerate(*sizes)


def chunk_grad_filtered_(
    z: torch.Tensor,
    target_local: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    row_scale: torch.Tensor,
    eps: float,
    scale: float,
    eps_over_v: float,
    one_minus_eps: float,
    two_zl: float,
    softcap: float,
    settings: Settings,
    mu: torch.Tensor | None = None,
    gh: torch.Tensor | None = None,
) -> torch.Tensor:
    """``chunk_grad_`` that also returns the block mask ``keep [ceil(Nc/BN), ceil(Vc/BV)]`` (bool) of
    the gradient filter: a block is kept when some entry has ``|dL/dz| >= eps * row_scale`` (rows
    with ``row_scale`` 0, e.g. ignored tokens, keep nothing)."""
    bn, bv = masked_blocks(z.device, z.dtype, settings)
    n, v = z.shape
    if z.numel() == 0 or degenerate(*z.shape):
        from .chunk_grad import chunk_grad_reference_

        chunk_grad_reference_(z, target_local, lse, g, scale, eps_over_v, one_minus_eps, two_zl, softcap, mu, gh)
        pad = torch.zeros(n, -v % bv, dtype=torch.float32, device=z.device)
        absmax = torch.cat([z.abs().float(), pad], 1).view(n, -1, bv).amax(2).T if v else z.new_zeros(0, n).float()
    else:
        _, absmax = _chunk_grad(
            z, target_local, lse, g, scale, eps_over_v, one_minus_eps, two_zl, softcap, settings, mu, gh, block_v=bv
        )
    thresh = eps * row_scale.to(torch.float32)
    hit = (absmax >= thresh[None, :]) & (thresh > 0)[None, :]  # [n_vt, Nc]
    hit = torch.cat([hit, hit.new_zeros(hit.shape[0], -n % bn)], 1)
    return (
        hit.view(hit.shape[0], hit.shape[1] // bn, bn).any(2).T.contiguous()
    )  # explicit sizes: an empty shard has 0 tiles


def _masked_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    keep: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    block_m: int,
    block_k: int,
    settings: Settings,
    variant: str,
    b_perm: torch.Tensor | None = None,
    out_perm: torch.Tensor | None = None,
) -> torch.Tensor:
    if a.numel() == 0:
        if accumulate:
            return out
        return out.zero_() if out_perm is None else out.index_fill_(0, out_perm.long(), 0)  # int64 index
    if _torch_masked(a.dtype, *a.shape, b.shape[1]):
        from .masked_mm import masked_mm_reference

        return masked_mm_reference(a, b, keep, out, accumulate, block_m, block_k, b_perm, out_perm)
    from .masked_mm import compact

    # distinct dummies for an unused index (no tensor object twice in one launch: see _launch)
    bp = b_perm.to(torch.int32) if b_perm is not None else a.new_empty(1, dtype=torch.int32)  # never read
    op = out_perm.to(torch.int32) if out_perm is not None else a.new_empty(1, dtype=torch.int32)
    return _launch(
        "masked_mm",
        (a, b, *compact(keep), out, bp, op, bool(accumulate), b_perm is not None, out_perm is not None),
        a.device,
        a.dtype,
        settings,
        variant,
        blocks={"block_m": block_m, "block_k": block_k},
    )


def dx_masked(
    dz: torch.Tensor,
    w: torch.Tensor,
    keep: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    settings: Settings,
    w_perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out (+)= dz @ w`` over the kept blocks of ``dz`` (kernels/masked_mm.py); with ``w_perm`` the
    columns of ``dz`` are the rows ``w[w_perm]`` (the filter's vocabulary order, no sorted copy of ``w``)."""
    bn, bv = masked_blocks(dz.device, dz.dtype, settings)
    return _masked_mm(dz, w, keep, out, accumulate, bn, bv, settings, "", b_perm=w_perm)  # the masked_mm entry


def dw_masked(
    dz: torch.Tensor,
    x: torch.Tensor,
    keep: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    settings: Settings,
    out_perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out (+)= dz.T @ x`` over the kept blocks of ``dz``: the same kernel on the transposed views; with
    ``out_perm`` row ``j`` of ``dz.T @ x`` goes to ``out[out_perm[j]]`` (the shard's own row order)."""
    bn, bv = masked_blocks(dz.device, dz.dtype, settings)
    return _masked_mm(
        dz.T, x, keep.T, out, accumulate, bv, bn, settings, "dw", out_perm=out_perm
    )  # masked_mm_dw, else masked_mm
