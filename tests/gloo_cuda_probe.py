"""Which gloo collectives work on CUDA tensors when every rank shares one GPU (issue 31 item 3).

    python tests/gloo_cuda_probe.py [OP ...]        # default: every op below, 2 ranks each

gloo moves CUDA tensors through the host for the ops it implements for CUDA; an op it implements
for CPU tensors only may read device pointers as host memory (SIGSEGV). Each op runs in its own
pair of processes (``torch.multiprocessing.start_processes``), so a crash names the op. Prints one
line per op: ok / wrong / error text / exit signal. Needs a CUDA device; no NCCL."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _ops():
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    def mesh():
        return init_device_mesh("cuda", (2,))

    def rs_ref(x, r):
        return (x * 3)[r * 4:(r + 1) * 4]  # ranks hold x and 2x

    return {
        "all_reduce": lambda x, r: (dist.all_reduce(y := x * (r + 1)) or y, x * 3),
        "broadcast": lambda x, r: (dist.broadcast(y := x * (r + 1), src=1) or y, x * 2),
        "all_gather": lambda x, r: ((lambda out: dist.all_gather(out, x * (r + 1)) or torch.cat(out))(
            [torch.empty_like(x) for _ in range(2)]), torch.cat([x, 2 * x])),
        "all_gather_into_tensor": lambda x, r: ((lambda out: dist.all_gather_into_tensor(out, x * (r + 1)) or out)(
            x.new_empty(16, *x.shape[1:])), torch.cat([x, 2 * x])),
        "reduce_scatter_tensor": lambda x, r: ((lambda out: dist.reduce_scatter_tensor(out, x * (r + 1)) or out)(
            x.new_empty(4, *x.shape[1:])), rs_ref(x, r)),
        "reduce_scatter": lambda x, r: ((lambda out: dist.reduce_scatter(out, list((x * (r + 1)).chunk(2))) or out)(
            x.new_empty(4, *x.shape[1:])), rs_ref(x, r)),
        "all_to_all_single": lambda x, r: ((lambda out: dist.all_to_all_single(out, x * (r + 1)) or out)(
            torch.empty_like(x)), torch.cat([x[r * 4:(r + 1) * 4], 2 * x[r * 4:(r + 1) * 4]])),
        "fc_all_gather_tensor": lambda x, r: (fc.wait_tensor(fc.all_gather_tensor(x * (r + 1), 0, dist.group.WORLD)),
                                              torch.cat([x, 2 * x])),
        "fc_reduce_scatter_tensor": lambda x, r: (fc.wait_tensor(
            fc.reduce_scatter_tensor(x * (r + 1), "sum", 0, dist.group.WORLD)), rs_ref(x, r)),
        "fc_all_reduce": lambda x, r: (fc.wait_tensor(
            fc.all_reduce(x * (r + 1), "sum", dist.group.WORLD)), x * 3),
        "dtensor_shard_to_replicate": lambda x, r: (DTensor.from_local((x * (r + 1))[:4], mesh(), [Shard(0)])
                                                    .redistribute(placements=[Replicate()]).to_local(),
                                                    torch.cat([x[:4], 2 * x[:4]])),
        "dtensor_partial_to_shard": lambda x, r: (DTensor.from_local(x * (r + 1), mesh(), [Partial()])
                                                  .redistribute(placements=[Shard(0)]).to_local(), rs_ref(x, r)),
        "dtensor_partial_to_replicate": lambda x, r: (DTensor.from_local(x * (r + 1), mesh(), [Partial()])
                                                      .redistribute(placements=[Replicate()]).to_local(), x * 3),
    }


def _rank(rank: int, op: str, init: str) -> None:
    torch.cuda.set_device(0)
    if os.environ.get("SHARED_GPU_FIX") == "1":  # the launcher's testing-mode fix (launch/components/shared_gpu.py)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launch"))
        from components import shared_gpu

        shared_gpu.install()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 5, generator=g).cuda()
        got, want = _ops()[op](x, rank)
        torch.cuda.synchronize()
        ok = torch.allclose(got.cpu(), want.cpu())
        if rank == 0:
            print(f"{op:32s} {'ok' if ok else 'WRONG'}", flush=True)
    except Exception as e:  # noqa: BLE001 - the probe reports every failure
        if rank == 0:
            print(f"{op:32s} error {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            traceback.print_exc(file=sys.stderr)
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    ops = argv or list(_ops())
    for op in ops:
        fd, path = tempfile.mkstemp()
        os.close(fd)
        os.remove(path)
        try:
            mp.start_processes(_rank, args=(op, f"file://{path}"), nprocs=2, start_method="spawn")
        except Exception as e:  # noqa: BLE001 - a crashed rank (SIGSEGV) names the op
            print(f"{op:32s} CRASH {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
