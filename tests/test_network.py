"""The devices' links on the virtual clock (engine/clock/network.py): transfer
times by hand, the shared server link's max-min fair shares and the finish
times they give a synchronous round and the asynchronous clock, a resume
with an upload half sent, the bad input refused through the CLI, and the
server's records of a run on a shared link."""
import copy

import numpy as np
import pytest
from conftest import REPO, tiny_federation

from rayfed_dg.cli import main
from rayfed_dg.config import DevicesConfig
from rayfed_dg.engine.clock.asynchronous import AsyncClock
from rayfed_dg.engine.clock.devices import DeviceModel, plan_round
from rayfed_dg.engine.clock.network import SharedLink, fair_rates, shared_uploads
from rayfed_dg.errors import ConfigError

INF = float("inf")


def test_fair_rates_fill_the_smallest_caps_first_and_split_what_is_left():
    # caps 1 < 5 < 10 of 9: 1 takes 1 (share 3), 5 takes 4 of the 8 left (share 4), 10 takes the last 4
    assert fair_rates(np.array([5.0, 1.0, 10.0]), 9.0).tolist() == [4.0, 1.0, 4.0]
    assert fair_rates(np.array([5.0, 1.0, 10.0]), 100.0).tolist() == [5.0, 1.0, 10.0]  # every cap below its share
    assert fair_rates(np.array([INF, INF, INF]), 3.0).tolist() == [1.0, 1.0, 1.0]


def test_uploads_on_a_shared_link_by_hand():
    # 10 Mbit each over 10 Mbit/s: 0 alone until 0.5 s (5 Mbit left), then 5 Mbit/s each: 0 ends at 1.5 s,
    # 1 has 5 Mbit left then and ends alone at 2.0 s
    ends = shared_uploads(SharedLink(10e6), {0: 0.0, 1: 0.5}, 10e6, {0: INF, 1: INF})
    assert ends == pytest.approx({0: 1.5, 1: 2.0})
    # 1's own uplink is 2 Mbit/s: from 0.5 s, 1 gets 2 and 0 the other 8: 0 ends at 0.5 + 5 / 8 = 1.125 s with
    # 1 at 8.75 Mbit left, sent at 2 Mbit/s: 1.125 + 4.375 = 5.5 s
    ends = shared_uploads(SharedLink(10e6), {0: 0.0, 1: 0.5}, 10e6, {0: INF, 1: 2e6})
    assert ends == pytest.approx({0: 1.125, 1: 5.5})


def test_the_link_refuses_to_go_back_in_time_and_round_trips_its_state():
    link = SharedLink(10e6)
    link.add(3, 1.0, 10e6, INF)
    link.add(1, 1.5, 10e6, 4e6)
    with pytest.raises(ValueError, match="cannot go back"):
        link.advance(1.2)
    other = SharedLink(10e6)
    other.load_state_dict(copy.deepcopy(link.state_dict()))
    assert other.next_end() == link.next_end() and other.next_end()[1] == 3


def _model(tmp_path=None, n=3, **net):
    cfg = DevicesConfig(enabled=True, step_seconds=2.0, network=net)
    return DeviceModel(cfg, 0, ["a"] * n, model_bytes=1_000_000)  # 8 Mbit each way


def test_transfer_times_by_hand():
    dev = _model(down_mbps=8.0, up_mbps=2.0, latency_s=0.1)
    # down 0.1 + 8 / 8; 3 steps of 2 s; up 8 / 2 + 0.1
    assert dev.ready(1, 3, 0) == pytest.approx(1.1 + 6.0)
    assert dev.duration(1, 3, 0) == pytest.approx(1.1 + 6.0 + 4.1)
    # the shorthand is both ways
    both = DeviceModel(DevicesConfig(enabled=True, bandwidth_mbps=4.0), 0, ["a"], model_bytes=1_000_000)
    assert both.duration(0, 1, 0) == pytest.approx(1.0 + 2.0 + 2.0)
    assert _model().duration(0, 3, 5) == 6.0  # no network: the steps alone


