"""rayfed_dg: a Ray-based simulation engine for federated domain generalization."""
__version__ = "0.1.0"
