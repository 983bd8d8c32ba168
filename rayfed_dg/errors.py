"""The errors a user can cause, in one place so that every command reports
them the same way (``utils.cli_errors``).

* ``ConfigError``: a bad config, flag or run directory (exit 2).
* ``DataError``: a dataset that cannot be read or split (exit 2).
* ``ModelError``: a model that cannot be built, e.g. missing weights (exit 2).
* ``ResourceError``: a worker pool the Ray cluster cannot fit (exit 2).
* ``EngineError``: the engine failed while running, e.g. a client diverged
  or every sampled client failed (exit 1).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad config: the message is one line naming the key and the file."""


class DataError(ValueError):
    """A dataset that cannot be read or split: one line saying what and where."""


class ModelError(ValueError):
    """A model that cannot be built as configured (e.g. weights not found)."""


class ResourceError(ConfigError):
    """The configured worker pool cannot fit the Ray cluster (bad input)."""


class EngineError(RuntimeError):
    """The engine failed while running (e.g. every sampled client failed)."""


class DivergedError(RuntimeError):
    """A client's local loss or update became NaN or infinite: retrying would
    repeat it (training is seeded), so the run stops instead of averaging garbage."""


USER_ERRORS = (ConfigError, DataError, ModelError)