def test_jitter_is_exponential_with_its_mean_seeded_per_client_draw_and_direction():
    dev = _model(n=2, jitter_s=0.5, latency_s=0.1)
    down = np.array([dev.network.down_s(0, d) for d in range(4000)]) - 0.1
    up = np.array([dev.network.up_delay_s(0, d) for d in range(4000)]) - 0.1
    assert down.mean() == pytest.approx(0.5, rel=0.06) and np.median(down) == pytest.approx(0.5 * np.log(2), rel=0.08)
    assert down.min() >= 0 and abs(np.corrcoef(down, up)[0, 1]) < 0.05
    assert dev.network.down_s(0, 7) == _model(n=2, jitter_s=0.5, latency_s=0.1).network.down_s(0, 7)
    assert dev.network.down_s(0, 7) != dev.network.down_s(1, 7)


def test_bandwidths_spread_around_their_medians_or_come_from_a_trace(tmp_path):
    dev = _model(n=4001, down_mbps=20.0, up_mbps=5.0, sigma=0.7)
    down, up = dev.network.down_bps / 1e6, dev.network.up_bps / 1e6
    assert np.median(down) == pytest.approx(20.0, rel=0.05) and np.median(up) == pytest.approx(5.0, rel=0.05)
    assert np.log(down).std() == pytest.approx(0.7, rel=0.05) and abs(np.corrcoef(down, up)[0, 1]) < 0.05
    path = tmp_path / "bw.csv"
    path.write_text("client,down_mbps,up_mbps\n1,16,4\n0,8,2\n")
    dev = _model(n=2, trace=str(path))
    assert dev.duration(0, 1, 0) == pytest.approx(1.0 + 2.0 + 4.0)
    assert dev.duration(1, 1, 0) == pytest.approx(0.5 + 2.0 + 2.0)
    path.write_text("client,down_mbps,up_mbps\n0,8,0\n1,8,2\n")
    with pytest.raises(ConfigError, match=r"^devices.network.trace: .* has a bandwidth <= 0"):
        _model(n=2, trace=str(path))


def test_each_devices_bandwidths_and_delays_by_hand_from_their_seeded_draws():
    """Down and up: the median times exp(sigma z), z the client's row of one
    seeded (clients, 2) draw; each delay the latency plus its own
    exponential draw (the second is the upload's), at jitter 1 as at 0.5."""
    from rayfed_dg.seeding import Stream, numpy_rng

    for jitter in (0.5, 1.0):
        net = _model(n=3, down_mbps=20.0, up_mbps=5.0, sigma=0.7, latency_s=0.1, jitter_s=jitter).network
        z = numpy_rng(0, Stream.DEVICE_BANDWIDTH).standard_normal((3, 2)) * 0.7
        assert net.down_bps.tolist() == (20.0 * np.exp(z[:, 0]) * 1e6).tolist()
        assert net.up_bps.tolist() == (5.0 * np.exp(z[:, 1]) * 1e6).tolist()
        for c, d in ((0, 0), (2, 5)):
            j = numpy_rng(0, Stream.DEVICE_JITTER, c, d).exponential(jitter, 2)
            assert net.up_delay_s(c, d) == 0.1 + j[1] and net.down_s(c, d) == 0.1 + j[0] + 8e6 / net.down_bps[c]
            assert net.up_s(c, d) == 8e6 / net.up_bps[c] + (0.1 + j[1])


def test_each_profiles_devices_take_their_own_tiers_link():
    from rayfed_dg.engine.clock.profiles import NETWORK

    cfg = DevicesConfig(enabled=True, step_seconds=2.0, profiles=[{"compute": "phone_low", "network": "mobile"},
                                                                  {"compute": "phone_high", "network": "broadband"}])
    dev = DeviceModel(cfg, 0, ["a"] * 4, model_bytes=1_000_000)
    for k, tier in enumerate(("mobile", "broadband")):
        link = NETWORK[tier]
        c = np.flatnonzero(dev.profile == k)
        assert dev.network.down_bps[c].tolist() == [link.down_mbps * 1e6] * 2
        assert dev.network.up_bps[c].tolist() == [link.up_mbps * 1e6] * 2


