"""FedOMG's aggregation part (engine/aggregation/omg.py; Nguyen et al., ICLR
2025): the solver's steps by hand (finite differences, small vectors), the
whole solver against the reference's loop written here in torch autograd, the
estimator on hand-made uploads, a server round whose global model is
recomputed from the clients' uploads, the ledger against plain FedAvg, and the
refusals in one line."""
import numpy as np
import pytest
import torch
from conftest import tiny_cfg, tiny_federation
from test_robust import round_one, uploads

from rayfed_dg.config import load_config
from rayfed_dg.engine.aggregation.omg import FedOMG, omg_weights
from rayfed_dg.engine.aggregation.pipeline import Uploads
from rayfed_dg.engine.rounds.parts import check_pipeline
from rayfed_dg.errors import ConfigError


def server(**kw):
    return load_config(None, ["server.aggregator=fedomg", *(f"server.{k}={v}" for k, v in kw.items())]).server


def by_hand(D: np.ndarray, kappa: float, steps: int, lr: float, mu: float, last: bool = False) -> np.ndarray:
    """g of FedOMG for the weighted updates D (rows d_i), step by step in
    NumPy: the objective as written in the paper's code, its gradient by
    central differences, SGD with momentum, the best iterate (``last``: the
    last one instead), lambda."""
    m = D.shape[0]
    GG = D @ D.T
    s = np.mean(np.sqrt(np.diag(GG) + 1e-4))
    GG = GG / s ** 2
    Gg = GG.mean(axis=1)
    c = np.sqrt(Gg.mean() + 1e-4) * kappa

    def F(w):
        a = np.exp(w) / np.exp(w).sum()
        return a @ Gg + c * np.sqrt(a @ GG @ a + 1e-4)

    def dF(w, h=1e-6):
        return np.array([(F(w + h * e) - F(w - h * e)) / (2 * h) for e in np.eye(m)])

    w, buf, best, w_best = np.zeros(m), None, np.inf, None
    for i in range(steps + 1):
        if F(w) < best or (last and i == steps):
            best, w_best = F(w), w.copy()
        if i < steps:
            buf = dF(w) if buf is None else mu * buf + dF(w)
            w = w - lr * buf
    a = np.exp(w_best) / np.exp(w_best).sum()
    lam = c / (np.sqrt(a @ GG @ a + 1e-4) + 1e-4)
    return ((1 / m + lam * a)[:, None] * D).sum(axis=0) / (1 + kappa ** 2)


