"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), reshardable across layouts.

``step_<N>/`` under ``checkpoint.ckpt_dir`` holds the DCP files of the model and optimizer state
(``get_state_dict``: DTensor shards keyed by fully qualified names, so a run saved at (dp=2, tp=2)
loads at (dp=1, tp=4), (dp=4, tp=1) or one process), ``train_state.json`` (step, data position,
loss history, layout, learning-rate schedule, config; written by rank 0), ``rng_rank<r>.pt``
(torch/CUDA/Python RNG of the rank; restored only at the same world size, the model uses no RNG in
training) and, last, ``complete.json`` written by rank 0 after a barrier once every rank's files are
on disk. ``complete.json`` is the manifest: the size and sha256 of every other file of the folder
(the ranks hash a share each, rank 0 writes them). Only checkpoints with the marker count, and a
resume uses the newest one whose files all match it (``choose_checkpoint``: verified before anything
is loaded or announced; the damaged ones are named in a warning and renamed ``step_<N>.damaged``).

Before saving, ``check_replicated`` compares a float64 fingerprint of every replicated parameter
(``Replicate()`` mesh dims of DTensors; plain parameters over the whole group) across the ranks that
hold copies, and raises on every rank naming the first parameter that differs."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .data import atomic_write

log = logging.getLogger("flce_dist.train")

MANIFEST = "complete.json"
SCHEDULE_KEYS = ("steps", "warmup_steps", "lr", "min_lr_ratio")
REPLICA_RTOL = 1e-6  # fingerprint difference allowed, relative to the parameter's L1 norm


def step_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step_{step:08d}"


def complete_checkpoints(ckpt_dir: Path) -> list[int]:
    steps = []
    if ckpt_dir.is_dir():
        for d in ckpt_dir.iterdir():
            if d.name.startswith("step_") and d.name[5:].isdigit() and (d / MANIFEST).is_file():
                steps.append(int(d.name[5:]))
    return sorted(steps)


def any_checkpoints(ckpt_dir: Path) -> bool:
    return ckpt_dir.is_dir() and any(d.name.startswith("step_") for d in ckpt_dir.iterdir())


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------- checksums

