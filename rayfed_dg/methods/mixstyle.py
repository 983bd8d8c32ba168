"""MixStyle under FedAvg (Zhou, Yang, Qiao, Xiang, "Domain Generalization with
MixStyle", ICLR 2021), the style-augmentation baseline of the StableFDG and
CCST papers.

Eq. 3-5: with probability ``p`` a layer replaces each sample's channel mean
and std by lambda * own + (1 - lambda) * those of a random other sample in
the batch, lambda ~ Beta(alpha, alpha), statistics detached.  A client holds
one domain, so the random-shuffle variant is the only one available; the
official placement is after the first three stages (``blocks``; the official
Office-Home setting is blocks 1-2).  Identity at evaluation; aggregation is
FedAvg.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from rayfed_dg.models import feature_sites, insert_after
from rayfed_dg.models.style import MixStyleLayer, RandomStyleLayer

from .base import Method, register_method

SITES = ("conv1", "stem", "block1", "block2", "block3", "block4")


def check_sites(blocks: list[str]) -> list[str]:
    bad = sorted(set(blocks) - set(SITES))
    if bad:
        raise ValueError(f"unknown sites {bad}; choose from {', '.join(SITES)}")
    return blocks


class StyleParams(BaseModel):
    """What every style-layer method sets: firing probability and sites."""
    model_config = ConfigDict(extra="forbid")
    p: float = Field(0.5, ge=0.0, le=1.0)
    blocks: Annotated[list[str], AfterValidator(check_sites)] = list(SITES)  # sites the style layer follows (SITES)


class StyleLayerMethod(Method):
    """FedAvg with a ``RandomStyleLayer`` after each site in ``params.blocks``,
    seeded per client and round."""

    def make_layer(self) -> RandomStyleLayer:
        raise NotImplementedError

    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        where = feature_sites(model.body)
        for s in self.p.blocks:
            if s in where:  # the conv net has no separate stem
                insert_after(model.body, where[s], self.make_layer())
        return model

    def round_start(self, model, ctx):
        for m in model.modules():
            if isinstance(m, RandomStyleLayer):
                m.gen = ctx.generator


@register_method
class MixStyle(StyleLayerMethod):
    name = "mixstyle"

    class Params(StyleParams):
        alpha: float = Field(0.1, gt=0.0)
        blocks: Annotated[list[str], AfterValidator(check_sites)] = ["block1", "block2", "block3"]

    def make_layer(self):
        return MixStyleLayer(self.p.p, self.p.alpha)
