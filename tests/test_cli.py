"""The command line, end to end, in a subprocess with its own local Ray."""
import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, ctrl_c_when, held_cli


def quick_run(run_dir, *sets, options=()):
    """The quickstart for target colour, 2 rounds on 16 px images, one method."""
    cmd = [sys.executable, "-m", "rayfed_dg", "run", str(REPO / "configs" / "quickstart.yaml"),
           "--target", "colour", "--run-dir", str(run_dir), "--no-progress", *options]
    for kv in ("training.rounds=2", "data.resolution=16", "model.width=8", "compare=null", *sets):
        cmd += ["--set", kv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_two_round_run_writes_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    proc = quick_run(run_dir, "method.name=fedbn")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fedbn" in proc.stdout and "colour" in proc.stdout
    for name in ("config.yaml", "summary.json", "best_colour.pt"):
        assert (run_dir / name).is_file(), name
    for name in ("metrics", "ledger", "clients"):  # folders of per-round parts
        assert sorted(p.name for p in (run_dir / f"{name}.parquet").iterdir()) == [
            "colour-r00001.parquet", "colour-r00002.parquet"], name
    assert list((run_dir / "tensorboard" / "colour").glob("events.out.tfevents.*"))
    m = pq.read_table(run_dir / "metrics.parquet").to_pylist()
    # FedBN's clients keep their own BN: each client's own model is evaluated too (personal_val)
    assert {r["split"] for r in m} == {"source_val", "target_test", "personal_val"}
    assert {r["round"] for r in m} == {1, 2}
    assert {r["domain"] for r in m if r["split"] == "source_val"} == {"mono", "negative", "texture"}
    s = json.loads((run_dir / "summary.json").read_text())["targets"]["colour"]
    val = {r["round"]: [] for r in m}
    for r in m:
        if r["split"] == "source_val":
            val[r["round"]].append(r["accuracy"])
    best = max(val, key=lambda k: (sum(val[k]) / 3, -k))
    assert s["selected_round"] == best
    tgt = [r["accuracy"] for r in m if r["split"] == "target_test" and r["round"] == best][0]
    assert abs(s["target_acc"] - tgt) < 1e-12
    sd = torch.load(run_dir / "best_colour.pt", weights_only=True)
    assert "head.weight" in sd
    led = pq.read_table(run_dir / "ledger.parquet").to_pylist()
    assert {r["direction"] for r in led} == {"up", "down"} and len({r["client"] for r in led}) == 3
    assert "method:\n  name: fedbn" in (run_dir / "config.yaml").read_text()


@pytest.fixture(scope="module")
def seed1_run(tmp_path_factory):
    """One CLI run of seed 1, read by two tests: what it prints, and its numbers against a two-seed run's."""
    run_dir = tmp_path_factory.mktemp("seed1") / "run"
    return run_dir, quick_run(run_dir, "training.seed=1", "engine.max_restarts=3")


@pytest.mark.slow
def test_a_normal_run_prints_nothing_that_looks_like_an_error(seed1_run):
    """Ray's per-worker core_worker line (ObjectRefs in a restartable actor's
    constructor) and its token-authentication WARNING must not appear; the
    only stderr lines are the engine's own progress lines."""
    proc = seed1_run[1]
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and all(ln.startswith("== ") for ln in lines), lines
    for word in ("WARNING", "core_worker", "restart will fail", "Token authentication", "rror"):
        assert word not in proc.stderr + proc.stdout, word


@pytest.mark.slow
def test_diverging_training_stops_with_one_line_error(tmp_path):
    # a learning rate of 1e9 sends the loss to inf/nan in the first round: the run
    # must stop (exit 1) with the engine's message, not average NaNs for 2 rounds
    run_dir = tmp_path / "run"
    proc = quick_run(run_dir, "training.lr=1e9")
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rayfed-dg: error: client ") and "round 1: local training diverged" in last, last
    # the other client's diverged job is fetched too, so Ray prints no "Unhandled error" after ours
    assert "Unhandled error" not in proc.stderr, proc.stderr[-2000:]
    assert not (run_dir / "summary.json").exists()


@pytest.mark.slow
def test_unknown_target_is_one_line_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rayfed_dg", "run", str(REPO / "configs" / "quickstart.yaml"),
                           "--target", "textures", "--run-dir", str(run_dir)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "did you mean texture" in lines[0]
    assert not run_dir.exists()


def test_report_averages_seeds(tmp_path):
    from rayfed_dg.cli import main

    for seed, (a, b) in enumerate(((0.5, 0.7), (0.7, 0.9))):
        d = tmp_path / f"s{seed}" / "fedavg"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"targets": {"x": {"target_acc": a}, "y": {"target_acc": b}},
                                                    "average_target_acc": (a + b) / 2, "method": "fedavg"}))
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["report", str(tmp_path / "s0"), str(tmp_path / "s1")]) == 0
    row = [l for l in buf.getvalue().splitlines() if l.startswith("| fedavg")][0]
    assert "| 2 |" in row and "60.00 ± 10.00" in row and "80.00 ± 10.00" in row and "70.00 ± 10.00" in row


