"""The baselines the four papers compare against: ELCFS, RSC, COPA,
CSAC, DSON and the centralized row, each core operation against a hand
computation."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_cfg

from rayfed_dg.engine import ClientRunner
from rayfed_dg.engine.workers.worker import to_numpy_state
from rayfed_dg.methods import ClientContext, ClientUpdate, build_method


def ctx_for(client=0, round=2, seed=0, **kw):
    return ClientContext(client, round, torch.device("cpu"), torch.Generator().manual_seed(seed), 10, **kw)


# --------------------------------------------------------------------------- ELCFS

def test_elcfs_interpolation_keeps_phase_and_moves_low_amplitudes_by_lambda():
    from rayfed_dg.methods.elcfs import interpolate_amplitude, low_freq_mask

    g = torch.Generator().manual_seed(0)
    x, other = torch.rand(2, 3, 16, 16, generator=g), torch.rand(2, 3, 16, 16, generator=g)
    amp_o = torch.fft.fft2(other).abs()
    lam = torch.tensor([0.3, 0.8])
    t = interpolate_amplitude(x, amp_o, lam, band=0.2)  # b = floor(16 * 0.2) = 3: a 7 x 7 block
    fx, ft = torch.fft.fft2(x.double()), torch.fft.fft2(t.double())
    m = torch.zeros(16, 16, dtype=torch.bool)
    for u in range(-3, 4):
        for v in range(-3, 4):
            m[u % 16, v % 16] = True  # frequencies (u, v) with |u|, |v| <= 3
    assert torch.equal(low_freq_mask(16, 16, 0.2) > 0, m)
    for i, la in enumerate(lam.tolist()):
        expect = torch.where(m, (1 - la) * fx[i].abs() + la * amp_o[i].double(), fx[i].abs())
        assert torch.allclose(ft[i].abs(), expect, atol=1e-3)
        # the phase is the local image's, where the amplitude is not ~0
        live = fx[i].abs() > 1e-2
        dphase = torch.angle(ft[i][live] * fx[i][live].conj())
        assert dphase.abs().max() < 1e-3
    # lambda 0: the image itself; the zero frequency of a full swap is the other's mean
    assert torch.allclose(interpolate_amplitude(x, amp_o, torch.zeros(2), 0.2), x, atol=1e-5)
    full = interpolate_amplitude(x, amp_o, torch.ones(2), 0.0)  # band 0: only (0, 0), as the released scripts
    assert torch.allclose(full.mean((2, 3)), other.mean((2, 3)), atol=1e-5)


class _FakeStageServer:
    def __init__(self, stage, images, labels, clients):
        from rayfed_dg.stages import StageClient

        self.stage, self.clients, self.num_clients, self.seed = stage, clients, len(clients), 0
        self.view = StageClient(images=images, labels=labels, device=torch.device("cpu"), threads=1, seed=0)
        self.rows, self.shared = [], {}

    def training_set(self, c):
        return self.clients[c]

    def map(self, phase, args, releases=None):
        assert phase.__self__ is self.stage  # a client phase is the stage's own method
        return {c: phase(self.view, c, self.clients[c], **a) for c, a in args.items()}

    def share(self, name, arrays):
        self.shared[name] = arrays

    def ledger(self, client_id, direction, group, nbytes, tensors=1):
        self.rows.append((client_id, direction, group, nbytes, tensors))


def test_amplitude_bank_holds_spectra_at_the_training_resolution(tiny_ds):
    """Images stored larger than the training crops (data.augment: domainbed): the bank's spectra are of the
    image resized to the training resolution, so they mix into training batches of that size."""
    from rayfed_dg.data.augment import resize
    from rayfed_dg.stages import StageClient
    from rayfed_dg.stages.amplitude import Amplitude

    big = np.repeat(np.repeat(tiny_ds.images[:8], 2, axis=1), 2, axis=2)[:, :18, :18]  # 18 px stored
    view = StageClient(images=big, labels=tiny_ds.labels[:8], device=torch.device("cpu"), threads=1, seed=0,
                       resolution=16)
    got = Amplitude(Amplitude.Params(fraction=1.0)).client_spectra(view, 0, np.arange(8))
    x = resize(torch.from_numpy(big.astype(np.float32).transpose(0, 3, 1, 2) / 255.0), 16)
    assert got.shape == (8, 3, 16, 16)
    assert np.allclose(got, torch.fft.fft2(x).abs().numpy(), atol=1e-4)


def test_amplitude_bank_stage_shares_spectra_and_ledgers_them(tiny_ds):
    from rayfed_dg.stages.amplitude import Amplitude, bank_sample

    clients = [np.arange(0, 40), np.arange(40, 64), np.arange(64, 80)]
    srv = _FakeStageServer(Amplitude(Amplitude.Params(fraction=0.25)), tiny_ds.images, tiny_ds.labels, clients)
    srv.stage.run(srv)
    bank, owners = srv.shared["amplitude"]["bank"], srv.shared["amplitude"]["owners"]
    assert list(np.bincount(owners)) == [10, 6, 4]  # a quarter of each client's images
    pick = bank_sample(24, 0.25, 0, 1)
    img = tiny_ds.images[clients[1][pick[2]]].astype(np.float64).transpose(2, 0, 1) / 255
    np.testing.assert_allclose(bank[owners == 1][2], np.abs(np.fft.fft2(img)), rtol=1e-4, atol=1e-4)
    row = bank[0].nbytes
    assert (1, "up", "payload:amplitude_spectra", 6 * row, 6) in srv.rows
    assert (1, "down", "payload:amplitude_bank", 14 * row, 14) in srv.rows  # the others' spectra only


def test_elcfs_update_is_the_first_order_episodic_gradient(tiny_ds):
    """One local step with plain SGD moves theta by -lr (grad L_inn(theta) +
    grad L_out(theta')), theta' = theta - beta clip(grad L_inn), t drawn
    from another client's amplitude; recomputed here with a copy of the model."""
    import copy

    from rayfed_dg.stages.amplitude import amplitude_spectrum

    cfg = tiny_cfg("method.name=elcfs", "stages.amplitude={}", "training.momentum=0", "training.weight_decay=0",
                   "training.lr=0.1", "method.meta_step=0.05", "method.clip=0.01", "method.band=0.25")
    method = build_method(cfg, 3)
    torch.manual_seed(0)
    model = method.build_model(10)
    bank = {"bank": amplitude_spectrum(tiny_ds.images[:12]), "owners": np.repeat([0, 1, 2], 4)}
    mean, std = torch.full((1, 3, 1, 1), 0.4), torch.full((1, 3, 1, 1), 0.3)
    x = (torch.from_numpy(tiny_ds.images[100:108]).permute(0, 3, 1, 2).float() / 255 - mean) / std
    y = torch.from_numpy(tiny_ds.labels[100:108])
    mk = lambda: ctx_for(1, stage_data={"amplitude": bank}, pixel_mean=mean, pixel_std=std)  # noqa: E731
    hand = copy.deepcopy(model).train()
    t = method.transformed(x, mk())
    assert not torch.allclose(t, x)
    method.local_train(model, lambda: iter([(x, y)]), mk())

    params = dict(hand.named_parameters())
    g_in = torch.autograd.grad(F.cross_entropy(hand(x), y), list(params.values()))
    fast = copy.deepcopy(hand)
    with torch.no_grad():
        for p, g in zip(fast.parameters(), g_in):
            p.sub_(0.05 * g.clamp(-0.01, 0.01))
    g_out = torch.autograd.grad(F.cross_entropy(fast(t), y), list(fast.parameters()))
    for (n, p0), a, b in zip(params.items(), g_in, g_out):
        assert torch.allclose(dict(model.named_parameters())[n], p0 - 0.1 * (a + b), atol=1e-5), n


def test_elcfs_draws_only_other_clients_amplitudes():
    from rayfed_dg.methods.elcfs import ELCFS

    method = build_method(tiny_cfg("method.name=elcfs", "stages.amplitude={}", "method.band=0.5"), 3)
    assert isinstance(method, ELCFS)
    h = w = 8
    # client 0's rows hold a huge zero-frequency amplitude: drawing one would blow the mean up
    bank = np.ones((6, 3, h, w), np.float32)
    bank[:3, :, 0, 0] = 1e6
    data = {"amplitude": {"bank": bank, "owners": np.array([0, 0, 0, 1, 2, 2])}}
    x = torch.zeros(64, 3, h, w)
    t = method.transformed(x, ctx_for(0, stage_data=data, pixel_mean=torch.zeros(1, 3, 1, 1),
                                      pixel_std=torch.ones(1, 3, 1, 1)))
    assert float(t.max()) < 1.0  # with lambda < 1, a 1e6 DC term would clip to 1 somewhere


def test_elcfs_without_the_bank_is_rejected():
    from rayfed_dg.errors import ConfigError

    with pytest.raises(ConfigError, match="needs the data stage"):
        tiny_cfg("method.name=elcfs")


# --------------------------------------------------------------------------- RSC

def test_rsc_mutes_exactly_the_top_channels_and_locations_by_gradient():
    from rayfed_dg.methods.rsc import rsc_mask

    b, c, h, w = 2, 10, 3, 3
    grad = torch.zeros(b, c, h, w)
    order = torch.tensor([[3, 7, 0, 9, 1, 2, 4, 5, 6, 8], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]])
    for i in range(b):
        for rank, ch in enumerate(order[i]):
            grad[i, ch] = 10.0 - rank  # channel order[i][0] has the largest mean gradient
    m = rsc_mask(torch.randn(b, c, h, w), grad, spatial=False, drop=1 / 3.2)  # ceil(10 / 3.2) = 4 channels
    for i in range(b):
        assert sorted(torch.nonzero(m[i, :, 0, 0] == 0).flatten().tolist()) == sorted(order[i][:4].tolist())
    assert m.shape == (b, c, 1, 1) and int((m == 0).sum()) == 8
    # spatial: importance sum_c z * mean-gradient(c); channel 0 has gradient 1, channel 1 has -1
    z = torch.zeros(1, 2, h, w)
    z[0, 0] = torch.arange(9.0).view(3, 3)
    z[0, 1] = 5.0
    g2 = torch.zeros(1, 2, h, w)
    g2[0, 0], g2[0, 1] = 1.0, -1.0
    ms = rsc_mask(z, g2, spatial=True, drop=1 / 3)  # ceil(9 / 3) = 3 locations: values 8, 7, 6 (minus 5)
    assert ms.shape == (1, 1, h, w)
    assert torch.nonzero(ms.flatten() == 0).flatten().tolist() == [6, 7, 8]


def test_rsc_batch_percentage_keeps_the_largest_confidence_drops():
    from rayfed_dg.methods.rsc import rsc_batch_select

    before = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    after = torch.tensor([0.1, 0.8, 0.6, 0.1, 0.6, 0.39])  # drops 0.8, 0, 0.1, 0.5, -0.1, 0.01
    assert rsc_batch_select(before, after, 1 / 3).tolist() == [True, False, False, True, False, False]
    assert rsc_batch_select(before, after, 0.0).tolist() == [False] * 6


@pytest.mark.parametrize("spatial", [False, True])
def test_rsc_loss_is_ce_of_the_muted_feature_map(tiny_ds, spatial):
    """By hand: z before pooling, gradient of the true-class logit, channel
    (or spatial) mask, batch selection, CE of the head on pool(z * mask); the
    gradient reaches the body through the unmuted features."""
    from rayfed_dg.methods.rsc import rsc_batch_select, rsc_mask

    # width 16: ceil(16 / 3) = 6 channels vs ceil(16 / 3.2) = 5, so swapped drop rates show
    cfg = tiny_cfg("method.name=rsc", f"method.spatial_p={int(spatial)}", "method.batch_drop=0.5", "model.width=16")
    method = build_method(cfg, 3)
    torch.manual_seed(1)
    model = method.build_model(10).train()
    x = torch.from_numpy(tiny_ds.images[:16]).permute(0, 3, 1, 2).float() / 255
    y = torch.from_numpy(tiny_ds.labels[:16])
    ctx = ctx_for()
    method.round_start(model, ctx)
    loss = method.loss(model, x, y, ctx)
    first = next(model.body.parameters())
    got_grad = torch.autograd.grad(loss, first)[0]

    body = model.body
    z = body[:16](x)  # the conv net's body: 4 blocks, then the global pool (index 16)
    zd = z.detach().requires_grad_(True)
    logits = model.head(zd.mean((2, 3)))
    grad = torch.autograd.grad(logits[torch.arange(16), y].sum(), zd)[0]
    mask = rsc_mask(zd.detach(), grad, spatial, 1 / 3 if spatial else 1 / 3.2)
    p0 = F.softmax(logits, 1)[torch.arange(16), y]
    p1 = F.softmax(model.head((zd * mask).mean((2, 3))), 1)[torch.arange(16), y]
    keep = rsc_batch_select(p0.detach(), p1.detach(), 0.5)
    assert 0 < int(keep.sum()) <= 8
    mask[~keep] = 1.0
    expect = F.cross_entropy(model.head((z * mask).mean((2, 3))), y)
    assert torch.allclose(loss, expect, atol=1e-6)
    assert not torch.allclose(loss, F.cross_entropy(model(x), y), atol=1e-4)
    want_grad = torch.autograd.grad(expect, first)[0]
    assert want_grad.abs().sum() > 0 and torch.allclose(got_grad, want_grad, atol=1e-6)


# --------------------------------------------------------------------------- COPA

def _copa(n=3, **sets):
    cfg = tiny_cfg("method.name=copa", *[f"method.{k}={v}" for k, v in sets.items()])
    method = build_method(cfg, num_clients=n)
    torch.manual_seed(0)
    return method, method.build_model(10)


def test_copa_test_prediction_is_the_ensemble_of_assembled_heads():
    method, model = _copa()
    h = model.head
    with torch.no_grad():
        h.ensemble_w.normal_()
        h.ensemble_b.normal_()
        h.ensemble_filled.copy_(torch.tensor([1.0, 0.0, 1.0]))  # client 1 has not trained a head yet
    f = torch.randn(5, h.in_features)
    probs = (F.softmax(f @ h.ensemble_w[0].T + h.ensemble_b[0], 1)
             + F.softmax(f @ h.ensemble_w[2].T + h.ensemble_b[2], 1)) / 2
    model.eval()
    assert torch.allclose(h(f).exp(), probs, atol=1e-6)
    x = torch.randn(2, 3, 16, 16)
    assert torch.allclose(model(x), h(model.features(x)))  # the model predicts with the ensemble
    logit_mode = _copa(ensemble="logit")[1].head
    logit_mode.load_state_dict(h.state_dict())
    logit_mode.eval()
    mean_logits = (f @ h.ensemble_w[0].T + h.ensemble_b[0] + f @ h.ensemble_w[2].T + h.ensemble_b[2]) / 2
    assert torch.allclose(logit_mode(f), mean_logits, atol=1e-5)
    model.train()
    assert torch.allclose(h(f), h.cls(f))  # training: the client's own head


def test_copa_local_loss_adds_the_other_frozen_heads():
    method, model = _copa(lam=0.7)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(0)
    gs = dict(sd, **{"head.ensemble_w": rng.normal(size=sd["head.ensemble_w"].shape).astype(np.float32),
                     "head.ensemble_b": rng.normal(size=sd["head.ensemble_b"].shape).astype(np.float32),
                     "head.ensemble_filled": np.array([1, 1, 1], np.float32)})
    payload = method.server_payloads(2, [1], {}, None, gs, {})[1]
    assert payload["copa_heads"].shape == (3, 10, model.head.in_features + 1)
    ctx = ctx_for(client=1, payload=payload)
    model.train()
    method.round_start(model, ctx)
    x, y = torch.randn(6, 3, 16, 16), torch.arange(6)
    loss = method.loss(model, x, y, ctx)
    f = model.features(x)
    w, b = torch.from_numpy(gs["head.ensemble_w"]), torch.from_numpy(gs["head.ensemble_b"])
    frozen = (F.cross_entropy(f @ w[0].T + b[0], y) + F.cross_entropy(f @ w[2].T + b[2], y)) / 2  # j != 1
    expect = F.cross_entropy(model.head.cls(f), y) + 0.7 * frozen
    assert torch.allclose(loss, expect, atol=1e-5)
    # the frozen heads' loss trains the extractor (its features must suit every domain's classifier)
    first = next(model.body.parameters())
    got, want = torch.autograd.grad(loss, first)[0], torch.autograd.grad(expect, first)[0]
    own_only = torch.autograd.grad(F.cross_entropy(model.head.cls(model.features(x)), y), first)[0]
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, own_only, atol=1e-4)
    assert not model.head.ensemble_w.requires_grad  # frozen: a buffer, never a parameter


