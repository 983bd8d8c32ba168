"""rayfed-dg: run leave-one-domain-out federations from a YAML config.

Bad input (config, data, resources) ends with one line on stderr and a
non-zero exit (2 for bad input, 1 for other failures); ``--debug`` shows the
traceback.  Nothing is written before the config, the data and the targets
have been checked.  A run records how it was started (``run.json``: targets,
seeds, ``--set`` values, the code's commit and library versions) and its
config before its first federation, so ``rayfed-dg run --resume RUN_DIR``
needs nothing else, and Ctrl-C prints that command.  Each command is a face:
``run`` over the run service (``engine/running/service.py``), the others over the
run directory (``engine/store/rundir.py``) and ``reporting``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TypeAlias

from rayfed_dg._version import __version__
from rayfed_dg.utils import render_table, run_cli, write_table, write_text


def _debug_flag(parser: argparse.ArgumentParser, top: bool = False) -> None:
    # a sub-command's flag only when given, so ``rayfed-dg --debug run ...`` keeps the top-level one
    parser.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="show the traceback of an error")


Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # what add_subparsers returns


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayfed-dg", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"rayfed-dg {__version__}")
    _debug_flag(p, top=True)
    sub = p.add_subparsers(dest="command", required=True)
    # in this order in ``--help``
    for add in (_add_run, _add_partition, _add_evaluate, _add_data, _add_report, _add_collect, _add_privacy,
                _add_devices, _add_plot):
        add(sub)
    return p


def _add_run(sub: Subcommands) -> None:
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
                          "seeds (rayfed-dg run --resume RUN_DIR); a URI (s3://bucket/prefix/NAME, the copy "
                          "output.sync_to keeps) is downloaded first, to $RAYFED_DG_CACHE/runs")
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


def _add_partition(sub: Subcommands) -> None:
    part = sub.add_parser("partition", help="summarise a config's partition, write its manifest and heatmap")
    part.add_argument("config")
    part.add_argument("--target", default=None, help="target domain (default: the first)")
    part.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    part.add_argument("--out", default="partitions",
                      help="folder for the manifest, the per-client table and the heatmap (default: partitions)")
    _debug_flag(part)


def _add_evaluate(sub: Subcommands) -> None:
    ev = sub.add_parser("evaluate", help="evaluate a run's saved models again with evaluation-time settings changed")
    ev.add_argument("run_dir", help="a run directory (one method's: RUN/LABEL for a compare run)")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="evaluation-time setting, e.g. --set method.inference=global (repeatable)")
    ev.add_argument("--weights", choices=("best", "final"), default="best",
                    help="the selected round's model (default) or the last round's")
    ev.add_argument("--target", default=None, help="target domain or comma list (default: the run's targets)")
    _debug_flag(ev)


def _add_data(sub: Subcommands) -> None:
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


def _add_report(sub: Subcommands) -> None:
    rep = sub.add_parser("report", help="target accuracy per method and model-selection rule, mean +- SE over seeds")
    rep.add_argument("run_dirs", nargs="+", help="run directories (a --seeds run, compare runs, or one per seed)")
    rep.add_argument("--format", choices=("md", "csv", "latex", "text"), default="md")
    _debug_flag(rep)


def _add_collect(sub: Subcommands) -> None:
    col = sub.add_parser("collect", help="sweep folders (tune.py) to a paper table: values chosen per seed on "
                                         "source validation, target accuracy mean +- SE over seeds")
    col.add_argument("sweep_dirs", nargs="+", help="sweep folders, as tune.py prints them (runs/tune/NAME)")
    col.add_argument("--format", choices=("md", "csv", "latex", "text"), default="md")
    _debug_flag(col)


def _config_args(parser: argparse.ArgumentParser, target_help: str) -> None:
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--target", default=None, help=target_help)


def _add_privacy(sub: Subcommands) -> None:
    priv = sub.add_parser("privacy", help="differential privacy: the noise a run needs for a target epsilon")
    _debug_flag(priv)
    psub = priv.add_subparsers(dest="privacy_command", required=True)
    cal = psub.add_parser("calibrate", help="the update noise multiplier z at which the config's rounds spend "
                                            "--epsilon at privacy.delta (its clients, clients per round, accountant)")
    _config_args(cal, "target domain whose partition counts (default: the first)")
    cal.add_argument("--epsilon", type=float, required=True, help="the target epsilon")
    _debug_flag(cal)


def _add_devices(sub: Subcommands) -> None:
    dev = sub.add_parser("devices", help="the device model's clock: calibration, traces in other simulators' "
                                         "formats")
    _debug_flag(dev)
    dsub = dev.add_subparsers(dest="devices_command", required=True)
    cal = dsub.add_parser("calibrate", help="measure devices.step_seconds and overhead_s on this machine: the "
                                            "config's trainings at two numbers of local steps")
    _config_args(cal, "the target domain whose federation runs (default: the first)")
    cal.add_argument("--steps", default="2,8", metavar="A,B", help="the two numbers of local steps (default 2,8)")
    cal.add_argument("--rounds", type=int, default=3, help="rounds of each (round 1 left out; default 3)")
    cal.add_argument("--out", default=None, help="write the measurement (JSON) here")
    _debug_flag(cal)
    conv = dsub.add_parser("convert", help="FedScale's or FLASH's device traces to the engine's CSV files "
                                           "(speeds.csv, bandwidth.csv, availability.csv)")
    conv.add_argument("--format", choices=("fedscale", "flash"), required=True)
    conv.add_argument("--capacity", default=None, help="FedScale's client_device_capacity (speeds, bandwidths)")
    conv.add_argument("--availability", default=None,
                      help="FedScale's client_behave_trace or FLASH's state_traces.json")
    conv.add_argument("--clients", type=int, required=True, help="the run's number of clients")
    conv.add_argument("--out", required=True, help="folder for the CSV files")
    _debug_flag(conv)


def _add_plot(sub: Subcommands) -> None:
    plot = sub.add_parser("plot", help="figures of runs: learning curves, per-client loss, t-SNE / PCA of features")
    plot.add_argument("run_dirs", nargs="+", help="run directories (as for report)")
    plot.add_argument("--kind", choices=("curves", "clients", "tsne", "pca"), default="curves")
    plot.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots of the first)")
    plot.add_argument("--target", default=None, help="target domain or comma list (default: every target)")
    plot.add_argument("--weights", choices=("best", "final"), default="best",
                      help="tsne / pca: the selected round's model (default) or the last round's")
    plot.add_argument("--per-domain", type=int, default=200,
                      help="tsne / pca: held-out images per domain (seeded sample; default 200)")
    plot.add_argument("--x", choices=("round", "sim_time"), default="round",
                      help="curves: against rounds (default) or the simulated seconds of the device model's clock "
                           "(runs with devices.enabled)")
    _debug_flag(plot)


def _partition(args) -> int:
    from rayfed_dg.config import load_config
    from rayfed_dg.data.protocol import manifest
    from rayfed_dg.engine.running.plan import load_data, resolve_targets, split_for
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


def _run(args) -> int:
    if args.wandb:  # the flags are the config's output.wandb / output.mlflow sections, recorded like any --set
        args.overrides.append(f"output.wandb.project={args.wandb}")
    if args.mlflow:
        args.overrides.append(f"output.mlflow.tracking_uri={args.mlflow}")
    from rayfed_dg.engine.running.service import RunInterrupted, RunRequest, execute_run
    from rayfed_dg.reporting import SE_NOTE, run_table, seeds_table

    req = RunRequest(config=args.config, target=args.target, overrides=list(args.overrides), run_dir=args.run_dir,
                     resume=args.resume, seeds=args.seeds, dry_run=args.dry_run, no_progress=args.no_progress)
    try:
        out = execute_run(req)
    except RunInterrupted as e:
        from rayfed_dg.engine.store.rundir import RunDir

        # the tasks and actor creations the interrupt abandoned fail as Ray tears them down; Ray would log each
        # such result as an "unhandled error" when its reference is collected at exit, after the line below
        os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"

        copy = RunDir(e.run_dir).mirror() if e.kept else None
        print(f"rayfed-dg: {e}" + (f"; or on another machine: rayfed-dg run --resume {copy.uri}" if copy else ""),
              file=sys.stderr)
        return 130
    where_to = "dry run: nothing kept (--run-dir DIR keeps its run directory)" if out.tmp is not None else \
        f"run dir {out.run_dir.path}"
    if out.seeds is None:
        print(f"\nTarget accuracy (%) at the round selected by mean source-validation accuracy; {where_to}")
        print(run_table(out.by_seed[None], out.run_dir.path))
    else:
        print(f"\nTarget accuracy (%) over seeds {','.join(map(str, out.seeds))} ({SE_NOTE}); {where_to}")
        print(seeds_table([out.run_dir.path], "text"))
    return 0


def _evaluate(args) -> int:
    import numpy as np

    from rayfed_dg.engine import RunDir, load_data, resolve_targets
    from rayfed_dg.engine.running.reevaluate import evaluate_saved, load_run_config

    run_dir = Path(args.run_dir)
    cfg = load_run_config(run_dir, args.overrides)
    ds = load_data(cfg)
    targets = resolve_targets(ds, args.target, cfg.data.heldout_val_domain) if args.target else \
        RunDir(run_dir).targets()
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

    from rayfed_dg import reporting as rep

    dirs = [Path(p) for p in args.run_dirs]
    rep.check_report_inputs(dirs)
    for line in rep.unfinished_runs(dirs) + rep.mixed_environments(dirs):
        warnings.warn(line, stacklevel=1)
    caption = (f"Target accuracy (%) at the round each model-selection rule picks; {rep.SE_NOTE}. "
               "The test-domain oracle is an upper bound and never chooses anything")
    _print_table(caption, rep.seeds_table(dirs, args.format), args.format)
    clock = rep.clock_table(dirs, args.format) if args.format != "csv" else None  # CSV: one table, for a spreadsheet
    if clock is not None:
        print()
        _print_table(rep.CLOCK_CAPTION, clock, args.format)
    private = rep.privacy_table(dirs, args.format) if args.format != "csv" else None
    if private is not None:
        print()
        _print_table(rep.PRIVACY_CAPTION, private, args.format)
    return 0


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
                          args.target, args.weights, args.per_domain, args.x):
        print(path)
    return 0


def _privacy(args) -> int:
    """``privacy calibrate``: z for the model updates alone (payload releases are known only by running)."""
    from rayfed_dg.engine.running.service import calibrate

    z, note = calibrate(args.config, args.epsilon, args.overrides, args.target)
    print(f"privacy.updates.noise_multiplier={z:.4f}")  # rounded up: never past epsilon
    print(f"rayfed-dg: {note}", file=sys.stderr)
    return 0


def _devices(args) -> int:
    from rayfed_dg.errors import ConfigError

    if args.devices_command == "calibrate":
        return _calibrate_devices(args)
    from rayfed_dg.engine.clock.traces import convert

    if args.clients < 1:
        raise ConfigError(f"--clients {args.clients}: give the run's number of clients (at least 1)")
    for path in convert(args.format, args.clients, Path(args.out), args.capacity, args.availability):
        print(path)
    return 0


def _calibrate_devices(args) -> int:
    import json

    from rayfed_dg.engine.running.calibration import calibrate_clock
    from rayfed_dg.errors import ConfigError

    try:
        a, b = (int(v) for v in args.steps.split(","))
    except ValueError:
        raise ConfigError(f"--steps {args.steps}: give two numbers of local steps, e.g. --steps 2,8") from None
    rec = calibrate_clock(args.config, args.overrides, args.target, (a, b), args.rounds)
    lo, hi = rec["step_seconds_5_95"]
    n = len(rec["trainings"][str(a)]) + len(rec["trainings"][str(b)])
    print(f"a local step of a full batch: {rec['step_seconds']:.4g} s (5-95 % {lo:.4g}-{hi:.4g}); a training "
          f"besides its steps: {rec['overhead_s']:.4g} s; from {n} trainings of {a} and {b} steps on "
          f"{rec['machine']['processor']}, {rec['workers'] or 'auto'} worker(s)")
    over = max(0.0, rec["overhead_s"])  # a negative intercept is noise: no training costs less than its steps
    print(f"--set devices.step_seconds={rec['step_seconds']:.6g} --set devices.overhead_s={over:.6g}")
    if args.out:
        write_text(json.dumps(rec, indent=1) + "\n", Path(args.out))
        print(args.out)
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
    if args.command == "privacy":
        return _privacy(args)
    if args.command == "devices":
        return _devices(args)
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
