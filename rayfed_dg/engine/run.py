"""Driver side: start Ray, run leave-one-domain-out federations, write records.

The driver holds no model and does no training: it puts the decoded dataset
in the object store once per run, starts one server actor per target domain
(which starts its worker pool), calls ``run_round`` and writes what comes
back.  Records of a run directory:

``config.yaml``        the resolved config
``metrics.parquet``    target, round, split (source_val | target_test), domain,
                       accuracy, loss, samples, clients_dropped
``ledger.parquet``     target, round, client, direction (up | down), group,
                       tensors, bytes (a dropped client: group ``dropped``)
``summary.json``       per target: selected round (by mean source-validation
                       accuracy), its source-val and target accuracy
``best_<target>.pt``   global weights of the selected round
``final_<target>.pt``  global weights after the last round
``checkpoints/<target>/round_*.pt``  resumable state every
                       ``output.checkpoint_every`` rounds
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch

from rayfed_dg.config import ConfigError, ExperimentConfig, save_config
from rayfed_dg.data import DomainDataset, FederatedSplit, leave_one_domain_out

from .checkpoint import load_latest, save_checkpoint
from .selection import select_round
from .server import Server, plan_workers


def init_ray(cfg: ExperimentConfig) -> None:
    if ray.is_initialized():
        return
    e = cfg.engine
    # the dashboard is off by default; when on, it listens on loopback only
    kwargs = dict(include_dashboard=e.include_dashboard, configure_logging=True, logging_level="WARNING",
                  log_to_driver=True, dashboard_host="127.0.0.1")
    if e.ray_address:
        ray.init(address=e.ray_address, **kwargs)
    else:
        ray.init(**kwargs)


def write_table(rows: list[dict], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def write_text(text: str, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def save_weights(state: dict[str, np.ndarray], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({k: torch.from_numpy(np.array(v)) for k, v in state.items()}, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


@dataclass
class TargetResult:
    target: str
    metrics: list[dict] = field(default_factory=list)
    ledger: list[dict] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)
    seconds_per_round: list[float] = field(default_factory=list)
    selected_round: int | None = None
    selected_val: float | None = None
    selected_target_acc: float | None = None
    rounds_done: int = 0
    tasks_retried: int = 0
    setup_info: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {"selected_round": self.selected_round, "source_val_acc": self.selected_val,
                "target_acc": self.selected_target_acc,
                "final_target_acc": next((m["accuracy"] for m in reversed(self.metrics)
                                          if m["split"] == "target_test"), None),
                "clients_dropped": len(self.dropped), "tasks_retried": self.tasks_retried,
                "setup": self.setup_info,
                "mean_seconds_per_round": float(np.mean(self.seconds_per_round)) if self.seconds_per_round else None}


def check_split(cfg: ExperimentConfig, split: FederatedSplit) -> None:
    k = cfg.training.clients_per_round
    if k is not None and k > split.num_clients:
        raise ConfigError(f"training.clients_per_round={k} exceeds the {split.num_clients} clients "
                          f"of partition {cfg.partition.strategy}; lower it or add clients")


def run_federation(cfg: ExperimentConfig, split: FederatedSplit, images_ref, labels_ref, num_classes: int,
                   run_dir: Path | None = None, progress: bool = True, worker_options: dict | None = None,
                   on_round: Callable[[dict, "TargetResult"], None] | None = None,
                   stop_after: int | None = None, pool_workers: int | None = None) -> TargetResult:
    """Run one federation (one target domain) to the end, resuming from the
    newest valid checkpoint in ``run_dir`` if there is one.  ``stop_after``
    ends early after that round (tests of resume use it).  ``pool_workers``
    fixes the pool size when the resources are already reserved (a Tune
    trial's placement group); otherwise it is planned against the cluster."""
    check_split(cfg, split)
    k = cfg.training.clients_per_round or split.num_clients
    n_workers = pool_workers or plan_workers(cfg.engine, k, ray.cluster_resources())
    ckpt_dir = run_dir / "checkpoints" / split.target if run_dir is not None else None
    res = TargetResult(split.target)
    state = load_latest(ckpt_dir) if ckpt_dir is not None and ckpt_dir.exists() else None
    if state is not None:
        res = TargetResult(**state["result"])
        if res.rounds_done >= cfg.training.rounds:
            return res
    ServerActor = ray.remote(Server)
    server_opts = {k_: v for k_, v in (worker_options or {}).items() if k_ == "scheduling_strategy"}
    server = ServerActor.options(num_cpus=0, **server_opts).remote(cfg.to_dict(), split, [images_ref, labels_ref],
                                                   num_classes, n_workers, worker_options)
    try:
        setup = ray.get(server.setup.remote())
    except BaseException:
        ray.kill(server)
        raise
    if state is None:
        res.ledger += [dict(x, target=split.target) for x in setup["ledger"]]
    res.setup_info = setup["info"]
    if state is not None:
        ray.get(server.set_state.remote(state["server"]))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.training.rounds, initial=res.rounds_done, desc=f"target {split.target}",
                   unit="round", leave=True)
    every = cfg.output.checkpoint_every
    try:
        for r in range(res.rounds_done + 1, cfg.training.rounds + 1):
            out = ray.get(server.run_round.remote())
            assert out["round"] == r
            res.rounds_done = r
            res.tasks_retried = out["tasks_retried"]
            res.seconds_per_round.append(out["seconds_total"])
            n_drop = len(out["dropped"])
            rows = [dict(m, target=split.target, clients_dropped=n_drop) for m in out["metrics"]]
            res.metrics += rows
            res.ledger += [dict(x, target=split.target) for x in out["ledger"]]
            res.ledger += [{"round": r, "client": d["client"], "direction": "up", "group": "dropped",
                            "tensors": 0, "bytes": 0, "target": split.target} for d in out["dropped"]]
            res.dropped += [dict(x, target=split.target) for x in out["dropped"]]
            new_best = False
            if rows:
                best, best_val = select_round(res.metrics)
                if best == r:
                    new_best = True
                    res.selected_round, res.selected_val = best, best_val
                    res.selected_target_acc = float(np.mean(
                        [m["accuracy"] for m in rows if m["split"] == "target_test"]))
            need_state = run_dir is not None and (
                (new_best and cfg.output.save_best_checkpoint) or r == cfg.training.rounds
                or (every and r % every == 0))
            if need_state:
                sstate = ray.get(server.get_state.remote())
                if new_best and cfg.output.save_best_checkpoint:
                    save_weights(sstate["global_state"], run_dir / f"best_{split.target}.pt")
                if r == cfg.training.rounds:
                    save_weights(sstate["global_state"], run_dir / f"final_{split.target}.pt")
                if every and (r % every == 0 or r == cfg.training.rounds):
                    save_checkpoint(ckpt_dir, r, {"server": sstate, "result": asdict(res)})
            if on_round is not None:
                on_round(out, res)
            if bar is not None:
                src = [m["accuracy"] for m in rows if m["split"] == "source_val"]
                tgt = [m["accuracy"] for m in rows if m["split"] == "target_test"]
                post = {"loss": f"{out['train_loss']:.3f}"}
                if src:
                    post |= {"src_val": f"{np.mean(src):.3f}", "target": f"{np.mean(tgt):.3f}"}
                if n_drop:
                    post["dropped"] = n_drop
                bar.set_postfix(post)
                bar.update(1)
            if stop_after is not None and r >= stop_after:
                break
    finally:
        if bar is not None:
            bar.close()
        try:
            ray.get(server.shutdown.remote())
        finally:
            ray.kill(server)
    return res


