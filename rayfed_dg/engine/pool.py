"""The worker pool: dispatch jobs to worker actors, retry, drop.

Jobs run on whichever worker is free, at most two tasks in flight per
worker (the next one starts while the server is still folding in the
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
  job re-runs uncharged).  A job
  that shared the worker re-runs alone ("solo": no other job is sent to that
  worker meanwhile) with the *same* attempt number and no budget spent; if it
  was the culprit it kills the worker again, alone, and is charged then.

So each job's sequence of attempts, and whether it is dropped, depends only
on its own seeded draws: exactly what the same job in exception mode, on one
worker, on a quiet machine would do.  Uncharged re-runs are counted apart
(``reruns``): like seconds, they describe the scheduling, not the result.

A worker whose process died is not sent anything until Ray has restarted it
(pinged every half second until it answers), waiting at most
``restart_timeout_s``, whatever the load: a restart is minutes on a lost
cloud node, seconds on a busy laptop, and counting attempts cannot tell
the two apart.  A worker past ``max_restarts`` is dead for good: it leaves
the pool and its jobs run on the others (no budget spent); with no worker
left the run stops.  A client whose training diverged stops the run (a
retry would diverge again: training is seeded); any other exception in
client code is a bug and is raised with its traceback.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray

from rayfed_dg.errors import EngineError

from .worker import OWN_FAULTS, DivergedError, JobFailed

IN_FLIGHT_PER_WORKER = 2
TASKS_PER_WORKER = 16  # tasks per worker per map when jobs are grouped: the tail's granularity is 1/16 of a share
MAX_GROUP = 64  # jobs in one task at most (their results are held together in the worker)
J = TypeVar("J", bound=Hashable)  # a job: a client id, or an evaluation chunk's key


def own_fault(err: Exception) -> bool:
    """An error the job's own code raised that a re-run may not repeat."""
    return isinstance(getattr(err, "cause", None), OWN_FAULTS)


SETTLE_S = 30.0  # how long a failing ``map`` waits for its other jobs before raising anyway


def _settle(inflight: Mapping[Any, Any]) -> None:
    """Fetch, and ignore, the jobs still in flight when ``map`` raises: an
    error nobody fetched is printed by Ray ("Unhandled error") when its ref is
    freed, after, and in the way of, the engine's own one-line message.  The
    wait is bounded (a job may hang, or wait for a worker Ray cannot place
    again): the real error must surface either way."""
    if not inflight:
        return
    done, _ = ray.wait(list(inflight), num_returns=len(inflight), timeout=SETTLE_S)
    for ref in done:
        try:
            ray.get(ref)
        except Exception:
            pass


@dataclass
class _Queued:
    job: Any
    attempt: int
    solo: bool = False  # re-run alone on its worker (it shared a worker that died)


@dataclass
class _Recovery:
    deadline: float
    next_ping: float = 0.0
    ping: Any = None  # the ObjectRef of the ping in flight
    died_once: bool = False  # a ping found the actor dead; a second one confirms it
    # jobs that failed alone on this worker: charged if its process really died (a new pid), else re-run
    verdicts: list = field(default_factory=list)


@dataclass
class _Running:
    worker: int
    job: Any
    attempt: int
    solo: bool
    alone: bool  # no other job was on its worker at any time while it was in flight
    error: str = ""


@dataclass
class _Task:
    """A Ray task in flight: one job, or a group of them (``submit_many``)."""
    worker: int
    runs: list[_Running]
    many: bool

    def share(self) -> None:
        for run in self.runs:
            run.alone = False


