"""Differential privacy of the statistics a client shares: clipping and
Gaussian noise where a payload leaves the client (issue 43, Deliver 2).

Every payload a client sends goes through ``release``, in the worker, before
the worker returns it: a method's ``upload_payload`` and ``round_prepare``
results (engine/worker.py) and the result of a data stage's client phase
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
group -> one of ``RECORDS``); a payload it does not declare is refused, so the
groups a run can release are known before it starts.
"""
from __future__ import annotations

import difflib
import zlib
from collections.abc import Mapping

import numpy as np

from rayfed_dg.config import ExperimentConfig, PrivacyConfig
from rayfed_dg.errors import ConfigError
from rayfed_dg.privacy import clip_rows, gaussian
from rayfed_dg.seeding import Stream, numpy_rng

# what one record of a shared payload is: the unit that clipping bounds and the noise hides
RECORDS = {
    "image": "each row (first axis) is a statistic of one image: rows are clipped one by one",
    "client": "the whole array is one statistic of the client's data: clipped as one vector",
    "exact": "integers (counts, signs): Gaussian noise is not defined for them, privacy.payloads refuses the group",
}


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
    if undeclared:
        raise TypeError(f"{owner} sends the payload {undeclared[0]!r} that its shared_payloads does not declare; "
                        f"add {undeclared[0]!r}: one of {', '.join(RECORDS)} (what one record is)")
    configured = {} if privacy is None else privacy.payloads
    out = dict(payload)
    for group in sorted(set(payload) & set(configured)):
        p = configured[group]
        out[group] = privatize(payload[group], declared[group], p.clip, p.noise_multiplier,
                               payload_rng(seed, round, client, group))
    return out


def released_payload_groups(cfg: ExperimentConfig) -> dict[str, str]:
    """The payload groups a run of ``cfg``'s method and data stages releases, group -> what one record is
    (``RECORDS``).  A compare row is a config of its own (``config.method_variants``)."""
    from rayfed_dg.methods import build_method
    from rayfed_dg.stages import build_stages

    groups = dict(build_method(cfg, 1).shared_payloads)
    for stage in build_stages(cfg):
        groups.update(stage.shared_payloads)
    return groups


def known_payload_groups() -> dict[str, str]:
    """Every group any registered method or stage may release (their classes' declarations)."""
    from rayfed_dg.methods import get_method_class, method_names
    from rayfed_dg.stages import get_stage_class, stage_names

    groups: dict[str, str] = {}
    for cls in [get_method_class(n) for n in method_names()] + [get_stage_class(n) for n in stage_names()]:
        groups.update(cls.shared_payloads)
    return groups


def check_payload_groups(cfg: ExperimentConfig) -> None:
    """Refuse, in one line naming the key, a ``privacy.payloads`` group that no registered method or stage
    releases, or one of integers (``exact``).  Registry-wide rather than per run, so that one privacy section
    serves every compare row (FedAvg beside CCST): a row that does not release a group noises nothing."""
    if cfg.privacy is None:
        return
    known = known_payload_groups()
    for group in sorted(cfg.privacy.payloads):
        key = f"privacy.payloads.{group}"
        if group not in known:
            close = difflib.get_close_matches(group, list(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{key}: no method or data stage shares a payload {group!r}; {hint}the groups are "
                              f"{', '.join(sorted(g for g in known if known[g] != 'exact'))}")
        if known[group] == "exact":
            raise ConfigError(f"{key}: the payload {group!r} holds integers (counts or signs), where Gaussian noise "
                              "is not defined; remove the key (docs/privacy.md, Shared statistics)")
