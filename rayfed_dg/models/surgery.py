"""Find and replace normalization layers by type, never by name substrings.

torchvision names a ResNet's shortcut BatchNorm ``downsample.1``, so name
filters such as ``'bn' in key`` miss it; everything here goes by module type.

timm's ``BatchNormAct2d`` (a BatchNorm2d subclass) applies its activation
(and dropout) itself: a norm that replaces one keeps them (``NormAct``).
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def modules_of_type(model: nn.Module, types: tuple[type, ...]) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, types)]


def state_keys_of(model: nn.Module, types: tuple[type, ...], kinds: Iterable[str] = ("param", "buffer")) -> set[str]:
    """State-dict keys owned directly by modules of ``types`` (parameters and
    persistent buffers; a module's sub-modules, e.g. adapters, excluded)."""
    kinds = set(kinds)
    keys: set[str] = set()
    for name, m in modules_of_type(model, types):
        prefix = f"{name}." if name else ""
        if "param" in kinds:
            keys |= {prefix + n for n, _ in m.named_parameters(recurse=False)}
        if "buffer" in kinds:
            keys |= {prefix + n for n, b in m.named_buffers(recurse=False)
                     if b is not None and n not in m._non_persistent_buffers_set}
    return keys


class NormAct(nn.Module):
    """A norm that replaced a timm ``BatchNormAct2d``, followed by that layer's
    own dropout and activation, as its forward applied them."""

    def __init__(self, norm: nn.Module, drop: nn.Module, act: nn.Module):
        super().__init__()
        self.norm, self.drop, self.act = norm, drop, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(self.norm(x)))


def norm_act_parts(m: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(dropout, activation) of a timm norm+activation layer, None for a plain norm (timm is not
    imported: a timm layer exists only once timm built it)."""
    norm_act = sys.modules.get("timm.layers.norm_act")
    kinds = tuple(getattr(norm_act, n) for n in ("BatchNormAct2d", "SyncBatchNormAct") if hasattr(norm_act, n))
    if kinds and isinstance(m, kinds):
        return m.drop, m.act
    return None


def replace_norm(model: nn.Module, make: Callable[[str, nn.Module], nn.Module | None],
                 types: tuple[type, ...] = BN_TYPES) -> list[str]:
    """Replace every module of ``types`` with ``make(name, old)`` (None keeps
    the old one); a timm ``BatchNormAct2d`` becomes ``NormAct(new, its
    dropout, its activation)``.  Returns the qualified names of replaced modules."""
    replaced: list[str] = []
    for name, old in modules_of_type(model, types):
        new = make(name, old)
        if new is None:
            continue
        parts = norm_act_parts(old)
        replace_module(model, name, new if parts is None else NormAct(new, *parts))
        replaced.append(name)
    return replaced


def feature_sites(body: nn.Module, need: Iterable[str] = ()) -> dict[str, str]:
    """Where feature-statistics methods (MixStyle, DSU, StableFDG, RSC) hook into a
    feature extractor: qualified names in ``body`` of the stem convolution
    (``conv1``), the end of the stem (``stem``, the ResNets' max-pool), the
    four stages (``block1`` .. ``block4``: ResNet ``layerK``, or the conv
    net's K-th conv-BN-ReLU-pool block, or a timm network's last four
    ``feature_info`` stages) and the global pooling (``pool``).  A site in
    ``need`` that the body lacks is a ``ValueError`` saying why."""
    if hasattr(body, "feature_sites"):  # a timm body knows its own (models/timm_backbones.py)
        sites = body.feature_sites()
        missing = [s for s in need if s not in sites]
        if missing:
            raise ValueError(body.missing_site_reason(missing[0]))
        return sites
    if hasattr(body, "layer1") and hasattr(body, "maxpool"):
        sites = {"conv1": "conv1", "stem": "maxpool", **{f"block{i}": f"layer{i}" for i in range(1, 5)},
                 "pool": "avgpool"}
    elif isinstance(body, nn.Sequential) and len(body) == 17:
        # conv net: 4 x [conv, bn, relu, pool] + global pool; its stem is block 1
        sites = {"conv1": "0", **{f"block{i}": str(4 * i - 1) for i in range(1, 5)}, "pool": "16"}
    else:
        raise ValueError("feature-statistics methods support the ResNets, the conv net and timm CNNs")
    missing = [s for s in need if s not in sites]
    if missing:
        raise ValueError(f"this backbone has no {missing[0]} site")
    return sites


def insert_after(root: nn.Module, name: str, *modules: nn.Module) -> None:
    """Replace submodule ``name`` of ``root`` by Sequential(it, *modules)."""
    replace_module(root, name, nn.Sequential(root.get_submodule(name), *modules))


def replace_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, module)
