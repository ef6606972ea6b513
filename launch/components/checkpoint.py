"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), reshardable across layouts.

``step_<N>/`` under ``checkpoint.ckpt_dir`` holds the DCP files of the model and optimizer state
(``get_state_dict``: DTensor shards keyed by fully qualified names, so a run saved at (dp=2, tp=2)
loads at (dp=1, tp=4), (dp=4, tp=1) or one process), ``train_state.json`` (step, data position,
loss history, layout, config; written by rank 0), ``rng_rank<r>.pt`` (torch/CUDA/Python RNG of the
rank; restored only at the same world size, the model uses no RNG in training) and, last,
``complete.json`` written by rank 0 after a barrier once every rank's files are on disk. Only
checkpoints with the marker count."""

from __future__ import annotations

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


def step_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step_{step:08d}"


def complete_checkpoints(ckpt_dir: Path) -> list[int]:
    steps = []
    if ckpt_dir.is_dir():
        for d in ckpt_dir.iterdir():
            if d.name.startswith("step_") and d.name[5:].isdigit() and (d / "complete.json").is_file():
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


def save_checkpoint(ckpt_dir: Path, step: int, train_state: dict, model, opt, pg, rank: int, keep: int) -> None:
    """Every rank calls this (DCP is collective). ``pg``: the process group of the run (None: one process)."""
    d = step_dir(ckpt_dir, step)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d), process_group=pg)
    torch.save(rng_state(), d / f"rng_rank{rank}.pt")
    if rank == 0:
        atomic_write(d / "train_state.json", lambda p: p.write_text(json.dumps({"step": step, **train_state})))
    if pg is not None:
        dist.barrier(group=pg)
    if rank == 0:
        atomic_write(d / "complete.json", lambda p: p.write_text(json.dumps({"step": step, **train_state["layout"]})))
        kept = set(complete_checkpoints(ckpt_dir)[-max(keep, 1):])
        for old in ckpt_dir.glob("step_*"):  # older complete ones beyond `keep`, and incomplete leftovers
            if old.name[5:].isdigit() and int(old.name[5:]) < step and int(old.name[5:]) not in kept:
                shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint: step %d -> %s", step, d)


def load_checkpoint(ckpt_dir: Path, step: int, model, opt, pg, rank: int, world: int, meta: dict) -> dict:
    """Load ``step_<step>`` into this layout's model and optimizer (DCP reshards); returns the
    train state. The head kind and vocabulary must match; dp/tp/world may differ."""
    d = step_dir(ckpt_dir, step)
    state = json.loads((d / "train_state.json").read_text())
    for key in ("head", "vocab_size", "tie_word_embeddings"):
        if state["layout"].get(key) != meta.get(key):
            raise ValueError(f"checkpoint {d} has {key}={state['layout'].get(key)!r}, this run {meta.get(key)!r}: "
                             f"start fresh (--overwrite) or use another ckpt_dir")
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(d), process_group=pg)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if state["layout"].get("world_size") == world and (d / f"rng_rank{rank}.pt").is_file():
        set_rng_state(torch.load(d / f"rng_rank{rank}.pt", weights_only=False))
    return state
