"""An experiment: every seed x every row (``compare``) x every target, its
federations side by side on the cluster.

``plan_experiment`` resolves and checks everything before anything is
written (the dataset's targets, each row's config and splits, each seed,
the worker pools); ``run_planned`` runs it into a run directory (the run
service, ``service.py``, calls both).  The dataset goes into the object
store once and every federation runs on one set of actors
(``host.ExperimentActors``): as many federations at once as the cluster's
worker slots fit (``engine.concurrent_federations``), longest expected
first, each given workers when it opens and more between its rounds when
nothing waits to start (the rule is ``schedule.py``'s, pure).  A
federation's numbers do not depend on what runs beside it: its workers are
its own while it runs, and every random choice is seeded from the seed,
round and client.

The driver is one thread: a ``ray.wait`` over each running federation's
call in flight (its opening, then one ``run_round`` at a time); a finished
round is handled as ``run_federation`` handles it (``run.FederationRun``),
then the next round is sent, or the federation ends and frees its server
and workers for the next.  A row's ``summary.json`` is written when its
last target ends.

``run_trial`` is a Tune trial's experiment: one federation for one target,
on actors of its own placed in the trial's placement group.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayfed_dg.config import EngineConfig, ExperimentConfig
from rayfed_dg.data import DomainDataset, FederatedSplit
from rayfed_dg.engine.store.records import RoundResult
from rayfed_dg.engine.store.rundir import RunDir
from rayfed_dg.engine.workers.resources import ensure_workers, init_ray, plan_workers
from rayfed_dg.errors import EngineError, ResourceError

from . import schedule
from .host import EngineHost, ExperimentActors, actor_key
from .plan import clients_per_round, load_data, make_splits, preflight, resolve_variants, split_for
from .run import FederationRun, TargetResult, run_federation


@dataclass
class Row:
    """One table row of one seed: a method variant with its config and splits."""

    seed: int | None  # None: a run without --seeds
    label: str
    cfg: ExperimentConfig
    splits: list[FederatedSplit]


@dataclass
class Experiment:
    ds: DomainDataset
    targets: list[str]
    configs: dict[int | None, ExperimentConfig]  # per seed, the whole config (``compare`` list and all)
    rows: list[Row]

    @property
    def labels(self) -> list[str]:
        return list(dict.fromkeys(r.label for r in self.rows))

    def row_dir(self, run_dir: RunDir, row: Row) -> RunDir:
        """Where ``run_planned`` writes ``row``: ``[seed<S>/][<label>/]``."""
        return run_dir.seed(row.seed).row(row.label, len(self.labels) > 1)


def plan_experiment(cfgs: list[tuple[int | None, ExperimentConfig]], ds: DomainDataset,
                    targets: list[str]) -> Experiment:
    """Every row of every seed, checked (model builds, stages, the pool
    fits) before anything is written.  The splits depend on
    ``data.split_seed`` only, so every seed's rows share the first seed's."""
    first = resolve_variants(cfgs[0][1], ds, targets)
    for _, vcfg, splits in first:
        preflight(vcfg, splits, ds.num_classes)
    rows = []
    for s, scfg in cfgs:
        variants = first if s == cfgs[0][0] else resolve_variants(scfg, ds, targets)
        rows += [Row(s, label, vcfg, splits) for label, vcfg, splits in variants]
    return Experiment(ds, targets, dict(cfgs), rows)


Key = Hashable  # a federation: (seed, row label, target)


@dataclass
class _Fed:
    """One federation of the experiment, from waiting to finished."""

    row: Row
    split: FederatedSplit
    dir: RunDir
    run: FederationRun | None = None  # while it runs
    server: Any = None
    id: int = 0  # its id on the experiment's actors
    workers: list = field(default_factory=list)  # in the order its pool holds them
    opening: list | None = None  # the refs of its opening calls, until they are back
    ref: Any = None  # the call in flight: its last opening call, then a round
    added: list = field(default_factory=list)  # refs of add_workers calls
    slot: int = 0  # its progress bar's line
    started_s: float = 0.0


def row_summary(row: Row, targets: dict[str, dict]) -> dict:
    """A row's ``summary.json``: each target's summary, in target order, and the row's average."""
    accs = [v["target_acc"] for v in targets.values() if v["target_acc"] is not None]
    cfg = row.cfg
    return {"targets": targets, "average_target_acc": float(np.mean(accs)) if accs else None,
            "method": cfg.method.name, "label": row.label or cfg.method.label or cfg.method.name,
            "seed": cfg.training.seed,
            "stages": {name: sc.raw_params() for name, sc in cfg.stages.items() if sc is not None}}


def worker_slots(engine: EngineConfig, most_clients: int) -> int:
    """Worker actors of ``engine``'s resources the cluster fits, for all the
    federations together (``resources.plan_workers`` without the cap of one
    federation's clients).  When none fits yet and an autoscaler runs, it is
    asked for one federation's pool only (``ensure_workers``): the slots are
    that pool."""
    try:
        return plan_workers(engine.model_copy(update={"num_workers": None}), 1 << 30, ray.cluster_resources())
    except ResourceError:
        return ensure_workers(engine, most_clients)


