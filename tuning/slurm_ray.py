#!/usr/bin/env python
"""The Ray side of the Slurm scripts (``tuning/slurm_ray.sh``): what the workers may ask for, checks that Ray got it.

    python tuning/slurm_ray.py plan --cpus 16 --gpus 4 --cpus-per-worker 1
        -> "0.25 16 0": each worker's GPU share, the workers per node and the GPUs
           they leave idle, so that the workers that fill a node's CPUs also fill its GPUs
    python tuning/slurm_ray.py wait --address IP:PORT --nodes 3 --cpus 16 --gpus 4
        -> waits for the nodes, then fails unless Ray's CPUs and GPUs are Slurm's
    python tuning/slurm_ray.py placement-groups --address IP:PORT
        -> the placement groups the sweep's trials reserved (removed ones too), and each bundle's node

Every line it prints starts with ``slurm_ray:`` so a job log can be read by
machine (``tests/test_slurm.py`` does).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import socket
import sys
import time

# Ray keeps resource quantities to 4 decimals; a share above 1 must be a whole number of GPUs
RAY_PRECISION = 10_000


def plan(cpus: float, gpus: int, cpus_per_worker: float) -> tuple[float, int]:
    """(GPUs per worker, workers per node) for a node of ``cpus`` CPUs and ``gpus`` GPUs.

    The workers a node's CPUs hold share its GPUs evenly, rounded down to
    what Ray can represent, so that many workers never ask for more GPUs than
    the node has, and (when the division is exact) use every one of them."""
    workers = math.floor(cpus / cpus_per_worker + 1e-9)
    if workers < 1:
        raise ValueError(f"one worker needs {cpus_per_worker:g} CPUs but a node has {cpus:g}")
    if gpus <= 0:
        return 0.0, workers
    if gpus >= workers:
        return float(gpus // workers), workers
    return math.floor(gpus * RAY_PRECISION / workers) / RAY_PRECISION, workers


def _say(msg: str) -> None:
    print(f"slurm_ray: {msg}", flush=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _check(pids: list[int]) -> None:
    dead = [p for p in pids if not _alive(p)]
    if dead:
        raise SystemExit(f"slurm_ray: error: a node's `ray start` step ended (process {dead[0]}); see above")


def _connect(address: str, timeout: float, pids: tuple[int, ...] | list[int] = ()) -> None:
    import ray

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        _check(list(pids))
        with socket.socket() as s:
            s.settimeout(2)
            if s.connect_ex((host, int(port))) == 0:
                break
        if time.monotonic() > deadline:
            raise SystemExit(f"slurm_ray: error: no Ray head answers at {address} after {timeout:g} s")
        time.sleep(1)
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except Exception as e:  # a head that failed after opening its port (see its step's output above)
        _check(list(pids))
        raise SystemExit(f"slurm_ray: error: cannot join the Ray cluster at {address}: "
                         f"{(str(e).strip().splitlines() or [type(e).__name__])[-1]}") from None


def wait(address: str, nodes: int, cpus: float, gpus: float, timeout: float, pids: list[int]) -> int:
    import ray

    _connect(address, timeout, pids)
    deadline = time.monotonic() + timeout
    alive: list = []
    while time.monotonic() < deadline:
        _check(pids)
        alive = [n for n in ray.nodes() if n["Alive"]]
        if len(alive) >= nodes:
            break
        time.sleep(1)
    res = ray.cluster_resources()
    have_cpu, have_gpu = float(res.get("CPU", 0)), float(res.get("GPU", 0))
    _say(f"ray cluster: {len(alive)} node(s), {have_cpu:g} CPU, {have_gpu:g} GPU "
         f"(Slurm: {nodes} node(s) x {cpus:g} CPU, {gpus:g} GPU)")
    for n in sorted(alive, key=lambda n: n["NodeManagerAddress"]):
        r = n["Resources"]
        _say(f"ray node {n['NodeManagerAddress']}: {r.get('CPU', 0):g} CPU, {r.get('GPU', 0):g} GPU")
    ray.shutdown()
    if len(alive) != nodes or have_cpu != nodes * cpus or have_gpu != nodes * gpus:
        _say(f"error: Ray has {len(alive)} node(s), {have_cpu:g} CPU, {have_gpu:g} GPU but Slurm allocated "
             f"{nodes} x ({cpus:g} CPU, {gpus:g} GPU) = {nodes * cpus:g} CPU, {nodes * gpus:g} GPU")
        return 1
    return 0


def placement_groups(address: str) -> int:
    import ray
    from ray.util.placement_group import placement_group_table

    _connect(address, 30)
    table = placement_group_table()
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    ray.shutdown()
    for pg_id, pg in sorted(table.items()):
        bundles = [pg["bundles"][i] for i in sorted(pg["bundles"])]
        gpu = sum(b.get("GPU", 0) for b in bundles)
        where = pg.get("bundles_to_node_id") or {}
        _say("placement group " + json.dumps({"id": pg_id[:12], "state": pg["state"], "bundles": bundles,
                                               "gpu": gpu, "placed": bool(where),
                                               "nodes": [ips.get(where[i], where[i]) for i in sorted(where)]}))
    _say(f"{len(table)} placement group(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--cpus", type=float, required=True)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--cpus-per-worker", type=float, required=True)
    w = sub.add_parser("wait")
    w.add_argument("--address", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--cpus", type=float, required=True)
    w.add_argument("--gpus", type=float, required=True)
    w.add_argument("--timeout", type=float, default=300)
    w.add_argument("--watch", type=int, nargs="*", default=[], metavar="PID",
                   help="the nodes' srun processes: fail at once if one ends")
    g = sub.add_parser("placement-groups")
    g.add_argument("--address", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        try:
            share, workers = plan(args.cpus, args.gpus, args.cpus_per_worker)
        except ValueError as e:
            print(f"slurm_ray: error: {e}", file=sys.stderr)
            return 2
        idle = args.gpus - share * workers  # a rounding remainder (2 GPUs / 3 workers) idles nothing
        print(f"{share:g} {workers} {idle if idle > 0.01 else 0:g}")
        return 0
    if args.cmd == "wait":
        return wait(args.address, args.nodes, args.cpus, args.gpus, args.timeout, args.watch)
    return placement_groups(args.address)


if __name__ == "__main__":
    sys.exit(main())
