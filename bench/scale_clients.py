"""FedAvg with 30 vs 1,000 clients: the same 10 clients per round, the same work.

Clients are virtual, so a federation of 1,000 clients should cost no more
actors, memory or time per round than one of 30.  Both runs train 10
sampled clients of 64 samples each per round (batch 32, one local epoch, the
32 px conv net), 5 rounds, with the same worker pool.  To keep the dataset
itself out of the comparison, the 1,000 clients index the same 30 blocks of
64 images (client i holds block i mod 30).  Peak RSS sums the driver and
every process below it (Ray's raylet, GCS, server and worker actors),
sampled every 50 ms.

    python bench/scale_clients.py [--rounds 5] [--model convnet|resnet18]
"""
from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import psutil


def tree_rss() -> int:
    me = psutil.Process()
    total = me.memory_info().rss
    for p in me.children(recursive=True):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class PeakRSS:
    def __init__(self):
        self.peak, self._stop = 0, threading.Event()

    def __enter__(self):
        def loop():
            while not self._stop.is_set():
                self.peak = max(self.peak, tree_rss())
                time.sleep(0.05)
        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def run(n_clients: int, rounds: int, arch: str) -> tuple[float, int]:
    import ray

    from rayfed_dg.config import load_config
    from rayfed_dg.data.protocol import FederatedSplit
    from rayfed_dg.engine import run_federation

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (30 * 64 + 64, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, len(images)).astype(np.int64)
    clients = [np.arange((i % 30) * 64, (i % 30 + 1) * 64) for i in range(n_clients)]
    split = FederatedSplit("t", clients, ["d"] * n_clients, {"d": np.arange(1920, 1952)}, {"t": np.arange(1952, 1984)})
    cfg = load_config(None, [f"model.arch={arch}", "training.clients_per_round=10", f"training.rounds={rounds}",
                             "training.batch_size=32", "evaluation.every=0", "engine.num_workers=2",
                             "engine.num_cpus_per_worker=1"])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        with PeakRSS() as peak:
            res = run_federation(cfg, split, ray.put(images), ray.put(labels), 10, progress=False)
    finally:
        ray.shutdown()
    return float(np.mean(res.seconds_per_round)), peak.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="convnet")
    args = ap.parse_args()
    out = {n: run(n, args.rounds, args.model) for n in (30, 1000)}
    for n, (sec, rss) in out.items():
        print(f"{n:5d} clients: {sec:.3f} s/round, peak RSS {rss / 2**20:.0f} MiB (driver + Ray processes)")
    print(f"ratio 1000/30: time {out[1000][0] / out[30][0]:.3f}, memory {out[1000][1] / out[30][1]:.3f} "
          "(targets <= 1.2)")


if __name__ == "__main__":
    main()
