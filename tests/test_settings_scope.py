"""Process-global state (issue #34 item 10): the environment defaults are read once, an
``override`` block belongs to its context (thread, asyncio task), a compiled call reads it without a
graph break and recompiles when it changes, and ``setup_reference_mode()`` leaves the environment
alone. Each test failed on the tree before the fix (a module-global override list, the environment
re-read on every call, ``os.environ["HELION_INTERPRET"] = "1"``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading

import torch

import flce_dist
from flce_dist import compile_op, reference_loss, settings

from ._checks import SMALL_BLOCKS, rel


def test_environment_is_read_once(monkeypatch):
    base = settings.current()
    try:
        monkeypatch.setenv("FLCE_CHUNK_MB", "7")
        assert settings.current() == base  # not re-read per call
        assert settings.reload_env().chunk_bytes == 7 << 20 and settings.current().chunk_bytes == 7 << 20
    finally:
        monkeypatch.delenv("FLCE_CHUNK_MB")
        settings.reload_env()


def test_override_is_per_thread():
    base = settings.current()
    seen = {}
    with settings.override(chunk_bytes=123):
        worker = threading.Thread(target=lambda: seen.setdefault("thread", settings.current()))
        worker.start()
        worker.join()
        assert settings.current().chunk_bytes == 123
    assert seen["thread"] == base, seen  # another thread never sees this thread's block
    assert settings.current() == base


def test_override_is_per_asyncio_task():
    seen = []

    async def task(budget):
        with settings.override(chunk_bytes=budget):
            await asyncio.sleep(0)  # the other task enters its own block here
            seen.append((budget, settings.current().chunk_bytes))
            await asyncio.sleep(0)
        seen.append((budget, settings.current().chunk_bytes))

    async def main():
        await asyncio.gather(task(1000), task(2000))

    base = settings.current().chunk_bytes
    asyncio.run(main())
    assert sorted(seen[:2]) == [(1000, 1000), (2000, 2000)], seen
    assert [b for _, b in seen[2:]] == [base, base], seen
    assert settings.current().chunk_bytes == base


def test_compiled_call_reads_the_override_without_graph_break(monkeypatch):
    """fullgraph=True: the settings read is traceable (a ContextVar read is not); a changed override
    recompiles, and the compiled op runs with each block's settings."""
    import torch._dynamo

    seen = []
    real = compile_op.flce_forward

    def spy(*args, **kw):
        seen.append(args[5].settings.chunk_bytes)
        return real(*args, **kw)

    monkeypatch.setattr(compile_op, "flce_forward", spy)
    g = torch.Generator().manual_seed(0)
    x, w, t = torch.randn(9, 16, generator=g), torch.randn(37, 16, generator=g) * 0.3, torch.randint(0, 37, (9,), generator=g)

    def step(x, w, t):
        return flce_dist.fused_linear_cross_entropy(x, w, t)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    want = reference_loss(x.double(), w.double(), t)
    for budget in (1 << 20, 2 << 20):
        with settings.override(blocks=SMALL_BLOCKS, chunk_bytes=budget):
            assert rel(compiled(x, w, t), want) < 1e-5
    assert seen == [1 << 20, 2 << 20], seen


_CHILD = textwrap.dedent("""
    import os, torch, helion
    import flce_dist.kernels.scale  # a kernel made before reference mode is asked for
    import flce_dist
    from flce_dist import reference_loss
    flce_dist.setup_reference_mode()
    assert "HELION_INTERPRET" not in os.environ, "setup_reference_mode wrote the environment"
    assert helion.Settings().ref_mode == helion.RefMode.OFF  # the program's own Helion kernels: untouched
    assert flce_dist.kernels.scale.scale_.settings.ref_mode == helion.RefMode.EAGER  # switched
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 16, generator=g, requires_grad=True)
    w = (torch.randn(37, 16, generator=g) * 0.3).requires_grad_()
    t = torch.randint(0, 37, (11,), generator=g)
    with flce_dist.settings.override(blocks={"lse_forward": {"block_n": 8, "block_v": 16, "block_h": 8}}):
        loss = flce_dist.fused_linear_cross_entropy(x, w, t, strategy="fused")
    (loss * 2).backward()  # grad_output != 1: the scale kernel, made before setup_reference_mode
    want = reference_loss(x.double(), w.double(), t)
    assert abs(loss.item() - want.item()) < 1e-5 * abs(want.item()), (loss.item(), want.item())
    print("OK")
""")


def test_setup_reference_mode_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k != "HELION_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
