"""The device model on a virtual clock (engine/clock/devices.py): hand-computed
availability (diurnal, Markov, trace, domain windows), the round's rule on
hand-made durations, the bad input it refuses through the CLI, and one run
end to end: the same participants and numbers on 1 and 2 workers, and
after a resume."""
import math

import numpy as np
import pytest
from conftest import REPO, tiny_cfg

from rayfed_dg.cli import main
from rayfed_dg.config import DevicesConfig, TrainingConfig
from rayfed_dg.engine.clock.devices import DeviceModel, MarkovChain, plan_round, planned_steps
from rayfed_dg.errors import ConfigError
from rayfed_dg.seeding import sample_clients


def test_planned_steps_match_the_workers_batches():
    t = TrainingConfig(batch_size=32, local_epochs=1)
    assert [planned_steps(t, n) for n in (1, 2, 31, 32, 33, 34, 64, 65, 66)] == [1, 1, 1, 1, 1, 2, 2, 2, 3]
    assert planned_steps(TrainingConfig(batch_size=32, local_epochs=3), 65) == 6
    assert planned_steps(TrainingConfig(batch_size=32, local_steps=7), 5) == 7


def test_planned_work_counts_each_batch_by_its_samples():
    from rayfed_dg.engine.clock.devices import planned_work

    # 106 samples of batch 32: batches of 32, 32, 32, 10 an epoch, six epochs: 6 x 106 / 32
    assert planned_work(TrainingConfig(batch_size=32, local_epochs=6), 106) == 6 * 106 / 32
    # 5 steps over 70 samples: 32, 32, 6, then 32, 32 of the next epoch
    assert planned_work(TrainingConfig(batch_size=32, local_steps=5), 70) == (32 + 32 + 6 + 32 + 32) / 32
    # 33 samples: the last sample alone is skipped (BatchNorm needs two); one sample alone is its own batch
    assert planned_work(TrainingConfig(batch_size=32, local_epochs=2), 33) == 2.0
    assert planned_work(TrainingConfig(batch_size=32, local_epochs=1), 1) == 1 / 32
    assert planned_work(TrainingConfig(batch_size=32, local_steps=3), 200) == 3.0


def test_durations_are_steps_over_speed_plus_the_models_transfer():
    cfg = DevicesConfig(enabled=True, step_seconds=2.0, speed="lognormal", speed_sigma=0.5, bandwidth_mbps=8.0)
    dev = DeviceModel(cfg, 0, ["a"] * 4, model_bytes=1_000_000)  # 2 x 8 Mbit at 8 Mbit/s: 2 s each way and back
    assert dev.duration(2, 10, 1) == pytest.approx(20.0 / dev.speeds[2] + 2.0)
    assert np.median(DeviceModel(cfg, 0, ["a"] * 2001).speeds) == pytest.approx(1.0, abs=0.05)  # median 1


def test_diurnal_availability_at_chosen_times():
    cfg = DevicesConfig(enabled=True, availability="diurnal", period_s=100.0, online_fraction=0.3)
    dev = DeviceModel(cfg, 3, ["a"] * 50)
    assert np.all((0 <= dev.phase) & (dev.phase < 100)) and len(set(dev.phase)) == 50  # a phase per client
    p = float(dev.phase[7])
    # online from its phase for 30 s of every 100
    for t, on in ((p + 0.5, True), (p + 29.5, True), (p + 30.5, False), (p + 99.5, False), (p + 100.5, True),
                  (p + 230.5, False)):
        assert dev.available(7, t) is on, t
    for t in (0.0, 17.0, 250.0):
        assert list(dev.online(t)) == [dev.available(c, t) for c in range(50)]
    assert 0.2 < dev.online(40.0).mean() < 0.4  # about online_fraction of the population
    # the window is half open: offline from its 30th second on (p + 30 - p is exactly 30 for client 7)
    assert (p + 30.0 - p) % 100.0 == 30.0
    assert dev.available(7, p + 30.0) is False and not dev.online(p + 30.0)[7]


