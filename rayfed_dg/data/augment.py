"""Training-time augmentation of a batch, on tensors on the worker's device.

``augment(x, mode, generator, size)`` takes a float batch (N, 3, D, D) in
[0, 1] (the decoded images, D = ``data.decode_size``) and returns (N, 3,
size, size).  Every random number is drawn, in a fixed order and count per
batch, from the client's ``torch.Generator`` (on the CPU) and only then moved
to the device, so a client's batches are the same on any worker, device or
retry; nothing touches the global RNG.  Without a generator (evaluation) the
batch is only resized to ``size``.

Modes (``data.augment``):

* ``none``
* ``flip``: horizontal flip with probability 1/2;
* ``flip_jitter``: flip, then one brightness scale in [0.8, 1.2] and shift in
  [-0.1, 0.1] per image;
* ``domainbed``: DomainBed's training transform (``domainbed/datasets.py``):
  ``RandomResizedCrop(size, scale=(0.7, 1.0))`` (aspect ratio in [3/4, 4/3],
  torchvision's ten attempts then its centre fallback), horizontal flip,
  ``ColorJitter(0.3, 0.3, 0.3, 0.3)`` (brightness, contrast and saturation
  factors in [0.7, 1.3], hue shift in [-0.3, 0.3], the four applied in a
  random order per image, with torchvision's formulas) and
  ``RandomGrayscale(p=0.1)``.  Where we differ: the crop is resized with
  bilinear interpolation without antialiasing (``F.interpolate``'s
  ``align_corners=False`` sampling; the crop is 0.84-1.14x the output side
  with the 8/7 decode size, so there is little to alias), and the colour
  operations run on float tensors rather than on 8-bit PIL images (no
  rounding between them).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MODES = ("none", "flip", "flip_jitter", "domainbed")
GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # ITU-R 601-2 luma, as torchvision's rgb_to_grayscale
CROP_SCALE = (0.7, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
JITTER = 0.3
GRAYSCALE_P = 0.1
CROP_ATTEMPTS = 10


# ------------------------------------------------------------------ colour ops
# each takes (n, 3, H, W) in [0, 1] and a per-image factor of shape (n,)

def grayscale(x: torch.Tensor) -> torch.Tensor:
    """(n, 1, H, W) luma."""
    r, g, b = GRAY_WEIGHTS
    return (r * x[:, 0] + g * x[:, 1] + b * x[:, 2]).unsqueeze(1)


def _blend(a: torch.Tensor, b: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    f = f.view(-1, 1, 1, 1)
    return (f * a + (1 - f) * b).clamp(0, 1)


def adjust_brightness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return _blend(x, torch.zeros_like(x), f)


def adjust_contrast(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return _blend(x, grayscale(x).mean(dim=(1, 2, 3), keepdim=True), f)


def adjust_saturation(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return _blend(x, grayscale(x), f)


def rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(1)
    maxc, _ = x.max(1)
    minc, _ = x.min(1)
    same = maxc == minc
    span = maxc - minc
    s = span / torch.where(same, torch.ones_like(maxc), maxc)
    div = torch.where(same, torch.ones_like(span), span)
    rc, gc, bc = (maxc - r) / div, (maxc - g) / div, (maxc - b) / div
    is_r = maxc == r
    is_g = (maxc == g) & ~is_r
    is_b = ~is_r & ~is_g
    h = is_r * (bc - gc) + is_g * (2.0 + rc - bc) + is_b * (4.0 + gc - rc)
    h = torch.fmod(h / 6.0 + 1.0, 1.0)
    return torch.stack((h, s, maxc), 1)


def hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    """The closed form of the six-sector formula: channel ``n`` (5 for red, 3
    green, 1 blue) is ``v - v s clamp(min(k, 4 - k), 0, 1)`` with ``k = (n + 6h) mod 6``."""
    h, s, v = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    n = torch.tensor([5.0, 3.0, 1.0], device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    k = torch.remainder(n + 6.0 * h, 6.0)
    return (v - v * s * torch.minimum(k, 4.0 - k).clamp(0, 1)).clamp(0, 1)


def adjust_hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate the hue by ``shift`` (a fraction of the circle, in [-0.5, 0.5])."""
    hsv = rgb_to_hsv(x)
    h = torch.remainder(hsv[:, 0] + shift.view(-1, 1, 1), 1.0)
    return hsv_to_rgb(torch.stack((h, hsv[:, 1], hsv[:, 2]), 1))


COLOUR_OPS = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)


# ---------------------------------------------------------------------- crop

