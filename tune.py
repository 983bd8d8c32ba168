#!/usr/bin/env python
"""Sweep a method's hyper-parameters over whole federated runs with Ray Tune.

    python tune.py --space NAME [--config CONFIG] [--target DOMAIN|all] [--samples N]
                   [--scheduler fifo|asha] [--resume] [--set k=v ...]
                   [--storage DIR|s3://BUCKET/PREFIX] [--keep-checkpoints N]
                   [--wandb PROJECT] [--mlflow TRACKING_URI]

Spaces are the YAML files in tuning/.  Model selection follows the DG
protocol: rounds and values are chosen by mean source-validation accuracy;
target accuracy is recorded, never used to choose.  Writes trials.parquet,
selection.parquet, selection.md and chosen_config.yaml in the sweep folder;
each trial's TensorBoard scalars go to <trial>/tensorboard/<target>.
"""
from __future__ import annotations

import argparse
import shlex
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--space", required=True, help="search space: a name (tuning/NAME.yaml) or a YAML file")
    ap.add_argument("--config", default=None, help="experiment config (default: the space's)")
    ap.add_argument("--target", default="all", help="target domain, comma list, or all (one trial per target)")
    ap.add_argument("--samples", type=int, default=1, help="samples per grid point / random draws")
    ap.add_argument("--seeds", default=None, metavar="S,S,...",
                    help="run every value and target once per training seed; each seed chooses its own value "
                         "(rayfed-dg collect SWEEP prints the paper table)")
    ap.add_argument("--scheduler", choices=["fifo", "asha"], default="fifo")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted sweep")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--storage", default="runs/tune",
                    help="where sweeps are kept: a folder, or a URI every node can write (s3://bucket/tune)")
    ap.add_argument("--keep-checkpoints", type=int, default=None, metavar="N",
                    help="checkpoints kept per trial (default 2: a resumed trial needs its latest)")
    ap.add_argument("--wandb", metavar="PROJECT", default=None,
                    help="also log trials to Weights & Biases (Ray Tune's WandbLoggerCallback; needs wandb)")
    ap.add_argument("--mlflow", metavar="TRACKING_URI", default=None,
                    help="also log trials to MLflow (Ray Tune's MLflowLoggerCallback; needs mlflow)")
    ap.add_argument("--tune-tables", action="store_true",
                    help="print Ray Tune's own status tables instead of a progress bar")
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)

    from rayfed_dg.errors import ConfigError
    from rayfed_dg.tuning import KEEP_CHECKPOINTS, SweepInterrupted, run_sweep
    from rayfed_dg.utils import run_cli

    def sweep() -> int:
        try:
            seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
        except ValueError:
            raise ConfigError(f"--seeds {args.seeds}: expected integers separated by commas, e.g. 0,1,2") from None
        given = list(argv if argv is not None else sys.argv[1:])
        again = shlex.join(["python", "tune.py", *given] + ([] if args.resume else ["--resume"]))
        try:
            out = run_sweep(args.space, args.config, args.target, args.samples, args.scheduler, args.resume,
                            args.overrides, args.storage, wandb_project=args.wandb, mlflow_uri=args.mlflow,
                            verbose=2 if args.tune_tables else 1, seeds=seeds,
                            keep=KEEP_CHECKPOINTS if args.keep_checkpoints is None else args.keep_checkpoints)
        except SweepInterrupted:
            print(f"tune.py: interrupted before any trial reported a round; nothing chosen; continue with: {again}",
                  file=sys.stderr)
            return 130
        print(f"\nTarget accuracy at each target's round selected by source validation; sweep {out['path']}")
        print(out["table"])
        if out["complete"]:
            print(f"chosen by mean source validation: {out['chosen']}  (config: {out['path']}/chosen_config.yaml)")
            return 0
        left = [r for r in out["records"] if not r["finished"]]
        failed = [r for r in left if r["status"] == "ERROR"]
        print(f"tune.py: {len(left)} of {len(out['records'])} trials unfinished"
              f"{f' ({len(failed)} failed)' if failed else ''}; nothing chosen; continue with: {again}",
              file=sys.stderr)
        return 1 if failed and len(failed) == len(left) else 130

    return run_cli("tune.py", sweep, args.debug)


if __name__ == "__main__":
    sys.exit(main())
