"""Normalization layers that replace BatchNorm, and where they go.

``XAN``  eXplicitly Assembled Normalization (gPerXAN, Le et al., CVPR 2024,
         Eq. 2): y = w_in * IN(x) + w_bn * BN(x), each branch with its own
         affine parameters.
``IBN``  IBN-Net's IBN-a layer (Pan et al., ECCV 2018): InstanceNorm on the
         first half of the channels, BatchNorm on the rest.
``DSON`` domain-specific optimized normalization (Seo et al., ECCV 2020):
         one normalization with a learned mix of BN and IN *statistics* and
         one affine transform (XAN mixes two normalized *outputs*).

Placement names which BatchNorm layers of a backbone are replaced:

``all``        every BatchNorm layer (stem, every block, every shortcut); the
               gPerXAN reference code's choice (53 layers in ResNet-50).
``blocks:K``   the BatchNorm layers inside the first K residual units
               (Bottleneck / BasicBlock) in forward order, shortcut
               (``downsample.1``) BNs included, stem excluded: ResNet-50
               ``blocks:4`` = layer1.0-2 and layer2.0 (14 of 53 layers),
               ``blocks:2`` = layer1.0-1 (7).  An explicit option only, not
               the paper's setting (see ``stages:K``).  ResNet-18's units are
               its 8 BasicBlocks; the conv net's are its 4 conv-BN-ReLU-pool
               units (its gPerXAN default is ``blocks:2``).
``stages:K``   every BatchNorm inside layer1..layerK of a ResNet (K <= 4).
               gPerXAN's setting: its "first four / first two blocks" read as
               ResNet stages (``methods/gperxan.py``), PACS ``stages:4`` (52
               of ResNet-50's 53 layers, all but the stem's; 19 of
               ResNet-18's 20) and Office-Home ``stages:2`` (23 of 53).
``dense1``     DenseNet-121's first dense block and the following transition
               block (``features.denseblock1``, ``features.transition1``; the
               paper's Camelyon17 setting).
``first_bn:stages:K``  (IBN-a) only the first BN (``bn1``) of each block in
               layer1..layerK.

On a timm backbone (``model.arch: timm/...``, ``models/timm_backbones.py``)
its stages are the last four stages of timm's ``feature_info``, ``block1``
.. ``block4`` (EfficientNet-Lite0: ``blocks.1``, ``blocks.2``, ``blocks.4``,
``blocks.6``): ``stages:K`` is every BatchNorm in the stage modules up to
``blockK`` (EfficientNet: every numbered stage ``blocks.0`` .. up to it, so
``stages:4`` is every BN but the stem's and the head convolution's, 47 of
Lite0's 49), ``blocks:K`` the first K children of those stage modules
(EfficientNet's inverted-residual blocks, ResNet's units), and
``first_bn:stages:K`` their ``bn1`` layers (the first BN of each
EfficientNet or ResNet block).  timm's ``BatchNormAct2d`` is a BatchNorm2d
that applies its activation: a layer that replaces it keeps that activation
(``surgery.NormAct``).  A placement that selects no BatchNorm layer (a
backbone without any, such as ConvNeXt's LayerNorms) is an error.
"""
from __future__ import annotations

import math
import re
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from .surgery import BN_TYPES, modules_of_type, replace_norm


