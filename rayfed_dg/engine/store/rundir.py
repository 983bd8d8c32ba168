"""``RunDir``: the layout of a run directory, its only writer and the reader
every command goes through (``report``, ``evaluate``, ``plot``,
``rayfed_dg.run`` / ``load``, ``run --resume``; a Tune trial's working
folder too).

An experiment's root holds ``run.json`` (how the run was started: targets,
seeds, labels, rounds, config and ``--set`` values, the code's environment),
then per training seed ``seed<S>/`` (a run with ``--seeds``; else the root
itself), then per ``compare`` row ``<label>/`` (when there are several; else
the seed folder itself).  Each level down to the row keeps the ``config.yaml``
it ran with; a row (one method, one seed) holds its run:

``config.yaml``        the resolved config
``summary.json``       per target the selected round and its accuracies,
                       plus ``average_target_acc``, ``method``, ``label``,
                       ``seed``, ``stages`` (``run.TargetResult.summary``)
``metrics.parquet/``, ``ledger.parquet/``, ``clients.parquet/``,
``rounds.parquet/``, ``privacy.parquet/`` (with privacy)  the tables
                       (``records.TABLES``), one Parquet part file per
                       (target, round), each written atomically
``best_<target>.pt``, ``final_<target>.pt``  global weights
``checkpoints/<target>/round_*.pt``  resumable state, and ``round_*.clients``
                       the client-state pieces they name (``clientstore.py``)
``client_state/<target>/``  client states spilled from the server's memory
                       while the federation runs (scratch, removed at its end)
``tensorboard/<target>/``  TensorBoard scalars (``output.tensorboard``)
``skipped_images.txt`` images ``data.on_corrupt: skip`` left out (root)

With ``output.sync_to`` the experiment's copy at ``<sync_to>/<root's name>``
is brought up to date (``remote.Mirror``) when ``run.json`` is written, after
every checkpoint and with every ``summary.json``; a new run refuses a copy
that already holds files.

``run.json`` and the checkpoints carry their format versions
(``formats.py``); whatever older run directories hold in another shape
(``summary.json`` files above the rows, tables in one Parquet file, a
``run.json`` without seeds) is read through ``formats.py``, and a run
directory of a newer format is refused in one line.  Sweep folders have
their owner beside this one (``sweepdir.SweepDir``).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from rayfed_dg.config import ExperimentConfig, row_labels, save_config
from rayfed_dg.errors import ConfigError
from rayfed_dg.utils import atomic_write_with, write_text

from .checkpoint import checkpoint_files, checkpoint_path, load_latest, save_checkpoint, saved_rounds
from .formats import read_run_record, read_whole_table, row_summary, stamp, upgrade_checkpoint
from .records import TABLES, table_schema
from .remote import Mirror

RUN_RECORD = "run.json"
CONFIG = "config.yaml"
SUMMARY = "summary.json"
SCRATCH = "client_state"  # spilled client states, removed when a federation ends: never copied
NOT_RUNS = ("checkpoints", SCRATCH, "tensorboard", "plots")  # folders of a run that hold no run
_MIRRORS: dict[Path, Mirror | None] = {}  # an experiment's root -> its copy, one per process (what it sent)


def _part_key(p: Path) -> tuple[str, int]:
    target, _, rnd = p.stem.rpartition("-r")
    return target, int(rnd) if rnd.isdigit() else -1


def _parts(folder: Path, schema, target: str | None = None, upto: int = 0) -> list:
    """A table folder's part files as Arrow tables in (target, round) order:
    all, or ``target``'s rounds up to ``upto``."""
    import pyarrow.parquet as pq

    keyed = sorted((_part_key(p), p) for p in folder.glob("*.parquet")) if folder.is_dir() else []
    return [pq.read_table(p, schema=schema) for (t, r), p in keyed if target is None or (t == target and r <= upto)]


