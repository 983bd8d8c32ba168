"""Every registered method trains at its defaults in the quickstart's regime.

The quickstart (configs/quickstart.yaml: the embedded digits at 16 px, the
conv net of width 32, lr 0.05 with momentum 0.9, one local epoch) for 3
rounds with target ``colour`` left out, each method at its own defaults
(``auto`` values resolve for this from-scratch conv net): no client may
diverge (the engine stops such a run) and the sources' mean validation
accuracy after the last round must beat chance (10 classes) with a margin.
tests/test_contract.py runs the registry on tiny data with some defaults
overridden; this one is what a user gets from the quickstart with
``--set method.name=NAME``.  Runs on the session's shared engine host
(``engine_host``), nothing else shrunk.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from rayfed_dg.methods import method_names

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
TARGET, ROUNDS = "colour", 3
CHANCE = 0.10  # 10 classes
MARGIN = 0.05  # above chance by more than a lucky round's noise (90 validation images per source)

# settings a method needs before it can run on the quickstart at all (not loss weights: those are its defaults)
NEEDS = {"elcfs": ["stages.amplitude={}"]}  # ELCFS reads its data stage's amplitude bank

# methods that cannot train there, each with its one-line reason (none at present: every registered method runs)
CANNOT: dict[str, str] = {}


def _cfg(name: str):
    from rayfed_dg.config import load_config

    return load_config(QUICKSTART, ["compare=null", f"method.name={name}", f"training.rounds={ROUNDS}",
                                    "output.save_best_checkpoint=false", *NEEDS.get(name, [])])


def test_the_methods_left_out_are_registered_and_say_why():
    assert set(CANNOT) <= set(method_names()) and all(CANNOT.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in method_names() if n not in CANNOT])
def test_method_trains_at_defaults(ray_session, tiny_ds, engine_host, name):
    from rayfed_dg.engine import run_federation
    from rayfed_dg.engine.running.plan import split_for

    cfg = _cfg(name)
    assert (cfg.data.name, cfg.data.resolution) == ("embedded_digits", 16)  # tiny_ds is the quickstart's data
    split = split_for(cfg, tiny_ds, TARGET)
    t0 = time.perf_counter()
    res = run_federation(cfg, split, ray_session.put(tiny_ds.images), ray_session.put(tiny_ds.labels),
                         tiny_ds.num_classes, progress=False, host=engine_host(tiny_ds, 2))
    assert res.rounds_done == ROUNDS, name
    last = [m["accuracy"] for m in res.metrics if m["split"] == "source_val" and m["round"] == ROUNDS]
    acc = sum(last) / len(last)
    print(f"{name}: source val {100 * acc:.1f}% after {ROUNDS} rounds ({time.perf_counter() - t0:.1f} s)")
    assert acc > CHANCE + MARGIN, f"{name}: source val {100 * acc:.1f}% after {ROUNDS} rounds, chance 10%"
