"""What a client's task reads besides the model: its training set after the
data stages, the arrays the stages share with every client, and, for methods
that select their local model on the client, a fixed validation subset."""
from __future__ import annotations

from typing import Any

import numpy as np

from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.seeding import Stream, numpy_rng


class ClientData:
    def __init__(self, split: FederatedSplit, seed: int, val_size: int):
        self.split, self.seed, self.val_size = split, seed, val_size
        # client -> its training set after the data stages: (dataset indices, ObjectRef of added samples); filled
        # once, before round 1, by the data stages (CCST), empty without them: rounds never grow it
        self.training_sets: dict[int, tuple[np.ndarray, Any]] = {}
        self.stage_data: dict[str, Any] = {}  # name -> ObjectRef of arrays a data stage shared with every client
        self._val_pools: dict[str, np.ndarray | None] = {}  # a client's domains -> their validation samples

    def add_stage_outputs(self, training_sets: dict[int, tuple[np.ndarray, Any]], shared: dict[str, Any]) -> None:
        """What one data stage produced (``StageHost``); a later stage reads it."""
        self.training_sets.update(training_sets)
        self.stage_data.update(shared)

    def training_set(self, cid: int) -> tuple[np.ndarray, Any]:
        return self.training_sets.get(cid, (self.split.clients[cid], None))

    def client_val(self, cid: int) -> np.ndarray | None:
        """A fixed, seeded subset of the validation split of the client's main
        source domain, for methods that select their local model on the client.
        Drawn again at each call (a few microseconds) rather than cached per
        client, so the server's memory does not grow with the clients it has seen."""
        n = self.val_size
        val = self._val_pool(self.split.client_domains[cid]) if n > 0 else None
        if val is not None and len(val) > n:
            val = np.sort(numpy_rng(self.seed, Stream.CLIENT_VAL, cid).choice(val, n, replace=False))
        return val

    def _val_pool(self, domains: str) -> np.ndarray | None:
        """The validation samples of a client's domains (a multi-domain client,
        "photo+art_painting" or the centralized client, validates on all of
        them), one array per distinct domain string."""
        if domains not in self._val_pools:
            doms = [d for d in domains.split("+") if d in self.split.val]
            self._val_pools[domains] = np.sort(np.concatenate([self.split.val[d] for d in doms])) if doms else None
        return self._val_pools[domains]
