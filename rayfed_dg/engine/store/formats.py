"""Format versions of what a run keeps, and the one place older shapes are read.

Each artifact records the version of its shape under the key ``format``:

==================  ================================================  ==============
artifact            where                                             version
==================  ================================================  ==============
run directory       ``run.json`` at the experiment's root             ``RUN_DIR``
checkpoint          its digest ``round_*.json`` and its ``.pt`` dict  ``CHECKPOINT``
client-state pieces the manifest a checkpoint holds (``client_pieces``)  ``PIECES``
sweep folder        its marker ``sweep.json``                         ``SWEEP``
==================  ================================================  ==============

An artifact without the key was written before versions: version 0, whose
several shapes are told apart by what they hold (the functions below say
which).  Reading goes through this module: ``version`` refuses a version
newer than this code reads, in one line, and each ``upgrade_*`` /
``read_*`` function turns an older shape into today's, so the code that
reads (``rundir.py``, ``checkpoint.py``, ``clientstore.py``,
``sweepdir.py``, ``running/run.py``) knows only today's.

To change a shape: bump its version here, add one upgrade step from the
version before (``_step``: one function per version), and add a fixture
written by the old code under ``tests/fixtures`` that a test reads.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rayfed_dg.errors import ConfigError

RUN_DIR = 1
CHECKPOINT = 3
PIECES = 1
SWEEP = 1
CURRENT = {"run directory": RUN_DIR, "checkpoint": CHECKPOINT, "client-state manifest": PIECES, "sweep folder": SWEEP}


def stamp(kind: str, tree: dict) -> dict:
    """``tree`` with today's version of ``kind`` first."""
    return {"format": CURRENT[kind], **{k: v for k, v in tree.items() if k != "format"}}


def version(kind: str, tree: dict, where: Any) -> int:
    """The version of ``tree`` (0: written before versions); a version this
    code does not know is refused in one line."""
    v = tree.get("format", 0)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= CURRENT[kind]:
        from rayfed_dg._version import __version__

        raise ConfigError(f"{where}: a {kind} of format {v!r}, newer than rayfed-dg {__version__} reads (format "
                          f"{CURRENT[kind]} at most); read it with the release that wrote it, or upgrade rayfed-dg")
    return v


def _upgrade(kind: str, tree: dict, where: Any, steps: dict[int, Callable[[dict], dict]]) -> dict:
    """``tree`` through every step from its version to today's, stamped."""
    v = version(kind, tree, where)
    for step in range(v, CURRENT[kind]):
        tree = steps[step](tree)
    return stamp(kind, tree)


# ------------------------------------------------------------------ run directory

def _run_record_0(rec: dict) -> dict:
    # before versions: ``seeds`` may be absent (a run without --seeds)
    return dict(rec, targets=list(rec["targets"]), seeds=rec.get("seeds"))


def read_run_record(path: Path) -> dict:
    """``run.json`` at ``path`` in today's shape; unreadable: ConfigError."""
    try:
        return _upgrade("run directory", json.loads(path.read_text()), path, {0: _run_record_0})
    except ConfigError:  # a newer format: its own line
        raise
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(f"{path} is unreadable; resume with the config, --target and --seeds the run was "
                          "started with (rayfed-dg run CONFIG --resume RUN_DIR ...)") from None


def resume_without_record(run_dir: Any, target: str | None, seeds: list[int] | None) -> tuple[list[int] | None, str]:
    """(seeds, target argument) to resume ``run_dir`` (a ``RunDir``) by,
    written before ``run.json``: those given again, which must be given."""
    from .rundir import CONFIG, RUN_RECORD

    if target is None:
        raise ConfigError(f"--resume {run_dir.path}: it has no {RUN_RECORD} (made by an older rayfed-dg), so its "
                          "targets are not recorded; give them again with --target (e.g. --target all)")
    if seeds is None and not run_dir.has_config() and any(run_dir.path.glob("seed*/" + CONFIG)):
        raise ConfigError(f"--resume {run_dir.path}: a --seeds run; resume it with the same --seeds")
    return seeds, target


def row_summary(tree: dict) -> dict | None:
    """A ``summary.json``'s row summary, or None.  Run directories written
    before versions also hold aggregate summaries above their rows (a compare
    run's ``{label: summary}``, a ``--seeds`` run's ``{"seeds": ...}`` at the
    root): no run (their rows are below)."""
    return tree if "targets" in tree else None


def read_whole_table(path: Path):
    """A table kept as one Parquet file (run directories written before
    per-round part files), as it is."""
    import pyarrow.parquet as pq

    return pq.read_table(path)