def file_digest(path: Path) -> dict:
    with open(path, "rb") as f:
        return {"bytes": path.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _world(pg) -> tuple[int, int]:
    return (dist.get_rank(pg), dist.get_world_size(pg)) if pg is not None else (0, 1)


def _share(items: list, pg, work) -> list:
    """``work(item)`` for this rank's share of ``items`` (round-robin); every rank gets all results,
    in the order of ``items``."""
    r, w = _world(pg)
    mine = {i: work(items[i]) for i in range(r, len(items), w)}
    if pg is None:
        return [mine[i] for i in range(len(items))]
    gathered: list = [None] * w
    dist.all_gather_object(gathered, mine, group=pg)
    allres = {k: v for part in gathered for k, v in part.items()}
    return [allres[i] for i in range(len(items))]


def _payload_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def write_manifest(d: Path, step: int, layout: dict, pg, rank: int) -> None:
    """Collective: the size and sha256 of every file of ``d`` into ``d/complete.json`` (rank 0)."""
    names = [_payload_files(d) if rank == 0 else None]
    if pg is not None:
        dist.broadcast_object_list(names, src=0, group=pg)
    digests = _share(names[0], pg, lambda n: file_digest(d / n))
    if rank == 0:
        files = dict(zip(names[0], digests))
        atomic_write(d / MANIFEST, lambda p: p.write_text(json.dumps({"step": step, **layout, "files": files}, indent=1)))


def _check_file(d: Path, name: str, want: dict) -> str | None:
    p = d / name
    if not p.is_file():
        return f"{name}: missing"
    size = p.stat().st_size
    if size != want.get("bytes"):
        return f"{name}: {size} bytes, {want.get('bytes')} recorded (truncated or rewritten)"
    if file_digest(p)["sha256"] != want.get("sha256"):
        return f"{name}: sha256 mismatch (damaged)"
    return None


def verify_checkpoint(d: Path, pg=None) -> list[str]:
    """Collective: what is wrong with checkpoint folder ``d`` (empty: intact), the same list on every
    rank. Rank 0 reads the manifest, the ranks check a share of the files each."""
    rank, _ = _world(pg)
    head: list = [None]
    if rank == 0:
        try:
            manifest = json.loads((d / MANIFEST).read_text())
            if not isinstance(manifest, dict) or manifest.get("step") != int(d.name[5:]):
                raise ValueError("not a manifest of this step")
            files = manifest.get("files")
            if files is None:
                log.warning("%s has no checksums (saved by an older launcher): loaded unverified", d / MANIFEST)
                files = {}
            elif not isinstance(files, dict) or not files:
                raise ValueError("no file list")
            head = [{"files": files}]
        except (OSError, ValueError, UnicodeDecodeError) as e:
            head = [{"error": f"{MANIFEST}: unreadable or garbage ({type(e).__name__}: {e})"}]
    if pg is not None:
        dist.broadcast_object_list(head, src=0, group=pg)
    if "error" in head[0]:
        return [head[0]["error"]]
    items = sorted(head[0]["files"].items())
    return [p for p in _share(items, pg, lambda kv: _check_file(d, *kv)) if p]


def choose_checkpoint(ckpt_dir: Path, candidates: list[int], pg=None) -> tuple[int | None, dict[int, list[str]]]:
    """Collective: the newest of ``candidates`` (complete checkpoints) whose files match their
    manifest, and the problems of the newer ones (``{step: [problem, ...]}``), the same on every
    rank. The damaged ones are renamed ``step_<N>.damaged`` by rank 0 when an intact one is found."""
    rank, _ = _world(pg)
    damaged: dict[int, list[str]] = {}
    for step in reversed(candidates):
        d = step_dir(ckpt_dir, step)
        bad = verify_checkpoint(d, pg)
        if not bad:
            if rank == 0:
                for s, problems in damaged.items():
                    log.warning("checkpoint %s is damaged, NOT loaded: %s", step_dir(ckpt_dir, s), "; ".join(problems))
                    aside = step_dir(ckpt_dir, s).with_name(step_dir(ckpt_dir, s).name + ".damaged")
                    shutil.rmtree(aside, ignore_errors=True)
                    step_dir(ckpt_dir, s).rename(aside)
                if damaged:
                    log.warning("falling back to the newest intact checkpoint %s (the damaged ones are renamed *.damaged)", d)
            if pg is not None:
                dist.barrier(group=pg)
            return step, damaged
        damaged[step] = bad
    return None, damaged


# ------------------------------------------------------------------------------ replicated parameters

def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().double().flatten()
    w = torch.arange(x.numel(), device=x.device, dtype=torch.float64).remainder_(7).add_(1)
    return torch.stack([x.sum(), (x * w).sum(), x.abs().sum()])


def check_replicated(model: torch.nn.Module, pg) -> None:
    """Collective (over ``pg``, the whole job): every replicated parameter must be the same on the ranks
    that hold a copy (DTensors: over each ``Replicate()`` mesh dim, the local tensors; plain
    parameters: over ``pg``). One all-gather of ``[k, 3]`` float64 fingerprints per group, then one
    object all-gather of the verdicts, so every rank raises the same ``RuntimeError`` naming the first
    parameter that differs. A no-op in one process."""
    if pg is None or dist.get_world_size(pg) == 1:
        return
    from torch.distributed.tensor import DTensor, Replicate

    groups: dict[tuple, tuple] = {}  # key -> (group, [names], [fingerprints])
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            for i, pl in enumerate(p.placements):
                if isinstance(pl, Replicate) and mesh.size(i) > 1:
                    key = (tuple(mesh.mesh.shape), mesh.mesh_dim_names, i)
                    g = groups.setdefault(key, (mesh.get_group(i), [], []))
                    g[1].append(name)
                    g[2].append(_fingerprint(p.to_local()))
        else:
            g = groups.setdefault(("plain",), (pg, [], []))
            g[1].append(name)
            g[2].append(_fingerprint(p))
    verdict = None
    for key, (group, names, fps) in groups.items():
        mine = torch.stack(fps)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        every = torch.stack(every).cpu()  # [ranks, k, 3]
        scale = every[:, :, 2].abs().amax(0).clamp(min=1e-30)  # [k]
        diff = (every - every[:1]).abs().amax(2).amax(0)  # [k]
        nan = torch.isnan(every).any(2)  # [ranks, k]: NaN everywhere is not a divergence, NaN on some ranks is
        bad = (nan.any(0) & ~nan.all(0)) | (~nan.any(0) & (diff > REPLICA_RTOL * scale))
        if bad.any() and verdict is None:
            k = int(bad.nonzero()[0])
            ranks = dist.get_process_group_ranks(group)
            dim = "whole group" if key == ("plain",) else f"mesh dim {key[1][key[2]] if key[1] else key[2]!r}"
            verdict = (f"replicated parameter {names[k]!r} differs between ranks {ranks} ({dim}): fingerprints "
                       f"(sum, weighted sum, L1) {[[float(v) for v in every[r, k]] for r in range(len(ranks))]}; "
                       f"the ranks have diverged and every later loss would be wrong")
    verdicts: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(verdicts, verdict, group=pg)
    first = next((v for v in verdicts if v), None)
    if first:
        raise RuntimeError(first)


# ------------------------------------------------------------------------------------- save / load

def schedule_of(t) -> dict:
    return {k: getattr(t, k) for k in SCHEDULE_KEYS}


def save_checkpoint(ckpt_dir: Path, step: int, train_state: dict, model, opt, pg, rank: int, keep: int) -> None:
    """Every rank calls this (DCP is collective). ``pg``: the process group of the run (None: one process).
    Replicated parameters are checked first (``check_replicated``): a diverged run is not saved."""
    check_replicated(model, pg)
    d = step_dir(ckpt_dir, step)
    if rank == 0:  # a stale marker of an earlier save of this step must not vouch for the new files
        (d / MANIFEST).unlink(missing_ok=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d), process_group=pg)
    torch.save(rng_state(), d / f"rng_rank{rank}.pt")
    if rank == 0:
        atomic_write(d / "train_state.json", lambda p: p.write_text(json.dumps({"step": step, **train_state})))
    if pg is not None:
        dist.barrier(group=pg)
    write_manifest(d, step, train_state["layout"], pg, rank)
    if rank == 0:
        kept = set(complete_checkpoints(ckpt_dir)[-max(keep, 1):])
        for old in ckpt_dir.glob("step_*"):  # older complete ones beyond `keep`, and incomplete leftovers
            if old.name[5:].isdigit() and int(old.name[5:]) < step and int(old.name[5:]) not in kept:
                shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint: step %d -> %s", step, d)


