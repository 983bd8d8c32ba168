"""The server actor: client sampling, broadcast, in-order reduce, evaluation.

One ``run_round`` call is one federated round:

1. sample ``clients_per_round`` of the N clients with the round's seed;
2. the global weights are already in the object store (one ``ray.put`` per
   round, after the previous aggregation); workers read them zero-copy;
3. if the method asks (``prepares_round``), every sampled client runs its
   preparation phase with this global model, and the server hands the
   results to the method's ``server_payloads``;
4. dispatch one training task per sampled client to the worker pool
   (``pool.py``: two in flight per worker, retries, drops);
5. fold updates into the average as they arrive, in client-id order, and
   write each client's local state back into the client store;
6. let the method set the tensors it assembles itself (``assemble_global``),
   put the new global model in the object store and evaluate it on every
   source domain's validation split and on the target domain.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayfed_dg.config import ExperimentConfig
from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.datasource import DataSource
from rayfed_dg.errors import EngineError
from rayfed_dg.methods import ClientUpdate, GlobalEval, build_method
from rayfed_dg.seeding import Stream, numpy_rng, sample_clients, seed_int
from rayfed_dg.stages import build_stages

from .aggregate import OrderedReducer
from .plan import clients_per_round
from .pool import WorkerPool
from .records import ClientStore, ClientTask, Ledger, RoundResult
from .worker import Worker, to_numpy_state

EVAL_CHUNK = 2048


class Server:
    def __init__(self, cfg: ExperimentConfig, split: FederatedSplit, num_classes: int, workers: list,
                 data_source: Any):
        # started by launch_server, with the workers and data source it is handed
        self.cfg = cfg
        self.split = split
        self.data_source = data_source
        self.method = build_method(cfg, split.num_clients)
        torch.manual_seed(seed_int(cfg.training.seed, Stream.INIT))
        model = self.method.build_model(num_classes)
        sd = model.state_dict()
        self.global_state = to_numpy_state(sd, sd.keys())
        self.local_keys = self.method.local_keys(model)
        self.groups = {k: self.method.tensor_group(k, k in self.local_keys) for k in sd}
        self.store = ClientStore({k: self.global_state[k] for k in sorted(self.local_keys)})
        self.server_state: dict = {}
        self.round = 0
        e = cfg.engine
        ray.get([w.ping.remote() for w in workers])
        self.pool = WorkerPool(workers, e.max_task_retries)
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
            info[stage.name] = stage.run(_StageServer(self, i, ledger))
        return {"ledger": ledger.rows, "info": info}

    def training_set(self, cid: int) -> tuple[np.ndarray, object]:
        return self.training_sets.get(cid, (self.split.clients[cid], None))

    # --------------------------------------------------------------- state
    def broadcast_state(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.global_state.items() if k not in self.local_keys}

    def get_state(self) -> dict:
        return {"round": self.round, "global_state": self.global_state, "client_store": self.store.states,
                "server_state": self.server_state}

    def set_state(self, state: dict) -> None:
        self.round = int(state["round"])
        self.global_state = state["global_state"]
        self.store.states = state["client_store"]
        self.server_state = state["server_state"]
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
        updates: dict[int, ClientUpdate] = {}

        def on_update(cid: int, upd: ClientUpdate | None) -> None:
            reducer.add(cid, None if upd is None else upd.update)
            if upd is None:
                return
            updates[cid] = upd
            self.store.put(cid, upd.update, upd.private)
            ledger.add_state(cid, "up", upd.update, self.groups.__getitem__)
            ledger.add_payload(cid, "up", upd.payload)
            ledger.add_state(cid, "down", bcast, self.groups.__getitem__)
            ledger.add_payload(cid, "down", payloads.get(cid, {}))

        dropped = self.pool.map(sampled, lambda w, cid, attempt: w.train.remote(
            _retry(self._task(r, cid, payloads.get(cid, {})), attempt), self.global_ref), on_update)
        retries = dict(self.pool.last_retries)
        if len(reducer.dropped) == len(sampled):
            raise EngineError(f"round {r}: every sampled client failed ({dropped[0][1]})")
        results = [updates[c] for c in sorted(updates)]
        self.global_state = reducer.result(self.global_state)
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
            round=r, sampled=sampled, dropped=[{"round": r, "client": c, "reason": why} for c, why in dropped],
            metrics=metrics, ledger=ledger.sorted_rows(),
            clients=self._client_rows(r, sampled, updates, dict(dropped), retries, ledger),
            train_loss=float(np.mean([u.train_loss for u in results])), tasks_retried=self.pool.retried,
            seconds_train=seconds_train, seconds_total=time.perf_counter() - t0)

    def _client_rows(self, r: int, sampled: list[int], updates: dict[int, ClientUpdate], dropped: dict[int, str],
                     retries: dict[int, int], ledger: Ledger) -> list[dict]:
        """One row per sampled client: what it trained, how long, what crossed
        the wire (from the round's ledger), its training task's retries, and
        whether it was dropped."""
        wire: dict[tuple[int, str], int] = {}
        for row in ledger.rows:
            wire[row["client"], row["direction"]] = wire.get((row["client"], row["direction"]), 0) + row["bytes"]
        sizes = self.split.client_sizes()
        rows = []
        for cid in sampled:
            u = updates.get(cid)
            rows.append({"round": r, "client": cid, "domain": self.split.client_domains[cid],
                         "samples": int(u.num_samples if u is not None else sizes[cid]),
                         "local_steps": u.steps if u is not None else 0,
                         "train_loss": u.train_loss if u is not None else None,
                         "seconds": u.seconds if u is not None else None,
                         "bytes_up": wire.get((cid, "up"), 0), "bytes_down": wire.get((cid, "down"), 0),
                         "retried": retries.get(cid, 0), "dropped": u is None, "drop_reason": dropped.get(cid)})
        return rows

    def _prepare(self, r: int, sampled: list[int], ledger: Ledger) -> dict[int, dict[str, np.ndarray]]:
        """The method's per-round client phase; every sampled client must
        answer (what it computes decides what the others receive)."""
        out = self.pool.map_all(sampled, lambda w, cid, attempt: w.prepare.remote(
            _retry(self._task(r, cid, {}), attempt), self.global_ref), f"round {r}: the preparation phase")
        for cid in sorted(out):  # the global model it used is the round's one broadcast (counted with training)
            ledger.add_payload(cid, "up", out[cid], prefix="prepare")
        return out

    def _evaluate_on_clients(self, results: list[ClientUpdate], ledger: Ledger) -> None:
        """The new global model on each participant's validation samples (e.g.
        FedDG-GA's generalization gaps): one task per client on the worker pool;
        what leaves the client is its loss and accuracy, two float64."""
        bs = self.cfg.evaluation.batch_size
        out = self.pool.map_all([u.client for u in results], lambda w, cid, attempt: w.evaluate.remote(
            self.global_ref, self.client_val(cid), bs), "evaluating the global model on a client")
        for u in results:
            correct, loss, cnt = out[u.client]
            u.global_eval = GlobalEval(accuracy=correct / max(cnt, 1), loss=loss / max(cnt, 1), samples=cnt)
            ledger.add(u.client, "up", "eval:global_on_client", 16)

    def personalizes(self) -> bool:
        """Whether clients keep model state that changes their predictions
        (FedBN, SiloBN, gPerXAN, FedFD on those bases), so that each client's
        own model is worth evaluating beside the global one."""
        return bool(self.local_keys) and self.method.local_state_predicts and self.cfg.evaluation.personal

    def evaluate(self, r: int) -> list[dict]:
        """The global model on every source domain's validation split and on
        the target; for a method with client-local state also each client's
        own model (the global weights with its local state from the client
        store) on its (main) source domain's validation split, as split
        ``personal_val`` with the client's id.  Selection reads only
        ``source_val``, so the personal figures never choose anything.  Chunks
        are spread over the pool."""
        bs = self.cfg.evaluation.batch_size
        sets: list[tuple[str, str, int | None, np.ndarray]] = \
            [("source_val", dom, None, idx) for dom, idx in self.split.val.items()] + \
            [("target_test", dom, None, idx) for dom, idx in self.split.test.items()]
        if self.personalizes():
            doms = self.split.client_domains
            sets += [("personal_val", doms[c], c, self.split.val[doms[c]]) for c in sorted(self.store.states)
                     if doms[c] in self.split.val]
        jobs = [(name, dom, cid, c0) for name, dom, cid, idx in sets for c0 in range(0, len(idx), EVAL_CHUNK)]
        index = {(name, dom, cid): idx for name, dom, cid, idx in sets}
        out = self.pool.map_all(jobs, lambda w, job, attempt: w.evaluate.remote(
            self.global_ref, index[job[:3]][job[3]:job[3] + EVAL_CHUNK], bs,
            None if job[2] is None else self.store.get(job[2])), f"round {r}: evaluation")
        rows = []
        for name, dom, cid, _ in sets:
            parts = [out[j] for j in jobs if j[:3] == (name, dom, cid)]
            correct, loss, cnt = (sum(p[i] for p in parts) for i in range(3))
            rows.append({"round": r, "split": name, "domain": dom, "client": cid, "accuracy": correct / max(cnt, 1),
                         "loss": loss / max(cnt, 1), "samples": cnt})
        return rows

    def shutdown(self) -> None:
        self.pool.shutdown()
        ray.kill(self.data_source)


def launch_server(cfg: ExperimentConfig, split: FederatedSplit, data_refs: list, num_classes: int, n_workers: int,
                  worker_options: dict | None = None) -> Any:
    """Start one federation's actors from the driver and return the server's
    handle: the server on the driver's node (the head, beside the dataset the
    driver owns, so losing a worker node loses only workers, which the pool
    restarts and retries), the workers, and a named actor that hands the
    workers the dataset's references.  Started together, the workers load
    torch while the server does.  Workers get that actor's name, a plain
    string: references or handles passed to a restartable actor's
    constructor need not outlive it, and a restarted worker asks again."""
    e = cfg.engine
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    source = f"rayfed_dg_data_{uuid.uuid4().hex}"
    data_source = ray.remote(DataSource).options(num_cpus=0, scheduling_strategy=here, name=source) \
        .remote(list(data_refs))
    opts = dict(num_cpus=e.num_cpus_per_worker, num_gpus=e.num_gpus_per_worker,
                max_restarts=e.max_restarts, max_task_retries=0)
    opts.update(worker_options or {})
    remote_worker = ray.remote(Worker)
    workers = [remote_worker.options(**opts).remote(cfg, source, num_classes, split.num_clients)
               for _ in range(n_workers)]
    # a Tune trial's placement group places the server too
    server_opts = {k: v for k, v in (worker_options or {}).items() if k == "scheduling_strategy"}
    return ray.remote(Server).options(num_cpus=0, **{"scheduling_strategy": here, **server_opts}) \
        .remote(cfg, split, num_classes, workers, data_source)


def _retry(task: ClientTask, attempt: int) -> ClientTask:
    task.attempt = attempt
    return task


class _StageServer:
    """The engine side of a data stage (``stages.base.StageServer``)."""

    def __init__(self, server: Server, index: int, ledger: Ledger):
        self._server, self._index, self._ledger = server, index, ledger
        self.num_clients = server.split.num_clients
        self.seed = server.cfg.training.seed

    def training_set(self, client_id: int) -> np.ndarray:
        return self._server.training_set(client_id)[0]

    def map(self, phase: str, args: dict[int, dict]) -> dict[int, object]:
        s = self._server
        return s.pool.map_all(sorted(args), lambda w, cid, attempt: w.run_stage.remote(
            self._index, phase, cid, self.training_set(cid), args[cid]), f"data stage phase {phase!r}")

    def set_training_set(self, client_id: int, keep: np.ndarray, images: np.ndarray, labels: np.ndarray) -> None:
        self._server.training_sets[client_id] = (keep, ray.put({"images": images, "labels": labels}))

    def share(self, name: str, arrays: dict[str, np.ndarray]) -> None:
        """Put ``arrays`` in the object store once; every training task
        carries the reference and the method reads ``ctx.stage_data[name]``
        (zero-copy).  What each client receives is the stage's to ledger."""
        self._server.stage_data[name] = ray.put(dict(arrays))

    def ledger(self, client_id: int, direction: str, group: str, nbytes: int, tensors: int = 1) -> None:
        self._ledger.add(client_id, direction, group, nbytes, tensors)
