"""Reliability of the training job's pieces, tested cheaply (issue 17, "Training job" items 4-9):
in-process unit tests on tiny DCP folders, one 2-rank gloo job spawned in-process (replicated
parameter divergence at checkpoint time, a collective timeout that names the step), the README's
commands. The full-job cases (resume from a damaged checkpoint, a changed schedule) reuse the
training runs of ``tests/test_train.py``'s fixture and live there."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch"))

from components import checkpoint as ckpt  # noqa: E402
from components.config import load_config  # noqa: E402

CONFIG = ROOT / "configs" / "train" / "tiny_cpu.toml"


def _tiny(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt


def _save(d: Path, steps, m, opt) -> None:
    for s in steps:
        ckpt.save_checkpoint(d, s, {"position": s, "losses": [0.0] * s, "layout": {"dp": 1, "tp": 1}}, m, opt, None, 0,
                             keep=len(steps))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_manifest_and_fallback(tmp_path):
    """Item 4: sha256 per file in complete.json; a damaged (bytes changed), truncated or missing file,
    or a garbage complete.json, makes choose_checkpoint fall back to the newest intact checkpoint,
    naming the bad files; none intact -> None (the launcher then refuses to start)."""
    m, opt = _tiny()
    _save(tmp_path, (1, 2, 3, 4), m, opt)
    man = json.loads((ckpt.step_dir(tmp_path, 4) / "complete.json").read_text())
    assert {".metadata", "__0_0.distcp", "train_state.json", "rng_rank0.pt"} <= set(man["files"]), man
    assert all(len(v["sha256"]) == 64 and v["bytes"] > 0 for v in man["files"].values())
    assert ckpt.choose_checkpoint(tmp_path, [1, 2, 3, 4]) == (4, {})

    f4 = ckpt.step_dir(tmp_path, 4) / "__0_0.distcp"  # same size, 64 bytes changed
    raw = bytearray(f4.read_bytes())
    raw[100:164] = b"\x7f" * 64
    f4.write_bytes(bytes(raw))
    f3 = ckpt.step_dir(tmp_path, 3) / "__0_0.distcp"  # truncated
    f3.write_bytes(f3.read_bytes()[:-10])
    (ckpt.step_dir(tmp_path, 2) / "complete.json").write_bytes(b"\x00garbage{")
    step, damaged = ckpt.choose_checkpoint(tmp_path, [1, 2, 3, 4])
    assert step == 1, damaged
    assert "__0_0.distcp: sha256 mismatch" in damaged[4][0]
    assert "__0_0.distcp" in damaged[3][0] and "truncated" in damaged[3][0]
    assert "complete.json" in damaged[2][0] and "garbage" in damaged[2][0]
    # the damaged ones are set aside (not retried, not counted as complete, still there to inspect)
    assert ckpt.complete_checkpoints(tmp_path) == [1]
    assert (tmp_path / "step_00000004.damaged" / "__0_0.distcp").is_file()
    (ckpt.step_dir(tmp_path, 1) / ".metadata").unlink()  # a missing file
    step, damaged = ckpt.choose_checkpoint(tmp_path, [1])
    assert step is None and damaged[1] == [".metadata: missing"]
    # a second save of a step never keeps the old marker vouching for the new files
    _save(tmp_path, (4,), m, opt)
    assert ckpt.verify_checkpoint(ckpt.step_dir(tmp_path, 4)) == []


def _run_main(argv, capsys):
    """launch/train.py's main() in this process (one rank), its output, and its exception if any."""
    import importlib.util
    import logging

    spec = importlib.util.spec_from_file_location("flce_train_main", ROOT / "launch" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    env = {k: os.environ.pop(k) for k in ("FAIL_AT_STEP", "RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")
           if k in os.environ}
    err = None
    try:
        train.main(argv)
    except BaseException as e:  # noqa: BLE001
        err = e
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
        os.environ.update(env)
    out = capsys.readouterr()
    return err, out.out + out.err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_no_intact_checkpoint_fails_before_loading(tmp_path, capsys):
    """Item 4: --resume over checkpoints that are all damaged stops with a message naming the bad
    files, before anything is loaded or announced (no "resumed from")."""
    m, opt = _tiny()
    ck = tmp_path / "ck"
    _save(ck, (2,), m, opt)
    (ckpt.step_dir(ck, 2) / "__0_0.distcp").write_bytes(b"")
    err, out = _run_main(["--config", str(CONFIG), "--resume", "--set", "parallel.tp=1", "--set", "model.num_layers=1",
                          "--set", f'checkpoint.ckpt_dir="{ck}"', "--set", f'job.out_dir="{tmp_path}"',
                          "--set", 'job.progress="off"', "--set", 'data.tokenizer="byte"',
                          "--set", f'data.cache_dir="{tmp_path / "cache"}"'], capsys)
    assert isinstance(err, SystemExit), (err, out[-3000:])
    msg = str(err.code)
    assert "no intact checkpoint" in msg and "step_00000002: __0_0.distcp" in msg and "--overwrite" in msg, msg
    assert "resumed from" not in out


def test_resume_schedule_check():
    """Item 6 (unit): the stored schedule vs this run's, in the three modes."""
    t = load_config(str(CONFIG), ["training.steps=100"], environ={}).training
    state = {"schedule": {"steps": 50, "warmup_steps": 5, "lr": 3e-3, "min_lr_ratio": 0.1}}
    with pytest.raises(ValueError, match=r"training\.steps 50 -> 100.*--set training\.steps=50.*resume_schedule=checkpoint"):
        ckpt.resume_schedule(state, t, "check", "checkpoint X")
    assert ckpt.resume_schedule(state, t, "checkpoint", "X")["steps"] == 50
    assert ckpt.resume_schedule(state, t, "config", "X")["steps"] == 100
    # a checkpoint without "schedule" (older launcher): read from its config
    legacy = {"config": {"training": {**state["schedule"]}}}
    with pytest.raises(ValueError, match=r"training\.steps 50 -> 100"):
        ckpt.resume_schedule(legacy, t, "check", "X")
    same = load_config(str(CONFIG), ["training.steps=50"], environ={}).training
    assert ckpt.resume_schedule(state, same, "check", "X") == state["schedule"]
    with pytest.raises(ValueError, match="resume_schedule must be one of"):
        load_config(str(CONFIG), ["resume_schedule=maybe"], environ={})


def test_step_errors_names_the_step():
    """Item 8 (unit): an error raised by a collective inside a step is re-raised naming the step, and a
    timeout names job.timeout_s; other errors pass through unchanged."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flce_train_se", ROOT / "launch" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    with pytest.raises(RuntimeError, match=r"^step 7: DistBackendError: Timed out.*job\.timeout_s=5"):
        with train.step_errors(7, 5.0):
            raise torch.distributed.DistBackendError("Timed out waiting 5000ms for recv operation to complete")
    with pytest.raises(FloatingPointError, match="loss is nan"):
        with train.step_errors(7, 5.0):
            raise FloatingPointError("loss is nan at step 7")


def test_pending_steps_read_back_at_flush():
    """The loop's per-step loss and grad norm stay on the device until a log step, a checkpoint or
    the end: flush appends them in order, returns the last pair, and a non-finite loss raises
    naming its step (before anything after it is saved)."""
    sys.path.insert(0, str(ROOT / "launch"))
    from components.metrics import PendingSteps

    p, losses = PendingSteps(), [1.5]
    assert p.flush(losses) is None
    for step, v in ((2, 1.25), (3, 1.0)):
        p.add(step, torch.tensor([v]), torch.tensor(0.5 * step))
    assert p.flush(losses) == (1.0, 1.5) and losses == [1.5, 1.25, 1.0] and p.flush(losses) is None
    p.add(4, torch.tensor(0.75), torch.tensor(1.0))
    p.add(5, torch.tensor(float("nan")), torch.tensor(1.0))
    p.add(6, torch.tensor(0.5), torch.tensor(1.0))
    with pytest.raises(FloatingPointError, match="loss is nan at step 5"):
        p.flush(losses)
    assert losses[-1] == 0.75


# ------------------------------------------------------------------ 2 gloo ranks, spawned in-process

def _worker(rank: int, tmp: str) -> None:
    import datetime
    import importlib.util

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    sys.path.insert(0, str(ROOT / "launch"))
    from components import checkpoint as ck

    spec = importlib.util.spec_from_file_location("flce_train_w", ROOT / "launch" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=2))
    res: dict = {}
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.norm = torch.nn.Parameter(distribute_tensor(torch.randn(8), mesh["tp"], [Replicate()]))
    m.head = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh["tp"], [Shard(0)]))
    m.plain = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pg = dist.group.WORLD

    def attempt(key, fn):
        try:
            fn()
            res[key] = "ok"
        except RuntimeError as e:
            res[key] = str(e)

    with torch.no_grad():
        m.head.to_local().add_(rank)  # shards differ by design: not a divergence
    attempt("clean", lambda: ck.check_replicated(m, pg))
    with torch.no_grad():
        if rank == 1:
            m.norm.to_local()[3] += 1e-3
    attempt("save", lambda: ck.save_checkpoint(Path(tmp) / "ck", 5, {"position": 0, "losses": [], "layout": {}},
                                              m, opt, pg, rank, 2))
    with torch.no_grad():
        if rank == 1:
            m.norm.to_local()[3] -= 1e-3
            m.plain[0] += 1.0
    attempt("plain", lambda: ck.check_replicated(m, pg))
    # item 8: rank 1 stays alive but never reaches the collective of step 3
    t0 = time.perf_counter()
    if rank == 0:
        attempt("timeout", lambda: _collective_in_step(train))
    else:
        time.sleep(4.5)
        res["timeout"] = "slept"
    res["timeout_s"] = time.perf_counter() - t0
    Path(tmp, f"res{rank}.json").write_text(json.dumps(res))
    os._exit(0)  # the group is broken after the timeout: no teardown


def _collective_in_step(train) -> None:
    import torch.distributed as dist

    with train.step_errors(3, 2.0):
        dist.all_reduce(torch.ones(4))


@pytest.mark.dist
def test_two_ranks_divergence_and_timeout(tmp_path):
    """Item 7: a replicated parameter (a Replicate() DTensor, then a plain one) that differs between the
    2 ranks makes save_checkpoint / check_replicated raise on BOTH ranks naming it (nothing is saved);
    shards that differ are fine. Item 8: a real gloo timeout inside step_errors names the step."""
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    mp.start_processes(_worker, args=(str(tmp_path),), nprocs=2, join=True, start_method="spawn")
    res = [json.loads((tmp_path / f"res{r}.json").read_text()) for r in (0, 1)]
    for r in res:
        assert r["clean"] == "ok", r
        assert "replicated parameter 'norm' differs between ranks [0, 1]" in r["save"], r
        assert "replicated parameter 'plain' differs" in r["plain"], r
    assert not (tmp_path / "ck" / "step_00000005" / "complete.json").exists()
    assert res[0]["timeout"].startswith("step 3: ") and "job.timeout_s=2" in res[0]["timeout"], res[0]
    print(f"2-rank job: {time.perf_counter() - t0:.1f} s")


def _partial_worker(rank: int, tmp: str, fix: bool) -> None:
    """The tiny Llama at (dp=1, tp=2), sequence parallel: one forward/backward, then (with ``fix``)
    reduce_partial_grads_, then the clip and an AdamW step, counting Partial reductions."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial

    sys.path.insert(0, str(ROOT / "launch"))
    from components.config import load_config
    from components.model import build_model, make_optimizer
    from components.parallelize import build_mesh, clip_grad_norm_, parallelize, reduce_partial_grads_

    import flce_dist

    flce_dist.setup_reference_mode()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    cfg = load_config(str(CONFIG), ["parallel.tp=2", "parallel.sp=true", "model.num_layers=1"], environ={})
    mesh = build_mesh("cpu", 1, 2)
    model = build_model(cfg, 64)
    parallelize(model, mesh, True, "")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    model(ids).backward()
    partial = {n: p.grad.full_tensor() for n, p in model.named_parameters()
               if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)}
    calls = []
    orig = Partial._reduce_value

    def counted(self, *a, **k):
        calls.append(1)
        return orig(self, *a, **k)

    res = {"partial": sorted(partial)}
    res["reduced"] = reduce_partial_grads_(model) if fix else 0
    grads = dict(model.named_parameters())
    res["left_partial"] = [n for n, p in grads.items() if isinstance(p.grad, DTensor)
                           and any(pl.is_partial() for pl in p.grad.placements)]
    res["max_diff"] = max(float((grads[n].grad.full_tensor() - want).abs().max()) for n, want in partial.items())
    Partial._reduce_value = counted
    clip_grad_norm_(model, 1.0)
    make_optimizer(model, cfg.training).step()
    Partial._reduce_value = orig
    res["rereductions"] = len(calls)
    print(f"[rank {rank}] fix={fix}: {len(calls)} Partial reductions in the clip and the AdamW step", flush=True)
    Path(tmp, f"res{rank}_{int(fix)}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("fix", [False, True])
def test_partial_grads_reduced_once(tmp_path, fix):
    """The norm weights' gradients under sequence parallelism are Partial after the backward;
    reduce_partial_grads_ reduces them (one all-reduce for the bucket), to the same values DTensor
    would give, so the clip and AdamW read them without reducing them again (without it: ~8
    reductions per norm weight per step, the ~165 small all-reduces of the tp=2 profile)."""
    from ._checks import spawn

    spawn(_partial_worker, 2, str(tmp_path), fix)
    for r in (0, 1):
        res = json.loads((tmp_path / f"res{r}_{int(fix)}.json").read_text())
        norms = [n for n in res["partial"] if "norm" in n]
        assert len(norms) == 3 and len(res["partial"]) == len(norms), res  # 2 layer norms + the final norm
        if fix:
            assert res["reduced"] == 3 and res["left_partial"] == [] and res["max_diff"] < 1e-6, res
            assert res["rereductions"] <= 2, res  # only the clip's norm of each sharded kind (Shard(0), Shard(1))
        else:  # what the fix removes: the clip and each AdamW read reduce the Partial grads again
            assert res["rereductions"] >= 2 + 2 * len(norms), res


# ------------------------------------------------------------------------------------- README

def _readme_train_commands() -> list[list[str]]:
    # the code blocks of the README and of docs/training.md (where the other entry points moved)
    blocks = [b for page in ("README.md", "docs/training.md") for b in (ROOT / page).read_text().split("```")[1::2]]
    cmds = []
    for line in "\n".join(blocks).splitlines():
        if "launch/train.py" in line or "launch/train.sh" in line:
            cmds.append(shlex.split(line.split("  #")[0].split("&&")[-1]))
    return cmds


def _out_dir(cmd: list[str]) -> str:
    config = next((w.split("=", 1)[1] for w in cmd if w.startswith("CONFIG=")), None)
    if "--config" in cmd:
        config = cmd[cmd.index("--config") + 1]
    sets = [cmd[i + 1] for i, w in enumerate(cmd) if w == "--set"]
    return load_config(str(ROOT / (config or "configs/train/tiny_cpu.toml")), sets, environ={}).job.out_dir


def test_readme_commands_do_not_clobber_each_other():
    """Item 9: a README command that starts fresh with --overwrite (the --head torch baseline, the other
    layouts, the restart demo) must not use the out_dir of another README command (it would delete
    that run's checkpoints); the MAX_RESTARTS example must crash something (FAIL_AT_STEP)."""
    cmds = _readme_train_commands()
    assert len(cmds) >= 6, cmds
    dirs = [(_out_dir(c), c) for c in cmds]
    for d, c in dirs:
        if "--overwrite" in c or "torch" in c:
            others = [o for o2, o in dirs if o2 == d and o is not c]
            assert not others, f"{shlex.join(c)}\n writes into {d}, as does\n {shlex.join(others[0])}"
    restart = [c for c in cmds if any(w.startswith("MAX_RESTARTS=") for w in c)]
    assert restart and all(any(w.startswith("FAIL_AT_STEP=") for w in c) for c in restart), restart


def test_config_errors_name_the_key():
    """Item 9: --set step=10 (unknown) lists the known keys; --set steps=ten names training.steps;
    batch_size=0 fails at load (all before any model is built)."""
    with pytest.raises(ValueError, match=r"--set step: unknown config key \(known: .*'training\.steps'"):
        load_config(str(CONFIG), ["step=10"], environ={})
    with pytest.raises(ValueError, match=r"training\.steps must be int, got str 'ten'"):
        load_config(str(CONFIG), ["steps=ten"], environ={})
    with pytest.raises(ValueError, match=r"training\.batch_size must be >= 1, got 0"):
        load_config(str(CONFIG), ["batch_size=0"], environ={})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_profile_step_writes_its_tables(tmp_path, capsys):
    """job.profile_step: torch.profiler over one step, tables with the head's record_function row."""
    err, out = _run_main(["--config", str(CONFIG), "--set", "parallel.tp=1", "--set", "model.num_layers=1",
                          "--set", "training.steps=3", "--set", "job.profile_step=2", "--set", "checkpoint.ckpt_every=0",
                          "--set", f'job.out_dir="{tmp_path / "run"}"', "--set", f'data.cache_dir="{tmp_path / "cache"}"',
                          "--set", 'job.progress="off"'], capsys)
    assert err is None, out[-3000:]
    text = (tmp_path / "run" / "profile_step2_rank0.txt").read_text()
    assert text.startswith("step 2: wall") and "head.flce" in text, text[:500]