class _Driver:
    """The ``ray.wait`` loop of ``run_planned`` (the module docstring)."""

    def __init__(self, exp: Experiment, run_dir: RunDir, progress: bool):
        self.exp, self.progress = exp, progress
        self.t0 = time.monotonic()
        self.feds: dict[Key, _Fed] = {}
        for row in exp.rows:
            for split in row.splits:
                self.feds[(row.seed, row.label, split.target)] = _Fed(row, split, exp.row_dir(run_dir, row))
        self.results: dict[Key, dict] = {}  # finished federations' target summaries
        self.running: dict[Key, _Fed] = {}
        self.most_at_once = 0
        self.before = 0  # federations a resumed run had finished
        self.bar_leave = False
        self.actors = ExperimentActors([ray.put(exp.ds.images), ray.put(exp.ds.labels)])

    def say(self, line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)  # above the progress bars

    # ------------------------------------------------------------- the loop
    def run(self) -> dict[int | None, dict[str, dict]]:
        try:
            todo = [k for k in self.feds if not self._done_before(k)]
            groups: dict[tuple, list[Key]] = {}
            for k in todo:
                e = self.feds[k].row.cfg.engine
                groups.setdefault((actor_key(e), e.num_workers, e.concurrent_federations), []).append(k)
            for keys in groups.values():
                self._group(keys)
        finally:
            for f in self.running.values():
                if f.run is not None:
                    f.run.close()
            self.actors.close()
        n = len(self.feds)
        before = f" ({self.before} finished before)" if self.before else ""
        self.say(f"== {n} federation{'s' * (n != 1)}{before}, at most {self.most_at_once} at once")
        by_seed: dict[int | None, dict[str, dict]] = {}
        for row in self.exp.rows:
            by_seed.setdefault(row.seed, {})[row.label] = row_summary(
                row, {s.target: self.results[(row.seed, row.label, s.target)] for s in row.splits})
        return by_seed

    def _done_before(self, key: Key) -> bool:
        """Whether a resumed run finished this federation (its checkpoint is at the last round)."""
        f = self.feds[key]
        if max(f.dir.saved_rounds(f.split.target), default=0) < f.row.cfg.training.rounds:
            return False
        run = FederationRun(f.row.cfg, f.split, f.dir)
        if not run.finished:  # its newest checkpoint was unreadable: it runs from an older one
            return False
        old = (f.dir.summary() or {}).get("targets", {}).get(f.split.target, {})
        self._finished(key, run.res.summary() | {"placement": old.get("placement")})  # where it ran then
        self.before += 1
        return True

    def _group(self, keys: list[Key]) -> None:
        """Run federations whose workers share resources (``host.actor_key``)."""
        cfg = self.feds[keys[0]].row.cfg
        e = cfg.engine
        jobs = {k: schedule.fed_job(k, self.feds[k].row.cfg, self.feds[k].split) for k in keys}
        slots = worker_slots(e, max(clients_per_round(self.feds[k].row.cfg, self.feds[k].split) for k in keys))
        most = None if e.concurrent_federations == "auto" else e.concurrent_federations
        plan = schedule.plan(list(jobs.values()), slots, most, e.num_workers)
        self.actors.group(e, slots)
        waiting = list(plan.order)
        self.bar_leave = most == 1  # one at a time: each bar stays, as one bar per target always did
        while waiting or self.running:
            while waiting and (most is None or len(self.running) < most) and \
                    plan.width[waiting[0]] <= self.actors.free_slots:
                key = waiting.pop(0)
                self._start(key, plan.width[key])
            if not self.running:
                raise EngineError(f"federation {waiting[0]} needs {plan.width[waiting[0]]} workers; "
                                  f"{slots} fit the cluster")
            if not waiting and self.actors.free_slots and e.num_workers is None:  # num_workers: a fixed width
                self._grow(jobs)
            by_ref = {f.ref: k for k, f in self.running.items()}
            ready, _ = ray.wait(list(by_ref), num_returns=1)
            self._step(by_ref[ready[0]])

    def _grow(self, jobs: dict[Key, schedule.FedJob]) -> None:
        """Free workers to running federations, as ``schedule.grow`` says; they join between rounds."""
        left = {k: (jobs[k], len(f.workers), self._to_start(f)) for k, f in self.running.items()}
        for k, n in schedule.grow(left, self.actors.free_slots).items():
            f = self.running[k]
            more = self.actors.take(n)
            f.added.append(self.actors.add(f.server, more))
            f.workers += more

    # ------------------------------------------------------------ a federation
    @staticmethod
    def _to_start(f: _Fed) -> int:
        """Rounds a worker added now would serve: those not sent yet."""
        assert f.run is not None
        return f.row.cfg.training.rounds - f.run.res.rounds_done - (f.opening is None)

    def _start(self, key: Key, width: int) -> None:
        f = self.feds[key]
        row = f.row
        if not f.dir.has_config():  # the row's first federation
            f.dir.path.mkdir(parents=True, exist_ok=True)
            f.dir.write_config(row.cfg)
        f.slot = min(set(range(len(self.running) + 1)) - {g.slot for g in self.running.values()})
        seed = "" if row.seed is None else f"seed {row.seed} "
        bar = None if not self.progress else {"desc": f"{seed}{row.label} {f.split.target}", "position": f.slot,
                                              "leave": self.bar_leave}
        f.run = FederationRun(row.cfg, f.split, f.dir, bar)
        f.workers = self.actors.take(width)
        f.server, f.id, f.opening = self.actors.open(row.cfg, f.split, self.exp.ds.num_classes, f.workers, f.run.state)
        f.ref, f.started_s = f.opening[-1], time.monotonic() - self.t0
        self.running[key] = f
        self.most_at_once = max(self.most_at_once, len(self.running))
        self.say(f"== {row.label}: {seed.strip() + ', ' if seed else ''}target {f.split.target}, "
                 f"{row.cfg.training.rounds} rounds, {width} worker{'s' * (width != 1)} -> {f.dir.path}")

    def _step(self, key: Key) -> None:
        """The call in flight of ``key`` is back: the next round, or the end."""
        f = self.running[key]
        assert f.run is not None
        if f.opening is not None:
            setup = ray.get(f.opening)[1]  # a failed start raises first
            f.opening = None
            f.run.opened(f.server, setup)
        else:
            f.run.round_done(ray.get(f.ref))
        if not f.run.finished:
            f.ref = f.server.run_round.remote()
            return
        f.run.close()
        ray.get(f.added)
        placement = {"workers": len(f.workers), "nodes": self.actors.nodes(f.workers), "started_s": f.started_s,
                     "ended_s": time.monotonic() - self.t0}
        self.actors.release(f.server, f.id, f.workers)
        del self.running[key]
        self._finished(key, f.run.res.summary() | {"placement": placement})
        f.run = None

    def _finished(self, key: Key, summary: dict) -> None:
        """Record a federation's summary; a row whose last target ended writes its ``summary.json``."""
        self.results[key] = summary
        f = self.feds[key]
        row = f.row
        keys = {s.target: (row.seed, row.label, s.target) for s in row.splits}
        if all(k in self.results for k in keys.values()):
            f.dir.write_summary(row_summary(row, {t: self.results[k] for t, k in keys.items()}))


