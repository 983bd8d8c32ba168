"""SCAFFOLD: stochastic controlled averaging.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic
Controlled Averaging for Federated Learning", ICML 2020, Algorithm 1.

The server holds the model x and a control variate c; every client i holds
its own control variate c_i (all control variates start at 0).  Each round,
with S the sampled clients and N the number of all clients:

* the server sends x and c to every i in S (c as the payload ``scaffold_c``,
  sized in the ledger);
* client i starts from y_i = x and takes K local steps (line 10)
      y_i <- y_i - eta_l (g_i(y_i) + c - c_i),
  then updates its control variate with option II (line 12)
      c_i+ = c_i - c + (x - y_i) / (K eta_l)
  and uploads y_i (the model, as in every method) and
  Delta c_i = c_i+ - c_i (the payload ``scaffold_dc``), line 13;
* the server (lines 16-17) sets
      x <- x + eta_g (1/|S|) sum_{i in S} (y_i - x)
      c <- c + (|S| / N) (1/|S|) sum_{i in S} Delta c_i.
  The average over S is unweighted, as in the paper (not by sample count);
  with eta_g = 1 (the default) the new x is that average.  Clients whose
  update did not arrive are not in S: their c_i did not change either, so c
  stays the mean of all N clients' c_i (the invariant tests/ check).

The server step for x is the server optimizer's (``engine/aggregation/server_opt.py``),
not this method's.  With avg = (1/|S|) sum_{i in S} y_i (the engine's reduce
under this method's unit weights) and Delta_t = avg - x, line 16 is
      x <- x + eta_g Delta_t,
and FedAvgM with momentum beta = 0 and server learning rate eta is
      m_t = 0 * m_{t-1} + Delta_t = Delta_t,   x <- x + eta m_t,
the same update for eta = eta_g, over the same tensors (the model's
trainable parameters; buffers keep the average in both), computed the same
way in float64 (tests/test_server_opt.py compares the two on hand-made
numbers).  So eta_g != 1 is ``server: {optimizer: fedavgm, momentum: 0,
lr: eta_g}``, and eta_g = 1 is no server optimizer at all.

Client state.  c_i is a buffer ``scaffold_ci`` of the model (one flat vector
over the trainable parameters, in ``named_parameters`` order), named both in
``local_keys`` and ``private_keys``: the engine keeps it per client across
rounds in its client store, never broadcasts it and never uploads it.  It is
a persistent buffer because the engine moves a client's state in and out of
the worker through the model's state dict; the price is that the global
model (and its checkpoints) carries one unused vector of zeros of the
trainable parameters' size.

Choices where the paper leaves the deep-learning setup open:
* control variates cover the trainable parameters only (what the optimizer
  steps); BatchNorm running statistics are averaged as in FedAvg, and with
  eta_g != 1 they take the average (the server step is for x, the weights);
* g_i includes the configured weight decay (it is part of the local loss that
  torch's SGD differentiates);
* SGD with momentum beta (the repo's default local optimizer) moves the model
  by eta_l sum_j w_j d_j after K steps, d_j the corrected gradient of step j
  and w_j = (1 - beta^(K-j+1)) / (1 - beta); option II then divides by
  K_eff = sum_j w_j instead of K, so that c_i+ is again the (w-weighted)
  mean of the client's gradients along its path, exactly what option II
  computes for plain SGD.  beta = 0 gives the paper's K.  Adam is refused:
  Algorithm 1's local step is SGD's.
* eta_l is the round's learning rate (``training.lr``, constant within a
  round, cosine-annealed across rounds when configured).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn
from pydantic import BaseModel, ConfigDict, model_validator

from rayfed_dg.errors import ConfigError

from .base import Method, register_method, train_steps

CI = "scaffold_ci"  # the client's control variate c_i (private buffer)
C = "scaffold_c"  # payload down: the server control variate c
DC = "scaffold_dc"  # payload up: Delta c_i


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters the local optimizer steps, in ``named_parameters`` order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflat(vector: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``vector`` shaped as the tensors of ``like``."""
    return [v.view_as(p) for v, p in zip(vector.split([p.numel() for p in like]), like)]


