"""Moving the global model to workers on other nodes, on a local multi-node cluster.

Starts ``cluster-local.yaml`` (a head with no GPU; the autoscaler adds
``gpu_worker`` nodes), places W reader actors on one worker node (W = 1 and
4, as four workers at ``num_gpus_per_worker: 0.25`` share a node) and, per
round, puts a ResNet-18 state dict in the object store on the head (as the
server does once per round) and has every reader take it as a task argument
(as ``Worker.train`` does).  Prints seconds per round for W = 1 and W = 4,
interleaved, their ratio, and how many copies of a round's model exist per
node (Ray's object directory): one per node means the node fetched it once,
whatever the number of workers reading it there.

    python bench/broadcast_cost.py [--rounds 5]

Needs port 6379 free (the fake provider's nodes join the head there); the
cluster is stopped by process id at the end.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import numpy as np
    import ray
    from ray.autoscaler.sdk import request_resources
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayfed_dg.cluster import ADDRESS, LocalCluster
    from rayfed_dg.engine.workers.resources import use_token_auth_if_available
    from rayfed_dg.models import build_backbone

    with LocalCluster(REPO / "cluster-local.yaml", temp_dir="/tmp/rayfed-dg-bench-cluster"):
        use_token_auth_if_available()
        ray.init(address=ADDRESS, logging_level="ERROR", log_to_driver=False)
        request_resources(bundles=[{"CPU": 1, "GPU": 1}])
        t0 = time.monotonic()
        while ray.cluster_resources().get("GPU", 0) < 1:
            assert time.monotonic() - t0 < 120, "no gpu_worker node came up"
            time.sleep(0.5)
        head = ray.get_runtime_context().get_node_id()
        node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
        state = {k: v.detach().numpy().copy() for k, v in build_backbone("resnet18", 10).state_dict().items()}
        nbytes = sum(a.nbytes for a in state.values())

        @ray.remote(num_cpus=0.1)
        class Reader:
            def read(self, global_state: dict) -> float:  # resolved by Ray, zero-copy on the node
                return float(global_state["head.bias"][0])

        pin = NodeAffinitySchedulingStrategy(node, soft=False)
        readers = {w: [Reader.options(scheduling_strategy=pin).remote() for _ in range(w)] for w in (1, 4)}
        ray.get([r.read.remote({"head.bias": np.zeros(1)}) for rs in readers.values() for r in rs])  # warm up
        times: dict[int, list[float]] = {1: [], 4: []}
        copies = []
        for _ in range(args.rounds):
            for w in (1, 4):
                state["head.bias"] = state["head.bias"] + 1.0  # a new model each round
                t = time.perf_counter()
                ref = ray.put(state)
                ray.get([r.read.remote(ref) for r in readers[w]])
                times[w].append(time.perf_counter() - t)
                locs = ray.experimental.get_object_locations([ref])[ref]
                copies.append((w, len(locs["node_ids"]), node in locs["node_ids"]))
                del ref
        ray.shutdown()
    med = {w: float(np.median(v)) for w, v in times.items()}
    print(f"global model: ResNet-18 state dict, {nbytes:,} bytes; readers on one remote node; {args.rounds} rounds")
    for w in (1, 4):
        rounds = ", ".join(f"{x:.3f}" for x in times[w])
        print(f"{w} worker(s) on the node: {med[w]:.3f} s per round (median; rounds {rounds})")
    print(f"ratio 4 workers / 1 worker: {med[4] / med[1]:.2f}  (4.00 if every worker fetched its own copy)")
    print("copies of a round's model per round (workers, nodes holding it, remote node among them): "
          + ", ".join(f"({w}, {n}, {on})" for w, n, on in copies[:4]))
    per_node = {n for _, n, _ in copies}
    print(f"bytes moved per round to the remote node: {nbytes:,} (one copy: head + remote = {sorted(per_node)} nodes "
          "hold it, whatever the number of workers)")


if __name__ == "__main__":
    main()
