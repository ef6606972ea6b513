"""DTensor weights / hidden states: torchrun launches tests/dtensor_checks.py with 4 gloo ranks
(a 1-D mesh of 4, and a 2x2 (dp, tp) mesh in both dim orders). On the GPUs:
``torchrun --nproc_per_node=2 tests/dtensor_checks.py --backend nccl``."""

import pytest

from tests._checks import torchrun


@pytest.mark.dist
def test_dtensor_inputs_match_reference():
    world = 4
    rc, out, summary = torchrun("dtensor_checks.py", world, "--backend", "gloo")
    assert rc == 0, out[-6000:]
    assert sorted(int(r) for r, _, _ in summary) == list(range(world)), out[-3000:]
    assert all(int(f) == 0 and int(n) > 150 for _, n, f in summary), summary