def test_uploads_apart_on_a_shared_link_each_end_alone_by_hand():
    # 3 Mbit at 10 Mbit/s: 0.3 s each. 0 ends at 0.3 before 2 starts; 2 ends at 1.0 as 1 starts (in floating
    # point, 0.7 + 0.3 lands within a rounding of 1.0: the bits left are clamped at 0, never below)
    ends = shared_uploads(SharedLink(10e6), {0: 0.0, 1: 1.0, 2: 0.7}, 3e6, {0: INF, 1: INF, 2: INF})
    assert ends == pytest.approx({0: 0.3, 2: 1.0, 1: 1.3})
    assert shared_uploads(SharedLink(10e6), {0: 0.0, 1: 10.0}, 10e6, {0: INF, 1: INF}) == pytest.approx({0: 1.0, 1: 11.0})


def test_a_devices_bandwidths_do_not_depend_on_how_many_devices_there_are():
    few, many = _model(n=10, down_mbps=20.0, up_mbps=5.0, sigma=0.7), _model(n=25, down_mbps=20.0, up_mbps=5.0, sigma=0.7)
    assert np.array_equal(few.network.down_bps, many.network.down_bps[:10])
    assert np.array_equal(few.network.up_bps, many.network.up_bps[:10])


def _speeds(tmp_path, speeds):
    path = tmp_path / "speeds.csv"
    path.write_text("client,speed\n" + "".join(f"{c},{s}\n" for c, s in enumerate(speeds)))
    return str(path)


def test_a_synchronous_rounds_uploads_share_the_server_link(tmp_path):
    # 1 step of 1 s at speeds 1, 2, 0.5: ready at 101, 100.5, 102; 10 Mbit over a 10 Mbit/s server link:
    # 1 alone until 101 (5 left), then 0 and 1 at 5 each: 1 ends at 102, 0 has 5 left; 2 starts at 102;
    # 0 and 2 at 5 each: 0 ends at 103, 2 has 5 left, alone: 103.5
    cfg = DevicesConfig(enabled=True, speed="trace", speed_trace=_speeds(tmp_path, [1, 2, 0.5]),
                        network={"server_mbps": 10.0})
    dev = DeviceModel(cfg, 0, ["a"] * 3, model_bytes=1_250_000)
    p = plan_round(dev, 3, 0, 1, 100.0, 2, np.ones(3, int), over_selection=1.5)  # all three
    assert p.finish == pytest.approx({0: 103.0, 1: 102.0, 2: 103.5})
    assert (p.aggregated, p.reasons) == ([0, 1], {2: "late"}) and p.close == pytest.approx(103.0)
    # a dropout uploads nothing: 0 has the link alone from 101 to 102, shares it with 2 until 103;
    # its own would-be finish is on its own (unlimited) link
    dev.drops = lambda c, d: c == 1
    p = plan_round(dev, 3, 0, 1, 100.0, 2, np.ones(3, int), over_selection=1.5)  # all three
    assert p.finish == pytest.approx({0: 102.0, 1: 100.5, 2: 103.0})
    assert (p.aggregated, p.reasons) == ([0, 2], {1: "dropout"})


def _async(tmp_path, k=1, latency=0.0):
    cfg = DevicesConfig(enabled=True, speed="trace", speed_trace=_speeds(tmp_path, [1, 2]),
                        network={"server_mbps": 10.0, "latency_s": latency})
    dev = DeviceModel(cfg, 0, ["a"] * 2, model_bytes=1_250_000)
    return AsyncClock(2, 2, k, 0, dev, lambda c: 1)


def test_the_asynchronous_clock_on_a_shared_link_by_hand(tmp_path):
    # ready at 1 (client 0) and 0.5 (1); 10 Mbit each over 10 Mbit/s.  1 alone until 1, both at 5 until 1 ends at
    # 2 (update 1); 1 starts again, ready at 2.5, when 0's last 5 Mbit (alone) have left (update 2, staleness 1);
    # 1 alone from 2.5 ends at 3.5 (update 3); 0, ready at 3.5, alone until 1 joins at 4, ends at 5 (update 4)
    clock = _async(tmp_path)
    got = [(u.time, [(t.client, t.staleness) for t in u.arrivals]) for u in (clock.next_update() for _ in range(4))]
    assert got == [(pytest.approx(2.0), [(1, 0)]), (pytest.approx(2.5), [(0, 1)]), (pytest.approx(3.5), [(1, 1)]),
                   (pytest.approx(5.0), [(0, 1)])]


