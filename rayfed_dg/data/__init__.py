"""Datasets, the leave-one-domain-out protocol and client partitions."""
from . import embedded, folders, sources  # noqa: F401  (register the loaders and sources)
from .base import DataError, DomainDataset, dataset_names, load_dataset, register_dataset
from .protocol import FederatedSplit, leave_one_domain_out, stratified_split

__all__ = [
    "DataError",
    "DomainDataset",
    "FederatedSplit",
    "dataset_names",
    "leave_one_domain_out",
    "load_dataset",
    "register_dataset",
    "stratified_split",
]
