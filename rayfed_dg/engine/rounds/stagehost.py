"""The engine side of a data stage (``stages.base.StageServer``): the
stage's client phases on the worker pool, and what the stage produces,
held here until the stage returns: the clients' new training sets, the
arrays it shares with every client, its ledger rows (round 0).
``run_stages`` runs the configured stages in order and hands each one's
sets and arrays to the federation (``ClientData.add_stage_outputs``)."""
from __future__ import annotations

from typing import Any

import numpy as np
import ray

from rayfed_dg.engine.store.records import Ledger
from rayfed_dg.engine.workers.pool import WorkerPool
from rayfed_dg.stages import Stage, build_stages
from rayfed_dg.stages.base import ClientPhase

from .federation import Federation


def run_stages(pool: WorkerPool, fed: Federation) -> dict:
    """The configured data stages, before round 1; returns their ledger rows
    (round 0) and costs.  Stages are deterministic and cached, so they are
    simply run again on resume."""
    ledger, info = Ledger(0), {}
    for i, stage in enumerate(build_stages(fed.cfg)):
        host = StageHost(pool, fed, stage, i, ledger)
        info[stage.name] = stage.run(host)
        fed.data.add_stage_outputs(host.training_sets, host.shared)
    return {"ledger": ledger.rows, "info": info}


class StageHost:
    def __init__(self, pool: WorkerPool, fed: Federation, stage: Stage, index: int, ledger: Ledger):
        self._pool, self._fed, self._stage, self._index, self._ledger = pool, fed, stage, index, ledger
        self.num_clients = fed.split.num_clients
        self.seed = fed.cfg.training.seed
        # client -> (dataset indices, ObjectRef of added samples): the stage's new training sets
        self.training_sets: dict[int, tuple[np.ndarray, Any]] = {}
        self.shared: dict[str, Any] = {}  # name -> ObjectRef of arrays the stage shares with every client

    def training_set(self, client_id: int) -> np.ndarray:
        return self.training_sets.get(client_id, self._fed.data.training_set(client_id))[0]

    def map(self, phase: ClientPhase, args: dict[int, dict], releases: str | None = None) -> dict[int, object]:
        if getattr(phase, "__self__", None) is not self._stage:
            raise TypeError(f"stage {self._stage.name}: map takes one of its own client phases (a method of the "
                            f"stage, e.g. self.client_style), not {phase!r}")
        if releases is not None and releases not in self._stage.shared_payloads:
            raise TypeError(f"stage {self._stage.name}: {phase.__name__} releases {releases!r}, which its "
                            "shared_payloads does not declare")
        name = phase.__name__  # each worker runs the same method of its own copy of the stage
        return self._pool.map_all(sorted(args), lambda w, cid, attempt: w.run_stage_in.remote(
            self._fed.id, self._index, name, cid, self.training_set(cid), args[cid], releases),
            f"data stage phase {name}")

    def set_training_set(self, client_id: int, keep: np.ndarray, images: np.ndarray, labels: np.ndarray) -> None:
        self.training_sets[client_id] = (keep, ray.put({"images": images, "labels": labels}))

    def share(self, name: str, arrays: dict[str, np.ndarray]) -> None:
        """Put ``arrays`` in the object store once; every training task
        carries the reference and the method reads ``ctx.stage_data[name]``
        (zero-copy).  What each client receives is the stage's to ledger."""
        self.shared[name] = ray.put(dict(arrays))

    def ledger(self, client_id: int, direction: str, group: str, nbytes: int, tensors: int = 1) -> None:
        self._ledger.add(client_id, direction, group, nbytes, tensors)
