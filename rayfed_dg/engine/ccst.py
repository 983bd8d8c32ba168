"""CCST as the engine's one-off data stage before round 1.

Chen, Jiang, Dou, Chen, "Federated Domain Generalization for Image
Recognition via Cross-Client Style Transfer", WACV 2023 (Sec. 3.2,
Algorithm 1).  Composable with any method: it only changes each client's
training set.

1. Every source client computes its style (``overall``: one style of all its
   training images; ``single``: J styles of random single images) and
   uploads it; the target domain never contributes (it has no client).
2. The server concatenates the styles into the bank and broadcasts it once.
3. Each client gives every training image K styles chosen without
   replacement from the clients' styles, its own among them: the own style
   keeps the original image, the K - 1 others are distinct other clients
   (with ``single``, one random style of that client's J).  The training set
   grows K-fold.  Validation was split off before (the protocol splits each
   domain before partitioning), so no validation image or copy of one is ever
   trained on, unlike the reference code, which split after augmenting.
4. Stylized images are cached on disk, keyed by the backend, the bank, the
   client's image list (its pixels) and K, so a second run does not stylize
   again.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np

from rayfed_dg.data.folders import cache_dir

from .seeding import numpy_rng

CCST = 11


def _cache_path(ccst_cfg) -> Path:
    return Path(ccst_cfg.cache_dir) if ccst_cfg.cache_dir else cache_dir() / "ccst"


def client_style(backend, ccst_cfg, images: np.ndarray, seed: int, client_id: int) -> np.ndarray:
    return backend.style_of(images, ccst_cfg.style, ccst_cfg.j, numpy_rng(seed, CCST, 1, client_id))


def choose_styles(n_images: int, own: int, owners: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n_images, k - 1) bank rows for each image: K - 1 distinct other clients,
    one random style of each (the own style, the original, is implicit)."""
    others = sorted(set(int(o) for o in owners) - {own})
    if k - 1 > len(others):
        raise ValueError(f"ccst.k={k} needs {k - 1} other clients' styles but only {len(others)} exist")
    rows_of = {o: np.flatnonzero(owners == o) for o in others}
    out = np.empty((n_images, k - 1), np.int64)
    for i in range(n_images):
        chosen = rng.choice(len(others), size=k - 1, replace=False) if k > 1 else []
        for jj, c in enumerate(chosen):
            rows = rows_of[others[c]]
            out[i, jj] = rows[int(rng.integers(len(rows)))]
    return out


def augment_client(backend, ccst_cfg, images: np.ndarray, labels: np.ndarray, bank: np.ndarray,
                   owners: np.ndarray, seed: int, client_id: int) -> dict:
    """The K - 1 stylized copies of each of the client's images (the originals
    stay in the base dataset), from the disk cache when possible."""
    t0 = time.perf_counter()
    k = ccst_cfg.k
    h = hashlib.sha256()
    for part in (backend.fingerprint(), ccst_cfg.style, str(k), str(ccst_cfg.j), str(seed), str(client_id)):
        h.update(part.encode() + b"|")
    h.update(np.ascontiguousarray(bank).tobytes())
    h.update(np.ascontiguousarray(owners).tobytes())
    h.update(hashlib.sha256(np.ascontiguousarray(images).tobytes()).digest())
    path = _cache_path(ccst_cfg) / f"{h.hexdigest()[:32]}.npz"
    n = len(images)
    if path.is_file():
        z = np.load(path)
        return {"images": z["images"], "labels": z["labels"], "source": z["source"], "style_row": z["style_row"],
                "cache": "hit", "seconds": time.perf_counter() - t0}
    rows = choose_styles(n, client_id, owners, k, numpy_rng(seed, CCST, 2, client_id))
    out = np.empty(((k - 1) * n,) + images.shape[1:], np.uint8)
    source = np.tile(np.arange(n), k - 1)
    style_row = rows.T.reshape(-1)  # copy-major: copy c of image i sits at c * n + i
    for r in np.unique(style_row):
        where = np.flatnonzero(style_row == r)
        out[where] = backend.stylize(images[source[where]], bank[r])
    lab = labels[source]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, images=out, labels=lab, source=source, style_row=style_row)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return {"images": out, "labels": lab, "source": source, "style_row": style_row, "cache": "miss",
            "seconds": time.perf_counter() - t0}