def make_run_dir(cfg: ExperimentConfig, run_dir: str | Path | None) -> Path:
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(cfg.output.root) / f"{cfg.output.name}-{stamp}"
    run_dir = Path(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run directory {run_dir} already exists and is not empty; "
                          "choose another --run-dir, or continue it with --resume")
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o755)
    return run_dir


def check_resume_dir(cfg: ExperimentConfig, run_dir: Path) -> None:
    """A run directory can be resumed only with the config that made it."""
    from rayfed_dg.config import load_config

    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; not a rayfed-dg run directory")
    old = load_config(saved).to_dict()
    new = cfg.to_dict()
    diff = sorted(f"{s}.{k}" for s in new if s != "output" for k in (new[s] or {}) if isinstance(new[s], dict)
                  and (old.get(s) or {}).get(k) != new[s][k])
    if new.get("compare") != old.get("compare"):
        diff.append("compare")
    if diff:
        raise ConfigError(f"--resume {run_dir}: that run used a different config ({', '.join(diff[:4])} differ); "
                          "resume with the same config and --set values")


def resolve_targets(ds: DomainDataset, target: str | None) -> list[str]:
    if target in (None, "all"):
        return list(ds.domain_names)
    names = [t.strip() for t in target.split(",")]
    for t in names:
        ds.domain_index(t)  # raises DataError with a did-you-mean
    return names


