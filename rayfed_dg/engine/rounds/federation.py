"""One federation's state, and the server-side steps of a round that only read and change it.

A ``Federation`` holds what one federation is between rounds: its config
and split, the method, the global model, the client store (each client's
local state), the method's server state, the server optimizer, the ledger
group of each tensor, the clients' training sets and the arrays the data
stages share (``add_stage_outputs``), and the validation samples of each
set of domains (a client's fixed validation subset is drawn from them,
seeded, when asked for); with ``devices.enabled``, the device model and its
clock (``clock_plan``: whom a round trains, ``devices.py``); in an
asynchronous server mode, the event simulation and the global model of each
version still in flight (``apply_async``: the update's equations,
``asynchronous.py``).  ``get_state`` / ``set_state`` are its checkpoint.
It does no I/O but the client store's (``clientstore.py``: spilled states,
checkpoint pieces) and knows nothing of Ray: the server (``server.py``)
moves work to the workers and back, and calls these steps in a round's
order.

The new global model of a round (``aggregate``), from the global model x_t
it started from and the reduce's weighted average (``aggregate.py``: an
order-independent sum of the uploads, folded on the workers unless the
method reads them, ``Method.folds_on_workers``):

1. every key starts at the average (the previous value where nobody
   uploaded one);
2. with a server optimizer (``server_opt.py``), the broadcast parameters
   that neither stay local nor are the method's own step from x_t along the
   average minus x_t;
3. the method sets the keys it declares in ``assembles`` (``assemble_global``,
   given the average and x_t); setting any other key is an error.

With DP-FedAvg (``privacy.updates``, ``dp.py``) every client weighs 1, the
workers fold clipped updates instead of weights, and step 1 takes, for the
float keys uploaded, x_t plus the noised sum over m (``UpdateDP.release``);
the clip of the next round follows (adaptive clipping).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rayfed_dg.config import DevicesConfig, ExperimentConfig
from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.engine.aggregation.exact import Reducer
from rayfed_dg.engine.aggregation.server_opt import ServerOptimizer, stepped_keys
from rayfed_dg.engine.clock import asynchronous as aio
from rayfed_dg.engine.clock.devices import DeviceModel, RoundPlan, model_bytes, plan_round, planned_steps
from rayfed_dg.engine.privacy.updates import UpdateDP, float_keys
from rayfed_dg.engine.store.clientstore import ClientStore
from rayfed_dg.engine.store.records import ClientTask, Fold
from rayfed_dg.engine.workers.worker import to_numpy_state
from rayfed_dg.errors import ConfigError, EngineError
from rayfed_dg.methods import ClientUpdate, Phase, build_method
from rayfed_dg.seeding import Stream, numpy_rng, sample_clients, seed_int


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
        self.assembled = self.method.assembles(model)
        self.groups = {k: self.method.tensor_group(k, k in self.local_keys) for k in sd}
        self.store = ClientStore({k: self.global_state[k] for k in sorted(self.local_keys)}, split.num_clients,
                                 int(cfg.engine.client_state_memory_mb * 2**20))
        self.server_state: dict = {}
        # None for server.optimizer none: the average is the new global model, as it always was
        self.server_opt = ServerOptimizer.from_config(cfg.server, self.global_state,
                                                      stepped_keys(model, self.local_keys | self.assembled))
        self.round = 0
        # client -> its training set after the data stages: (dataset indices, ObjectRef of added samples); filled
        # once, before round 1, by the data stages (CCST), empty without them: rounds never grow it
        self.training_sets: dict[int, tuple[np.ndarray, Any]] = {}
        self.stage_data: dict[str, Any] = {}  # name -> ObjectRef of arrays a data stage shared with every client
        self._val_pools: dict[str, np.ndarray | None] = {}  # a client's domains -> their validation samples
        # the device model (devices.enabled) and its clock: simulated seconds at which the next round starts
        self.devices = DeviceModel(cfg.devices, cfg.training.seed, split.client_domains,
                                   model_bytes(self.global_state)) if cfg.devices.enabled else None
        self.clock = 0.0
        self.steps = np.array([planned_steps(cfg.training, int(n)) for n in self.sizes]) \
            if cfg.devices.enabled else None  # each client's local steps in a round, which its duration counts
        # asynchronous modes: the virtual clock, and the global model of every version still in flight (and the
        # current one), since each client trains from the version it downloaded
        self.async_clock = self._async_clock() if cfg.server.mode != "sync" else None
        self.versions: dict[int, dict[str, np.ndarray]] = {0: self.global_state} if self.async_clock is not None else {}
        u = cfg.privacy.updates if cfg.privacy is not None else None
        uploaded = set(sd) - self.method.private_keys(model)
        self.dp = None if u is None else UpdateDP(u, cfg.training.seed, clients_per_round(cfg, split),
                                                  float_keys(sd, uploaded))

    # ------------------------------------------------------------ data stages
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
        n = self.method.client_val_size()
        val = self._val_pool(self.split.client_domains[cid]) if n > 0 else None
        if val is not None and len(val) > n:
            val = np.sort(numpy_rng(self.cfg.training.seed, Stream.CLIENT_VAL, cid).choice(val, n, replace=False))
        return val

    def _val_pool(self, domains: str) -> np.ndarray | None:
        """The validation samples of a client's domains (a multi-domain client,
        "photo+art_painting" or the centralized client, validates on all of
        them), one array per distinct domain string."""
        if domains not in self._val_pools:
            doms = [d for d in domains.split("+") if d in self.split.val]
            self._val_pools[domains] = np.sort(np.concatenate([self.split.val[d] for d in doms])) if doms else None
        return self._val_pools[domains]

    # --------------------------------------------------------------- a round
    def sample(self, r: int) -> list[int]:
        per_round = clients_per_round(self.cfg, self.split)
        return sample_clients(self.cfg.training.seed, r, self.split.num_clients, per_round)

    def clock_plan(self, r: int) -> RoundPlan | None:
        """Round ``r`` on the device model's clock (``devices.plan_round``):
        whom it selects, aggregates, and when it closes; None without one."""
        if self.devices is None or self.steps is None:
            return None
        d = self.cfg.devices
        return plan_round(self.devices, self.split.num_clients, self.cfg.training.seed, r, self.clock,
                          clients_per_round(self.cfg, self.split), self.steps, d.over_selection, d.deadline_s,
                          d.wait_s)

    def reducer(self, sampled: list[int]) -> Reducer:
        if self.dp is not None:  # the fixed-denominator estimator: every client weighs 1 (dp.py)
            return Reducer(sampled, dict.fromkeys(sampled, 1.0))
        sizes = self.sizes[sampled]
        return Reducer(sampled, dict(zip(sampled, self.method.aggregation_weights(
            sampled, sizes, self.server_state))))

    def payloads(self, r: int, sampled: list[int], prepared: dict[int, dict[str, np.ndarray]]) -> dict[int, dict]:
        return self.method.server_payloads(r, sampled, self.server_state,
                                           numpy_rng(self.cfg.training.seed, Stream.PAYLOAD, r),
                                           self.global_state, prepared)

    def broadcast_state(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.global_state.items() if k not in self.local_keys}

    def task(self, r: int, cid: int, payload: dict, attempt: int, fold: Fold | None = None) -> ClientTask:
        """Client ``cid``'s task in round ``r``; ``attempt``: its retries so far;
        ``fold``: where its worker sums its upload (None: it travels whole)."""
        indices, extra = self.training_set(cid)
        return ClientTask(client=cid, round=r, indices=indices, local_state=self.store.get(cid), payload=payload,
                          extra=extra, val_indices=self.client_val(cid), fault_p=self.cfg.engine.fault_probability,
                          stage_data=dict(self.stage_data), attempt=attempt, fold=fold,
                          dp_clip=None if self.dp is None else self.dp.clip)

    def aggregate(self, r: int, reducer: Reducer, results: list[ClientUpdate]) -> None:
        """The new global model (the module docstring's three steps)."""
        x_t, average = self.global_state, reducer.result(self.global_state)
        if self.dp is not None:
            average.update(self.dp.release(r, reducer.sums(self.dp.keys), x_t))
            self.dp.adapt(r, sum(bool(u.unclipped) for u in results), len(results))
        new = average if self.server_opt is None else self.server_opt.step(x_t, average)
        own = self.method.assemble_global(r, results, average, x_t, self.server_state)
        if not own.keys() <= self.assembled:
            raise EngineError(f"method {self.method.name}: assemble_global set {sorted(own.keys() - self.assembled)}, "
                              "which its assembles(model) does not name; add them there")
        new.update(own)
        self.global_state = new

    def end_round(self, r: int, results: list[ClientUpdate]) -> None:
        self.method.after_round(r, results, self.server_state)
        self.round = r

    def personalizes(self) -> bool:
        """Whether clients keep model state that changes their predictions
        (FedBN, SiloBN, gPerXAN, FedFD on those bases), so that each client's
        own model is worth evaluating beside the global one."""
        return bool(self.local_keys) and Phase.PERSONAL_EVAL in self.method.phases and self.cfg.evaluation.personal

    def own_states(self) -> Mapping[int, dict[str, np.ndarray]]:
        """Each client's local state, for the clients whose own model is
        evaluated (none unless ``personalizes``), read from the store as the
        evaluation asks for each."""
        return self.store.view() if self.personalizes() else {}

    # ------------------------------------------------------------ asynchronous modes
    def _async_clock(self) -> aio.AsyncClock:
        n, sizes = self.split.num_clients, self.sizes
        aio.check_async(self.cfg, n)  # the run's preflight did; a federation opened by hand is checked too
        # without devices.enabled: the section's defaults, every device online, one simulated second a local step
        devices = self.devices if self.devices is not None else DeviceModel(
            DevicesConfig(), self.cfg.training.seed, self.split.client_domains)
        return aio.AsyncClock(n, aio.concurrency(self.cfg, n), aio.buffer_size(self.cfg, n), self.cfg.training.seed,
                              devices, lambda c: planned_steps(self.cfg.training, int(sizes[c])),
                              self.cfg.server.retry_s)

    def apply_async(self, arrivals: list[aio.Training], updates: dict[int, ClientUpdate]) -> None:
        """The new global model from one server update's arrivals (in the
        clock's order) that returned an upload (``asynchronous.py``'s equations)."""
        s = self.cfg.server
        got = [t for t in arrivals if t.client in updates]
        ids = [t.client for t in got]
        weights = self.method.aggregation_weights(ids, self.sizes[ids], self.server_state)
        x = self.global_state
        if s.mode == "fedasync":
            (t,) = got
            alpha = aio.fedasync_alpha(s.alpha, s.staleness, t.staleness, s.staleness_a, s.staleness_b)
            self.global_state = aio.fedasync_step(x, updates[t.client].update, alpha)
            return
        delta = aio.fedbuff_delta(x, [(updates[t.client].update, self.versions[t.version], float(w),
                                       aio.staleness_weight(s.staleness, t.staleness, s.staleness_a, s.staleness_b))
                                      for t, w in zip(got, weights)])
        if self.server_opt is None:
            self.global_state = aio.fedbuff_step(x, delta, s.eta)
        else:  # the optimizer steps along the buffer's mean update (FedBuff's ServerUpdate)
            self.global_state = self.server_opt.step(x, aio.fedbuff_step(x, delta, 1.0))

    def keep_versions(self) -> None:
        """After an update: the new version is kept, and those no training in flight started from are let go."""
        assert self.async_clock is not None
        self.versions[self.round] = self.global_state
        live = self.async_clock.in_flight_versions() | {self.round}
        self.versions = {v: st for v, st in self.versions.items() if v in live}

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
                "clock": self.clock,
                **({"server_optimizer": self.server_opt.state_dict()} if self.server_opt is not None else {}),
                **({"dp_clip": self.dp.clip} if self.dp is not None else {}),
                **({"async": {"clock": self.async_clock.state_dict(),  # the current version is global_state
                              "versions": {v: st for v, st in self.versions.items() if v != self.round}}}
                   if self.async_clock is not None else {})}

    def set_state(self, state: dict) -> None:
        """``state`` from ``get_state``; its ``client_pieces`` carries the
        folder of its pieces (``directory``), added by whoever loaded it."""
        self.round = int(state["round"])
        self.global_state = state["global_state"]
        if "client_pieces" in state:
            self.store.load(state["client_pieces"], Path(state["client_pieces"]["directory"]))
        else:  # a checkpoint written before pieces: every state inside it
            self.store.load_states(state["client_store"])
        self.server_state = state["server_state"]
        self.clock = float(state.get("clock", 0.0))  # checkpoints written before the clock have none
        if self.server_opt is not None:  # a config with a server optimizer resumes only its own runs (check_resume_dir)
            self.server_opt.load_state_dict(state["server_optimizer"])
        if self.dp is not None:  # likewise DP-FedAvg: the clip adaptive clipping reached
            self.dp.clip = float(state["dp_clip"])
        if self.async_clock is not None:  # likewise an asynchronous mode
            self.async_clock.load_state_dict(state["async"]["clock"])
            self.versions = {**state["async"]["versions"], self.round: self.global_state}
