"""Buffered asynchronous aggregation (engine/aggregation/buffered.py, engine/clock/asynchronous.py): the
staleness functions, FedBuff's and FedAsync's server updates and the event simulation
against hand-computed values; the refusals through the CLI; end to end on
local Ray, the same tables on one and two workers and after a resume."""
import numpy as np
import pytest
from conftest import REPO, tiny_cfg, tiny_federation

from rayfed_dg.cli import main
from rayfed_dg.config import DevicesConfig, load_config
from rayfed_dg.data import leave_one_domain_out
from rayfed_dg.engine.aggregation.buffered import (
    FedBuff,
    fedasync_alpha,
    fedasync_step,
    fedbuff_delta,
    fedbuff_step,
    staleness_weight,
)
from rayfed_dg.engine.aggregation.pipeline import refusal
from rayfed_dg.engine.clock.asynchronous import AsyncClock
from rayfed_dg.engine.clock.devices import DeviceModel
from rayfed_dg.methods import declarations
from rayfed_dg.seeding import Stream


def ideal(n: int) -> DeviceModel:
    """The devices section's defaults: every device online, one simulated second a local step, no dropout."""
    return DeviceModel(DevicesConfig(), 0, ["d"] * n)

# ------------------------------------------------------------------ staleness weights

@pytest.mark.parametrize("kind, x, a, b, want", [
    ("constant", 7, 0.5, 4, 1.0),
    ("polynomial", 0, 0.5, 4, 1.0),  # FedBuff's 1 / sqrt(1 + tau): a fresh upload weighs 1
    ("polynomial", 3, 0.5, 4, 0.5),  # 1 / sqrt(4)
    ("polynomial", 1, 1.0, 4, 0.5),  # (1 + 1)^-1
    ("hinge", 2, 10, 4, 1.0),  # below b: 1
    ("hinge", 4, 10, 4, 1.0),  # up to b: 1
    ("hinge", 5, 10, 4, 1 / 11),  # 1 / (10 (5 - 4) + 1)
    ("hinge", 6, 0.5, 4, 0.5),  # 1 / (0.5 (6 - 4) + 1)
])
def test_staleness_weights_by_hand(kind, x, a, b, want):
    assert staleness_weight(kind, x, a, b) == pytest.approx(want, rel=1e-15)


def test_fedasync_counts_staleness_from_one():
    """Xie et al.'s t - tau is 1 for a client that trained on the newest model:
    alpha 0.6, polynomial a = 1: fresh 0.6 / 2, two updates stale 0.6 / 4."""
    assert fedasync_alpha(0.6, "polynomial", 0, a=1.0) == pytest.approx(0.3)
    assert fedasync_alpha(0.6, "polynomial", 2, a=1.0) == pytest.approx(0.15)
    assert fedasync_alpha(0.6, "constant", 9) == pytest.approx(0.6)


# ------------------------------------------------------------------ server updates

def f32(*v):
    return np.array(v, np.float32)


def test_fedbuff_update_by_hand():
    """K = 2: A trained on the current model (staleness 0, s = 1), B on a model
    three updates old (s = 1 / sqrt(4) = 0.5), equal weights, eta_g = 0.5.
    Delta_A = ([2, 0], [1]), Delta_B = ([0, 4], [2]); mean = (1 Delta_A +
    0.5 Delta_B) / 2 = ([1, 1], [1]); x + 0.5 mean = ([1.5, 2.5], [0.5]).
    ``c`` nobody uploaded (a private key) keeps its value."""
    x = {"w": f32(1, 2), "b": f32(0), "c": f32(7)}
    old = {"w": f32(0, 0), "b": f32(0), "c": f32(9)}
    a = {"w": f32(3, 2), "b": f32(1)}
    b = {"w": f32(0, 4), "b": f32(2)}
    s = [staleness_weight("polynomial", tau, 0.5) for tau in (0, 3)]
    delta = fedbuff_delta(x, [(a, x, 1.0, s[0]), (b, old, 1.0, s[1])])
    assert set(delta) == {"w", "b"}
    new = fedbuff_step(x, delta, 0.5)
    np.testing.assert_array_equal(new["w"], f32(1.5, 2.5))
    np.testing.assert_array_equal(new["b"], f32(0.5))
    assert new["c"] is x["c"] and new["w"].dtype == np.float32
    # the method's reduce weights (FedAvg: sample counts) weigh the mean: (1 Delta_A + 3 * 0.5 Delta_B) / 4
    delta = fedbuff_delta(x, [(a, x, 1.0, s[0]), (b, old, 3.0, s[1])])
    np.testing.assert_allclose(delta["w"], [0.5, 1.5])


