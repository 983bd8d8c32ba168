"""Typed records of a round, and the ledger the server keeps.

``ClientTask``   what a worker needs to run one client in one round;
``Fold``         where it folds the client's upload (``aggregate.py``)
``MetricRow``, ``ClientRow``, ``LedgerRow``, ``DropRow``, ``PrivacyRow``  one row of a
                 round's records, typed from where they are made to the
                 writer: ``table_rows`` is the one place they become the
                 run directory's table rows (``.row()``, plus the target)
``Split``        the metrics table's split names
``RoundResult``  what ``Server.run_round`` returns to the driver
``Ledger``       what crossed the wire: ``LedgerRow``s (round, client,
                 direction, group, tensors, bytes), one per tensor group
``TABLES``       the tables' columns; ``split_means`` / ``split_mean`` the
                 mean accuracy of a split per round, read from table rows

(``ClientUpdate``, what a training task returns, is defined with the method
hooks in ``methods/base.py``, since ``after_round`` receives it.  The run
directory that holds the tables is ``rundir.RunDir``; each client's
persistent local state between rounds is ``clientstore.ClientStore``'s.)
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rayfed_dg.data.protocol import FederatedSplit
    from rayfed_dg.engine.clock.devices import RoundPlan
    from rayfed_dg.methods import ClientUpdate


@dataclass(frozen=True)
class Fold:
    """The worker adds the client's upload, times ``weight``, to its partial
    sum of (federation, round, epoch) instead of returning it; epoch 0 is
    the round's training, 1, 2, ... re-runs of clients whose partial was
    lost with its worker's process (``rounds/round.py``'s ``gather``);
    ``window``: the round's window exponents of the sum, by tensor
    (``aggregation/exact.py``), the same for every fold of the round."""
    federation: int
    round: int
    epoch: int
    weight: float
    window: Mapping[str, int] = field(default_factory=dict)


@dataclass
class ClientTask:
    client: int
    round: int
    indices: np.ndarray  # the client's training samples in the dataset
    local_state: dict[str, np.ndarray]  # from the client store
    payload: dict[str, np.ndarray] = field(default_factory=dict)  # the method's per-client broadcast
    extra: Any = None  # a data stage's added samples {"images", "labels"} (or an ObjectRef of them), or None
    val_indices: np.ndarray | None = None  # for client-side selection (``client_val_size``)
    stage_data: dict[str, Any] = field(default_factory=dict)  # data stages' shared arrays (or ObjectRefs), by name
    attempt: int = 0  # retries of this task so far (faults are seeded per attempt)
    fault_p: float = 0.0
    fold: Fold | None = None  # None: the whole upload travels back (a method that reads it, tests)
    dp_clip: float | None = None  # DP-FedAvg (``dp.py``): the round's clip of the update, None without it


class Split(StrEnum):
    SOURCE_VAL = "source_val"  # each source domain's validation split: the only one selection reads
    TARGET_TEST = "target_test"  # the held-out domain
    PERSONAL_VAL = "personal_val"  # a client's own model on its source domain's validation split
    SOURCE_TEST = "source_test"  # each source domain's in-domain test split (data.source_test_fraction)
    HELDOUT_VAL = "heldout_val"  # the held-out validation domain (data.heldout_val_domain)


class _Row:
    def row(self) -> dict[str, Any]:
        """The table's plain row (a ``Split`` becomes its string)."""
        return {k: str(v) if isinstance(v, StrEnum) else v for k, v in vars(self).items()}


@dataclass
class MetricRow(_Row):
    round: int
    split: Split
    domain: str
    client: int | None  # None: the global model; an id: that client's own model (``personal_val``)
    accuracy: float
    loss: float
    samples: int


@dataclass
class ClientRow(_Row):
    """A sampled client in one round: what it trained, how long, what crossed
    the wire, its training task's charged retries, whether it was dropped
    (then ``train_loss`` and ``seconds`` are None)."""
    round: int
    client: int
    domain: str
    samples: int
    local_steps: int
    train_loss: float | None
    seconds: float | None
    bytes_up: int
    bytes_down: int
    retried: int
    dropped: bool
    drop_reason: str | None
    # the virtual clock (``devices`` / an asynchronous server mode); None where it is off
    sim_start: float | None = None  # simulated seconds when the client began training
    sim_finish: float | None = None  # simulated seconds when its upload arrived (or would have)
    deadline_met: bool | None = None  # whether it arrived by the round's deadline and was aggregated
    staleness: int | None = None  # asynchronous modes: server versions between its start and its aggregation


@dataclass
class LedgerRow(_Row):
    round: int
    client: int
    direction: str  # "up" or "down"
    group: str  # a tensor group, or "payload:<name>", "prepare:<name>", ...
    tensors: int
    bytes: int


