"""Federated (DG) methods: one file per method, each registered by name."""
from . import (  # noqa: F401
                   copa,
                   csac,
                   dson,
                   dsu,
                   elcfs,
                   fedadg,
                   fedbn,
                   feddg_ga,
                   feddyn,
                   fedfd,
                   fedgma,
                   fediir,
                   fedprox,
                   fedsam,
                   fedsr,
                   gperxan,
                   mixstyle,
                   moon,
                   rsc,  # (register)
                   scaffold,
                   silobn,
                   stablefdg,
)
from .base import (
                   ClientContext,
                   ClientUpdate,
                   GlobalEval,
                   LocalResult,
                   Method,
                   Phase,
                   Precision,
                   Slot,
                   build_method,
                   get_method_class,
                   method_names,
                   register_method,
)

__all__ = ["ClientContext", "ClientUpdate", "GlobalEval", "LocalResult", "Method", "Phase", "Precision", "Slot",
           "build_method", "get_method_class", "method_names", "register_method"]