def test_the_asynchronous_clock_on_a_shared_link_with_latency_by_hand(tmp_path):
    # 0.25 s each way: ready at 1.25 (client 0) and 0.75 (1); 1 alone until 1.25, both at 5 until 1's last bit at
    # 2.25, arriving 2.5 (update 1); 0's last 5 Mbit alone end at 2.75, arriving 3 (update 2); 1 restarted at 2.5 is
    # ready at 3.25, alone to 4.25, arriving 4.5 (update 3); 0 restarted at 3 is ready at 4.25, alone to 5.25: 5.5
    clock = _async(tmp_path, latency=0.25)
    got = [(u.time, [t.client for t in u.arrivals]) for u in (clock.next_update() for _ in range(4))]
    assert got == [(pytest.approx(2.5), [1]), (pytest.approx(3.0), [0]), (pytest.approx(4.5), [1]),
                   (pytest.approx(5.5), [0])]


def test_an_upload_start_before_another_ends_is_taken_first_whatever_the_later_events(tmp_path):
    # ready at 1, 1.5 and 10 (speeds 1, 2/3, 0.1); 10 Mbit each over 10 Mbit/s.  0 alone until 1.5 (5 left), then
    # 0 and 1 at 5 each: 0 ends at 2.5, 1 (5 left) alone ends at 3; 2 alone from 10 ends at 11 (one update, K = 3)
    cfg = DevicesConfig(enabled=True, speed="trace", speed_trace=_speeds(tmp_path, [1, 2 / 3, 0.1]),
                        network={"server_mbps": 10.0})
    c = AsyncClock(3, 3, 3, 0, DeviceModel(cfg, 0, ["a"] * 3, model_bytes=1_250_000), lambda cl: 1)
    u = c.next_update()
    assert [t.client for t in u.arrivals] == [0, 1, 2]
    assert [t.finish for t in u.arrivals] == pytest.approx([2.5, 3.0, 11.0])


def test_an_update_that_wakes_idle_slots_keeps_the_trainings_waiting_to_upload(tmp_path):
    # FedBuff, K = 2 of 2 clients: 1 arrives at 2 and its slot finds nobody (0 trains, 1 waits in the buffer);
    # 0's upload ends at 2.5 (update 1); both start again, ready at 3.5 and 3: 1 alone until 3.5, both at 5 Mbit/s
    # until 1 ends at 4.5, 0 alone to 5 (update 2); and so on every 2.5 s
    clock = _async(tmp_path, k=2)
    got = [(u.time, sorted(t.client for t in u.arrivals)) for u in (clock.next_update() for _ in range(3))]
    assert got == [(pytest.approx(2.5), [0, 1]), (pytest.approx(5.0), [0, 1]), (pytest.approx(7.5), [0, 1])]


def test_the_asynchronous_clock_resumes_with_an_upload_half_sent(tmp_path):
    clock = _async(tmp_path)
    clock.next_update()  # at 2: client 0 has 5 of its 10 Mbit on the link
    assert clock.link is not None and clock.link.active[0][0] == pytest.approx(5e6)
    state = copy.deepcopy(clock.state_dict())
    rest = [(u.time, [t.client for t in u.arrivals]) for u in (clock.next_update() for _ in range(3))]
    other = _async(tmp_path)
    other.load_state_dict(state)
    assert [(u.time, [t.client for t in u.arrivals]) for u in (other.next_update() for _ in range(3))] == rest


