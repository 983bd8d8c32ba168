"""Model selection rules, as DomainBed's ``model_selection.py``: which round's
global model a run reports, from its evaluation rows (``metrics``).

``training_domain``  training-domain validation, the DG protocol and the one
                     rule that chooses anything (best checkpoint, summary,
                     Tune): the round that maximises the mean accuracy over
                     source domains of the global model on their validation
                     splits.  Only ``source_val`` rows are read, so target
                     accuracy can never influence it.
``heldout_domain``   held-out-domain validation (FedDG-Benchmark, Bai et
                     al., ICLR 2024): the round that maximises the accuracy
                     on ``data.heldout_val_domain``, a domain neither
                     trained on nor a target.  Only runs that hold one out
                     have it; ``report`` shows it for those.
``last_round``       the last evaluated round.
``oracle``           test-domain oracle: the round that maximises the target
                     accuracy itself.  An upper bound, reported beside the
                     others and never used to choose anything.

Ties go to the earlier round.  Each rule is a small class tested on
hand-made records (``tests/test_selection.py``).
"""
from __future__ import annotations

import numpy as np

from .records import Split, split_means


def _argmax_first(values: dict[int, float]) -> int | None:
    best, best_v = None, None
    for rnd in sorted(values):
        if best_v is None or values[rnd] > best_v:
            best, best_v = rnd, values[rnd]
    return best


class SelectionRule:
    name = ""
    label = ""
    upper_bound = False  # True: reported as a bound, never used to choose
    needs: str | None = None  # a split only some runs evaluate; without it the rule has nothing to say

    def choose(self, rows: list[dict]) -> int | None:
        raise NotImplementedError


class TrainingDomainValidation(SelectionRule):
    name, label = "training_domain", "training-domain validation"

    def choose(self, rows):
        return _argmax_first(split_means(rows, Split.SOURCE_VAL))


class HeldOutDomainValidation(SelectionRule):
    name, label, needs = "heldout_domain", "held-out-domain validation", Split.HELDOUT_VAL

    def choose(self, rows):
        return _argmax_first(split_means(rows, Split.HELDOUT_VAL))


class LastRound(SelectionRule):
    name, label = "last_round", "last round"

    def choose(self, rows):
        evaluated = split_means(rows, Split.TARGET_TEST)
        return max(evaluated) if evaluated else None


class TestDomainOracle(SelectionRule):
    __test__ = False  # not a pytest class
    name, label, upper_bound = "oracle", "test-domain oracle (upper bound)", True

    def choose(self, rows):
        return _argmax_first(split_means(rows, Split.TARGET_TEST))


RULES: tuple[SelectionRule, ...] = (TrainingDomainValidation(), HeldOutDomainValidation(), LastRound(),
                                    TestDomainOracle())


def select(rows: list[dict], rule: SelectionRule) -> dict | None:
    """{round, source_val, target_acc, source_test, personal_val} of the
    round ``rule`` picks among one target's evaluation rows (means over
    domains / clients; None for a split the run did not evaluate), or None
    when there are no rows."""
    rnd = rule.choose(rows)
    if rnd is None:
        return None
    at = {s: split_means(rows, s).get(rnd) for s in (Split.SOURCE_VAL, Split.TARGET_TEST, Split.SOURCE_TEST,
                                                         Split.PERSONAL_VAL)}
    return {"round": rnd, "source_val": at[Split.SOURCE_VAL], "target_acc": at[Split.TARGET_TEST],
            "source_test": at[Split.SOURCE_TEST], "personal_val": at[Split.PERSONAL_VAL]}


def select_round(rows: list[dict]) -> tuple[int | None, float | None]:
    """The training-domain-validation round and its mean source-validation accuracy."""
    rnd = TrainingDomainValidation().choose(rows)
    return rnd, (None if rnd is None else split_means(rows, Split.SOURCE_VAL)[rnd])


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard error over seeds: SE = std(ddof=1) / sqrt(n)
    (None for a single seed)."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return float(v.mean()), None
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v)))
