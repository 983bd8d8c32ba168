"""The federated engine: server actor, worker actors, pool, reduce, selection, records, the run directory
and the run service."""
from rayfed_dg.errors import EngineError, ResourceError

from .aggregate import Reducer
from .clientstore import ClientStore
from .experiment import run_experiment
from .host import launch_server
from .plan import (
                   clients_per_round,
                   load_data,
                   make_splits,
                   match_budget,
                   preflight,
                   resolve_targets,
                   resolve_variants,
                   split_for,
)
from .records import ClientTask, Ledger, RoundResult
from .resources import init_ray, plan_workers
from .run import TargetResult, check_resume_dir, format_table, run_federation
from .rundir import RunDir
from .selection import select_round
from .server import Server
from .worker import ClientRunner, Worker

__all__ = ["ClientRunner", "ClientStore", "ClientTask", "EngineError", "Ledger", "Reducer", "ResourceError",
           "RoundResult", "RunDir", "Server", "TargetResult", "Worker", "check_resume_dir", "clients_per_round",
           "format_table", "init_ray", "launch_server", "load_data", "make_splits", "match_budget", "plan_workers",
           "preflight", "resolve_targets", "resolve_variants", "run_experiment", "run_federation", "select_round",
           "split_for"]
