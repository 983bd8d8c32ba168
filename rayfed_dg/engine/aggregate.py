"""Streaming weighted averaging in client-id order (FedAvg, gPerXAN Eq. 1).

Updates arrive in whatever order workers finish; they are folded into a
float64 accumulator strictly in ascending client id, so the sum (and hence
the global model) is bit-identical for any worker count or finishing order.
Memory stays O(model) plus the updates that arrived early.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch


class OrderedReducer:
    def __init__(self, order: list[int], weights: dict[int, float]):
        self.order = list(order)
        self.weights = dict(weights)
        self._pos = 0
        self._pending: dict[int, dict[str, np.ndarray] | None] = {}
        self._acc: dict[str, np.ndarray] = {}
        self._wsum: dict[str, float] = {}
        self.dropped: list[int] = []

    def add(self, client_id: int, update: dict[str, np.ndarray] | None) -> None:
        """``update`` None marks a client that returned nothing (dropped)."""
        self._pending[client_id] = update
        while self._pos < len(self.order) and self.order[self._pos] in self._pending:
            cid = self.order[self._pos]
            upd = self._pending.pop(cid)
            self._pos += 1
            if upd is None:
                self.dropped.append(cid)
                continue
            w = float(self.weights[cid])
            for k, v in upd.items():
                if k not in self._acc:
                    self._acc[k] = np.zeros(v.shape, dtype=np.float64)
                    self._wsum[k] = 0.0
                # in place, product and sum in float64, no temporaries (numpy's
                # astype + multiply allocates two model-sized arrays per client)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # read-only object-store view, only read
                    torch.from_numpy(self._acc[k]).add_(torch.as_tensor(np.asarray(v)), alpha=w)
                self._wsum[k] += w

    @property
    def complete(self) -> bool:
        return self._pos == len(self.order)

    def result(self, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Weighted means, renormalised over the clients that returned, cast
        to the dtype of ``like``; keys nobody uploaded keep ``like``'s value."""
        assert self.complete, "not every client has been folded in"
        out = {}
        for k, ref in like.items():
            if k in self._acc and self._wsum[k] > 0:
                mean = self._acc[k] / self._wsum[k]
                if np.issubdtype(ref.dtype, np.integer):
                    mean = np.rint(mean)
                out[k] = np.asarray(mean).astype(ref.dtype)
            else:
                out[k] = ref
        return out
