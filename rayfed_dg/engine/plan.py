"""What a run is made of, resolved once for the CLI, tune.py and the benches:
the dataset, the targets, each target's split, the clients per round, the
worker pool, and the checks that must pass before anything is written."""
from __future__ import annotations

import math
from typing import Any

from rayfed_dg.config import ExperimentConfig
from rayfed_dg.data import DomainDataset, FederatedSplit, leave_one_domain_out, load_dataset
from rayfed_dg.errors import ConfigError, DataError, ModelError, ResourceError


def load_data(cfg: ExperimentConfig) -> DomainDataset:
    """The config's dataset, decoded at ``data.decode_size`` (the resolution,
    or larger when a random crop is taken from it); ``data.root`` is resolved
    against the data root (``$RAYFED_DG_DATA``) unless absolute."""
    from rayfed_dg.data.sources import resolve_root

    d = cfg.data
    ds = load_dataset(d.name, resolve_root(d.name, d.root), d.decode_size, d.domains, **d.loader_options())
    return ds.subsample(d.limit_per_domain, d.split_seed) if d.limit_per_domain else ds


def resolve_targets(ds: DomainDataset, target: str | None) -> list[str]:
    if target in (None, "all"):
        return list(ds.domain_names)
    names = [t.strip() for t in target.split(",")]
    for t in names:
        ds.domain_index(t)  # raises DataError with a did-you-mean
    return names


def clients_per_round(cfg: ExperimentConfig, split: FederatedSplit) -> int:
    """``training.clients_per_round``, where None means every client."""
    k = cfg.training.clients_per_round
    if k is not None and k > split.num_clients:
        raise ConfigError(f"training.clients_per_round={k} exceeds the {split.num_clients} clients "
                          f"of partition {cfg.partition.strategy}; lower it or add clients")
    return split.num_clients if k is None else k


def split_for(cfg: ExperimentConfig, ds: DomainDataset, target: str) -> FederatedSplit:
    p, d = cfg.partition, cfg.data
    return leave_one_domain_out(ds, target, d.val_fraction, d.split_seed, p.strategy, p.num_clients, p.alpha,
                                p.min_size, p.clients, p.heterogeneity)


def make_splits(cfg: ExperimentConfig, ds: DomainDataset, targets: list[str]) -> list[FederatedSplit]:
    """All partitions of a run, checked (clients per round, data stages)
    before anything is written."""
    from rayfed_dg.stages import build_stages

    splits = [split_for(cfg, ds, t) for t in targets]
    stages = build_stages(cfg)
    for s in splits:
        clients_per_round(cfg, s)
        for stage in stages:
            stage.check_clients(s.num_clients)
    return splits


def autoscaler_present() -> bool:
    """Whether the connected cluster runs a real autoscaler (``ray up``, a
    fake multi-node cluster).  Plain local Ray runs the autoscaler's
    read-only provider, whose node types are named after its nodes
    (``node_<id>``); a cluster config names its node types itself."""
    import json

    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get("__autoscaling_status")
    if not raw:
        return False
    report = json.loads(raw).get("autoscaler_report") or {}
    types = set((report.get("node_type_mapping") or {}).values()) | set(report.get("active_nodes") or {})
    return any(not str(t).startswith("node_") for t in types)


def ensure_workers(engine_cfg, clients_per_round: int) -> int:
    """``plan_workers`` against the cluster as it is; when the pool does not
    fit and an autoscaler runs (``engine.autoscaler``), ask it for the pool's
    bundles and wait up to ``engine.scale_up_timeout_s``, saying what it waits
    for; then fail with one line naming what was asked and what is there."""
    import sys
    import time

    import ray
    from ray.autoscaler.sdk import request_resources

    try:
        return plan_workers(engine_cfg, clients_per_round, ray.cluster_resources())
    except ResourceError:
        mode = engine_cfg.autoscaler
        if mode == "off" or (mode == "auto" and not autoscaler_present()):
            raise
    c, g = engine_cfg.num_cpus_per_worker, engine_cfg.num_gpus_per_worker
    want = engine_cfg.num_workers or clients_per_round
    bundle = {"CPU": c, **({"GPU": g} if g else {})}
    timeout = engine_cfg.scale_up_timeout_s
    print(f"rayfed-dg: the cluster cannot fit the worker pool yet; asked the autoscaler for {want} x {bundle}, "
          f"waiting up to {timeout:g} s (engine.scale_up_timeout_s)", file=sys.stderr, flush=True)
    request_resources(bundles=[dict(bundle) for _ in range(want)])
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                n = plan_workers(engine_cfg, clients_per_round, ray.cluster_resources())
                res = ray.cluster_resources()
                print(f"rayfed-dg: the cluster now has {res.get('CPU', 0):g} CPU / {res.get('GPU', 0):g} GPU; "
                      f"starting {n} workers", file=sys.stderr, flush=True)
                return n
            except ResourceError:
                if time.monotonic() >= deadline:
                    res = ray.cluster_resources()
                    raise ResourceError(
                        f"the autoscaler did not provide {want} worker(s) of {c:g} CPU / {g:g} GPU "
                        f"({want * c:g} CPU / {want * g:g} GPU) within engine.scale_up_timeout_s={timeout:g}; the "
                        f"cluster has {res.get('CPU', 0):g} CPU / {res.get('GPU', 0):g} GPU; lower engine.num_workers, "
                        "num_cpus_per_worker or num_gpus_per_worker, or raise the node types' max_workers in the "
                        "cluster config") from None
                time.sleep(1.0)
    finally:
        request_resources(bundles=[])  # the placed workers hold their nodes; let idle ones go


