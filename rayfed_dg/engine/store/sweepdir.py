"""``SweepDir``: a Ray Tune sweep's folder (``tune.py``, ``tuning.run_sweep``),
its only writer besides Tune itself and the reader ``rayfed-dg collect``
and ``report`` go through.

Tune writes the sweep's state (``tuner.pkl``, ``experiment_state-*.json``)
and one folder per trial (``params.json``, ``result.json``, its
checkpoints).  When the sweep ends, ``run_sweep`` adds:

``sweep.json``          the marker: ``format`` (``formats.SWEEP``), the
                        method's ``label``, the searched ``params``, the
                        ``targets`` in order
``trials.parquet``      one record per trial (``RECORD_KEYS`` and the
                        searched values)
``selection.parquet``, ``selection.md``  the selection table per value
``chosen_config.yaml``  the chosen value's config (only once every trial
                        finished)

Sweeps of an older format (no marker, records without ``finished``) are
read through ``formats.upgrade_sweep`` / ``formats.upgrade_trials``; a
newer one is refused in one line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rayfed_dg.utils import write_table, write_text

from .formats import stamp, upgrade_sweep, upgrade_trials, version

MARKER = "sweep.json"
TRIALS = "trials.parquet"
SELECTION = "selection.parquet"
SELECTION_MD = "selection.md"
CHOSEN = "chosen_config.yaml"
# a trial record's own columns; the others are the searched values
RECORD_KEYS = ("target", "seed", "finished", "status", "selected_round", "selected_src_val", "selected_target_acc",
               "rounds_run", "resumed_from_round")


class SweepDir:
    """A sweep's folder (local: a sweep kept on remote storage is written
    to a local folder first and uploaded, ``files``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"SweepDir({str(self.path)!r})"

    @staticmethod
    def kind(path: Path) -> str | None:
        """``"sweep"`` (a sweep's folder), ``"trial"`` (one of its trials' folders) or None."""
        if (path / TRIALS).exists() or (path / "tuner.pkl").exists() or any(path.glob("experiment_state-*.json")):
            return "sweep"
        if (path / "params.json").is_file() and ((path / "result.json").exists() or (path / "progress.csv").exists()):
            return "trial"
        return None

    @property
    def selection_md(self) -> Path:
        return self.path / SELECTION_MD

    def trial_dirs(self) -> list[Path]:
        """Its trials' folders, by name."""
        return sorted(p for p in self.path.iterdir() if p.is_dir() and self.kind(p) == "trial") \
            if self.path.is_dir() else []

    # ------------------------------------------------------------ what run_sweep writes

    def write(self, label: str, params: list[str], targets: list[str], records: list[dict],
              rows: list[dict]) -> None:
        """The marker, the trials and the selection table (``collect`` reads them back)."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_table(records, self.path / TRIALS)
        write_table(rows, self.path / SELECTION)
        write_text(json.dumps(stamp("sweep folder", {"label": label, "params": params, "targets": targets})) + "\n",
                   self.path / MARKER)

    def write_selection(self, markdown: str) -> None:
        write_text(markdown + "\n", self.selection_md)

    def write_chosen(self, config_yaml: str | None) -> None:
        """The chosen value's config; None (the sweep chose nothing yet): none,
        and a file an earlier collection wrote goes."""
        path = self.path / CHOSEN
        if config_yaml is not None:
            write_text(config_yaml, path)
        else:
            path.unlink(missing_ok=True)

    def files(self) -> list[Path]:
        """What ``write*`` wrote (what goes beside the trials in remote storage)."""
        return sorted(p for p in self.path.iterdir() if p.name in (MARKER, TRIALS, SELECTION, SELECTION_MD, CHOSEN))

    # ------------------------------------------------------------ what collect reads

    def has_trials(self) -> bool:
        return (self.path / TRIALS).is_file()

    def read(self) -> tuple[dict[str, Any], list[dict]]:
        """(the marker, the trial records), in today's shape."""
        import pyarrow.parquet as pq

        path = self.path / MARKER
        marker = json.loads(path.read_text()) if path.is_file() else {}
        v = version("sweep folder", marker, path)
        records = upgrade_trials(pq.read_table(self.path / TRIALS).to_pylist(), v)
        return upgrade_sweep(marker, path, self.path.name, records, RECORD_KEYS), records
