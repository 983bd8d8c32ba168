"""How uploads become the next global model: the exact, order-independent
sum that workers fold into (``exact.py``), the pipeline of declared parts a
round's uploads pass through (``pipeline.py``), its estimators (the weighted
mean, the buffered and mixing asynchronous updates, the robust rules,
FedOMG's on-server gradient matching) and the server optimizers.

May import: store (the records a fold is addressed by).
"""
MAY_IMPORT: tuple[str, ...] = ("store",)

from . import omg, robust  # noqa: E402  (register fedomg, median and trimmed_mean)
from .pipeline import Estimator, Uploads, register_aggregator  # noqa: E402

__all__ = ["MAY_IMPORT", "Estimator", "Uploads", "omg", "register_aggregator", "robust"]
