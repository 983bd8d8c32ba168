"""FedProx (Li et al., MLSys 2020): local objective CE + (mu/2)||w - w_g||^2,
with w_g the global weights received at the start of the round."""
from __future__ import annotations

import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from .base import Method, register_method


@register_method
class FedProx(Method):
    name = "fedprox"
    batchable = True  # functional_loss: the proximal term against the client's own start of the round

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        mu: float = Field(0.01, ge=0.0)  # CCST's reference value

    def round_start(self, model, ctx):
        ctx.scratch["w_g"] = [p.detach().clone() for p in model.parameters()]

    def loss(self, model, x, y, ctx):
        ce = F.cross_entropy(model(x), y)
        prox = sum(((p - g) ** 2).sum() for p, g in zip(model.parameters(), ctx.scratch["w_g"]))
        return ce + 0.5 * self.p.mu * prox

    def functional_loss(self, forward, x, y, params, start):
        ce = F.cross_entropy(forward(x), y)
        prox = sum(((params[k] - start[k]) ** 2).sum() for k in params)
        return ce + 0.5 * self.p.mu * prox
