"""FedDG-GA: federated domain generalization with generalization adjustment.

Zhang, Xu, Hu, Li, Xu, Jiang, "Federated Domain Generalization with
Generalization Adjustment", CVPR 2023.  A baseline of the gPerXAN and
FedFD-A papers.  Local training is FedAvg's; only the aggregation weights
change.

Each round r, for every participating client i:
* before aggregation, the client evaluates its trained local model on its
  own validation data: ``before_i = L(theta_i^r; D_i)`` (uploaded as the
  one-float payload ``ga_local``);
* the server aggregates with the current weights a^r (not data sizes;
  a^1 = 1 / K uniform), then the new global model is evaluated on the same
  validation data: ``after_i = L(theta^r; D_i)``; the engine runs this
  evaluation on the client's worker (``Phase.EVALUATE_ON_CLIENTS``) and
  records its two float64 (loss, accuracy) in the ledger;
* the generalization gap G_i = after_i - before_i (loss; with accuracy the
  sign flips), normalised around its mean,
  ``A_i = (G_i - mean(G)) / max_j |G_j - mean(G)|``, adjusts the weights for
  the next round, ``a_i <- a_i + d^r A_i``, clipped to [0, 1] and renormalised
  to sum to one;
* the step decays linearly, d^r = d (1 - (r - 1) / R) for rounds r = 1..R
  (the paper's d (1 - r / R) counting rounds from 0), d = 0.2.

Where we differ from the reference code (../shared/notes/methods.md, s. 5),
following the paper: the reference normalises by max |G| without subtracting
the mean and scales the step by an extra 1 / K; it divides by zero when all
gaps are equal, where we leave the weights unchanged.  The reference selects
the model on sum_i a_i val_acc_i; the engine selects on the mean source
validation accuracy as for every method.

The paper defines full participation only.  With partial participation a
client's weight is kept across rounds and the update (and renormalisation)
involves the round's participants only; a client seen for the first time
starts at 1 / K of its round.
"""
from __future__ import annotations

import sys

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .base import Method, Phase, evaluate_on_val, register_method


def ga_step(round: int, rounds: int, step: float) -> float:
    """d^r for rounds r = 1..R: d at the first round, d / R at the last."""
    return step * (1.0 - (round - 1) / max(rounds, 1))


def ga_update(weights: np.ndarray, gaps: np.ndarray, d: float) -> np.ndarray:
    """One generalization adjustment of the participants' weights (loss gaps)."""
    dev = gaps - gaps.mean()
    m = float(np.abs(dev).max()) if len(dev) else 0.0
    new = weights + (d * dev / m if m > 0 else 0.0)
    new = np.clip(new, 0.0, 1.0)
    total = new.sum()
    # all clipped to 0 cannot happen while the mean-centred steps sum to zero
    # and d < 1, but a uniform fallback keeps the reduce defined
    return new / total if total > 0 else np.full_like(new, 1.0 / len(new))


@register_method
class FedDGGA(Method):
    name = "feddg_ga"
    phases = (Phase.EVALUATE_ON_CLIENTS, Phase.PERSONAL_EVAL)
    shared_payloads = {"ga_local": "client"}  # one float: its model's loss (accuracy) on its validation set

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        step_size: float = Field(0.2, gt=0.0, lt=1.0)  # d
        metric: str = Field("loss", pattern="^(loss|accuracy)$")  # the paper's fairness metric: loss
        val_samples: int | None = Field(None, ge=1)  # cap on each client's validation samples (None: all)

    def client_val_size(self) -> int:
        return self.p.val_samples or sys.maxsize

    def upload_payload(self, model, ctx):
        if ctx.val_indices is None or len(ctx.val_indices) == 0:
            raise ValueError(f"client {ctx.client_id} has no validation samples for FedDG-GA")
        model.eval()
        acc, loss = evaluate_on_val(model, ctx)
        return {"ga_local": np.array([loss if self.p.metric == "loss" else acc], dtype=np.float64)}

    def aggregation_weights(self, client_ids, sizes, server_state):
        stored = server_state.get("ga_weights", {})
        first = 1.0 / len(client_ids)
        return np.array([stored.get(int(c), first) for c in client_ids], dtype=np.float64)

    def after_round(self, round, results, server_state):
        if not results:
            return
        ids = [r.client for r in results]
        w = self.aggregation_weights(ids, None, server_state)
        w = w / w.sum()  # the participants' weights as this round's reduce used them
        stored = server_state.setdefault("ga_weights", {})
        key = "loss" if self.p.metric == "loss" else "accuracy"
        after = np.array([getattr(r.global_eval, key) for r in results], dtype=np.float64)
        before = np.array([float(r.payload["ga_local"][0]) for r in results], dtype=np.float64)
        sign = 1.0 if self.p.metric == "loss" else -1.0  # a larger loss gap, or accuracy drop, gains weight
        new = ga_update(w, sign * (after - before), ga_step(round, self.training.rounds, self.p.step_size))
        for c, v in zip(ids, new):
            stored[c] = float(v)
