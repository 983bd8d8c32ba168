"""Client-drift correction: SCAFFOLD (ICML 2020), FedDyn (ICLR 2021), MOON
(CVPR 2021).  Hand computations on tiny tensors, what leaves a client, and
short deterministic and resumed runs on local Ray."""
import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_cfg, tiny_federation

from rayfed_dg.data import leave_one_domain_out
from rayfed_dg.engine import ClientRunner
from rayfed_dg.engine.workers.worker import to_numpy_state
from rayfed_dg.methods import ClientContext, ClientUpdate, build_method
from rayfed_dg.methods.moon import model_contrastive_loss, representation
from rayfed_dg.methods.scaffold import effective_steps, flat, trainable


def _ctx(round=1, client=0, payload=None):
    return ClientContext(client_id=client, round=round, device=torch.device("cpu"),
                         generator=torch.Generator().manual_seed(0), num_samples=8, payload=payload or {})


def _batches(n, seed=0, size=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 16, 16, generator=g), torch.arange(size) % 10) for _ in range(n)]


def _grad(model, x, y):
    """The CE gradient over the trainable parameters, flat, on a copy (train mode, as local training)."""
    m = copy.deepcopy(model).train()
    loss = F.cross_entropy(m(x), y)
    return flat(torch.autograd.grad(loss, [p for _, p in trainable(m)]))


def _update(client, payload=None, update=None):
    return ClientUpdate(client=client, num_samples=10, update=update or {}, private={}, payload=payload or {},
                        train_loss=0.0, seconds=0.0)


# ------------------------------------------------------------------ SCAFFOLD

def test_scaffold_one_sgd_step_and_option_ii_by_hand():
    """Algorithm 1 line 10 with K = 1: y = x - eta (g(x) + c - c_i); option II
    (line 12) then gives c_i+ = c_i - c + (x - y)/eta = g(x); Delta c_i =
    g(x) - c_i is the upload."""
    cfg = tiny_cfg("method.name=scaffold", "training.momentum=0", "training.weight_decay=0", "training.lr=0.1")
    method = build_method(cfg, 3)
    torch.manual_seed(0)
    model = method.build_model(10)
    n = method.numel
    ci = torch.randn(n) * 0.1
    c = torch.randn(n) * 0.1
    model.scaffold_ci.copy_(ci)
    x, y = _batches(1)[0]
    g = _grad(model, x, y)
    x0 = flat(p for _, p in trainable(model))
    ctx = _ctx(payload={"scaffold_c": c.numpy()})
    method.round_start(model, ctx)
    method.local_train(model, lambda: iter([(x, y)]), ctx)
    y1 = flat(p for _, p in trainable(model))
    assert torch.allclose(y1, x0 - 0.1 * (g + c - ci), atol=1e-6)
    assert torch.allclose(model.scaffold_ci, g, atol=1e-4)
    dc = method.upload_payload(model, ctx)["scaffold_dc"]
    assert dc.dtype == np.float32 and dc.shape == (n,)
    np.testing.assert_allclose(dc, (g - ci).numpy(), atol=1e-4)


def test_scaffold_option_ii_divides_by_the_rounds_own_learning_rate_under_a_schedule():
    """Under ``lr_schedule: cosine`` line 10 steps with round 3's eta_3 = 0.1 * (1 + cos(pi * 2/4)) / 2 = 0.05, and
    option II must divide (x - y) by that same eta_3: c_i+ = g(x) again.  Dividing by the configured 0.1 (the
    audit's mutant) halves c_i+."""
    cfg = tiny_cfg("method.name=scaffold", "training.momentum=0", "training.weight_decay=0", "training.lr=0.1",
                   "training.rounds=4", "training.lr_schedule=cosine")
    method = build_method(cfg, 3)
    torch.manual_seed(1)
    model = method.build_model(10)
    n = method.numel
    ci, c = torch.randn(n) * 0.1, torch.randn(n) * 0.1
    model.scaffold_ci.copy_(ci)
    x, y = _batches(1, seed=3)[0]
    g = _grad(model, x, y)
    x0 = flat(p for _, p in trainable(model))
    ctx = _ctx(round=3, payload={"scaffold_c": c.numpy()})
    method.round_start(model, ctx)
    method.local_train(model, lambda: iter([(x, y)]), ctx)
    assert torch.allclose(flat(p for _, p in trainable(model)), x0 - 0.05 * (g + c - ci), atol=1e-6)
    assert torch.allclose(model.scaffold_ci, g, atol=1e-4)
    np.testing.assert_allclose(method.upload_payload(model, ctx)["scaffold_dc"], (g - ci).numpy(), atol=1e-4)


