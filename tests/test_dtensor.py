"""DTensor weights / hidden states: torchrun launches tests/dtensor_checks.py with 4 gloo ranks
(a 1-D mesh of 4, and a 2x2 (dp, tp) mesh in both dim orders). On the GPUs:
``torchrun --nproc_per_node=2 tests/dtensor_checks.py --backend nccl``."""

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
def test_dtensor_inputs_match_reference():
    world = 4
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", str(ROOT / "tests" / "dtensor_checks.py"), "--backend", "gloo"]
    env = {**os.environ, "HELION_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = "\n".join(line for line in (res.stdout + res.stderr).splitlines() if "registered at" not in line)
    summary = re.findall(r"\[rank (\d+)\] (\d+) passed, (\d+) failed", out)
    assert res.returncode == 0, out[-6000:]
    assert sorted(int(r) for r, _, _ in summary) == list(range(world)), out[-3000:]
    assert all(int(f) == 0 and int(n) > 150 for _, n, f in summary), summary
