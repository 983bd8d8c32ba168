"""One round on the worker pool: the same steps for a synchronous round and
for an asynchronous mode's server update.

1. the cohort (``Federation.cohort``: sampled with the round's seed, planned
   on the device model's clock, or named by the asynchronous clock); a round
   on the clock in which nobody uploads in time trains nobody;
2. the phases the method declares at ``Slot.BEFORE_TRAINING`` and its server
   payloads;
3. training on the pool (``engine/workers/pool.py``; its policy in
   ``dispatch.py``), each client from the model version it downloaded (the
   round's global model, or in an asynchronous mode the version it started
   from); where the aggregation pipeline lets them (``Pipeline.folds``),
   workers fold their clients' uploads into one exact partial sum each and
   ``gather`` merges one per worker, else each upload travels whole;
4. each client's local state back into the client store, and the new global
   model from the aggregation pipeline (``Federation.aggregate``), put in the
   object store once;
5. the phases at ``Slot.AFTER_AGGREGATION``, the method's ``after_round``;
   in an evaluated round, the phases at evaluation and the global model on
   every source domain's validation split and on the target.

Every client row, ledger row and the ``RoundResult`` are built here, once.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from rayfed_dg.engine.aggregation.exact import Reducer
from rayfed_dg.engine.store.records import ClientTask, DropRow, Fold, Ledger, MetricRow, RoundResult
from rayfed_dg.engine.workers.batched import client_groups
from rayfed_dg.engine.workers.pool import WorkerPool
from rayfed_dg.errors import EngineError
from rayfed_dg.methods import ClientUpdate, Slot

from .cohort import Cohort, cohort_rows
from .evaluation import evaluate_global
from .federation import Federation
from .phases import RoundWork, run_phases


@dataclass
class Published:
    """The global model of each version clients may train from, in the object store (one ``ray.put`` each)."""
    current: Any = None
    versions: dict[int, Any] = field(default_factory=dict)

    def put_all(self, fed: Federation) -> None:
        self.current = ray.put(fed.global_state)
        self.versions = {v: self.current if v == fed.round else ray.put(st)
                         for v, st in fed.schedule.versions.items()}

    def track(self, fed: Federation) -> None:
        """After a round: the versions still in flight keep their references, the new one is ``current``."""
        self.versions = {v: self.versions.get(v, self.current) for v in fed.schedule.versions}

    def ref(self, c: Cohort, cid: int) -> Any:
        t = c.starts.get(cid)
        return self.current if t is None else self.versions[t.version]


def _rerun_done(cid: int, upd: ClientUpdate | None) -> None:
    """A lost fold's re-run came back; its update is the one already recorded."""
    if upd is None:
        raise EngineError(f"client {cid}'s partial sum was lost with its worker, and training it again failed")


@dataclass
class Trained:
    updates: dict[int, ClientUpdate] = field(default_factory=dict)
    failed: list[tuple[int, str]] = field(default_factory=list)
    retries: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0


def run_round(fed: Federation, pool: WorkerPool, pub: Published) -> RoundResult:
    t0 = time.perf_counter()
    c = fed.cohort()
    r, ledger = c.round, Ledger(c.round)
    work = RoundWork(r, c.train, ledger, fed, pool, pub.current)
    bcast = Ledger.group_sizes(fed.broadcast_state(), fed.groups.__getitem__)  # every client receives these
    reducer, done = fed.reducer(c.train), Trained()
    if c.train:
        run_phases(Slot.BEFORE_TRAINING, work)
        done = train(fed, pool, pub, c, work, reducer, bcast)
        for cid in sorted(done.updates):  # after the gather: a client trained again starts from the round's state
            fed.store.put(cid, done.updates[cid].update, done.updates[cid].private)
        work.results = fed.aggregate(c, reducer, done.updates)
        work.global_ref = pub.current = ray.put(fed.global_state)
        run_phases(Slot.AFTER_AGGREGATION, work)
    fed.end_round(c, work.results)
    pub.track(fed)
    metrics = evaluate(fed, pool, pub, work) if evaluates(fed, r) else []
    rows = cohort_rows(c, fed.split, done.updates, dict(done.failed), done.retries, ledger, fed.sizes, bcast)
    return RoundResult(
        round=r, sampled=c.listed, dropped=[DropRow(r, k, why) for k, why in done.failed], metrics=metrics,
        ledger=ledger.sorted_rows(), clients=rows,
        train_loss=float(np.mean([u.train_loss for u in work.results])) if work.results else float("nan"),
        tasks_retried=pool.retried, tasks_rerun=pool.reruns,
        seconds_total=time.perf_counter() - t0, seconds_clients=done.seconds, sim_time=c.sim_time,
        dp_clip=fed.pipeline.estimator.record().get("dp_clip"))


