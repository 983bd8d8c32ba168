"""TerraIncognita's layout, built from LILA's Caltech Camera Traps files.

DomainBed's TerraIncognita is four camera locations (38, 43, 46, 100) of the
Caltech Camera Traps images, each image filed under every one of the ten
classes its annotations name (bird, bobcat, cat, coyote, dog, empty, opossum,
rabbit, raccoon, squirrel; other classes are left out):
``<out>/location_<L>/<class>/<file>``.  The images come from
``eccv_18_all_images_sm/`` and the annotations from the COCO-style CCT file
(``images`` with ``location``, ``annotations``, ``categories``).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .base import DataError

LOCATIONS = ("38", "43", "46", "100")
CLASSES = ("bird", "bobcat", "cat", "coyote", "dog", "empty", "opossum", "rabbit", "raccoon", "squirrel")
IMAGES_DIR = "eccv_18_all_images_sm"


def _find(root: Path, want, what: str) -> Path:
    hits = sorted(p for p in root.rglob("*") if want(p))
    if not hits:
        raise DataError(f"the TerraIncognita archives hold no {what} (looked in {root})")
    return hits[0]


def _annotations(path: Path) -> dict:
    with open(path) as f:
        data = json.load(f)
    if not all(k in data for k in ("images", "annotations", "categories")):
        raise DataError(f"{path}: expected a COCO Camera Traps file (images, annotations, categories)")
    return data


def arrange_terra_incognita(extracted: Path, out: Path) -> dict[str, int]:
    """Build ``out`` from the extracted archives; returns images per location.
    Files are hard-linked when possible (same file system), else copied."""
    images = _find(extracted, lambda p: p.is_dir() and p.name == IMAGES_DIR, f"{IMAGES_DIR}/ folder")
    ann = _find(extracted, lambda p: p.is_file() and p.suffix == ".json" and p.name.startswith("caltech"),
                "Caltech Camera Traps .json annotation file")
    data = _annotations(ann)
    names = {c["id"]: c["name"] for c in data["categories"]}
    cats: dict[object, set[str]] = {}
    for a in data["annotations"]:
        name = names.get(a["category_id"])
        if name in CLASSES:
            cats.setdefault(a["image_id"], set()).add(name)
    counts = {f"location_{loc}": 0 for loc in LOCATIONS}
    missing: list[str] = []
    base = images.resolve()
    for im in data["images"]:
        loc = str(im.get("location"))
        if loc not in LOCATIONS or im["id"] not in cats:
            continue
        src = (images / im["file_name"]).resolve()
        if base not in src.parents:  # a file name that climbs out of the image folder
            raise DataError(f"{ann}: image file name {im['file_name']!r} points outside {images}")
        if not src.is_file():
            missing.append(im["file_name"])
            continue
        for c in sorted(cats[im["id"]]):
            dst = out / f"location_{loc}" / c / src.name
            if dst.exists():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
        counts[f"location_{loc}"] += 1
    if missing:
        raise DataError(f"{ann} lists {len(missing)} image(s) of locations {', '.join(LOCATIONS)} that "
                        f"{images} does not hold (e.g. {missing[0]})")
    return counts
