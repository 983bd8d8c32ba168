"""Records written as the run goes: per-round part files that survive a crash,
a resume without duplicate rows, the per-client table, personalized
evaluation, TensorBoard scalars equal to the metrics table."""
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_cfg, tiny_federation

from rayfed_dg.data import leave_one_domain_out
from rayfed_dg.engine import ClientRunner
from rayfed_dg.engine.store.records import TABLES, TIMING, table_rows
from rayfed_dg.engine.store.rundir import RunDir
from rayfed_dg.engine.store.tblog import read_scalars

# the tables every run writes (privacy.parquet/ only with a privacy: section)
EVERY_RUN = [name for name in TABLES if name != "privacy"]

TARGET = "colour"


class Killed(Exception):
    pass


def federation(ray, ds, run_dir, *sets, on_round=None, host=None):
    return tiny_federation(ds, TARGET, "training.rounds=4", "output.checkpoint_every=1", "training.local_steps=3",
                           *sets, run_dir=run_dir, on_round=on_round, host=host)


def kill_after(r):
    def on_round(out, res):
        if out.round == r:
            raise Killed(f"killed after round {r}")
    return on_round


def read_rows(run_dir, name):
    return RunDir(run_dir).read_rows(name)


def rounds_of(run_dir, name):
    return sorted({row["round"] for row in read_rows(run_dir, name)})


