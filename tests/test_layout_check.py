"""The once-per-layout shard check at 2 gloo ranks (``distributed/shard.py``), issue #34's findings:

(4) torch.compile of a call with a group (TP without SP, plain tensors) is one graph: no break;
(5) a new token count costs no handshake (no host sync), and the per-call guard keeps no per-N
    cache that grows without bound (``distributed/guard.py``);
(7) the common TP mistakes: the full ``[V, H]`` weight on every rank raises a ValueError naming
    ``weight``; correct shards pass; without ``vocab_size=`` (and ``vocab_start=``) a warning names
    ``vocab_size=`` (shards in another rank order cannot be told apart from the weights);
(8) targets that differ across ranks (ids local to each shard): the guard's message says that
    targets are global vocabulary ids.

Each test is one ``torch.multiprocessing.spawn`` of 2 ranks with a ``file://`` rendezvous; every rank
writes its findings to a file that the test reads."""

from __future__ import annotations

import os
import tempfile
import traceback
import warnings

import pytest
import torch

import flce_dist
from flce_dist import fused_linear_cross_entropy as F
from flce_dist import reference_loss
from tests._checks import SMALL_BLOCKS, rel, spawn


def _init(rank: int, tmp: str):
    import torch.distributed as dist

    flce_dist.setup_reference_mode()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    return dist


def _spawn(worker, *args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_run, 2, worker, tmp, *args)
        return [torch.load(os.path.join(tmp, f"r{r}.pt")) for r in range(2)]


def _run(rank: int, worker, tmp: str, *args) -> None:
    dist = _init(rank, tmp)
    try:
        res = worker(rank, dist, *args)
    except Exception:  # noqa: BLE001  (reported by the test, with the rank's traceback)
        res = {"error": traceback.format_exc()}
    torch.save(res, f"{tmp}/r{rank}.pt")
    dist.destroy_process_group()