def test_markov_chain_has_the_hand_computed_rates_and_any_order_gives_the_same_states():
    # mean online 30 s, offline 90 s, stepped every 10 s: a = 1/30, b = 1/90, a + b = 2/45;
    # stationary online b / (a + b) = 0.25; stay online over a step 0.25 + 0.75 exp(-4/9) = 0.7309
    chain = MarkovChain(5, 40_000, 30.0, 90.0, 10.0)
    assert chain.p_on == pytest.approx(0.25) and chain.p_stay_on == pytest.approx(0.7309, abs=1e-4)
    assert chain.p_come_on == pytest.approx(0.25 * (1 - math.exp(-4 / 9)))
    s0, s1, s40 = chain.state(0.0), chain.state(10.0), chain.state(400.0)
    assert s0.mean() == pytest.approx(0.25, abs=0.01) and s40.mean() == pytest.approx(0.25, abs=0.01)
    assert s1[s0].mean() == pytest.approx(0.7309, abs=0.015)  # the online that stayed online
    assert s1[~s0].mean() == pytest.approx(0.0897, abs=0.01)  # the offline that came online
    assert np.array_equal(chain.state(9.99), s0)  # constant between steps
    # another chain asked in another order (far ahead past snapshots, then back) gives the same states
    other = MarkovChain(5, 40_000, 30.0, 90.0, 10.0)
    far = other.state(3000.0)
    assert np.array_equal(other.state(400.0), s40) and np.array_equal(other.state(10.0), s1)
    assert np.array_equal(chain.state(3000.0), far)
    # the device model's markov availability is this chain, in both lookups
    cfg = DevicesConfig(enabled=True, availability="markov", mean_online_s=30.0, mean_offline_s=90.0,
                        markov_step_s=10.0)
    dev = DeviceModel(cfg, 5, ["a"] * 40_000)
    assert np.array_equal(dev.online(400.0), s40) and [dev.available(c, 10.0) for c in range(50)] == list(s1[:50])


def test_markov_states_are_the_chain_stepped_from_its_stationary_start_whatever_the_query_order():
    """Against the chain written out step by step: step 0 draws the stationary start, step j moves each device with
    step j's uniforms.  Queried out of order, across the 256-step snapshots and back; the first question is past
    step 0, as a resumed run's is."""
    from rayfed_dg.seeding import Stream, numpy_rng

    chain = MarkovChain(3, 50, 30.0, 90.0, 10.0)
    want = [numpy_rng(3, Stream.DEVICE_MARKOV, 0).random(50) < 0.25]
    for j in range(1, 600):
        u = numpy_rng(3, Stream.DEVICE_MARKOV, j).random(50)
        want.append(np.where(want[-1], u < chain.p_stay_on, u < chain.p_come_on))
    for k in (2, 0, 1, 255, 256, 257, 599, 300, 511, 512, 3, 256, 0, 598):
        assert np.array_equal(chain.state(10.0 * k + 5.0), want[k]), k
    # memory: the states of every 256th step, not of every step (10^5 clients over a long run are gigabytes)
    assert sorted(chain.snapshots) == [0, 256, 512]


def _trace(tmp_path, rows, header="client,start_s,end_s"):
    path = tmp_path / "trace.csv"
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return str(path)


def test_trace_lookup_with_its_period(tmp_path):
    path = _trace(tmp_path, ["0,20,30", "0,0,10", "1,5,15", "2,0,0"])  # client 2 is never online; period 30
    dev = DeviceModel(DevicesConfig(enabled=True, availability="trace", availability_trace=path), 0, ["a"] * 3)
    cases = {(0, 5): True, (0, 10): False, (0, 19.9): False, (0, 25): True, (0, 35): True, (0, 41): False,
             (1, 4.9): False, (1, 5): True, (1, 14.9): True, (1, 15): False, (1, 38): True, (2, 0): False}
    for (c, t), on in cases.items():
        assert dev.available(c, t) is on, (c, t)
    assert list(dev.online(25.0)) == [True, False, False] and list(dev.online(36.0)) == [True, True, False]


def test_a_trace_that_misses_a_client_names_it(tmp_path):
    path = _trace(tmp_path, ["0,0,10", "2,0,10"])
    with pytest.raises(ConfigError, match=r"devices.availability_trace: .* covers 2 of the 3 clients \(client 1 has "
                                          r"no row\); give a row to every client 0..2$"):
        DeviceModel(DevicesConfig(enabled=True, availability="trace", availability_trace=path), 0, ["a"] * 3)
    speeds = _trace(tmp_path, ["0,2.0", "1,0.5"], header="client,speed")
    dev = DeviceModel(DevicesConfig(enabled=True, speed="trace", speed_trace=speeds), 0, ["a"] * 2)
    assert dev.duration(1, 3, 0) == 6.0 and dev.duration(0, 3, 0) == 1.5


