"""A paper table on a rehearsal cluster: concurrent federations against one at a time, measured in one run.

Ray's multi-node test utilities (``ray.cluster_utils.Cluster``) start a head
(no GPU) and ``--nodes`` nodes with ``--gpus`` declared GPUs each on this
machine; training runs on the CPU (``engine.gpus_declared_only``) while every
scheduling decision is a GPU cluster's (one GPU per worker).  The table is the
quickstart's 2 rows x 4 targets x ``--seeds`` (24 federations for 3 seeds) at
a tiny budget, run through ``rayfed_dg.run`` with
``engine.concurrent_federations: auto`` and with ``1``.  Prints how many
federations ran at once and on which nodes (each target's ``placement`` in its
row's summary.json), whether the metrics, ledger and clients tables (less the
clients' wall seconds) are equal bit for bit to the sequential run's, and the
wall-time ratio.  Where the config has no ``engine.concurrent_federations``,
only the sequential run is made, and the bench says so.

The cluster's processes are this script's children, stopped by
``Cluster.shutdown`` (never ``ray stop``); its address file is written under
a private ``RAY_TMPDIR``, so no other Ray driver on the machine joins it.

    python bench/rehearsal_cluster.py [--nodes 4] [--gpus 4] [--seeds 0,1,2] [--rounds 2] [--limit 40]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLES = ("metrics", "ledger", "clients")
TIMING = {"clients": ["seconds"]}  # wall-clock columns: scheduling, not numbers


def start_cluster(nodes: int, gpus: int, cpus: float, temp: Path):
    """A head with no GPU and ``nodes`` nodes of ``gpus`` GPUs and ``cpus``
    CPUs; returns the cluster and {node id: name}."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_TMPDIR"] = str(temp)  # ray.init() elsewhere on the machine looks for /tmp/ray's address file
    mem = 150 * 1024 * 1024
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "object_store_memory": mem,
                                                           "include_dashboard": False})
    names = {cluster.head_node.node_id: "head"}
    for i in range(nodes):
        node = cluster.add_node(num_cpus=cpus, num_gpus=gpus, object_store_memory=mem)
        names[node.node_id] = f"gpu{i + 1}"
    cluster.wait_for_nodes(timeout=120)  # a loaded machine starts raylets slowly
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    return cluster, names


def placements(root: Path, seeds: list[int]) -> list[tuple[str, dict | None]]:
    """(seed / row / target, its ``placement`` or None where not recorded) of every federation."""
    from rayfed_dg.engine.store.rundir import RunDir

    out = []
    for s in seeds:
        for row in RunDir(root).seed(s).subdirs():
            for target, summary in (row.summary() or {}).get("targets", {}).items():
                out.append((f"seed {s} {row.path.name} {target}", summary.get("placement")))
    return out


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most intervals that overlap (an end at the instant another starts does not overlap it)."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def compare(a: Path, b: Path, seeds: list[int]) -> list[str]:
    """One line per table: rows compared and whether ``a`` equals ``b`` bit for bit."""
    from rayfed_dg.engine.store.rundir import RunDir

    lines = []
    for name in TABLES:
        rows, same = 0, True
        for s in seeds:
            for ra, rb in zip(RunDir(a).seed(s).subdirs(), RunDir(b).seed(s).subdirs(), strict=True):
                ta, tb = (r.read_table(name).drop_columns(TIMING.get(name, [])) for r in (ra, rb))
                rows += ta.num_rows
                same = same and ra.path.name == rb.path.name and ta.equals(tb)
        lines.append(f"  {name}: {rows} rows, {'identical' if same else 'DIFFERENT'}")
    return lines


def run_table(args, root: Path, concurrent: str | int | None) -> float:
    import rayfed_dg

    overrides = {"training.rounds": args.rounds, "data.limit_per_domain": args.limit, "model.width": 8,
                 "engine.gpus_declared_only": True, "engine.num_gpus_per_worker": 1,
                 "engine.num_cpus_per_worker": args.cpus / args.gpus, "output.tensorboard": False}
    if concurrent is not None:
        overrides["engine.concurrent_federations"] = concurrent
    t0 = time.perf_counter()
    rayfed_dg.run(REPO / "configs/quickstart.yaml", overrides, target="all", run_dir=root, seeds=args.seeds,
                  progress=False)
    return time.perf_counter() - t0


def report(label: str, root: Path, seeds: list[int], names: dict[str, str], wall: float) -> None:
    feds = placements(root, seeds)
    print(f"\n{label}: {len(feds)} federations, {wall:.1f} s")
    spans = [(p["started_s"], p["ended_s"]) for _, p in feds if p is not None]
    if len(spans) < len(feds):
        print("  at once: not recorded (no placement in summary.json)")
        return
    print(f"  at most {most_at_once(spans)} federations at once")
    for what, p in feds:
        assert p is not None
        nodes = ", ".join(names.get(n, n[:8]) for n in p["nodes"])
        print(f"  {what}: {p['workers']} workers on {nodes}, {p['started_s']:.1f}-{p['ended_s']:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=4, help="declared GPUs per node (one per worker)")
    ap.add_argument("--cpus", type=float, default=1.0, help="declared CPUs per node, shared by its workers")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=40, help="data.limit_per_domain")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    from rayfed_dg.config import EngineConfig, load_config
    from rayfed_dg.engine import load_data

    has_key = "concurrent_federations" in EngineConfig.model_fields
    load_data(load_config(REPO / "configs/quickstart.yaml", [f"data.limit_per_domain={args.limit}"]))  # decode cache
    work = Path(tempfile.mkdtemp(prefix="rfdg-rc-"))
    cluster, names = start_cluster(args.nodes, args.gpus, args.cpus, work / "ray")
    try:
        print(f"rehearsal cluster: head (no GPU) + {args.nodes} nodes x {args.gpus} GPUs, {args.cpus:g} CPU each; "
              f"quickstart, seeds {args.seeds}, {args.rounds} rounds, {args.limit} images per domain; "
              f"run directories in {work}")
        seq = run_table(args, work / "one", 1 if has_key else None)
        report("engine.concurrent_federations: 1" if has_key else "sequential (this version's only way)",
               work / "one", seeds, names, seq)
        if not has_key:
            print("\nengine.concurrent_federations is not a config key in this version: the sequential run only")
            return
        conc = run_table(args, work / "auto", "auto")
        report("engine.concurrent_federations: auto", work / "auto", seeds, names, conc)
        print("\nauto against 1, bit for bit (clients' wall seconds left out):")
        print("\n".join(compare(work / "auto", work / "one", seeds)))
        print(f"wall time: 1 at a time {seq:.1f} s, auto {conc:.1f} s; speed-up (1 at a time / auto) {seq / conc:.2f}")
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
