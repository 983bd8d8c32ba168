"""rayfed_dg: a Ray-based simulation engine for federated domain generalization.

``rayfed_dg.run(config, overrides, target=..., run_dir=..., seeds=...)`` is
``rayfed-dg run`` from Python and ``rayfed_dg.load(run_dir)`` reads a
finished run directory (``api.py``); it is imported on first use, so
``import rayfed_dg`` stays cheap (no torch, no Ray).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

__all__ = ["RunResult", "__version__", "load", "run"]

if TYPE_CHECKING:
    from .api import RunResult, load, run


def __getattr__(name: str) -> Any:
    if name in ("run", "load", "RunResult"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'rayfed_dg' has no attribute {name!r}")
