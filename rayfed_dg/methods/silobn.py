"""SiloBN (Andreux et al., 2020): BatchNorm running statistics stay on the
client, BN affine weights are shared and averaged like every other weight.

As with FedBN the clients upload their statistics, and their weighted average
forms the global model's statistics, which serve the unseen target domain
(and are FedFD-A's "global statistics")."""
from __future__ import annotations

from rayfed_dg.models import BN_TYPES, state_keys_of

from .base import Method, register_method


@register_method
class SiloBN(Method):
    name = "silobn"

    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        if not state_keys_of(model, BN_TYPES, kinds=("buffer",)):
            raise ValueError("silobn keeps the BatchNorm statistics on the clients and this backbone has none")
        return model

    def local_keys(self, model):
        return state_keys_of(model, BN_TYPES, kinds=("buffer",))
