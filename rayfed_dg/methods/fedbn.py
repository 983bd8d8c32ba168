"""FedBN (Li et al., ICLR 2021): every BatchNorm tensor (affine weights and
running statistics) stays on the client; all other weights are averaged.

Clients still upload their BN state and the server averages it into the
global model, because the unseen target domain has no local BN of its own;
this is how CCST's reference code evaluates FedBN on the target.  BN layers
are found by type (``surgery.state_keys_of``), so torchvision's shortcut
``downsample.1`` BatchNorm is local too, unlike in name-substring filters.
"""
from __future__ import annotations

from rayfed_dg.models import BN_TYPES, state_keys_of

from .base import Method, register_method


@register_method
class FedBN(Method):
    name = "fedbn"
    batchable = True  # each client's BN state is its own slice of the stacked buffers

    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        if not state_keys_of(model, BN_TYPES):  # e.g. a timm ConvNeXt: nothing would stay local
            raise ValueError("fedbn keeps the BatchNorm layers on the clients and this backbone has none")
        return model

    def local_keys(self, model):
        return state_keys_of(model, BN_TYPES)