def test_copa_server_assembles_each_clients_head_into_its_slot():
    method, model = _copa()
    g = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    ups = []
    for c in (0, 2):
        u = {k: v + 0 for k, v in g.items() if k not in method.private_keys(model)}
        u["head.cls.weight"] = np.full_like(g["head.cls.weight"], c + 1.0)
        u["head.cls.bias"] = np.full_like(g["head.cls.bias"], -c - 1.0)
        ups.append(ClientUpdate(c, 10, u, {}, {}, 0.0, 0.0))
    out = method.assemble_global(1, ups, g, g, {})
    assert set(out) == method.assembles(model)
    assert np.all(out["head.ensemble_w"][0] == 1) and np.all(out["head.ensemble_w"][2] == 3)
    assert np.all(out["head.ensemble_b"][2] == -3)
    np.testing.assert_array_equal(out["head.ensemble_w"][1], g["head.ensemble_w"][1])  # not sampled: kept
    assert out["head.ensemble_filled"].tolist() == [1, 0, 1]
    assert method.tensor_group("head.cls.weight", True) == "copa_own_head"


@pytest.mark.slow
def test_copa_global_model_carries_the_assembled_heads(ray_session, tiny_ds, engine_host):
    from conftest import server_rounds

    cfg = tiny_cfg("method.name=copa", "training.local_steps=2")
    split, (s1,), bcast = server_rounds(ray_session, cfg, tiny_ds, rounds=1, host=engine_host(tiny_ds, 1))
    g = s1["global_state"]
    for c in range(split.num_clients):
        np.testing.assert_array_equal(g["head.ensemble_w"][c], s1["client_store"][c]["head.cls.weight"])
    assert "head.ensemble_w" not in bcast and "head.cls.weight" not in bcast  # the heads travel as payload


