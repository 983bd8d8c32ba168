"""Ray Tune sweeps of whole federations, selection by source validation, cluster.yaml."""
import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, ctrl_c_when, tiny_space

from rayfed_dg.tuning import select_value


def test_selection_rule_uses_source_validation_not_target():
    recs = []
    # value 0.5 has the best target accuracy everywhere, 1.0 the best source validation
    for lam, src, tgt in ((0.0, 0.60, 0.50), (0.5, 0.70, 0.95), (1.0, 0.80, 0.40)):
        for t in ("a", "b"):
            recs.append({"method.lam": lam, "target": t, "selected_round": 3, "selected_src_val": src,
                         "selected_target_acc": tgt})
    chosen, rows = select_value(recs, ["method.lam"])
    assert chosen == {"method.lam": 1.0}
    assert [r["chosen"] for r in rows] == [False, False, True]
    assert rows[1]["a"] == 0.95 and rows[2]["a_round"] == 3


def test_collect_chooses_per_seed_on_source_validation_then_mean_se_over_seeds(tmp_path, capsys):
    from rayfed_dg.cli import main
    from rayfed_dg.utils import write_table

    # seed 0 prefers lam 1.0 on source validation, seed 1 lam 0.0; target accuracy never decides
    src = {(0, 0.0): 0.5, (0, 1.0): 0.6, (1, 0.0): 0.7, (1, 1.0): 0.4}
    tgt = {(0, 0.0, "a"): 0.9, (0, 1.0, "a"): 0.30, (0, 0.0, "b"): 0.9, (0, 1.0, "b"): 0.50,
           (1, 0.0, "a"): 0.20, (1, 1.0, "a"): 0.9, (1, 0.0, "b"): 0.60, (1, 1.0, "b"): 0.9}
    recs = [{"method.lam": lam, "target": t, "seed": s, "finished": True, "status": "TERMINATED",
             "selected_round": 2, "selected_src_val": src[s, lam], "selected_target_acc": tgt[s, lam, t],
             "rounds_run": 2, "resumed_from_round": 0}
            for s in (0, 1) for lam in (0.0, 1.0) for t in ("a", "b")]
    sweep = tmp_path / "lambda"
    sweep.mkdir()
    write_table(recs, sweep / "trials.parquet")
    assert main(["collect", str(sweep), "--format", "csv"]) == 0
    head, row = capsys.readouterr().out.strip().splitlines()
    # by hand: a = (30, 20) -> 25 ± 5; b = (50, 60) -> 55 ± 5; per-seed avg (40, 40) -> 40 ± 0
    assert head == "method,seeds,a,b,avg,chosen on source validation"
    assert row == 'lambda,2,25.00 ± 5.00,55.00 ± 5.00,40.00 ± 0.00,seed 0: method.lam=1.0; seed 1: method.lam=0.0'
    # a seed with an unfinished trial is left out (its choice could change) and said
    recs[2]["finished"] = False  # seed 0, lam 1.0, target a
    write_table(recs, sweep / "trials.parquet")
    assert main(["collect", str(sweep), "--format", "csv"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[1]
    assert row.startswith("lambda,1,20.00,60.00,40.00,") and "seeds left out, unfinished: 0" in row, row
    assert main(["collect", str(tmp_path / "nothing")]) == 2
    assert "not a sweep folder" in capsys.readouterr().err


def test_selection_averages_source_validation_over_targets_and_gives_a_tie_to_the_first_value():
    # mean source validation: x=1 (0.875 + 0.125) / 2 = 0.5; x=2 and x=3 both 0.625 (a tie): x=2, first in order;
    # the best single target (x=1 on a) or the last of a tie (x=3) would be another choice
    src = {(1, "a"): 0.875, (1, "b"): 0.125, (2, "a"): 0.625, (2, "b"): 0.625, (3, "a"): 0.5, (3, "b"): 0.75}
    # the trials in an order that no sort of the records themselves would put back (x=3's first trial on a)
    recs = [{"target": t, "x": x, "selected_round": 1, "selected_src_val": src[x, t], "selected_target_acc": 0.1}
            for x in (3, 1, 2) for t in (("a", "b") if x == 3 else ("b", "a"))]
    chosen, rows = select_value(recs, ["x"])
    assert chosen == {"x": 2}
    assert [r["x"] for r in rows] == [1, 2, 3] and [r["chosen"] for r in rows] == [False, True, False]
    assert [r["mean_src_val"] for r in rows] == [0.5, 0.625, 0.625]


def test_the_sweep_table_by_hand_with_records_that_predate_the_finished_flag():
    from rayfed_dg.tuning import markdown_table

    # no "finished" key: a record of an older sweep, finished; value 3's only trial stopped before any evaluation
    recs = [{"x": 1, "target": "a", "selected_round": 4, "selected_src_val": 0.5, "selected_target_acc": 0.25},
            {"x": 1, "target": "b", "selected_round": 3, "selected_src_val": 0.75, "selected_target_acc": 0.5},
            {"x": 2, "target": "a", "selected_round": 2, "selected_src_val": 0.25, "selected_target_acc": 0.125},
            {"x": 3, "target": "a", "selected_round": None, "selected_src_val": None, "selected_target_acc": None,
             "finished": False}]
    chosen, rows = select_value(recs, ["x"])
    assert chosen == {"x": 1} and rows[0]["a_finished"] is True
    assert markdown_table(rows, ["a", "b"], ["x"]).splitlines()[2:] == [
        "| 1 | 25.00 (r4) | 50.00 (r3) | 37.50 | 62.50 | **yes** |",
        "| 2 | 12.50 (r2) | - | 12.50 | 25.00 |  |",
        "| 3 | unfinished | - | - | - |  |"]


def test_collect_reads_the_sweeps_label_params_and_target_order_and_lists_seeds_in_order(tmp_path, capsys):
    from rayfed_dg.cli import main
    from rayfed_dg.utils import write_table

    # seeds listed 1 then 0, records without "finished" (older sweeps: finished); sweep.json names the label,
    # the searched key and the targets' order
    recs = [{"method.lam": lam, "target": t, "seed": s, "selected_round": 2, "selected_src_val": 0.5 + lam * (s - 0.5),
             "selected_target_acc": {"a": 0.5, "b": 0.25}[t] + lam / 8}
            for s in (1, 0) for lam in ((0.0, 1.0) if s else (1.0, 0.0)) for t in ("a", "b")]
    sweep = tmp_path / "folder"
    sweep.mkdir()
    write_table(recs, sweep / "trials.parquet")
    (sweep / "sweep.json").write_text(json.dumps({"label": "lam-sweep", "params": ["method.lam"],
                                                   "targets": ["b", "a"]}))
    assert main(["collect", str(sweep), "--format", "csv"]) == 0
    head, row = capsys.readouterr().out.strip().splitlines()
    # seed 0 chooses lam 0 (src 0.5 vs 0.0), seed 1 lam 1 (1.0 vs 0.5): b (25.00, 37.50), a (50.00, 62.50)
    assert head == "method,seeds,b,a,avg,chosen on source validation"
    assert row == "lam-sweep,2,31.25 ± 6.25,56.25 ± 6.25,43.75 ± 6.25,seed 0: method.lam=0.0; seed 1: method.lam=1.0"
    # a folder without trials.parquet says how to finish it; a path that is no folder does not
    (tmp_path / "empty").mkdir()
    assert main(["collect", str(tmp_path / "empty")]) == 2
    assert "run tune.py ... --resume" in capsys.readouterr().err
    assert main(["collect", str(tmp_path / "nothing")]) == 2
    assert "--resume" not in capsys.readouterr().err


def test_selection_ignores_values_missing_targets():
    recs = [{"x": 1, "target": "a", "selected_round": 1, "selected_src_val": 0.9, "selected_target_acc": 0.1},
            {"x": 2, "target": "a", "selected_round": 1, "selected_src_val": 0.5, "selected_target_acc": 0.1},
            {"x": 2, "target": "b", "selected_round": 1, "selected_src_val": 0.5, "selected_target_acc": 0.1}]
    assert select_value(recs, ["x"])[0] == {"x": 2}


def test_an_unfinished_trial_is_marked_and_its_value_never_chosen():
    from rayfed_dg.tuning import markdown_table

    # value 2 has the best source validation, but its trial on target b was interrupted at round 2
    recs = [{"x": 1, "target": "a", "selected_round": 4, "selected_src_val": 0.6, "selected_target_acc": 0.3,
             "finished": True},
            {"x": 1, "target": "b", "selected_round": 3, "selected_src_val": 0.6, "selected_target_acc": 0.4,
             "finished": True},
            {"x": 2, "target": "a", "selected_round": 4, "selected_src_val": 0.9, "selected_target_acc": 0.5,
             "finished": True},
            {"x": 2, "target": "b", "selected_round": 2, "selected_src_val": 0.95, "selected_target_acc": 0.6,
             "finished": False}]
    chosen, rows = select_value(recs, ["x"])
    assert chosen == {"x": 1} and [r["chosen"] for r in rows] == [True, False]
    assert rows[1]["mean_src_val"] == 0.9  # only the finished trial's figure
    table = markdown_table(rows, ["a", "b"], ["x"])
    assert "60.00 (r2, unfinished)" in table and table.count("unfinished") == 1
    recs[1]["finished"] = False  # no value with every target finished: nothing is chosen
    assert select_value(recs, ["x"])[0] is None


def test_bad_space_is_one_line_exit_2():
    r = subprocess.run([sys.executable, str(REPO / "tune.py"), "--space", "lamda"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "did you mean lambda" in lines[0] and "lr" in lines[0]


def test_a_trial_process_told_to_end_inside_a_finaliser_ends_quietly(tmp_path):
    """A trial's process (Tune's actor) ends with Ray's SIGTERM, whose
    SystemExit can land in a finaliser: the trainable makes that an exit
    with its code, not a traceback under the finished sweep."""
    from conftest import FINALISER_EXIT, in_python

    out = in_python("import sys\nfrom rayfed_dg.tuning import trainable\n"
                    "try:\n    trainable({'target': 'colour'}, config_path=sys.argv[1], fixed=[])\n"
                    "except Exception:\n    pass\n" + FINALISER_EXIT, str(tmp_path / "missing.yaml"))
    assert (out.returncode, out.stdout, out.stderr) == (3, "", ""), out.stderr[-2000:]


def test_cluster_yaml_validates_against_rays_schema():
    import jsonschema
    import ray
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((REPO / "cluster.yaml").read_text())
    schema = json.load(
        open(os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")))
    jsonschema.validate(cfg, schema)
    validate_config(prepare_config(cfg))
    assert "--dashboard-host=127.0.0.1" in " ".join(cfg["head_start_ray_commands"])
    assert any("pip install" in c for c in cfg["setup_commands"])


@pytest.fixture(scope="module")
def two_trials(ray_session, tmp_path_factory):
    """One two-trial sweep (seed 3, 2 rounds), read by two tests: (its result, its storage, its spaces' folder)."""
    from rayfed_dg.tuning import run_sweep

    space_dir = tmp_path_factory.mktemp("spaces")
    store = tmp_path_factory.mktemp("sweep") / "store"
    tiny_space(space_dir / "tiny.yaml", "training.rounds=2")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # relative config path, as `python tune.py` users give it
        out = run_sweep("tiny", None, "colour", 1, "fifo", False, [], str(store), space_dir=space_dir, verbose=0,
                        seeds=[3])
    return out, store, space_dir


@pytest.mark.slow
def test_two_trial_sweep_writes_table_and_resumes_without_rerunning(two_trials, monkeypatch):
    from rayfed_dg.tuning import run_sweep

    out, store, space_dir = two_trials
    monkeypatch.chdir(REPO)
    assert len(out["records"]) == 2 and {r["method.lam"] for r in out["records"]} == {0.0, 1.0}
    assert {r["seed"] for r in out["records"]} == {3}
    sel = store / "tiny"
    for f in ("trials.parquet", "selection.parquet", "selection.md", "chosen_config.yaml"):
        assert (sel / f).is_file()
    best = max(out["records"], key=lambda r: r["selected_src_val"])
    assert out["chosen"] == {"method.lam": best["method.lam"]}
    assert yaml.safe_load((sel / "chosen_config.yaml").read_text())["method"]["lam"] == best["method.lam"]
    results = sorted(sel.glob("*/result.json"))
    before = [p.read_text() for p in results]
    assert len(results) == 2 and all(len(b.splitlines()) == 2 for b in before)  # 2 rounds reported each
    assert all(json.loads(b.splitlines()[0])["config"]["training.seed"] == 3 for b in before)  # the trials' seed
    from rayfed_dg.tuning import collect

    row = collect([sel], "csv").splitlines()[1]  # the sweep's method, its seed, and the value that seed chose
    assert row.startswith("gperxan,1,") and row.endswith(f"seed 3: method.lam={out['chosen']['method.lam']}"), row
    # each trial writes the run's TensorBoard scalars, equal to what it reported to Tune
    import numpy as np

    from rayfed_dg.engine.store.tblog import read_scalars

    for p in results:
        sc = read_scalars(p.parent / "tensorboard" / "colour")
        assert {"accuracy/source_val", "accuracy/target", "loss/train", "comm/bytes_up"} <= set(sc)
        reported = [json.loads(line) for line in p.read_text().splitlines()]
        # Tune's metrics are fractions (as the parquet tables); TensorBoard shows percent, as everything read by eye
        assert sc["accuracy/source_val"] == [(r["round"], float(np.float32(100 * r["src_val"]))) for r in reported]
        assert sc["accuracy/target"] == [(r["round"], float(np.float32(100 * r["target_acc"]))) for r in reported]
    # a kept trial checkpoint is complete by itself: the engine's checkpoint and the tables' rows up to its round,
    # which a restored trial reads back (its own checkpoint does not carry them)
    kept = sorted(sel.glob("*/checkpoint_*"))
    assert kept
    for ck in kept:
        (pt,) = sorted((ck / "checkpoints" / "colour").glob("round_*.pt"))
        r = int(pt.stem.split("_")[1])
        for table in ("metrics", "clients", "ledger"):
            assert (ck / f"{table}.parquet" / f"colour-r{r:05d}.parquet").is_file(), (ck, table)
    again = run_sweep("tiny", None, "colour", 1, "fifo", True, [], str(store), space_dir=space_dir, verbose=0)
    assert [p.read_text() for p in sorted(sel.glob("*/result.json"))] == before  # nothing re-ran
    assert again["chosen"] == out["chosen"]


@pytest.mark.slow
def test_sweep_interrupted_mid_trial_exits_130_chooses_nothing_and_resumes_to_an_uninterrupted_ones_result(
        tmp_path):
    """Ctrl-C (SIGINT to tune.py) while trials run: exit code 130, the table
    marks the unfinished trials, no chosen_config.yaml; ``--resume`` then
    continues each trial from its last checkpoint, and the result equals a
    sweep that was never interrupted."""
    import re
    import signal
    import time

    import pyarrow.parquet as pq

    # 12 rounds: on an idle machine a 16-px round takes a fraction of a second and the sweep's state is saved
    # once a second, so a window of two rounds (4 rounds, checkpoints 1-2) could pass unseen and the sweep end
    rounds = 12
    space = tiny_space(tmp_path / "tiny.yaml", f"training.rounds={rounds}", "output.checkpoint_every=1")
    cmd = [sys.executable, "tune.py", "--space", str(space), "--target", "colour"]
    proc = subprocess.Popen(cmd + ["--storage", str(tmp_path / "killed")], cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 400
    def recorded():  # the sweep's own state (saved every second) knows a trial's checkpoint of rounds 2 to 9
        return any(re.search(r"checkpoint_00000[1-8]", p.read_text())
                   for p in (tmp_path / "killed" / "tiny").glob("experiment_state*.json"))

    while not recorded():
        assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before round 2 was saved"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the driver
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert not (tmp_path / "killed" / "tiny" / "chosen_config.yaml").exists()
    said = [line for line in err.splitlines() if line.startswith("tune.py: ")]
    assert "unfinished" in out and len(said) == 1 and said[0].endswith("--resume"), (out[-2000:], err[-2000:])
    assert "nothing chosen; continue with: " in said[0]
    resumed = subprocess.run(cmd + ["--storage", str(tmp_path / "killed"), "--resume"], cwd=REPO,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "killed" / "tiny" / "chosen_config.yaml").is_file()
    clean = subprocess.run(cmd + ["--storage", str(tmp_path / "clean")], cwd=REPO, capture_output=True, text=True,
                           timeout=900)
    assert clean.returncode == 0, clean.stderr[-3000:]
    # what a user reads: a line per trial and the table, not Tune's status tables, its TensorBoard hint into
    # Ray's session folder, or a trial's checkpoint log lines
    lines = clean.stdout.splitlines()
    assert lines[0] == f"sweep folder {tmp_path / 'clean' / 'tiny'} (tensorboard --logdir {tmp_path / 'clean' / 'tiny'})"
    assert sorted(x.split(":")[0] for x in lines if f"finished after {rounds} rounds, best source val" in x) == [
        "method.lam=0.0 target=colour", "method.lam=1.0 target=colour"]
    assert len(lines) <= 12 and "/tmp/ray" not in clean.stdout + clean.stderr, clean.stdout
    assert "Traceback" not in clean.stderr and "Checkpoint successfully" not in clean.stderr, clean.stderr[-2000:]
    assert f"finished after {rounds} rounds" in resumed.stdout  # the bar and lines come back with a resumed sweep
    cols = ["method.lam", "target", "selected_round", "selected_src_val", "selected_target_acc", "rounds_run"]
    key = lambda p: sorted(tuple(r[c] for c in cols) for r in pq.read_table(p).to_pylist())  # noqa: E731
    assert key(tmp_path / "killed" / "tiny" / "trials.parquet") == key(tmp_path / "clean" / "tiny" / "trials.parquet")
    # the trial that had saved rounds went on from its last checkpoint, not from round 1
    resumed = lambda p: [r["resumed_from_round"] for r in pq.read_table(p / "tiny" / "trials.parquet").to_pylist()]  # noqa
    assert max(resumed(tmp_path / "killed")) >= 2 and set(resumed(tmp_path / "clean")) == {0}


@pytest.mark.slow
def test_sigterm_to_tune_py_alone_stops_the_sweep_as_ctrl_c_does(tmp_path):
    """``kill PID`` or ``timeout`` reaches the sweep's driver alone; Ray's failure-signal handler would abort it
    (exit 134, a stack dump) before it could name the resume command.  The signal lands once Tune made a
    trial's folder (after it set up the sweep's callbacks, the handlers among them) and inside that trial's
    first round (1,000 local epochs, which no machine ends before the signal): no trial has reported, and
    there is no table to print."""

    space = tiny_space(tmp_path / "tiny.yaml", "training.rounds=2", "training.local_epochs=1000")
    cmd = [sys.executable, "tune.py", "--space", str(space), "--target", "colour", "--storage", str(tmp_path / "sw")]
    code, out, err = ctrl_c_when(cmd, lambda: any((tmp_path / "sw" / "tiny").glob("trainable_*")),
                                 "a trial started", timeout=400, sigterm=True, cwd=REPO)
    assert code == 130 and "SIGTERM received" not in err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("tune.py: ")]
    again = shlex.join(["python", "tune.py", *cmd[2:], "--resume"])
    assert said == [f"tune.py: interrupted before any trial reported a round; nothing chosen; continue with: {again}"], \
        err[-2000:]
    assert not (tmp_path / "sw" / "tiny" / "chosen_config.yaml").exists()


@pytest.mark.slow
def test_a_trial_whose_process_is_killed_restarts_from_its_checkpoint_and_ends_as_one_never_killed(tmp_path):
    """Tune's FailureConfig (engine.trial_max_failures): one of two trials of
    the same config (the grid names its value twice) loses its process, as
    on a lost node, while its own trial folder holds a checkpoint of rounds
    3-9; the sweep goes on by itself, that trial from its checkpoint, and
    both trials end with the same numbers."""
    import re
    import signal
    import time

    import psutil
    import pyarrow.parquet as pq

    space = tiny_space(tmp_path / "tiny.yaml", "training.rounds=12", "output.checkpoint_every=1")
    spec = yaml.safe_load(space.read_text())
    spec["params"] = {"method.lam": {"grid": [0.5, 0.5]}}
    space.write_text(yaml.safe_dump(spec))
    proc = subprocess.Popen([sys.executable, "tune.py", "--space", str(space), "--target", "colour", "--storage",
                             str(tmp_path / "t")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 400

    def saved(trial):
        """The checkpoint indices in the sweep folder of the trial whose
        process is ``trial`` (Tune moves a trial's process into
        working_dirs/<its trial folder's name>); empty while it has none."""
        try:
            if "ImplicitFunc" not in " ".join(trial.cmdline()):
                return []
            folder = tmp_path / "t" / "tiny" / os.path.basename(trial.cwd())
        except psutil.Error:  # it ended meanwhile
            return []
        return [int(m[1]) for p in folder.glob("checkpoint_*") if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))]

    def in_window(trial):
        # a trial reports checkpoint k+1 only after Tune took in checkpoint k, so index 2 means a restore
        # point of round 2 at least; at most 8 (round 9) leaves rounds to run
        return 2 <= max(saved(trial), default=-1) <= 8

    while not (ready := [t for t in psutil.Process(proc.pid).children(recursive=True) if in_window(t)]):
        assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before round 3 was saved"
        time.sleep(0.2)
    ready[0].send_signal(signal.SIGSTOP)  # no round moves on between this look and the kill
    assert in_window(ready[0]), f"the trial went past round 9 before it was stopped: {saved(ready[0])}"
    ready[0].send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    rows = pq.read_table(tmp_path / "t" / "tiny" / "trials.parquet").to_pylist()
    cols = ["selected_round", "selected_src_val", "selected_target_acc", "rounds_run", "finished"]
    assert len(rows) == 2 and [r[c] for c in cols for r in rows[:1]] == [r[c] for c in cols for r in rows[1:]], rows
    assert rows[0]["rounds_run"] == 12
    # the killed trial went on from its last checkpoint, not from round 1; the other never restarted
    assert sorted(r["resumed_from_round"] for r in rows)[0] == 0 and max(r["resumed_from_round"] for r in rows) >= 2, rows


def _space_searching_data(path, base):
    """``base``'s space with data.split_seed searched over its one configured value: the same trials, but a
    ``data.*`` key is searched, so each trial loads and puts a dataset of its own."""
    space = yaml.safe_load(base.read_text())
    space["params"]["data.split_seed"] = {"grid": [0]}
    path.write_text(yaml.safe_dump(space))
    return path


def test_a_sweep_uploads_its_dataset_once_unless_a_data_key_is_searched(ray_session, tmp_path):
    import numpy as np

    from rayfed_dg.tuning import plan_sweep, upload

    space = tiny_space(tmp_path / "tiny.yaml")
    sw = plan_sweep(str(space), None, "colour", 1, "fifo", [], str(tmp_path / "st"))
    data = upload(sw)
    images, labels = ray_session.get(data["refs"])
    # the trials' copy is the driver's dataset, read in place (a read-only view of the object store)
    assert np.array_equal(images, sw.ds.images) and np.array_equal(labels, sw.ds.labels)
    assert not images.flags.writeable
    assert np.array_equal(data["rest"]["domains"], sw.ds.domains) and data["rest"]["domain_names"] == sw.ds.domain_names
    searched = plan_sweep(str(_space_searching_data(tmp_path / "d.yaml", space)), None, "colour", 1, "fifo", [],
                          str(tmp_path / "st"))
    assert upload(searched) is None


@pytest.mark.slow
def test_trials_share_one_upload_and_give_the_numbers_of_per_trial_loading(two_trials, tmp_path, monkeypatch):
    from rayfed_dg.tuning import run_sweep

    monkeypatch.chdir(REPO)
    shared, store, space_dir = two_trials  # the sweep whose trials share the driver's upload
    _space_searching_data(tmp_path / "own.yaml", space_dir / "tiny.yaml")
    own = run_sweep("own", None, "colour", 1, "fifo", False, [], str(tmp_path / "b"), space_dir=tmp_path, verbose=0,
                    seeds=[3])
    reported = lambda d: [[json.loads(line) for line in p.read_text().splitlines()]  # noqa: E731
                          for p in sorted(d.glob("*/result.json"))]
    uploads = {r.get("data_upload") for rs in reported(store / "tiny") for r in rs}
    assert len(uploads) == 1 and None not in uploads  # both trials, every round: the one object the driver put
    assert all("data_upload" not in r for rs in reported(tmp_path / "b" / "own") for r in rs)
    cols = ["method.lam", "target", "selected_round", "selected_src_val", "selected_target_acc", "rounds_run"]
    key = lambda out: sorted(tuple(r[c] for c in cols) for r in out["records"])  # noqa: E731
    assert len(shared["records"]) == 2 and key(shared) == key(own)
    assert shared["chosen"] == {"method.lam": own["chosen"]["method.lam"]}


def test_wandb_and_mlflow_are_never_imported_unless_asked_for():
    code = ("import sys; import rayfed_dg.tuning as t; assert t.logger_callbacks('x') == []; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'mlflow') "
            "or m.startswith('ray.air.integrations')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


def test_asking_for_wandb_or_mlflow_without_the_package_is_one_line(monkeypatch):
    from rayfed_dg.config import ConfigError
    from rayfed_dg.tuning import logger_callbacks

    for flag, mod, arg in (("--wandb", "wandb", {"wandb_project": "p"}), ("--mlflow", "mlflow", {"mlflow_uri": "u"})):
        monkeypatch.setitem(sys.modules, mod, None)  # import fails, as when the package is absent
        with pytest.raises(ConfigError, match=f"{flag} needs the {mod} package"):
            logger_callbacks("x", **arg)
