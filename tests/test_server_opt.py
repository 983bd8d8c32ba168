"""Server optimizers (engine/aggregation/server_opt.py): FedAvgM, FedAdagrad, FedYogi, FedAdam.

Hand-computed steps over two rounds; ``none`` is the plain average bit for
bit; the engine steps the global parameters only (buffers and a method's
local keys keep the average); a run is deterministic, differs from FedAvg
and resumes bit-identically (the optimizer's state is in the checkpoint);
a method that sets every parameter itself is refused with one line; the
optimizer composes with the keys a method assembles (``Federation.aggregate``);
SCAFFOLD's server step is FedAvgM's without momentum.
"""
import math

import numpy as np
import pytest
import torch
from conftest import tiny_cfg, tiny_federation

from rayfed_dg.config import ConfigError, load_config, method_variants, validate
from rayfed_dg.data import leave_one_domain_out
from rayfed_dg.engine import ClientRunner, Reducer
from rayfed_dg.engine.aggregation.server_opt import ServerOptimizer, stepped_keys
from rayfed_dg.engine.store.checkpoint import load_latest
from rayfed_dg.methods import build_method

ETA, B1, B2, TAU = 0.1, 0.5, 0.75, 0.5


def two_rounds(kind, eta=ETA, b1=B1, b2=B2, tau=TAU):
    """Round 1: x0 = [1, -1], Delta = [2, 0]; round 2: Delta = [-0.5, 2]. Also a
    float buffer, an integer buffer and a local key the optimizer must pass through."""
    x0 = {"w": np.array([1.0, -1.0]), "bn.running_mean": np.array([5.0]),
          "bn.num_batches_tracked": np.array(7, np.int64), "local.w": np.array([0.0])}
    opt = ServerOptimizer(kind, eta, b1, b2, tau, x0, ["w", "bn.num_batches_tracked"])
    v_init = {k: v.copy() for k, v in opt.v.items()}
    avg1 = {"w": x0["w"] + [2.0, 0.0], "bn.running_mean": np.array([6.0]),
            "bn.num_batches_tracked": np.array(9, np.int64), "local.w": np.array([3.0])}
    x1 = opt.step(x0, avg1)
    m1, v1 = opt.m["w"].copy(), {k: v.copy() for k, v in opt.v.items()}
    avg2 = dict(avg1, w=x1["w"] + [-0.5, 2.0])
    x2 = opt.step(x1, avg2)
    return opt, v_init, x1, m1, v1, x2, avg1


@pytest.mark.parametrize("kind,v1,v2", [
    # v_{-1} = tau^2 = 0.25
    ("fedadagrad", [0.25 + 4.0, 0.25 + 0.0], [4.25 + 0.25, 0.25 + 4.0]),
    # round 1: sign(0.25 - 4) = -1 and sign(0.25 - 0) = +1; round 2: sign(1.25 - 0.25) = +1, sign(0.25 - 4) = -1
    ("fedyogi", [0.25 + 0.25 * 4.0, 0.25 - 0.0], [1.25 - 0.25 * 0.25, 0.25 + 0.25 * 4.0]),
    ("fedadam", [0.75 * 0.25 + 0.25 * 4.0, 0.75 * 0.25], [0.75 * 1.1875 + 0.25 * 0.25, 0.75 * 0.1875 + 0.25 * 4.0]),
])
def test_adaptive_optimizers_two_rounds_by_hand(kind, v1, v2):
    opt, v_init, x1, m1, got_v1, x2, avg1 = two_rounds(kind)
    np.testing.assert_array_equal(v_init["w"], [0.25, 0.25])  # Algorithm 2: v_{-1} >= tau^2, we take tau^2
    # m_1 = 0.5 * 0 + 0.5 * [2, 0];  m_2 = 0.5 * [1, 0] + 0.5 * [-0.5, 2] = [0.25, 1]
    np.testing.assert_array_equal(m1, [1.0, 0.0])
    np.testing.assert_array_equal(opt.m["w"], [0.25, 1.0])
    np.testing.assert_allclose(got_v1["w"], v1, rtol=1e-15)
    np.testing.assert_allclose(opt.v["w"], v2, rtol=1e-15)
    # x_1 = x_0 + 0.1 m_1 / (sqrt(v_1) + 0.5): the second weight had Delta = 0, m = 0: it stays
    e1 = [1.0 + 0.1 * 1.0 / (math.sqrt(v1[0]) + 0.5), -1.0]
    np.testing.assert_allclose(x1["w"], e1, rtol=1e-14)
    e2 = [e1[0] + 0.1 * 0.25 / (math.sqrt(v2[0]) + 0.5), e1[1] + 0.1 * 1.0 / (math.sqrt(v2[1]) + 0.5)]
    np.testing.assert_allclose(x2["w"], e2, rtol=1e-14)
    # what it does not step keeps the average: buffers (integer or float) and keys it was not given
    for k in ("bn.running_mean", "bn.num_batches_tracked", "local.w"):
        assert x1[k] is avg1[k]
    assert opt.keys == ["w"] and opt.steps == 2