# --------------------------------------------------------------------------- DSON

def test_dson_mixes_bn_and_in_statistics_by_hand():
    from rayfed_dg.models import DSON

    torch.manual_seed(0)
    m = DSON(3)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        m.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
        m.logit_bn.fill_(0.3)
        m.logit_in.fill_(-0.4)
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    w_bn = math.exp(0.3) / (math.exp(0.3) + math.exp(-0.4))
    y = m.train()(x).detach()
    xc = x[:, 2]
    mu = w_bn * xc.mean() + (1 - w_bn) * x[1, 2].mean()
    var = w_bn * xc.var(unbiased=False) + (1 - w_bn) * x[1, 2].var(unbiased=False)
    assert abs(float(y[1, 2, 3, 4]) - float(2.0 * (x[1, 2, 3, 4] - mu) / torch.sqrt(var + 1e-5) - 0.3)) < 1e-5
    # running statistics as BatchNorm's (momentum 0.1, unbiased variance)
    assert torch.allclose(m.running_var, 0.9 + 0.1 * x.transpose(0, 1).reshape(3, -1).var(1), atol=1e-5)
    m.eval()
    y2 = m(x)
    mu = w_bn * m.running_mean[0] + (1 - w_bn) * x[3, 0].mean()
    var = w_bn * m.running_var[0] + (1 - w_bn) * x[3, 0].var(unbiased=False)
    assert abs(float(y2[3, 0, 0, 1]) - float(1.5 * (x[3, 0, 0, 1] - mu) / torch.sqrt(var + 1e-5) + 0.1)) < 1e-5


