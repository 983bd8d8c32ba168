"""The virtual clock against wall time on this machine.

1. ``rayfed-dg devices calibrate``'s measurement of the config below (the
   quickstart's digits at 32 px, a conv net 64 wide, batch 32, ``--workers``
   2):
   ``step_seconds`` and ``overhead_s``, every device this machine (speed 1).
2. A synchronous run on the clock: 8 Dirichlet clients (alpha 0.5: 2 to 9
   batches an epoch, ``--epochs`` 6), a client a worker each round, over-selection 1.5
   and a deadline at 1.2 x the median predicted training, so some rounds
   lose a client to it.
3. FedBuff on the clock: as many training at once as workers, K the same.

Per round (update) it compares what the clock predicts with what the run
measured: each trained client's training, sim_finish - sim_start against
its row's wall seconds (the worker's, from loading the global model to the
packed update), and the round's clients' phase, the longest predicted
training against the server's seconds from the first dispatch to the last
update in (``seconds_clients``: it also holds dispatch and transfer, which
the clock leaves out).  It prints each table and the mean absolute error
per round in % of the measured time (target <= 5 %), and what bounds that
error here (``report``): the same with the step refitted on the run, and the
spread of repeated identical trainings.

    python bench/clock_validation.py [--rounds 12] [--epochs 6] [--workers 2] [--skip-calibration STEP,OVERHEAD]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = ["data.resolution=32", "model.width=64", "training.batch_size=32", "engine.num_cpus_per_worker=1",
        "compare=null", "evaluation.every=0", "output.save_best_checkpoint=false",
        "output.checkpoint_every=0"]
SPLIT = ["partition.strategy=dirichlet", "partition.num_clients=8", "partition.alpha=0.5"]
TARGET = "mono"


def run(sets: list[str], rounds: int, workers: int) -> list[dict]:
    """One federation of the quickstart's config with ``sets``: per round, its clients' predicted and measured
    seconds."""
    import ray

    from rayfed_dg.config import load_config
    from rayfed_dg.engine import run_federation
    from rayfed_dg.engine.running.host import EngineHost
    from rayfed_dg.engine.running.plan import load_data, split_for

    cfg = load_config(str(REPO / "configs" / "quickstart.yaml"), [*BASE, *SPLIT, *sets, f"training.rounds={rounds}"])
    ds = load_data(cfg)
    split = split_for(cfg, ds, TARGET)
    host = EngineHost(cfg.engine, [ray.put(ds.images), ray.put(ds.labels)], workers)
    rows: list[dict] = []

    def on_round(out, res) -> None:
        trained = [c for c in out.clients if c.seconds is not None and not c.dropped]
        rows.append({"round": out.round, "makespan": out.seconds_clients,
                     "clients": [(c.client, c.local_steps, c.sim_finish - c.sim_start, c.seconds) for c in trained],
                     "cut": [c.client for c in out.clients if c.dropped]})

    try:
        run_federation(cfg, split, None, None, ds.num_classes, None, progress=False, on_round=on_round, host=host)
    finally:
        host.close()
    return rows


def report(name: str, rows: list[dict], skip: int = 1) -> None:
    """The table of one run and its errors; the first ``skip`` rounds (warm-up) are shown, not counted.

    Beside the clock's error it prints what bounds it on this machine: the error left with the step refitted on
    the run's own trainings (the median measured/predicted: what a calibration taken during the run would give),
    and the floor, the spread of the run's repeated trainings (the same client and steps) about their median:
    no clock that gives a training one duration does better than that."""
    print(f"\n{name}")
    print(f"{'round':>5} {'clients (steps)':>22} {'predicted':>10} {'measured':>9} {'error':>7} "
          f"{'phase pred.':>11} {'phase meas.':>11} {'error':>7}  cut")
    per, phase, signed = [], [], []
    for r in rows:
        if not r["clients"]:
            print(f"{r['round']:5d} {'(none)':>22}")
            continue
        pred = statistics.mean(c[2] for c in r["clients"])
        meas = statistics.mean(c[3] for c in r["clients"])
        ppred = max(c[2] for c in r["clients"])
        e1, e2 = (pred - meas) / meas, (ppred - r["makespan"]) / r["makespan"]
        if r["round"] > skip:
            per.append(abs(e1))
            phase.append(abs(e2))
            signed.append(e1)
        who = ",".join(f"{c[0]}({c[1]})" for c in r["clients"])
        print(f"{r['round']:5d} {who:>22} {pred:9.3f}s {meas:8.3f}s {100 * e1:+6.1f}% {ppred:10.3f}s "
              f"{r['makespan']:10.3f}s {100 * e2:+6.1f}%  {','.join(map(str, r['cut'])) or '-'}")
    print(f"mean absolute error per round, rounds {skip + 1}-{rows[-1]['round']}: trainings "
          f"{100 * statistics.mean(per):.1f} %, the clients' phase {100 * statistics.mean(phase):.1f} % "
          f"(target <= 5 %); mean signed error of the trainings {100 * statistics.mean(signed):+.1f} %")
    counted = [c for r in rows if r["round"] > skip for c in r["clients"]]
    scale = statistics.median(c[3] / c[2] for c in counted)
    refit = statistics.mean(abs(c[2] * scale - c[3]) / c[3] for c in counted)
    groups: dict[tuple[int, int], list[float]] = {}
    for c in counted:
        groups.setdefault((c[0], c[1]), []).append(c[3])
    spread = [abs(m - statistics.median(g)) / statistics.median(g) for g in groups.values() if len(g) > 1 for m in g]
    clock = statistics.mean(abs(c[2] - c[3]) / c[3] for c in counted)
    print(f"each training: the clock's mean absolute error {100 * clock:.1f} %, "
          f"with the step refitted on this run (x {scale:.3f}) {100 * refit:.1f} %; the floor, "
          f"{len(spread)} repeated trainings about their median: "
          + (f"{100 * statistics.mean(spread):.1f} %" if spread else "none repeated"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=6, help="local epochs (longer trainings: less relative noise)")
    ap.add_argument("--workers", type=int, default=2, help="workers, each one device at a time")
    ap.add_argument("--skip-calibration", default=None, metavar="STEP,OVERHEAD",
                    help="use these seconds instead of measuring them")
    args = ap.parse_args()
    import numpy as np
    import ray

    from rayfed_dg.config import load_config
    from rayfed_dg.engine.clock.devices import planned_work
    from rayfed_dg.engine.running.calibration import calibrate_clock
    from rayfed_dg.engine.running.plan import load_data, split_for

    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    w = args.workers
    base = [*BASE, f"engine.num_workers={w}"]
    if args.skip_calibration:
        step, over = (float(v) for v in args.skip_calibration.split(","))
    else:
        cal = calibrate_clock(str(REPO / "configs" / "quickstart.yaml"), [*base, *SPLIT], TARGET, (2, 24), 4)
        step, over = cal["step_seconds"], max(0.0, cal["overhead_s"])
        lo, hi = cal["step_seconds_5_95"]
        print(f"calibration: a step {step:.4f} s (5-95 % {lo:.4f}-{hi:.4f}), a training's overhead {over:.4f} s, "
              f"from {sum(len(v) for v in cal['trainings'].values())} trainings")
    epochs = f"training.local_epochs={args.epochs}"
    cfg = load_config(str(REPO / "configs" / "quickstart.yaml"), [*base, *SPLIT, epochs])
    sizes = split_for(cfg, load_data(cfg), TARGET).client_sizes()
    planned = np.array([over + planned_work(cfg.training, int(n)) * step for n in sizes])
    deadline = 1.2 * float(np.median(planned))
    print(f"clients' sizes {sizes.tolist()}, predicted trainings {np.round(planned, 3).tolist()} s, "
          f"deadline {deadline:.3f} s")
    clock = [f"engine.num_workers={w}", "devices.enabled=true", f"devices.step_seconds={step!r}",
             f"devices.overhead_s={over!r}", epochs]
    try:
        sync = run([*clock, f"training.clients_per_round={w}", "devices.over_selection=1.5",
                    f"devices.deadline_s={deadline!r}"], args.rounds, w)
        buff = run([*clock, "server.mode=fedbuff", f"server.concurrency={w}", f"server.buffer_size={w}"],
                   args.rounds, w)
    finally:
        ray.shutdown()
    report(f"synchronous, {w} of 8 a round, over-selection 1.5, a deadline", sync)
    report(f"FedBuff, {w} at once, K = {w}", buff)
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