def test_fedbuff_step_by_eta_and_the_weight_sum_it_needs():
    np.testing.assert_array_equal(fedbuff_step({"w": f32(1, 2)}, {"w": np.array([2.0, -4.0])}, 0.5)["w"], f32(2, 0))
    x, y = {"w": f32(0)}, {"w": f32(2)}
    np.testing.assert_array_equal(fedbuff_delta(x, [(y, x, 0.5, 1.0)])["w"], [2.0])  # a weight sum under 1 is fine
    for weights in ([0.0], [-1.0], []):
        with pytest.raises(ValueError, match="positive weight sum"):
            fedbuff_delta(x, [(y, x, w, 1.0) for w in weights])


@pytest.mark.parametrize("optimizer, step", [("none", 0.5), ("fedavgm", 1.0), ("fedadam", 1.0)])
def test_fedbuffs_estimate_steps_by_eta_alone_and_is_the_optimizers_target_with_one(optimizer, step):
    """Without a server optimizer FedBuff's estimate is x + eta_g mean (server.lr 0.5); with one it is x + mean,
    the point the optimizer steps towards by its own lr."""
    from types import SimpleNamespace

    from rayfed_dg.engine.aggregation.pipeline import Uploads

    server = tiny_cfg("server.mode=fedbuff", f"server.optimizer={optimizer}", "server.lr=0.5").server
    x = {"w": f32(1, 1)}
    ups = {0: SimpleNamespace(update={"w": f32(3, 1)}), 1: SimpleNamespace(update={"w": f32(1, 5)})}
    u = Uploads(1, x, None, ups, [0, 1], weights={0: 1.0, 1: 3.0}, starts={0: x, 1: x}, staleness={0: 0, 1: 0})
    mean = np.array([(1 * 2 + 3 * 0) / 4, (1 * 0 + 3 * 4) / 4])  # [0.5, 3]
    np.testing.assert_allclose(FedBuff(server, x).estimate(u)["w"], 1 + step * mean, rtol=1e-7)


def test_fedasync_mixing_by_hand():
    """alpha_t = 0.3: 0.7 x + 0.3 x_new = 0.7 [1, 2] + 0.3 [3, 6] = [1.6, 3.2]; an int key rounds."""
    x = {"w": np.array([1.0, 2.0]), "n": np.array(10, np.int64), "c": f32(7)}
    new = fedasync_step(x, {"w": np.array([3.0, 6.0]), "n": np.array(13, np.int64)}, 0.3)
    np.testing.assert_allclose(new["w"], [1.6, 3.2], rtol=1e-15)
    assert new["n"] == 11 and new["n"].dtype == np.int64 and new["c"] is x["c"]


# ------------------------------------------------------------------ the clock

class TableDevices:
    """Hand-made devices: a fixed duration per client, online only at the
    listed times (``online``: time -> clients), client 3's trainings drop."""

    def __init__(self, durations, online, drops=()):
        self.durations, self.online, self.dropping = durations, online, set(drops)

    def duration(self, client, steps, draw):
        return float(self.durations[client])

    def available(self, client, t):
        return client in self.online.get(t, ())

    def drops(self, client, draw):
        return client in self.dropping


def clock(drops=()):
    devices = TableDevices({0: 2, 1: 5, 2: 3, 3: 4}, {0: {0, 1}, 2: {2}, 5: {3}, 9: {0}, 19: {1}}, drops)
    return AsyncClock(4, 2, 2, seed=0, devices=devices, steps=lambda c: 1, retry_s=10.0)


