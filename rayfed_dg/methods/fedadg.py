"""FedADG: federated adversarial domain generalization.

Zhang, Xie, Bai, Yu, Li, Gao, "Federated Learning with Domain
Generalization", arXiv 2111.10487 (2021); a baseline of FedDG-Benchmark (Bai
et al., ICLR 2024).  The paper's text is not in this repository; the losses
below follow its public code (``pacs-ours/localTrain.py``, ``Nets.py``,
``train.py``), which FedDG-Benchmark ports.

Each client k aligns the distribution of its features z = F(x) to a
reference distribution drawn from a generator G(y~, u) (u ~ U[0, 1)^noise_dim,
y~ the one-hot label scaled by ``label_scale``), through its own
discriminator D(y~, z) in (0, 1) (a bias-free linear projection of z to
``rp_size``, concatenated with y~, an MLP and a sigmoid; all of it trained).  G is shared and
averaged with F and the classifier C; D stays on its client, never uploaded.
Each local step of a round, after the round's first ``warmup_fraction`` of
steps (plain label-smoothed cross-entropy on F and C, the code's
``i_epochs``), takes three updates on one batch:

    D:     min  mean (1 - D(y~, G(y~, u)))^2 + D(y~, F(x))^2          (F, G detached)
    F, C:  min  alpha LS-CE(C(F(x)), y) + (1 - alpha) mean (1 - D(y~, F(x)))^2
    G:     min  mean D(y~, G(y~, u))^2

so D tells the reference (1) from the features (0), the features move to
look like the reference and the reference to look like the features.  LS-CE
is cross-entropy with label smoothing ``label_smoothing`` (torch's: spread over
all classes).  D's step reads F in evaluation mode, as the code does.  D and G take SGD
with ``adv_lr``, the code's momentum 0.9 and weight decay 1e-5; F and C
take the run's optimizer.

Where we differ from the reference code, and why:
* the code's learning-rate warm-up and plateau schedulers are left out (the
  run's ``training.lr_schedule`` applies to F and C);
* the code returns each client's best model over its local epochs on its
  own validation split; clients here upload their last iterate;
* its FedAvg averages the clients' models unweighted; we weigh by sample
  count, as every FedAvg-based method here;
* optimizers are fresh each round (the code keeps D's across rounds): a
  client holds no optimizer state between rounds in this engine;
* the default sizes are the code's PACS ones (noise 2048, generator hidden
  4096, projection 1024, discriminator hidden 1024), made for AlexNet's 4096
  features; G travels with the model every round, so for small backbones
  they may be scaled down (the contract test does).
fp16 is refused: three optimizers share one batch's step.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.errors import ConfigError

from .base import LocalResult, Method, register_method

GEN, DISC = "fedadg_generator", "fedadg_discriminator"


class Generator(nn.Module):
    """G(y~, u): [u, y~] -> Linear -> LeakyReLU -> Linear -> ReLU (the code's GeneDistrNet)."""

    def __init__(self, num_classes: int, noise_dim: int, hidden: int, feature_dim: int):
        super().__init__()
        self.noise_dim = noise_dim
        self.net = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden), nn.LeakyReLU(),
                                 nn.Linear(hidden, feature_dim), nn.ReLU())
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight, 0.5)

    def forward(self, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([u, y], 1))


class Discriminator(nn.Module):
    """D(y~, z): a bias-free projection of z to rp_size, [proj, y~] -> Linear
    -> LeakyReLU -> Linear -> sigmoid; every Linear Kaiming-uniform.  (The
    code divides the projection by its norm, then its ``initialize_params``
    draws it again, Kaiming-uniform: what it starts from is the latter.)"""

    def __init__(self, num_classes: int, feature_dim: int, rp_size: int, hidden: int):
        super().__init__()
        self.projection = nn.Linear(feature_dim, rp_size, bias=False)
        self.net = nn.Sequential(nn.Linear(rp_size + num_classes, hidden), nn.LeakyReLU(), nn.Linear(hidden, 1),
                                 nn.Sigmoid())
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.kaiming_uniform_(m.weight)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([self.projection(z.flatten(1)), y], 1))


def discriminator_loss(d_ref: torch.Tensor, d_feat: torch.Tensor) -> torch.Tensor:
    """mean (1 - D(reference))^2 + D(features)^2."""
    return ((1 - d_ref) ** 2 + d_feat ** 2).mean()


def encoder_loss(d_feat: torch.Tensor) -> torch.Tensor:
    """mean (1 - D(features))^2: the features as the reference."""
    return ((1 - d_feat) ** 2).mean()


def generator_loss(d_ref: torch.Tensor) -> torch.Tensor:
    """mean D(reference)^2: the reference as the features."""
    return (d_ref ** 2).mean()


