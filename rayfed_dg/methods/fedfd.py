"""FedFD and FedFD-A: federated feature diversification and instance feature adaptation.

Yang, Choi, Park, Choi, Chang, Yun, "Feature Diversification and Adaptation
for Federated Domain Generalization", ECCV 2024.  There is no public reference code; the
paper (Sec. 3.2-3.3, Eq. 1-7, appendix F Tables 15-16) is the specification.

* Every BatchNorm2d of the feature extractor becomes an ``FDBN`` layer that
  can normalise with (a) its own BN statistics (the original path f),
  (b) mixed statistics mu_mix = u * mu_inst + (1 - u) * mu_G, sigma likewise
  (Eq. 2, u in R^C drawn per channel each iteration from U(a, b)), or
  (c) interpolated statistics alpha * inst + (1 - alpha) * global (Eq. 6)
  with a per-sample, per-layer scalar alpha from the instance adapter
  (Eq. 7): two FC layers on [mu_inst - mu_G ; sigma_inst - sigma_G] giving
  (delta, epsilon), alpha = clamp(z * delta + epsilon, 0, 1), z ~ N(0, 1) in
  training and alpha = clamp(epsilon, 0, 1) at test.
* Local loss (Eq. 3-5): (1 - l1) CE(C(f), y) + l1 CE(C(f_aug), y)
  + l2 mean_i ||f_i - f_aug,i||^2 on the feature extractor's pooled outputs.
* Training alternates, per iteration (Table 15): a main-network step on Eq. 5
  (adapter frozen), then an adapter step on CE through Eq. 6-7 (main network
  frozen).  Everything shared, the adapters included, is averaged by FedAvg.
* Global statistics are the BN running statistics of the received global
  model.  With base ``silobn`` / ``fedbn`` (statistics local) the server still
  averages the clients' running statistics into the global model and sends
  that average as the payload ``global_stats``: the same bytes a FedAvg
  client receives for its statistics, nothing more.

Where the paper is silent (our choices, also listed on the docs site's methods page):
* sigma is the standard deviation sqrt(var + eps) (BN's eps 1e-5), instance
  statistics use the biased variance over H x W, as BN does;
* gradients flow through the instance statistics (nothing is detached);
* the mixed and adapted forwards do not update the running statistics; only
  the original path does, as ordinary BN in training;
* z is drawn per sample and per layer;
* adapter hidden width = max(4, C // 16) for a layer of C channels with a
  ReLU between the two FC layers: +1.9% parameters on ResNet-18, matching the
  paper's "+1.9%"; the adapter's last layer starts at zero weights and bias
  epsilon = 0.5, so alpha starts at 0.5 everywhere;
* the adapter step uses a fresh SGD with the main optimiser's settings;
* client-side selection validates on the validation split of the client's
  own (main) source domain (or a fixed seeded subset of ``select_samples``), in the inference
  mode used at test, and uploads the best of the round's candidates (every
  ``select_every`` iterations and the last one); the optimiser's momentum is
  not rolled back, only the uploaded weights;
* the global statistics of round 1 are those of the initial model.

lambda2 (CAFL's weight): ``auto`` (the default) = 1 / d for a backbone of d
pooled features, from scratch or pretrained; ``lambda2: 4.0`` is the paper's.
CAFL sums squares over the d features.  On the quickstart's conv net (lr 0.05,
momentum 0.9, 4 rounds) training failed where d * lambda2 >= 3 at both widths
tried (32: 0.03 trains, 0.1 near chance; 128: 0.01 trains, 0.03 near chance;
1 and 4 diverge), and EfficientNet-Lite0 pretrained (d = 1,280, lr 0.02) did
best at 0.001 (d * lambda2 = 1.3) of 0.001 / 0.01 / 0.1, 4.0 diverging: no
factor for the regime.  The limit grows as the step shrinks (digits conv net
at lr 0.01: 0.1 trains at d = 64); 1 / d trains at the quickstart's lr 0.05
with momentum 0.9, the largest SGD step in configs/.  The grid:
docs/results/defaults.md.
"""
from __future__ import annotations

import sys
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rayfed_dg.models import BN_TYPES, modules_of_type, replace_norm, state_keys_of

from .base import Method, evaluate_on_val, register_method, train_steps


