"""End-to-end engine behaviour on real local Ray (no mocks)."""
import time

import numpy as np
import pytest
import torch
from conftest import server_rounds, tiny_cfg

from rayfed_dg.data import leave_one_domain_out
from rayfed_dg.engine import ClientRunner, run_federation
from rayfed_dg.errors import EngineError
from rayfed_dg.methods import build_method
from rayfed_dg.models import BN_TYPES, state_keys_of


def bn_keys(cfg, ds, kinds=("param", "buffer")):
    model = build_method(cfg, 3).build_model(ds.num_classes)
    return state_keys_of(model, BN_TYPES, kinds)


def test_fedavg_global_equals_weighted_mean_of_client_models(ray_session, tiny_ds, engine_host):
    ray = ray_session
    cfg = tiny_cfg("training.rounds=1")
    split = leave_one_domain_out(tiny_ds, "texture", cfg.data.val_fraction, cfg.data.split_seed)
    server = engine_host(tiny_ds, 2).open(cfg, split, tiny_ds.num_classes)
    g0 = ray.get(server.get_state.remote())["global_state"]
    out = ray.get(server.run_round.remote())
    assert out.tasks_retried == out.tasks_rerun == 0  # each federation counts its own (the host served others)
    g1 = ray.get(server.get_state.remote())["global_state"]
    # recompute each client's local training in this process, then average by hand
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, tiny_ds.num_classes, 3)
    ups = [runner.run_client(c, 1, split.clients[c], g0, {}, {}).update for c in range(split.num_clients)]
    n = split.client_sizes().astype(np.float64)
    key = "head.weight"
    expect = sum(n[i] * ups[i][key].astype(np.float64) for i in range(3)) / n.sum()
    np.testing.assert_allclose(g1[key], expect.astype(np.float32), rtol=1e-6, atol=1e-7)
    assert not np.allclose(g1[key], g0[key])  # training moved it
    # num_batches_tracked is averaged too
    nbt = [k for k in g1 if k.endswith("num_batches_tracked")][0]
    assert g1[nbt] == round(sum(n[i] * ups[i][nbt] for i in range(3)) / n.sum())


@pytest.mark.parametrize("method,kinds", [("fedbn", ("param", "buffer")),
                                          pytest.param("silobn", ("buffer",), marks=pytest.mark.slow)])
def test_local_bn_state_survives_broadcast_and_persists(ray_session, tiny_ds, engine_host, method, kinds):
    ray = ray_session
    cfg = tiny_cfg(f"method.name={method}")
    local = bn_keys(cfg, tiny_ds, kinds)
    shared_bn = bn_keys(cfg, tiny_ds) - local
    split, (s1, s2), bcast = server_rounds(ray, cfg, tiny_ds, rounds=2, host=engine_host(tiny_ds, 1))
    assert local.isdisjoint(bcast) and shared_bn <= set(bcast)
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, tiny_ds.num_classes, 3)
    for c in range(split.num_clients):
        assert set(s1["client_store"][c]) == local
        # round 2 starts from this client's own round-1 BN state, not the global average
        redo = runner.run_client(c, 2, split.clients[c], s1["global_state"], s1["client_store"][c], {}).update
        for k in local:
            np.testing.assert_array_equal(s2["client_store"][c][k], redo[k])
            assert not np.array_equal(s1["client_store"][c][k], s1["global_state"][k]) or k.endswith("tracked")
    # the global model carries the weighted average of the clients' BN state
    n = split.client_sizes().astype(np.float64)
    k = sorted(x for x in local if x.endswith("running_mean"))[0]
    avg = sum(n[c] * s2["client_store"][c][k].astype(np.float64) for c in range(3)) / n.sum()
    np.testing.assert_allclose(s2["global_state"][k], avg.astype(np.float32), rtol=1e-5, atol=1e-7)


def test_same_metrics_with_one_and_two_workers(ray_session, tiny_ds, engine_host):
    cfg = tiny_cfg("training.rounds=2", "method.name=fedbn")
    out = []
    for workers in (1, 2):
        c = tiny_cfg("training.rounds=2", "method.name=fedbn", f"engine.num_workers={workers}")
        split = leave_one_domain_out(tiny_ds, "mono", cfg.data.val_fraction, cfg.data.split_seed)
        res = run_federation(c, split, None, None, tiny_ds.num_classes, progress=False,
                             host=engine_host(tiny_ds, workers))
        out.append(res)
    a, b = ([(m["round"], m["split"], m["domain"], m["accuracy"], m["loss"]) for m in r.metrics] for r in out)
    assert a == b and len(a) == 2 * (4 + 3)  # 3 source val, 1 target, and FedBN's 3 clients' own models
    assert out[0].ledger == out[1].ledger


