"""COPA: collaborative optimization and aggregation.

Wu, Gong, "Collaborative Optimization and Aggregation for Decentralized
Domain Generalization and Adaptation", ICCV 2021.  A baseline of the gPerXAN
and FedFD-A papers (CCST copies COPA's own numbers: no code was released).

The global model is a domain-invariant feature extractor g and an ensemble
of domain-specific classifiers {h_1, ..., h_N}, one per client.

* Local optimization: client k trains g and its own head h_k together with
  the other clients' heads from the last ensemble, frozen ("collaboration of
  frozen classifiers"), so that its features suit every domain's classifier:
      L_k = CE(h_k(g(x)), y) + lam * mean_{j != k} CE(h_j(g(x)), y)
  (j over the heads already assembled; none in round 1).
* Aggregation: g is averaged (FedAvg, |D_i| weights); the heads are not
  averaged but assembled: slot k of the ensemble becomes client k's head
  (``assemble_global``); a client not sampled this round keeps its slot.
* Test: the ensemble predicts, the mean over the assembled heads of
  softmax(h_j(g(x))) (``ensemble: prob``; ``logit`` averages the logits).
* Hybrid batch-instance normalization in g: IBN-a layers (InstanceNorm on half
  the channels) in the first BN of each block of stages 1-3, IBN-Net's own
  placement (``norm: ibn``; ``bn`` keeps BatchNorm).

What travels (ledger): up, the whole model, the own head under its own group
``copa_own_head``; down, the extractor and the ensemble of all N heads with
bias as one payload ``copa_heads`` (N x C x (D + 1) floats) plus which
slots are filled (``copa_filled``).  The ensemble in the model
(``head.ensemble_*``) is filled by the server for the global (test) model;
on a client it is kept private, only read from the payload.

Choices where the paper was not available here to check (``[unverified]``
in ../shared/notes/methods.md): the frozen heads' CE terms are averaged and
weighted by ``lam`` = 1, so they weigh as much as the own head whatever the
number of clients; the ensemble averages probabilities with equal weight per
head; IBN-a stands for "hybrid batch-instance normalization"; heads not yet
trained are left out of the loss and of the ensemble.  COPA's UDA part
(prediction agreement on unlabeled target data) does not apply to DG.
"""
from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.models import apply_norm

from .base import Method, register_method
from .gperxan import IBN_PLACEMENT, auto_placement

OWN = "head.cls."
ENSEMBLE = ("head.ensemble_w", "head.ensemble_b", "head.ensemble_filled")


