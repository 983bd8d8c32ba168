"""StableFDG (NeurIPS 2023): style sharing, k-means++ shifting, oversampling,
exploration, attention highlighter."""
import numpy as np
import pytest
import torch
from conftest import tiny_cfg

from rayfed_dg.engine import ClientRunner
from rayfed_dg.methods.stablefdg import assign_styles
from rayfed_dg.models.style import (
    FeatureHighlighter,
    StyleShift,
    StyleState,
    balanced_oversample,
    channel_stats,
    explore,
    kmeanspp_seeds,
    style_information,
)


def test_derangement_never_self_and_seeded():
    clients = list(range(7))
    for seed in range(50):
        a = assign_styles(clients, clients, 1, np.random.default_rng(seed))
        assert all(a[c] != [c] for c in clients)
        assert sorted(x[0] for x in a.values()) == clients  # one-to-one: no two get the same
    a1 = assign_styles(clients, clients, 1, np.random.default_rng(3))
    assert a1 == assign_styles(clients, clients, 1, np.random.default_rng(3))
    assert a1 != assign_styles(clients, clients, 1, np.random.default_rng(4))
    # partial participation: 3 sampled of a pool of 10 known styles, 2 styles each, all distinct
    b = assign_styles([1, 4, 7], list(range(10)), 2, np.random.default_rng(0))
    got = [s for v in b.values() for s in v]
    assert len(got) == 6 == len(set(got)) and all(c not in b[c] for c in b)
    # styles known for only some of the round's clients: every style given comes from the pool, never one's own
    for seed in range(20):
        c = assign_styles([0, 1, 2], [0, 1], 1, np.random.default_rng(seed))
        assert all(set(v) <= {0, 1} and k not in v for k, v in c.items()), (seed, c)
    # two styles each from three clients: once the unused ones run out, each still gets the two others'
    for seed in range(20):
        d = assign_styles([0, 1, 2], [0, 1, 2], 2, np.random.default_rng(seed))
        assert {k: sorted(v) for k, v in d.items()} == {0: [1, 2], 1: [0, 2], 2: [0, 1]}, (seed, d)


def test_partners_are_drawn_for_single_samples_of_a_class_the_client_holds_twice():
    from types import SimpleNamespace

    from rayfed_dg.methods import build_method

    labels = np.array([0, 0, 0, 1, 1, 2])  # the client's: class 0 three times, 1 twice, 2 once
    ctx = SimpleNamespace(labels=labels, indices=np.arange(6), generator=torch.Generator().manual_seed(0),
                          fetch=lambda idx: (torch.full((len(idx), 1), 9.0), torch.as_tensor(labels[idx])))
    method = build_method(tiny_cfg("method.name=stablefdg"), 3)
    x, y = torch.zeros(4, 1), torch.tensor([0, 1, 1, 2])
    # class 0 and class 2 have one sample in the batch; only class 0 has another on the client
    x2, y2 = method._with_partners(x, y, ctx)
    assert y2.tolist() == [0, 1, 1, 2, 0] and x2[4].item() == 9.0
    off = build_method(tiny_cfg("method.name=stablefdg", "method.attention=false"), 3)
    assert off._with_partners(x, y, ctx)[1].tolist() == [0, 1, 1, 2]  # no highlighter, no partners
    # class 1 once in the batch and exactly twice on the client: its other sample is the partner
    x3, y3 = method._with_partners(torch.zeros(4, 1), torch.tensor([0, 0, 1, 2]), ctx)
    assert y3.tolist() == [0, 0, 1, 2, 1]


def test_one_client_round_gets_no_style_and_does_not_wait_for_a_derangement():
    # a round whose only participant is the only style known: nobody else's style to give (no endless redraw)
    assert assign_styles([3], [3], 1, np.random.default_rng(0)) == {3: []}


def test_the_loss_gives_the_highlighter_each_samples_same_class_partner():
    from types import SimpleNamespace

    from rayfed_dg.methods import build_method
    from rayfed_dg.models.style import same_class_partners

    torch.manual_seed(0)  # without round_start the style layers draw from the global generator: fixed draws
    method = build_method(tiny_cfg("method.name=stablefdg", "model.width=8"), 3)
    model = method.build_model(10).train()
    hl = method._highlighter(model)
    seen = []
    hl.register_forward_hook(lambda m, i, o: seen.append(None if m.partners is None else m.partners.tolist()))
    x, y = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([2, 0, 2, 1])
    method.loss(model, x, y, SimpleNamespace(fetch=None))
    # the labels as the last block sees them (oversampling enlarged the batch): each sample's next of its class
    labels = model.style_state.labels
    assert len(labels) > 4 and seen == [same_class_partners(labels, None)[0].tolist()]
    assert seen[0] != list(range(len(labels)))  # some sample has a partner other than itself