@pytest.mark.slow
def test_evaluate_reproduces_the_selected_round_and_changes_only_evaluation(tmp_path, capsys):
    # FedFD-A Table 3 c1 re-evaluates one trained model with other inference statistics; a comparison of one row
    # (as a table is run a row at a time) keeps the row's files in the run directory itself
    from rayfed_dg.cli import main

    run_dir = tmp_path / "run"
    proc = quick_run(run_dir, "compare=[{name: fedfda, lambda2: 0.1}]")
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = json.loads((run_dir / "summary.json").read_text())["targets"]["colour"]
    capsys.readouterr()

    def evaluate(*sets):
        args = ["evaluate", str(run_dir)] + [a for kv in sets for a in ("--set", kv)]
        code = main(args)
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = evaluate()
    assert code == 0
    row = [c.strip() for c in [l for l in out.splitlines() if l.startswith("colour |")][0].split(" | ")]
    # the saved best model, evaluated again, gives exactly what the run recorded
    assert row[1] == f"{100 * s['source_val_acc']:.2f}" and row[2] == f"{100 * s['target_acc']:.2f}"
    accs = set()
    for mode in ("global", "instance", "adapter"):
        code, out, _ = evaluate(f"method.inference={mode}")
        assert code == 0
        accs.add([l for l in out.splitlines() if l.startswith("colour |")][0])
    assert len(accs) >= 2  # the inference statistics change the predictions
    code, _, err = evaluate("model.width=16")
    assert code == 2 and err.count("\n") == 1 and "may only change" in err
    code, _, err = evaluate("method.name=fedfd")
    assert code == 2 and "trained with fedfda" in err


