"""A soak: 10^5 clients with state (FedBN), the device model on, FedBuff, 500 server updates.

Does anything grow with the updates that should not?  Per update it records
the server actor's RSS, the wall seconds since the previous update, the
client store's bytes in memory and in its spill file and the clients it
holds, and per checkpoint the ``.pt``'s bytes and its piece's (the states
changed since the previous checkpoint).  It prints each figure's mean over
the last 100 updates over its mean over the first 100 (target <= 1.1).  The
spill file must grow with the clients it holds (each touched client's state
lives somewhere), so its figure is bytes per spilled client; the piece is
per client trained since the previous checkpoint.

Clients index 30 shared blocks of 64 random images (client i holds block
i mod 30), so the split is small whatever the population; the conv net is
8 wide, one local step of batch 8; the devices have lognormal speeds,
Markov availability and 10 % dropout; FedBuff trains 100 at once and
updates every 10 arrivals; an evaluation every 50 updates (with FedBN's own
models, a seeded sample of ``evaluation.personal_clients``); a checkpoint
every 10 updates; a store budget of 4 MiB (``--budget-mb``: below what the
run's states take, the store spills).

    python bench/soak.py [--clients 100000] [--updates 500] [--concurrency 100] [--budget-mb 4]
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from state_store import block_population  # bench/: the same population of 30 shared blocks

BUDGET_MB = 4
CHECKPOINT_EVERY = 10


def soak(n_clients: int, updates: int, concurrency: int, budget_mb: float = BUDGET_MB) -> list[dict]:
    import ray

    from rayfed_dg.config import load_config
    from rayfed_dg.engine import run_federation
    from rayfed_dg.engine.running.host import EngineHost
    from rayfed_dg.engine.store.clientstore import piece_name

    images, labels, split = block_population(n_clients)
    cfg = load_config(None, [
        "method.name=fedbn", "model.width=8", "training.local_steps=1", "training.batch_size=8",
        f"training.rounds={updates}", "server.mode=fedbuff", f"server.concurrency={concurrency}",
        "server.buffer_size=10", "devices.enabled=true", "devices.speed=lognormal", "devices.availability=markov",
        "devices.mean_online_s=600", "devices.mean_offline_s=600", "devices.dropout=0.1", "evaluation.every=50",
        "engine.num_workers=2", "engine.num_cpus_per_worker=1", f"output.checkpoint_every={CHECKPOINT_EVERY}",
        "output.save_best_checkpoint=false", f"engine.client_state_memory_mb={budget_mb}"])
    run_dir = Path(tempfile.mkdtemp(prefix="rayfed-dg-soak-"))
    ckpt = run_dir / "checkpoints" / "t"
    host = EngineHost(cfg.engine, [ray.put(images), ray.put(labels)], 2)
    server = psutil.Process(ray.get(host.server.__ray_call__.remote(lambda self: os.getpid())))
    rows: list[dict] = []
    last = [time.perf_counter()]

    def on_round(out, res) -> None:
        now = time.perf_counter()
        mem, spill, held, spilled = ray.get(host.server.__ray_call__.remote(lambda self: (
            self.fed.store.memory_bytes, self.fed.store.spill_bytes, len(self.fed.store.clients()),
            len(self.fed.store.clients()) - len(self.fed.store.in_memory()))))
        pt, piece = ckpt / f"round_{out.round:05d}.pt", ckpt / piece_name(out.round)
        rows.append({"update": out.round, "seconds": now - last[0], "rss": server.memory_info().rss, "mem": mem,
                     "spill": spill, "held": held, "spilled": spilled,
                     "pt": pt.stat().st_size if pt.exists() else None,
                     "piece": piece.stat().st_size if piece.exists() else None,
                     "trained": sum(not c.dropped for c in out.clients)})
        last[0] = time.perf_counter()  # the callback's own reads are not the update's time

    try:
        run_federation(cfg, split, None, None, 10, run_dir, progress=False, on_round=on_round, host=host)
    finally:
        host.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows


def ratios(rows: list[dict], window: int = 100) -> dict[str, float]:
    """Each figure's mean over the last ``window`` updates over its mean over the first."""
    def per(r: dict, key: str) -> float | None:
        if key == "spill per spilled client":
            return r["spill"] / r["spilled"] if r["spilled"] else None
        if key == "piece per trained client":
            return None if r["piece"] is None else r["piece"] / r["since"]
        return r[key]

    since = 0
    for r in rows:  # clients trained since the previous checkpoint
        since += r["trained"]
        r["since"] = since
        if r["pt"] is not None:
            since = 0
    out = {}
    for key in ("rss", "seconds", "pt", "piece per trained client", "spill per spilled client", "mem"):
        first = [v for r in rows[:window] if (v := per(r, key)) is not None]
        late = [v for r in rows[-window:] if (v := per(r, key)) is not None]
        out[key] = float(np.mean(late) / np.mean(first)) if first and late else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100_000)
    ap.add_argument("--updates", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--budget-mb", type=float, default=BUDGET_MB, help="the store's memory budget (spills past it)")
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    t0 = time.perf_counter()
    try:
        rows = soak(args.clients, args.updates, args.concurrency, args.budget_mb)
    finally:
        ray.shutdown()
    mib = 2**20
    print(f"fedbn, {args.clients:,} clients, FedBuff K=10 of {args.concurrency} at once, {args.updates} updates, "
          f"devices on, a checkpoint every {CHECKPOINT_EVERY}, store budget {args.budget_mb:g} MiB: "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"{'update':>6} {'s/update':>8} {'server RSS':>10} {'store mem':>9} {'spill':>9} {'held':>6} {'.pt':>9} "
          f"{'piece':>9}")
    for r in rows[::50] + rows[-1:]:
        pt = "" if r["pt"] is None else f"{r['pt'] / 1024:.1f} KiB"
        piece = "" if r["piece"] is None else f"{r['piece'] / 1024:.1f} KiB"
        print(f"{r['update']:6d} {r['seconds']:8.3f} {r['rss'] / mib:6.0f} MiB {r['mem'] / mib:5.2f} MiB "
              f"{r['spill'] / mib:5.2f} MiB {r['held']:6d} {pt:>9} {piece:>9}")
    print("last 100 updates / first 100 (target <= 1.1): " +
          ", ".join(f"{k} {v:.3f}" for k, v in ratios(rows).items()))


if __name__ == "__main__":
    main()
