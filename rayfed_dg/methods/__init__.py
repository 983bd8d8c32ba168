"""Federated (DG) methods: one file per method, each registered by name."""
from .base import (ClientContext, ClientUpdate, GlobalEval, Method, build_method, get_method_class, method_names,
                   register_method)
from . import (copa, csac, dson, dsu, elcfs, fedbn, feddg_ga, fedfd, fedprox, fedsr, gperxan, mixstyle,  # noqa: F401
               rsc, silobn, stablefdg)  # (register)

__all__ = ["ClientContext", "ClientUpdate", "GlobalEval", "Method", "build_method", "get_method_class", "method_names", "register_method"]
