"""The engine side of a data stage (``stages.base.StageServer``): the
stage's client phases on the worker pool, its per-client training sets, the
arrays it shares with every client, and its ledger rows (round 0)."""
from __future__ import annotations

from typing import Any

import numpy as np
import ray

from .records import Ledger


class StageHost:
    def __init__(self, server: Any, index: int, ledger: Ledger):
        self._server, self._index, self._ledger = server, index, ledger
        self.num_clients = server.split.num_clients
        self.seed = server.cfg.training.seed

    def training_set(self, client_id: int) -> np.ndarray:
        return self._server.training_set(client_id)[0]

    def map(self, phase: str, args: dict[int, dict]) -> dict[int, object]:
        s = self._server
        return s.pool.map_all(sorted(args), lambda w, cid, attempt: w.run_stage_in.remote(
            s.federation, self._index, phase, cid, self.training_set(cid), args[cid]), f"data stage phase {phase!r}")

    def set_training_set(self, client_id: int, keep: np.ndarray, images: np.ndarray, labels: np.ndarray) -> None:
        self._server.training_sets[client_id] = (keep, ray.put({"images": images, "labels": labels}))

    def share(self, name: str, arrays: dict[str, np.ndarray]) -> None:
        """Put ``arrays`` in the object store once; every training task
        carries the reference and the method reads ``ctx.stage_data[name]``
        (zero-copy).  What each client receives is the stage's to ledger."""
        self._server.stage_data[name] = ray.put(dict(arrays))

    def ledger(self, client_id: int, direction: str, group: str, nbytes: int, tensors: int = 1) -> None:
        self._ledger.add(client_id, direction, group, nbytes, tensors)
