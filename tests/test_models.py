import numpy as np
import pytest
import torch

from rayfed_dg.models import BN_TYPES, ModelError, build_backbone, state_keys_of


def test_bn_found_by_type_including_downsample():
    m = build_backbone("resnet18", 7)
    keys = state_keys_of(m, BN_TYPES)
    assert "body.layer2.0.downsample.1.weight" in keys
    assert "body.layer2.0.downsample.1.running_var" in keys
    assert not any(k.startswith("head.") for k in keys)
    # 20 BN layers in ResNet-18, 5 tensors each
    assert len(keys) == 20 * 5


def test_split_model_features_are_the_pooled_last_map_and_the_head_is_linear():
    import torchvision

    ref = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    m = build_backbone("resnet18", 10).eval()
    m.load_state_dict({("head." + k[3:] if k.startswith("fc.") else "body." + k): v
                       for k, v in ref.state_dict().items()})
    x = torch.randn(2, 3, 32, 32)
    # torchvision's own forward, written out: g(x) = GAP(layer4(...)), logits = W g(x) + b
    t = ref.maxpool(ref.relu(ref.bn1(ref.conv1(x))))
    pooled = ref.layer4(ref.layer3(ref.layer2(ref.layer1(t)))).mean((2, 3))
    assert torch.allclose(m.features(x), pooled, atol=1e-5)
    assert torch.allclose(m(x), pooled @ ref.fc.weight.T + ref.fc.bias, atol=1e-5)
    assert m.feature_dim == 512


def test_missing_pretrained_weights_fail_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # an empty hub cache
    with pytest.raises(ModelError, match="not found"):
        build_backbone("resnet18", 7, pretrained=str(tmp_path / "nope.pth"))
    with pytest.raises(ModelError, match="not a torchvision weights name"):
        build_backbone("resnet18", 7, pretrained="IMAGENET9K")
    with pytest.raises(ModelError, match="torch hub cache"):
        build_backbone("resnet18", 7, pretrained="IMAGENET1K_V1")


def test_local_pretrained_file_loads(tmp_path):
    import torchvision

    ref = torchvision.models.resnet18(weights=None)
    torch.save(ref.state_dict(), tmp_path / "r18.pth")
    m = build_backbone("resnet18", 7, pretrained=str(tmp_path / "r18.pth"))
    assert torch.equal(m.body.layer1[0].bn1.running_var, ref.layer1[0].bn1.running_var)
    assert torch.equal(m.body.conv1.weight, ref.conv1.weight)


def test_model_arch_is_a_known_name_or_a_timm_model(monkeypatch):
    import sys

    from rayfed_dg.config import ConfigError, load_config

    assert load_config(None, ["model.arch=timm/resnet50.a1_in1k"]).model.arch == "timm/resnet50.a1_in1k"
    with pytest.raises(ConfigError, match=r"model.arch: Value error, use one of convnet, resnet18, resnet50, "
                                          r"densenet121, simple_cnn or timm/<name> .*\(got 'resnet34'\)"):
        load_config(None, ["model.arch=resnet34"])
    # a timm arch needs timm only when its model is built; without it, one line naming the extra
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(ModelError) as e:
        build_backbone("timm/tf_efficientnet_lite0", 7)
    assert str(e.value) == "model.arch timm/tf_efficientnet_lite0: needs timm (pip install -e '.[pretrained]')"
    assert build_backbone("convnet", 7).feature_dim == 64  # nothing else needs it


def test_simple_cnn_is_pfl_researchs_cifar10_model():
    """pfl-research's simple_cnn: conv 3->32 (896), conv 32->64 (18,496), dense 14*14*64->128 (1,605,760),
    head 128->10 (1,290) parameters; Glorot-uniform weights (bound sqrt(6 / (fan_in + fan_out)))."""
    m = build_backbone("simple_cnn", 10)
    assert m.feature_dim == 128
    assert [p.numel() for p in m.parameters()] == [864, 32, 18432, 64, 1605632, 128, 1280, 10]
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    dense = m.body[7].weight
    assert float(dense.abs().max()) <= (6 / (12544 + 128)) ** 0.5 and float(dense.std()) > 0.8 * (2 / (12544 + 128)) ** 0.5
    with pytest.raises(ModelError, match="simple_cnn has no pretrained weights"):
        build_backbone("simple_cnn", 10, "IMAGENET1K_V1")


def test_simple_cnn_dropout_is_seeded_by_round_and_client(tiny_ds):
    """simple_cnn's dropout draws from torch's global generator, which a worker seeds per (round, client): a
    client's update is the same on a fresh worker as on one that trained another client first."""
    from rayfed_dg.config import load_config
    from rayfed_dg.engine import ClientRunner
    from rayfed_dg.engine.workers.worker import to_numpy_state

    cfg = load_config(None, ["model.arch=simple_cnn", "data.resolution=32", "training.local_steps=2",
                             "training.batch_size=8", "engine.num_cpus_per_worker=1"])
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, tiny_ds.num_classes, 2)
    g = to_numpy_state(runner.model.state_dict(), runner.model.state_dict().keys())
    first = runner.run_client(0, 1, np.arange(16), g).update
    runner.run_client(1, 1, np.arange(16, 32), g)
    torch.manual_seed(123)  # whatever the generator held before, the task reseeds it
    again = runner.run_client(0, 1, np.arange(16), g).update
    later = runner.run_client(0, 2, np.arange(16), g).update  # round 2: other dropout masks, other batches
    for k in first:
        np.testing.assert_array_equal(first[k], again[k])
    assert not np.array_equal(first["head.weight"], later["head.weight"])
