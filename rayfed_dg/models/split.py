"""The model shape every method relies on: a feature extractor and a linear head.

``SplitModel.features(x)`` gives the pooled feature vector g(x) and
``SplitModel.head`` the classifier h, so methods can regularise features
through another head (gPerXAN's guiding regularizer) or add losses on them.
Its own module so that every backbone family (``backbones.py``,
``timm_backbones.py``) builds it without importing another.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class SplitModel(nn.Module):
    def __init__(self, body: nn.Module, head: nn.Linear):
        super().__init__()
        self.body = body
        self.head = head

    @property
    def feature_dim(self) -> int:
        return self.head.in_features

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.body(x), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
