"""Ray plumbing: starting or joining Ray, sizing the worker pool against the
cluster's resources, and asking an autoscaler for what does not fit yet."""
from __future__ import annotations

import math
from typing import Any

from rayfed_dg.config import ExperimentConfig
from rayfed_dg.errors import ConfigError, ResourceError


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


def autoscaler_present() -> bool:
    """Whether the connected cluster runs a real autoscaler (``ray up``, a
    fake multi-node cluster).  Plain local Ray runs the autoscaler's
    read-only provider, whose node types are named after its nodes
    (``node_<id>``); a cluster config names its node types itself.  v1
    reports in the GCS's key-value store; v2 (``ray up``'s autoscaler since
    Ray 2.50) writes nothing there and answers ``get_cluster_status``."""
    import json

    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    if is_autoscaler_v2(fetch_from_server=True):
        status = get_cluster_status(ray.get_runtime_context().gcs_address)
        types = {n.ray_node_type_name for n in status.active_nodes + status.idle_nodes + status.pending_nodes}
        return any(not str(t).startswith("node_") for t in types)
    raw = _internal_kv_get("__autoscaling_status")
    if not raw:
        return False
    report = json.loads(raw).get("autoscaler_report") or {}
    types = set((report.get("node_type_mapping") or {}).values()) | set(report.get("active_nodes") or {})
    return any(not str(t).startswith("node_") for t in types)


def cluster_to_join(address: str | None) -> str | None:
    """The running cluster ``ray.init(address=address)`` joins (its GCS
    address), found as Ray finds it: the address, else ``RAY_ADDRESS``, else
    the cluster of the last ``ray start`` on this machine
    (``<RAY_TMPDIR or /tmp>/ray/ray_current_cluster``, as on a ``ray up``
    head); None where ``ray.init`` starts a local Ray of its own.  Raises
    ValueError (a malformed address) or ConnectionError (``auto`` with no
    cluster running) as ``ray.init`` would."""
    from ray._private.services import canonicalize_bootstrap_address

    if address is not None and address.startswith("ray://"):  # Ray Client: a remote cluster, never a local Ray
        return address
    return canonicalize_bootstrap_address(address)  # type: ignore[arg-type]  # annotated str, takes None as ray.init


def use_token_auth_if_available(local: bool = False) -> None:
    """Token authentication, said explicitly, where this driver needs it.
    ``local`` (this driver starts its own Ray): on, as Ray would turn it on
    by itself, but then with a WARNING on every run, which saying so
    explicitly (Ray's own opt-in) silences.  Joining a running cluster: on
    only where this machine has a token (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``: what Ray's ``ray start``
    turned auth on with); a cluster started without one, as ``cluster.yaml``
    starts its head, refuses a driver that asks for it ("no authentication
    token was found"), and ignores a token it was not started with.
    ``RAY_AUTH_MODE`` set by the user wins."""
    import os

    if "RAY_AUTH_MODE" in os.environ:
        return
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    if local or AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        os.environ["RAY_AUTH_MODE"] = "token"
        Config.initialize("")  # Ray reads its settings once; re-read them (as Ray's own token setup does)


def init_ray(cfg: ExperimentConfig) -> None:
    """Start a local Ray or join the cluster that ``engine.ray_address``,
    ``RAY_ADDRESS`` or a ``ray start`` on this machine names (as ``ray.init``
    decides); a cluster that cannot be joined ends in one line (ConfigError)."""
    import os

    import ray
    from ray.exceptions import AuthenticationError

    from rayfed_dg.utils import env_set

    if ray.is_initialized():
        return
    e = cfg.engine
    named = (f"engine.ray_address={e.ray_address}" if e.ray_address else
             f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}" if os.environ.get("RAY_ADDRESS") else
             "the cluster of the last `ray start` on this machine")
    try:
        joins = cluster_to_join(e.ray_address)
    except (ValueError, ConnectionError) as err:
        raise ConfigError(f"cannot join a Ray cluster ({named}): {' '.join(str(err).split())}") from None
    use_token_auth_if_available(local=joins is None)
    # the dashboard is off by default; when on, it listens on loopback only
    kwargs: dict[str, Any] = dict(include_dashboard=e.include_dashboard, configure_logging=True,
                                  logging_level="WARNING", log_to_driver=True, dashboard_host="127.0.0.1")
    try:
        # read by the raylet ray.init starts (Ray's job manager sets it the same way); ignored when ray.init joins a
        # running cluster, which refuses a _system_config.  The address decided above, so Ray does not look again
        with env_set("RAY_worker_niceness", str(e.worker_niceness)):
            ray.init(address=joins or "local", **kwargs)  # "local": start one, never join what was not decided
    except (ConnectionError, AuthenticationError) as err:
        if joins is None:
            raise
        token = "its token in ~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH"
        hint = (f"; RAY_AUTH_MODE=token needs {token}" if isinstance(err, AuthenticationError) else
                f"; check that its head runs, the address, and, if the cluster has token authentication, {token}")
        raise ConfigError(f"cannot join the Ray cluster at {joins} ({named}): {' '.join(str(err).split())}"
                          f"{hint}") from None


def launching_nodes(report: dict, num_cpus: float, num_gpus: float) -> str | None:
    """What an autoscaler v1 status report (``__autoscaling_status``) says is
    being brought up that could host a worker of ``num_cpus`` CPU and
    ``num_gpus`` GPU ("1 x gpu_worker"), or None.  Pending launches (the
    provider's create call: EC2's, or a fake node's start) and pending nodes
    (booting, setting up) count when their resources together
    (``pending_resources``) hold one such worker."""
    from collections import Counter

    r = report.get("autoscaler_report") or {}
    kinds = Counter({t: n for t, n in (r.get("pending_launches") or {}).items() if n})
    kinds.update(node[-2] for node in r.get("pending_nodes") or [])  # (id,) ip, node type, status
    res = r.get("pending_resources") or {}
    if not kinds or res.get("CPU", 0) < num_cpus or res.get("GPU", 0) < num_gpus:
        return None
    return ", ".join(f"{n} x {t}" for t, n in sorted(kinds.items()))


def autoscaler_launching(num_cpus: float, num_gpus: float) -> str | None:
    """What the connected cluster's autoscaler is bringing up that could host
    a worker (see ``launching_nodes``), or None (none runs, or it launches
    nothing).  Autoscaler v2 (what ``ray up`` starts since Ray 2.50) answers
    through the GCS (``get_cluster_status``), without the node types'
    resources: any pending launch or node counts; v1 (``ray start
    --autoscaling-config``, the local cluster) writes its report in the GCS's
    key-value store."""
    import json
    from collections import Counter

    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        if is_autoscaler_v2(fetch_from_server=True):
            status = get_cluster_status(ray.get_runtime_context().gcs_address)
            kinds: Counter[str] = Counter(node.ray_node_type_name for node in status.pending_nodes)
            for req in status.pending_launches:
                kinds[req.ray_node_type_name] += req.count
            return ", ".join(f"{n} x {t}" for t, n in sorted(kinds.items()) if n) or None
        raw = _internal_kv_get("__autoscaling_status")
    except Exception:  # a status the GCS could not give (it restarts, a Ray that changed it) extends nothing
        return None
    return launching_nodes(json.loads(raw), num_cpus, num_gpus) if raw else None