def reference_loop(D: np.ndarray, kappa=0.5, steps=20, lr=25.0, mu=0.5) -> np.ndarray:
    """The reference's ``OMG`` (FedOMG-DG/algorithms/FedOMG/utils/fed_merge.py) re-typed in
    torch autograd and torch.optim.SGD, in float64, with num_tasks = m."""
    grads = torch.tensor(D, dtype=torch.float64)
    m = grads.shape[0]
    GG = grads.mm(grads.t())
    scale = (torch.diag(GG) + 1e-4).sqrt().mean()
    GG = GG / scale.pow(2)
    Gg = GG.mean(1, keepdim=True)
    gg = Gg.mean(0, keepdim=True)
    w = torch.zeros(m, 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([w], lr=lr, momentum=mu)
    c = (gg + 1e-4).sqrt() * kappa
    w_best, obj_best = None, np.inf
    for i in range(steps + 1):
        opt.zero_grad()
        ww = torch.softmax(w, 0)
        obj = ww.t().mm(Gg) + c * (ww.t().mm(GG).mm(ww) + 1e-4).sqrt()
        if obj.item() < obj_best:
            obj_best, w_best = obj.item(), w.detach().clone()
        if i < steps:
            obj.backward()
            opt.step()
    ww = torch.softmax(w_best, 0)
    lmbda = c.view(-1) / ((ww.t().mm(GG).mm(ww) + 1e-4).sqrt() + 1e-4)
    return (((1 / m + ww * lmbda).view(-1, 1) * grads).sum(0) / (1 + kappa ** 2)).numpy()


D2 = np.array([[3.0, 0.0, 1.0], [1.0, 1.0, -2.0]])


@pytest.mark.parametrize("steps", [0, 1, 2, 3])
def test_a_few_solver_steps_by_hand(steps):
    """Two clients, small vectors: lr 0.5 (so the iterates move but do not
    jump), momentum 0.5, kappa 0.5; the gradient taken by differences."""
    alpha = omg_weights(D2 @ D2.T, 0.5, steps, 0.5, 0.5)
    np.testing.assert_allclose(alpha @ D2, by_hand(D2, 0.5, steps, 0.5, 0.5), rtol=1e-7, atol=1e-9)


def test_the_best_iterate_is_taken_not_the_last():
    """At the default lr 25 the iterates of D2 overshoot: F is lowest after the first step."""
    g = omg_weights(D2 @ D2.T, 0.5, 20, 25.0, 0.5) @ D2
    np.testing.assert_allclose(g, by_hand(D2, 0.5, 20, 25.0, 0.5), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(g, by_hand(D2, 0.5, 1, 25.0, 0.5), rtol=1e-6, atol=1e-9)  # the best: w_1
    assert not np.allclose(g, by_hand(D2, 0.5, 20, 25.0, 0.5, last=True), rtol=1e-3)


def test_the_solver_moves_and_its_step_count_and_momentum_matter():
    g = {(t, mu): omg_weights(D2 @ D2.T, 0.5, t, 0.5, mu) for t in (0, 1, 3) for mu in (0.0, 0.5)}
    assert not np.allclose(g[0, 0.5], g[1, 0.5]) and not np.allclose(g[1, 0.5], g[3, 0.5])
    assert np.allclose(g[1, 0.0], g[1, 0.5]) and not np.allclose(g[3, 0.0], g[3, 0.5])  # momentum from step 2
    # kappa 0: lambda = 0, the plain mean of the weighted updates
    np.testing.assert_allclose(omg_weights(D2 @ D2.T, 0.0, 20, 25.0, 0.5), [0.5, 0.5], rtol=0, atol=0)


@pytest.mark.parametrize("seed, m", [(0, 3), (1, 2), (2, 5)])
def test_the_default_solver_is_the_reference_loop(seed, m):
    """20 steps, lr 25, momentum 0.5, kappa 0.5 against the reference's loop in torch."""
    D = np.random.default_rng(seed).normal(size=(m, 11)) * np.array([1.0, 3.0, 0.2, 1.0, 2.0][:m])[:, None]
    alpha = omg_weights(D @ D.T, 0.5, 20, 25.0, 0.5)
    np.testing.assert_allclose(alpha @ D, reference_loop(D), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(alpha @ D, by_hand(D, 0.5, 20, 25.0, 0.5), rtol=1e-5, atol=1e-8)


X = {"w": np.zeros(3, np.float32), "b": np.array([1.0, -1.0], np.float32), "run": np.ones(2, np.float32),
     "n": np.array(4, np.int64), "nobody": np.full(2, 7.0, np.float32)}
Y = {0: {"w": [3.0, 0.0, 1.0], "b": [2.0, -1.0], "run": [2.0, 0.0], "n": 6},
     1: {"w": [1.0, 1.0, -2.0], "b": [1.0, 0.0], "run": [4.0, 1.0], "n": 9},
     2: {"w": [0.0, -2.0, 0.5], "b": [0.0, -3.0], "run": [1.0, 5.0], "n": 7}}
SIZES = [1.0, 3.0, 2.0]


def omg_uploads(arrival=(0, 1, 2), weights=SIZES) -> Uploads:
    """The uploads of Y as the engine hands them over: ``updates`` filled in arrival order, ``order`` the clients'."""
    vals = {c: {k: np.asarray(v, X[k].dtype) for k, v in Y[c].items()} for c in arrival}
    u = uploads(vals, X, sorted(vals))
    u.weights = dict(enumerate(weights))
    return u


def test_the_estimator_by_hand_with_buffers_weights_and_the_global_lr():
    """Parameters w, b: x_t + eta_g g over the concatenated d_i = p_i (y_i - x_t);
    the buffers run (float) and n (integer): the weighted mean; nobody: x_t."""
    est = FedOMG(server(omg_global_lr=0.7), X)
    est.bind(["w", "b"])
    out = est.estimate(omg_uploads())
    p = np.array(SIZES) / sum(SIZES)
    flat = lambda y: np.concatenate([np.asarray(y["w"], float) - X["w"], np.asarray(y["b"], float) - X["b"]])  # noqa
    D = np.stack([pi * flat(Y[c]) for pi, c in zip(p, Y)])
    new = np.concatenate([X["w"], X["b"]]) + 0.7 * reference_loop(D)
    np.testing.assert_allclose(out["w"], new[:3].astype(np.float32), rtol=1e-6)
    np.testing.assert_allclose(out["b"], new[3:].astype(np.float32), rtol=1e-6)
    np.testing.assert_allclose(out["run"], (p[:, None] * np.array([Y[c]["run"] for c in Y])).sum(0), rtol=1e-6)
    assert out["n"] == 8 and out["n"].dtype == np.int64  # (6 + 27 + 14) / 6 = 7.83 -> 8
    np.testing.assert_array_equal(out["nobody"], X["nobody"])
    assert out["w"].dtype == np.float32


def test_kappa_zero_steps_eta_over_m_towards_the_weighted_mean():
    est = FedOMG(server(omg_kappa=0.0, omg_global_lr=0.9), X)
    est.bind(["w", "b"])
    out = est.estimate(omg_uploads())
    p = np.array(SIZES) / sum(SIZES)
    for k in ("w", "b"):
        mean = (p[:, None] * np.array([Y[c][k] for c in Y])).sum(0)
        np.testing.assert_allclose(out[k], X[k] + 0.9 / 3 * (mean - X[k]), rtol=1e-6, atol=1e-7)


def test_the_result_is_the_same_bits_in_any_upload_order():
    outs = set()
    for arrival in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        est = FedOMG(server(), X)
        est.bind(["w", "b"])
        outs.add(b"".join(v.tobytes() for _, v in sorted(est.estimate(omg_uploads(arrival)).items())))
    assert len(outs) == 1


def test_the_keys_are_refused_with_another_aggregator_in_one_line_and_left_out_of_the_dump():
    for k, v in (("omg_steps", 5), ("omg_lr", 1.0), ("omg_momentum", 0.9), ("omg_kappa", 0.2),
                 ("omg_global_lr", 1.0)):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"server.{k}={v}", "server.aggregator=median"])
        assert f"server.{k} applies to server.aggregator fedomg only (not median)" in str(e.value)
        assert "\n" not in str(e.value)
    assert not any(k.startswith("omg_") for k in load_config(None, []).to_dict()["server"])
    dumped = load_config(None, ["server.aggregator=fedomg", "server.omg_kappa=0.2"]).to_dict()["server"]
    assert dumped["omg_kappa"] == 0.2 and dumped["omg_steps"] == 20 and dumped["omg_lr"] == 25.0
    assert (dumped["omg_momentum"], dumped["omg_global_lr"]) == (0.5, 0.5)


def test_the_pipeline_takes_averaging_methods_and_refuses_the_rest():
    for method in ("fedavg", "fedsam", "gperxan", "fedbn", "feddg_ga"):
        check_pipeline(tiny_cfg("server.aggregator=fedomg", f"method.name={method}"))
    check_pipeline(tiny_cfg("server.aggregator=fedomg", "server.optimizer=fedadam"))

    def why(*sets):
        with pytest.raises(ConfigError) as e:
            check_pipeline(tiny_cfg("server.aggregator=fedomg", *sets))
        assert "\n" not in str(e.value)
        return str(e.value)

    assert why("method.name=feddyn").startswith("server.aggregator: method feddyn sets global tensors itself")
    assert why("method.name=fedgma").endswith("use server.aggregator mean")
    assert why("server.mode=fedbuff").startswith("server.aggregator=fedomg: server.mode=fedbuff combines")
    assert why("privacy.updates.clip=1.0", "privacy.updates.noise_multiplier=1.0").startswith(
        "server.aggregator=fedomg: privacy.updates adds noise")


def _want(g0, ups, params, sizes, kappa=0.5, lr_g=0.5):
    """Round 1's global model recomputed from the uploads: FedOMG over the parameters, the weighted mean else."""
    p = sizes / sizes.sum()
    keys = sorted(params)
    D = np.stack([pi * np.concatenate([(np.asarray(u[k], np.float64) - g0[k]).ravel() for k in keys])
                  for pi, u in zip(p, ups)])
    g, out, at = reference_loop(D, kappa=kappa), {}, 0
    for k in keys:
        n = g0[k].size
        out[k] = g0[k] + lr_g * g[at:at + n].reshape(g0[k].shape)
        at += n
    for k in set(g0) - set(keys):
        out[k] = sum(pi * np.asarray(u[k], np.float64) for pi, u in zip(p, ups))
        if np.issubdtype(g0[k].dtype, np.integer):
            out[k] = np.rint(out[k])
    return out


@pytest.mark.parametrize("sets", [(), ("server.optimizer=fedavgm", "server.momentum=0", "server.lr=0.5")],
                         ids=["fedomg", "fedomg_fedavgm"])
def test_a_server_round_is_fedomg_over_the_clients_uploads(ray_session, tiny_ds, engine_host, sets):
    """Round 1 on a server actor against the clients' uploads recomputed here
    (six clients, weights |D_i|); with FedAvgM at beta 0, eta 0.5 the
    parameters are x_t + 0.5 (FedOMG's estimate - x_t)."""
    g0, got, ups, params, sizes = round_one(ray_session, tiny_ds, engine_host, "server.aggregator=fedomg", *sets)
    want = _want(g0, ups, params, sizes)
    for k in g0:
        w = want[k]
        if sets and k in params:
            w = g0[k] + 0.5 * (w.astype(g0[k].dtype).astype(np.float64) - g0[k])
        np.testing.assert_allclose(got[k], w.astype(g0[k].dtype), rtol=1e-5, atol=1e-6, err_msg=k)
    assert any(not np.allclose(got[k], g0[k]) for k in params)


def test_the_ledger_shows_no_bytes_beyond_fedavgs_and_workers_do_not_matter(ray_session, tiny_ds, engine_host):
    """FedOMG reads the same uploads on the server: every ledger row (round,
    client, direction, bytes) is plain FedAvg's; the models differ.  On two
    workers FedOMG's metrics are the same as on one."""
    sets = ("training.rounds=2", "training.local_steps=2")
    plain = tiny_federation(tiny_ds, "texture", *sets, host=engine_host(tiny_ds, 1))
    omg = tiny_federation(tiny_ds, "texture", *sets, "server.aggregator=fedomg", host=engine_host(tiny_ds, 1))
    assert plain.ledger == omg.ledger and len(plain.ledger) > 0
    assert [m["loss"] for m in plain.metrics] != [m["loss"] for m in omg.metrics]
    two = tiny_federation(tiny_ds, "texture", *sets, "server.aggregator=fedomg", "engine.num_workers=2",
                          host=engine_host(tiny_ds, 2))
    assert two.metrics == omg.metrics and two.ledger == omg.ledger


@pytest.mark.parametrize("method", ["fedsam", "gperxan"])
def test_fedomg_composes_with_a_client_method_on_the_server(ray_session, tiny_ds, engine_host, method):
    """FedSAM + FedOMG and gPerXAN + FedOMG, round 1 on a server actor against
    the clients' uploads recomputed here: FedOMG matches the shared parameters
    only; gPerXAN's personal BN side (its ``local_keys``) is never matched and
    takes the weighted mean, like a buffer."""
    from rayfed_dg.methods import build_method

    g0, got, ups, params, sizes = round_one(ray_session, tiny_ds, engine_host, "server.aggregator=fedomg",
                                            f"method.name={method}")
    m = build_method(tiny_cfg(f"method.name={method}"), 6)
    local = m.local_keys(m.build_model(tiny_ds.num_classes))
    assert bool(local) == (method == "gperxan")
    want = _want(g0, ups, params - local, sizes)
    for k in g0:
        np.testing.assert_allclose(got[k], want[k].astype(g0[k].dtype), rtol=1e-5, atol=1e-6, err_msg=k)
    assert any(not np.allclose(got[k], g0[k]) for k in params - local)
