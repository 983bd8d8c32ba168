"""Client-batched training (``engine.client_batching``) vs the one-by-one
engine, measured in one run.

The cross-device shape of bench/engine_overhead.py: pfl-research's CIFAR10
benchmark, 1,000 clients of 50 random 32 px images, 50 sampled a round,
batch 10 (5 steps a client), simple_cnn (with its two dropouts), plain SGD
lr 0.1.  Both sides run the engine (``run_federation``) on one worker with
one CPU thread, alternating ``--repeat`` times so machine noise hits both
alike; batching stacks ``--group`` clients a step.  Prints seconds per
round of each (without each repetition's round 1: worker start-up), and
the ratio batched / one by one.  Then the same on one CUDA GPU (one worker
given the GPU), or a line saying there is none.

    python bench/client_batching.py [--rounds 3] [--repeat 2] [--group 16]
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from engine_overhead import SHAPES, engine_loop, make_data


def configs(rounds: int, group: int, cuda: bool):
    from rayfed_dg.config import load_config

    s = SHAPES["cross_device"]
    dev = ["engine.device=cuda", "engine.num_gpus_per_worker=1"] if cuda else []
    base = [*s.config, "data.resolution=32", "training.local_epochs=1", f"training.rounds={rounds}",
            f"training.clients_per_round={s.per_round}", "evaluation.every=0", "engine.num_workers=1",
            "engine.num_cpus_per_worker=1", "output.save_best_checkpoint=false", *dev]
    return {"one by one": load_config(None, base),
            "batched": load_config(None, [*base, "engine.client_batching=true", f"engine.client_group_size={group}"])}


def measure(label: str, cfgs: dict, repeat: int, rounds: int) -> None:
    s = SHAPES["cross_device"]
    images, labels = make_data(s.clients, s.per_client, 32)
    clients = [np.arange(i * s.per_client, (i + 1) * s.per_client) for i in range(s.clients)]
    val_idx = np.arange(s.clients * s.per_client, len(labels))
    out: dict[str, list[float]] = {k: [] for k in cfgs}
    for _ in range(repeat):  # interleaved
        for name, cfg in cfgs.items():
            wall, _ = engine_loop(cfg, images, labels, clients, val_idx)
            out[name] += wall[1:] if rounds > 1 else wall
    mean = {k: float(np.mean(v)) for k, v in out.items()}
    print(f"[{label}] {s.label}; {rounds} rounds x{repeat} interleaved, round 1 of each left out")
    for k, v in out.items():
        print(f"[{label}] {k:>10} s/round: {mean[k]:.3f}  (rounds: {', '.join(f'{x:.2f}' for x in v)})")
    print(f"[{label}] ratio batched / one by one: {mean['batched'] / mean['one by one']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--group", type=int, default=16, help="engine.client_group_size")
    args = ap.parse_args()

    import ray

    cuda = torch.cuda.is_available()
    ray.init(num_cpus=1, num_gpus=1 if cuda else 0, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False, _system_config={"worker_niceness": os.nice(0)})
    measure(f"cpu, group {args.group}", configs(args.rounds, args.group, False), args.repeat, args.rounds)
    if cuda:
        measure(f"cuda {torch.cuda.get_device_name(0)}, group {args.group}", configs(args.rounds, args.group, True),
                args.repeat, args.rounds)
    else:
        print("[cuda] skipped: torch sees no CUDA device here")
    ray.shutdown()


if __name__ == "__main__":
    main()