@dataclass
class PrivacyRow(_Row):
    """Epsilon of one group after a round (``accountant.py``), with what it composed."""
    round: int
    group: str  # "updates", a payload group, or "total"
    releases: int  # mechanisms composed so far (updates: rounds; a payload group: its worst client's releases)
    noise_multiplier: float | None  # the group's z (None for the total)
    clip: float | None  # the round's update clip (adaptive clipping moves it), a payload group's clip
    epsilon: float
    delta: float


@dataclass
class DropRow(_Row):
    """A sampled client whose training failed for good in a round."""
    round: int
    client: int
    reason: str


@dataclass
class RoundResult:
    round: int
    sampled: list[int]
    dropped: list[DropRow]
    metrics: list[MetricRow]
    ledger: list[LedgerRow]
    clients: list[ClientRow]  # one per sampled client
    train_loss: float
    tasks_retried: int  # over the run so far: failures the tasks caused themselves (seeded, so reproducible)
    seconds_total: float
    tasks_rerun: int = 0  # over the run so far: re-runs after a shared worker died (scheduling, like seconds)
    seconds_clients: float = 0.0  # the clients' phase: first dispatch to last update in (its makespan)
    sim_time: float | None = None  # the virtual clock when the round's aggregation happened (None: no clock)
    dp_clip: float | None = None  # DP-FedAvg: the clip of the round's updates (None without privacy.updates)


class Ledger:
    """Rows of what crossed the wire in one round (or the data stage, round 0)."""

    def __init__(self, round: int):
        self.round = round
        self.rows: list[LedgerRow] = []

    def add(self, client: int, direction: str, group: str, nbytes: int, tensors: int = 1) -> None:
        self.rows.append(LedgerRow(self.round, int(client), direction, group, int(tensors), int(nbytes)))

    @staticmethod
    def group_sizes(arrays: Mapping[str, np.ndarray | int],
                    group_of: Callable[[str], str]) -> list[tuple[str, int, int]]:
        """(group, bytes, tensors) of model tensors (or of their sizes in bytes), by group name."""
        groups: dict[str, list[int]] = {}
        for key, arr in arrays.items():
            g = groups.setdefault(group_of(key), [0, 0])
            g[0] += 1
            g[1] += arr if isinstance(arr, int) else arr.nbytes
        return [(group, b, cnt) for group, (cnt, b) in sorted(groups.items())]

    def add_state(self, client: int, direction: str,
                  arrays: Mapping[str, np.ndarray | int] | list[tuple[str, int, int]],
                  group_of: Callable[[str], str] | None = None) -> None:
        """Model tensors (or their sizes in bytes: an upload folded on its
        worker), one row per tensor group (or their ``group_sizes``, when
        many clients receive the same tensors)."""
        sizes = arrays if isinstance(arrays, list) else self.group_sizes(arrays, group_of or str)
        for group, b, cnt in sizes:
            self.add(client, direction, group, b, cnt)

    def add_payload(self, client: int, direction: str, payload: dict[str, np.ndarray], prefix: str = "payload") -> None:
        for name, arr in sorted(payload.items()):
            self.add(client, direction, f"{prefix}:{name}", int(np.asarray(arr).nbytes))

    def sorted_rows(self) -> list[LedgerRow]:
        return sorted(self.rows, key=lambda x: (x.client, x.direction, x.group))


# ------------------------------------------------------------------ run-directory tables

# column name -> Arrow type; every part file of a table has exactly this schema
TABLES: dict[str, list[tuple[str, str]]] = {
    "metrics": [("target", "string"), ("round", "int64"), ("split", "string"), ("domain", "string"),
                ("client", "int64"), ("accuracy", "float64"), ("loss", "float64"), ("samples", "int64"),
                ("clients_dropped", "int64"), ("sim_time", "float64")],
    "ledger": [("target", "string"), ("round", "int64"), ("client", "int64"), ("direction", "string"),
               ("group", "string"), ("tensors", "int64"), ("bytes", "int64")],
    "clients": [("target", "string"), ("round", "int64"), ("client", "int64"), ("domain", "string"),
                ("samples", "int64"), ("local_steps", "int64"), ("train_loss", "float64"), ("seconds", "float64"),
                ("bytes_up", "int64"), ("bytes_down", "int64"), ("retried", "int64"), ("dropped", "bool"),
                ("drop_reason", "string"), ("sim_start", "float64"), ("sim_finish", "float64"),
                ("deadline_met", "bool"), ("staleness", "int64")],
    # each round's wall seconds and its clients' phase (first dispatch to last update in): timing, which differs
    # between two runs of one config, kept here so that a checkpoint does not grow with the rounds
    "rounds": [("target", "string"), ("round", "int64"), ("seconds", "float64"), ("seconds_clients", "float64")],
    # only with privacy: (accountant.py): epsilon per group and in total after each round
    "privacy": [("target", "string"), ("round", "int64"), ("group", "string"), ("releases", "int64"),
                ("noise_multiplier", "float64"), ("clip", "float64"), ("epsilon", "float64"), ("delta", "float64")],
}


