"""The exact fold against a float64 ``add_``, per value, measured in one run.

Folds ResNet-18-shaped uploads (the model's state dict, 11.2 M values, each
a fresh random perturbation of the global model, weight a sample count) into

* the engine's exact fixed-point sum (``FixedSum.add`` in the round's window,
  ``engine/aggregation/exact.py``), as a worker folds a client's upload;
* a float64 accumulator with ``acc.add_(v, alpha=w)`` per tensor, as a plain
  loop sums a round (the baseline of the target: at most 1.5x);
* the same ``add_`` in chunks of the fold's size, which on a CPU stays in
  cache (the strictest baseline: it beats the plain per-tensor ``add_``);

alternating, ``--repeat`` times, and prints ns per value (the fastest repeat
and the median), the ratios, the
partial's bytes per value (``pack``), and the time to pack a partial and to
merge one on the server, per value.  ``--device cuda`` folds on the GPU.

    python bench/fold_cost.py [--repeat 7] [--threads 1] [--device cpu|cuda] [--arch resnet18]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _interleaved(fns: dict, repeat: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds of each of ``fns`` (called with the pass number), interleaved ``repeat`` times after one untimed
    pass (it allocates)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeat + 1):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn(i)
            _sync(device)
            if i:
                times[name].append(time.perf_counter() - t0)
    return times


def _report(times: dict[str, list[float]], n: int) -> None:
    # the fastest of the repeats: what each costs when nothing else takes the core (a shared machine only adds)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in best:
        print(f"  {k:14s} {1e9 * best[k] / n:6.2f} ns/value fastest, {1e9 * med[k] / n:6.2f} median")
    print(f"  fold / add_          {best['fold'] / best['add_']:.2f} fastest, {med['fold'] / med['add_']:.2f} median "
          "(target <= 1.5)")
    print(f"  fold / add_ chunked  {best['fold'] / best['add_ chunked']:.2f} fastest, "
          f"{med['fold'] / med['add_ chunked']:.2f} median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--arch", default="resnet18")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no GPU available: --device cuda needs one")
        return
    torch.set_num_threads(args.threads)
    from rayfed_dg.engine.aggregation.exact import CHUNK, FixedSum, windows
    from rayfed_dg.models import build_backbone

    torch.manual_seed(0)
    x_t = {k: v.to(device) for k, v in build_backbone(args.arch, 10).state_dict().items()
           if v.is_floating_point()}
    n = sum(v.numel() for v in x_t.values())
    uploads = [{k: v + 0.01 * torch.randn_like(v) for k, v in x_t.items()} for _ in range(2)]
    w = 64.0
    win = windows({k: v.cpu().numpy() for k, v in x_t.items()}, [w])
    fixed, acc = FixedSum(win), {k: torch.zeros_like(v, dtype=torch.float64) for k, v in x_t.items()}

    def fold(i: int) -> None:
        fixed.add(w, uploads[i % 2])

    def add(i: int) -> None:
        for k, v in uploads[i % 2].items():
            acc[k].add_(v, alpha=w)

    def add_chunked(i: int) -> None:
        for k, v in uploads[i % 2].items():
            a, f = acc[k].view(-1), v.reshape(-1)
            step = f.numel() if device.type != "cpu" else CHUNK
            for lo in range(0, f.numel(), step):
                a[lo:lo + step].add_(f[lo:lo + step], alpha=w)

    times = _interleaved({"fold": fold, "add_": add, "add_ chunked": add_chunked}, args.repeat, device)
    print(f"{args.arch} uploads, {n:,} values, device {device}, {args.threads} thread(s), {args.repeat} repeats "
          "interleaved")
    _report(times, n)
    t0 = time.perf_counter()
    packed = fixed.pack()
    t1 = time.perf_counter()
    server = FixedSum(win)
    server.merge(packed)
    t2 = time.perf_counter()
    print(f"  partial: {packed.nbytes / n:.2f} bytes/value ({len(packed.cells)} accumulators for "
          f"{len(x_t)} tensors); pack {1e9 * (t1 - t0) / n:.2f} ns/value, server merge {1e9 * (t2 - t1) / n:.2f} "
          f"ns/value")
    assert all(np.isfinite(p).all() for p in packed.pieces)


if __name__ == "__main__":
    main()
