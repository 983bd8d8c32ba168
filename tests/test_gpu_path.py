"""The GPU path, tested on the CPU where torch allows: ``training.precision``
(bf16 autocast; fp16 through a gradient scaler), ``engine.tf32`` /
``engine.cudnn_benchmark`` (accepted, no effect on the CPU), and the dataset
resident on the worker's device (``engine.data_on_device``), forced on the
CPU to run its gather-by-index path against the host path bit for bit."""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import tiny_cfg, tiny_federation

from rayfed_dg.config import ConfigError, load_config
from rayfed_dg.engine import ClientRunner
from rayfed_dg.engine.workers.worker import RESIDENT_SHARE, resident_budget
from rayfed_dg.methods import Precision


def _runner(ds, *sets):
    return ClientRunner(tiny_cfg(*sets), ds.images, ds.labels, ds.num_classes, 3)


def _update(runner, client=0, indices=None, rnd=1):
    """One client's update (of samples 0-95 by default) from the runner's
    initial weights (seeded by training.seed: the same in every runner)."""
    g0 = {k: v.detach().numpy().copy() for k, v in runner.model.state_dict().items()}
    return runner.run_client(client, rnd, np.arange(96) if indices is None else indices, g0)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ precision

def test_bf16_trains_fp32_weights_and_differs_from_fp32(tiny_ds):
    sets = ("training.local_steps=3", "data.augment=flip_jitter")
    r32, r16 = _runner(tiny_ds, *sets), _runner(tiny_ds, *sets, "training.precision=bf16")
    g0 = {k: v.detach().numpy().copy() for k, v in r32.model.state_dict().items()}
    # evaluation autocasts too: the same weights give a slightly different summed loss
    (c32, l32, n), (c16, l16, _) = r32.evaluate(g0, np.arange(300), 128), r16.evaluate(g0, np.arange(300), 128)
    assert l16 != l32 and abs(l16 - l32) < 0.02 * l32 and abs(c16 - c32) <= 0.05 * n
    fp32, bf16 = _update(r32), _update(r16)
    assert np.isfinite(bf16.train_loss) and bf16.steps == 3
    # the weights (and so the upload) stay fp32; only the arithmetic of the forward pass changed
    assert all(bf16.update[k].dtype == fp32.update[k].dtype for k in fp32.update)
    assert bf16.update["head.weight"].dtype == np.float32
    assert not _same(fp32.update, bf16.update) and bf16.train_loss != fp32.train_loss
    # bf16 keeps 8 bits of mantissa: the loss is fp32's to about 1 %, not something else
    assert abs(bf16.train_loss - fp32.train_loss) < 0.05 * fp32.train_loss


def test_fp16_trains_through_the_scaler(tiny_ds):
    sets = ("training.local_steps=3",)
    fp32 = _update(_runner(tiny_ds, *sets))
    fp16 = _update(_runner(tiny_ds, *sets, "training.precision=fp16"))
    assert np.isfinite(fp16.train_loss) and fp16.steps == 3
    assert fp16.update["head.weight"].dtype == np.float32
    assert not _same(fp32.update, fp16.update)
    assert abs(fp16.train_loss - fp32.train_loss) < 0.05 * fp32.train_loss


def _linear_step(precision: Precision, scale_loss: float):
    """One SGD step (lr 50) of a 2->1 linear layer on loss = scale_loss * out.sum(), in fp32 as cross-entropy's."""
    lin = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, -2.0]]))
    opt = torch.optim.SGD(lin.parameters(), lr=50.0)
    x = torch.tensor([[1.0, 3.0], [2.0, 1.0]])
    with precision.autocast():
        loss = scale_loss * lin(x).float().sum()
    opt.zero_grad(set_to_none=True)
    precision.step(opt, loss)
    return lin.weight.detach()


# d loss / d w = scale_loss * (the sum of the rows of x) = scale_loss * (3, 4); SGD steps by lr times that
STEPPED = torch.tensor([[1.0 - 50 * 0.01 * 3, -2.0 - 50 * 0.01 * 4]])


