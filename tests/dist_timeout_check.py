"""Rank 1 never enters the loss: rank 0 must get the process group's timeout error, not hang.

    torchrun --nproc_per_node=2 tests/dist_timeout_check.py
"""

import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flce_dist  # noqa: E402


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=4))
    r = dist.get_rank()
    if r == 0:
        x, w = torch.randn(5, 8), torch.randn(6, 8)
        t = torch.randint(0, 12, (5,))
        t0 = time.time()
        try:
            flce_dist.fused_linear_cross_entropy(x, w, t, group=dist.group.WORLD, vocab_size=12)
        except RuntimeError as e:
            print(f"[rank 0] TIMEOUT_OK after {time.time() - t0:.1f}s: {str(e)[:120]}", flush=True)
            sys.stdout.flush()
            import os
            os._exit(0)
        print("[rank 0] NO_ERROR", flush=True)
        sys.exit(1)
    time.sleep(12)  # a rank that never calls the loss (stuck elsewhere), then leaves
    import os
    os._exit(0)


if __name__ == "__main__":
    main()
