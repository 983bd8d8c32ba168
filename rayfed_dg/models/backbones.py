"""The torchvision backbones, the conv net and pfl-research's CIFAR10 CNN, each a ``SplitModel``;
``build_backbone`` picks one by name (``timm/<name>``: ``timm_backbones.py``)."""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn as nn

from rayfed_dg.errors import ModelError

from .split import SplitModel
from .timm_backbones import timm_backbone

__all__ = ["ModelError", "SplitModel", "build_backbone", "convnet", "densenet", "resnet", "simple_cnn"]


def convnet(num_classes: int, width: int = 64, norm_layer=nn.BatchNorm2d) -> SplitModel:
    """Four conv3x3-BN-ReLU-maxpool blocks for 32 px inputs (the Digits-DG
    benchmark's network), then global average pooling."""
    layers: list[nn.Module] = []
    c_in = 3
    for _ in range(4):
        layers += [nn.Conv2d(c_in, width, 3, padding=1, bias=False), norm_layer(width), nn.ReLU(inplace=True),
                   nn.MaxPool2d(2)]
        c_in = width
    layers += [nn.AdaptiveAvgPool2d(1)]
    return SplitModel(nn.Sequential(*layers), nn.Linear(width, num_classes))


def simple_cnn(num_classes: int) -> SplitModel:
    """pfl-research's CIFAR10 cross-device benchmark model (``benchmarks/model/pytorch/cnn.py``,
    ``simple_cnn``) for 32 px inputs: conv3x3 32 - ReLU - conv3x3 64 - ReLU - maxpool 2 - dropout 0.25 -
    dense 128 - ReLU - dropout 0.5, then the linear head; no normalization layers; Glorot-uniform weights
    as there (its TF2 twin's initialisation)."""
    body = nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Dropout(0.25), nn.Flatten(), nn.Linear(14 * 14 * 64, 128), nn.ReLU(), nn.Dropout(0.5))
    model = SplitModel(body, nn.Linear(128, num_classes))
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(m.weight)
    return model


class _ResNetBody(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        for name in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool"):
            setattr(self, name, getattr(net, name))

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.avgpool(x)


def _load_pretrained(arch: str, spec: str) -> dict[str, torch.Tensor]:
    """``spec`` is a torchvision weights name (e.g. IMAGENET1K_V1) or a file."""
    path = Path(spec).expanduser()
    if path.suffix in (".pth", ".pt") or path.exists() or "/" in spec:
        if not path.is_file():
            raise ModelError(f"model.pretrained: weights file {path} not found; give an existing .pth file")
        sd = torch.load(path, map_location="cpu", weights_only=True)
        return sd.get("state_dict", sd) if isinstance(sd, dict) else sd
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(arch)
        weights = enum[spec]
    except KeyError:
        names = ", ".join(w.name for w in torchvision.models.get_model_weights(arch))
        raise ModelError(f"model.pretrained: {spec!r} is not a torchvision weights name for {arch} "
                         f"(known: {names})") from None
    fname = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    if not fname.is_file():
        raise ModelError(
            f"model.pretrained: {arch} {spec} weights are not in the torch hub cache ({fname}); "
            "this machine cannot download them: copy that file there, or set model.pretrained to a local .pth path"
        )
    return torch.load(fname, map_location="cpu", weights_only=True)


def resnet(arch: str, num_classes: int, pretrained: str | None = None, norm_layer=None) -> SplitModel:
    import torchvision

    ctor = getattr(torchvision.models, arch)
    net = ctor(weights=None, num_classes=1000, **({"norm_layer": norm_layer} if norm_layer else {}))
    if pretrained:
        sd = _load_pretrained(arch, pretrained)
        sd = {k: v for k, v in sd.items() if not k.startswith("fc.")}
        missing, unexpected = net.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.startswith("fc.")]
        if missing or unexpected:
            raise ModelError(
                f"model.pretrained: {len(missing)} model tensors got no weights (e.g. {missing[:2]}) and "
                f"{len(unexpected)} weights found no home (e.g. {unexpected[:2]})"
            )
    return SplitModel(_ResNetBody(net), nn.Linear(net.fc.in_features, num_classes))


class _DenseNetBody(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.features = net.features
        self.pool = nn.Sequential(nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1))

    def forward(self, x):
        return self.pool(self.features(x))


def densenet(arch: str, num_classes: int, pretrained: str | None = None) -> SplitModel:
    import torchvision

    net = getattr(torchvision.models, arch)(weights=None)
    if pretrained:
        sd = _load_pretrained(arch, pretrained)
        # torchvision's old checkpoints name dense layers 'norm.1'; the model 'norm1'
        sd = {re.sub(r"\.(norm|relu|conv)\.((?:[12])\.(?:weight|bias|running_mean|running_var))$", r".\1\2", k): v
              for k, v in sd.items() if not k.startswith("classifier.")}
        missing, unexpected = net.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.startswith("classifier.")]
        if missing or unexpected:
            raise ModelError(f"model.pretrained: {len(missing)} model tensors got no weights (e.g. {missing[:2]}) "
                             f"and {len(unexpected)} weights found no home (e.g. {unexpected[:2]})")
    return SplitModel(_DenseNetBody(net), nn.Linear(net.classifier.in_features, num_classes))


def build_backbone(arch: str, num_classes: int, pretrained: str | None = None, width: int = 64) -> SplitModel:
    if arch.startswith("timm/"):  # timm itself is imported only here, when a timm backbone is named
        return timm_backbone(arch, num_classes, pretrained)
    if arch == "convnet":
        if pretrained:
            raise ModelError("model.pretrained: the convnet has no pretrained weights; set it to null")
        return convnet(num_classes, width)
    if arch == "simple_cnn":
        if pretrained:
            raise ModelError("model.pretrained: simple_cnn has no pretrained weights; set it to null")
        return simple_cnn(num_classes)
    if arch.startswith("densenet"):
        return densenet(arch, num_classes, pretrained)
    return resnet(arch, num_classes, pretrained)