def test_report_keeps_ccst_variants_apart(tmp_path, capsys):
    from rayfed_dg.cli import main

    for name, ccst, acc in (("plain", "stages: {ccst: null}", 0.5), ("k1", "stages: {ccst: {k: 1}}", 0.6),
                            ("k2", "stages: {ccst: {k: 2, style: overall}}", 0.7),
                            ("single", "stages: {ccst: {k: 2, style: single, j: 3}}", 0.8)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(ccst + "\n")
        (d / "summary.json").write_text(json.dumps({"targets": {"x": {"target_acc": acc}}, "average_target_acc": acc,
                                                    "method": "fedavg"}))
    assert main(["report"] + [str(tmp_path / n) for n in ("plain", "k1", "k2", "single")]) == 0
    rows = {l.split(" | ")[0][2:]: l for l in capsys.readouterr().out.splitlines()
            if l.startswith("| fedavg") and "training-domain" in l}
    # a stage's label names the settings that differ from its defaults (K = 2, overall style)
    assert set(rows) == {"fedavg", "fedavg + ccst(k=1)", "fedavg + ccst", "fedavg + ccst(j=3, style=single)"}
    assert "| 70.00 |" in rows["fedavg + ccst"]


def test_result_table_aligns_every_variant():
    from rayfed_dg.engine import format_table

    def summary(accs, rounds):
        return {"targets": {t: {"target_acc": a, "selected_round": r} for t, a, r in zip(("mnist", "usps"), accs, rounds)},
                "average_target_acc": sum(accs) / 2}

    lines = format_table({"fedavg": summary([0.9333, 0.125], [10, 9]),
                          "a_longer_label": summary([0.0417, 0.0417], [1, 1])}).splitlines()
    assert len(lines) == 6 and len({len(x) for x in lines}) == 1
    assert {tuple(i for i, ch in enumerate(x) if ch == "|") for x in lines if "|" in x} == {
        tuple(i for i, ch in enumerate(lines[0]) if ch == "|")}
    assert lines[4].split("|")[1:] == ["  4.17 ", "  4.17 ", "  4.17"]


@pytest.mark.slow
def test_seeds_give_the_numbers_of_separate_runs(tmp_path, seed1_run):
    from rayfed_dg.engine.store.rundir import RunDir

    read_rows = lambda d, name: RunDir(d).read_rows(name)  # noqa: E731

    multi = tmp_path / "multi"
    proc = quick_run(multi, options=("--seeds", "0,1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # summary.json has one shape, a row's: each seed's folder holds its own, the root none
    assert sorted(p.name for p in multi.iterdir()) == ["run.json", "seed0", "seed1"]
    # the second seed against a run of its own (state carried over from the first seed would show here)
    one, r = seed1_run
    assert r.returncode == 0, r.stderr[-2000:]
    assert read_rows(multi / "seed1", "metrics") == read_rows(one, "metrics")
    a, b = (json.loads((d / "summary.json").read_text())["targets"]["colour"] for d in (multi / "seed1", one))
    assert a["selected_round"] == b["selected_round"] and a["target_acc"] == b["target_acc"]
    m0, m1 = (read_rows(multi / f"seed{s}", "metrics") for s in (0, 1))
    assert m0 != m1  # the seeds really differ
    # the final table: mean +- SE over the two seeds, every rule
    accs = [json.loads((multi / f"seed{s}" / "summary.json").read_text())["targets"]["colour"]["target_acc"]
            for s in (0, 1)]
    row = [l for l in proc.stdout.splitlines() if "training-domain validation" in l][0]
    assert f"{50 * (accs[0] + accs[1]):.2f} ± {50 * abs(accs[0] - accs[1]):.2f}" in row
    assert "SE = std(ddof=1)/sqrt(n)" in proc.stdout and "test-domain oracle" in proc.stdout


def test_bad_seeds_are_one_line_exit_2(tmp_path, capsys):
    from rayfed_dg.cli import main

    for bad in ("0,x", "1,1", ","):
        assert main(["run", str(REPO / "configs" / "quickstart.yaml"), "--seeds", bad,
                     "--run-dir", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--seeds" in err[0]
    assert not (tmp_path / "r").exists()


def test_version_debug_and_help_text(capsys):
    from rayfed_dg import __version__
    from rayfed_dg.cli import _build_parser, main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"rayfed-dg {__version__}"
    parser = _build_parser()
    subs = parser._subparsers._group_actions[0].choices
    for name, sub in [("", parser), *subs.items(), *subs["data"]._subparsers._group_actions[0].choices.items()]:
        text = sub.format_help()
        assert "--debug" in text, name  # every command says it takes --debug
        assert "``" not in text and "`" not in text, name  # no reST markup in help
    assert main(["--debug", "report", "/nonexistent"]) == 2  # a top-level --debug is kept by the sub-command
    assert "Traceback" in capsys.readouterr().err


def test_data_list_fits_a_terminal(capsys, monkeypatch):
    from rayfed_dg.cli import main

    root = "/" + "deep/" * 30 + "data"  # a CI machine's long data root: only its own line may be long
    monkeypatch.setenv("RAYFED_DG_DATA", root)
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert f"data root: {root}\n" in out
    assert max(len(line) for line in out.splitlines() if root not in line) <= 100
    assert "pacs" in out and "PACS.zip" in out and "present" in out


def test_a_setting_the_run_would_ignore_is_an_error(tmp_path, capsys):
    from rayfed_dg.cli import main

    qs = str(REPO / "configs" / "quickstart.yaml")
    cases = [(["--set", "method.name=fedprox"], "--set method.name=fedprox: "),
             (["--set", "method.lam=0.3"], "runs its compare: list (fedavg, gperxan)"),
             (["--seeds", "0,1", "--set", "training.seed=3"], "--set training.seed=3 and --seeds"),
             (["--resume", str(tmp_path), "--run-dir", str(tmp_path / "x")], "drop --run-dir"),
             (["--resume", str(tmp_path), "--dry-run"], "--dry-run and --resume")]
    for extra, msg in cases:
        argv = ["run", *extra] if "--resume" in extra else ["run", qs, "--run-dir", str(tmp_path / "r"), *extra]
        assert main(argv) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], (extra, err)
    assert "add --set compare=null to run one method" in main(["run", qs, "--set", "method.name=fedprox"]) * "" + \
        capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "x").exists()


def fake_summary(path, label, seed, accs, method=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "summary.json").write_text(json.dumps({
        "targets": {t: {"target_acc": a, "selected_round": 1} for t, a in accs.items()},
        "average_target_acc": sum(accs.values()) / len(accs), "method": method or label, "label": label,
        "seed": seed}))


def test_report_input_that_holds_no_finished_run_is_exit_2(tmp_path, capsys):
    from rayfed_dg.cli import main

    (tmp_path / "empty").mkdir()
    sweep = tmp_path / "tune" / "lambda"
    sweep.mkdir(parents=True)
    (sweep / "trials.parquet").write_bytes(b"")
    for args, msg in (([str(tmp_path / "does_not_exist")], "does_not_exist: no such directory"),
                      ([str(tmp_path / "empty")], "no finished runs under"),
                      ([str(sweep)], "is a Ray Tune sweep folder, not a run directory: its table is"),
                      ([str(tmp_path / "tune")], "lambda is a Ray Tune folder: see its selection.md")):
        assert main(["report", *args]) == 2, args
        out = capsys.readouterr()
        err = out.err.strip().splitlines()
        assert len(err) == 1 and msg in err[0] and out.out == "", (args, err)


def test_report_names_what_an_interrupted_run_has_not_finished(tmp_path, capsys):
    from test_selection import SRC, make_run

    from rayfed_dg.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"targets": ["colour", "mono"], "seeds": None, "rounds": 4,
                                              "labels": ["fedavg", "gperxan", "fedbn"]}))
    make_run(run / "fedavg", "fedavg", 0, {t: (SRC, {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}) for t in ("colour", "mono")})
    make_run(run / "gperxan", "gperxan", 0, {"colour": ({1: 0.5, 2: 0.6}, {1: 0.1, 2: 0.2})})
    (run / "gperxan" / "summary.json").unlink()  # killed in round 3 of colour
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr()
    warn = out.err.strip().splitlines()
    assert warn == [
        f"rayfed-dg: warning: {run}/gperxan is not finished (colour 2 of 4 rounds, mono 0 of 4 rounds) and is not "
        f"in the table; resume with: rayfed-dg run --resume {run}",
        f"rayfed-dg: warning: {run}/fedbn is not finished (not started) and is not in the table; resume with: "
        f"rayfed-dg run --resume {run}"]
    assert "| fedavg |" in out.out and "gperxan" not in out.out