def test_scaffold_with_momentum_keeps_option_ii_the_mean_gradient():
    """Heavy-ball SGD moves y by eta sum_j w_j (g_j + c - c_i), w_j =
    (1 - beta^(K-j+1))/(1 - beta): dividing by K_eff = sum_j w_j makes c_i+ the
    w-weighted mean of the gradients met along the path (the raw g_j are read
    by an optimizer hook registered before SCAFFOLD's correction)."""
    assert effective_steps(3, 0.0) == 3.0
    assert effective_steps(2, 0.5) == pytest.approx(2.5)  # w = (1.5, 1)
    assert effective_steps(3, 0.9) == pytest.approx(sum((1 - 0.9 ** (3 - j + 1)) / 0.1 for j in (1, 2, 3)))
    cfg = tiny_cfg("method.name=scaffold", "training.momentum=0.9", "training.weight_decay=0", "training.lr=0.05")
    method = build_method(cfg, 3)
    torch.manual_seed(1)
    model = method.build_model(10)
    n = method.numel
    model.scaffold_ci.copy_(torch.randn(n) * 0.05)
    c = torch.randn(n) * 0.05
    seen: list[torch.Tensor] = []
    make = method.make_optimizer

    def recording(model_, round_=1, params=None):
        opt = make(model_, round_, params)
        opt.register_step_pre_hook(lambda o, a, k: seen.append(flat(p.grad for p in o.param_groups[0]["params"])))
        return opt

    method.make_optimizer = recording
    batches = _batches(3, seed=2)
    ctx = _ctx(payload={"scaffold_c": c.numpy()})
    method.local_train(model, lambda: iter(batches), ctx)
    assert len(seen) == 3
    w = [(1 - 0.9 ** (3 - j + 1)) / 0.1 for j in (1, 2, 3)]
    expect = sum(wj * g for wj, g in zip(w, seen)) / sum(w)
    assert torch.allclose(model.scaffold_ci, expect, atol=1e-4)


def test_scaffold_server_control_variate_by_hand():
    """Line 17 over two rounds, N = 4: c <- c + (|S|/N) mean_S Delta c_i over
    an unweighted reduce; c goes down as float32.  Line 16 (x) is the server
    optimizer's step (tests/test_server_opt.py)."""
    method = build_method(tiny_cfg("method.name=scaffold"), 4)
    model = method.build_model(10)
    n = method.numel
    x = to_numpy_state(model.state_dict(), model.state_dict().keys())
    assert np.array_equal(method.aggregation_weights([0, 3], np.array([10, 90]), {}), [1.0, 1.0])
    assert method.assembles(model) == set()
    state: dict = {}
    down = method.server_payloads(1, [1, 3], state, np.random.default_rng(0), x, {})
    assert sorted(down) == [1, 3] and np.array_equal(down[1]["scaffold_c"], np.zeros(n, np.float32))
    rng = np.random.default_rng(1)
    dc1, dc3, dc0 = (rng.normal(size=n).astype(np.float32) for _ in range(3))
    method.after_round(1, [_update(1, {"scaffold_dc": dc1}), _update(3, {"scaffold_dc": dc3})], state)
    c1 = (dc1.astype(np.float64) + dc3) / 4  # (2/4) * mean of two
    np.testing.assert_allclose(state["scaffold_c"], c1, rtol=1e-12)
    down = method.server_payloads(2, [0], state, np.random.default_rng(0), x, {})
    assert down[0]["scaffold_c"].dtype == np.float32
    np.testing.assert_allclose(down[0]["scaffold_c"], c1.astype(np.float32))
    method.after_round(2, [_update(0, {"scaffold_dc": dc0})], state)
    np.testing.assert_allclose(state["scaffold_c"], c1 + dc0.astype(np.float64) / 4, rtol=1e-12)


def test_scaffold_refuses_adam():
    from rayfed_dg.errors import ConfigError

    with pytest.raises(ConfigError, match="training.optimizer=adam"):
        tiny_cfg("method.name=scaffold", "training.optimizer=adam")


# ------------------------------------------------------------------ FedDyn

