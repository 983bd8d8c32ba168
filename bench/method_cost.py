"""Seconds per local step of each method vs FedAvg, measured in one run.

Every method trains the same backbone on the same batches (same batch size
and resolution) through the engine's own client code (``ClientRunner``),
without Ray, so only the method's compute differs.  Methods are interleaved
over repetitions so machine noise hits all alike; the ratio is the median
step time of a method over FedAvg's.

    python bench/method_cost.py [--arch resnet18] [--res 64] [--batch 32] [--steps 10] [--methods ...]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

DEFAULT = ["fedavg", "fedprox", "gperxan", "fedfd", "fedfda", "stablefdg"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", nargs="*", default=None, help="name or name:key=value,key=value")
    args = ap.parse_args()

    from rayfed_dg.config import load_config
    from rayfed_dg.engine import ClientRunner
    from rayfed_dg.engine.worker import to_numpy_state
    from rayfed_dg.methods import method_names

    methods = args.methods or [m for m in DEFAULT if m in method_names()]
    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    images = rng.integers(0, 256, (n, args.res, args.res, 3), dtype=np.uint8)
    labels = rng.integers(0, 7, n).astype(np.int64)
    runners = {}
    for spec in methods:
        name, _, kv = spec.partition(":")
        sets = [f"method.{x}" for x in kv.split(",") if x]
        cfg = load_config(None, [f"model.arch={args.arch}", f"data.resolution={args.res}",
                                 f"training.batch_size={args.batch}", "training.local_epochs=1",
                                 f"engine.num_cpus_per_worker={args.threads}", f"method.name={name}", *sets])
        r = ClientRunner(cfg.to_dict(), images, labels, 7)
        sd = r.model.state_dict()
        g = to_numpy_state(sd, sd.keys())
        payload = r.method.server_payloads(1, [0], {}, np.random.default_rng(0), g).get(0, {})
        runners[spec] = (r, g, payload)
    torch.set_num_threads(args.threads)
    times = {m: [] for m in methods}
    for rep in range(args.repeat + 1):
        for m in methods:
            r, g, payload = runners[m]
            t0 = time.perf_counter()
            r.train(0, rep + 1, np.arange(n), g, {k: g[k] for k in r.local_keys}, payload)
            if rep:  # the first repetition warms up
                times[m].append((time.perf_counter() - t0) / args.steps)
    base = statistics.median(times[methods[0]])
    print(f"backbone {args.arch}, {args.res}px, batch {args.batch}, {args.steps} steps x {args.repeat} repeats, "
          f"{args.threads} threads")
    for m in methods:
        t = statistics.median(times[m])
        print(f"{m:40s} {t * 1000:8.1f} ms/step   ratio vs {methods[0]}: {t / base:.3f}")


if __name__ == "__main__":
    main()
