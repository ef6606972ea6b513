"""The gloo exit abort (issue #31 item 1): ``destroy_process_group`` must free the default group, so
that its gloo worker threads are joined before the interpreter finalizes.

The abort ("terminate called without an active exception", now and then in
``test_bench_rl.py::test_cpu_smoke_two_ranks`` and other rank processes): flce_dist's first call
imports ``torch._dynamo`` (``torch._disable_dynamo``), which imports
``torch.distributed.nn.functional``, whose ``group=group.WORLD`` defaults, evaluated then, hold the
live default group for the life of the process. ``destroy_process_group`` cannot free it; its
``pt_gloo_runloop`` threads outlive ``main``, and one still releasing the last collective's work (a
tensor decref that takes the GIL) once ``Py_FinalizeEx`` has begun dies in ``take_gil ->
pthread_exit`` through a noexcept frame -> ``std::terminate`` (gdb backtrace in
benchmarks/results/flaky_loop/README.md). The fix (``flce_dist/distributed/groups.py``): flce_dist
imports that module at package import while no group exists (defaults ``None``). It no longer
rewrites torch's defaults after each call (issue 52 finding 8: ``tests/test_contract.py`` checks
that a loss call leaves them as they were); docs/guarantees.md ("Process exit") states the case of
an import after ``init_process_group``."""

from __future__ import annotations

import subprocess
import sys

from ._checks import ROOT

_SCRIPT = r"""
import gc, os, sys, tempfile, weakref
import torch, torch.distributed as dist
import flce_dist  # before the group, as scripts do
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    pg = weakref.ref(dist.group.WORLD)
    import torch._dynamo  # what flce_dist's first call (Helion) or a torch.compile imports after init_process_group
    dist.all_reduce(torch.ones(3))
    flce_dist.setup_reference_mode()
    x, w, t = torch.randn(4, 8, requires_grad=True), torch.randn(5, 8), torch.randint(0, 5, (4,))
    flce_dist.fused_linear_cross_entropy(x, w, t, group=dist.group.WORLD, vocab_size=5).backward()
    dist.destroy_process_group()
    gc.collect()
    threads = [open(f"/proc/self/task/{d}/comm").read().strip() for d in os.listdir("/proc/self/task")]
    print("alive", pg() is not None, "runloops", threads.count("pt_gloo_runloop"))
"""


def test_destroy_frees_the_default_group_in_a_fresh_process():
    """flce_dist imported before init_process_group, torch._dynamo and a loss call after: nothing
    left alive (before the fix: ``alive True runloops 2``)."""
    res = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "alive False runloops 0" in res.stdout, (res.stdout, res.stderr[-2000:])
