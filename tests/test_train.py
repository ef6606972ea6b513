"""The training job (launch/train.py) on the CPU: a Llama tensor-parallel over a (dp, tp) mesh
(gloo, fp32, Helion reference mode), checked against the one-process run.

Six jobs are launched at once (module fixture ``runs``), all from the tiny_cpu config with the same
seed and the same global batch of 4 sequences, 8 steps, a checkpoint every 4:

- ``ref``: one process, (dp=1, tp=1), flce head;
- ``d2t2``: 4 ranks, (dp=2, tp=2), sequence parallel, FSDP2 over dp, flce head on the Shard(0)
  lm_head DTensor;
- ``d2t2_torch``: the same mesh with the torch head (ColwiseParallel lm_head + loss_parallel);
- ``twonode``: ``d2t2`` as two torchrun "nodes" on localhost (c10d rendezvous, 2 ranks each);
- ``tied_ref`` / ``ft``: tied embeddings, one process vs (dp=1, tp=2) without sequence
  parallelism under ``torchrun --max-restarts=1`` with ``FAIL_AT_STEP=6``: rank 1 SIGKILLs itself
  after step 6, torchrun restarts both ranks, which resume from the step-4 checkpoint.

Then (``resumed``): ``d2t2``'s step-4 DCP checkpoint resumed at (dp=4, tp=1), and a fresh start
over an existing ckpt_dir, which must be refused. In this pytest process (one rank, ``main()``
called directly, a few seconds): d2t2's checkpoints resumed with 4 KiB of the step-8 lm_head bytes
overwritten (falls back to step 4, warns naming the file) and with another ``training.steps``
(refused before loading; kept with ``training.resume_schedule=checkpoint``). Config errors are
plain unit tests; the cheaper reliability tests are in ``tests/test_train_reliability.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "launch" / "train.py"
CONFIG = ROOT / "configs" / "train" / "tiny_cpu.toml"
STEPS, CKPT_EVERY, FAIL_AT = 8, 4, 6
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(n: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *extra]


def _job(name: str, tmp: Path, launcher: list[str], sets: list[str], extra_env: dict | None = None,
         args: list[str] = (), out: Path | None = None) -> dict:
    out = out or tmp / name
    cmd = [*launcher, str(TRAIN), "--config", str(CONFIG),
           "--set", f"training.steps={STEPS}", "--set", f"checkpoint.ckpt_every={CKPT_EVERY}",
           "--set", f'job.out_dir="{out}"', "--set", f'data.cache_dir="{tmp / "cache"}"',
           "--set", f'job.losses_file="{tmp / name}.json"',
           "--set", 'job.progress="off"', "--set", "job.log_every=1", *sum((["--set", s] for s in sets), []), *args]
    env = {**os.environ, "HELION_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if "FAIL_AT_STEP" not in (extra_env or {}):
        env.pop("FAIL_AT_STEP", None)
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return {"name": name, "procs": [proc], "log": tmp / f"{name}.log", "losses": tmp / f"{name}.json", "fh": log}


def _two_nodes(name: str, tmp: Path, sets: list[str]) -> dict:
    """Two torchrun agents ("nodes") of 2 ranks each on localhost, one c10d rendezvous."""
    port = _free_port()
    jobs = [_job(f"{name}{k}" if k else name, tmp,
                 [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={k}", "--nproc-per-node=2",
                  "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=twonode{port}"],
                 sets, out=tmp / name) for k in (0, 1)]
    jobs[1]["losses"] = jobs[0]["losses"] = tmp / f"{name}.json"  # rank 0 (on node 0) writes it
    return {**jobs[0], "procs": [j["procs"][0] for j in jobs], "fhs": [j["fh"] for j in jobs],
            "logs": [j["log"] for j in jobs]}


def _wait(jobs: list[dict], expect_fail: bool = False) -> dict:
    results = {}
    for j in jobs:
        rcs = []
        for p in j["procs"]:
            try:
                rcs.append(p.wait(timeout=400))
            except subprocess.TimeoutExpired:
                p.kill()
                rcs.append("timeout")
        for fh in j.get("fhs", [j["fh"]]):
            fh.close()
        text = "\n".join("\n".join(line for line in Path(lg).read_text().splitlines() if "registered at" not in line)
                         for lg in j.get("logs", [j["log"]]))
        if expect_fail:
            results[j["name"]] = {"rc": rcs, "output": text}
            continue
        assert all(rc == 0 for rc in rcs), f"{j['name']} job failed ({rcs}):\n{text[-6000:]}"
        results[j["name"]] = {**json.loads(j["losses"].read_text()), "output": text}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    t0 = time.perf_counter()
    sp22 = ["parallel.dp=2", "parallel.tp=2", "parallel.sp=true"]
    jobs = [
        _job("ref", tmp, [sys.executable], ["parallel.tp=1"]),
        _job("d2t2", tmp, _torchrun(4), sp22),
        _job("d2t2_torch", tmp, _torchrun(4), sp22, args=["--head", "torch"]),
        _two_nodes("twonode", tmp, sp22),
        _job("tied_ref", tmp, [sys.executable], ["parallel.tp=1", "model.tie_word_embeddings=true"]),
        _job("ft", tmp, _torchrun(2, "--max-restarts=1"), ["parallel.tp=2", "parallel.sp=false", "model.tie_word_embeddings=true"],
             {"FAIL_AT_STEP": str(FAIL_AT)}),
    ]
    results = _wait(jobs)
    t1 = time.perf_counter()
    # d2t2's step-4 checkpoint, resumed on another layout; a fresh start over a used ckpt_dir
    src = tmp / "d2t2" / "checkpoints" / f"step_{CKPT_EVERY:08d}"
    shutil.copytree(src, tmp / "resumed" / "checkpoints" / src.name)
    shutil.copytree(src, tmp / "refused" / "checkpoints" / src.name)
    later = [_job("resumed", tmp, _torchrun(4), ["parallel.dp=4", "parallel.tp=1"], args=["--resume"]),
             _job("compiled", tmp, _torchrun(2), ["parallel.tp=2", "parallel.sp=true", 'model.compile="aot_eager"',
                                                  'training.optimizer_impl="fused"'])]
    refused = [_job("refused", tmp, [sys.executable], ["parallel.tp=1"])]
    results.update(_wait(later))
    results.update(_wait(refused, expect_fail=True))
    print(f"\ntraining jobs: {t1 - t0:.1f} s (6 at once), then {time.perf_counter() - t1:.1f} s (resume, compiled, refusal)")
    results["tmp"] = tmp
    return results


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.dist
def test_2d_mesh_matches_one_process(runs):
    ref, d = runs["ref"], runs["d2t2"]
    assert (d["dp"], d["tp"], d["sp"], d["world_size"], d["head"]) == (2, 2, True, 4, "flce")
    assert (ref["dp"], ref["tp"], ref["world_size"]) == (1, 1, 1)
    assert len(ref["losses"]) == STEPS
    diff = _max_diff(d["losses"], ref["losses"])
    assert diff < TOL, f"(dp=2, tp=2, sp) vs one process: max per-step loss difference {diff:.3e}\n{d['losses']}\n{ref['losses']}"
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]


@pytest.mark.dist
def test_compiled_layers_and_fused_adamw_match(runs):
    """model.compile (each decoder layer torch.compile'd after TP, here the aot_eager backend: graph
    capture of the DTensor layers) and training.optimizer_impl="fused" at (dp=1, tp=2, sp): the same
    per-step losses as one process."""
    c, ref = runs["compiled"], runs["ref"]
    assert (c["tp"], c["sp"]) == (2, True) and c["config"]["model"]["compile"] == "aot_eager"
    diff = _max_diff(c["losses"], ref["losses"])
    assert diff < TOL, f"compiled + fused AdamW vs one process: {diff:.3e}\n{c['losses']}\n{ref['losses']}"


@pytest.mark.dist
def test_flce_head_matches_loss_parallel_head(runs):
    a, b = runs["d2t2"], runs["d2t2_torch"]
    assert b["head"] == "torch" and (b["dp"], b["tp"]) == (2, 2)
    diff = _max_diff(a["losses"], b["losses"])
    assert diff < TOL, f"flce vs loss_parallel head on (dp=2, tp=2): {diff:.3e}\n{a['losses']}\n{b['losses']}"


@pytest.mark.dist
def test_two_nodes_on_localhost(runs):
    a, b = runs["twonode"], runs["d2t2"]
    assert a["world_size"] == 4
    diff = _max_diff(a["losses"], b["losses"])
    assert diff < TOL, f"two-node run vs single-node run: {diff:.3e}"


@pytest.mark.dist
def test_tied_embeddings_and_restart_after_rank_failure(runs):
    ft, ref = runs["ft"], runs["tied_ref"]
    assert f"fault injection: rank 1 kills itself after step {FAIL_AT}" in ft["output"], ft["output"][-3000:]
    assert ft["restart_count"] == 1 and ft["resumed_from"] == CKPT_EVERY, {k: ft[k] for k in ("restart_count", "resumed_from")}
    assert ft["tie_word_embeddings"] and (ft["tp"], ft["sp"]) == (2, False)
    diff = _max_diff(ft["losses"], ref["losses"])
    assert diff < TOL, f"tied, tp=2, restarted vs tied one process: {diff:.3e}\n{ft['losses']}\n{ref['losses']}"
    assert _max_diff(ref["losses"], runs["ref"]["losses"]) > 1e-3  # tying changes the model


@pytest.mark.dist
def test_dcp_resume_across_layouts(runs):
    r, d = runs["resumed"], runs["d2t2"]
    assert r["resumed_from"] == CKPT_EVERY and (r["dp"], r["tp"]) == (4, 1)
    assert "saved at dp=2 x tp=2" in r["output"]
    diff = _max_diff(r["losses"], d["losses"])  # steps 1-4 from the checkpoint, 5-8 recomputed at (4, 1)
    assert diff < TOL, f"(2,2) -> (4,1) resume vs uninterrupted (2,2): {diff:.3e}\n{r['losses']}\n{d['losses']}"


@pytest.mark.dist
def test_capture_trained_fixture_from_launcher_checkpoint(runs):
    """benchmarks/capture_trained.py --checkpoint on this job's own DCP checkpoint (d2t2's last: the
    lm_head and every layer saved as FSDP2 x TP DTensor shards): the ``trained`` data mode's fixture
    holds the full lm_head, hidden states of the model's width and a loss near the job's own."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import capture_trained

    tmp, d = runs["tmp"], runs["d2t2"]
    tokens = next((tmp / "cache").glob("tokens-*.pt"))
    out = tmp / "trained_fixture.pt"
    capture_trained.main(["--device", "cpu", "--checkpoint", str(tmp / "d2t2" / "checkpoints" / f"step_{STEPS:08d}"),
                          "--tokens", str(tokens), "--config", str(CONFIG), "--seq", "64", "--rows", "256",
                          "--out", str(out)])
    fx = torch.load(out, weights_only=False)
    assert fx["weight"].shape == (d["vocab_size"], 64) and fx["hidden"].shape == (256, 64)
    assert fx["target"].shape == (256,) and int(fx["target"].max()) < d["vocab_size"]
    assert torch.isfinite(fx["hidden"].float()).all() and fx["hidden"].float().std() > 0.1
    assert abs(fx["meta"]["capture_loss"] - d["losses"][-1]) < 0.5, (fx["meta"], d["losses"][-1])