def test_without_the_highlighter_a_head_that_does_more_than_pool_is_accepted():
    pytest.importorskip("timm", reason="timm is not installed (pip install -e '.[dev]')")
    from rayfed_dg.methods import build_method

    convnext = ["model.arch=timm/test_convnext", "data.resolution=64"]
    model = build_method(tiny_cfg("method.name=stablefdg", "method.attention=false", *convnext), 3).build_model(7)
    assert model.head.in_features == model.feature_dim  # no [GAP, attention] concatenation
    with pytest.raises(ValueError, match="the feature highlighter attends over the last feature map"):
        build_method(tiny_cfg("method.name=stablefdg", *convnext), 3).build_model(7)


def test_style_information_by_hand():
    x = torch.tensor([[[[1.0, 3.0]], [[2.0, 2.0]]], [[[5.0, 5.0]], [[0.0, 4.0]]]])  # (2, 2, 1, 2)
    mu, sig = channel_stats(x)
    phi = style_information(mu, sig)
    # per-sample means: s0 (2, 2), s1 (5, 2); stds: s0 (1, 0), s1 (0, 2) (+1e-6 inside the sqrt)
    s = np.sqrt
    expect = [3.5, 2.0, (s(1 + 1e-6) + s(1e-6)) / 2, (s(1e-6) + s(4 + 1e-6)) / 2,
              2.25, 0.0, ((s(1 + 1e-6) - s(1e-6)) / 2) ** 2, ((s(4 + 1e-6) - s(1e-6)) / 2) ** 2]
    np.testing.assert_allclose(phi, expect, rtol=1e-5, atol=1e-7)


