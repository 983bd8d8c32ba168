"""The server actor: client sampling, broadcast, in-order reduce, evaluation.

One ``run_round`` call is one federated round:

1. sample ``clients_per_round`` of the N clients with the round's seed;
2. the global weights are already in the object store (one ``ray.put`` per
   round, after the previous aggregation); workers read them zero-copy;
3. dispatch one task per sampled client to the worker pool, at most one in
   flight per worker, retrying failed tasks;
4. fold updates into the average as they arrive, in client-id order;
5. write the clients' local state back into the client state store;
6. put the new global model in the object store and evaluate it on every
   source domain's validation split and on the target domain.
"""
from __future__ import annotations

import math
import time

import numpy as np
import ray
import torch

from rayfed_dg.config import ConfigError, validate
from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.methods import build_method

from .aggregate import OrderedReducer
from .seeding import CLIENT_VAL, INIT, numpy_rng, sample_clients, seed_int
from .worker import DivergedError, InjectedFault, Worker, to_numpy_state

EVAL_CHUNK = 2048


def _retryable(err: Exception) -> bool:
    """Dead workers, injected faults and out-of-memory are retried; any other
    exception in client code is a bug and stops the run with its traceback."""
    if isinstance(err, ray.exceptions.RayActorError):
        return True
    cause = getattr(err, "cause", None)
    return isinstance(cause, (InjectedFault, torch.OutOfMemoryError, MemoryError))


class EngineError(RuntimeError):
    """The engine failed while running (e.g. every sampled client failed)."""


class ResourceError(ConfigError):
    """The configured worker pool cannot fit the Ray cluster (bad input)."""


def nbytes(arrays: dict[str, np.ndarray]) -> int:
    return int(sum(a.nbytes for a in arrays.values()))


def plan_workers(engine_cfg, clients_per_round: int, resources: dict) -> int:
    """How many workers to start; fail up front when the request cannot fit,
    because Ray waits silently forever for resources that never come."""
    cpu, gpu = float(resources.get("CPU", 0)), float(resources.get("GPU", 0))
    c, g = engine_cfg.num_cpus_per_worker, engine_cfg.num_gpus_per_worker
    fit = math.floor(cpu / c + 1e-9)
    if g > 0:
        fit = min(fit, math.floor(gpu / g + 1e-9))
    if engine_cfg.num_workers is not None:
        w = engine_cfg.num_workers
        if w > fit:
            raise ResourceError(
                f"engine.num_workers={w} with {c} CPU and {g} GPU each needs {w * c:g} CPU / {w * g:g} GPU, "
                f"but the Ray cluster has {cpu:g} CPU / {gpu:g} GPU; lower num_workers or the per-worker resources"
            )
        return w
    if fit < 1:
        raise ResourceError(
            f"one worker needs {c:g} CPU and {g:g} GPU but the Ray cluster has {cpu:g} CPU / {gpu:g} GPU; "
            "lower engine.num_cpus_per_worker / num_gpus_per_worker"
        )
    return max(1, min(fit, clients_per_round))