class XAN(nn.Module):
    """y = w_in * (gamma_in * (x - mu_in) / sqrt(var_in + eps) + beta_in)
         + w_bn * (gamma_bn * (x - mu_bn) / sqrt(var_bn + eps) + beta_bn)   (Eq. 2)

    (w_bn, w_in) = softmax(logit_bn, logit_in), one pair per layer.  The paper
    says the weights are "randomly initialized" and learned end to end; we
    follow the reference code: two scalar logits initialised equal (w = 0.5,
    0.5) and a softmax, so the weights stay positive and sum to 1.  The IN
    branch uses per-sample statistics in training and in evaluation (no
    running statistics); the BN branch is an ordinary BatchNorm2d.

    ``bn_weight`` is w_bn at initialisation (0.5: the reference code's):
    logit_in stays 1 and logit_bn = 1 + ln(w_bn / (1 - w_bn)), so 0.5 gives
    the reference code's parameters exactly.  Near 1, a XAN built from a
    pretrained BatchNorm computes nearly the BatchNorm's output at round 0.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, bn_weight: float = 0.5):
        super().__init__()
        if not 0.0 < bn_weight < 1.0:
            raise ValueError(f"XAN bn_weight {bn_weight} must lie strictly between 0 and 1")
        self.bn = nn.BatchNorm2d(num_features, eps=eps, momentum=momentum)
        self.inorm = nn.InstanceNorm2d(num_features, eps=eps, affine=True, track_running_stats=False)
        self.logit_bn = nn.Parameter(torch.full((1,), 1.0 + math.log(bn_weight / (1.0 - bn_weight))))
        self.logit_in = nn.Parameter(torch.ones(1))

    def weights(self) -> torch.Tensor:
        return torch.softmax(torch.cat([self.logit_bn, self.logit_in]), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weights()
        return w[0] * self.bn(x) + w[1] * self.inorm(x)

    @classmethod
    def from_bn(cls, bn: nn.BatchNorm2d, bn_weight: float = 0.5) -> XAN:
        """Both branches start from ``bn``: the BN branch takes its affine
        parameters and running statistics, the IN branch its affine ones."""
        m = cls(bn.num_features, bn.eps, bn.momentum if bn.momentum is not None else 0.1, bn_weight)
        with torch.no_grad():
            m.bn.load_state_dict(bn.state_dict())
            if bn.affine:
                m.inorm.weight.copy_(bn.weight)
                m.inorm.bias.copy_(bn.bias)
        return m


class IBN(nn.Module):
    """IBN-a: InstanceNorm (affine) on the first ``C // 2`` channels,
    BatchNorm on the remaining ones."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        # (not ``self.half``: that would shadow nn.Module.half(), the float16 cast)
        self.n_in = num_features // 2
        self.inorm = nn.InstanceNorm2d(self.n_in, eps=eps, affine=True)
        self.bn = nn.BatchNorm2d(num_features - self.n_in, eps=eps, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, [self.n_in, x.shape[1] - self.n_in], 1)
        return torch.cat([self.inorm(a.contiguous()), self.bn(b.contiguous())], 1)

    @classmethod
    def from_bn(cls, bn: nn.BatchNorm2d) -> IBN:
        m = cls(bn.num_features, bn.eps, bn.momentum if bn.momentum is not None else 0.1)
        with torch.no_grad():
            h = m.n_in
            if bn.affine:
                m.inorm.weight.copy_(bn.weight[:h])
                m.inorm.bias.copy_(bn.bias[:h])
                m.bn.weight.copy_(bn.weight[h:])
                m.bn.bias.copy_(bn.bias[h:])
            m.bn.running_mean.copy_(bn.running_mean[h:])
            m.bn.running_var.copy_(bn.running_var[h:])
        return m


