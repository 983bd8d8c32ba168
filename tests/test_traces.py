"""Device traces in FedScale's and FLASH's formats (engine/clock/traces.py),
written by the tests: the rows FedScale's aggregator and client manager map
each client to, FLASH's availability rule against its timer transcribed,
the engine's CSV with a period per client, the converters' round trip, and
bad files refused in one line through the CLI."""
import decimal
import json
import os
import pickle

import numpy as np
import pytest

from rayfed_dg.cli import main
from rayfed_dg.config import DevicesConfig
from rayfed_dg.engine.clock.devices import DeviceModel
from rayfed_dg.engine.clock.traces import convert, flash_user, read_availability, read_bandwidths, read_speeds
from rayfed_dg.errors import ConfigError


def _pickle(path, obj):
    path.write_bytes(pickle.dumps(obj))
    return str(path)


@pytest.fixture
def capacity(tmp_path):
    # keys 0..3: FedScale's client id c + 1 reads key (c + 1) % 4
    return _pickle(tmp_path / "client_device_capacity", {
        0: {"computation": 400.0, "communication": 1000.0}, 1: {"computation": 100.0, "communication": 2000.0},
        2: {"computation": 200.0, "communication": 8000.0}, 3: {"computation": 50.0, "communication": 500.0}})


def test_fedscale_capacity_rows_and_speeds_relative_to_the_median_device(capacity, tmp_path):
    # median ms per sample of the file: (100 + 200) / 2 = 150; clients 0..4 read keys 1, 2, 3, 0, 1
    assert read_speeds(capacity, "fedscale", 5).tolist() == [1.5, 0.75, 3.0, 0.375, 1.5]
    down, up = read_bandwidths(capacity, "fedscale", 5)
    # kbit/s both ways, FedScale's kbit being 1024 bits
    assert down.tolist() == up.tolist() == pytest.approx([2.048, 8.192, 0.512, 1.024, 2.048], rel=1e-12)
    # keys 1..3, as FedScale's own file may be: client 2 maps to key 0, which FedScale silently replaces
    short = _pickle(tmp_path / "short", {k: {"computation": 1.0, "communication": 1.0} for k in (1, 2, 3)})
    with pytest.raises(ConfigError, match=r"^devices.speed_trace: .* has no client 0, which FedScale maps client 3 "
                                          r"to \(id % 3 rows\); use fewer than 3 clients or add a key 0$"):
        read_speeds(short, "fedscale", 3)


def test_a_pickle_that_is_not_plain_data_is_refused_unrun(tmp_path):
    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    evil = _pickle(tmp_path / "evil", {1: Boom()})
    with pytest.raises(ConfigError, match=r"^devices.speed_trace: .* is not a FedScale pickle of plain data"):
        read_speeds(evil, "fedscale", 1)
    assert not (tmp_path / "ran").exists()
    # NumPy scalars, as a file written from NumPy values holds, are numbers
    np_file = _pickle(tmp_path / "np", {0: {"computation": np.float64(2.0), "communication": np.float32(4.0)},
                                        1: {"computation": np.float64(1.0), "communication": np.float32(8.0)}})
    assert read_speeds(np_file, "fedscale", 2).tolist() == [1.5, 0.75]


def test_fedscale_behaviour_records_in_file_order_each_with_its_own_period(tmp_path):
    path = _pickle(tmp_path / "client_behave_trace", {
        5: {"active": [0], "inactive": [10], "finish_time": 100, "duration": 10, "model": "x"},
        2: {"active": [20, 50], "inactive": [30, 60], "finish_time": 80, "duration": 20, "model": "y"},
        9: {"active": [5], "inactive": [6], "finish_time": 50, "duration": 1, "model": "z"}})
    tr = read_availability(path, "fedscale", 3)  # clients 0, 1, 2 take records 2, 3, 1 (key 2, 9, 5)
    cases = {(0, 25): True, (0, 35): False, (0, 55): True, (0, 105): True, (0, 125): False, (1, 5.5): True,
             (1, 7): False, (1, 55.5): True, (2, 5): True, (2, 105): True, (2, 150): False, (2, 10): False}
    for (c, t), on in cases.items():
        assert tr.available(c, t) is on, (c, t)
        assert tr.online(t)[c] == on, (c, t)


def _flash_lines(*rows):
    return "\n".join(f"2020-01-02 00:{s // 60:02d}:{s % 60:02d}\t{state}" for s, state in rows) + "\n"