def _data(n: int, h: int, v: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.3, torch.randint(0, v, (n,), generator=g)


# (4) ------------------------------------------------------------------------------------------------

def _compile_worker(rank, dist, _):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    h, v = 16, 37
    x, w, t = _data(12, h, v)
    lo, hi = flce_dist.vocab_shard(v, rank, 2)
    wl = w[lo:hi].clone().requires_grad_()
    group = dist.group.WORLD

    def step(x, w, t):
        return F(x, w, t, group=group, vocab_size=v)

    with flce_dist.settings.override(blocks=SMALL_BLOCKS):
        loss = torch.compile(step, backend="eager")(x, wl, t)
    loss.backward()
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    return {"breaks": breaks, "loss": rel(loss, reference_loss(x.double(), w.double(), t))}


@pytest.mark.dist
def test_compile_with_group_has_no_graph_break():
    for r, res in enumerate(_spawn(_compile_worker, None)):
        assert "error" not in res, res.get("error")
        assert sum(res["breaks"].values()) == 0, f"rank {r}: graph breaks {res['breaks']}"
        assert res["loss"] < 1e-5, res


# (5) ------------------------------------------------------------------------------------------------

def _tokens_worker(rank, dist, calls):
    """``calls`` calls with distinct token counts for each way of stating the layout: ``vocab_size=``,
    a DTensor weight (its global shape states it), ``VocabParallelLMHead`` (passes its vocab_size);
    the handshakes (all-gathers of the shard check, each a host sync) counted per way."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from flce_dist.distributed import guard, shard

    gathers = []
    real = shard.all_gather_rows

    def counted(t, group):
        gathers.append(tuple(t.shape))
        return real(t, group)

    shard.all_gather_rows = counted
    h, v = 16, 37
    lo, hi = flce_dist.vocab_shard(v, rank, 2)
    group = dist.group.WORLD
    mesh = init_device_mesh("cpu", (2,))
    _, w_full, _ = _data(1, h, v, seed=99)
    head = flce_dist.VocabParallelLMHead(h, v, group=group)
    with torch.no_grad():
        head.weight.copy_(w_full[lo:hi])
    ways = {
        "vocab_size": lambda x, t: F(x, w_full[lo:hi], t, group=group, vocab_size=v),
        "dtensor": lambda x, t: F(x, DTensor.from_local(w_full[lo:hi], mesh, [Shard(0)], shape=(v, h),
                                                        stride=(h, 1)), t),
        "head": lambda x, t: head(x, t),
    }
    out = {}
    with torch.no_grad(), flce_dist.settings.override(blocks=SMALL_BLOCKS):
        for name, call in ways.items():
            shard.clear_shard_cache()
            gathers.clear()
            worst = 0.0
            for i in range(calls):
                x, _, t = _data(3 + i, h, v, seed=i)
                worst = max(worst, rel(call(x, t), reference_loss(x.double(), w_full.double(), t)))
            out[name] = {"handshakes": len(gathers), "worst": worst}
    out["caches"] = {name: fn.cache_info().currsize for name, fn in vars(guard).items() if hasattr(fn, "cache_info")}
    out["held"] = {name: len(c) for name, c in vars(guard).items() if isinstance(c, dict) and not name.startswith("__")}
    return out


@pytest.mark.dist
def test_new_token_counts_cost_no_handshake():
    """Without vocab_size= (or a DTensor / head that knows it) every new token count still costs one
    handshake: nothing every rank shares then tells a new layout from an old one (shard.py)."""
    calls = 50
    for r, res in enumerate(_spawn(_tokens_worker, calls)):
        assert "error" not in res, res.get("error")
        for way in ("vocab_size", "dtensor", "head"):
            got = res[way]
            assert got["handshakes"] <= 1, f"rank {r}, {way}: {got['handshakes']} handshakes (host syncs) for {calls} token counts"
            assert got["worst"] < 1e-5, (way, got)
        # the guard's caches do not grow with the number of distinct token counts
        assert all(size <= 8 for size in res["caches"].values()), res["caches"]
        assert all(size <= 8 for size in res["held"].values()), res["held"]


# (7) ------------------------------------------------------------------------------------------------

def _mistakes_worker(rank, dist, _):
    from flce_dist.distributed.shard import clear_shard_cache

    h, v = 16, 37
    x, w, t = _data(10, h, v)
    lo, hi = flce_dist.vocab_shard(v, rank, 2)
    group = dist.group.WORLD
    out = {}

    def attempt(name, **kw):
        clear_shard_cache()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                loss = F(x, kw.pop("weight"), t, group=group, **kw)
                out[name] = ("ok", rel(loss, reference_loss(x.double(), w.double(), t)))
            except ValueError as exc:
                out[name] = ("ValueError", str(exc))
        out[name + "_warnings"] = [str(m.message) for m in seen]

    with torch.no_grad(), flce_dist.settings.override(blocks=SMALL_BLOCKS):
        attempt("full", weight=w)
        attempt("full_sized", weight=w, vocab_size=v)
        attempt("shards", weight=w[lo:hi], vocab_size=v)
        attempt("shards_no_size", weight=w[lo:hi])
        attempt("shards_start", weight=w[lo:hi], vocab_start=lo)
        # a legit layout whose shards are all equal (a constant initialisation), stated by vocab_size
        attempt("zeros_sized", weight=torch.zeros(hi - lo, h), vocab_size=v)
        # tied embeddings: each rank's shard is its own slice of the embedding table
        emb = torch.nn.Embedding(v, h)
        attempt("tied", weight=emb.weight.detach()[lo:hi])
        # targets as ids local to the rank's shard (the guard's message says they are global ids)
        try:
            F(x, w[lo:hi], t - lo, group=group, vocab_size=v)
            out["local_targets"] = ("ok", "")
        except ValueError as exc:
            out["local_targets"] = ("ValueError", str(exc))
    return out


@pytest.mark.dist
def test_common_tp_mistakes_are_caught():
    for r, res in enumerate(_spawn(_mistakes_worker, None)):
        assert "error" not in res, res.get("error")
        kind, msg = res["local_targets"]
        assert kind == "ValueError" and "ranks [1]" in msg and "GLOBAL vocabulary ids" in msg, (r, msg)
        assert "other the targets" not in msg, msg
        for name in ("full", "full_sized"):
            kind, msg = res[name]
            assert kind == "ValueError" and "weight" in msg and "vocab_shard" in msg, (r, name, res[name])
        for name in ("shards", "shards_no_size", "shards_start"):
            kind, err = res[name]
            assert kind == "ok" and err < 1e-5, (r, name, res[name])
        assert res["zeros_sized"][0] == "ok", (r, res["zeros_sized"])
        assert res["tied"][0] == "ok", (r, res["tied"])
        # the rank order cannot be checked from the weights: said once, when nothing states the layout
        assert any("vocab_size=" in m for m in res["shards_no_size_warnings"]), res["shards_no_size_warnings"]
        assert not any("vocab_size=" in m for m in res["shards_warnings"]), res["shards_warnings"]
        assert not any("vocab_size=" in m for m in res["shards_start_warnings"]), res["shards_start_warnings"]