def arrivals(update):
    return [(t.client, t.version, t.start, t.finish, t.staleness) for t in update.arrivals]


def test_event_simulation_by_hand():
    """4 clients, 2 training at once, K = 2; durations 2, 5, 3, 4 s; who is
    online when forces each start.  t=0: 0 and 1 start.  t=2: 0 arrives; 2 (the
    only one online) starts from v0.  t=5: 1 arrives (ties by client id before
    2): update 1 = {0, 1}; 3 starts from v1.  t=5: 2 arrives, staleness 1; no
    one online for its slot (3 in flight, 2 seen): retry at 15.  t=9: 3 arrives:
    update 2 = {2 (stale 1), 3 (fresh)}; 0 starts from v2; the idle slot tries
    at once (the update), finds nobody: retry at 19.  t=11: 0 arrives, nobody
    online: retry at 21.  t=19: 1 starts from v2.  t=24: update 3 = {0, 1}."""
    c = clock()
    u = c.next_update()
    assert (u.version, u.time, u.dropped) == (1, 5.0, [])
    assert arrivals(u) == [(0, 0, 0.0, 2.0, 0), (1, 0, 0.0, 5.0, 0)]
    u = c.next_update()
    assert (u.version, u.time) == (2, 9.0)
    assert arrivals(u) == [(2, 0, 2.0, 5.0, 1), (3, 1, 5.0, 9.0, 0)]
    u = c.next_update()
    assert (u.version, u.time) == (3, 24.0)
    assert arrivals(u) == [(0, 2, 9.0, 11.0, 0), (1, 2, 19.0, 24.0, 0)]


def test_event_simulation_dropout_and_checkpoint():
    """Client 3 drops out at t=9: its slot goes to 0 (from v1, the version
    then), and update 2 = {2 (stale 1), 0 (fresh)} at t=11, reporting 3's
    dropout.  A clock restored from the state after update 1 goes on the same."""
    c = clock(drops={3})
    c.next_update()
    saved = c.state_dict()
    u = c.next_update()
    assert arrivals(u) == [(2, 0, 2.0, 5.0, 1), (0, 1, 9.0, 11.0, 0)]
    assert [(t.client, t.start, t.finish) for t in u.dropped] == [(3, 5.0, 9.0)] and u.time == 11.0
    again = clock(drops={3})
    again.load_state_dict(saved)
    v = again.next_update()
    assert arrivals(v) == arrivals(u) and v.time == u.time and again.state_dict() == c.state_dict()


def test_a_client_trains_once_per_update():
    """Two slots, K = 2; only client 0 is online at t=0 (the other slot tries
    again at 10, finds nobody, then at 20).  Client 0 arrives at t=1 and is the
    only one online: it is not started again before the update (its upload
    waits in the buffer); its slot tries again at t=11, when client 1 is online."""
    devices = TableDevices({0: 1, 1: 1}, {0: {0}, 1: {0}, 11: {1}})
    u = AsyncClock(3, 2, 2, seed=0, devices=devices, steps=lambda c: 1, retry_s=10.0).next_update()
    assert arrivals(u) == [(0, 0, 0.0, 1.0, 0), (1, 0, 11.0, 12.0, 0)] and u.time == 12.0


def test_idle_slots_try_again_at_the_update():
    """K = concurrency = clients = 3, always online, 1, 2 and 3 s: each
    arrival's slot finds nobody (the others in flight or seen), and all three
    restart at the update, from the new version, not retry_s later."""
    c = AsyncClock(3, 3, 3, 0, ideal(3), lambda cl: cl + 1, retry_s=100.0)
    assert c.next_update().time == 3.0
    u = c.next_update()
    assert u.time == 6.0 and arrivals(u) == [(0, 1, 3.0, 4.0, 0), (1, 1, 3.0, 5.0, 0), (2, 1, 3.0, 6.0, 0)]


