"""rayfed_dg: a Ray-based simulation engine for federated domain generalization.

``rayfed_dg.run(config, overrides, target=..., run_dir=..., seeds=...,
resume=...)`` is ``rayfed-dg run`` from Python, ``rayfed_dg.load(run_dir)``
reads a finished run directory, ``rayfed_dg.calibrate`` and
``rayfed_dg.collect`` are ``rayfed-dg privacy calibrate`` and ``rayfed-dg
collect`` (``api.py``); it is imported on first use, so
``import rayfed_dg`` stays cheap (no torch, no Ray).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

__all__ = ["RunResult", "__version__", "calibrate", "collect", "load", "run"]

if TYPE_CHECKING:
    from .api import RunResult, calibrate, collect, load, run


def __getattr__(name: str) -> Any:
    if name in ("run", "load", "calibrate", "collect", "RunResult"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'rayfed_dg' has no attribute {name!r}")