def test_kmeanspp_keeps_exactly_half_and_shift_changes_the_rest():
    g = torch.Generator().manual_seed(0)
    for b in (2, 3, 7, 32):
        pts = torch.randn(b, 6)
        seeds = kmeanspp_seeds(pts, b // 2, g)
        assert len(seeds) == b // 2 == len(set(seeds.tolist()))
    st = StyleState(gen=torch.Generator().manual_seed(1), shift_p=1.0)
    c = 4
    st.received = np.concatenate([np.full(c, 5.0), np.full(c, 2.0), np.full(c, 0.1), np.full(c, 0.1)])[None]
    layer = StyleShift(st).train()
    x = torch.randn(9, c, 3, 3)
    y = layer(x)
    same = [torch.equal(x[i], y[i]) for i in range(9)]
    assert sum(same) == 9 // 2  # floor(B/2) keep their style, the rest are shifted
    moved = [i for i in range(9) if not same[i]]
    mu, _ = channel_stats(y[moved])
    assert (mu - 5.0).abs().max() < 2.0  # shifted towards the received centre


def test_oversampling_balances_as_in_appendix_g():
    labels = torch.tensor([0, 0, 0, 1, 1, 2])  # counts 3, 2, 1
    extra = balanced_oversample(labels, 6, torch.Generator().manual_seed(0))
    assert torch.bincount(labels[extra], minlength=3).tolist() == [1, 2, 3]
    extra = balanced_oversample(torch.tensor([4, 4, 4, 4, 9]), 3, torch.Generator())
    assert sorted(torch.tensor([4, 4, 4, 4, 9])[extra].tolist()) == [9, 9, 9]


def test_oversampling_breaks_ties_with_the_seeded_generator():
    # four classes of one sample each: the first extra sample's class must not always be the lowest id
    labels = torch.tensor([0, 1, 2, 3])
    gen = torch.Generator().manual_seed(0)
    first = [int(labels[balanced_oversample(labels, 1, gen)[0]]) for _ in range(400)]
    counts = torch.bincount(torch.tensor(first), minlength=4).tolist()
    assert all(60 < c < 140 for c in counts), counts  # about 100 each
    again = torch.Generator().manual_seed(0)
    assert first == [int(labels[balanced_oversample(labels, 1, again)[0]]) for _ in range(400)]  # seeded


def test_exploration_with_alpha_zero_is_identity_and_moves_otherwise():
    x = torch.randn(6, 3, 4, 4) * 2 + 1
    pick = torch.tensor([0, 2, 2, 5])
    out = explore(x, pick, 0.0)
    assert out.shape == (10, 3, 4, 4) and torch.equal(out[:6], x)
    assert torch.allclose(out[6:], x[pick], atol=1e-5)
    far = explore(x, pick, 3.0)
    mu_all = channel_stats(torch.cat([x, x[pick]]))[0].mean(0)
    d0 = (channel_stats(x[pick])[0] - mu_all).abs()
    d3 = (channel_stats(far[6:])[0] - mu_all).abs()
    assert torch.allclose(d3, 4 * d0, atol=1e-4)  # mu + 3 (mu - mean): four times as far


def test_explored_styles_are_adain_targets_without_gradient():
    """Summed over a map, an AdaIN output is H W mu_new: with the new styles
    detached (the default, as AdaIN and the reference code) nothing of it
    depends on the features, so its gradient is zero; with
    ``detach=False`` (Eq. 4 differentiated) each explored map sums to
    H W ((1 + alpha) mu - alpha mu_bar), whose gradient is computed by hand
    below."""
    x = (torch.randn(4, 2, 3, 3) * 2 + 1).requires_grad_()
    pick = torch.tensor([1, 1, 3, 0])
    explore(x, pick, 3.0)[4:].sum().backward()
    assert torch.allclose(x.grad, torch.zeros_like(x), atol=1e-5)
    x.grad = None
    explore(x, pick, 3.0, detach=False)[4:].sum().backward()
    # d/dx of sum over picked maps of HW (4 mu_e - 3 mu_bar), mu_bar over the 8 samples of the concatenated batch:
    # an element of sample i gets 4 x (times picked) - 3 x 4 x (1 + times picked) / 8
    times = torch.bincount(pick, minlength=4).float()
    expect = 4 * times - 3 * 4 * (1 + times) / 8
    assert torch.allclose(x.grad, expect[:, None, None, None].expand_as(x), atol=1e-4)
    # any weighting of the output (the sum above cancels the std path): the gradient is AdaIN's with the new
    # mean and std as constants, computed here from the batch's statistics by hand
    w = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    x.grad = None
    (explore(x, pick, 3.0)[4:] * w).sum().backward()
    got = x.grad.clone()
    with torch.no_grad():
        xs = torch.cat([x, x[pick]])
        mu, sd = xs.mean((2, 3)), torch.sqrt(xs.var((2, 3), unbiased=False) + 1e-6)
        new_mu, new_sd = mu[4:] + 3 * (mu[4:] - mu.mean(0)), sd[4:] + 3 * (sd[4:] - sd.mean(0))
    x.grad = None
    e = x[pick]
    m, s = e.mean((2, 3), keepdim=True), torch.sqrt(e.var((2, 3), unbiased=False, keepdim=True) + 1e-6)
    ((((e - m) / s) * new_sd[:, :, None, None] + new_mu[:, :, None, None]) * w).sum().backward()
    assert torch.allclose(got, x.grad, atol=1e-4)


def test_attention_sums_to_one_and_test_forward_is_self_attention():
    st = StyleState()
    hl = FeatureHighlighter(8, st, d=5)
    z = torch.randn(4, 8, 3, 3)
    hl.train()
    hl.partners = torch.tensor([1, 0, 3, 2])
    out_train = hl(z)
    a = hl.last_attention
    assert a.shape == (4, 9) and torch.allclose(a.sum(1), torch.ones(4))
    assert out_train.shape == (4, 16, 1, 1)
    hl.eval()
    e1, e2 = hl(z), hl(z)
    assert torch.equal(e1, e2)
    assert not torch.allclose(out_train, e1)  # training mixed in the partner's query


@pytest.mark.parametrize("scores", ["cosine", "dot", "scaled"])
def test_attention_scores_by_hand(scores):
    """Eq. 6-8 written out per sample with loops: S[m, n] = <q_m, k_n> over the
    d channels (cosine: both L2-normalised first, as the reference code;
    scaled: / sqrt(d)); mean over query positions m, softmax over key
    positions n; in training the query is (q_i + q_partner) / 2."""
    torch.manual_seed(0)
    hl = FeatureHighlighter(6, StyleState(), d=4, scores=scores)
    z = torch.randn(3, 6, 2, 3) * 3
    with torch.no_grad():
        q_all, k_all = hl.q(z).flatten(2), hl.k(z).flatten(2)  # (B, d, HW)
        if scores == "cosine":
            q_all, k_all = q_all / q_all.norm(dim=1, keepdim=True), k_all / k_all.norm(dim=1, keepdim=True)

        def by_hand(i, partner=None, transpose=False):
            q = q_all[i] if partner is None else (q_all[i] + q_all[partner]) / 2
            hw = q.shape[1]
            s = torch.tensor([[float(q[:, m] @ k_all[i][:, n]) for n in range(hw)] for m in range(hw)])
            if scores == "scaled":
                s = s / 2.0  # sqrt(d) = 2
            if transpose:
                s = s.T
            a = torch.softmax(s.mean(0), 0)
            return torch.cat([z[i].mean((1, 2)), z[i].flatten(1) @ a])

        hl.eval()
        out = hl(z)[:, :, 0, 0]
        for i in range(3):
            assert torch.allclose(out[i], by_hand(i), atol=1e-5)
            assert not torch.allclose(out[i], by_hand(i, transpose=True), atol=1e-5)  # the test sees S^T
        hl.train()
        hl.partners = torch.tensor([2, 0, 1])
        out = hl(z)[:, :, 0, 0]
        for i, j in enumerate([2, 0, 1]):
            assert torch.allclose(out[i], by_hand(i, partner=j), atol=1e-5)


def test_stablefdg_client_prepares_a_4c_style_and_trains(tiny_ds):
    from rayfed_dg.engine import ClientTask
    from rayfed_dg.engine.workers.worker import to_numpy_state

    cfg = tiny_cfg("method.name=stablefdg", "model.width=8")
    r = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, 10, 3)
    g = to_numpy_state(r.model.state_dict(), r.model.state_dict().keys())
    phi = r.prepare(ClientTask(client=0, round=1, indices=np.arange(100), local_state={}), g)["style"]
    assert phi.shape == (4 * 8,) and np.all(phi[8:16] > 0)  # [mu, sigma, Var(mu), Var(sigma)], sigma > 0
    out = r.run_client(0, 1, np.arange(100), g, {}, {"styles": phi[None] * 1.1})
    assert r.model.head.in_features == 16  # [GAP, attention] doubles the classifier input
    assert np.isfinite(out.train_loss)
    assert not np.array_equal(out.update["head.weight"], g["head.weight"])  # it trained
    again = r.run_client(0, 1, np.arange(100), g, {}, {"styles": phi[None] * 1.1})
    assert all(np.array_equal(out.update[k], again.update[k]) for k in out.update)  # seeded


