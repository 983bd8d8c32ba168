"""Engine overhead vs a plain sequential PyTorch loop, measured in one run.

Two workloads, FedAvg, one local epoch, evaluation of the global model once
at the end:

* ``resnet``: 30 clients of 64 samples, 10 sampled per round, ResNet-18 at
  32 px, batch 32, SGD lr 0.01 with momentum;
* ``cross_device``: pfl-research's CIFAR10 cross-device benchmark, 1,000
  clients of 50 images (32 px, 10 classes, random pixels), 50 sampled per
  round, batch 10 (5 steps per client), its 2-conv CNN (``model.arch:
  simple_cnn``), plain SGD lr 0.1 as its config has it.

Both sides do the same steps: sample clients, load the global weights, train
each client with a fresh SGD, average the weights by sample count, evaluate.
The plain loop runs in this process with ``--cpus`` threads; the engine on
``--workers`` workers sharing ``--cpus`` cores.  By default both train on one
core (one worker): the same kernels on both sides, so the ratio is the
engine's orchestration alone.  (Two threads in one process, on a machine
other work shares, can make each step ten times slower: OpenMP's threads
wait for each other; docs/results/cost.md.)  Plain and engine alternate,
shape by shape, ``--repeat`` times, so machine noise hits both alike.  Prints seconds
per round of each, the ratio engine / plain (target <= 1.05 on both shapes),
with and without each repetition's round 1 (fresh worker processes:
first-iteration kernel set-up the plain loop pays once), and the engine's
orchestration per client: (workers x round wall - the clients' own training
seconds) / clients, over the rounds between the first and the evaluated last
(with one worker: the round's wall time that is not a client training).

    python bench/engine_overhead.py [--shapes resnet,cross_device] [--rounds 4] [--workers 1] [--cpus 1] [--repeat 2]
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    label: str
    clients: int
    per_client: int
    per_round: int
    config: tuple[str, ...]  # overrides; the plain loop reads the same config


SHAPES = {
    "resnet": Shape("30 clients, 10/round, ResNet-18 32px, 64 samples/client, batch 32, 1 epoch", 30, 64, 10,
                    ("model.arch=resnet18", "training.batch_size=32", "training.lr=0.01")),
    "cross_device": Shape("pfl-research CIFAR10 cross-device: 1,000 clients, 50/round, simple_cnn 32px, "
                          "50 samples/client, batch 10, 1 epoch", 1000, 50, 50,
                          ("model.arch=simple_cnn", "training.batch_size=10", "training.lr=0.1",
                           "training.momentum=0.0", "training.weight_decay=0.0")),
}


def make_data(n_clients: int, per_client: int, res: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = n_clients * per_client + 64
    images = rng.integers(0, 256, size=(n, res, res, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n).astype(np.int64)
    return images, labels


def plain_loop(cfg, images, labels, clients, val_idx, rounds, threads):
    import time

    from rayfed_dg.models import build_backbone
    from rayfed_dg.seeding import Stream, sample_clients, seed_int, seed_torch, torch_generator

    t = cfg.training
    torch.set_num_threads(threads)
    torch.manual_seed(seed_int(t.seed, Stream.INIT))
    model = build_backbone(cfg.model.arch, 10)
    global_sd = {k: v.clone() for k, v in model.state_dict().items()}
    mean = torch.tensor(cfg.data.mean).view(1, 3, 1, 1)
    std = torch.tensor(cfg.data.std).view(1, 3, 1, 1)

    def tensors(idx):  # channels-last, as the worker's batches are: the same kernels on both sides
        x = torch.from_numpy(images[idx]).permute(0, 3, 1, 2).float().div_(255.0)
        x = x.contiguous(memory_format=torch.channels_last)
        return (x - mean) / std, torch.from_numpy(labels[idx])

    times = []
    for r in range(1, rounds + 1):
        t0 = time.perf_counter()
        sampled = sample_clients(t.seed, r, len(clients), t.clients_per_round)
        acc = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in global_sd.items()}
        wsum = 0.0
        for cid in sampled:
            model.load_state_dict(global_sd)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
            gen = torch_generator(t.seed, Stream.TRAIN, r, cid)
            seed_torch(seed_int(t.seed, Stream.TRAIN, r, cid), torch.device("cpu"))  # dropout's draws, as a worker
            idx = clients[cid][torch.randperm(len(clients[cid]), generator=gen).numpy()]
            for s in range(0, len(idx), t.batch_size):
                x, y = tensors(idx[s:s + t.batch_size])
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            w = float(len(clients[cid]))
            for k, v in model.state_dict().items():
                acc[k].add_(v, alpha=w)
            wsum += w
        global_sd = {k: (acc[k] / wsum).to(v.dtype) if v.is_floating_point() else (acc[k] / wsum).round().to(v.dtype)
                     for k, v in global_sd.items()}
        if r == rounds:
            model.load_state_dict(global_sd)
            model.eval()
            with torch.no_grad():
                x, y = tensors(val_idx)
                float((model(x).argmax(1) == y).float().mean())
        times.append(time.perf_counter() - t0)
    return times


def engine_loop(cfg, images, labels, clients, val_idx):
    """Seconds per round (the server's round wall time) and each round's
    clients' own training seconds, summed."""
    import ray

    from rayfed_dg.data.protocol import FederatedSplit
    from rayfed_dg.engine import run_federation

    split = FederatedSplit(target="t", clients=clients, client_domains=["d"] * len(clients),
                           val={"d": val_idx[:32]}, test={"t": val_idx[32:]})
    res = run_federation(cfg, split, ray.put(images), ray.put(labels), 10, progress=False)
    own = [0.0] * len(res.seconds_per_round)
    for c in res.clients:
        own[c["round"] - 1] += c["seconds"]
    return res.seconds_per_round, own


def _fmt(xs) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def report(name: str, shape: Shape, out: dict[str, list[float]], rounds: int, repeat: int, workers: int,
           cpus: float) -> None:
    plain, eng = float(np.mean(out["plain"])), float(np.mean(out["engine"]))
    print(f"[{name}] workload: {shape.label}, {rounds} rounds, x{repeat} interleaved")
    print(f"[{name}] plain loop   s/round: {plain:.3f}  (rounds: {_fmt(out['plain'])})")
    print(f"[{name}] engine ({workers} workers x {cpus:g} CPU) s/round: {eng:.3f}  (rounds: {_fmt(out['engine'])})")
    print(f"[{name}] ratio engine / plain: {eng / plain:.3f}  (target <= 1.05)")
    steady = [i for i in range(len(out["plain"])) if i % rounds]
    if steady:
        sp = float(np.mean([out["plain"][i] for i in steady]))
        se = float(np.mean([out["engine"][i] for i in steady]))
        print(f"[{name}] ratio without each repetition's round 1: {se / sp:.3f}")
    # between the first round (process warm-up) and the last (evaluation)
    mid = [i for i in range(len(out["engine"])) if 0 < i % rounds < rounds - 1] or list(range(len(out["engine"])))
    orch = [(workers * out["engine"][i] - out["own"][i]) / shape.per_round for i in mid]
    own = [out["own"][i] / shape.per_round for i in mid]
    print(f"[{name}] engine per client: own {1000 * float(np.mean(own)):.2f} ms, orchestration "
          f"{1000 * float(np.mean(orch)):.2f} ms (workers x wall - own, / clients; by round: "
          f"{_fmt(1000 * np.array(orch))})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="resnet,cross_device", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--cpus", type=int, default=1, help="cores for Ray, and the plain loop's threads")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved repetitions of plain, engine")
    args = ap.parse_args()
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {', '.join(unknown)}; use a comma-separated list of {', '.join(SHAPES)}")

    import ray

    from rayfed_dg.config import load_config

    cpus = args.cpus / args.workers
    work = {}
    for name in names:
        s = SHAPES[name]
        cfg = load_config(None, [
            *s.config, "data.resolution=32", "training.local_epochs=1", f"training.rounds={args.rounds}",
            f"training.clients_per_round={s.per_round}", "evaluation.every=0", f"engine.num_workers={args.workers}",
            f"engine.num_cpus_per_worker={cpus}", "output.save_best_checkpoint=false"])
        images, labels = make_data(s.clients, s.per_client, 32)
        clients = [np.arange(i * s.per_client, (i + 1) * s.per_client) for i in range(s.clients)]
        work[name] = (cfg, images, labels, clients, np.arange(s.clients * s.per_client, len(labels)))
    # Ray starts its workers at niceness 15 unless told otherwise; the plain loop runs here at the driver's.
    # On a loaded machine that alone made the engine's side slower (rayfed-dg's own init_ray sets
    # engine.worker_niceness, 0 by default): both sides run at the same niceness
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             _system_config={"worker_niceness": os.nice(0)})
    out = {n: {"plain": [], "engine": [], "own": []} for n in names}
    for _ in range(args.repeat):  # interleaved, so machine noise hits both sides alike
        for name in names:
            cfg, images, labels, clients, val_idx = work[name]
            out[name]["plain"] += plain_loop(cfg, images, labels, clients, val_idx, args.rounds, args.cpus)
            wall, own = engine_loop(cfg, images, labels, clients, val_idx)
            out[name]["engine"] += wall
            out[name]["own"] += own
    ray.shutdown()
    for name in names:
        report(name, SHAPES[name], out[name], args.rounds, args.repeat, args.workers, cpus)


if __name__ == "__main__":
    main()
