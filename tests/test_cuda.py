"""Checks that need a CUDA GPU (skipped elsewhere, CI included): the GPU
path's numbers do not depend on the number of workers sharing the GPU, the
dataset kept on the GPU gives the host path's bits, the exact fold on the
GPU gives the CPU's, and the reduced precisions train on the GPU.  Run them on a GPU machine with
``python -m pytest -q tests/test_cuda.py``."""
import numpy as np
import pytest
import torch
from conftest import tiny_cfg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)")

CUDA = ("engine.device=cuda",)


def _run(ds, *sets):
    import ray

    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import run_federation

    cfg = tiny_cfg("training.rounds=2", "method.name=fedbn", *CUDA, *sets)
    split = leave_one_domain_out(ds, "mono", cfg.data.val_fraction, cfg.data.split_seed)
    res = run_federation(cfg, split, ray.put(ds.images), ray.put(ds.labels), ds.num_classes, progress=False)
    return [(m["round"], m["split"], m["domain"], m["accuracy"], m["loss"]) for m in res.metrics]


def test_one_and_two_workers_sharing_the_gpu_give_the_same_numbers(ray_session, tiny_ds):
    one = _run(tiny_ds, "engine.num_workers=1", "engine.num_gpus_per_worker=0.5")
    two = _run(tiny_ds, "engine.num_workers=2", "engine.num_gpus_per_worker=0.5")
    assert one == two and len(one) == 2 * (4 + 3)


def test_dataset_on_the_gpu_gives_the_host_paths_numbers(ray_session, tiny_ds):
    on = _run(tiny_ds, "engine.num_gpus_per_worker=0.5", "engine.data_on_device=true")
    off = _run(tiny_ds, "engine.num_gpus_per_worker=0.5", "engine.data_on_device=false")
    assert on == off


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_trains_on_the_gpu_and_differs_from_fp32(ray_session, tiny_ds, precision):
    fp32 = _run(tiny_ds, "engine.num_gpus_per_worker=0.5")
    low = _run(tiny_ds, "engine.num_gpus_per_worker=0.5", f"training.precision={precision}")
    assert all(np.isfinite(row[4]) for row in low)
    assert [r[:3] for r in low] == [r[:3] for r in fp32] and low != fp32


def test_the_exact_fold_on_the_gpu_gives_the_cpus_bits_in_one_copy_to_the_host():
    from rayfed_dg.engine.aggregation.exact import FixedSum, windows

    rng = np.random.default_rng(0)
    x_t = {"w": rng.normal(size=(64, 3, 3, 3)).astype(np.float32), "b": np.zeros(64, np.float32)}
    ups = [(float(n), {k: (v + 0.1 * rng.normal(size=v.shape)).astype(np.float32) for k, v in x_t.items()})
           for n in (50, 64, 7)]
    win = windows(x_t, [w for w, _ in ups])
    packs = {}
    for dev in ("cpu", "cuda"):
        s = FixedSum(win)
        for w, up in ups:
            s.add(w, {k: torch.from_numpy(v).to(dev) for k, v in up.items()})
        assert all(c.device.type == dev for at in s.cells.values() for c in at.values())  # folded on the device
        packs[dev] = s.pack()
    assert packs["cpu"].cells == packs["cuda"].cells
    assert all(np.array_equal(a, b) for a, b in zip(packs["cpu"].pieces, packs["cuda"].pieces))