@register_method
class FedADG(Method):
    name = "fedadg"
    phases = ()  # D only shapes the loss; the model predicts without it

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        alpha: float = Field(0.85, ge=0.0, le=1.0)  # weight of the classification loss against the alignment
        label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)  # of the cross-entropy (the code's PACS value)
        label_scale: float = Field(0.7, gt=0.0)  # the one-hot label's value fed to G and D
        warmup_fraction: float = Field(0.3, ge=0.0, le=1.0)  # share of a round's steps on plain CE first (3 of 10)
        adv_lr: float = Field(0.007, gt=0.0)  # SGD learning rate of D and G
        noise_dim: int = Field(2048, ge=1)  # G's uniform noise
        gen_hidden: int = Field(4096, ge=1)  # G's hidden layer
        rp_size: int = Field(1024, ge=1)  # D's projection of the features
        disc_hidden: int = Field(1024, ge=1)  # D's hidden layer

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.training.precision == "fp16":
            raise ConfigError("fedadg cannot train in training.precision fp16: its three optimizers share one "
                              "batch's gradient scaler; use bf16 or fp32")

    # ------------------------------------------------------------------ model
    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        p, dim = self.p, model.feature_dim
        self.num_classes = num_classes
        model.add_module(GEN, Generator(num_classes, p.noise_dim, p.gen_hidden, dim))
        model.add_module(DISC, Discriminator(num_classes, dim, p.rp_size, p.disc_hidden))
        return model

    def local_keys(self, model):
        return {k for k in model.state_dict() if k.startswith(DISC + ".")}

    def private_keys(self, model):
        return self.local_keys(model)

    def tensor_group(self, key, is_local):
        if key.startswith(GEN + "."):
            return GEN
        return super().tensor_group(key, is_local)

    # ------------------------------------------------------------ client side
    def _planned_steps(self, ctx) -> int:
        t = self.training
        return t.local_steps or t.local_epochs * math.ceil(ctx.num_samples / t.batch_size)

    def local_train(self, model, batches, ctx):
        p = self.p
        gen, disc = getattr(model, GEN), getattr(model, DISC)
        task = [q for n, q in model.named_parameters()
                if q.requires_grad and not n.startswith((GEN + ".", DISC + "."))]
        opt = self.make_optimizer(model, ctx.round, task)
        opt_d = torch.optim.SGD(disc.parameters(), lr=p.adv_lr, momentum=0.9, weight_decay=1e-5)
        opt_g = torch.optim.SGD(gen.parameters(), lr=p.adv_lr, momentum=0.9, weight_decay=1e-5)
        warmup = round(p.warmup_fraction * self._planned_steps(ctx))
        prec = ctx.precision
        model.train()
        total, n, steps = 0.0, 0, 0
        for x, y in batches():
            if steps < warmup:
                with prec.autocast():
                    loss = F.cross_entropy(model(x), y, label_smoothing=p.label_smoothing)
                opt.zero_grad(set_to_none=True)
                prec.step(opt, loss)
            else:
                loss = self.adversarial_step(model, x, y, ctx, opt, opt_d, opt_g)
            total += float(loss.detach()) * len(y)
            n += len(y)
            steps += 1
        return LocalResult(loss=total / max(n, 1), steps=steps, samples=n)

    def adversarial_step(self, model, x, y, ctx, opt, opt_d, opt_g) -> torch.Tensor:
        """D, then F and C, then G, on one batch (the code's train_step order)."""
        p, prec = self.p, ctx.precision
        gen, disc = getattr(model, GEN), getattr(model, DISC)
        y_soft = F.one_hot(y, self.num_classes).to(x.dtype) * p.label_scale
        u = torch.rand(len(y), p.noise_dim, generator=ctx.generator).to(x.device)
        model.eval()  # as the code: F in evaluation mode for D's step (BatchNorm statistics untouched)
        with prec.autocast():
            with torch.no_grad():
                feat = model.features(x)
                ref = gen(y_soft, u)
        model.train()
        with prec.autocast():
            d_loss = discriminator_loss(disc(y_soft, ref), disc(y_soft, feat))
        opt_d.zero_grad(set_to_none=True)
        prec.step(opt_d, d_loss)
        with prec.autocast():
            feat = model.features(x)
            ce = F.cross_entropy(model.head(feat), y, label_smoothing=p.label_smoothing)
            loss = p.alpha * ce + (1 - p.alpha) * encoder_loss(disc(y_soft, feat))
        opt.zero_grad(set_to_none=True)
        disc.zero_grad(set_to_none=True)
        prec.step(opt, loss)
        with prec.autocast():
            g_loss = generator_loss(disc(y_soft, gen(y_soft, u)))
        opt_g.zero_grad(set_to_none=True)
        disc.zero_grad(set_to_none=True)
        prec.step(opt_g, g_loss)
        return loss
