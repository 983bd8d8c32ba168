"""gPerXAN (CVPR 2024): XAN formula, placement, PerXAN state, frozen h_g."""
import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import server_rounds, tiny_cfg

from rayfed_dg.engine import ClientRunner
from rayfed_dg.methods import ClientContext, build_method
from rayfed_dg.models import XAN, build_backbone, placement_names
from rayfed_dg.models.norms import IBN


def test_xan_matches_eq2_by_hand_in_train_and_eval():
    torch.manual_seed(0)
    m = XAN(3)
    with torch.no_grad():
        m.bn.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        m.bn.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
        m.inorm.weight.copy_(torch.tensor([0.7, 1.1, -1.0]))
        m.inorm.bias.copy_(torch.tensor([-0.2, 0.0, 0.5]))
        m.logit_bn.fill_(0.3)
        m.logit_in.fill_(-0.4)
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    m.train()
    y = m(x)
    # hand computation of one element: sample 1, channel 2, position (3, 4)
    xc = x[:, 2]
    mu_bn, var_bn = xc.mean(), xc.var(unbiased=False)
    mu_in, var_in = x[1, 2].mean(), x[1, 2].var(unbiased=False)
    w_bn = np.exp(0.3) / (np.exp(0.3) + np.exp(-0.4))
    v = x[1, 2, 3, 4]
    by_hand = w_bn * (2.0 * (v - mu_bn) / torch.sqrt(var_bn + 1e-5) - 0.3) + \
        (1 - w_bn) * (-1.0 * (v - mu_in) / torch.sqrt(var_in + 1e-5) + 0.5)
    assert abs(float(y[1, 2, 3, 4]) - float(by_hand)) < 1e-5
    from rayfed_dg.models.norms import xan_output_by_hand

    assert torch.allclose(y, xan_output_by_hand(x, m, training=True), atol=1e-5)
    m.eval()  # BN side uses running statistics, IN side still per-sample
    assert torch.allclose(m(x), xan_output_by_hand(x, m, training=False), atol=1e-5)
    assert abs(m.weights().sum().item() - 1) < 1e-7


def test_xan_from_pretrained_bn_keeps_its_values():
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.weight.uniform_()
        bn.bias.uniform_()
        bn.running_mean.uniform_()
        bn.running_var.uniform_(1, 2)
    x = XAN.from_bn(bn)
    assert torch.equal(x.bn.running_var, bn.running_var) and torch.equal(x.bn.weight, bn.weight)
    assert torch.equal(x.inorm.weight, bn.weight) and torch.equal(x.inorm.bias, bn.bias)
    i = IBN.from_bn(bn)
    assert torch.equal(i.inorm.weight, bn.weight[:2]) and torch.equal(i.bn.running_mean, bn.running_mean[2:])


def test_xan_and_ibn_from_a_cumulative_average_batchnorm_track_statistics_at_momentum_0_1():
    # momentum None (a cumulative average) has no meaning once the layer is split: both branches move their
    # running mean by PyTorch's default 0.1 of the batch mean from the statistics they start with
    bn = nn.BatchNorm2d(4, momentum=None)
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([1.0, -1.0, 2.0, 0.5]))
    x = torch.arange(2 * 4 * 3 * 3, dtype=torch.float32).reshape(2, 4, 3, 3) / 10
    batch_mean = x.mean(dim=(0, 2, 3))
    xan = XAN.from_bn(bn).train()
    xan(x)
    assert torch.allclose(xan.bn.running_mean, 0.9 * bn.running_mean + 0.1 * batch_mean, atol=1e-6)
    ibn = IBN.from_bn(bn).train()
    ibn(x)
    assert torch.allclose(ibn.bn.running_mean, 0.9 * bn.running_mean[2:] + 0.1 * batch_mean[2:], atol=1e-6)


