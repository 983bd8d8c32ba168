"""Driver side: start Ray, run leave-one-domain-out federations, write records.

The driver holds no model and does no training: it puts the decoded dataset
in the object store once per run, starts one server actor per target domain
(which starts its worker pool), calls ``run_round`` and writes what comes
back.  Records of a run directory:

``config.yaml``      the resolved config
``metrics.parquet``  target, round, split (source_val | target_test), domain,
                     accuracy, loss, samples
``ledger.parquet``   target, round, client, direction (up | down), group,
                     tensors, bytes
``dropped.parquet``  clients that failed every retry (only if any did)
``summary.json``     per target: selected round (by mean source validation
                     accuracy), its source-val and target accuracy
``best_<target>.pt`` global weights of the selected round
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch

from rayfed_dg.config import ExperimentConfig, save_config
from rayfed_dg.data import DomainDataset, FederatedSplit, leave_one_domain_out

from .selection import select_round
from .server import Server, plan_workers


def init_ray(cfg: ExperimentConfig) -> None:
    if ray.is_initialized():
        return
    e = cfg.engine
    kwargs = dict(include_dashboard=e.include_dashboard, configure_logging=True, logging_level="WARNING",
                  log_to_driver=True)
    if e.include_dashboard:
        kwargs["dashboard_host"] = "127.0.0.1"
    if e.ray_address:
        ray.init(address=e.ray_address, **kwargs)
    else:
        ray.init(**kwargs)


def write_table(rows: list[dict], path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)


def save_weights(state: dict[str, np.ndarray], path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({k: torch.from_numpy(np.array(v)) for k, v in state.items()}, tmp)
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

    def summary(self) -> dict:
        return {"selected_round": self.selected_round, "source_val_acc": self.selected_val,
                "target_acc": self.selected_target_acc,
                "final_target_acc": next((m["accuracy"] for m in reversed(self.metrics)
                                          if m["split"] == "target_test"), None),
                "mean_seconds_per_round": float(np.mean(self.seconds_per_round)) if self.seconds_per_round else None}


def run_federation(cfg: ExperimentConfig, split: FederatedSplit, images_ref, labels_ref, num_classes: int,
                   run_dir: Path | None = None, progress: bool = True,
                   worker_options: dict | None = None) -> TargetResult:
    """Run one federation (one target domain) to the end."""
    k = cfg.training.clients_per_round or split.num_clients
    if k > split.num_clients:
        from rayfed_dg.config import ConfigError

        raise ConfigError(f"training.clients_per_round={k} exceeds the {split.num_clients} clients of the partition")
    n_workers = plan_workers(cfg.engine, k, ray.cluster_resources())
    ServerActor = ray.remote(Server)
    server = ServerActor.options(num_cpus=0).remote(cfg.to_dict(), split, images_ref, labels_ref,
                                                   num_classes, n_workers, worker_options)
    res = TargetResult(split.target)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.training.rounds, desc=f"target {split.target}", unit="round", leave=True)
    try:
        for _ in range(cfg.training.rounds):
            out = ray.get(server.run_round.remote())
            r = out["round"]
            res.seconds_per_round.append(out["seconds_total"])
            rows = [dict(m, target=split.target) for m in out["metrics"]]
            res.metrics += rows
            res.ledger += [dict(x, target=split.target) for x in out["ledger"]]
            res.dropped += [dict(x, target=split.target) for x in out["dropped"]]
            if rows:
                best, best_val = select_round(res.metrics)
                if best == r:
                    res.selected_round, res.selected_val = best, best_val
                    res.selected_target_acc = float(np.mean(
                        [m["accuracy"] for m in rows if m["split"] == "target_test"]))
                    if run_dir is not None and cfg.output.save_best_checkpoint:
                        state = ray.get(server.get_state.remote())["global_state"]
                        save_weights(state, run_dir / f"best_{split.target}.pt")
            if bar is not None:
                src = [m["accuracy"] for m in rows if m["split"] == "source_val"]
                tgt = [m["accuracy"] for m in rows if m["split"] == "target_test"]
                post = {"loss": f"{out['train_loss']:.3f}"}
                if src:
                    post |= {"src_val": f"{np.mean(src):.3f}", "target": f"{np.mean(tgt):.3f}"}
                bar.set_postfix(post)
                bar.update(1)
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
        from rayfed_dg.config import ConfigError

        raise ConfigError(f"run directory {run_dir} already exists and is not empty; choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    return run_dir


def resolve_targets(ds: DomainDataset, target: str | None) -> list[str]:
    if target in (None, "all"):
        return list(ds.domain_names)
    names = [t.strip() for t in target.split(",")]
    for t in names:
        ds.domain_index(t)  # raises DataError with a did-you-mean
    return names


def run_experiment(cfg: ExperimentConfig, ds: DomainDataset, targets: list[str], run_dir: Path,
                   progress: bool = True) -> dict:
    """Leave-one-domain-out over ``targets``; writes the run directory."""
    init_ray(cfg)
    p, d = cfg.partition, cfg.data
    splits = [leave_one_domain_out(ds, t, d.val_fraction, d.split_seed, p.strategy, p.num_clients, p.alpha,
                                   p.min_size) for t in targets]
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
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_table(summary: dict, label: str) -> str:
    targets = list(summary["targets"])
    head = ["method"] + targets + ["avg"]
    vals = [f"{100 * summary['targets'][t]['target_acc']:.2f}" for t in targets]
    avg = summary.get("average_target_acc")
    row = [label] + vals + [f"{100 * avg:.2f}" if avg is not None else "-"]
    sel = ["selected round"] + [str(summary["targets"][t]["selected_round"]) for t in targets] + [""]
    widths = [max(len(str(a)), len(str(b)), len(str(c))) for a, b, c in zip(head, row, sel)]
    fmt = lambda cells: " | ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(head), "-+-".join("-" * w for w in widths), fmt(row), fmt(sel)])
