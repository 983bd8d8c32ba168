"""Running an experiment: resolving its plan (data, targets, splits, the
checks before anything is written), the run service behind the CLI and the
Python API, the hosts that keep actors across federations, concurrent
federations and their schedule, and re-evaluating a finished run.

May import: every other wing.
"""
MAY_IMPORT: tuple[str, ...] = ("rounds", "workers", "privacy", "aggregation", "clock", "store")