def test_xan_bn_weight_sets_the_initial_mix_and_reaches_the_method():
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(1, 2)
    ref = XAN.from_bn(bn)  # the reference code's start: both logits 1, bit for bit
    assert float(ref.logit_bn) == 1.0 and float(ref.logit_in) == 1.0
    near = XAN.from_bn(bn, 0.9)
    # softmax(1 + ln 9, 1) = (9, 1) / 10
    assert float(near.logit_in) == 1.0 and abs(float(near.logit_bn) - (1 + np.log(9.0))) < 1e-6
    assert torch.allclose(near.weights(), torch.tensor([0.9, 0.1]), atol=1e-6)
    x = torch.randn(2, 4, 5, 5)
    bn.eval(), near.eval()
    # w_bn = 0.9: the output is 0.9 of the pretrained BatchNorm's plus 0.1 of the instance-normalised branch
    inorm = (x - x.mean((2, 3), keepdim=True)) / torch.sqrt(x.var((2, 3), unbiased=False, keepdim=True) + 1e-5)
    by_hand = 0.9 * bn(x) + 0.1 * (bn.weight.view(1, -1, 1, 1) * inorm + bn.bias.view(1, -1, 1, 1))
    assert torch.allclose(near(x), by_hand, atol=1e-5)
    with pytest.raises(ValueError, match="between 0 and 1"):
        XAN(4, bn_weight=1.0)
    # auto: the reference code's 0.5 from scratch, 0.9 on a pretrained backbone (only the config is read here)
    assert build_method(tiny_cfg("method.name=gperxan"), 2).bn_weight() == 0.5
    assert build_method(tiny_cfg("method.name=gperxan", "model.pretrained=some.pth"), 2).bn_weight() == 0.9
    assert build_method(tiny_cfg("method.name=gperxan", "model.pretrained=some.pth", "method.bn_weight=0.5"),
                        2).bn_weight() == 0.5
    from rayfed_dg.models.norms import apply_norm

    net = build_backbone("convnet", 10)  # the surgery on its own starts where the reference code does
    assert apply_norm(net, "all", "xan") and all(torch.equal(m.weights(), torch.tensor([0.5, 0.5]))
                                                 for m in net.modules() if isinstance(m, XAN))
    method = build_method(tiny_cfg("method.name=gperxan", "method.bn_weight=0.75"), 2)
    xans = [m for m in method.build_model(10).modules() if isinstance(m, XAN)]
    assert xans and all(torch.allclose(m.weights(), torch.tensor([0.75, 0.25]), atol=1e-6) for m in xans)


def test_placements_name_the_documented_layers():
    r50 = build_backbone("resnet50", 7)
    # the default reading: a "block" is a ResNet stage
    r18 = build_backbone("resnet18", 7)
    assert placement_names(r18, "stages:2") == [
        "body.layer1.0.bn1", "body.layer1.0.bn2", "body.layer1.1.bn1", "body.layer1.1.bn2",
        "body.layer2.0.bn1", "body.layer2.0.bn2", "body.layer2.0.downsample.1", "body.layer2.1.bn1",
        "body.layer2.1.bn2"]
    s4 = placement_names(r50, "stages:4")
    assert len(s4) == 52 and "body.bn1" not in s4 and "body.layer4.2.bn3" in s4
    assert len(placement_names(r50, "stages:2")) == 23  # layer1: 3 x 3 + downsample, layer2: 4 x 3 + downsample
    from rayfed_dg.methods.gperxan import DEFAULT_PLACEMENT

    assert DEFAULT_PLACEMENT["resnet50"] == "stages:4" and DEFAULT_PLACEMENT["resnet18"] == "stages:4"
    # the residual-unit reading stays as an explicit option
    b4 = placement_names(r50, "blocks:4")
    assert b4[0] == "body.layer1.0.bn1" and b4[-1] == "body.layer2.0.downsample.1" and len(b4) == 14
    assert "body.bn1" not in b4 and not any("layer2.1" in n for n in b4)
    assert len(placement_names(r50, "blocks:2")) == 7 and len(placement_names(r50, "all")) == 53
    d = placement_names(build_backbone("densenet121", 2), "dense1")
    assert len(d) == 13 and d[-1] == "body.features.transition1.norm"
    assert all("denseblock1" in n or "transition1" in n for n in d)
    assert placement_names(build_backbone("convnet", 10), "blocks:2") == ["body.1", "body.5"]
    assert placement_names(build_backbone("resnet18", 7), "first_bn:stages:3") == [
        f"body.layer{s}.{b}.bn1" for s in (1, 2, 3) for b in (0, 1)]
    with pytest.raises(ValueError, match="unknown placement"):
        placement_names(r50, "first4")


