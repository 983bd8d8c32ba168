"""Workers and their pool: the worker actor that trains clients and folds
their uploads, the pool that dispatches tasks, retries them and replaces
dead workers (its policy pure, in ``dispatch.py``), the faults a task can
report, and fitting the pool to the Ray cluster.

May import: privacy (the client-side clip), aggregation (the fold), store.
"""
MAY_IMPORT: tuple[str, ...] = ("privacy", "aggregation", "store")
