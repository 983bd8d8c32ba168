"""FedIIR: implicit invariant relationships, through the classifier's gradients.

Guo, Guo, Zhang, Li, Wang, "Out-of-Distribution Generalization of Federated
Learning via Implicit Invariant Relationships", ICML 2023 (the penalty of
Sec. 4, Eq. 8-9), as its reference code (YamingGuo98/FedIIR,
``domainbed/algorithms.py``) computes it.

Each round, before any client trains (``Phase.PREPARE``), every sampled
client k computes the gradient of the cross-entropy with respect to the
classifier's parameters theta (``model.head``) under the round's global
model, on each of its batches b, and uploads the sum and the count:
(sum_b grad_theta CE_b, B_k).  The server forms the mean over every batch of
the sampled clients and keeps an exponential moving average of it across
rounds (``ema``, the reference's), starting from 0:

    g_new = (sum_k sum_b grad_theta CE_b) / (sum_k B_k)
    g_bar <- ema g_bar + (1 - ema) g_new

and sends g_bar to the clients.  Client k's local objective on a batch is

    CE + penalty || grad_theta CE - g_bar ||_2^2

its gradient taken through grad_theta CE (double backpropagation: the
penalty pulls every client's classifier gradient towards the clients'
mean, which the paper shows regularises the features' inner products
across clients).  The server averages the weights as FedAvg.

Where the reference code decides and the paper is silent:
* the prepare pass covers the client's training samples in batches of
  ``training.batch_size`` (the reference loops over its client loader;
  ``grad_batches`` caps it), in a seeded order, without augmentation;
* the default penalty is the reference's PACS value (1e-3; VLCS 5e-3,
  Office-Home 5e-4), the EMA 0.95;
* the reference averages the clients' weights unweighted; we weigh by
  sample count as every FedAvg-based method here (``aggregation`` is the
  engine's, equal for its one-client-per-domain protocol's balanced sources);
* the reference's PACS classifier is a 3-layer MLP (DomainBed's
  ``nonlinear_classifier``); theta here is the backbone's linear head.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from .base import Method, Phase, register_method

GRAD_SUM, BATCHES, MEAN = "fediir_grad_sum", "fediir_batches", "fediir_grad_mean"


def head_params(model) -> list[torch.nn.Parameter]:
    return [p for p in model.head.parameters() if p.requires_grad]


@register_method
class FedIIR(Method):
    name = "fediir"
    phases = (Phase.PREPARE, Phase.PERSONAL_EVAL)
    # the summed head gradient is a statistic of all the client's batches; their count is an integer
    shared_payloads = {GRAD_SUM: "client", BATCHES: "exact"}

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        penalty: float = Field(1e-3, ge=0.0)  # weight of || grad CE - mean gradient ||^2 (reference: PACS 1e-3)
        ema: float = Field(0.95, ge=0.0, lt=1.0)  # moving average of the clients' mean classifier gradient
        grad_batches: int = Field(0, ge=0)  # batches of the prepare pass per client; 0: every training sample

    # ------------------------------------------------------------ client side
    def round_prepare(self, model, ctx):
        """sum_b grad_theta CE_b over the client's batches, and B_k."""
        idx = ctx.indices[torch.randperm(len(ctx.indices), generator=ctx.generator).numpy()]
        bs = self.training.batch_size
        starts = range(0, len(idx), bs)
        if self.p.grad_batches:
            starts = starts[:self.p.grad_batches]
        params = head_params(model)
        total = [torch.zeros_like(p) for p in params]
        was = model.training
        model.train()  # the mode the loss is taken in during training (BatchNorm batch statistics)
        try:
            for s in starts:
                x, y = ctx.fetch(idx[s:s + bs])
                with ctx.precision.autocast():
                    loss = F.cross_entropy(model(x), y)
                for t, g in zip(total, torch.autograd.grad(loss, params)):
                    t += g.float()
        finally:
            model.train(was)
        flat = torch.cat([t.reshape(-1) for t in total]).cpu().numpy().astype(np.float64)
        return {GRAD_SUM: flat, BATCHES: np.array([len(starts)], np.int64)}

    def round_start(self, model, ctx):
        params = head_params(model)
        if MEAN not in ctx.payload:  # no client has answered a prepare phase yet: the average starts at 0
            ctx.scratch["g_bar"] = [torch.zeros_like(p) for p in params]
            return
        mean = torch.as_tensor(np.asarray(ctx.payload[MEAN]), dtype=torch.float32, device=ctx.device)
        ctx.scratch["g_bar"] = [m.view_as(p) for m, p in zip(mean.split([p.numel() for p in params]), params)]

    def loss(self, model, x, y, ctx):
        ce = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(ce, head_params(model), create_graph=True)
        penalty = sum(((g - m) ** 2).sum() for g, m in zip(grads, ctx.scratch["g_bar"]))
        return ce + self.p.penalty * penalty

    # ------------------------------------------------------------ server side
    def server_payloads(self, round, client_ids, server_state, rng, global_state, prepared):
        answered = sorted(c for c in prepared if GRAD_SUM in prepared[c])
        if not answered:  # nothing new this round: the mean so far (0 before any)
            prev = server_state.get(MEAN)
            if prev is None:
                return {}
            return {c: {MEAN: prev.astype(np.float32)} for c in client_ids}
        total = sum(np.asarray(prepared[c][GRAD_SUM], np.float64) for c in answered)  # client-id order
        batches = sum(int(prepared[c][BATCHES][0]) for c in answered)
        new = total / max(batches, 1)
        prev = server_state.get(MEAN)
        mean = (1 - self.p.ema) * new if prev is None else self.p.ema * prev + (1 - self.p.ema) * new
        server_state[MEAN] = mean
        down = mean.astype(np.float32)
        return {c: {MEAN: down} for c in client_ids}