def test_feddyn_dynamic_regularizer_gradient_by_hand():
    """grad of L(theta) - <grad_k, theta> + alpha/2 ||theta - theta^{t-1}||^2 is
    grad L(theta) - grad_k + alpha (theta - theta^{t-1})."""
    method = build_method(tiny_cfg("method.name=feddyn", "method.alpha=0.3"), 3)
    torch.manual_seed(2)
    model = method.build_model(10)
    n = method.numel
    gk = torch.randn(n) * 0.2
    model.feddyn_grad.copy_(gk)
    ctx = _ctx()
    method.round_start(model, ctx)
    theta0 = flat(p for _, p in trainable(model))
    with torch.no_grad():
        for _, p in trainable(model):
            p.add_(torch.randn_like(p) * 0.05)
    theta = flat(p for _, p in trainable(model))
    model.eval()  # fixed BN statistics: the same forward for the loss and the plain CE
    x, y = _batches(1, seed=3)[0]
    params = [p for _, p in trainable(model)]
    got = flat(torch.autograd.grad(method.loss(model, x, y, ctx), params))
    ce = flat(torch.autograd.grad(F.cross_entropy(model(x), y), params))
    assert torch.allclose(got, ce - gk + 0.3 * (theta - theta0), atol=1e-5)
    # the value: the constant <grad_k, theta^{t-1}> is left out
    val = method.loss(model, x, y, ctx).item()
    expect = F.cross_entropy(model(x), y).item() - float(gk @ (theta - theta0)) + 0.15 * float(
        ((theta - theta0) ** 2).sum())
    assert val == pytest.approx(expect, abs=1e-5)


def test_feddyn_client_state_update_by_hand():
    """After local training grad_k <- grad_k - alpha (theta_k^t - theta^{t-1})."""
    method = build_method(tiny_cfg("method.name=feddyn", "method.alpha=0.2"), 3)
    torch.manual_seed(3)
    model = method.build_model(10)
    gk = torch.randn(method.numel) * 0.1
    model.feddyn_grad.copy_(gk)
    theta0 = flat(p for _, p in trainable(model))
    ctx = _ctx()
    method.round_start(model, ctx)
    method.local_train(model, lambda: iter(_batches(2, seed=4)), ctx)
    theta1 = flat(p for _, p in trainable(model))
    assert not torch.allclose(theta1, theta0)
    assert torch.allclose(model.feddyn_grad, gk - 0.2 * (theta1 - theta0), atol=1e-6)


def test_feddyn_server_h_and_model_over_two_rounds_by_hand():
    """m = 3, alpha = 0.1.  Round 1, P = {0, 1}; round 2, P = {2}:
    h^t = h^{t-1} - alpha (1/m) sum_P (theta_k^t - theta^{t-1}),
    theta^t = mean_P theta_k^t - h^t / alpha (unweighted mean)."""
    method = build_method(tiny_cfg("method.name=feddyn", "method.alpha=0.1"), 3)
    method.build_model(10)
    method.param_keys = ["w"]  # the server arithmetic on one made-up parameter
    assert np.array_equal(method.aggregation_weights([0, 1], np.array([5, 50]), {}), [1.0, 1.0])
    state: dict = {}
    th0 = {"w": np.array([1.0, 2.0], np.float32), "bn": np.array([7.0], np.float32)}
    assert method.assembles(None) == {"w"}  # a server optimizer would have nothing to step
    t0, t1 = np.array([1.5, 2.0]), np.array([0.5, 3.0])
    mean1 = {"w": ((t0 + t1) / 2).astype(np.float32), "bn": np.array([8.0], np.float32)}
    got1 = method.assemble_global(1, [_update(0), _update(1)], mean1, th0, state)
    h1 = -0.1 / 3 * ((t0 - th0["w"]) + (t1 - th0["w"]))  # = [0, -1/30]
    np.testing.assert_allclose(state["feddyn_h"]["w"], h1, rtol=1e-12)
    th1 = (t0 + t1) / 2 - h1 / 0.1  # = [1, 2.5] + [0, 1/3]
    assert sorted(got1) == ["w"] and got1["w"].dtype == np.float32
    np.testing.assert_allclose(got1["w"], th1, rtol=1e-6)
    g1 = dict(mean1, w=got1["w"])
    t2 = np.array([0.0, 4.0])
    got2 = method.assemble_global(2, [_update(2)], {"w": t2.astype(np.float32), "bn": g1["bn"]}, g1, state)
    h2 = h1 - 0.1 / 3 * (t2 - got1["w"].astype(np.float64))
    np.testing.assert_allclose(state["feddyn_h"]["w"], h2, rtol=1e-6)
    np.testing.assert_allclose(got2["w"], t2 - h2 / 0.1, rtol=1e-6)