def test_every_update_takes_k_distinct_clients_and_the_stream_seeds_the_picks():
    """A larger population, always online, one second a step: every update has
    K distinct clients, concurrency clients stay in flight, staleness is the
    versions passed since the start; the picks come from Stream.ASYNC_SAMPLE (a
    different seed, other clients)."""
    def run(seed):
        c = AsyncClock(50, 8, 3, seed, ideal(50), lambda cl: 1 + cl % 7)
        out = []
        for _ in range(20):
            u = c.next_update()
            assert len({t.client for t in u.arrivals}) == 3 and len(c.flight) == 8
            assert all(t.staleness == u.version - 1 - t.version for t in u.arrivals)
            out.append(arrivals(u))
        return out

    assert run(0) == run(0) and run(0) != run(1)
    assert Stream.ASYNC_SAMPLE == 20


def _sampler(seed: int, i: int, n: int, ok) -> tuple[int, bool]:
    """The documented sampler's i-th pick: candidates drawn uniformly from the
    stream's i-th generator (4 x min(n, 64) of them), else the first
    eligible of a permutation from the same generator; and whether it fell
    back to the permutation.  Written out so that a change of the picks,
    which changes every asynchronous run's numbers, is seen."""
    from rayfed_dg.seeding import numpy_rng

    rng = numpy_rng(seed, Stream.ASYNC_SAMPLE, i)
    for c in rng.integers(0, n, size=4 * min(n, 64)).tolist():
        if ok(c):
            return c, False
    return next(c for c in rng.permutation(n).tolist() if ok(c)), True


def test_the_clock_picks_each_start_with_the_streams_next_sampler_and_numbers_its_draws():
    """Eight starts at t = 0 among 50 devices: start i is the sampler's pick
    i among those not yet started, and its draw (the device model's dropout
    and jitter) is i."""
    c = AsyncClock(50, 8, 3, 5, ideal(50), lambda cl: 1)
    want: list[int] = []
    for i in range(8):
        want.append(_sampler(5, i, 50, lambda cl: cl not in want)[0])
    assert [(t.client, t.draw) for t in sorted(c.flight.values(), key=lambda t: t.draw)] == \
        [(cl, i) for i, cl in enumerate(want)]


class TwoOnline:
    """1,000 devices, only 0 and 700 ever online, one second a training."""

    def duration(self, client, steps, draw):
        return 1.0

    def available(self, client, t):
        return client in (0, 700)

    def drops(self, client, draw):
        return False


def test_a_pick_among_few_online_falls_back_to_the_samplers_permutation():
    """One slot, K = 1: after each update both online devices are free, so
    update j's client is the sampler's pick j; most picks miss both in the
    256 candidates and take the permutation's first."""
    c = AsyncClock(1000, 1, 1, 3, TwoOnline(), lambda cl: 1)
    got = [c.next_update().arrivals[0].client for _ in range(16)]
    want = [_sampler(3, j, 1000, lambda cl: cl in (0, 700)) for j in range(16)]
    assert got == [cl for cl, _ in want] and sum(fell for _, fell in want) >= 5 and set(got) == {0, 700}