def split_for(cfg: ExperimentConfig, ds: DomainDataset, target: str) -> FederatedSplit:
    p, d = cfg.partition, cfg.data
    return leave_one_domain_out(ds, target, d.val_fraction, d.split_seed, p.strategy, p.num_clients, p.alpha,
                                p.min_size, p.clients, p.heterogeneity)


def make_splits(cfg: ExperimentConfig, ds: DomainDataset, targets: list[str]) -> list[FederatedSplit]:
    """All partitions of a run, checked before anything is written."""
    splits = [split_for(cfg, ds, t) for t in targets]
    for s in splits:
        check_split(cfg, s)
    return splits


def preflight(cfg: ExperimentConfig, splits: list[FederatedSplit], num_classes: int) -> None:
    """Fail before anything is written: the model builds (weights found) and
    the worker pool fits the Ray cluster."""
    from rayfed_dg.methods import build_method

    build_method(cfg).build_model(num_classes)
    if cfg.ccst.enabled:
        from rayfed_dg.models.styletransfer import make_backend

        make_backend(cfg.ccst)  # weights files / optional extra present
    init_ray(cfg)
    for s in splits:
        plan_workers(cfg.engine, cfg.training.clients_per_round or s.num_clients, ray.cluster_resources())


def run_experiment(cfg: ExperimentConfig, ds: DomainDataset, targets: list[str], run_dir: Path,
                   progress: bool = True, splits: list[FederatedSplit] | None = None) -> dict:
    """Leave-one-domain-out over ``targets``; writes (or resumes) ``run_dir``."""
    splits = splits or make_splits(cfg, ds, targets)
    init_ray(cfg)
    if not (run_dir / "config.yaml").exists():
        save_config(cfg, run_dir / "config.yaml")
    images_ref, labels_ref = ray.put(ds.images), ray.put(ds.labels)
    metrics, ledger, dropped, summary = [], [], [], {"targets": {}}
    for split in splits:
        res = run_federation(cfg, split, images_ref, labels_ref, ds.num_classes, run_dir, progress)
        metrics += res.metrics
        ledger += res.ledger
        dropped += res.dropped
        summary["targets"][split.target] = res.summary()
        write_table(metrics, run_dir / "metrics.parquet")
        write_table(ledger, run_dir / "ledger.parquet")
        if dropped:
            write_table(dropped, run_dir / "dropped.parquet")
    accs = [v["target_acc"] for v in summary["targets"].values() if v["target_acc"] is not None]
    summary["average_target_acc"] = float(np.mean(accs)) if accs else None
    summary["method"] = cfg.method.name
    write_text(json.dumps(summary, indent=2), run_dir / "summary.json")
    return summary


def format_table(summaries: dict[str, dict]) -> str:
    """One aligned table: per variant label, a row of target accuracies (%)
    and a row of the selected rounds."""
    targets = list(next(iter(summaries.values()))["targets"])
    rows = [["method"] + targets + ["avg"]]
    for label, summary in summaries.items():
        avg = summary.get("average_target_acc")
        rows.append([label] + [f"{100 * summary['targets'][t]['target_acc']:.2f}" for t in targets]
                    + [f"{100 * avg:.2f}" if avg is not None else "-"])
        rows.append(["selected round"] + [str(summary["targets"][t]["selected_round"]) for t in targets] + [""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda cells: " | ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(rows[0]), "-+-".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]])
