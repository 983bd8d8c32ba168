"""What the engine costs around training, measured in one run.

1. Start-up per federation: one experiment's actors (``EngineHost``) start
   once; the first federation pays for the processes, each later one (other
   targets and methods of the quickstart) only for ``open`` + the data
   stages.  Compared with starting fresh actors per federation, in the
   same run.
2. Per-client orchestration cost: a model whose training costs almost
   nothing (conv net of width 4 at 16 px, one local step of batch 2), 300
   clients a round, 1 worker.  ``orchestration / client`` = (round's
   training wall time - the clients' own seconds) / clients: what a GPU that
   trains a client in a few milliseconds would see on top.  Target <= 2 ms.
   With one client per Ray task (the baseline, ``engine.group_small_clients:
   false``) and with small clients grouped (the default).
3. Makespan on a skewed partition: Dirichlet multi-domain clients (alpha
   0.3: client sizes differ by 10x and more), two local epochs of a conv net
   of width 32 at 32 px (clients of 10 ms to 1 s), 2 workers; the round's
   makespan over the ideal (summed client seconds / workers), for
   largest-first dispatch and for client-id order.  Target <= 1.1.  Also
   the clients' phase alone (first dispatch to last update in), without
   the round's aggregation and broadcast.

    python bench/orchestration.py [--part startup,client,makespan] [--rounds 3]
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def _cfg(*overrides):
    from rayfed_dg.config import load_config

    return load_config("configs/quickstart.yaml", ["compare=null", "output.save_best_checkpoint=false",
                                                   "output.tensorboard=false", *overrides])


def startup() -> None:
    import ray

    from rayfed_dg.data import leave_one_domain_out, load_dataset
    from rayfed_dg.engine.running.host import EngineHost

    ds = load_dataset("embedded_digits", None, 16)
    refs = [ray.put(ds.images), ray.put(ds.labels)]
    feds = [(_cfg(f"method.name={m}"), leave_one_domain_out(ds, t, 0.2, 0))
            for m in ("fedavg", "gperxan") for t in ds.domain_names]
    # fresh actors per federation (the baseline): start, open, set up, shut down
    fresh = []
    for cfg, split in feds[:3]:
        t0 = time.perf_counter()
        host = EngineHost(cfg.engine, refs, 2)
        ray.get(host.open(cfg, split, ds.num_classes).setup.remote())
        host.close()
        fresh.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    host = EngineHost(feds[0][0].engine, refs, 2)
    shared = []
    for cfg, split in feds:
        ray.get(host.open(cfg, split, ds.num_classes).setup.remote())
        shared.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    host.close()
    print(f"start-up, fresh actors per federation: {', '.join(f'{s:.2f}' for s in fresh)} s "
          f"(mean {np.mean(fresh):.2f} s)")
    print(f"start-up, one host: first federation {shared[0]:.2f} s; each later one "
          f"{', '.join(f'{s:.3f}' for s in shared[1:])} s (max {max(shared[1:]):.3f} s, target <= 0.5 s)")


def _federation(cfg, split, ds):
    import ray

    from rayfed_dg.engine import run_federation

    return run_federation(cfg, split, ray.put(ds.images), ray.put(ds.labels), ds.num_classes, progress=False)


def per_client(rounds: int) -> None:
    from rayfed_dg.data import load_dataset
    from rayfed_dg.engine import split_for

    ds = load_dataset("embedded_digits", None, 16)
    for grouped in (False, True):  # one client per Ray task (the baseline), then small clients grouped
        cfg = _cfg("model.width=4", "partition.strategy=single_domain", "partition.num_clients=300",
                   "training.local_steps=1", "training.batch_size=2", f"training.rounds={rounds}",
                   "evaluation.every=0", "engine.num_workers=1", "method.name=fedavg",
                   f"engine.group_small_clients={str(grouped).lower()}")
        split = split_for(cfg, ds, "colour")
        res = _federation(cfg, split, ds)
        by_round: dict[int, list[dict]] = {}
        for c in res.clients:
            by_round.setdefault(c["round"], []).append(c)
        label = "grouped" if grouped else "one client per task"
        for r, rows in sorted(by_round.items()):
            wall = res.seconds_per_round[r - 1]
            own = sum(c["seconds"] for c in rows)
            print(f"{label}, round {r}: {len(rows)} clients, {1000 * wall / len(rows):.2f} ms wall / client, "
                  f"clients' own {1000 * own / len(rows):.2f} ms, orchestration "
                  f"{1000 * (wall - own) / len(rows):.2f} ms / client")
        # round 1 pays each worker's first optimizer, the last round the evaluation
        steady = [r for r in sorted(by_round) if 1 < r < rounds] or [1]
        orch = np.mean([(res.seconds_per_round[r - 1] - sum(c["seconds"] for c in by_round[r])) / len(by_round[r])
                        for r in steady])
        print(f"{label}: orchestration per client (rounds {steady[0]}-{steady[-1]}, aggregation included): "
              f"{1000 * orch:.2f} ms (target <= 2 ms)")


def makespan(rounds: int) -> None:
    from rayfed_dg.data import load_dataset

    ds = load_dataset("embedded_digits", None, 32)
    split = None
    for schedule in ("largest_first", "in_order"):
        cfg = _cfg("partition.strategy=dirichlet", "partition.num_clients=30", "partition.alpha=0.3",
                   "partition.min_size=2", f"training.rounds={rounds}", "evaluation.every=0", "engine.num_workers=2",
                   "method.name=fedavg", f"engine.schedule={schedule}", "data.resolution=32",
                   "training.local_epochs=2")
        from rayfed_dg.engine import split_for

        split = split or split_for(cfg, ds, "colour")
        res = _federation(cfg, split, ds)
        sizes = split.client_sizes()
        ratios, phase = [], []
        for r in range(2, rounds):  # round 1 pays each worker's first optimizer, the last the evaluation
            rows = [c for c in res.clients if c["round"] == r]
            ideal = sum(c["seconds"] for c in rows) / 2
            ratios.append(res.seconds_per_round[r - 1] / ideal)
            phase.append(res.seconds_clients_per_round[r - 1] / ideal)
        print(f"{schedule}: {split.num_clients} clients of {sizes.min()}-{sizes.max()} samples; round makespan / "
              f"ideal (summed client seconds / 2 workers), rounds 2-{rounds - 1}: "
              f"{', '.join(f'{x:.3f}' for x in ratios)} (mean {np.mean(ratios):.3f}, target <= 1.1); "
              f"the clients' phase alone: mean {np.mean(phase):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="startup,client,makespan")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import ray

    from rayfed_dg.config import EngineConfig

    # workers at the niceness a run gives them (engine.worker_niceness), not Ray's 15
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             _system_config={"worker_niceness": EngineConfig().worker_niceness})
    parts = args.part.split(",")
    if "startup" in parts:
        startup()
    if "client" in parts:
        per_client(args.rounds)
    if "makespan" in parts:
        makespan(args.rounds)


if __name__ == "__main__":
    main()
