"""MOON: model-contrastive federated learning.

Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021, Sec. 3.

Network (Sec. 3.2): base encoder, projection head, output layer.  The
representation z = R_w(x) is the projection head's output, "the network
before the output layer", and the classifier reads z.  As in the reference
code (QinbinLi/MOON, model.py ``ModelFedCon``) the projection head is a
two-layer MLP, Linear(d, d) - ReLU - Linear(d, out_dim), out_dim = 256, and
the output layer Linear(out_dim, classes).  ``projection_head: false`` takes
z = the encoder's pooled features (the reference's ``ModelFedCon_noheader``).

Local objective of client i in round t (Eq. 1-3), per mini-batch mean:
    l_con = -log( exp(sim(z, z_glob)/tau)
                  / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )
    loss  = CE(output(z), y) + mu * l_con
with sim the cosine similarity, z from the model being trained, z_glob from
the round's global model w^t (frozen) and z_prev from the client's own
local model of its previous participation w_i^{t-1} (frozen).  As in the
reference code both frozen models run in eval mode (BatchNorm with their
running statistics) and only z carries a gradient.  Aggregation is FedAvg's
(|D_i|-weighted, Algorithm 1 line 6).

w_i^{t-1} is client-local state that never leaves the client: a frozen copy
of the model under ``moon_prev`` (plus ``moon_round``, the round it was
trained in, 0 before the first), both local and private, so the engine keeps
them per client across rounds, never broadcasts nor uploads them (the same
device as CSAC's private model).  With partial participation it is the model
from the client's last round, however long ago, as Algorithm 1's w_i^{t-1}
reads for a client that kept its last local model.

First participation: the paper's w_i^{t-1} does not exist yet.  The
reference code's pool of previous models is empty in its first round, so
the contrastive logits hold only the positive pair and l_con = -log 1 = 0;
(with partial participation, a client first sampled later contrasts with
its own untrained random initialisation, which the reference created per
client).  We follow the paper's definition: without a previous local model
there is no negative pair and l_con is left out (exactly 0 as in the
reference's first round), whenever a client participates for the first time.

Defaults: tau = 0.5 (the paper's default temperature, Sec. 4.1); mu = 1, the
paper's best for CIFAR-100 and Tiny-ImageNet and the reference code's
default; the paper's best for CIFAR-10 is mu = 5 (mu tuned over
{0.1, 1, 5, 10}), which configs/digits/drift_compare.yaml uses for digits
(10 classes, a small conv net, as CIFAR-10's setting).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from .base import Method, frozen, register_method, train_steps

PREV = "moon_prev"  # submodule: the client's previous local model (private)
SEEN = "moon_round"  # buffer: the round of that model, 0 before the client's first


class MoonHead(nn.Module):
    """Projection head then output layer: ``proj(f)`` is the representation z."""

    def __init__(self, in_dim: int, num_classes: int, out_dim: int = 256, projection: bool = True):
        super().__init__()
        self._in = in_dim
        if projection:
            self.proj: nn.Module = nn.Sequential(nn.Linear(in_dim, in_dim), nn.ReLU(), nn.Linear(in_dim, out_dim))
        else:
            self.proj, out_dim = nn.Identity(), in_dim
        self.cls = nn.Linear(out_dim, num_classes)

    @property
    def in_features(self) -> int:
        return self._in

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.cls(self.proj(f))


def representation(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """z = R_w(x): the projection head's output."""
    return model.head.proj(model.features(x))


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 1, averaged over the batch: the cross-entropy of picking the
    global model's representation among {z_glob, z_prev}."""
    pos = F.cosine_similarity(z, z_glob, dim=-1) / tau
    neg = F.cosine_similarity(z, z_prev, dim=-1) / tau
    return F.cross_entropy(torch.stack([pos, neg], 1), torch.zeros(len(z), dtype=torch.long, device=z.device))


@register_method
class Moon(Method):
    name = "moon"
    phases = ()  # the previous model only enters the loss

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        mu: float = Field(1.0, ge=0.0)
        tau: float = Field(0.5, gt=0.0)
        out_dim: int = Field(256, ge=1)  # the projection head's output dimension
        projection_head: bool = True  # z from a two-layer MLP head (the reference's); false: z = pooled features

    # ------------------------------------------------------------------ model
    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        model.head = MoonHead(model.head.in_features, num_classes, self.p.out_dim, self.p.projection_head)
        setattr(model, PREV, frozen(copy.deepcopy(model)))
        model.register_buffer(SEEN, torch.zeros((), dtype=torch.long))
        return model

    def private_keys(self, model):
        return {k for k in model.state_dict() if k.startswith(PREV + ".")} | {SEEN}

    def local_keys(self, model):
        return self.private_keys(model)

    def tensor_group(self, key, is_local):
        return "moon_prev" if is_local else "shared"

    # ------------------------------------------------------------ client side
    def round_start(self, model, ctx):
        if self.p.mu > 0 and int(getattr(model, SEEN)) > 0:
            # w^t as received, frozen; its copy leaves the previous model out (memo: None)
            ctx.scratch["glob"] = frozen(copy.deepcopy(model, {id(getattr(model, PREV)): None}))

    def loss(self, model, x, y, ctx):
        z = representation(model, x)
        ce = F.cross_entropy(model.head.cls(z), y)
        glob = ctx.scratch.get("glob")
        if glob is None:  # no previous local model yet (or mu = 0): no negative pair
            return ce
        with torch.no_grad():
            z_glob = representation(glob, x)
            z_prev = representation(getattr(model, PREV), x)
        return ce + self.p.mu * model_contrastive_loss(z, z_glob, z_prev, self.p.tau)

    def local_train(self, model, batches, ctx):
        opt = self.make_optimizer(model, ctx.round)  # the previous model's parameters are frozen
        model.train()
        getattr(model, PREV).eval()  # model.train() reached it too
        stats = train_steps(opt, batches, lambda x, y: self.loss(model, x, y, ctx), precision=ctx.precision)
        with torch.no_grad():  # this round's local model is the client's next w_i^{t-1}
            own = {k: v for k, v in model.state_dict().items() if not k.startswith(PREV + ".") and k != SEEN}
            getattr(model, PREV).load_state_dict(own)
            getattr(model, SEEN).fill_(ctx.round)
        return stats