class DSON(nn.Module):
    """x_hat = (x - mu) / sqrt(var + eps),  y = gamma * x_hat + beta, with

        mu  = w_bn * mu_bn  + w_in * mu_in
        var = w_bn * var_bn + w_in * var_in

    (Seo et al., Eq. 3-5).  mu_in, var_in: each sample's per-channel
    statistics over (H, W); mu_bn, var_bn: the batch's over (N, H, W) in
    training (biased variance, as BatchNorm normalises) and the running
    estimates at evaluation (updated like BatchNorm's, with the unbiased batch
    variance).  (w_bn, w_in) = softmax(logit_bn, logit_in): one pair per layer,
    shared by mean and variance (the paper's single mixture weight per layer
    and domain, kept in [0, 1]; a softmax instead of clipping, initialised
    equal as XAN's reference code).  In FL a domain is a client: the whole
    layer (gamma, beta, running statistics, mixture logits) is the
    domain-specific part (``methods/dson.py``)."""

    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.logit_bn = nn.Parameter(torch.ones(1))
        self.logit_in = nn.Parameter(torch.ones(1))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def weights(self) -> torch.Tensor:
        return torch.softmax(torch.cat([self.logit_bn, self.logit_in]), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu_in = x.mean((2, 3), keepdim=True)
        var_in = x.var((2, 3), unbiased=False, keepdim=True)
        if self.training:
            mu_bn = x.mean((0, 2, 3), keepdim=True)
            var_bn = x.var((0, 2, 3), unbiased=False, keepdim=True)
            with torch.no_grad():
                n = x.numel() / x.shape[1]
                self.running_mean.lerp_(mu_bn.flatten(), self.momentum)
                self.running_var.lerp_(var_bn.flatten() * n / max(n - 1, 1), self.momentum)
                self.num_batches_tracked += 1
        else:
            mu_bn = self.running_mean.view(1, -1, 1, 1)
            var_bn = self.running_var.view(1, -1, 1, 1)
        w = self.weights()
        mu = w[0] * mu_bn + w[1] * mu_in
        var = w[0] * var_bn + w[1] * var_in
        x_hat = (x - mu) / torch.sqrt(var + self.eps)
        return self.weight.view(1, -1, 1, 1) * x_hat + self.bias.view(1, -1, 1, 1)

    @classmethod
    def from_bn(cls, bn: nn.BatchNorm2d) -> DSON:
        """Starts from ``bn``'s affine parameters and running statistics."""
        m = cls(bn.num_features, bn.eps, bn.momentum if bn.momentum is not None else 0.1)
        with torch.no_grad():
            if bn.affine:
                m.weight.copy_(bn.weight)
                m.bias.copy_(bn.bias)
            if bn.running_mean is not None and bn.running_var is not None:
                m.running_mean.copy_(bn.running_mean)
                m.running_var.copy_(bn.running_var)
        return m


def _block_prefixes(model: nn.Module) -> list[str]:
    """Residual blocks (or conv-net units) in forward order."""
    body = getattr(model, "body", None)
    if hasattr(body, "residual_units"):  # a timm backbone
        return [f"body.{n}" for n in body.residual_units()]
    # a torchvision ResNet was built by torchvision, already imported; importing it only to learn that the
    # conv net has no residual blocks costs seconds (in the driver and in each worker)
    resnet = sys.modules.get("torchvision.models.resnet")
    kinds = (resnet.BasicBlock, resnet.Bottleneck) if resnet is not None else ()
    blocks = [n for n, m in model.named_modules() if kinds and isinstance(m, kinds)]
    if blocks:
        return blocks
    # the conv net: each BatchNorm is one unit
    return [n for n, _ in modules_of_type(model, BN_TYPES)]


def placement_names(model: nn.Module, placement: str) -> list[str]:
    """Qualified names of the BatchNorm2d layers that ``placement`` selects."""
    bns = [n for n, m in modules_of_type(model, (nn.BatchNorm2d,))]
    if placement == "all":
        return bns
    m = re.fullmatch(r"(first_bn:)?(blocks|stages):(\d+)", placement)
    if m:
        first_only, kind, k = bool(m.group(1)), m.group(2), int(m.group(3))
        if kind == "blocks":
            prefixes = _block_prefixes(model)
            if k > len(prefixes):
                raise ValueError(f"placement {placement}: the model has only {len(prefixes)} blocks")
            prefixes = prefixes[:k]
        elif hasattr(getattr(model, "body", None), "stage_modules"):  # a timm backbone
            prefixes = [f"body.{n}" for n in model.body.stage_modules(k)]
        else:
            if k > 4:
                raise ValueError(f"placement {placement}: a ResNet has 4 stages")
            prefixes = [n for n, _ in model.named_modules() if re.search(rf"(^|\.)layer[1-{k}]$", n)]
            if not prefixes:
                raise ValueError(f"placement {placement} needs a ResNet (layer1..layer4) or a timm CNN")
        out = [n for n in bns if any(n == p or n.startswith(p + ".") for p in prefixes)]
        if first_only:
            out = [n for n in out if n.endswith(".bn1")]
        return out
    if placement == "dense1":
        out = [n for n in bns if re.search(r"(^|\.)(denseblock1|transition1)(\.|$)", n)]
        if not out:
            raise ValueError("placement dense1 needs a DenseNet (features.denseblock1)")
        return out
    raise ValueError(f"unknown placement {placement!r}; use all, blocks:K, stages:K, dense1 or first_bn:stages:K")


def apply_norm(model: nn.Module, placement: str, kind: str, xan_bn_weight: float = 0.5) -> list[str]:
    """Replace the BatchNorm2d layers named by ``placement`` with ``kind``
    (``xan``, ``ibn`` or ``dson``), each initialised from the BN it replaces
    (a XAN with ``w_bn = xan_bn_weight``)."""
    names = set(placement_names(model, placement))
    if not names:
        raise ValueError(f"placement {placement} selects no BatchNorm layer of this backbone: {kind} replaces "
                         "BatchNorm layers")
    make = {"xan": lambda bn: XAN.from_bn(bn, xan_bn_weight), "ibn": IBN.from_bn, "dson": DSON.from_bn}[kind]
    return replace_norm(model, lambda n, old: make(old) if n in names else None, (nn.BatchNorm2d,))


def xan_output_by_hand(x: torch.Tensor, m: XAN, training: bool) -> torch.Tensor:
    """Eq. 2 written out with explicit statistics (tests compare the layer to it)."""
    eps = m.bn.eps
    mu_in = x.mean((2, 3), keepdim=True)
    var_in = x.var((2, 3), unbiased=False, keepdim=True)
    if training:
        mu_bn = x.mean((0, 2, 3), keepdim=True)
        var_bn = x.var((0, 2, 3), unbiased=False, keepdim=True)
    else:
        mu_bn = m.bn.running_mean.view(1, -1, 1, 1)
        var_bn = m.bn.running_var.view(1, -1, 1, 1)
    c = lambda t: t.view(1, -1, 1, 1)  # noqa: E731
    y_in = c(m.inorm.weight) * (x - mu_in) / torch.sqrt(var_in + eps) + c(m.inorm.bias)
    y_bn = c(m.bn.weight) * (x - mu_bn) / torch.sqrt(var_bn + eps) + c(m.bn.bias)
    w = F.softmax(torch.cat([m.logit_bn, m.logit_in]), 0)
    return w[1] * y_in + w[0] * y_bn