def test_dson_layers_are_client_specific_and_the_regularizer_is_gperxans():
    from rayfed_dg.models import DSON

    method = build_method(tiny_cfg("method.name=dson"), 3)
    model = method.build_model(10)
    assert sum(isinstance(m, DSON) for m in model.modules()) == 4  # every BN of the conv net
    local = method.local_keys(model)
    assert local == {f"body.{i}.{k}" for i in (1, 5, 9, 13)
                     for k in ("weight", "bias", "logit_bn", "logit_in", "running_mean", "running_var",
                               "num_batches_tracked")}
    assert method.tensor_group("body.1.weight", True) == "dson_domain_specific"
    ctx = ctx_for()
    model.train()
    method.round_start(model, ctx)
    x, y = torch.randn(4, 3, 16, 16), torch.arange(4)
    f = model.features(x)
    expect = F.cross_entropy(model.head(f), y) + 0.5 * F.cross_entropy(F.linear(f, *ctx.scratch["h_g"]), y)
    loss = method.loss(model, x, y, ctx)
    assert torch.allclose(loss, expect, atol=1e-5)
    # and the same gradient: the regularizer reaches the extractor through the features (a detached f fails)
    params = [p for p in model.parameters() if p.requires_grad]
    for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(expect, params)):
        assert torch.allclose(got, want, atol=1e-6)


