"""Compiled local steps on the CPU (``engine.compile``), measured in one run.

The ResNet-18 32 px shape of ``bench/engine_overhead.py`` (``SHAPES["resnet"]``:
30 clients of 64 samples, 10 a round, batch 32, one epoch, FedAvg):
federations eager and compiled (``--mode``, default ``default``) in turn,
``--repeat`` times, on the same worker actors.  Prints:

* each worker's compile time in each compiled federation (the warm-up step
  in ``ClientRunner.bind``, read from the worker: ``compile_seconds``), paid
  once per worker and federation in round 1's wall time: the first from an
  empty Inductor cache (a temporary ``TORCHINDUCTOR_CACHE_DIR``), the later
  ones from what it cached;
* seconds per round of each, and their ratio compiled / eager over the
  rounds between each federation's first (bind, and the compile) and its
  last (evaluation);
* the rounds after which the first compile has paid for itself at that ratio.

Both sides train on ``--cpus`` cores (one worker by default); Inductor
compiles C++ with gcc, in worker processes of its own.

    python bench/compile_cost.py [--rounds 4] [--repeat 2] [--workers 1] [--cpus 1] [--mode default]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
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
    ap.add_argument("--repeat", type=int, default=2, help="eager and compiled federations, in turn")
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
    out: dict[str, list[float]] = {m: [] for m in cfgs}
    compile_s: list[list[float | None]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the workers' first compile starts from nothing
        ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                 _system_config={"worker_niceness": os.nice(0)})
        refs = [ray.put(images), ray.put(labels)]
        host = EngineHost(cfgs["off"].engine, refs, args.workers)
        try:
            for _ in range(args.repeat):  # in turn, so machine noise hits both alike
                for m, cfg in cfgs.items():
                    out[m] += federation(cfg, host, refs, clients, val_idx)
                    if m != "off":
                        compile_s.append(worker_compile_seconds(host))
        finally:
            host.close()
            ray.shutdown()
    report(args, s.label, out, compile_s, time.perf_counter() - t0)


def report(args, label: str, out: dict[str, list[float]], compile_s: list[list[float | None]], took: float) -> None:
    r = args.rounds
    mid = [i for i in range(len(out["off"])) if 0 < i % r < r - 1] or list(range(len(out["off"])))
    eager, comp = (float(np.mean([out[m][i] for i in mid])) for m in out)
    print(f"[compile_cost] {label}, {r} rounds x{args.repeat} in turn, {args.workers} worker(s) x "
          f"{args.cpus / args.workers:g} CPU, engine.compile={args.mode} (took {took:.0f} s in all)")
    for i, secs in enumerate(compile_s):
        print(f"[compile_cost] compile per worker, federation {i + 1} "
              f"({'empty Inductor cache' if i == 0 else 'from the cache'}): "
              + ", ".join("n/a" if c is None else f"{c:.1f} s" for c in secs))
    for m in out:
        rounds = ", ".join(f"{x:.2f}" for x in out[m])
        print(f"[compile_cost] {'eager' if m == 'off' else m:>15} s/round: rounds {rounds}")
    print(f"[compile_cost] s/round between each federation's first and last rounds: eager {eager:.3f}, compiled "
          f"{comp:.3f}; ratio compiled / eager {comp / eager:.3f}")
    first = [c for c in compile_s[0] if c is not None] if compile_s else []
    gain, cost = eager - comp, float(np.mean(first)) if first else float("nan")
    print("[compile_cost] the first compile pays for itself after "
          + (f"{cost / gain:.0f} rounds per worker" if gain > 0 else "no number of rounds: compiled is not faster "
             "at this ratio"))


if __name__ == "__main__":
    main()
