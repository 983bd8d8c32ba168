"""FedFD / FedFD-A (ECCV 2024): Eq. 2 mixing, Eq. 6-7 adapter, alternation, global statistics."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import server_rounds, tiny_cfg

from rayfed_dg.data import leave_one_domain_out
from rayfed_dg.engine import ClientRunner
from rayfed_dg.engine.rounds.federation import Federation
from rayfed_dg.engine.workers.worker import to_numpy_state
from rayfed_dg.methods import ClientContext, build_method
from rayfed_dg.methods.fedfd import FDBN, fd_layers, set_mode


def test_mixed_statistics_match_eq2_by_hand():
    m = FDBN(2).train()
    with torch.no_grad():
        m.weight.copy_(torch.tensor([2.0, 1.0]))
        m.bias.copy_(torch.tensor([0.5, -1.0]))
    m.g_mean.copy_(torch.tensor([1.0, -2.0]))
    m.g_var.copy_(torch.tensor([4.0, 0.25]))
    m.u = torch.tensor([0.25, 0.8])
    m.mode = "mix"
    x = torch.tensor([[[[1.0, 3.0], [5.0, 7.0]], [[0.0, 0.0], [2.0, 2.0]]]])  # (1, 2, 2, 2)
    y = m(x).detach()
    # channel 0: mu_inst = 4, var_inst = 5 -> sigma_inst = sqrt(5 + 1e-5); sigma_G = sqrt(4 + 1e-5)
    mu = 0.25 * 4 + 0.75 * 1.0
    sig = 0.25 * np.sqrt(5 + 1e-5) + 0.75 * np.sqrt(4 + 1e-5)
    assert abs(float(y[0, 0, 1, 1]) - (2.0 * (7.0 - mu) / sig + 0.5)) < 1e-5
    # channel 1: mu_inst = 1, var_inst = 1
    mu1 = 0.8 * 1 + 0.2 * -2.0
    sig1 = 0.8 * np.sqrt(1 + 1e-5) + 0.2 * np.sqrt(0.25 + 1e-5)
    assert abs(float(y[0, 1, 0, 0]) - (1.0 * (0.0 - mu1) / sig1 - 1.0)) < 1e-5
    before = m.running_mean.clone()
    m(x)
    assert torch.equal(m.running_mean, before)  # the augmented path leaves running statistics alone


def runner(ds, *sets):
    cfg = tiny_cfg(*sets)
    r = ClientRunner(cfg, ds.images, ds.labels, 10, 3)
    return cfg, r


def test_u_per_channel_in_range_and_new_each_iteration(tiny_ds):
    cfg, r = runner(tiny_ds, "method.name=fedfd", "method.u_low=0.2", "method.u_high=0.4")
    ctx = ClientContext(0, 1, torch.device("cpu"), torch.Generator().manual_seed(0), 10)
    draws = []
    for _ in range(3):
        r.method._draw_u(r.model, ctx)
        draws.append(torch.cat([m.u for m in fd_layers(r.model)]))
    for u in draws:
        assert (u >= 0.2).all() and (u <= 0.4).all() and u.std() > 0  # per channel, not one scalar
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    _, r0 = runner(tiny_ds, "method.name=fedfd", "method.u_fixed=0")
    r0.method._draw_u(r0.model, ctx)
    assert all((m.u == 0).all() for m in fd_layers(r0.model))


def test_alpha_in_unit_interval_and_deterministic_at_test(tiny_ds):
    cfg, r = runner(tiny_ds, "method.name=fedfda")
    model = r.model
    with torch.no_grad():  # a random adapter, so alpha is not the constant initial 0.5
        for m in fd_layers(model):
            for p in m.adapter.parameters():
                p.normal_(0, 2.0)
    x, _ = r._tensors(np.arange(16), None)
    model.train()
    set_mode(model, "adapt")
    for m in fd_layers(model):
        m.gen = torch.Generator().manual_seed(1)
    model(x)
    a_train = torch.cat([m.last_alpha for m in fd_layers(model)])
    assert (a_train >= 0).all() and (a_train <= 1).all() and 0 < (a_train == 0).float().mean() + (
        a_train == 1).float().mean() < 1  # the clamp bites, but not everywhere
    model.eval()
    y1, y2 = model(x), model(x)
    assert torch.equal(y1, y2)
    a_test = [m.last_alpha for m in fd_layers(model)]
    assert all(((a >= 0) & (a <= 1)).all() for a in a_test) and a_test[0].shape == (16,)  # one alpha per sample


def test_adapter_gets_gradient_only_in_its_phase(tiny_ds):
    cfg, r = runner(tiny_ds, "method.name=fedfda")
    model, method = r.model, r.method
    g = to_numpy_state(model.state_dict(), model.state_dict().keys())
    payload = method.server_payloads(1, [0], {}, None, g, {})[0]
    ctx = ClientContext(0, 1, torch.device("cpu"), torch.Generator().manual_seed(0), 32, payload=payload)
    method.round_start(model, ctx)
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if ".adapter." in n}
    main = {n: p.detach().clone() for n, p in model.named_parameters() if ".adapter." not in n}
    x, y = r._tensors(np.arange(32), None)
    model.train()
    for p in adapter:
        model.get_parameter(p).requires_grad_(False)
    method.main_loss(model, x, y, ctx).backward()
    assert all(model.get_parameter(n).grad is None for n in adapter)
    assert any(model.get_parameter(n).grad is not None for n in main)
    # a whole local step changes both groups, each by its own optimiser
    model.zero_grad(set_to_none=True)
    for p in adapter:
        model.get_parameter(p).requires_grad_(True)
    method.local_train(model, lambda: iter([(x, y)]), ctx)
    assert any(not torch.equal(model.get_parameter(n), v) for n, v in adapter.items())
    assert any(not torch.equal(model.get_parameter(n), v) for n, v in main.items())
    assert all(p.requires_grad for p in model.parameters())


def test_clients_use_the_servers_averaged_running_statistics(ray_session, tiny_ds):
    ray = ray_session
    cfg = tiny_cfg("method.name=fedfda", "training.rounds=1")
    split, (s1,), _ = server_rounds(ray, cfg, tiny_ds)
    g = s1["global_state"]
    n = split.client_sizes().astype(np.float64)
    k = "body.1.running_mean"
    avg = sum(n[c] * s1["client_store"][c][k].astype(np.float64) for c in range(3)) / n.sum()
    np.testing.assert_allclose(g[k], avg.astype(np.float32), rtol=1e-5, atol=1e-7)  # SiloBN base: averaged
    method = build_method(cfg, 3)
    payload = method.server_payloads(2, [0], {}, None, g, {})[0]
    _, r = runner(tiny_ds, "method.name=fedfda")
    ctx = ClientContext(0, 2, torch.device("cpu"), torch.Generator(), 10, payload=payload)
    r.method.round_start(r.model, ctx)
    layer = dict(r.model.named_modules())["body.1"]
    assert torch.equal(layer.g_mean, torch.from_numpy(np.array(g[k])))
    assert torch.equal(layer.g_var, torch.from_numpy(np.array(g["body.1.running_var"])))
    # the payload is exactly the running statistics: the bytes a FedAvg client gets for them
    stat_bytes = sum(v.nbytes for kk, v in g.items() if kk.endswith(("running_mean", "running_var")))
    assert payload["global_stats"].nbytes == stat_bytes


def test_client_side_selection_uploads_the_best_validated_iterate(tiny_ds):
    split = leave_one_domain_out(tiny_ds, "texture", 0.2, 0)
    train, val = split.clients[0], split.val[split.client_domains[0]]
    sets = ("method.name=fedfda", "method.lambda2=0.1", "training.local_steps=6")
    _, plain = runner(tiny_ds, *sets)
    _, sel = runner(tiny_ds, *sets, "method.select_every=2")
    g = to_numpy_state(plain.model.state_dict(), plain.model.state_dict().keys())
    pay = plain.method.server_payloads(1, [0], {}, None, g, {})[0]
    a = plain.run_client(0, 1, train, g, {}, pay)
    b = sel.run_client(0, 1, train, g, {}, pay, val_indices=val)
    it, acc = b.stats["selected_iteration"], b.stats["selected_val_acc"]
    assert it in (2, 4, 6)
    # selection scores the uploaded weights with the received global statistics, i.e. the
    # uploaded model with the statistics of the global model it started the round from
    stats = lambda k: k.endswith(("running_mean", "running_var"))  # noqa: E731
    with_global = lambda upd: {**g, **{k: v for k, v in upd.items() if not stats(k)}}  # noqa: E731
    correct, _, n = sel.evaluate(with_global(b.update), val, 64)
    assert correct / n == acc  # the uploaded model is the one that scored acc
    correct_last, _, _ = plain.evaluate(with_global(a.update), val, 64)
    assert acc >= correct_last / n  # the last iterate was a candidate (same seeded trajectory)
    same = all(np.array_equal(a.update[k], b.update[k]) for k in a.update)
    assert same == (it == 6)


@pytest.mark.parametrize("scores, chosen", [
    ([0.5, 0.7, 0.7, 0.6], 4),  # a tie keeps the earlier iterate (4, not 6)
    ([0.5, 0.6, 0.6, 0.9], 7),  # the round's last iterate (7, off the every-2 grid) is a candidate
    ([0.0, 0.0, 0.0, 0.0], 2),  # all at zero: the first candidate, never "none"
])
def test_client_side_selection_takes_the_first_best_of_the_scored_candidates(tiny_ds, monkeypatch, scores, chosen):
    """Sec. 4.1's selection with scripted validation scores: candidates at iterations 2, 4, 6 (select_every=2)
    and 7 (the last of 7 steps); the upload is the state scored at the chosen one, bit for bit."""
    import rayfed_dg.methods.fedfd as fedfd

    split = leave_one_domain_out(tiny_ds, "texture", 0.2, 0)
    train, val = split.clients[0], split.val[split.client_domains[0]]
    _, sel = runner(tiny_ds, "method.name=fedfda", "method.lambda2=0.1", "training.local_steps=7",
                    "method.select_every=2")
    seen = []

    def scripted(model, ctx):
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return scores[len(seen) - 1], 0.0

    monkeypatch.setattr(fedfd, "evaluate_on_val", scripted)
    g = to_numpy_state(sel.model.state_dict(), sel.model.state_dict().keys())
    pay = sel.method.server_payloads(1, [0], {}, None, g, {})[0]
    b = sel.run_client(0, 1, train, g, {}, pay, val_indices=val)
    assert len(seen) == 4
    assert b.stats["selected_iteration"] == chosen and b.stats["selected_val_acc"] == scores[[2, 4, 6, 7].index(chosen)]
    kept = seen[[2, 4, 6, 7].index(chosen)]
    assert all(np.array_equal(b.update[k], kept[k].numpy()) for k in b.update)
    others = [s for i, s in enumerate(seen) if i != [2, 4, 6, 7].index(chosen)]
    assert all(any(not np.array_equal(b.update[k], s[k].numpy()) for k in b.update) for s in others)


def test_server_gives_each_client_validation_of_its_own_domain(tiny_ds):
    cfg = tiny_cfg("method.name=fedfda", "method.select_every=5", "method.select_samples=7")
    split = leave_one_domain_out(tiny_ds, "texture", 0.2, 0)
    fed, again = Federation(cfg, split, 10, 1), Federation(cfg, split, 10, 2)
    for c in range(split.num_clients):
        v = fed.data.client_val(c)
        assert len(v) == 7 and set(v) <= set(split.val[split.client_domains[c]])
        assert np.array_equal(v, fed.data.client_val(c)) and np.array_equal(v, again.data.client_val(c))  # seeded, fixed


def test_client_side_selection_normalises_with_the_received_global_statistics():
    """The adapter was trained on differences from the received
    global statistics; selecting on the client must use them too (not the
    client's own running statistics, which under SiloBN are not global)."""
    torch.manual_seed(0)
    m = FDBN(3, adapter=True).eval()
    with torch.no_grad():
        m.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        m.running_var.copy_(torch.tensor([1.5, 0.5, 2.0]))
        m.g_mean.copy_(torch.tensor([-0.3, 0.2, 0.1]))
        m.g_var.copy_(torch.tensor([0.7, 1.2, 0.9]))
        m.adapter[2].weight.normal_()
        m.weight.copy_(torch.tensor([1.2, 0.8, 1.0]))
        m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x = torch.randn(2, 3, 4, 4)
    var_i, mu_i = torch.var_mean(x, (2, 3), unbiased=False)
    sig_i = torch.sqrt(var_i + 1e-5)

    def by_hand(g_mean, g_var, mode):
        sig_g = torch.sqrt(g_var + 1e-5)
        if mode == "plain":
            mu, sig = g_mean.expand(2, 3), sig_g.expand(2, 3)
        else:
            eps = m.adapter(torch.cat([mu_i - g_mean, sig_i - sig_g], 1))[:, 1]
            a = eps.clamp(0, 1).unsqueeze(1)
            mu, sig = a * mu_i + (1 - a) * g_mean, a * sig_i + (1 - a) * sig_g
        return (x - mu[:, :, None, None]) / sig[:, :, None, None] * m.weight[None, :, None, None] \
            + m.bias[None, :, None, None]

    for mode in ("adapt", "plain"):
        m.mode = mode
        with torch.no_grad():
            m.eval_with_received = True
            selected = m(x)
            m.eval_with_received = False
            tested = m(x)  # the server's test: the global model's own running statistics are the global ones
        assert torch.allclose(selected, by_hand(m.g_mean, m.g_var, mode), atol=1e-5), mode
        assert torch.allclose(tested, by_hand(m.running_mean, m.running_var, mode), atol=1e-5), mode
        assert not torch.allclose(selected, tested)


# ---------------------------------------------------------------- an independent re-implementation
def _stats(x):
    var, mu = torch.var_mean(x, (2, 3), unbiased=False)  # per sample and channel (instance statistics)
    return mu, torch.sqrt(var + 1e-5)


def _norm(x, mu, sig, m):
    return (x - mu[:, :, None, None]) / sig[:, :, None, None] * m.weight[None, :, None, None] \
        + m.bias[None, :, None, None]


def _manual_features(model, x, mode):
    """The conv net's forward with every FDBN written out: ``plain`` = BN with
    batch statistics (training), ``mix`` = Eq. 2 with the layer's u and the
    received global statistics."""
    h = x
    for layer in model.body:
        if isinstance(layer, FDBN):
            if mode == "plain":
                var, mu = torch.var_mean(h, (0, 2, 3), unbiased=False)
                mu, sig = mu.expand(len(h), -1), torch.sqrt(var + 1e-5).expand(len(h), -1)
            else:
                mu_i, sig_i = _stats(h)
                mu_g, sig_g = layer.g_mean[None], torch.sqrt(layer.g_var + 1e-5)[None]
                u = layer.u[None]
                mu, sig = u * mu_i + (1 - u) * mu_g, u * sig_i + (1 - u) * sig_g
            h = _norm(h, mu, sig, layer)
        else:
            h = layer(h)
    return torch.flatten(h, 1)


def _fedfd_model(*sets):
    cfg = tiny_cfg("method.name=fedfd", "method.lambda1=0.3", "method.lambda2=0.7", "model.width=6", *sets)
    method = build_method(cfg, 3)
    torch.manual_seed(0)
    model = method.build_model(10).train()
    for m in fd_layers(model):
        with torch.no_grad():
            m.g_mean.copy_(torch.randn(m.num_features) * 0.3)
            m.g_var.copy_(torch.rand(m.num_features) + 0.5)
            m.weight.copy_(torch.rand(m.num_features) + 0.5)
            m.bias.copy_(torch.randn(m.num_features) * 0.1)
    return method, model


# lambda2: a number as given; auto = 1 / (pooled features): 1/6 on the conv net of width 6
@pytest.mark.parametrize("lambda2,l2", [("0.7", 0.7), ("auto", 1 / 6)])
def test_eq3_to_5_loss_value_and_gradient_match_an_independent_computation(lambda2, l2):
    method, model = _fedfd_model(f"method.lambda2={lambda2}")
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 3, 3, 7])
    ctx = ClientContext(0, 1, torch.device("cpu"), torch.Generator().manual_seed(1), 4)
    loss = method.main_loss(model, x, y, ctx)  # draws u into the layers
    us = [m.u.clone() for m in fd_layers(model)]
    assert all(u.shape == (m.num_features,) and u.std() > 0 for u, m in zip(us, fd_layers(model)))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    f = _manual_features(model, x, "plain")
    f_aug = _manual_features(model, x, "mix")
    ce = F.cross_entropy(model.head(f), y)
    cacl = F.cross_entropy(model.head(f_aug), y)
    cafl = ((f - f_aug) ** 2).sum(1).mean()  # Eq. 3: mean over samples of the squared feature distance
    expect = 0.7 * ce + 0.3 * cacl + l2 * cafl  # (1 - l1) CE + l1 CACL + l2 CAFL, l1 = 0.3
    assert abs(loss.item() - expect.item()) < 1e-4 * max(1.0, abs(expect.item()))
    # the diversified features carry gradient too (CACL and CAFL reach the extractor through f_aug)
    for g, e in zip(grads, torch.autograd.grad(expect, params)):
        assert torch.allclose(g, e, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("arch,width,features", [("convnet", 32, 32), ("resnet18", None, 512)])
def test_lambda2_auto_is_one_over_the_pooled_features(arch, width, features):
    sets = [f"model.arch={arch}", *([f"model.width={width}"] if width else [])]
    method = build_method(tiny_cfg("method.name=fedfda", *sets), 3)
    assert method.p.lambda2 == "auto"
    assert method.build_model(10).feature_dim == features
    assert method.resolve_lambda2(features) == 1 / features
    assert build_method(tiny_cfg("method.name=fedfda", "method.lambda2=4.0", *sets), 3).resolve_lambda2(features) == 4.0


def test_eq6_7_adapter_with_fixed_weights_and_noise_by_hand():
    torch.manual_seed(0)
    m = FDBN(4, adapter=True).train()
    with torch.no_grad():
        for p in m.adapter.parameters():
            p.normal_(0, 0.3)
        m.adapter[2].weight.mul_(0.3)
        m.adapter[2].bias.copy_(torch.tensor([0.15, 0.5]))  # delta, epsilon around alpha = 0.5
        m.g_mean.copy_(torch.tensor([0.2, -0.5, 1.0, 0.0]))
        m.g_var.copy_(torch.tensor([0.8, 1.5, 0.6, 1.1]))
        m.weight.copy_(torch.tensor([1.1, 0.9, 1.3, 0.7]))
        m.bias.copy_(torch.tensor([0.05, -0.1, 0.2, 0.0]))
    m.mode = "adapt"
    x = torch.randn(3, 4, 5, 5) * 1.5 + 0.3
    mu_i, sig_i = _stats(x)
    w1, b1, w2, b2 = m.adapter[0].weight, m.adapter[0].bias, m.adapter[2].weight, m.adapter[2].bias
    for training in (True, False):
        # global statistics: the received ones on the client; at test the global model's own running ones
        g_mean, g_var = (m.g_mean, m.g_var) if training else (m.running_mean, m.running_var)
        mu_g, sig_g = g_mean[None], torch.sqrt(g_var + 1e-5)[None]
        hidden = torch.relu(torch.cat([mu_i - mu_g, sig_i - sig_g], 1) @ w1.T + b1)  # Eq. 7 input
        delta, eps = (hidden @ w2.T + b2).unbind(1)
        m.train(training)
        m.gen = torch.Generator().manual_seed(5)
        z = torch.randn(3, generator=torch.Generator().manual_seed(5))
        alpha = (z * delta + eps).clamp(0, 1) if training else eps.clamp(0, 1)  # Eq. 7; test: epsilon alone
        a = alpha[:, None]
        expect = _norm(x, a * mu_i + (1 - a) * mu_g, a * sig_i + (1 - a) * sig_g, m)  # Eq. 6: alpha on the instance side
        with torch.no_grad():
            got = m(x)
        assert torch.allclose(got, expect, atol=1e-5), training
        assert 0 < alpha.min().item() and alpha.max().item() < 1  # the test's values stay off the clamps
