"""Differential privacy of the statistics a client shares: clipping and
Gaussian noise where a payload leaves the client.

Every payload a client sends goes through ``release``, in the worker, before
the worker returns it: a method's ``upload_payload`` and ``round_prepare``
results (engine/workers/worker.py) and the result of a data stage's client phase
that its server half maps with ``releases=`` (stages/base.py). A payload
group is the payload's name, the ledger's group after ``payload:`` or
``prepare:``; the server, the ledger and the accountant see the noised
array only, the same shape, dtype and bytes as the clean one.

With ``privacy.payloads.<group>: {clip: C, noise_multiplier: z}`` each
record of the group is scaled to an L2 norm of at most C and every element
gets N(0, (z C)^2) noise drawn from
``numpy_rng(seed, Stream.DP_PAYLOAD, round, client, crc32(group))``: the same
noise whatever the worker count, the task order or a retry.  What a record
is, each method and stage declares beside the payload (``shared_payloads``,
group -> one of ``methods.payloads.RECORDS``); with ``privacy:`` set, a
payload it does not declare stops the run, so the groups a run can release
are known before it starts.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping

import numpy as np

from rayfed_dg.config import PrivacyConfig
from rayfed_dg.errors import DivergedError
from rayfed_dg.methods.payloads import RECORDS
from rayfed_dg.seeding import Stream, numpy_rng

from .mechanisms import clip_rows, gaussian


def group_id(group: str) -> int:
    """A stable number of a group's name (never Python's salted ``hash``), for its noise's seed."""
    return zlib.crc32(group.encode())


def payload_rng(seed: int, round: int, client: int, group: str) -> np.random.Generator:
    """The generator of the noise on ``client``'s ``group`` in ``round`` (0: the data stages)."""
    return numpy_rng(seed, Stream.DP_PAYLOAD, round, client, group_id(group))


def privatize(x: np.ndarray, record: str, clip: float, noise_multiplier: float,
              rng: np.random.Generator) -> np.ndarray:
    """``x``'s records clipped to ``clip`` plus N(0, (noise_multiplier clip)^2) per element, in ``x``'s dtype."""
    a = np.asarray(x)
    if record not in ("image", "client") or not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"a payload of records {record!r} and dtype {a.dtype} cannot be clipped and noised")
    wide = a.astype(np.float64)  # rounded to the payload's dtype once, after the noise
    clipped = clip_rows(wide if record == "image" else wide.reshape(1, -1), clip).reshape(a.shape)
    return (clipped + gaussian(a.shape, noise_multiplier * clip, rng)).astype(a.dtype)


def release(payload: Mapping[str, np.ndarray], declared: Mapping[str, str], privacy: PrivacyConfig | None,
            seed: int, round: int, client: int, owner: str) -> dict[str, np.ndarray]:
    """What leaves ``client``: ``payload`` with each group that ``privacy.payloads`` names clipped and
    noised (the others untouched, the very arrays).  ``declared``: the owner's ``shared_payloads``."""
    undeclared = sorted(set(payload) - set(declared))
    if undeclared and privacy is not None:  # without privacy, a plugin written before declarations still runs
        raise TypeError(f"{owner} sends the payload {undeclared[0]!r} that its shared_payloads does not declare; "
                        f"add {undeclared[0]!r}: one of {', '.join(RECORDS)} (what one record is)")
    for group, a in payload.items():  # a NaN statistic (a diverged model's) would poison every client it reaches
        arr = np.asarray(a)
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
            raise DivergedError(f"client {client}'s payload {group!r} in round {round} is not finite ({owner}): its "
                                "model diverged")
    configured = {} if privacy is None else privacy.payloads
    out = dict(payload)
    for group in sorted(set(payload) & set(configured)):
        p = configured[group]
        out[group] = privatize(payload[group], declared[group], p.clip, p.noise_multiplier,
                               payload_rng(seed, round, client, group))
    return out