def test_gperxan_model_surgery_and_local_keys():
    cfg = tiny_cfg("method.name=gperxan", "model.arch=resnet18")
    m = build_method(cfg, 3)
    net = m.build_model(7)
    xans = [n for n, mod in net.named_modules() if isinstance(mod, XAN)]
    assert xans == placement_names(build_backbone("resnet18", 7), "stages:4")  # the default reading
    assert len(xans) == 19  # every BN of ResNet-18 but the stem's
    local = m.local_keys(net)
    assert len(local) == len(xans) * 6  # bn weight, bias, running mean/var, num_batches_tracked, logit_bn
    assert all(".bn." in k or k.endswith("logit_bn") for k in local)
    assert not any(".inorm." in k or k.endswith("logit_in") for k in local)
    off = build_method(tiny_cfg("method.name=gperxan", "method.personalize=false"), 3)
    assert off.local_keys(off.build_model(10)) == set()


def test_guiding_head_is_frozen_and_gets_no_gradient(tiny_ds):
    cfg = tiny_cfg("method.name=gperxan", "method.lam=1.0")
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, 10, 3)
    model, method = runner.model, runner.method
    ctx = ClientContext(0, 1, torch.device("cpu"), torch.Generator().manual_seed(0), 64)
    method.round_start(model, ctx)
    w_g, b_g = (t.clone() for t in ctx.scratch["h_g"])
    assert not ctx.scratch["h_g"][0].requires_grad
    gen = torch.Generator().manual_seed(1)
    res = method.local_train(model, lambda: runner.batches(np.arange(200), gen), ctx)
    assert res.samples == 200 and res.steps == 7  # ceil(200 / 32) batches, one pass
    assert torch.equal(ctx.scratch["h_g"][0], w_g) and torch.equal(ctx.scratch["h_g"][1], b_g)
    assert not torch.equal(model.head.weight, w_g)  # the local head did train
    # the regularizer alone sends gradient to the features only
    x, y = runner._tensors(np.arange(8), None)
    model.zero_grad()
    feats = model.features(x)
    reg = torch.nn.functional.cross_entropy(torch.nn.functional.linear(feats, *ctx.scratch["h_g"]), y)
    reg.backward()
    assert model.head.weight.grad is None
    assert model.body[0].weight.grad is not None and model.body[0].weight.grad.abs().sum() > 0


def test_loss_is_ce_plus_lambda_ce_through_global_head(tiny_ds):
    cfg = tiny_cfg("method.name=gperxan", "method.lam=0.25")
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, 10, 3)
    model, method = runner.model, runner.method
    ctx = ClientContext(0, 1, torch.device("cpu"), torch.Generator(), 8)
    method.round_start(model, ctx)
    with torch.no_grad():
        ctx.scratch["h_g"][0].mul_(2.0)  # make h_g differ from the local head
    x, y = runner._tensors(np.arange(8), None)
    model.train()
    got = method.loss(model, x, y, ctx)
    f = model.features(x)
    ce = torch.nn.functional.cross_entropy
    expect = ce(model.head(f), y) + 0.25 * ce(f @ ctx.scratch["h_g"][0].T + ctx.scratch["h_g"][1], y)
    assert abs(float(got) - float(expect)) < 1e-5


