"""Multi-rank CPU tests: torchrun launches tests/dist_checks.py with gloo ranks.

On the GPU machine the same checks run with NCCL:
``torchrun --nproc_per_node=2 tests/dist_checks.py --backend nccl --big``.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_vocab_parallel_matches_reference(world):
    """2 and 3 ranks run every check; 4 and 8 (the TP sizes of the 4x/8x H200 runs) a quick set."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", str(ROOT / "tests" / "dist_checks.py"), "--backend", "gloo"]
    if world > 3:
        cmd.append("--quick")
    env = {**os.environ, "HELION_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = "\n".join(line for line in (res.stdout + res.stderr).splitlines() if "registered at" not in line)
    summary = re.findall(r"\[rank (\d+)\] (\d+) passed, (\d+) failed", out)
    assert res.returncode == 0, out[-6000:]
    assert sorted(int(r) for r, _, _ in summary) == list(range(world)), out[-3000:]
    assert all(int(f) == 0 and int(n) > 40 for _, n, f in summary), summary


@pytest.mark.dist
def test_missing_rank_times_out_instead_of_hanging():
    """A rank that never enters the loss: the others get the group's timeout error (4 s here)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", str(ROOT / "tests" / "dist_timeout_check.py")]
    env = {**os.environ, "HELION_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert "TIMEOUT_OK" in out, out[-3000:]
    assert "NO_ERROR" not in out
