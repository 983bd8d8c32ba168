"""Backbones (feature extractor + head) and normalization surgery."""
from .backbones import ModelError, SplitModel, build_backbone, convnet, resnet
from .norms import IBN, XAN, apply_norm, placement_names
from .surgery import BN_TYPES, modules_of_type, replace_norm, state_keys_of

__all__ = ["IBN", "XAN", "apply_norm", "placement_names", "BN_TYPES", "ModelError", "SplitModel", "build_backbone", "convnet", "modules_of_type",
           "replace_norm", "resnet", "state_keys_of"]