# the tables' columns that are wall time: two runs of one config differ in them and nowhere else in the tables
TIMING = ("seconds", "seconds_clients")


def table_schema(name: str):
    import pyarrow as pa

    return pa.schema([(col, pa.type_for_alias(t)) for col, t in TABLES[name]])


def _table(target: str, rows: Iterable[_Row], **extra: Any) -> list[dict]:
    return [dict(r.row(), target=target, **extra) for r in rows]


def client_rows(r: int, split: FederatedSplit, sampled: list[int], updates: dict[int, ClientUpdate],
                dropped: dict[int, str], retries: dict[int, int], ledger: Ledger,
                plan: RoundPlan | None = None) -> list[ClientRow]:
    """One ``ClientRow`` per sampled client; its bytes from the round's
    ledger.  On the device model's clock (``plan``), one per selected
    client: its simulated start and finish, whether it was aggregated
    (``deadline_met``), and why not (the plan's ``dropout``, ``deadline``,
    ``late``, or the task's failure)."""
    wire: dict[tuple[int, str], int] = {}
    for row in ledger.rows:
        wire[row.client, row.direction] = wire.get((row.client, row.direction), 0) + row.bytes
    sizes = split.client_sizes()
    rows = []
    for cid in sampled if plan is None else plan.selected:
        u = updates.get(cid)
        reason = dropped.get(cid) if plan is None else plan.reasons.get(cid, dropped.get(cid))
        rows.append(ClientRow(
            round=r, client=cid, domain=split.client_domains[cid],
            samples=int(u.num_samples if u is not None else sizes[cid]),
            local_steps=u.steps if u is not None else 0,
            train_loss=u.train_loss if u is not None else None, seconds=u.seconds if u is not None else None,
            bytes_up=wire.get((cid, "up"), 0), bytes_down=wire.get((cid, "down"), 0),
            retried=retries.get(cid, 0), dropped=u is None, drop_reason=reason,
            sim_start=None if plan is None else plan.start, sim_finish=None if plan is None else plan.finish[cid],
            deadline_met=None if plan is None else u is not None))
    return rows



def table_rows(target: str, out: RoundResult) -> dict[str, list[dict]]:
    """A round's rows of the run directory's tables, by table: where typed
    rows become plain ones and get their target (a dropped client is a
    ledger row of group ``dropped``; every metric row counts the round's
    drops)."""
    drops = [LedgerRow(d.round, d.client, "up", "dropped", 0, 0) for d in out.dropped]
    return {"metrics": _table(target, out.metrics, clients_dropped=len(out.dropped), sim_time=out.sim_time),
            "ledger": _table(target, out.ledger + drops), "clients": _table(target, out.clients),
            "rounds": [round_row(target, out.round, out.seconds_total, out.seconds_clients)]}


def round_row(target: str, round: int, seconds: float, seconds_clients: float) -> dict:
    """A row of the rounds table."""
    return {"target": target, "round": round, "seconds": seconds, "seconds_clients": seconds_clients}


def dropped_rows(target: str, ledger: Iterable[Mapping[str, Any]], clients: Iterable[Mapping[str, Any]]) -> list[dict]:
    """The clients whose training failed for good (``DropRow``s as plain rows),
    read back from one target's ledger rows (group ``dropped``) and clients
    rows (their ``drop_reason``)."""
    reasons = {(c["round"], c["client"]): c["drop_reason"] for c in clients if c["dropped"]}
    return [{"round": r["round"], "client": r["client"], "reason": reasons.get((r["round"], r["client"])),
             "target": target} for r in ledger if r["group"] == "dropped"]


def stage_rows(target: str, ledger: list[LedgerRow]) -> dict[str, list[dict]]:
    """The data stages' ledger rows (round 0) as table rows."""
    return {"ledger": _table(target, ledger)}


def split_means(rows: Iterable[Mapping[str, Any]], split: str) -> dict[int, float]:
    """{round: mean accuracy over the rows of ``split``} (means over domains,
    or clients for ``personal_val``) from one target's metrics table rows,
    by round: what selection, progress, reports and plots read."""
    per_round: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r["split"] == split:
            per_round[int(r["round"])].append(float(r["accuracy"]))
    return {rnd: sum(v) / len(v) for rnd, v in sorted(per_round.items())}


def split_mean(rows: Iterable[Mapping[str, Any]], split: str, round: int) -> float | None:
    """``split_means`` at one round; None when that round did not evaluate ``split``."""
    return split_means((r for r in rows if int(r["round"]) == round), split).get(round)
