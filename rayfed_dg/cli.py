"""rayfed-dg: run leave-one-domain-out federations from a YAML config.

Bad input (config, data, resources) ends with one line on stderr and a
non-zero exit (2 for bad input, 1 for other failures); ``--debug`` shows the
traceback.  Nothing is written before the config, the data and the targets
have been checked.  A run records how it was started (``run.json``: targets,
seeds, ``--set`` values, the code's commit and library versions) and its
config before its first federation, so ``rayfed-dg run --resume RUN_DIR``
needs nothing else, and Ctrl-C prints that command.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayfed_dg import __version__
from rayfed_dg.utils import environment, environment_changes, render_table, run_cli, write_table, write_text

RUN_RECORD = "run.json"  # how a run was started (rayfed-dg run), read by --resume and report


def _debug_flag(parser: argparse.ArgumentParser, top: bool = False) -> None:
    # a sub-command's flag only when given, so ``rayfed-dg --debug run ...`` keeps the top-level one
    parser.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="show the traceback of an error")


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayfed-dg", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"rayfed-dg {__version__}")
    _debug_flag(p, top=True)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train leave-one-domain-out federations")
    run.add_argument("config", nargs="?", default=None,
                     help="experiment YAML file (optional with --resume: the run directory holds its config)")
    run.add_argument("--target", default=None,
                     help="target domain, comma list, or 'all' (default; --resume: the run's own targets)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set training.lr=0.01 (repeatable)")
    run.add_argument("--run-dir", default=None, help="output directory (default: output.root/name-timestamp)")
    run.add_argument("--resume", metavar="RUN_DIR", default=None,
                     help="continue RUN_DIR from its last complete checkpoint, with its own config, targets and "
                          "seeds (rayfed-dg run --resume RUN_DIR)")
    run.add_argument("--seeds", default=None, metavar="S,S,...",
                     help="run each training seed in turn into RUN_DIR/seed<S> and end with mean +- SE over seeds")
    run.add_argument("--no-progress", action="store_true", help="no live progress bars")
    run.add_argument("--dry-run", action="store_true",
                     help="prove the config builds and trains: 1 round, 1 local step, a few images per client "
                          "(in a temporary directory unless --run-dir is given)")
    run.add_argument("--wandb", metavar="PROJECT", default=None,
                     help="also log each federation's round scalars to Weights & Biases (output.wandb.project; "
                          "needs wandb: pip install 'rayfed_dg[wandb]')")
    run.add_argument("--mlflow", metavar="TRACKING_URI", default=None,
                     help="also log them to MLflow, e.g. sqlite:///mlflow.db (output.mlflow.tracking_uri; "
                          "needs mlflow: pip install 'rayfed_dg[mlflow]')")
    _debug_flag(run)
    part = sub.add_parser("partition", help="summarise a config's partition, write its manifest and heatmap")
    part.add_argument("config")
    part.add_argument("--target", default=None, help="target domain (default: the first)")
    part.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    part.add_argument("--out", default="partitions",
                      help="folder for the manifest, the per-client table and the heatmap (default: partitions)")
    _debug_flag(part)
    ev = sub.add_parser("evaluate", help="evaluate a run's saved models again with evaluation-time settings changed")
    ev.add_argument("run_dir", help="a run directory (one method's: RUN/LABEL for a compare run)")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="evaluation-time setting, e.g. --set method.inference=global (repeatable)")
    ev.add_argument("--weights", choices=("best", "final"), default="best",
                    help="the selected round's model (default) or the last round's")
    ev.add_argument("--target", default=None, help="target domain or comma list (default: the run's targets)")
    _debug_flag(ev)
    data = sub.add_parser("data", help="fetch the public datasets into the data root ($RAYFED_DG_DATA, ~/data)")
    _debug_flag(data)
    dsub = data.add_subparsers(dest="data_command", required=True)
    fetch = dsub.add_parser("fetch", help="download, verify and unpack a dataset (resumable)")
    fetch.add_argument("name", help="pacs, office_home, vlcs, domainnet, digits_dg, camelyon17, terra_incognita")
    fetch.add_argument("--root", default=None, help="data root to install into (default: $RAYFED_DG_DATA or ~/data)")
    fetch.add_argument("--keep-archives", action="store_true", help="keep the downloaded archives in ROOT/.downloads")
    fetch.add_argument("--no-progress", action="store_true", help="no progress bar")
    _debug_flag(fetch)
    dlist = dsub.add_parser("list", help="the datasets 'data fetch' knows, where they go and whether they are there")
    _debug_flag(dlist)
    rep = sub.add_parser("report", help="target accuracy per method and model-selection rule, mean +- SE over seeds")
    rep.add_argument("run_dirs", nargs="+", help="run directories (a --seeds run, compare runs, or one per seed)")
    rep.add_argument("--format", choices=("md", "csv", "latex", "text"), default="md")
    _debug_flag(rep)
    col = sub.add_parser("collect", help="sweep folders (tune.py) to a paper table: values chosen per seed on "
                                         "source validation, target accuracy mean +- SE over seeds")
    col.add_argument("sweep_dirs", nargs="+", help="sweep folders, as tune.py prints them (runs/tune/NAME)")
    col.add_argument("--format", choices=("md", "csv", "latex", "text"), default="md")
    _debug_flag(col)
    plot = sub.add_parser("plot", help="figures of runs: learning curves, per-client loss, t-SNE / PCA of features")
    plot.add_argument("run_dirs", nargs="+", help="run directories (as for report)")
    plot.add_argument("--kind", choices=("curves", "clients", "tsne", "pca"), default="curves")
    plot.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots of the first)")
    plot.add_argument("--target", default=None, help="target domain or comma list (default: every target)")
    plot.add_argument("--weights", choices=("best", "final"), default="best",
                      help="tsne / pca: the selected round's model (default) or the last round's")
    plot.add_argument("--per-domain", type=int, default=200,
                      help="tsne / pca: held-out images per domain (seeded sample; default 200)")
    _debug_flag(plot)
    return p


def _partition(args) -> int:
    from rayfed_dg.config import load_config
    from rayfed_dg.data.protocol import manifest
    from rayfed_dg.engine.plan import load_data, resolve_targets, split_for
    from rayfed_dg.reporting import partition_clients_csv, partition_heatmap, partition_summary

    cfg = load_config(args.config, args.overrides)
    ds = load_data(cfg)
    target = resolve_targets(ds, args.target or "all", cfg.data.heldout_val_domain)[0]
    split = split_for(cfg, ds, target)
    out = Path(args.out)
    stem = f"{Path(args.config).stem}-{target}"
    table = out / f"{stem}-clients.csv"
    print(partition_summary(ds, split, table))
    out.mkdir(parents=True, exist_ok=True)
    write_table(manifest(ds, split), out / f"{stem}.parquet")
    write_text(partition_clients_csv(ds, split), table)
    p = cfg.partition
    title = f"{cfg.data.name} {p.strategy}" + (f" alpha={p.alpha}" if p.alpha else "") + \
        f", {split.num_clients} clients, target {target}"
    png = partition_heatmap(ds, split, out / f"{stem}.png", title)
    print(f"manifest {out / (stem + '.parquet')}\nclients  {table}\nheatmap  {png}")
    return 0


def parse_seeds(text: str | None) -> list[int] | None:
    """``--seeds 0,1,2`` -> [0, 1, 2]; None when not given."""
    from rayfed_dg.config import ConfigError

    if text is None:
        return None
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: expected a comma list of integers, e.g. --seeds 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: expected distinct integers, e.g. --seeds 0,1,2")
    return seeds


def _check_overrides(path: str | Path, overrides: list[str]) -> None:
    """A ``--set`` the run would ignore is an error naming why (checked on
    the file and its ``--set`` values as written, before validation)."""
    from rayfed_dg.config import ConfigError, _read_yaml, apply_overrides

    bad = [o for o in overrides if o.split("=", 1)[0].strip().split(".")[0] == "method"]
    if not bad:
        return
    rows = apply_overrides(_read_yaml(Path(path)), overrides).get("compare")
    if rows:
        labels = ", ".join(str(m.get("label") or m.get("name", "fedavg")) if isinstance(m, dict) else str(m)
                           for m in rows)
        raise ConfigError(f"--set {bad[0]}: {path} runs its compare: list ({labels}), whose rows replace the "
                          "method: section; add --set compare=null to run one method, or change the rows")


def _dry_overrides(cfg) -> list[str]:
    clients = cfg.partition.num_clients or 1
    # enough images that every client of the partition gets a few
    return ["training.rounds=1", "training.local_steps=1", "training.batch_size=4",
            f"data.limit_per_domain={max(24, 6 * clients)}", "partition.min_size=1",
            "evaluation.batch_size=8", "output.checkpoint_every=1"]


def _seed_dir(run_dir: Path, seed: int | None) -> Path:
    return run_dir if seed is None else run_dir / f"seed{seed}"


def _read_record(run_dir: Path) -> dict | None:
    from rayfed_dg.config import ConfigError

    path = run_dir / RUN_RECORD
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
        rec["targets"], rec["seeds"] = list(rec["targets"]), rec.get("seeds")
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"--resume {run_dir}: its {RUN_RECORD} is unreadable; resume with the config, --target "
                          "and --seeds it was started with (rayfed-dg run CONFIG --resume RUN_DIR ...)") from None
    return rec


def _resume_plan(args, seeds: list[int] | None):
    """(run directory, configs per seed, target argument) of ``--resume``:
    the run's own config(s), targets and seeds, unless given again (then they
    must match)."""
    from rayfed_dg.config import ConfigError, load_config, unrecorded_defaults

    run_dir = Path(args.resume)
    if args.run_dir is not None:
        raise ConfigError(f"--run-dir and --resume: --resume {run_dir} continues that directory; drop --run-dir")
    if args.dry_run:
        raise ConfigError("--dry-run and --resume: a dry run trains one round in a temporary directory and "
                          "cannot continue a run; drop one of them")
    if not run_dir.is_dir():
        raise ConfigError(f"--resume {run_dir}: no such directory")
    rec = _read_record(run_dir)
    if rec is not None:
        if seeds is not None and seeds != rec["seeds"]:
            was = "without --seeds" if rec["seeds"] is None else "with --seeds " + ",".join(map(str, rec["seeds"]))
            raise ConfigError(f"--seeds {args.seeds}: {run_dir} was started {was}; --resume continues those seeds "
                              "(drop --seeds)")
        seeds = rec["seeds"]
        target_arg = ",".join(rec["targets"])
    else:  # a run directory from before rayfed-dg recorded how runs were started
        if args.target is None:
            raise ConfigError(f"--resume {run_dir}: it has no {RUN_RECORD} (made by an older rayfed-dg), so its "
                              "targets are not recorded; give them again with --target (e.g. --target all)")
        target_arg = args.target
        if seeds is None and not (run_dir / "config.yaml").is_file() and any(run_dir.glob("seed*/config.yaml")):
            raise ConfigError(f"--resume {run_dir}: a --seeds run; resume it with the same --seeds")
    if args.config is not None:
        path = Path(args.config)
    else:
        each: list[int | None] = list(seeds) if seeds else [None]
        have = [d for d in (_seed_dir(run_dir, s) for s in each) if (d / "config.yaml").is_file()]
        if not have:
            raise ConfigError(f"--resume {run_dir}: no config.yaml there; not a rayfed-dg run directory")
        path = have[0] / "config.yaml"  # every seed's config is this one with its own training.seed
    _check_overrides(path, args.overrides)
    base = [(s, load_config(path, args.overrides + ([] if s is None else [f"training.seed={s}"])))
            for s in (list(seeds) if seeds else [None])]
    # the run's own config.yaml (a config given again is the user's, written without defaults): a default changed
    # since the run began would change its variant
    saved = _seed_dir(run_dir, seeds[0] if seeds else None) / "config.yaml"
    for line in unrecorded_defaults(saved) if saved.is_file() else []:
        print(f"rayfed-dg: warning: {saved} does not record {line}; resuming with these (this release's "
              "defaults)", file=sys.stderr)
    changed = environment_changes(rec.get("environment") if rec else None, environment())
    if changed:
        print(f"rayfed-dg: warning: {run_dir} was started with other code or libraries ({', '.join(changed)}); "
              "its remaining rounds may not give the numbers an uninterrupted run would", file=sys.stderr)
    return run_dir, base, target_arg, rec


def _write_record(run_dir: Path, exp, args, seeds: list[int] | None) -> None:
    """``run.json`` and each seed's ``config.yaml``, before the first
    federation: what ``--resume`` and ``report`` read."""
    from rayfed_dg.config import save_config

    for s, scfg in exp.configs.items():
        sdir = _seed_dir(run_dir, s)
        sdir.mkdir(parents=True, exist_ok=True)
        if not (sdir / "config.yaml").exists():
            save_config(scfg, sdir / "config.yaml")
    rec = {"targets": list(exp.targets), "seeds": seeds, "labels": exp.labels,
           "rounds": next(iter(exp.configs.values())).training.rounds,
           "config": args.config, "overrides": list(args.overrides), "rayfed_dg": __version__,
           "environment": environment()}
    write_text(json.dumps(rec, indent=2) + "\n", run_dir / RUN_RECORD)


@dataclass
class RunRequest:
    """What ``rayfed-dg run`` was asked (its flags, by the parser's names):
    the CLI and ``rayfed_dg.run`` (api.py) both hand one to ``execute_run``."""

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
    run_dir: Path
    exp: Any  # engine.experiment.Experiment
    seeds: list[int] | None
    by_seed: dict[int | None, dict[str, dict]]  # {seed: {label: summary}}
    tmp: Any = None  # a dry run's temporary directory (removed when this is dropped), else None


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during the federations; every finished round is on disk."""

    def __init__(self, run_dir: Path, kept: bool):
        self.run_dir, self.kept = run_dir, kept
        super().__init__("interrupted (a dry run keeps nothing)" if not kept else
                         f"interrupted; resume with: rayfed-dg run --resume {shlex.quote(str(run_dir))}")


def execute_run(args: RunRequest) -> RunOutcome:
    """Everything ``rayfed-dg run`` does but print its closing table: check
    the config(s), data and targets, make (or reopen) the run directory,
    record how the run was started, train every seed, row and target, and
    (``--seeds``) write the seeds' summary.  Ctrl-C raises ``RunInterrupted``."""
    from rayfed_dg.config import ConfigError, ExperimentConfig, load_config
    from rayfed_dg.engine import check_resume_dir, load_data, make_run_dir, resolve_targets
    from rayfed_dg.engine.experiment import plan_experiment, run_planned
    from rayfed_dg.engine.trackers import require_trackers

    seeds = parse_seeds(args.seeds)
    if seeds is not None:
        fixed = [o for o in args.overrides if o.split("=", 1)[0].strip() == "training.seed"]
        if fixed:
            raise ConfigError(f"--set {fixed[0]} and --seeds: each seed sets training.seed; drop one of them")
    rec = None
    cfgs: list[tuple[int | None, ExperimentConfig]]
    if args.resume:
        run_dir, cfgs, target_arg, rec = _resume_plan(args, seeds)
        seeds = None if cfgs[0][0] is None else [s for s, _ in cfgs if s is not None]
    else:
        if args.config is None:
            raise ConfigError("run: give the experiment's config (rayfed-dg run CONFIG), or --resume RUN_DIR to "
                              "continue a run")
        _check_overrides(args.config, args.overrides)
        first = load_config(args.config, args.overrides)
        dry = _dry_overrides(first) if args.dry_run else []
        # one config per seed (--seeds: training.seed set last)
        cfgs = \
            [(None, load_config(args.config, args.overrides + dry))] if seeds is None else \
            [(s, load_config(args.config, args.overrides + dry + [f"training.seed={s}"])) for s in seeds]
        target_arg = args.target
    cfg = cfgs[0][1]
    for _, scfg in cfgs:  # output.wandb / output.mlflow (a compare row keeps the output section): installed, answering
        require_trackers(scfg)
    ds = load_data(cfg)
    targets = resolve_targets(ds, target_arg, cfg.data.heldout_val_domain)
    if args.resume and rec is not None and args.target is not None and \
            resolve_targets(ds, args.target, cfg.data.heldout_val_domain) != targets:
        raise ConfigError(f"--target {args.target}: {run_dir} was started with --target {','.join(targets)}; "
                          "--resume continues those targets (drop --target)")
    exp = plan_experiment(cfgs, ds, targets)  # every check passes before anything is written
    tmp = None
    if args.resume:
        for s, scfg in cfgs:
            sdir = _seed_dir(run_dir, s)
            if s is None or sdir.exists():
                check_resume_dir(scfg, sdir)
    elif args.dry_run and args.run_dir is None:
        import tempfile

        # a dry run proves the config; it leaves no run directory behind unless asked to
        tmp = tempfile.TemporaryDirectory(prefix="rayfed-dg-dry-run-")
        run_dir = make_run_dir(cfg, tmp.name)
    else:
        run_dir = make_run_dir(cfg, args.run_dir)
    if rec is None:
        _write_record(run_dir, exp, args, seeds)
    skipped = ds.meta.get("skipped_files") or []
    if skipped:  # data.on_corrupt: skip (the loader warned, naming a few)
        write_text("\n".join(skipped) + "\n", run_dir / "skipped_images.txt")
    try:
        by_seed = run_planned(exp, run_dir, progress=not args.no_progress)
    except KeyboardInterrupt:
        raise RunInterrupted(run_dir, tmp is None) from None
    if seeds is not None:
        write_text(json.dumps({"seeds": {str(s): v for s, v in by_seed.items()}}, indent=2),
                   run_dir / "summary.json")
    return RunOutcome(run_dir, exp, seeds, by_seed, tmp)


def _run(args) -> int:
    if args.wandb:  # the flags are the config's output.wandb / output.mlflow sections, recorded like any --set
        args.overrides.append(f"output.wandb.project={args.wandb}")
    if args.mlflow:
        args.overrides.append(f"output.mlflow.tracking_uri={args.mlflow}")
    req = RunRequest(config=args.config, target=args.target, overrides=list(args.overrides), run_dir=args.run_dir,
                     resume=args.resume, seeds=args.seeds, dry_run=args.dry_run, no_progress=args.no_progress)
    try:
        out = execute_run(req)
    except RunInterrupted as e:
        print(f"rayfed-dg: {e}", file=sys.stderr)
        return 130
    where_to = "dry run: nothing kept (--run-dir DIR keeps its run directory)" if out.tmp is not None else \
        f"run dir {out.run_dir}"
    if out.seeds is None:
        from rayfed_dg.reporting import run_table

        print(f"\nTarget accuracy (%) at the round selected by mean source-validation accuracy; {where_to}")
        print(run_table(out.by_seed[None], out.run_dir))
        return 0
    from rayfed_dg.reporting import SE_NOTE, seeds_table

    print(f"\nTarget accuracy (%) over seeds {','.join(map(str, out.seeds))} ({SE_NOTE}); {where_to}")
    print(seeds_table([out.run_dir], "text"))
    return 0


def _evaluate(args) -> int:
    import numpy as np

    from rayfed_dg.engine import load_data, resolve_targets
    from rayfed_dg.engine.evaluate import evaluate_saved, load_run_config, run_targets

    run_dir = Path(args.run_dir)
    cfg = load_run_config(run_dir, args.overrides)
    ds = load_data(cfg)
    targets = resolve_targets(ds, args.target, cfg.data.heldout_val_domain) if args.target else run_targets(run_dir)
    res = evaluate_saved(cfg, ds, targets, run_dir, args.weights)
    what = " ".join(args.overrides) or "the run's own settings"
    print(f"{run_dir} ({cfg.method.name}), {args.weights} models, {what}")
    rows = [[t, f"{100 * r['source_val']:.2f}", f"{100 * r['target_test']:.2f}"] for t, r in res.items()]
    rows.append(["avg", f"{100 * np.mean([r['source_val'] for r in res.values()]):.2f}",
                 f"{100 * np.mean([r['target_test'] for r in res.values()]):.2f}"])
    print(render_table(["target", "source val", "target test"], rows))
    return 0


def _report(args) -> int:
    import warnings

    from rayfed_dg.reporting import SE_NOTE, check_report_inputs, mixed_environments, seeds_table, unfinished_runs

    dirs = [Path(p) for p in args.run_dirs]
    check_report_inputs(dirs)
    for line in unfinished_runs(dirs) + mixed_environments(dirs):
        warnings.warn(line, stacklevel=1)
    caption = (f"Target accuracy (%) at the round each model-selection rule picks; {SE_NOTE}. "
               "The test-domain oracle is an upper bound and never chooses anything")
    return _print_table(caption, seeds_table(dirs, args.format), args.format)


def _print_table(caption: str, table: str, fmt: str) -> int:
    """A table under its caption: a line above it (Markdown, text), a LaTeX
    comment, or nothing (CSV, for a spreadsheet)."""
    if fmt in ("md", "text"):
        print(caption + ".\n")
    elif fmt == "latex":
        print("% " + caption)
    print(table)
    return 0


def _collect(args) -> int:
    from rayfed_dg.tuning import COLLECT_CAPTION, collect

    return _print_table(COLLECT_CAPTION, collect([Path(p) for p in args.sweep_dirs], args.format), args.format)


def _plot(args) -> int:
    from rayfed_dg.plots import plot_runs

    for path in plot_runs([Path(p) for p in args.run_dirs], args.kind, Path(args.out) if args.out else None,
                          args.target, args.weights, args.per_domain):
        print(path)
    return 0


def _data(args) -> int:
    from rayfed_dg.data.fetch import describe, fetch
    from rayfed_dg.data.sources import DATA_ENV, data_root

    if args.data_command == "list":
        # the root on a line of its own: a long path must not push the explanation past a terminal's width
        print(f"data root: {data_root()}")
        print(f"  set by ${DATA_ENV} (default ~/data); configs name dataset folders relative to it")
        rows, sources = describe()
        print(render_table(["name", "folder", "present", "checks"], rows))
        print("\nwhere each comes from (rayfed-dg data fetch NAME):")
        print(sources)
        return 0
    dest = fetch(args.name, args.root, progress=not args.no_progress, keep_archives=args.keep_archives)
    print(dest)
    return 0


def _dispatch(args) -> int:
    if args.command == "data":
        return _data(args)
    if args.command == "report":
        return _report(args)
    if args.command == "plot":
        return _plot(args)
    if args.command == "collect":
        return _collect(args)
    if args.command == "evaluate":
        return _evaluate(args)
    return _run(args) if args.command == "run" else _partition(args)


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    return run_cli("rayfed-dg", lambda: _dispatch(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