def run_planned(exp: Experiment, run_dir: RunDir, progress: bool = True) -> dict[int | None, dict[str, dict]]:
    """Run every federation of ``exp`` into its row's folder of ``run_dir``
    (``Experiment.row_dir``), side by side (the module docstring); returns
    {seed: {label: summary}}."""
    return _Driver(exp, run_dir, progress).run()


def run_experiment(cfg: ExperimentConfig, ds: DomainDataset, targets: list[str], run_dir: Path,
                   progress: bool = True, splits: list[FederatedSplit] | None = None, label: str | None = None) -> dict:
    """One row: leave-one-domain-out over ``targets``; writes (or resumes)
    ``run_dir``.  ``label``: the method's row name in tables (a compare
    entry's label)."""
    splits = splits or make_splits(cfg, ds, targets)
    init_ray(cfg)
    name = label or cfg.method.label or cfg.method.name
    exp = Experiment(ds, targets, {None: cfg}, [Row(None, name, cfg, splits)])
    return run_planned(exp, RunDir(run_dir), progress)[None][name]


def run_trial(cfg: ExperimentConfig, target: str, run_dir: Path, placement_group=None,
              on_round: Callable[[RoundResult, TargetResult], None] | None = None,
              tensorboard: Path | None = None,
              dataset: tuple[DomainDataset, list[ray.ObjectRef]] | None = None) -> TargetResult:
    """One federation for ``target`` on actors of its own.  In a Tune trial,
    ``placement_group`` is the trial's: it reserved an empty bundle for the
    server and one per worker, so the pool has that many workers and every
    actor is placed in it (concurrent trials never take each other's).
    ``dataset``: a sweep's one upload, the dataset (its images and labels
    read zero-copy from the object store) and the refs of its images and
    labels, which the workers read; None: the trial loads the config's
    dataset and puts a copy of its own."""
    if dataset is None:
        ds = load_data(cfg)
        data_refs = [ray.put(ds.images), ray.put(ds.labels)]
    else:
        ds, data_refs = dataset
    split = split_for(cfg, ds, target)
    if placement_group is not None:
        opts = {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group)}
        workers = len(placement_group.bundle_specs) - 1
    else:
        opts, workers = None, ensure_workers(cfg.engine, clients_per_round(cfg, split))
    host = EngineHost(cfg.engine, data_refs, workers, opts)
    try:
        return run_federation(cfg, split, None, None, ds.num_classes, run_dir, progress=False, on_round=on_round,
                              tensorboard=tensorboard, host=host)
    finally:
        host.close()