class Server:
    def __init__(self, cfg_tree: dict, split: FederatedSplit, data_refs: list, num_classes: int,
                 num_workers: int, worker_options: dict | None = None):
        # ``data_refs`` = [images_ref, labels_ref] inside a list, so Ray hands the
        # server the references, not the arrays; the server keeps them alive
        # because a restarted worker re-runs its constructor with them
        self.data_refs = list(data_refs)
        self.cfg = validate(cfg_tree, "<server>")
        self.split = split
        self.method = build_method(self.cfg)
        torch.manual_seed(seed_int(self.cfg.training.seed, INIT))
        model = self.method.build_model(num_classes)
        sd = model.state_dict()
        self.global_state = to_numpy_state(sd, sd.keys())
        self.local_keys = self.method.local_keys(model)
        self.private_keys = self.method.private_keys(model)
        self.groups = {k: self.method.tensor_group(k, k in self.local_keys) for k in sd}
        # a client seen for the first time starts its local state from the initial model
        self.init_local = {k: self.global_state[k] for k in sorted(self.local_keys)}
        self.client_store: dict[int, dict[str, np.ndarray]] = {}
        self.server_state: dict = {}
        self.round = 0
        self.retried = 0  # failed task attempts that were retried, over the run
        e = self.cfg.engine
        opts = dict(num_cpus=e.num_cpus_per_worker, num_gpus=e.num_gpus_per_worker,
                    max_restarts=e.max_restarts, max_task_retries=0)
        opts.update(worker_options or {})
        remote_worker = ray.remote(Worker)
        self.workers = [
            remote_worker.options(**opts).remote(cfg_tree, self.data_refs, num_classes)
            for _ in range(num_workers)
        ]
        ray.get([w.ping.remote() for w in self.workers])
        self.global_ref = ray.put(self.global_state)
        # client -> its training set after the data stage: (base indices kept, ObjectRef of the added samples)
        self.stage: dict[int, tuple[np.ndarray, object]] = {}
        self._client_val: dict[int, np.ndarray | None] = {}  # client -> its fixed validation indices

    # -------------------------------------------------------------- setup
    def setup(self) -> dict:
        """One-off data stage before round 1 (CCST); returns its ledger rows
        (round 0) and costs.  Deterministic and cached, so it is simply run
        again on resume."""
        c = self.cfg.ccst
        if not c.enabled:
            return {"ledger": [], "info": {}}
        t0 = time.perf_counter()
        n = self.split.num_clients
        if c.k > n:
            raise ConfigError(f"ccst.k={c.k} exceeds the {n} source clients: each image takes K distinct clients' "
                              f"styles (Algorithm 1); set ccst.k <= {n}")
        styles: dict[int, np.ndarray] = {}

        def on_style(cid, res):
            if res is None:
                raise EngineError(f"CCST: client {cid} could not compute its style")
            styles[cid] = np.asarray(res, np.float32)

        self._run_pool(list(range(n)), lambda w, cid, a: w.ccst_style.remote(cid, self.split.clients[cid]), on_style,
                       self.cfg.engine.max_task_retries)
        bank = np.concatenate([styles[i] for i in range(n)])
        owners = np.concatenate([np.full(len(styles[i]), i) for i in range(n)])
        t_style = time.perf_counter() - t0
        info = {"hits": 0, "misses": 0, "images_stylized": 0, "originals_kept": 0, "stylized_copies": 0}

        def on_aug(cid, res):
            if res is None:
                raise EngineError(f"CCST: client {cid} could not stylize its images")
            info["hits" if res["cache"] == "hit" else "misses"] += 1
            info["images_stylized"] += res["images_stylized"]
            info["originals_kept"] += int(res["keep"].sum())
            info["stylized_copies"] += len(res["labels"])
            self.stage[cid] = (self.split.clients[cid][res["keep"]],
                               ray.put({"images": res["images"], "labels": res["labels"]}))

        self._run_pool(list(range(n)), lambda w, cid, a: w.ccst_augment.remote(cid, self.split.clients[cid], bank,
                                                                                 owners), on_aug,
                       self.cfg.engine.max_task_retries)
        ledger = []
        for i in range(n):
            ledger.append({"round": 0, "client": i, "direction": "up", "group": "payload:ccst_style", "tensors": 1,
                           "bytes": int(styles[i].nbytes)})
            ledger.append({"round": 0, "client": i, "direction": "down", "group": "payload:ccst_bank", "tensors": 1,
                           "bytes": int(bank.nbytes)})
        info.update(seconds_style=t_style, seconds_total=time.perf_counter() - t0, bank_shape=list(bank.shape))
        self.ccst_bank = (bank, owners)
        return {"ledger": ledger, "info": info}

    # --------------------------------------------------------------- state
    def broadcast_state(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.global_state.items() if k not in self.local_keys}

    def get_state(self) -> dict:
        return {"round": self.round, "global_state": self.global_state, "client_store": self.client_store,
                "server_state": self.server_state}

    def set_state(self, state: dict) -> None:
        self.round = int(state["round"])
        self.global_state = state["global_state"]
        self.client_store = state["client_store"]
        self.server_state = state["server_state"]
        self.global_ref = ray.put(self.global_state)

    def worker_pids(self) -> list[int]:
        return ray.get([w.ping.remote() for w in self.workers])

    # ------------------------------------------------------------ dispatch
    def _run_pool(self, jobs: list[tuple], submit, on_result, retries: int) -> list:
        """Run ``jobs`` on the worker pool, at most two in flight per worker.

        ``submit(worker, job, attempt)`` returns an ObjectRef; a failed job is
        retried up to ``retries`` times (on whichever worker is free, after Ray
        restarted a dead one) and reported to ``on_result(job, None, err)``
        when it keeps failing."""
        queue = [(job, 0) for job in jobs]
        # two tasks queued per worker: the next one starts while the server
        # is still reducing the previous result, so workers never wait on it
        free = [w for _ in range(2) for w in range(len(self.workers))]
        inflight: dict = {}
        failed = []
        while queue or inflight:
            while queue and free:
                job, attempt = queue.pop(0)
                w = free.pop(0)
                inflight[submit(self.workers[w], job, attempt)] = (w, job, attempt)
            ready, _ = ray.wait(list(inflight), num_returns=1)
            ref = ready[0]
            w, job, attempt = inflight.pop(ref)
            free.append(w)
            try:
                res = ray.get(ref)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
                if isinstance(getattr(err, "cause", None), DivergedError):
                    raise EngineError(str(err.cause)) from None
                if not _retryable(err):
                    raise
                if attempt < retries:
                    self.retried += 1
                    queue.insert(0, (job, attempt + 1))
                else:
                    failed.append((job, repr(err).splitlines()[0][:200]))
                    on_result(job, None)
                continue
            on_result(job, res)
        return failed

    def client_val(self, cid: int) -> np.ndarray | None:
        """A fixed, seeded subset of the validation split of the client's main
        source domain, for methods that select their local model on the client."""
        if cid not in self._client_val:
            n = self.method.client_val_size()
            val = self.split.val[self.split.client_domains[cid]] if n > 0 else None
            if val is not None and len(val) > n:
                val = np.sort(numpy_rng(self.cfg.training.seed, CLIENT_VAL, cid).choice(val, n, replace=False))
            self._client_val[cid] = val
        return self._client_val[cid]

    # --------------------------------------------------------------- round
    def run_round(self) -> dict:
        t0 = time.perf_counter()
        cfg = self.cfg
        r = self.round + 1
        n = self.split.num_clients
        k = cfg.training.clients_per_round or n
        sampled = sample_clients(cfg.training.seed, r, n, k)
        sizes = self.split.client_sizes()[sampled]
        weights = self.method.aggregation_weights(sampled, sizes, self.server_state)
        reducer = OrderedReducer(sampled, dict(zip(sampled, weights)))
        payloads = self.method.server_payloads(r, sampled, self.server_state, numpy_rng(cfg.training.seed, 7, r),
                                               self.global_state)
        bcast = self.broadcast_state()
        down_bytes = {}
        for key, arr in bcast.items():
            down_bytes.setdefault(self.groups[key], [0, 0])
            down_bytes[self.groups[key]][0] += 1
            down_bytes[self.groups[key]][1] += arr.nbytes
        ledger, results = [], {}
        fault_p = cfg.engine.fault_probability

        def submit(worker, cid, attempt):
            indices, extra = self.stage.get(cid, (self.split.clients[cid], None))
            return worker.train.remote(cid, r, indices, self.global_ref,
                                       self.client_store.get(cid, self.init_local), payloads.get(cid, {}),
                                       fault_p, attempt, extra=extra,
                                       val_indices=self.client_val(cid))

        def on_result(cid, res):
            if res is None:
                reducer.add(cid, None)
                return
            upd = res["update"]
            reducer.add(cid, upd)
            results[cid] = {"stats": res["stats"], "payload": res["payload"], "num_samples": res["num_samples"]}
            local = {k_: upd[k_] for k_ in self.init_local if k_ in upd}
            local.update(res["private"])
            self.client_store[cid] = {k_: np.array(v) for k_, v in local.items()}
            up: dict[str, list[int]] = {}
            for key, arr in upd.items():
                g = up.setdefault(self.groups[key], [0, 0])
                g[0] += 1
                g[1] += arr.nbytes
            for name, arr in res["payload"].items():
                up[f"payload:{name}"] = [1, int(np.asarray(arr).nbytes)]
            for g, (cnt, b) in sorted(up.items()):
                ledger.append({"round": r, "client": cid, "direction": "up", "group": g, "tensors": cnt, "bytes": b})
            for g, (cnt, b) in sorted(down_bytes.items()):
                ledger.append({"round": r, "client": cid, "direction": "down", "group": g, "tensors": cnt, "bytes": b})
            for name, arr in payloads.get(cid, {}).items():
                ledger.append({"round": r, "client": cid, "direction": "down", "group": f"payload:{name}",
                               "tensors": 1, "bytes": int(np.asarray(arr).nbytes)})

        failed = self._run_pool(sampled, submit, on_result, cfg.engine.max_task_retries)
        if len(reducer.dropped) == len(sampled):
            raise EngineError(f"round {r}: every sampled client failed ({failed[0][1]})")
        self.global_state = reducer.result(self.global_state)
        self.global_ref = ray.put(self.global_state)
        if self.method.evaluates_global_on_clients:
            self._evaluate_on_clients(r, results, ledger)
        self.method.after_round(r, [results[c] | {"client": c} for c in sorted(results)], self.server_state)
        self.round = r
        train_s = time.perf_counter() - t0

        rows = []
        every = cfg.evaluation.every
        if (every and r % every == 0) or r == cfg.training.rounds:
            rows = self.evaluate(r)
        ledger.sort(key=lambda x: (x["client"], x["direction"], x["group"]))
        return {
            "round": r,
            "sampled": sampled,
            "dropped": [{"round": r, "client": c, "reason": why} for c, why in failed],
            "metrics": rows,
            "ledger": ledger,
            "train_loss": float(np.mean([results[c]["stats"].get("train_loss", np.nan) for c in sorted(results)])),
            "tasks_retried": self.retried,
            "seconds_train": train_s,
            "seconds_client_tasks": float(sum(results[c]["stats"].get("seconds", 0.0) for c in results)),
            "seconds_total": time.perf_counter() - t0,
        }

    def _evaluate_on_clients(self, r: int, results: dict, ledger: list) -> None:
        """The new global model on each participant's validation samples (e.g.
        FedDG-GA's generalization gaps): one task per client on the worker pool;
        what leaves the client is its loss and accuracy, two float64."""
        bs = self.cfg.evaluation.batch_size

        def submit(worker, cid, attempt):
            return worker.evaluate.remote(self.global_ref, self.client_val(cid), bs)

        def on_result(cid, res):
            if res is None:
                raise EngineError(f"round {r}: evaluating the global model on client {cid} failed after retries")
            correct, loss, cnt = res
            results[cid]["global_eval"] = {"accuracy": correct / max(cnt, 1), "loss": loss / max(cnt, 1),
                                           "samples": cnt}
            ledger.append({"round": r, "client": cid, "direction": "up", "group": "eval:global_on_client",
                           "tensors": 1, "bytes": 16})

        self._run_pool(sorted(results), submit, on_result, self.cfg.engine.max_task_retries)

    def evaluate(self, r: int) -> list[dict]:
        bs = self.cfg.evaluation.batch_size
        jobs = []
        for split_name, sets in (("source_val", self.split.val), ("target_test", self.split.test)):
            for dom, idx in sets.items():
                for c0 in range(0, len(idx), EVAL_CHUNK):
                    jobs.append((split_name, dom, c0 // EVAL_CHUNK, idx[c0:c0 + EVAL_CHUNK]))
        out: dict[tuple, tuple] = {}

        def submit(worker, job, attempt):
            return worker.evaluate.remote(self.global_ref, job[3], bs)

        def on_result(job, res):
            if res is None:
                raise EngineError(f"evaluation of {job[0]} {job[1]} failed after retries")
            out[job[:3]] = res

        self._run_pool(jobs, submit, on_result, self.cfg.engine.max_task_retries)
        rows = []
        for split_name, sets in (("source_val", self.split.val), ("target_test", self.split.test)):
            for dom in sets:
                parts = [out[key] for key in sorted(out) if key[0] == split_name and key[1] == dom]
                correct = sum(p[0] for p in parts)
                loss = sum(p[1] for p in parts)
                cnt = sum(p[2] for p in parts)
                rows.append({"round": r, "split": split_name, "domain": dom,
                             "accuracy": correct / max(cnt, 1), "loss": loss / max(cnt, 1), "samples": cnt})
        return rows

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
