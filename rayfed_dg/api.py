"""``rayfed_dg.run``: ``rayfed-dg run`` from Python (a notebook, a script).

    import rayfed_dg
    result = rayfed_dg.run("configs/quickstart.yaml", target="colour",
                           overrides={"training.rounds": 2, "compare": None})
    result.metrics          # DataFrame: every evaluation row of every method and seed
    print(result.table())   # what ``rayfed-dg report RUN_DIR`` prints
    again = rayfed_dg.load(result.run_dir)  # the same, from the run directory
    rayfed_dg.run(resume="s3://bucket/runs/NAME")  # continue a run (a folder, or its output.sync_to copy)
    z = rayfed_dg.calibrate("configs/quickstart.yaml", epsilon=4)  # rayfed-dg privacy calibrate
    print(rayfed_dg.collect(["runs/tune/lambda"]))  # rayfed-dg collect: sweeps to a paper table

It is the CLI's own run (the run service, ``engine.running.service.execute_run``:
the same checks, run directory, ``run.json`` and federations), so the
numbers are those of ``rayfed-dg run`` with the same config, bit for bit,
and ``rayfed-dg report`` / ``plot`` / ``run --resume`` read its run
directory as any other.
``overrides`` are ``--set`` values with Python values: ``{"training.lr":
0.01}`` is ``--set training.lr=0.01`` (``None`` is ``null``).  Both read
the run directory through ``engine.store.rundir.RunDir``, as ``report`` does.
"""
from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunResult", "calibrate", "collect", "load", "run"]

TABLES = ("metrics", "clients", "ledger", "privacy", "rounds")


@dataclass
class RunResult:
    """A finished run.  ``metrics``, ``clients``, ``ledger``, ``privacy``
    (epsilon per round and group; empty without a ``privacy:`` section) and
    ``rounds`` (each round's wall seconds; empty for a run of an earlier
    release until a resume writes them) are the run
    directory's tables (pandas DataFrames, or pyarrow Tables without pandas)
    over every row (method) and seed, in the order they ran, with two
    leading columns ``label`` and ``seed``; past those, each sub-run's rows
    are exactly its ``<table>.parquet``.  ``summary`` is the table ``rayfed-dg
    report`` prints, one dict a row (cells as printed: percent, mean ± SE);
    ``table()`` is that table in Markdown."""

    run_dir: Path
    metrics: Any
    clients: Any
    ledger: Any
    privacy: Any
    rounds: Any
    summary: list[dict[str, str]]
    _markdown: str = field(default="", repr=False)

    def table(self) -> str:
        return self._markdown


def _value(v: Any) -> str:
    """A Python value as ``--set`` text that YAML reads back as the same value."""
    import yaml

    return yaml.safe_dump(v, default_flow_style=True, width=1 << 30).strip().removesuffix("\n...")


def _overrides(overrides: Mapping[str, Any] | None) -> list[str]:
    from rayfed_dg.config import ConfigError

    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise ConfigError("overrides: expected a mapping of dotted keys to values, e.g. {'training.lr': 0.01}")
    return [f"{k}={_value(v)}" for k, v in overrides.items()]


def _seeds(seeds: Sequence[int] | str | None) -> str | None:
    if seeds is None or isinstance(seeds, str):
        return seeds
    return ",".join(str(int(s)) for s in seeds)


def _result(root: Path, rows: list[tuple[str, int | None, Any]]) -> RunResult:
    """The run directory ``root`` with its (label, seed, ``RunDir``) rows:
    each table over them, as DataFrames if pandas is there, and the report."""
    import pyarrow as pa

    from rayfed_dg.reporting import seeds_table

    parts: dict[str, list] = {name: [] for name in TABLES}
    for label, seed, where in rows:
        for name in TABLES:
            t = where.read_table(name)
            t = t.add_column(0, "seed", pa.array([seed] * len(t), pa.int64()))
            parts[name].append(t.add_column(0, "label", pa.array([label] * len(t), pa.string())))
    tables: dict[str, Any] = {name: pa.concat_tables(ts) for name, ts in parts.items()}
    try:
        import pandas  # noqa: F401
    except ImportError:
        pass
    else:
        tables = {name: t.to_pandas() for name, t in tables.items()}
    summary = list(csv.DictReader(io.StringIO(seeds_table([root], "csv"))))
    return RunResult(root, **tables, summary=summary, _markdown=seeds_table([root], "md"))