def read_train_state(ckpt_dir: Path, step: int) -> dict:
    return json.loads((step_dir(ckpt_dir, step) / "train_state.json").read_text())


def resume_schedule(state: dict, t, mode: str, where: str) -> dict:
    """The learning-rate schedule to continue with: the checkpoint's (``state["schedule"]``, else its
    config's training section) vs this run's ``training`` values. Equal: either. Different:
    ``mode`` "check" raises ``ValueError`` saying what changed and how to proceed, "checkpoint"
    keeps the stored schedule, "config" switches to this run's values from the next step on."""
    now = schedule_of(t)
    stored = state.get("schedule") or {k: state.get("config", {}).get("training", {}).get(k) for k in SCHEDULE_KEYS}
    if any(v is None for v in stored.values()):
        log.warning("%s records no learning-rate schedule: continuing with this run's", where)
        return now
    changed = {k: (stored[k], now[k]) for k in SCHEDULE_KEYS if stored[k] != now[k]}
    if not changed:
        return now
    what = ", ".join(f"training.{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
    if mode == "checkpoint":
        log.warning("learning-rate schedule differs from %s (%s): continuing the checkpoint's schedule "
                    "(training.resume_schedule=checkpoint)", where, what)
        return stored
    if mode == "config":
        log.warning("learning-rate schedule differs from %s (%s): switching to this run's schedule from the next "
                    "step on (training.resume_schedule=config)", where, what)
        return now
    same = " ".join(f"--set training.{k}={stored[k]!r}" for k in changed)
    raise ValueError(
        f"{where} was trained with another learning-rate schedule: {what}. Resuming would change the learning "
        f"rate of every later step. Either resume with the stored values ({same}), or choose explicitly: "
        f"--set training.resume_schedule=checkpoint (keep the stored schedule; past its last step the learning "
        f"rate stays at lr * min_lr_ratio) or --set training.resume_schedule=config (this run's schedule from the "
        f"next step on)")


def load_checkpoint(ckpt_dir: Path, step: int, model, opt, pg, rank: int, world: int, meta: dict) -> dict:
    """Load ``step_<step>`` into this layout's model and optimizer (DCP reshards); returns the
    train state. The head kind and vocabulary must match; dp/tp/world may differ."""
    d = step_dir(ckpt_dir, step)
    state = read_train_state(ckpt_dir, step)
    check_meta(state, meta, d)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(d), process_group=pg)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if state["layout"].get("world_size") == world and (d / f"rng_rank{rank}.pt").is_file():
        set_rng_state(torch.load(d / f"rng_rank{rank}.pt", weights_only=False))
    return state


def check_meta(state: dict, meta: dict, d: Path) -> None:
    for key in ("head", "vocab_size", "tie_word_embeddings"):
        if state["layout"].get(key) != meta.get(key):
            raise ValueError(f"checkpoint {d} has {key}={state['layout'].get(key)!r}, this run {meta.get(key)!r}: "
                             f"start fresh (--overwrite) or use another ckpt_dir")

