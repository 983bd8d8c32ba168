"""The federated engine, in wings by role (each wing's ``__init__`` says what
lives there and which wings it may import; ``tests/test_layout.py`` holds
those directions):

    running      an experiment: plan, run service, hosts, schedule
    rounds       one federation and its rounds: server, federation, phases
    workers      worker actors and their pool
    privacy      DP mechanisms, DP-FedAvg's parts, payload privacy, accountant
    aggregation  the exact sum, the aggregation pipeline and its parts
    store        records, client store, run directory, checkpoints, formats
    clock        the device model and the asynchronous event simulation

Arrows point down this list only (``clock`` imports no wing).  Below the
engine: data, models, methods, seeding, config; above it: cli, api, tuning,
reporting.  This package re-exports what those use.
"""
from rayfed_dg.engine.aggregation.exact import Reducer
from rayfed_dg.engine.rounds.server import Server
from rayfed_dg.engine.running.experiment import run_experiment
from rayfed_dg.engine.running.host import launch_server
from rayfed_dg.engine.running.plan import (
                   clients_per_round,
                   load_data,
                   make_splits,
                   match_budget,
                   preflight,
                   resolve_targets,
                   resolve_variants,
                   split_for,
)
from rayfed_dg.engine.running.run import TargetResult, check_resume_dir, format_table, run_federation
from rayfed_dg.engine.store.clientstore import ClientStore
from rayfed_dg.engine.store.records import ClientTask, Ledger, RoundResult
from rayfed_dg.engine.store.rundir import RunDir
from rayfed_dg.engine.store.selection import select_round
from rayfed_dg.engine.workers.resources import init_ray, plan_workers
from rayfed_dg.engine.workers.worker import ClientRunner, Worker
from rayfed_dg.errors import EngineError, ResourceError

__all__ = ["ClientRunner", "ClientStore", "ClientTask", "EngineError", "Ledger", "Reducer", "ResourceError",
           "RoundResult", "RunDir", "Server", "TargetResult", "Worker", "check_resume_dir", "clients_per_round",
           "format_table", "init_ray", "launch_server", "load_data", "make_splits", "match_budget", "plan_workers",
           "preflight", "resolve_targets", "resolve_variants", "run_experiment", "run_federation", "select_round",
           "split_for"]
