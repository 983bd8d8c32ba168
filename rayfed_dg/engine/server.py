"""The server actor: client sampling, broadcast, in-order reduce; evaluation in ``evaluation.py``.

One ``run_round`` call is one federated round:

1. sample ``clients_per_round`` of the N clients with the round's seed;
2. the global weights are already in the object store (one ``ray.put`` per
   round, after the previous aggregation); workers read them zero-copy;
3. if the method asks (``prepares_round``), every sampled client runs its
   preparation phase with this global model, and the server hands the
   results to the method's ``server_payloads``;
4. dispatch the sampled clients' training to the worker pool (``pool.py``:
   largest first, small clients grouped into one Ray task, two tasks in
   flight per worker, retries, drops);
5. fold updates into the average as they arrive, in client-id order, and
   write each client's local state back into the client store;
6. with a server optimizer (``server_opt.py``), step from the global model
   along the average minus it (FedAvgM, FedAdam, ...); then
   let the method set the tensors it assembles itself (``assemble_global``),
   put the new global model in the object store and evaluate it on every
   source domain's validation split and on the target domain.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray
import torch

from rayfed_dg.config import ExperimentConfig
from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.errors import EngineError
from rayfed_dg.methods import ClientUpdate, build_method
from rayfed_dg.seeding import Stream, numpy_rng, sample_clients, seed_int
from rayfed_dg.stages import build_stages

from .aggregate import OrderedReducer
from .evaluation import evaluate_global, evaluate_on_clients
from .plan import clients_per_round
from .pool import WorkerPool
from .records import ClientRow, ClientStore, ClientTask, DropRow, Ledger, MetricRow, RoundResult
from .server_opt import ServerOptimizer, stepped_keys
from .stagehost import StageHost
from .worker import to_numpy_state


class Server:
    """One experiment's server actor: it keeps the worker pool for the
    experiment and runs one federation at a time (``start``)."""

    def __init__(self, workers: list, data_source: Any):
        # started by EngineHost, with the workers and data source it is handed
        self.data_source = data_source
        self.pool = WorkerPool(workers, 0)  # waits until every worker is up
        self.federation = 0

    def retire_restarted(self) -> list[int]:
        """End the workers whose process died since they were started (their
        Ray restart budget is spent, or they left the pool); returns their
        places for ``replace_workers``."""
        gone = sorted(self.pool.restarted)
        for w in gone:
            ray.kill(self.pool.workers[w])
        return gone

    def replace_workers(self, fresh: dict[int, Any]) -> None:
        self.pool.replace(fresh)

    def start(self, cfg: ExperimentConfig, split: FederatedSplit, num_classes: int, federation: int) -> None:
        """Begin a federation (its workers build its model on their first task)."""
        self.cfg = cfg
        self.split = split
        self.federation = federation
        self.method = build_method(cfg, split.num_clients)
        torch.manual_seed(seed_int(cfg.training.seed, Stream.INIT))
        model = self.method.build_model(num_classes)
        sd = model.state_dict()
        self.global_state = to_numpy_state(sd, sd.keys())
        self.local_keys = self.method.local_keys(model)
        self.groups = {k: self.method.tensor_group(k, k in self.local_keys) for k in sd}
        self.store = ClientStore({k: self.global_state[k] for k in sorted(self.local_keys)})
        self.server_state: dict = {}
        # None for server.optimizer none: the average is the new global model, as it always was
        self.server_opt = ServerOptimizer.from_config(cfg.server, self.global_state,
                                                      stepped_keys(model, self.local_keys))
        self.round = 0
        e = cfg.engine
        self.pool.retries, self.pool.restart_timeout_s = e.max_task_retries, e.worker_restart_timeout_s
        self.pool.retried = self.pool.reruns = 0
        self.global_ref = ray.put(self.global_state)
        # client -> its training set after the data stages: (dataset indices, ObjectRef of added samples)
        self.training_sets: dict[int, tuple[np.ndarray, object]] = {}
        self.stage_data: dict[str, object] = {}  # name -> ObjectRef of arrays a data stage shared with every client
        self._client_val: dict[int, np.ndarray | None] = {}  # client -> its fixed validation indices

    # ------------------------------------------------------------ data stages
    def setup(self) -> dict:
        """Run the configured data stages before round 1; returns their
        ledger rows (round 0) and costs.  Stages are deterministic and
        cached, so they are simply run again on resume."""
        ledger, info = Ledger(0), {}
        for i, stage in enumerate(build_stages(self.cfg)):
            info[stage.name] = stage.run(StageHost(self, i, ledger))
        return {"ledger": ledger.rows, "info": info}

    def training_set(self, cid: int) -> tuple[np.ndarray, object]:
        return self.training_sets.get(cid, (self.split.clients[cid], None))

    # --------------------------------------------------------------- state
    def broadcast_state(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.global_state.items() if k not in self.local_keys}

    def get_state(self) -> dict:
        return {"round": self.round, "global_state": self.global_state, "client_store": self.store.states,
                "server_state": self.server_state,
                **({"server_optimizer": self.server_opt.state_dict()} if self.server_opt is not None else {})}

    def set_state(self, state: dict) -> None:
        self.round = int(state["round"])
        self.global_state = state["global_state"]
        self.store.states = state["client_store"]
        self.server_state = state["server_state"]
        if self.server_opt is not None:  # a config with a server optimizer resumes only its own runs (check_resume_dir)
            self.server_opt.load_state_dict(state["server_optimizer"])
        self.global_ref = ray.put(self.global_state)

    def client_val(self, cid: int) -> np.ndarray | None:
        """A fixed, seeded subset of the validation split of the client's main
        source domain, for methods that select their local model on the client."""
        if cid not in self._client_val:
            n = self.method.client_val_size()
            # a multi-domain client ("photo+art_painting", the centralized client) validates on all its domains
            doms = [d for d in self.split.client_domains[cid].split("+") if d in self.split.val]
            val = np.sort(np.concatenate([self.split.val[d] for d in doms])) if n > 0 and doms else None
            if val is not None and len(val) > n:
                val = np.sort(numpy_rng(self.cfg.training.seed, Stream.CLIENT_VAL, cid).choice(val, n, replace=False))
            self._client_val[cid] = val
        return self._client_val[cid]

    def _task(self, r: int, cid: int, payload: dict) -> ClientTask:
        indices, extra = self.training_set(cid)
        return ClientTask(client=cid, round=r, indices=indices, local_state=self.store.get(cid), payload=payload,
                          extra=extra, val_indices=self.client_val(cid), fault_p=self.cfg.engine.fault_probability,
                          stage_data=dict(self.stage_data))

    # --------------------------------------------------------------- round
    def run_round(self) -> RoundResult:
        t0 = time.perf_counter()
        r, seed = self.round + 1, self.cfg.training.seed
        sampled = sample_clients(seed, r, self.split.num_clients, clients_per_round(self.cfg, self.split))
        sizes = self.split.client_sizes()[sampled]
        reducer = OrderedReducer(sampled, dict(zip(sampled, self.method.aggregation_weights(
            sampled, sizes, self.server_state))))
        ledger = Ledger(r)
        prepared = self._prepare(r, sampled, ledger) if self.method.prepares_round else {}
        payloads = self.method.server_payloads(r, sampled, self.server_state, numpy_rng(seed, Stream.PAYLOAD, r),
                                               self.global_state, prepared)
        bcast = self.broadcast_state()
        bcast_sizes = Ledger.group_sizes(bcast, self.groups.__getitem__)  # every client receives these
        updates: dict[int, ClientUpdate] = {}

        def on_update(cid: int, upd: ClientUpdate | None) -> None:
            reducer.add(cid, None if upd is None else upd.update)
            if upd is None:
                return
            updates[cid] = upd
            self.store.put(cid, upd.update, upd.private)
            ledger.add_state(cid, "up", upd.update, self.groups.__getitem__)
            ledger.add_payload(cid, "up", upd.payload)
            ledger.add_state(cid, "down", bcast_sizes)
            ledger.add_payload(cid, "down", payloads.get(cid, {}))

        task = lambda cid, attempt: _retry(self._task(r, cid, payloads.get(cid, {})), attempt)
        t_clients = time.perf_counter()
        dropped = self.pool.map(
            sampled, lambda w, cid, attempt: w.train_in.remote(self.federation, task(cid, attempt), self.global_ref),
            on_update, cost=dict(zip(sampled, sizes.tolist())),
            largest_first=self.cfg.engine.schedule == "largest_first",
            submit_many=None if not self.cfg.engine.group_small_clients else lambda w, jobs: w.train_many_in.remote(
                self.federation, [task(cid, attempt) for cid, attempt in jobs], self.global_ref))
        seconds_clients = time.perf_counter() - t_clients
        retries = dict(self.pool.last_retries)
        if len(reducer.dropped) == len(sampled):
            raise EngineError(f"round {r}: every sampled client failed ({dropped[0][1]})")
        results = [updates[c] for c in sorted(updates)]
        x_t, self.global_state = self.global_state, reducer.result(self.global_state)
        if self.server_opt is not None:  # before the tensors a method assembles itself: those replace the step's
            self.global_state = self.server_opt.step(x_t, self.global_state)
        self.global_state.update(self.method.assemble_global(r, results, self.global_state, self.server_state))
        self.global_ref = ray.put(self.global_state)
        if self.method.evaluates_global_on_clients:
            self._evaluate_on_clients(results, ledger)
        self.method.after_round(r, results, self.server_state)
        self.round = r
        seconds_train = time.perf_counter() - t0
        every = self.cfg.evaluation.every
        metrics = self.evaluate(r) if (every and r % every == 0) or r == self.cfg.training.rounds else []
        return RoundResult(
            round=r, sampled=sampled, dropped=[DropRow(r, c, why) for c, why in dropped],
            metrics=metrics, ledger=ledger.sorted_rows(),
            clients=self._client_rows(r, sampled, updates, dict(dropped), retries, ledger),
            train_loss=float(np.mean([u.train_loss for u in results])), tasks_retried=self.pool.retried,
            tasks_rerun=self.pool.reruns,
            seconds_train=seconds_train, seconds_total=time.perf_counter() - t0, seconds_clients=seconds_clients)

    def _client_rows(self, r: int, sampled: list[int], updates: dict[int, ClientUpdate], dropped: dict[int, str],
                     retries: dict[int, int], ledger: Ledger) -> list[ClientRow]:
        """One ``ClientRow`` per sampled client; its bytes from the round's ledger."""
        wire: dict[tuple[int, str], int] = {}
        for row in ledger.rows:
            wire[row.client, row.direction] = wire.get((row.client, row.direction), 0) + row.bytes
        sizes = self.split.client_sizes()
        rows = []
        for cid in sampled:
            u = updates.get(cid)
            rows.append(ClientRow(
                round=r, client=cid, domain=self.split.client_domains[cid],
                samples=int(u.num_samples if u is not None else sizes[cid]),
                local_steps=u.steps if u is not None else 0,
                train_loss=u.train_loss if u is not None else None, seconds=u.seconds if u is not None else None,
                bytes_up=wire.get((cid, "up"), 0), bytes_down=wire.get((cid, "down"), 0),
                retried=retries.get(cid, 0), dropped=u is None, drop_reason=dropped.get(cid)))
        return rows

    def _prepare(self, r: int, sampled: list[int], ledger: Ledger) -> dict[int, dict[str, np.ndarray]]:
        """The method's per-round client phase; every sampled client must
        answer (what it computes decides what the others receive)."""
        out = self.pool.map_all(sampled, lambda w, cid, attempt: w.prepare_in.remote(
            self.federation, _retry(self._task(r, cid, {}), attempt), self.global_ref),
            f"round {r}: the preparation phase")
        for cid in sorted(out):  # the global model it used is the round's one broadcast (counted with training)
            ledger.add_payload(cid, "up", out[cid], prefix="prepare")
        return out

    def _evaluate_on_clients(self, results: list[ClientUpdate], ledger: Ledger) -> None:
        evaluate_on_clients(self.pool, self.federation, self.global_ref, results, self.client_val,
                            self.cfg.evaluation.batch_size, ledger)

    def personalizes(self) -> bool:
        """Whether clients keep model state that changes their predictions
        (FedBN, SiloBN, gPerXAN, FedFD on those bases), so that each client's
        own model is worth evaluating beside the global one."""
        return bool(self.local_keys) and self.method.local_state_predicts and self.cfg.evaluation.personal

    def evaluate(self, r: int) -> list[MetricRow]:
        own = {c: self.store.get(c) for c in sorted(self.store.states)} if self.personalizes() else {}
        return evaluate_global(self.pool, self.federation, self.global_ref, self.split, own,
                               self.cfg.evaluation.batch_size, r)

    def shutdown(self) -> None:
        self.pool.shutdown()
        ray.kill(self.data_source)


def launch_server(cfg: ExperimentConfig, split: FederatedSplit, data_refs: list, num_classes: int, n_workers: int,
                  worker_options: dict | None = None) -> Any:
    """A one-federation experiment's server, started (``EngineHost``) and
    holding ``split``'s federation; ``shutdown`` ends its actors.  For tests
    and tools that drive a server round by round."""
    from .host import EngineHost

    host = EngineHost(cfg.engine, data_refs, n_workers, worker_options)
    host.open(cfg, split, num_classes)
    return host.server


def _retry(task: ClientTask, attempt: int) -> ClientTask:
    task.attempt = attempt
    return task
