"""The actor that holds a server's dataset references for its workers.

Outside ``rayfed_dg.engine`` on purpose: an actor's process imports the
module its class lives in, and the engine imports torch (2-3 s of CPU per
process).  This one imports nothing, so each federation starts one process
fewer that loads torch."""
from __future__ import annotations


class DataSource:
    """Holds the dataset's object references for the workers of one server."""

    def __init__(self, refs: list):
        self._refs = list(refs)

    def refs(self) -> list:
        return self._refs