# --------------------------------------------------------------------------- CSAC

def test_csac_mk_mmd_matches_the_kernel_sums():
    from rayfed_dg.methods.csac import KERNEL_ALPHAS, mk_mmd

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g) + 1
    x = torch.cat([a, b])
    d2 = ((x[:, None] - x[None]) ** 2).sum(-1)
    k = sum(torch.exp(-d2 / (2 * al * d2.mean())) for al in KERNEL_ALPHAS)
    off = ~torch.eye(5, dtype=torch.bool)
    expect = k[:5, :5][off].mean() + k[5:, 5:][off].mean() - 2 * k[:5, 5:].mean() + 2 / 4
    assert torch.allclose(mk_mmd(a, b), expect, atol=1e-5)
    assert float(mk_mmd(a, b)) > float(mk_mmd(a, a + 0.01))


def test_csac_layerwise_aggregation_weighs_by_distance_to_the_mean():
    from rayfed_dg.methods.csac import layerwise_weights

    np.testing.assert_allclose(layerwise_weights([np.array([0.0, 0]), np.array([2.0, 0]), np.array([4.0, 0])]),
                               [0.5, 0.0, 0.5])
    method = build_method(tiny_cfg("method.name=csac"), 3)
    g = {"a": np.zeros(2, np.float32), "n": np.array(3, np.int64), "private.a": np.zeros(2, np.float32)}
    ups = [ClientUpdate(i, 1, {"a": np.array(v, np.float32), "n": np.array(i, np.int64)}, {}, {}, 0.0, 0.0)
           for i, v in enumerate([[0.0, 0.0], [1.0, 0.0], [4.0, 0.0]])]
    out = method.assemble_global(1, ups, g, g, {})
    d = np.array([5 / 3, 2 / 3, 7 / 3])  # |v - mean| with mean 5/3
    np.testing.assert_allclose(out["a"], [(d / d.sum()) @ np.array([0.0, 1.0, 4.0]), 0.0], rtol=1e-6)
    assert set(out) == {"a"}  # integer buffers and the private model keep the engine's values


