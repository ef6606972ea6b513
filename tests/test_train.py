"""The training job (launch/train.py) on the CPU: convergence against a plain-torch baseline, and
fault tolerance under torchrun.

Three jobs are launched at once (module fixture), each with the tiny_cpu config, 30 steps, a
checkpoint every 10 steps, fp32, gloo, Helion reference mode, and each writes its per-step losses
to a JSON file:

- ``tp``: ``torchrun --nproc_per_node=2``: the vocab-parallel flce_dist head over 2 ranks;
- ``torch``: one process, ``--head torch``: ``nn.Linear`` + ``F.cross_entropy`` from the same seed;
- ``ft``: like ``tp`` under ``torchrun --max-restarts=1`` with ``FAIL_AT_STEP=15``: rank 1
  SIGKILLs itself after step 15 on the first attempt; torchrun restarts both ranks, which resume
  from the step-10 checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "launch" / "train.py"
CONFIG = ROOT / "configs" / "train" / "tiny_cpu.toml"
STEPS, CKPT_EVERY, FAIL_AT = 30, 10, 15


def _job(name: str, tmp: Path, launcher: list[str], extra_env: dict[str, str] | None = None) -> dict:
    out = tmp / name
    cmd = [*launcher, str(TRAIN), "--config", str(CONFIG),
           "--set", f"training.steps={STEPS}", "--set", f"checkpoint.ckpt_every={CKPT_EVERY}",
           "--set", f'job.out_dir="{out}"', "--set", f'data.cache_dir="{tmp / "cache"}"',
           "--set", 'job.progress="off"', "--set", "job.log_every=5"]
    if name == "torch":
        cmd += ["--head", "torch"]
    env = {**os.environ, "HELION_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if "FAIL_AT_STEP" not in (extra_env or {}):
        env.pop("FAIL_AT_STEP", None)
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return {"name": name, "proc": proc, "log": tmp / f"{name}.log", "losses": out / "losses.json", "fh": log}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    t0 = time.perf_counter()
    jobs = [
        _job("tp", tmp, torchrun),
        _job("torch", tmp, [sys.executable]),
        _job("ft", tmp, [*torchrun, "--max-restarts=1"], {"FAIL_AT_STEP": str(FAIL_AT)}),
    ]
    results = {}
    for j in jobs:
        try:
            rc = j["proc"].wait(timeout=300)
        except subprocess.TimeoutExpired:
            j["proc"].kill()
            rc = "timeout"
        j["fh"].close()
        text = "\n".join(line for line in j["log"].read_text().splitlines() if "registered at" not in line)
        assert rc == 0, f"{j['name']} job failed ({rc}):\n{text[-6000:]}"
        results[j["name"]] = {**json.loads(j["losses"].read_text()), "output": text}
    print(f"\n3 training jobs in {time.perf_counter() - t0:.1f} s")
    return results


@pytest.mark.dist
def test_tp_flce_matches_torch_baseline(runs):
    tp, base = runs["tp"], runs["torch"]
    assert (tp["head"], tp["world_size"], base["head"], base["world_size"]) == ("flce", 2, "torch", 1)
    a, b = tp["losses"], base["losses"]
    assert len(a) == len(b) == STEPS
    diff = max(abs(x - y) for x, y in zip(a, b))
    assert diff < 1e-4, f"max per-step loss difference {diff:.3e}\ntp:    {a}\ntorch: {b}"
    assert a[-1] < a[0] - 0.5, f"loss did not fall: {a[0]:.4f} -> {a[-1]:.4f}"


@pytest.mark.dist
def test_restart_after_rank_failure_resumes_exactly(runs):
    ft, tp = runs["ft"], runs["tp"]
    assert "fault injection: rank 1 kills itself after step 15" in ft["output"], ft["output"][-3000:]
    assert ft["restart_count"] == 1 and ft["resumed_from"] == CKPT_EVERY, {k: ft[k] for k in ("restart_count", "resumed_from")}
    assert len(ft["losses"]) == STEPS
    diff = max(abs(x - y) for x, y in zip(ft["losses"], tp["losses"]))
    assert diff <= 1e-6, f"resumed run differs from the uninterrupted one by {diff:.3e}"


def test_config_overrides_and_data_order():
    sys.path.insert(0, str(ROOT / "launch"))
    import torch
    import train

    cfg = train.load_config(str(CONFIG), ["training.steps=7", "ckpt_every=3", 'head="torch"', "betas=[0.8, 0.9]"])
    assert cfg["training"]["steps"] == 7 and cfg["checkpoint"]["ckpt_every"] == 3 and cfg["model"]["head"] == "torch"
    assert cfg["training"]["betas"] == [0.8, 0.9]
    assert cfg["checkpoint"]["ckpt_dir"].endswith("checkpoints")
    with pytest.raises(ValueError, match="unknown"):
        train.load_config(str(CONFIG), ["training.stpes=7"])
    # the data position alone fixes every later batch, across epoch boundaries
    data = train.SequenceData(torch.arange(1000), seq_len=10, seed=3)
    whole = torch.cat([data.batch(p, 4) for p in range(0, 240, 4)])
    again = train.SequenceData(torch.arange(1000), seq_len=10, seed=3)
    assert torch.equal(again.batch(96, 8), whole[96:104])
    assert sorted(whole[:100, 0].tolist()) == list(range(0, 1000, 10))  # an epoch is a permutation
    assert not torch.equal(whole[:100], whole[100:200])  # each epoch has its own order
