import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
REPO = Path(__file__).resolve().parents[1]


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
