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
    rep = sub.add_parser("report", help="table of target accuracy over runs (seeds) per method")
    rep.add_argument("run_dirs", nargs="+")
    rep.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
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


def _run(args) -> int:
    from rayfed_dg.config import load_config
    from rayfed_dg.engine import (
        check_resume_dir,
        format_table,
        load_data,
        make_run_dir,
        preflight,
        resolve_targets,
        resolve_variants,
        run_experiment,
    )

    dry = []
    if args.dry_run:
        clients = load_config(args.config, args.overrides).partition.num_clients or 1
        # enough images that every client of the partition gets a few
        dry = ["training.rounds=1", "training.local_steps=1", "training.batch_size=4",
               f"data.limit_per_domain={max(24, 6 * clients)}", "partition.min_size=1",
               "evaluation.batch_size=8", "output.checkpoint_every=1"]
    cfg = load_config(args.config, args.overrides + dry)
    ds = load_data(cfg)
    targets = resolve_targets(ds, args.target)
    # partition errors surface before anything is written; a row with its own partition gets its own splits
    variants = resolve_variants(cfg, ds, targets)
    for _, vcfg, splits in variants:
        preflight(vcfg, splits, ds.num_classes)
    if args.resume:
        run_dir = Path(args.resume)
        check_resume_dir(cfg, run_dir)
    elif args.dry_run and args.run_dir is None:
        import tempfile

        # a dry run proves the config; it leaves no run directory behind unless asked to
        tmp = tempfile.TemporaryDirectory(prefix="rayfed-dg-dry-run-")
        run_dir = make_run_dir(cfg, tmp.name)
    else:
        run_dir = make_run_dir(cfg, args.run_dir)
    from rayfed_dg.config import save_config

    if not (run_dir / "config.yaml").exists():
        save_config(cfg, run_dir / "config.yaml")
    summaries = {}
    for label, vcfg, splits in variants:
        sub = run_dir if len(variants) == 1 else run_dir / label
        sub.mkdir(parents=True, exist_ok=True)
        print(f"== {label}: {len(targets)} target(s), {vcfg.training.rounds} rounds -> {sub}", file=sys.stderr)
        summary = run_experiment(vcfg, ds, targets, sub, progress=not args.no_progress, splits=splits)
        summaries[label] = summary
    if len(variants) > 1:
        write_text(json.dumps(summaries, indent=2), run_dir / "summary.json")
    print(f"\nTarget accuracy (%) at the round selected by mean source-validation accuracy; run dir {run_dir}")
    print(format_table(summaries))
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


def _dispatch(args) -> int:
    if args.command == "report":
        from rayfed_dg.reporting import seeds_table

        print(seeds_table([Path(p) for p in args.run_dirs]))
        return 0
    if args.command == "evaluate":
        return _evaluate(args)
    return _run(args) if args.command == "run" else _partition(args)


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    return run_cli("rayfed-dg", lambda: _dispatch(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
