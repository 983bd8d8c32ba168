"""The worker pool on local Ray: a diverged client stops ``map`` with the
engine's error, after fetching the other jobs in flight, and never waits
without bound for a job that hangs; the round's tail goes out in ever smaller
groups, to idle workers only; the wait for a lost worker follows the
autoscaler's launches (``give_up_at``, by hand; a pool whose only worker was
lost waits for it while a launch is seen), read from canned autoscaler v1
reports and v2 cluster statuses, and asked only when the autoscaler is
followed (``server.follow_autoscaler``)."""
import json
import time

import pytest

from rayfed_dg.engine.workers import pool as pool_mod
from rayfed_dg.engine.workers.pool import WorkerPool, give_up_at
from rayfed_dg.errors import EngineError


def _actor_class(ray):
    @ray.remote(num_cpus=0)
    class Job:
        def ping(self):
            import os

            return os.getpid()

        def run(self, what: str, seconds: float = 0.0):
            from rayfed_dg.engine.workers.worker import DivergedError

            time.sleep(seconds)
            if what == "diverge":
                raise DivergedError(f"client {seconds} diverged")
            return what

        def run_many(self, jobs: list, seconds_per_cost: float, cost: dict):
            time.sleep(seconds_per_cost * sum(cost[j] for j, _ in jobs))
            return [j for j, _ in jobs]

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


def test_the_round_tail_goes_out_in_shrinking_groups_to_idle_workers_only(ray_session):
    """Largest first, small jobs grouped up to 1/32 of the map's cost (16
    tasks per worker, 2 workers) and to 1/4 of the cost still queued (guided
    self-scheduling); a second task is queued behind a running one only while
    the queue behind it holds at least twice its cost (dispatch.py).  Group
    compositions depend on the queue alone, so they are fixed whatever the
    timing: computed by hand below."""
    ray = ray_session
    job = _actor_class(ray)
    workers = [job.remote(), job.remote()]
    try:
        cost = {0: 10.0, 1: 40.0, 2: 20.0, 3: 30.0, **{j: 1.0 for j in range(4, 34)}}  # 130 in all
        pool = WorkerPool(workers, retries=0)
        sent, inflight, done = [], {0: 0, 1: 0}, []
        where: dict[int, int] = {}

        def submit_many(w, jobs):
            i = workers.index(w)
            group = [j for j, _ in jobs]
            left = sum(cost.values()) - sum(cost[j] for g, _ in sent for j in g) - sum(cost[j] for j in group)
            sent.append((group, (inflight[i], left)))
            inflight[i] += 1
            for j in group:
                where[j] = i
            return w.run_many.remote(jobs, 0.01, cost)

        def on_result(j, r):
            assert r == j
            done.append(j)
            if all(x in done for x in next(g for g, _ in sent if j in g)):
                inflight[where[j]] -= 1

        assert pool.map(list(cost), None, on_result, cost=cost, submit_many=submit_many) == []
        assert sorted(done) == list(range(34))
        # 1/32 of 130 = 4.06; 1/4 of what is queued: 30 -> 7.5, 26 -> 6.5, 22 -> 5.5, 18 -> 4.5 (4 jobs each), 14 ->
        # 3.5 (3), 11 -> 2.75 (2), 9 -> 2.25 (2), then 7 single jobs
        assert [g for g, _ in sent] == [[1], [3], [2], [0], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15],
                                        [16, 17, 18, 19], [20, 21, 22], [23, 24], [25, 26]] + [[j] for j in range(27, 34)]
        for group, (busy, left) in sent:  # queued behind a running task only with twice its cost still to come
            assert not busy or left >= 2 * sum(cost[j] for j in group), (group, busy, left)
        assert any(busy for _, (busy, _) in sent)  # the check above was exercised
    finally:
        for h in workers:
            ray.kill(h)


def test_the_wait_for_a_lost_worker_follows_the_autoscalers_launches():
    # lost at 100 s, 300 s to come back, at most 1800 s while the autoscaler launches
    assert give_up_at(100, 300, 1800, None) == 400  # no autoscaler, or it launched nothing
    assert give_up_at(100, 300, 1800, 50) == 400  # a launch seen before the loss changes nothing
    assert give_up_at(100, 300, 1800, 250) == 550  # 300 s after the last launch seen
    assert give_up_at(100, 300, 1800, 1700) == 1900  # still launching: bounded 1800 s after the loss
    assert give_up_at(100, 300, 200, 250) == 400  # a bound below the plain wait never shortens it


def _v1_report(**autoscaler_report) -> dict:
    return {"time": 0.0, "autoscaler_report": {"active_nodes": {"head": 1}, "pending_nodes": [],
                                               "pending_launches": {}, "failed_nodes": [], **autoscaler_report}}


def test_a_v1_report_names_what_is_launched_when_it_holds_a_worker():
    from rayfed_dg.engine.workers.resources import launching_nodes

    launch = _v1_report(pending_launches={"gpu_worker": 1, "cpu_worker": 0}, pending_resources={"CPU": 4, "GPU": 1})
    assert launching_nodes(launch, 1.0, 0.25) == "1 x gpu_worker"  # a type asked none of is not named
    # nodes booting or being set up: (ip, node type, status), beside a launch of the same type
    booting = _v1_report(pending_nodes=[("10.0.0.7", "gpu_worker", "setting-up"), ("10.0.0.8", "gpu_worker", "waiting")],
                         pending_launches={"gpu_worker": 1}, pending_resources={"CPU": 12, "GPU": 3})
    assert launching_nodes(booting, 1.0, 0.25) == "3 x gpu_worker"
    # what is pending cannot hold one worker: no CPU to spare, or no GPU
    assert launching_nodes(launch, 5.0, 0.0) is None and launching_nodes(launch, 1.0, 2.0) is None
    assert launching_nodes(_v1_report(pending_resources={"CPU": 4}), 1.0, 0.0) is None  # resources, no node
    assert launching_nodes({}, 1.0, 0.0) is None and launching_nodes(_v1_report(), 1.0, 0.0) is None