@pytest.mark.slow
def test_styles_travel_through_the_engine_and_ledger(tiny_ds, engine_host):
    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import run_federation

    cfg = tiny_cfg("method.name=stablefdg", "model.width=8", "training.rounds=2")
    split = leave_one_domain_out(tiny_ds, "mono", 0.2, 0)
    res = run_federation(cfg, split, None, None, 10, progress=False, host=engine_host(tiny_ds, 2))
    up = [r for r in res.ledger if r["group"] == "prepare:style"]
    down = [r for r in res.ledger if r["group"] == "payload:styles"]
    # every round: each participant uploads its style before training and receives a peer's
    assert sorted((r["round"], r["direction"]) for r in up) == [(1, "up")] * 3 + [(2, "up")] * 3
    assert all(r["bytes"] == 4 * 8 * 4 for r in up + down)  # 4C float32
    assert sorted(r["round"] for r in down) == [1, 1, 1, 2, 2, 2]


def test_styles_received_in_a_round_come_from_that_rounds_participants_and_model(ray_session, tiny_ds, engine_host):
    """Algorithm 1's order, through the engine: with 6 clients and 3 per round,
    what the server aggregates in round 2 is exactly what the round-2
    participants train when each receives the style that another round-2
    participant computed with round 2's global model."""
    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import ClientTask
    from rayfed_dg.seeding import Stream, numpy_rng

    ray = ray_session
    cfg = tiny_cfg("method.name=stablefdg", "model.width=8", "method.attention=false", "method.shift_p=1.0",
                   "partition.strategy=single_domain", "partition.num_clients=6", "training.clients_per_round=3",
                   "training.local_steps=3", "evaluation.every=0", "training.rounds=3")
    split = leave_one_domain_out(tiny_ds, "mono", 0.2, 0, "single_domain", 6)
    server = engine_host(tiny_ds, 2).open(cfg, split, 10)
    ray.get(server.run_round.remote())
    g1 = ray.get(server.get_state.remote())["global_state"]
    out2 = ray.get(server.run_round.remote())
    g2 = ray.get(server.get_state.remote())["global_state"]
    sampled = out2.sampled
    assert len(sampled) == 3
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, 10, 3)
    styles = {c: runner.prepare(ClientTask(client=c, round=2, indices=split.clients[c], local_state={}), g1)["style"]
              for c in sampled}
    given = assign_styles(sampled, sampled, 1, numpy_rng(cfg.training.seed, Stream.PAYLOAD, 2))
    assert all(given[c] != [c] and given[c][0] in sampled for c in sampled)
    ups = {c: runner.run_client(c, 2, split.clients[c], g1, {}, {"styles": styles[given[c][0]][None]}).update
           for c in sampled}
    n = split.client_sizes()[sampled].astype(np.float64)
    expect = sum(w * ups[c]["head.weight"].astype(np.float64) for w, c in zip(n, sampled)) / n.sum()
    np.testing.assert_allclose(g2["head.weight"], expect.astype(np.float32), rtol=1e-5, atol=1e-6)