# ------------------------------------------------------------------ MOON

def test_moon_contrastive_loss_on_hand_picked_vectors():
    """Eq. 1 with tau = 0.5: sample 1 has sim(z, z_glob) = 1, sim(z, z_prev) = 0,
    sample 2 has 1/sqrt 2 and -1/sqrt 2."""
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    z_glob = torch.tensor([[2.0, 0.0], [1.0, 0.0]])
    z_prev = torch.tensor([[0.0, 3.0], [-1.0, 0.0]])
    l1 = -math.log(math.exp(2.0) / (math.exp(2.0) + math.exp(0.0)))
    s = 1 / math.sqrt(2)
    l2 = -math.log(math.exp(s / 0.5) / (math.exp(s / 0.5) + math.exp(-s / 0.5)))
    assert model_contrastive_loss(z, z_glob, z_prev, 0.5).item() == pytest.approx((l1 + l2) / 2, rel=1e-6)
    # the positive pair is the global model's: swapping them raises the loss
    assert model_contrastive_loss(z, z_prev, z_glob, 0.5).item() > (l1 + l2) / 2


def test_moon_loss_reads_the_projection_and_skips_the_term_at_first_participation():
    """loss = CE(output(z), y) + mu * l_con(z, z_glob, z_prev), z the projection
    head's output (out_dim wide) of the model being trained, z_glob of the
    frozen global copy taken at round start, z_prev of the client's previous
    model; on a client's first round (no previous model) loss = CE."""
    method = build_method(tiny_cfg("method.name=moon", "method.mu=5", "method.out_dim=12"), 3)
    torch.manual_seed(4)
    model = method.build_model(10)
    assert model.head.cls.in_features == 12 and model.head.proj[2].out_features == 12
    x, y = _batches(1, seed=5)[0]
    first = _ctx()
    method.round_start(model, first)
    assert "glob" not in first.scratch
    model.eval()
    assert method.loss(model, x, y, first).item() == pytest.approx(F.cross_entropy(model(x), y).item(), abs=1e-6)
    # a client that trained in round 1 (its previous model differs from the global one)
    with torch.no_grad():
        for p in model.moon_prev.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.moon_round.fill_(1)
    ctx = _ctx(round=2)
    method.round_start(model, ctx)
    glob = ctx.scratch["glob"]
    assert glob.moon_prev is None and not any(p.requires_grad for p in glob.parameters())
    with torch.no_grad():  # the model trains on; the snapshot stays w^t
        for p in model.head.cls.parameters():
            p.add_(0.1)
    model.eval()
    model.moon_prev.eval()
    z = model.head.proj(model.features(x))
    z_glob = representation(glob, x)
    z_prev = representation(model.moon_prev, x)
    cos = torch.nn.functional.cosine_similarity
    pos, neg = cos(z, z_glob, dim=-1) / 0.5, cos(z, z_prev, dim=-1) / 0.5
    l_con = (-(pos.exp() / (pos.exp() + neg.exp())).log()).mean()
    expect = F.cross_entropy(model.head.cls(z), y) + 5 * l_con
    assert l_con.item() > 0.01
    assert method.loss(model, x, y, ctx).item() == pytest.approx(expect.item(), abs=1e-5)


def test_moon_previous_model_is_the_clients_own_and_private(tiny_ds):
    """The client's trained model becomes its private previous model (never in
    the upload); on the first participation mu does not matter (no negative
    pair), from the second it does."""
    split = leave_one_domain_out(tiny_ds, "texture", 0.2, 0)

    def client(mu, rounds):
        cfg = tiny_cfg("method.name=moon", f"method.mu={mu}", "training.local_steps=2", "training.batch_size=16")
        runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, 10, split.num_clients)
        g = to_numpy_state(runner.model.state_dict(), runner.model.state_dict().keys())
        local, outs = {}, []
        for r in range(1, rounds + 1):
            upd = runner.run_client(0, r, split.clients[0], g, local)
            local = dict(upd.private)
            outs.append(upd)
        return outs

    a = client(0.0, 2)
    b = client(5.0, 2)
    up = a[0].update
    assert not any(k.startswith("moon_prev.") or k == "moon_round" for k in up)
    assert sorted(a[0].private) == sorted([f"moon_prev.{k}" for k in up] + ["moon_round"])
    assert all(np.array_equal(a[0].private[f"moon_prev.{k}"], v) for k, v in up.items())
    assert int(a[0].private["moon_round"]) == 1 and int(a[1].private["moon_round"]) == 2
    assert all(np.array_equal(a[0].update[k], b[0].update[k]) for k in up)  # round 1: l_con absent
    assert any(not np.array_equal(a[1].update[k], b[1].update[k]) for k in up)  # round 2: present