@pytest.mark.slow
def test_perxan_bn_side_is_the_clients_own_and_global_averages_it(ray_session, tiny_ds, engine_host):
    ray = ray_session
    cfg = tiny_cfg("method.name=gperxan")
    split, (s1, s2), bcast = server_rounds(ray, cfg, tiny_ds, rounds=2, host=engine_host(tiny_ds, 2))
    method = build_method(cfg, 3)
    local = method.local_keys(method.build_model(10))
    assert local and local.isdisjoint(bcast)
    assert any(".inorm." in k for k in bcast) and any(k.endswith("logit_in") for k in bcast)
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, 10, 3)
    n = split.client_sizes().astype(np.float64)
    for c in range(3):
        # after round 2: the client's round-1 BN side plus its own round-2 training
        redo = runner.run_client(c, 2, split.clients[c], s1["global_state"], s1["client_store"][c], {}).update
        for k in local:
            np.testing.assert_array_equal(s2["client_store"][c][k], redo[k])
    for k in [k for k in local if not k.endswith("num_batches_tracked")]:
        avg = sum(n[c] * s2["client_store"][c][k].astype(np.float64) for c in range(3)) / n.sum()
        np.testing.assert_allclose(s2["global_state"][k], avg.astype(np.float32), rtol=1e-5, atol=1e-6)
        # ... and that global value is not what the clients hold
        assert not all(np.array_equal(s2["global_state"][k], s2["client_store"][c][k]) for c in range(3))


def test_unseen_target_is_evaluated_with_the_weighted_average_of_everything(ray_session, tiny_ds, engine_host):
    """Algorithm 1 line 12: the global model tested on the unseen target is the
    sample-weighted average of all client parameters, the BN sides included
    (they are never broadcast back, but they are averaged)."""
    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import Reducer, run_federation
    from rayfed_dg.engine.workers.worker import to_numpy_state

    cfg = tiny_cfg("method.name=gperxan", "training.rounds=1")
    split = leave_one_domain_out(tiny_ds, "texture", 0.2, 0)
    res = run_federation(cfg, split, None, None, 10, progress=False, host=engine_host(tiny_ds, 2))
    row = [m for m in res.metrics if m["split"] == "target_test"][0]
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, 10, 3)
    sd = runner.model.state_dict()
    g0 = to_numpy_state(sd, sd.keys())
    local = build_method(cfg, 3).local_keys(runner.model)
    ups = {c: runner.run_client(c, 1, split.clients[c], g0, {k: g0[k] for k in local}, {}).update
           for c in range(3)}
    n = split.client_sizes()
    reducer = Reducer([0, 1, 2], {c: float(n[c]) for c in range(3)})
    for c in (2, 0, 1):
        reducer.add(c, ups[c])
    avg = reducer.result(g0)
    assert all(k in ups[0] for k in local)  # the BN sides were uploaded
    correct, loss, cnt = runner.evaluate(avg, split.test["texture"], 512)
    assert correct / cnt == row["accuracy"] and abs(loss / cnt - row["loss"]) < 1e-6
    # with the clients' own BN sides left out (the initial ones instead), the target figures differ
    correct2, loss2, _ = runner.evaluate({**avg, **{k: g0[k] for k in local}}, split.test["texture"], 512)
    assert abs(loss2 / cnt - row["loss"]) > 1e-4