def test_exploration_sigma_follows_eq5_unclamped():
    # two oversampled copies of sample 0 whose std (0.5) is below the batch mean:
    # Eq. 5 gives sigma_new = s + 3 (s - mean) < 0, a flipped map with the same content
    x = torch.stack([torch.tensor([[0.0, 1.0], [0.0, 1.0]]), torch.tensor([[0.0, 4.0], [0.0, 4.0]])])[:, None]
    out = explore(x, torch.tensor([0, 0]), 3.0)
    sig = torch.tensor([0.5, 2.0, 0.5, 0.5])  # biased std over the 2 x 2 map
    s_new = 0.5 + 3 * (0.5 - sig.mean())  # = -0.625
    mu = torch.tensor([0.5, 2.0, 0.5, 0.5])
    m_new = 0.5 + 3 * (0.5 - mu.mean())
    xn = (x[0] - 0.5) / torch.sqrt(torch.tensor(0.25 + 1e-6))
    assert torch.allclose(out[2], xn * s_new + m_new, atol=1e-5) and torch.allclose(out[3], out[2])


def test_stablefdg_learns_from_scratch_with_every_style_op_firing(tiny_ds):
    # every style operation on every batch must still leave a model that fits its data
    from rayfed_dg.engine.workers.worker import to_numpy_state

    cfg = tiny_cfg("method.name=stablefdg", "method.attention=false", "method.explore_p=1.0",
                   "training.local_steps=15", "training.lr=0.05")
    r = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, 10, 3)
    idx = np.flatnonzero(tiny_ds.domains == 0)[:200]
    sd = r.model.state_dict()
    g = to_numpy_state(sd, sd.keys())
    for rnd in range(1, 7):
        out = r.run_client(0, rnd, idx, g, {}, {})
        g = {**g, **out.update}
    correct, loss, n = r.evaluate(g, idx, 256)
    assert np.isfinite(out.train_loss) and correct / n > 0.6, correct / n


# ---------------------------------------------------------------- value tests (issue: part 5)
def _stablefdg_model(*overrides):
    from rayfed_dg.methods import build_method

    cfg = tiny_cfg("method.name=stablefdg", *overrides)
    method = build_method(cfg, 3)
    torch.manual_seed(0)
    return method, method.build_model(10)


