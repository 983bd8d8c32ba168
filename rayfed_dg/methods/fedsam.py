"""FedSAM: sharpness-aware local training, aggregated as FedAvg.

Qu, Li, Duan, Liu, Tang, Lu, "Generalized Federated Learning via
Sharpness Aware Minimization", ICML 2022, Algorithm 1 (FedSAM), whose
local step is SAM's (Foret, Kleiner, Mobahi, Neyshabur, "Sharpness-Aware
Minimization for Efficiently Improving Generalization", ICLR 2021, Eq. 2).

Each local step of client k, on a batch with loss F_k and weights w:

    g     = grad F_k(w)                              (first forward/backward)
    e(w)  = rho g / ||g||_2                          (||.||_2 over every trainable parameter)
    g~    = grad F_k(w + e(w))                       (second forward/backward, at the perturbed weights)
    w    <- optimizer step from w with the gradient g~

The server averages the clients' weights by sample count (FedAvg, the
paper's aggregation for FedSAM).  The local optimizer is the run's
(``training.optimizer``, momentum and weight decay as configured), stepped
from the unperturbed w: SAM's reference optimizer restores w before the base
optimizer's step, which is also where weight decay is taken.

Choices where the paper leaves the deep-learning setup open:
* BatchNorm running statistics are updated by the first pass only (at w, as
  plain SGD would update them); the second pass, at w + e, leaves them as
  they are.  Common SAM implementations update them twice; the statistics of
  perturbed weights are not the model's.
* ``rho`` defaults to 0.05, SAM's default (Foret et al.); Qu et al. tune it
  per dataset, so sweep it on source validation.
* fp16 is refused: a step the gradient scaler skips would leave the weights
  at w + e.  bf16 and fp32 run as usual.
* MoFedSAM (the paper's Algorithm 2, local momentum towards the previous
  global update) is not implemented.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.errors import ConfigError

from .base import Method, register_method, train_steps

UNPERTURBED = "fedsam_w"  # ctx.scratch key: the step's parameters and their values at w, put back before the step


def sam_perturbation(grads: list[torch.Tensor | None], rho: float) -> list[torch.Tensor | None]:
    """e = rho g / ||g||_2, the norm over every tensor of g (a parameter the
    loss did not reach has no gradient and is not perturbed)."""
    present = [g for g in grads if g is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present])) if present else 0.0
    scale = rho / (norm + 1e-12)
    return [None if g is None else g * scale for g in grads]


def _frozen_statistics(model: nn.Module) -> list[tuple[nn.modules.batchnorm._BatchNorm, float | None, torch.Tensor]]:
    """Set every BatchNorm's momentum to 0 (its running statistics unchanged
    by a forward pass in training mode); returns what to restore, the batch
    count too (a cumulative average, momentum None, divides by it)."""
    saved = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            saved.append((m, m.momentum, m.num_batches_tracked.clone()))
            m.momentum = 0.0
    return saved


@register_method
class FedSAM(Method):
    name = "fedsam"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        rho: float = Field(0.05, gt=0.0)  # radius of the weight perturbation (SAM's default; tune it)

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.training.precision == "fp16":
            raise ConfigError("fedsam cannot train in training.precision fp16: a step the gradient scaler skips "
                              "would leave the weights perturbed; use bf16 or fp32")

    def loss(self, model, x, y, ctx):
        """CE at w + e(w), its gradient the SAM gradient; the weights stay
        perturbed until the optimizer's pre-step hook takes e away."""
        params = [p for p in model.parameters() if p.requires_grad]
        first = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(first, params, allow_unused=True)
        e = sam_perturbation(list(grads), self.p.rho)
        # w itself, not w + e - e: the step starts from the exact weights (as SAM's reference keeps old_p)
        ctx.scratch[UNPERTURBED] = (params, [p.detach().clone() for p in params])
        with torch.no_grad():
            for p, d in zip(params, e):
                if d is not None:
                    p.add_(d)
        saved = _frozen_statistics(model)
        try:
            return F.cross_entropy(model(x), y)
        finally:
            for m, momentum, count in saved:
                m.momentum = momentum
                m.num_batches_tracked.copy_(count)

    def local_train(self, model, batches, ctx):
        opt = self.make_optimizer(model, ctx.round)

        def restore(_opt, _args, _kwargs):  # the step is taken from w, with the gradient at w + e
            params, w = ctx.scratch.pop(UNPERTURBED)
            with torch.no_grad():
                for p, v in zip(params, w):
                    p.copy_(v)

        opt.register_step_pre_hook(restore)
        model.train()
        return train_steps(opt, batches, lambda x, y: self.loss(model, x, y, ctx), precision=ctx.precision)
