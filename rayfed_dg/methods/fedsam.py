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
* fp16 is refused while rho > 0: a step the gradient scaler skips would
  leave the weights at w + e.  bf16 and fp32 run as usual.
* MoFedSAM (the paper's Algorithm 2, local momentum towards the previous
  global update) is not implemented.

FedLGF's flatness terms, as options (Yan, Guo, "Local and Global Flatness
for Federated Domain Generalization", ECCV 2024).  The paper's text is not
at hand here; the terms follow its reference code (cnyanhao/FedLGF,
``FedSVD.update`` in ``domainbed/algorithms.py`` and
``AdversarialPertubation`` in ``domainbed/networks.py``).  With features
f = g_w(x) and logits z = h_w(f) of the local model, the objective of a
batch is

    J(w) = CE(z, y) + local_flatness  KL(softmax(z_l) || softmax(z))
                    + global_flatness KL(softmax(z_g) || softmax(z))

where z_l and z_g are the logits of an adversarially perturbed head, both
constants (no gradient flows through them):

    z_l = adv(h_w, f)                   the local head, on the local features
    z_g = adv(h_wg, g_wg(x))            the round's global model (frozen)

and adv(h, f), for the head's weight W (bias b unperturbed), target
p = softmax(z), is one step of KL ascent from a random start:

    singular (default): W = U diag(S) V^T,  W(d) = U diag(relu(S + d)) V^T
    weight:             W(d) = W + d
    delta ~ N(0, I) (or U(-1/2, 1/2)), normalized to unit L2 norm (per row
            of W for ``weight``, over all of S for ``singular``)
    G     = d KL(p || softmax(f W(init delta)^T + b)) / d delta
    adv   = f W(grad G / ||G||)^T + b   (the same normalization as delta)

