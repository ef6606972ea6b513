"""Multi-rank CPU tests: torchrun launches tests/dist_checks.py with gloo ranks.

On the GPU machine the same checks run with NCCL:
``torchrun --nproc_per_node=2 tests/dist_checks.py --backend nccl --big``.
"""

import pytest

from tests._checks import torchrun


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_vocab_parallel_matches_reference(world):
    """2 and 3 ranks run every check; 4 and 8 (the TP sizes of the 4x/8x H200 runs) a quick set."""
    rc, out, summary = torchrun("dist_checks.py", world, "--backend", "gloo", *(["--quick"] if world > 3 else []))
    assert rc == 0, out[-6000:]
    assert sorted(int(r) for r, _, _ in summary) == list(range(world)), out[-3000:]
    assert all(int(f) == 0 and int(n) > 40 for _, n, f in summary), summary


@pytest.mark.dist
def test_missing_rank_times_out_instead_of_hanging():
    """A rank that never enters the loss: the others get the group's timeout error (4 s here)."""
    _, out, _ = torchrun("dist_timeout_check.py", 2, timeout=120)
    assert "TIMEOUT_OK" in out, out[-3000:]
    assert "NO_ERROR" not in out