def without_seconds(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.fixture(scope="module")
def killed_and_clean(ray_session, tiny_ds, engine_host, tmp_path_factory):
    """FedBN (so personal rows too), checkpoints every 2 rounds, killed after
    round 3 (a copy of the run directory as the kill left it), then resumed
    (from round 2: round 3 is repeated) on actors of its own, as in a new
    process; and the same run uninterrupted.  Returns the three folders, then
    the resumed and the uninterrupted runs' results."""
    import shutil

    base = tmp_path_factory.mktemp("records")
    killed, clean, at_kill = base / "killed", base / "clean", base / "at_kill"
    sets = ("output.checkpoint_every=2", "method.name=fedbn")
    host = engine_host(tiny_ds, 2)
    with pytest.raises(Killed):
        federation(ray_session, tiny_ds, killed, *sets, on_round=kill_after(3), host=host)
    shutil.copytree(killed, at_kill)
    resumed = federation(ray_session, tiny_ds, killed, *sets)
    whole = federation(ray_session, tiny_ds, clean, *sets, host=host)
    return at_kill, killed, clean, resumed, whole


@pytest.mark.slow
def test_killed_run_keeps_every_finished_round(killed_and_clean):
    at_kill, *_ = killed_and_clean
    for name in EVERY_RUN:
        assert rounds_of(at_kill, name) == [1, 2, 3], name
        parts = sorted((at_kill / f"{name}.parquet").iterdir())
        assert [p.name for p in parts] == [f"{TARGET}-r{r:05d}.parquet" for r in (1, 2, 3)]
        for p in parts:  # every part is a complete Parquet file on its own
            assert pq.read_table(p).num_rows > 0
        # any Parquet reader sees the folder as one table
        assert pq.read_table(at_kill / f"{name}.parquet").num_rows == len(read_rows(at_kill, name))
    # per round: 3 source val + 1 target + 3 clients' own models; 3 clients
    assert len(read_rows(at_kill, "metrics")) == 3 * 7 and len(read_rows(at_kill, "clients")) == 3 * 3
    assert [c.name for c in (at_kill / "checkpoints" / TARGET).glob("*.json")] == ["round_00002.json"]


@pytest.mark.slow
def test_resume_adds_no_duplicate_rows(killed_and_clean):
    at_kill, killed, clean, resumed, whole = killed_and_clean
    for name in EVERY_RUN:
        a, b = read_rows(killed, name), read_rows(clean, name)
        assert rounds_of(killed, name) == [1, 2, 3, 4]
        assert without_seconds(a) == without_seconds(b), name  # same rows, none twice
    # what the resumed run returns: the seconds of the rounds before its checkpoint, which the checkpoint left to
    # the rounds table
    at_two = torch.load(at_kill / "checkpoints" / TARGET / "round_00002.pt", weights_only=True)["result"]
    assert at_two["seconds_per_round"] == at_two["seconds_clients_per_round"] == []
    assert resumed.seconds_per_round == [r["seconds"] for r in read_rows(killed, "rounds")] and \
        len(resumed.seconds_per_round) == 4


@pytest.mark.slow
def test_a_resumed_run_reads_its_failed_clients_back_from_the_tables(ray_session, tiny_ds, engine_host, tmp_path):
    """Client 1's every training fails: the checkpoint keeps no failed
    client (they would grow with the failures), and the run resumed from it
    returns the failed clients of the uninterrupted run, those before the
    checkpoint included."""
    sets = ("output.checkpoint_every=1", "engine.fault_clients=[1]", "engine.max_task_retries=0")
    host = engine_host(tiny_ds, 2)
    with pytest.raises(Killed):
        federation(ray_session, tiny_ds, tmp_path / "cut", *sets, on_round=kill_after(2), host=host)
    at_two = torch.load(tmp_path / "cut" / "checkpoints" / TARGET / "round_00002.pt", weights_only=True)["result"]
    resumed = federation(ray_session, tiny_ds, tmp_path / "cut", *sets, host=host)
    whole = federation(ray_session, tiny_ds, tmp_path / "whole", *sets, host=host)
    assert at_two["dropped"] == [] and at_two["rounds_done"] == 2
    assert resumed.dropped == whole.dropped and {d["round"] for d in whole.dropped} & {1, 2}
    assert all(d["client"] == 1 and "injected" in d["reason"].lower() for d in whole.dropped)
    assert resumed.summary()["clients_dropped"] == whole.summary()["clients_dropped"]


@pytest.mark.slow
def test_rows_reach_disk_before_the_rounds_checkpoint(ray_session, tiny_ds, engine_host, tmp_path, monkeypatch):
    # dying while round 2's rows are written must not leave a checkpoint of round 2 behind:
    # the resumed run would start at round 3 and round 2's rows would be missing for good
    real = RunDir.write_round

    def dies_at_round_2(self, target, round, tables):
        if round == 2:
            raise Killed("killed while writing round 2")
        real(self, target, round, tables)

    monkeypatch.setattr(RunDir, "write_round", dies_at_round_2)
    with pytest.raises(Killed):
        federation(ray_session, tiny_ds, tmp_path, host=engine_host(tiny_ds, 2))
    monkeypatch.setattr(RunDir, "write_round", real)
    federation(ray_session, tiny_ds, tmp_path)  # the resume, on actors of its own as in a new process
    for name in EVERY_RUN:
        assert rounds_of(tmp_path, name) == [1, 2, 3, 4], name


def test_clients_table_rows(ray_session, tiny_ds, tmp_path):
    res = federation(ray_session, tiny_ds, tmp_path, "training.rounds=2", "engine.fault_clients=[1]",
                     "engine.max_task_retries=1", "training.batch_size=16")
    rows = read_rows(tmp_path, "clients")
    assert rows == res.clients
    ledger = read_rows(tmp_path, "ledger")
    split = leave_one_domain_out(tiny_ds, TARGET, 0.2, 0)
    assert [(r["round"], r["client"]) for r in rows] == [(r, c) for r in (1, 2) for c in (0, 1, 2)]
    for r in rows:
        assert r["target"] == TARGET and r["domain"] == split.client_domains[r["client"]]
        assert r["samples"] == len(split.clients[r["client"]])
        for d in ("up", "down"):
            assert r[f"bytes_{d}"] == sum(x["bytes"] for x in ledger if x["round"] == r["round"]
                                          and x["client"] == r["client"] and x["direction"] == d)
        if r["client"] == 1:  # fails every attempt: retried once, then dropped
            assert r["dropped"] and r["retried"] == 1 and "injected" in r["drop_reason"].lower()
            assert r["local_steps"] == 0 and r["train_loss"] is None and r["bytes_down"] == 0
        else:
            assert not r["dropped"] and r["retried"] == 0 and r["drop_reason"] is None
            assert r["local_steps"] == 3 and math.isfinite(r["train_loss"]) and r["seconds"] > 0
            assert r["bytes_up"] > 0 and r["bytes_down"] > 0


@pytest.mark.slow
def test_personalized_evaluation_is_each_clients_own_model(ray_session, tiny_ds, engine_host):
    ray = ray_session
    cfg = tiny_cfg("training.rounds=1", "method.name=fedbn", "training.local_steps=3")
    split = leave_one_domain_out(tiny_ds, TARGET, cfg.data.val_fraction, cfg.data.split_seed)
    host = engine_host(tiny_ds, 1)
    server = host.open(cfg, split, tiny_ds.num_classes)
    out = ray.get(server.run_round.remote())
    state = ray.get(server.get_state.remote())
    personal = [m for m in out.metrics if m.split == "personal_val"]
    assert [m.client for m in personal] == [0, 1, 2]
    assert all(m.client is None for m in out.metrics if m.split != "personal_val")
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, tiny_ds.num_classes, 3)
    glob = {m.domain: m.loss for m in out.metrics if m.split == "source_val"}
    for m in personal:
        c = m.client
        assert m.domain == split.client_domains[c]
        val = split.val[m.domain]
        correct, loss, n = runner.evaluate(state["global_state"], val, 64, state["client_store"][c])
        assert m.accuracy == correct / n and m.samples == n
        assert m.loss == pytest.approx(loss / n, rel=1e-5)
        assert abs(m.loss - glob[m.domain]) > 1e-4  # the client's own BN state, not the global model
    # a method without client state (FedAvg) has no personal rows
    assert not ray.get(host.open(tiny_cfg(), split, 10).current.remote()).personalizes()