@pytest.mark.parametrize("arch", ["resnet18", "convnet"])
def test_style_information_is_taken_at_the_first_blocks_output(arch):
    """Phi_n (Eq. 2-3) at the output of the first residual block (Sec. 4.1,
    'Where to apply style-based modules'; ResNet layer1), computed in eval
    mode with no style operation: the expected value runs the backbone's
    layers by hand and stops after block 1.  ResNet-18's stem and layer1
    have the same width (64) and layer2 another (128), so statistics taken
    after the stem differ in value and after block 2 in size; the conv net's
    blocks all have one width, so a wrong block differs in value only."""
    from rayfed_dg.models.style import StyleExplore

    method, model = _stablefdg_model(f"model.arch={arch}")
    body = model.body
    x = torch.randn(6, 3, 32, 32) * 0.5 + 0.2
    assert model.training
    phi = method.compute_style(model, [x[:4], x[4:]])  # statistics gathered over two batches
    assert model.training  # computed in eval mode, the training mode restored after
    model.eval()
    with torch.no_grad():
        if arch == "resnet18":
            shifter = body.layer1
            h = body.maxpool(body.relu(body.bn1(body.conv1(x))))
            h = body.layer1[0](h)  # layer1 itself; [1:] are the inserted style modules
        else:
            shifter = body[3]
            h = body[3][0](body[2](body[1](body[0](x))))  # conv, BN, ReLU, max-pool
    # the style shift sits right after the very block the statistics are taken at
    assert isinstance(shifter[1], StyleShift) and isinstance(shifter[2], StyleExplore)
    c = h.shape[1]
    mu = h.mean((2, 3))
    sig = torch.sqrt(h.var((2, 3), unbiased=False) + 1e-6)
    expect = torch.cat([mu.mean(0), sig.mean(0), mu.var(0, unbiased=False), sig.var(0, unbiased=False)])
    assert phi.shape == (4 * c,)
    np.testing.assert_allclose(phi, expect.numpy(), rtol=1e-4, atol=1e-6)


def test_default_attention_scores_are_cosine():
    """The default of StableFDG's feature highlighter is the reference code's
    cosine scores (q and k L2-normalised over the d channels at each
    position), not Eq. 6's raw dot product; checked on the values of the
    highlighter the method builds with no scoring option given."""
    _, model = _stablefdg_model("model.arch=convnet", "model.width=8")
    hl = next(m for m in model.modules() if isinstance(m, FeatureHighlighter))
    assert FeatureHighlighter(8, StyleState()).scores == hl.scores == "cosine"
    z = torch.randn(3, 8, 3, 3) * 4
    hl.eval()
    with torch.no_grad():
        out = hl(z)[:, :, 0, 0]
        q, k = hl.q(z).flatten(2), hl.k(z).flatten(2)  # (B, d, HW)
        s_cos = torch.einsum("bdm,bdn->bmn", q / q.norm(dim=1, keepdim=True), k / k.norm(dim=1, keepdim=True))
        s_dot = torch.einsum("bdm,bdn->bmn", q, k)
        for s, should_match in ((s_cos, True), (s_dot, False), (s_dot / hl.d ** 0.5, False)):
            a = torch.softmax(s.mean(1), 1)
            expect = torch.cat([z.mean((2, 3)), torch.einsum("bn,bcn->bc", a, z.flatten(2))], 1)
            assert torch.allclose(out, expect, atol=1e-5) == should_match


def test_style_shift_noise_has_the_received_standard_deviation():
    """Step 2: the shifted samples' new statistics are mu ~ N(mu_n', Sigma_n'(mu))
    and sigma ~ N(sigma_n', Sigma_n'(sigma)) with Sigma the *variance* of Eq. 2,
    so the noise's standard deviation is sqrt(Sigma).  Received variances 4.0
    and 0.25 give standard deviations 2.0 and 0.5 (read as standard deviations,
    4.0 and 0.25).  AdaIN leaves each shifted sample with exactly its drawn
    statistics, so the draws are read back from the output."""
    c, b = 64, 101
    mu_c, sig_c, var_mu, var_sig = 1.5, 5.0, 4.0, 0.25
    st = StyleState(gen=torch.Generator().manual_seed(0), shift_p=1.0)
    st.received = np.concatenate([np.full(c, mu_c), np.full(c, sig_c), np.full(c, var_mu),
                                  np.full(c, var_sig)]).astype(np.float32)[None]
    x = torch.randn(b, c, 4, 4)
    y = StyleShift(st).train()(x)
    moved = [i for i in range(b) if not torch.equal(x[i], y[i])]
    assert len(moved) == b - b // 2
    mu, sig = channel_stats(y[moved])  # (50, 64): 3,200 draws each
    assert abs(float(mu.mean()) - mu_c) < 0.1 and abs(float(sig.mean()) - sig_c) < 0.05
    assert abs(float(mu.std()) - 2.0) < 0.1, float(mu.std())  # sqrt(4.0), not 4.0
    assert abs(float(sig.std()) - 0.5) < 0.03, float(sig.std())  # sqrt(0.25), not 0.25


