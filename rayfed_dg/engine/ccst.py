"""CCST as the engine's one-off data stage before round 1.

Chen, Jiang, Dou, Chen, "Federated Domain Generalization for Image
Recognition via Cross-Client Style Transfer", WACV 2023 (Sec. 3.2,
Algorithm 1).  Composable with any method: it only changes each client's
training set.

1. Every source client computes its style (``overall``: one style of all its
   training images; ``single``: J styles of random single images) and
   uploads it; the target domain never contributes (it has no client).
2. The server concatenates the styles into the bank and broadcasts it once.
3. Algorithm 1: each client gives every training image K of the N source
   clients, drawn without replacement from all N (its own among the
   candidates).  Drawing its own client keeps the original image; any other
   client restyles the image with that client's style (with ``single``, one
   random style of that client's J).  The training set becomes K times the
   original size; the original is among an image's K versions with
   probability K / N (always when K = N).  Validation was split off before
   (the protocol splits each domain before partitioning), so no validation
   image or copy of one is ever trained on, unlike the reference code, which
   split after augmenting.
4. Stylized images are cached on disk.  With ``overall`` a style is a
   property of the client's image set (its style sample is seeded by the
   images, not by the run seed), and the cache holds the whole set restyled
   with one bank style, keyed by the backend, the style and the images: other
   seeds, other K and other targets that share the domain reuse it.  With
   ``single`` the cache is keyed by the run's choices.
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
OWN = -1  # in a choice table: the image's own client, i.e. the original image
CACHE_VERSION = "2"


def _cache_path(ccst_cfg) -> Path:
    return Path(ccst_cfg.cache_dir) if ccst_cfg.cache_dir else cache_dir() / "ccst"


def _digest(images: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(images).tobytes()).digest()


def client_style(backend, ccst_cfg, images: np.ndarray, seed: int, client_id: int) -> np.ndarray:
    if ccst_cfg.style == "overall":
        # seeded by the image set so a domain has one style whatever the run's seed or client numbering
        rng = np.random.default_rng(int.from_bytes(_digest(images)[:8], "little"))
    else:
        rng = numpy_rng(seed, CCST, 1, client_id)
    return backend.style_of(images, ccst_cfg.style, ccst_cfg.j, rng)


def choose_styles(n_images: int, own: int, owners: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n_images, k) choice table (Algorithm 1, line 3): K distinct clients
    per image drawn from all of them, each entry a bank row of the chosen
    client (one random style of its J) or ``OWN`` for the image's own client."""
    clients = sorted(set(int(o) for o in owners) | {own})
    if k > len(clients):
        raise ValueError(f"ccst.k={k} exceeds the {len(clients)} source clients whose styles are in the bank")
    rows_of = {c: np.flatnonzero(owners == c) for c in clients if c != own}
    out = np.empty((n_images, k), np.int64)
    for i in range(n_images):
        for jj, c in enumerate(rng.choice(len(clients), size=k, replace=False)):
            c = clients[c]
            out[i, jj] = OWN if c == own else rows_of[c][int(rng.integers(len(rows_of[c])))]
    return out


def _cached(path: Path, make):
    if path.is_file():
        with np.load(path) as z:
            return z["images"], True
    out = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, images=out)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return out, False


def augment_client(backend, ccst_cfg, images: np.ndarray, labels: np.ndarray, bank: np.ndarray,
                   owners: np.ndarray, seed: int, client_id: int) -> dict:
    """The client's augmented training set: ``keep`` marks the images whose
    original is one of their K versions (those stay in the base dataset);
    ``images`` / ``labels`` / ``source`` / ``style_row`` are the stylized
    versions, ``source`` indexing the client's image list."""
    t0 = time.perf_counter()
    n = len(images)
    choice = choose_styles(n, client_id, owners, ccst_cfg.k, numpy_rng(seed, CCST, 2, client_id))
    keep = (choice == OWN).any(1)
    source = np.repeat(np.arange(n), ccst_cfg.k)[choice.reshape(-1) != OWN]
    style_row = choice.reshape(-1)[choice.reshape(-1) != OWN]
    out = np.empty((len(source),) + images.shape[1:], np.uint8)
    img_digest = _digest(images)
    hits = misses = stylized = 0
    for r in np.unique(style_row):
        where = np.flatnonzero(style_row == r)
        h = hashlib.sha256()
        for part in (CACHE_VERSION, backend.fingerprint(), ccst_cfg.style):
            h.update(part.encode() + b"|")
        h.update(np.ascontiguousarray(bank[r], np.float32).tobytes())
        h.update(img_digest)
        if ccst_cfg.style == "overall":  # the whole set in this style, reusable by any run
            subset = None
        else:  # only the images this run sends to this style
            subset = source[where]
            h.update(np.ascontiguousarray(subset).tobytes())
        path = _cache_path(ccst_cfg) / f"{h.hexdigest()[:32]}.npz"
        todo = images if subset is None else images[subset]
        styled, hit = _cached(path, lambda: backend.stylize(todo, bank[r]))
        hits, misses = hits + hit, misses + (not hit)
        stylized += 0 if hit else len(todo)
        out[where] = styled[source[where]] if subset is None else styled
    return {"images": out, "labels": labels[source], "source": source, "style_row": style_row, "keep": keep,
            "cache": "hit" if misses == 0 else "miss", "cache_files": {"hits": hits, "misses": misses},
            "images_stylized": stylized, "seconds": time.perf_counter() - t0}
