"""The benchmark helpers that need no GPU: the TP scaling-efficiency arithmetic, the data modes
(benchmarks/data.py), the benchmarks' argument parsing (benchmarks/common.py), the plot of data-mode
CSVs, the probes in benchmarks/probes/ and benchmarks/device.sh's list of steps."""

from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH / "probes"))  # the one-off probes (they put benchmarks/ on the path themselves)
sys.path.insert(0, str(BENCH))
scaling = pytest.importorskip("scaling")
bench_data = pytest.importorskip("data")
common = pytest.importorskip("common")


def _write(path: Path, p: int, n: int, flce_ms: float, ar_ms: float) -> None:
    rows = [dict(shape="llama3", impl="floor", P=p, N=n, fwd_bwd_ms=1.0, ratio=1.0, mem_gib=0.0, mm_ms=0.3, allreduce_ms=ar_ms),
            dict(shape="llama3", impl="flce", P=p, N=n, fwd_bwd_ms=flce_ms, ratio=1.2, mem_gib=1.0 / p, mm_ms=0.3, allreduce_ms=ar_ms)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_scaling_efficiency(tmp_path):
    _write(tmp_path / "bench_tp1.csv", 1, 8192, 40.0, 0.0)
    _write(tmp_path / "bench_tp2.csv", 2, 8192, 22.0, 1.0)
    _write(tmp_path / "bench_tp8.csv", 8, 8192, 8.0, 1.5)
    _write(tmp_path / "bench_tp4_n32768.csv", 4, 32768, 30.0, 2.0)  # no P=1 at this N: skipped
    rows = scaling.efficiency(scaling.load([str(tmp_path)], "flce"))
    got = {(r["N"], r["P"]): r for r in rows}
    assert set(got) == {(8192, 1), (8192, 2), (8192, 8)}
    assert got[(8192, 1)]["efficiency"] == pytest.approx(1.0)
    assert got[(8192, 2)]["ideal_ms"] == pytest.approx(40.0 / 2 + 1.0)
    assert got[(8192, 2)]["efficiency"] == pytest.approx(21.0 / 22.0)
    assert got[(8192, 8)]["efficiency"] == pytest.approx((5.0 + 1.5) / 8.0)


def test_scaling_plot(tmp_path):
    pytest.importorskip("matplotlib")  # the .[bench] extra
    _write(tmp_path / "bench_tp1.csv", 1, 8192, 40.0, 0.0)
    _write(tmp_path / "bench_tp4.csv", 4, 8192, 11.0, 1.0)
    scaling.plot(scaling.efficiency(scaling.load([str(tmp_path)], "flce")), tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").stat().st_size > 0


def test_scaling_filters_data_mode(tmp_path):
    rows = []
    for data, ms in (("random", 40.0), ("realistic", 30.0)):
        rows.append(dict(shape="llama3", data=data, impl="floor", P=1, N=8192, fwd_bwd_ms=1.0, ratio=1.0, mem_gib=0.0,
                         mm_ms=0.3, allreduce_ms=0.0))
        rows.append(dict(shape="llama3", data=data, impl="flce", P=1, N=8192, fwd_bwd_ms=ms, ratio=1.2, mem_gib=1.0,
                         mm_ms=0.3, allreduce_ms=0.0))
    with open(tmp_path / "bench_tp1.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert scaling.load([str(tmp_path)], "flce")[("llama3", 8192)][1]["ms"] == 40.0
    assert scaling.load([str(tmp_path)], "flce", "realistic")[("llama3", 8192)][1]["ms"] == 30.0


# ---- data modes (benchmarks/data.py) ----

def test_random_mode_is_the_old_bench_input():
    """mode="random" repeats bench.py's / bench_tp.py's pre-data-mode generator calls bit for bit."""
    n, h, v = 64, 96, 1000
    for dt in (torch.bfloat16, torch.float32):
        g = torch.Generator(device="cpu").manual_seed(0)
        x0 = torch.randn(n, h, device="cpu", dtype=dt, generator=g)
        w0 = torch.randn(v, h, device="cpu", dtype=dt, generator=g) * h**-0.5
        t0 = torch.randint(0, v, (n,), device="cpu", generator=g)
        x, w, t = bench_data.make_inputs(n, h, v, mode="random", dtype=dt, device="cpu", seed=0)
        assert x.dtype == w.dtype == dt
        assert torch.equal(x, x0) and torch.equal(w, w0) and torch.equal(t, t0)


def _realistic(seed=0, **kw):
    return bench_data.make_inputs(512, 256, 5000, mode="realistic", dtype=torch.bfloat16, device="cpu", seed=seed, **kw)


def test_realistic_loss_and_long_tail():
    import flce_dist

    x, w, t = _realistic()
    assert x.shape == (512, 256) and w.shape == (5000, 256) and t.shape == (512,) and t.dtype == torch.int64
    assert x.dtype == w.dtype == torch.bfloat16 and not x.requires_grad
    loss = flce_dist.reference_loss(x.double(), w.double(), t).item()
    assert 1.5 <= loss <= 3.5, loss
    counts = torch.bincount(t, minlength=5000).sort(descending=True).values
    assert counts[:50].sum().item() / 512 > 0.20  # the top 1% of the vocab holds > 20% of the targets
    z = x.double() @ w.double().T
    assert 8 <= z.max(1).values.mean().item() <= 30  # max logit per row of realistic scale
    assert 1.0 <= z.std(1).mean().item() <= 5.0


def test_realistic_is_deterministic_and_shuffled():
    a, b, c = _realistic(0), _realistic(0), _realistic(1)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[2], c[2])
    # shuffled vocabulary: the frequent tokens are spread over the ids; sorted_vocab: ids in frequency order
    _, _, t = a
    _, _, ts = _realistic(0, sorted_vocab=True)
    assert (ts < 50).float().mean().item() > 0.20
    assert (t < 50).float().mean().item() < 0.10


def test_describe():
    import flce_dist

    xr, wr, tr = bench_data.make_inputs(512, 256, 5000, mode="random", seed=0)
    xs, ws, ts = _realistic()
    blk = (16, 16)  # 128x128 blocks are never all negligible at V=5000
    dr, ds = (bench_data.describe(x, w, t, block=blk) for x, w, t in ((xr, wr, tr), (xs, ws, ts)))
    for d in (dr, ds):
        assert 0.0 <= d["skip_frac"] <= 1.0 and 0.0 <= d["skip_frac_sorted"] <= 1.0
        assert d["rows"] == 512 and set(bench_data.DESCRIBE_KEYS) <= set(d)
        assert 0.0 <= d["entropy"] <= math.log(5000) + 1e-4
    assert ds["skip_frac_sorted"] > dr["skip_frac_sorted"] and ds["skip_frac"] >= dr["skip_frac"]
    assert ds["skip_frac_sorted"] >= ds["skip_frac"]
    assert ds["loss"] == pytest.approx(flce_dist.reference_loss(xs.double(), ws.double(), ts).item(), rel=1e-3)
    assert ds["entropy_std"] > 0.5  # entropy spread out over the tokens
    assert dr["loss"] > 8 and ds["loss"] < 3.5
    d = bench_data.describe(xs, ws, ts, max_rows=100)  # a subsample that is not a whole number of blocks
    assert d["rows"] == 100 and 0.0 <= d["skip_frac"] <= 1.0
    # blocks fully negligible by construction: rows whose softmax is one-hot on their target
    x = torch.zeros(4, 2)
    x[:, 0] = 100.0
    w = torch.zeros(6, 2)
    w[0, 0] = 1.0
    d = bench_data.describe(x, w, torch.zeros(4, dtype=torch.long), block=(2, 2))
    assert d["skip_frac"] == 1.0 and d["loss"] == pytest.approx(0.0, abs=1e-6)


def test_trained_fixture_tiles_rows(tmp_path):
    hid = torch.randn(10, 8).bfloat16()
    weight = torch.randn(30, 8).bfloat16()
    tgt = torch.randint(0, 30, (10,))
    torch.save(dict(hidden=hid, weight=weight, target=tgt), tmp_path / "f.pt")
    assert bench_data.fixture_shape(tmp_path / "f.pt") == (8, 30)
    x, w, t = bench_data.make_inputs(25, None, None, mode="trained", fixture=tmp_path / "f.pt")
    assert x.shape == (25, 8) and torch.equal(x[10:20], hid) and torch.equal(t[20:], tgt[:5]) and torch.equal(w, weight)
    x, _, t = bench_data.make_inputs(4, 8, 30, mode="trained", fixture=tmp_path / "f.pt", dtype=torch.float32)
    assert x.dtype == torch.float32 and t.shape == (4,)
    with pytest.raises(ValueError, match="V=30"):
        bench_data.make_inputs(4, 8, 31, mode="trained", fixture=tmp_path / "f.pt")
    with pytest.raises(ValueError, match="fixture"):
        bench_data.make_inputs(4, 8, 30, mode="trained")
    with pytest.raises(ValueError, match="mode"):
        bench_data.make_inputs(4, 8, 30, mode="uniform")


def test_bench_argument_parsing():
    bench = pytest.importorskip("bench")
    a = bench.parse_args([])
    assert a.data == ["random", "realistic"] and a.impls == ""
    a = bench.parse_args(["--data", "realistic", "--impls", "cce_exact", "--shapes", "gemma"])
    assert a.data == ["realistic"] and a.impls.split(",") == ["cce_exact"]
    assert common.cases(a) == [("gemma", "realistic", 2304, 262208)]
    a = bench.parse_args(["--data", "random,realistic", "--shapes", "llama3,qwen3"])
    assert [c[:2] for c in common.cases(a)] == [("llama3", "random"), ("llama3", "realistic"), ("qwen3", "random"),
                                               ("qwen3", "realistic")]
    for bad in (["--data", "uniform"], ["--data", "trained"], ["--shapes", "gpt2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    assert common.csv_suffix(["random", "realistic"]) == "" and common.csv_suffix(["realistic"]) == "_realistic"
    assert common.csv_name("bench_tp2", ["realistic"], 32768) == "bench_tp2_n32768_realistic.csv"
    assert common.csv_name("bench_bf16", ["random", "realistic"], 8192) == common.csv_name("bench_bf16", ["random", "realistic"]) \
        == "bench_bf16.csv"
    assert scaling._NAME.search("bench_tp2_n32768_realistic.csv").groups() == ("2", "32768")
    bench_tp = pytest.importorskip("bench_tp")
    a = bench_tp.parse_args(["--data", "realistic", "--impls", "flce,megatron"])
    assert a.data == ["realistic"]
    for bad in (["--data", "nope"], ["--shapes", "gpt2"]):
        with pytest.raises(SystemExit):
            bench_tp.parse_args(bad)


def test_bench_chunk_plan_and_table(capsys):
    """common.chunk_plan gives the fused strategy's own rows (the CPU plan: 256 MiB chunks; an explicit
    budget through the settings), and the table prints ``xplan``, the ratio to that plan's cuBLAS work."""
    bench = pytest.importorskip("bench")
    import flce_dist
    from flce_dist.chunking import chunk_rows
    from flce_dist.settings import current

    x = torch.randn(5000, 64, dtype=torch.bfloat16)
    assert common.chunk_plan(x, 300000) == chunk_rows(5000, 300000, 2, x.device, current())
    assert common.chunk_plan(x, 300000) < 5000  # several chunks at this V: the plan is not the whole batch
    with flce_dist.override(chunk_bytes=1 << 20):
        assert common.chunk_plan(x, 4096) == 125  # 1 MiB = 128 rows of 4096 bf16, balanced: 40 chunks of 125
    row = dict(shape="llama3", data="random", impl="flce", fwd_bwd_ms=40.0, ratio_fb=1.1, steady_ms=39.0,
               ratio_steady=1.05, fwd_ms=13.0, ratio_f=1.05, mem_gib=1.7, extra_gib=0.74, fwd_mem_gib=0.05,
               ratio_fb3=1.05, ratio_plan=1.0123)
    bench.print_table([row])
    out = capsys.readouterr().out
    assert "xplan" in out.splitlines()[0] and out.splitlines()[1].rstrip().endswith("1.01")
    bench.print_table([dict(row, rounds_ms=38.5, vs_flce=1.0, rounds_single_ms=39.5, vs_flce_single=1.0),
                       dict(row, impl="liger_c16", rounds_ms=40.0, vs_flce=1.039, rounds_single_ms=40.3,
                            vs_flce_single=1.021)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-6:] == ["rounds", "/flce", "rnd", "1", "/flce", "1"]
    assert lines[2].rstrip().endswith("40.00  1.039    40.30   1.021")


def test_plot_per_data_mode(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    plot = pytest.importorskip("plot")
    rows = [dict(shape="llama3", data=d, impl=i, fwd_bwd_ms=1.0, ratio_fb=r, mem_gib=1.0)
            for d in ("random", "realistic") for i, r in (("matmul", 1.0), ("flce", 1.1), ("cce", 1.3), ("cce_exact", 3.0))]
    with open(tmp_path / "bench_bf16.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    sets = plot._load(tmp_path / "bench_bf16.csv")
    assert [t for t, _ in sets] == ["TP=1 random", "TP=1 realistic"]
    assert [t for t, _ in plot._load(tmp_path / "bench_bf16.csv", ["realistic"])] == ["TP=1 realistic"]
    monkeypatch.setattr(sys, "argv", ["plot.py", str(tmp_path / "bench_bf16.csv"), "--out", str(tmp_path / "s.png")])
    plot.main()
    assert (tmp_path / "s.png").stat().st_size > 0


def test_plot_chunk_sweep(tmp_path, monkeypatch):
    """plot.py --chunk-sweep reads ab_flce.py's CSV rows (run 21's columns) into one panel per data mode."""
    pytest.importorskip("matplotlib")
    plot = pytest.importorskip("plot")
    rows = [dict(tag=f"c{mb}", shape=s, data=d, chunk_mb=mb, extra_gib=g, ratio_dist3=r, plan_vs_dist3=r - 0.02)
            for d in ("random", "realistic") for s in ("llama3", "gemma")
            for mb, g, r in (("", 0.74, 1.06), ("2048", 2.14, 1.02))]
    with open(tmp_path / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    monkeypatch.setattr(sys, "argv", ["plot.py", "--chunk-sweep", str(tmp_path / "sweep.csv"), "--out",
                                      str(tmp_path / "c.png")])
    plot.main()
    assert (tmp_path / "c.png").stat().st_size > 0


def test_capture_from_dcp_checkpoint(tmp_path):
    """capture_trained.py --checkpoint: a DCP folder holding a LlamaForCausalLM state dict under a
    prefix becomes a fixture that make_inputs(mode="trained") loads."""
    pytest.importorskip("transformers")
    import torch.distributed.checkpoint as dcp

    capture = pytest.importorskip("capture_trained")
    torch.manual_seed(0)
    model = capture.build_llama(50, 16, 32, 2, 2, 1, 32)
    ckpt = tmp_path / "checkpoints" / "step_10"
    dcp.save({"app": {"model": model.state_dict()}}, checkpoint_id=str(ckpt))
    torch.save({"ids": torch.randint(0, 50, (500,), dtype=torch.int32), "vocab_size": 50}, tmp_path / "tokens.pt")
    (tmp_path / "m.toml").write_text("[model]\nnum_heads = 2\nnum_kv_heads = 1\n")
    out = tmp_path / "fx.pt"
    capture.main(["--device", "cpu", "--checkpoint", str(ckpt), "--tokens", str(tmp_path / "tokens.pt"),
                  "--config", str(tmp_path / "m.toml"), "--seq", "32", "--rows", "100", "--out", str(out)])
    x, w, t = bench_data.make_inputs(150, 16, 50, mode="trained", fixture=out)
    assert x.shape == (150, 16) and w.shape == (50, 16) and x.dtype == torch.bfloat16
    assert torch.equal(w, model.lm_head.weight.detach().bfloat16())
    assert 0 <= int(t.min()) and int(t.max()) < 50


def test_probe_scripts_import():
    """benchmarks/probes/merge_probe.py and kernel_profile.py import without a GPU (their CUDA work is in main)."""
    merge_probe = pytest.importorskip("merge_probe")
    pytest.importorskip("kernel_profile")  # imports without a GPU too (its cases come from data.cases)
    assert all(bn & (bn - 1) == 0 and bt & (bt - 1) == 0 for bn, bt, _, _ in merge_probe.CANDIDATES)


def test_literal_shapes():
    """bench.py's ``--shapes`` takes ``<H>x<V>`` beside the named shapes (issue 30's table has shapes with no model
    name); a malformed one is refused by name."""
    import argparse

    import common

    ap = argparse.ArgumentParser()
    common.add_case_args(ap)
    args = ap.parse_args(["--shapes", "4096x32000,gemma", "--data", "random"])
    common.check_case_args(ap, args)
    assert common.cases(args) == [("4096x32000", "random", 4096, 32000), ("gemma", "random", 2304, 262208)]
    bad = ap.parse_args(["--shapes", "4096x", "--data", "random"])
    with pytest.raises(SystemExit):
        common.check_case_args(ap, bad)


def test_three_matmuls_and_energy():
    """``_timing.three_matmuls`` runs the layer's three distinct matmuls; ``energy_j`` is None without a GPU."""
    from flce_dist._timing import three_matmuls

    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 24, generator=g, dtype=torch.float64)
    w = torch.randn(300, 24, generator=g, dtype=torch.float64) * 0.7
    xb, wb = x, w
    run = three_matmuls(xb, wb)
    run()
    y, dy, dx, dw = run.buffers
    torch.testing.assert_close(y, xb @ wb.T)
    assert torch.isfinite(dy).all() and dy.std() > 0.5  # random, not zeros
    torch.testing.assert_close(dx, dy @ wb)
    torch.testing.assert_close(dw, dy.T @ xb)
    if not torch.cuda.is_available():  # NVML's energy counter needs a GPU: no reading, and fn is not called
        from flce_dist._timing import energy_j

        calls = []
        assert energy_j(lambda: calls.append(1), calls=3) is None and not calls


def _small_call_inputs(n: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded bf16 leaves x [n, 16], w [v, 16] and int64 targets for one small traced fused call."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 16, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, 16, generator=g) * 0.3).bfloat16().requires_grad_()
    return x, w, torch.randint(0, v, (n,), generator=g)


def test_op_trace_names_the_small_ops():
    """benchmarks/probes/op_trace.py on the CPU (reference mode): the Helion launches of one fused call are
    marked in order, the torch ops outside them are counted apart from those their host code runs,
    and ``_launch`` is restored afterwards."""
    import flce_dist
    from flce_dist.kernels import launch

    op_trace = pytest.importorskip("op_trace")
    flce_dist.setup_reference_mode()
    x, w, t = _small_call_inputs(70, 33)
    real = launch._launch
    log = op_trace.OpLog()
    op_trace.trace(lambda: flce_dist.fused_linear_cross_entropy(x, w, t).backward(), log)
    assert launch._launch is real and w.grad is not None
    order = log.order
    assert "[target_rows]" in order and "[lse_forward]" in order
    assert order.index("[target_rows]") < order.index("[lse_forward]")
    inside = {where for where, _ in log.counts if where}
    assert "lse_forward" in inside  # reference mode runs the kernel body as torch ops: listed under its name
    assert sum(c for (where, _), c in log.counts.items() if not where) == sum(1 for o in order if not o.startswith("["))
    assert op_trace.cuda_kernels(lambda: None) == [] or torch.cuda.is_available()


def test_chunked_matmuls_models_the_loss_plan():
    """``_timing.chunked_matmuls`` is a floor only while it issues the loss's own cuBLAS work: traced
    (op_trace) on one fused call with a 3-chunk plan, the loss runs per chunk one float32-out dX
    matmul, the first chunk writes dW and the later ones ``addmm_`` into it (plus one reference-sample
    matmul); the model runs the same dW ops and one logits matmul per chunk where the loss runs its
    Helion pass. A change to the loss's matmul structure fails here until the model follows it."""
    import flce_dist
    from flce_dist import core
    from flce_dist._timing import chunked_matmuls
    from flce_dist.options import FLCEParams, LossOptions

    op_trace = pytest.importorskip("op_trace")
    flce_dist.setup_reference_mode()
    x, w, t = _small_call_inputs(300, 40)
    with flce_dist.override(chunk_bytes=128 * 40 * 2):
        rows = core.fused_plan(300, x, FLCEParams(0, 40, LossOptions(), flce_dist.settings.current()), None, False)
        loss = op_trace.OpLog()
        op_trace.trace(lambda: flce_dist.fused_linear_cross_entropy(x, w, t).backward(), loss)
    chunks = -(-300 // rows)
    assert chunks == 3
    model = op_trace.OpLog()
    op_trace.trace(chunked_matmuls(x.detach(), w.detach(), rows), model)
    lc = {op: c for (where, op), c in loss.counts.items() if not where}
    mc = {op: c for (where, op), c in model.counts.items() if not where}
    assert lc.get("aten.mm.dtype") == chunks  # dX = E' @ W in float32 (the CPU model: mm, then .float())
    assert lc.get("aten.addmm_.default") == mc.get("aten.addmm_.default") == chunks - 1
    assert lc.get("aten.mm.out") == 1 and mc.get("aten.mm.out") == chunks + 1  # dW written once; + the logits
    assert lc.get("aten.mm.default") == 1 and mc.get("aten.mm.default") == chunks  # the reference; the model's dX


@pytest.mark.parametrize("n,rows", [(301, 128), (128, 128), (77, 200)])
def test_chunked_matmuls_is_the_chunked_product(n, rows):
    """``_timing.chunked_matmuls`` (the fused plan's cuBLAS work alone): its dW is the sum over the
    token chunks of E_c.T x_c with E_c = x_c W.T, the last chunk's logits are left in the buffer,
    and every chunk is visited (an uneven tail included)."""
    from flce_dist._timing import chunked_matmuls

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 24, generator=g, dtype=torch.float64)
    w = torch.randn(37, 24, generator=g, dtype=torch.float64)
    run = chunked_matmuls(x, w, rows)
    run()
    buf, dw = run.buffers
    torch.testing.assert_close(dw, (x @ w.T).T @ x)
    last = x[(n - 1) // rows * rows:]
    torch.testing.assert_close(buf[:last.shape[0]], last @ w.T)
    with pytest.raises(ValueError, match="rows"):
        chunked_matmuls(x, w, 0)


def test_cases_by_data_mode(tmp_path):
    """data.cases, which every benchmark and probe lists its runs with: one case per (shape, data
    mode), ``trained`` at the fixture's own H and V."""
    from flce_dist._timing import SHAPES

    assert bench_data.cases("llama3,gemma", ["random", "realistic"], SHAPES) == [
        ("llama3", "random", 4096, 128256), ("llama3", "realistic", 4096, 128256),
        ("gemma", "random", 2304, 262208), ("gemma", "realistic", 2304, 262208)]
    fx = tmp_path / "fx.pt"
    torch.save({"hidden": torch.zeros(4, 24, dtype=torch.bfloat16), "weight": torch.zeros(77, 24, dtype=torch.bfloat16),
                "target": torch.zeros(4, dtype=torch.int64)}, fx)
    assert bench_data.cases("qwen3", ["random", "trained"], SHAPES, str(fx)) == [("qwen3", "random", 4096, 151936),
                                                                  ("trained", "trained", 24, 77)]


def test_ab_flce_interleaves_the_forward_with_its_matmul(monkeypatch):
    """ab_flce.py --fwd-rounds: each round times the bare matmul, then the loss's forward (alternated,
    so that both see the same power state), and returns the rounds in order; the loss really runs
    (reference mode) and its value is the float64 reference's; --fwd-only without rounds is refused."""
    import subprocess

    import flce_dist
    from flce_dist import reference

    ab = pytest.importorskip("ab_flce")
    flce_dist.setup_reference_mode()
    seen, values = [], []

    def fake_steady(fn, reps, calls=5):
        out = fn()
        kind = "mm" if out.dim() == 2 else "fwd"
        seen.append(kind)
        if kind == "fwd":
            values.append(out)
        return 2.0 + len(seen) if kind == "mm" else 3.0 + len(seen)

    monkeypatch.setattr(ab, "cuda_steady_ms", fake_steady)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(13, 8, generator=g), torch.randn(37, 8, generator=g)
    t = torch.randint(0, 37, (13,), generator=g)
    mms, fwds = ab.interleaved_forward(x, w, t, 3, 2)
    assert seen == ["mm", "fwd"] * 3
    assert mms == [3.0, 5.0, 7.0] and fwds == [5.0, 7.0, 9.0]
    want = reference.reference_loss(x.double(), w.double(), t)
    torch.testing.assert_close(values[0].double(), want, rtol=1e-5, atol=1e-5)
    r = subprocess.run([sys.executable, str(Path(ab.__file__)), "--tag", "x", "--fwd-only"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "--fwd-only needs --fwd-rounds >= 1" in r.stderr


def test_ab_flce_shard_emulates_one_rank(monkeypatch):
    """ab_flce.py --shard P: rank 0's rows of the full head, targets folded into the shard, and each
    case yielded inside the chunk budget that gives the loss the rank's chunk rows (common.chunk_plan
    agrees), the override gone after the case; --shard 1 leaves the case alone; --shard 0 is refused."""
    import argparse
    import subprocess

    import flce_dist

    ab = pytest.importorskip("ab_flce")
    g = torch.Generator().manual_seed(9)
    full = {}

    def fake_inputs(n, h, v, mode, sorted_vocab=False, fixture=""):
        full[mode] = (torch.randn(n, h, generator=g), torch.randn(v, h, generator=g), torch.randint(0, v, (n,), generator=g))
        return full[mode]

    monkeypatch.setattr(ab, "case_inputs", fake_inputs)
    monkeypatch.setattr(ab, "SHAPES", {"odd": (24, 50001)})
    args = argparse.Namespace(shapes="odd", data=["random", "realistic"], fixture="", sorted_vocab=False, n=3000, shard=2)
    before = flce_dist.settings.current().chunk_bytes
    seen = 0
    for shape, mode, h, v, x, w, t in ab.timed_cases(args):
        xf, wf, tf = full[mode]
        assert shape == "odd/2" and h == 24 and v == 25001 and x is xf
        assert torch.equal(w, wf[:25001]) and w.requires_grad and torch.equal(t, tf % 25001) and (tf >= 25001).any()
        budget = flce_dist.settings.current().chunk_bytes
        assert budget is not None and budget % (25001 * 4) == 0
        assert ab.common.chunk_plan(x, v) == budget // (25001 * 4) < 3000  # the rank's rows, several chunks
        seen += 1
    assert seen == 2 and flce_dist.settings.current().chunk_bytes == before
    args.shard = 1
    (case,) = [c for c in ab.timed_cases(argparse.Namespace(**{**vars(args), "data": ["random"]}))]
    assert case[0] == "odd" and case[3] == 50001 and case[5] is full["random"][1]
    r = subprocess.run([sys.executable, str(Path(ab.__file__)), "--tag", "x", "--shard", "0"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "--shard must be >= 1" in r.stderr


def test_ab_flce_main_writes_loss_and_forward_csvs(monkeypatch, tmp_path, capsys):
    """ab_flce.main with --fwd-rounds and --shard (timers faked, the loss run for real in reference
    mode): the loss rows and the interleaved forward rows go to two CSVs with their own columns (one
    writer for both failed on the device in run 22), and the printed lines carry the shard's name."""
    import flce_dist

    ab = pytest.importorskip("ab_flce")
    flce_dist.setup_reference_mode()
    g = torch.Generator().manual_seed(13)

    def fake_inputs(n, h, v, mode, sorted_vocab=False, fixture=""):
        return (torch.randn(n, h, generator=g).requires_grad_(), torch.randn(v, h, generator=g).requires_grad_(),
                torch.randint(0, v, (n,), generator=g))

    def fake_timer(fn, reps, calls=5):
        fn()
        return 2.0

    monkeypatch.setattr(ab, "case_inputs", fake_inputs)
    monkeypatch.setattr(ab, "SHAPES", {"odd": (16, 1001)})
    monkeypatch.setattr(ab, "cuda_steady_ms", fake_timer)
    monkeypatch.setattr(ab, "cuda_time_ms", fake_timer)
    monkeypatch.setattr(ab, "energy_j", lambda fn, *a, **k: None)
    monkeypatch.setattr(ab, "peak_gib", lambda fn, x, w: 1.0)
    monkeypatch.setattr(ab.torch.cuda, "empty_cache", lambda: None)
    from flce_dist import _timing

    monkeypatch.setattr(_timing, "RESULTS", tmp_path / "results")  # not the repository's benchmarks/results
    monkeypatch.setattr(sys, "argv", ["ab_flce.py", "--tag", "t", "--shapes", "odd", "--data", "random", "--n", "37",
                                      "--reps", "1", "--fwd-rounds", "2", "--shard", "2", "--out", str(tmp_path)])
    ab.main()
    out = capsys.readouterr().out
    assert "[t] odd/2   random    fwd interleaved" in out and "[t] odd/2   random    flce" in out
    with open(tmp_path / "ab_t.csv") as f:
        (loss,) = list(csv.DictReader(f))
    with open(tmp_path / "ab_t_fwd.csv") as f:
        (fwd,) = list(csv.DictReader(f))
    assert loss["shape"] == "odd/2" and float(loss["ratio_dist3"]) == 1.0 and "rounds" not in loss
    assert fwd["shape"] == "odd/2" and fwd["rounds"] == "2" and float(fwd["ratio_1mm"]) == 1.0
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["ab_t.csv", "ab_t_fwd.csv"]


# every step name a GPU call has used (the old case statement's, and "none": the wheel install alone), less the
# steps of the one-off probes that left the tree (eventprobe, epiprobe, launchprobe, scaleprobe, hostab: git history)
DEVICE_STEPS = """none tests rl tprl dtensor ab fwdab shardab tpab tune tunestore tunecls tunepers storeab chunksweep gradab
gradbench optrace mergeprobe tunechunk sweep bench benchab bench32 tests32
profile train trainbench ds scaling tp tpquick tpbench tpprofile filterprobe benchfilter filtertrain trainedbench quack1
quack2 benchquack cutedsl benchcute rlcute hostcost""".split()


def test_device_sh_lists_every_step_with_what_it_measures(tmp_path):
    """``bash benchmarks/device.sh --list``: one line per ``step_<name>`` function, each with its
    description (the comment above the function); every step name of before is still a step; every
    script and test file a step runs exists; an unknown step is refused (exit 2) before the call
    does anything (no wheel install, nothing in $OUT)."""
    sh = BENCH / "device.sh"
    assert subprocess.run(["bash", "-n", str(sh)]).returncode == 0
    r = subprocess.run(["bash", str(sh), "--list"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    listed = {}
    for line in r.stdout.splitlines()[1:]:
        name, _, desc = line.strip().partition(" ")
        listed[name] = desc.strip()
    text = sh.read_text()
    assert sorted(listed) == sorted(re.findall(r"^step_([a-z0-9]+)\(\)", text, re.M))
    assert set(DEVICE_STEPS) <= set(listed), set(DEVICE_STEPS) - set(listed)
    short = {k: d for k, d in listed.items() if len(d.split()) < 4}
    assert not short, f"steps without a description: {short}"
    for path in set(re.findall(r"(?:benchmarks|tests|launch)/[\w/]+\.(?:py|sh)", text)):
        assert (BENCH.parent / path).is_file(), path
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(sh), "tests", "nosuchstep"], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "OUT": str(out)}, cwd=tmp_path)
    assert r.returncode == 2 and "unknown step 'nosuchstep'" in r.stderr and not out.exists()


def test_benchmarks_readme_names_every_script():
    """benchmarks/README.md lists every script under benchmarks/ (and probes/) with what runs it: a new script
    gets its row there, and a script nothing runs any more leaves the tree (git history keeps it)."""
    text = (BENCH / "README.md").read_text()
    scripts = [p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh") and "results" not in p.parts
               and "__pycache__" not in p.parts]
    missing = [str(p.relative_to(BENCH)) for p in scripts if f"`{p.relative_to(BENCH)}" not in text
               and f"`{p.name}`" not in text and f"{p.name}`" not in text]
    assert scripts and not missing, f"benchmarks/README.md does not name {missing}"


def test_results_readme_names_every_folder():
    """benchmarks/results/README.md says what each folder and figure under benchmarks/results/ is: a
    new run folder gets its line there."""
    results = BENCH / "results"
    text = (results / "README.md").read_text()
    kept = [p.name for p in results.iterdir() if p.is_dir() or p.suffix == ".png"]
    missing = [n for n in kept if f"`{n}/`" not in text and f"`{n}`" not in text]
    assert not missing, f"benchmarks/results/README.md does not name {missing}"


def test_bench_torch_lce_row_on_cpu():
    """bench.py times torch's own chunked linear cross entropy wherever the running torch has it
    (torch 2.13 here): the row's callable gives the plain cross entropy of the same inputs."""
    import torch.nn.functional as F

    if not hasattr(F, "linear_cross_entropy"):
        pytest.skip("this torch has no F.linear_cross_entropy")
    lce = pytest.importorskip("bench").torch_lce()  # what bench._impls() times as "torch_lce"
    assert lce is not None
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(37, 24, generator=g), torch.randn(101, 24, generator=g) * 0.3
    t = torch.randint(0, 101, (37,), generator=g)
    ref = F.cross_entropy((x.double() @ w.double().T), t)
    assert abs(lce(x, w, t).double().item() - ref.item()) < 1e-5


def test_plot_loss_curves(tmp_path, monkeypatch):
    """plot.py --loss-curves reads the launcher's losses.json (a dict with "losses") or a bare list,
    one line per file, differences per seed suffix; run 25's curves came from it."""
    pytest.importorskip("matplotlib")
    plot = pytest.importorskip("plot")
    import json

    paths = []
    for name, off in (("l_exact_s0", 0.0), ("l_auto_s0", 0.1), ("l_exact_s1", 0.2), ("l_auto_s1", 0.05)):
        ys = [5.0 / (1 + i) + off for i in range(30)]
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"losses": ys, "tp": 1} if "exact" in name else ys))
        paths.append(str(p))
    monkeypatch.setattr(sys, "argv", ["plot.py", "--loss-curves", *paths, "--out", str(tmp_path / "c.png")])
    plot.main()
    assert (tmp_path / "c.png").stat().st_size > 0


def test_bench_trl_refuses_without_cuda(monkeypatch, capsys):
    """bench_trl.py (GPU only) stops with exit code 2 and says it needs CUDA, before building anything."""
    trl_bench = pytest.importorskip("bench_trl")
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    monkeypatch.setattr(sys, "argv", ["bench_trl.py", "--levels", "head"])
    with pytest.raises(SystemExit) as e:
        trl_bench.main()
    assert e.value.code == 2 and "CUDA" in capsys.readouterr().err


def test_interleaved_rounds_pair_each_round(monkeypatch, capsys):
    """``_timing.interleaved_ms`` rotates the order per round and ``paired_ratios`` divides within a round, so a
    drift common to a round cancels: here every round is slower than the last by 10% (the clock drift the lent
    machines show), peer B is 2% slower than flce in each round and A 5% faster; the per-round ratios stay exact
    where a ratio of medians taken at different times would not. bench.py's ``interleave`` fills the rows."""
    from flce_dist import _timing

    base = {"3mm": 1.0, "flce": 1.04, "A": 1.04 * 0.95, "B": 1.04 * 1.02}
    calls: list[str] = []

    def timer(fn):  # round k of the calls so far runs 1.1^k slower
        calls.append(fn.name)
        return base[fn.name] * 1.1 ** ((len(calls) - 1) // len(base))

    fns = {}
    for k in base:
        fn = (lambda: None)
        fn.name = k
        fns[k] = fn
    per_round = _timing.interleaved_ms(fns, 4, timer)
    assert calls[:4] == ["3mm", "flce", "A", "B"] and calls[4:8] == ["flce", "A", "B", "3mm"]
    assert all(len(v) == 4 for v in per_round.values())
    r = _timing.paired_ratios(per_round, "flce")
    assert set(r) == {"3mm", "A", "B"}
    assert r["B"] == pytest.approx((1.02, 1.02, 1.02)) and r["A"] == pytest.approx((0.95, 0.95, 0.95))
    assert r["3mm"][0] == pytest.approx(1 / 1.04)
    with pytest.raises(ValueError, match="ref="):
        _timing.paired_ratios(per_round, "liger")

    bench = pytest.importorskip("bench")
    assert bench.parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "-1"])
    with pytest.raises(SystemExit):  # rounds report each impl against flce
        bench.parse_args(["--rounds", "2", "--impls", "liger,torch"])
    assert bench.parse_args(["--rounds", "2", "--impls", "flce,torch"]).impls == "flce,torch"
    with monkeypatch.context() as m:  # a tree from before run 28 (no interleaved_ms): refused, not a TypeError later
        m.setattr(bench, "interleaved_ms", None)
        with pytest.raises(SystemExit):
            bench.parse_args(["--rounds", "2"])
        assert bench.parse_args([]).rounds == 0
    # both timing modes' rounds (issue 53), for real on the CPU: every entry once per round and mode
    import common

    tm = common.Timers(reps=2, steady_calls=2, idle_ms=0, device="cpu", warmup=1)
    got = common.interleaved_modes({"a": lambda: None, "b": lambda: None}, 3, tm)
    assert set(got) == {"steady", "single"} and all(len(v) == 3 for m in got.values() for v in m.values())
    # interleave() on CPU with fake timers standing in for both modes: steady as above, single with A 3% slower
    # than flce (B as steady): the rows of the case get each mode's columns
    single_base = dict(base, A=1.04 * 1.03)

    def single_timer(fn):
        return single_base[fn.name]

    monkeypatch.setattr(bench.common, "interleaved_modes", lambda f, rounds, tm_: {
        "steady": _timing.interleaved_ms({k: fns[k] for k in f}, rounds, timer),
        "single": _timing.interleaved_ms({k: fns[k] for k in f}, rounds, single_timer)})
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    calls[:] = []
    rows = [dict(shape="s", data="random", impl="matmul")] + [dict(shape="s", data="random", impl=k)
                                                                for k in ("flce", "A", "B")]
    x, w = torch.randn(5, 3), torch.randn(7, 3)
    bench.interleave(rows[1:], {k: fns[k] for k in ("flce", "A", "B")}, x, w, 3, tm)
    assert "rounds_ms" not in rows[0]
    assert rows[3]["vs_flce"] == pytest.approx(1.02) and rows[2]["vs_flce"] == pytest.approx(0.95)
    assert rows[1]["vs_flce"] == 1.0 and rows[1]["rounds_x3dist"] == pytest.approx(1.04)
    assert rows[2]["vs_flce_single"] == pytest.approx(1.03) and rows[3]["vs_flce_single"] == pytest.approx(1.02)
    assert rows[1]["rounds_single_ms"] == pytest.approx(1.04) and rows[2]["vs_flce_single_min"] == pytest.approx(1.03)
    out = capsys.readouterr().out
    steady_line, single_line = (ln for ln in out.splitlines() if "interleaved" in ln)
    assert "interleaved steady, 3 rounds" in steady_line and "closest peer A: flce ahead by -5.0%" in steady_line
    assert "interleaved single, 3 rounds" in single_line and "closest peer B: flce ahead by +2.0%" in single_line
    assert "A +3.0%" in single_line
    # with flce's chunk plan (run 31): its cuBLAS work is a round entry, never a peer; rows get rounds_xplan
    base["plan"] = single_base["plan"] = 1.01
    plan_fn = (lambda: None)
    plan_fn.name = "plan"
    fns["plan"] = plan_fn
    made = []
    monkeypatch.setattr(bench, "chunked_matmuls", lambda x_, w_, rows_: made.append(rows_) or plan_fn)
    calls[:] = []
    bench.interleave(rows[1:], {k: fns[k] for k in ("flce", "A", "B")}, x, w, 3, tm, plan=4)
    assert made == [4] and "plan" in calls
    assert rows[1]["rounds_xplan"] == pytest.approx(1.04 / 1.01) and rows[3]["rounds_xplan"] == pytest.approx(1.04 * 1.02 / 1.01)
    assert rows[2]["rounds_single_xplan"] == pytest.approx(1.04 * 1.03 / 1.01)
    out = capsys.readouterr().out
    assert f"= {1.04 / 1.01:.3f}x its 4-row plan's cuBLAS work" in out
    assert "closest peer A" in out and "plan " not in out.split("closest")[1]


def test_bench_steps_bind_each_impl_and_csv_takes_new_columns(tmp_path, monkeypatch):
    """The interleaved rounds call bench.py's fwd+bwd steps after the loop over impls: each step must still run
    its own impl (run 28's first rounds call timed the last impl under every name: a lambda over the loop
    variable). And a CSV whose later rows add columns (the rounds' ``vs_flce``) is written, not refused."""
    bench = pytest.importorskip("bench")
    from flce_dist import _timing

    called = []

    def impl(tag):
        def fn(x, w, t):
            called.append(tag)
            return torch.nn.functional.cross_entropy(x @ w.T, t)
        return fn

    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    t = torch.randint(0, 9, (6,))
    steps = bench.fwd_bwd_steps({"flce": impl("flce"), "liger": impl("liger"), "torch": impl("torch")}, x, w, t)
    for k in ("liger", "flce", "torch"):
        steps[k]()
    assert called == ["liger", "flce", "torch"] and w.grad is not None
    rows = [dict(impl="matmul", ms=1.0), dict(impl="flce", ms=2.0, vs_flce=1.0), dict(impl="liger", ms=2.1, vs_flce=1.05)]
    monkeypatch.setattr(_timing, "RESULTS", tmp_path / "results")  # not the repository's results folder
    _timing.write_csv(rows, "t.csv", [tmp_path])
    import csv

    got = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert [r["vs_flce"] for r in got] == ["", "1.0", "1.05"]
    assert (tmp_path / "results" / "t.csv").read_text() == (tmp_path / "t.csv").read_text()


def test_bench_filter_rows_run_their_vocab_order(monkeypatch):
    """bench.py's ``flce_filter_copy`` / ``flce_filter_gather`` rows run the gradient filter in that
    ``Settings.filter_order`` (spied at the core's fused backward), ``flce_filter`` in the default ("gather")."""
    bench = pytest.importorskip("bench")
    from flce_dist import core, settings

    seen = []
    fused = core.fused_forward_backward

    def spy(x, w, b, tl, g, p, *a, **k):
        seen.append(p.settings.filter_order)
        return fused(x, w, b, tl, g, p, *a, **k)

    monkeypatch.setattr(core, "fused_forward_backward", spy)
    impls = bench.filter_impls(settings)  # not bench._impls(): its peers' imports build DeepSpeed's ops (~35 s)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 16, generator=g, requires_grad=True), torch.randn(37, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 37, (7,), generator=g)
    for k in ("flce_filter_copy", "flce_filter_gather", "flce_filter"):
        impls[k](x.bfloat16(), w.bfloat16(), t).backward()
    assert seen == ["copy", "gather", "gather"]


def test_bench_rounds_compare_flce_with_peers_not_its_own_variants(monkeypatch, capsys):
    """The rounds' summary line names the closest *peer*: flce's own rows (another chunk budget, the filter)
    are not peers (run 30's line named ``flce_onechunk``); every other peer follows with its median and spread."""
    bench = pytest.importorskip("bench")
    from flce_dist import _timing

    base = {"3mm": 1.0, "flce": 1.04, "flce_onechunk": 1.0, "A": 1.04 * 1.03, "B": 1.04 * 1.05}
    fns = {}
    for k in base:
        fn = (lambda: None)
        fn.name = k
        fns[k] = fn
    monkeypatch.setattr(bench.common, "interleaved_modes", lambda f, rounds, tm: {m: _timing.interleaved_ms(
        {k: fns[k] for k in f}, rounds, lambda fn: base[fn.name]) for m in ("steady", "single")})
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    names = ("flce", "flce_onechunk", "A", "B")
    rows = [dict(shape="s", data="random", impl=k) for k in names]
    bench.interleave(rows, {k: fns[k] for k in names}, torch.randn(5, 3), torch.randn(7, 3), 2, None)
    out = capsys.readouterr().out
    assert out.count("closest peer A: flce ahead by +3.0% (rounds +3.0..+3.0%); B +5.0% (+5.0..+5.0%)") == 2
    assert out.count("flce_onechunk 1.00 ms") == 2  # flce's own variant: its time, not a lead
    assert rows[1]["vs_flce"] == pytest.approx(1.0 / 1.04)  # the variant's row still has its ratio


# ---- issue 53: the two timing modes, the CuTe DSL rows, the host-cost probe ----

def test_timers_single_from_idle_and_steady_back_to_back():
    """``common.Timers`` on the CPU: ``single`` runs its warm-up, then per sample the sleep (``idle_ms``) OUTSIDE the
    timed call and one call; ``steady`` one untimed call then K calls per sample, timed together, per call."""
    calls = []

    def fn():
        calls.append(time.perf_counter())
        time.sleep(0.004)

    tm = common.Timers(3, steady_calls=4, idle_ms=60, device="cpu", warmup=2)
    ms = tm.single(fn)
    assert len(calls) == 2 + 3 and 3.5 <= ms < 40, ms  # the 60 ms idle sleeps are not in the figure
    assert all(b - a >= 0.06 for a, b in zip(calls[2:], calls[3:]))  # each timed call came after its idle sleep
    calls.clear()
    st = tm.steady(fn)
    assert len(calls) == 2 + 3 * (1 + 4) and 3.5 <= st < 40, st  # max(3, reps // 2) samples of 1 + K calls
    assert math.isnan(tm.peak(fn))
    before = []
    tm = common.Timers(2, steady_calls=1, idle_ms=0, device="cpu", before=lambda: before.append(1), warmup=0)
    tm.single(lambda: None)
    tm.steady(lambda: None)
    assert len(before) == 2 + 3
    cols = common.mode_cols(6.0, 4.8, 4.0, 4.0 * 1.2)
    assert cols == pytest.approx(dict(single_ms=6.0, steady_ms=4.8, host_ms=1.2, single_x3mm=1.5, steady_x3mm=1.0,
                                      host_adj_ms=1.2 - (4.0 - 4.8)))


def test_bench_timing_args_and_cute_constraints(capsys):
    bench = pytest.importorskip("bench")
    a = bench.parse_args([])
    assert a.steady_calls == common.STEADY_CALLS == 4 and a.idle_ms == common.IDLE_MS
    a = bench.parse_args(["--steady-calls", "8", "--idle-ms", "0"])
    assert (a.steady_calls, a.idle_ms) == (8, 0.0)
    for bad in (["--steady-calls", "0"], ["--idle-ms", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    bf16 = torch.bfloat16
    why = bench.cute_skip(torch.empty(100, 8, dtype=torch.float32), torch.empty(1000, 8, dtype=torch.float32))
    assert all(s in why for s in ("bf16 only", "N=100 is not a multiple of 128", "V=1000 is not a multiple of 256",
                                  "CUDA"))
    assert bench.cute_skip(torch.empty(256, 8, dtype=bf16), torch.empty(512, 8, dtype=bf16)) == "needs a CUDA device (sm_90)"
    assert "V=128256" not in bench.cute_skip(torch.empty(1024, 8, dtype=bf16), torch.empty(128256, 8, dtype=bf16))  # llama3
    for v in (151936, 262208):  # qwen3, gemma: not multiples of 256
        assert f"V={v} is not a multiple of 256" in bench.cute_skip(torch.empty(8192, 8, dtype=bf16), torch.empty(v, 8, dtype=bf16))
    got = bench.liger_cute_impls()  # no CuTe DSL (nor Liger) here: nothing, and the reason printed
    if not got:
        assert "liger_cute unavailable" in capsys.readouterr().out
    else:
        assert hasattr(got["liger_cute"], "skip")


def test_bench_case_rows_carry_both_timing_modes(tmp_path, monkeypatch, capsys):
    """bench.run_case on the CPU: the ``matmul`` and ``3mm`` rows, then each impl that can run in both timing modes
    (single, steady, host = single - steady, each against the 3mm row of the same mode), an impl whose ``skip``
    names a reason is left out with that line; the CSV carries the mode columns and the table prints them."""
    bench = pytest.importorskip("bench")
    from flce_dist import _timing

    def ce(x, w, t):
        return torch.nn.functional.cross_entropy((x @ w.T).float(), t)

    def never(x, w, t):
        raise AssertionError("a skipped impl ran")

    never.skip = lambda x, w: "not here"
    x, w, t = bench_data.make_inputs(32, 16, 64, mode="random", dtype=torch.float32)
    args = bench.parse_args(["--rounds", "0"])
    tm = common.Timers(2, steady_calls=2, idle_ms=0, device="cpu", warmup=1)
    rows = bench.run_case("tiny", "random", x, w, t, {"A": ce, "cute": never}, args, tm)
    assert [r["impl"] for r in rows] == ["matmul", "3mm", "A"]
    assert "cute            skipped: not here" in capsys.readouterr().out
    mm3, a = rows[1], rows[2]
    assert mm3["single_x3mm"] == mm3["steady_x3mm"] == 1.0 and mm3["fwd_bwd_ms"] == mm3["floor3_ms"]
    assert a["fwd_bwd_ms"] == a["single_ms"] and a["host_ms"] == pytest.approx(a["single_ms"] - a["steady_ms"])
    assert a["single_x3mm"] == pytest.approx(a["single_ms"] / mm3["single_ms"]) == pytest.approx(a["ratio_fb3"])
    assert a["steady_x3mm"] == pytest.approx(a["steady_ms"] / mm3["steady_ms"])
    assert a["steady_calls"] == 2 and a["idle_ms"] == 0 and math.isnan(a["mem_gib"])
    monkeypatch.setattr(_timing, "RESULTS", tmp_path / "results")
    common.save(rows, "bench_bf16.csv", args)
    got = list(csv.DictReader(open(tmp_path / "results" / "bench_bf16.csv")))
    assert {"single_ms", "steady_ms", "host_ms", "single_x3mm", "steady_x3mm", "floor3_steady_ms", "fwd_bwd_ms",
            "ratio_fb", "ratio_steady", "mem_gib", "extra_gib"} <= set(got[0])
    assert [r["impl"] for r in got] == ["matmul", "3mm", "A"]
    bench.print_table(rows)
    head = capsys.readouterr().out.splitlines()[0].split()
    assert head[3:9] == ["single", "ms", "x3dist", "steady", "x3dist", "host"] and "peak" in head


def test_host_cost_probe_smoke(tmp_path, capsys):
    """benchmarks/probes/host_cost.py --smoke (CPU reference mode, seconds): the trace lists each phase's Helion
    launches and small ops in order, the per-N rows carry both modes and the launch count, the CSVs go to --out
    only, and the phase hooks are removed afterwards."""
    host_cost = pytest.importorskip("host_cost")
    from flce_dist import autograd, core
    from flce_dist.kernels import launch

    real = launch._launch, core._Guard.__dict__["combine"], autograd.FLCEFunction.__dict__["backward"]
    rows = host_cost.main(["--smoke", "--out", str(tmp_path)])
    assert (launch._launch, core._Guard.__dict__["combine"], autograd.FLCEFunction.__dict__["backward"]) == real
    assert [r["N"] for r in rows] == [64, 128]
    for r in rows:
        assert r["helion_launches"] == 8  # targets, logits, row_prepare, dz_gated, row_scale, token rows, 2 scales
        assert r["host_ms"] == pytest.approx(r["single_ms"] - r["steady_ms"]) and r["call_host_ms"] > 0
    out = capsys.readouterr().out
    assert "=== host_cost summary" in out and "=== trace N=128" in out
    trace = list(csv.DictReader(open(tmp_path / "host_cost_trace_smoke.csv")))
    helion = [(r["phase"], r["item"]) for r in trace if r["kind"] == "Helion"]
    assert helion == [("targets", "[target_rows]"), ("logits pass", "[lse_forward]"), ("row_prepare", "[row_prepare]"),
                      ("dz_gated", "[dz_gated]"), ("row_scale", "[row_scale]"), ("token rows", "[token_rows]"),
                      ("backward scale", "[scale]"), ("backward scale", "[scale]")]
    kinds = {(r["phase"], r["item"]): r["kind"] for r in trace}
    assert kinds[(host_cost.CPU_ONLY, "_local_scalar_dense")] == "SYNC"  # the CPU-only target range check
    assert kinds[("fused pass", "mm")] == "cuBLAS"
    assert kinds[("forward core", "empty")] == "alloc"  # the targets' buffers (core._Tokens)
    phases = {r["phase"] for r in csv.DictReader(open(tmp_path / "host_cost_phases_smoke.csv"))}
    assert {"api", "autograd apply", "logits pass", "stats combine", "backward scale", "helion launch"} <= phases
    assert not (BENCH / "results" / "host_cost_smoke.csv").exists()
    aten = torch.ops.aten
    assert [host_cost.op_kind(f) for f in (aten.mm.default, aten.empty.memory_format, aten.view.default,
                                           aten._local_scalar_dense.default, aten.add.Tensor)] == \
        ["cuBLAS", "alloc", "view", "SYNC", "kernel"]
    assert [host_cost.kernel_class(k) for k in ("_helion_lse_forward_partials", "nvjet_tst_128x256", "Memset (Device)",
                                                "void at::native::vectorized_elementwise_kernel")] == \
        ["Helion", "cuBLAS", "memset/memcpy", "torch"]


def test_guard_cost_probe_smoke(tmp_path):
    """benchmarks/probes/guard_cost.py --smoke (issue 52 finding 3) runs on the CPU in its own process
    (it makes a 1-rank gloo group): the table comes last, the default guard runs fewer ops than the
    check_inputs one at every N and P, and its CSV has every row."""
    cmd = [sys.executable, str(BENCH / "probes" / "guard_cost.py"), "--smoke", "--out", str(tmp_path)]
    env = {**os.environ, "HELION_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert res.stdout.rstrip().splitlines()[-1].startswith("call 1-rank group"), res.stdout[-2000:]
    with open(tmp_path / "guard_cost.csv") as f:
        rows = list(csv.DictReader(f))
    guard = [r for r in rows if r["what"] == "guard"]
    assert len(guard) == 2 * 2 * 3 and len(rows) == len(guard) + 2 * 4  # 2 N x 2 P x 3 settings; calls
    by = {(r["N"], r["P"], r["setting"].split()[0]): int(r["ops"]) for r in guard}
    for (n, p, setting), ops in by.items():
        if setting == "after":
            assert 0 < ops < by[(n, p, "before")], by
        if setting == "default":  # issue 61's word 7 (loss_weights, num_items_in_batch): only where they are given
            assert ops > by[(n, p, "after")], by
