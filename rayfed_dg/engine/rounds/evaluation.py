"""Evaluation during a federation, on the worker pool.

* ``evaluate_global``: the global model on every source domain's validation
  split and on the target; for a method with client-local state also each
  client's own model (the global weights with its local state) on its (main)
  source domain's validation split, as split ``personal_val`` with the
  client's id.  Selection reads only ``source_val``, so the personal figures
  never choose anything.  Splits are cut into chunks spread over the pool and
  summed in a fixed order, so no scheduling changes a figure.
* ``evaluate_on_clients``: the new global model on each participant's own
  validation samples (e.g. FedDG-GA's generalization gaps).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.engine.store.records import Ledger, MetricRow, Split
from rayfed_dg.engine.workers.pool import WorkerPool
from rayfed_dg.methods import ClientUpdate, GlobalEval

EVAL_CHUNK = 2048


def evaluate_global(pool: WorkerPool, federation: int, global_ref: Any, split: FederatedSplit,
                    own_state: Mapping[int, dict[str, np.ndarray]], batch_size: int, r: int) -> list[MetricRow]:
    """Metric rows of round ``r``; ``own_state``: client -> its local state,
    for the clients whose own model is evaluated (empty: none)."""
    sets: list[tuple[Split, str, int | None, np.ndarray]] = \
        [(Split.SOURCE_VAL, dom, None, idx) for dom, idx in split.val.items()] + \
        [(Split.TARGET_TEST, dom, None, idx) for dom, idx in split.test.items()] + \
        [(Split.SOURCE_TEST, dom, None, idx) for dom, idx in split.source_test.items()] + \
        [(Split.HELDOUT_VAL, dom, None, idx) for dom, idx in split.heldout_val.items()]
    doms = split.client_domains
    sets += [(Split.PERSONAL_VAL, doms[c], c, split.val[doms[c]]) for c in own_state if doms[c] in split.val]
    jobs = [(name, dom, cid, c0) for name, dom, cid, idx in sets for c0 in range(0, len(idx), EVAL_CHUNK)]
    index = {(name, dom, cid): idx for name, dom, cid, idx in sets}
    out = pool.map_all(jobs, lambda w, job, attempt: w.evaluate_in.remote(
        federation, global_ref, index[job[:3]][job[3]:job[3] + EVAL_CHUNK], batch_size,
        None if job[2] is None else own_state[job[2]]), f"round {r}: evaluation")
    parts: dict[tuple, list] = {}  # one pass: a population of personal models makes sets x jobs quadratic
    for j in jobs:
        parts.setdefault(j[:3], []).append(out[j])
    rows = []
    for name, dom, cid, _ in sets:
        correct, loss, cnt = (sum(p[i] for p in parts[name, dom, cid]) for i in range(3))
        rows.append(MetricRow(r, Split(name), dom, cid, correct / max(cnt, 1), loss / max(cnt, 1), cnt))
    return rows


def evaluate_on_clients(pool: WorkerPool, federation: int, global_ref: Any, results: list[ClientUpdate],
                        client_val: Callable[[int], np.ndarray | None], batch_size: int, ledger: Ledger) -> None:
    """Set each update's ``global_eval``: one task per client on the worker
    pool; what leaves the client is its loss and accuracy, two float64."""
    out = pool.map_all([u.client for u in results], lambda w, cid, attempt: w.evaluate_in.remote(
        federation, global_ref, client_val(cid), batch_size), "evaluating the global model on a client")
    for u in results:
        correct, loss, cnt = out[u.client]
        u.global_eval = GlobalEval(accuracy=correct / max(cnt, 1), loss=loss / max(cnt, 1), samples=cnt)
        ledger.add(u.client, "up", "eval:global_on_client", 16)
