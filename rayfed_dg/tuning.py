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

The sweep loads the dataset once and puts it into the object store once
(``upload``): every trial reads that copy zero-copy, instead of loading and
putting its own.  A space that searches a ``data.*`` key keeps per-trial
loading, since its trials may need different data.

Every round reports ``src_val`` (mean source-validation accuracy: the metric
Tune optimises and ASHA stops on) and ``target_acc`` (recorded, never used
to choose).  ``select_value`` applies the training-domain-validation rule:
for each hyper-parameter value, the round of each target's trial is chosen
by source validation; the value with the best mean selected source
validation wins, and its target accuracies are what one reports.

The engine's checkpoints travel through Tune's checkpoint API, so a trial
that failed (its node lost with its process) starts again from its last one
on any node, ``engine.trial_max_failures`` times (Tune's ``FailureConfig``),
and ends with the numbers of a trial that never failed.

Each trial also writes the run's TensorBoard scalars (``engine/store/tblog.py``:
the same tags as ``rayfed-dg run``) to ``<trial dir>/tensorboard/<target>``,
so ``tensorboard --logdir runs/tune/NAME`` compares the trials.  W&B and
MLflow are optional, off by default, through the logger callbacks Ray Tune
ships (``logger_callbacks``); neither package is imported unless asked for.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from rayfed_dg.config import ConfigError, ExperimentConfig, load_config
from rayfed_dg.data import DomainDataset
from rayfed_dg.engine.store.records import Split
from rayfed_dg.errors import EngineError
from rayfed_dg.utils import did_you_mean, env_set, exit_quietly_on_sigterm, render_table, sigterm_as_interrupt

if TYPE_CHECKING:
    from rayfed_dg.engine.store.sweepdir import SweepDir

REPO_ROOT = Path(__file__).resolve().parents[1]
SPACE_DIR = REPO_ROOT / "tuning"
# a restored trial continues from its latest checkpoint and the selection reads reported metrics, never a
# checkpoint; the one before the latest is kept too, as Tune's saved sweep state may still name it
KEEP_CHECKPOINTS = 2


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


def upload(sw: Sweep) -> dict | None:
    """The sweep's dataset in the object store, once for every trial: the
    refs of its images and labels, and the rest of the dataset (domains,
    names), small, which each trial rebuilds it from.  None when the space
    searches a ``data.*`` key: a trial may then need other data (another
    resolution, subsample or split seed) and loads its own."""
    import ray

    if any(key == "data" or key.startswith("data.") for key in sw.space["params"]):
        return None
    ds = sw.ds
    return {"refs": [ray.put(ds.images), ray.put(ds.labels)],
            "rest": {"domains": ds.domains, "domain_names": ds.domain_names, "class_names": ds.class_names,
                     "meta": ds.meta}}


