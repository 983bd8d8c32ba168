"""In-memory multi-domain image datasets and the dataset registry."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rayfed_dg.errors import DataError
from rayfed_dg.utils import Registry, did_you_mean

__all__ = ["DataError", "DomainDataset", "dataset_names", "load_dataset", "register_dataset", "subsample_indices"]


@dataclass
class DomainDataset:
    """Decoded images of several domains, held as one array.

    ``images`` is uint8 (N, H, W, 3); ``labels`` and ``domains`` are int64 (N,)
    indices into ``class_names`` and ``domain_names``.
    """

    images: np.ndarray
    labels: np.ndarray
    domains: np.ndarray
    domain_names: list[str]
    class_names: list[str]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.images)
        if self.images.dtype != np.uint8 or self.images.ndim != 4 or self.images.shape[-1] != 3:
            raise DataError(f"images must be uint8 (N, H, W, 3), got {self.images.dtype} {self.images.shape}")
        if len(self.labels) != n or len(self.domains) != n:
            raise DataError("images, labels and domains differ in length")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def domain_index(self, name: str) -> int:
        if name not in self.domain_names:
            raise DataError(f"unknown domain {name!r}{did_you_mean(name, self.domain_names)}; "
                            f"this dataset has {', '.join(self.domain_names)}")
        return self.domain_names.index(name)

    def subsample(self, per_domain: int, seed: int = 0) -> DomainDataset:
        """At most ``per_domain`` images of each domain, classes kept in proportion."""
        k = subsample_indices(self.labels, self.domains, per_domain, seed)
        if len(k) == len(self.labels):
            return self
        return DomainDataset(np.ascontiguousarray(self.images[k]), self.labels[k], self.domains[k],
                             self.domain_names, self.class_names, dict(self.meta, subsampled=per_domain))

    def counts(self) -> dict[str, int]:
        return {d: int((self.domains == i).sum()) for i, d in enumerate(self.domain_names)}


def subsample_indices(labels: np.ndarray, domains: np.ndarray, per_domain: int, seed: int = 0) -> np.ndarray:
    """Sorted indices of at most ``per_domain`` samples of each domain,
    stratified by class (sorted by class, then evenly spaced) and seeded."""
    rng = np.random.default_rng(seed)
    keep = []
    for j in np.unique(domains):
        idx = np.flatnonzero(domains == j)
        if len(idx) > per_domain:
            order = np.lexsort((rng.random(len(idx)), labels[idx]))
            idx = idx[order][np.linspace(0, len(idx) - 1, per_domain).round().astype(int)]
        keep.append(idx)
    return np.sort(np.concatenate(keep))


_REGISTRY: Registry[Callable[..., DomainDataset]] = Registry("dataset", DataError)


def register_dataset(name: str):
    def deco(fn: Callable[..., DomainDataset]):
        return _REGISTRY.add(name, fn)

    return deco


def dataset_names() -> list[str]:
    return _REGISTRY.names()


def load_dataset(name: str, root: str | None, resolution: int, domains: list[str] | None = None,
                 **options) -> DomainDataset:
    """``options``: loader settings such as ``on_corrupt`` and ``top_classes``."""
    ds = _REGISTRY.get(name)(root=root, resolution=resolution, **options)
    if domains:
        keep_idx = [ds.domain_index(d) for d in domains]
        mask = np.isin(ds.domains, keep_idx)
        remap = {old: new for new, old in enumerate(keep_idx)}
        ds = DomainDataset(
            images=ds.images[mask],
            labels=ds.labels[mask],
            domains=np.array([remap[int(d)] for d in ds.domains[mask]], dtype=np.int64),
            domain_names=list(domains),
            class_names=ds.class_names,
            meta=ds.meta,
        )
    return ds