def load(run_dir: str | Path) -> RunResult:
    """A finished run directory (``rayfed-dg run``'s or ``rayfed_dg.run``'s,
    of this release or an older one) as ``run`` returns it: its rows in the
    order ``report`` lists them (seeds by number, rows in config order)."""
    from rayfed_dg.engine.store.rundir import RunDir
    from rayfed_dg.reporting import check_report_inputs, find_runs

    root = Path(run_dir)
    check_report_inputs([root])
    rows = [(r.summary.get("label") or r.label, r.summary.get("seed"), RunDir(r.path)) for r in find_runs(root)]
    return _result(root, rows)


def run(config: str | Path | None = None, overrides: Mapping[str, Any] | None = None, *,
        target: str | Sequence[str] | None = None, run_dir: str | Path | None = None,
        seeds: Sequence[int] | str | None = None, resume: str | Path | None = None,
        progress: bool = True, dry_run: bool = False) -> RunResult:
    """``rayfed-dg run CONFIG [--set k=v ...] [--target T] [--run-dir DIR]
    [--seeds S,S] [--resume RUN] [--dry-run]``: trains, writes the run
    directory and returns its tables.  ``target``: a domain, a list, or
    "all" (default); ``seeds``: ``[0, 1, 2]``; ``resume``: a run directory
    to continue (its own config, targets and seeds), or the URI of its copy
    (``s3://bucket/prefix/NAME``, what ``output.sync_to`` keeps: downloaded
    to ``$RAYFED_DG_CACHE/runs`` first, and the resumed run updates that
    copy); ``dry_run``: one round of one step on a few images, in a
    temporary directory unless ``run_dir`` is given (the tables are read
    before it goes).  ``--wandb`` / ``--mlflow`` are ``overrides``
    (``{"output.wandb.project": ...}``, ``{"output.mlflow.tracking_uri": ...}``).  Bad input raises ``ConfigError`` (or
    ``DataError``) with the CLI's one-line message; Ctrl-C, or SIGTERM when called from the
    main thread, raises ``engine.running.service.RunInterrupted`` (a
    ``KeyboardInterrupt``) naming the resume."""
    from rayfed_dg.engine.running.service import RunRequest, execute_run

    if target is not None and not isinstance(target, str):
        target = ",".join(target)
    req = RunRequest(config=None if config is None else str(config), target=target, overrides=_overrides(overrides),
                     run_dir=None if run_dir is None else str(run_dir), resume=None if resume is None else str(resume),
                     seeds=_seeds(seeds), dry_run=dry_run, no_progress=not progress)
    out = execute_run(req)
    return _result(out.run_dir.path, [(row.label, row.cfg.training.seed, out.exp.row_dir(out.run_dir, row))
                                      for row in out.exp.rows])


def calibrate(config: str | Path, epsilon: float, overrides: Mapping[str, Any] | None = None, *,
              target: str | None = None) -> float:
    """``rayfed-dg privacy calibrate CONFIG --epsilon E [--set k=v ...]
    [--target T]``: the update noise multiplier z (rounded up to 4 decimals:
    never past ``epsilon``) at which the config's rounds spend ``epsilon``
    at ``privacy.delta``, for the model updates alone (what the CLI prints
    as ``privacy.updates.noise_multiplier=z``).  ``target``: the domain
    whose partition counts (default: the first)."""
    from rayfed_dg.engine.running.service import calibrate as calibrate_noise

    return calibrate_noise(config, epsilon, _overrides(overrides), target)[0]


def collect(sweep_dirs: Sequence[str | Path], fmt: str = "md") -> str:
    """``rayfed-dg collect SWEEP_DIR ... [--format F]``: sweep folders
    (``tune.py``'s) as one table, a row per sweep: target accuracy (%) at
    the values each seed chose on source validation, mean ± SE over seeds.
    ``fmt``: md, csv, latex or text."""
    from rayfed_dg.tuning import collect as collect_sweeps

    if isinstance(sweep_dirs, (str, Path)):
        sweep_dirs = [sweep_dirs]
    return collect_sweeps([Path(d) for d in sweep_dirs], fmt)
