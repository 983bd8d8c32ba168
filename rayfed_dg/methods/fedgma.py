"""FedGMA: gradient-masked averaging.

Tenison, Sreeharan, Rish, Belilovsky, "Gradient Masked Averaging for
Federated Learning", TMLR 2023 (arXiv 2201.11986), Algorithm 1; a baseline of
FedDG-Benchmark (Bai et al., ICLR 2024).

Clients train as in FedAvg.  With w the global model of the round, w_k the
weights client k uploads, Delta_k = w_k - w and S the clients whose update
arrived, the server computes per parameter coordinate j

    A_j  = | (1/|S|) sum_{k in S} sign(Delta_k,j) |           (sign agreement, in [0, 1])
    m_j  = 1 if A_j >= tau, else A_j                             (the soft mask)
    w_j <- w_j + eta m_j sum_{k in S} p_k Delta_k,j,   p_k = n_k / sum_{l in S} n_l

so coordinates on which the clients agree move as in FedAvg and the others
are damped by their agreement.  Each client uploads sign(Delta_k) over the
trainable parameters (int8, the payload ``fedgma_sign``, sized in the
ledger) beside its weights; the weights are averaged where they are trained
as for every method, and the signs reach the server whole.

Defaults are FedDG-Benchmark's PACS configuration (``mask_threshold`` 0.4,
``step_size`` 1.0).  Where we differ from that reference code:
* its older server reads one hyper-parameter as both tau and eta; we keep
  them apart, as the paper does;
* it masks every entry of the state dict, BatchNorm running statistics
  included; we mask the trainable parameters (the "gradients" of the paper)
  and buffers take the weighted average, as in FedAvg.
sign(0) = 0: a client that did not move a coordinate counts as no vote, and
|S| still divides.  A server optimizer is refused: eta is this method's
server step.
"""
from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.errors import ConfigError

from .base import Method, register_method
from .scaffold import flat, trainable

SIGN = "fedgma_sign"


def gma_mask(sign_sum: np.ndarray, clients: int, tau: float) -> np.ndarray:
    """m = 1 where A = |sign_sum| / clients >= tau, else A."""
    agreement = np.abs(sign_sum.astype(np.float64)) / clients
    return np.where(agreement >= tau, 1.0, agreement)


@register_method
class FedGMA(Method):
    name = "fedgma"
    shared_payloads = {SIGN: "exact"}  # int8 signs: no Gaussian mechanism (randomized response would be)

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        mask_threshold: float = Field(0.4, ge=0.0, le=1.0)  # tau: agreement at or above which a coordinate moves fully
        step_size: float = Field(1.0, gt=0.0)  # eta: the server's step along the masked average update

    def __init__(self, params, model_cfg, training_cfg, num_clients):
        super().__init__(params, model_cfg, training_cfg, num_clients)
        self.param_keys: list[str] = []

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.server.optimizer != "none":
            raise ConfigError(f"server.optimizer {cfg.server.optimizer} has nothing to step: fedgma sets every "
                              "parameter itself (w + step_size * mask * average update); use server.optimizer: none")

    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        self.param_keys = [n for n, _ in trainable(model)]
        return model

    # ------------------------------------------------------------ client side
    def round_start(self, model, ctx):
        ctx.scratch["w_g"] = flat(p for _, p in trainable(model)).detach().clone()

    def upload_payload(self, model, ctx):
        with torch.no_grad():
            delta = flat(p for _, p in trainable(model)) - ctx.scratch["w_g"]
        return {SIGN: torch.sign(delta).to(torch.int8).cpu().numpy()}

    # ------------------------------------------------------------ server side
    def assembles(self, model):
        return set(self.param_keys)

    def assemble_global(self, round, results, average, previous, server_state):
        if not results:
            return {}
        sign_sum = np.zeros(results[0].payload[SIGN].shape, np.int64)
        for r in results:  # integers: exact in any order
            sign_sum += r.payload[SIGN]
        mask = gma_mask(sign_sum, len(results), self.p.mask_threshold)
        out, start = {}, 0
        for k in self.param_keys:  # the flat sign vector follows trainable()'s order
            prev = previous[k].astype(np.float64)
            m = mask[start:start + prev.size].reshape(prev.shape)
            start += prev.size
            step = self.p.step_size * m * (average[k].astype(np.float64) - prev)
            out[k] = (prev + step).astype(average[k].dtype)
        return out
