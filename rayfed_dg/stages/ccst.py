"""CCST: cross-client style transfer, as a data stage before round 1.

Chen, Jiang, Dou, Chen, "Federated Domain Generalization for Image
Recognition via Cross-Client Style Transfer", WACV 2023 (Sec. 3.2,
Algorithm 1).  Composable with any method: it only changes each client's
training set.

1. Every source client computes its style (``overall``: one style of all its
   training images; ``single``: J styles of random single images, by default
   J = ceil(|D_i| / 32), the paper's one style per batch of 32 images) and
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
4. Stylized images are cached on disk, a file per client image set and bank
   style (keyed by the backend, the style kind, the style vector and the
   images), holding the set's images restyled in that style so far.  A run
   stylizes only the copies it needs that are not there yet: K - 1 or K per
   image, where restyling the whole set in every bank style it uses would
   cost up to N / K times more (N clients).  An image is restyled on its
   own (the backends' contract), so a copy is the same made alone or with
   others, and other seeds, other K and other targets whose clients hold the
   same images reuse it (with ``overall`` a style is a property of the
   client's image set: its style sample is seeded by the images, not by the
   run seed).

Backends (``models/styletransfer.py``): ``adain`` (the paper's; VGG-19 and
decoder weight files) and ``ghiasi`` (offline ONNX networks, no download).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.data.folders import cache_dir
from rayfed_dg.errors import ConfigError, EngineError
from rayfed_dg.seeding import Stream, numpy_rng
from rayfed_dg.utils import atomic_write_with

from .base import Stage, StageClient, StageServer, gather_bank, register_stage

OWN = -1  # in a choice table: the image's own client, i.e. the original image
CACHE_VERSION = "3"  # 3: each image stylized on its own canvas
SINGLE_BATCH = 32  # the paper's single-image bank: one style per batch of 32 images


class CCSTParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: Literal["ghiasi", "adain"] = "ghiasi"  # adain: the paper's (weight files); ghiasi: offline ONNX
    style: Literal["overall", "single"] = "overall"  # one style of all a client's images, or J single-image ones
    k: int = Field(2, ge=1)  # augmentation level K: versions per image, K distinct clients' styles (<= clients)
    j: int | None = Field(None, ge=1)  # single-image styles per client; None: ceil(|D_i| / 32)
    adain_vgg: str | None = None  # vgg_normalised.pth (pytorch-AdaIN)
    adain_decoder: str | None = None  # decoder.pth (pytorch-AdaIN)
    max_style_images: int = Field(256, ge=1)  # ghiasi overall style: images averaged
    work_size: int = Field(100, ge=16, le=376)  # ghiasi: pixels an image is stylized at
    cache_dir: str | None = None  # stylized images (default: $RAYFED_DG_CACHE/ccst)


def styles_per_client(p: CCSTParams, n_images: int) -> int:
    return p.j if p.j is not None else max(1, math.ceil(n_images / SINGLE_BATCH))


def _cache_path(p: CCSTParams) -> Path:
    return Path(p.cache_dir) if p.cache_dir else cache_dir() / "ccst"


def _digest(images: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(images).tobytes()).digest()


def client_style(backend, p: CCSTParams, images: np.ndarray, seed: int, client_id: int) -> np.ndarray:
    if p.style == "overall":
        # seeded by the image set so a domain has one style whatever the run's seed or client numbering
        rng = np.random.default_rng(int.from_bytes(_digest(images)[:8], "little"))
    else:
        rng = numpy_rng(seed, Stream.STAGE, 1, client_id)
    return backend.style_of(images, p.style, styles_per_client(p, len(images)), rng)


def choose_styles(n_images: int, own: int, owners: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n_images, k) choice table (Algorithm 1, line 3): K distinct clients
    per image drawn from all of them, each entry a bank row of the chosen
    client (one random style of its J) or ``OWN`` for the image's own client."""
    clients = sorted(set(int(o) for o in owners) | {own})
    if k > len(clients):
        raise ValueError(f"k={k} exceeds the {len(clients)} source clients whose styles are in the bank")
    rows_of = {c: np.flatnonzero(owners == c) for c in clients if c != own}
    out = np.empty((n_images, k), np.int64)
    for i in range(n_images):
        for jj, c in enumerate(rng.choice(len(clients), size=k, replace=False)):
            c = clients[c]
            out[i, jj] = OWN if c == own else rows_of[c][int(rng.integers(len(rows_of[c])))]
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One writer at a time for ``path``: the concurrent federations of a run,
    and other runs, share cache files (a domain's client has one image set
    whatever the target).  An advisory lock on one of 256 lock files, chosen
    by the file's name, so that other files are filled in meanwhile."""
    import fcntl

    lock = path.parent / ".locks" / f"{path.name[:2]}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_cached(path: Path, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
    """(index, images) of a cache file; nothing where there is no file or a damaged one (made again)."""
    try:
        with np.load(path) as z:
            images = z["images"]
            # a file without an index holds the whole set (as the cache wrote it before files were filled in part)
            index = z["index"] if "index" in z.files else np.arange(len(images))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # OSError: no file too
        return np.empty(0, np.int64), None
    if len(index) != len(images) or images.shape[1:] != shape or np.any(np.diff(index) <= 0):
        return np.empty(0, np.int64), None
    return index, images