def test_fp16_scaler_unscales_the_step_and_backs_off_on_overflow():
    p = Precision("fp16", "cpu")
    assert p.scaler is not None and p.scaler.get_scale() == 2.0 ** 16
    # the fp16 output's gradient is 0.01 x 65,536 (scaled); the step uses the unscaled gradient
    w = _linear_step(p, 0.01)
    assert torch.allclose(w, STEPPED, atol=2e-3)  # to fp16's rounding; without unscaling it would be 65,536x
    assert p.scaler.get_scale() == 2.0 ** 16  # no overflow: the scale grows only after 2,000 good steps
    # 1 x 65,536 overflows fp16 (its largest finite value is 65,504): the step is skipped, the scale halves
    p = Precision("fp16", "cpu")
    w = _linear_step(p, 1.0)
    assert torch.equal(w, torch.tensor([[1.0, -2.0]]))
    assert p.scaler.get_scale() == 2.0 ** 15
    # fp32 and bf16 step without a scaler
    assert Precision("bf16", "cpu").scaler is None
    assert torch.allclose(_linear_step(Precision(), 0.01), STEPPED, atol=1e-6)


def test_a_method_loop_that_ignores_the_precision_is_refused(tiny_ds):
    runner = _runner(tiny_ds, "training.local_steps=1", "training.precision=bf16")

    def plain_loop(model, batches, ctx):  # a method's own loop, without ctx.precision
        from rayfed_dg.methods import LocalResult

        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return LocalResult(loss=float(loss.detach()), steps=1, samples=len(y))

    runner.method.local_train = plain_loop
    with pytest.raises(TypeError, match="ignored training.precision=bf16: pass precision=ctx.precision"):
        _update(runner)


def test_elcfs_refuses_fp16_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["method.name=elcfs", "stages.amplitude={}", "training.precision=fp16"])
    assert "training.precision to bf16 or fp32" in str(e.value) and "\n" not in str(e.value)
    load_config(None, ["method.name=elcfs", "stages.amplitude={}", "training.precision=bf16"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedfda", "csac", "moon", "scaffold", "feddyn", "elcfs", "rsc"])
def test_methods_owning_their_loop_train_in_bf16(ray_session, tiny_ds, engine_host, name):
    """Each method with its own loop (or its own gradients) trains under bf16
    autocast: the worker refuses a loop that never entered it."""
    extra = {"fedfda": ["method.lambda2=0.1"], "csac": ["method.pretrain_steps=2"], "elcfs": ["stages.amplitude={}"]}
    res = tiny_federation(tiny_ds, "texture", f"method.name={name}", "training.rounds=1", "training.local_steps=2",
                          "training.precision=bf16", *extra.get(name, []),
                          host=engine_host(tiny_ds))
    assert res.clients and all(np.isfinite(c["train_loss"]) for c in res.clients)


# -------------------------------------------------------------- engine flags

def test_tf32_and_cudnn_benchmark_are_accepted_and_change_nothing_on_the_cpu(tiny_ds):
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
              torch.backends.cudnn.deterministic)
    sets = ("training.local_steps=2",)
    on = _update(_runner(tiny_ds, *sets, "engine.tf32=true", "engine.cudnn_benchmark=true"))
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic) == before  # CUDA's flags: a CPU worker leaves them alone
    assert _same(on.update, _update(_runner(tiny_ds, *sets)).update)


# ------------------------------------------------------------- data on device

def test_resident_budget_is_a_share_of_the_workers_gpu_memory():
    gib = 2 ** 30
    assert resident_budget(80 * gib, 0.25) == RESIDENT_SHARE * 20 * gib
    assert resident_budget(80 * gib, 0.0) == RESIDENT_SHARE * 80 * gib  # no GPU share declared: the whole device
    assert resident_budget(80 * gib, 2.0) == RESIDENT_SHARE * 80 * gib  # one process uses one device


@pytest.mark.parametrize("augment", ["domainbed", "flip_jitter"])
def test_resident_dataset_gives_the_same_bits_as_the_host_path(tiny_ds, augment):
    """``data_on_device: true`` gathers batches by index from the dataset as a
    tensor on the device (here the CPU) and augments them there: a client's
    update, its loss and an evaluation are those of the host path, bit for bit."""
    sets = ("training.local_steps=3", f"data.augment={augment}")
    host, dev = _runner(tiny_ds, *sets), _runner(tiny_ds, *sets, "engine.data_on_device=true")
    assert host.resident is None and dev.resident is not None  # auto on the CPU: the host path
    assert dev.resident[0].shape == tiny_ds.images.shape and dev.resident[0].dtype == torch.uint8
    idx = np.array([5, 90, 17, 3, 64, 200, 41])
    a, b = _update(host, 1, idx), _update(dev, 1, idx)
    assert _same(a.update, b.update) and a.train_loss == b.train_loss
    g = {k: v.detach().numpy().copy() for k, v in host.model.state_dict().items()}
    assert host.evaluate(g, np.arange(150), 64) == dev.evaluate(g, np.arange(150), 64)
