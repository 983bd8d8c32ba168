"""The data-stage interface and registry.

A data stage changes the clients' training sets once, before round 1 (CCST's
cross-client style transfer; an amplitude bank would be another).  Like a
method it is one class in one file, registered by name, with typed
parameters; the engine runs "the configured stages" (``stages:`` in the
config, in order) and never names one.

A stage has two halves:

* server half, ``run(server)``, in the server actor: it drives the stage
  through the ``StageServer`` the engine hands it (``map`` runs a client
  phase on every client through the worker pool, with retries;
  ``set_training_set`` replaces a client's training set; ``share`` hands
  arrays to every client's training tasks, where the method reads them as
  ``ctx.stage_data[name]`` (ELCFS's amplitude bank); ``ledger`` records
  what crossed the wire, as round 0) and returns a dict of costs for
  ``summary.json``;
* client half, the stage's client phases: its own methods
  ``(client, client_id, indices, **args)``, run in a worker, where
  ``client`` is a ``StageClient`` (the dataset's images and labels, the
  device, the worker's threads, the run's seed).  The server half names a
  phase by the method itself, ``server.map(self.client_style, args)``: a
  misspelt phase fails where it is written (and in mypy), not in a worker.

A client phase whose result leaves the client as a payload is mapped with
``releases=<group>`` (``gather_bank`` does): the worker clips and noises it
there when ``privacy.payloads`` names the group (``engine/privacy/payloads.py``).
The stage declares each such group and what one record of it is in
``shared_payloads`` (as a method does, ``methods/base.py``).

A stage is deterministic and safe to repeat (it is simply run again on
resume), so its randomness comes from ``seeding.Stream.STAGE``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from rayfed_dg.errors import ConfigError
from rayfed_dg.utils import Registry


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class StageClient:
    """What a stage's client half sees inside a worker."""
    images: np.ndarray  # the whole dataset, uint8 (N, H, W, 3), read-only
    labels: np.ndarray
    device: torch.device
    threads: int
    seed: int
    resolution: int | None = None  # the training resolution (stored images may be decoded larger: crops)


# a client phase: a stage's own method (client, client_id, indices, **args), bound to the stage that maps it
ClientPhase = Callable[..., Any]


class StageServer(Protocol):
    """What a stage's server half can do (implemented by the engine)."""
    num_clients: int
    seed: int

    def training_set(self, client_id: int) -> np.ndarray: ...

    def map(self, phase: ClientPhase, args: dict[int, dict[str, Any]], releases: str | None = None) -> dict[int, Any]:
        """``phase`` on each client of ``args``; ``releases``: its result leaves the client as that payload group."""

    def set_training_set(self, client_id: int, keep: np.ndarray, images: np.ndarray, labels: np.ndarray) -> None: ...

    def share(self, name: str, arrays: dict[str, np.ndarray]) -> None: ...

    def ledger(self, client_id: int, direction: str, group: str, nbytes: int, tensors: int = 1) -> None: ...


def gather_bank(server: StageServer, phase: ClientPhase,
                releases: str) -> tuple[dict[int, np.ndarray], np.ndarray, np.ndarray]:
    """Run the client phase ``phase`` on every client, whose arrays leave it as the payload group
    ``releases``, and stack them into one bank: (per client, bank, owner of each bank row)."""
    per = server.map(phase, {c: {} for c in range(server.num_clients)}, releases=releases)
    bank = np.concatenate([per[c] for c in range(server.num_clients)])
    owners = np.concatenate([np.full(len(per[c]), c, np.int64) for c in range(server.num_clients)])
    return per, bank, owners


class Stage:
    name = "base"
    Params: type[BaseModel] = NoParams
    # the payload groups its client phases release (``releases=``), by group: what one record is,
    # "image" | "client" | "exact" (methods/payloads.py RECORDS)
    shared_payloads: dict[str, str] = {}

    def __init__(self, params: Any):
        self.p = params

    @classmethod
    def check(cls, cfg) -> None:
        """Raise ``ConfigError`` for a config this stage cannot run."""

    def check_clients(self, num_clients: int) -> None:
        """Raise ``ConfigError`` when the partition does not suit the stage."""

    def preflight(self) -> None:
        """In the driver, before anything is written: fail early (e.g. a
        weights file or an optional package that is missing)."""

    def run(self, server: StageServer) -> dict:
        raise NotImplementedError


_REGISTRY: Registry[type[Stage]] = Registry("data stage")


def register_stage(cls: type[Stage]) -> type[Stage]:
    return _REGISTRY.add(cls.name, cls)


def stage_names() -> list[str]:
    return _REGISTRY.names()


def get_stage_class(name: str) -> type[Stage]:
    return _REGISTRY.get(name)


def build_stages(cfg) -> list[Stage]:
    """The configured stages, in order, with their typed parameters."""
    return [get_stage_class(name)(params) for name, params in cfg.active_stages()]


__all__ = ["ClientPhase", "ConfigError", "NoParams", "Stage", "StageClient", "StageServer", "build_stages",
           "gather_bank", "get_stage_class", "register_stage", "stage_names"]
