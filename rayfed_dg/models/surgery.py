"""Find and replace normalization layers by type, never by name substrings.

torchvision names a ResNet's shortcut BatchNorm ``downsample.1``, so name
filters such as ``'bn' in key`` miss it; everything here goes by module type.
"""
from __future__ import annotations

from typing import Callable, Iterable

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


def replace_norm(model: nn.Module, make: Callable[[str, nn.Module], nn.Module | None],
                 types: tuple[type, ...] = BN_TYPES) -> list[str]:
    """Replace every module of ``types`` with ``make(name, old)`` (None keeps
    the old one).  Returns the qualified names of replaced modules."""
    replaced: list[str] = []
    for name, old in modules_of_type(model, types):
        new = make(name, old)
        if new is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
        replaced.append(name)
    return replaced
