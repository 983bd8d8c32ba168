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


def test_a_worker_not_back_in_time_leaves_the_pool_and_its_lone_job_is_charged_once(ray_session, tmp_path):
    ray = ray_session
    marker = str(tmp_path / "started")

    @ray.remote(num_cpus=0, max_restarts=1, max_task_retries=0)
    class Slow:
        def __init__(self, marker: str):
            import os

            if os.path.exists(marker):  # a restart: far slower than the pool's timeout
                time.sleep(60)
            open(marker, "w").close()

        def ping(self):
            import os

            return os.getpid()

        def run(self, job: int, attempt: int):
            import os

            if job == 0 and attempt == 0:
                os._exit(1)  # the job's own first attempt kills its worker
            return job, attempt

    @ray.remote(num_cpus=0)
    class Fine:
        def ping(self):
            import os

            return os.getpid()

        def run(self, job: int, attempt: int):
            time.sleep(0.2)
            return job, attempt

    slow, fine = Slow.remote(marker), Fine.remote()
    try:
        pool = WorkerPool([slow, fine], retries=2, restart_timeout_s=3.0)
        got = {}
        t0 = time.monotonic()
        dropped = pool.map([0], lambda w, j, attempt: w.run.remote(j, attempt), got.__setitem__)
        assert dropped == [] and got == {0: (0, 1)}  # charged once: its second attempt ran on the other worker
        assert pool.dead == {0} and pool.retried == 1 and pool.reruns == 0
        assert time.monotonic() - t0 < 30  # it left at the timeout, not after the 60 s restart
    finally:
        for h in (slow, fine):
            ray.kill(h)
