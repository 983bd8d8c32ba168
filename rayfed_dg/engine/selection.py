"""Model selection by the DG protocol: training-domain validation.

The selected round maximises the mean accuracy over source domains of the
global model on their validation splits.  Only rows with split
``source_val`` are read, so target accuracy can never influence the choice;
ties go to the earlier round.
"""
from __future__ import annotations

from collections import defaultdict


def select_round(rows: list[dict]) -> tuple[int | None, float | None]:
    per_round: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r["split"] == "source_val":
            per_round[int(r["round"])].append(float(r["accuracy"]))
    best, best_acc = None, None
    for rnd in sorted(per_round):
        acc = sum(per_round[rnd]) / len(per_round[rnd])
        if best_acc is None or acc > best_acc:
            best, best_acc = rnd, acc
    return best, best_acc
