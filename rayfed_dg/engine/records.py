"""Typed records of a round and the two stores the server keeps.

``ClientTask``   what a worker needs to run one client in one round
``RoundResult``  what ``Server.run_round`` returns to the driver
``Ledger``       what crossed the wire: rows (round, client, direction,
                 group, tensors, bytes), one per tensor group
``ClientStore``  each client's persistent local state between rounds

(``ClientUpdate``, what a training task returns, is defined with the method
hooks in ``methods/base.py``, since ``after_round`` receives it.)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class ClientTask:
    client: int
    round: int
    indices: np.ndarray  # the client's training samples in the dataset
    local_state: dict[str, np.ndarray]  # from the client store
    payload: dict[str, np.ndarray] = field(default_factory=dict)  # the method's per-client broadcast
    extra: Any = None  # a data stage's added samples {"images", "labels"} (or an ObjectRef of them), or None
    val_indices: np.ndarray | None = None  # for client-side selection (``client_val_size``)
    stage_data: dict[str, Any] = field(default_factory=dict)  # data stages' shared arrays (or ObjectRefs), by name
    attempt: int = 0  # retries of this task so far (faults are seeded per attempt)
    fault_p: float = 0.0


@dataclass
class RoundResult:
    round: int
    sampled: list[int]
    dropped: list[dict]  # {"round", "client", "reason"}
    metrics: list[dict]  # evaluation rows: round, split, domain, accuracy, loss, samples
    ledger: list[dict]
    clients: list[dict]  # one row per returned client: client, samples, train_loss, seconds
    train_loss: float
    tasks_retried: int  # over the run so far
    seconds_train: float
    seconds_total: float


class Ledger:
    """Rows of what crossed the wire in one round (or the data stage, round 0)."""

    def __init__(self, round: int):
        self.round = round
        self.rows: list[dict] = []

    def add(self, client: int, direction: str, group: str, nbytes: int, tensors: int = 1) -> None:
        self.rows.append({"round": self.round, "client": int(client), "direction": direction, "group": group,
                          "tensors": int(tensors), "bytes": int(nbytes)})

    def add_state(self, client: int, direction: str, arrays: dict[str, np.ndarray],
                  group_of: Callable[[str], str]) -> None:
        """Model tensors, one row per tensor group."""
        groups: dict[str, list[int]] = {}
        for key, arr in arrays.items():
            g = groups.setdefault(group_of(key), [0, 0])
            g[0] += 1
            g[1] += arr.nbytes
        for group, (cnt, b) in sorted(groups.items()):
            self.add(client, direction, group, b, cnt)

    def add_payload(self, client: int, direction: str, payload: dict[str, np.ndarray], prefix: str = "payload") -> None:
        for name, arr in sorted(payload.items()):
            self.add(client, direction, f"{prefix}:{name}", int(np.asarray(arr).nbytes))

    def sorted_rows(self) -> list[dict]:
        return sorted(self.rows, key=lambda x: (x["client"], x["direction"], x["group"]))


class ClientStore:
    """Per-client persistent state (``local_keys`` and ``private_keys``),
    kept by the server across rounds; a client seen for the first time starts
    from ``initial`` (the initial model's local tensors)."""

    def __init__(self, initial: dict[str, np.ndarray]):
        self.initial = initial
        self.states: dict[int, dict[str, np.ndarray]] = {}

    def get(self, client: int) -> dict[str, np.ndarray]:
        return self.states.get(client, self.initial)

    def put(self, client: int, update: dict[str, np.ndarray], private: dict[str, np.ndarray]) -> None:
        local = {k: update[k] for k in self.initial if k in update}
        local.update(private)
        # copies: ``update`` may be read-only views of the object store
        self.states[client] = {k: np.array(v) for k, v in local.items()}