USER_2 = _flash_lines((10, "screen_lock"), (20, "wifi"), (30, "battery_charged_on"), (50, "screen_unlock"),
                      (60, "screen_lock"), (70, "4G"), (100, "85%"))
USER_10 = _flash_lines((100, "screen_lock"), (100, "wifi"), (110, "battery_charged_on"), (170, "battery_charged_off"),
                       (180, "screen_on"))


def test_flash_windows_follow_its_rule_locked_on_wifi_and_charging():
    # online from 30 (the third condition) to 50 (unlocked), again from 60 to 70 (off wifi); messages from 10 to 100
    assert flash_user(USER_2) == ([(30.0, 50.0), (60.0, 70.0)], 10.0, 100.0)
    assert flash_user(USER_10) == ([(110.0, 170.0)], 100.0, 180.0)
    assert flash_user(_flash_lines((0, "screen_lock"), (5, "wifi"), (9, "screen_off"))) is None  # never online
    assert flash_user(_flash_lines((0, "screen_lock"), (5, "wifi"), (6, "battery_charged_on"))) is None  # still open
    assert flash_user("2020-01-02 00:00:10 screen_lock\n") is None  # no tab: FLASH rejects the trace
    assert flash_user(_flash_lines((0, "wifi"), (1, "x%"))) is None
    with pytest.raises(ConfigError, match="unknown FLASH state 'dancing'"):
        flash_user(_flash_lines((0, "dancing")))


def test_flash_joins_windows_that_touch_and_rejects_a_battery_level_that_is_not_a_number():
    # unlocked and locked again at the same second (60): the windows [50, 60) and [60, 70) are one
    touching = _flash_lines((0, "wifi"), (5, "battery_charged_on"), (10, "screen_lock"), (20, "screen_unlock"),
                            (30, "screen_lock"), (40, "screen_unlock"), (50, "screen_lock"), (60, "screen_unlock"),
                            (60, "screen_lock"), (70, "screen_unlock"), (80, "screen_on"))
    assert flash_user(touching) == ([(10.0, 20.0), (30.0, 40.0), (50.0, 70.0)], 0.0, 80.0)
    first_two = _flash_lines((0, "wifi"), (5, "battery_charged_on"), (10, "screen_lock"), (20, "screen_unlock"),
                             (20, "screen_lock"), (30, "screen_unlock"), (40, "screen_on"))
    assert flash_user(first_two) == ([(10.0, 30.0)], 0.0, 40.0)
    # a user FLASH accepts but for one battery level: "85x%" is not a number, "85%" is
    assert flash_user(USER_2.replace("85%", "85x%")) is None
    assert flash_user(USER_2.replace("85%", "5.5%")) == flash_user(USER_2) is not None
    # a blank line is skipped, not the end; messages need not be in time order, only the last must come after
    # the first (else FLASH's period is <= 0)
    assert flash_user(USER_2.replace("\n", "\n\n", 2)) == flash_user(USER_2)
    shuffled = _flash_lines((0, "wifi"), (10, "screen_lock"), (5, "battery_charged_on"), (8, "screen_unlock"))
    assert flash_user(shuffled) == ([(5.0, 8.0)], 0.0, 8.0)
    instant = _flash_lines((0, "wifi"), (0, "battery_charged_on"), (0, "screen_lock"), (0, "screen_unlock"))
    assert flash_user(instant) is None  # one instant: FLASH's period would be 0
    # every condition starts off: a user never on wifi, or never locked, is never online
    assert flash_user(_flash_lines((0, "screen_lock"), (5, "battery_charged_on"), (9, "battery_charged_off"))) is None
    assert flash_user(_flash_lines((0, "wifi"), (5, "battery_charged_on"), (9, "battery_charged_off"))) is None


def _flash_timer(windows, first, last, t):
    """FLASH's Timer.ready (models/timer.py), in floats and half-open as the engine's traces."""
    now = (t - first) % (last - first) + first
    return any(a <= now < b for a, b in windows)


