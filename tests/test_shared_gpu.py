"""The launcher's testing mode ``job.device = "cuda-shared"`` (issue 31 item 3): every rank on cuda:0
with gloo. On this CPU machine: the config accepts it, a machine without CUDA refuses it with a clear
message, and the functional all-gather that ``launch/components/shared_gpu.py`` installs for CUDA
tensors (host-staged ``dist.all_gather_into_tensor``) gathers the right rows at 2 gloo ranks. The
CUDA run itself is ``tests/shared_gpu_checks.sh`` on the H200 (benchmarks/results/run24)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch"))

from components import shared_gpu  # noqa: E402
from components.config import load_config  # noqa: E402
from tests._checks import spawn  # noqa: E402


def test_config_accepts_cuda_shared_and_rejects_typos():
    cfg = load_config(ROOT / "configs/train/llama_small_gpu.toml", ['job.device="cuda-shared"'])
    assert cfg.job.device == "cuda-shared"
    with pytest.raises(ValueError, match="job.device"):
        load_config(ROOT / "configs/train/llama_small_gpu.toml", ['job.device="cuda_shared"'])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_cuda_shared_without_cuda_is_refused():
    import train

    cfg = load_config(ROOT / "configs/train/tiny_cpu.toml", ['job.device="cuda-shared"'])
    with pytest.raises(SystemExit, match="no CUDA device"):
        train.init_distributed(cfg, 0, 1, 0)


def _rank(rank: int, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        x = torch.arange(15.0).view(5, 3) + 100 * rank
        got = shared_gpu._gather(x, 2, dist.group.WORLD.group_name)
        want = torch.cat([torch.arange(15.0).view(5, 3), torch.arange(15.0).view(5, 3) + 100])
        assert torch.equal(got, want), (got, want)
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_host_staged_functional_all_gather_two_ranks():
    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.remove(path)
    spawn(_rank, 2, f"file://{path}")
    shared_gpu.install()
    shared_gpu.install()  # idempotent
    assert len(shared_gpu._LIBS) == 1
