"""FedSR (Nguyen, Torr, Lim, "FedSR: A Simple and Effective Domain
Generalization Method for Federated Learning", NeurIPS 2022), a baseline of
the gPerXAN and FedFD-A papers.

The feature extractor's output goes through a linear encoder to
(mu, s) in R^{2 z_dim}; the representation is z ~ N(mu, diag(sigma^2)),
sigma = softplus(s), drawn once per sample in training (reparameterised),
and the classifier sees z.  Two regularizers are added to CE:
* L2R (representation norm): ``l2r * mean_i ||z_i||_2^2``;
* CMI (conditional mutual information bound):
  ``cmi * mean_i KL(N(mu_i, sigma_i^2) || N(r_mu[y_i], r_sigma[y_i]^2))``
  summed over dimensions, with r_sigma = softplus(r_s) and (r_mu, r_s) a
  per-class reference distribution that each client learns and never shares.
At evaluation the prediction averages the softmax over ``eval_samples``
draws of z (20, as the reference code), from a fixed seed so that evaluation
is deterministic.  Everything but (r_mu, r_s) is averaged by FedAvg.

Choices against the public reference code (../notes/methods.md section 5):
its L2R uses the unsquared norm ||z||_2, we use the squared norm of the
paper's objective; its CMI also scales (mu, sigma) by a learned C, which the
paper does not have and we leave out; it averages clients uniformly, we
weight by sample count as every other method here.
Defaults: z_dim 512 (ResNet-18), l2r 0.01, cmi 1e-3 (the README's PACS value).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from .base import Method, register_method

EVAL_SEED = 20220  # evaluation draws are the same for every worker and round


class ProbabilisticHead(nn.Module):
    def __init__(self, in_dim: int, z_dim: int, num_classes: int, eval_samples: int):
        super().__init__()
        self.enc = nn.Linear(in_dim, 2 * z_dim)
        self.cls = nn.Linear(z_dim, num_classes)
        self.r_mu = nn.Parameter(torch.zeros(num_classes, z_dim))
        self.r_s = nn.Parameter(torch.ones(num_classes, z_dim))
        self.eval_samples = eval_samples
        self.gen: torch.Generator | None = None
        self.last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # mu, sigma, z

    @property
    def in_features(self) -> int:
        return self.enc.in_features

    def forward(self, f):
        mu, s = self.enc(f).chunk(2, dim=1)
        sigma = F.softplus(s)
        if self.training:
            z = mu + sigma * torch.randn(mu.shape, generator=self.gen).to(mu)
            self.last = (mu, sigma, z)
            return self.cls(z)
        g = torch.Generator().manual_seed(EVAL_SEED)
        probs = 0
        for _ in range(self.eval_samples):
            z = mu + sigma * torch.randn(mu.shape, generator=g).to(mu)
            probs = probs + F.softmax(self.cls(z), dim=1)
        return torch.log(probs / self.eval_samples)  # log of the averaged softmax: argmax and CE as usual


def gaussian_kl(mu_q, sig_q, mu_p, sig_p) -> torch.Tensor:
    """KL(N(mu_q, sig_q^2) || N(mu_p, sig_p^2)) summed over the last dimension."""
    return (torch.log(sig_p / sig_q) + (sig_q ** 2 + (mu_q - mu_p) ** 2) / (2 * sig_p ** 2) - 0.5).sum(-1)


@register_method
class FedSR(Method):
    name = "fedsr"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        z_dim: int = Field(512, ge=1)
        l2r: float = Field(0.01, ge=0.0)
        cmi: float = Field(1e-3, ge=0.0)
        eval_samples: int = Field(20, ge=1)

    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        model.head = ProbabilisticHead(model.head.in_features, self.p.z_dim, num_classes, self.p.eval_samples)
        return model

    phases = ()  # r_mu, r_s enter only the loss: a client's own model predicts as the global one

    def local_keys(self, model):
        return {"head.r_mu", "head.r_s"}

    def private_keys(self, model):
        return self.local_keys(model)

    def round_start(self, model, ctx):
        model.head.gen = ctx.generator

    def loss(self, model, x, y, ctx):
        ce = F.cross_entropy(model(x), y)
        mu, sigma, z = model.head.last
        l2r = (z ** 2).sum(1).mean()
        h = model.head
        cmi = gaussian_kl(mu, sigma, h.r_mu[y], F.softplus(h.r_s[y])).mean()
        return ce + self.p.l2r * l2r + self.p.cmi * cmi