def test_first_moment_weighs_delta_by_one_minus_beta1_and_yogi_keeps_v_where_it_equals_delta_squared():
    """beta1 = 0.6 (not 0.5, where beta1 = 1 - beta1 would hide a swap): m_1 = 0.4 Delta.  FedYogi's
    v - (1 - beta2) Delta^2 sign(v - Delta^2) leaves v unchanged where v = Delta^2 exactly (sign 0)."""
    x0 = {"w": np.array([0.0, 0.0])}
    for kind in ("fedadam", "fedyogi", "fedadagrad"):
        opt = ServerOptimizer(kind, 0.1, 0.6, 0.75, 0.5, x0, ["w"])
        opt.step(x0, {"w": np.array([0.5, -2.0])})  # Delta^2 = [0.25, 4]: the first equals v_{-1} = tau^2
        np.testing.assert_allclose(opt.m["w"], [0.2, -0.8], rtol=1e-15)
        if kind == "fedyogi":
            np.testing.assert_array_equal(opt.v["w"], [0.25, 0.25 + 0.25 * 4.0])


def test_a_checkpoint_of_another_optimizer_or_other_tensors_is_refused():
    x0 = {"w": np.array([1.0]), "b": np.array([2.0])}
    opt = ServerOptimizer("fedadam", 0.1, 0.9, 0.99, 1e-3, x0, ["w", "b"])
    opt.step(x0, {"w": np.array([2.0]), "b": np.array([1.0])})
    state = opt.state_dict()
    same = ServerOptimizer("fedadam", 0.1, 0.9, 0.99, 1e-3, x0, ["w", "b"])
    same.load_state_dict(state)
    assert same.steps == 1 and same.m["w"][0] == opt.m["w"][0] and same.v["b"][0] == opt.v["b"][0]
    for other in (ServerOptimizer("fedyogi", 0.1, 0.9, 0.99, 1e-3, x0, ["w", "b"]),
                  ServerOptimizer("fedadagrad", 0.1, 0.9, 0.99, 1e-3, x0, ["w", "b"]),
                  ServerOptimizer("fedadam", 0.1, 0.9, 0.99, 1e-3, x0, ["w"]),
                  ServerOptimizer("fedadam", 0.1, 0.9, 0.99, 1e-3, x0, ["b"])):
        with pytest.raises(ValueError, match="does not match"):
            other.load_state_dict(state)
    adam_more_v = dict(state, v={"w": state["v"]["w"]})  # m over both tensors, v over one: refused too
    with pytest.raises(ValueError, match="does not match"):
        same.load_state_dict(adam_more_v)
    with pytest.raises(ValueError, match="does not match"):
        same.load_state_dict(dict(state, m={"w": state["m"]["w"]}))
    for extra in ("m", "v"):  # a tensor this run does not have, in one of the two moments
        with pytest.raises(ValueError, match="does not match"):
            same.load_state_dict(dict(state, **{extra: {**state[extra], "c": np.zeros(1)}}))
    avgm = ServerOptimizer("fedavgm", 0.1, 0.9, 0.99, 1e-3, x0, ["w", "b"])
    with pytest.raises(ValueError, match="does not match"):  # an adaptive state into FedAvgM (v: {} there)
        avgm.load_state_dict(state)