def effective_steps(k: int, momentum: float) -> float:
    """K_eff = sum_{j=1..K} (1 - beta^(K-j+1)) / (1 - beta): the total weight
    of the K corrected gradients in the displacement of K heavy-ball steps
    (torch's SGD, momentum buffer starting at 0); K when beta = 0."""
    if momentum == 0.0:
        return float(k)
    b = momentum
    return (k - b * (1.0 - b ** k) / (1.0 - b)) / (1.0 - b)


@register_method
class Scaffold(Method):
    name = "scaffold"
    # c_i only steers the local steps: a client's own model predicts as the global one
    phases = ()
    shared_payloads = {DC: "client"}  # Delta c_i: a model-sized vector of the client's gradients

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        @model_validator(mode="before")
        @classmethod
        def _server_lr(cls, data: Any) -> Any:
            # run directories written before the server step moved hold server_lr: 1.0 (no step): still read
            if isinstance(data, dict) and data.get("server_lr") == 1.0:
                return {k: v for k, v in data.items() if k != "server_lr"}
            if isinstance(data, dict) and "server_lr" in data:
                raise ValueError(f"scaffold's server_lr is the server optimizer's step now: set server: {{optimizer: "
                                 f"fedavgm, momentum: 0, lr: {data['server_lr']}}} instead of method.server_lr")
            return data

    def __init__(self, params, model_cfg, training_cfg, num_clients):
        super().__init__(params, model_cfg, training_cfg, num_clients)
        self.numel = 0

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.training.optimizer != "sgd":
            raise ConfigError(f"scaffold's local step is SGD's (Algorithm 1 line 10) and its control-variate update "
                              f"assumes it; training.optimizer={cfg.training.optimizer}: use sgd")

    # ------------------------------------------------------------------ model
    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        self.numel = sum(p.numel() for _, p in trainable(model))
        model.register_buffer(CI, torch.zeros(self.numel))
        return model

    def local_keys(self, model):
        return {CI}

    def private_keys(self, model):
        return {CI}

    # ------------------------------------------------------------ client side
    def local_train(self, model, batches, ctx):
        params = [p for _, p in trainable(model)]
        ci: torch.Tensor = getattr(model, CI)
        c = torch.from_numpy(np.array(ctx.payload[C], dtype=np.float32)).to(ci.device)
        x = flat(params)
        correction = unflat(c - ci, params)  # c - c_i, per parameter
        opt = self.make_optimizer(model, ctx.round, params)

        def correct(_opt, _args, _kwargs):  # line 10: the step takes g + c - c_i
            for p, d in zip(params, correction):
                if p.grad is None:  # a parameter the loss did not reach still drifts by c - c_i
                    p.grad = d.clone()
                else:
                    p.grad.add_(d)

        opt.register_step_pre_hook(correct)
        model.train()
        res = train_steps(opt, batches, lambda xb, yb: self.loss(model, xb, yb, ctx), precision=ctx.precision)
        with torch.no_grad():
            if res.steps:  # option II (line 12), K_eff for momentum (module docstring)
                new = ci - c + (x - flat(params)) / (effective_steps(res.steps, self.training.momentum)
                                                     * self.lr_at(ctx.round))
            else:
                new = ci.clone()
            ctx.scratch[DC] = (new - ci).cpu().numpy().astype(np.float32)
            ci.copy_(new)
        return res

    def upload_payload(self, model, ctx):
        return {DC: ctx.scratch[DC]}

    # ------------------------------------------------------------ server side
    def aggregation_weights(self, client_ids, sizes, server_state):
        return np.ones(len(client_ids), dtype=np.float64)  # (1/|S|) sum_{i in S}, lines 16-17

    def server_payloads(self, round, client_ids, server_state, rng, global_state, prepared):
        c = server_state.get(C)
        c32 = (np.zeros(self.numel, np.float32) if c is None else np.asarray(c, np.float32))
        return {cid: {C: c32} for cid in client_ids}

    def after_round(self, round, results, server_state):
        if not results:
            return
        c = np.asarray(server_state.get(C, np.zeros(self.numel)), np.float64)
        total = np.zeros_like(c)
        for r in results:  # in client-id order: a deterministic sum
            total += np.asarray(r.payload[DC], np.float64)
        server_state[C] = c + total / self.num_clients  # (|S|/N) * mean over S of Delta c_i