class RunDir:
    """One folder of a run directory: an experiment's root, a seed's folder
    or a row's (they may be the same folder).  Paths only; nothing is read
    or written until asked."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ------------------------------------------------------------ layout

    @classmethod
    def create(cls, cfg: ExperimentConfig, path: str | Path | None) -> RunDir:
        """A new, empty run directory (default ``output.root/name-timestamp``)."""
        if path is None:
            path = Path(cfg.output.root) / f"{cfg.output.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        path = Path(path)
        if path.exists() and any(path.iterdir()):
            raise ConfigError(f"run directory {path} already exists and is not empty; "
                              "choose another --run-dir, or continue it with --resume")
        if cfg.output.sync_to:
            _mirror_of(path.resolve(), cfg.output.sync_to).check_new()
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o755)
        return cls(path)

    def seed(self, seed: int | None) -> RunDir:
        """A training seed's folder: ``seed<S>/``, or this one for a run without ``--seeds``."""
        return self if seed is None else RunDir(self.path / f"seed{seed}")

    def row(self, label: str, many: bool) -> RunDir:
        """A ``compare`` row's folder within a seed's: ``<label>/`` when the experiment has several rows."""
        return RunDir(self.path / label) if many else self

    @staticmethod
    def seed_of(name: str) -> int | None:
        """The seed a folder named ``seed<S>`` holds, else None."""
        m = re.fullmatch(r"seed(\d+)", name)
        return int(m.group(1)) if m else None

    def subdirs(self) -> list[RunDir]:
        """Folders that may hold runs, in the experiment's order: seeds by
        number, compare rows in config order, anything else by name."""
        if not self.path.is_dir():
            return []
        labels = self.compare_labels()

        def key(p: Path):
            s = self.seed_of(p.name)
            if s is not None:
                return 0, s, ""
            return (1, labels.index(p.name), "") if p.name in labels else (2, 0, p.name)

        return [RunDir(p) for p in sorted((p for p in self.path.iterdir() if p.is_dir() and p.name not in NOT_RUNS
                                           and not p.name.endswith(".parquet") and not p.name.startswith(".")),
                                          key=key)]

    def checkpoints(self, target: str) -> Path:
        return self.path / "checkpoints" / target

    def checkpoint(self, target: str, round: int) -> Path:
        return checkpoint_path(self.checkpoints(target), round)

    def save_checkpoint(self, target: str, round: int, state: dict, pieces: dict[str, dict] | None = None) -> None:
        """``state`` as ``target``'s checkpoint of ``round`` (verifiable; the
        two newest are kept: ``checkpoint.py``); ``pieces``: the client-state
        pieces it names, already written beside it by the server's store."""
        save_checkpoint(self.checkpoints(target), round, stamp("checkpoint", state), pieces)
        self.sync()

    def latest_checkpoint(self, target: str) -> dict | None:
        """``target``'s newest checkpoint that verifies, in today's shape, or None."""
        d = self.checkpoints(target)
        state = load_latest(d) if d.is_dir() else None
        return None if state is None else upgrade_checkpoint(state, d)

    def checkpoint_files(self, target: str, round: int) -> list[Path]:
        """The files of ``target``'s checkpoint of ``round``: what a copy of it needs."""
        return checkpoint_files(self.checkpoints(target), round)

    def client_state(self, target: str) -> Path:
        """Where ``target``'s federation spills client states while it runs."""
        return self.path / SCRATCH / target

    def saved_rounds(self, target: str) -> list[int]:
        return saved_rounds(self.checkpoints(target))

    def weights(self, kind: str, target: str) -> Path:
        """``best`` (the selected round's) or ``final`` global weights of ``target``."""
        return self.path / f"{kind}_{target}.pt"

    def save_weights(self, kind: str, target: str, state: dict[str, np.ndarray]) -> None:
        atomic_write_with(self.weights(kind, target), lambda buf: torch.save(
            {k: torch.from_numpy(np.array(v)) for k, v in state.items()}, buf))

    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    # ------------------------------------------------------------ run.json

    def write_record(self, record: dict) -> None:
        write_text(json.dumps(stamp("run directory", record), indent=2) + "\n", self.path / RUN_RECORD)
        self.sync(strict=True)

    def record(self) -> dict | None:
        """This folder's ``run.json``; None when it has none (a seed's or a
        row's folder, or a run made before run.json).  Unreadable: ConfigError."""
        path = self.path / RUN_RECORD
        return read_run_record(path) if path.is_file() else None

    def experiment(self) -> tuple[RunDir, dict] | None:
        """(the experiment's root, its ``run.json``) for this folder or the
        experiment it is in (a row, a seed, a seed's row); None for runs
        made before ``run.json``."""
        for d in [self.path, *list(self.path.parents)[:2]]:
            if _json(d / RUN_RECORD):
                return RunDir(d), read_run_record(d / RUN_RECORD)
        return None

    # ------------------------------------------------------------ config.yaml

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG

    def has_config(self) -> bool:
        return self.config_path.is_file()

    def write_config(self, cfg: ExperimentConfig) -> None:
        """The folder's ``config.yaml``, once: the first config written is the
        one the folder was started with (a resume never rewrites it)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.config_path.exists():
            save_config(cfg, self.config_path)

    def config_tree(self) -> dict:
        """``config.yaml`` as plain YAML (no validation, no plugins): {} when absent or unreadable."""
        return _yaml(self.config_path)

    def compare_labels(self) -> list[str]:
        """The row labels of the experiment whose config this folder holds, in
        config order (``config.row_labels``, read from the plain YAML, so a
        run's plugins need not import)."""
        rows = [m for m in self.config_tree().get("compare") or [] if isinstance(m, dict)]
        return row_labels([m.get("label") or m.get("name", "fedavg") for m in rows])

    # ------------------------------------------------------------ summary.json

    def write_summary(self, summary: dict) -> None:
        write_text(json.dumps(summary, indent=2), self.path / SUMMARY)
        self.sync()

    def summary(self) -> dict | None:
        """The finished row's summary; None while it runs (and above the rows: ``formats.row_summary``)."""
        return row_summary(_json(self.path / SUMMARY))

    def targets(self) -> list[str]:
        """The targets a finished row ran, in order."""
        s = self.summary()
        if s is None:
            raise ConfigError(f"{self.path}: no summary.json (the run did not finish); name the targets with --target")
        return list(s["targets"])

    # ------------------------------------------------------------ the copy at output.sync_to

    def mirror(self) -> Mirror | None:
        """The copy of the experiment this folder is in (``output.sync_to``
        of its config, or of its first seed's), None without one."""
        found = self.experiment()
        if found is None:
            return None
        root = found[0].path.resolve()
        if root not in _MIRRORS:
            trees = [d.config_tree() for d in [found[0], *found[0].subdirs()] if d.has_config()]
            uri = next((t["output"]["sync_to"] for t in trees if (t.get("output") or {}).get("sync_to")), None)
            _MIRRORS[root] = _mirror_of(root, uri) if uri else None
        return _MIRRORS[root]

    def sync(self, strict: bool = False) -> None:
        """Bring the experiment's copy up to date (none: nothing).  A failure
        ends the run when ``strict`` (its start: nothing trained yet), else is
        a warning: the run goes on and the next sync tries again."""
        copy = self.mirror()
        if copy is None:
            return
        try:
            copy.sync()
        except OSError as e:
            if strict:
                raise ConfigError(f"output.sync_to: cannot write {copy.uri} ({e}); check the bucket and the "
                                  "credentials (on AWS: the node's instance profile)") from None
            print(f"rayfed-dg: warning: output.sync_to: {copy.uri} was not brought up to date ({e}); the next "
                  "checkpoint tries again", file=sys.stderr)

    # ------------------------------------------------------------ tables

    def has_table(self, name: str) -> bool:
        return (self.path / f"{name}.parquet").exists()

    def write_rows(self, name: str, target: str, round: int, rows: list[dict]) -> None:
        """Table rows (``records.table_rows``) of one (target, round) as the
        part file ``<name>.parquet/<target>-r<round:05d>.parquet``, written
        atomically: a run killed at any moment leaves every finished round
        readable and never a half-written part; a resumed run rewrites the
        rounds it repeats under the same names (no duplicate rows)."""
        if not rows:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        folder = self.path / f"{name}.parquet"
        folder.mkdir(exist_ok=True)
        table = pa.Table.from_pylist(rows, schema=table_schema(name))
        atomic_write_with(folder / f"{target}-r{round:05d}.parquet", lambda buf: pq.write_table(table, buf))

    def write_round(self, target: str, round: int, tables: dict[str, list[dict]]) -> None:
        for name, rows in tables.items():
            self.write_rows(name, target, round, rows)

    def read_table(self, name: str):
        """Table ``name`` as one Arrow table, part files in (target, round)
        order (an older run's single file: ``formats.read_whole_table``).  Any
        Parquet reader (pandas, DuckDB, Polars) reads the folder as one table too."""
        import pyarrow as pa

        path = self.path / f"{name}.parquet"
        if path.is_file():
            return read_whole_table(path)
        parts = _parts(path, table_schema(name))
        return pa.concat_tables(parts) if parts else table_schema(name).empty_table()

    def read_rows(self, name: str) -> list[dict]:
        return self.read_table(name).to_pylist()

    def read_target_rows(self, name: str, target: str, upto: int) -> list[dict]:
        """The rows of one target's rounds 0 .. ``upto`` of table ``name``, in
        round order (what a resumed federation had recorded at its checkpoint)."""
        return [row for t in _parts(self.path / f"{name}.parquet", table_schema(name), target, upto)
                for row in t.to_pylist()]

    # ------------------------------------------------------------ other files

    def write_skipped(self, files: list[str]) -> None:
        """The images ``data.on_corrupt: skip`` left out (the loader warned, naming a few)."""
        write_text("\n".join(files) + "\n", self.path / "skipped_images.txt")


def resume_files(run_dir: RunDir, target: str, round: int) -> list[Path]:
    """Every file a resume from ``target``'s checkpoint of ``round`` reads:
    the checkpoint's own (``checkpoint_files``) and the part files of the
    target's rounds 0 .. ``round`` in each table, where a checkpoint's rows
    are (``running/run.py``, ``TABLED``).  A copy of these alone (a Tune
    trial's snapshot) resumes as the run directory does."""
    parts = [p for name in TABLES for p in sorted((run_dir.path / f"{name}.parquet").glob("*.parquet"))
             if (key := _part_key(p))[0] == target and key[1] <= round]
    return [*run_dir.checkpoint_files(target, round), *parts]


def marks_complete(rel: str) -> bool:
    """Whether the file at ``rel`` (relative to the experiment's root) says
    that others are complete: a checkpoint's digest, a row's summary."""
    p = PurePosixPath(rel)
    return p.name == SUMMARY or (len(p.parts) >= 3 and p.parts[-3] == "checkpoints" and p.suffix == ".json")


def _mirror_of(root: Path, sync_to: str) -> Mirror:
    return Mirror(root, f"{sync_to.rstrip('/')}/{root.name}", marks_complete, (SCRATCH,))


def _yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        tree = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return {}
    return tree if isinstance(tree, dict) else {}


def _json(path: Path) -> dict[str, Any]:
    try:
        tree = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return {}
    return tree if isinstance(tree, dict) else {}
