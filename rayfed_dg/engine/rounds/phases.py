"""The optional round phases (the phase table in ``methods/base.py``): what
each runs on the worker pool, and ``RoundWork``, what a round's phases read
and add to.  The round (``server.py``) calls ``run_phases`` at each slot;
a phase runs only for a method that declares it."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayfed_dg.engine.store.records import Ledger
from rayfed_dg.engine.workers.pool import WorkerPool
from rayfed_dg.methods import ClientUpdate, Phase, Slot

from .evaluation import evaluate_on_clients
from .federation import Federation


@dataclass
class RoundWork:
    round: int
    sampled: list[int]
    ledger: Ledger
    fed: Federation
    pool: WorkerPool
    global_ref: Any  # the object-store reference of the global model the phase sees
    prepared: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # ``Phase.PREPARE``'s results
    results: list[ClientUpdate] = field(default_factory=list)  # the round's updates, in client order
    own: Mapping[int, dict[str, np.ndarray]] = field(default_factory=dict)  # ``Phase.PERSONAL_EVAL``: local states


def run_phases(slot: Slot, work: RoundWork) -> None:
    """The phases the method declares for ``slot``, in its order."""
    for phase in work.fed.method.phases:
        if phase.slot is slot:
            RUNNERS[phase](work)


def prepare(work: RoundWork) -> None:
    """``round_prepare`` on every sampled client, with the round's global
    model; every one must answer (what it computes decides what the others
    receive)."""
    fed, r = work.fed, work.round
    work.prepared = work.pool.map_all(work.sampled, lambda w, cid, attempt: w.prepare_in.remote(
        fed.id, fed.task(r, cid, {}, attempt), work.global_ref), f"round {r}: the preparation phase")
    for cid in sorted(work.prepared):  # the global model it used is the round's one broadcast (counted with training)
        work.ledger.add_payload(cid, "up", work.prepared[cid], prefix="prepare")


def global_on_clients(work: RoundWork) -> None:
    """The new global model on each participant's validation samples (``ClientUpdate.global_eval``)."""
    evaluate_on_clients(work.pool, work.fed.id, work.global_ref, work.results, work.fed.data.client_val,
                        work.fed.cfg.evaluation.batch_size, work.ledger)


def personal_states(work: RoundWork) -> None:
    """The local states whose own model the evaluation adds (``personal_val``)."""
    work.own = work.fed.own_states(work.round)


# a new phase adds its member (with its slot) to ``Phase`` and its runner here
RUNNERS: dict[Phase, Callable[[RoundWork], None]] = {
    Phase.PREPARE: prepare,
    Phase.EVALUATE_ON_CLIENTS: global_on_clients,
    Phase.PERSONAL_EVAL: personal_states,
}