def test_csac_pretrains_once_then_calibrates_to_its_private_model(tiny_ds):
    cfg = tiny_cfg("method.name=csac", "method.pretrain_steps=3", "training.local_steps=2", "method.lam=0.6")
    r = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, 10, 3)
    sd = r.model.state_dict()
    g = to_numpy_state(sd, sd.keys())
    first = r.run_client(0, 1, np.arange(96), g, {}, {})
    assert first.stats["pretrained"] == 1.0 and first.private["private_ready"] == 1.0
    assert not any(k.startswith("private") for k in first.update)
    np.testing.assert_array_equal(first.private["private.head.weight"], first.update["head.weight"])
    # round 2: the loss is CE + lam MK-MMD(private logits, logits) on the first batch
    from rayfed_dg.methods.csac import mk_mmd

    method, model = r.method, r.model
    model.load_state_dict({**{k: torch.from_numpy(v) for k, v in g.items()},
                           **{k: torch.from_numpy(np.asarray(v)) for k, v in first.private.items()}})
    x = torch.from_numpy(tiny_ds.images[:32]).permute(0, 3, 1, 2).float() / 255
    y = torch.from_numpy(tiny_ds.labels[:32])
    model.train()
    model.private.eval()
    expect = F.cross_entropy(model(x), y) + 0.6 * mk_mmd(model.private(x), model(x))
    named = {k: p for k, p in model.named_parameters() if p.requires_grad}
    assert named and not any(k.startswith("private") for k in named)  # the private model is frozen
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = dict(zip(named, torch.autograd.grad(expect, list(named.values()))))
    ctx = ctx_for()
    res = method.local_train(model, lambda: iter([(x, y)]), ctx)  # one step: its loss is reported
    assert abs(res.loss - expect.item()) < 1e-4 and "pretrained" not in res.stats and res.steps == 1
    # the step is SGD's first (momentum buffer = gradient) on that loss's gradient: the MK-MMD term pulls the
    # model's logits (a detached one would not), and the private model does not move
    lr, wd = method.lr_at(ctx.round), cfg.training.weight_decay
    after = model.state_dict()
    for k, g in grads.items():
        assert torch.allclose(after[k], before[k] - lr * (g + wd * before[k]), atol=1e-6), k
    for k in after:
        if k.startswith("private"):
            assert torch.equal(after[k], before[k]), k


