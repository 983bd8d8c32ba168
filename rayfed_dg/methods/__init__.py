"""Federated (DG) methods: one file per method, each registered by name."""
from . import dsu, fedbn, feddg_ga, fedfd, fedprox, fedsr, gperxan, mixstyle, silobn, stablefdg  # noqa: F401  (register)
from .base import (
                   ClientContext,
                   ClientUpdate,
                   GlobalEval,
                   Method,
                   build_method,
                   get_method_class,
                   method_names,
                   register_method,
)

__all__ = ["ClientContext", "ClientUpdate", "GlobalEval", "Method", "build_method", "get_method_class", "method_names",
           "register_method"]