def trainable(trial_config: dict, *, config_path: str, fixed: list[str], data: dict | None = None) -> None:
    """One Tune trial: a complete federation for ``trial_config['target']``
    (``engine.running.experiment.run_trial``, on actors in the trial's placement group).
    ``data``: the sweep's ``upload`` (None: the trial loads its own)."""
    exit_quietly_on_sigterm()  # Tune's SIGTERM inside a finaliser: a traceback under the finished sweep, else
    import logging

    import ray
    from ray import tune

    from rayfed_dg.engine.running.experiment import run_trial
    from rayfed_dg.engine.store.rundir import RunDir, resume_files

    logging.getLogger("ray.train").setLevel(logging.WARNING)  # "Checkpoint successfully created" each round
    cfg = load_config(config_path, fixed + overrides_of(trial_config) + ["output.save_best_checkpoint=false"])
    target = trial_config["target"]
    # the engine's own resumable checkpoints (every output.checkpoint_every rounds) travel through Tune's
    # checkpoint API, so a restored trial continues from its last one instead of round 1
    work = RunDir(tempfile.mkdtemp(prefix="rayfed-dg-trial-"))
    restored = tune.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            shutil.copytree(d, work.path, dirs_exist_ok=True)
    last: dict = {"resumed_from_round": max(work.saved_rounds(target), default=0)}  # 0: the trial started at round 1
    dataset = None
    if data is not None:
        images, labels = ray.get(data["refs"])  # read-only views of the object store, not copies
        dataset = (DomainDataset(images, labels, **data["rest"]), data["refs"])
        last["data_upload"] = data["refs"][0].hex()  # the sweep's one upload, the same in every trial
    trial_dir = tune.get_context().get_trial_dir()  # Tune syncs it to the sweep folder
    tb = Path(trial_dir) / "tensorboard" if cfg.output.tensorboard and trial_dir else None

    def report(out, res):
        if out.metrics:
            last["src_val"] = res.mean(Split.SOURCE_VAL, out.round)
            last["target_acc"] = res.mean(Split.TARGET_TEST, out.round)
        if "src_val" not in last:
            return
        metrics = {"round": out.round, **last, "selected_round": res.selected_round,
                   "selected_src_val": res.selected_val, "selected_target_acc": res.selected_target_acc}
        saved = work.checkpoint(target, out.round)
        if not saved.is_file():
            tune.report(metrics)
            return
        snap = RunDir(tempfile.mkdtemp(prefix="rayfed-dg-ckpt-"))
        # with the client-state pieces it names and the tables' rows it does not carry
        for f in resume_files(work, target, out.round):
            (snap.path / f.relative_to(work.path)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, snap.path / f.relative_to(work.path))
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(snap.path)))
        shutil.rmtree(snap.path, ignore_errors=True)

    try:
        run_trial(cfg, target, work.path, ray.util.get_current_placement_group(), on_round=report, tensorboard=tb,
                  dataset=dataset)
    finally:
        shutil.rmtree(work.path, ignore_errors=True)


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


