"""Server optimizers: a step along the round's pseudo-gradient instead of taking the average.

The round's weighted average of the clients' models, ``avg`` (the reduce,
``aggregate.py``), and the global model it started from, x_t, give the
pseudo-gradient Delta_t = avg - x_t (Reddi et al.'s Delta_t is the mean of
the clients' x_i - x_t, which is the same thing; here the clients are
weighted as the method's reduce weights them, |D_i| for FedAvg).

* FedAdagrad / FedYogi / FedAdam: Reddi, Charles, Zaheer, Garrett, Rush,
  Konecny, Kumar, McMahan, "Adaptive Federated Optimization", ICLR 2021,
  Algorithm 2, line by line:
      m_t = beta1 m_{t-1} + (1 - beta1) Delta_t                  (m_{-1} = 0)
      v_t = v_{t-1} + Delta_t^2                                  (FedAdagrad)
      v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)  (FedYogi)
      v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2                (FedAdam)
      x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)
  The algorithm asks for v_{-1} >= tau^2 and names no value; we start at
  v_{-1} = tau^2, the smallest it allows (Flower starts at 0, which the
  paper's condition excludes).  No bias correction: the algorithm has none
  (Flower's FedAdam adds Adam's; we do not).
* FedAvgM: Hsu, Qi, Brown, "Measuring the Effects of Non-Identical Data
  Distribution for Federated Visual Classification", 2019, Sec. 3: the
  server keeps a momentum buffer, v <- beta v + Delta w, w <- w - v, with
  Delta w the average update as a descent direction (our -Delta_t).  In our
  sign and with Reddi et al.'s server learning rate (their FedAvgM is server
  SGD with momentum):  m_t = beta m_{t-1} + Delta_t,  x_{t+1} = x_t + eta m_t;
  eta = 1 is Hsu et al.'s form.  With beta = 0 and eta = 1 it is FedAvg.

What is stepped: the model's parameters that the server broadcasts.  The
server optimizer never touches

* a method's local / private keys (they are not global: FedBN's BN layers,
  gPerXAN's BN side of XAN, COPA's heads), whatever the engine averages
  into the global inference model there;
* buffers: BatchNorm running statistics (and num_batches_tracked) keep the
  plain weighted average, as Flower / FedML users commonly do.  They are
  not optimized by gradients but estimated from data under the current
  weights; an adaptive step would move each of them by about eta whatever
  its scale (Adam's step is about eta * sign(Delta) at first) and could
  drive a running variance negative, while the average is an estimate of
  the federation's statistics, which is what the buffers mean.

State (m, and v for the adaptive ones) is kept in each tensor's own dtype
(the memory of one or two more models, as torch.optim.Adam keeps); each
step computes in float64 from it.  It is part of the server's checkpoint,
so a resumed run steps exactly as an uninterrupted one.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch.nn as nn

ADAPTIVE = ("fedadagrad", "fedyogi", "fedadam")


def stepped_keys(model: nn.Module, local_keys: Iterable[str]) -> list[str]:
    """State-dict names of ``model``'s parameters that are global (broadcast):
    what a server optimizer steps; every buffer and local key keeps the average."""
    local = set(local_keys)
    return sorted({n for n, _ in model.named_parameters(remove_duplicate=False)} - local)


class ServerOptimizer:
    """One federation's server optimizer over the tensors ``keys`` of the
    global model, ``init`` (the global model before round 1, for shapes and
    dtypes)."""

    def __init__(self, optimizer: str, eta: float, beta1: float, beta2: float, tau: float,
                 init: dict[str, np.ndarray], keys: Iterable[str]):
        if optimizer not in ADAPTIVE + ("fedavgm",):
            raise ValueError(f"unknown server optimizer {optimizer!r}")
        self.optimizer, self.eta, self.beta1, self.beta2, self.tau = optimizer, eta, beta1, beta2, tau
        self.keys = sorted(k for k in keys if np.issubdtype(np.asarray(init[k]).dtype, np.floating))
        self.m = {k: np.zeros_like(init[k]) for k in self.keys}
        # Algorithm 2: v_{-1} >= tau^2; its smallest value
        self.v = {k: np.full_like(init[k], tau * tau) for k in self.keys} if optimizer in ADAPTIVE else {}
        self.steps = 0

    @classmethod
    def from_config(cls, server_cfg, init: dict[str, np.ndarray], keys: Iterable[str]) -> ServerOptimizer | None:
        """The configured optimizer (``server:`` section); None for ``none`` (the average is the new model)."""
        c = server_cfg
        if c.optimizer == "none":
            return None
        return cls(c.optimizer, c.eta, c.momentum, c.beta2, c.tau, init, keys)

    def step(self, x: dict[str, np.ndarray], avg: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The new global model: ``avg`` (the round's weighted average, the
        previous values for keys nobody uploaded) with every stepped key
        replaced by x_{t+1}; ``x`` is the global model x_t the round started from."""
        out = dict(avg)
        b1, b2 = self.beta1, self.beta2
        for k in self.keys:
            xk = np.asarray(x[k], np.float64)
            delta = np.asarray(avg[k], np.float64) - xk
            m = np.asarray(self.m[k], np.float64)
            if self.optimizer == "fedavgm":
                m = b1 * m + delta
                new = xk + self.eta * m
            else:
                m = b1 * m + (1.0 - b1) * delta
                v, d2 = np.asarray(self.v[k], np.float64), delta * delta
                if self.optimizer == "fedadagrad":
                    v = v + d2
                elif self.optimizer == "fedyogi":
                    v = v - (1.0 - b2) * d2 * np.sign(v - d2)
                else:
                    v = b2 * v + (1.0 - b2) * d2
                new = xk + self.eta * m / (np.sqrt(v) + self.tau)
                self.v[k] = v.astype(self.v[k].dtype)
            self.m[k] = m.astype(self.m[k].dtype)
            out[k] = new.astype(np.asarray(x[k]).dtype)
        self.steps += 1
        return out

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer, "steps": self.steps, "m": dict(self.m), "v": dict(self.v)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("optimizer") != self.optimizer or set(state["m"]) != set(self.m) \
                or set(state["v"]) != set(self.v):
            raise ValueError(f"the checkpoint's server optimizer state ({state.get('optimizer')}) does not match "
                             f"this run's {self.optimizer} over {len(self.m)} tensors")
        self.steps = int(state["steps"])
        self.m = {k: np.asarray(state["m"][k], self.m[k].dtype) for k in self.m}
        self.v = {k: np.asarray(state["v"][k], self.v[k].dtype) for k in self.v}