def test_report_and_resume_name_the_code_and_libraries_a_run_was_made_with(tmp_path, capsys):
    """run.json records the commit and library versions (a PACS figure moved 1.3 points between two sessions
    with the same config and seed, and nothing recorded why); report warns when it averages or sets side by side runs
    made with different ones, and --resume when it would continue a run with other ones."""
    from test_selection import SRC, make_run

    from rayfed_dg.cli import main
    from rayfed_dg.utils import environment

    now = environment()
    assert set(now) == {"python", "rayfed_dg_commit", "torch", "torchvision", "numpy", "pillow", "timm", "ray"}
    assert now["torch"] == torch.__version__.split("+")[0] and now["pillow"] is not None

    def finished(name, seed, env):
        run = tmp_path / name
        make_run(run, "fedavg", seed, {"colour": (SRC, {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4})})
        (run / "run.json").write_text(json.dumps({"targets": ["colour"], "seeds": None, "environment": env}))
        return run

    same = [finished("a", 0, now), finished("b", 1, dict(now))]  # seeds of one row
    other = finished("c", 2, dict(now, pillow="12.1.0", numpy="1.26.4"))
    old = finished("d", 3, None)  # made before run.json recorded an environment: not compared
    assert main(["report", *map(str, same), str(old)]) == 0
    assert capsys.readouterr().err == ""
    assert main(["report", *map(str, same), str(other)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rayfed-dg: warning: these runs were made with different code or libraries: numpy {now['numpy']} "
                   f"({same[0]} and 1 more), 1.26.4 ({other}); pillow {now['pillow']} ({same[0]} and 1 more), 12.1.0 "
                   f"({other}); a difference between them can come from those as well as from the seed or the method"]
    # --resume names what changed (here refused afterwards: another target than the run's)
    (other / "config.yaml").write_text("method: {name: fedavg}\n")
    assert main(["run", "--resume", str(other), "--target", "mono"]) == 2
    err = capsys.readouterr().err
    assert (f"rayfed-dg: warning: {other} was started with other code or libraries (numpy 1.26.4 -> {now['numpy']}, "
            f"pillow 12.1.0 -> {now['pillow']}); its remaining rounds may not give the numbers an uninterrupted run "
            "would") in err
    (same[0] / "config.yaml").write_text("method: {name: fedavg}\n")
    assert main(["run", "--resume", str(same[0]), "--target", "mono"]) == 2
    assert "other code or libraries" not in capsys.readouterr().err


def test_one_label_and_one_order_per_row(tmp_path, capsys):
    """Rows in the config's order (not by name), each under one label in
    run's table, report and the plots; a run named twice counts once."""
    from rayfed_dg.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("compare:\n  - {name: gperxan}\n  - {name: fedavg, stages: {ccst: {k: 3}}}\n"
                                     "  - {name: fedavg, label: ccst, stages: {ccst: {}}}\n"
                                     "  - {name: elcfs, stages: {amplitude: {}}}\n")
    rows = [("gperxan", "gperxan", None, 0.5), ("fedavg", "fedavg", "stages: {ccst: {k: 3}}\n", 0.6),
            ("ccst", "fedavg", "stages: {ccst: {k: 2}}\n", 0.7), ("elcfs", "elcfs", "stages: {amplitude: {}}\n", 0.8)]
    summaries = {}
    for label, method, stages, acc in rows:
        fake_summary(run / label, label, 0, {"mono": acc, "colour": acc}, method)
        (run / label / "config.yaml").write_text(f"method: {{name: {method}}}\n" + (stages or ""))
        summaries[label] = json.loads((run / label / "summary.json").read_text())
    want = ["gperxan", "fedavg + ccst(k=3)", "ccst", "elcfs"]
    assert main(["report", str(run), str(run / "fedavg"), "--format", "csv"]) == 0  # a folder and one inside it
    out = capsys.readouterr().out.strip().splitlines()
    got = [l.split(",")[0] for l in out[1:] if "training-domain" in l]
    assert got == want and all(",1," in l for l in out[1:])
    assert out[0].startswith("method,selection,seeds,mono,colour")  # targets in the order they ran
    from rayfed_dg.reporting import collect_runs, run_table

    table = run_table(summaries, run)
    assert [l.split("|")[0].strip() for l in table.splitlines()[2::2]] == want
    assert list(collect_runs([run], unfinished=True)) == want
    # seeds by number, not by name: seed10 after seed2
    seeds = tmp_path / "seeds"
    for s in (0, 2, 10):
        fake_summary(seeds / f"seed{s}", "fedavg", s, {"mono": 0.1 * s})
    assert [r.summary["seed"] for r in collect_runs([seeds])["fedavg"]] == [0, 2, 10]


@pytest.mark.slow
def test_ctrl_c_prints_the_resume_command_and_resume_needs_only_the_run_directory(tmp_path, capsys):

    from rayfed_dg.cli import main

    run = tmp_path / "run"
    args = ["run", str(REPO / "configs" / "quickstart.yaml"), "--target", "colour", "--run-dir", str(run),
            "--no-progress"]
    for kv in ("training.rounds=3", "data.resolution=16", "model.width=8", "compare=null", "output.checkpoint_every=1"):
        args += ["--set", kv]
    ckpts, marker = run / "checkpoints" / "colour", tmp_path / "saved"
    # the driver waits after round 1's checkpoint: Ctrl-C lands mid-run however busy the machine is
    code, out, err = ctrl_c_when(held_cli(args, marker), marker.exists, "round 1 was saved")
    seen = sorted(p.name for p in ckpts.glob("round_*.json"))
    assert code == 130 and seen == ["round_00001.json"], (seen, err[-2000:])
    assert err.strip().splitlines()[-1] == f"rayfed-dg: interrupted; resume with: rayfed-dg run --resume {run}"
    assert not (run / "summary.json").exists()
    assert json.loads((run / "run.json").read_text())["targets"] == ["colour"]
    # the report says what is missing and how to finish it, exit 2
    assert main(["report", str(run)]) == 2
    assert f"resume with: rayfed-dg run --resume {run}" in capsys.readouterr().err
    # another target than the run's is refused; the run's own are kept without being named
    assert main(["run", "--resume", str(run), "--target", "mono"]) == 2
    assert "was started with --target colour" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "rayfed_dg", "run", "--resume", str(run), "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert list(json.loads((run / "summary.json").read_text())["targets"]) == ["colour"]
    assert f"run dir {run}" in r.stdout and any(l.strip().startswith("fedavg |") for l in r.stdout.splitlines())


@pytest.mark.slow
def test_sigterm_to_the_driver_stops_the_run_as_ctrl_c_does(tmp_path):
    """``kill PID`` (``timeout``, ``docker stop``) reaches the driver alone; Ray's failure-signal handler would
    abort it (exit 134, a stack dump, no resume line)."""
    run, marker = tmp_path / "run", tmp_path / "saved"
    args = ["run", str(REPO / "configs" / "quickstart.yaml"), "--target", "colour", "--run-dir", str(run),
            "--no-progress"]
    for kv in ("training.rounds=3", "data.resolution=16", "model.width=8", "compare=null", "output.checkpoint_every=1"):
        args += ["--set", kv]
    code, out, err = ctrl_c_when(held_cli(args, marker), marker.exists, "round 1 was saved", sigterm=True)
    assert code == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == f"rayfed-dg: interrupted; resume with: rayfed-dg run --resume {run}"
    assert "SIGTERM received" not in err and not (run / "summary.json").exists()
    assert sorted(p.name for p in (run / "checkpoints" / "colour").glob("round_*.json")) == ["round_00001.json"]


@pytest.mark.slow
def test_a_dry_run_names_no_directory_it_deleted(tmp_path, capsys):
    from rayfed_dg.cli import main

    assert main(["run", str(REPO / "configs" / "quickstart.yaml"), "--dry-run", "--target", "colour", "--no-progress",
                 "--set", "data.resolution=16", "--set", "model.width=8"]) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing kept (--run-dir DIR keeps its run directory)" in out
    assert "rayfed-dg-dry-run-" not in out and any(l.strip().startswith("gperxan |") for l in out.splitlines())


def test_output_cut_short_by_the_reader_is_no_traceback():
    import os
    import subprocess
    import sys

    # `rayfed-dg data list | head -0`: the reader has left before anything is written
    r, w = os.pipe()
    os.close(r)
    p = subprocess.run([sys.executable, "-m", "rayfed_dg", "data", "list"], stdout=w, stderr=subprocess.PIPE,
                       text=True, timeout=120)
    os.close(w)
    assert p.returncode == 141 and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
