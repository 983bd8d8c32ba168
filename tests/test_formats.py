"""Format versions (engine/store/formats.py): what today's code writes
carries them, a newer format is refused in one line, and older shapes are
read through the one migration module (the fixtures of ``test_rundir.py``
and the hand-made old checkpoints of ``test_clientstore.py`` too)."""
import json
from dataclasses import asdict

import numpy as np
import pytest
from conftest import tiny_cfg

from rayfed_dg.config import ConfigError
from rayfed_dg.engine.store import formats
from rayfed_dg.engine.store.checkpoint import checkpoint_path, save_checkpoint
from rayfed_dg.engine.store.clientstore import ClientStore
from rayfed_dg.engine.store.rundir import RUN_RECORD, RunDir
from rayfed_dg.engine.store.sweepdir import MARKER, SweepDir

INIT = {"w": np.zeros(4, np.float32)}
RECORD = {"targets": ["mono"], "seeds": None, "labels": ["fedavg"], "rounds": 2, "config": None, "overrides": []}


def _trials(lams=(0.0, 1.0), targets=("a", "b")) -> list[dict]:
    return [{"method.lam": lam, "target": t, "seed": None, "finished": True, "status": "TERMINATED",
             "selected_round": 2, "selected_src_val": 0.5 + lam / 4, "selected_target_acc": 0.25 + lam / 8,
             "rounds_run": 2, "resumed_from_round": 0} for lam in lams for t in targets]


def _run_dir_with_checkpoint(path) -> tuple[RunDir, ClientStore]:
    """Today's run directory: run.json, and a checkpoint whose client states are in pieces."""
    from rayfed_dg.engine.running.run import TargetResult

    rd = RunDir.create(tiny_cfg(), path)
    rd.write_record(RECORD)
    store = ClientStore(INIT, 4, 1000)
    for c in (0, 2, 3):
        store.put(c, {"w": np.full(4, c, np.float32)}, {})
    manifest = store.checkpoint(rd.checkpoints("mono"), 1)
    server = {"round": 1, "global_state": {"w": np.ones(4, np.float32)}, "client_pieces": manifest,
              "server_state": {}, "clock": 2.5}
    rd.save_checkpoint("mono", 1, {"server": server, "result": asdict(TargetResult("mono", rounds_done=1)),
                                   "rows": "tables"}, manifest["pieces"])
    return rd, store


def test_what_today_writes_carries_its_format_and_reads_back(tmp_path):
    rd, store = _run_dir_with_checkpoint(tmp_path / "run")
    assert json.loads((rd.path / RUN_RECORD).read_text())["format"] == formats.RUN_DIR
    assert rd.record() == {"format": formats.RUN_DIR, **RECORD}
    assert rd.experiment()[1]["format"] == formats.RUN_DIR
    digest = json.loads(checkpoint_path(rd.checkpoints("mono"), 1).with_suffix(".json").read_text())
    assert digest["format"] == formats.CHECKPOINT
    ckpt = rd.latest_checkpoint("mono")
    assert ckpt["format"] == formats.CHECKPOINT and ckpt["rows"] == "tables" and ckpt["server"]["clock"] == 2.5
    manifest = ckpt["server"]["client_pieces"]
    assert manifest["format"] == formats.PIECES and manifest == store.manifest()
    again = ClientStore(INIT, 4, 1000)
    again.load(manifest, rd.checkpoints("mono"))
    assert again.clients() == [0, 2, 3] and [again.get(c)["w"][0] for c in (0, 2, 3)] == [0, 2, 3]
    # a sweep folder: its marker carries the format, and collect reads it through SweepDir
    from rayfed_dg.tuning import collect

    sweep = SweepDir(tmp_path / "lam")
    sweep.write("gperxan", ["method.lam"], ["b", "a"], _trials(), [])
    assert json.loads((sweep.path / MARKER).read_text()) == {
        "format": formats.SWEEP, "label": "gperxan", "params": ["method.lam"], "targets": ["b", "a"]}
    marker, records = sweep.read()
    assert marker["format"] == formats.SWEEP and records == _trials()
    assert collect([sweep.path], "csv").splitlines()[0] == "method,seeds,b,a,avg,chosen on source validation"
    assert SweepDir.kind(sweep.path) == "sweep" and SweepDir.kind(rd.path) is None
    trial = sweep.path / "trainable_00000"  # as Tune names a trial's folder
    trial.mkdir()
    (trial / "params.json").write_text("{}")
    (trial / "result.json").write_text("")
    assert sweep.trial_dirs() == [trial] and SweepDir.kind(trial) == "trial"