def _cluster_status(monkeypatch, status, kv: bytes | None = None) -> None:
    """The connected cluster as ``autoscaler_launching`` reads it: v2's
    ``status`` (a ``ClusterStatus``), or with ``status`` None, v1's report
    ``kv`` in the GCS's key-value store."""
    from types import SimpleNamespace

    import ray
    import ray.autoscaler.v2.sdk as sdk
    import ray.autoscaler.v2.utils as utils
    import ray.experimental.internal_kv as internal_kv

    def get_cluster_status(address):
        assert address == "10.0.0.1:6379"
        return status

    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="10.0.0.1:6379"))
    monkeypatch.setattr(utils, "is_autoscaler_v2", lambda fetch_from_server=False: status is not None)
    monkeypatch.setattr(sdk, "get_cluster_status", get_cluster_status)
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda key: kv if key == "__autoscaling_status" else None)


def test_autoscaler_v2_counts_every_pending_node_and_launch(monkeypatch):
    from ray.autoscaler.v2.schema import ClusterStatus, LaunchRequest, NodeInfo

    from rayfed_dg.engine.workers.resources import autoscaler_launching

    node = NodeInfo(instance_type_name="g5.xlarge", ray_node_type_name="gpu_worker", instance_id="i-1",
                    ip_address="10.0.0.7")
    launch = [LaunchRequest(instance_type_name=t, ray_node_type_name=r, count=n,
                            state=LaunchRequest.Status.PENDING, request_ts_s=0)
              for t, r, n in [("g5.xlarge", "gpu_worker", 2), ("m5.large", "cpu_worker", 1)]]
    _cluster_status(monkeypatch, ClusterStatus(pending_nodes=[node], pending_launches=launch))
    # v2 reports no node type's resources: a worker's size (4 GPUs here) does not filter
    assert autoscaler_launching(1.0, 4.0) == "1 x cpu_worker, 3 x gpu_worker"
    _cluster_status(monkeypatch, ClusterStatus(idle_nodes=[node]))
    assert autoscaler_launching(1.0, 0.0) is None  # nothing pending
    _cluster_status(monkeypatch, None, json.dumps(_v1_report(pending_launches={"gpu_worker": 1},
                                                             pending_resources={"CPU": 4, "GPU": 1})).encode())
    assert autoscaler_launching(1.0, 0.25) == "1 x gpu_worker" and autoscaler_launching(1.0, 2.0) is None
    _cluster_status(monkeypatch, None)
    assert autoscaler_launching(1.0, 0.0) is None  # no v1 report either: no autoscaler


def test_the_server_gives_its_pool_the_autoscalers_launches_only_when_the_autoscaler_is_followed(monkeypatch):
    from rayfed_dg.config import EngineConfig
    from rayfed_dg.engine.rounds.server import follow_autoscaler

    _cluster_status(monkeypatch, None, json.dumps(_v1_report(pending_launches={"gpu_worker": 1},
                                                             pending_resources={"CPU": 4, "GPU": 1})).encode())
    assert follow_autoscaler(EngineConfig(autoscaler="off")) is None
    for mode in ("auto", "on"):
        # the pool asks with the worker's own size (4 CPUs and a GPU are launched): 2 CPUs and a GPU fit, not the reverse
        cfg = EngineConfig(autoscaler=mode, num_cpus_per_worker=2.0, num_gpus_per_worker=1.0)
        assert follow_autoscaler(cfg)() == "1 x gpu_worker"
        assert follow_autoscaler(cfg.model_copy(update={"num_cpus_per_worker": 1.0, "num_gpus_per_worker": 2.0}))() is None


def test_a_pool_whose_only_worker_was_lost_waits_for_it_while_a_launch_is_seen(ray_session, tmp_path):
    """Its restart takes 4 s, the pool's plain wait 1.5 s: it stays only
    because the autoscaler is seen launching meanwhile; without one the run
    stops with the one-line error."""
    ray = ray_session

    @ray.remote(num_cpus=0, max_restarts=2, max_task_retries=0)
    class Slow:
        def __init__(self, marker: str):
            import os

            if os.path.exists(marker):  # a restart: a node being launched
                time.sleep(4)
            open(marker, "w").close()

        def ping(self):
            import os

            return os.getpid()

        def run(self, job: int, attempt: int):
            import os

            if attempt == 0:
                os._exit(1)  # the first attempt kills the pool's only worker
            return job, attempt

    asked = []

    def launching():
        asked.append(time.monotonic())
        return "1 x gpu_worker"

    w = Slow.remote(str(tmp_path / "a"))
    try:
        pool = WorkerPool([w], retries=2, restart_timeout_s=1.5, replacement_timeout_s=30, launching=launching)
        got = {}
        t0 = time.monotonic()
        assert pool.map([0], lambda w, j, attempt: w.run.remote(j, attempt), got.__setitem__) == []
        assert got == {0: (0, 1)} and pool.dead == set() and time.monotonic() - t0 >= 4
        assert len(asked) >= 2  # asked when the worker was lost, and again while it waited
    finally:
        ray.kill(w)
    w = Slow.remote(str(tmp_path / "b"))
    try:
        pool = WorkerPool([w], retries=2, restart_timeout_s=1.5, launching=lambda: None)
        with pytest.raises(EngineError, match="every worker died and none came back"):
            pool.map([0], lambda w, j, attempt: w.run.remote(j, attempt), lambda j, r: None)
    finally:
        ray.kill(w)
