"""Ray Tune sweeps whose trials are whole federated runs.

A search space is a YAML file in ``tuning/`` (resolved by name)::

    config: configs/digits/gperxan_lambda.yaml   # default experiment config
    set: [method.name=gperxan]                    # fixed overrides (optional)
    params:
      method.lam: {grid: [0.0, 0.25, 0.5, 0.75, 1.0]}
      training.lr: {loguniform: [1.0e-4, 1.0e-1]}
      method.alpha: {uniform: [0.0, 5.0]}
      method.k: {choice: [1, 2, 3]}

Each trial is one leave-one-domain-out federation for one target (``--target
all`` adds the target to the grid).  A trial reserves its server and workers
together as one placement group: an empty head bundle (the trainable and the
server only coordinate) and one bundle per worker with the config's
``num_cpus_per_worker`` / ``num_gpus_per_worker``, so concurrent trials
never starve each other; inside a trial the pool is sized from those bundles,
not from the cluster.

Every round reports ``src_val`` (mean source-validation accuracy: the metric
Tune optimises and ASHA stops on) and ``target_acc`` (recorded, never used
to choose).  ``select_value`` applies the training-domain-validation rule:
for each hyper-parameter value, the round of each target's trial is chosen
by source validation; the value with the best mean selected source
validation wins, and its target accuracies are what one reports.

Each trial also writes the run's TensorBoard scalars (``engine/tblog.py``:
the same tags as ``rayfed-dg run``) to ``<trial dir>/tensorboard/<target>``,
so ``tensorboard --logdir runs/tune/NAME`` compares the trials.  W&B and
MLflow are optional, off by default, through the logger callbacks Ray Tune
ships (``logger_callbacks``); neither package is imported unless asked for.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rayfed_dg.config import ConfigError, load_config
from rayfed_dg.utils import did_you_mean, render_table, write_table, write_text

REPO_ROOT = Path(__file__).resolve().parents[1]
SPACE_DIR = REPO_ROOT / "tuning"


def space_names(space_dir: Path = SPACE_DIR) -> list[str]:
    return sorted(p.stem for p in space_dir.glob("*.yaml"))


def load_space(name: str, space_dir: Path = SPACE_DIR) -> dict:
    """A space by name (``tuning/NAME.yaml``) or by the path of a YAML file."""
    path = Path(name) if name.endswith((".yaml", ".yml")) and Path(name).is_file() else space_dir / f"{name}.yaml"
    if not path.is_file():
        known = space_names(space_dir)
        raise ConfigError(f"unknown search space {name!r}{did_you_mean(name, known)}; "
                          f"spaces in {space_dir}: {', '.join(known)}")
    space = yaml.safe_load(path.read_text()) or {}
    if not isinstance(space.get("params"), dict) or not space["params"]:
        raise ConfigError(f"{path}: needs a 'params' mapping of config keys to distributions")
    for key, dist in space["params"].items():
        if not isinstance(dist, dict) or len(dist) != 1 or next(iter(dist)) not in ("grid", "choice", "uniform",
                                                                                     "loguniform"):
            raise ConfigError(f"{path}: params.{key} must be one of {{grid|choice|uniform|loguniform: ...}}")
    space["path"] = str(path)
    return space


def to_tune(dist: dict):
    from ray import tune

    kind, v = next(iter(dist.items()))
    if kind == "grid":
        return tune.grid_search(list(v))
    if kind == "choice":
        return tune.choice(list(v))
    return tune.uniform(*v) if kind == "uniform" else tune.loguniform(*v)


def overrides_of(trial_config: dict) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in sorted(trial_config.items()) if k != "target"]


def trainable(trial_config: dict, *, config_path: str, fixed: list[str]) -> None:
    """One Tune trial: a complete federation for ``trial_config['target']``."""
    import ray
    from ray import tune
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rayfed_dg.engine import load_data, run_federation, split_for

    cfg = load_config(config_path, fixed + overrides_of(trial_config) + ["output.save_best_checkpoint=false"])
    ds = load_data(cfg)
    split = split_for(cfg, ds, trial_config["target"])
    pg = ray.util.get_current_placement_group()
    opts = {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg)} if pg is not None else None
    workers = len(pg.bundle_specs) - 1 if pg is not None else None
    # the engine's own resumable checkpoints (every output.checkpoint_every rounds) travel through Tune's
    # checkpoint API, so a restored trial continues from its last one instead of round 1
    work = Path(tempfile.mkdtemp(prefix="rayfed-dg-trial-"))
    restored = tune.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            shutil.copytree(d, work, dirs_exist_ok=True)
    saved_rounds = [int(p.stem.split("_")[1]) for p in work.glob("checkpoints/*/round_*.pt")]
    last: dict = {"resumed_from_round": max(saved_rounds, default=0)}  # 0: the trial started at round 1
    trial_dir = tune.get_context().get_trial_dir()  # Tune syncs it to the sweep folder
    tb = Path(trial_dir) / "tensorboard" if cfg.output.tensorboard and trial_dir else None

    def report(out, res):
        if out.metrics:
            last["src_val"] = float(np.mean([m["accuracy"] for m in out.metrics if m["split"] == "source_val"]))
            last["target_acc"] = float(np.mean([m["accuracy"] for m in out.metrics if m["split"] == "target_test"]))
        if "src_val" not in last:
            return
        metrics = {"round": out.round, **last, "selected_round": res.selected_round,
                   "selected_src_val": res.selected_val, "selected_target_acc": res.selected_target_acc}
        saved = work / "checkpoints" / split.target / f"round_{out.round:05d}.pt"
        if not saved.is_file():
            tune.report(metrics)
            return
        snap = Path(tempfile.mkdtemp(prefix="rayfed-dg-ckpt-"))
        (snap / "checkpoints" / split.target).mkdir(parents=True)
        for f in (saved, saved.with_suffix(".json")):
            shutil.copy2(f, snap / "checkpoints" / split.target / f.name)
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(snap)))
        shutil.rmtree(snap, ignore_errors=True)

    try:
        run_federation(cfg, split, ray.put(ds.images), ray.put(ds.labels), ds.num_classes, run_dir=work,
                       progress=False, worker_options=opts, on_round=report, pool_workers=workers,
                       tensorboard=tb)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def logger_callbacks(name: str, wandb_project: str | None = None, mlflow_uri: str | None = None) -> list:
    """Ray Tune's W&B and MLflow logger callbacks, each only when asked for
    (a project, a tracking URI); their modules, and ``wandb`` / ``mlflow``,
    are imported here and nowhere else."""
    cbs: list = []
    if wandb_project:
        try:
            import wandb  # noqa: F401
            from ray.air.integrations.wandb import WandbLoggerCallback
        except ImportError:
            raise ConfigError("--wandb needs the wandb package (pip install wandb)") from None
        cbs.append(WandbLoggerCallback(project=wandb_project, group=name))
    if mlflow_uri:
        try:
            import mlflow  # noqa: F401
            from ray.air.integrations.mlflow import MLflowLoggerCallback
        except ImportError:
            raise ConfigError("--mlflow needs the mlflow package (pip install mlflow)") from None
        cbs.append(MLflowLoggerCallback(tracking_uri=mlflow_uri, experiment_name=name))
    return cbs


def placement(cfg, workers: int):
    from ray import tune

    e = cfg.engine
    bundle = {"CPU": e.num_cpus_per_worker}
    if e.num_gpus_per_worker:
        bundle["GPU"] = e.num_gpus_per_worker
    return tune.PlacementGroupFactory([{"CPU": 0}] + [dict(bundle) for _ in range(workers)])


def select_value(records: list[dict], params: list[str]) -> tuple[dict, list[dict]]:
    """Training-domain validation over trial records.

    ``records``: one per trial with the searched ``params``, ``target``,
    ``selected_round``, ``selected_src_val``, ``selected_target_acc``.
    Returns (the chosen value assignment, one table row per value with the
    target accuracy at each target's selected round).  Target accuracy is
    carried into the table but never read to choose."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(tuple(r[p] for p in params), []).append(r)
    rows = []
    for key, rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        row = dict(zip(params, key))
        for r in sorted(rs, key=lambda r: r["target"]):
            row[f"{r['target']}"] = r["selected_target_acc"]
            row[f"{r['target']}_round"] = r["selected_round"]
        row["mean_src_val"] = float(np.mean([r["selected_src_val"] for r in rs]))
        row["_n"] = len(rs)
        rows.append(row)
    full = max(r["_n"] for r in rows)
    # only values with every target finished compete; ties go to the first listed value
    best = max((r for r in rows if r["_n"] == full), key=lambda r: r["mean_src_val"])
    for r in rows:
        r["chosen"] = r is best
        del r["_n"]
    return {p: best[p] for p in params}, rows


def markdown_table(rows: list[dict], targets: list[str], params: list[str]) -> str:
    head = params + [f"{t} (%)" for t in targets] + ["avg (%)", "mean src val (%)", "chosen"]
    body = []
    for r in rows:
        accs = [r.get(t) for t in targets]
        avg = np.mean([a for a in accs if a is not None]) if any(a is not None for a in accs) else None
        cells = [str(r[p]) for p in params] + [f"{100 * a:.2f} (r{r.get(t + '_round')})" if a is not None else "-"
                                               for t, a in zip(targets, accs)]
        cells += [f"{100 * avg:.2f}" if avg is not None else "-", f"{100 * r['mean_src_val']:.2f}",
                  "**yes**" if r["chosen"] else ""]
        body.append(cells)
    return render_table(head, body, "md")


def run_sweep(space_name: str, config: str | None, target: str, samples: int, scheduler: str, resume: bool,
              overrides: list[str], storage: str, space_dir: Path = SPACE_DIR, verbose: int = 1,
              wandb_project: str | None = None, mlflow_uri: str | None = None) -> dict[str, Any]:
    from ray import tune

    from rayfed_dg.data.sources import resolve_root
    from rayfed_dg.engine import clients_per_round, init_ray, load_data, make_splits, resolve_targets
    from rayfed_dg.engine.resources import ensure_workers

    space = load_space(space_name, space_dir)
    callbacks = logger_callbacks(space_name, wandb_project, mlflow_uri)  # a missing package fails before any trial
    config_path = config or space.get("config")
    if not config_path:
        raise ConfigError(f"{space['path']}: no 'config' and no --config given")
    # trials run in their own folders: every path they read must be absolute
    config_path = str(Path(config_path).resolve() if Path(config_path).exists() else REPO_ROOT / config_path)
    fixed = list(space.get("set", [])) + list(overrides)
    cfg = load_config(config_path, fixed)
    root = resolve_root(cfg.data.name, cfg.data.root)
    if root is not None and root != cfg.data.root:  # this machine's data root, for trials on any node
        fixed.append(f"data.root={root}")
        cfg = load_config(config_path, fixed)
    for key in space["params"]:  # every searched key must be a valid config key
        v = space["params"][key]
        probe = next(iter(v.values()))[0]
        load_config(config_path, fixed + [f"{key}={json.dumps(probe)}"])
    ds = load_data(cfg)
    targets = resolve_targets(ds, target)
    splits = make_splits(cfg, ds, targets)
    init_ray(cfg)
    k = max(clients_per_round(cfg, s) for s in splits)
    workers = ensure_workers(cfg.engine, k)

    param_space = {key: to_tune(d) for key, d in space["params"].items()}
    param_space["target"] = tune.grid_search(targets)
    sched = None
    if scheduler == "asha":
        sched = tune.schedulers.ASHAScheduler(time_attr="round", max_t=cfg.training.rounds,
                                              grace_period=max(1, cfg.training.rounds // 4))
    # a local path, or a URI Ray Tune and pyarrow understand (s3://, gs://): a multi-node sweep needs storage
    # every node can reach, since Ray no longer syncs trial folders to the head
    remote = "://" in storage
    storage = storage if remote else str(Path(storage).resolve())
    name = Path(space_name).stem if space_name.endswith((".yaml", ".yml")) else space_name
    exp_path = Path(storage) / name if not remote else Path(tempfile.mkdtemp(prefix="rayfed-dg-sweep-")) / name
    # Tune saves the sweep's state (which checkpoint each trial is at) every 10 s or more by default; a sweep
    # killed in between would restart trials from scratch: save it every second (it is a few kB here)
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")
    fn = tune.with_parameters(trainable, config_path=config_path, fixed=fixed)
    fn = tune.with_resources(fn, placement(cfg, workers))
    if resume:
        where = f"{storage.rstrip('/')}/{name}"
        if not tune.Tuner.can_restore(where):
            raise ConfigError(f"--resume: no sweep to resume at {where}")
        tuner = tune.Tuner.restore(where, fn, resume_unfinished=True, restart_errored=True)
    else:
        if not remote and exp_path.exists():
            raise ConfigError(f"sweep directory {exp_path} exists; continue it with --resume or choose --storage")
        tuner = tune.Tuner(fn, param_space=param_space,
                           tune_config=tune.TuneConfig(metric="src_val", mode="max", num_samples=samples,
                                                       scheduler=sched),
                           run_config=tune.RunConfig(name=name, storage_path=storage, verbose=verbose,
                                                     callbacks=callbacks or None))
    results = tuner.fit()
    params = list(space["params"])
    records = []
    for i in range(len(results)):
        res = results[i]
        m, conf = res.metrics or {}, res.config or {}
        if m.get("selected_round") is None:
            continue
        records.append({**{p: conf[p] for p in params}, "target": conf["target"],
                        "selected_round": m["selected_round"], "selected_src_val": m["selected_src_val"],
                        "selected_target_acc": m["selected_target_acc"], "rounds_run": m.get("round"),
                        "resumed_from_round": m.get("resumed_from_round", 0)})
    if not records:
        raise RuntimeError("no trial reported a selected round")
    chosen, rows = select_value(records, params)
    exp_path.mkdir(parents=True, exist_ok=True)
    write_table(records, exp_path / "trials.parquet")
    write_table(rows, exp_path / "selection.parquet")
    md = markdown_table(rows, targets, params)
    write_text(md + "\n", exp_path / "selection.md")
    chosen_cfg = load_config(config_path, fixed + overrides_of(chosen))
    write_text(yaml.safe_dump(chosen_cfg.to_dict(), sort_keys=False), exp_path / "chosen_config.yaml")
    if remote:  # the tables go beside the trials, in the sweep's storage
        import pyarrow.fs as pafs

        fs, root = pafs.FileSystem.from_uri(f"{storage.rstrip('/')}/{name}")
        for f in exp_path.iterdir():
            with fs.open_output_stream(f"{root}/{f.name}") as out:
                out.write(f.read_bytes())
    path = f"{storage.rstrip('/')}/{name}" if remote else str(exp_path)
    return {"path": path, "chosen": chosen, "table": md, "records": records}
