"""benchmarks/bench_rl.py (issue #16, the RL head) without a GPU: its arguments, the --cpu-smoke path on one
process and on 2 gloo ranks (the correctness check runs first in each, so the Megatron-style torch row is checked
against the TP=1 formula), and that the check rejects a wrong implementation. The flce_rl rows need
flce_dist.logprobs_and_entropy and skip (with that reason) in a tree without it."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flce_dist
import torch
from tests._checks import free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
bench_rl = pytest.importorskip("bench_rl")

HAS_RL = hasattr(flce_dist, "logprobs_and_entropy")
NO_RL = "flce_dist.logprobs_and_entropy does not exist in this tree yet (issue #16)"


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_arguments():
    a = bench_rl.parse_args(["--device", "cpu"])
    assert a.shapes == "llama3,qwen3,gemma" and a.n == 8192 and a.reps == 10 and a.data == ["random", "realistic"]
    assert a.temperature == 0.7 and a.beta == 0.01 and a.impls.split(",") == list(bench_rl.DEFAULT_IMPLS)
    a = bench_rl.parse_args(["--cpu-smoke", "--data", "realistic"])
    assert a.device == "cpu" and a.shapes == "tiny" and a.n == 64 and a.data == ["realistic"]
    for bad in (["--impls", "flce,nope"], ["--shapes", "gpt2"], ["--data", "uniform"]):
        with pytest.raises(SystemExit):
            bench_rl.parse_args(["--device", "cpu", *bad])


def test_cpu_smoke_torch_and_loss_rows(tmp_path):
    rows = bench_rl.main(["--cpu-smoke", "--impls", "flce_loss,flce_mean,torch", "--out", str(tmp_path)])
    assert [(r["data"], r["impl"]) for r in rows] == [(d, i) for d in ("random", "realistic")
                                                      for i in ("flce_loss", "flce_mean", "torch")]
    assert all(r["fwd_bwd_ms"] > 0 for r in rows)
    assert all(r["ratio"] == 1.0 for r in rows if r["impl"] == "flce_loss")
    saved = _rows(tmp_path / "bench_rl_tp1_smoke.csv")
    assert len(saved) == 6 and {"d_loss", "note", "mem_gib", "ratio"} <= set(saved[0])


@pytest.mark.skipif(not HAS_RL, reason=NO_RL)
def test_cpu_smoke_flce_rl(tmp_path):
    rows = bench_rl.main(["--cpu-smoke", "--data", "realistic", "--impls", "flce_rl,flce_loss,torch"])
    assert [r["impl"] for r in rows] == ["flce_rl", "flce_loss", "torch"]  # the check passed, then all were timed


@pytest.mark.skipif(not HAS_RL, reason=NO_RL)
def test_cpu_smoke_filter_rows(tmp_path):
    """The gradient filter's rows (copy and gather order) pass the check and are timed, each with its note."""
    rows = bench_rl.main(["--cpu-smoke", "--data", "random", "--impls", "flce_rl_filter,flce_rl_gather,flce_loss"])
    assert [r["impl"] for r in rows] == ["flce_rl_filter", "flce_rl_gather", "flce_loss"]
    assert [r["note"] for r in rows[:2]] == ["grad_filter_eps='auto', filter_order=copy",
                                             "grad_filter_eps='auto', filter_order=gather"]


def test_check_rejects_a_wrong_implementation(monkeypatch):
    wrong = lambda x, w, t, temp, group, start, vocab: bench_rl.torch_rl(x, w, t, temp * 1.01)  # noqa: E731
    monkeypatch.setattr(bench_rl, "flce_rl_fn", lambda: (wrong, "wrong temperature"))
    with pytest.raises(AssertionError, match="flce_rl differs"):
        bench_rl.main(["--cpu-smoke", "--data", "random", "--impls", "flce_rl"])


