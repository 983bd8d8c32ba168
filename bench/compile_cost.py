"""Compiled local steps on the CPU (``engine.compile``), measured in one run.

The ResNet-18 32 px shape of ``bench/engine_overhead.py`` (``SHAPES["resnet"]``:
30 clients of 64 samples, 10 a round, batch 32, one epoch, FedAvg), one
federation eager then one compiled (``--mode``, default ``default``) on the
same worker actors.  Prints:

* each worker's compile time (the warm-up step in ``ClientRunner.bind``,
  read from the worker: ``compile_seconds``), paid once per worker and
  federation, in round 1's wall time;
* seconds per round of each, and their ratio compiled / eager between the
  first round (bind, and the compile) and the last (evaluation);
* the rounds after which the compile has paid for itself at that ratio.

Both sides train on ``--cpus`` cores (one worker by default).  Inductor
compiles C++ with gcc: on 2 busy cores the compile takes minutes.

    python bench/compile_cost.py [--rounds 4] [--workers 1] [--cpus 1] [--mode default]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_overhead import SHAPES, make_data  # noqa: E402


def worker_compile_seconds(host) -> list[float | None]:
    """Each worker's ``compile_seconds`` of the federation it bound last."""
    import ray

    return ray.get([w.__ray_call__.remote(lambda self: getattr(self, "compile_seconds", None)) for w in host.workers])


def federation(cfg, host, refs, clients, val_idx) -> list[float]:
    from rayfed_dg.data.protocol import FederatedSplit
    from rayfed_dg.engine import run_federation

    split = FederatedSplit(target="t", clients=clients, client_domains=["d"] * len(clients),
                           val={"d": val_idx[:32]}, test={"t": val_idx[32:]})
    return run_federation(cfg, split, refs[0], refs[1], 10, progress=False, host=host).seconds_per_round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--cpus", type=int, default=1, help="cores for Ray, shared by the workers")
    ap.add_argument("--mode", choices=("default", "reduce-overhead"), default="default",
                    help="engine.compile (reduce-overhead: CUDA workers only, refused here)")
    args = ap.parse_args()
    import ray

    from rayfed_dg.config import load_config
    from rayfed_dg.engine.running.host import EngineHost

    s = SHAPES["resnet"]
    base = [*s.config, "data.resolution=32", "training.local_epochs=1", f"training.rounds={args.rounds}",
            f"training.clients_per_round={s.per_round}", "evaluation.every=0", f"engine.num_workers={args.workers}",
            f"engine.num_cpus_per_worker={args.cpus / args.workers:g}", "output.save_best_checkpoint=false",
            "output.tensorboard=false"]
    cfgs = {m: load_config(None, [*base, f"engine.compile={m}"]) for m in ("off", args.mode)}
    images, labels = make_data(s.clients, s.per_client, 32)
    clients = [np.arange(i * s.per_client, (i + 1) * s.per_client) for i in range(s.clients)]
    val_idx = np.arange(s.clients * s.per_client, len(labels))
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             _system_config={"worker_niceness": os.nice(0)})
    refs = [ray.put(images), ray.put(labels)]
    host = EngineHost(cfgs["off"].engine, refs, args.workers)
    out, compile_s = {}, []
    try:
        t0 = time.perf_counter()
        for m, cfg in cfgs.items():
            out[m] = federation(cfg, host, refs, clients, val_idx)
            if m != "off":
                compile_s = worker_compile_seconds(host)
    finally:
        host.close()
        ray.shutdown()
    r = args.rounds
    mid = [i for i in range(r) if 0 < i < r - 1] or list(range(r))
    eager, comp = (float(np.mean([out[m][i] for i in mid])) for m in cfgs)
    print(f"[compile_cost] {s.label}, {r} rounds, {args.workers} worker(s) x {args.cpus / args.workers:g} CPU, "
          f"engine.compile={args.mode} (took {time.perf_counter() - t0:.0f} s in all)")
    print("[compile_cost] compile per worker: " + ", ".join("n/a" if c is None else f"{c:.1f} s" for c in compile_s)
          + " (once per worker and federation, in round 1)")
    for m in cfgs:
        rounds = ", ".join(f"{x:.2f}" for x in out[m])
        print(f"[compile_cost] {'eager' if m == 'off' else m:>15} s/round: rounds {rounds}")
    ratio = comp / eager
    print(f"[compile_cost] s/round between the first and last rounds: eager {eager:.3f}, compiled {comp:.3f}; "
          f"ratio compiled / eager {ratio:.3f}")
    gain, cost = eager - comp, float(np.mean([c for c in compile_s if c is not None] or [float("nan")]))
    print("[compile_cost] the compile pays for itself after "
          + (f"{cost / gain:.0f} rounds per worker" if gain > 0 else "never at this ratio (compiled is not faster)"))


if __name__ == "__main__":
    main()
