"""Where the public datasets live: the data root and each dataset's sources.

**The data root.**  Configs name a dataset folder relative to the data root,
``$RAYFED_DG_DATA`` (default ``~/data``): ``data.root: PACS`` reads
``$RAYFED_DG_DATA/PACS``; an absolute path (or one starting with ``~``) is
kept as it is.  A dataset that ``rayfed-dg data fetch`` knows needs no
``data.root`` at all: it defaults to the folder the fetch writes
(``pacs`` -> ``$RAYFED_DG_DATA/PACS``).

**Sources.**  The URLs are the ones DomainBed's ``domainbed/scripts/download.py``
(PACS, Office-Home, VLCS, DomainNet, TerraIncognita), Dassl's Digits-DG
loader and WILDS' ``Camelyon17Dataset`` download from.  SHA-256 checksums
are given where public material establishes them (DomainNet: TensorFlow
Datasets' ``domainnet/checksums.tsv``); the others are published without one
(Google Drive files, LILA and CodaLab bundles), so their archive is checked
by size where the publisher states it (WILDS' ``compressed_size``) and, for
all, by structure: the extracted tree must pass the listing of the loader
that reads it (``folders.list_layout``) before it is moved into place.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rayfed_dg.utils import Registry

from .base import DataError

DATA_ENV = "RAYFED_DG_DATA"


def data_root() -> Path:
    """``$RAYFED_DG_DATA``, default ``~/data``."""
    return Path(os.environ.get(DATA_ENV) or Path.home() / "data").expanduser()


def resolve_root(name: str, root: str | None) -> str | None:
    """``data.root`` of loader ``name`` as a path: relative to the data root
    unless absolute (``~`` expanded); when unset, the folder ``data fetch``
    writes for that loader (None for a loader no source feeds, e.g. embedded)."""
    if root is None:
        src = source_for_loader(name)
        return None if src is None else str(data_root() / src.folder)
    p = Path(root).expanduser()
    return str(p if p.is_absolute() else data_root() / p)


@dataclass(frozen=True)
class Archive:
    """One file to download.  ``sha256`` / ``size`` are None when no public
    source states them (never guessed); ``mirrors`` are tried in order when
    ``url`` cannot be reached."""

    url: str
    filename: str
    sha256: str | None = None
    size: int | None = None
    mirrors: tuple[str, ...] = ()


@dataclass(frozen=True)
class Source:
    """A dataset ``rayfed-dg data fetch NAME`` can install: its archives, the
    folder under the data root, the loader (``data.name``) that reads it, and
    the entries that mark the top of its layout inside the extracted tree
    (found at any depth up to 3, e.g. PACS.zip's ``kfold/``).  ``arrange``
    builds the layout itself when the archives do not contain it
    (TerraIncognita: images sorted into location/class folders from the
    annotation file)."""

    name: str
    loader: str
    folder: str
    archives: tuple[Archive, ...]
    marker: tuple[str, ...]
    origin: str  # who publishes these URLs (shown by `data list`)
    arrange: Callable[[Path, Path], None] | None = None


_SOURCES: Registry[Source] = Registry("dataset source", DataError)


def register_source(src: Source) -> Source:
    return _SOURCES.add(src.name, src)


def get_source(name: str) -> Source:
    return _SOURCES.get(name)


def source_names() -> list[str]:
    return _SOURCES.names()


def source_for_loader(loader: str) -> Source | None:
    return next((get_source(n) for n in source_names() if get_source(n).loader == loader), None)


def fetch_hint(loader: str) -> str:
    """The clause a missing-folder error ends with: how to get the data."""
    src = source_for_loader(loader)
    if src is None:
        return ""
    return (f"; fetch it with `rayfed-dg data fetch {src.name}` (writes {data_root() / src.folder}; "
            f"${DATA_ENV} sets the data root)")


def _drive(file_id: str) -> str:
    # the direct-download endpoint of a public Google Drive file (the one gdown ends at for large
    # files, past the virus-scan page); DomainBed links the same ids as drive.google.com/uc?id=ID
    return f"https://drive.usercontent.google.com/download?id={file_id}&export=download&confirm=t"


# DomainBed, domainbed/scripts/download.py: Google Drive ids, no checksums published.
register_source(Source(
    "pacs", "pacs", "PACS", (Archive(_drive("1JFr8f805nMUelQWWmfnJR3y4_SYoN5Pd"), "PACS.zip"),),
    ("photo", "art_painting", "cartoon", "sketch"), "DomainBed (Google Drive, PACS.zip with kfold/)"))
register_source(Source(
    "office_home", "office_home", "OfficeHome",
    (Archive(_drive("1uY0pj7oFsjMxRwaD3Sxy0jgel0fsYXLC"), "office_home.zip"),),
    ("Art", "Clipart", "Product", "Real World"), "DomainBed (Google Drive, OfficeHomeDataset_10072016/)"))
register_source(Source(
    "vlcs", "vlcs", "VLCS", (Archive(_drive("1skwblH1_okBwxWxmRsp9_qi15hyPpxg8"), "VLCS.tar.gz"),),
    ("Caltech101", "LabelMe", "SUN09", "VOC2007"), "DomainBed (Google Drive, VLCS.tar.gz)"))

# DomainNet ("cleaned" clipart and painting, as DomainBed): sizes and SHA-256 from TensorFlow
# Datasets' image_classification/domainnet/checksums.tsv.  DomainBed also deletes the files listed
# in its misc/domain_net_duplicates.txt; that list is not fetched here, so those images stay.
_DN = "http://csr.bu.edu/ftp/visda/2019/multi-source/"
register_source(Source(
    "domainnet", "domainnet", "DomainNet", (
        Archive(_DN + "groundtruth/clipart.zip", "clipart.zip",
                "f8f248a3e8bbc9868c523ae24e6601b4c2ad102afc60c0efeb4f3255df22354d", 1270909081),
        Archive(_DN + "infograph.zip", "infograph.zip",
                "891e14f476317e97b6f06d6498c11d0a5b8d0c8b57210765ed9beb072da611fa", 4338659804),
        Archive(_DN + "groundtruth/painting.zip", "painting.zip",
                "fa47e6d405503ea0286cabd767f176bd30e988b63ddd7b9db16cf030c9770015", 3679366174),
        Archive(_DN + "quickdraw.zip", "quickdraw.zip",
                "9f37df2a8c3733703dbb35ad9964202a65f675ca30137756457537536b485d84", 459920701),
        Archive(_DN + "real.zip", "real.zip",
                "d7fe010b430c5b510f85d657d38c4a1924822695fabea4fef57bd00dba251d63", 6062039589),
        Archive(_DN + "sketch.zip", "sketch.zip",
                "23a7dbae7016b343e934399beaa8a68728fb5e570ebe2c71df9b75cf91c499fc", 2633992926),
    ), ("clipart", "infograph", "painting", "quickdraw", "real", "sketch"),
    "DomainBed / the DomainNet authors (csr.bu.edu; SHA-256 from TensorFlow Datasets)"))

# Digits-DG as Dassl downloads it (dassl/data/datasets/dg/digits_dg.py): Google Drive, no checksum.
register_source(Source(
    "digits_dg", "digits_dg", "digits_dg",
    (Archive(_drive("15V7EsHfCcfbKgsDmzQKj_DfXt_XYp_P7"), "digits_dg.zip"),),
    ("mnist", "mnist_m", "svhn", "syn"), "Dassl (Google Drive, digits_dg.zip)"))

# WILDS' Camelyon17Dataset, version 1.0: a CodaLab bundle (a .tar.gz) whose size WILDS states
# (compressed_size 10,658,709,504 bytes); WILDS publishes no checksum.
register_source(Source(
    "camelyon17", "camelyon17", "camelyon17_v1.0",
    (Archive("https://worksheets.codalab.org/rest/bundles/0xe45e15f39fb54e9d9e919556af67aabe/contents/blob/",
             "camelyon17_v1.0.tar.gz", size=10_658_709_504),),
    ("metadata.csv", "patches"), "WILDS v1.0 (CodaLab)"))


def _arrange_terra(extracted: Path, out: Path) -> None:
    from .terra import arrange_terra_incognita

    arrange_terra_incognita(extracted, out)


# TerraIncognita as DomainBed builds it: LILA's Caltech Camera Traps images (ECCV'18 subset, small
# versions) and the CCT annotation file; the URLs are DomainBed's (LILA's Azure container), the
# mirrors LILA's copy on Google Cloud Storage.  No checksum is published.
_LILA_AZ = "https://lilablobssc.blob.core.windows.net/caltechcameratraps/"
_LILA_GCS = "https://storage.googleapis.com/public-datasets-lila/caltechcameratraps/"
register_source(Source(
    "terra_incognita", "terra_incognita", "terra_incognita", (
        Archive(_LILA_AZ + "eccv_18_all_images_sm.tar.gz", "eccv_18_all_images_sm.tar.gz",
                mirrors=(_LILA_GCS + "eccv_18_all_images_sm.tar.gz",)),
        Archive(_LILA_AZ + "labels/caltech_camera_traps.json.zip", "caltech_camera_traps.json.zip",
                mirrors=(_LILA_GCS + "labels/caltech_camera_traps.json.zip",)),
    ), ("location_100", "location_38", "location_43", "location_46"),
    "DomainBed (LILA Caltech Camera Traps, sorted by location and class)", arrange=_arrange_terra))