def test_flash_availability_is_flashs_timer_with_each_users_own_period(tmp_path):
    path = tmp_path / "state_traces.json"
    bad = _flash_lines((0, "screen_lock")).replace("00:00:00", "2020-13-40 00:00:00")
    path.write_text(json.dumps({"10": {"guid": "b", "model": "m", "messages": USER_10},
                                "2": {"guid": "a", "model": "m", "messages": USER_2},
                                "3": {"guid": "c", "model": "m", "messages": bad}}))
    tr = read_availability(str(path), "flash", 3)  # valid users in uid order: 2, 10; client 2 wraps to user 2
    users = [flash_user(USER_2), flash_user(USER_10), flash_user(USER_2)]
    for t in np.arange(-200.0, 400.0, 2.5):
        want = [_flash_timer(*u, t) for u in users]
        assert [tr.available(c, t) for c in range(3)] == want, t
        assert tr.online(t).tolist() == want, t
    # user 10's window [110, 170] of period 80 from 100 wraps: online at t = 5 (local 165), not at 15 (175)
    assert tr.available(1, 5.0) and not tr.available(1, 15.0) and tr.available(1, 35.0)


def test_csv_availability_with_a_period_per_client(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("client,start_s,end_s,period_s\n0,0,10,20\n1,5,30,100\n0,15,20,20\n")
    tr = read_availability(str(path), "csv", 2)
    assert [tr.available(0, t) for t in (5, 12, 17, 25, 36)] == [True, False, True, True, True]
    assert [tr.available(1, t) for t in (4, 5, 29, 30, 106, 131)] == [False, True, True, False, True, False]
    path.write_text("client,start_s,end_s,period_s\n0,0,10,20\n0,12,14,30\n")
    with pytest.raises(ConfigError, match="gives one client two period_s values"):
        read_availability(str(path), "csv", 1)
    for rows in ("0,0,25,20", "0,0,0,0"):
        path.write_text(f"client,start_s,end_s,period_s\n{rows}\n")
        with pytest.raises(ConfigError, match="has a period_s <= 0 or an interval ending after its period_s; give"):
            read_availability(str(path), "csv", 1)


def test_csv_availability_bounds_each_refused_alone_and_a_short_period_read(tmp_path):
    path = tmp_path / "a.csv"
    # a start below 0 with an end after it, and an end before a start of at least 0: each alone is refused
    for text in ("client,start_s,end_s,period_s\n0,-1,5,10\n", "client,start_s,end_s,period_s\n0,5,4,10\n",
                 "client,start_s,end_s\n0,-1,5\n"):
        path.write_text(text)
        with pytest.raises(ConfigError, match="has an interval with start_s < 0 or end_s < start_s$"):
            read_availability(str(path), "csv", 1)
    # a period below one second is a period: online for the first quarter of every half second
    path.write_text("client,start_s,end_s,period_s\n0,0,0.125,0.5\n")
    tr = read_availability(str(path), "csv", 1)
    assert [tr.available(0, t) for t in (0.0, 0.1, 0.2, 0.5, 0.6, 0.7)] == [True, True, False, True, True, False]
    # one client's two periods are refused in either order (the larger first, then the smaller)
    path.write_text("client,start_s,end_s,period_s\n0,0,10,30\n0,12,14,20\n")
    with pytest.raises(ConfigError, match="gives one client two period_s values; give one per client$"):
        read_availability(str(path), "csv", 1)
    # rows past the population are ignored, their own periods too
    path.write_text("client,start_s,end_s,period_s\n0,0,10,20\n1,0,3,7\n3,0,1,4\n")
    tr = read_availability(str(path), "csv", 1)
    assert tr.period.tolist() == [20.0] and [tr.available(0, t) for t in (5, 15, 25)] == [True, False, True]
    assert [tr.online(t).tolist() for t in (5, 15)] == [[True], [False]]
    # without period_s the period is the file's largest end, however short; none at all is refused
    path.write_text("client,start_s,end_s\n0,0,0.25\n1,0.5,0.75\n")
    tr = read_availability(str(path), "csv", 2)
    assert tr.period.tolist() == [0.75, 0.75] and [tr.available(1, t) for t in (0.6, 0.8, 1.3)] == [True, False, True]
    path.write_text("client,start_s,end_s\n0,0,0\n1,0,0\n")
    with pytest.raises(ConfigError, match=r"no client is ever online \(every end_s is 0\)$"):
        read_availability(str(path), "csv", 2)


def test_converted_csv_reads_as_the_original(capacity, tmp_path):
    # second intervals: record 0's runs past its finish_time, record 3's starts after it
    behave = _pickle(tmp_path / "behave", {
        k: {"active": [3 * k, 40 + 10 * k], "inactive": [3 * k + 7, 70 + 10 * k], "finish_time": 60 + k} for k in range(4)})
    files = convert("fedscale", 6, tmp_path / "csv", capacity=capacity, availability=behave)
    assert [f.name for f in files] == ["speeds.csv", "bandwidth.csv", "availability.csv"]
    csv_dir = tmp_path / "csv"
    assert np.array_equal(read_speeds(str(csv_dir / "speeds.csv"), "csv", 6), read_speeds(capacity, "fedscale", 6))
    for a, b in zip(read_bandwidths(str(csv_dir / "bandwidth.csv"), "csv", 6), read_bandwidths(capacity, "fedscale", 6)):
        assert np.array_equal(a, b)
    mine, theirs = read_availability(str(csv_dir / "availability.csv"), "csv", 6), read_availability(behave, "fedscale", 6)
    for t in np.arange(0.0, 500.0, 0.5):
        assert np.array_equal(mine.online(t), theirs.online(t)), t


def test_the_device_model_reads_the_format_it_is_told(capacity, tmp_path):
    cfg = DevicesConfig(enabled=True, step_seconds=2.0, speed="trace", speed_trace=capacity, trace_format="fedscale",
                        network={"trace": capacity})
    dev = DeviceModel(cfg, 0, ["a"] * 5, model_bytes=256_000)  # 2.048 Mbit each way
    # client 0: speed 1.5, 2000 FedScale kbit/s (2.048 Mbit/s) both ways: 1 s down, 3 steps x 2 s / 1.5, 1 s up
    assert dev.duration(0, 3, 0) == pytest.approx(1.0 + 4.0 + 1.0)
    with pytest.raises(ConfigError, match="^devices.trace_format: flash has no speed trace; use trace_format csv"):
        DeviceModel(cfg.model_copy(update={"trace_format": "flash"}), 0, ["a"] * 5)


def test_convert_through_the_cli_and_its_refusals(capacity, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["devices", "convert", "--format", "fedscale", "--capacity", capacity, "--clients", "3",
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out / "speeds.csv"), str(out / "bandwidth.csv")]
    for argv, says in [
        (["--format", "flash", "--capacity", capacity], "devices.trace_format: flash has no speed trace"),
        (["--format", "fedscale", "--availability", str(tmp_path / "none")], "devices.availability_trace: cannot read"),
        (["--format", "fedscale"], "devices convert: give --capacity, --availability or both"),
        (["--format", "fedscale", "--capacity", _pickle(tmp_path / "short", {
            k: {"computation": 1.0, "communication": 1.0} for k in (1, 2, 3)})], "has no client 0, which FedScale maps"),
        (["--format", "fedscale", "--capacity", _pickle(tmp_path / "code", {1: decimal.Decimal(1)})],
         "is not a FedScale pickle of plain data (decimal.Decimal is not plain data)"),
    ]:
        code = main(["devices", "convert", *argv, "--clients", "3", "--out", str(tmp_path / "no")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and says in err[0], err
        assert not (tmp_path / "no").exists()


def test_converted_flash_csv_reads_as_the_original(tmp_path):
    path = tmp_path / "state_traces.json"
    path.write_text(json.dumps({"2": {"messages": USER_2}, "10": {"messages": USER_10}}))
    convert("flash", 3, tmp_path / "csv", availability=str(path))
    mine, theirs = read_availability(str(tmp_path / "csv" / "availability.csv"), "csv", 3), \
        read_availability(str(path), "flash", 3)
    for t in np.arange(-100.0, 400.0, 0.5):
        assert np.array_equal(mine.online(t), theirs.online(t)), t


def test_flash_refusals_keep_their_reason(tmp_path):
    path = tmp_path / "state_traces.json"
    path.write_text(json.dumps({"2": {"messages": _flash_lines((0, "dancing"))}}))
    with pytest.raises(ConfigError, match="unknown FLASH state 'dancing' \\(FLASH stops on it\\); remove"):
        read_availability(str(path), "flash", 1)
    # messages out of time order: FLASH's period would be negative
    backwards = _flash_lines((50, "screen_lock"), (60, "wifi"), (70, "battery_charged_on"), (80, "4G"), (10, "wifi"))
    assert flash_user(backwards) is None


@pytest.mark.parametrize("rows, n, expect", [
    ("0,1\n1.2,2\n", 2, "has a client that is not a whole number >= 0"),
    ("0,1\n1.7,2\n", 2, "has a client that is not a whole number >= 0"),
    ("0,1\n1,2\n-1,3\n", 2, "has a client that is not a whole number >= 0"),  # -1 would index the last client
    ("1,1\n2,2\n", 3, r"covers 2 of the 3 clients \(client 0 has no row\)"),
    ("2,1\n", 3, r"covers 1 of the 3 clients \(client 0 has no row\)"),  # the first missing one is named
])
def test_a_speed_trace_needs_a_whole_id_for_every_client(tmp_path, rows, n, expect):
    path = tmp_path / "speeds.csv"
    path.write_text("client,speed\n" + rows)
    with pytest.raises(ConfigError, match=f"^devices.speed_trace: {path} {expect}"):
        read_speeds(str(path), "csv", n)


def test_a_speed_traces_rows_past_the_population_are_ignored(tmp_path):
    path = tmp_path / "speeds.csv"
    path.write_text("client,speed\n3,9\n1,2\n0,1\n2,7\n")  # 2 and 3 are past two clients
    assert read_speeds(str(path), "csv", 2).tolist() == [1.0, 2.0]


def test_a_fedscale_file_refused_names_the_file_its_trace_needs(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"^devices.availability_trace: cannot read .*; give FedScale's "
                                          r"client_behave_trace$"):
        read_availability(missing, "fedscale", 1)
    for read, key in ((read_speeds, "speed_trace"), (read_bandwidths, "network.trace")):
        with pytest.raises(ConfigError, match=rf"^devices.{key}: cannot read .*; give FedScale's "
                                              r"client_device_capacity$"):
            read(missing, "fedscale", 1)
    # a pickle of plain data that is not a dict of clients, or an empty one
    for obj in ([{"computation": 1.0, "communication": 1.0}], {}):
        with pytest.raises(ConfigError, match=r"is not a FedScale dict of clients; give FedScale's "
                                              r"client_device_capacity$"):
            read_speeds(_pickle(tmp_path / "other", obj), "fedscale", 1)


@pytest.mark.parametrize("ms, kbps", [(0.0, 1.0), (-0.5, 1.0), (float("inf"), 1.0), (float("nan"), 1.0),
                                      (1.0, 0.0), (1.0, -0.5), (1.0, float("inf")), (1.0, float("nan"))])
def test_a_fedscale_capacity_needs_each_value_positive_and_finite_alone(tmp_path, ms, kbps):
    # client 0 reads key 1, which holds the one bad value (computation is checked in every record)
    path = _pickle(tmp_path / "cap", {0: {"computation": 2.0, "communication": 2.0},
                                      1: {"computation": ms, "communication": kbps}})
    with pytest.raises(ConfigError, match=r"has a computation or communication <= 0 or not finite; every device "
                                          r"needs a positive, finite ms per sample and kbit/s$"):
        read_bandwidths(path, "fedscale", 1)


def test_a_fedscale_capacity_below_one_is_a_speed_and_a_bandwidth(tmp_path):
    path = _pickle(tmp_path / "cap", {0: {"computation": 0.25, "communication": 0.5},
                                      1: {"computation": 0.5, "communication": 0.25}})
    # median 0.375 ms per sample: client 0 (key 1) 0.75, client 1 (key 0) 1.5; 0.25 and 0.5 kbit/s of 1024 bits
    assert read_speeds(path, "fedscale", 2).tolist() == [0.75, 1.5]
    assert read_bandwidths(path, "fedscale", 2)[1].tolist() == pytest.approx([0.256e-3, 0.512e-3], rel=1e-12)


@pytest.mark.parametrize("record", [
    {"active": [0, 20], "inactive": [10], "finish_time": 50},  # an unpaired start
    {"active": [0], "inactive": [10, 30], "finish_time": 50},  # an unpaired end
    {"active": [0], "inactive": [10], "finish_time": 0},
    {"active": [0], "inactive": [10], "finish_time": -5},
    {"active": [-1], "inactive": [10], "finish_time": 50},
    {"active": [20], "inactive": [10], "finish_time": 50},
])
def test_a_fedscale_behaviour_record_is_refused_on_each_fault_alone(tmp_path, record):
    path = _pickle(tmp_path / "behave", {0: {"active": [0], "inactive": [5], "finish_time": 10}, 1: record})
    with pytest.raises(ConfigError, match=r"a record's 'active' and 'inactive' are not paired intervals "
                                          r"0 <= active <= inactive, or its finish_time is <= 0; fix that record$"):
        read_availability(path, "fedscale", 1)


def test_a_fedscale_behaviour_record_of_an_instant_or_under_a_second_is_read(tmp_path):
    # an empty interval [3, 3) beside [5, 6), and a finish_time of half a second
    path = _pickle(tmp_path / "behave", {0: {"active": [0], "inactive": [0.25], "finish_time": 0.5},
                                         1: {"active": [3, 5], "inactive": [3, 6], "finish_time": 10}})
    tr = read_availability(path, "fedscale", 2)  # client 0 reads record 1, client 1 record 0
    assert [tr.available(0, t) for t in (3.0, 5.0, 5.5, 6.0, 15.5)] == [False, True, True, False, True]
    assert [tr.available(1, t) for t in (0.0, 0.2, 0.3, 0.6, 0.8)] == [True, True, False, True, False]


def test_a_bandwidth_trace_refuses_a_flash_file_and_a_negative_bandwidth(tmp_path):
    path = tmp_path / "bw.csv"
    path.write_text("client,down_mbps,up_mbps\n0,1,1\n")
    with pytest.raises(ConfigError, match="^devices.trace_format: flash has no bandwidth trace; use trace_format csv"):
        read_bandwidths(str(path), "flash", 1)
    for row in ("0,-1,1", "0,1,-0.5"):
        path.write_text(f"client,down_mbps,up_mbps\n{row}\n")
        with pytest.raises(ConfigError, match=r"has a bandwidth <= 0 or not finite; give Mbit/s > 0$"):
            read_bandwidths(str(path), "csv", 1)


def test_a_client_never_online_converts_to_a_csv_that_reads_as_never_online(tmp_path):
    # record 1 has no interval (client 0), record 0 one (client 1); its CSV row is a placeholder [0, 0)
    behave = _pickle(tmp_path / "behave", {0: {"active": [2], "inactive": [4], "finish_time": 8},
                                           1: {"active": [], "inactive": [], "finish_time": 5}})
    out = tmp_path / "new" / "csv"  # made with its parents, and written again over the first files
    convert("fedscale", 2, out, availability=behave)
    convert("fedscale", 2, out, availability=behave)
    mine = read_availability(str(out / "availability.csv"), "csv", 2)
    theirs = read_availability(behave, "fedscale", 2)
    for t in np.arange(0.0, 20.0, 0.25):
        assert np.array_equal(mine.online(t), theirs.online(t)), t
    assert not any(mine.available(0, t) for t in np.arange(0.0, 20.0, 0.25))


def test_overlapping_and_empty_intervals_are_read_as_their_union(tmp_path):
    # [0, 10) holds [2, 3); [20, 20) is empty beside [20, 30); [40, 45) touches [45, 50)
    path = tmp_path / "a.csv"
    path.write_text("client,start_s,end_s,period_s\n0,0,10,60\n0,2,3,60\n0,20,30,60\n0,20,20,60\n0,45,50,60\n"
                    "0,40,45,60\n")
    tr = read_availability(str(path), "csv", 1)
    for t in np.arange(0.0, 120.0, 0.5):
        want = bool(t % 60 < 10 or 20 <= t % 60 < 30 or 40 <= t % 60 < 50)
        assert tr.available(0, t) is want and tr.online(t)[0] == want, t
    assert list(zip(tr.starts.tolist(), tr.ends.tolist())) == [(0.0, 10.0), (20.0, 30.0), (40.0, 50.0)]
    # FedScale's records likewise; FLASH's windows out of time order joined: [6, 100) holds [10, 20)
    behave = _pickle(tmp_path / "behave", {0: {"active": [0, 2], "inactive": [10, 3], "finish_time": 20}})
    assert [read_availability(behave, "fedscale", 1).available(0, t) for t in (1, 5, 12)] == [True, True, False]
    shuffled = _flash_lines((0, "wifi"), (1, "battery_charged_on"), (2, "screen_lock"), (5, "screen_unlock"),
                            (6, "screen_lock"), (100, "screen_unlock"), (10, "screen_lock"), (20, "screen_unlock"),
                            (200, "screen_on"))
    assert flash_user(shuffled) == ([(2.0, 5.0), (6.0, 100.0)], 0.0, 200.0)
