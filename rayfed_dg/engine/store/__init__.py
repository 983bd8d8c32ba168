"""What a run keeps: the typed records of a round and its ledger, the client
state store, the run directory and its checkpoints, their format versions
and migrations, remote copies, TensorBoard and the experiment trackers, and
model selection over the recorded metrics.

May import: clock (a round's plan is recorded with its clients).
"""
MAY_IMPORT: tuple[str, ...] = ("clock",)