def test_partial_participation_and_ledger(ray_session, tiny_ds, engine_host):
    cfg = tiny_cfg("partition.strategy=single_domain", "partition.num_clients=9",
                   "training.clients_per_round=4", "training.rounds=2")
    split = leave_one_domain_out(tiny_ds, "colour", 0.2, 0, "single_domain", 9)
    res = run_federation(cfg, split, None, None, 10, progress=False, host=engine_host(tiny_ds, 2))
    by_round = {}
    for row in res.ledger:
        by_round.setdefault(row["round"], set()).add(row["client"])
    assert all(len(v) == 4 for v in by_round.values()) and by_round[1] != by_round[2]
    model = build_method(cfg, 3).build_model(10)
    full = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    ups = [r["bytes"] for r in res.ledger if r["direction"] == "up"]
    assert set(ups) == {full}


def test_evaluated_rounds_are_every_kth_and_the_last(ray_session, tiny_ds, engine_host):
    cfg = tiny_cfg("training.rounds=5", "evaluation.every=2")
    split = leave_one_domain_out(tiny_ds, "colour", cfg.data.val_fraction, cfg.data.split_seed)
    res = run_federation(cfg, split, None, None, 10, progress=False, host=engine_host(tiny_ds, 1))
    assert sorted({row["round"] for row in res.metrics}) == [2, 4, 5]


def test_a_round_whose_every_client_fails_stops_with_a_failures_reason(ray_session, tiny_ds, engine_host):
    cfg = tiny_cfg("engine.fault_clients=[0, 1, 2]", "engine.fault_mode=exception", "engine.max_task_retries=0")
    split = leave_one_domain_out(tiny_ds, "colour", cfg.data.val_fraction, cfg.data.split_seed)
    # the round, and a failed client's reason (the first in the pool's order; the error crossed Ray: its
    # text holds the server's traceback too)
    with pytest.raises(EngineError, match=r"round 1: every sampled client failed \(InjectedFault\('injected fault "
                       r"in client [012] round 1 attempt 0'\)\)"):
        run_federation(cfg, split, None, None, 10, progress=False, host=engine_host(tiny_ds, 1))


def test_a_rounds_seconds_lie_within_the_wall_time_of_its_call(ray_session, tiny_ds, engine_host):
    """The seconds the server times a round by (the rounds table's ``seconds``) are a part of the round's call
    as the driver sees it, and the clients' phase a part of them: rounds of a tenth of a second or so here.
    Its loss is the trained clients' mean."""
    cfg = tiny_cfg("training.rounds=4")
    split = leave_one_domain_out(tiny_ds, "colour", cfg.data.val_fraction, cfg.data.split_seed)
    server = engine_host(tiny_ds, 1).open(cfg, split, tiny_ds.num_classes)
    for _ in range(4):
        t0 = time.perf_counter()
        out = ray_session.get(server.run_round.remote())
        wall = time.perf_counter() - t0
        assert 0 < out.seconds_clients <= out.seconds_total <= wall, (out.seconds_clients, out.seconds_total, wall)
        # its training loss: the mean of the trained clients' own (the clients table's)
        losses = [row.train_loss for row in out.clients if row.train_loss is not None]
        assert len(losses) == 3 and out.train_loss == pytest.approx(np.mean(losses), rel=1e-12)