def check_resumable(root: Path) -> None:
    """A run directory whose tables are single files cannot be resumed (a
    resume rewrites rounds as part files): refused in one line."""
    legacy = [p.name for name in ("metrics.parquet", "ledger.parquet") for p in root.rglob(name) if p.is_file()]
    if legacy:
        raise ConfigError(f"--resume {root}: its {legacy[0]} is one file, written by an older rayfed-dg "
                          "(records are now folders of per-round parts); start a new run")


# ------------------------------------------------------------------ checkpoints

def upgrade_digest(meta: dict, where: Any) -> dict:
    """A checkpoint's digest (``round_*.json``) in today's shape: before
    versions, one without ``pieces`` names none."""
    return _upgrade("checkpoint", meta, where, {0: lambda m: {"pieces": {}, **m}, 1: lambda m: m, 2: lambda m: m})


def upgrade_checkpoint_state(state: dict) -> dict:
    """A federation's state (``Federation.get_state``) from a checkpoint
    written before versions, with what those lack: ``clock`` (0.0: the
    simulated clock had not started).  A state holding every client's state
    (``client_store``, no pieces) is still today's shape: ``get_state``
    without a folder gives it."""
    return {"clock": 0.0, **state}


def _checkpoint_0(ckpt: dict) -> dict:
    result = dict(ckpt["result"])
    # before rounds recorded their clients' phase: unknown (NaN) for the first rounds, those before the run was
    # resumed by the release that began to record it
    clients_s = list(result.get("seconds_clients_per_round", []))
    result["seconds_clients_per_round"] = [float("nan")] * (len(result["seconds_per_round"]) - len(clients_s)) + \
        clients_s
    # before the tables held them, the clients' and ledger's rows were the result's own
    return dict(ckpt, server=upgrade_checkpoint_state(ckpt["server"]), result=result, rows=ckpt.get("rows", "result"))


def upgrade_checkpoint(ckpt: dict, where: Any) -> dict:
    """A run's checkpoint (``{"server", "result", "rows"}``, as
    ``running/run.py`` writes it) in today's shape."""
    # version 2 keeps the metrics' rows in the tables too (``rows: "all tables"``), version 3 each round's seconds
    # (the rounds table, ``rows: "all tables and rounds"``); a checkpoint says what it kept in ``rows`` itself,
    # and code that reads only an older version refuses a newer one instead of resuming without those rows
    return _upgrade("checkpoint", ckpt, where, {0: _checkpoint_0, 1: lambda c: c, 2: lambda c: c})


# ------------------------------------------------------------------ client-state pieces

Index = tuple[np.ndarray, np.ndarray, np.ndarray]  # a piece's clients, their records' offsets and lengths


def piece_indexes(manifest: dict, directory: Path) -> tuple[dict[int, Index], bool]:
    """({piece's round: its index} of a checkpoint's manifest whose pieces are
    in ``directory``, whether the next checkpoint must rewrite every state).
    Before versions, a manifest may hold the map itself (``clients``,
    ``piece``, ``offset``, ``length``: its pieces have no index); the map is
    then split by piece, and the next checkpoint writes every state into a
    piece with an index."""
    from .clientstore import piece_name, piece_round, read_index

    v = version("client-state manifest", manifest, "a checkpoint's client-state manifest")
    rounds = sorted(piece_round(name) for name in manifest["pieces"])
    if v >= 1 or "clients" not in manifest:
        return {p: read_index(directory / piece_name(p)) for p in rounds}, False
    ids, piece = np.asarray(manifest["clients"], np.int64), np.asarray(manifest["piece"], np.int64)
    offset, length = np.asarray(manifest["offset"], np.int64), np.asarray(manifest["length"], np.int64)
    return {p: (ids[piece == p], offset[piece == p], length[piece == p]) for p in rounds}, True


# ------------------------------------------------------------------ sweep folders

def upgrade_sweep(marker: dict, where: Any, name: str, records: list[dict], record_keys: tuple[str, ...]) -> dict:
    """A sweep's marker (``sweep.json``: ``label``, ``params``, ``targets``)
    in today's shape.  Sweeps before versions may have none (``marker`` is
    {}): the folder's name, the trials table's other columns and its targets
    in order stand in."""
    def step0(m: dict) -> dict:
        return {"label": m.get("label") or name,
                "params": m.get("params") or [k for k in (records[0] if records else {}) if k not in record_keys],
                "targets": m.get("targets") or list(dict.fromkeys(r["target"] for r in records)), **{
                    k: v for k, v in m.items() if k not in ("label", "params", "targets")}}

    return _upgrade("sweep folder", marker, where, {0: step0})


def upgrade_trials(records: list[dict], sweep_version: int) -> list[dict]:
    """A sweep's trial records in today's shape: before versions, a record
    without ``finished`` is of a sweep that predates the flag (finished)."""
    return records if sweep_version >= 1 else [{"finished": True, **r} for r in records]
