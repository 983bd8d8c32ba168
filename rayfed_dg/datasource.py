"""The actor that holds an experiment's dataset references for its workers.

Outside ``rayfed_dg.engine`` on purpose: an actor's process imports the
module its class lives in, and the engine imports torch (2-3 s of CPU per
process).  This one imports nothing, so each federation starts one process
fewer that loads torch."""
from __future__ import annotations


class DataSource:
    """Holds the dataset's object references for an experiment's workers, and
    what each running federation of the experiment is (config, classes,
    clients), so that any worker, restarted or not, builds the federation a
    task names.  Federations run side by side: each is registered when it
    opens and dropped when it ends."""

    def __init__(self, refs: list):
        from rayfed_dg.utils import exit_quietly_on_sigterm

        exit_quietly_on_sigterm()  # Ray's SIGTERM inside a finaliser: a traceback at the end of a run, else
        self._refs = list(refs)
        self._federations: dict[int, tuple] = {}

    def refs(self) -> list:
        return self._refs

    def register(self, federation: int, spec: tuple) -> None:
        self._federations[federation] = spec

    def drop(self, federation: int) -> None:
        self._federations.pop(federation, None)

    def federation(self, federation: int) -> tuple:
        return self._federations[federation]
