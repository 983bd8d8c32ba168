"""How uploads become the next global model: the exact, order-independent
sum that workers fold into (``exact.py``), the pipeline of declared parts a
round's uploads pass through (``pipeline.py``), its estimators (the weighted
mean, the buffered and mixing asynchronous updates, the robust rules) and
the server optimizers.

May import: store (the records a fold is addressed by).
"""
MAY_IMPORT: tuple[str, ...] = ("store",)

from . import robust  # noqa: E402  (registers median and trimmed_mean)
from .pipeline import Estimator, Uploads, register_aggregator  # noqa: E402

__all__ = ["MAY_IMPORT", "Estimator", "Uploads", "register_aggregator", "robust"]