@pytest.mark.dist
def test_cpu_smoke_two_ranks(tmp_path):
    impls = "flce_rl,flce_loss,torch" if HAS_RL else "flce_loss,torch"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "benchmarks" / "bench_rl.py"), "--cpu-smoke", "--impls", impls,
           "--out", str(tmp_path)]
    env = {**os.environ, "HELION_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "check torch" in out and ("check flce_rl" in out) == HAS_RL
    rows = _rows(tmp_path / "bench_rl_tp2_smoke.csv")
    assert {r["impl"] for r in rows} == set(impls.split(",")) and {r["P"] for r in rows} == {"2"}
    assert all(r["note"] == "Megatron fp32 shard logits" for r in rows if r["impl"] == "torch")


def _fake_sm90(dev, p, dtype, entropy, target_check=False, temp_factor=1.0):
    """A stand-in for Liger's SM90 kernel on the CPU: the torch formula, entropy on or off (None)."""
    def rl(x, w, t, temp, group, *_):
        lp, en = bench_rl.torch_rl(x, w, t, temp * temp_factor)
        return (lp, en) if entropy else (lp, None)
    return rl, f"fake sm90, entropy {'on' if entropy else 'off'}"


@pytest.mark.skipif(not HAS_RL, reason=NO_RL)
def test_cpu_smoke_sm90_rows_against_their_flce_peers(tmp_path, monkeypatch, capsys):
    """Issue 53: ``liger_sm90`` (entropy on) and ``liger_sm90_noent`` (off) are checked (the entropy-off row
    against the log-prob-only reference gradient), timed in both modes, and compared with their flce peer
    (flce_rl, flce_loss) in the same mode; on this CPU the real kernel is skipped with its reason."""
    rows = bench_rl.main(["--cpu-smoke", "--data", "random", "--impls", "flce_rl,flce_loss,liger_sm90,liger_sm90_noent"])
    out = capsys.readouterr().out
    assert "skipping liger_sm90: needs a CUDA sm_90 GPU" in out and [r["impl"] for r in rows] == ["flce_rl", "flce_loss"]
    monkeypatch.setattr(bench_rl, "liger_sm90_fn", _fake_sm90)
    rows = bench_rl.main(["--cpu-smoke", "--data", "random", "--impls", "flce_rl,flce_loss,liger_sm90,liger_sm90_noent",
                          "--steady-calls", "3", "--idle-ms", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "check liger_sm90 " in out and "check liger_sm90_noent " in out
    assert "entropy" not in out.split("check liger_sm90_noent ")[1].splitlines()[0]  # no entropy to compare
    by = {r["impl"]: r for r in rows}
    assert list(by) == ["flce_rl", "flce_loss", "liger_sm90", "liger_sm90_noent"]
    for impl, peer in (("liger_sm90", "flce_rl"), ("liger_sm90_noent", "flce_loss")):
        r = by[impl]
        assert r["peer"] == peer and r["vs_peer"] == pytest.approx(r["single_ms"] / by[peer]["single_ms"])
        assert r["vs_peer_steady"] == pytest.approx(r["steady_ms"] / by[peer]["steady_ms"])
    for r in rows:
        assert r["fwd_bwd_ms"] == r["single_ms"] > 0 and r["steady_ms"] > 0 and r["steady_calls"] == 3
        assert r["host_ms"] == pytest.approx(r["single_ms"] - r["steady_ms"])
        assert r["single_x3mm"] == pytest.approx(r["single_ms"] / r["floor3_ms"])
    saved = _rows(tmp_path / "bench_rl_tp1_random_smoke.csv")
    assert {"single_ms", "steady_ms", "host_ms", "vs_peer", "vs_peer_steady", "peer", "steady_x3mm"} <= set(saved[0])
    assert [r["peer"] for r in saved] == ["", "", "flce_rl", "flce_loss"]


def test_check_rejects_a_wrong_entropy_off_row(monkeypatch):
    monkeypatch.setattr(bench_rl, "liger_sm90_fn", lambda *a, **k: _fake_sm90(*a, **k, temp_factor=1.05))
    with pytest.raises(AssertionError, match="liger_sm90_noent differs"):
        bench_rl.main(["--cpu-smoke", "--data", "random", "--impls", "liger_sm90_noent"])


def test_sm90_target_check_switch(monkeypatch):
    """The liger_sm90 rows turn Liger's host-syncing target check off around the call only (--liger-target-check:
    left as it is)."""
    seen = []
    with bench_rl._env(bench_rl.SM90_CHECK_ENV, "0"):
        seen.append(os.environ.get(bench_rl.SM90_CHECK_ENV))
    monkeypatch.setenv(bench_rl.SM90_CHECK_ENV, "1")
    with bench_rl._env(bench_rl.SM90_CHECK_ENV, None):
        seen.append(os.environ.get(bench_rl.SM90_CHECK_ENV))
    with bench_rl._env(bench_rl.SM90_CHECK_ENV, "0"):
        seen.append(os.environ.get(bench_rl.SM90_CHECK_ENV))
    assert seen == ["0", "1", "0"] and os.environ[bench_rl.SM90_CHECK_ENV] == "1"
    a = bench_rl.parse_args(["--cpu-smoke"])
    assert a.steady_calls == 2 and not a.liger_target_check
    assert bench_rl.parse_args(["--device", "cpu"]).steady_calls == 4
    import torch

    fn, why = bench_rl.liger_sm90_fn(torch.device("cpu"), 2, torch.bfloat16, True)
    assert fn is None and why == "a single-GPU kernel (TP=1 only)"
    fn, why = bench_rl.liger_sm90_fn(torch.device("cpu"), 1, torch.bfloat16, False)
    assert fn is None and "sm_90" in why


def test_rounds_pair_each_liger_row_with_its_flce_row(monkeypatch, capsys):
    """``--rounds`` (issue 53): the rows and the three matmuls timed again in interleaved rounds per timing mode; a
    Liger row gets its median per-round ratio to its flce counterpart (``PEERS``), each mode apart; rounds that drift
    together cancel. On the CPU smoke path the columns are there for every row; refused under torchrun."""
    base = {"3mm": 1.0, "flce_rl": 2.0, "liger_sm90": 2.2, "flce_loss": 1.5, "liger_sm90_noent": 1.5 * 1.04}
    single = dict(base, liger_sm90=2.0 * 1.06)

    def fake(fns, rounds, tm):
        assert set(fns) == set(base)
        return {m: {k: [b[k] * 1.1 ** r for r in range(rounds)] for k in fns} for m, b in
                (("steady", base), ("single", single))}

    monkeypatch.setattr(bench_rl.common, "interleaved_modes", fake)
    by_impl = {k: dict(impl=k) for k in base if k != "3mm"}
    bench_rl.peer_rounds(by_impl, {k: None for k in by_impl}, None, 3, None)
    assert by_impl["liger_sm90"]["vs_peer_rounds"] == pytest.approx(1.1)
    assert by_impl["liger_sm90"]["vs_peer_rounds_single"] == pytest.approx(1.06)
    assert by_impl["liger_sm90_noent"]["vs_peer_rounds"] == pytest.approx(1.04)
    assert "vs_peer_rounds" not in by_impl["flce_rl"] and by_impl["flce_rl"]["rounds_x3mm"] == pytest.approx(2.0)
    out = capsys.readouterr().out
    assert "interleaved steady, 3 rounds" in out and "flce_rl vs liger_sm90: flce ahead by +10.0%" in out
    assert "interleaved single, 3 rounds" in out and "flce_rl vs liger_sm90: flce ahead by +6.0%" in out
    monkeypatch.undo()
    rows = bench_rl.main(["--cpu-smoke", "--data", "random", "--impls", "flce_loss,torch", "--rounds", "2"])
    assert all(r["rounds_ms"] > 0 and r["rounds_single_ms"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        bench_rl.parse_args(["--cpu-smoke", "--rounds", "-1"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        bench_rl.parse_args(["--cpu-smoke", "--rounds", "2"])


def test_bench_trace_cpu_smoke(tmp_path, monkeypatch):
    """benchmarks/bench_trace.py (issue 60): the grpo / padfree traces are seeded and shaped as documented, and
    the --cpu-smoke trace runs flce and torch, each in a fresh process, for both heads, with every column."""
    import bench_trace
    from flce_dist import _timing

    monkeypatch.setattr(_timing, "RESULTS", tmp_path / "results")
    g = bench_trace.trace("grpo", 50)
    assert g == bench_trace.trace("grpo", 50) and all(n == 8 * max(lens) and 16 <= min(lens) for n, lens in g)
    assert len({n for n, _ in g}) > 25  # N changes at nearly every call
    p = bench_trace.trace("padfree", 50, seed=3)
    assert all(512 <= n <= bench_trace.MAX_N and lens is None for n, lens in p) and len({n for n, _ in p}) > 40
    t = bench_trace.targets(torch.arange(64), 16, [1, 2, 8, 3, 4, 5, 6, 7])  # 8 completions of 2 padded positions
    assert t.tolist()[:4] == [0, -100, 2, 3]
    for head in ("loss", "rl"):
        rows = bench_trace.main(["--cpu-smoke", "--head", head, "--out", str(tmp_path)])
        assert [r["impl"] for r in rows] == (["flce", "torch"] if head == "loss" else ["flce_rl", "torch_rl"])
        for r in rows:
            assert "error" not in r, r
            assert r["calls"] == 6 and r["p50_ms"] > 0 and r["total_s"] > 0 and r["first_ms"] >= r["p50_ms"] * 0.5
        assert rows[0]["helion_binds"] > 0 and rows[1]["helion_binds"] == 0
        assert (tmp_path / f"bench_trace_{head}.csv").is_file()
