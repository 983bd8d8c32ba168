"""The worker pool's policy, apart from Ray: which jobs go to which worker
next (``DispatchPlan``) and what a failure costs the job that had it
(``FailureLedger``).  Plain objects over job ids, costs and worker indices:
``pool.py`` moves the work and asks these two what to do.

Dispatch.  Jobs run on whichever worker is free, at most two tasks in flight
per worker (the next one starts while the server is still folding in the
previous result), in the order given, or largest first (longest-processing-
time-first list scheduling: a large client dispatched last would leave the
other workers idle at the end of the round).  A task waiting behind another
on a busy worker is committed to it before anyone knows which worker frees
first, so with job costs known (and two workers or more) the second task
goes out only while the queue behind it holds at least ``workers`` times its
cost: the round's tail is handed to workers as they become idle (list
scheduling proper), and a worker that finishes early never watches another
one's queued task.

Small jobs travel together.  A Ray task costs about a millisecond of
submission, argument and result handling whatever it carries, which is
the whole cost of a client that trains in a few milliseconds (cross-device
partitions, a fast GPU).  When the caller can run several jobs in one task
(``submit_many``) and gives each job a cost, consecutive jobs of the
dispatch order are grouped until a group holds ``1 / (TASKS_PER_WORKER x
workers)`` of the map's total cost, and at most ``1 / (2 x workers)`` of
the cost still queued (guided self-scheduling: the last groups are single
clients); a job larger than that goes alone, so the large clients that
decide the makespan are scheduled one by one and the small tail in tasks of
many.  Grouping changes which process runs a job,
never what it computes (every job is seeded by its own ids).

Retry accounting that no timing can change.  A job's *attempt* number seeds
what it does (fault injection is drawn per attempt), and its retry budget
(``retries``) decides whether it is dropped, so both may only count failures
the job itself caused:

* an error raised by the job's own code (an injected fault, out of memory)
  is the job's: charged, and re-submitted with the next attempt number;
* a worker process that dies fails every job in flight on it, and which jobs
  shared the dying worker is a matter of timing.  A job that was alone on
  its worker from submission to failure caused the death: charged, once a
  ping shows the worker's process was really replaced (a new pid; an
  unreachable worker that answers with its old pid was no death, and the
  job re-runs uncharged), or once the worker left the pool.  A job
  that shared the worker re-runs alone ("solo": no other job is sent to that
  worker meanwhile) with the *same* attempt number and no budget spent; if it
  was the culprit it kills the worker again, alone, and is charged then.  A
  job on a worker that had already left the pool re-runs the same way.

So each job's sequence of attempts, and whether it is dropped, depends only
on its own seeded draws: exactly what the same job in exception mode, on one
worker, on a quiet machine would do.  Uncharged re-runs are counted apart
(``reruns``): like seconds, they describe the scheduling, not the result.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

IN_FLIGHT_PER_WORKER = 2
TASKS_PER_WORKER = 16  # tasks per worker per map when jobs are grouped: the tail's granularity is 1/16 of a share
MAX_GROUP = 64  # jobs in one task at most (their results are held together in the worker)


@dataclass
class Attempt:
    """A queued job and the attempt number that seeds it."""
    job: Any
    attempt: int
    solo: bool = False  # re-run alone on its worker (it shared a worker that died)


@dataclass(eq=False)  # runs are told apart by identity: the same attempt may run again after a death
class Run:
    """A job in flight on a worker."""
    worker: int
    job: Any
    attempt: int
    alone: bool  # no other job was on its worker at any time while it was in flight


@dataclass(frozen=True)
class Verdict:
    """A failed job's fate: ``again`` goes to the queue's head, or the job is
    dropped (``again`` None) for ``reason``."""
    job: Any
    again: Attempt | None
    reason: str = ""


class DispatchPlan:
    """One map's queue and what each worker has in flight: ``next`` names
    the worker that gets a task now and the jobs it carries; ``done`` and
    ``requeue`` say what came back."""

    def __init__(self, jobs: Sequence[Any], workers: int, usable: int, cost: Mapping[Any, float] | None = None,
                 largest_first: bool = True, grouped: bool = False):
        """``workers``: the pool's size; ``usable``: how many of them take
        work at the map's start (the group and tail limits share the cost
        among them); ``grouped``: several jobs may travel in one task."""
        order = list(jobs) if cost is None or not largest_first else sorted(jobs, key=lambda j: -cost[j])
        self.queue = [Attempt(job, 0) for job in order]  # stable sort: ties keep the given order
        self.cost = cost
        self.usable = usable or 1
        self.group_cost = (sum(cost[j] for j in jobs) / (TASKS_PER_WORKER * self.usable)
                           if cost is not None and grouped else 0.0)
        self.load = [0] * workers  # tasks in flight per worker
        self.solo_on: set[int] = set()  # workers running a solo job: nothing else goes there meanwhile

    @property
    def grouping(self) -> bool:
        """Tasks carry a list of jobs (``submit_many``), even when one."""
        return self.group_cost > 0

    def next(self, ready: Collection[int]) -> tuple[int, list[Attempt]] | None:
        """The worker to send a task now and its jobs (taken off the queue),
        or None: nothing goes out until a task comes back.  First in, first
        out; a solo job at the head waits for an idle worker and holds the
        queue.  ``ready``: the workers that may be sent work now."""
        if not self.queue:
            return None
        w = self._pick(ready, self.queue[0].solo)
        if w is None:
            return None
        left = sum(self.cost[q.job] for q in self.queue) if self.cost is not None else 0.0
        group = self._take(left)
        if self.load[w] and self.usable > 1 and self.cost is not None:
            g = sum(self.cost[q.job] for q in group)
            if left - g < self.usable * g:  # the round's tail goes to idle workers only
                self.queue[:0] = group
                return None
        self.load[w] += 1
        if group[0].solo:
            self.solo_on.add(w)
        return w, group

    def done(self, worker: int) -> None:
        """A task of ``worker`` came back (results or failure)."""
        self.load[worker] -= 1
        self.solo_on.discard(worker)

    def requeue(self, attempt: Attempt) -> None:
        self.queue.insert(0, attempt)

    def _pick(self, ready: Collection[int], solo: bool) -> int | None:
        """The least-loaded ready worker with room (lowest index on ties); a
        solo job only an idle one."""
        room = [w for w in range(len(self.load)) if w in ready and w not in self.solo_on
                and self.load[w] < (1 if solo else IN_FLIGHT_PER_WORKER)]
        return min(room, key=lambda w: (self.load[w], w)) if room else None

    def _take(self, left: float) -> list[Attempt]:
        """The queue's head, and the jobs after it that fit its group;
        ``left``: the queue's cost."""
        # guided self-scheduling: a group holds at most 1 / (2 x workers) of what is left, so the
        # groups shrink to single clients at the round's end and no worker finishes far behind
        limit = min(self.group_cost, left / (2 * self.usable)) if self.group_cost > 0 else 0.0
        group = [self.queue.pop(0)]
        cost = self.cost
        if group[0].solo or cost is None or cost[group[0].job] >= limit:
            return group
        total = cost[group[0].job]
        while (self.queue and not self.queue[0].solo and len(group) < MAX_GROUP
               and total + cost[self.queue[0].job] <= limit):
            total += cost[self.queue[0].job]
            group.append(self.queue.pop(0))
        return group