def test_the_clock_gives_up_after_its_fruitless_tries_counted_from_the_last_arrival(monkeypatch):
    """Two slots, K = 2, retries every 10 s, the give-up after 5 fruitless
    tries (monkeypatched from 100,000).  Only client 0 is ever online (at
    t = 0), and trains 35 s: the other slot tries at 10, 20, 30 (3); 0
    arrives at 35 (progress: the count starts again) and its slot finds
    nobody; tries at 40, 45, 50, 55, 60 (5) and 65, the sixth: given up there."""
    import rayfed_dg.engine.clock.asynchronous as aio
    from rayfed_dg.errors import EngineError

    monkeypatch.setattr(aio, "IDLE_RETRIES", 5)
    c = AsyncClock(2, 2, 2, 0, TableDevices({0: 35, 1: 1}, {0: {0}}), steps=lambda cl: 1, retry_s=10.0)
    with pytest.raises(EngineError, match=r"^no client could start a training for 6 tries \(every 10.0 simulated"):
        c.next_update()
    assert c.time == 65.0
    # a try that starts a training is progress too: three slots, 0 trains 100 s from t = 0, 1 is online at t = 20
    # only; tries at 10 (2), 20 (1 starts: the count starts again; the other slot's try: 1), 30 ... 70: the sixth
    c = AsyncClock(3, 3, 3, 0, TableDevices({0: 100, 1: 100}, {0: {0}, 20: {1}}), steps=lambda cl: 1, retry_s=10.0)
    with pytest.raises(EngineError, match="for 6 tries"):
        c.next_update()
    assert c.time == 70.0
    # nobody ever online: the count starts at 0 with the update, tries at 10 ... 60
    c = AsyncClock(1, 1, 1, 0, TableDevices({0: 1}, {}), steps=lambda cl: 1, retry_s=10.0)
    with pytest.raises(EngineError, match="for 6 tries"):
        c.next_update()
    assert c.time == 60.0


def test_updates_never_start_more_trainings_than_the_concurrency():
    """A domain offline for the first 50 s leaves slots idle, a shared link
    leaves uploads waiting to start: after every update exactly the
    concurrency is in flight (an update restarts the idle slots once, and
    only them)."""
    cfg = DevicesConfig(enabled=True, domain_offline=[{"domain": "b", "start_s": 0.0, "end_s": 50.0}],
                        network={"server_mbps": 10.0})
    c = AsyncClock(8, 3, 2, 0, DeviceModel(cfg, 0, ["a"] * 3 + ["b"] * 5, model_bytes=2_500_000), lambda cl: 4,
                   retry_s=7.0)
    seen = set()
    for _ in range(30):
        u = c.next_update()
        seen |= {t.client for t in u.arrivals}
        assert len(c.flight) == 3 and {k for _, k, _ in c.events} <= {0, 2}
    assert seen == set(range(8)) and u.time > 50.0


# ------------------------------------------------------------------ what may run

def test_buffer_size_defaults_to_one_for_fedasync_and_ten_or_the_concurrency_for_fedbuff():
    from rayfed_dg.engine.clock.asynchronous import buffer_size

    def k(*sets: str) -> int:
        return buffer_size(load_config(None, list(sets)), 100)

    assert k("server.mode=fedasync") == 1 and k("server.mode=fedasync", "server.concurrency=20") == 1
    assert k("server.mode=fedbuff", "server.concurrency=20") == 10  # Nguyen et al.'s K
    assert k("server.mode=fedbuff", "server.concurrency=4") == 4
    assert k("server.mode=fedbuff", "server.concurrency=20", "server.buffer_size=3") == 3


def test_the_clock_refuses_an_empty_buffer():
    with pytest.raises(ValueError, match=r"need 1 <= buffer_size \(0\)"):
        AsyncClock(4, 2, 0, seed=0, devices=ideal(4), steps=lambda c: 1)


def test_which_methods_can_run_asynchronously():
    """Decided from the hooks: weighted-average methods pass; those with their
    own global tensors, server payloads, server state, a preparation or
    after-aggregation phase, or uploads read whole are refused."""
    def why(name, *sets):
        cfg = tiny_cfg(f"method.name={name}", *sets)
        return refusal(FedBuff, [FedBuff], declarations(cfg))

    for ok in ("fedavg", "fedprox", "fedbn", "silobn", "gperxan", "mixstyle", "dsu", "fedsr", "moon"):
        assert why(ok) is None, ok
    assert "assemble_global" in why("feddyn")
    assert "after_round" in why("scaffold")
    assert "server_payloads" in why("stablefdg")
    assert "after_round" in why("feddg_ga")
    assert "assemble_global" in why("copa")