def test_profiles_take_their_exact_shares_in_a_seeded_order_and_give_their_tiers_figures():
    from rayfed_dg.engine.clock.profiles import COMPUTE, NETWORK, assign

    # 1 : 2 of 10: 3.33 and 6.67, floors 3 and 6, the one left to the larger remainder; equal halves of 5: 3 and 2
    a = assign([1.0, 2.0], 10, 0)
    assert np.bincount(a).tolist() == [3, 7] and np.array_equal(a, assign([1.0, 2.0], 10, 0))
    assert not np.array_equal(a, assign([1.0, 2.0], 10, 1)) and np.bincount(assign([1, 1], 5, 0)).tolist() == [3, 2]
    cfg = DevicesConfig(enabled=True, step_seconds=2.0, network={"down_mbps": 8.0},
                        profiles=[{"compute": "phone_low", "network": "mobile", "share": 1},
                                  {"compute": "phone_high", "share": 1}])
    dev = DeviceModel(cfg, 0, ["a"] * 4, model_bytes=1_000_000)  # 8 Mbit
    low, high = np.flatnonzero(dev.profile == 0), np.flatnonzero(dev.profile == 1)
    assert len(low) == len(high) == 2
    m = NETWORK["mobile"]
    # phone_low on mobile: 8 Mbit down at 35.96 Mbit/s after 20 ms, 1 step x 2 s x 1642 / 179, up at 11.22
    want = m.latency_s + 8 / m.down_mbps + 2.0 * 1642 / 179 + 8 / m.up_mbps + m.latency_s
    assert dev.duration(int(low[0]), 1, 0) == pytest.approx(want) and COMPUTE["phone_low"].slowdown > 9
    # phone_high with the config's own network: 8 Mbit at 8 Mbit/s down, no limit up
    assert dev.duration(int(high[0]), 1, 0) == pytest.approx(1.0 + 2.0)


# ------------------------------------------------------------------ bad input, through the CLI

QS = str(REPO / "configs" / "quickstart.yaml")