@pytest.mark.dist
def test_fresh_start_over_checkpoints_is_refused(runs):
    r = runs["refused"]
    assert r["rc"] != [0] and "already holds checkpoints" in r["output"] and "--overwrite" in r["output"], r["output"][-2000:]
    assert (runs["tmp"] / "refused" / "checkpoints" / f"step_{CKPT_EVERY:08d}" / "complete.json").is_file()  # untouched


def _in_process(runs, name: str, capsys, sets: list[str], args: list[str] = ()):
    """launch/train.py's main() in this process (one rank, tp=1) over ``runs["tmp"] / name``, the
    fixture's data cache: (exception or None, output, losses file or None)."""
    from tests.test_train_reliability import _run_main

    tmp = runs["tmp"]
    argv = ["--config", str(CONFIG), "--set", f"training.steps={STEPS}", "--set", f"checkpoint.ckpt_every={CKPT_EVERY}",
            "--set", f'job.out_dir="{tmp / name}"', "--set", f'data.cache_dir="{tmp / "cache"}"',
            "--set", 'job.progress="off"', "--set", "job.log_every=1", "--set", "parallel.tp=1",
            *sum((["--set", s] for s in sets), []), *args]
    err, out = _run_main(argv, capsys)
    losses = tmp / name / "losses.json"
    return err, out, json.loads(losses.read_text()) if losses.is_file() else None


