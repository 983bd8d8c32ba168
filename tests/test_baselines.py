"""Style-augmentation baselines: MixStyle (ICLR 2021) and DSU (ICLR 2022)."""
import numpy as np
import torch

from conftest import tiny_cfg
from rayfed_dg.engine import ClientRunner
from rayfed_dg.engine.worker import to_numpy_state
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
        model = build_method(cfg).build_model(7)
        return [n for n, m in model.named_modules() if isinstance(m, RandomStyleLayer)]

    assert sites("mixstyle", "resnet18") == ["body.layer1.1", "body.layer2.1", "body.layer3.1"]
    assert sites("dsu", "resnet18") == ["body.conv1.1", "body.maxpool.1", "body.layer1.1", "body.layer2.1",
                                        "body.layer3.1", "body.layer4.1"]
    assert sites("dsu", "convnet") == ["body.0.1", "body.3.1", "body.7.1", "body.11.1", "body.15.1"]


def test_style_baselines_are_seeded_and_change_training(tiny_ds):
    def update(method):
        cfg = tiny_cfg(f"method.name={method}", "training.local_steps=4")
        r = ClientRunner(cfg.to_dict(), tiny_ds.images, tiny_ds.labels, 10)
        sd = r.model.state_dict()
        g = to_numpy_state(sd, sd.keys())
        return r.train(0, 1, np.arange(128), g, {}, {})["update"]

    base = update("fedavg")
    for m in ("mixstyle", "dsu"):
        a, b = update(m), update(m)
        assert all(np.array_equal(a[k], b[k]) for k in a)  # the same seed, the same weights
        assert not np.allclose(a["head.weight"], base["head.weight"])  # the augmentation took effect