# ------------------------------------------------------------------ on local Ray: what leaves a client

def _server_run(ray, host, cfg, ds, rounds, strategy="per_domain", clients=None):
    split = leave_one_domain_out(ds, "texture", 0.2, 0, strategy, clients) if clients else \
        leave_one_domain_out(ds, "texture", 0.2, 0)
    server = host(ds, 1).open(cfg, split, ds.num_classes)
    outs = [ray.get(server.run_round.remote()) for _ in range(rounds)]
    state = ray.get(server.get_state.remote())
    bcast = ray.get(server.current.remote()).broadcast_state()
    return split, outs, state, bcast


def _check_uploads(outs, keys, private, payload_up, payload_down, nbytes):
    """Per sampled client and round: the model tensors up are exactly the
    non-private ones, and the only payloads are the named ones, each ``nbytes``."""
    for out in outs:
        assert not out.dropped
        for c in out.sampled:
            rows = [r for r in out.ledger if r.client == c]
            up = [r for r in rows if r.direction == "up" and not r.group.startswith("payload:")]
            assert sum(r.tensors for r in up) == len(keys) - len(private)
            for direction, names in (("up", payload_up), ("down", payload_down)):
                pay = {r.group: r.bytes for r in rows if r.direction == direction
                       and r.group.startswith("payload:")}
                assert pay == {f"payload:{n}": nbytes for n in names}, (direction, pay)


@pytest.mark.slow
def test_scaffold_ci_never_leaves_the_client_and_c_is_the_mean_of_all(ray_session, tiny_ds, engine_host):
    """6 clients, 3 per round, 2 rounds: c_i is neither broadcast nor uploaded
    (only Delta c_i, and c down, each one float32 vector); the server's c is
    (1/N) sum over all N clients of c_i (0 for a client never sampled)."""
    cfg = tiny_cfg("method.name=scaffold", "partition.strategy=single_domain", "partition.num_clients=6",
                   "training.clients_per_round=3", "training.local_steps=3", "training.batch_size=16")
    split, outs, state, bcast = _server_run(ray_session, engine_host, cfg, tiny_ds, 2, "single_domain", 6)
    method = build_method(cfg, 6)
    model = method.build_model(10)
    n = method.numel
    _check_uploads(outs, model.state_dict(), {"scaffold_ci"}, ["scaffold_dc"], ["scaffold_c"], 4 * n)
    assert "scaffold_ci" not in bcast
    assert not state["global_state"]["scaffold_ci"].any()  # nobody uploads it
    seen = sorted({c for o in outs for c in o.sampled})
    assert 3 < len(seen) < 6  # partial participation: some client never sampled
    store = state["client_store"]
    cis = [store[c]["scaffold_ci"] if c in store else np.zeros(n, np.float32) for c in range(6)]
    assert all(np.abs(cis[c]).sum() > 0 for c in seen)
    np.testing.assert_allclose(state["server_state"]["scaffold_c"], np.mean(cis, 0), atol=1e-6)