def test_a_domain_window_takes_its_domains_clients_offline():
    cfg = DevicesConfig(enabled=True, domain_offline=[{"domain": "b", "start_s": 10.0, "end_s": 20.0}])
    dev = DeviceModel(cfg, 0, ["a", "b", "a+b", "c"])
    assert list(dev.online(15.0)) == [True, False, False, True]
    assert [dev.available(c, 15.0) for c in range(4)] == [True, False, False, True]
    assert dev.online(9.9).all() and dev.online(20.0).all() and dev.available(1, 20.0)
    # the window is [start_s, end_s): offline from its first second, online again from its end, in both lookups
    for t, b_on in ((10.0, False), (19.9, False), (20.0, True), (25.0, True)):
        assert list(dev.online(t)) == [True, b_on, b_on, True] == [dev.available(c, t) for c in range(4)], t


def test_a_slow_domains_clients_take_its_factor_longer():
    cfg = DevicesConfig(enabled=True, step_seconds=2.0, overhead_s=1.0, domain_slowdown={"b": 3.0, "c": 1.5})
    dev = DeviceModel(cfg, 0, ["a", "b", "a+b", "c+b", "c"])
    # (1 + 10 x 2) s at speed 1; a multi-domain client takes its slowest domain's factor
    assert [dev.duration(c, 10, 0) for c in range(5)] == [21.0, 63.0, 63.0, 63.0, 31.5]
    lognormal = DevicesConfig(enabled=True, speed="lognormal", domain_slowdown={"b": 3.0})
    base = DeviceModel(DevicesConfig(enabled=True, speed="lognormal"), 4, ["a", "b"] * 3).speeds
    assert DeviceModel(lognormal, 4, ["a", "b"] * 3).speeds.tolist() == pytest.approx(base / np.array([1, 3] * 3))


def test_dropout_is_seeded_per_client_and_draw():
    dev = DeviceModel(DevicesConfig(enabled=True, dropout=0.3), 0, ["a"] * 200)
    draws = np.array([[dev.drops(c, d) for d in range(1, 6)] for c in range(200)])
    assert 0.2 < draws.mean() < 0.4 and not np.all(draws == draws[:, :1])  # draws differ from round to round
    assert np.array_equal(draws, [[dev.drops(c, d) for d in range(1, 6)] for c in range(200)])


class HandDevices:
    """Durations, availability and dropouts written by hand (the ``Devices`` protocol)."""

    def __init__(self, durations, offline=(), drop=(), online_from=0.0):
        self.durations, self.offline, self.drop, self.online_from = durations, set(offline), set(drop), online_from

    def duration(self, client, steps, draw):
        return self.durations[client] * steps

    def available(self, client, t):
        return client not in self.offline and t >= self.online_from

    def drops(self, client, draw):
        return client in self.drop


def _plan(dev, k, t=100.0, **kw):
    return plan_round(dev, len(dev.durations), 0, 1, t, k, np.ones(len(dev.durations), int), **kw)


def test_round_closes_at_the_kth_upload_and_aggregates_the_first_k():
    dev = HandDevices([5.0, 3.0, 4.0, 1.0], offline=[3], drop=[1])
    # 2 x 1.5 = 3 of the 3 online (client 3 is offline); 1 drops out; 2 (at 104) and 0 (at 105) make it
    p = _plan(dev, 2, over_selection=1.5, deadline_s=10.0)
    assert (p.start, p.selected, p.aggregated, p.close) == (100.0, [0, 1, 2], [0, 2], 105.0)
    assert p.finish == {0: 105.0, 1: 103.0, 2: 104.0} and p.reasons == {1: "dropout"}
    # k = 1: the first upload closes the round, the other finisher is late
    p = _plan(HandDevices([5.0, 3.0, 4.0]), 1, over_selection=3.0, deadline_s=10.0)
    assert (p.aggregated, p.close, p.reasons) == ([1], 103.0, {0: "late", 2: "late"})
    # 2 x 2 = 4 to select, only 3 online: all 3
    p = _plan(dev, 2, over_selection=2.0, deadline_s=10.0)
    assert (p.selected, p.aggregated) == ([0, 1, 2], [0, 2])