def train(fed: Federation, pool: WorkerPool, pub: Published, c: Cohort, work: RoundWork, reducer: Reducer,
          bcast: list) -> Trained:
    """Train the cohort on the pool; the uploads folded into ``reducer`` (on
    the workers, or here), each returned update recorded in the ledger."""
    r, ledger, done = c.round, work.ledger, Trained()
    payloads = fed.payloads(r, c.train, work.prepared)  # none in an asynchronous mode: it refuses server_payloads
    folds, sums = fed.pipeline.folds(), fed.pipeline.estimator.sums  # an asynchronous estimator reads uploads whole

    def on_update(cid: int, upd: ClientUpdate | None) -> None:
        if sums and (upd is None or not folds):
            reducer.add(cid, None if upd is None else upd.update)
        if upd is None:
            return
        done.updates[cid] = upd
        ledger.add_state(cid, "up", upd.sizes, fed.groups.__getitem__)  # the whole upload left the client
        ledger.add_payload(cid, "up", upd.payload)
        ledger.add_state(cid, "down", bcast)
        ledger.add_payload(cid, "down", payloads.get(cid, {}))

    def task(cid: int, attempt: int, epoch: int = 0) -> ClientTask:
        fold = Fold(fed.id, r, epoch, reducer.weights[cid], reducer.window) if folds else None
        return fed.task(r, cid, payloads.get(cid, {}), attempt, fold)

    t = time.perf_counter()
    shared = c.update is None  # every client reads the round's one global model: small ones may share a task
    # sync only (the config refuses the rest): every client reads the round's one global model
    batched = Batched(fed, pool, pub, c, task, payloads) if fed.cfg.engine.client_batching else None
    if batched is not None:
        done.failed, done.retries = batched.map(on_update)
    else:
        done.failed = pool.map(
            c.train, lambda w, cid, attempt: w.train_in.remote(fed.id, task(cid, attempt), pub.ref(c, cid)),
            on_update, cost={k: int(fed.sizes[k]) for k in c.train},
            largest_first=fed.cfg.engine.schedule == "largest_first",
            submit_many=None if not (shared and fed.cfg.engine.group_small_clients) else lambda w, jobs: w
            .train_many_in.remote(fed.id, [task(cid, attempt) for cid, attempt in jobs], pub.current))
        done.retries = dict(pool.last_retries)  # before any later map
    if not done.updates:
        raise EngineError(f"{c.noun} {r}: every {c.who} client failed ({done.failed[0][1]})")
    if folds:
        gather(fed, pool, reducer, batched.rerun(done.retries) if batched is not None else
               lambda w, cid, attempt, epoch: w.train_in.remote(
                   fed.id, task(cid, done.retries.get(cid, 0) + attempt, epoch), pub.current))
    done.seconds = time.perf_counter() - t
    return done