class EnsembleHead(nn.Module):
    """The client's own classifier ``cls`` (trained) and the assembled
    ensemble (buffers).  In training mode it is the own classifier; in
    evaluation the ensemble's prediction (log of the mean probability, so
    argmax and cross-entropy read it as logits)."""

    ensemble_w: torch.Tensor
    ensemble_b: torch.Tensor
    ensemble_filled: torch.Tensor

    def __init__(self, in_dim: int, num_classes: int, num_heads: int, mode: str):
        super().__init__()
        self.cls = nn.Linear(in_dim, num_classes)
        self.mode = mode
        self.register_buffer("ensemble_w", self.cls.weight.detach().clone().expand(num_heads, -1, -1).clone())
        self.register_buffer("ensemble_b", self.cls.bias.detach().clone().expand(num_heads, -1).clone())
        self.register_buffer("ensemble_filled", torch.zeros(num_heads))

    @property
    def in_features(self) -> int:
        return self.cls.in_features

    def heads(self, f: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        """Logits of the ensemble heads ``which`` (bool (N,)): (K, B, C)."""
        return torch.einsum("bd,kcd->kbc", f, self.ensemble_w[which]) + self.ensemble_b[which][:, None, :]

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        which = self.ensemble_filled > 0
        # before any head is assembled (a client's copy in round 1) the own classifier is the only one
        if self.training or not bool(which.any()):
            return self.cls(f)
        return ensemble_predict(self.heads(f, which), self.mode)


def ensemble_predict(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """(K, B, C) logits of K heads -> (B, C) ensemble logits."""
    if mode == "logit":
        return logits.mean(0)
    # log of the mean probability, in log space: log(mean(softmax)) is -inf once every head gives a class ~0
    return torch.logsumexp(F.log_softmax(logits, -1), 0) - math.log(logits.shape[0])


@register_method
class COPA(Method):
    name = "copa"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        lam: float = Field(1.0, ge=0.0)  # weight of the frozen heads' loss
        norm: Literal["ibn", "bn"] = "ibn"  # hybrid batch-instance normalization in the extractor
        ensemble: Literal["prob", "logit"] = "prob"  # how the heads' predictions are combined at test

    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        if self.p.norm == "ibn":
            try:
                apply_norm(model, auto_placement(IBN_PLACEMENT, self.model_cfg.arch), "ibn")
            except ValueError as e:  # e.g. a timm backbone without BatchNorm
                raise ValueError(f"copa's hybrid batch-instance normalization: {e} (method.norm: bn keeps the "
                                 "backbone's own)") from None
        model.head = EnsembleHead(model.head.in_features, num_classes, self.num_clients, self.p.ensemble)
        return model

    # at test the model predicts with the ensemble the server assembles; a client's stored head and ensemble
    # copy are not a model of its own worth evaluating (no personal_val rows)
    phases = ()

    def local_keys(self, model):
        return {k for k in model.state_dict() if k.startswith(OWN)} | set(ENSEMBLE)

    def private_keys(self, model):
        return set(ENSEMBLE)  # the client reads the ensemble from the payload; the server assembles its own

    def tensor_group(self, key, is_local):
        if key.startswith(OWN):
            return "copa_own_head"
        return "copa_heads" if key in ENSEMBLE else "shared"

    # ------------------------------------------------------------ client side
    def round_start(self, model, ctx):
        heads = torch.as_tensor(np.asarray(ctx.payload["copa_heads"]))
        filled = torch.as_tensor(np.asarray(ctx.payload["copa_filled"]))
        with torch.no_grad():
            model.head.ensemble_w.copy_(heads[..., :-1])
            model.head.ensemble_b.copy_(heads[..., -1])
            model.head.ensemble_filled.copy_(filled)
        others = filled > 0
        others[ctx.client_id] = False
        ctx.scratch["others"] = others.to(ctx.device)

    def loss(self, model, x, y, ctx):
        f = model.features(x)
        loss = F.cross_entropy(model.head.cls(f), y)
        others = ctx.scratch["others"]
        if self.p.lam > 0 and bool(others.any()):
            logits = model.head.heads(f, others)  # frozen: buffers, no gradient but into f
            k, b, c = logits.shape
            frozen = F.cross_entropy(logits.reshape(k * b, c), y.repeat(k))  # the mean over heads and samples
            loss = loss + self.p.lam * frozen
        return loss

    # ------------------------------------------------------------ server side
    def server_payloads(self, round, client_ids, server_state, rng, global_state, prepared):
        heads = np.concatenate([global_state["head.ensemble_w"], global_state["head.ensemble_b"][..., None]], -1)
        filled = np.asarray(global_state["head.ensemble_filled"], np.float32)
        return {c: {"copa_heads": heads, "copa_filled": filled} for c in client_ids}

    def assembles(self, model):
        return set(ENSEMBLE)

    def assemble_global(self, round, results, average, previous, server_state):
        # the heads are local keys: they reach the server in r.update even where workers fold the rest
        w = np.array(average["head.ensemble_w"])
        b = np.array(average["head.ensemble_b"])
        filled = np.array(average["head.ensemble_filled"])
        for r in results:  # slot k <- client k's head
            w[r.client] = r.update[OWN + "weight"]
            b[r.client] = r.update[OWN + "bias"]
            filled[r.client] = 1.0
        return {"head.ensemble_w": w, "head.ensemble_b": b, "head.ensemble_filled": filled}