def test_partial_sums_lost_at_every_gather_end_the_round_after_max_task_retries_plus_two(ray_session):
    """The gather of a round's partial sums (``round.gather``, on a real
    pool): a worker that loses its partial every time is asked
    ``max_task_retries + 2`` times, each lost client is trained again before
    each later ask (epochs 1, 2, ...: uncharged, counted as re-runs), and the
    round then stops with the count in its message."""
    import os
    from types import SimpleNamespace

    from rayfed_dg.engine.aggregation.exact import Reducer
    from rayfed_dg.engine.rounds.round import gather
    from rayfed_dg.engine.workers.pool import WorkerPool

    ray = ray_session

    @ray.remote(num_cpus=0)
    class LosesItsPartial:
        def __init__(self):
            self.asked, self.trained = [], []

        def ping(self):
            return os.getpid()

        def train(self, cid, attempt, epoch):
            self.trained.append((cid, attempt, epoch))
            return "trained again"

        def take_partial(self, federation, r, epoch):
            self.asked.append((federation, r, epoch))
            return None  # its process died after folding, as far as the server can tell

        def log(self):
            return self.asked, self.trained

    worker = LosesItsPartial.remote()
    pool = WorkerPool([worker], 3)
    fed = SimpleNamespace(id=7, round=4, cfg=tiny_cfg("engine.max_task_retries=3"))
    with pytest.raises(EngineError) as err:
        gather(fed, pool, Reducer([0, 2], {0: 1.0, 2: 3.0}),
               lambda w, cid, attempt, epoch: w.train.remote(cid, attempt, epoch))
    assert str(err.value) == ("round 5: the partial sums of clients [0, 2] were lost 5 times (workers dying); "
                              "see the workers' logs")
    asked, trained = ray.get(worker.log.remote())
    assert asked == [(7, 5, e) for e in range(5)]
    assert sorted(trained) == [(c, 0, e) for c in (0, 2) for e in (1, 2, 3, 4)] and pool.reruns == 8
    ray.kill(worker)


@pytest.mark.slow
def test_fedbn_ledger_sends_less_down_same_up(ray_session, tiny_ds, engine_host):
    totals = {}
    for method in ("fedavg", "fedbn"):
        cfg = tiny_cfg(f"method.name={method}", "training.rounds=1")
        split = leave_one_domain_out(tiny_ds, "mono", 0.2, 0)
        res = run_federation(cfg, split, None, None, 10, progress=False, host=engine_host(tiny_ds, 2))
        totals[method] = {d: sum(r["bytes"] for r in res.ledger if r["direction"] == d) for d in ("up", "down")}
    cfg = tiny_cfg("method.name=fedbn")
    local = bn_keys(cfg, tiny_ds)
    bn_bytes = sum(t.numel() * t.element_size() for k, t in build_method(cfg, 3).build_model(10).state_dict().items()
                   if k in local)
    assert totals["fedbn"]["up"] == totals["fedavg"]["up"]
    assert totals["fedavg"]["down"] - totals["fedbn"]["down"] == 3 * bn_bytes


def test_a_local_train_returning_a_dict_is_one_line(tiny_ds, monkeypatch):
    """Contract v1's ``local_train`` returned a dict of magic keys: the worker
    says what to return instead."""
    from rayfed_dg.engine.workers.worker import to_numpy_state

    r = ClientRunner(tiny_cfg("training.local_steps=1"), tiny_ds.images, tiny_ds.labels, 10, 3)
    g = to_numpy_state(r.model.state_dict(), r.model.state_dict().keys())
    monkeypatch.setattr(r.method, "local_train", lambda *a: {"train_loss": 1.0})
    with pytest.raises(TypeError, match="local_train returned dict; in method contract v2 it returns a LocalResult"):
        r.run_client(0, 1, np.arange(64), g)


def test_local_steps_and_epochs_bound_the_local_loop(tiny_ds):
    from rayfed_dg.engine.workers.worker import to_numpy_state

    for sets, expect, steps in ((["training.local_steps=3"], 3 * 32, 3), (["training.local_epochs=2"], 2 * 200, 14)):
        cfg = tiny_cfg(*sets)
        r = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, 10, 3)
        g = to_numpy_state(r.model.state_dict(), r.model.state_dict().keys())
        out = r.run_client(0, 1, np.arange(200), g, {}, {})
        assert out.samples_stepped == expect and out.steps == steps  # 2 epochs of ceil(200 / 32) batches
        # with data-stage additions (CCST copies) the same bound holds
        extra = {"images": tiny_ds.images[200:300], "labels": tiny_ds.labels[200:300]}
        out = r.run_client(0, 1, np.arange(200), g, {}, {}, extra=extra)
        assert out.samples_stepped == (3 * 32 if "local_steps" in sets[0] else 2 * 300)
        assert out.num_samples == 300