# --------------------------------------------------------------------------- centralized row

def test_centralized_partition_is_one_client_with_every_source(tiny_ds):
    from rayfed_dg.data import leave_one_domain_out

    fed = leave_one_domain_out(tiny_ds, "texture", 0.2, 0)
    cen = leave_one_domain_out(tiny_ds, "texture", 0.2, 0, "centralized")
    assert cen.num_clients == 1 and cen.client_domains == ["mono+negative+colour"]
    np.testing.assert_array_equal(cen.clients[0], np.sort(np.concatenate(fed.clients)))
    assert {k: v.tolist() for k, v in cen.val.items()} == {k: v.tolist() for k, v in fed.val.items()}


def test_a_compare_row_with_the_centralized_partition_keeps_the_step_budget(tiny_ds):
    from rayfed_dg.config import load_config
    from rayfed_dg.engine import resolve_variants
    from rayfed_dg.errors import ConfigError

    sets = ["data.resolution=16", "training.local_steps=7",
            "compare=[{name: fedavg}, {name: fedavg, label: centralized, partition: {strategy: centralized}},"
            " {name: elcfs, stages: {amplitude: {fraction: 0.5}}}]"]
    rows = {label: (cfg, splits) for label, cfg, splits in resolve_variants(load_config(None, sets), tiny_ds,
                                                                           ["texture", "mono"])}
    fed, cen, elcfs = rows["fedavg"], rows["centralized"], rows["elcfs"]
    assert fed[0].training.local_steps == 7 and fed[1][0].num_clients == 3
    assert cen[0].partition.strategy == "centralized" and cen[1][0].num_clients == 1
    assert cen[0].training.local_steps == 21 and cen[0].method.name == "fedavg"  # 3 clients x 7 steps
    assert "amplitude" in elcfs[0].stages and not fed[0].stages  # a row's stages are its own
    # 30 clients, 10 a round: the centralized client trains 10 x 7 steps a round
    part = ["partition.strategy=single_domain", "partition.num_clients=30", "training.clients_per_round=10"]
    (_, c30, _), = [r for r in resolve_variants(load_config(None, sets[:2] + part + [
        "compare=[{name: fedavg, partition: {strategy: centralized}}]"]), tiny_ds, ["texture"])]
    assert c30.training.local_steps == 70 and c30.training.clients_per_round is None
    # epochs with partial participation: no fixed budget to match
    with pytest.raises(ConfigError, match="set training.local_steps"):
        resolve_variants(load_config(None, ["training.local_steps=null"] + part + [
            "compare=[{name: fedavg, partition: {strategy: centralized}}]"]), tiny_ds, ["texture"])
    with pytest.raises(ConfigError, match="only compare rows"):
        load_config(None, ["method.partition={strategy: centralized}"])


def test_compare_rows_with_the_comparisons_stages_share_its_splits(tiny_ds):
    """Built once for every row whose partition and data stages are the comparison's (a row's config is written
    with its stage parameters resolved, the comparison's as given: equal all the same)."""
    from rayfed_dg.config import load_config
    from rayfed_dg.engine import resolve_variants

    sets = ["data.resolution=16", "stages.ccst={k: 2}",
            "compare=[{name: fedavg}, {name: fedprox}, {name: fedavg, label: other, stages: {ccst: {k: 1}}}]"]
    rows = {label: splits for label, _, splits in resolve_variants(load_config(None, sets), tiny_ds, ["texture"])}
    assert rows["fedavg"] is rows["fedprox"] and rows["other"] is not rows["fedavg"]
