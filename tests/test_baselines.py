"""Style-augmentation baselines: MixStyle (ICLR 2021) and DSU (ICLR 2022)."""
import numpy as np
import pytest
import torch
from conftest import tiny_cfg

from rayfed_dg.engine import ClientRunner
from rayfed_dg.engine.workers.worker import to_numpy_state
from rayfed_dg.methods import build_method
from rayfed_dg.models.style import DSULayer, MixStyleLayer, RandomStyleLayer, _beta


def test_dsu_matches_eq_3_to_8_by_hand():
    x = torch.randn(4, 3, 5, 5) * 3 + 1
    layer = DSULayer(p=1.0).train()
    layer.gen = torch.Generator().manual_seed(7)
    out = layer(x)
    g = torch.Generator().manual_seed(7)
    torch.rand(1, generator=g)  # the firing coin
    mu = x.mean((2, 3))
    sig = torch.sqrt(x.var((2, 3), unbiased=True) + 1e-6)
    s_mu = torch.sqrt(mu.var(0, unbiased=True) + 1e-6)
    s_sig = torch.sqrt(sig.var(0, unbiased=True) + 1e-6)
    beta = mu + torch.randn(4, 3, generator=g) * s_mu
    gamma = sig + torch.randn(4, 3, generator=g) * s_sig
    expect = (x - mu[..., None, None]) / sig[..., None, None] * gamma[..., None, None] + beta[..., None, None]
    assert torch.allclose(out, expect, atol=1e-5)
    assert torch.equal(layer.eval()(x), x)


def test_mixstyle_mixes_detached_statistics_by_hand():
    x = torch.randn(6, 2, 4, 4) * 2 - 1
    layer = MixStyleLayer(p=1.0, alpha=0.1).train()
    layer.gen = torch.Generator().manual_seed(3)
    out = layer(x)
    g = torch.Generator().manual_seed(3)
    torch.rand(1, generator=g)
    lam = _beta(0.1, 6, g)
    perm = torch.randperm(6, generator=g)
    mu = x.mean((2, 3))
    sig = torch.sqrt(x.var((2, 3), unbiased=False) + 1e-6)
    m2, s2 = lam * mu + (1 - lam) * mu[perm], lam * sig + (1 - lam) * sig[perm]
    assert torch.allclose(out, (x - mu[..., None, None]) / sig[..., None, None] * s2[..., None, None]
                          + m2[..., None, None], atol=1e-5)
    never = MixStyleLayer(p=0.0).train()
    never.gen = torch.Generator()
    assert torch.equal(never(x), x) and torch.equal(layer.eval()(x), x)


def test_placements_name_the_official_sites():
    def sites(method, arch):
        cfg = tiny_cfg(f"method.name={method}", f"model.arch={arch}")
        model = build_method(cfg, 3).build_model(7)
        return [n for n, m in model.named_modules() if isinstance(m, RandomStyleLayer)]

    assert sites("mixstyle", "resnet18") == ["body.layer1.1", "body.layer2.1", "body.layer3.1"]
    assert sites("dsu", "resnet18") == ["body.conv1.1", "body.maxpool.1", "body.layer1.1", "body.layer2.1",
                                        "body.layer3.1", "body.layer4.1"]
    assert sites("dsu", "convnet") == ["body.0.1", "body.3.1", "body.7.1", "body.11.1", "body.15.1"]


def test_style_baselines_are_seeded_and_change_training(tiny_ds):
    def update(method):
        cfg = tiny_cfg(f"method.name={method}", "training.local_steps=4")
        r = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, 10, 3)
        sd = r.model.state_dict()
        g = to_numpy_state(sd, sd.keys())
        return r.run_client(0, 1, np.arange(128), g, {}, {}).update

    base = update("fedavg")
    for m in ("mixstyle", "dsu"):
        a, b = update(m), update(m)
        assert all(np.array_equal(a[k], b[k]) for k in a)  # the same seed, the same weights
        assert not np.allclose(a["head.weight"], base["head.weight"])  # the augmentation took effect