def test_stepped_keys_name_both_names_of_a_tied_parameter():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    net[1].weight = net[0].weight  # tied: one tensor, two state-dict keys, each averaged and stepped
    assert stepped_keys(net, set()) == ["0.bias", "0.weight", "1.bias", "1.weight"]


def test_fedavgm_two_rounds_by_hand():
    """Hsu et al.'s buffer without dampening, m = beta m + Delta, and x += eta m (eta 0.5, beta 0.5)."""
    x0 = {"w": np.array([1.0, 2.0])}
    opt = ServerOptimizer("fedavgm", 0.5, 0.5, 0.99, 1e-3, x0, ["w"])
    assert opt.v == {}  # no second moment
    x1 = opt.step(x0, {"w": np.array([3.0, 1.0])})  # Delta = [2, -1], m = [2, -1]
    np.testing.assert_array_equal(opt.m["w"], [2.0, -1.0])
    np.testing.assert_array_equal(x1["w"], [2.0, 1.5])  # [1 + 0.5 * 2, 2 - 0.5 * 1]
    x2 = opt.step(x1, {"w": np.array([3.0, 1.5])})  # Delta = [1, 0], m = 0.5 [2, -1] + [1, 0] = [2, -0.5]
    np.testing.assert_array_equal(opt.m["w"], [2.0, -0.5])
    np.testing.assert_array_equal(x2["w"], [3.0, 1.25])  # [2 + 0.5 * 2, 1.5 - 0.5 * 0.5]


def test_fedavgm_without_momentum_at_rate_one_is_the_average_bit_for_bit():
    rng = np.random.default_rng(0)
    x = {"w": rng.normal(size=1000).astype(np.float32)}
    avg = {"w": (x["w"] + rng.normal(scale=1e-3, size=1000)).astype(np.float32)}
    out = ServerOptimizer("fedavgm", 1.0, 0.0, 0.99, 1e-3, x, ["w"]).step(x, avg)
    assert out["w"].dtype == np.float32 and np.array_equal(out["w"], avg["w"])


def test_stepped_keys_are_the_global_parameters():
    cfg = tiny_cfg("method.name=gperxan")
    method = build_method(cfg, 3)
    model = method.build_model(10)
    local = method.local_keys(model)
    keys = set(stepped_keys(model, local))
    params = {n for n, _ in model.named_parameters()}
    assert keys == params - local and keys and local & params  # some BN-side parameters are local: not stepped
    assert not any(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in keys)


# ------------------------------------------------------------------ config

def test_config_defaults_ranges_and_compare_rows():
    s = load_config(None).server
    assert s.optimizer == "none"
    assert {o: load_config(None, [f"server.optimizer={o}"]).server.eta
            for o in ("fedavgm", "fedadam", "fedyogi", "fedadagrad")} == \
        {"fedavgm": 1.0, "fedadam": 1e-2, "fedyogi": 1e-2, "fedadagrad": 1e-1}
    assert load_config(None, ["server.optimizer=fedadam", "server.lr=0.03"]).server.eta == 0.03
    for bad in ("server.momentum=1", "server.beta2=-0.1", "server.tau=0", "server.lr=0", "server.optimizer=adam"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])
    cfg = validate({"server": {"tau": 0.01}, "compare": [{"name": "fedavg"},
                                                          {"name": "fedavg", "label": "adam",
                                                           "server": {"optimizer": "fedadam"}}]})
    rows = dict(method_variants(cfg))
    assert rows["fedavg"].server.optimizer == "none"
    assert rows["adam"].server.optimizer == "fedadam" and rows["adam"].server.tau == 0.01  # merged over the top level