def _copy_ckpts(runs, src: str, dst: str, steps) -> Path:
    for s in steps:
        d = runs["tmp"] / src / "checkpoints" / f"step_{s:08d}"
        shutil.copytree(d, runs["tmp"] / dst / "checkpoints" / d.name)
    return runs["tmp"] / dst / "checkpoints"


@pytest.mark.dist
def test_damaged_checkpoint_falls_back(runs, capsys):
    """Item 4: 4 KiB of a rank's lm_head bytes overwritten in d2t2's step-8 checkpoint: the resume
    warns naming the file, falls back to step 4 and recomputes steps 5-8 exactly (before: it loaded
    the garbage silently and resumed at step 8)."""
    import torch.distributed.checkpoint as dcp

    ck = _copy_ckpts(runs, "d2t2", "damaged", (CKPT_EVERY, STEPS))
    d8 = ck / f"step_{STEPS:08d}"
    meta = dcp.FileSystemReader(str(d8)).read_metadata()
    idx, info = next((i, v) for i, v in meta.storage_data.items() if i.fqn == "model.lm_head.weight")
    f = d8 / info.relative_path
    raw = bytearray(f.read_bytes())
    at = info.offset + info.length // 2  # inside the tensor's bytes: the load itself would not notice
    raw[at:at + 4096] = b"\x5f" * 4096  # float32 1.6e19: before the fix, exit 0 and a loss of ~1e19
    f.write_bytes(bytes(raw))
    err, out, res = _in_process(runs, "damaged", capsys, [], ["--resume"])
    assert err is None, (err, out[-3000:])
    assert f"step_{STEPS:08d} is damaged" in out and f"{info.relative_path}: sha256 mismatch" in out, out[-3000:]
    assert res["resumed_from"] == CKPT_EVERY, out[-3000:]
    diff = _max_diff(res["losses"], runs["d2t2"]["losses"])
    assert diff < TOL, f"fallback resume vs uninterrupted (2,2): {diff:.3e}\n{res['losses']}"
    assert (ck / f"step_{STEPS:08d}.damaged").is_dir() and (ck / f"step_{STEPS:08d}" / "complete.json").is_file()