def test_a_worker_given_gpus_never_trains_on_the_cpu_in_silence(monkeypatch):
    """num_gpus_per_worker > 0 and no usable CUDA: one line naming what was
    given and what torch sees, unless the GPUs are declared only."""
    from rayfed_dg.engine.workers.worker import resolve_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineError) as e:
        resolve_device("auto", 0.25)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("engine.num_gpus_per_worker=0.25 (engine.device=auto) but this worker")
    assert f"torch {torch.__version__} built for CUDA" in msg and "CUDA_VISIBLE_DEVICES=" in msg
    assert "engine.gpus_declared_only: true" in msg
    with pytest.raises(EngineError, match="engine.device: auto"):
        resolve_device("cuda", 0.0)
    assert resolve_device("auto", 0.25, declared_only=True).type == "cpu"  # a rehearsal's declared GPUs
    assert resolve_device("auto", 0.0).type == "cpu" and resolve_device("cpu", 0.0).type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto", 0.25).type == "cuda"


def test_silobns_global_model_is_fedavgs(ray_session, tiny_ds, engine_host):
    """Why SiloBN's unseen-target row equals FedAvg's (docs/results.md): BN trains on batch statistics, so the
    running statistics SiloBN keeps on the clients never reach a gradient, and the server averages them into
    the global model as FedAvg does.  Only the clients' own models (personal validation) differ."""
    host = engine_host(tiny_ds, 1)
    _, (_, avg), _ = server_rounds(ray_session, tiny_cfg("method.name=fedavg"), tiny_ds, rounds=2, host=host)
    _, (_, silo), _ = server_rounds(ray_session, tiny_cfg("method.name=silobn"), tiny_ds, rounds=2, host=host)
    assert set(avg["global_state"]) == set(silo["global_state"])
    stats = {k for k in avg["global_state"] if k.endswith(("running_mean", "running_var"))}
    for k, v in avg["global_state"].items():
        if k in stats:  # the average of momentum updates = the momentum update of the average, up to rounding
            np.testing.assert_allclose(silo["global_state"][k], v, rtol=1e-6, atol=1e-7, err_msg=k)
        else:
            np.testing.assert_array_equal(silo["global_state"][k], v, err_msg=k)
    k = next(k for k in silo["client_store"][0] if k.endswith("running_var"))
    assert not np.array_equal(silo["client_store"][0][k], silo["global_state"][k])


@pytest.mark.slow
def test_a_run_gives_its_workers_the_drivers_niceness_unless_told_otherwise():
    """Ray's default (15 added) would put the clients' training below every other job on the machine."""
    import json
    import os
    import subprocess
    import sys

    code = """
import json, os, ray
from rayfed_dg.config import load_config
from rayfed_dg.engine import init_ray

@ray.remote(num_cpus=0)
def nice():
    return os.nice(0)

out = [os.nice(0)]
for sets in ([], ["engine.worker_niceness=7"]):
    init_ray(load_config(None, sets))
    out.append(ray.get(nice.remote()))
    ray.shutdown()
print(json.dumps(out + [os.environ.get("RAY_worker_niceness")]))
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a new local Ray, not a running one
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    base, default, seven, left = json.loads(r.stdout.strip().splitlines()[-1])
    assert base < 12, "run the tests below niceness 12, or the +7 below cannot show"
    assert default == base and seven == base + 7 and left == os.environ.get("RAY_worker_niceness")


def test_joining_a_running_cluster_passes_no_worker_settings(monkeypatch):
    """ray.init refuses a _system_config when it joins a running cluster (RAY_ADDRESS, `ray start` on this
    machine): the niceness goes by the environment the raylet it starts would read, and only for that call."""
    import os

    import ray

    from rayfed_dg.engine import init_ray
    from rayfed_dg.engine.workers import resources

    seen = []
    monkeypatch.setattr(resources, "use_token_auth_if_available", lambda local=False: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append((kw, os.environ.get("RAY_worker_niceness"))))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setenv("RAY_worker_niceness", "3")
    init_ray(tiny_cfg("engine.worker_niceness=2"))
    (kw, during), = seen
    assert "_system_config" not in kw and during == "2" and os.environ["RAY_worker_niceness"] == "3"


def test_clients_per_round_may_be_every_client_but_not_more(tiny_ds):
    from rayfed_dg.engine.rounds.federation import clients_per_round
    from rayfed_dg.errors import ConfigError

    split = leave_one_domain_out(tiny_ds, "colour", 0.2, 0)
    n = split.num_clients
    assert clients_per_round(tiny_cfg(f"training.clients_per_round={n}"), split) == n
    assert clients_per_round(tiny_cfg(), split) == n  # None: every client
    with pytest.raises(ConfigError, match=f"training.clients_per_round={n + 1} exceeds the {n} clients"):
        clients_per_round(tiny_cfg(f"training.clients_per_round={n + 1}"), split)
