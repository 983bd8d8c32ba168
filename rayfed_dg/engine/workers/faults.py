"""The failures a client job can report, shared by the worker that raises
them and the pool that judges them (``pool.py`` needs these names, not the
worker's training code)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rayfed_dg.errors import DivergedError


class InjectedFault(RuntimeError):
    pass


__all__ = ["OWN_FAULTS", "DivergedError", "InjectedFault", "JobFailed"]

OWN_FAULTS = (InjectedFault, torch.OutOfMemoryError, MemoryError)


@dataclass
class JobFailed:
    """One job's own fault inside a task that ran several (``submit_many``):
    the task returns this in the job's place and the others' results stand."""
    error: str
