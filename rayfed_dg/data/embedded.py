"""Embedded default data: four visual domains of scikit-learn's digits.

Built deterministically (no download, no ``../shared``) from the 1,797 8x8
handwritten digits that ship inside scikit-learn.  The digits are split,
stratified by class with a fixed seed, into four disjoint subsets, one per
domain, so no handwritten sample appears in two domains and the held-out
domain is genuinely unseen.  Each subset is upsampled bilinearly to the
configured resolution and rendered as:

``mono``      grey-level white strokes on black (the original look).
``negative``  inverted: dark strokes on a white background.
``colour``    strokes in a saturated colour drawn per image, on a dark
              background of the opposite hue.
``texture``   bold strokes (3x3 max-filter dilation at 32 px, scaled with the
              resolution) over a random sinusoidal stripe texture whose
              angle, frequency and tint are drawn per image.

Domain differences are thus colour, polarity, background texture and stroke
width, the kinds of shift the Digits-DG and PACS benchmarks exhibit.
"""
from __future__ import annotations

import colorsys

import numpy as np
import torch
import torch.nn.functional as F

from .base import DomainDataset, register_dataset

DOMAINS = ["mono", "negative", "colour", "texture"]
_SEED = 20240521


def _stratified_quarters(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Assign each sample to one of 4 domains, balanced within every class."""
    out = np.empty(len(labels), dtype=np.int64)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        out[idx] = np.arange(len(idx)) % 4
    return out


def _hue_rgb(h: float, s: float, v: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v), dtype=np.float32)


@register_dataset("embedded_digits")
def embedded_digits(root: str | None = None, resolution: int = 32, **_) -> DomainDataset:
    from sklearn.datasets import load_digits

    raw = load_digits()
    x = torch.from_numpy(raw.images.astype(np.float32) / 16.0)[:, None]  # (N,1,8,8) in [0,1]
    labels = raw.target.astype(np.int64)
    rng = np.random.default_rng(_SEED)
    dom = _stratified_quarters(labels, rng)

    # 1-pixel border so strokes do not touch the edge after upsampling
    x = F.pad(x, (1, 1, 1, 1))
    ink = F.interpolate(x, size=(resolution, resolution), mode="bilinear", align_corners=False)
    ink = ink.clamp(0, 1)[:, 0].numpy()  # (N,H,W)
    k = max(3, 2 * round(resolution / 32) + 1)
    bold = F.max_pool2d(torch.from_numpy(ink)[:, None], k, stride=1, padding=k // 2)[:, 0].numpy()

    n, h, w = ink.shape
    out = np.zeros((n, h, w, 3), dtype=np.float32)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) / max(h, w)
    for i in range(n):
        d = dom[i]
        if d == 0:
            img = np.repeat(ink[i][..., None], 3, axis=2)
        elif d == 1:
            img = 1.0 - np.repeat(ink[i][..., None], 3, axis=2)
        elif d == 2:
            hue = rng.random()
            fg, bg = _hue_rgb(hue, 0.9, 1.0), _hue_rgb(hue + 0.5, 0.7, 0.35)
            a = ink[i][..., None]
            img = a * fg + (1 - a) * bg
        else:
            theta, freq = rng.random() * np.pi, 4 + 8 * rng.random()
            stripes = 0.5 + 0.5 * np.sin(2 * np.pi * freq * (np.cos(theta) * xx + np.sin(theta) * yy))
            tint = _hue_rgb(rng.random(), 0.5, 0.8)
            bg = 0.55 * stripes[..., None] * tint
            a = bold[i][..., None]
            img = a * np.ones(3, dtype=np.float32) + (1 - a) * bg
        out[i] = img
    images = np.clip(np.round(out * 255), 0, 255).astype(np.uint8)
    return DomainDataset(
        images=images,
        labels=labels,
        domains=dom,
        domain_names=list(DOMAINS),
        class_names=[str(c) for c in range(10)],
        meta={"source": "sklearn.datasets.load_digits", "seed": _SEED},
    )
