"""A paper table on 8 and 64 GPUs: the engine's concurrency rule
(``rayfed_dg/engine/running/schedule.py``) replayed on measured per-federation costs,
makespan over the ideal (total work / GPUs; target at most 1.1).

Costs, by default, the pretrained PACS table of docs/results/pacs.md:
wall seconds per method and seed for its four targets, the two
ends of each recorded range taken as the two seeds, 8 rows (CCST with a warm
style cache), so 64 federations.  The config steps every client 12 x 32
images whatever its size, so a federation's wall is split evenly over its 4
targets, 5 rounds and 3 clients; one worker per GPU
(``engine.num_gpus_per_worker: 1``).  ``--runs DIR ...`` takes the costs from
run directories instead: each federation's clients table (every client's
training seconds, round by round; the mean per client over rounds).

    python bench/schedule_sim.py [--gpus 8 64] [--runs RUN_DIR ...]
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from rayfed_dg.engine.running.schedule import FedJob, simulate

# docs/results/pacs.md, the first "Wall per method and seed (four targets, ...)": (low, high) seconds
PACS_WALL = {"fedavg": (229, 231), "silobn": (236, 273), "fedbn": (242, 412), "stablefdg": (693, 948),
             "fedfda": (957, 964), "gperxan": (655, 695), "gperxan_stages3": (497, 515), "ccst": (548, 548)}
PACS_TARGETS = ("photo", "art_painting", "cartoon", "sketch")


def pacs_jobs(rounds: int = 5, clients: int = 3) -> list[FedJob]:
    jobs = []
    for method, walls in PACS_WALL.items():
        for seed, wall in enumerate(walls):
            per_client = wall / len(PACS_TARGETS) / rounds / clients
            jobs += [FedJob((seed, method, t), (per_client,) * clients, rounds) for t in PACS_TARGETS]
    return jobs


def run_dir_jobs(paths: list[str]) -> list[FedJob]:
    """Every (row folder, target) of the run directories as a federation,
    its clients' mean training seconds as their cost."""
    from rayfed_dg.engine.store.rundir import RunDir

    jobs = []
    for path in paths:
        for rd in [RunDir(d) for d in sorted({p.parent for p in Path(path).rglob("clients*")})]:
            if not rd.has_table("clients"):
                continue
            rows = rd.read_rows("clients")
            seconds: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
            rounds: dict[str, set[int]] = defaultdict(set)
            per_round: dict[tuple[str, int], int] = defaultdict(int)
            for r in rows:
                if r.get("seconds") is not None:
                    seconds[r["target"]][r["client"]].append(float(r["seconds"]))
                rounds[r["target"]].add(int(r["round"]))
                per_round[(r["target"], int(r["round"]))] += 1
            for target, by_client in seconds.items():
                k = max(n for (t, _), n in per_round.items() if t == target)
                means = sorted((sum(v) / len(v) for v in by_client.values()), reverse=True)
                cost = tuple(means[:k]) if k >= len(means) else (sum(means) / len(means),) * k
                jobs.append(FedJob((str(rd.path), target), cost, len(rounds[target])))
    if not jobs:
        raise SystemExit(f"schedule_sim: no clients tables under {' '.join(paths)}; give rayfed-dg run directories")
    return jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--runs", nargs="+", help="run directories to take the federations' costs from")
    args = ap.parse_args()
    jobs = run_dir_jobs(args.runs) if args.runs else pacs_jobs()
    src = ", ".join(args.runs) if args.runs else "docs/results/pacs.md's pretrained PACS table"
    print(f"{len(jobs)} federations from {src}; total work {sum(j.work for j in jobs):,.0f} worker-seconds")
    worst = 0.0
    for g in args.gpus:
        s = simulate(jobs, g)
        widths = sorted({w[0] for w in s.widths.values()})
        grown = sum(1 for w in s.widths.values() if w[-1] > w[0])
        print(f"{g:3d} GPUs: start width {widths}, at most {s.most_running} federations at once, {grown} grown "
              f"at the end; makespan {s.makespan:,.1f} s, ideal {s.ideal:,.1f} s, ratio {s.ratio:.3f}")
        for w in range(1, max(j.max_workers for j in jobs) + 1):
            alt = simulate(jobs, g, width=w).ratio
            print(f"          (every federation on {w} worker(s) instead: ratio {alt:.3f})")
        worst = max(worst, s.ratio)
    print(f"worst makespan / ideal: {worst:.3f} (target at most 1.1: {'met' if worst <= 1.1 else 'NOT met'})")


if __name__ == "__main__":
    main()
