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


def server_rounds(ray, cfg, ds, target="texture", workers=1, rounds=1):
    """Run ``rounds`` rounds on a real server actor; returns (split, [state
    after each round], broadcast state at the end)."""
    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import Server

    split = leave_one_domain_out(ds, target, cfg.data.val_fraction, cfg.data.split_seed)
    server = ray.remote(Server).options(num_cpus=0).remote(
        cfg.to_dict(), split, [ray.put(ds.images), ray.put(ds.labels)], ds.num_classes, workers)
    states = []
    for _ in range(rounds):
        ray.get(server.run_round.remote())
        states.append(ray.get(server.get_state.remote()))
    bcast = ray.get(server.broadcast_state.remote())
    ray.get(server.shutdown.remote())
    return split, states, bcast
