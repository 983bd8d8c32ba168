"""The per-client cycle of a worker: one optimizer reset in place per
client, the round's global state copied to the device once, the loss summed
on the device; each as a fresh process would compute it."""
import numpy as np
import torch

from rayfed_dg.engine import ClientRunner, ClientTask
from rayfed_dg.engine.workers.worker import to_numpy_state


def _runner(tiny_ds, *sets):
    from conftest import tiny_cfg

    cfg = tiny_cfg("training.local_steps=3", "training.momentum=0.9", *sets)
    return ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, tiny_ds.num_classes, 3)


def _read_only(state):
    out = {k: v.copy() for k, v in state.items()}
    for v in out.values():
        v.setflags(write=False)  # as a round's global model reaches a worker: an object-store view
    return out


def _train(runner, cid, state, rnd=1):
    idx = np.arange(cid * 40, cid * 40 + 40)
    return runner.train(ClientTask(client=cid, round=rnd, indices=idx, local_state={}), state)


def _same(a, b):
    return all(np.array_equal(a.update[k], b.update[k]) for k in a.update) and a.train_loss == b.train_loss


def test_a_reused_optimizer_starts_each_client_as_a_fresh_one(tiny_ds):
    warm = _runner(tiny_ds, "training.lr_schedule=cosine")  # round 2's learning rate is half round 1's
    sd = warm.model.state_dict()
    g0 = to_numpy_state(sd, sd.keys())
    first = _train(warm, 0, g0)
    opt = warm.method.make_optimizer(warm.model, 2)
    assert opt is warm.method.make_optimizer(warm.model, 1)  # one optimizer, reset in place
    assert opt.param_groups[0]["lr"] == warm.method.lr_at(1) != warm.method.lr_at(2) and not opt.state
    opt.param_groups[0].update(initial_lr=1.0, momentum=0.0)  # what a scheduler or a method may leave behind
    opt = warm.method.make_optimizer(warm.model, 1)
    assert "initial_lr" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.9
    stacked = [torch.zeros(3, requires_grad=True)]  # tensors not the model's (client batching's): never kept
    assert warm.method.make_optimizer(warm.model, 1, stacked) is not warm.method.make_optimizer(warm.model, 1, stacked)
    assert len(warm.method._optimizers[warm.model]) == 1
    after = _train(warm, 1, g0, rnd=2)  # momentum buffers of client 0 must not reach client 1
    fresh = _train(_runner(tiny_ds, "training.lr_schedule=cosine"), 1, g0, rnd=2)
    assert _same(after, fresh) and not _same(first, after)


def test_the_round_model_is_copied_to_the_device_once_and_replaced_by_the_next(tiny_ds):
    runner = _runner(tiny_ds)
    sd = runner.model.state_dict()
    g0 = _read_only(to_numpy_state(sd, sd.keys()))
    g1 = _read_only({k: (v * 0.5 if v.dtype.kind == "f" else v) for k, v in g0.items()})
    a = _train(runner, 0, g0)
    kept = runner._global[2]
    b = _train(runner, 1, dict(g0))  # another task of the same round (a new dict of the same arrays)
    assert runner._global[2] is kept
    c = _train(runner, 0, g1)  # the next round: other arrays, another copy
    assert runner._global[2] is not kept
    fresh = _runner(tiny_ds)
    for got, cid, state in ((a, 0, g0), (b, 1, g0), (c, 0, g1)):
        writable = {k: v.copy() for k, v in state.items()}  # loaded as it is, no copy kept
        assert _same(got, _train(fresh, cid, writable)), cid
    assert fresh._global is None


def test_the_loss_summed_on_the_device_is_the_host_sum():
    from rayfed_dg.methods.base import train_steps

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [(torch.randn(n, 4), torch.randint(0, 3, (n,))) for n in (5, 7, 3)]
    losses = []

    def loss_fn(x, y):
        out = torch.nn.functional.cross_entropy(model(x), y)
        losses.append((float(out.detach()), len(y)))
        return out

    res = train_steps(opt, lambda: iter(xs), loss_fn)
    total = 0.0
    for v, n in losses:
        total += v * n
    assert res.loss == total / 15 and res.steps == 3 and res.samples == 15