init = ``perturb_init`` and grad = ``perturb_grad``; the random start is
not kept in the second step (the reference's).  The global term pulls the
local model towards predictions the global model keeps under its worst
nearby heads ("global flatness"), the local term towards its own ("local
flatness"); ``rho`` keeps SAM's step on top, on the gradient of J.
FedLGF itself is ``rho: 0`` (no SAM step, one pass) with both terms at 0.1
and its README's perturbation (singular, normal, 10, 0.1: the defaults
here; its hyper-parameter registry's defaults are weight, uniform, 0.1,
0.01, with comments giving other values: the README's command is the
published run).  Choices where the reference code is specific to DomainBed:
* the global model runs in evaluation mode (the reference's ResNet keeps
  its BatchNorms frozen in evaluation mode always; ours train theirs);
* the random start is drawn from the client's seeded generator, local
  term first, then global (the reference's order, from the global stream);
  like every method's draws here, they move the batch order and
  augmentation drawn after them, so a row with the terms on does not see
  the same batches as FedSAM's at the same seed;
* the head is the backbone's linear head (the reference perturbs each
  linear layer of its classifier, which is one layer unless DomainBed's
  ``nonlinear_classifier`` is set); the perturbation and the KL terms are
  computed in fp32 (bf16 logits under autocast: bf16's log-softmax on a
  CPU made a KL of -9e-4 where fp32 gives +4e-4).
"""
from __future__ import annotations

import copy
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.errors import ConfigError

from .base import Method, frozen, register_method, train_steps

UNPERTURBED = "fedsam_w"  # ctx.scratch key: the step's parameters and their values at w, put back before the step
GLOBAL = "fedsam_global"  # ctx.scratch key: the round's global model, frozen (FedLGF's global flatness)


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


def adversarial_logits(feature: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, kind: str, init: float, grad: float, dist: str,
                       generator: torch.Generator) -> torch.Tensor:
    """FedLGF's adv(h, f): the logits of the head (weight, bias) perturbed by
    one KL-ascent step from a random start (module docstring), detached."""
    with torch.autocast(feature.device.type, enabled=False):  # an SVD in bf16 is not defined
        f, W = feature.detach().float(), weight.detach().float()
        b = None if bias is None else bias.detach().float()
        p = F.softmax(target.detach().float(), dim=1)
        if kind == "singular":
            U, S, Vh = torch.linalg.svd(W, full_matrices=False)

            def head(d: torch.Tensor, scale: float) -> torch.Tensor:
                return F.linear(f, U @ torch.diag(F.relu(S + scale * d)) @ Vh, b)
            shape, dim = S.shape, None  # one unit vector over all singular values
        else:
            def head(d: torch.Tensor, scale: float) -> torch.Tensor:
                return F.linear(f, W + scale * d, b)
            shape, dim = W.shape, 1  # one unit vector per row (per class)

        def unit(v: torch.Tensor) -> torch.Tensor:  # the reference's 1e-8 guard
            return v / (torch.linalg.vector_norm(v, dim=dim, keepdim=dim is not None) + 1e-8)
        draw = torch.randn(shape, generator=generator) if dist == "normal" else \
            torch.rand(shape, generator=generator) - 0.5
        delta = unit(draw.to(f.device)).requires_grad_(True)
        with torch.enable_grad():
            kl = F.kl_div(F.log_softmax(head(delta, init), dim=1), p, reduction="batchmean")
            (g,) = torch.autograd.grad(kl, delta)
        with torch.no_grad():
            return head(unit(g), grad)


def flatness_kl(logits: torch.Tensor, perturbed: torch.Tensor) -> torch.Tensor:
    """KL(softmax(perturbed) || softmax(logits)), batch mean: the reference's
    ``F.kl_div(log_softmax(logits), softmax(perturbed), 'batchmean')``."""
    return F.kl_div(F.log_softmax(logits.float(), dim=1), F.softmax(perturbed.float(), dim=1), reduction="batchmean")


@register_method
class FedSAM(Method):
    name = "fedsam"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        rho: float = Field(0.05, ge=0.0)  # radius of the weight perturbation (SAM's default; tune it); 0: no SAM step
        # FedLGF's terms (0: off): KL to the local / the global model's adversarially perturbed head
        local_flatness: float = Field(0.0, ge=0.0)
        global_flatness: float = Field(0.0, ge=0.0)
        perturb: Literal["singular", "weight"] = "singular"
        perturb_dist: Literal["normal", "uniform"] = "normal"
        perturb_init: float = Field(10.0, gt=0.0)  # FedLGF's README: 10 and 0.1 on singular values
        perturb_grad: float = Field(0.1, gt=0.0)

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.training.precision == "fp16" and cfg.method.params.rho > 0:
            raise ConfigError("fedsam cannot train in training.precision fp16 with rho > 0: a step the gradient "
                              "scaler skips would leave the weights perturbed; use bf16 or fp32")

    def round_start(self, model, ctx):
        if (self.p.local_flatness > 0 or self.p.global_flatness > 0) and not isinstance(model.head, nn.Linear):
            raise ConfigError(f"fedsam's flatness terms perturb a linear head; this model's head is "
                              f"{type(model.head).__name__}: set method.local_flatness and global_flatness to 0")
        if self.p.global_flatness > 0:
            ctx.scratch[GLOBAL] = frozen(copy.deepcopy(model))

    def objective(self, model, x, y, ctx, global_features):
        """CE, plus FedLGF's flatness terms where they are on (``model.features``
        and ``model.head`` then: the split backbone every built model has)."""
        p = self.p
        if p.local_flatness == 0 and p.global_flatness == 0:
            return F.cross_entropy(model(x), y)
        f = model.features(x)
        z = model.head(f)
        loss = F.cross_entropy(z, y)
        adv = dict(kind=p.perturb, init=p.perturb_init, grad=p.perturb_grad, dist=p.perturb_dist,
                   generator=ctx.generator)
        if p.local_flatness > 0:
            head = model.head
            loss = loss + p.local_flatness * flatness_kl(z, adversarial_logits(f, z, head.weight, head.bias, **adv))
        if p.global_flatness > 0:
            head = ctx.scratch[GLOBAL].head
            zg = adversarial_logits(global_features, z, head.weight, head.bias, **adv)
            loss = loss + p.global_flatness * flatness_kl(z, zg)
        return loss

    def loss(self, model, x, y, ctx):
        """J at w + e(w), its gradient the SAM gradient; the weights stay
        perturbed until the optimizer's pre-step hook takes e away.  J at w
        when rho is 0."""
        global_features = None
        if self.p.global_flatness > 0:
            with torch.no_grad():
                global_features = ctx.scratch[GLOBAL].features(x)
        if self.p.rho == 0:
            return self.objective(model, x, y, ctx, global_features)
        params = [p for p in model.parameters() if p.requires_grad]
        first = self.objective(model, x, y, ctx, global_features)
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
            return self.objective(model, x, y, ctx, global_features)
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

        if self.p.rho > 0:  # rho 0: the loss perturbs nothing
            opt.register_step_pre_hook(restore)
        model.train()
        return train_steps(opt, batches, lambda x, y: self.loss(model, x, y, ctx), precision=ctx.precision)
