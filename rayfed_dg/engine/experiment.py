"""An experiment: every seed x every row (``compare``) x every target, on one
set of actors.

``plan_experiment`` resolves and checks everything before anything is
written (the dataset's targets, each row's config and splits, each seed,
the worker pools); ``run_planned`` runs it into a run directory (the run
service, ``service.py``, calls both).  Actors start once (``host.HostPool``): the first federation pays
for the processes, every later one only for building its model.

``run_trial`` is a Tune trial's experiment: one federation for one target,
on actors of its own placed in the trial's placement group.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayfed_dg.config import ExperimentConfig
from rayfed_dg.data import DomainDataset, FederatedSplit

from .host import EngineHost, HostPool
from .plan import clients_per_round, load_data, preflight, resolve_variants, split_for
from .records import RoundResult
from .resources import ensure_workers
from .run import TargetResult, run_experiment, run_federation
from .rundir import RunDir


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


def run_planned(exp: Experiment, run_dir: RunDir, progress: bool = True) -> dict[int | None, dict[str, dict]]:
    """Run every row into its folder of ``run_dir`` (``Experiment.row_dir``);
    returns {seed: {label: summary}}."""
    by_seed: dict[int | None, dict[str, dict]] = {}
    hosts = HostPool.planned([ray.put(exp.ds.images), ray.put(exp.ds.labels)], [(r.cfg, r.splits) for r in exp.rows])
    try:
        for row in exp.rows:
            sub = exp.row_dir(run_dir, row)
            sub.path.mkdir(parents=True, exist_ok=True)
            what = "" if row.seed is None else f"seed {row.seed}, "
            print(f"== {row.label}: {what}{len(exp.targets)} target(s), {row.cfg.training.rounds} rounds -> "
                  f"{sub.path}", file=sys.stderr)
            by_seed.setdefault(row.seed, {})[row.label] = run_experiment(
                row.cfg, exp.ds, exp.targets, sub.path, progress=progress, splits=row.splits, label=row.label,
                hosts=hosts)
    finally:
        hosts.close()
    return by_seed


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