def match_budget(base: ExperimentConfig, base_split: FederatedSplit, row: ExperimentConfig,
                 row_split: FederatedSplit) -> ExperimentConfig:
    """A ``compare`` row with its own partition (e.g. the centralized
    reference) trains as many local SGD steps per round, summed over the
    round's clients, as the comparison's partition, so rows differ in who
    holds the data, not in compute.

    * ``training.local_steps`` S with K clients per round: the row's clients
      per round become min(K, its clients) = K' and its local steps
      ceil(K * S / K') (the centralized client: K * S steps a round).
    * ``training.local_epochs`` with every client in every round: unchanged:
      an epoch over the pooled data is the same number of samples as an epoch
      on every client (the step counts differ only in each client's last
      partial batch).  With partial participation an epoch budget depends on
      which clients were sampled, so the row needs ``training.local_steps``.
    """
    if row.partition == base.partition:
        return row
    t = base.training
    k_base = clients_per_round(base, base_split)
    k_row = min(k_base, row_split.num_clients)
    if t.local_steps is None:
        if k_base < base_split.num_clients:
            raise ConfigError(f"compare row {row.method.label or row.method.name}: its own partition with partial "
                              f"participation ({k_base} of {base_split.num_clients} clients a round) and "
                              "training.local_epochs has no fixed step budget to match; set training.local_steps")
        k_row = row_split.num_clients
        changes = {"clients_per_round": None if k_row == row_split.num_clients else k_row}
    else:
        changes = {"clients_per_round": None if k_row == row_split.num_clients else k_row,
                   "local_steps": -(-k_base * t.local_steps // k_row)}
    from rayfed_dg.config import validate

    tree = row.to_dict()
    tree["training"].update(changes)
    return validate(tree, f"compare row {row.method.label or row.method.name} (budget of {k_base} clients a round)")


def resolve_variants(cfg: ExperimentConfig, ds: DomainDataset,
                     targets: list[str]) -> list[tuple[str, ExperimentConfig, list[FederatedSplit]]]:
    """(label, config, splits) of every row to run, checked before anything is
    written: rows with their own partition get their own splits and the
    comparison's step budget (``match_budget``)."""
    from rayfed_dg.config import method_variants

    base_splits = make_splits(cfg, ds, targets)
    out = []
    for label, vcfg in method_variants(cfg):
        if vcfg.partition == cfg.partition:
            out.append((label, vcfg, base_splits if vcfg.stages == cfg.stages else make_splits(vcfg, ds, targets)))
            continue
        splits = [split_for(vcfg, ds, t) for t in targets]
        vcfg = match_budget(cfg, base_splits[0], vcfg, splits[0])
        out.append((label, vcfg, make_splits(vcfg, ds, targets)))
    return out


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


def use_token_auth_if_available(local: bool = False) -> None:
    """Token authentication, said explicitly.  A cluster started with ``ray
    start`` has it on, and a driver connecting to it must ask for it too; a
    local ``ray.init`` turns it on by itself but then logs a WARNING on every
    run, which saying so explicitly (Ray's own opt-in) silences."""
    import os
    from pathlib import Path

    if "RAY_AUTH_MODE" not in os.environ and (local or "RAY_AUTH_TOKEN" in os.environ
                                              or (Path.home() / ".ray" / "auth_token").is_file()):
        from ray._raylet import Config  # type: ignore[attr-defined]

        os.environ["RAY_AUTH_MODE"] = "token"
        Config.initialize("")  # Ray reads its settings once; re-read them (as Ray's own token setup does)


def init_ray(cfg: ExperimentConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    e = cfg.engine
    # the dashboard is off by default; when on, it listens on loopback only
    kwargs: dict[str, Any] = dict(include_dashboard=e.include_dashboard, configure_logging=True,
                                  logging_level="WARNING", log_to_driver=True, dashboard_host="127.0.0.1")
    if e.ray_address:
        use_token_auth_if_available()
        ray.init(address=e.ray_address, **kwargs)
    else:
        use_token_auth_if_available(local=True)
        ray.init(**kwargs)


def preflight(cfg: ExperimentConfig, splits: list[FederatedSplit], num_classes: int) -> None:
    """Fail before anything is written: the model builds (weights found, the
    method accepts the backbone), the stages can run, and the worker pool
    fits the Ray cluster."""

    from rayfed_dg.methods import build_method
    from rayfed_dg.stages import build_stages

    try:
        build_method(cfg, splits[0].num_clients if splits else None).build_model(num_classes)
    except (ValueError, KeyError) as e:
        if isinstance(e, (ConfigError, ModelError, DataError)):
            raise
        # a method that cannot build on this backbone is a config problem, not a crash
        raise ConfigError(f"method {cfg.method.name} cannot build model.arch={cfg.model.arch}: {e}") from None
    for stage in build_stages(cfg):
        stage.preflight()
    init_ray(cfg)
    for s in splits:
        ensure_workers(cfg.engine, clients_per_round(cfg, s))
