"""The once-per-layout shard check at 2 gloo ranks (``distributed/shard.py``), issue #34's findings:

(4) torch.compile of a call with a group (TP without SP, plain tensors) is one graph: no break;
(5) a new token count costs no handshake (no host sync), and the per-call guard keeps no per-N
    cache that grows without bound (``distributed/guard.py``);
(7) the common TP mistakes: the full ``[V, H]`` weight on every rank raises a ValueError naming
    ``weight``; correct shards pass; without ``vocab_size=`` and ``vocab_start=`` a plain-tensor
    ``group=`` is a ValueError naming both (issue 52: the layout is stated, not guessed);
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
        "vocab_start": lambda x, t: F(x, w_full[lo:hi], t, group=group, vocab_start=lo),
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
    """Every way of stating the layout (vocab_size=, vocab_start=, a DTensor weight, the head) costs
    one handshake for any number of token counts: the token count is not part of the shard check's
    key (shard.py)."""
    calls = 50
    for r, res in enumerate(_spawn(_tokens_worker, calls)):
        assert "error" not in res, res.get("error")
        for way in ("vocab_size", "vocab_start", "dtensor", "head"):
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
        attempt("tied", weight=emb.weight.detach()[lo:hi], vocab_size=v)
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
        for name in ("shards", "shards_start"):
            kind, err = res[name]
            assert kind == "ok" and err < 1e-5, (r, name, res[name])
            assert not res[name + "_warnings"], res[name + "_warnings"]
        assert res["zeros_sized"][0] == "ok", (r, res["zeros_sized"])
        assert res["tied"][0] == "ok", (r, res["tied"])
        # nothing states the layout: refused on every rank, naming what to pass
        kind, msg = res["shards_no_size"]
        assert kind == "ValueError" and "vocab_size=" in msg and "vocab_start=" in msg, (r, res["shards_no_size"])


# issue 52, finding 3 ------------------------------------------------------------------------------

def _two_heads_worker(rank, dist, _):
    """Two heads of V = 7 then V = 8 rows (rank 0 holds 4 rows of both, rank 1 3 then 4) and the same
    token count, on one group: the issue's desync (rank 0 hit the shard cache, rank 1 missed and
    entered the handshake alone). Each way of calling reports its outcome per head."""
    from flce_dist.distributed import shard

    group = dist.group.WORLD
    h, n = 16, 9
    out = {}

    def heads(name, **how):
        shard.clear_shard_cache()
        res = []
        for v in (7, 8):
            x, w, t = _data(n, h, v, seed=v)
            lo, hi = flce_dist.vocab_shard(v, rank, 2)
            kw = {k: (f(v, lo) if callable(f) else f) for k, f in how.items()}
            try:
                with flce_dist.settings.override(blocks=SMALL_BLOCKS):
                    loss = F(x, w[lo:hi].clone().requires_grad_(), t, group=group, **kw)
                res.append(("ok", rel(loss, reference_loss(x.double(), w.double(), t)), hi - lo))
            except ValueError as exc:
                res.append(("ValueError", str(exc), hi - lo))
        out[name] = res

    heads("vocab_size", vocab_size=lambda v, lo: v)
    heads("vocab_start_and_size", vocab_start=lambda v, lo: lo, vocab_size=lambda v, lo: v)
    heads("nothing")
    heads("vocab_start_only", vocab_start=lambda v, lo: lo)
    # after the stale-layout error the group is still usable, and clearing the cache re-checks
    shard.clear_shard_cache()
    x, w, t = _data(n, h, 8, seed=8)
    lo, hi = flce_dist.vocab_shard(8, rank, 2)
    with flce_dist.settings.override(blocks=SMALL_BLOCKS):
        out["after"] = rel(F(x, w[lo:hi], t, group=group, vocab_start=lo), reference_loss(x.double(), w.double(), t))
    return out


@pytest.mark.dist
def test_two_heads_v7_then_v8_no_desync():
    """With vocab_size= both heads just work; with nothing stated every rank raises the same
    ValueError naming vocab_size= and vocab_start=; with only vocab_start= the second head (a shard
    that changed on rank 1 alone under the same stated layout) raises the same ValueError on every
    rank at the per-call guard. Nothing hangs, no rank is alone in a collective."""
    results = _spawn(_two_heads_worker, None)
    for r, res in enumerate(results):
        assert "error" not in res, res.get("error")
        assert [x[2] for x in res["vocab_size"]] == [4 - r, 4], res  # rank 1's shard grows, rank 0's does not
        for way in ("vocab_size", "vocab_start_and_size"):
            assert all(kind == "ok" and err < 1e-5 for kind, err, _ in res[way]), (r, way, res[way])
        assert all(kind == "ValueError" and "vocab_size=" in msg and "vocab_start=" in msg
                   for kind, msg, _ in res["nothing"]), (r, res["nothing"])
        first, second = res["vocab_start_only"]
        assert first[0] == "ok" and first[1] < 1e-5, (r, first)
        assert second[0] == "ValueError" and "ranks [1]" in second[1] and "vocab_size=" in second[1], (r, second)
        assert res["after"] < 1e-5, res
    # the same message on every rank
    assert results[0]["vocab_start_only"][1][1] == results[1]["vocab_start_only"][1][1]
