"""Shared fixtures and the test tiers.

``python -m pytest -q -m "not slow"`` is the fast tier (every value test and
the in-process engine tests on one shared local Ray); ``python -m pytest -q``
runs everything, as CI does.  Markers: ``slow`` (CLI subprocesses with their
own Ray, sweeps, real-data decoding), ``ray`` (uses the session's local
Ray), ``data`` (reads the real datasets under the data root; skipped when
absent), ``cluster`` (multi-node Ray on this machine).

The data root: ``$RAYFED_DG_DATA`` when set, else this checkout's neighbour
``../shared/data`` when it exists (set here, so that configs naming
``data.root: PACS`` and subprocesses find it).
"""
import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
REPO = Path(__file__).resolve().parents[1]
if not os.environ.get("RAYFED_DG_DATA") and SHARED_DATA.is_dir():
    os.environ["RAYFED_DG_DATA"] = str(SHARED_DATA)
DATA_ROOT = Path(os.environ.get("RAYFED_DG_DATA") or Path.home() / "data").expanduser()


def needs_data(folder: str):
    """Skip unless the data root holds ``folder`` (the ``data`` marker goes with it)."""
    return pytest.mark.skipif(not (DATA_ROOT / folder).is_dir(),
                              reason=f"{DATA_ROOT / folder} is not present (set RAYFED_DG_DATA or run "
                                     "`rayfed-dg data fetch`)")


def pytest_configure(config):
    # one decode cache for the whole session (real datasets are decoded once, not per test);
    # tests of the cache itself point RAYFED_DG_CACHE at their own folder
    if "RAYFED_DG_CACHE" not in os.environ:
        os.environ["RAYFED_DG_CACHE"] = str(Path(config.rootpath) / ".pytest_cache" / "rayfed_dg")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=True, logging_level="ERROR",
                 log_to_driver=False)
    yield ray


@pytest.fixture(scope="session")
def tiny_ds():
    from rayfed_dg.data import load_dataset

    return load_dataset("embedded_digits", None, 16)


def tiny_cfg(*overrides):
    from rayfed_dg.config import load_config

    base = ["data.resolution=16", "model.width=8", "training.rounds=2", "training.batch_size=32",
            "training.lr=0.05", "engine.num_cpus_per_worker=1", "evaluation.batch_size=512",
            "output.save_best_checkpoint=false"]
    return load_config(None, base + list(overrides))


def server_rounds(ray, cfg, ds, target="texture", workers=1, rounds=1):
    """Run ``rounds`` rounds on a real server actor; returns (split, [state
    after each round], broadcast state at the end)."""
    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import launch_server

    split = leave_one_domain_out(ds, target, cfg.data.val_fraction, cfg.data.split_seed)
    server = launch_server(
        cfg, split, [ray.put(ds.images), ray.put(ds.labels)], ds.num_classes, workers)
    states = []
    for _ in range(rounds):
        ray.get(server.run_round.remote())
        states.append(ray.get(server.get_state.remote()))
    bcast = ray.get(server.broadcast_state.remote())
    ray.get(server.shutdown.remote())
    return split, states, bcast
