"""An experiment: every seed x every row (``compare``) x every target, on one
set of actors.

``plan_experiment`` resolves and checks everything before anything is
written (the dataset's targets, each row's config and splits, each seed,
the worker pools); ``run_planned`` runs it into a run directory.  The CLI,
and any script that wants the CLI's runs (benches, notebooks), go through
these two.  Actors start once (``host.HostPool``): the first federation pays
for the processes, every later one only for building its model.

``run_trial`` is a Tune trial's experiment: one federation for one target,
on actors of its own placed in the trial's placement group.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayfed_dg.config import ExperimentConfig, save_config
from rayfed_dg.data import DomainDataset, FederatedSplit
from rayfed_dg.utils import write_text

from .host import EngineHost, HostPool
from .plan import clients_per_round, load_data, preflight, resolve_variants, split_for
from .records import RoundResult
from .resources import ensure_workers
from .run import TargetResult, run_experiment, run_federation


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

    def seed_dir(self, run_dir: Path, row: Row) -> Path:
        return run_dir if row.seed is None else run_dir / f"seed{row.seed}"

    def row_dir(self, run_dir: Path, row: Row) -> Path:
        """Where ``run_planned`` writes ``row``: ``[seed<S>/][<label>/]``."""
        return self.seed_dir(run_dir, row) / row.label if len(self.labels) > 1 else self.seed_dir(run_dir, row)


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


def run_planned(exp: Experiment, run_dir: Path, progress: bool = True) -> dict[int | None, dict[str, dict]]:
    """Run every row into ``run_dir`` (``seed<S>/`` per seed, ``<label>/`` per
    row when there are several); returns {seed: {label: summary}}."""
    many = len(exp.labels) > 1
    by_seed: dict[int | None, dict[str, dict]] = {}
    hosts = HostPool.planned([ray.put(exp.ds.images), ray.put(exp.ds.labels)], [(r.cfg, r.splits) for r in exp.rows])
    try:
        for row in exp.rows:
            sdir = exp.seed_dir(run_dir, row)
            sdir.mkdir(parents=True, exist_ok=True)
            if not (sdir / "config.yaml").exists():
                save_config(exp.configs[row.seed], sdir / "config.yaml")
            sub = exp.row_dir(run_dir, row)
            sub.mkdir(parents=True, exist_ok=True)
            what = "" if row.seed is None else f"seed {row.seed}, "
            print(f"== {row.label}: {what}{len(exp.targets)} target(s), {row.cfg.training.rounds} rounds -> {sub}",
                  file=sys.stderr)
            summaries = by_seed.setdefault(row.seed, {})
            summaries[row.label] = run_experiment(row.cfg, exp.ds, exp.targets, sub, progress=progress,
                                                  splits=row.splits, label=row.label, hosts=hosts)
            if many and len(summaries) == len(exp.labels):
                write_text(json.dumps(summaries, indent=2), sdir / "summary.json")
    finally:
        hosts.close()
    return by_seed


def run_trial(cfg: ExperimentConfig, target: str, run_dir: Path, placement_group=None,
              on_round: Callable[[RoundResult, TargetResult], None] | None = None,
              tensorboard: Path | None = None) -> TargetResult:
    """One federation for ``target`` on actors of its own.  In a Tune trial,
    ``placement_group`` is the trial's: it reserved an empty bundle for the
    server and one per worker, so the pool has that many workers and every
    actor is placed in it (concurrent trials never take each other's)."""
    ds = load_data(cfg)
    split = split_for(cfg, ds, target)
    if placement_group is not None:
        opts = {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group)}
        workers = len(placement_group.bundle_specs) - 1
    else:
        opts, workers = None, ensure_workers(cfg.engine, clients_per_round(cfg, split))
    host = EngineHost(cfg.engine, [ray.put(ds.images), ray.put(ds.labels)], workers, opts)
    try:
        return run_federation(cfg, split, None, None, ds.num_classes, run_dir, progress=False, on_round=on_round,
                              tensorboard=tensorboard, host=host)
    finally:
        host.close()