def test_the_clock_takes_durations_availability_and_dropout_from_the_device_model():
    """With ``devices.enabled`` the clock's durations are planned steps x
    step_seconds / speed (lognormal speeds here), a dropped training frees
    its slot without an upload, and an offline domain starts nobody."""
    dev = DeviceModel(DevicesConfig(enabled=True, speed="lognormal", step_seconds=10.0), 3, ["a", "a", "b", "b"])
    c = AsyncClock(4, 4, 2, 0, dev, lambda cl: 2)
    first = c.next_update()
    fastest = sorted(range(4), key=lambda cl: (20.0 / dev.speeds[cl], cl))[:2]
    assert [t.client for t in first.arrivals] == fastest
    assert [t.finish for t in first.arrivals] == [20.0 / dev.speeds[cl] for cl in fastest]
    assert first.time == first.arrivals[-1].finish and all(t.staleness == 0 for t in first.arrivals)
    off = DeviceModel(DevicesConfig(enabled=True, domain_offline=[{"domain": "b", "start_s": 0.0, "end_s": 1e9}]),
                      0, ["a", "a", "b", "b"])
    c = AsyncClock(4, 2, 1, 0, off, lambda cl: 1)
    assert {t.client for _ in range(4) for t in c.next_update().arrivals} <= {0, 1}
    drops = DeviceModel(DevicesConfig(enabled=True, dropout=0.5), 0, ["a"] * 4)
    c = AsyncClock(4, 4, 2, 0, drops, lambda cl: 1)
    upd = c.next_update()
    assert all(drops.drops(t.client, t.draw) for t in upd.dropped)
    assert not any(drops.drops(t.client, t.draw) for t in upd.arrivals)
    # every device in flight at once and most trainings dropping out: a dropped device starts again rather than
    # waiting for an update that only it could fill
    drops = DeviceModel(DevicesConfig(enabled=True, dropout=0.5), 4, ["a"] * 6)
    c = AsyncClock(6, 6, 2, 4, drops, lambda cl: 1)
    assert [len(c.next_update().arrivals) for _ in range(3)] == [2, 2, 2]


QS = str(REPO / "configs" / "quickstart.yaml")
TINY = ["--set", "compare=null", "--set", "data.resolution=16", "--set", "model.width=8"]