def _cached_subset(path: Path, need: np.ndarray, shape: tuple[int, ...], make) -> tuple[np.ndarray, int]:
    """The images ``need`` (sorted indices into the client's set, each of
    ``shape``) in one style: those the cache file holds read from it, the
    rest made now (``make(indices)``) and added to it; (images in ``need``'s
    order, number made)."""
    with _locked(path):  # _locked makes the folder
        index, images = _read_cached(path, shape)
        missing = np.setdiff1d(need, index)
        if len(missing):
            made = make(missing)
            index = np.concatenate([index, missing])
            images = made if images is None else np.concatenate([images, made])
            order = np.argsort(index, kind="stable")
            index, images = index[order], images[order]
            atomic_write_with(path, lambda buf: np.savez(buf, index=index, images=images))
    assert images is not None
    return images[np.searchsorted(index, need)], len(missing)


def augment_client(backend, p: CCSTParams, images: np.ndarray, labels: np.ndarray, bank: np.ndarray,
                   owners: np.ndarray, seed: int, client_id: int) -> dict:
    """The client's augmented training set: ``keep`` marks the images whose
    original is one of their K versions (those stay in the base dataset);
    ``images`` / ``labels`` / ``source`` / ``style_row`` are the stylized
    versions, ``source`` indexing the client's image list."""
    t0 = time.perf_counter()
    n = len(images)
    choice = choose_styles(n, client_id, owners, p.k, numpy_rng(seed, Stream.STAGE, 2, client_id))
    keep = (choice == OWN).any(1)
    source = np.repeat(np.arange(n), p.k)[choice.reshape(-1) != OWN]
    style_row = choice.reshape(-1)[choice.reshape(-1) != OWN]
    out = np.empty((len(source),) + images.shape[1:], np.uint8)
    img_digest = _digest(images)
    hits = misses = stylized = 0
    for r in np.unique(style_row):
        where = np.flatnonzero(style_row == r)
        h = hashlib.sha256()
        for part in (CACHE_VERSION, backend.fingerprint(), p.style):
            h.update(part.encode() + b"|")
        h.update(np.ascontiguousarray(bank[r], np.float32).tobytes())
        h.update(img_digest)
        need = np.unique(source[where])
        styled, made = _cached_subset(_cache_path(p) / f"{h.hexdigest()[:32]}.npz", need, images.shape[1:],
                                      lambda idx: backend.stylize(images[idx], bank[r]))
        hits, misses = hits + (made == 0), misses + (made > 0)
        stylized += made
        out[where] = styled[np.searchsorted(need, source[where])]
    return {"images": out, "labels": labels[source], "source": source, "style_row": style_row, "keep": keep,
            "cache": "hit" if misses == 0 else "miss", "cache_files": {"hits": hits, "misses": misses},
            "images_stylized": stylized, "seconds": time.perf_counter() - t0}


@register_stage
class CCST(Stage):
    name = "ccst"
    Params = CCSTParams
    shared_payloads = {"ccst_style": "client"}  # overall: one style of the client's images (up to 256)

    def __init__(self, params: CCSTParams):
        super().__init__(params)
        self._backend: Any = None
        if params.style == "single":  # J rows, each the style of one distinct image
            self.shared_payloads = {"ccst_style": "image"}

    def check_clients(self, num_clients: int) -> None:
        if self.p.k > num_clients:
            raise ConfigError(f"stages.ccst.k={self.p.k} exceeds the {num_clients} source clients: each image "
                              f"takes K distinct clients' styles (Algorithm 1); set stages.ccst.k <= {num_clients}")

    def preflight(self) -> None:
        from rayfed_dg.models.styletransfer import make_backend

        make_backend(self.p)  # weights files / optional extra present

    # ------------------------------------------------------------ client half
    def backend(self, client: StageClient):
        if self._backend is None:
            from rayfed_dg.models.styletransfer import make_backend

            self._backend = make_backend(self.p, str(client.device), threads=client.threads)
        return self._backend

    def client_style(self, client: StageClient, client_id: int, indices: np.ndarray) -> np.ndarray:
        return np.asarray(client_style(self.backend(client), self.p, client.images[indices], client.seed, client_id),
                          np.float32)

    def client_augment(self, client: StageClient, client_id: int, indices: np.ndarray, bank: np.ndarray,
                       owners: np.ndarray) -> dict:
        return augment_client(self.backend(client), self.p, client.images[indices], client.labels[indices], bank,
                              owners, client.seed, client_id)

    # ------------------------------------------------------------ server half
    def run(self, server: StageServer) -> dict:
        t0 = time.perf_counter()
        n = server.num_clients
        self.check_clients(n)
        styles, bank, owners = gather_bank(server, self.client_style, "ccst_style")
        t_style = time.perf_counter() - t0
        info: dict[str, Any] = {"hits": 0, "misses": 0, "images_stylized": 0, "originals_kept": 0,
                                "stylized_copies": 0}
        augmented = server.map(self.client_augment, {c: {"bank": bank, "owners": owners} for c in range(n)})
        for cid in range(n):
            res = augmented[cid]
            info["hits" if res["cache"] == "hit" else "misses"] += 1
            info["images_stylized"] += res["images_stylized"]
            info["originals_kept"] += int(res["keep"].sum())
            info["stylized_copies"] += len(res["labels"])
            server.set_training_set(cid, server.training_set(cid)[res["keep"]], res["images"], res["labels"])
        for i in range(n):
            server.ledger(i, "up", "payload:ccst_style", int(styles[i].nbytes))
            server.ledger(i, "down", "payload:ccst_bank", int(bank.nbytes))
        if not len(bank):
            raise EngineError("CCST: the style bank is empty")
        info.update(seconds_style=t_style, seconds_total=time.perf_counter() - t0, bank_shape=list(bank.shape))
        return info
