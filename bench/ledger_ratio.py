"""Bytes up and down per round of each method vs FedAvg, from the ledger.

Runs two rounds of each method on the embedded data with the same backbone
(default ResNet-18) through the engine, reads what the communication ledger
recorded per client and direction in round 2 (what a method exchanges from
round 2 on, e.g. StableFDG's shared styles, is included), and prints the
ratios to FedAvg.  A method's data stages (``stages_needed``: ELCFS's
amplitude bank) run before round 1; their one-off bytes (round 0) are
printed apart, with their size in FedAvg rounds.

    python bench/ledger_ratio.py [--arch resnet18] [--methods gperxan fedbn ...]
"""
from __future__ import annotations

import argparse
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="resnet18")
    # the paper baselines; CSAC pre-trains one step in round 1 (its default is 1,800)
    ap.add_argument("--methods", nargs="*", default=["fedbn", "silobn", "gperxan", "rsc", "elcfs", "copa",
                                                      "csac:pretrain_steps=1", "dson"])
    args = ap.parse_args()

    import ray

    from rayfed_dg.config import EngineConfig, load_config
    from rayfed_dg.data import leave_one_domain_out, load_dataset
    from rayfed_dg.engine import run_federation
    from rayfed_dg.methods import get_method_class

    ds = load_dataset("embedded_digits", None, 32)
    split = leave_one_domain_out(ds, "mono", 0.2, 0)
    # workers at the niceness a run gives them (engine.worker_niceness), not Ray's 15
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             _system_config={"worker_niceness": EngineConfig().worker_niceness})
    refs = ray.put(ds.images), ray.put(ds.labels)
    totals = {}
    for spec in ["fedavg"] + args.methods:
        name, _, kv = spec.partition(":")
        sets = [f"method.{x}" for x in kv.split(",") if x]
        sets += [f"stages.{st}={{}}" for st in get_method_class(name).stages_needed]
        cfg = load_config(None, [f"model.arch={args.arch}", "training.rounds=2", "training.local_steps=1",
                                 "evaluation.every=0", f"method.name={name}", *sets])
        res = run_federation(cfg, split, *refs, ds.num_classes, progress=False)
        t = defaultdict(int)
        groups = defaultdict(int)
        setup = defaultdict(int)
        for row in res.ledger:
            if row["round"] == 2:
                t[row["direction"]] += row["bytes"]
                groups[(row["direction"], row["group"])] += row["bytes"]
            elif row["round"] == 0:  # data stages, once before round 1
                setup[(row["direction"], row["group"])] += row["bytes"]
        totals[spec] = (dict(t), dict(groups), dict(setup))
    ray.shutdown()
    base = totals["fedavg"][0]
    print(f"backbone {args.arch}; bytes of round 2 over 3 clients")
    for spec, (t, groups, setup) in totals.items():
        g = ", ".join(f"{d}:{k}={v:,}" for (d, k), v in sorted(groups.items()))
        print(f"{spec:28s} up {t['up']:>12,} ({t['up'] / base['up']:.4f}x)  down {t['down']:>12,} "
              f"({t['down'] / base['down']:.4f}x)  [{g}]")
        for (d, k), v in sorted(setup.items()):
            print(f"{'':28s} once before round 1: {d}:{k} = {v:,} bytes "
                  f"({v / base[d]:.4f} of a FedAvg round's {d}load)")


if __name__ == "__main__":
    main()