class Batched:
    """A round's training with ``engine.client_batching``: each group of
    ``client_groups`` is one job of the pool, one Ray task on one worker
    (``Worker.train_group_in``); a fault of one of its clients is the
    group's (charged, retried and dropped together)."""

    def __init__(self, fed: Federation, pool: WorkerPool, pub: Published, c: Cohort,
                 task: Callable[..., ClientTask], payloads: dict):
        self.fed, self.pool, self.pub, self.c, self.task, self.payloads = fed, pool, pub, c, task, payloads
        self.sizes = {k: int(fed.sizes[k]) for k in c.train}
        self.groups = client_groups(c.train, self.sizes, fed.cfg.engine.client_group_size)

    def map(self, on_update: Callable[[int, ClientUpdate | None], None]) -> tuple[list, dict[int, int]]:
        """Train the groups: (the dropped clients with their reason, each client's charged retries)."""
        def on_group(g: tuple[int, ...], res: list | None) -> None:
            for cid, upd in zip(g, res if res is not None else [None] * len(g)):
                on_update(cid, upd)

        fed = self.fed
        dropped = self.pool.map(
            self.groups, lambda w, g, attempt: w.train_group_in.remote(
                fed.id, [self.task(cid, attempt) for cid in g], self.pub.current),
            on_group, cost={g: sum(self.sizes[k] for k in g) for g in self.groups},
            largest_first=fed.cfg.engine.schedule == "largest_first")
        retries = {cid: n for g, n in self.pool.last_retries.items() for cid in g}
        return [(cid, why) for g, why in dropped for cid in g], retries

    def rerun(self, retries: dict[int, int]) -> Callable[[Any, int, int, int], Any]:
        """``gather``'s re-run of a client whose partial sum was lost: its whole
        group again (the same bits), only that client folding."""
        def submit(w: Any, cid: int, attempt: int, epoch: int) -> Any:
            g = next(g for g in self.groups if cid in g)
            a = retries.get(cid, 0) + attempt
            tasks = [self.task(cid, a, epoch) if k == cid else
                     self.fed.task(self.c.round, k, self.payloads.get(k, {}), a) for k in g]
            return w.train_group_in.remote(self.fed.id, tasks, self.pub.current)

        return submit


def gather(fed: Federation, pool: WorkerPool, reducer: Reducer, rerun: Callable[[Any, int, int, int], Any]) -> None:
    """Merge each worker's partial sum of the round.  The clients of a
    partial that was lost (its worker's process died after folding them)
    or is not whole (a client in two partials, or one the round dropped)
    train again, at the attempt that succeeded (training is seeded: the
    same upload), folding into the next epoch's partials: uncharged and
    unrecorded, counted only as re-runs.  ``rerun(worker, client,
    attempt, epoch)`` submits one."""
    r = fed.round + 1
    for epoch in range(fed.cfg.engine.max_task_retries + 2):
        if epoch:
            lost = reducer.missing
            pool.reruns += len(lost)
            pool.map(lost, lambda w, cid, attempt: rerun(w, cid, attempt, epoch), _rerun_done)
        parts = [p for p in pool.ask_each(lambda w: w.take_partial.remote(fed.id, r, epoch)) if p]
        waiting = set(reducer.missing)
        seen = Counter(k for p in parts for k in p.clients)
        for p in parts:
            if all(k in waiting and seen[k] == 1 for k in p.clients):
                reducer.add_partial(p)
        if reducer.complete:
            return
    raise EngineError(f"round {r}: the partial sums of clients {reducer.missing} were lost "
                      f"{fed.cfg.engine.max_task_retries + 2} times (workers dying); see the workers' logs")


def evaluates(fed: Federation, r: int) -> bool:
    every = fed.cfg.evaluation.every
    return bool(every and r % every == 0) or r == fed.cfg.training.rounds


def evaluate(fed: Federation, pool: WorkerPool, pub: Published, work: RoundWork) -> list[MetricRow]:
    run_phases(Slot.AT_EVALUATION, work)
    return evaluate_global(pool, fed.id, pub.current, fed.split, work.own, fed.cfg.evaluation.batch_size, work.round)
