"""CSAC: collaborative semantic aggregation and calibration.

Yuan, Ma, Chen, Kuang, Wu, Lin, "Collaborative Semantic Aggregation and
Calibration for Federated (Separated) Domain Generalization", TKDE 2023
(arXiv 2110.06736).  A baseline of the FedFD-A paper, whose framework is
built on CSAC's released code (junkunyuan/CSAC); FedFD-A ran the baselines
with their public code, so we follow that code where it differs from the
paper's text.

* Local semantic acquisition: the first time a client takes part it trains
  the broadcast model on its own data alone (CE) for ``pretrain_steps``
  iterations; the result is uploaded and also kept on the client, frozen, as
  its private model f_k^p (``private.*``, never uploaded; CSAC pre-trains
  every client before the first aggregation, so round 1 here is that
  pre-training plus the first aggregation: CSAC's R rounds are our R + 1).
* Data-free semantic aggregation (the code's ``fusion: l2``): every tensor
  (layer) t of the global model is a weighted sum of the clients' tensors,
      t = sum_i a_i^t w_i^t,   a_i^t = d_i^t / sum_j d_j^t,
      d_i^t = || w_i^t - mean_j w_j^t ||_2
  so a client whose layer differs more from the plain mean weighs more in
  that layer (uniform mean when all coincide; integer buffers keep the
  engine's average).  ``aggregation: fedavg`` uses |D_i| weights instead.
* Semantic calibration while training the aggregated model f locally:
      L = CE(f(x), y) + lam * MK-MMD(f_k^p(x), f(x))
  MK-MMD (Long et al.'s multiple-kernel MMD with the unbiased in-domain
  terms) between the logits of the frozen private model and of the model
  being trained, Gaussian kernels of bandwidth 3^u * mean squared distance,
  u = -3..1 (the code's ``addition: bone``).

Where the released code differs from the paper: the paper calibrates
intermediate layers across levels with attention weights (PAM and CAM
energies); in the code's default mode (``--mode alpha``) the attention
returns the weights but no calibrated features, so the cross-layer term is
identically zero and the loss above (CE plus the logit MK-MMD) is what it
trains: we implement that, not the attention calibration.  The code's
backbone has a 256-d bottleneck (Linear, BatchNorm1d, ReLU) before the
classifier; here every method shares the project's backbone and head.
Defaults from the code: lam = 0.6, pre-training 30 epochs x 60 iterations =
1800 steps, local training 10 x 20 = 200 iterations a round (``training.
local_steps``), SGD lr 0.01 momentum 0.5, batch 64, 40 rounds.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.errors import ConfigError

from .base import Declarations, Method, register_method, train_steps

KERNEL_ALPHAS = tuple(3.0 ** u for u in range(-3, 2))
PRIVATE = "private."
READY = "private_ready"  # sorts after the private model's keys


def mk_mmd(zs: torch.Tensor, zt: torch.Tensor, alphas=KERNEL_ALPHAS) -> torch.Tensor:
    """Multiple-kernel MMD between two equal-sized batches, as the CSAC code
    (tllib): sum over Gaussian kernels, bandwidth sigma^2 = alpha * mean
    squared distance (detached), in-domain pairs i != j."""
    b = len(zs)
    x = torch.cat([zs.flatten(1), zt.flatten(1)])
    d2 = torch.cdist(x, x).pow(2)
    mean_d2 = d2.detach().mean()
    k = sum(torch.exp(-d2 / (2 * a * mean_d2)) for a in alphas)
    same = torch.full((b, b), 1.0 / (b * (b - 1)), device=x.device).fill_diagonal_(0.0)
    cross = torch.full((b, b), -1.0 / (b * b), device=x.device)
    index = torch.cat([torch.cat([same, cross], 1), torch.cat([cross, same], 1)])
    return (k * index).sum() + 2.0 / (b - 1)


def layerwise_weights(tensors: list[np.ndarray]) -> np.ndarray:
    """a_i = d_i / sum_j d_j with d_i = ||w_i - mean||_2 (uniform when all d_i = 0)."""
    stack = np.stack([np.asarray(t, np.float64) for t in tensors])
    d = np.sqrt(((stack - stack.mean(0)) ** 2).reshape(len(stack), -1).sum(1))
    return d / d.sum() if d.sum() > 0 else np.full(len(d), 1.0 / len(d))


@register_method
class CSAC(Method):
    name = "csac"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        lam: float = Field(0.6, ge=0.0)  # weight of the calibration loss
        pretrain_steps: int | None = Field(1800, ge=1)  # None: one round's local budget
        aggregation: Literal["l2", "fedavg"] = "l2"  # l2: data-free semantic (layer-wise) weights; fedavg: |D_i|

    @classmethod
    def declare(cls, params) -> Declarations:
        # the layer-wise weights read every client's tensors (assemble_global)
        return replace(super().declare(params), folds_on_workers=params.aggregation == "fedavg")

    @property
    def folds_on_workers(self) -> bool:  # type: ignore[override]
        return self.declare(self.p).folds_on_workers

    @classmethod
    def check(cls, cfg) -> None:
        # the layer-wise aggregation assembles every shared float tensor: a server optimizer would step none
        if cfg.server.optimizer != "none" and cfg.method.params.aggregation == "l2":
            raise ConfigError(f"server.optimizer {cfg.server.optimizer} has nothing to step: csac's layer-wise "
                              "aggregation sets every shared tensor itself; use server.optimizer: none, or "
                              "method.aggregation: fedavg")

    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        private = copy.deepcopy(model)
        for p in private.parameters():
            p.requires_grad_(False)
        model.private = private  # the frozen private model f_k^p (kept on the client)
        model.register_buffer(READY, torch.zeros(()))  # 1 once the client has pre-trained
        return model

    def private_keys(self, model):
        return {k for k in model.state_dict() if k.startswith(PRIVATE)} | {READY}

    def local_keys(self, model):
        return self.private_keys(model)

    def tensor_group(self, key, is_local):
        return "csac_private" if is_local else "shared"

    def local_train(self, model, batches, ctx):
        opt = self.make_optimizer(model, ctx.round)  # the private model's parameters are frozen
        model.train()
        private: nn.Module = model.private
        if float(getattr(model, READY)) == 0:  # local semantic acquisition (pre-training)
            stats = train_steps(opt, batches, lambda x, y: F.cross_entropy(model(x), y), self.p.pretrain_steps,
                                precision=ctx.precision)
            with torch.no_grad():
                src = {k: v for k, v in model.state_dict().items() if not k.startswith(PRIVATE) and k != READY}
                private.load_state_dict(src)
                getattr(model, READY).fill_(1.0)
            stats.stats["pretrained"] = 1.0
            return stats
        private.eval()

        def loss_fn(x, y):
            logits = model(x)
            with torch.no_grad():
                fixed = private(x)
            return F.cross_entropy(logits, y) + self.p.lam * mk_mmd(fixed, logits)

        return train_steps(opt, batches, loss_fn, precision=ctx.precision)

    def assembles(self, model):
        if self.p.aggregation == "fedavg":
            return set()
        return {k for k, v in model.state_dict().items()
                if not (k.startswith(PRIVATE) or k == READY) and torch.is_floating_point(v)}

    def assemble_global(self, round, results, average, previous, server_state):
        if self.p.aggregation == "fedavg" or len(results) < 2:
            return {}
        out = {}
        for key, avg in average.items():
            if key.startswith(PRIVATE) or key == READY or np.issubdtype(avg.dtype, np.integer):
                continue
            tensors = [r.update[key] for r in results]
            a = layerwise_weights(tensors)
            out[key] = sum(w * np.asarray(t, np.float64) for w, t in zip(a, tensors)).astype(avg.dtype)
        return out
