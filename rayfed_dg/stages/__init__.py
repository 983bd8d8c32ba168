"""Data stages: one file per stage, each registered by name."""
from . import amplitude, ccst  # noqa: F401  (register)
from .base import Stage, StageClient, StageServer, build_stages, get_stage_class, register_stage, stage_names

__all__ = ["Stage", "StageClient", "StageServer", "build_stages", "get_stage_class", "register_stage", "stage_names"]
