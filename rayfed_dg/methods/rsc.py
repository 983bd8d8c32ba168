"""RSC under FedAvg: representation self-challenging on each client.

Huang, Wang, Xing, Huang, "Self-Challenging Improves Cross-Domain
Generalization", ECCV 2020.  A centralized DG baseline applied inside each
client ("FedAvg w/ RSC") in the gPerXAN, CCST and FedFD-A papers; no
federated change, aggregation is FedAvg.

Per batch, on the last feature map z (B, C, H, W) before global pooling
(ResNet layer4, the conv net's fourth block, a timm CNN's ``forward_features``
output: only where its features are that map's average pool, not a head
with layers of its own) and the labels y:

1. g = d (sum_i h(pool(z))_{i, y_i}) / d z, the gradient of each sample's
   true-class logit with respect to z (z detached: no update from this pass);
2. with probability ``spatial_p`` spatial, else channel muting:
   * channel: importance of channel c = mean_{hw} g[c, h, w]; mute the
     ceil(C * channel_drop) channels with the largest importance;
   * spatial: importance of location (h, w) = sum_c z[c, h, w] * mean_{hw'} g[c, h', w']
     (Grad-CAM); mute the ceil(H W * spatial_drop) largest locations;
3. batch percentage: the change of the true-class probability,
   p_y(z) - p_y(z * m) - 1e-4 clipped at 0, is computed per sample; only the
   samples whose change is above the (round(B * batch_drop) + 1)-th largest
   keep their mask (at most round(B * batch_drop) samples; none whose
   confidence did not drop), the others are not muted;
4. loss = CE(h(pool(z * m)), y); the mask is a constant, so the gradient
   flows through the unmuted features into the whole network.

Defaults are the official code's (DeLightCMU/RSC, ResNet ``forward``):
spatial 1/3, channel 1/3.2, spatial or channel with equal odds per batch.
The official batch percentage starts at 0.3 and grows by 0.2 every 10
epochs; a client here restarts its local epochs every round, so we keep the
paper's fixed 1/3 (also DomainBed's).  The official code switches the model to
``eval()`` for steps 1-3, which changes nothing there (pooling and a linear
head); we compute z once in training mode.  Ties in importance are broken by
``topk`` where the official threshold would mute fewer entries.  CCST's
reference code runs DomainBed's variant (channel muting of the pooled
feature vector only): ``spatial_p: 0`` gives the channel half.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.errors import ConfigError
from rayfed_dg.models import feature_sites

from .base import Method, register_method


def rsc_mask(z: torch.Tensor, grad: torch.Tensor, spatial: bool, drop: float) -> torch.Tensor:
    """0 on the most predictive channels (B, C, 1, 1) or locations (B, 1, H, W), 1 elsewhere."""
    b, c, h, w = z.shape
    channel_score = grad.mean((2, 3))  # (B, C)
    if spatial:
        score = (z * channel_score[:, :, None, None]).sum(1).reshape(b, h * w)
        k = math.ceil(h * w * drop)
    else:
        score, k = channel_score, math.ceil(c * drop)
    mask = torch.ones_like(score)
    mask.scatter_(1, score.topk(min(k, score.shape[1]), dim=1).indices, 0.0)
    return mask.view(b, 1, h, w) if spatial else mask.view(b, c, 1, 1)


def rsc_batch_select(p_before: torch.Tensor, p_after: torch.Tensor, batch_drop: float) -> torch.Tensor:
    """Bool (B,): the samples whose mask is kept (largest drop of true-class confidence)."""
    change = (p_before - p_after - 1e-4).clamp(min=0.0)
    k = min(int(round(len(change) * batch_drop)), len(change) - 1)
    threshold = change.sort(descending=True).values[k]
    return change > threshold


@register_method
class RSC(Method):
    name = "rsc"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        spatial_drop: float = Field(1 / 3, gt=0.0, lt=1.0)  # share of locations muted
        channel_drop: float = Field(1 / 3.2, gt=0.0, lt=1.0)  # share of channels muted
        batch_drop: float = Field(1 / 3, ge=0.0, le=1.0)  # share of the batch that is muted
        spatial_p: float = Field(0.5, ge=0.0, le=1.0)  # odds of spatial (vs channel) muting per batch

    @classmethod
    def check(cls, cfg) -> None:
        # the last feature map is read at the global pooling that feature_sites knows (ResNets, the conv net,
        # timm CNNs whose features are the average pool of their last map: checked when the model is built)
        arch = cfg.model.arch
        if not (arch.startswith(("resnet", "timm/")) or arch == "convnet"):
            raise ConfigError(f"rsc mutes the last feature map of the ResNets and the conv net; model.arch "
                              f"{arch} is not supported: use resnet18/resnet50, convnet or a timm CNN")

    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        try:  # a timm network whose head does more than pool has no such map: rejected before anything runs
            feature_sites(model.body, need=("pool",))
        except ValueError as e:
            raise ValueError(f"rsc mutes the last feature map before global average pooling; {e}") from None
        return model

    def round_start(self, model, ctx):
        ctx.scratch["pool"] = model.body.get_submodule(feature_sites(model.body)["pool"])

    def head_of_map(self, model, pool, z):
        return model.head(torch.flatten(pool(z), 1))

    def loss(self, model, x, y, ctx):
        pool = ctx.scratch["pool"]
        seen: dict[str, torch.Tensor] = {}
        hook = pool.register_forward_pre_hook(lambda m, inp: seen.__setitem__("z", inp[0]))
        try:
            model.body(x)
        finally:
            hook.remove()
        z = seen["z"]
        with torch.enable_grad():
            zd = z.detach().requires_grad_(True)
            logits = self.head_of_map(model, pool, zd)
            grad, = torch.autograd.grad(logits.gather(1, y[:, None]).sum(), zd)
        with torch.no_grad():
            spatial = bool(torch.rand(1, generator=ctx.generator) < self.p.spatial_p)
            mask = rsc_mask(zd.detach(), grad, spatial, self.p.spatial_drop if spatial else self.p.channel_drop)
            p_before = F.softmax(logits, 1).gather(1, y[:, None])[:, 0]
            p_after = F.softmax(self.head_of_map(model, pool, zd * mask), 1).gather(1, y[:, None])[:, 0]
            keep = rsc_batch_select(p_before, p_after, self.p.batch_drop)
            mask[~keep] = 1.0
        return F.cross_entropy(self.head_of_map(model, pool, z * mask), y)
