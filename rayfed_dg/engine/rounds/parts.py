"""Which aggregation parts a federation runs (``engine/aggregation/pipeline.py``),
chosen from its config: the estimator (DP-FedAvg's with ``privacy.updates``,
an asynchronous mode's with ``server.mode``, else ``server.aggregator``'s),
the server optimizer and the method's assembly; and the one check, before
anything is built, that they combine with each other and with the method."""
from __future__ import annotations

from typing import Any

import numpy as np

from rayfed_dg.config import ExperimentConfig
from rayfed_dg.engine.aggregation import omg, robust  # noqa: F401  (register median, trimmed_mean, fedomg)
from rayfed_dg.engine.aggregation.buffered import ASYNC_ESTIMATORS
from rayfed_dg.engine.aggregation.pipeline import Estimator, Pipeline, aggregator_class, refusal
from rayfed_dg.engine.aggregation.server_opt import ServerOptimizer, stepped_keys
from rayfed_dg.engine.privacy.updates import DPMean, UpdateDP, float_keys
from rayfed_dg.errors import ConfigError
from rayfed_dg.methods import Method, declarations


def chosen(cfg: ExperimentConfig) -> list[type[Estimator]]:
    """Every estimator the config asks for, the one that runs first.  DP with
    an asynchronous mode is ``check_privacy``'s to refuse (it names why)."""
    out: list[type[Estimator]] = []
    if cfg.privacy is not None and cfg.privacy.updates is not None:
        out.append(DPMean)
    if cfg.server.mode != "sync" and not out:
        out.append(ASYNC_ESTIMATORS[cfg.server.mode])
    if cfg.server.aggregator != "mean":
        out.append(aggregator_class(cfg.server.aggregator))
    return out or [aggregator_class("mean")]


def check_pipeline(cfg: ExperimentConfig) -> None:
    """Refuse, in one line, parts that do not combine (``pipeline.refusal``)."""
    parts = chosen(cfg)
    why = refusal(parts[0], parts, declarations(cfg))
    if why is not None:
        raise ConfigError(why)


def build_pipeline(cfg: ExperimentConfig, method: Method, model: Any, global_state: dict[str, np.ndarray],
                   local_keys: set[str], assembled: set[str], per_round: int) -> Pipeline:
    check_pipeline(cfg)  # the run's preflight did; a federation opened by hand is checked too
    est_cls = chosen(cfg)[0]
    if est_cls is DPMean:
        u = cfg.privacy.updates if cfg.privacy is not None else None
        assert u is not None
        sd = model.state_dict()
        uploaded = set(sd) - method.private_keys(model)
        estimator: Estimator = DPMean(UpdateDP(u, cfg.training.seed, per_round, float_keys(sd, uploaded)))
    else:
        estimator = est_cls(cfg.server, global_state)
    stepped = stepped_keys(model, local_keys | assembled)
    estimator.bind(stepped)
    # None for server.optimizer none: the estimate is the new global model
    optimizer = ServerOptimizer.from_config(cfg.server, global_state, stepped)
    return Pipeline(estimator, optimizer, method, assembled)