@pytest.mark.dist
def test_resume_with_another_schedule(runs, capsys):
    """Item 6: d2t2's step-4 checkpoint (8-step schedule) resumed with training.steps=10 stops before
    loading, saying what changed and how to proceed; with training.resume_schedule=checkpoint it keeps
    the 8-step schedule: steps 5-8 equal the uninterrupted run's (before: silently re-planned)."""
    _copy_ckpts(runs, "d2t2", "resched", (CKPT_EVERY,))
    err, out, _ = _in_process(runs, "resched", capsys, ["training.steps=10"], ["--resume"])
    assert isinstance(err, SystemExit), (err, out[-3000:])
    msg = str(err.code)
    assert "training.steps 8 -> 10" in msg and "--set training.steps=8" in msg and "resume_schedule=checkpoint" in msg, msg
    assert "resumed from" not in out
    err, out, res = _in_process(runs, "resched", capsys, ["training.steps=10", "training.resume_schedule=checkpoint"],
                                ["--resume"])
    assert err is None, (err, out[-3000:])
    assert res["resumed_from"] == CKPT_EVERY and len(res["losses"]) == 10
    diff = _max_diff(res["losses"][:STEPS], runs["d2t2"]["losses"])
    assert diff < TOL, f"stored schedule kept vs uninterrupted: {diff:.3e}\n{res['losses']}"


