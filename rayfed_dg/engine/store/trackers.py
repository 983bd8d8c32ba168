"""Weights & Biases and MLflow: the TensorBoard scalars of every round
(``tblog.round_scalars``, same tags and values) to an experiment tracker, as
round callbacks of the driver (``run.RoundCallback``).  Asked for by the
config (``output.wandb: {project: P, mode: offline}``, ``output.mlflow:
{tracking_uri: sqlite:///mlflow.db}``) or ``rayfed-dg run --wandb P --mlflow
URI``; neither package is imported unless asked for (both are optional
extras: ``pip install 'rayfed_dg[wandb]'`` / ``'[mlflow]'``).

One tracker run per federation (target), as TensorBoard has one event
folder per target: named ``<row dir relative to the experiment>/<target>``
(``seed0/fedavg/colour``; just the target for a one-method run) and grouped
(W&B ``group``, MLflow tag ``rayfed_dg.run_dir``) by the experiment's run
directory.  The round is the step.  A resumed federation continues the same
tracker run: W&B by an id derived from its run directory and target
(``resume="allow"``), MLflow by the tag ``rayfed_dg.federation``; the
rounds it repeats are logged again at the same steps.  W&B's local files go
to ``<row dir>/wandb/``.
"""
from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

from rayfed_dg.config import ConfigError, ExperimentConfig

from .records import RoundResult
from .rundir import RunDir
from .tblog import round_scalars


def _wandb():
    try:
        import wandb
    except ImportError:
        raise ConfigError("output.wandb (--wandb) needs the wandb package (pip install wandb, or "
                          "pip install -e '.[wandb]')") from None
    return wandb


def _mlflow_client(uri: str):
    try:
        from mlflow import MlflowClient
    except ImportError:
        raise ConfigError("output.mlflow (--mlflow) needs the mlflow package (pip install mlflow, or "
                          "pip install -e '.[mlflow]')") from None
    for name in ("mlflow", "alembic"):  # a new SQLite store announces its tables at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # the store answers (a file: store MLflow 3 refuses, a bad URI)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"output.mlflow.tracking_uri {uri}: {first}") from e
    return client


def require_trackers(cfg: ExperimentConfig) -> None:
    """In the driver, before anything is written: the packages the config's
    trackers need are installed and an MLflow store answers (one line)."""
    if cfg.output.wandb is not None:
        _wandb()
    if cfg.output.mlflow is not None:
        _mlflow_client(cfg.output.mlflow.tracking_uri)


def _names(run_dir: Path, target: str) -> tuple[str, str]:
    """(this federation's run name, the experiment's name)."""
    run_dir = run_dir.resolve()
    found = RunDir(run_dir).experiment()
    if found is None:
        return target, run_dir.name
    root = found[0].path
    rel = run_dir.relative_to(root)
    return (f"{rel.as_posix()}/{target}" if rel.parts else target), root.name


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


class WandbLogger:
    def __init__(self, cfg: ExperimentConfig, run_dir: Path, target: str):
        wandb = _wandb()
        w = cfg.output.wandb
        assert w is not None
        name, group = _names(run_dir, target)
        fed = f"{run_dir.resolve()}/{target}"
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=w.project, entity=w.entity, mode=w.mode, name=name, group=group,
                              id=hashlib.sha1(fed.encode()).hexdigest()[:16], resume="allow", dir=str(run_dir),
                              config=cfg.to_dict(), settings=wandb.Settings(silent=True))
        self.rounds, self.last = cfg.training.rounds, 0

    def on_round(self, out: RoundResult, res: Any, new_best: bool, server_state) -> None:
        self.run.log(round_scalars(out, res), step=out.round)
        self.last = out.round

    def close(self) -> None:
        self.run.finish(exit_code=0 if self.last >= self.rounds else 1)  # stopped early: a failure or Ctrl-C


class MlflowLogger:
    def __init__(self, cfg: ExperimentConfig, run_dir: Path, target: str):
        m = cfg.output.mlflow
        assert m is not None
        self.client = _mlflow_client(m.tracking_uri)
        self.rounds, self.last = cfg.training.rounds, 0
        name, group = _names(run_dir, target)
        fed = f"{run_dir.resolve()}/{target}"
        exp_name = m.experiment or cfg.output.name
        exp = self.client.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(exp_name)
        same = self.client.search_runs([exp_id], f"tags.`rayfed_dg.federation` = '{fed}'", max_results=1)
        if same:  # a resumed federation: the same MLflow run
            self.run_id = same[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(exp_id, run_name=name, tags={
            "rayfed_dg.federation": fed, "rayfed_dg.run_dir": group, "target": target,
            "method": cfg.method.label or cfg.method.name, "seed": str(cfg.training.seed)})
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in _flat(cfg.to_dict()).items()]
        for i in range(0, len(params), 100):  # the store takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def on_round(self, out: RoundResult, res: Any, new_best: bool, server_state) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, out.round)
                                                    for k, v in round_scalars(out, res).items()])
        self.last = out.round

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if self.last >= self.rounds else "KILLED")


def tracker_callbacks(cfg: ExperimentConfig, run_dir: Path, target: str) -> list:
    """The round callbacks the config asks for (none by default)."""
    cbs: list = []
    if cfg.output.wandb is not None:
        cbs.append(WandbLogger(cfg, run_dir, target))
    if cfg.output.mlflow is not None:
        cbs.append(MlflowLogger(cfg, run_dir, target))
    return cbs
