"""The actors of an experiment, started once and reused by every federation.

An experiment (every target, every ``compare`` row, every ``--seeds`` seed)
runs its federations one after another on one set of actors: a named
``DataSource`` that holds the dataset's references and the current
federation's spec, the worker pool, and the server.  Starting them costs
seconds (each process imports torch); opening a federation on running
actors costs a registration and the server's model build.

Rows whose workers need other resources (``engine.num_cpus_per_worker``,
``num_gpus_per_worker``, ``max_restarts``, ``device``) cannot share actors:
``HostPool`` starts a host for each distinct set when a row needs it, ending
the one before (each is sized to what the cluster fits).  A Tune trial keeps a host of its own (its placement group
reserves the workers).
"""
from __future__ import annotations

import uuid
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayfed_dg.config import EngineConfig, ExperimentConfig
from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.datasource import DataSource

from .plan import clients_per_round
from .resources import ensure_workers
from .server import Server
from .worker import Worker


def actor_key(e: EngineConfig) -> tuple:
    """What a worker actor is started with: rows that differ here need their own."""
    return (e.num_cpus_per_worker, e.num_gpus_per_worker, e.max_restarts, e.device)


class EngineHost:
    """Start the actors from the driver: the server on the driver's node (the
    head, beside the dataset the driver owns, so losing a worker node loses
    only workers, which the pool restarts and retries), the workers, and the
    named data source.  Started together, the workers load torch while the
    server does.  Workers get the data source's name, a plain string:
    references or handles passed to a restartable actor's constructor need
    not outlive it, and a restarted worker asks again."""

    def __init__(self, engine: EngineConfig, data_refs: list, n_workers: int, worker_options: dict | None = None):
        self.key, self.n_workers = actor_key(engine), n_workers
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        name = f"rayfed_dg_data_{uuid.uuid4().hex}"
        self.data_source: Any = ray.remote(DataSource).options(num_cpus=0, scheduling_strategy=here, name=name) \
            .remote(list(data_refs))
        opts = dict(num_cpus=engine.num_cpus_per_worker, num_gpus=engine.num_gpus_per_worker,
                    max_restarts=engine.max_restarts, max_task_retries=0)
        opts.update(worker_options or {})
        self._new_worker = lambda: ray.remote(Worker).options(**opts).remote(name)
        self.workers = workers = [self._new_worker() for _ in range(n_workers)]
        # a Tune trial's placement group places the server too
        server_opts = {k: v for k, v in (worker_options or {}).items() if k == "scheduling_strategy"}
        self.server: Any = ray.remote(Server).options(num_cpus=0, **{"scheduling_strategy": here, **server_opts}) \
            .remote(workers, self.data_source)
        self.federations = 0

    def open(self, cfg: ExperimentConfig, split: FederatedSplit, num_classes: int) -> Any:
        """Make ``split``'s federation the server's current one; returns the server."""
        if actor_key(cfg.engine) != self.key:
            raise ValueError(f"a federation needing workers {actor_key(cfg.engine)} on a host of {self.key}")
        self.federations += 1
        # a worker that died during an earlier federation used up Ray restarts: each federation starts with
        # whole budgets (engine.max_restarts), as it did on actors of its own
        gone = ray.get(self.server.retire_restarted.remote())
        if gone:
            fresh = {w: self._new_worker() for w in gone}
            ray.get(self.server.replace_workers.remote(fresh))
            for w, actor in fresh.items():
                self.workers[w] = actor
        ray.get(self.data_source.register.remote(self.federations, (cfg, num_classes, split.num_clients)))
        ray.get(self.server.start.remote(cfg, split, num_classes, self.federations))
        return self.server

    def close(self) -> None:
        """End every actor from the driver, whatever state the server is in
        (busy with a round after Ctrl-C, or dead)."""
        for actor in [self.server, *self.workers, self.data_source]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass


def launch_server(cfg: ExperimentConfig, split: FederatedSplit, data_refs: list, num_classes: int, n_workers: int,
                  worker_options: dict | None = None) -> Any:
    """A one-federation experiment's server, started (``EngineHost``) and
    holding ``split``'s federation; ``shutdown`` ends its actors.  For tests
    and tools that drive a server round by round."""
    host = EngineHost(cfg.engine, data_refs, n_workers, worker_options)
    host.open(cfg, split, num_classes)
    return host.server


class HostPool:
    """One ``EngineHost`` per distinct worker resources, started on first use
    with as many workers as the largest federation planned for it needs."""

    def __init__(self, data_refs: list, workers: dict[tuple, int]):
        self.data_refs, self.workers = list(data_refs), dict(workers)
        self.hosts: dict[tuple, EngineHost] = {}

    @classmethod
    def planned(cls, data_refs: list, rows: list[tuple[ExperimentConfig, list[FederatedSplit]]]) -> HostPool:
        """Sized for the largest federation of ``rows`` on each set of worker
        resources (a federation with fewer clients a round leaves the extra
        workers idle, which costs them nothing)."""
        need: dict[tuple, int] = {}
        for cfg, splits in rows:
            n = max(ensure_workers(cfg.engine, clients_per_round(cfg, s)) for s in splits)
            need[actor_key(cfg.engine)] = max(need.get(actor_key(cfg.engine), 0), n)
        return cls(data_refs, need)

    def host(self, cfg: ExperimentConfig) -> EngineHost:
        key = actor_key(cfg.engine)
        if key not in self.hosts:
            # each host is sized to what the cluster fits: another one still running could leave it unplaceable
            self.close()
            self.hosts[key] = EngineHost(cfg.engine, self.data_refs, self.workers[key])
        return self.hosts[key]

    def close(self) -> None:
        hosts, self.hosts = list(self.hosts.values()), {}
        for h in hosts:
            h.close()
