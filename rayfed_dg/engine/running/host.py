"""The actors of an experiment: one dataset upload and one ``DataSource``
for all of it, generic worker actors, and a server actor per running federation.

``ExperimentActors`` serves ``experiment.run_planned``, which runs the
federations of an experiment (every target, every ``compare`` row, every
``--seeds`` seed) side by side: the named ``DataSource`` holds the dataset's
references and the spec of every running federation (so any worker builds
whichever federation a task names), workers are started as needed up to the
slots the cluster fits, lent to a federation's server when it opens (more
between its rounds, ``add``) and taken back when it ends, and an ended
federation's server actor opens the next one.  Starting an actor costs
seconds (each process imports torch); opening a federation on running
actors costs a registration and the server's model build.

Federations whose workers need other resources (``engine.num_cpus_per_worker``,
``num_gpus_per_worker``, ``max_restarts``, ``device``: ``actor_key``) cannot
share workers: they run in a later group (``group`` ends the idle workers of
the one before).

``EngineHost`` is one server and its own workers, opening one federation
after another: ``run_federation`` without an experiment, a Tune trial (its
placement group reserves the workers), tests and tools.
"""
from __future__ import annotations

import uuid
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rayfed_dg.config import EngineConfig, ExperimentConfig
from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.datasource import DataSource
from rayfed_dg.engine.rounds.server import Server
from rayfed_dg.engine.workers.worker import Worker


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
        # a Tune trial's placement group places the server too, in the trial's own bundle (0): beside the trial's
        # run directory, which the server's client store writes checkpoint pieces to and reads them from
        server_opts = {k: v for k, v in (worker_options or {}).items() if k == "scheduling_strategy"}
        if isinstance(server_opts.get("scheduling_strategy"), PlacementGroupSchedulingStrategy):
            server_opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                server_opts["scheduling_strategy"].placement_group, placement_group_bundle_index=0)
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
        self.data_source.drop.remote(self.federations - 1)
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


class ExperimentActors:
    """The actors ``experiment.run_planned`` runs an experiment's federations
    on, side by side (the module docstring).  The driver lends workers to a
    federation (``take``, ``open``, ``add``) and gets them back (``release``);
    a worker serves one federation at a time, so federations never share a
    worker mid-round and each computes what it would alone."""

    def __init__(self, data_refs: list):
        self.here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.name = f"rayfed_dg_data_{uuid.uuid4().hex}"
        self.data_source: Any = ray.remote(DataSource).options(num_cpus=0, scheduling_strategy=self.here,
                                                                name=self.name).remote(list(data_refs))
        self.servers: list = []  # every server actor started
        self.idle_servers: list = []
        self.workers: list = []  # every worker actor started (for close)
        self.free: list = []  # the current group's workers lent to no federation
        self.slots = self.lent = 0
        self._node: dict[Any, Any] = {}  # worker -> ObjectRef of its node id
        self._opts: dict = {}
        self.federations = 0  # ids given so far: a worker builds a federation by its id, so each has its own

    def group(self, engine: EngineConfig, slots: int) -> None:
        """Workers of ``engine``'s resources from now on, at most ``slots`` of
        them; the previous group's (all idle by now) end, freeing theirs."""
        for w in self.free:
            ray.kill(w)
        self.free, self.slots, self.lent = [], slots, 0
        self._opts = dict(num_cpus=engine.num_cpus_per_worker, num_gpus=engine.num_gpus_per_worker,
                          max_restarts=engine.max_restarts, max_task_retries=0)

    @property
    def free_slots(self) -> int:
        """Workers that could still be lent (idle ones, or ones not started yet)."""
        return self.slots - self.lent

    def take(self, n: int) -> list:
        """``n`` workers: idle ones first, then new ones."""
        if n > self.free_slots:
            raise ValueError(f"{n} workers asked with {self.free_slots} free")
        got, self.free = self.free[:n], self.free[n:]
        for _ in range(n - len(got)):
            w: Any = ray.remote(Worker).options(**self._opts).remote(self.name)
            self._node[w] = w.node.remote()
            self.workers.append(w)
            got.append(w)
        self.lent += n
        return got

    def open(self, cfg: ExperimentConfig, split: FederatedSplit, num_classes: int, workers: list,
             state: dict | None) -> tuple[Any, int, list]:
        """Open ``split``'s federation on a server with ``workers``: (server,
        the federation's id, the refs of its opening calls: start, the data
        stages' setup, and the checkpoint's ``set_state`` when resuming)."""
        self.federations += 1
        fid = self.federations
        if self.idle_servers:
            server = self.idle_servers.pop()
        else:
            server = ray.remote(Server).options(num_cpus=0, scheduling_strategy=self.here).remote([], self.data_source)
            self.servers.append(server)
        # before any task names it: a worker asks the data source for the spec on its first task
        ray.get(self.data_source.register.remote(fid, (cfg, num_classes, split.num_clients)))
        refs = [server.start.remote(cfg, split, num_classes, fid, workers), server.setup.remote()]
        if state is not None:
            refs.append(server.set_state.remote(state["server"]))
        return server, fid, refs

    def add(self, server: Any, workers: list) -> Any:
        """Lend ``workers`` to a running federation: the call queues behind the
        round in flight, so they join between rounds.  Returns its ref."""
        return server.add_workers.remote(workers)

    def release(self, server: Any, fid: int, workers: list) -> None:
        """Take back a finished federation's server and ``workers`` (in the
        order its pool holds them).  A worker whose process died during it
        (its Ray restarts spent) is ended and its slot freed: the next
        federation gets a new one with a whole ``engine.max_restarts``."""
        gone = set(ray.get(server.retire_restarted.remote()))
        self.free += [w for i, w in enumerate(workers) if i not in gone]
        self.lent -= len(workers)
        self.data_source.drop.remote(fid)
        self.idle_servers.append(server)

    def nodes(self, workers: list) -> list[str]:
        """The sorted ids of the nodes ``workers`` were started on."""
        out = set()
        for w in workers:
            try:
                out.add(ray.get(self._node[w]))
            except ray.exceptions.RayError:  # died before it answered: its node is unknown
                pass
        return sorted(out)

    def close(self) -> None:
        """End every actor, whatever state each is in (busy with a round after Ctrl-C, or dead)."""
        for actor in [*self.servers, *self.workers, self.data_source]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