@pytest.mark.parametrize("sets, expect", [
    (["devices.bandwidth_mbps=10", "devices.network.up_mbps=2"],
     "devices: Value error, bandwidth_mbps sets both ways for every device: drop it, or network.down_mbps"),
    (["devices.network.trace=bw.csv", "devices.network.sigma=0.5"],
     "devices.network: Value error, trace gives every device's bandwidths: drop down_mbps, up_mbps and sigma"),
    (["devices.network.latency_s=-1"], "devices.network.latency_s: Input should be greater than or equal to 0"),
    (["devices.network.server_mbps=0"], "devices.network.server_mbps: Input should be greater than 0"),
    (["devices.network.server_mbps=.inf"], "devices.network.server_mbps: Input should be a finite number"),
    (["devices.bandwidth_mbps=.inf"], "devices.bandwidth_mbps: Input should be a finite number"),
    (["devices.network.trace=missing.csv"], "devices.network.trace: cannot read"),
    (["devices.profiles=[{compute: phone_tiny}]"], "devices.profiles.0.compute: unknown tier 'phone_tiny'; use one of "
                                                   "phone_high, phone_mid, phone_low"),
    (["devices.profiles=[{compute: phone_low, network: dsl}]"], "devices.profiles.0.network: unknown tier 'dsl'"),
    (["devices.profiles=[{compute: phone_low}]", "devices.speed=lognormal"],
     "devices: Value error, profiles set each device's speed: drop speed: lognormal, or the profiles"),
    (["devices.profiles=[{compute: phone_low, network: mobile}]", "devices.network.trace=bw.csv"],
     "devices: Value error, network.trace gives every device's bandwidths: drop it, or the profiles' network"),
])
def test_bad_network_input_is_one_line_exit_2_and_writes_nothing(ray_session, tmp_path, capsys, monkeypatch, sets,
                                                                 expect):
    monkeypatch.setenv("RAYFED_DG_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bw.csv").write_text("client,down_mbps,up_mbps\n0,8,2\n")
    run_dir = tmp_path / "run"
    argv = [QS, "--set", "compare=null", "--set", "data.resolution=16", "--set", "model.width=8", "--set",
            "devices.enabled=true", *[x for s in sets for x in ("--set", s)]]
    code = main(["run", *argv, "--target", "mono", "--run-dir", str(run_dir), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expect in err[0], err
    assert not run_dir.exists()


# ------------------------------------------------------------------ through the server

def test_a_runs_recorded_finishes_are_its_transfers_and_the_shared_uploads_by_hand(ray_session, tiny_ds, engine_host):
    """Three clients, one step of 1 s each, ready together: each upload of the
    model's B bytes gets a third of the server's 1 Mbit/s, so each training
    takes latency + 8B / down + 1 s + 3 x 8B / 1e6 + latency, recorded in
    every client row (with the training's overhead of 0.5 s); the model's
    bytes are what each downloaded."""
    sets = ("training.rounds=2", "training.local_steps=1", "evaluation.every=0", "devices.enabled=true",
            "devices.network.server_mbps=1", "devices.network.down_mbps=4", "devices.network.latency_s=0.25",
            "devices.overhead_s=0.5")
    res = tiny_federation(tiny_ds, "texture", *sets, host=engine_host(tiny_ds, 1))
    rows = res.clients
    assert len(rows) == 6 and len({r["bytes_down"] for r in rows}) == 1
    bits = 8.0 * rows[0]["bytes_down"]
    took = 0.25 + bits / 4e6 + 0.5 + 1.0 + 3 * bits / 1e6 + 0.25
    for r in rows:
        assert r["sim_finish"] - r["sim_start"] == pytest.approx(took, rel=1e-9), r
    assert sorted({r["sim_start"] for r in rows}) == pytest.approx([0.0, took])


# ------------------------------------------------------------------ calibration

def test_the_calibration_line_through_the_medians_by_hand():
    from rayfed_dg.engine.running.calibration import fit

    # medians 1.1 s (2 full batches) and 3.0 s (8): a batch 1.9 / 6 s, a training 1.1 - 2 x 1.9 / 6 s besides
    f = fit([2, 2, 2], [1.0, 1.2, 1.1], [8, 8, 8], [3.1, 2.9, 3.0])
    assert f["step_seconds"] == pytest.approx(1.9 / 6) and f["overhead_s"] == pytest.approx(1.1 - 3.8 / 6)
    lo, hi = f["step_seconds_5_95"]
    assert lo < f["step_seconds"] < hi and (lo, hi) == pytest.approx(((2.9 - 1.2) / 6, (3.1 - 1.0) / 6), abs=0.02)
    # work counted by samples: a group of 8 steps whose median client did 6.5 batches' worth
    f = fit([2, 1.5, 2], [1.0, 1.2, 1.1], [8, 6.5, 6.5], [3.1, 2.9, 3.0])
    assert f["step_seconds"] == pytest.approx(1.9 / 4.5) and f["overhead_s"] == pytest.approx(1.1 - 2 * 1.9 / 4.5)


def test_calibrate_through_the_cli_times_the_trainings_after_round_one(ray_session, tmp_path, capsys):
    import json

    out = tmp_path / "cal.json"
    argv = ["devices", "calibrate", QS, "--set", "data.resolution=16", "--set", "model.width=8", "--target", "mono",
            "--steps", "1,3", "--rounds", "3", "--out", str(out)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rec = json.loads(out.read_text())
    # the quickstart's 3 clients a round, rounds 2 and 3 of each run
    assert [len(rec["trainings"][k]) for k in ("1", "3")] == [6, 6] and rec["steps"] == [1, 3]
    assert rec["step_seconds"] > 0 and (rec["resolution"], rec["model"]) == (16, "convnet")
    assert lines[1] == (f"--set devices.step_seconds={rec['step_seconds']:.6g} "
                        f"--set devices.overhead_s={max(0.0, rec['overhead_s']):.6g}")
    assert main(["devices", "calibrate", QS, "--steps", "3,3"]) == 2
    assert "--steps 3,3: give two numbers of local steps, 1 <= a < b" in capsys.readouterr().err


def test_a_runs_recorded_trainings_count_each_batch_by_its_samples(ray_session, tiny_ds, engine_host):
    """One epoch of batch 32 on the clock at 1 s a full batch: each client's training takes its samples / 32 s
    (the last batch short; one left alone would be skipped), read from the server's client rows."""
    sets = ("training.rounds=1", "training.local_epochs=1", "evaluation.every=0", "devices.enabled=true")
    rows = tiny_federation(tiny_ds, "texture", *sets, host=engine_host(tiny_ds, 1)).clients
    assert len(rows) == 3 and any(r["samples"] % 32 >= 2 for r in rows)
    for r in rows:
        n = r["samples"] - (1 if r["samples"] % 32 == 1 else 0)
        assert r["sim_finish"] - r["sim_start"] == pytest.approx(n / 32, rel=1e-12), r