def test_a_method_that_sets_every_parameter_itself_is_refused_in_one_line():
    for bad in (["method.name=csac"], ["method.name=feddyn"]):
        with pytest.raises(ConfigError) as e:
            load_config(None, [*bad, "server.optimizer=fedyogi"])
        msg = str(e.value)
        assert "\n" not in msg and bad[0].split("=")[1] in msg and "fedyogi" in msg
        load_config(None, bad)  # without a server optimizer it runs
    # averages (FedDG-GA reweights; COPA assembles local heads only; SCAFFOLD's step is FedAvgM's; CSAC's fedavg)
    for ok in ("gperxan", "feddg_ga", "copa", "scaffold"):
        load_config(None, [f"method.name={ok}", "server.optimizer=fedadam"])
    load_config(None, ["method.name=csac", "method.aggregation=fedavg", "server.optimizer=fedadam"])
    cfg = validate({"server": {"optimizer": "fedadam"}, "compare": [{"name": "fedavg"}, {"name": "csac"}]})
    with pytest.raises(ConfigError, match="compare \\(csac\\).*fedadam.*csac"):
        method_variants(cfg)


# ------------------------------------------------------------------ engine

TARGET = "colour"


@pytest.mark.slow
def test_engine_steps_parameters_and_averages_the_rest(ray_session, tiny_ds, engine_host):
    """One round of gPerXAN on a server with ``none`` and with FedAdam, against
    the clients' updates recomputed here: ``none`` is their plain average bit
    for bit; FedAdam moves each global parameter by Algorithm 2's first step
    and leaves buffers and gPerXAN's local (BN-side) keys at the average."""
    ray = ray_session
    states = {}
    for opt in ("none", "fedadam"):
        cfg = tiny_cfg("method.name=gperxan", "training.local_steps=2", f"server.optimizer={opt}")
        split = leave_one_domain_out(tiny_ds, TARGET, cfg.data.val_fraction, cfg.data.split_seed)
        server = engine_host(tiny_ds, 1).open(cfg, split, tiny_ds.num_classes)
        g0 = ray.get(server.get_state.remote())["global_state"]
        ray.get(server.run_round.remote())
        states[opt] = ray.get(server.get_state.remote())
    assert "server_optimizer" not in states["none"]
    method = build_method(cfg, split.num_clients)
    model = method.build_model(tiny_ds.num_classes)
    local = method.local_keys(model)
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, tiny_ds.num_classes, split.num_clients)
    ups = {c: runner.run_client(c, 1, split.clients[c], g0, {k: g0[k] for k in local}).update
           for c in range(split.num_clients)}
    red = Reducer(list(range(split.num_clients)), dict(enumerate(split.client_sizes().astype(float))))
    for c in ups:
        red.add(c, ups[c])
    avg = red.result(g0)
    for k in g0:
        np.testing.assert_array_equal(states["none"]["global_state"][k], avg[k], err_msg=k)
    got = states["fedadam"]["global_state"]
    params = {n for n, _ in model.named_parameters()}
    stepped = params - local
    for k in set(g0) - stepped:  # buffers, local keys: the plain average
        np.testing.assert_array_equal(got[k], avg[k], err_msg=k)
    # round 1 by hand: m = 0.1 D, v = 0.99 tau^2 + 0.01 D^2, x + 0.01 m / (sqrt(v) + 1e-3)
    for k in sorted(stepped):
        d = avg[k].astype(np.float64) - g0[k].astype(np.float64)
        expect = g0[k] + 0.01 * (0.1 * d) / (np.sqrt(0.99 * 1e-6 + 0.01 * d * d) + 1e-3)
        np.testing.assert_allclose(got[k], expect, rtol=1e-6, atol=1e-7, err_msg=k)
    k = "head.weight"
    assert k in stepped and not np.allclose(got[k], avg[k])  # the step is not the average
    np.testing.assert_allclose(states["fedadam"]["server_optimizer"]["m"][k],
                               0.1 * (avg[k].astype(np.float64) - g0[k]), rtol=1e-5, atol=1e-9)


def federation(ray, ds, run_dir, *sets, on_round=None, host=None):
    return tiny_federation(ds, TARGET, "training.rounds=3", "training.local_steps=3", "output.checkpoint_every=1",
                           *sets, run_dir=run_dir, on_round=on_round, host=host)


class Killed(Exception):
    pass