def test_ibn_forward_by_hand():
    torch.manual_seed(0)
    m = IBN(4)
    with torch.no_grad():
        m.inorm.weight.copy_(torch.tensor([1.5, 0.5]))
        m.inorm.bias.copy_(torch.tensor([0.1, -0.1]))
        m.bn.weight.copy_(torch.tensor([2.0, 0.7]))
        m.bn.bias.copy_(torch.tensor([0.3, 0.0]))
        m.bn.running_mean.copy_(torch.tensor([0.4, -0.2]))
        m.bn.running_var.copy_(torch.tensor([1.3, 0.6]))
    x = torch.randn(3, 4, 5, 5)
    for training in (True, False):
        m.train(training)
        y = m(x)
        a, b = x[:, :2], x[:, 2:]
        # first C // 2 channels: per sample and channel (instance) statistics, in train and eval alike
        mu_a, var_a = a.mean((2, 3), keepdim=True), a.var((2, 3), unbiased=False, keepdim=True)
        ya = (a - mu_a) / torch.sqrt(var_a + 1e-5) * m.inorm.weight.view(1, 2, 1, 1) + m.inorm.bias.view(1, 2, 1, 1)
        # the rest: batch statistics in training, running statistics at test
        if training:
            mu_b, var_b = b.mean((0, 2, 3), keepdim=True), b.var((0, 2, 3), unbiased=False, keepdim=True)
        else:
            mu_b, var_b = m.bn.running_mean.view(1, 2, 1, 1), m.bn.running_var.view(1, 2, 1, 1)
        yb = (b - mu_b) / torch.sqrt(var_b + 1e-5) * m.bn.weight.view(1, 2, 1, 1) + m.bn.bias.view(1, 2, 1, 1)
        assert torch.allclose(y, torch.cat([ya, yb], 1), atol=1e-5), training


def test_gperxan_params_refuse_what_the_paper_excludes_and_default_to_its_setting():
    from rayfed_dg.config import ConfigError, load_config

    p = build_method(tiny_cfg("method.name=gperxan"), 3).p
    # the paper's PACS lambda, its XAN with the BN side personalised, its placement per backbone
    assert (p.lam, p.norm, p.personalize, p.placement, p.bn_weight) == (0.5, "xan", True, "auto", "auto")
    # w_bn is a softmax weight of two logits: 0 and 1 (and beyond) cannot be reached
    for bad in ("0.0", "1.0", "-0.5", "1.5"):
        with pytest.raises(ConfigError, match="strictly between 0 and 1"):
            load_config(None, ["method.name=gperxan", f"method.bn_weight={bad}"])
    for bad in ("1.5", "-0.1"):  # Eq. 3's lambda weighs the guidance term within [0, 1]
        with pytest.raises(ConfigError, match="lam"):
            load_config(None, ["method.name=gperxan", f"method.lam={bad}"])
    assert load_config(None, ["method.name=gperxan", "method.bn_weight=0.999"]).method.bn_weight == 0.999


def test_gperxan_norm_bn_keeps_the_backbones_batchnorm_and_ledger_groups_name_each_side():
    base = build_method(tiny_cfg("method.name=fedavg", "model.arch=resnet18"), 3).build_model(7)
    m = build_method(tiny_cfg("method.name=gperxan", "model.arch=resnet18", "method.norm=bn"), 3)
    net = m.build_model(7)
    # gFedAvg's ablation: the network as built, every norm layer a BatchNorm, no XAN, nothing kept local
    assert not any(isinstance(mod, (XAN, IBN)) for mod in net.modules()) and m.local_keys(net) == set()
    assert sorted(net.state_dict()) == sorted(base.state_dict())
    # the ledger's groups: PerXAN's BN side stays on the client, the IN side and the rest are shared
    x = build_method(tiny_cfg("method.name=gperxan", "model.arch=resnet18"), 3)
    net = x.build_model(7)
    local = x.local_keys(net)
    groups = {k: x.tensor_group(k, k in local) for k in net.state_dict()}
    assert {k for k, g in groups.items() if g == "xan_bn_side"} == local
    inside = {k for k, g in groups.items() if g == "xan_in_side"}
    assert inside and all(".inorm." in k or k.endswith(".logit_in") for k in inside)
    assert groups["head.weight"] == "shared" and groups["body.bn1.weight"] == "shared"
    assert len(inside) == 19 * 3  # each XAN's inorm weight, bias and its logit_in
