"""Atomic, verifiable round checkpoints.

A checkpoint is written as ``round_00012.pt`` (torch.save of tensors and
plain Python values only, loadable with ``torch.load(weights_only=True)``)
plus ``round_00012.json`` holding its SHA-256, and the SHA-256 and size of
each client-state piece it names (``round_*.clients``, written before it by
the client store: ``clientstore.py``; each piece ends with its index, which
client is where in it, and the pieces the ``.pt`` names are the whole map).
Everything is written to a temporary name and renamed, the digest last, so
a checkpoint without a matching digest, or whose pieces (their indexes
included) are missing or do not match theirs, is incomplete or corrupt and
the previous one is used, with a warning naming the file.  The two most
recent checkpoints are kept, and the pieces either of them names; a piece
both name (a client unchanged since) fails both.  The digest carries its
``format`` (``formats.CHECKPOINT``), read before anything else: a checkpoint
of a newer format is refused in one line, not taken for a corrupt one.
"""
from __future__ import annotations

import hashlib
import io
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rayfed_dg.utils import atomic_write

from .formats import stamp, upgrade_digest

KEEP = 2


class CheckpointWarning(UserWarning):
    pass


def to_torch_tree(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.array(x))
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {k: to_torch_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_torch_tree(v) for v in x)
    return x


def to_numpy_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, dict):
        return {k: to_numpy_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_numpy_tree(v) for v in x)
    return x


def checkpoint_path(directory: Path, round: int) -> Path:
    return directory / f"round_{round:05d}.pt"


def saved_rounds(directory: Path) -> list[int]:
    """The rounds ``directory`` holds checkpoints of (verified or not), ascending."""
    return sorted(int(p.stem.split("_")[1]) for p in directory.glob("round_*.pt"))


def _pieces(directory: Path, round: int) -> dict[str, dict]:
    """The pieces the checkpoint of ``round`` names ({} when its digest is unreadable: it cannot be used)."""
    try:
        path = checkpoint_path(directory, round).with_suffix(".json")
        return dict(upgrade_digest(json.loads(path.read_text()), path)["pieces"])
    except (OSError, ValueError, AttributeError):
        return {}


def checkpoint_files(directory: Path, round: int) -> list[Path]:
    """Every file the checkpoint of ``round`` is made of: its ``.pt``, its digest, the pieces it names."""
    path = checkpoint_path(directory, round)
    return [path, path.with_suffix(".json"), *(directory / name for name in sorted(_pieces(directory, round)))]


def save_checkpoint(directory: Path, round: int, state: dict, pieces: dict[str, dict] | None = None) -> Path:
    """``state`` as the checkpoint of ``round``; ``pieces``: the client-state
    pieces in ``directory`` it names, file name -> {"sha256", "bytes"}."""
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(to_torch_tree(state), buf)
    data = buf.getvalue()
    path = checkpoint_path(directory, round)
    atomic_write(path, data)
    digest = stamp("checkpoint", {"round": round, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                                  "pieces": pieces or {}})
    atomic_write(path.with_suffix(".json"), json.dumps(digest).encode())
    for old in saved_rounds(directory)[:-KEEP]:
        checkpoint_path(directory, old).unlink(missing_ok=True)
        checkpoint_path(directory, old).with_suffix(".json").unlink(missing_ok=True)
    # pieces no kept checkpoint names: superseded, or written by a run killed before its checkpoint
    named = {name for r in saved_rounds(directory) for name in _pieces(directory, r)}
    for piece in directory.glob("round_*.clients"):
        if piece.name not in named:
            piece.unlink(missing_ok=True)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _unusable(path: Path, e: Exception) -> None:
    warnings.warn(f"checkpoint {path} is incomplete or corrupt ({type(e).__name__}: {e}); "
                  "falling back to the previous one", CheckpointWarning, stacklevel=3)


def _verified(path: Path) -> dict | None:
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        if not isinstance(meta, dict):
            raise ValueError("its digest is not a JSON object")
    except (OSError, ValueError) as e:
        _unusable(path, e)
        return None
    meta = upgrade_digest(meta, path.with_suffix(".json"))  # outside the fallback: a newer format is refused
    try:
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise ValueError("digest mismatch")
        for name, piece in meta["pieces"].items():  # every byte of a state a resume may read
            p = path.parent / name
            if not p.is_file() or p.stat().st_size != piece["bytes"] or _sha256(p) != piece["sha256"]:
                raise ValueError(f"its client-state piece {p} is missing or corrupt")
        return to_numpy_tree(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
    except Exception as e:  # noqa: BLE001  any failure means: not usable
        _unusable(path, e)
        return None


def load_latest(directory: Path) -> dict | None:
    """The newest checkpoint that verifies, or None."""
    for r in reversed(saved_rounds(directory)):
        state = _verified(checkpoint_path(directory, r))
        if state is not None:
            return state
    return None