def test_kmeanspp_seeding_draws_proportionally_to_squared_distance():
    """k-means++ (Arthur & Vassilvitskii 2007): the first seed uniformly, the
    next with probability D(x)^2 / sum D^2.  On the line {0, 1, 3}: after 0,
    P(1) = 1/10 and P(3) = 9/10; after 1, P(0) = 1/5; after 3, P(0) = 9/13.
    Uniform seeding gives 1/2 everywhere, D instead of D^2 1/4 after 0."""
    pts = torch.tensor([[0.0], [1.0], [3.0]])
    gen = torch.Generator().manual_seed(0)
    n = 3000
    pairs = [tuple(kmeanspp_seeds(pts, 2, gen).tolist()) for _ in range(n)]
    expect = {(0, 1): 1 / 10, (0, 2): 9 / 10, (1, 0): 1 / 5, (1, 2): 4 / 5, (2, 0): 9 / 13, (2, 1): 4 / 13}
    for (i, j), p in expect.items():
        got = sum(pr == (i, j) for pr in pairs) / n
        assert abs(got - p / 3) < 0.025, ((i, j), got, p / 3)


def test_style_shift_keeps_the_outlier_style_with_kmeanspp():
    """Seven samples of one style and one far from it, B = 8, B/2 = 4 kept:
    k-means++ puts a seed on the outlier every time (once any of the seven is
    a seed, the other six are at distance 0 and the outlier carries all of
    the D^2 mass), so the outlier is never shifted; uniform selection keeps
    it half of the time."""
    c = 4
    base = torch.randn(1, c, 3, 3)
    x = torch.cat([base.repeat(7, 1, 1, 1), base * 10 + 20])
    received = np.concatenate([np.full(c, -3.0), np.full(c, 0.5), np.full(c, 0.1), np.full(c, 0.1)])[None]
    kept = {}
    for selection in ("kmeans++", "random"):
        kept[selection] = []
        for seed in range(30):
            st = StyleState(gen=torch.Generator().manual_seed(seed), shift_p=1.0, selection=selection)
            st.received = received
            y = StyleShift(st).train()(x)
            assert sum(torch.equal(x[i], y[i]) for i in range(8)) == 4
            kept[selection].append(torch.equal(y[7], x[7]))
    assert all(kept["kmeans++"])
    assert 5 < sum(kept["random"]) < 25  # the control: random selection does shift it sometimes


def test_same_class_partner_is_the_next_sample_of_its_class_cyclically():
    from rayfed_dg.models.style import same_class_partners

    partner, has = same_class_partners(torch.tensor([2, 0, 2, 1, 2, 0]), None)
    # class 2 at 0, 2, 4 -> 2, 4, 0; class 0 at 1, 5 -> 5, 1; class 1 alone keeps itself, without a partner
    assert partner.tolist() == [2, 5, 4, 3, 0, 1] and has.tolist() == [True, True, True, False, True, True]


@pytest.mark.parametrize("mode", ["balanced", "random", "none"])
def test_exploration_enlarges_the_batch_by_each_oversampling_mode(mode):
    from rayfed_dg.models.style import StyleExplore

    labels = torch.tensor([0, 0, 0, 1])
    st = StyleState(labels=labels, gen=torch.Generator().manual_seed(0), oversample=mode, explore_p=1.0)
    out = StyleExplore(st).train()(torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(1)))
    if mode == "none":  # only MixStyle: the batch keeps its size and labels
        assert out.shape[0] == 4 and torch.equal(st.labels, labels)
        return
    assert out.shape[0] == 8 and st.fired
    if mode == "balanced":  # one class of three and one of one: four of each after the four extra samples
        assert torch.bincount(st.labels).tolist() == [4, 4]
    else:  # uniform over the batch: the generator's draws after the coin's, replayed
        g = torch.Generator().manual_seed(0)
        torch.rand(1, generator=g)
        assert torch.equal(st.labels[4:], labels[torch.randint(4, (4,), generator=g)])


def test_the_coin_fires_with_its_probability_from_the_seeded_stream():
    st = StyleState(gen=torch.Generator().manual_seed(3))
    got = [st.coin(0.25) for _ in range(200)]
    g = torch.Generator().manual_seed(3)
    assert got == [float(torch.rand(1, generator=g)) < 0.25 for _ in range(200)] and 30 < sum(got) < 70
    assert not any(st.coin(0.0) for _ in range(50)) and all(st.coin(1.0) for _ in range(50))
