"""The server's inbox per round, before and after workers fold their clients' uploads, measured in one run.

Workload: FedAvg, ResNet-18 at 32 px on random data, 50 clients
a round, 2 workers, one local step of batch 8.  One round's clients train
twice on the same worker actors from the same global model:

* before: every client's whole upload travels to the server (``ClientTask.fold``
  None, the path the engine keeps for a method that reads uploads), which
  folds it with a float64 ``add_`` per tensor (the plain fold, the
  baseline, called here directly; the engine does not use it).  The
  server-side fold of the same uploads (``Reducer.add``, the exact fixed-point sum) is
  timed beside it;
* after: each worker folds the uploads of its clients into one partial sum
  (``Fold``); the server receives the small per-client updates (stats, sizes)
  and one partial per worker, and merges the partials.

Bytes received: the pickled size (protocol 5, out-of-band buffers counted) of
every object the server gets with ``ray.get``.  Prints both, their ratio, the
server's folding seconds, the per-client cost of the worker's fold on this
CPU (the exact sum vs the plain float64 add), and checks that both paths give the same
average bit for bit.

    python bench/server_inbox.py [--clients 50] [--workers 2]
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import time
import warnings

import numpy as np
import torch


def wire_bytes(obj) -> int:
    """Bytes of ``obj`` as Ray ships it: the pickle plus its out-of-band buffers."""
    bufs: list = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    return len(head) + sum(b.raw().nbytes for b in bufs)


def plain_fold(acc: dict[str, torch.Tensor], update: dict[str, np.ndarray], w: float) -> None:
    """The plain fold: float64 ``add_`` in place, tensor by tensor, in arrival order (no binning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, v in update.items():
            t = torch.as_tensor(np.asarray(v))
            if k not in acc:
                acc[k] = torch.zeros(t.shape, dtype=torch.float64)
            acc[k].add_(t, alpha=w)


def fold_cost_ms(state: dict[str, torch.Tensor], reps: int = 5) -> tuple[float, float]:
    """Median ms to fold one ResNet-18 upload: the exact fixed-point sum, the plain float64 add."""
    from rayfed_dg.engine.aggregation.exact import FixedSum, windows

    b = FixedSum(windows({k: v.numpy() for k, v in state.items()}, [37.0]))
    acc = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in state.items()}
    exact, plain = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.add(37.0, state)
        t1 = time.perf_counter()
        for k, v in state.items():
            acc[k].add_(v, alpha=37.0)
        plain.append(time.perf_counter() - t1)
        exact.append(t1 - t0)
    return statistics.median(exact) * 1e3, statistics.median(plain) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    import ray

    from rayfed_dg.config import load_config
    from rayfed_dg.data.protocol import FederatedSplit
    from rayfed_dg.engine.rounds.federation import Federation
    from rayfed_dg.engine.running.host import EngineHost
    from rayfed_dg.engine.store.records import Fold
    from rayfed_dg.engine.workers.pool import WorkerPool

    n, per = args.clients, 16
    cfg = load_config(None, [
        "model.arch=resnet18", "data.resolution=32", "training.batch_size=8", "training.local_steps=1",
        f"training.clients_per_round={n}", "training.rounds=1", f"engine.num_workers={args.workers}",
        f"engine.num_cpus_per_worker={2 / args.workers:g}", "output.save_best_checkpoint=false"])
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n * per + 64, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=len(images)).astype(np.int64)
    clients = [np.arange(i * per, (i + 1) * per) for i in range(n)]
    split = FederatedSplit(target="t", clients=clients, client_domains=["d"] * n,
                           val={"d": np.arange(n * per, n * per + 32)},
                           test={"t": np.arange(n * per + 32, len(images))})
    torch.set_num_threads(1)  # as the server actor (num_cpus 0: Ray gives it one OpenMP thread)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    host = EngineHost(cfg.engine, [ray.put(images), ray.put(labels)], args.workers)
    try:
        host.open(cfg, split, 10)  # registers federation 1 with the workers' data source
        fed = Federation(cfg, split, 10, host.federations)  # this process plays the server
        pool = WorkerPool(host.workers, 0)
        global_ref = ray.put(fed.global_state)
        sampled = fed.sample(1)
        cost = {c: len(clients[c]) for c in sampled}

        # ---- before: whole uploads, folded by the server as they arrive
        whole, acc = fed.reducer(sampled), {}
        before = {"bytes": 0, "plain": 0.0, "exact": 0.0}

        def on_whole(cid, upd):
            before["bytes"] += wire_bytes(upd)
            t0 = time.perf_counter()
            plain_fold(acc, upd.update, whole.weights[cid])
            t1 = time.perf_counter()
            whole.add(cid, upd.update)
            before["plain"] += t1 - t0
            before["exact"] += time.perf_counter() - t1

        t0 = time.perf_counter()
        pool.map(sampled, lambda w, cid, a: w.train_in.remote(fed.id, fed.task(1, cid, {}, a), global_ref),
                 on_whole, cost)
        wall_before = time.perf_counter() - t0

        # ---- after: each worker folds its clients; one partial per worker
        folded = fed.reducer(sampled)
        after = {"bytes": 0, "merge": 0.0}
        on_small = lambda cid, upd: after.__setitem__("bytes", after["bytes"] + wire_bytes(upd))  # noqa: E731
        t0 = time.perf_counter()
        fold = lambda cid: Fold(fed.id, 1, 0, folded.weights[cid], folded.window)  # noqa: E731
        pool.map(sampled, lambda w, cid, a: w.train_in.remote(fed.id, fed.task(1, cid, {}, a, fold(cid)), global_ref),
                 on_small, cost)
        parts = [p for p in pool.ask_each(lambda w: w.take_partial.remote(fed.id, 1, 0)) if p is not None]
        wall_after = time.perf_counter() - t0
        after["bytes"] += sum(wire_bytes(p) for p in parts)
        t1 = time.perf_counter()
        for p in parts:
            folded.add_partial(p)
        after["merge"] = time.perf_counter() - t1
        a, b = whole.result(fed.global_state), folded.result(fed.global_state)
        same = all(np.array_equal(a[k], b[k]) for k in a)
        model = fed.method.build_model(10)
        state = {k: v.detach() for k, v in model.state_dict().items()}
    finally:
        host.close()
        ray.shutdown()
    exact_ms, plain_ms = fold_cost_ms(state)
    params = sum(v.numel() for v in state.values())
    mb = lambda x: x / 1e6  # noqa: E731
    print(f"workload: FedAvg, ResNet-18 ({params / 1e6:.1f} M values), 32 px, {n} clients a round, "
          f"{args.workers} workers, 1 local step of batch 8")
    print(f"before: server received {mb(before['bytes']):.1f} MB in {n} whole uploads; folding took "
          f"{before['plain']:.2f} s (plain float64 add_, called directly) / {before['exact']:.2f} s (exact, on the "
          f"server); clients' phase {wall_before:.1f} s")
    print(f"after:  server received {mb(after['bytes']):.1f} MB: {n} updates without tensors + {len(parts)} "
          f"partial sums ({', '.join(f'{len(p.clients)} clients' for p in parts)}); merging took "
          f"{after['merge']:.2f} s; clients' phase {wall_after:.1f} s")
    print(f"bytes ratio after / before: {after['bytes'] / before['bytes']:.3f}  (workers / clients = "
          f"{args.workers / n:.3f}; a partial carries 8 bytes a value, an upload 4)")
    print(f"fold per client on a worker, this CPU, 1 thread: exact {exact_ms:.0f} ms, plain float64 add_ "
          f"{plain_ms:.0f} ms (x{exact_ms / plain_ms:.2f})")
    print(f"same average, bit for bit: {same}")


if __name__ == "__main__":
    main()