@pytest.mark.slow
def test_feddyn_grad_never_leaves_the_client_and_h_is_their_mean(ray_session, tiny_ds, engine_host):
    """FedDyn sends nothing but the model; grad_k stays on the client; the
    server's h equals (1/m) sum_k grad_k over all m clients."""
    cfg = tiny_cfg("method.name=feddyn", "method.alpha=0.1", "partition.strategy=single_domain",
                   "partition.num_clients=6", "training.clients_per_round=3", "training.local_steps=3",
                   "training.batch_size=16")
    split, outs, state, bcast = _server_run(ray_session, engine_host, cfg, tiny_ds, 2, "single_domain", 6)
    method = build_method(cfg, 6)
    model = method.build_model(10)
    _check_uploads(outs, model.state_dict(), {"feddyn_grad"}, [], [], 0)
    assert "feddyn_grad" not in bcast and not state["global_state"]["feddyn_grad"].any()
    store = state["client_store"]
    grads = [store[c]["feddyn_grad"] if c in store else np.zeros(method.numel, np.float32) for c in range(6)]
    h = state["server_state"]["feddyn_h"]
    np.testing.assert_allclose(np.concatenate([h[k].ravel() for k in method.param_keys]), np.mean(grads, 0),
                               atol=1e-6)
    assert np.abs(np.mean(grads, 0)).sum() > 0


@pytest.mark.slow
def test_moon_previous_model_never_leaves_the_client(ray_session, tiny_ds, engine_host):
    cfg = tiny_cfg("method.name=moon", "training.local_steps=3", "training.batch_size=16")
    split, outs, state, bcast = _server_run(ray_session, engine_host, cfg, tiny_ds, 2)
    from rayfed_dg.seeding import Stream, seed_int

    method = build_method(cfg, split.num_clients)
    torch.manual_seed(seed_int(cfg.training.seed, Stream.INIT))  # the server's initial model
    model = method.build_model(10)
    private = method.private_keys(model)
    _check_uploads(outs, model.state_dict(), private, [], [], 0)
    assert not private & set(bcast)
    init = model.state_dict()
    assert all(np.array_equal(state["global_state"][k], init[k].numpy()) for k in private)
    for c in range(split.num_clients):
        assert int(state["client_store"][c]["moon_round"]) == 2
    k = "moon_prev.head.cls.weight"
    assert not np.array_equal(state["client_store"][0][k], state["client_store"][1][k])


# ------------------------------------------------------------------ end to end

def _federation(ray, ds, name, *extra, run_dir=None, stop_after=None, host=None):
    return tiny_federation(ds, "texture", f"method.name={name}", "training.local_steps=3", "training.batch_size=16",
                           *extra, run_dir=run_dir, stop_after=stop_after, host=host)


def _key(res):
    return [(m["round"], m["split"], m["domain"], m["client"], m["accuracy"], m["loss"]) for m in res.metrics]


PARTIAL = {"scaffold": ["training.clients_per_round=2"], "feddyn": ["training.clients_per_round=2"], "moon": []}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_two_rounds_end_to_end_are_deterministic(ray_session, tiny_ds, engine_host, name):
    """Two rounds (2 of the 3 clients per round for SCAFFOLD and FedDyn) on one
    and on two workers: the same metrics and ledger, finite losses."""
    a = _federation(ray_session, tiny_ds, name, *PARTIAL[name], "engine.num_workers=1", host=engine_host(tiny_ds, 1))
    b = _federation(ray_session, tiny_ds, name, *PARTIAL[name], "engine.num_workers=2", host=engine_host(tiny_ds, 2))
    assert a.rounds_done == 2 and all(np.isfinite(m["loss"]) for m in a.metrics)
    assert _key(a) == _key(b) and a.ledger == b.ledger
    if PARTIAL[name]:
        assert {len({r["client"] for r in a.clients if r["round"] == t}) for t in (1, 2)} == {2}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["scaffold", "feddyn"])
def test_resumed_run_equals_the_uninterrupted_one(ray_session, tiny_ds, engine_host, tmp_path, name):
    """Stopped after round 1 and resumed from its checkpoint (server control
    variate / h, every client's c_i / grad_k), three rounds of 2 of 3 clients
    give the uninterrupted run's numbers.  The resumed run starts actors of
    its own, as a resume in a new process does: it has only the checkpoint."""
    extra = ("training.rounds=3", "training.clients_per_round=2", "output.checkpoint_every=1")
    host = engine_host(tiny_ds, 2)
    clean = _federation(ray_session, tiny_ds, name, *extra, run_dir=tmp_path / "clean", host=host)
    cut = _federation(ray_session, tiny_ds, name, *extra, run_dir=tmp_path / "cut", stop_after=1, host=host)
    assert cut.rounds_done == 1
    resumed = _federation(ray_session, tiny_ds, name, *extra, run_dir=tmp_path / "cut")
    assert resumed.rounds_done == 3
    assert _key(resumed) == _key(clean) and resumed.ledger == clean.ledger