def test_round_closes_at_the_deadline_when_fewer_than_k_make_it():
    dev = HandDevices([5.0, 3.0, 4.0, 1.0], offline=[3], drop=[1])
    p = _plan(dev, 2, over_selection=1.5, deadline_s=4.5)
    assert (p.aggregated, p.close, p.reasons) == ([2], 104.5, {0: "deadline", 1: "dropout"})
    # an upload at the deadline itself is in time: aggregated, or late (not past the deadline) once k are in
    p = _plan(dev, 2, over_selection=1.5, deadline_s=5.0)
    assert (p.aggregated, p.close, p.reasons) == ([0, 2], 105.0, {1: "dropout"})
    p = _plan(dev, 1, over_selection=3.0, deadline_s=5.0)
    assert (p.aggregated, p.close, p.reasons) == ([2], 104.0, {0: "late", 1: "dropout"})
    # no deadline: it waits for the last selected client, a dropout noticed when its training would have ended
    p = _plan(HandDevices([5.0, 9.0, 4.0], drop=[1]), 3)
    assert (p.aggregated, p.close, p.reasons) == ([0, 2], 109.0, {1: "dropout"})
    p = _plan(HandDevices([5.0, 9.0], drop=[0, 1]), 2, deadline_s=7.0)  # nobody: the round is idle until 107
    assert (p.aggregated, p.close) == ([], 107.0)


def test_ties_go_in_client_order_and_nobody_online_waits():
    p = _plan(HandDevices([2.0, 2.0, 2.0]), 2, over_selection=1.5)
    assert (p.aggregated, p.reasons, p.close) == ([0, 1], {2: "late"}, 102.0)
    # nobody online before t = 130: the clock moves on by wait_s = 25 twice, to 150
    p = _plan(HandDevices([1.0, 2.0], online_from=130.0), 2, wait_s=25.0)
    assert (p.start, p.aggregated, p.close) == (150.0, [0, 1], 152.0)


def test_the_clock_with_everyone_online_samples_the_clients_of_a_run_without_it():
    dev = DeviceModel(DevicesConfig(enabled=True), 7, ["a"] * 40)
    for r in range(1, 6):
        p = plan_round(dev, 40, 7, r, 0.0, 6, np.ones(40, int))
        assert p.selected == p.aggregated == sample_clients(7, r, 40, 6)
    # over-selection samples among the online only
    dev = DeviceModel(DevicesConfig(enabled=True, domain_offline=[{"domain": "b", "start_s": 0, "end_s": 50}]), 7,
                      ["a"] * 20 + ["b"] * 20)
    p = plan_round(dev, 40, 7, 1, 10.0, 6, np.ones(40, int), over_selection=1.5)
    assert len(p.selected) == 9 and max(p.selected) < 20 and len(p.aggregated) == 6


# ------------------------------------------------------------------ bad input, through the CLI

QS = str(REPO / "configs" / "quickstart.yaml")
CD = [QS, "--set", "compare=null", "--set", "data.resolution=16", "--set", "model.width=8", "--set",
      "partition.strategy=single_domain", "--set", "partition.num_clients=12", "--set", "training.clients_per_round=3",
      "--set", "devices.enabled=true"]


