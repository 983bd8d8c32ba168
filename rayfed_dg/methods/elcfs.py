"""ELCFS (the method of "FedDG"): episodic learning in continuous frequency space.

Liu, Chen, Qin, Dou, Heng, "FedDG: Federated Domain Generalization on
Medical Image Segmentation via Episodic Learning in Continuous Frequency
Space", CVPR 2021.  A baseline of the gPerXAN, FedFD-A, CCST and StableFDG
papers.  Needs the amplitude bank (``stages: {amplitude: {}}``,
``stages/amplitude.py``); aggregation is FedAvg.

Continuous frequency space interpolation (Sec. 3.2, Eq. 1-2).  For a local
image x with F(x) = A exp(iP), an amplitude spectrum A_n of another client
drawn from the bank and lambda ~ U(0, 1):

    A' = A * (1 - M) + ((1 - lambda) A + lambda A_n) * M
    t  = F^-1(A' exp(iP))               (the phase P is kept)

M is 1 on the centred (2b + 1) x (2b + 1) block of low frequencies,
b = floor(min(H, W) * band), 0 elsewhere (the reference code's mask, made
on the fftshifted spectrum).  t is clipped to the pixel range.

Episodic learning (Sec. 3.3, Eq. 3-6), per batch: meta-train on the raw
images, L_inn = CE(f_theta(x), y), one inner step
theta' = theta - beta * clip(grad L_inn, -c, c); meta-test on the
interpolated images with the inner-updated weights, L_out = CE(f_theta'(t), y);
the update minimises L_inn + L_out.  As in the reference code the inner
gradient is not differentiated again (first order: d theta' / d theta = I).

Choices (reference code notes: ../shared/notes/methods.md, sec. 5):
* the boundary-oriented contrastive term of L_out is for segmentation
  (boundary and background pixels of a mask); classification has no masks, so
  L_out is the task loss alone, as in CCST's classification port;
* band = 0.1, the default of the reference functions; the released training
  scripts pass 0 (only the zero frequency, i.e. each channel's mean
  brightness) and the demo 0.003 at 384 px (a 3 x 3 block);
* lambda ~ U(0, 1) per image, the paper's continuous interpolation; the
  reference code draws the local weight from {0.1, ..., 1.0} (CCST's port
  {0.1, ..., 0.9});
* the other client is drawn uniformly among the others, then one of its
  images uniformly (ELCFS code; CCST's port may draw the client itself);
* beta = 1e-3 and c = 100 from the ELCFS code (CCST's port clips at 1.0);
  its port builds the inner-updated network with ``load_state_dict``, which
  cuts the graph so that L_out never reaches the model: we keep the graph;
* interpolation acts on pixels in [0, 1], before the colour normalisation
  (batches are un-normalised with ``ctx.pixel_mean`` / ``pixel_std``), as the
  reference code transforms raw images; flips are applied before it.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch.func import functional_call

from rayfed_dg.errors import ConfigError
from rayfed_dg.stages.amplitude import SHARED

from .base import Method, register_method


def low_freq_mask(h: int, w: int, band: float) -> torch.Tensor:
    """M in unshifted FFT layout: 1 on the (2b + 1)^2 frequencies nearest zero."""
    b = int(math.floor(min(h, w) * band))
    m = torch.zeros(h, w)
    ch, cw = h // 2, w // 2  # the zero frequency after fftshift
    m[ch - b:ch + b + 1, cw - b:cw + b + 1] = 1.0
    return torch.fft.ifftshift(m, dim=(-2, -1))


def interpolate_amplitude(x: torch.Tensor, amp_other: torch.Tensor, lam: torch.Tensor,
                          band: float) -> torch.Tensor:
    """Eq. 2: ``x`` (B, C, H, W) with its low-frequency amplitude moved a
    fraction ``lam`` (B,) toward ``amp_other`` (B, C, H, W); phase kept.  Not clipped."""
    f = torch.fft.fft2(x, dim=(-2, -1))
    amp, pha = f.abs(), f.angle()
    m = low_freq_mask(x.shape[-2], x.shape[-1], band).to(x.device)
    lam = lam.view(-1, 1, 1, 1).to(x)
    new = amp * (1 - m) + ((1 - lam) * amp + lam * amp_other) * m
    return torch.fft.ifft2(torch.polar(new, pha), dim=(-2, -1)).real


@register_method
class ELCFS(Method):
    name = "elcfs"
    stages_needed = (SHARED,)

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        band: float = Field(0.1, ge=0.0, le=0.5)  # L: half-width of the interpolated block / min(H, W)
        meta_step: float = Field(1e-3, gt=0.0)  # beta, the inner learning rate
        clip: float = Field(100.0, gt=0.0)  # c, element-wise clip of the inner gradient

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.training.precision == "fp16":  # the inner gradient is taken by autograd.grad, outside the scaler
            raise ConfigError("elcfs takes its inner (meta) gradient outside fp16's gradient scaler, where small "
                              "gradients vanish: set training.precision to bf16 or fp32")

    def transformed(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """The interpolated version of a normalised batch, normalised again."""
        bank = ctx.stage_data[SHARED]
        others = np.flatnonzero(bank["owners"] != ctx.client_id)
        owners = bank["owners"][others]
        clients = np.unique(owners)
        g = ctx.generator
        n = len(x)
        pick_client = clients[torch.randint(len(clients), (n,), generator=g).numpy()]
        rows = np.empty(n, np.int64)
        for i, c in enumerate(pick_client):  # a client, then one of its images, uniformly
            mine = others[owners == c]
            rows[i] = mine[int(torch.randint(len(mine), (1,), generator=g))]
        lam = torch.rand(n, generator=g)
        amp = torch.from_numpy(np.ascontiguousarray(bank["bank"][rows])).to(x)
        mean, std = ctx.pixel_mean.to(x), ctx.pixel_std.to(x)
        pixels = x * std + mean
        t = interpolate_amplitude(pixels, amp, lam, self.p.band).clamp(0.0, 1.0)
        return (t - mean) / std

    def loss(self, model, x, y, ctx):
        """L_inn + L_out of one episode; the base loop takes the step (first order: the inner gradients are
        constants in theta', so d theta' / d theta = I)."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        t = self.transformed(x, ctx)
        loss_inner = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss_inner, [p for _, p in named], retain_graph=True)
        fast = {n: p - self.p.meta_step * g.clamp(-self.p.clip, self.p.clip) for (n, p), g in zip(named, grads)}
        loss_outer = F.cross_entropy(functional_call(model, fast, (t,), strict=False), y)
        return loss_inner + loss_outer
