"""The worker pool: dispatch jobs to worker actors, retry, drop.

Jobs run on whichever worker is free, at most two in flight per worker (the
next one starts while the server is still folding in the previous result).
A job that fails with a retryable error (a dead worker, an injected fault,
out of memory) is re-submitted up to ``retries`` times, after Ray restarted
a dead worker (a lost worker backs off 0.25, 0.5, 1, ... up to 5 s per
attempt, so a lost node's workers have time to come back elsewhere); one
that keeps failing is reported as dropped.  A client
whose training diverged stops the run (a retry would diverge again: training
is seeded); any other exception in client code is a bug and is raised with
its traceback.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import ray
import torch

from rayfed_dg.errors import EngineError

from .worker import DivergedError, InjectedFault

IN_FLIGHT_PER_WORKER = 2
J = TypeVar("J", bound=Hashable)  # a job: a client id, or an evaluation chunk's key


def retryable(err: Exception) -> bool:
    if isinstance(err, ray.exceptions.RayActorError):
        return True
    cause = getattr(err, "cause", None)
    return isinstance(cause, (InjectedFault, torch.OutOfMemoryError, MemoryError))


SETTLE_S = 30.0  # how long a failing ``map`` waits for its other jobs before raising anyway


def _settle(inflight: dict[Any, Any]) -> None:
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


class WorkerPool:
    def __init__(self, workers: list[Any], retries: int):
        self.workers = list(workers)
        self.retries = retries
        self.retried = 0  # failed attempts that were retried, over the pool's life
        self.last_retries: dict[Any, int] = {}  # job -> its retries in the latest ``map``

    def map(self, jobs: Sequence[J], submit: Callable[[Any, J, int], Any],
            on_result: Callable[[J, Any], None]) -> list[tuple[J, str]]:
        """Run every job: ``submit(worker, job, attempt)`` returns an ObjectRef;
        ``on_result(job, result)`` is called as results arrive (in completion
        order), with ``None`` for a job dropped after its retries.  Returns the
        dropped jobs with a one-line reason."""
        queue: list[tuple[J, int, float]] = [(job, 0, 0.0) for job in jobs]  # (job, attempt, not before)
        free = [w for _ in range(IN_FLIGHT_PER_WORKER) for w in range(len(self.workers))]
        inflight: dict[Any, tuple[int, J, int]] = {}
        dropped: list[tuple[J, str]] = []
        self.last_retries = {}
        try:
            while queue or inflight:
                now = time.monotonic()
                while free and queue and min(q[2] for q in queue) <= now:
                    job, attempt, _ = queue.pop(next(i for i, q in enumerate(queue) if q[2] <= now))
                    w = free.pop(0)
                    inflight[submit(self.workers[w], job, attempt)] = (w, job, attempt)
                wait = max(0.0, min(q[2] for q in queue) - now) if queue and free else None
                if not inflight:
                    time.sleep(wait or 0.0)
                    continue
                ready, _ = ray.wait(list(inflight), num_returns=1, timeout=wait)
                if not ready:
                    continue
                ref = ready[0]
                w, job, attempt = inflight.pop(ref)
                free.append(w)
                try:
                    res = ray.get(ref)
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
                    cause = getattr(err, "cause", None)
                    if isinstance(cause, DivergedError):
                        raise EngineError(str(cause)) from None
                    if not retryable(err):
                        raise
                    if attempt < self.retries:
                        self.retried += 1
                        self.last_retries[job] = self.last_retries.get(job, 0) + 1
                        # a lost worker (its process or its node) takes Ray a moment to restart: back off
                        delay = min(5.0, 0.25 * 2 ** attempt) if isinstance(err, ray.exceptions.RayActorError) else 0.0
                        queue.insert(0, (job, attempt + 1, time.monotonic() + delay))
                    else:
                        dropped.append((job, repr(err).splitlines()[0][:200]))
                        on_result(job, None)
                    continue
                on_result(job, res)
        except Exception:
            _settle(inflight)
            raise
        return dropped

    def map_all(self, jobs: Sequence[J], submit: Callable[[Any, J, int], Any], what: str) -> dict[J, Any]:
        """``map`` where every job must succeed: {job: result}, or EngineError."""
        out: dict[J, Any] = {}

        def on_result(job: J, res: Any) -> None:
            if res is None:
                raise EngineError(f"{what} failed for {job} after {self.retries} retries")
            out[job] = res

        self.map(jobs, submit, on_result)
        return out

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
