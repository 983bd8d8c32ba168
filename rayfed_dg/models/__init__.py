"""Backbones (feature extractor + head) and normalization surgery."""
from .backbones import ModelError, build_backbone, convnet, resnet
from .norms import DSON, IBN, XAN, apply_norm, placement_names
from .split import SplitModel
from .surgery import BN_TYPES, feature_sites, insert_after, modules_of_type, replace_module, replace_norm, state_keys_of

__all__ = ["BN_TYPES", "DSON", "IBN", "XAN", "ModelError", "SplitModel", "apply_norm", "build_backbone", "convnet",
           "feature_sites", "insert_after", "modules_of_type", "placement_names", "replace_module", "replace_norm",
           "resnet", "state_keys_of"]