def _load(*sets):
    sys.path.insert(0, str(ROOT / "launch"))
    from components.config import load_config

    return load_config(str(CONFIG), list(sets), environ={})


def test_config_overrides_and_errors():
    cfg = _load("training.steps=7", "ckpt_every=3", 'head="torch"', "betas=[0.8, 0.9]", "parallel.dp=2", "lr=1")
    assert cfg.training.steps == 7 and cfg.checkpoint.ckpt_every == 3 and cfg.model.head == "torch"
    assert cfg.training.betas == [0.8, 0.9] and cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)
    assert cfg.checkpoint.ckpt_dir.endswith("checkpoints") and (cfg.parallel.dp, cfg.parallel.tp) == (2, 2)
    with pytest.raises(ValueError, match=r"training.*'stpes'.*known.*steps"):
        _load("training.stpes=7")
    with pytest.raises(ValueError, match="unknown config key"):
        _load("nosuchkey=1")
    with pytest.raises(ValueError, match=r"training\.steps must be int"):
        _load("steps=ten")
    with pytest.raises(ValueError, match=r"parallel\.sp must be bool"):
        _load("parallel.sp=1")
    with pytest.raises(ValueError, match=r"model\.head must be one of"):
        _load("head=jax")
    with pytest.raises(ValueError, match=r"training\.optimizer_impl must be one of"):
        _load('optimizer_impl="apex"')
    assert _load('optimizer_impl="fused"').training.optimizer_impl == "fused"
    from components.config import filter_eps

    assert filter_eps(_load('grad_filter_eps="auto"').model) == "auto" and filter_eps(_load().model) is None
    assert filter_eps(_load('grad_filter_eps="1e-4"').model) == 1e-4
    with pytest.raises(ValueError, match=r"model\.grad_filter_eps must be .*'fast'"):
        _load('grad_filter_eps="fast"')
    with pytest.raises(ValueError, match=r"model\.grad_filter_eps must be .*'2'"):
        _load('grad_filter_eps="2"')
    with pytest.raises(ValueError, match=r"grad_filter_eps needs model\.head = 'flce'"):
        _load('grad_filter_eps="auto"', 'head="torch"')
    with pytest.raises(ValueError, match=r"batch_size=4 must be divisible by parallel\.dp=3"):
        _load("parallel.dp=3")
    with pytest.raises(ValueError, match=r"batch_size must be >= 1"):
        _load("batch_size=0")
    cfg = _load("parallel.dp=-1")
    with pytest.raises(ValueError, match="does not divide the world size 3"):
        cfg.resolve(3)
    assert _load().resolve(4).parallel.dp == 2
    with pytest.raises(ValueError, match=r"num_kv_heads=2 must be divisible by parallel\.tp=4"):
        _load("parallel.tp=4").resolve(4)


def test_data_order_and_dp_slices():
    import torch

    sys.path.insert(0, str(ROOT / "launch"))
    from components.data import SequenceData

    # the data position alone fixes every later batch, across epoch boundaries
    data = SequenceData(torch.arange(1000), seq_len=10, seed=3)
    whole = torch.cat([data.batch(p, 4) for p in range(0, 240, 4)])
    again = SequenceData(torch.arange(1000), seq_len=10, seed=3)
    assert torch.equal(again.batch(96, 8), whole[96:104])
    assert sorted(whole[:100, 0].tolist()) == list(range(0, 1000, 10))  # an epoch is a permutation
    assert not torch.equal(whole[:100], whole[100:200])  # each epoch has its own order
    # dp rank d reads rows [d*B/dp, (d+1)*B/dp) of the global batch
    assert torch.equal(torch.cat([data.batch(96, 8, d, 4) for d in range(4)]), data.batch(96, 8))
