import pytest
import torch

torch.set_num_threads(1)  # reference mode is ~8x faster single-threaded on 2 cores

if not torch.cuda.is_available():  # Helion reference mode: an explicit call, never an import side effect
    import os

    import flce_dist

    flce_dist.setup_reference_mode()
    # the tests' spawned ranks and subprocesses take the mode from the environment (the library
    # never writes it: issue #34 item 10); CI sets it already
    os.environ.setdefault("HELION_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (run on the H200 with -m gpu)")
    config.addinivalue_line("markers", "dist: multi-rank tests (torchrun / gloo on CPU, nccl on GPU)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


from ._checks import SMALL_BLOCKS, rel  # noqa: E402,F401  (re-exported to the test files)


@pytest.fixture
def small_tiles():
    from flce_dist import settings

    with settings.override(blocks=SMALL_BLOCKS):
        yield