class FDBN(nn.BatchNorm2d):
    """BatchNorm2d with the mixed (Eq. 2), adapted (Eq. 6-7) and instance paths."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, adapter: bool = False):
        super().__init__(num_features, eps=eps, momentum=momentum)
        # the client's copy of the global statistics: received, never uploaded
        self.register_buffer("g_mean", torch.zeros(num_features), persistent=False)
        self.register_buffer("g_var", torch.ones(num_features), persistent=False)
        self.adapter = None
        if adapter:
            h = max(4, num_features // 16)
            self.adapter = nn.Sequential(nn.Linear(2 * num_features, h), nn.ReLU(inplace=True), nn.Linear(h, 2))
            with torch.no_grad():
                self.adapter[2].weight.zero_()
                self.adapter[2].bias.copy_(torch.tensor([0.0, 0.5]))
        self.mode = "plain"  # plain | mix | adapt | instance
        self.u: torch.Tensor | None = None
        self.gen: torch.Generator | None = None
        self.last_alpha: torch.Tensor | None = None
        # client-side selection evaluates with the received global statistics, as the adapter was trained on
        # differences from them (the client's own running statistics are not the global ones under SiloBN)
        self.eval_with_received = False

    @classmethod
    def from_bn(cls, bn: nn.BatchNorm2d, adapter: bool) -> FDBN:
        m = cls(bn.num_features, bn.eps, bn.momentum if bn.momentum is not None else 0.1, adapter)
        m.load_state_dict(bn.state_dict(), strict=False)
        return m

    def global_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        # at test time the global model's own running statistics are the global ones
        if self.training or self.eval_with_received:
            return self.g_mean, self.g_var
        return self.running_mean, self.running_var

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "plain":
            if not self.training and self.eval_with_received:
                return F.batch_norm(x, self.g_mean, self.g_var, self.weight, self.bias, False, 0.0, self.eps)
            return super().forward(x)
        var_i, mu_i = torch.var_mean(x, (2, 3), unbiased=False)
        sig_i = torch.sqrt(var_i + self.eps)
        g_mean, g_var = self.global_stats()
        mu_g, sig_g = g_mean.unsqueeze(0), torch.sqrt(g_var + self.eps).unsqueeze(0)
        if self.mode == "mix":
            u = self.u.unsqueeze(0)
            mu, sig = u * mu_i + (1 - u) * mu_g, u * sig_i + (1 - u) * sig_g
        elif self.mode == "instance":
            mu, sig = mu_i, sig_i
        elif self.mode == "adapt":
            out = self.adapter(torch.cat([mu_i - mu_g, sig_i - sig_g], 1))
            delta, eps = out[:, 0], out[:, 1]
            if self.training:
                z = torch.randn(delta.shape, generator=self.gen, device=self.gen.device).to(delta.device)
                alpha = (z * delta + eps).clamp(0, 1)
            else:
                alpha = eps.clamp(0, 1)
            self.last_alpha = alpha.detach()
            a = alpha.unsqueeze(1)
            mu, sig = a * mu_i + (1 - a) * mu_g, a * sig_i + (1 - a) * sig_g
        else:
            raise ValueError(f"unknown FDBN mode {self.mode}")
        # (x - mu) / sig * w + b folded into one multiply-add over the map (cheaper on CPU)
        scale = self.weight.unsqueeze(0) / sig
        shift = self.bias.unsqueeze(0) - mu * scale
        return torch.addcmul(shift[:, :, None, None], x, scale[:, :, None, None])


# lambda2: auto's numerator (auto = AUTO_LAMBDA2 / d for d pooled features): CAFL sums squares over the features,
# so its gradient grows with d; weighted 1 / d it is their mean with weight 1.  The grid behind it is in the module
# docstring and docs/results/defaults.md.
AUTO_LAMBDA2 = 1.0


def fd_layers(model: nn.Module) -> list[FDBN]:
    return [m for _, m in modules_of_type(model, (FDBN,))]


def set_mode(model: nn.Module, mode: str) -> None:
    for m in fd_layers(model):
        m.mode = mode


@register_method
class FedFD(Method):
    name = "fedfd"
    use_adapter = False

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        base: Literal["fedavg", "fedbn", "silobn"] = "silobn"  # what BN keeps local: nothing, all, statistics
        lambda1: float = Field(0.1, ge=0.0, le=1.0)
        # CAFL's weight: auto = AUTO_LAMBDA2 / d for a backbone of d pooled features (1/32 on the quickstart's
        # conv net, 1/1280 on EfficientNet-Lite0), from scratch or pretrained; 4.0 is the paper's setting
        lambda2: float | Literal["auto"] = "auto"
        u_low: float = 0.0  # u ~ U(u_low, u_high) per channel per iteration (Table 9 ranges)
        u_high: float = 1.0  # upper end of u's range
        u_fixed: float | None = None  # Table 2: 0 = global only, 1 = instance only, 0.5 = fixed
        # the BN statistics used at test: global, instance or adapter-mixed; auto: adapter for FedFD-A, else global
        inference: Literal["auto", "global", "instance", "adapter"] = "auto"
        # client-side selection (Sec. 4.1): validate every `select_every` iterations (paper: 20)
        # on the validation split of the client's own domain (capped at `select_samples`
        # images if set); upload the best model of the round
        select_every: int | None = Field(None, ge=1)
        select_samples: int | None = Field(None, ge=1)

        @field_validator("lambda2")
        @classmethod
        def _non_negative(cls, v):
            if v != "auto" and v < 0:
                raise ValueError(f"lambda2 {v} must be >= 0 (or auto)")
            return v

        @model_validator(mode="after")
        def _range(self):
            if self.u_high < self.u_low:
                raise ValueError("u_high must be >= u_low")
            return self

    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        # (a timm BatchNormAct2d becomes FDBN + its activation: surgery.NormAct)
        if not replace_norm(model, lambda n, bn: FDBN.from_bn(bn, self.use_adapter), (nn.BatchNorm2d,)):
            raise ValueError(f"{self.name} diversifies BatchNorm statistics and this backbone has no BatchNorm2d layer")
        infer = self.p.inference
        if infer == "auto":
            infer = "adapter" if self.use_adapter else "global"
        if infer == "adapter" and not self.use_adapter:
            raise ValueError("inference: adapter needs method fedfda")
        self._eval_mode = {"global": "plain", "instance": "instance", "adapter": "adapt"}[infer]
        set_mode(model, self._eval_mode)
        return model

    def resolve_lambda2(self, feature_dim: int) -> float:
        """CAFL's weight: ``lambda2``, or for ``auto`` AUTO_LAMBDA2 / ``feature_dim``."""
        if self.p.lambda2 != "auto":
            return float(self.p.lambda2)
        return AUTO_LAMBDA2 / feature_dim

    def client_val_size(self):
        if not self.p.select_every:
            return 0
        return self.p.select_samples or sys.maxsize

    # ---------------------------------------------------------- what is local
    def local_keys(self, model):
        if self.p.base == "fedbn":
            return state_keys_of(model, BN_TYPES)  # FDBN is a BatchNorm2d; adapters stay shared
        if self.p.base == "silobn":
            return state_keys_of(model, BN_TYPES, kinds=("buffer",))
        return set()

    def _stats_local(self) -> bool:
        return self.p.base in ("fedbn", "silobn")

    def tensor_group(self, key, is_local):
        if ".adapter." in key:
            return "adapter"
        return super().tensor_group(key, is_local)

    def server_payloads(self, round, client_ids, server_state, rng, global_state, prepared):
        if not self._stats_local():
            return {}
        keys = sorted(k for k in global_state if k.endswith(".running_mean") or k.endswith(".running_var"))
        stats = np.concatenate([global_state[k].ravel() for k in keys]).astype(np.float32)
        return {c: {"global_stats": stats} for c in client_ids}

    # ------------------------------------------------------------ local step
    def round_start(self, model, ctx):
        layers = fd_layers(model)
        if self._stats_local():
            flat = torch.as_tensor(np.asarray(ctx.payload["global_stats"]))
            # the server packed the global model's running statistics in sorted key order
            sd = model.state_dict(keep_vars=True)
            keys = sorted(k for k in sd if k.endswith(".running_mean") or k.endswith(".running_var"))
            layer_of = {f"{n}.running_mean": m for n, m in modules_of_type(model, (FDBN,))}
            i = 0
            for k in keys:
                c = sd[k].numel()
                m = layer_of.get(k) or layer_of.get(k.replace(".running_var", ".running_mean"))
                (m.g_mean if k.endswith("running_mean") else m.g_var).copy_(flat[i:i + c])
                i += c
        else:
            for m in layers:
                m.g_mean.copy_(m.running_mean)
                m.g_var.copy_(m.running_var)
        for m in layers:
            m.gen = ctx.generator

    def _draw_u(self, model, ctx):
        p = self.p
        for m in fd_layers(model):
            if p.u_fixed is not None:
                m.u = torch.full((m.num_features,), float(p.u_fixed), device=m.weight.device)
            else:
                u = torch.rand(m.num_features, generator=ctx.generator) * (p.u_high - p.u_low) + p.u_low
                m.u = u.to(m.weight.device)

    def main_loss(self, model, x, y, ctx) -> torch.Tensor:
        """Eq. 5: (1 - l1) CE(f) + l1 CACL(f_aug) + l2 CAFL(f, f_aug)."""
        set_mode(model, "plain")
        f = model.features(x)
        ce = F.cross_entropy(model.head(f), y)
        self._draw_u(model, ctx)
        set_mode(model, "mix")
        f_aug = model.features(x)
        set_mode(model, "plain")
        cacl = F.cross_entropy(model.head(f_aug), y)
        cafl = ((f - f_aug) ** 2).sum(1).mean()
        l1, l2 = self.p.lambda1, self.resolve_lambda2(model.feature_dim)
        return (1 - l1) * ce + l1 * cacl + l2 * cafl

    def local_train(self, model, batches, ctx):
        main = [p for n, p in model.named_parameters() if ".adapter." not in n]
        adapter = [p for n, p in model.named_parameters() if ".adapter." in n]
        opt = self.make_optimizer(model, ctx.round, main)
        # the adapter's own optimiser; make_optimizer skips frozen tensors, so build it unfrozen
        opt_a = self.make_optimizer(model, ctx.round, adapter) if adapter else None
        model.train()
        every = self.p.select_every if ctx.val_indices is not None and len(ctx.val_indices) else None
        best = (-1.0, 0, None)  # (validation accuracy, iteration, state)
        it = 0

        def main_step_loss(x, y):  # the main network's step, adapter frozen
            for p in adapter:
                p.requires_grad_(False)
            return self.main_loss(model, x, y, ctx)

        def after_main_step(x, y, i):
            nonlocal best, it
            for p in adapter:
                p.requires_grad_(True)
            if opt_a is not None:
                # the adapter's step: CE through Eq. 6-7, main network frozen
                for p in main:
                    p.requires_grad_(False)
                set_mode(model, "adapt")
                with ctx.precision.autocast():
                    loss_a = F.cross_entropy(model(x), y)
                opt_a.zero_grad(set_to_none=True)
                ctx.precision.step(opt_a, loss_a)
                for p in main:
                    p.requires_grad_(True)
            set_mode(model, "plain")
            it = i
            if every and it % every == 0:
                best = self._keep_best(model, ctx, it, best)

        stats = train_steps(opt, batches, main_step_loss, after_step=after_main_step, precision=ctx.precision)
        if every:
            if it % every:  # the round's last iterate is always a candidate
                best = self._keep_best(model, ctx, it, best)
            model.load_state_dict(best[2])
            stats.stats.update(selected_iteration=best[1], selected_val_acc=best[0])
        set_mode(model, self._eval_mode)
        return stats

    @torch.no_grad()
    def _keep_best(self, model, ctx, it, best):
        """Validate in the inference mode used at test; keep the state if it is
        strictly better (ties keep the earlier iterate)."""
        set_mode(model, self._eval_mode)
        model.eval()
        for m in fd_layers(model):
            m.eval_with_received = True
        try:
            acc, _ = evaluate_on_val(model, ctx)
        finally:
            for m in fd_layers(model):
                m.eval_with_received = False
        model.train()
        set_mode(model, "plain")
        if acc > best[0]:
            return acc, it, {k: v.detach().clone() for k, v in model.state_dict().items()}
        return best


@register_method
class FedFDA(FedFD):
    name = "fedfda"
    use_adapter = True