@pytest.mark.slow
def test_tensorboard_scalars_equal_the_metrics_table(killed_and_clean):
    _, _, clean, *_ = killed_and_clean
    logdir = clean / "tensorboard" / TARGET
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    sc = {tag: dict(points) for tag, points in read_scalars(logdir).items()}
    assert set(sc) == {"accuracy/source_val", "accuracy/target", "accuracy/personal_val", "loss/train",
                       "time/round_seconds", "comm/bytes_up", "comm/bytes_down"}
    metrics, clients, ledger = (read_rows(clean, n) for n in ("metrics", "clients", "ledger"))
    rounds = (1, 2, 3, 4)
    for tag, split in (("accuracy/source_val", "source_val"), ("accuracy/target", "target_test"),
                       ("accuracy/personal_val", "personal_val")):
        want = {r: np.float32(100 * np.mean([m["accuracy"] for m in metrics if m["round"] == r and m["split"] == split]))
                for r in rounds}
        assert sc[tag] == want, tag
    assert sc["loss/train"] == {r: np.float32(np.mean([c["train_loss"] for c in clients if c["round"] == r]))
                                for r in rounds}
    for d in ("up", "down"):
        assert sc[f"comm/bytes_{d}"] == {r: np.float32(sum(x["bytes"] for x in ledger if x["round"] == r
                                                           and x["direction"] == d)) for r in rounds}
    assert all(v > 0 for v in sc["time/round_seconds"].values())


@pytest.mark.slow
def test_tensorboard_after_resume_shows_each_round_once(killed_and_clean):
    _, killed, clean, *_ = killed_and_clean
    a, b = (read_scalars(d / "tensorboard" / TARGET) for d in (killed, clean))
    assert len(list((killed / "tensorboard" / TARGET).glob("events.*"))) == 2
    for tag in ("accuracy/source_val", "accuracy/target", "accuracy/personal_val", "loss/train", "comm/bytes_up"):
        assert [s for s, _ in a[tag]] == [1, 2, 3, 4], tag  # round 3 of the killed run is hidden, not drawn twice
        assert a[tag] == b[tag], tag


def test_progress_bar_and_tensorboard_show_percent():
    from rayfed_dg.engine.running.run import ProgressBar, TargetResult
    from rayfed_dg.engine.store.records import MetricRow, RoundResult, Split
    from rayfed_dg.engine.store.tblog import round_scalars

    m = [MetricRow(1, Split(s), d, None, acc, 1.0, 10) for s, d, acc in (
        ("source_val", "a", 0.5), ("source_val", "b", 0.25), ("target_test", "t", 0.125), ("heldout_val", "h", 0.75),
        ("source_test", "a", 0.5), ("source_test", "b", 0.0))]
    out = RoundResult(round=1, sampled=[0], dropped=[], metrics=m, ledger=[], clients=[], train_loss=1.5,
                      tasks_retried=0, seconds_total=2.0)
    res = TargetResult("t")
    bar = ProgressBar(tiny_cfg(), res)
    assert res.add_round(out, table_rows("t", out))  # the one evaluated round is the selected one
    bar.on_round(out, res, True, dict)
    assert "src_val=37.5%" in bar.bar.postfix and "target=12.5%" in bar.bar.postfix, bar.bar.postfix
    bar.close()
    s = round_scalars(out, res)
    assert s["accuracy/source_val"] == 37.5 and s["accuracy/target"] == 12.5 and s["loss/train"] == 1.5
    assert s["accuracy/heldout_val"] == 75.0 and s["accuracy/source_test"] == 25.0 and "accuracy/personal_val" not in s
