"""What clients share besides model tensors: the payload groups that methods
and data stages declare (``shared_payloads``, group -> what one record is),
the groups a config releases, and the check of ``privacy.payloads`` against
them (a group nobody shares, or one of integers, is bad input).  The
clipping and noise themselves are the engine's (``engine/privacy/payloads.py``);
this module is light enough for the config's validation to call.
"""
from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from rayfed_dg.errors import ConfigError
from rayfed_dg.stages import build_stages, get_stage_class, stage_names

from .base import declarations, get_method_class, method_names

if TYPE_CHECKING:
    from rayfed_dg.config import ExperimentConfig

# what one record of a shared payload is: the unit that clipping bounds and the noise hides
RECORDS = {
    "image": "each row (first axis) is a statistic of one image: rows are clipped one by one",
    "client": "the whole array is one statistic of the client's data: clipped as one vector",
    "exact": "integers (counts, signs): Gaussian noise is not defined for them, privacy.payloads refuses the group",
}


def released_payload_groups(cfg: ExperimentConfig) -> dict[str, str]:
    """The payload groups a run of ``cfg``'s method and data stages releases, group -> what one record is
    (``RECORDS``).  A compare row is a config of its own (``config.method_variants``)."""
    groups = dict(declarations(cfg).shared_payloads)
    for stage in build_stages(cfg):
        groups.update(stage.shared_payloads)
    return groups


def known_payload_groups() -> dict[str, str]:
    """Every group any registered method or stage may release (their classes' declarations)."""
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
