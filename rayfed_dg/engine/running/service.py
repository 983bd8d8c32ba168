"""The run service: what ``rayfed-dg run`` and ``rayfed_dg.run`` do, for
both (they only turn their arguments into a ``RunRequest`` and print or
return the ``RunOutcome``).

``execute_run`` checks the config(s), data and targets, makes (or reopens,
``plan_resume``; a URI is downloaded first, ``fetch_run``) the run directory, records how the run was started
(``write_record``: ``run.json`` and each seed's ``config.yaml``, before the
first federation, so ``--resume RUN_DIR`` needs nothing else), then trains
every seed, row and target.  Nothing is written before every check passed.
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayfed_dg._version import __version__
from rayfed_dg.config import ConfigError, ExperimentConfig, load_config
from rayfed_dg.engine.store.formats import resume_without_record
from rayfed_dg.engine.store.rundir import RunDir
from rayfed_dg.utils import environment, environment_changes, sigterm_as_interrupt

Configs = list[tuple[int | None, ExperimentConfig]]  # one config per seed (None: a run without --seeds)


@dataclass
class RunRequest:
    """What ``rayfed-dg run`` was asked (its flags, by the parser's names)."""

    config: str | None = None
    target: str | None = None
    overrides: list[str] = field(default_factory=list)
    run_dir: str | None = None
    resume: str | None = None
    seeds: str | None = None  # "0,1,2", as --seeds
    dry_run: bool = False
    no_progress: bool = False


@dataclass
class RunOutcome:
    run_dir: RunDir
    exp: Any  # experiment.Experiment
    seeds: list[int] | None
    by_seed: dict[int | None, dict[str, dict]]  # {seed: {label: summary}}
    tmp: Any = None  # a dry run's temporary directory (removed when this is dropped), else None


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during the federations; every finished round is on disk."""

    def __init__(self, run_dir: Path, kept: bool):
        self.run_dir, self.kept = run_dir, kept
        super().__init__("interrupted (a dry run keeps nothing)" if not kept else
                         f"interrupted; resume with: rayfed-dg run --resume {shlex.quote(str(run_dir))}")


def parse_seeds(text: str | None) -> list[int] | None:
    """``--seeds 0,1,2`` -> [0, 1, 2]; None when not given."""
    if text is None:
        return None
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: expected a comma list of integers, e.g. --seeds 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: expected distinct integers, e.g. --seeds 0,1,2")
    return seeds


def check_overrides(path: str | Path, overrides: list[str]) -> None:
    """A ``--set`` the run would ignore is an error naming why (checked on
    the file and its ``--set`` values as written, before validation)."""
    from rayfed_dg.config import _read_yaml, apply_overrides

    bad = [o for o in overrides if o.split("=", 1)[0].strip().split(".")[0] == "method"]
    if not bad:
        return
    rows = apply_overrides(_read_yaml(Path(path)), overrides).get("compare")
    if rows:
        labels = ", ".join(str(m.get("label") or m.get("name", "fedavg")) if isinstance(m, dict) else str(m)
                           for m in rows)
        raise ConfigError(f"--set {bad[0]}: {path} runs its compare: list ({labels}), whose rows replace the "
                          "method: section; add --set compare=null to run one method, or change the rows")


def _dry_overrides(cfg: ExperimentConfig) -> list[str]:
    clients = cfg.partition.num_clients or 1
    # enough images that every client of the partition gets a few
    return ["training.rounds=1", "training.local_steps=1", "training.batch_size=4",
            f"data.limit_per_domain={max(24, 6 * clients)}", "partition.min_size=1",
            "evaluation.batch_size=8", "output.checkpoint_every=1", "output.sync_to=null"]  # nothing kept


def _new_configs(req: RunRequest, seeds: list[int] | None) -> Configs:
    if req.config is None:
        raise ConfigError("run: give the experiment's config (rayfed-dg run CONFIG), or --resume RUN_DIR to "
                          "continue a run")
    check_overrides(req.config, req.overrides)
    dry = _dry_overrides(load_config(req.config, req.overrides)) if req.dry_run else []
    # --seeds: training.seed set last
    return [(None, load_config(req.config, req.overrides + dry))] if seeds is None else \
        [(s, load_config(req.config, req.overrides + dry + [f"training.seed={s}"])) for s in seeds]


def _record_seeds(rec: dict | None, run_dir: RunDir, req: RunRequest, seeds: list[int] | None
                  ) -> tuple[list[int] | None, str]:
    """(seeds, target argument) a resume continues: ``run.json``'s, or
    (a run made before it) the ones given again."""
    if rec is not None:
        if seeds is not None and seeds != rec["seeds"]:
            was = "without --seeds" if rec["seeds"] is None else "with --seeds " + ",".join(map(str, rec["seeds"]))
            raise ConfigError(f"--seeds {req.seeds}: {run_dir.path} was started {was}; --resume continues those "
                              "seeds (drop --seeds)")
        return rec["seeds"], ",".join(rec["targets"])
    return resume_without_record(run_dir, req.target, seeds)


def fetch_run(uri: str) -> Path:
    """The run directory copied to ``uri`` (``output.sync_to``), downloaded
    to this machine's cache; the resumed run updates the same copy."""
    from rayfed_dg.data.folders import cache_dir
    from rayfed_dg.engine.store.remote import download, local_files, open_uri
    from rayfed_dg.engine.store.rundir import RUN_RECORD

    local = cache_dir() / "runs" / open_uri(uri)[1].lstrip("/")
    copy = RunDir(download(uri, local, RUN_RECORD)).mirror()
    if copy is not None:  # the copy holds exactly what was downloaded: not sent back, and a rewrite is sent
        copy.sent = local_files(local, copy.scratch)
    print(f"rayfed-dg: downloaded {uri} to {local}", file=sys.stderr)
    if copy is None or copy.uri != uri.rstrip("/"):
        print(f"rayfed-dg: warning: {uri} is a run whose output.sync_to names "
              f"{'no copy' if copy is None else copy.uri}: the resumed run updates that, not {uri}", file=sys.stderr)
    return local


def plan_resume(req: RunRequest, seeds: list[int] | None) -> tuple[RunDir, Configs, str, dict | None]:
    """(run directory, configs per seed, target argument, ``run.json``) of
    ``--resume``: the run's own config(s), targets and seeds, unless given
    again (then they must match)."""
    from rayfed_dg.config import unrecorded_defaults

    run_dir = RunDir(req.resume or "")
    if req.run_dir is not None:
        raise ConfigError(f"--run-dir and --resume: --resume {run_dir.path} continues that directory; drop --run-dir")
    if req.dry_run:
        raise ConfigError("--dry-run and --resume: a dry run trains one round in a temporary directory and "
                          "cannot continue a run; drop one of them")
    if "://" in str(req.resume):
        run_dir = RunDir(fetch_run(str(req.resume)))
    if not run_dir.path.is_dir():
        raise ConfigError(f"--resume {run_dir.path}: no such directory")
    rec = run_dir.record()
    seeds, target_arg = _record_seeds(rec, run_dir, req, seeds)
    each: list[int | None] = list(seeds) if seeds else [None]
    if req.config is not None:
        path = Path(req.config)
    else:
        have = [d for d in (run_dir.seed(s) for s in each) if d.has_config()]
        if not have:
            raise ConfigError(f"--resume {run_dir.path}: no config.yaml there; not a rayfed-dg run directory")
        path = have[0].config_path  # every seed's config is this one with its own training.seed
    check_overrides(path, req.overrides)
    cfgs = [(s, load_config(path, req.overrides + ([] if s is None else [f"training.seed={s}"]))) for s in each]
    # the run's own config.yaml (a config given again is the user's, written without defaults): a default changed
    # since the run began would change its variant
    saved = run_dir.seed(each[0])
    for line in unrecorded_defaults(saved.config_path) if saved.has_config() else []:
        print(f"rayfed-dg: warning: {saved.config_path} does not record {line}; resuming with these (this "
              "release's defaults)", file=sys.stderr)
    changed = environment_changes(rec.get("environment") if rec else None, environment())
    if changed:
        print(f"rayfed-dg: warning: {run_dir.path} was started with other code or libraries ({', '.join(changed)}); "
              "its remaining rounds may not give the numbers an uninterrupted run would", file=sys.stderr)
    return run_dir, cfgs, target_arg, rec


def calibrate(config: str | Path, epsilon: float, overrides: list[str], target: str | None = None
              ) -> tuple[float, str]:
    """``rayfed-dg privacy calibrate``: (the update noise multiplier z, rounded
    up to 4 decimals so it never spends past ``epsilon``, at which the
    config's rounds spend ``epsilon`` at ``privacy.delta`` for the model
    updates alone; a line saying so).  Payload releases are known only by
    running: they add their own."""
    import math

    from rayfed_dg.config import PrivacyConfig, UpdatePrivacyConfig
    from rayfed_dg.engine.privacy.accountant import Accountant

    from .plan import clients_per_round, load_data, resolve_targets, split_for

    if not epsilon > 0:
        raise ConfigError(f"--epsilon {epsilon:g}: give a positive epsilon, e.g. --epsilon 4")
    cfg = load_config(config, overrides)
    ds = load_data(cfg)
    split = split_for(cfg, ds, resolve_targets(ds, target or "all", cfg.data.heldout_val_domain)[0])
    p = cfg.privacy or PrivacyConfig()
    if p.updates is None:
        p = p.model_copy(update={"updates": UpdatePrivacyConfig(clip=1.0)})
    n, m, rounds = split.num_clients, clients_per_round(cfg, split), cfg.training.rounds
    acc = Accountant(p, n, m)
    acc.check()
    z = math.ceil(acc.calibrate(rounds, epsilon) * 1e4) / 1e4
    return z, (f"epsilon {epsilon:g} at delta {p.delta:g} ({p.accountant}) over {rounds} rounds of {m} of {n} "
               "clients, for the model updates alone (shared statistics add their own)")


def write_record(run_dir: RunDir, exp, req: RunRequest, seeds: list[int] | None) -> None:
    """``run.json`` and each seed's ``config.yaml``, before the first
    federation: what ``--resume`` and ``report`` read."""
    for s, scfg in exp.configs.items():
        run_dir.seed(s).write_config(scfg)
    run_dir.write_record({"targets": list(exp.targets), "seeds": seeds, "labels": exp.labels,
                          "rounds": next(iter(exp.configs.values())).training.rounds,
                          "config": req.config, "overrides": list(req.overrides), "rayfed_dg": __version__,
                          "environment": environment()})


def _open_run_dir(req: RunRequest, cfgs: Configs, resumed: RunDir | None) -> tuple[RunDir, Any]:
    """(the run directory, a dry run's temporary directory or None): a
    resumed one checked against its configs, else a new one."""
    from .run import check_resume_dir

    if resumed is not None:
        for s, scfg in cfgs:
            if s is None or resumed.seed(s).path.exists():
                check_resume_dir(scfg, resumed.seed(s))
        return resumed, None
    if req.dry_run and req.run_dir is None:
        import tempfile

        # a dry run proves the config; it leaves no run directory behind unless asked to
        tmp = tempfile.TemporaryDirectory(prefix="rayfed-dg-dry-run-")
        return RunDir.create(cfgs[0][1], tmp.name), tmp
    return RunDir.create(cfgs[0][1], req.run_dir), None


def execute_run(req: RunRequest) -> RunOutcome:
    """Everything ``rayfed-dg run`` does but print its closing table.
    Ctrl-C, or SIGTERM when called from the main thread, raises
    ``RunInterrupted``; the caller's SIGTERM handler is put back after."""
    from rayfed_dg.engine.store.trackers import require_trackers

    from .experiment import plan_experiment, run_planned
    from .plan import load_data, resolve_targets

    seeds = parse_seeds(req.seeds)
    fixed = [o for o in req.overrides if o.split("=", 1)[0].strip() == "training.seed"]
    if seeds is not None and fixed:
        raise ConfigError(f"--set {fixed[0]} and --seeds: each seed sets training.seed; drop one of them")
    resumed, rec = None, None
    target_arg: str | None
    if req.resume:
        resumed, cfgs, target_arg, rec = plan_resume(req, seeds)
        seeds = None if cfgs[0][0] is None else [s for s, _ in cfgs if s is not None]
    else:
        cfgs, target_arg = _new_configs(req, seeds), req.target
    cfg = cfgs[0][1]
    for _, scfg in cfgs:  # output.wandb / output.mlflow (a compare row keeps the output section): installed, answering
        require_trackers(scfg)
    ds = load_data(cfg)
    targets = resolve_targets(ds, target_arg, cfg.data.heldout_val_domain)
    if resumed is not None and rec is not None and req.target is not None and \
            resolve_targets(ds, req.target, cfg.data.heldout_val_domain) != targets:
        raise ConfigError(f"--target {req.target}: {resumed.path} was started with --target {','.join(targets)}; "
                          "--resume continues those targets (drop --target)")
    exp = plan_experiment(cfgs, ds, targets)  # every check passes before anything is written
    run_dir, tmp = _open_run_dir(req, cfgs, resumed)
    if rec is None:
        write_record(run_dir, exp, req, seeds)
    if ds.meta.get("skipped_files"):  # data.on_corrupt: skip
        run_dir.write_skipped(ds.meta["skipped_files"])
    try:
        with sigterm_as_interrupt():
            by_seed = run_planned(exp, run_dir, progress=not req.no_progress)
    except KeyboardInterrupt:
        raise RunInterrupted(run_dir.path, tmp is None) from None
    return RunOutcome(run_dir, exp, seeds, by_seed, tmp)
