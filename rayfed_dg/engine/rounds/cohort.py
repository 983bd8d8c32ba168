"""Who a round trains: one ``Cohort`` shape for a synchronous round (sampled
with the round's seed, or planned on the device model's clock) and for an
asynchronous mode's server update (named by its virtual clock), so that the
server runs both with one round loop and builds their records in one place.

``Schedule`` keeps what decides the next cohort between rounds: the device
model and its clock (simulated seconds at which the next round starts), and
in an asynchronous mode the event simulation and the global model of each
version still in flight (each client trains from the version it downloaded).
Its state is part of the federation's checkpoint.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rayfed_dg.config import DevicesConfig, ExperimentConfig
from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.engine.clock import asynchronous as aio
from rayfed_dg.engine.clock.devices import DeviceModel, RoundPlan, model_bytes, plan_round, planned_work
from rayfed_dg.engine.store.records import ClientRow, Ledger, client_rows
from rayfed_dg.methods import ClientUpdate

State = dict[str, np.ndarray]


@dataclass
class Cohort:
    """One round's clients: ``train`` (sorted) train; ``listed`` is the
    round's recorded sample; ``charged`` downloaded the model and sent
    nothing (the clock's late, offline or dropped-out selections), in order."""
    round: int
    train: list[int]
    listed: list[int]
    charged: list[int] = field(default_factory=list)
    plan: RoundPlan | None = None  # the device model's synchronous round
    update: aio.Update | None = None  # an asynchronous mode's server update
    noun: str = "round"  # what the records call it: a round, or an asynchronous update
    who: str = "sampled"

    @property
    def sim_time(self) -> float | None:
        return self.plan.close if self.plan is not None else self.update.time if self.update is not None else None

    @property
    def starts(self) -> dict[int, aio.Training]:
        return {t.client: t for t in self.update.arrivals} if self.update is not None else {}

    def order(self) -> list[int]:
        """The clients in the order the estimator combines them: an update's arrival order, else client order."""
        return [t.client for t in self.update.arrivals] if self.update is not None else list(self.train)


class Schedule:
    """What picks each round's cohort (module docstring)."""

    def __init__(self, cfg: ExperimentConfig, split: FederatedSplit, sizes: np.ndarray, per_round: int,
                 global_state: State):
        self.cfg, self.split, self.per_round = cfg, split, per_round
        self.devices = DeviceModel(cfg.devices, cfg.training.seed, split.client_domains,
                                   model_bytes(global_state)) if cfg.devices.enabled else None
        self.clock = 0.0
        steps = lambda c: planned_work(cfg.training, int(sizes[c]))
        # each client's work in a round (its local steps in full batches' worth), which its duration counts
        self.steps = np.array([steps(c) for c in range(len(sizes))]) if cfg.devices.enabled else None
        self.async_clock = None
        if cfg.server.mode != "sync":
            n = split.num_clients
            aio.check_async(cfg, n)  # the run's preflight did; a federation opened by hand is checked too
            # without devices.enabled: the section's defaults, every device online, one simulated second a step
            devices = self.devices or DeviceModel(DevicesConfig(), cfg.training.seed, split.client_domains)
            self.async_clock = aio.AsyncClock(n, aio.concurrency(cfg, n), aio.buffer_size(cfg, n), cfg.training.seed,
                                              devices, steps, cfg.server.retry_s)
        self.versions: dict[int, State] = {0: global_state} if self.async_clock is not None else {}

    def next(self, r: int, sample: Callable[[int], list[int]]) -> Cohort:
        if self.async_clock is not None:
            upd = self.async_clock.next_update()
            ids = sorted(t.client for t in upd.arrivals)
            return Cohort(r, ids, sorted(set(ids) | {t.client for t in upd.dropped}),
                          [t.client for t in upd.dropped], update=upd, noun="update", who="arriving")
        if self.devices is None or self.steps is None:
            sampled = sample(r)
            return Cohort(r, sampled, sampled)
        d = self.cfg.devices
        plan = plan_round(self.devices, self.split.num_clients, self.cfg.training.seed, r, self.clock,
                          self.per_round, self.steps, d.over_selection, d.deadline_s, d.wait_s)
        return Cohort(r, plan.aggregated, plan.selected, sorted(plan.reasons), plan=plan)

    def finish(self, c: Cohort, global_state: State) -> None:
        """After round ``c``: the clock moves to its close; an asynchronous
        mode keeps the new version and lets go of those no training in flight
        started from."""
        if c.plan is not None:
            self.clock = c.plan.close
        if self.async_clock is not None:
            self.versions[c.round] = global_state
            live = self.async_clock.in_flight_versions() | {c.round}
            self.versions = {v: st for v, st in self.versions.items() if v in live}

    # ------------------------------------------------------------ checkpoint
    def state_dict(self, round: int) -> dict:
        return {"clock": self.clock,
                **({"async": {"clock": self.async_clock.state_dict(),  # the current version is the global state
                              "versions": {v: st for v, st in self.versions.items() if v != round}}}
                   if self.async_clock is not None else {})}

    def load_state_dict(self, state: dict, round: int, global_state: State) -> None:
        self.clock = float(state["clock"])  # an older checkpoint has it from store/formats.py
        if self.async_clock is not None:  # a config in an asynchronous mode resumes only its own runs
            self.async_clock.load_state_dict(state["async"]["clock"])
            self.versions = {**state["async"]["versions"], round: global_state}


def cohort_rows(c: Cohort, split: FederatedSplit, updates: dict[int, ClientUpdate], failed: dict[int, str],
                retries: dict[int, int], ledger: Ledger, sizes: np.ndarray, bcast: list) -> list[ClientRow]:
    """The round's client rows, and the downloads of the ``charged`` clients
    in the ledger (``bcast``: the broadcast's groups).  A synchronous round's
    rows are ``client_rows`` (on the clock, one per selected client, its
    download counted).  An asynchronous update's add each training's
    simulated start, finish and staleness, and a row of its own for each
    training that dropped out, charged its download there: its device may
    also have trained again and arrived in this update, a row that counts
    only that training's download.  Sorted by arrival."""
    if c.update is None:
        for cid in c.charged:
            ledger.add_state(cid, "down", bcast)
        return client_rows(c.round, split, c.train, updates, failed, retries, ledger, c.plan)
    rows = client_rows(c.round, split, c.train, updates, failed, retries, ledger)
    down = sum(b for _, b, _ in bcast)
    start = c.starts
    for row in rows:
        t = start[row.client]
        row.sim_start, row.sim_finish = t.start, t.finish
        row.staleness = t.staleness if row.client in updates else None
    for t in c.update.dropped:  # like the sync clock's late clients, not a failed task (no DropRow)
        ledger.add_state(t.client, "down", bcast)
        rows.append(ClientRow(
            round=c.round, client=t.client, domain=split.client_domains[t.client], samples=int(sizes[t.client]),
            local_steps=0, train_loss=None, seconds=None, bytes_up=0, bytes_down=down, retried=0, dropped=True,
            drop_reason="dropout", sim_start=t.start, sim_finish=t.finish))
    rows.sort(key=lambda row: (row.sim_finish, row.client))
    return rows
