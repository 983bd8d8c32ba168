"""One set of actors per experiment: a worker that served other federations
computes exactly what fresh actors compute, and its process never restarts."""
import numpy as np
import pytest
from conftest import tiny_cfg

from rayfed_dg.data import leave_one_domain_out
from rayfed_dg.engine import run_federation
from rayfed_dg.engine.running.host import EngineHost

# rows whose clients compute differently: another model (gPerXAN's XAN layers), another loss (FedProx), another
# seed; FedBN's client-local state must be its own federation's
ROWS = [(["method.name=fedavg"], "colour"), (["method.name=fedbn"], "colour"),
        (["method.name=gperxan"], "negative"), (["method.name=fedprox", "method.mu=0.5"], "negative"),
        (["method.name=fedavg", "training.seed=1"], "negative")]


def _no_time(rows):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


@pytest.mark.slow
def test_one_host_serves_every_federation_with_the_numbers_of_fresh_actors(ray_session, tiny_ds):
    ray = ray_session
    runs = [(tiny_cfg("training.rounds=2", "training.local_steps=2", *m), leave_one_domain_out(tiny_ds, t, 0.2, 0))
            for m, t in ROWS]
    refs = [ray.put(tiny_ds.images), ray.put(tiny_ds.labels)]
    # today's way: every federation starts its own actors (here one worker)
    fresh = [run_federation(cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"num_workers": 1})}), split,
                            *refs, 10, progress=False) for cfg, split in runs]
    host = EngineHost(runs[0][0].engine, refs, 2)
    try:
        pids = ray.get([w.ping.remote() for w in host.workers])
        shared = [run_federation(cfg, split, None, None, 10, progress=False, host=host) for cfg, split in runs]
        assert ray.get([w.ping.remote() for w in host.workers]) == pids  # the same processes served every row
        assert host.federations == len(runs)
        assert len({tuple(r.metrics[-1].values()) for r in shared}) == len(runs)  # the rows differ
    finally:
        host.close()
    for (m, t), a, b in zip(ROWS, fresh, shared):
        assert a.metrics == b.metrics, (m, t)
        assert a.ledger == b.ledger and _no_time(a.clients) == _no_time(b.clients), (m, t)
        assert a.selected_round == b.selected_round and a.selected_target_acc == b.selected_target_acc
    # fedbn's personal rows prove the client store was the federation's own, not the previous one's
    personal = [m for m in shared[1].metrics if m["split"] == "personal_val"]
    assert len(personal) == 2 * 3 and len({m["loss"] for m in personal}) == len(personal)
    assert np.isfinite([m["loss"] for m in personal]).all()


@pytest.mark.slow
def test_workers_killed_in_one_federation_are_replaced_before_the_next_with_the_same_numbers(ray_session, tiny_ds):
    """Injected worker deaths in every federation of one host: each federation
    equals its fault-free run, and the next one starts on fresh workers (a
    whole engine.max_restarts budget), not on the spent ones."""
    ray = ray_session
    base = ["training.rounds=2", "method.name=fedavg", "training.local_steps=2"]
    faults = ["engine.fault_probability=0.2", "engine.fault_mode=kill", "engine.max_task_retries=8",
              "engine.max_restarts=20"]
    splits = [leave_one_domain_out(tiny_ds, t, 0.2, 0) for t in ("colour", "negative")]
    refs = [ray.put(tiny_ds.images), ray.put(tiny_ds.labels)]
    clean = [run_federation(tiny_cfg(*base, "engine.num_workers=2"), s, *refs, 10, progress=False) for s in splits]
    cfg = tiny_cfg(*base, *faults)
    host = EngineHost(cfg.engine, refs, 2)
    try:
        faulty, handles = [], []
        for s in splits:
            faulty.append(run_federation(cfg, s, None, None, 10, progress=False, host=host))
            handles.append(list(host.workers))
        replaced_after_first = [a != b for a, b in zip(handles[0], handles[1])]
    finally:
        host.close()
    for a, b in zip(clean, faulty):
        assert a.metrics == b.metrics and b.dropped == []
    assert faulty[0].tasks_retried == 1  # seeded: round 1 kills client 1's first attempt, nothing else dies
    # the second federation's open replaced every worker whose process the first one killed, and ended it
    assert any(replaced_after_first)
    for old, was_replaced in zip(handles[0], replaced_after_first):
        if was_replaced:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(old.ping.remote(), timeout=60)


def _churning(ray, base):
    """``base``, with a method that spends its time in finalisers: where a
    SIGTERM's SystemExit lands, as it can at the end of a run."""
    import os
    import time

    class Slow:
        def __del__(self):
            t = time.monotonic()
            while time.monotonic() - t < 0.2:
                pass

    class Churning(base):
        def pid(self):
            return os.getpid()

        def churn(self):
            while True:
                Slow()

    return ray.remote(num_cpus=0)(Churning)


@pytest.mark.parametrize("kind", ["data source", "server", "worker"])
def test_an_actor_told_to_end_inside_a_finaliser_ends(ray_session, kind):
    """Ray ends an actor's process with SIGTERM; its SystemExit raised inside
    a finaliser is one Python cannot raise (it prints a traceback, "Exception
    ignored", and runs on): each of the engine's actors exits there all the
    same (``utils.exit_quietly_on_sigterm``)."""
    import os
    import signal
    import time

    from rayfed_dg.datasource import DataSource
    from rayfed_dg.engine.rounds.server import Server
    from rayfed_dg.engine.workers.worker import Worker

    ray = ray_session
    refs = [ray.put(np.zeros(2, np.uint8)), ray.put(np.zeros(2, np.int64))]
    name = f"exit-test-source-{kind}"
    source = ray.remote(num_cpus=0)(DataSource).options(name=name).remote(refs)
    base, args = {"data source": (DataSource, (refs,)), "server": (Server, ([], source)),
                  "worker": (Worker, (name,))}[kind]
    actor = _churning(ray, base).remote(*args)
    try:
        pid = ray.get(actor.pid.remote())
        actor.churn.remote()
        time.sleep(1.0)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30  # without: it runs on until Ray kills it at the session's end
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the {kind} actor (pid {pid}) still runs 30 s after SIGTERM")
    finally:
        ray.kill(actor)
        ray.kill(source)