class FailureLedger:
    """One map's failures: which jobs shared a worker, what each failure is
    charged, and the verdicts (retry with the next attempt, re-run alone with
    the same one, drop past ``retries``)."""

    def __init__(self, retries: int):
        self.retries = retries
        self.retried = 0  # charged failures that were retried
        self.reruns = 0  # uncharged re-runs
        self.charged: dict[Any, int] = {}  # job -> its charged retries
        self.dropped: list[tuple[Any, str]] = []  # (job, reason) past its retries
        self.on: dict[int, list[Run]] = {}  # worker -> the runs in flight on it
        # worker -> the runs that failed alone on it, with their reason: judged when it answers a ping
        self.pending: dict[int, list[tuple[Run, str]]] = {}

    def start(self, worker: int, group: list[Attempt]) -> list[Run]:
        """A task carrying ``group`` goes to ``worker``: its runs, and every
        run already there no longer alone."""
        here = self.on.setdefault(worker, [])
        for run in here:
            run.alone = False
        runs = [Run(worker, q.job, q.attempt, alone=not here and len(group) == 1) for q in group]
        here.extend(runs)
        return runs

    def finish(self, runs: list[Run]) -> None:
        """Their task came back."""
        for run in runs:
            self.on[run.worker].remove(run)

    def charge(self, run: Run, reason: str) -> Verdict:
        """The job's own code failed."""
        return self._judge(run, True, reason)

    def worker_died(self, runs: list[Run], reason: str, in_pool: bool) -> list[Verdict]:
        """The worker process running ``runs`` died (``in_pool``: it is
        restarting, not gone).  A run alone on it waits for ``answered``; the
        others re-run alone, uncharged."""
        out = []
        for run in runs:
            if in_pool and run.alone:
                self.pending.setdefault(run.worker, []).append((run, reason))
            else:
                out.append(self._judge(run, False, reason))
        return out

    def answered(self, worker: int, died: bool) -> list[Verdict]:
        """``worker`` is back (``died``: with a new pid), or left the pool
        (``died`` True): the verdicts on the runs that failed alone on it."""
        return [self._judge(run, died, reason) for run, reason in self.pending.pop(worker, [])]

    @property
    def awaiting(self) -> bool:
        """Some failure waits for its worker's answer."""
        return any(self.pending.values())

    def _judge(self, run: Run, charged: bool, reason: str) -> Verdict:
        if not charged:
            self.reruns += 1
            return Verdict(run.job, Attempt(run.job, run.attempt, solo=True))
        if run.attempt < self.retries:
            self.retried += 1
            self.charged[run.job] = self.charged.get(run.job, 0) + 1
            return Verdict(run.job, Attempt(run.job, run.attempt + 1))
        self.dropped.append((run.job, reason))
        return Verdict(run.job, None, reason)
