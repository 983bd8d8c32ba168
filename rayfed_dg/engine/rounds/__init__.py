"""One federation and its rounds: the server actor, the federation's state
and its server-side steps, the method's optional phases, the data stages
before round 1, and the evaluation of a round's global model.

May import: workers, privacy, aggregation, clock, store.
"""
MAY_IMPORT: tuple[str, ...] = ("workers", "privacy", "aggregation", "clock", "store")
