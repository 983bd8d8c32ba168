"""Differential privacy: the Gaussian and clipping mechanisms, DP-FedAvg on
model updates (a client-side clip and a server-side fixed-denominator
estimator with noise: parts of the aggregation pipeline), privatized
method payloads, and the accountant.

May import: aggregation (its parts plug into the pipeline), store (the
accountant's records).
"""
MAY_IMPORT: tuple[str, ...] = ("aggregation", "store")
