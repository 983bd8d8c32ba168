"""Loaders for the standard folder layouts, with an on-disk decode cache.

Every loader lists files, checks the layout, then decodes and resizes each
image once to the run's resolution into a cache (NumPy ``.npy`` in
``$RAYFED_DG_CACHE`` or ``~/.cache/rayfed_dg``), keyed by the file list (paths,
sizes, modification times) and the resolution.  A second run memory-maps the
cache instead of decoding.  Layouts (``<root>`` is ``data.root``, a path
relative to the data root ``$RAYFED_DG_DATA`` unless absolute, see
``sources.py``; ``rayfed-dg data fetch NAME`` builds each of them):

* ``pacs``        ``<root>/{photo,art_painting,cartoon,sketch}/<class>/*``
* ``office_home`` ``<root>/{Art,Clipart,Product,Real World}/<class>/*``
  (``Real_World`` is accepted too)
* ``vlcs``        ``<root>/{Caltech101,LabelMe,SUN09,VOC2007}/<class>/*``
* ``domainnet``   ``<root>/{clipart,infograph,painting,quickdraw,real,sketch}/<class>/*``;
  ``data.top_classes: K`` keeps the K classes with most images overall
* ``terra_incognita`` ``<root>/{location_100,location_38,location_43,location_46}/<class>/*``
  (DomainBed's layout: ten classes, ``empty`` included)
* ``digits``      ``<root>/<domain>/<class>/*`` for any set of digit domains
  (e.g. mnist, mnist_m, usps), and the Digits-DG layout
  ``<root>/<domain>/{train,val}/<class>/*`` (both parts are pooled; the
  protocol makes its own split)
* ``digits_dg``   Digits-DG only: ``<root>/{mnist,mnist_m,svhn,syn}/{train,val}/<class>/*``
* ``camelyon17``  the WILDS v1.0 layout: ``<root>/metadata.csv`` (columns
  patient, node, x_coord, y_coord, tumor, center, ...) and
  ``<root>/patches/patient_<p>_node_<n>/patch_patient_<p>_node_<n>_x_<x>_y_<y>.png``;
  the hospital (``center`` 0-4) is the domain, ``tumor`` the label
* ``folder``      any ``<root>/<domain>/<class>/*`` tree

A missing or malformed root fails with one line naming the root, what was
expected and what was found.  A file that cannot be decoded fails with its
path, or with ``data.on_corrupt: skip`` is left out: every load says so in
one warning (how many, the first few paths and why), and a run lists every
one in its ``skipped_images.txt``.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rayfed_dg.utils import atomic_write_with, write_text

from .base import DataError, DomainDataset, register_dataset, subsample_indices


class SkippedImages(UserWarning):
    """Images left out under ``data.on_corrupt: skip``."""


IMAGE_EXT = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
CACHE_VERSION = 1


def cache_dir() -> Path:
    return Path(os.environ.get("RAYFED_DG_CACHE", Path.home() / ".cache" / "rayfed_dg"))


def _need_root(root: str | None, name: str, expected: str) -> Path:
    if not root:
        raise DataError(f"dataset {name} needs data.root: a folder laid out as {expected}")
    p = Path(root).expanduser()
    if not p.is_dir():
        from .sources import fetch_hint

        raise DataError(f"data.root {p} does not exist or is not a folder; expected {expected}{fetch_hint(name)}")
    return p


def _subdirs(p: Path) -> list[str]:
    return sorted(d.name for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))


def _images_in(p: Path) -> list[Path]:
    return sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_EXT and f.is_file())


def list_domain_class_tree(root: Path, domains: list[str], name: str, aliases: dict[str, str] | None = None):
    """Files of ``<root>/<domain>/<class>/*``; class names are the union over domains."""
    aliases = aliases or {}
    found = _subdirs(root)
    dirs = {}
    for d in domains:
        cands = [d] + [a for a, canon in aliases.items() if canon == d]
        hit = next((c for c in cands if (root / c).is_dir()), None)
        if hit is None:
            raise DataError(f"data.root {root} is not a {name} tree: expected domain folders "
                            f"{', '.join(domains)}; found {', '.join(found) or 'no folders'}")
        dirs[d] = root / hit
    classes = sorted({c for d in domains for c in _subdirs(dirs[d])})
    if not classes:
        raise DataError(f"data.root {root}: domain folders hold no class folders; expected {name} "
                        "<domain>/<class>/<images>")
    files: list[Path] = []
    labels: list[int] = []
    doms: list[int] = []
    for j, d in enumerate(domains):
        n_before = len(files)
        for ci, c in enumerate(classes):
            cdir = dirs[d] / c
            if not cdir.is_dir():
                continue
            for f in _images_in(cdir):
                files.append(f)
                labels.append(ci)
                doms.append(j)
        if len(files) == n_before:
            raise DataError(f"data.root {root}: domain folder {dirs[d]} holds no images "
                            f"({', '.join(sorted(IMAGE_EXT))})")
    return files, np.array(labels, np.int64), np.array(doms, np.int64), classes


def _decode_one(args) -> np.ndarray | str:
    path, res = args
    from PIL import Image

    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB").resize((res, res), Image.Resampling.BILINEAR), dtype=np.uint8)
    except Exception as e:  # noqa: BLE001  reported with its path by the caller
        return f"{type(e).__name__}: {e}"


def decode_cached(files: list[Path], resolution: int, on_corrupt: str = "fail",
                  progress: bool = True) -> tuple[np.ndarray, np.ndarray, dict]:
    """Decoded (N, R, R, 3) uint8 images and the kept-file mask, from the
    cache when its key matches, else decoded in parallel and cached."""
    import PIL

    # Pillow decodes and resizes: a cache another version filled would give other pixels under the same key
    h = hashlib.sha256(f"v{CACHE_VERSION}|{resolution}|{on_corrupt}|pillow {PIL.__version__}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    key = h.hexdigest()[:24]
    cdir = cache_dir()
    img_path, meta_path = cdir / f"{key}.npy", cdir / f"{key}.json"
    if img_path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        keep = np.array(meta["keep"], dtype=bool)
        return np.load(img_path, mmap_mode="r"), keep, {"cache": "hit", "path": str(img_path), **meta["info"]}
    out = np.zeros((len(files), resolution, resolution, 3), np.uint8)
    keep = np.ones(len(files), bool)
    bad: list[str] = []
    why = ""
    jobs = [(str(f), resolution) for f in files]
    workers = max(1, min(os.cpu_count() or 1, 8))
    it = None
    with ProcessPoolExecutor(workers) as pool:
        it = pool.map(_decode_one, jobs, chunksize=64)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, total=len(jobs), desc=f"decode {resolution}px", unit="img", leave=False,
                      disable=None)  # None: only on a terminal
        for i, r in enumerate(it):
            if isinstance(r, str):
                if on_corrupt == "fail":
                    raise DataError(f"cannot decode image {files[i]} ({r}); fix or remove it, "
                                    "or set data.on_corrupt: skip")
                keep[i] = False
                bad.append(str(files[i]))
                why = why or r
            else:
                out[i] = r
    out = out[keep]
    info = {"skipped_corrupt": len(bad), "skipped_files": bad, "skipped_why": why}
    cdir.mkdir(parents=True, exist_ok=True)
    atomic_write_with(img_path, lambda buf: np.save(buf, out))
    write_text(json.dumps({"keep": keep.tolist(), "info": info}), meta_path)  # last: it marks the entry complete
    return out, keep, {"cache": "miss", "path": str(img_path), **info}


@dataclass
class Listing:
    """The files of a dataset tree and what they are, before any decoding."""

    root: Path
    files: list[Path]
    labels: np.ndarray  # int64 index into class_names
    domains: np.ndarray  # int64 index into domain_names
    domain_names: list[str]
    class_names: list[str]

    def counts(self) -> dict[str, int]:
        return {d: int((self.domains == i).sum()) for i, d in enumerate(self.domain_names)}


_LISTERS: dict[str, Callable[[str | None], Listing]] = {}


def list_layout(name: str, root: str | Path | None) -> Listing:
    """List (and check) the tree of loader ``name`` without decoding anything:
    what ``data fetch`` runs on a freshly extracted tree."""
    return _LISTERS[name](None if root is None else str(root))


def _loader(name: str, default_resolution: int):
    """Register ``name`` as a dataset read by the lister ``fn(root) -> Listing``."""

    def deco(fn: Callable[[str | None], Listing]):
        _LISTERS[name] = fn

        def load(root=None, resolution=default_resolution, on_corrupt="fail", top_classes=None,
                 limit_per_domain=None, **_):
            return _decode(fn(root), resolution, on_corrupt, top_classes, limit_per_domain)

        load.__name__ = load.__qualname__ = name
        register_dataset(name)(load)
        return fn

    return deco


def _decode(lst: Listing, resolution: int, on_corrupt: str, top_classes: int | None,
            limit_per_domain: int | None) -> DomainDataset:
    files, labels, doms, classes = lst.files, lst.labels, lst.domains, lst.class_names
    if top_classes:
        counts = np.bincount(labels, minlength=len(classes))
        keep_c = sorted(np.argsort(-counts, kind="stable")[:top_classes])
        sel = np.isin(labels, keep_c)
        remap = {old: new for new, old in enumerate(keep_c)}
        files = [f for f, s in zip(files, sel) if s]
        labels = np.array([remap[int(x)] for x in labels[sel]], np.int64)
        doms = doms[sel]
        classes = [classes[c] for c in keep_c]
    if limit_per_domain:  # decode only what will be used
        sel = subsample_indices(labels, doms, limit_per_domain)
        files, labels, doms = [files[i] for i in sel], labels[sel], doms[sel]
    images, keep, info = decode_cached(files, resolution, on_corrupt)
    bad = info.get("skipped_files") or []
    if bad:
        import warnings

        first = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        why = f" ({info['skipped_why']})" if info.get("skipped_why") else ""
        warnings.warn(f"data.on_corrupt: skip: left out {len(bad)} of {len(files)} images under {lst.root} that "
                      f"cannot be decoded: {first}{why}; a run lists every one in its skipped_images.txt",
                      SkippedImages, stacklevel=2)
    return DomainDataset(images=np.asarray(images), labels=labels[keep], domains=doms[keep],
                         domain_names=list(lst.domain_names), class_names=classes,
                         meta={"root": str(lst.root), **info})


def _tree(name: str, root: Path, domains: list[str], aliases: dict[str, str] | None = None) -> Listing:
    files, labels, doms, classes = list_domain_class_tree(root, domains, name, aliases)
    return Listing(root, files, labels, doms, list(domains), classes)


PACS_DOMAINS = ["photo", "art_painting", "cartoon", "sketch"]


@_loader("pacs", 64)
def pacs(root):
    r = _need_root(root, "pacs", "<root>/{photo,art_painting,cartoon,sketch}/<class>/<images>")
    return _tree("PACS", r, PACS_DOMAINS)


@_loader("office_home", 64)
def office_home(root):
    r = _need_root(root, "office_home", "<root>/{Art,Clipart,Product,Real World}/<class>/<images>")
    return _tree("Office-Home", r, ["Art", "Clipart", "Product", "Real World"],
                 aliases={"Real_World": "Real World", "RealWorld": "Real World"})


@_loader("vlcs", 64)
def vlcs(root):
    r = _need_root(root, "vlcs", "<root>/{Caltech101,LabelMe,SUN09,VOC2007}/<class>/<images>")
    return _tree("VLCS", r, ["Caltech101", "LabelMe", "SUN09", "VOC2007"])


@_loader("domainnet", 64)
def domainnet(root):
    doms = ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
    r = _need_root(root, "domainnet", "<root>/{" + ",".join(doms) + "}/<class>/<images>")
    return _tree("DomainNet", r, doms)


TERRA_DOMAINS = ["location_100", "location_38", "location_43", "location_46"]


@_loader("terra_incognita", 64)
def terra_incognita(root):
    """DomainBed's layout: the four camera locations, ten classes (empty included)."""
    r = _need_root(root, "terra_incognita", "<root>/{" + ",".join(TERRA_DOMAINS) + "}/<class>/<images>")
    return _tree("TerraIncognita", r, TERRA_DOMAINS)


def _root_and_domains(root, name: str, example: str = "") -> tuple[Path, list[str]]:
    r = _need_root(root, name, f"<root>/<domain>/<class>/<images>{example}")
    doms = _subdirs(r)
    if not doms:
        raise DataError(f"data.root {r} holds no domain folders; expected <root>/<domain>/<class>/<images>")
    return r, doms


def _digits_tree(r: Path, doms: list[str]) -> Listing:
    # Digits-DG nests train/ and val/ inside each domain: pool both parts
    if not all(set(_subdirs(r / d)) >= {"train"} for d in doms):
        return _tree("digits", r, doms)
    files: list[Path] = []
    labels, dl = [], []
    classes: list[str] | None = None
    for j, d in enumerate(doms):
        for p in [p for p in ("train", "val") if (r / d / p).is_dir()]:
            f, lab, _, cls = list_domain_class_tree(r / d, [p], "Digits-DG")
            if classes is None:
                classes = cls
            elif cls != classes:
                raise DataError(f"data.root {r}: {d}/{p} has classes {cls}, expected {classes}")
            files += f
            labels.append(lab)
            dl.append(np.full(len(f), j, np.int64))
    return Listing(r, files, np.concatenate(labels), np.concatenate(dl), doms, classes or [])


@_loader("digits", 32)
def digits(root):
    r, doms = _root_and_domains(root, "digits", " (e.g. mnist, mnist_m, usps)")
    return _digits_tree(r, doms)


DIGITS_DG_DOMAINS = ["mnist", "mnist_m", "svhn", "syn"]


@_loader("digits_dg", 32)
def digits_dg(root):
    """Digits-DG as Dassl ships it: ``<root>/{mnist,mnist_m,svhn,syn}/{train,val}/<class>/*``."""
    expected = "<root>/{" + ",".join(DIGITS_DG_DOMAINS) + "}/{train,val}/<class>/<images>"
    r = _need_root(root, "digits_dg", expected)
    missing = [d for d in DIGITS_DG_DOMAINS if not (r / d / "train").is_dir()]
    if missing:
        raise DataError(f"data.root {r} is not a Digits-DG tree: expected {expected}; "
                        f"missing {', '.join(d + '/train' for d in missing)}")
    return _digits_tree(r, DIGITS_DG_DOMAINS)


@_loader("folder", 64)
def folder(root):
    r, doms = _root_and_domains(root, "folder")
    return _tree("folder", r, doms)


@_loader("camelyon17", 96)
def camelyon17(root):
    expected = "<root>/metadata.csv and <root>/patches/patient_<p>_node_<n>/<png>"
    r = _need_root(root, "camelyon17", expected)
    meta = r / "metadata.csv"
    if not meta.is_file():
        raise DataError(f"data.root {r} is not a Camelyon17 (WILDS) tree: expected {expected}; "
                        f"found {', '.join(p.name for p in sorted(r.iterdir())[:6]) or 'nothing'}")
    with open(meta, newline="") as f:
        rows = list(csv.DictReader(f))
    need = {"patient", "node", "x_coord", "y_coord", "tumor", "center"}
    if not rows or not need <= set(rows[0]):
        raise DataError(f"{meta}: expected columns {', '.join(sorted(need))}; "
                        f"found {', '.join(rows[0]) if rows else 'no rows'}")
    files, labels, centers = [], [], []
    for row in rows:
        p, n = int(float(row["patient"])), int(float(row["node"]))
        x, y = int(float(row["x_coord"])), int(float(row["y_coord"]))
        f = r / "patches" / f"patient_{p:03d}_node_{n}" / f"patch_patient_{p:03d}_node_{n}_x_{x}_y_{y}.png"
        if not f.is_file():
            raise DataError(f"{meta} lists a patch that is missing: {f}")
        files.append(f)
        labels.append(int(float(row["tumor"])))
        centers.append(int(float(row["center"])))
    present = sorted(set(centers))
    remap = {c: i for i, c in enumerate(present)}
    return Listing(r, files, np.array(labels, np.int64), np.array([remap[c] for c in centers], np.int64),
                   [f"hospital{c + 1}" for c in present], ["normal", "tumor"])
