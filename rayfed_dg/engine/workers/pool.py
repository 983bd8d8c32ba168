"""The worker pool: dispatch jobs to worker actors, retry, drop.

``map`` is an event loop over ``ray.wait``: it asks ``dispatch.py`` which
jobs go to which worker next (largest first, small jobs grouped, the round's
tail to idle workers only) and what a failure costs (charged, re-run alone
uncharged, dropped past ``retries``), and moves the work.  The rules, and
why no timing can change a job's attempts, are written there.

A worker whose process died is not sent anything until Ray has restarted it
(pinged every half second until it answers), waiting ``restart_timeout_s``,
whatever the load: a restart is minutes on a lost cloud node, seconds on a
busy laptop, and counting attempts cannot tell the two apart.  While the
autoscaler launches a node (``launching``, ``resources.autoscaler_launching``; asked every
``LAUNCH_POLL_S`` while a worker is away, and at least twice within
``restart_timeout_s``), the wait follows it: it ends
``restart_timeout_s`` after the last time a launch was seen, and never later
than ``replacement_timeout_s`` after the loss (``give_up_at``); a pool whose
every worker was lost waits so too, saying on stderr what it waits for.  A
worker past ``max_restarts`` is dead for good: it leaves the pool and its
jobs run on the others (no budget spent); with no worker left the run
stops.  A client whose training diverged stops the run (a
retry would diverge again: training is seeded); any other exception in
client code is a bug and is raised with its traceback.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import ray

from rayfed_dg.errors import EngineError

from .dispatch import Attempt, DispatchPlan, FailureLedger, Run, Verdict
from .faults import OWN_FAULTS, DivergedError, JobFailed

J = TypeVar("J", bound=Hashable)  # a job: a client id, or an evaluation chunk's key
Answer = Callable[[int, bool], None]  # a restarting worker answered: (worker, its process died)
Launching = Callable[[], str | None]  # what the autoscaler launches that could host a worker ("1 x gpu_worker")


def own_fault(err: Exception) -> bool:
    """An error the job's own code raised that a re-run may not repeat."""
    return isinstance(getattr(err, "cause", None), OWN_FAULTS)


SETTLE_S = 30.0  # how long a failing ``map`` waits for its other jobs before raising anyway
LAUNCH_POLL_S = 5.0  # the autoscaler's own update interval (on a cloud): asking more often learns nothing
SAY_EVERY_S = 60.0  # a line on stderr this often while workers are away


def give_up_at(lost_at: float, restart_timeout_s: float, replacement_timeout_s: float,
               launch_seen_at: float | None) -> float:
    """When a worker lost at ``lost_at`` leaves the pool: ``restart_timeout_s``
    after its loss or after the autoscaler was last seen launching a node
    that could host it (``launch_seen_at``), whichever is later, but never
    past ``replacement_timeout_s`` after the loss (nor before the first)."""
    end = lost_at + restart_timeout_s
    if launch_seen_at is None:
        return end
    return max(end, min(launch_seen_at + restart_timeout_s, lost_at + replacement_timeout_s))


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


def _apply(verdicts: list[Verdict], plan: DispatchPlan, on_result: Callable[[Any, Any], None]) -> None:
    """A retry goes to the queue's head; a dropped job's result is None."""
    for v in verdicts:
        if v.again is None:
            on_result(v.job, None)
        else:
            plan.requeue(v.again)


@dataclass
class _Recovery:
    lost_at: float
    next_ping: float = 0.0
    ping: Any = None  # the ObjectRef of the ping in flight
    died_once: bool = False  # a ping found the actor dead; a second one confirms it


@dataclass
class _Task:
    """A Ray task in flight: one job, or a group of them (``submit_many``)."""
    worker: int
    runs: list[Run]
    many: bool


def _send(worker: Any, group: list[Attempt], submit: Callable[[Any, Any, int], Any],
          submit_many: Callable[[Any, list[tuple[Any, int]]], Any] | None) -> Any:
    """The ObjectRef of a task carrying ``group`` to ``worker``: a list of
    jobs with ``submit_many``, else its one job."""
    if submit_many is not None:
        return submit_many(worker, [(q.job, q.attempt) for q in group])
    return submit(worker, group[0].job, group[0].attempt)