def weights(run_dir):
    return torch.load(run_dir / f"final_{TARGET}.pt", weights_only=True)


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_fedadam_run_is_deterministic_and_differs_from_fedavg(ray_session, tiny_ds, engine_host, tmp_path):
    host = engine_host(tiny_ds, 2)
    runs = {name: federation(ray_session, tiny_ds, tmp_path / name, "training.rounds=2", *sets, host=host)
            for name, sets in [("fedavg", ()), ("adam1", ("server.optimizer=fedadam",)),
                               ("adam2", ("server.optimizer=fedadam",))]}
    assert runs["adam1"].metrics == runs["adam2"].metrics  # same seed, same numbers
    assert same_weights(weights(tmp_path / "adam1"), weights(tmp_path / "adam2"))
    assert not same_weights(weights(tmp_path / "adam1"), weights(tmp_path / "fedavg"))
    assert runs["adam1"].metrics != runs["fedavg"].metrics


@pytest.mark.slow
def test_resume_mid_run_equals_uninterrupted_gperxan_fedyogi(ray_session, tiny_ds, engine_host, tmp_path):
    """gPerXAN with FedYogi (the adaptive state and gPerXAN's client state both
    in the checkpoint), killed after round 2 of 3, then resumed on actors of
    its own, as in a new process: it has only the checkpoint."""
    sets = ("method.name=gperxan", "server.optimizer=fedyogi")
    host = engine_host(tiny_ds, 2)

    def kill_after_2(out, res):
        if out.round == 2:
            raise Killed

    with pytest.raises(Killed):
        federation(ray_session, tiny_ds, tmp_path / "killed", *sets, on_round=kill_after_2, host=host)
    assert not (tmp_path / "killed" / f"final_{TARGET}.pt").exists()
    resumed = federation(ray_session, tiny_ds, tmp_path / "killed", *sets)
    clean = federation(ray_session, tiny_ds, tmp_path / "clean", *sets, host=host)
    assert resumed.metrics == clean.metrics and len(clean.metrics) > 0
    assert same_weights(weights(tmp_path / "killed"), weights(tmp_path / "clean"))
    a, b = (load_latest(tmp_path / d / "checkpoints" / TARGET)["server"]["server_optimizer"]
            for d in ("killed", "clean"))
    assert a["steps"] == b["steps"] == 3
    for part in ("m", "v"):
        assert all(np.array_equal(a[part][k], b[part][k]) for k in b[part])


def test_scaffold_server_step_is_fedavgm_without_momentum():
    """SCAFFOLD's line 16, x <- x + eta_g (mean_S y_i - x), is FedAvgM with
    beta = 0 and eta = eta_g over the same tensors: by hand over two rounds
    (no momentum carried into round 2), and bit for bit against line 16 as
    SCAFFOLD computed it itself (float64, cast back) on random float32 models."""
    x0 = {"w": np.array([1.0, -2.0], np.float32)}
    opt = ServerOptimizer("fedavgm", 0.5, 0.0, 0.99, 1e-3, x0, ["w"])
    ys = [np.array([3.0, -2.0], np.float32), np.array([1.0, 2.0], np.float32)]  # two clients' models
    mean1 = {"w": ((ys[0].astype(np.float64) + ys[1]) / 2).astype(np.float32)}  # [2, 0]: the unweighted reduce
    x1 = opt.step(x0, mean1)
    np.testing.assert_array_equal(x1["w"], [1.5, -1.0])  # x + 0.5 (mean - x) = [1, -2] + 0.5 [1, 2]
    x2 = opt.step(x1, {"w": np.array([0.5, -1.0], np.float32)})
    np.testing.assert_array_equal(x2["w"], [1.0, -1.0])  # [1.5, -1] + 0.5 [-1, 0]: round 1's step not carried

    def line16(x, mean, eta):  # SCAFFOLD's own step as it was written before it became the server optimizer's
        return (x.astype(np.float64) + eta * (mean.astype(np.float64) - x)).astype(mean.dtype)

    rng = np.random.default_rng(0)
    for eta in (0.5, 1.7):
        x = {"w": rng.normal(size=1000).astype(np.float32)}
        opt = ServerOptimizer("fedavgm", eta, 0.0, 0.99, 1e-3, x, ["w"])
        for _ in range(3):
            mean = {"w": (x["w"] + rng.normal(scale=1e-2, size=1000)).astype(np.float32)}
            new = opt.step(x, mean)
            np.testing.assert_array_equal(new["w"], line16(x["w"], mean["w"], eta))
            x = new