@pytest.mark.parametrize("sets, expect", [
    (["server.mode=fedbuff", "method.name=scaffold"],
     "server.mode=fedbuff: method scaffold keeps server state across rounds (after_round)"),
    (["server.mode=fedbuff", "server.buffer_size=3", "server.concurrency=2"],
     "server.buffer_size=3 exceeds server.concurrency=2"),
    (["server.mode=fedbuff", "server.buffer_size=3", "training.clients_per_round=2"],
     "server.buffer_size=3 exceeds the 2 clients training at once"),
    (["server.mode=fedbuff", "server.concurrency=4"], "server.concurrency=4 exceeds the 3 clients"),
    (["server.mode=fedasync", "server.optimizer=fedadam"], "drop server.optimizer or use server.mode fedbuff"),
    (["server.mode=fedasync", "server.buffer_size=2"], "fedasync mixes in each arrival on its own"),
    (["server.mode=fedbuff", "server.alpha=0.9"], "server.alpha is fedasync's mixing weight"),
    (["server.buffer_size=2"], "server.buffer_size applies to the asynchronous modes only"),
    (["server.mode=fedbuff", "server.staleness_b=2"], "server.staleness_b has no effect with server.staleness polynomial"),
    (["server.mode=fedbuff", "devices.enabled=true", "devices.deadline_s=100"],
     "devices.deadline_s shapes a synchronous round; server.mode=fedbuff has no rounds to close"),
    (["server.mode=fedasync", "devices.enabled=true", "devices.over_selection=1.5"],
     "devices.over_selection shapes a synchronous round; server.mode=fedasync has no rounds to close"),
])
def test_refusals_are_one_line_exit_2_and_write_nothing(ray_session, tmp_path, capsys, monkeypatch, sets, expect):
    monkeypatch.setenv("RAYFED_DG_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    args = [a for s in sets for a in ("--set", s)]
    code = main(["run", QS, *TINY, *args, "--target", "texture", "--run-dir", str(run_dir), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expect in err[0], err
    assert not run_dir.exists()


def test_a_sync_config_dumps_as_before():
    """The asynchronous keys are left out of a sync run's config.yaml (a run
    directory from before they existed resumes), written for an async one."""
    assert "mode" not in load_config(None).to_dict()["server"]
    tree = load_config(None, ["server.mode=fedbuff", "server.buffer_size=2"]).to_dict()["server"]
    assert tree["mode"] == "fedbuff" and tree["buffer_size"] == 2


# ------------------------------------------------------------------ end to end

ASYNC = ("server.mode=fedbuff", "server.buffer_size=2", "training.local_epochs=1", "training.batch_size=64",
         "training.rounds=3", "output.checkpoint_every=1")


def _key(res):
    no_time = [{k: v for k, v in r.items() if k != "seconds"} for r in res.clients]
    return [(m["round"], m["split"], m["domain"], m["accuracy"], m["loss"], m["sim_time"]) for m in res.metrics], \
        no_time, res.ledger


@pytest.mark.slow
def test_fedbuff_same_tables_on_one_and_two_workers_and_after_a_resume(ray_session, tiny_ds, engine_host, tmp_path):
    """FedBuff (K = 2 of 3 clients training at once, one epoch: the clients'
    sizes make their finish times differ) for three updates: the same metrics,
    clients (with sim_start, sim_finish, staleness) and ledger on one and two
    workers; stopped after update 1 and resumed on fresh actors (the clock and
    the in-flight versions from the checkpoint), the same again."""
    one = tiny_federation(tiny_ds, "texture", *ASYNC, "engine.num_workers=1", host=engine_host(tiny_ds, 1))
    two = tiny_federation(tiny_ds, "texture", *ASYNC, "engine.num_workers=2", run_dir=tmp_path / "clean",
                          host=engine_host(tiny_ds, 2))
    assert _key(one) == _key(two)
    assert one.rounds_done == 3 and {r["round"] for r in one.clients} == {1, 2, 3}
    assert any(r["staleness"] > 0 for r in one.clients)  # some upload was stale
    assert all(r["sim_finish"] > r["sim_start"] for r in one.clients)
    cut = tiny_federation(tiny_ds, "texture", *ASYNC, run_dir=tmp_path / "cut", stop_after=1,
                          host=engine_host(tiny_ds, 2))
    assert cut.rounds_done == 1
    resumed = tiny_federation(tiny_ds, "texture", *ASYNC, run_dir=tmp_path / "cut")
    assert _key(resumed) == _key(two)


@pytest.mark.slow
def test_fedasync_with_local_state_and_faults_same_on_one_and_two_workers(ray_session, tiny_ds, engine_host):
    """FedAsync on FedBN (BatchNorm stays on the clients) with seeded faults:
    four updates of one arrival each give the same tables on one and two
    workers, the retries recorded as charged."""
    sets = ("server.mode=fedasync", "method.name=fedbn", "engine.fault_probability=0.5", "training.batch_size=64",
            "training.rounds=4")
    one = tiny_federation(tiny_ds, "texture", *sets, "engine.num_workers=1", host=engine_host(tiny_ds, 1))
    two = tiny_federation(tiny_ds, "texture", *sets, "engine.num_workers=2", host=engine_host(tiny_ds, 2))
    assert _key(one) == _key(two)
    assert [len([r for r in one.clients if r["round"] == t and not r["dropped"]]) for t in (1, 2, 3, 4)] == [1] * 4
    assert sum(r["retried"] for r in one.clients) > 0


def test_fedbuff_dropouts_are_rows_of_their_own_charged_the_download(ray_session, tiny_ds, engine_host):
    """With the device model's dropout, every update still aggregates K
    uploads; each dropped training is a row of its own (no upload, reason
    ``dropout``, its simulated times) and is charged the model it
    downloaded, as a synchronous round's late clients are."""
    sets = ("server.mode=fedbuff", "server.buffer_size=2", "devices.enabled=true", "devices.dropout=0.5",
            "training.local_steps=1", "training.rounds=4", "evaluation.every=0")
    res = tiny_federation(tiny_ds, "texture", *sets, host=engine_host(tiny_ds, 1))
    rows = res.clients
    assert [sum(not r["dropped"] for r in rows if r["round"] == t) for t in (1, 2, 3, 4)] == [2] * 4
    drops = [r for r in rows if r["dropped"]]
    assert drops and all(r["drop_reason"] == "dropout" and r["bytes_up"] == 0 and r["staleness"] is None
                         and r["sim_finish"] > r["sim_start"] for r in drops)
    down = {r["bytes_down"] for r in rows if not r["dropped"]}
    assert len(down) == 1 and {r["bytes_down"] for r in drops} == down
    charged = {(x["round"], x["client"]) for x in res.ledger if x["direction"] == "down"}
    assert {(r["round"], r["client"]) for r in drops} <= charged


def test_fedbuffs_first_update_through_the_server_is_x_plus_eta_times_the_weighted_mean_update(ray_session, tiny_ds,
                                                                                            engine_host):
    """Every client in the first buffer trained from x_0 (staleness 0, s = 1) with the same seeds as a
    synchronous round 1, so FedBuff's update is x_0 + eta_g (FedAvg's round-1 model - x_0), eta_g = server.lr
    0.5: the uploads reach the estimator whole, weighted by their sample counts."""
    ray = ray_session
    base = ("training.rounds=1", "training.local_steps=2", "evaluation.every=0")
    sync = tiny_cfg(*base)
    split = leave_one_domain_out(tiny_ds, "texture", sync.data.val_fraction, sync.data.split_seed)
    n = split.num_clients
    buff = tiny_cfg(*base, "server.mode=fedbuff", f"server.buffer_size={n}", f"server.concurrency={n}", "server.lr=0.5")
    host = engine_host(tiny_ds, 2)
    out = {}
    for name, cfg in (("sync", sync), ("buff", buff)):
        server = host.open(cfg, split, tiny_ds.num_classes)
        x0 = ray.get(server.get_state.remote())["global_state"]
        ray.get(server.run_round.remote())
        out[name] = ray.get(server.get_state.remote())["global_state"]
    k = "head.weight"
    want = x0[k].astype(np.float64) + 0.5 * (out["sync"][k].astype(np.float64) - x0[k])
    np.testing.assert_allclose(out["buff"][k], want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(out["buff"][k], x0[k])


def test_fedasyncs_first_update_through_the_server_mixes_the_first_arrival_by_hand(ray_session, tiny_ds, engine_host):
    """FedAsync with every client training from x_0: the first arrival (staleness 0, t - tau = 1) is mixed in as
    x_1 = (1 - alpha s(1)) x_0 + alpha s(1) y, y its upload recomputed in this process (alpha 0.6, polynomial
    a = 0.5: s(1) = 2^-0.5); the upload reaches the estimator whole."""
    from rayfed_dg.engine import ClientRunner

    ray = ray_session
    cfg = tiny_cfg("training.rounds=1", "training.local_steps=2", "evaluation.every=0", "server.mode=fedasync")
    split = leave_one_domain_out(tiny_ds, "texture", cfg.data.val_fraction, cfg.data.split_seed)
    server = engine_host(tiny_ds, 2).open(cfg, split, tiny_ds.num_classes)
    x0 = ray.get(server.get_state.remote())["global_state"]
    out = ray.get(server.run_round.remote())
    x1 = ray.get(server.get_state.remote())["global_state"]
    (c,) = [r.client for r in out.clients if not r.dropped]
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, tiny_ds.num_classes, 3)
    y = runner.run_client(c, 1, split.clients[c], x0, {}, {}).update
    a = 0.6 * 2 ** -0.5
    k = "head.weight"
    want = (1 - a) * x0[k].astype(np.float64) + a * y[k].astype(np.float64)
    np.testing.assert_allclose(x1[k], want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(x1[k], x0[k])
