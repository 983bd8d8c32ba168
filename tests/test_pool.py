"""The worker pool on local Ray: a diverged client stops ``map`` with the
engine's error, after fetching the other jobs in flight, and never waits
without bound for a job that hangs."""
import time

import pytest

from rayfed_dg.engine import pool as pool_mod
from rayfed_dg.engine.pool import WorkerPool
from rayfed_dg.errors import EngineError


def _actor_class(ray):
    @ray.remote(num_cpus=0)
    class Job:
        def ping(self):
            import os

            return os.getpid()

        def run(self, what: str, seconds: float = 0.0):
            from rayfed_dg.engine.worker import DivergedError

            time.sleep(seconds)
            if what == "diverge":
                raise DivergedError(f"client {seconds} diverged")
            return what

    return Job


def test_a_diverged_job_raises_after_settling_the_others_and_a_hung_one_is_not_awaited(ray_session, monkeypatch):
    ray = ray_session
    job = _actor_class(ray)
    a, b = job.remote(), job.remote()
    try:
        ray.get([a.run.remote("ready"), b.run.remote("ready")])  # actor start-up stays out of the timings
        # job 0 diverges at once; job 1 diverges 2 s later: map fetches it before raising
        pool = WorkerPool([a, b], retries=0)
        plan = {0: ("diverge", 0.0), 1: ("diverge", 2.0)}
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="client 0.0 diverged"):
            pool.map([0, 1], lambda w, j, attempt: w.run.remote(*plan[j]), lambda j, r: None)
        assert time.monotonic() - t0 >= 2.0  # it waited for the other job rather than leaving its error unread
        # a job that hangs is waited for SETTLE_S at most, then the real error surfaces anyway
        monkeypatch.setattr(pool_mod, "SETTLE_S", 1.0)
        c = job.remote()
        ray.get(c.run.remote("ready"))
        pool = WorkerPool([a, c], retries=0)
        plan = {0: ("diverge", 0.5), 1: ("ok", 600.0)}
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="diverged"):
            pool.map([0, 1], lambda w, j, attempt: w.run.remote(*plan[j]), lambda j, r: None)
        assert time.monotonic() - t0 < 20
    finally:
        for h in (a, b):
            ray.kill(h)
        if "c" in locals():
            ray.kill(c)
