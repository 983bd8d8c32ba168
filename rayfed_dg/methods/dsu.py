"""DSU under FedAvg (Li, Dai, Ge, Liu, Shan, Duan, "Uncertainty Modeling for
Out-of-Distribution Generalization", ICLR 2022), a style-augmentation
baseline of the StableFDG paper.

Eq. 3-8: with probability ``p`` a layer resamples each sample's channel
statistics, beta ~ N(mu, Sigma_mu^2) and gamma ~ N(sigma, Sigma_sigma^2),
where Sigma_mu and Sigma_sigma are the standard deviations over the batch of
the per-sample means and stds, and outputs gamma (x - mu) / sigma + beta.
The official placement is six sites: after the stem convolution (before its
BN), after the stem's max-pool and after each of the four stages (the conv
net has no separate stem, so five).  Identity at evaluation; FedAvg.
"""
from __future__ import annotations

from rayfed_dg.models.style import DSULayer

from .base import register_method
from .mixstyle import StyleLayerMethod, StyleParams


@register_method
class DSU(StyleLayerMethod):
    name = "dsu"
    Params = StyleParams  # p and all six sites, the official defaults

    def make_layer(self):
        return DSULayer(self.p.p)
