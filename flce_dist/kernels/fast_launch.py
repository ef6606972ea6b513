"""A Helion launcher that skips Triton's per-call argument binding on a repeat launch (CUDA, issue 53).

Helion's generated host function ends in ``_launcher(triton_kernel, grid, *args, num_warps=..,
num_stages=..)``; its default launcher calls ``triton_kernel.run(*args, grid=grid, warmup=False, ...)``,
which on every call reads the current device and stream, binds each argument to derive its
specialisation, formats the kernel-cache key, checks the kernel's globals and builds the launch
metadata, then calls the compiled kernel's ``run``. This launcher keeps that path for the first
launch of each specialisation (it compiles, launches and returns the ``CompiledKernel``) and, on a
repeat, calls ``CompiledKernel.run`` directly with the same positional arguments Triton would pass.

The cache key holds everything Triton specialises on, and more: per tensor its dtype and whether its
data pointer is 16-byte aligned (Triton's ``tt.divisibility`` on pointers); per ``constexpr`` parameter and
per bool its exact value; per run-time int (a token count, a stride) whether it is 1, a multiple of 16 and
within int32 (Triton's ``== 1`` and ``% 16`` specialisations and its i32 / i64 choice), not its value, so a
new token count hits; per float its type (Triton does not specialise float values); and the kernel, the
grid's rank, device, ``num_warps`` and ``num_stages`` (the grid itself is passed to each launch). A miss takes Triton's own path, so a key that is finer than Triton's costs at most a
bind, never a wrong kernel.

Falls back to Helion's default launcher (every call) where the direct call's assumptions do not
hold: extra launcher keywords (remote copies, PTX options, cooperative grids), an argument of another
type (a tensor subclass, a descriptor), a kernel with pre-run hooks, fewer positional arguments than
the kernel's parameters (defaults), and while any Triton launch hook is registered (profilers such as
proton read the launch metadata this path does not build), and while Triton's per-call knobs (``knobs.runtime.debug``,
``knobs.compilation.instrumentation_mode``, a stages inspection hook: Triton's launcher keys its kernels on them)
differ from those at the first launch of that specialisation (issue 61). The layout of ``CompiledKernel.run``'s
arguments is the one triton 3.6 through 3.9 use (``fast_path_supported``); another triton takes the
default launcher.

Used by ``launch._launch`` on CUDA tensors. Bounded: cleared at ``_MAX`` entries.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_COMPILED: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}  # key -> (CompiledKernel, Triton's knobs then)
_CONSTEXPR: dict[Any, tuple[bool, ...]] = {}  # per Triton kernel (one per bound kernel and config: bounded with them)
_MAX = 1024


@functools.cache
def fast_path_supported() -> bool:
    """Whether the installed triton's ``CompiledKernel.run`` takes the argument layout this module passes
    (triton 3.6 - 3.9: grid x3, stream, function, packed metadata, launch metadata, enter / exit hook, args)."""
    try:
        import triton

        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except (ImportError, ValueError):
        return False
    return (3, 6) <= (major, minor) <= (3, 9)


@functools.cache
def _default_launcher() -> Any:
    from helion.runtime import default_launcher

    return default_launcher


@functools.cache
def _runtime_knobs() -> Any:
    from triton import knobs

    return knobs.runtime


@functools.cache
def _compilation_knobs() -> Any:
    from triton import knobs

    return knobs.compilation


def _knob_state() -> tuple[Any, ...]:
    """Triton's per-call knobs that its own launcher (``JITFunction.run``, triton 3.6 - 3.9) folds into its kernel
    key: ``knobs.runtime.debug``, ``knobs.compilation.instrumentation_mode`` and a stages inspection hook
    (``knobs.runtime.add_stages_inspection_hook``). Read per launch (environment variables or set values)."""
    rt = _runtime_knobs()
    return (
        rt.debug,
        getattr(_compilation_knobs(), "instrumentation_mode", None),
        getattr(rt, "add_stages_inspection_hook", None),
    )


def _hooks_active() -> bool:
    """Whether a Triton launch hook is registered (a HookChain with calls, or a plain callable)."""
    rt = _runtime_knobs()
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return True
    return False


def _constexprs(triton_kernel: Any) -> tuple[bool, ...]:
    """Which of the kernel's parameters are ``tl.constexpr`` (their exact values are in Triton's key)."""
    got = _CONSTEXPR.get(triton_kernel)
    if got is None:
        got = _CONSTEXPR[triton_kernel] = tuple(bool(getattr(p, "is_constexpr", True)) for p in triton_kernel.params)
    return got


def _int_class(a: int) -> tuple[bool, bool, bool]:
    """What Triton specialises a run-time int on, and more: ``== 1``, ``% 16 == 0``, and whether it fits int32
    (Triton's i32 / i64 choice). A token count or a stride enters the key only through these."""
    return a == 1, a % 16 == 0, -(2**31) <= a < 2**31


def _spec(args: tuple[Any, ...], constexpr: tuple[bool, ...]) -> tuple[Any, ...] | None:
    key: list[Any] = []
    for a, ce in zip(args, constexpr, strict=False):  # False: the behaviour it had (B905 asks to choose)
        t = type(a)
        if t is torch.Tensor or t is torch.nn.Parameter:
            key.append((a.dtype, a.data_ptr() & 15 == 0))
        elif t is int:
            key.append((t, a) if ce else (t, _int_class(a)))
        elif t is bool:
            key.append((t, a))
        elif t is float:
            key.append(float)
        elif a is None:
            key.append(None)
        else:
            return None
    return tuple(key)


def launcher(
    triton_kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int, num_stages: int, **kwargs: Any
) -> Any:
    """Drop-in for ``helion.runtime.default_launcher`` (the ``_launcher=`` of a Helion host function)."""
    spec = None
    if not (kwargs or triton_kernel.pre_run_hooks or _hooks_active()) and len(args) == len(triton_kernel.params):
        spec = _spec(args, _constexprs(triton_kernel))
    if spec is None:
        return _default_launcher()(triton_kernel, grid, *args, num_warps=num_warps, num_stages=num_stages, **kwargs)
    dev = torch.cuda.current_device()
    key = (triton_kernel, len(grid), dev, num_warps, num_stages, spec)  # the grid is a launch argument
    got, knobs = _COMPILED.get(key), _knob_state()
    if got is None or got[1] != knobs:  # new, or Triton's knobs changed since: Triton's own launcher (its binary)
        k = _default_launcher()(triton_kernel, grid, *args, num_warps=num_warps, num_stages=num_stages)
        if got is None and hasattr(k, "packed_metadata"):
            if len(_COMPILED) >= _MAX:
                _COMPILED.clear()
            _COMPILED[key] = (k, knobs)
        return k
    k = got[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    k.run(
        grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(dev), k.function, k.packed_metadata, None, None, None, *args
    )
    return k