def test_bad_device_input_is_one_line_exit_2_and_writes_nothing(ray_session, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAYFED_DG_CACHE", str(tmp_path / "cache"))
    short = _trace(tmp_path, [f"{c},0,100" for c in range(11)])  # 11 of the 12 clients
    cases = [
        (["devices.availability=trace", f"devices.availability_trace={short}"],
         "devices.availability_trace: " + short + " covers 11 of the 12 clients (client"),
        # every device at speed 1: the smallest client (88 samples, batch 32) takes 3 steps of 32, 32 and 24 samples,
        # 88 / 32 full batches' worth of 1 s
        (["devices.deadline_s=2.5"], "devices.deadline_s: 2.5 s is shorter than the fastest client's training (2.75 s"),
        # the floor, whatever the jitter a training may draw on top (mean 100 s here)
        (["devices.deadline_s=2.5", "devices.network.jitter_s=100"],
         "devices.deadline_s: 2.5 s is shorter than the fastest client's training (2.75 s simulated, without jitter)"),
        (["devices.over_selection=0.8"], "devices.over_selection: Value error, must be at least 1"),
        (["devices.domain_offline=[{domain: textures, start_s: 0, end_s: 10}]"],
         "devices.domain_offline.0.domain: unknown domain 'textures'; use one of"),
        (["devices.domain_slowdown={textures: 3}"], "devices.domain_slowdown.textures: unknown domain 'textures'"),
        (["devices.domain_slowdown={colour: 0}"], "devices.domain_slowdown.colour: Input should be greater than 0"),
    ]
    for i, (sets, expect) in enumerate(cases):
        run_dir = tmp_path / f"run-{i}"
        argv = [*CD, *[x for s in sets for x in ("--set", s)]]
        code = main(["run", *argv, "--target", "mono", "--run-dir", str(run_dir), "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and expect in err[0], (sets, err)
        assert not run_dir.exists()


# ------------------------------------------------------------------ end to end

DEVICES = ["partition.strategy=single_domain", "partition.num_clients=12", "training.clients_per_round=3",
           "training.rounds=3", "training.local_steps=2", "output.checkpoint_every=1", "devices.enabled=true",
           "devices.speed=lognormal", "devices.speed_sigma=0.8", "devices.availability=diurnal",
           "devices.period_s=20", "devices.online_fraction=0.6", "devices.dropout=0.25", "devices.deadline_s=2.5",
           "devices.over_selection=1.7", "devices.domain_offline=[{domain: colour, start_s: 2, end_s: 6}]"]


def test_a_deadline_above_the_trainings_floor_is_accepted_however_large_the_jitter(tiny_ds):
    """Two local steps of a full batch at speed 1, no transfer time: every training takes 2 s plus its jitter
    (exponential, mean 100 s).  Some draws meet a deadline of 2.01 s; 2 s is accepted too (an upload at the
    deadline is in time, ``plan_round``); none meets 1.99 s."""
    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine.clock.devices import check_devices

    split = leave_one_domain_out(tiny_ds, "texture", 0.2, 0, "single_domain", 12)
    base = ["partition.strategy=single_domain", "partition.num_clients=12", "training.clients_per_round=3",
            "training.local_steps=2", "devices.enabled=true", "devices.network.jitter_s=100"]
    check_devices(tiny_cfg(*base, "devices.deadline_s=2.01"), split, 1000)
    check_devices(tiny_cfg(*base, "devices.deadline_s=2"), split, 1000)
    with pytest.raises(ConfigError, match=r"training \(2 s simulated, without jitter\); raise it to 2 or more, "):
        check_devices(tiny_cfg(*base, "devices.deadline_s=1.99"), split, 1000)


def _clock_run(ds, *sets, host=None, **kw):
    import ray

    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import run_federation

    cfg = tiny_cfg(*DEVICES, *sets)
    split = leave_one_domain_out(ds, "texture", 0.2, 0, "single_domain", 12)
    return run_federation(cfg, split, ray.put(ds.images), ray.put(ds.labels), ds.num_classes, progress=False,
                          host=host, **kw)


def _tables(res):
    wall = ("seconds",)
    return ([(m["round"], m["split"], m["domain"], m["accuracy"], m["loss"], m["sim_time"]) for m in res.metrics],
            [{k: v for k, v in r.items() if k not in wall} for r in res.clients], res.ledger)


@pytest.mark.slow
def test_device_model_run_is_the_same_on_one_and_two_workers_and_after_a_resume(ray_session, tiny_ds, engine_host,
                                                                               tmp_path):
    """Availability from the Markov chain, the one with state: the resumed run's chain first asks at round 2's
    start, a few steps past 0, and must find the states the uninterrupted run stepped through."""
    markov = ("devices.availability=markov", "devices.mean_online_s=6", "devices.mean_offline_s=4",
              "devices.markov_step_s=1")
    one = _clock_run(tiny_ds, *markov, "engine.num_workers=1", host=engine_host(tiny_ds, 1), run_dir=tmp_path / "one")
    two = _clock_run(tiny_ds, *markov, "engine.num_workers=2", host=engine_host(tiny_ds, 2))
    assert _tables(one) == _tables(two)
    cut = _clock_run(tiny_ds, *markov, "engine.num_workers=2", host=engine_host(tiny_ds, 2), run_dir=tmp_path / "cut",
                     stop_after=1)
    assert cut.rounds_done == 1
    resumed = _clock_run(tiny_ds, *markov, "engine.num_workers=1", run_dir=tmp_path / "cut")  # actors of its own
    assert _tables(resumed) == _tables(one)
    rows = one.clients
    # the clock ran: every row has its simulated start and finish, the rounds start where the previous closed
    assert all(r["sim_start"] is not None and r["sim_finish"] >= r["sim_start"] for r in rows)
    closes = sorted({(m["round"], m["sim_time"]) for m in one.metrics})
    starts = sorted({(r["round"], r["sim_start"]) for r in rows})
    assert [s for _, s in starts[1:]] >= [c for _, c in closes[:-1]] and closes[0][1] > 0
    made = [r for r in rows if r["deadline_met"]]
    assert made and all(not r["dropped"] and r["bytes_up"] > 0 for r in made)
    assert all(r["dropped"] and r["bytes_up"] == 0 and r["bytes_down"] > 0 and r["drop_reason"] in
               ("dropout", "deadline", "late") and r["local_steps"] == 0 for r in rows if not r["deadline_met"])
    assert all(len([r for r in made if r["round"] == t]) <= 3 for t in (1, 2, 3))  # at most clients_per_round
    assert any(not r["deadline_met"] for r in rows)  # the scenario drops somebody


def test_a_slow_domain_is_slower_on_the_servers_clock(ray_session, tiny_ds, engine_host):
    """Through the server: every device at speed 1, one a second a full batch's worth, mono's devices 3x
    slower: each aggregated training's simulated seconds are its planned work, x 3 for mono's."""
    from rayfed_dg.engine.clock.devices import planned_work

    sets = ("devices.speed=constant", "devices.availability=always", "devices.dropout=0", "devices.deadline_s=null",
            "devices.over_selection=1", "devices.domain_offline=[]", "devices.domain_slowdown={mono: 3}")
    res = _clock_run(tiny_ds, *sets, host=engine_host(tiny_ds, 2))
    training = tiny_cfg(*DEVICES, *sets).training
    made = [r for r in res.clients if r["deadline_met"]]
    assert len(made) == 9 and {"mono", "negative"} <= {r["domain"] for r in made}
    for r in made:
        slow = 3 if r["domain"] == "mono" else 1
        assert r["sim_finish"] - r["sim_start"] == pytest.approx(slow * planned_work(training, r["samples"])), r


def test_a_round_whose_every_device_drops_out_trains_nobody_and_times_no_clients(ray_session, tiny_ds, engine_host):
    """Through the server: at a dropout of 0.99 the seeded draws drop every
    device round 1 selects, so it trains no client: its clients' phase is
    0 s (the rounds table's ``seconds_clients``), its loss NaN, the global
    model unchanged."""
    from rayfed_dg.data import leave_one_domain_out

    cfg = tiny_cfg(*DEVICES, "devices.speed=constant", "devices.availability=always", "devices.dropout=0.99",
                   "devices.deadline_s=null", "devices.domain_offline=[]")
    split = leave_one_domain_out(tiny_ds, "texture", 0.2, 0, "single_domain", 12)
    server = engine_host(tiny_ds, 1).open(cfg, split, tiny_ds.num_classes)
    before = ray_session.get(server.get_state.remote())["global_state"]
    idle = ray_session.get(server.run_round.remote())
    after = ray_session.get(server.get_state.remote())["global_state"]
    assert idle.round == 1 and idle.clients and all(r.drop_reason == "dropout" for r in idle.clients)
    assert idle.seconds_clients == 0.0 and math.isnan(idle.train_loss)
    assert all(np.array_equal(before[k], after[k]) for k in before)


# ------------------------------------------------------------------ report and plot on simulated time

def _clock_record(path, label, seed, times, accs, clients):
    """A finished run by hand: target ``t``, one source domain, each round's
    simulated time and target accuracy; ``clients``: (round, domain, dropped)."""
    import json

    from rayfed_dg.engine.store.rundir import RunDir

    path.mkdir(parents=True)
    rd = RunDir(path)
    for r, (when, acc) in enumerate(zip(times, accs), start=1):
        rd.write_rows("metrics", "t", r, [
            {"target": "t", "round": r, "split": split, "domain": d, "accuracy": a, "loss": 1.0, "samples": 10,
             "clients_dropped": 0, "sim_time": when} for split, d, a in (("source_val", "a", 0.5 + r / 100),
                                                                        ("target_test", "t", acc))])
        rd.write_rows("clients", "t", r, [
            {"target": "t", "round": r, "client": i, "domain": d, "samples": 5, "local_steps": 1, "bytes_up": 0,
             "bytes_down": 0, "retried": 0, "dropped": dropped}
            for i, (rr, d, dropped) in enumerate(clients) if rr == r])
    (path / "summary.json").write_text(json.dumps({"targets": {"t": {"selected_round": 3, "target_acc": accs[2]}},
                                                   "method": label, "label": label, "seed": seed}))


@pytest.fixture
def clock_runs(tmp_path):
    _clock_record(tmp_path / "sync" / "seed0", "sync", 0, (10, 20, 30), (0.2, 0.4, 0.6),
                  [(1, "a", False), (2, "a", False), (3, "a", True), (2, "b", False)])
    _clock_record(tmp_path / "sync" / "seed1", "sync", 1, (12, 24, 36), (0.3, 0.5, 0.7),
                  [(1, "a", False), (1, "a", True), (1, "b", False), (2, "b", False), (3, "b", False)])
    _clock_record(tmp_path / "async" / "seed0", "async", 0, (5, 15, 25), (0.1, 0.5, 0.8),
                  [(1, "b", False), (3, "b", False)])
    return tmp_path


def test_report_compares_at_equal_simulated_time_with_each_domains_participation(clock_runs, capsys):
    # T = the earliest end, 25 s: sync's seeds had 0.4 (round 2 at 20 s) and 0.5 (round 2 at 24 s), async 0.8;
    # domain a: sync aggregated 2 of 3 (seed 0) and 1 of 2 (seed 1): 1.5 / 2.5; async never selected it
    assert main(["report", str(clock_runs / "sync"), str(clock_runs / "async")]) == 0
    out = capsys.readouterr().out
    assert "On the virtual clock" in out
    table = {line.split(" | ")[0].strip("| "): [c.strip() for c in line.strip("| ").split(" | ")]
             for line in out.split("On the virtual clock")[1].splitlines() if line.startswith("| ")}
    # source validation (0.5 + round / 100) at T: round 2 for both sync seeds, round 3 (at 25 s) for async
    assert table["method"][3:] == ["at T = 25 s", "at the end", "source val at T", "end (simulated s)", "a", "b"]
    assert table["sync"] == ["sync", "t", "2", "45.00 ± 5.00", "65.00 ± 5.00", "52.00 ± 0.00", "33", "1.5/2.5", "2/2"]
    assert table["async"] == ["async", "t", "1", "80.00", "80.00", "53.00", "25", "-", "2/2"]


def test_curves_against_simulated_time_hold_each_seeds_accuracy_until_its_next_round(clock_runs, monkeypatch):
    import rayfed_dg.plots as plots
    from rayfed_dg.reporting import collect_runs

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    plots.learning_curves(collect_runs([clock_runs / "sync"]), ["t"], clock_runs / "c.png", x="sim_time")
    line = figs[0].axes[1].get_lines()[0]  # target accuracy, the mean over the two seeds
    # from 12 s (both seeds have a point): seed 0 holds 0.2 until 20, seed 1 has 0.3 from 12 ...
    xs, ys = line.get_xdata(), line.get_ydata()
    assert list(xs) == [12, 20, 24, 30, 36]
    assert np.allclose(ys, [25, 35, 45, 55, 65]) and line.get_drawstyle() == "steps-post"
    assert figs[0].axes[1].get_xlabel() == "simulated time (s)"
    _clock_record(clock_runs / "plain", "plain", 0, (None, None, None), (0.2, 0.4, 0.6), [])  # no clock
    with pytest.raises(ConfigError, match="--x sim_time: these runs have no simulated time"):
        plots.learning_curves(collect_runs([clock_runs / "plain"]), ["t"], clock_runs / "c.png", x="sim_time")


def test_a_round_where_every_selected_device_drops_out_keeps_the_model(ray_session, tiny_ds, engine_host):
    # seed 2, dropout 0.7, 2 of 12 clients a round at speed 1 (2 steps: 2 s): rounds aggregate 2, 0 and 1 clients
    res = _clock_run(tiny_ds, "training.seed=2", "devices.dropout=0.7", "devices.speed=constant",
                     "devices.availability=always", "devices.deadline_s=null", "devices.over_selection=1",
                     "devices.domain_offline=[]", "training.clients_per_round=2", host=engine_host(tiny_ds, 2))
    by_round = {t: [r for r in res.clients if r["round"] == t] for t in (1, 2, 3)}
    assert [sum(r["deadline_met"] for r in rows) for rows in by_round.values()] == [2, 0, 1]
    assert all(r["drop_reason"] == "dropout" and r["bytes_up"] == 0 and r["bytes_down"] > 0 for r in by_round[2])
    # no deadline: each round closes when its last selected device would have finished, 2 s after it started
    assert sorted({(m["round"], m["sim_time"]) for m in res.metrics}) == [(1, 2.0), (2, 4.0), (3, 6.0)]
    acc = {t: [(m["domain"], m["accuracy"], m["loss"]) for m in res.metrics if m["round"] == t] for t in (1, 2, 3)}
    assert acc[2] == acc[1] and acc[3] != acc[2]  # the idle round evaluated the unchanged global model


def test_the_clock_with_every_device_always_online_trains_what_a_run_without_it_trains(ray_session, tiny_ds,
                                                                                        engine_host):
    sets = ["training.clients_per_round=5", "training.rounds=2", "training.local_steps=2"]
    split_sets = ["partition.strategy=single_domain", "partition.num_clients=12"]

    def run(*more):
        import ray

        from rayfed_dg.data import leave_one_domain_out
        from rayfed_dg.engine import run_federation

        cfg = tiny_cfg(*split_sets, *sets, *more)
        split = leave_one_domain_out(tiny_ds, "texture", 0.2, 0, "single_domain", 12)
        return run_federation(cfg, split, ray.put(tiny_ds.images), ray.put(tiny_ds.labels), tiny_ds.num_classes,
                              progress=False, host=engine_host(tiny_ds, 2))

    off, on = run(), run("devices.enabled=true")
    key = [(m["round"], m["split"], m["domain"], m["accuracy"], m["loss"]) for m in off.metrics]
    assert key == [(m["round"], m["split"], m["domain"], m["accuracy"], m["loss"]) for m in on.metrics]
    assert off.ledger == on.ledger and all(m["sim_time"] is None for m in off.metrics)
    # 2 steps of 1 s each: the rounds close at 2 s and 4 s
    assert sorted({(m["round"], m["sim_time"]) for m in on.metrics}) == [(1, 2.0), (2, 4.0)]


@pytest.mark.parametrize("rows, header, says", [
    (["0,1.0", "1,0"], "client,speed", "has a speed <= 0"),
    (["0,1.0", "1,-2"], "client,speed", "has a speed <= 0"),
    (["0,inf", "1,1.0"], "client,speed", "has a speed <= 0 or not finite"),
    (["0,1.0", "1,nan"], "client,speed", "has a speed <= 0 or not finite"),
    (["0,1.0", "1,1.0"], "client,speeds", "needs a header line with the columns client,speed"),
    ([], "", "needs a header line with the columns client,speed"),
    (["0,1.0", "1,fast"], "client,speed", "has a value that is not a number in columns client,speed"),
])
def test_a_bad_speed_trace_is_refused_in_one_line(tmp_path, rows, header, says):
    path = _trace(tmp_path, rows, header=header)
    with pytest.raises(ConfigError, match="^devices.speed_trace: ") as e:
        DeviceModel(DevicesConfig(enabled=True, speed="trace", speed_trace=path), 0, ["a"] * 2)
    assert says in str(e.value) and "\n" not in str(e.value)