def select_value(records: list[dict], params: list[str]) -> tuple[dict | None, list[dict]]:
    """Training-domain validation over trial records.

    ``records``: one per trial with the searched ``params``, ``target``,
    ``selected_round``, ``selected_src_val``, ``selected_target_acc`` and
    ``finished`` (False: the trial was interrupted or failed; it is shown,
    marked, and never chosen).  Returns (the chosen value assignment, or None
    when no value has every target's trial finished, and one table row per
    value with the target accuracy at each target's selected round).  Target
    accuracy is carried into the table but never read to choose."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(tuple(r[p] for p in params), []).append(r)
    rows = []
    targets = {r["target"] for r in records}
    for key, rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        row = dict(zip(params, key))
        for r in sorted(rs, key=lambda r: r["target"]):
            row[f"{r['target']}"] = r["selected_target_acc"]
            row[f"{r['target']}_round"] = r["selected_round"]
            row[f"{r['target']}_finished"] = r.get("finished", True)
        done = [r for r in rs if r.get("finished", True) and r["selected_src_val"] is not None]
        row["mean_src_val"] = float(np.mean([r["selected_src_val"] for r in done])) if done else None
        row["_n"] = len({r["target"] for r in done})
        rows.append(row)
    # only values with every target finished compete; ties go to the first listed value
    complete = [r for r in rows if r["_n"] == len(targets)]
    best = max(complete, key=lambda r: r["mean_src_val"]) if complete else None
    for r in rows:
        r["chosen"] = r is best
        del r["_n"]
    return ({p: best[p] for p in params} if best is not None else None), rows


def select_per_seed(records: list[dict], params: list[str]) -> dict[Any, tuple[dict | None, list[dict]]]:
    """``select_value`` within each trial seed (``record["seed"]``; None for
    a sweep run without ``--seeds``), as DomainBed's ``collect_results``:
    each seed chooses its own value on source validation."""
    by_seed: dict[Any, list[dict]] = {}
    for r in records:
        by_seed.setdefault(r.get("seed"), []).append(r)
    return {s: select_value(rs, params) for s, rs in sorted(by_seed.items(), key=lambda kv: str(kv[0]))}


def collect_row(records: list[dict], params: list[str], targets: list[str]) -> dict[str, Any]:
    """A sweep's result as a paper reports it: per seed, the value chosen on
    source validation and the target accuracy (fraction) at each target's
    selected round for that value.  A seed with any unfinished trial is left
    out (its choice could still change) and listed in ``incomplete``."""
    per_target: dict[str, list[float]] = {t: [] for t in targets}
    avgs, chosen, incomplete = [], [], []
    unfinished = {r.get("seed") for r in records if not r.get("finished", True)}
    for seed, (value, rows) in select_per_seed(records, params).items():
        row = next((r for r in rows if r["chosen"]), None)
        if seed in unfinished or value is None or row is None or any(row.get(t) is None for t in targets):
            incomplete.append(seed)
            continue
        for t in targets:
            per_target[t].append(float(row[t]))
        avgs.append(float(np.mean([row[t] for t in targets])))
        chosen.append((seed, value))
    return {"per_target": per_target, "avg": avgs, "chosen": chosen, "incomplete": incomplete}


def collect(sweep_dirs: list[Path], fmt: str = "md") -> str:
    """``rayfed-dg collect``: one row per sweep folder (its method), target
    accuracy (%) at the values chosen per seed on source validation only,
    mean ± SE over seeds (DomainBed's ``collect_results``)."""
    from rayfed_dg.engine.store.sweepdir import TRIALS, SweepDir
    from rayfed_dg.reporting import mean_se_cell

    sweeps = []
    for d in sweep_dirs:
        if not SweepDir(d).has_trials():
            hint = " (it is unfinished or was never collected: run tune.py ... --resume)" if d.is_dir() else ""
            raise ConfigError(f"collect: {d} is not a sweep folder with {TRIALS}{hint}; "
                              "pass the folders tune.py printed, e.g. runs/tune/lambda")
        meta, records = SweepDir(d).read()
        sweeps.append((meta["label"], meta["params"], meta["targets"], records))
    targets = list(dict.fromkeys(t for s in sweeps for t in s[2]))
    body = []
    for label, params, mine, records in sweeps:
        c = collect_row(records, params, mine)
        chosen = "; ".join(f"seed {s}: " + ", ".join(f"{k}={v}" for k, v in value.items()) if s is not None else
                           ", ".join(f"{k}={v}" for k, v in value.items()) for s, value in c["chosen"])
        if c["incomplete"]:
            chosen += f" (seeds left out, unfinished: {', '.join(map(str, c['incomplete']))})"
        body.append([label, len(c["avg"])] + [mean_se_cell(c["per_target"].get(t, [])) for t in targets]
                    + [mean_se_cell(c["avg"]), chosen])
    return render_table(["method", "seeds"] + targets + ["avg", "chosen on source validation"], body, fmt)


COLLECT_CAPTION = ("Target accuracy (%) at the values each seed chose on source validation only (then each "
                   "target's round by source validation); mean ± SE over seeds, SE = std(ddof=1)/sqrt(n)")


def markdown_table(rows: list[dict], targets: list[str], params: list[str]) -> str:
    head = params + [f"{t} (%)" for t in targets] + ["avg (%)", "mean src val (%)", "chosen"]
    body = []
    for r in rows:
        accs = [r.get(t) for t in targets]
        avg = np.mean([a for a in accs if a is not None]) if any(a is not None for a in accs) else None
        cells = [str(r[p]) for p in params]
        for t, a in zip(targets, accs):
            mark = "" if r.get(f"{t}_finished", True) else ", unfinished"
            cells.append(f"{100 * a:.2f} (r{r.get(t + '_round')}{mark})" if a is not None else
                         ("-" if not mark else "unfinished"))
        cells += [f"{100 * avg:.2f}" if avg is not None else "-",
                  f"{100 * r['mean_src_val']:.2f}" if r["mean_src_val"] is not None else "-",
                  "**yes**" if r["chosen"] else ""]
        body.append(cells)
    return render_table(head, body, "md")


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM before any trial reported a round: no table to
    print, only the sweep (``--resume``) to continue."""

    def __init__(self, where: str):
        self.where = where
        super().__init__(f"interrupted before any trial reported a round; continue the sweep in {where} with --resume")


@dataclass
class Sweep:
    """A sweep, resolved and checked before any trial starts."""
    space: dict
    name: str
    config_path: str  # absolute: trials run in folders of their own
    fixed: list[str]  # the space's ``set`` and the command line's overrides (and this machine's data root)
    cfg: ExperimentConfig
    ds: DomainDataset  # as the driver loaded it for the checks (``upload`` shares it with the trials)
    targets: list[str]
    workers: int  # per trial
    storage: str  # a local folder (absolute) or a URI
    scheduler: str
    samples: int
    seeds: list[int] | None = None  # training.seed values: every value x target is run once per seed
    keep: int = KEEP_CHECKPOINTS  # checkpoints Tune keeps per trial (CheckpointConfig.num_to_keep)

    @property
    def remote(self) -> bool:
        return "://" in self.storage

    @property
    def where(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"


def plan_sweep(space_name: str, config: str | None, target: str, samples: int, scheduler: str,
               overrides: list[str], storage: str, space_dir: Path = SPACE_DIR,
               seeds: list[int] | None = None, keep: int = KEEP_CHECKPOINTS) -> Sweep:
    """Every check a sweep can fail before its first trial: the space, the
    config with each searched key, the data, the targets, and the trials'
    worker pools (``engine.running.experiment.plan_experiment``: the model builds,
    the pool fits the cluster)."""
    from rayfed_dg.data.sources import resolve_root
    from rayfed_dg.engine import clients_per_round, load_data, resolve_targets
    from rayfed_dg.engine.running.experiment import plan_experiment
    from rayfed_dg.engine.workers.resources import ensure_workers

    space = load_space(space_name, space_dir)
    config_path = config or space.get("config")
    if not config_path:
        raise ConfigError(f"{space['path']}: no 'config' and no --config given")
    config_path = str(Path(config_path).resolve() if Path(config_path).exists() else REPO_ROOT / config_path)
    fixed = list(space.get("set", [])) + list(overrides)
    cfg = load_config(config_path, fixed)
    root = resolve_root(cfg.data.name, cfg.data.root)
    if root is not None and root != cfg.data.root:  # this machine's data root, for trials on any node
        fixed.append(f"data.root={root}")
        cfg = load_config(config_path, fixed)
    for key, dist in space["params"].items():  # every searched key must be a valid config key
        load_config(config_path, fixed + [f"{key}={json.dumps(next(iter(dist.values()))[0])}"])
    ds = load_data(cfg)
    targets = resolve_targets(ds, target, cfg.data.heldout_val_domain)
    exp = plan_experiment([(None, cfg)], ds, targets)
    workers = max(ensure_workers(r.cfg.engine, clients_per_round(r.cfg, s)) for r in exp.rows for s in r.splits)
    name = Path(space_name).stem if space_name.endswith((".yaml", ".yml")) else space_name
    storage = storage if "://" in storage else str(Path(storage).resolve())
    if seeds is not None and ("training.seed" in space["params"] or len(set(seeds)) != len(seeds) or not seeds):
        raise ConfigError("--seeds: give distinct seeds, and not with a space that searches training.seed")
    if keep < 1:
        raise ConfigError(f"--keep-checkpoints {keep}: a resumed trial needs its latest checkpoint; give 1 or more")
    return Sweep(space, name, config_path, fixed, cfg, ds, targets, workers, storage, scheduler, samples,
                 sorted(seeds) if seeds else None, keep)


def _tuner(sw: Sweep, resume: bool, verbose: int, callbacks: list):
    from ray import tune

    # with_parameters stores its arguments in the object store once; the refs in ``data`` travel inside them
    fn = tune.with_parameters(trainable, config_path=sw.config_path, fixed=sw.fixed, data=upload(sw))
    fn = tune.with_resources(fn, placement(sw.cfg, sw.workers))
    if resume:
        if not tune.Tuner.can_restore(sw.where):
            raise ConfigError(f"--resume: no sweep to resume at {sw.where}")
        return tune.Tuner.restore(sw.where, fn, resume_unfinished=True, restart_errored=True)
    if tune.Tuner.can_restore(sw.where) or (not sw.remote and Path(sw.where).exists()):
        raise ConfigError(f"sweep directory {sw.where} exists; continue it with --resume or choose --storage")
    param_space = {key: to_tune(d) for key, d in sw.space["params"].items()}
    param_space["target"] = tune.grid_search(sw.targets)
    if sw.seeds:  # seeds are not searched: collect chooses a value per seed (DomainBed's trial seeds)
        param_space["training.seed"] = tune.grid_search(sw.seeds)
    sched = None
    if sw.scheduler == "asha":
        rounds = sw.cfg.training.rounds
        sched = tune.schedulers.ASHAScheduler(time_attr="round", max_t=rounds, grace_period=max(1, rounds // 4))
    return tune.Tuner(fn, param_space=param_space,
                      tune_config=tune.TuneConfig(metric="src_val", mode="max", num_samples=sw.samples,
                                                  scheduler=sched),
                      run_config=tune.RunConfig(name=sw.name, storage_path=sw.storage, verbose=verbose,
                                                checkpoint_config=tune.CheckpointConfig(num_to_keep=sw.keep),
                                                callbacks=callbacks or None,
                                                # a failed trial (its node lost) goes on from its last checkpoint
                                                failure_config=tune.FailureConfig(
                                                    max_failures=sw.cfg.engine.trial_max_failures)))


def _interrupt_watch():
    """A Tune callback that notes each trial's status when Ctrl-C (or SIGTERM) arrives.
    Tune's own SIGINT handler (installed before callbacks are set up) stops
    the sweep gracefully, and then marks every trial it stopped TERMINATED,
    as if it had finished: the statuses of that moment are the truth."""
    from ray.tune import Callback

    class InterruptWatch(Callback):
        def __init__(self):
            self.trials: list = []
            self.at_interrupt: dict[str, str] | None = None

        def setup(self, **info):
            tune_handler = signal.getsignal(signal.SIGINT)

            def on_sigint(signum, frame):
                if self.at_interrupt is None:
                    self.at_interrupt = {t.trial_id: t.status for t in self.trials}
                if callable(tune_handler):
                    tune_handler(signum, frame)
                else:
                    raise KeyboardInterrupt

            signal.signal(signal.SIGINT, on_sigint)
            # SIGTERM to the driver alone (kill PID, timeout) stops the sweep as Ctrl-C does; Ray's own handler
            # would abort it with a stack dump, before the table of what was left and the resume command
            signal.signal(signal.SIGTERM, on_sigint)

        def on_step_begin(self, iteration, trials, **info):
            self.trials = trials

    return InterruptWatch()


def _trial_label(trial, params: list[str]) -> str:
    return " ".join(f"{k}={trial.config[k]}" for k in [*params, "training.seed", "target"] if k in trial.config)


def _note_result(progress, trial, result: dict) -> None:
    """``_sweep_progress``'s record of a trial's report: its round (moving
    the bar) and its best source validation so far."""
    progress.done[trial.trial_id] = int(result.get("round", 0))
    if result.get("selected_src_val") is not None:
        progress.best[trial.trial_id] = 100 * float(result["selected_src_val"])
    if progress.bar is not None:
        progress.bar.n = sum(progress.done.values())
        progress.bar.refresh()


def _sweep_progress(where: str, rounds: int, params: list[str]):
    """A Tune callback that replaces Tune's status tables (dozens of lines a
    minute, and a TensorBoard hint into Ray's session folder) with one
    progress bar over all trials' rounds and one line per trial that ends."""
    from ray.tune import Callback

    class SweepProgress(Callback):
        def __init__(self):
            self.bar: Any = None
            self.done: dict[str, int] = {}
            self.best: dict[str, float] = {}

        def __getstate__(self):  # Tune pickles its callbacks with the sweep's state; a bar is not state
            return {**self.__dict__, "bar": None}

        def setup(self, stop=None, num_samples=None, total_num_samples=None, **info):
            from tqdm import tqdm

            total_num_samples = total_num_samples or 0
            self.bar = tqdm(total=total_num_samples * rounds, initial=sum(self.done.values()), unit="round",
                            desc=f"{total_num_samples} trials", dynamic_ncols=True)
            self.bar.write(f"sweep folder {where} (tensorboard --logdir {where})")

        def on_trial_result(self, iteration, trials, trial, result, **info):
            _note_result(self, trial, result)

        def on_trial_complete(self, iteration, trials, trial, **info):
            if self.bar is not None:
                best = self.best.get(trial.trial_id)
                self.bar.write(f"{_trial_label(trial, params)}: finished after {self.done.get(trial.trial_id, 0)} "
                               "rounds" + (f", best source val {best:.2f}%" if best is not None else ""))

        def on_trial_error(self, iteration, trials, trial, **info):
            if self.bar is not None:
                self.bar.write(f"{_trial_label(trial, params)}: failed at round {self.done.get(trial.trial_id, 0)} "
                               f"(its error: {trial.local_path}/error.txt)")

        def on_experiment_end(self, trials, **info):
            if self.bar is not None:
                self.bar.close()

    return SweepProgress()


def _records(results, params: list[str], at_interrupt: dict[str, str] | None) -> list[dict]:
    """One record per trial; ``finished`` is False for a trial that was not
    TERMINATED when the sweep was interrupted (``at_interrupt``), or that failed."""
    trials = getattr(getattr(results, "_experiment_analysis", None), "trials", None)
    trials = trials if trials is not None and len(trials) == len(results) else [None] * len(results)
    records = []
    for res, trial in zip(results, trials):
        m, conf = res.metrics or {}, dict(res.config or getattr(trial, "config", None) or {})
        if not conf:
            continue
        status = "ERROR" if res.error is not None else "TERMINATED"
        if at_interrupt is not None and trial is not None and status != "ERROR":
            status = at_interrupt.get(trial.trial_id, "PENDING")
        records.append({**{p: conf[p] for p in params}, "target": conf["target"], "seed": conf.get("training.seed"),
                        "finished": status == "TERMINATED",
                        "status": status,
                        "selected_round": m.get("selected_round"), "selected_src_val": m.get("selected_src_val"),
                        "selected_target_acc": m.get("selected_target_acc"), "rounds_run": m.get("round"),
                        "resumed_from_round": m.get("resumed_from_round", 0)})
    return records


def _saved_watch(tuner, verbose: int):
    """The interrupt watch the sweep runs with: a restored sweep runs with the
    callbacks saved with it (a copy of the watch made when it started), whose
    progress bar is dropped when it resumes without one (``verbose`` not 1)."""
    local = getattr(tuner, "_local_tuner", None)
    saved = local.get_run_config().callbacks if local is not None else None
    watch = next((cb for cb in saved or [] if hasattr(cb, "at_interrupt")), None)
    if saved is not None and verbose != 1:  # a sweep started with a bar, resumed without one
        saved[:] = [cb for cb in saved if not hasattr(cb, "best")]
    if watch is not None:
        watch.at_interrupt, watch.trials = None, []
    return watch


def _write_chosen(sw: Sweep, folder: SweepDir, chosen: dict | None) -> str | None:
    """``chosen_config.yaml``: the config with the chosen values; none while
    the sweep is unfinished (``chosen`` None: one an earlier collection wrote goes)."""
    chosen_yaml = None
    if chosen is not None:
        chosen_cfg = load_config(sw.config_path, sw.fixed + overrides_of(chosen))
        chosen_yaml = yaml.safe_dump(chosen_cfg.to_dict(), sort_keys=False)
    folder.write_chosen(chosen_yaml)
    return chosen_yaml


def _publish(folder: SweepDir, where: str, chosen_yaml: str | None) -> None:
    """Upload the local folder of a remote sweep's tables to its storage
    ``where``, deleting a stale chosen config there, then remove the folder."""
    from rayfed_dg.engine.store.remote import delete_file, upload_files
    from rayfed_dg.engine.store.sweepdir import CHOSEN

    upload_files(folder.files(), where)
    if chosen_yaml is None:
        delete_file(f"{where}/{CHOSEN}")
    shutil.rmtree(folder.path.parent, ignore_errors=True)


def run_sweep(space_name: str, config: str | None, target: str, samples: int, scheduler: str, resume: bool,
              overrides: list[str], storage: str, space_dir: Path = SPACE_DIR, verbose: int = 1,
              wandb_project: str | None = None, mlflow_uri: str | None = None,
              seeds: list[int] | None = None, keep: int = KEEP_CHECKPOINTS) -> dict[str, Any]:
    """Plan, run (or resume) and collect a sweep.  Returns {path, chosen,
    table, records, complete}; ``chosen`` is None and no
    ``chosen_config.yaml`` is written while any trial is unfinished.
    ``verbose``: 0 prints nothing, 1 a progress bar and a line per finished
    trial, 2 Ray Tune's own status tables instead.  Ctrl-C or SIGTERM (from
    the main thread) stops it gracefully; before any trial reported a round,
    it raises ``SweepInterrupted``."""
    from rayfed_dg.engine import init_ray
    from rayfed_dg.engine.store.sweepdir import SweepDir

    callbacks = logger_callbacks(space_name, wandb_project, mlflow_uri)  # a missing package fails before any trial
    sw = plan_sweep(space_name, config, target, samples, scheduler, overrides, storage, space_dir, seeds, keep)
    init_ray(sw.cfg)
    # Tune saves the sweep's state (which checkpoint each trial is at) every 10 s or more by default; a sweep
    # killed in between would restart trials from scratch: save it every second (it is a few kB here)
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")
    progress = [_sweep_progress(sw.where, sw.cfg.training.rounds, list(sw.space["params"]))] if verbose == 1 else []
    # SIGTERM: a KeyboardInterrupt while the dataset is uploaded, a graceful stop once Tune runs (_interrupt_watch),
    # and the handler from before when the sweep ends
    with sigterm_as_interrupt():
        tuner = _tuner(sw, resume, 1 if verbose == 2 else 0, [*callbacks, *progress, _interrupt_watch()])
        watch = _saved_watch(tuner, verbose)
        # Tune's newer console output prints its experiment box and a TensorBoard hint into Ray's session folder
        # whatever the verbosity; its legacy output at verbosity 0 prints nothing
        with env_set("RAY_AIR_NEW_OUTPUT", "1" if verbose == 2 else "0"):
            results = tuner.fit()
    params = list(sw.space["params"])
    records = _records(results, params, watch.at_interrupt if watch is not None else None)
    if not any(r["selected_round"] is not None for r in records):
        if watch is not None and watch.at_interrupt is not None:
            raise SweepInterrupted(sw.where)
        raise EngineError("no trial reported a selected round" + (
            "" if all(r["finished"] for r in records) else f"; continue the sweep with --resume ({sw.where})"))
    chosen, rows = select_value(records, params)  # with seeds: the best mean over every seed and target
    complete = all(r["finished"] for r in records)
    seeded = any(r["seed"] is not None for r in records)
    if seeded:
        per_seed = select_per_seed(records, params)
        rows = [{"seed": s, **row} for s, (_, rs) in per_seed.items() for row in rs]
    exp_path = Path(sw.where) if not sw.remote else Path(tempfile.mkdtemp(prefix="rayfed-dg-sweep-")) / sw.name
    folder = SweepDir(exp_path)
    folder.write(sw.cfg.method.label or sw.cfg.method.name, params, sw.targets, records, rows)
    if seeded:
        md = "\n\n".join(f"seed {s}:\n" + markdown_table(rs, sw.targets, params) for s, (_, rs) in per_seed.items())
        md += f"\n\n{COLLECT_CAPTION} (rayfed-dg collect):\n\n" + collect([exp_path])
    else:
        md = markdown_table(rows, sw.targets, params)
    folder.write_selection(md)
    chosen_yaml = _write_chosen(sw, folder, chosen if complete else None)
    if sw.remote:  # the tables go beside the trials, in the sweep's storage
        _publish(folder, sw.where, chosen_yaml)
    return {"path": sw.where if sw.remote else str(exp_path), "chosen": chosen if complete else None, "table": md,
            "records": records, "complete": complete}