def test_fedsr_kl_and_loss_by_hand(tiny_ds):
    from torch.distributions import Normal, kl_divergence

    from rayfed_dg.methods.base import ClientContext
    from rayfed_dg.methods.fedsr import gaussian_kl

    mq, sq, mp, sp = torch.randn(5, 4), torch.rand(5, 4) + 0.1, torch.randn(5, 4), torch.rand(5, 4) + 0.1
    assert torch.allclose(gaussian_kl(mq, sq, mp, sp), kl_divergence(Normal(mq, sq), Normal(mp, sp)).sum(-1),
                          atol=1e-5)
    cfg = tiny_cfg("method.name=fedsr", "method.z_dim=6", "method.l2r=0.3", "method.cmi=0.7")
    method = build_method(cfg, 3)
    model = method.build_model(10).train()
    ctx = ClientContext(0, 1, torch.device("cpu"), torch.Generator().manual_seed(0), 10)
    method.round_start(model, ctx)
    x = torch.randn(8, 3, 16, 16)
    y = torch.arange(8) % 10
    loss = method.loss(model, x, y, ctx)
    mu, sig, z = model.head.last
    h = model.head
    assert torch.allclose(sig, torch.nn.functional.softplus(h.enc(model.features(x))[:, 6:]), atol=1e-6)
    kl = kl_divergence(Normal(mu, sig), Normal(h.r_mu[y], torch.nn.functional.softplus(h.r_s[y]))).sum(1).mean()
    ce = torch.nn.functional.cross_entropy(h.cls(z), y)
    assert torch.allclose(loss, ce + 0.3 * (z ** 2).sum(1).mean() + 0.7 * kl, atol=1e-5)
    model.eval()
    a, b = model(x), model(x)
    assert torch.equal(a, b) and torch.allclose(a.exp().sum(1), torch.ones(8), atol=1e-5)


@pytest.mark.slow
def test_fedsr_reference_distribution_never_leaves_the_client(ray_session, tiny_ds):
    from conftest import server_rounds

    cfg = tiny_cfg("method.name=fedsr", "method.z_dim=6")
    split, (s1, s2), bcast = server_rounds(ray_session, cfg, tiny_ds, rounds=2)
    init = build_method(cfg, 3).build_model(10).state_dict()
    assert "head.r_mu" not in bcast
    # the global model keeps the initial reference distribution: no client's reached it
    assert np.array_equal(s2["global_state"]["head.r_mu"], init["head.r_mu"].numpy())
    mus = [s2["client_store"][c]["head.r_mu"] for c in range(split.num_clients)]
    assert not np.array_equal(mus[0], mus[1]) and not np.array_equal(mus[0], init["head.r_mu"].numpy())


def test_fedprox_proximal_term_by_hand():
    """Li et al. Eq. 2: h(w) = F(w) + mu/2 ||w - w_g||^2 over every trainable
    parameter, w_g the weights received at the start of the round."""
    import torch.nn.functional as F

    from rayfed_dg.methods import ClientContext, build_method

    cfg = tiny_cfg("method.name=fedprox", "method.mu=0.3")
    method = build_method(cfg, 3)
    model = method.build_model(10)
    ctx = ClientContext(client_id=0, round=1, device=torch.device("cpu"), generator=torch.Generator(), num_samples=4)
    method.round_start(model, ctx)
    w_g = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    model.eval()  # BN with fixed statistics: both sides see the same forward
    got = method.loss(model, x, y, ctx)
    dist = sum(float(((p.detach() - w_g[n]) ** 2).sum()) for n, p in model.named_parameters())
    expect = F.cross_entropy(model(x), y).item() + 0.3 / 2 * dist
    assert abs(float(got.detach()) - expect) < 1e-5 and dist > 0
    # its gradient on a weight is dCE/dw + mu (w - w_g)
    got.backward()
    w = model.head.weight
    ce_only = F.cross_entropy(model(x), y)
    g_ce = torch.autograd.grad(ce_only, w)[0]
    assert torch.allclose(w.grad, g_ce + 0.3 * (w.detach() - w_g["head.weight"]), atol=1e-6)


@pytest.mark.parametrize("name,kinds", [("fedbn", ("weight", "bias", "running_mean", "running_var",
                                                    "num_batches_tracked")),
                                         ("silobn", ("running_mean", "running_var", "num_batches_tracked"))])
def test_fedbn_and_silobn_keep_the_shortcut_batchnorm_local(name, kinds):
    # ResNet-18's projection shortcuts (layerK.0.downsample.1) are BatchNorm too: a name filter on "bn" misses them
    from rayfed_dg.methods import build_method

    method = build_method(tiny_cfg(f"method.name={name}", "model.arch=resnet18"), 3)
    model = method.build_model(7)
    local = method.local_keys(model)
    for stage in (2, 3, 4):
        for kind in kinds:
            assert f"body.layer{stage}.0.downsample.1.{kind}" in local, (name, stage, kind)
    expect = {f"{n}.{k}" for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d) for k in kinds}
    assert local == expect  # exactly the BN state of the given kinds, the 20 BN layers of ResNet-18
    assert "body.layer2.0.downsample.0.weight" not in local  # the shortcut conv is shared
