"""FedDyn: federated learning with dynamic regularization.

Acar, Zhao, Matas Navarro, Mattina, Whatmough, Saligrama, "Federated
Learning Based on Dynamic Regularization", ICLR 2021, Algorithm 1.

With m clients, P_t the round's participants, theta^{t-1} the global model
they receive and grad_k each client's state (0 before its first round):

* client k in P_t minimises the dynamically regularised objective
      L_k(theta) - <grad_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2
  (grad_k = grad L_k(theta_k^{t-1}), its gradient at its last local model),
  uploads theta_k^t, and updates its state with the first-order condition of
  that minimum
      grad_k <- grad_k - alpha (theta_k^t - theta^{t-1});
* the server keeps h (h^0 = 0) and sets
      h^t = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})
      theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - h^t / alpha.
  The average over P_t is unweighted (``aggregation_weights``), theta^t is
  both what the next round receives and what is evaluated (the reference
  code also reports the plain average as "sel"; we follow the paper), and h
  is server state (``server_state["feddyn_h"]``, one float64 array per
  trainable parameter), checkpointed with it.

The loss drops the constant <grad_k, theta^{t-1}> from the linear term,
L_k(theta) - <grad_k, theta - theta^{t-1}> + ..., so that the reported
training loss starts at the plain loss; its gradient is the paper's.
grad_k is a buffer ``feddyn_grad`` of the model (one flat vector over the
trainable parameters), local and private: the engine keeps it per client and
it never leaves the client; persistent because client state moves through
the model's state dict (the global model carries an unused vector of zeros).

The regulariser and h cover the trainable parameters; BatchNorm running
statistics take the participants' plain average (``assembles`` names the
parameters; theta^{t-1} is ``assemble_global``'s ``previous``).  Not a server
optimizer's step: h carries the clients' drift across rounds, so a server
optimizer would have nothing left to step and is refused.  m is the
partition's number of clients; with clients dropped in a round, P_t holds
those whose update arrived (their grad_k changed, the others' did not), so
h stays (1/m) sum_k grad_k over all clients.

alpha = 0.01: the reference code's CIFAR-10 example (alpemreacar/FedDyn,
example_cifar_10.py); the paper searches alpha in {0.1, 0.01, 0.001}
[unverified].  The reference scales alpha per client by m |D_k| / |D| and
folds the quadratic term into weight decay; the paper has one alpha, as here.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.errors import ConfigError

from .base import Method, register_method
from .scaffold import flat, trainable, unflat

GRAD = "feddyn_grad"  # the client's grad_k (private buffer)
H = "feddyn_h"  # server state


@register_method
class FedDyn(Method):
    name = "feddyn"
    phases = ()  # grad_k only shapes the local objective

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        alpha: float = Field(0.01, gt=0.0)

    def __init__(self, params, model_cfg, training_cfg, num_clients):
        super().__init__(params, model_cfg, training_cfg, num_clients)
        self.param_keys: list[str] = []
        self.numel = 0

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.server.optimizer != "none":  # theta^t = mean - h/alpha sets every parameter
            raise ConfigError(f"server.optimizer {cfg.server.optimizer} has nothing to step: feddyn sets every "
                              "parameter of the global model itself (theta = mean - h/alpha); use server.optimizer: "
                              "none with it")

    # ------------------------------------------------------------------ model
    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        params = trainable(model)
        self.param_keys = [n for n, _ in params]
        self.numel = sum(p.numel() for _, p in params)
        model.register_buffer(GRAD, torch.zeros(self.numel))
        return model

    def local_keys(self, model):
        return {GRAD}

    def private_keys(self, model):
        return {GRAD}

    # ------------------------------------------------------------ client side
    def round_start(self, model, ctx):
        params = [p for _, p in trainable(model)]
        ctx.scratch["theta_prev"] = [p.detach().clone() for p in params]  # theta^{t-1}
        ctx.scratch["grad"] = unflat(getattr(model, GRAD), params)

    def loss(self, model, x, y, ctx):
        ce = F.cross_entropy(model(x), y)
        lin, quad = 0.0, 0.0
        for p, p0, g in zip((p for _, p in trainable(model)), ctx.scratch["theta_prev"], ctx.scratch["grad"]):
            d = p - p0
            lin = lin + (g * d).sum()
            quad = quad + (d * d).sum()
        return ce - lin + 0.5 * self.p.alpha * quad

    def local_train(self, model, batches, ctx):
        stats = super().local_train(model, batches, ctx)
        with torch.no_grad():  # grad_k <- grad_k - alpha (theta_k^t - theta^{t-1})
            params = [p for _, p in trainable(model)]
            getattr(model, GRAD).sub_(self.p.alpha * (flat(params) - flat(ctx.scratch["theta_prev"])))
        return stats

    # ------------------------------------------------------------ server side
    def aggregation_weights(self, client_ids, sizes, server_state):
        return np.ones(len(client_ids), dtype=np.float64)  # (1/|P_t|) sum_{k in P_t}

    def assembles(self, model):
        return set(self.param_keys)

    def assemble_global(self, round, results, average, previous, server_state):
        share = self.p.alpha * len(results) / self.num_clients
        h = server_state.setdefault(H, {})
        out = {}
        for k in self.param_keys:
            mean = average[k].astype(np.float64)  # (1/|P_t|) sum theta_k^t: the unweighted reduce
            hk = h.get(k, 0.0) - share * (mean - previous[k])  # alpha (1/m) sum = alpha (|P_t|/m) (mean - prev)
            h[k] = hk
            out[k] = (mean - hk / self.p.alpha).astype(average[k].dtype)
        return out