def crop_boxes(n: int, height: int, width: int, gen: torch.Generator, scale=CROP_SCALE,
               ratio=CROP_RATIO) -> torch.Tensor:
    """(n, 4) int64 boxes (top, left, h, w) as torchvision's
    ``RandomResizedCrop.get_params``: up to ten draws of an area fraction in
    ``scale`` and a log-uniform aspect ratio in ``ratio``, the first that fits
    wins, else the centred crop of the whole image (clamped to ``ratio``).
    Always draws ``n * 10 * 4`` numbers."""
    u = torch.rand(n, CROP_ATTEMPTS, 4, generator=gen, dtype=torch.float64)
    area = height * width * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    log_r = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[..., 1]
    aspect = torch.exp(log_r)
    w = torch.round(torch.sqrt(area * aspect))
    h = torch.round(torch.sqrt(area / aspect))
    ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    top = torch.floor(u[..., 2] * (height - h + 1))
    left = torch.floor(u[..., 3] * (width - w + 1))
    first = torch.argmax(ok.to(torch.int64), 1)  # first attempt that fits (0 if none)
    pick = lambda t: t.gather(1, first[:, None])[:, 0]  # noqa: E731
    # fallback: the whole image, its aspect ratio clamped into `ratio`, centred
    in_ratio = width / height
    if in_ratio < ratio[0]:
        fw, fh = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        fw, fh = round(height * ratio[1]), height
    else:
        fw, fh = width, height
    fb = torch.tensor([(height - fh) // 2, (width - fw) // 2, fh, fw], dtype=torch.float64)
    boxes = torch.stack((pick(top), pick(left), pick(h), pick(w)), 1)
    boxes = torch.where(ok.any(1, keepdim=True), boxes, fb)
    return boxes.to(torch.int64)


def resized_crop(x: torch.Tensor, boxes: torch.Tensor, size: int) -> torch.Tensor:
    """Crop each image to its box and resize it to ``size`` x ``size`` in one
    batched ``grid_sample``: the same values as ``F.interpolate(crop, size,
    mode="bilinear", align_corners=False)`` on each crop (source coordinates
    clamped to the crop, as interpolate does)."""
    n, _, H, W = x.shape
    b = boxes.to(x.device, torch.float32)
    top, left, h, w = b[:, 0:1], b[:, 1:2], b[:, 2:3], b[:, 3:4]
    u = torch.arange(size, device=x.device, dtype=torch.float32)[None]  # (1, S)
    src_x = left + torch.minimum(((u + 0.5) * w / size - 0.5).clamp(min=0), w - 1)
    src_y = top + torch.minimum(((u + 0.5) * h / size - 0.5).clamp(min=0), h - 1)
    gx = 2 * src_x / max(W - 1, 1) - 1  # align_corners=True normalisation of pixel centres
    gy = 2 * src_y / max(H - 1, 1) - 1
    grid = torch.stack((gx[:, None, :].expand(n, size, size), gy[:, :, None].expand(n, size, size)), -1)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=True)


def resize(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


# -------------------------------------------------------------------- modes

def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=gen)


def domainbed(x: torch.Tensor, gen: torch.Generator, size: int) -> torch.Tensor:
    n, dev = len(x), x.device
    x = resized_crop(x, crop_boxes(n, x.shape[-2], x.shape[-1], gen), size)
    flip = (_rand(gen, n) < 0.5).to(dev)
    x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
    lo, hi = 1 - JITTER, 1 + JITTER
    factors = [lo + (hi - lo) * _rand(gen, n) for _ in range(3)] + [JITTER * (2 * _rand(gen, n) - 1)]
    order = torch.argsort(_rand(gen, n, 4), 1)  # a random permutation of the four ops per image
    factors = [f.to(dev) for f in factors]
    for k in range(4):
        for op, fn in enumerate(COLOUR_OPS):
            sel = (order[:, k] == op).nonzero()[:, 0].to(dev)
            if len(sel):
                x = x.index_copy(0, sel, fn(x.index_select(0, sel), factors[op].index_select(0, sel)))
    gray = (_rand(gen, n) < GRAYSCALE_P).to(dev)
    return torch.where(gray.view(-1, 1, 1, 1), grayscale(x).expand_as(x), x)


def augment(x: torch.Tensor, mode: str, gen: torch.Generator | None, size: int) -> torch.Tensor:
    """The batch as the model sees it (before normalisation)."""
    if gen is None or mode == "none":
        return resize(x, size)
    if mode == "domainbed":
        return domainbed(x, gen, size)
    n, dev = len(x), x.device
    flip = (torch.rand(n, generator=gen) < 0.5).to(dev)
    x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
    if mode == "flip_jitter":
        scale = 1 + 0.4 * (torch.rand(n, 1, 1, 1, generator=gen) - 0.5)
        shift = 0.2 * (torch.rand(n, 1, 1, 1, generator=gen) - 0.5)
        x = (x * scale.to(dev) + shift.to(dev)).clamp_(0, 1)
    if mode not in MODES:
        raise ValueError(f"unknown data.augment {mode!r}")
    return resize(x, size)
