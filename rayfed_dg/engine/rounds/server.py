"""The server actor: it keeps an experiment's worker pool and conducts the
rounds of its current federation: ``federation.py`` holds the federation's
state, ``round.py`` runs one round (synchronous, or one server update of an
asynchronous mode) on the pool, ``cohort.py`` picks its clients and the
aggregation pipeline (``engine/aggregation/pipeline.py``) makes its new
global model.  The optional phases are those the method declares
(``Method.phases``), each run at its slot (``phases.py``; ``methods/base.py``
has the table).  Data stages run before round 1 (``stagehost.run_stages``).
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import ray

from rayfed_dg.config import ExperimentConfig
from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.engine.store.records import RoundResult
from rayfed_dg.engine.workers.pool import Launching, WorkerPool
from rayfed_dg.engine.workers.resources import autoscaler_launching
from rayfed_dg.utils import exit_quietly_on_sigterm

from .federation import Federation
from .round import Published, run_round
from .stagehost import run_stages


def follow_autoscaler(e) -> Launching | None:
    """What the pool asks while it waits for a lost worker (it waits on while
    the autoscaler launches a node, ``pool.give_up_at``): what is being
    launched for a worker of ``e``'s size; nothing with ``engine.autoscaler``
    off."""
    return None if e.autoscaler == "off" else partial(autoscaler_launching, e.num_cpus_per_worker,
                                                      e.num_gpus_per_worker)


class Server:
    """One experiment's server actor: it keeps the worker pool for the
    experiment and runs one federation at a time (``start``)."""

    def __init__(self, workers: list, data_source: Any):
        # started by EngineHost, with the workers and data source it is handed
        exit_quietly_on_sigterm()  # Ray's SIGTERM inside a finaliser: a traceback at the end of a run, else
        self.data_source = data_source
        self.pool = WorkerPool(workers, 0)  # waits until every worker is up

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

    def add_workers(self, workers: list) -> None:
        """More workers for the current federation (called between its rounds)."""
        self.pool.add(workers)

    def start(self, cfg: ExperimentConfig, split: FederatedSplit, num_classes: int, federation: int,
              workers: list | None = None) -> None:
        """Begin a federation (its workers build its model on their first
        task); ``workers``: its own pool instead of the one kept so far."""
        if workers is not None:
            self.pool = WorkerPool(workers, 0)
        self.fed = Federation(cfg, split, num_classes, federation)
        e = cfg.engine
        self.pool.retries, self.pool.restart_timeout_s = e.max_task_retries, e.worker_restart_timeout_s
        self.pool.replacement_timeout_s, self.pool.launching = e.worker_replacement_timeout_s, follow_autoscaler(e)
        self.pool.retried = self.pool.reruns = 0
        self.pub = Published()  # the global model (and in an asynchronous mode each version in flight), in the store
        self.pub.put_all(self.fed)

    @property
    def split(self) -> FederatedSplit:
        return self.fed.split

    def current(self) -> Federation:
        """The current federation, as a copy (tests and tools read it)."""
        return self.fed

    def setup(self) -> dict:
        return run_stages(self.pool, self.fed)

    def get_state(self, pieces: Path | None = None, clients: bool = True) -> dict:
        return self.fed.get_state(pieces, clients)

    def spill_to(self, directory: str) -> None:
        """Spill client states to ``directory`` (the run directory's; before the first round)."""
        self.fed.store.use_directory(Path(directory))

    def set_state(self, state: dict) -> None:
        self.fed.set_state(state)
        self.pub.put_all(self.fed)

    # --------------------------------------------------------------- round
    def run_round(self) -> RoundResult:
        """One round, or one server update of an asynchronous mode (``round.py``)."""
        return run_round(self.fed, self.pool, self.pub)

    def shutdown(self) -> None:
        self.pool.shutdown()
        ray.kill(self.data_source)