class WorkerPool:
    PING_EVERY_S = 0.5  # while a worker restarts; a ping to a restarting actor fails at once

    def __init__(self, workers: list[Any], retries: int, restart_timeout_s: float = 300.0):
        self.workers = list(workers)
        self.pids: list[int] = ray.get([w.ping.remote() for w in self.workers])  # every worker up
        self.retries = retries
        self.restart_timeout_s = restart_timeout_s
        self.dead: set[int] = set()  # workers past their restarts (or not back in time), out of the pool
        self.recovering: dict[int, _Recovery] = {}  # worker -> its restart, kept across maps
        self.restarted: set[int] = set()  # workers whose process died since ``replace`` last renewed them
        self.retried = 0  # charged failures that were retried, over the pool's life
        self.reruns = 0  # uncharged re-runs (a shared worker died, a worker left the pool): scheduling only
        self.last_retries: dict[Any, int] = {}  # job -> its charged retries in the latest ``map``

    # ------------------------------------------------------------- workers
    def replace(self, fresh: dict[int, Any]) -> None:
        """Put new actors in place of workers that died or restarted (their
        Ray restart budget is spent), so every federation of an experiment
        starts with whole budgets, as it did with actors of its own."""
        for w, actor in fresh.items():
            self.workers[w] = actor
            self.dead.discard(w)
            self.recovering.pop(w, None)
        if fresh:
            for w, pid in zip(fresh, ray.get([self.workers[w].ping.remote() for w in fresh])):
                self.pids[w] = pid
        self.restarted -= set(fresh)

    def _usable(self, w: int) -> bool:
        return w not in self.dead and w not in self.recovering

    def _recover(self, w: int) -> _Recovery | None:
        """Send no job to ``w`` until a ping says Ray has restarted it."""
        if w in self.dead:
            return None
        if w not in self.recovering:
            self.recovering[w] = _Recovery(deadline=time.monotonic() + self.restart_timeout_s)
        return self.recovering[w]

    def _poll_recovering(self, judge: Callable[[_Running, bool], None]) -> None:
        """Ping each restarting worker that has no ping out and is due; one
        past its deadline leaves the pool (its jobs run on the others), unless
        its answer already arrived (read it first: it may be from before a
        long pause between two maps)."""
        now = time.monotonic()
        for w, rec in list(self.recovering.items()):
            if now > rec.deadline:
                if rec.ping is not None and ray.wait([rec.ping], timeout=0)[0]:
                    self._pinged(w, judge)
                if w in self.recovering and now > self.recovering[w].deadline:
                    self._leave(w, judge)
            elif rec.ping is None and now >= rec.next_ping:
                rec.ping = self.workers[w].ping.remote()

    def _leave(self, w: int, judge: Callable[[_Running, bool], None]) -> None:
        rec = self.recovering.pop(w)
        self.dead.add(w)
        self.restarted.add(w)
        for run in rec.verdicts:
            judge(run, True)  # it was alone on a worker that died
        if len(self.dead) == len(self.workers):
            raise EngineError(f"every worker died and none came back (engine.max_restarts, "
                              f"engine.worker_restart_timeout_s={self.restart_timeout_s:g})")

    def _pinged(self, w: int, judge: Callable[[_Running, bool], None]) -> None:
        rec = self.recovering[w]
        ref, rec.ping = rec.ping, None
        try:
            pid = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:  # still restarting (or not placed yet): ask again soon
            rec.next_ping = time.monotonic() + self.PING_EVERY_S
            return
        except ray.exceptions.RayActorError:  # past max_restarts: dead for good (asked twice to be sure)
            if not rec.died_once:
                rec.died_once, rec.next_ping = True, time.monotonic() + self.PING_EVERY_S
                return
            self._leave(w, judge)
            return
        del self.recovering[w]
        died = pid != self.pids[w]
        self.pids[w] = pid
        if died:
            self.restarted.add(w)
        for run in rec.verdicts:
            judge(run, died)  # a worker that answers with its old pid never died: the job was not at fault

    def _next_wake(self) -> float | None:
        """Seconds until a restarting worker is due a ping or past its deadline."""
        times = [t for rec in self.recovering.values() for t in ((rec.deadline,) if rec.ping else
                                                                 (rec.deadline, rec.next_ping))]
        return max(0.0, min(times) - time.monotonic()) + 0.01 if times else None

    def _pick(self, load: list[int], solo_on: set[int], solo: bool) -> int | None:
        """The least-loaded usable worker with room (lowest index on ties)."""
        room = [w for w in range(len(self.workers)) if self._usable(w) and w not in solo_on
                and load[w] < (1 if solo else IN_FLIGHT_PER_WORKER) and (not solo or load[w] == 0)]
        return min(room, key=lambda w: (load[w], w)) if room else None

    # ---------------------------------------------------------------- jobs
    def map(self, jobs: Sequence[J], submit: Callable[[Any, J, int], Any],
            on_result: Callable[[J, Any], None], cost: Mapping[J, float] | None = None,
            largest_first: bool = True,
            submit_many: Callable[[Any, list[tuple[J, int]]], Any] | None = None) -> list[tuple[J, str]]:
        """Run every job: ``submit(worker, job, attempt)`` returns an ObjectRef;
        ``on_result(job, result)`` is called as results arrive (in completion
        order), with ``None`` for a job dropped after its retries.  ``cost``
        (e.g. a client's sample count) dispatches the largest jobs first
        (unless ``largest_first`` is False) and, with ``submit_many(worker,
        [(job, attempt), ...])`` (an ObjectRef of one result or ``JobFailed``
        per job, as ``run_each`` gives), sends small jobs in groups.
        Returns the dropped jobs with a one-line reason."""
        order = list(jobs) if cost is None or not largest_first else sorted(jobs, key=lambda j: -cost[j])
        queue = [_Queued(job, 0) for job in order]  # stable sort: ties keep the given order
        usable = sum(self._usable(w) for w in range(len(self.workers))) or 1
        group_cost = (sum(cost[j] for j in jobs) / (TASKS_PER_WORKER * usable)
                      if cost is not None and submit_many is not None else 0.0)
        load = [0] * len(self.workers)
        solo_on: set[int] = set()
        inflight: dict[Any, _Task] = {}
        dropped: list[tuple[J, str]] = []
        self.last_retries = {}

        def judge(run: _Running, charged: bool) -> None:
            """A failed job's fate: charged (next attempt, or dropped past the
            budget) or re-run alone with the same attempt."""
            if not charged:
                self.reruns += 1
                queue.insert(0, _Queued(run.job, run.attempt, solo=True))
            elif run.attempt < self.retries:
                self.retried += 1
                self.last_retries[run.job] = self.last_retries.get(run.job, 0) + 1
                queue.insert(0, _Queued(run.job, run.attempt + 1))
            else:
                dropped.append((run.job, run.error))
                on_result(run.job, None)

        def take(left: float) -> list[_Queued]:
            """The queue's head, and the jobs after it that fit its group;
            ``left``: the queue's cost."""
            # guided self-scheduling: a group holds at most 1 / (2 x workers) of what is left, so the
            # groups shrink to single clients at the round's end and no worker finishes far behind
            limit = min(group_cost, left / (2 * usable)) if group_cost > 0 else 0.0
            group = [queue.pop(0)]
            if group[0].solo or cost is None or cost[group[0].job] >= limit:
                return group
            total = cost[group[0].job]
            while (queue and not queue[0].solo and len(group) < MAX_GROUP
                   and total + cost[queue[0].job] <= limit):
                total += cost[queue[0].job]
                group.append(queue.pop(0))
            return group

        def waiting_verdict() -> bool:
            return any(rec.verdicts for rec in self.recovering.values())

        try:
            while queue or inflight or waiting_verdict():
                # first in, first out; a solo job at the head waits for an idle worker and holds the queue
                while queue:
                    pick = self._pick(load, solo_on, queue[0].solo)
                    if pick is None:
                        break
                    w = pick
                    left = sum(cost[q.job] for q in queue) if cost is not None else 0.0  # once per dispatch
                    group = take(left)
                    if load[w] and usable > 1 and cost is not None:
                        g = sum(cost[q.job] for q in group)
                        if left - g < usable * g:
                            queue[:0] = group  # the round's tail goes to idle workers only (see the docstring)
                            break
                    for task in inflight.values():
                        if task.worker == w:
                            task.share()
                    runs = [_Running(w, q.job, q.attempt, q.solo, alone=load[w] == 0 and len(group) == 1)
                            for q in group]
                    if group_cost > 0 and submit_many is not None:
                        ref = submit_many(self.workers[w], [(q.job, q.attempt) for q in group])
                    else:
                        ref = submit(self.workers[w], group[0].job, group[0].attempt)
                    inflight[ref] = _Task(w, runs, many=group_cost > 0)
                    load[w] += 1
                    if group[0].solo:
                        solo_on.add(w)
                if not inflight and not self.recovering:
                    raise EngineError("no worker left in the pool")
                self._poll_recovering(judge)
                pings = {rec.ping: w for w, rec in self.recovering.items() if rec.ping is not None}
                waiting = list(inflight) + list(pings)
                if not waiting:  # every worker restarting, none due a ping yet
                    time.sleep(self._next_wake() or 0.0)
                    continue
                ready, _ = ray.wait(waiting, num_returns=1, timeout=self._next_wake())
                if not ready:
                    continue
                ref = ready[0]
                if ref in pings:
                    self._pinged(pings[ref], judge)
                    continue
                task = inflight.pop(ref)
                load[task.worker] -= 1
                solo_on.discard(task.worker)
                try:
                    res = ray.get(ref)
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
                    cause = getattr(err, "cause", None)
                    if isinstance(cause, DivergedError):
                        raise EngineError(str(cause)) from None
                    for run in task.runs:
                        run.error = repr(err).splitlines()[0][:200]
                        if isinstance(err, ray.exceptions.RayActorError):
                            rec = self._recover(task.worker)
                            if rec is not None and run.alone:
                                rec.verdicts.append(run)  # judged when the worker answers: did its process die?
                            else:  # it shared the worker that died (or the worker left the pool): not its failure
                                judge(run, False)
                        elif own_fault(err):
                            judge(run, True)
                        else:
                            raise
                    continue
                for run, out in zip(task.runs, res if task.many else [res]):
                    if isinstance(out, JobFailed):
                        run.error = out.error
                        judge(run, True)
                    else:
                        on_result(run.job, out)
        except Exception:
            _settle(inflight)
            raise
        return dropped

    def map_all(self, jobs: Sequence[J], submit: Callable[[Any, J, int], Any], what: str,
                cost: Mapping[J, float] | None = None) -> dict[J, Any]:
        """``map`` where every job must succeed: {job: result}, or EngineError."""
        out: dict[J, Any] = {}

        def on_result(job: J, res: Any) -> None:
            if res is None:
                raise EngineError(f"{what} failed for {job} after {self.retries} retries")
            out[job] = res

        self.map(jobs, submit, on_result, cost)
        return out

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
