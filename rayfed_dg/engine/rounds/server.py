"""The server actor: it keeps an experiment's worker pool and conducts the
rounds of its current federation (``federation.py`` holds the state).

One ``run_round`` call is one federated round:

1. sample ``clients_per_round`` of the N clients with the round's seed; with
   the device model (``devices.enabled``), the round's plan on its clock
   (``devices.plan_round``) instead: the clients online at the round's
   start are over-selected, and only those that upload by the round's close
   train (the others are charged the download, and recorded); an
   ``_idle_round`` when none does;
2. the global weights are already in the object store (one ``ray.put`` per
   round, after the previous aggregation); workers read them zero-copy;
3. the phases the method declares at ``Slot.BEFORE_TRAINING`` (``Phase.PREPARE``: every
   sampled client computes with this global model, and the method's
   ``server_payloads`` gets the results);
4. dispatch the sampled clients' training to the worker pool (``pool.py``, its policy in ``dispatch.py``:
   largest first, small clients grouped into one Ray task, two tasks in
   flight per worker, retries, drops);
5. fold updates into the average (``aggregate.py``: a sum whose bits do not
   depend on order): each worker folds the uploads of the clients it
   trained into one partial sum and the server merges one per worker
   (``gather``), or, for a method that reads each upload
   (``Method.folds_on_workers`` False), the server folds each as it
   arrives; each client's local state goes back into the client store;
6. the new global model (``Federation.aggregate``: the average, a server
   optimizer's step, the method's own tensors), put in the object store;
7. the phases at ``Slot.AFTER_AGGREGATION`` (``Phase.EVALUATE_ON_CLIENTS``), the
   method's ``after_round``; in an evaluated round, the phases at
   evaluation (``Phase.PERSONAL_EVAL``) and the evaluation of the global
   model on every source domain's validation split and on the target.

In an asynchronous server mode (``server.mode``) ``run_round`` is
``run_async_round``: one server update, its clients named by the virtual
clock (``asynchronous.py``).

The optional phases are those the method declares (``Method.phases``),
each run at its slot (``phases.py``; ``methods/base.py`` has the table).
Data stages run before round 1 (``stagehost.run_stages``).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import ray

from rayfed_dg.config import ExperimentConfig
from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.engine.aggregation.exact import Reducer
from rayfed_dg.engine.clock.devices import RoundPlan
from rayfed_dg.engine.store.records import (
    ClientRow,
    ClientTask,
    DropRow,
    Fold,
    Ledger,
    MetricRow,
    RoundResult,
    client_rows,
)
from rayfed_dg.engine.workers.pool import Launching, WorkerPool
from rayfed_dg.engine.workers.resources import autoscaler_launching
from rayfed_dg.errors import EngineError
from rayfed_dg.methods import ClientUpdate, Slot

from .evaluation import evaluate_global
from .federation import Federation
from .phases import RoundWork, run_phases
from .stagehost import run_stages


def _rerun_done(cid: int, upd: ClientUpdate | None) -> None:
    """A lost fold's re-run came back; its update is the one already recorded."""
    if upd is None:
        raise EngineError(f"client {cid}'s partial sum was lost with its worker, and training it again failed")


def follow_autoscaler(e) -> Launching | None:
    """What the pool asks while it waits for a lost worker (it waits on while
    the autoscaler launches a node, ``pool.give_up_at``): what is being
    launched for a worker of ``e``'s size; nothing with ``engine.autoscaler``
    off."""
    return None if e.autoscaler == "off" else partial(autoscaler_launching, e.num_cpus_per_worker,
                                                      e.num_gpus_per_worker)


