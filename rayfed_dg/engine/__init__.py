"""The federated engine: server actor, worker actors, reduce, selection, records."""
from .aggregate import OrderedReducer
from .run import (check_resume_dir, format_table, init_ray, make_run_dir, make_splits, preflight, resolve_targets,
                  run_experiment, run_federation)
from .selection import select_round
from .server import EngineError, Server, plan_workers
from .worker import ClientRunner, Worker

__all__ = ["ClientRunner", "EngineError", "check_resume_dir", "make_splits", "preflight", "OrderedReducer", "Server", "Worker", "format_table", "init_ray",
           "make_run_dir", "plan_workers", "resolve_targets", "run_experiment", "run_federation", "select_round"]