def test_scaffold_server_lr_is_refused_naming_the_server_optimizer():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["method.name=scaffold", "method.server_lr=0.5"])
    msg = str(e.value)
    assert "\n" not in msg and "server: {optimizer: fedavgm, momentum: 0, lr: 0.5}" in msg, msg
    # an old run directory's config.yaml holds the default, server_lr: 1.0 (no server step): it still reads
    assert load_config(None, ["method.name=scaffold", "method.server_lr=1.0"]).server.optimizer == "none"
    # dropping the old key keeps every other one, so a misspelt parameter beside it is still refused, whichever
    # side of "server_lr" its name sorts
    for typo in ("method.momentum=0.9", "method.weight=2"):
        with pytest.raises(ConfigError, match=typo.split(".")[1].split("=")[0]):
            load_config(None, ["method.name=scaffold", "method.server_lr=1.0", typo])
    cfg = load_config(None, ["method.name=scaffold", "server.optimizer=fedavgm", "server.momentum=0", "server.lr=0.5"])
    method = build_method(cfg, 3)
    model = method.build_model(10)
    # the server optimizer steps exactly the parameters SCAFFOLD's line 16 moved (its c_i is a local buffer)
    assert stepped_keys(model, method.local_keys(model) | method.assembles(model)) == \
        sorted(n for n, p in model.named_parameters() if p.requires_grad)


def test_server_optimizer_steps_what_the_method_does_not_assemble(tiny_ds, monkeypatch):
    """A method that sets one parameter itself (from the previous global
    model) beside FedAvgM (beta 0, eta 0.5): that parameter is the method's,
    the other parameters take the half step, buffers the average; setting a
    key the method did not declare stops the round."""
    from rayfed_dg.engine.rounds.cohort import Cohort
    from rayfed_dg.engine.rounds.federation import Federation
    from rayfed_dg.errors import EngineError
    from rayfed_dg.methods import Method, base, register_method

    monkeypatch.setattr(base._REGISTRY, "_items", dict(base._REGISTRY._items))

    @register_method
    class OwnBias(Method):
        name = "own_head_bias"

        def assembles(self, model):
            return {"head.bias"}

        def assemble_global(self, round, results, average, previous, server_state):
            return {"head.bias": previous["head.bias"] + 1.0}

    cfg = tiny_cfg("method.name=own_head_bias", "server.optimizer=fedavgm", "server.momentum=0", "server.lr=0.5")
    split = leave_one_domain_out(tiny_ds, TARGET, cfg.data.val_fraction, cfg.data.split_seed)
    fed = Federation(cfg, split, tiny_ds.num_classes, 1)
    assert fed.pipeline.optimizer is not None and "head.bias" not in fed.pipeline.optimizer.keys and "head.weight" in fed.pipeline.optimizer.keys
    x0 = dict(fed.global_state)
    sampled = list(range(split.num_clients))
    red = fed.reducer(sampled)
    for c in sampled:  # client c moves every float tensor by c + 1
        red.add(c, {k: v + np.asarray(c + 1, v.dtype) if np.issubdtype(v.dtype, np.floating) else v
                    for k, v in x0.items()})
    sizes = split.client_sizes().astype(np.float64)
    delta = float(sizes @ (np.arange(len(sampled)) + 1.0) / sizes.sum())
    fed.aggregate(Cohort(1, sampled, sampled), red, {})
    g = fed.global_state
    np.testing.assert_allclose(g["head.weight"], x0["head.weight"] + 0.5 * delta, rtol=1e-6)  # stepped
    np.testing.assert_allclose(g["body.1.running_mean"], x0["body.1.running_mean"] + delta, rtol=1e-6)  # averaged
    np.testing.assert_array_equal(g["head.bias"], x0["head.bias"] + 1.0)  # the method's own
    red = fed.reducer(sampled)
    for c in sampled:
        red.add(c, g)
    monkeypatch.setattr(fed.method, "assemble_global", lambda *a: {"head.weight": g["head.weight"]})
    with pytest.raises(EngineError, match=r"own_head_bias: assemble_global set \['head.weight'\].*assembles"):
        fed.aggregate(Cohort(2, sampled, sampled), red, {})
