"""``rayfed-dg devices calibrate``: the virtual clock's step time measured on
this machine.  The config runs (one target, its model, resolution, batch,
precision, method and workers, devices off) for a few rounds at two numbers
of local steps a and b; every client row records the wall seconds of its
training (loading the global model, the local steps, packing the update).
Each training's work is counted as the clock counts it, in full batches'
worth (``planned_work``: a short batch counts its samples); a line through
the two groups' medians gives the seconds of a full batch,
(median T_b - median T_a) / (median W_b - median W_a), and what a training
costs besides, median T_a - median W_a x step: ``devices.step_seconds`` and
``devices.overhead_s`` of a device of speed 1 that is this machine.  Round 1 is left out (its
first batches pay for allocation and warm-up); the spread is a seeded
bootstrap of the trainings.
"""
from __future__ import annotations

import os
import platform
import tempfile

import numpy as np

from rayfed_dg.errors import ConfigError

_PLAIN = ["compare=null", "devices.enabled=false", "evaluation.every=0", "output.save_best_checkpoint=false",
          "output.checkpoint_every=0", "output.sync_to=null"]


def _trainings(config: str, overrides: list[str], target: str | None, steps: int,
               rounds: int) -> tuple[list[float], list[float]]:
    """(work, wall seconds) of every training after round 1 of ``steps``
    local steps, its work in full batches' worth (``planned_work``, the
    clock's unit: a short batch counts its samples)."""
    from rayfed_dg.config import load_config
    from rayfed_dg.engine.clock.devices import planned_work

    from .service import RunRequest, execute_run

    sets = [*overrides, *_PLAIN, f"training.local_steps={steps}", f"training.rounds={rounds}"]
    training = load_config(config, sets).training
    with tempfile.TemporaryDirectory(prefix="rayfed-dg-calibrate-") as tmp:
        out = execute_run(RunRequest(config=config, target=target, overrides=sets, run_dir=tmp + "/run",
                                     no_progress=True))
        rows = [r for r in out.run_dir.read_rows("clients")
                if r["round"] > 1 and r["seconds"] is not None and not r["dropped"]]
    return [planned_work(training, int(r["samples"])) for r in rows], [float(r["seconds"]) for r in rows]


def fit(wa: list[float], ta: list[float], wb: list[float], tb: list[float], resamples: int = 2000) -> dict:
    """A full batch's seconds and a training's overhead through the medians
    of two groups of trainings (work ``wa`` taking ``ta`` seconds, ``wb``
    taking ``tb``), with 5 and 95 % percentiles of a bootstrap that resamples
    each group's trainings."""
    def line(xa, ya, xb, yb) -> tuple[np.ndarray, np.ndarray]:
        step = (np.median(yb, axis=-1) - np.median(ya, axis=-1)) / (np.median(xb, axis=-1) - np.median(xa, axis=-1))
        return step, np.median(ya, axis=-1) - np.median(xa, axis=-1) * step

    wa_, ta_, wb_, tb_ = (np.asarray(v, float) for v in (wa, ta, wb, tb))
    step, over = line(wa_, ta_, wb_, tb_)
    rng = np.random.default_rng(0)
    ia = rng.integers(0, len(ta_), size=(resamples, len(ta_)))
    ib = rng.integers(0, len(tb_), size=(resamples, len(tb_)))
    bs, bo = line(wa_[ia], ta_[ia], wb_[ib], tb_[ib])
    return {"step_seconds": float(step), "overhead_s": float(over),
            "step_seconds_5_95": [float(v) for v in np.percentile(bs, [5, 95])],
            "overhead_s_5_95": [float(v) for v in np.percentile(bo, [5, 95])]}


def calibrate_clock(config: str, overrides: list[str], target: str | None, steps: tuple[int, int] = (2, 8),
                    rounds: int = 3) -> dict:
    """The measurement of the module docstring, as a record for a JSON file."""
    import torch

    from rayfed_dg.config import load_config

    a, b = steps
    if not 1 <= a < b:
        raise ConfigError(f"--steps {a},{b}: give two numbers of local steps, 1 <= a < b (e.g. --steps 2,8)")
    if rounds < 2:
        raise ConfigError(f"--rounds {rounds}: give at least 2 (round 1, the warm-up, is left out)")
    cfg = load_config(config, [*overrides, *_PLAIN])
    (wa, ta), (wb, tb) = (_trainings(config, overrides, target, s, rounds) for s in steps)
    if len(ta) < 2 or len(tb) < 2:
        raise ConfigError("devices calibrate: fewer than 2 trainings after round 1; raise --rounds or "
                          "training.clients_per_round")
    f = fit(wa, ta, wb, tb)
    if f["step_seconds"] <= 0:
        raise ConfigError(f"devices calibrate: the trainings of {b} steps took no longer than those of {a} (medians "
                          f"{np.median(tb):.4g} s, {np.median(ta):.4g} s): the machine's noise hides the steps; raise "
                          "--steps (e.g. 2,20) or --rounds")
    e, d, t = cfg.engine, cfg.data, cfg.training
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() and e.device != "cpu" else None
    return {**f, "steps": [a, b], "rounds": rounds, "trainings": {str(a): ta, str(b): tb},
            "work": {str(a): wa, str(b): wb},
            "config": str(config), "overrides": list(overrides), "model": cfg.model.arch, "method": cfg.method.name,
            "resolution": d.resolution, "batch_size": t.batch_size, "precision": t.precision,
            "workers": e.num_workers, "cpus_per_worker": e.num_cpus_per_worker, "device": e.device,
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpus": os.cpu_count(), "torch": torch.__version__, "gpu": cuda}}
