"""Federations side by side (engine.concurrent_federations): the numbers of
one after another, whatever runs beside a federation, how many workers it
has, or which of its workers die; a stopped concurrent run resumes to the
same numbers; where each federation ran is recorded."""
import json
import subprocess
import sys

import pytest
from conftest import REPO, ctrl_c_when, held_cli

from rayfed_dg.config import ConfigError, load_config
from rayfed_dg.engine.store.records import TABLES, TIMING
from rayfed_dg.engine.store.rundir import RunDir

QUICK = ["data.resolution=16", "model.width=8", "training.local_epochs=null", "training.local_steps=2"]
ROWS = ("fedavg", "gperxan")  # the quickstart's compare rows
TARGETS = ["colour", "mono"]


def run_inproc(run_dir, *sets, resume=False):
    """``rayfed-dg run`` of the quickstart (2 rows x 2 targets, 2 rounds) in this process, on the session's Ray."""
    from rayfed_dg.engine.running.service import RunRequest, execute_run

    if resume:
        return execute_run(RunRequest(resume=str(run_dir), no_progress=True))
    return execute_run(RunRequest(config=str(REPO / "configs" / "quickstart.yaml"), target=",".join(TARGETS),
                                  run_dir=str(run_dir), no_progress=True,
                                  overrides=["training.rounds=2", *QUICK, *sets]))


def tables(run_dir, skip=TIMING):
    """Every row's tables but the columns ``skip`` (``TIMING``: wall time) and each target's selected round and
    accuracies."""
    out = {}
    for label in ROWS:
        rd = RunDir(run_dir / label)
        for name in TABLES:
            out[label, name] = [{k: v for k, v in r.items() if k not in skip} for r in rd.read_rows(name)]
        for t, s in rd.summary()["targets"].items():
            out[label, t] = (s["selected_round"], s["target_acc"], s["source_val_acc"], s["final_target_acc"])
    return out


def placements(run_dir):
    return [RunDir(run_dir / label).summary()["targets"][t]["placement"] for label in ROWS for t in TARGETS]


def test_concurrent_federations_is_auto_or_a_whole_number():
    assert load_config(None).engine.concurrent_federations == "auto"
    assert load_config(None, ["engine.concurrent_federations=3"]).engine.concurrent_federations == 3
    for bad in ("0", "-1", "2.5", "many", "true"):
        with pytest.raises(ConfigError, match=r"engine\.concurrent_federations: .*auto .*whole number >= 1") as e:
            load_config(None, [f"engine.concurrent_federations={bad}"])
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_side_by_side_gives_the_numbers_of_one_after_another(ray_session, tmp_path, capsys):
    """One at a time with 2 workers each; auto (2 at once on the session's
    2 CPUs, workers lent and added between rounds as the rule says); auto
    with 1 worker each and workers killed mid-round: the same tables, row
    for row, and the same selections."""
    one = tmp_path / "one"
    run_inproc(one, "engine.concurrent_federations=1", "engine.num_workers=2")
    assert "== 4 federations, at most 1 at once" in capsys.readouterr().err
    base = tables(one)
    assert len(base["fedavg", "metrics"]) == 2 * 2 * 4 and len(base["gperxan", "clients"]) == 2 * 2 * 3
    auto = tmp_path / "auto"
    run_inproc(auto)
    assert "== 4 federations, at most 2 at once" in capsys.readouterr().err
    assert tables(auto) == base
    faulty = tmp_path / "faulty"
    # p = 0.2: seeded, the same draws in every federation (they name no target or method), round 1 kills
    # client 1's first attempt and nothing else dies: one worker process lost per federation, each restart costly
    run_inproc(faulty, "engine.num_workers=1", "engine.fault_probability=0.2", "engine.fault_mode=kill",
               "engine.max_task_retries=8", "engine.max_restarts=20")
    # the clients' charged retries differ (they are the faults); nothing else does
    assert tables(faulty, (*TIMING, "retried")) == tables(one, (*TIMING, "retried"))
    assert sum(r["retried"] for label in ROWS for r in RunDir(faulty / label).read_rows("clients")) == 4
    # where each ran: one node (the session's), its workers, its span; side by side, two spans overlap
    node = ray_session.get_runtime_context().get_node_id()
    for run, widths in ((one, {2}), (auto, {1, 2}), (faulty, {1})):
        ps = placements(run)
        assert all(p["nodes"] == [node] and p["workers"] in widths and 0 <= p["started_s"] < p["ended_s"] for p in ps)
        spans = sorted((p["started_s"], p["ended_s"]) for p in ps)
        overlap = any(b[0] < a[1] for a, b in zip(spans, spans[1:]))
        assert overlap == (run != one), run
    # resuming a finished run schedules nothing and keeps every record, placements included
    before = placements(auto)
    run_inproc(auto, resume=True)
    assert "== 4 federations (4 finished before), at most 0 at once" in capsys.readouterr().err
    assert tables(auto) == base and placements(auto) == before


def cli(run_dir, *sets):
    cmd = [sys.executable, "-m", "rayfed_dg", "run", str(REPO / "configs" / "quickstart.yaml"), "--target",
           ",".join(TARGETS), "--run-dir", str(run_dir), "--no-progress"]
    for kv in ("training.rounds=5", *QUICK, *sets):
        cmd += ["--set", kv]
    return cmd


@pytest.mark.slow
def test_ctrl_c_in_a_concurrent_run_then_resume_gives_the_uninterrupted_numbers(tmp_path):
    run, clean = tmp_path / "run", tmp_path / "clean"
    marker = tmp_path / "saved"
    # the driver waits once two federations have saved a round: Ctrl-C lands while several run, however busy
    # the machine is
    code, _, err = ctrl_c_when(held_cli(cli(run)[3:], marker, federations=2), marker.exists,
                               "two federations saved a round", timeout=900)
    assert len({p.parent for p in run.glob("*/checkpoints/*/round_*.json")}) == 2
    assert code == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == f"rayfed-dg: interrupted; resume with: rayfed-dg run --resume {run}"
    r = subprocess.run([sys.executable, "-m", "rayfed_dg", "run", "--resume", str(run), "--no-progress"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    c = subprocess.run(cli(clean, "engine.concurrent_federations=1"), capture_output=True, text=True, timeout=900)
    assert c.returncode == 0, c.stderr[-2000:]
    assert "at most 1 at once" in c.stderr
    got, want = tables(run), tables(clean)
    assert len(want["fedavg", "metrics"]) == 5 * 2 * 4 and got == want
    for label in ROWS:  # the same row summaries but for the timings
        a, b = (json.loads((d / label / "summary.json").read_text()) for d in (run, clean))
        for s in (a, b):
            for t in s["targets"].values():
                for k in ("placement", "mean_seconds_per_round", "tasks_rerun"):
                    t.pop(k)
        assert a == b, label
