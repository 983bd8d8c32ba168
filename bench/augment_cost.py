"""Seconds per local step with ``data.augment: domainbed`` vs ``flip``, in one run.

Both modes train the same backbone through the engine's own client code
(``ClientRunner``, no Ray) on the embedded digits, decoded as each mode
decodes them (``flip``: at the resolution; ``domainbed``: at 8/7 of it, then
cropped back): a timed call is one client's local update of ``--steps``
steps; the modes are interleaved over ``--repeat`` repetitions so machine
noise hits both alike, and the medians are compared.  The batch preparation
alone (uint8 -> device tensor, augmentation, normalisation) is timed the
same way.

    python bench/augment_cost.py [--arch convnet] [--width 32] [--res 32] [--batch 32] [--steps 10]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="convnet")
    ap.add_argument("--width", type=int, default=32, help="convnet channels")
    ap.add_argument("--res", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker's num_cpus_per_worker)")
    args = ap.parse_args()

    from rayfed_dg.config import load_config
    from rayfed_dg.data import load_dataset
    from rayfed_dg.engine import ClientRunner
    from rayfed_dg.engine.workers.worker import to_numpy_state

    modes = ["flip", "domainbed"]
    runners, idx = {}, np.arange(args.batch * args.steps)
    for mode in modes:
        cfg = load_config(None, [f"model.arch={args.arch}", f"model.width={args.width}", f"data.resolution={args.res}",
                                 f"data.augment={mode}", f"training.batch_size={args.batch}",
                                 f"training.local_steps={args.steps}", f"engine.num_cpus_per_worker={args.threads}"])
        ds = load_dataset("embedded_digits", None, cfg.data.decode_size)
        r = ClientRunner(cfg, ds.images, ds.labels, ds.num_classes, 3)
        state = to_numpy_state(r.model.state_dict(), r.model.state_dict().keys())
        runners[mode] = (r, state, ds)
        r.run_client(0, 1, idx, state)  # warm-up
    step: dict[str, list[float]] = {m: [] for m in modes}
    prep: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.repeat):
        for mode in modes:
            r, state, ds = runners[mode]
            t0 = time.perf_counter()
            r.run_client(0, 2 + rep, idx, state)
            step[mode].append((time.perf_counter() - t0) / args.steps)
            gen = torch.Generator().manual_seed(rep)
            t0 = time.perf_counter()
            for s in range(args.steps):
                b = idx[s * args.batch:(s + 1) * args.batch]
                r._to_tensors(ds.images[b], ds.labels[b], gen)
            prep[mode].append((time.perf_counter() - t0) / args.steps)
    med = {m: (statistics.median(step[m]), statistics.median(prep[m])) for m in modes}
    r0 = runners["domainbed"][0]
    print(f"{args.arch}" + (f" width {args.width}" if args.arch == "convnet" else "") +
          f", {args.res} px (domainbed decoded at {r0.cfg.data.decode_size} px), batch {args.batch}, "
          f"{args.steps} steps x {args.repeat} interleaved repeats, {args.threads} thread(s); medians")
    for m in modes:
        print(f"  {m:10s} {1000 * med[m][0]:8.2f} ms per local step   {1000 * med[m][1]:7.2f} ms of it preparing "
              "the batch")
    print(f"  domainbed / flip: {med['domainbed'][0] / med['flip'][0]:.2f}x per step, "
          f"{med['domainbed'][1] / med['flip'][1]:.2f}x per batch preparation")


if __name__ == "__main__":
    main()
