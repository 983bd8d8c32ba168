"""The quickstart's federations side by side against one after another, in
one run.

``configs/quickstart.yaml`` (2 rows x 4 targets: 8 federations, 8 rounds)
with ``engine.concurrent_federations: 1`` and with ``auto``, each through
the run service as ``rayfed-dg run`` runs it, on this machine's local Ray.
Prints what the concurrency rule chose (slots, width, order), each run's
wall time, how many federations ran at once, the ratio, and asserts the two
tables (metrics, ledger, clients of every row; selected rounds and
accuracies) are the same.

    python bench/concurrent_federations.py [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=[], help="extra config overrides, e.g. training.rounds=2")
    args = ap.parse_args()

    import ray

    from rayfed_dg.config import load_config
    from rayfed_dg.engine.running import schedule
    from rayfed_dg.engine.running.experiment import plan_experiment, worker_slots
    from rayfed_dg.engine.running.plan import clients_per_round, load_data, resolve_targets
    from rayfed_dg.engine.running.run import format_table
    from rayfed_dg.engine.running.service import RunRequest, execute_run
    from rayfed_dg.engine.store.records import TABLES
    from rayfed_dg.engine.store.rundir import RunDir

    config = "configs/quickstart.yaml"
    cfg = load_config(config, args.set)
    ds = load_data(cfg)
    exp = plan_experiment([(None, cfg)], ds, resolve_targets(ds, None))  # starts local Ray
    jobs = [schedule.fed_job((r.label, s.target), r.cfg, s) for r in exp.rows for s in r.splits]
    slots = worker_slots(cfg.engine, max(clients_per_round(r.cfg, s) for r in exp.rows for s in r.splits))
    plan = schedule.plan(jobs, slots)
    res = ray.cluster_resources()
    print(f"cluster: {res.get('CPU', 0):g} CPU / {res.get('GPU', 0):g} GPU; {len(jobs)} federations; {slots} worker "
          f"slots; auto starts each on {sorted(set(plan.width.values()))} worker(s), in the order "
          f"{', '.join('/'.join(k) for k in plan.order)}")

    walls, out = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-concurrent-") as tmp:
        for conc in ("1", "auto"):
            t0 = time.perf_counter()
            o = execute_run(RunRequest(config=config, run_dir=str(Path(tmp) / conc), no_progress=True,
                                       overrides=[*args.set, f"engine.concurrent_federations={conc}"]))
            walls[conc] = time.perf_counter() - t0
            summaries = o.by_seed[None]
            places = [t["placement"] for s in summaries.values() for t in s["targets"].values()]
            spans = sorted((p["started_s"], p["ended_s"]) for p in places)
            most = max(sum(a <= s < b for a, b in spans) for s, _ in spans)
            tables = {(label, name): [{k: v for k, v in r.items() if k != "seconds"}
                                      for r in RunDir(Path(tmp) / conc / label).read_rows(name)]
                      for label in summaries for name in TABLES}
            out[conc] = (format_table(summaries), tables)
            print(f"concurrent_federations={conc}: {walls[conc]:.1f} s wall, at most {most} at once, workers per "
                  f"federation {sorted(p['workers'] for p in places)}")
    assert out["1"][0] == out["auto"][0], "the tables differ"
    assert out["1"][1] == out["auto"][1], "the metrics, ledger or clients tables differ"
    rows = sum(len(v) for (_, name), v in out["1"][1].items() if name == "metrics")
    print(out["auto"][0])
    print(f"same table, and the same metrics/ledger/clients rows ({rows} metric rows); wall 1 / auto = "
          f"{walls['1'] / walls['auto']:.2f}x")


if __name__ == "__main__":
    main()
