"""CCST's costs: stylization throughput, one-off setup time, bytes shared, a montage.

    python bench/ccst_cost.py [--dataset embedded_digits|digits|pacs] [--root DIR] [--res 64] [--k 3]
                              [--montage PATH] [--montage-only]

Runs the CCST data stage (overall style, K styles per image) for one
leave-one-domain-out split through the engine on local Ray, twice (the second
run reads the stylized images from the cache), and prints images per second,
setup seconds, and the style bytes shared against one round of FedAvg's model
bytes.  Writes a montage: a block of columns per source client, its original
images on top, then the same images in each other client's overall style.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="embedded_digits")
    ap.add_argument("--root", default=None)
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--style", default="overall")
    ap.add_argument("--target", default=None)
    ap.add_argument("--montage", default="runs/ccst_montage.png")
    ap.add_argument("--montage-only", action="store_true", help="skip the timed setup runs")
    ap.add_argument("--images", type=int, default=4, help="images per client in the montage")
    args = ap.parse_args()

    from rayfed_dg.config import load_config
    from rayfed_dg.data import leave_one_domain_out, load_dataset

    ds = load_dataset(args.dataset, args.root, args.res)
    target = args.target or ds.domain_names[-1]
    split = leave_one_domain_out(ds, target, 0.1, 0)
    cache = tempfile.mkdtemp(prefix="ccst-cache-")
    cfg = load_config(None, [f"stages.ccst.k={args.k}", f"stages.ccst.style={args.style}",
                             f"stages.ccst.cache_dir={cache}", "training.rounds=1", "training.local_steps=1",
                             "evaluation.every=0", f"data.resolution={args.res}", "model.width=16",
                             "engine.num_cpus_per_worker=1", "output.save_best_checkpoint=false"])
    if not args.montage_only:
        timed_setup(args, cfg, ds, split, target)
    montage(args, cfg, ds, split)


def timed_setup(args, cfg, ds, split, target) -> None:
    import ray

    from rayfed_dg.engine.running.run import run_federation

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    refs = ray.put(ds.images), ray.put(ds.labels)
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        res = run_federation(cfg, split, *refs, ds.num_classes, progress=False)
        runs.append((res, time.perf_counter() - t0))
    ray.shutdown()
    info = runs[0][0].setup_info["ccst"]
    stylized = info["images_stylized"]
    stylize_s = info["seconds_total"] - info["seconds_style"]
    up = sum(r["bytes"] for r in runs[0][0].ledger if r["group"] == "payload:ccst_style")
    down = sum(r["bytes"] for r in runs[0][0].ledger if r["group"] == "payload:ccst_bank")
    model_down = sum(r["bytes"] for r in runs[0][0].ledger if r["round"] == 1 and r["direction"] == "down")
    n_train = sum(len(c) for c in split.clients)
    print(f"{args.dataset} {args.res}px, target {target}, {split.num_clients} clients, {n_train} training images, "
          f"K={args.k}, style={args.style}, backend ghiasi (2 workers x 1 CPU)")
    print(f"setup, first run : {info['seconds_total']:.1f} s (styles {info['seconds_style']:.1f} s, "
          f"stylizing {stylized} images {stylize_s:.1f} s = {stylized / max(stylize_s, 1e-9):.0f} images/s)")
    print(f"setup, second run: {runs[1][0].setup_info['ccst']['seconds_total']:.1f} s "
          f"(cache hits {runs[1][0].setup_info['ccst']['hits']}/{split.num_clients})")
    print(f"bytes shared once: styles up {up:,}, bank down {down:,}; one FedAvg round sends {model_down:,} down "
          f"(CCST adds {100 * (up + down) / model_down:.4f}% of one round's download, once)")



def montage(args, cfg, ds, split) -> None:
    """Each source client's first images, then restyled with every other client's overall style."""
    from PIL import Image

    from rayfed_dg.models.styletransfer import GhiasiBackend

    be = GhiasiBackend(threads=2, work_size=cfg.stage_params("ccst").work_size)
    rng = np.random.default_rng(0)
    rows = []
    styles = [be.style_of(ds.images[c], "overall", 1, rng)[0] for c in split.clients]
    for i, c in enumerate(split.clients):
        img = ds.images[c[:args.images]]
        row = [np.concatenate(list(img), 1)]
        for j, s in enumerate(styles):
            if j != i:
                row.append(np.concatenate(list(be.stylize(img, s)), 1))
        rows.append(np.concatenate(row, 0))
    m = np.concatenate(rows, 1)
    Path(args.montage).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(m).resize((m.shape[1] * 2, m.shape[0] * 2), Image.NEAREST).save(args.montage)
    print(f"montage {args.montage}: columns = source clients ({', '.join(split.client_domains)}), "
          f"rows = original, then each other client's style; {args.images} images each")


if __name__ == "__main__":
    main()