def _failed(task: _Task, err: Exception, ledger: FailureLedger,
            recover: Callable[[int], _Recovery | None]) -> list[Verdict]:
    """The verdicts on a task that raised: a diverged client stops the
    run, and an error that is neither a worker's death nor the job's
    own fault is a bug, raised.  ``recover(worker)`` starts waiting for a
    dead worker's restart (None: it is out of the pool)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, DivergedError):
        raise EngineError(str(cause)) from None
    reason = repr(err).splitlines()[0][:200]
    if isinstance(err, ray.exceptions.RayActorError):  # judged when the worker answers: did its process die?
        return ledger.worker_died(task.runs, reason, in_pool=recover(task.worker) is not None)
    if own_fault(err):
        return [ledger.charge(run, reason) for run in task.runs]
    raise err


def _waiting_line(lost: int, ready: int, waited: float, left: float, launch: str | None,
                  restart_timeout_s: float, replacement_timeout_s: float) -> str:
    """What a pool with ``lost`` workers away says on stderr now and then."""
    what = f"the autoscaler is launching {launch}" if launch is not None else "no node is being launched for them"
    return (f"rayfed-dg: waiting for {lost} lost worker(s) ({ready} others ready), "
            f"{waited:.0f} s so far; {what}; giving up in {max(0.0, left):.0f} s "
            f"(engine.worker_restart_timeout_s={restart_timeout_s:g}, "
            f"worker_replacement_timeout_s={replacement_timeout_s:g})")


class WorkerPool:
    PING_EVERY_S = 0.5  # while a worker restarts; a ping to a restarting actor fails at once

    def __init__(self, workers: list[Any], retries: int, restart_timeout_s: float = 300.0,
                 replacement_timeout_s: float = 1800.0, launching: Launching | None = None):
        self.workers = list(workers)
        self.pids: list[int] = ray.get([w.ping.remote() for w in self.workers])  # every worker up
        self.retries = retries
        self.restart_timeout_s = restart_timeout_s
        self.replacement_timeout_s = replacement_timeout_s
        self.launching = launching  # None: no autoscaler to follow
        self.launch: str | None = None  # what the autoscaler launched when last asked
        self.launch_seen_at: float | None = None  # when it was last seen launching
        self.next_poll = self.next_say = 0.0
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

    def add(self, workers: list[Any]) -> None:
        """More workers, between maps (placed after the ones already held)."""
        self.pids += ray.get([w.ping.remote() for w in workers])
        self.workers += workers

    def _ready(self) -> set[int]:
        """The workers that may be sent work: neither restarting nor dead."""
        return {w for w in range(len(self.workers)) if w not in self.dead and w not in self.recovering}

    def _recover(self, w: int) -> _Recovery | None:
        """Send no job to ``w`` until a ping says Ray has restarted it."""
        if w in self.dead:
            return None
        if w not in self.recovering:
            now = time.monotonic()
            if not self.recovering:  # the first worker away: ask the autoscaler now; speak when a plain wait would end
                self.next_poll, self.next_say = now, now + min(SAY_EVERY_S, self.restart_timeout_s)
            self.recovering[w] = _Recovery(lost_at=now)
        return self.recovering[w]

    def _deadline(self, rec: _Recovery) -> float:
        return give_up_at(rec.lost_at, self.restart_timeout_s, self.replacement_timeout_s, self.launch_seen_at)

    def _follow_autoscaler(self, now: float) -> None:
        """Ask the autoscaler what it launches (when due), and say now and
        then what the pool waits for."""
        if self.launching is not None and now >= self.next_poll:
            self.launch = self.launching()
            if self.launch is not None:
                self.launch_seen_at = now
            self.next_poll = now + min(LAUNCH_POLL_S, self.restart_timeout_s / 2)  # twice in a plain wait at least
        if now >= self.next_say:
            self.next_say = now + SAY_EVERY_S
            first = min(rec.lost_at for rec in self.recovering.values())
            end = max(self._deadline(rec) for rec in self.recovering.values())
            print(_waiting_line(len(self.recovering), len(self._ready()), now - first, end - now, self.launch,
                                self.restart_timeout_s, self.replacement_timeout_s), file=sys.stderr, flush=True)

    def _poll_recovering(self, answer: Answer) -> None:
        """Ping each restarting worker that has no ping out and is due; one
        past its deadline leaves the pool (its jobs run on the others), unless
        its answer already arrived (read it first: it may be from before a
        long pause between two maps)."""
        now = time.monotonic()
        if self.recovering:
            self._follow_autoscaler(now)
        for w, rec in list(self.recovering.items()):
            if now > self._deadline(rec):
                if rec.ping is not None and ray.wait([rec.ping], timeout=0)[0]:
                    self._pinged(w, answer)
                if w in self.recovering and now > self._deadline(self.recovering[w]):
                    self._leave(w, answer)
            elif rec.ping is None and now >= rec.next_ping:
                rec.ping = self.workers[w].ping.remote()

    def _leave(self, w: int, answer: Answer) -> None:
        self.recovering.pop(w)
        self.dead.add(w)
        self.restarted.add(w)
        answer(w, True)  # a job alone on it when it died is charged
        if len(self.dead) == len(self.workers):
            raise EngineError(f"every worker died and none came back (engine.max_restarts, "
                              f"engine.worker_restart_timeout_s={self.restart_timeout_s:g}, "
                              f"worker_replacement_timeout_s={self.replacement_timeout_s:g} while the autoscaler "
                              "launches nodes)")

    def _pinged(self, w: int, answer: Answer) -> None:
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
            self._leave(w, answer)
            return
        del self.recovering[w]
        died = pid != self.pids[w]
        self.pids[w] = pid
        if died:
            self.restarted.add(w)
        answer(w, died)  # a worker that answers with its old pid never died: the job was not at fault

    def _next_wake(self) -> float | None:
        """Seconds until a restarting worker is due a ping or past its
        deadline, or the autoscaler is due a question."""
        if not self.recovering:
            return None
        times = [t for rec in self.recovering.values() for t in ((self._deadline(rec),) if rec.ping else
                                                                 (self._deadline(rec), rec.next_ping))]
        times += [self.next_say] + ([self.next_poll] if self.launching is not None else [])
        return max(0.0, min(times) - time.monotonic()) + 0.01

    def _wait(self, inflight: list[Any], answer: Answer) -> Any:
        """The next task back, or None when a restarting worker was heard
        from (or is due a ping) first."""
        self._poll_recovering(answer)
        pings = {rec.ping: w for w, rec in self.recovering.items() if rec.ping is not None}
        waiting = inflight + list(pings)
        if not waiting:  # every worker restarting, none due a ping yet
            time.sleep(self._next_wake() or 0.0)
            return None
        ready, _ = ray.wait(waiting, num_returns=1, timeout=self._next_wake())
        if ready and ready[0] in pings:
            self._pinged(pings[ready[0]], answer)
            return None
        return ready[0] if ready else None

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
        plan = DispatchPlan(jobs, len(self.workers), len(self._ready()), cost, largest_first, submit_many is not None)
        ledger = FailureLedger(self.retries)
        self.last_retries = ledger.charged
        inflight: dict[Any, _Task] = {}
        try:
            while plan.queue or inflight or ledger.awaiting:
                while (step := plan.next(self._ready())) is not None:
                    runs = ledger.start(*step)
                    ref = _send(self.workers[step[0]], step[1], submit, submit_many if plan.grouping else None)
                    inflight[ref] = _Task(step[0], runs, many=plan.grouping)
                if not inflight and not self.recovering:
                    raise EngineError("no worker left in the pool")
                ref = self._wait(list(inflight), lambda w, died: _apply(ledger.answered(w, died), plan, on_result))
                if ref is None:
                    continue
                task = inflight.pop(ref)
                plan.done(task.worker)
                ledger.finish(task.runs)
                try:
                    res = ray.get(ref)
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
                    _apply(_failed(task, err, ledger, self._recover), plan, on_result)
                    continue
                for run, out in zip(task.runs, res if task.many else [res]):
                    if isinstance(out, JobFailed):
                        _apply([ledger.charge(run, out.error)], plan, on_result)
                    else:
                        on_result(run.job, out)
        except Exception:
            _settle(inflight)
            raise
        finally:  # the pool's counters span its life (the server resets them per federation)
            self.retried += ledger.retried
            self.reruns += ledger.reruns
        return ledger.dropped

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

    def ask_each(self, call: Callable[[Any], Any]) -> list[Any]:
        """``call(worker)`` (an ObjectRef) on every worker that takes work now:
        their answers, None from one whose process died meanwhile."""
        refs = [call(self.workers[w]) for w in sorted(self._ready())]
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                out.append(None)
        return out

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