class Server:
    """One experiment's server actor: it keeps the worker pool for the
    experiment and runs one federation at a time (``start``)."""

    def __init__(self, workers: list, data_source: Any):
        # started by EngineHost, with the workers and data source it is handed
        self.data_source = data_source
        self.pool = WorkerPool(workers, 0)  # waits until every worker is up

    def retire_restarted(self) -> list[int]:
        """End the workers whose process died since they were started (their
        Ray restart budget is spent, or they left the pool); returns their
        places for ``replace_workers``."""
        gone = sorted(self.pool.restarted)
        for w in gone:
            ray.kill(self.pool.workers[w])
        return gone

    def replace_workers(self, fresh: dict[int, Any]) -> None:
        self.pool.replace(fresh)

    def add_workers(self, workers: list) -> None:
        """More workers for the current federation (called between its rounds)."""
        self.pool.add(workers)

    def start(self, cfg: ExperimentConfig, split: FederatedSplit, num_classes: int, federation: int,
              workers: list | None = None) -> None:
        """Begin a federation (its workers build its model on their first
        task); ``workers``: its own pool instead of the one kept so far."""
        if workers is not None:
            self.pool = WorkerPool(workers, 0)
        self.fed = Federation(cfg, split, num_classes, federation)
        e = cfg.engine
        self.pool.retries, self.pool.restart_timeout_s = e.max_task_retries, e.worker_restart_timeout_s
        self.pool.replacement_timeout_s, self.pool.launching = e.worker_replacement_timeout_s, follow_autoscaler(e)
        self.pool.retried = self.pool.reruns = 0
        self.global_ref = ray.put(self.fed.global_state)
        # asynchronous modes: the global model of each version still in flight, in the object store
        self.versions = {v: self.global_ref for v in self.fed.versions}

    @property
    def split(self) -> FederatedSplit:
        return self.fed.split

    def current(self) -> Federation:
        """The current federation, as a copy (tests and tools read it)."""
        return self.fed

    def setup(self) -> dict:
        return run_stages(self.pool, self.fed)

    def get_state(self, pieces: Path | None = None, clients: bool = True) -> dict:
        return self.fed.get_state(pieces, clients)

    def spill_to(self, directory: str) -> None:
        """Spill client states to ``directory`` (the run directory's; before the first round)."""
        self.fed.store.use_directory(Path(directory))

    def set_state(self, state: dict) -> None:
        self.fed.set_state(state)
        self.global_ref = ray.put(self.fed.global_state)
        self.versions = {v: self.global_ref if v == self.fed.round else ray.put(st)
                         for v, st in self.fed.versions.items()}

    # --------------------------------------------------------------- round
    def run_round(self) -> RoundResult:
        if self.fed.async_clock is not None:
            return self.run_async_round()
        t0 = time.perf_counter()
        fed = self.fed
        r = fed.round + 1
        plan = fed.clock_plan(r)  # the device model's round (None without one): only its aggregated clients train
        sampled = fed.sample(r) if plan is None else plan.aggregated
        if plan is not None and not sampled:
            return self._idle_round(r, plan, t0)
        sizes = fed.sizes[sampled]
        reducer, ledger = fed.reducer(sampled), Ledger(r)
        work = RoundWork(r, sampled, ledger, fed, self.pool, self.global_ref)
        run_phases(Slot.BEFORE_TRAINING, work)
        payloads = fed.payloads(r, sampled, work.prepared)
        bcast_sizes = Ledger.group_sizes(fed.broadcast_state(), fed.groups.__getitem__)  # every client receives these
        updates: dict[int, ClientUpdate] = {}

        folds = fed.method.folds_on_workers

        def on_update(cid: int, upd: ClientUpdate | None) -> None:
            if upd is None or not folds:
                reducer.add(cid, None if upd is None else upd.update)
            if upd is None:
                return
            updates[cid] = upd
            ledger.add_state(cid, "up", upd.sizes, fed.groups.__getitem__)  # the whole upload left the client
            ledger.add_payload(cid, "up", upd.payload)
            ledger.add_state(cid, "down", bcast_sizes)
            ledger.add_payload(cid, "down", payloads.get(cid, {}))

        def task(cid: int, attempt: int, epoch: int = 0) -> ClientTask:
            fold = Fold(fed.id, r, epoch, reducer.weights[cid]) if folds else None
            return fed.task(r, cid, payloads.get(cid, {}), attempt, fold)

        t_clients = time.perf_counter()
        dropped = self.pool.map(
            sampled, lambda w, cid, attempt: w.train_in.remote(fed.id, task(cid, attempt), self.global_ref),
            on_update, cost=dict(zip(sampled, sizes.tolist())),
            largest_first=fed.cfg.engine.schedule == "largest_first",
            submit_many=None if not fed.cfg.engine.group_small_clients else lambda w, jobs: w.train_many_in.remote(
                fed.id, [task(cid, attempt) for cid, attempt in jobs], self.global_ref))
        retries = dict(self.pool.last_retries)
        if len(reducer.dropped) == len(sampled):
            raise EngineError(f"round {r}: every sampled client failed ({dropped[0][1]})")
        if folds:
            self.gather(reducer, lambda w, cid, attempt, epoch: w.train_in.remote(
                fed.id, task(cid, retries.get(cid, 0) + attempt, epoch), self.global_ref))
        seconds_clients = time.perf_counter() - t_clients
        for cid in sorted(updates):  # after the gather: a client trained again starts from the round's local state
            fed.store.put(cid, updates[cid].update, updates[cid].private)
        results = work.results = [updates[c] for c in sorted(updates)]
        if plan is not None:  # the selected clients that did not make it downloaded the model, and sent nothing
            for cid in sorted(plan.reasons):
                ledger.add_state(cid, "down", bcast_sizes)
            fed.clock = plan.close
        clip = None if fed.dp is None else fed.dp.clip  # this round's: aggregating sets the next one's
        fed.aggregate(r, reducer, results)
        work.global_ref = self.global_ref = ray.put(fed.global_state)
        run_phases(Slot.AFTER_AGGREGATION, work)
        fed.end_round(r, results)
        seconds_train = time.perf_counter() - t0
        metrics = self.evaluate(work) if self._evaluates(r) else []
        return RoundResult(
            round=r, sampled=sampled if plan is None else plan.selected,
            dropped=[DropRow(r, c, why) for c, why in dropped], metrics=metrics, ledger=ledger.sorted_rows(),
            clients=client_rows(r, self.split, sampled, updates, dict(dropped), retries, ledger, plan),
            train_loss=float(np.mean([u.train_loss for u in results])), tasks_retried=self.pool.retried,
            tasks_rerun=self.pool.reruns,
            seconds_train=seconds_train, seconds_total=time.perf_counter() - t0, seconds_clients=seconds_clients,
            sim_time=None if plan is None else plan.close, dp_clip=clip)

    def _evaluates(self, r: int) -> bool:
        every = self.fed.cfg.evaluation.every
        return bool(every and r % every == 0) or r == self.fed.cfg.training.rounds

    def _idle_round(self, r: int, plan: RoundPlan, t0: float) -> RoundResult:
        """A round on the clock in which no selected client uploads in time:
        nobody trains, the global model and the method's state stay, the
        clock moves on to the round's close."""
        fed, ledger = self.fed, Ledger(r)
        bcast_sizes = Ledger.group_sizes(fed.broadcast_state(), fed.groups.__getitem__)
        for cid in plan.selected:
            ledger.add_state(cid, "down", bcast_sizes)
        fed.clock, fed.round = plan.close, r
        work = RoundWork(r, [], ledger, fed, self.pool, self.global_ref)
        metrics = self.evaluate(work) if self._evaluates(r) else []
        seconds = time.perf_counter() - t0
        return RoundResult(
            round=r, sampled=plan.selected, dropped=[], metrics=metrics, ledger=ledger.sorted_rows(),
            clients=client_rows(r, self.split, [], {}, {}, {}, ledger, plan), train_loss=float("nan"),
            tasks_retried=self.pool.retried, tasks_rerun=self.pool.reruns, seconds_train=seconds,
            seconds_total=seconds, sim_time=plan.close)

    def run_async_round(self) -> RoundResult:
        """One server update of an asynchronous mode (``asynchronous.py``):
        the clock names the K arrivals; each trains now, on the pool, from the
        version it downloaded (the training depends only on that version, its
        local state, which nothing changes while it is in flight, and its
        seeds), its upload travels whole, and the update combines them in the
        clock's order."""
        t0 = time.perf_counter()
        fed = self.fed
        assert fed.async_clock is not None
        r = fed.round + 1
        upd = fed.async_clock.next_update()
        start = {t.client: t for t in upd.arrivals}
        ids = sorted(start)
        ledger, updates = Ledger(r), {}
        bcast_sizes = Ledger.group_sizes(fed.broadcast_state(), fed.groups.__getitem__)

        def on_update(cid: int, u: ClientUpdate | None) -> None:
            if u is None:
                return
            updates[cid] = u
            ledger.add_state(cid, "up", u.sizes, fed.groups.__getitem__)
            ledger.add_state(cid, "down", bcast_sizes)

        t_clients = time.perf_counter()
        failed = self.pool.map(  # one task per client: each reads its own version
            ids, lambda w, cid, attempt: w.train_in.remote(fed.id, fed.task(r, cid, {}, attempt),
                                                           self.versions[start[cid].version]),
            on_update, cost={c: int(fed.sizes[c]) for c in ids},
            largest_first=fed.cfg.engine.schedule == "largest_first")
        retries = dict(self.pool.last_retries)  # before the evaluation's maps
        if not updates:
            raise EngineError(f"update {r}: every arriving client failed ({failed[0][1]})")
        seconds_clients = time.perf_counter() - t_clients
        for cid in ids:
            if cid in updates:
                fed.store.put(cid, updates[cid].update, updates[cid].private)
        fed.apply_async(upd.arrivals, updates)
        results = [updates[c] for c in ids if c in updates]
        fed.end_round(r, results)
        fed.keep_versions()
        self.global_ref = ray.put(fed.global_state)
        self.versions = {v: self.versions.get(v, self.global_ref) for v in fed.versions}
        seconds_train = time.perf_counter() - t0
        work = RoundWork(r, ids, ledger, fed, self.pool, self.global_ref, results=results)
        metrics = self.evaluate(work) if self._evaluates(r) else []
        rows = client_rows(r, self.split, ids, updates, dict(failed), retries, ledger)
        for row in rows:
            t = start[row.client]
            row.sim_start, row.sim_finish = t.start, t.finish
            row.staleness = t.staleness if row.client in updates else None
        # a training that dropped out: a row of its own (its device may also have trained again and arrived in this
        # update), charged the download it made; like the sync clock's, not a failed task (no DropRow)
        down = sum(b for _, b, _ in bcast_sizes)
        sizes = fed.sizes
        for t in upd.dropped:
            ledger.add_state(t.client, "down", bcast_sizes)
            rows.append(ClientRow(
                round=r, client=t.client, domain=self.split.client_domains[t.client], samples=int(sizes[t.client]),
                local_steps=0, train_loss=None, seconds=None, bytes_up=0, bytes_down=down, retried=0, dropped=True,
                drop_reason="dropout", sim_start=t.start, sim_finish=t.finish))
        rows.sort(key=lambda row: (row.sim_finish, row.client))
        return RoundResult(
            round=r, sampled=sorted(set(ids) | {t.client for t in upd.dropped}),
            dropped=[DropRow(r, c, why) for c, why in failed],
            metrics=metrics, ledger=ledger.sorted_rows(), clients=rows,
            train_loss=float(np.mean([u.train_loss for u in results])), tasks_retried=self.pool.retried,
            tasks_rerun=self.pool.reruns, seconds_train=seconds_train, seconds_total=time.perf_counter() - t0,
            seconds_clients=seconds_clients, sim_time=upd.time)

    def gather(self, reducer: Reducer, rerun: Callable[[Any, int, int, int], Any]) -> None:
        """Merge each worker's partial sum of the round.  The clients of a
        partial that was lost (its worker's process died after folding them)
        or is not whole (a client in two partials, or one the round dropped)
        train again, at the attempt that succeeded (training is seeded: the
        same upload), folding into the next epoch's partials: uncharged and
        unrecorded, counted only as re-runs.  ``rerun(worker, client,
        attempt, epoch)`` submits one."""
        fed, r = self.fed, self.fed.round + 1
        for epoch in range(fed.cfg.engine.max_task_retries + 2):
            if epoch:
                lost = reducer.missing
                self.pool.reruns += len(lost)
                self.pool.map(lost, lambda w, cid, attempt: rerun(w, cid, attempt, epoch), _rerun_done)
            parts = [p for p in self.pool.ask_each(lambda w: w.take_partial.remote(fed.id, r, epoch)) if p]
            waiting = set(reducer.missing)
            seen = Counter(c for p in parts for c in p.clients)
            for p in parts:
                if all(c in waiting and seen[c] == 1 for c in p.clients):
                    reducer.add_partial(p)
            if reducer.complete:
                return
        raise EngineError(f"round {r}: the partial sums of clients {reducer.missing} were lost "
                          f"{fed.cfg.engine.max_task_retries + 2} times (workers dying); see the workers' logs")

    def evaluate(self, work: RoundWork) -> list[MetricRow]:
        run_phases(Slot.AT_EVALUATION, work)
        return evaluate_global(self.pool, self.fed.id, self.global_ref, self.split, work.own,
                               self.fed.cfg.evaluation.batch_size, work.round)

    def shutdown(self) -> None:
        self.pool.shutdown()
        ray.kill(self.data_source)
