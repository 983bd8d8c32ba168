"""``rayfed-dg``: run leave-one-domain-out federations from a YAML config.

Bad input (config, data, resources) ends with one line on stderr and a
non-zero exit (2 for bad input, 1 for other failures); ``--debug`` shows the
traceback.  Nothing is written before the config, the data and the targets
have been checked.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rayfed_dg.utils import render_table, run_cli, write_table, write_text


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayfed-dg", description=__doc__.splitlines()[0])
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train leave-one-domain-out federations")
    run.add_argument("config", help="experiment YAML file")
    run.add_argument("--target", default="all", help="target domain, comma list, or 'all' (default)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set training.lr=0.01 (repeatable)")
    run.add_argument("--run-dir", default=None, help="output directory (default: output.root/name-timestamp)")
    run.add_argument("--resume", metavar="RUN_DIR", default=None,
                     help="continue RUN_DIR (made with the same config) from its last complete checkpoint")
    run.add_argument("--seeds", default=None, metavar="S,S,...",
                     help="run each training seed in turn into RUN_DIR/seed<S> and end with mean +- SE over seeds")
    run.add_argument("--no-progress", action="store_true", help="no live progress bars")
    run.add_argument("--dry-run", action="store_true",
                     help="prove the config builds and trains: 1 round, 1 local step, a few images per client "
                          "(in a temporary directory unless --run-dir is given)")
    run.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    part = sub.add_parser("partition", help="summarise a config's partition, write its manifest and heatmap")
    part.add_argument("config")
    part.add_argument("--target", default=None, help="target domain (default: the first)")
    part.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    part.add_argument("--out", default="partitions", help="folder for the manifest and heatmap")
    part.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    ev = sub.add_parser("evaluate", help="evaluate a run's saved models again with evaluation-time settings changed")
    ev.add_argument("run_dir", help="a run directory (one method's: RUN/LABEL for a compare run)")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="evaluation-time setting, e.g. --set method.inference=global (repeatable)")
    ev.add_argument("--weights", choices=("best", "final"), default="best",
                    help="the selected round's model (default) or the last round's")
    ev.add_argument("--target", default=None, help="target domain or comma list (default: the run's targets)")
    ev.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    data = sub.add_parser("data", help="fetch the public datasets into the data root ($RAYFED_DG_DATA, ~/data)")
    dsub = data.add_subparsers(dest="data_command", required=True)
    fetch = dsub.add_parser("fetch", help="download, verify and unpack a dataset (resumable)")
    fetch.add_argument("name", help="pacs, office_home, vlcs, domainnet, digits_dg, camelyon17, terra_incognita")
    fetch.add_argument("--root", default=None, help="data root to install into (default: $RAYFED_DG_DATA or ~/data)")
    fetch.add_argument("--keep-archives", action="store_true", help="keep the downloaded archives in ROOT/.downloads")
    fetch.add_argument("--no-progress", action="store_true", help="no progress bar")
    fetch.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    dlist = dsub.add_parser("list", help="the datasets `data fetch` knows, where they go and whether they are there")
    dlist.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    rep = sub.add_parser("report", help="target accuracy per method and model-selection rule, mean +- SE over seeds")
    rep.add_argument("run_dirs", nargs="+", help="run directories (a --seeds run, compare runs, or one per seed)")
    rep.add_argument("--format", choices=("md", "csv", "latex", "text"), default="md")
    rep.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    plot = sub.add_parser("plot", help="figures of runs: learning curves, per-client loss, t-SNE / PCA of features")
    plot.add_argument("run_dirs", nargs="+", help="run directories (as for report)")
    plot.add_argument("--kind", choices=("curves", "clients", "tsne", "pca"), default="curves")
    plot.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots of the first)")
    plot.add_argument("--target", default=None, help="target domain or comma list (default: every target)")
    plot.add_argument("--weights", choices=("best", "final"), default="best",
                      help="tsne / pca: the selected round's model (default) or the last round's")
    plot.add_argument("--per-domain", type=int, default=200,
                      help="tsne / pca: held-out images per domain (seeded sample; default 200)")
    plot.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return p


def _partition(args) -> int:
    from rayfed_dg.config import load_config
    from rayfed_dg.data.protocol import manifest
    from rayfed_dg.engine.plan import load_data, resolve_targets, split_for
    from rayfed_dg.reporting import partition_heatmap, partition_summary

    cfg = load_config(args.config, args.overrides)
    ds = load_data(cfg)
    target = resolve_targets(ds, args.target)[0] if args.target else ds.domain_names[0]
    split = split_for(cfg, ds, target)
    print(partition_summary(ds, split))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{Path(args.config).stem}-{target}"
    write_table(manifest(ds, split), out / f"{stem}.parquet")
    p = cfg.partition
    title = f"{cfg.data.name} {p.strategy}" + (f" alpha={p.alpha}" if p.alpha else "") + \
        f", {split.num_clients} clients, target {target}"
    png = partition_heatmap(ds, split, out / f"{stem}.png", title)
    print(f"manifest {out / (stem + '.parquet')}\nheatmap  {png}")
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


def _run(args) -> int:
    from rayfed_dg.config import ConfigError, ExperimentConfig, load_config
    from rayfed_dg.engine import check_resume_dir, format_table, load_data, make_run_dir, resolve_targets
    from rayfed_dg.engine.experiment import plan_experiment, run_planned

    seeds = parse_seeds(args.seeds)
    dry = []
    if args.dry_run:
        clients = load_config(args.config, args.overrides).partition.num_clients or 1
        # enough images that every client of the partition gets a few
        dry = ["training.rounds=1", "training.local_steps=1", "training.batch_size=4",
               f"data.limit_per_domain={max(24, 6 * clients)}", "partition.min_size=1",
               "evaluation.batch_size=8", "output.checkpoint_every=1"]
    # one config per seed (--seeds: training.seed set last, so it wins over --set)
    cfgs: list[tuple[int | None, ExperimentConfig]] = \
        [(None, load_config(args.config, args.overrides + dry))] if seeds is None else \
        [(s, load_config(args.config, args.overrides + dry + [f"training.seed={s}"])) for s in seeds]
    cfg = cfgs[0][1]
    ds = load_data(cfg)
    targets = resolve_targets(ds, args.target)
    exp = plan_experiment(cfgs, ds, targets)  # every check passes before anything is written
    if args.resume:
        run_dir = Path(args.resume)
        for s, scfg in cfgs:
            sdir = run_dir if s is None else run_dir / f"seed{s}"
            if s is None and not (sdir / "config.yaml").is_file() and any(run_dir.glob("seed*/config.yaml")):
                raise ConfigError(f"--resume {run_dir}: a --seeds run; resume it with the same --seeds")
            if s is None or sdir.exists():
                check_resume_dir(scfg, sdir)
    elif args.dry_run and args.run_dir is None:
        import tempfile

        # a dry run proves the config; it leaves no run directory behind unless asked to
        tmp = tempfile.TemporaryDirectory(prefix="rayfed-dg-dry-run-")
        run_dir = make_run_dir(cfg, tmp.name)
    else:
        run_dir = make_run_dir(cfg, args.run_dir)
    by_seed = run_planned(exp, run_dir, progress=not args.no_progress)
    if seeds is None:
        print(f"\nTarget accuracy (%) at the round selected by mean source-validation accuracy; run dir {run_dir}")
        print(format_table(by_seed[None]))
        return 0
    from rayfed_dg.reporting import SE_NOTE, seeds_table

    write_text(json.dumps({"seeds": {str(s): v for s, v in by_seed.items()}}, indent=2), run_dir / "summary.json")
    print(f"\nTarget accuracy (%) over seeds {','.join(map(str, seeds))} ({SE_NOTE}); run dir {run_dir}")
    print(seeds_table([run_dir], "text"))
    return 0


def _evaluate(args) -> int:
    import numpy as np

    from rayfed_dg.engine import load_data, resolve_targets
    from rayfed_dg.engine.evaluate import evaluate_saved, load_run_config, run_targets

    run_dir = Path(args.run_dir)
    cfg = load_run_config(run_dir, args.overrides)
    ds = load_data(cfg)
    targets = resolve_targets(ds, args.target) if args.target else run_targets(run_dir)
    res = evaluate_saved(cfg, ds, targets, run_dir, args.weights)
    what = " ".join(args.overrides) or "the run's own settings"
    print(f"{run_dir} ({cfg.method.name}), {args.weights} models, {what}")
    rows = [[t, f"{100 * r['source_val']:.2f}", f"{100 * r['target_test']:.2f}"] for t, r in res.items()]
    rows.append(["avg", f"{100 * np.mean([r['source_val'] for r in res.values()]):.2f}",
                 f"{100 * np.mean([r['target_test'] for r in res.values()]):.2f}"])
    print(render_table(["target", "source val", "target test"], rows))
    return 0


def _report(args) -> int:
    from rayfed_dg.reporting import SE_NOTE, seeds_table

    caption = (f"Target accuracy (%) at the round each model-selection rule picks; {SE_NOTE}. "
               "The test-domain oracle is an upper bound and never chooses anything.")
    table = seeds_table([Path(p) for p in args.run_dirs], args.format)
    if args.format in ("md", "text"):
        print(caption + "\n")
    elif args.format == "latex":
        print("% " + caption)
    print(table)
    return 0


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
        print(f"data root {data_root()} (${DATA_ENV}, default ~/data); configs name folders relative to it")
        print(render_table(["name", "data.name", "folder", "archives", "checks", "present", "source"], describe()))
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
    if args.command == "evaluate":
        return _evaluate(args)
    return _run(args) if args.command == "run" else _partition(args)


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    return run_cli("rayfed-dg", lambda: _dispatch(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
