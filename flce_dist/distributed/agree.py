"""Which collectives a rank issues is decided from what every rank of the group already shares (issue 61).

The rule: every decision that changes which collectives a rank issues (how many statistics all-gathers and
of which size, whether the forward all-reduces dX, the deterministic path, sequence parallelism's gathers,
the shard check's handshake itself) is taken from values every rank already shares, or the ranks agree on it
first. A rank's own arguments are not such values: one rank may differ (a per-rank config, a frozen parameter
on one stage, a data loader that gives one rank other weights). On the GPU the per-call guard's verdict
(``guard.py``) stays on the device, so a rank cannot learn in time that a peer differs; it must issue the same
collectives anyway.

So each rank keeps, per group, the **history of agreed calls**: the digest of every call's *plan* (everything
that shapes its collectives: hidden size, dtypes, bias, which gradients it forms, grad mode, loss_weights or
num_items given, the loss options, settings, the stated layout; not the token count, which RL and evaluation
change every call and the guard compares per call) in the order the group made them. Every rank updates it
at the same calls in the same way, from agreed values only, so it is the same on every rank. From it every
rank **predicts** the next call's plan: the plan that followed the last one the previous time (a call of the
same plan as the last one, the first time), so a steady program (one plan, or a training step that
alternates two heads or a log-prob and a training call) is predicted exactly. Then, per call:

* **cold** (no history: the group's first call, or after ``clear_shard_cache()``): every rank is cold, so
  every rank runs the shard check's handshake (``shard.py``: one all-gather and a host sync), which compares
  the plans and the token count and raises the same ``ValueError`` on every rank if they differ.
* **hit** (the call's plan is the predicted one): nothing more; the call runs its plan (the hot path: a
  dict lookup, no collective, no sync).
* **stand-in** (the call's plan is not the predicted one: a change on this rank, and perhaps on every rank):
  this rank runs the *predicted* plan in place of its own call (``api._stand_in``: the core on stand-in
  inputs with an empty shard, so nothing is computed but its collectives), whose guard carries this
  call's own digest, so that every rank's guard fails at the first statistics all-gather. The stand-in
  reads that all-gather's guards (a host sync, paid only here): if **every** rank stood in for the same new
  plan and token count, the group changed plans together (a new head, evaluation after training): every rank
  raises :class:`Replan` there, records the new plan (running the handshake where its stated layout is new)
  and then runs the call itself. Otherwise the ranks
  differ: the ones whose calls were predicted run on and fail their guard (the same ``ValueError`` on CPU
  tensors and with ``check_finite``, NaN otherwise), and the stand-ins finish the predicted plan's
  collectives, forward and (when autograd runs it) backward, and return NaN in the shape of their own
  call. Every rank issued the same collectives; the history records the predicted plan on every rank.

Costs: a hit costs a digest (cached) and two dict operations on the host. A plan change that every rank
makes costs one statistics all-gather of stand-in inputs and a host sync, once per change (plus the
handshake where the stated layout is new; the successor table makes a steady alternation free). Not caught here: a rank whose token count alone
differs issues differently sized all-gathers (the guard compares the count but cannot stop them; gloo
aborts on the size mismatch, NCCL hangs or pairs them wrongly); a rank that skips the backward its peers
run (a rank that never enters a collective: the group's timeout); calls under ``torch.compile``, whose
shard check runs once at trace time and whose graph's plan is fixed then.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


class Replan(Exception):
    """Raised on every rank by the stand-in's first statistics all-gather when every rank's call has the same
    plan and it is not the predicted one: the group changed plans together (caught by the API, which then
    agrees on the new plan and runs the call)."""


@dataclass
class History:
    """One group's agreed calls (the same on every rank): the last plan's digest, the plan that followed each
    plan last time, and each agreed plan's record (what a stand-in needs to run it)."""

    last: int | None = None
    before: int | None = None
    successor: dict[int, int] = field(default_factory=dict)
    plans: dict[int, Any] = field(default_factory=dict)

    def predict(self) -> int | None:
        """The next call's plan every rank expects (None: cold)."""
        return None if self.last is None else self.successor.get(self.last, self.last)

    def advance(self, digest: int) -> None:
        """The call of plan ``digest`` ran on every rank (or stood in for, everywhere it differed)."""
        if self.last is not None:
            self.successor[self.last] = digest
        self.before, self.last = self.last, digest

    def redo(self, digest: int) -> None:
        """The last call turned out to be a plan change every rank made (:class:`Replan`): ``digest`` ran."""
        if self.before is not None:
            self.successor[self.before] = digest
        self.last = digest

    def record(self, digest: int, plan: Any) -> None:
        """The record of agreed plan ``digest`` (bounded: every rank clears at the same call, the plans being
        agreed ones; the last plan stays predicted)."""
        if digest not in self.plans and len(self.plans) >= _MAX_PLANS:
            self.plans.clear()
            self.successor.clear()
            self.before = None
        self.plans[digest] = plan


_MAX_PLANS = 256
_HISTORY: weakref.WeakKeyDictionary[dist.ProcessGroup, History] = weakref.WeakKeyDictionary()


def history(group: dist.ProcessGroup) -> History:
    """``group``'s history of agreed calls (created cold)."""
    got = _HISTORY.get(group)
    if got is None:
        got = _HISTORY[group] = History()
    return got


def clear() -> None:
    """Forget every group's history (``shard.clear_shard_cache``: on every rank at the same point)."""
    _HISTORY.clear()