def test_only_sweepdir_names_the_sweep_folders_files():
    """A sweep folder has one owner, as a run directory has (``test_rundir``)."""
    import ast

    from conftest import REPO

    names = {"sweep.json", "trials.parquet", "selection.parquet", "selection.md", "chosen_config.yaml"}
    for path in [*(REPO / "rayfed_dg").rglob("*.py"), REPO / "tune.py"]:
        if path.name == "sweepdir.py":
            continue
        found = {n.value for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Constant) and n.value in names}
        assert not found, (path, found)


def _newer(path, **tree):
    path.write_text(json.dumps({**json.loads(path.read_text()), **tree}))


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "newer than rayfed-dg" in msg and "upgrade rayfed-dg" in msg, msg
    return msg


def test_a_newer_format_is_refused_in_one_line(tmp_path, capsys):
    from rayfed_dg.cli import main

    rd, _ = _run_dir_with_checkpoint(tmp_path / "run")
    # a checkpoint: refused, not taken for a corrupt one (no fallback to an older checkpoint)
    _newer(checkpoint_path(rd.checkpoints("mono"), 1).with_suffix(".json"), format=formats.CHECKPOINT + 1)
    with pytest.raises(ConfigError) as e:
        rd.latest_checkpoint("mono")
    assert f"a checkpoint of format {formats.CHECKPOINT + 1}" in _one_line(e)
    # a client-state manifest
    manifest = dict(ClientStore(INIT, 4, 1000).manifest(), format=formats.PIECES + 1)
    with pytest.raises(ConfigError) as e:
        ClientStore(INIT, 4, 1000).load(manifest, rd.checkpoints("mono"))
    _one_line(e)
    # the run directory: run.json, read by --resume and report
    _newer(rd.path / RUN_RECORD, format=formats.RUN_DIR + 1)
    with pytest.raises(ConfigError) as e:
        rd.record()
    assert str(rd.path / RUN_RECORD) in _one_line(e)
    for argv in (["run", "--resume", str(rd.path)], ["report", str(rd.path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "a run directory of format 2, newer than rayfed-dg" in err[0], err
    # a sweep folder: collect
    sweep = SweepDir(tmp_path / "lam")
    sweep.write("gperxan", ["method.lam"], ["a", "b"], _trials(), [])
    _newer(sweep.path / MARKER, format=formats.SWEEP + 1)
    assert main(["collect", str(sweep.path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a sweep folder of format 2, newer than rayfed-dg" in err[0], err


def test_a_checkpoint_written_before_versions_is_read_in_todays_shape(tmp_path):
    """A run's checkpoint without ``format``: no ``clock`` in its federation
    state, no ``rows`` (its clients' and ledger's rows are in its result),
    fewer clients'-phase times than rounds."""
    from rayfed_dg.engine.running.run import TargetResult

    result = asdict(TargetResult("mono", rounds_done=2, seconds_per_round=[1.0, 2.0]))
    del result["seconds_clients_per_round"]  # before rounds recorded their clients' phase
    rd = RunDir(tmp_path)
    save_checkpoint(rd.checkpoints("mono"), 2, {"server": {"round": 2, "global_state": {}, "server_state": {}},
                                                "result": result})
    digest = checkpoint_path(rd.checkpoints("mono"), 2).with_suffix(".json")
    digest.write_text(json.dumps({k: v for k, v in json.loads(digest.read_text()).items()
                                  if k not in ("format", "pieces")}))
    ckpt = rd.latest_checkpoint("mono")
    assert ckpt["format"] == formats.CHECKPOINT and ckpt["rows"] == "result" and ckpt["server"]["clock"] == 0.0
    assert ckpt["result"]["seconds_per_round"] == [1.0, 2.0]
    assert np.isnan(ckpt["result"]["seconds_clients_per_round"]).all()
    assert len(ckpt["result"]["seconds_clients_per_round"]) == 2
    assert formats.upgrade_checkpoint_state({"round": 3, "clock": 7.0}) == {"round": 3, "clock": 7.0}


def test_a_version_1_checkpoint_resumes_with_the_metrics_rows_it_carries(tmp_path):
    """Version 1 kept the metrics' rows in the checkpoint's result (``rows:
    "tables"``: only the clients' and ledger's are the tables'); today's
    keeps them in the metrics table (``rows: "all tables"``), and resuming
    reads each from where its version put it."""
    from rayfed_dg.engine.running.run import TargetResult, _resume

    def metric(r, acc):
        return {"target": "mono", "round": r, "split": "source_val", "domain": "a", "client": None,
                "accuracy": acc, "loss": 1.0, "samples": 4, "clients_dropped": 0, "sim_time": None}

    rd = RunDir.create(tiny_cfg(), tmp_path / "run")
    rd.write_record(RECORD)
    rd.write_round("mono", 1, {"metrics": [metric(1, 0.25)]})  # what the table holds
    carried = [metric(1, 0.75)]  # what a version 1 checkpoint carried
    server = {"round": 1, "global_state": {"w": np.ones(4, np.float32)}, "server_state": {}, "clock": 0.0}
    result = asdict(TargetResult("mono", metrics=carried, rounds_done=1, seconds_per_round=[1.0],
                                 seconds_clients_per_round=[1.0]))
    save_checkpoint(rd.checkpoints("mono"), 1, {"format": 1, "server": server, "result": result, "rows": "tables"})
    res, state = _resume(rd, "mono")
    assert state["format"] == formats.CHECKPOINT and res.metrics == carried
    assert [(r["round"], r["seconds"]) for r in rd.read_rows("rounds")] == [(1, 1.0)]  # its seconds: the table's
    rd.save_checkpoint("mono", 1, {"server": server, "result": dict(result, metrics=[]), "rows": "all tables"})
    assert _resume(rd, "mono")[0].metrics == [metric(1, 0.25)]


def test_a_version_2_checkpoint_moves_its_seconds_into_the_rounds_table(tmp_path):
    """Version 2 carried each round's seconds in its result; version 3 keeps
    them in the rounds table (``rows: "all tables and rounds"``), so that a
    checkpoint does not grow with the rounds.  Resuming a version 2
    checkpoint writes its seconds there; the next checkpoint carries none
    and resumes with them."""
    from rayfed_dg.engine.running.run import ROWS, TargetResult, _resume

    rd = RunDir.create(tiny_cfg(), tmp_path / "run")
    rd.write_record(RECORD)
    server = {"round": 2, "global_state": {"w": np.ones(4, np.float32)}, "server_state": {}, "clock": 0.0}
    result = asdict(TargetResult("mono", rounds_done=2, seconds_per_round=[1.5, 2.5],
                                 seconds_clients_per_round=[1.0, 2.0]))
    save_checkpoint(rd.checkpoints("mono"), 2, {"format": 2, "server": server, "result": result,
                                                "rows": "all tables"})
    res, state = _resume(rd, "mono")
    assert state["format"] == formats.CHECKPOINT and state["rows"] == "all tables"
    assert res.seconds_per_round == [1.5, 2.5] and res.seconds_clients_per_round == [1.0, 2.0]
    assert [(r["target"], r["round"], r["seconds"], r["seconds_clients"]) for r in rd.read_rows("rounds")] == [
        ("mono", 1, 1.5, 1.0), ("mono", 2, 2.5, 2.0)]
    rd.save_checkpoint("mono", 2, {"server": server, "rows": ROWS, "result": dict(
        result, seconds_per_round=[], seconds_clients_per_round=[])})
    again = _resume(rd, "mono")[0]
    assert again.seconds_per_round == [1.5, 2.5] and again.seconds_clients_per_round == [1.0, 2.0]


def test_an_older_checkpoints_seconds_are_its_last_rounds(tmp_path):
    """A run resumed across the release that began to record the clients'
    phase carried it for its last rounds only, and a checkpoint's lists may
    be shorter than its rounds: each second goes to its own round, counted
    back from the checkpoint's, the unknown phase (NaN) to the first."""
    from rayfed_dg.engine.running.run import TargetResult, _resume

    rd = RunDir.create(tiny_cfg(), tmp_path / "run")
    rd.write_record(RECORD)
    result = asdict(TargetResult("mono", rounds_done=5, seconds_per_round=[2.0, 3.0, 4.0, 5.0]))
    result["seconds_clients_per_round"] = [0.4, 0.5]
    server = {"round": 5, "global_state": {"w": np.ones(4, np.float32)}, "server_state": {}}
    save_checkpoint(rd.checkpoints("mono"), 5, {"format": 0, "server": server, "result": result})
    res = _resume(rd, "mono")[0]
    assert res.seconds_per_round == [2.0, 3.0, 4.0, 5.0] and res.seconds_clients_per_round[2:] == [0.4, 0.5]
    rows = [(r["round"], r["seconds"], r["seconds_clients"]) for r in rd.read_rows("rounds")]
    assert [r[:2] for r in rows] == [(2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0)]
    assert np.isnan([r[2] for r in rows[:2]]).all() and [r[2] for r in rows[2:]] == [0.4, 0.5]


def test_todays_checkpoint_reads_its_failed_clients_from_the_tables(tmp_path):
    """A client whose training failed for good is a ledger row of group
    ``dropped`` and a clients row with its reason; today's checkpoint keeps
    none of them (they would grow with the failures), and resuming reads
    them back: round, client and reason, of this target and its rounds up to
    the checkpoint's."""
    from rayfed_dg.engine.running.run import ROWS, TargetResult, _resume

    rd = RunDir.create(tiny_cfg(), tmp_path / "run")
    rd.write_record(RECORD)

    def client(t, r, c, reason):
        return {"target": t, "round": r, "client": c, "dropped": reason is not None, "drop_reason": reason}

    def drop(t, r, c, group="dropped"):
        return {"target": t, "round": r, "client": c, "direction": "up", "group": group, "tensors": 0, "bytes": 0}

    for t, r in (("mono", 1), ("mono", 2), ("mono", 3), ("other", 1)):
        rd.write_round(t, r, {"ledger": [drop(t, r, 0, "updates"), drop(t, r, 0, "model"), drop(t, r, r)],
                              "clients": [client(t, r, 0, None), client(t, r, 4, "deadline"),
                                          client(t, r, r, f"failed {t} {r}")]})
    server = {"round": 2, "global_state": {"w": np.ones(4, np.float32)}, "server_state": {}, "clock": 0.0}
    rd.save_checkpoint("mono", 2, {"server": server, "rows": ROWS, "result": asdict(TargetResult("mono", rounds_done=2))})
    assert _resume(rd, "mono")[0].dropped == [{"round": 1, "client": 1, "reason": "failed mono 1", "target": "mono"},
                                              {"round": 2, "client": 2, "reason": "failed mono 2", "target": "mono"}]


def test_the_fixtures_run_json_is_read_through_the_migration(tmp_path):
    from test_rundir import OLD

    rec = RunDir(OLD / "compare_seeds").record()
    assert "format" not in json.loads((OLD / "compare_seeds" / RUN_RECORD).read_text())
    assert rec["format"] == formats.RUN_DIR and rec["seeds"] == [0, 1]
    # a sweep before its marker carried a format: the folder's name, the records' keys and targets stand in
    sweep = SweepDir(tmp_path / "old-sweep")
    sweep.write("x", ["method.lam"], ["a"], [{k: v for k, v in r.items() if k != "finished"} for r in _trials()], [])
    (sweep.path / MARKER).unlink()
    marker, records = sweep.read()
    assert marker == {"format": formats.SWEEP, "label": "old-sweep", "params": ["method.lam"], "targets": ["a", "b"]}
    assert all(r["finished"] for r in records)


def test_a_copy_of_the_resume_files_alone_resumes_as_the_run_directory_does(tmp_path):
    """A Tune trial's snapshot is a copy of ``resume_files``: the checkpoint with its pieces and the part files
    of the target's rounds up to it (its rows are the tables'), not a later round's nor another target's."""
    import shutil

    from rayfed_dg.engine.running.run import TargetResult, _resume
    from rayfed_dg.engine.store.rundir import resume_files

    rd, _ = _run_dir_with_checkpoint(tmp_path / "run")
    for t, r in (("mono", 1), ("mono", 2), ("other", 1)):
        rd.write_round(t, r, {
            "metrics": [{"target": t, "round": r, "split": "source_val", "domain": "a", "accuracy": r / 4}],
            "ledger": [{"target": t, "round": r, "client": 0, "direction": "up", "group": "g", "tensors": 1,
                        "bytes": 8}]})
    server = {"round": 1, "global_state": {"w": np.ones(4, np.float32)}, "server_state": {}, "clock": 0.0}
    rd.save_checkpoint("mono", 1, {"server": server, "rows": "all tables",
                                   "result": asdict(TargetResult("mono", rounds_done=1, seconds_per_round=[1.0],
                                                                 seconds_clients_per_round=[1.0]))})
    files = resume_files(rd, "mono", 1)
    assert {f.relative_to(rd.path).as_posix() for f in files if f.parent.name != "mono"} == {
        "metrics.parquet/mono-r00001.parquet", "ledger.parquet/mono-r00001.parquet"}
    snap = tmp_path / "snap"
    for f in files:
        (snap / f.relative_to(rd.path)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, snap / f.relative_to(rd.path))
    here, there = _resume(rd, "mono")[0], _resume(RunDir(snap), "mono")[0]
    assert there.metrics == here.metrics and [m["accuracy"] for m in there.metrics] == [0.25]
    assert there.ledger == here.ledger and len(there.ledger) == 1
