"""Which federations of an experiment run at once, and on how many workers.

An experiment is a list of federations (seed x row x target) and the cluster
fits ``slots`` worker actors.  A federation's rounds are the unit of time: a
round trains its clients on the federation's workers, largest first (the
pool's own dispatch), so a round on ``w`` workers lasts as long as the most
loaded of them (``FedJob.round_time``).  The rule, which the driver follows
(``experiment.py``) and ``simulate`` replays on estimated or measured costs
(``bench/schedule_sim.py``):

1. Order: longest expected work first (Graham's LPT list scheduling), the
   key breaking ties, so the order never depends on the cluster.
2. Width: every federation starts on the same number of workers ``w``
   (capped at its clients per round), ``engine.num_workers`` when set, else
   the candidate 1..max clients per round whose simulated makespan is the
   shortest (ties: the smaller ``w``, more federations at once).  Narrow
   federations waste nothing while many wait; wide ones leave no long
   federation alone at the end.
3. Start: the next federation starts as soon as ``w`` workers are free
   (and fewer than ``max_running``, ``engine.concurrent_federations``, run).
4. Grow: once none waits, free workers join running federations between
   rounds (a worker added during a round serves from the next one): one at a
   time, to the federation with the longest expected remaining time, as long
   as one more worker shortens its rounds.

Which worker trains which client never changes a number (the engine's sums
do not depend on it), so the rule is free to use any width; it only moves
the makespan.
"""
from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class FedJob:
    key: Hashable  # the driver's name for the federation, e.g. (seed, label, target)
    round_clients: tuple[float, ...]  # expected cost of each client a round trains
    rounds: int

    @property
    def max_workers(self) -> int:
        return max(1, len(self.round_clients))  # more workers than a round's clients idle

    @property
    def work(self) -> float:
        return self.rounds * sum(self.round_clients)

    @cached_property
    def _sorted(self) -> tuple[float, ...]:
        return tuple(sorted(self.round_clients, reverse=True))

    def round_time(self, workers: int) -> float:
        """A round's clients, largest first, each to the least loaded of ``workers``: the longest load."""
        loads = [0.0] * max(1, min(workers, self.max_workers))
        for c in self._sorted:
            heapq.heapreplace(loads, loads[0] + c)
        return max(loads)


@dataclass
class Plan:
    order: list[Hashable]  # the order federations start in
    width: dict[Hashable, int]  # workers each starts with


def fed_job(key: Hashable, cfg, split) -> FedJob:
    """A federation's expected cost from its config: samples stepped per client
    (``local_steps`` x batch, or ``local_epochs`` x its size) for the clients
    one round trains (every client, or ``clients_per_round`` of mean size)."""
    from .plan import clients_per_round

    t = cfg.training
    sizes = [float(s) for s in split.client_sizes()]
    cost = [float(t.local_steps * t.batch_size) if t.local_steps is not None else t.local_epochs * s for s in sizes]
    k = clients_per_round(cfg, split)
    if k < len(cost):
        cost = [sum(cost) / len(cost)] * k
    return FedJob(key, tuple(cost), t.rounds)


def _ordered(jobs: Sequence[FedJob]) -> list[FedJob]:
    return sorted(jobs, key=lambda j: (-j.work, repr(j.key)))


def plan(jobs: Sequence[FedJob], slots: int, max_running: int | None = None, width: int | None = None) -> Plan:
    """Order and starting widths (rules 1 and 2)."""
    if slots < 1:
        raise ValueError(f"slots={slots}: the cluster must fit at least one worker")
    ordered = _ordered(jobs)
    if width is None:
        widest = min(slots, max((j.max_workers for j in jobs), default=1))
        width = min(range(1, widest + 1), key=lambda w: (simulate(jobs, slots, max_running, w).makespan, w))
    return Plan([j.key for j in ordered], {j.key: max(1, min(width, j.max_workers, slots)) for j in ordered})


def grow(running: Mapping[Hashable, tuple[FedJob, int, int]], free: int) -> dict[Hashable, int]:
    """Rule 4: extra workers for running federations, ``running`` mapping each
    to (its job, its workers, its rounds still to start: those a worker added
    now can serve); ``free`` idle workers."""
    width = {k: w for k, (_, w, _) in running.items()}
    extra: dict[Hashable, int] = {}
    while free > 0:
        best, best_left = None, -1.0
        for k in sorted(running, key=repr):
            job, _, left = running[k]
            w = width[k]
            if left > 0 and w < job.max_workers and job.round_time(w + 1) < job.round_time(w):
                remaining = left * job.round_time(w)
                if remaining > best_left:
                    best, best_left = k, remaining
        if best is None:
            break
        width[best] += 1
        extra[best] = extra.get(best, 0) + 1
        free -= 1
    return extra


@dataclass
class Schedule:
    makespan: float
    ideal: float  # total work / slots: no schedule ends sooner
    start: dict[Hashable, float] = field(default_factory=dict)
    end: dict[Hashable, float] = field(default_factory=dict)
    widths: dict[Hashable, list[int]] = field(default_factory=dict)  # each federation's workers, round by round
    most_running: int = 0

    @property
    def ratio(self) -> float:
        return self.makespan / self.ideal if self.ideal > 0 else 1.0


def simulate(jobs: Sequence[FedJob], slots: int, max_running: int | None = None, width: int | None = None
             ) -> Schedule:
    """The rule replayed on the jobs' costs (one worker does one cost unit a
    second): when each federation starts and ends, and the makespan.  With
    ``width`` None the rule's own choice (``plan``)."""
    p = plan(jobs, slots, max_running, width)
    by_key = {j.key: j for j in jobs}
    queue = list(p.order)
    free, now = slots, 0.0
    out = Schedule(0.0, sum(j.work for j in jobs) / slots)
    workers: dict[Hashable, int] = {}  # running federation -> its workers (those added mid-round included)
    left: dict[Hashable, int] = {}  # rounds not yet ended
    events: list[tuple[float, str, Hashable]] = []  # (time its round ends, tie-break, federation)

    def start_round(k: Hashable) -> None:
        out.widths[k].append(workers[k])
        heapq.heappush(events, (now + by_key[k].round_time(workers[k]), repr(k), k))

    while True:
        while queue and free >= p.width[queue[0]] and (max_running is None or len(workers) < max_running):
            k = queue.pop(0)
            workers[k], left[k], out.start[k], out.widths[k] = p.width[k], by_key[k].rounds, now, []
            free -= p.width[k]
            start_round(k)
        out.most_running = max(out.most_running, len(workers))
        if not queue and free > 0:
            for k, n in grow({k: (by_key[k], workers[k], left[k] - 1) for k in workers}, free).items():
                workers[k] += n
                free -= n
        if not events:
            break
        now, _, k = heapq.heappop(events)
        left[k] -= 1
        if left[k] > 0:
            start_round(k)
            continue
        out.end[k] = now
        free += workers.pop(k)
    out.makespan = max(out.end.values(), default=0.0)
    return out
