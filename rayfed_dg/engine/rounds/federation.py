"""One federation's state, and the server-side steps of a round that only read and change it.

A ``Federation`` holds what one federation is between rounds: its config
and split, the method, the global model, the client store (each client's
local state), the method's server state, the ledger group of each tensor,
what clients read besides the model (``clientdata.py``: training sets after
the data stages, the stages' shared arrays, validation subsets), what picks
each round's clients (``cohort.py``: sampling, the device model's clock, an
asynchronous mode's event simulation and model versions) and the
aggregation pipeline (``parts.py``, ``engine/aggregation/pipeline.py``: the
estimator, the server optimizer, the method's assembly).  ``get_state`` /
``set_state`` are its checkpoint.  It does no I/O but the client store's
(``engine/store/clientstore.py``: spilled states, checkpoint pieces) and
knows nothing of Ray: the server (``server.py``) moves work to the workers
and back, and calls these steps in a round's order.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from rayfed_dg.config import ExperimentConfig
from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.engine.aggregation.exact import Reducer
from rayfed_dg.engine.aggregation.pipeline import Uploads
from rayfed_dg.engine.store.clientstore import ClientStore
from rayfed_dg.engine.store.records import ClientTask, Fold
from rayfed_dg.engine.workers.worker import to_numpy_state
from rayfed_dg.errors import ConfigError
from rayfed_dg.methods import ClientUpdate, Phase, build_method
from rayfed_dg.seeding import Stream, numpy_rng, sample_clients, seed_int

from .clientdata import ClientData
from .cohort import Cohort, Schedule
from .parts import build_pipeline


def clients_per_round(cfg: ExperimentConfig, split: FederatedSplit) -> int:
    """``training.clients_per_round``, where None means every client."""
    k = cfg.training.clients_per_round
    if k is not None and k > split.num_clients:
        raise ConfigError(f"training.clients_per_round={k} exceeds the {split.num_clients} clients "
                          f"of partition {cfg.partition.strategy}; lower it or add clients")
    return split.num_clients if k is None else k



class Federation:
    def __init__(self, cfg: ExperimentConfig, split: FederatedSplit, num_classes: int, id: int):
        self.cfg, self.split, self.id = cfg, split, id  # id: the federation's number on its host's actors
        self.sizes = split.client_sizes()  # once: the split's clients never change, and it is O(population)
        self.method = build_method(cfg, split.num_clients)
        torch.manual_seed(seed_int(cfg.training.seed, Stream.INIT))
        model = self.method.build_model(num_classes)
        sd = model.state_dict()
        self.global_state = to_numpy_state(sd, sd.keys())
        self.local_keys = self.method.local_keys(model)
        self.groups = {k: self.method.tensor_group(k, k in self.local_keys) for k in sd}
        self.store = ClientStore({k: self.global_state[k] for k in sorted(self.local_keys)}, split.num_clients,
                                 int(cfg.engine.client_state_memory_mb * 2**20))
        self.server_state: dict = {}
        self.round = 0
        self.data = ClientData(split, cfg.training.seed, self.method.client_val_size())
        self.per_round = clients_per_round(cfg, split)
        self.schedule = Schedule(cfg, split, self.sizes, self.per_round, self.global_state)
        self.pipeline = build_pipeline(cfg, self.method, model, self.global_state, self.local_keys,
                                       self.method.assembles(model), self.per_round)

    # --------------------------------------------------------------- a round
    def sample(self, r: int) -> list[int]:
        return sample_clients(self.cfg.training.seed, r, self.split.num_clients, self.per_round)

    def cohort(self) -> Cohort:
        """Who the next round trains (``cohort.Schedule``)."""
        return self.schedule.next(self.round + 1, self.sample)

    def _weights(self, clients: list[int]) -> dict[int, float]:
        return self.pipeline.estimator.weights(clients, lambda ids: self.method.aggregation_weights(
            ids, self.sizes[ids], self.server_state))

    def reducer(self, clients: list[int]) -> Reducer:
        return Reducer(clients, self._weights(clients), self.global_state)

    def payloads(self, r: int, sampled: list[int], prepared: dict[int, dict[str, np.ndarray]]) -> dict[int, dict]:
        return self.method.server_payloads(r, sampled, self.server_state,
                                           numpy_rng(self.cfg.training.seed, Stream.PAYLOAD, r),
                                           self.global_state, prepared)

    def broadcast_state(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.global_state.items() if k not in self.local_keys}

    def task(self, r: int, cid: int, payload: dict, attempt: int, fold: Fold | None = None) -> ClientTask:
        """Client ``cid``'s task in round ``r``; ``attempt``: its retries so far;
        ``fold``: where its worker sums its upload (None: it travels whole)."""
        indices, extra = self.data.training_set(cid)
        return ClientTask(client=cid, round=r, indices=indices, local_state=self.store.get(cid), payload=payload,
                          extra=extra, val_indices=self.data.client_val(cid),
                          fault_p=self.cfg.engine.fault_probability, stage_data=dict(self.data.stage_data),
                          attempt=attempt, fold=fold, dp_clip=self.pipeline.estimator.client_clip())

    def aggregate(self, c: Cohort, reducer: Reducer, updates: dict[int, ClientUpdate]) -> list[ClientUpdate]:
        """The new global model from round ``c``'s uploads (the aggregation
        pipeline); returns the round's results in client order."""
        results = [updates[k] for k in sorted(updates)]
        got = [k for k in c.order() if k in updates]
        est = self.pipeline.estimator
        starts = c.starts
        u = Uploads(c.round, self.global_state, reducer, updates, got,
                    reducer.weights if est.sums else self._weights(got),
                    {k: self.schedule.versions[t.version] for k, t in starts.items()},
                    {k: t.staleness for k, t in starts.items()})
        self.global_state = self.pipeline.run(u, results, self.server_state)
        return results

    def end_round(self, c: Cohort, results: list[ClientUpdate]) -> None:
        if c.train:  # a round on the clock in which nobody trained leaves the method's state as it was
            self.method.after_round(c.round, results, self.server_state)
        self.round = c.round
        self.schedule.finish(c, self.global_state)

    def personalizes(self) -> bool:
        """Whether clients keep model state that changes their predictions
        (FedBN, SiloBN, gPerXAN, FedFD on those bases), so that each client's
        own model is worth evaluating beside the global one."""
        return bool(self.local_keys) and Phase.PERSONAL_EVAL in self.method.phases and self.cfg.evaluation.personal

    def own_states(self, r: int) -> Mapping[int, dict[str, np.ndarray]]:
        """Each client's local state, for the clients whose own model round
        ``r`` evaluates (none unless ``personalizes``): every client with a
        state, read from the store as the evaluation asks for each, or, past
        ``evaluation.personal_clients`` of them, a seeded sample of that many
        drawn afresh each round (read at once)."""
        if not self.personalizes():
            return {}
        view, k, doms = self.store.view(), self.cfg.evaluation.personal_clients, self.split.client_domains
        have = [c for c in self.store.clients() if doms[c] in self.split.val]  # those with a split to evaluate on
        if k is None or len(have) <= k:
            return view
        pick = numpy_rng(self.cfg.training.seed, Stream.PERSONAL_EVAL, r).choice(have, size=k, replace=False)
        return {c: view[c] for c in sorted(pick.tolist())}

    # ------------------------------------------------------------ checkpoint
    def get_state(self, pieces: Path | None = None, clients: bool = True) -> dict:
        """The federation's state.  ``pieces``: a checkpoint's folder: the
        client states changed since the previous checkpoint are written
        there, and the state holds the store's manifest (``client_pieces``);
        None: every client's state, in memory (``client_store``: tests and
        tools), or none (``clients`` False: the global model is what is wanted)."""
        store = {"client_pieces": self.store.checkpoint(pieces, self.round)} if pieces is not None else \
            {"client_store": self.store.snapshot()} if clients else {}
        return {"round": self.round, "global_state": self.global_state, **store, "server_state": self.server_state,
                **self.schedule.state_dict(self.round), **self.pipeline.state_dict()}

    def set_state(self, state: dict) -> None:
        """``state`` from ``get_state``; its ``client_pieces`` carries the
        folder of its pieces (``directory``), added by whoever loaded it."""
        self.round = int(state["round"])
        self.global_state = state["global_state"]
        if "client_pieces" in state:
            self.store.load(state["client_pieces"], Path(state["client_pieces"]["directory"]))
        else:  # every client's state inside the state (``get_state`` without a folder; older checkpoints)
            self.store.load_states(state["client_store"])
        self.server_state = state["server_state"]
        self.schedule.load_state_dict(state, self.round, self.global_state)
        self.pipeline.load_state_dict(state)
