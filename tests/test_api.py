"""``rayfed_dg.run`` (api.py) is ``rayfed-dg run`` from Python, and the W&B /
MLflow round loggers of ``rayfed-dg run`` (engine/store/trackers.py)."""
import json
import runpy
import struct
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO

EXAMPLE = REPO / "docs" / "examples" / "api_example.py"
TINY = ["compare=null", "training.rounds=2", "data.resolution=16", "model.width=8"]  # the example's overrides


def _sets(*kv):
    return [a for x in kv for a in ("--set", x)]


def test_importing_the_package_imports_neither_torch_nor_ray():
    code = ("import sys, rayfed_dg; f = rayfed_dg.run; c = rayfed_dg.RunResult; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'pandas', 'pyarrow', 'yaml'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"
    import rayfed_dg

    with pytest.raises(AttributeError, match="no attribute 'runn'"):
        rayfed_dg.runn  # noqa: B018


def test_overrides_are_set_values_that_read_back_as_the_python_values():
    from rayfed_dg.api import _overrides
    from rayfed_dg.config import ConfigError, load_config

    sets = _overrides({"compare": None, "training.lr": 1e-5, "method.name": "fedprox", "method.mu": 0.5,
                       "data.domains": ["mono", "colour"], "output.name": "1.0", "training.rounds": 3})
    # 1e-5 as "1e-05" would be a string to YAML (PyYAML wants a dot); "1.0" as a string stays one
    assert sets == ["compare=null", "training.lr=1.0e-05", "method.name=fedprox", "method.mu=0.5",
                    "data.domains=[mono, colour]", "output.name='1.0'", "training.rounds=3"]
    cfg = load_config(REPO / "configs" / "quickstart.yaml", sets)
    assert cfg.compare is None and cfg.training.lr == 1e-5 and cfg.method.name == "fedprox"
    assert cfg.method.params.mu == 0.5 and cfg.data.domains == ["mono", "colour"] and cfg.output.name == "1.0"
    with pytest.raises(ConfigError, match="expected a mapping of dotted keys"):
        _overrides(["training.lr=0.1"])


@pytest.mark.slow
def test_the_readme_example_gives_the_numbers_of_rayfed_dg_run(ray_session, tmp_path, monkeypatch, capsys):
    """docs/examples/api_example.py, run as it is (in this process, on the
    session's Ray), against ``rayfed-dg run`` with the same config in a
    subprocess of its own: the same metrics bit for bit, the same table."""
    from rayfed_dg.cli import main
    from rayfed_dg.engine.store.rundir import RunDir
    from rayfed_dg.utils import environment

    (tmp_path / "configs").symlink_to(REPO / "configs")  # the example names configs/quickstart.yaml
    monkeypatch.chdir(tmp_path)
    result = runpy.run_path(str(EXAMPLE), run_name="__main__")["result"]
    out = capsys.readouterr().out
    assert str(result.run_dir) in out and result.run_dir.parent == Path("runs")  # output.root, under the cwd
    cli = subprocess.run([sys.executable, "-m", "rayfed_dg", "run", "configs/quickstart.yaml", "--target", "colour",
                          "--run-dir", "cli", "--no-progress", *_sets(*TINY)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr[-2000:]
    m = result.metrics
    assert list(m.columns[:2]) == ["label", "seed"] and set(m["label"]) == {"fedavg"} and set(m["seed"]) == {0}
    written = pq.read_table(tmp_path / "cli" / "metrics.parquet").to_pandas()
    got = m.drop(columns=["label", "seed"]).sort_values(["round", "split", "domain"]).reset_index(drop=True)
    assert got.equals(written.sort_values(["round", "split", "domain"]).reset_index(drop=True))  # exact floats
    assert sorted(got["round"].unique()) == [1, 2] and set(got["split"]) == {"source_val", "target_test"}
    # the other tables are the run directory's as well (seconds are wall time, the one column that may differ)
    for name, frame in (("clients", result.clients), ("ledger", result.ledger)):
        mine = RunDir(result.run_dir).read_table(name).to_pandas()
        assert frame.drop(columns=["label", "seed"]).equals(mine), name
        theirs = RunDir(tmp_path / "cli").read_table(name).to_pandas()
        assert mine.drop(columns=["seconds"], errors="ignore").equals(
            theirs.drop(columns=["seconds"], errors="ignore")), name
    # rounds: one row a round, its wall seconds the driver measured, past its clients' phase
    r = result.rounds
    assert list(zip(r["target"], r["round"])) == [("colour", 1), ("colour", 2)]
    assert r.drop(columns=["label", "seed"]).equals(RunDir(result.run_dir).read_table("rounds").to_pandas())
    assert (r["seconds"] >= r["seconds_clients"]).all() and (r["seconds_clients"] > 0).all()
    # summary: report's table as rows; table(): report's Markdown
    assert [(r["method"], r["selection"], r["seeds"]) for r in result.summary] == [
        ("fedavg", "training-domain validation", "1"), ("fedavg", "last round", "1"),
        ("fedavg", "test-domain oracle (upper bound)", "1")]
    s = json.loads((tmp_path / "cli" / "summary.json").read_text())["targets"]["colour"]
    assert result.summary[0]["colour"] == f"{100 * s['target_acc']:.2f}"
    assert main(["report", str(result.run_dir)]) == 0
    assert result.table() in capsys.readouterr().out and result.table().startswith("| method | selection |")
    # it is a CLI run directory: resumable and recorded the same way
    rec = json.loads((result.run_dir / "run.json").read_text())
    assert rec["targets"] == ["colour"] and rec["overrides"] == TINY
    assert rec["environment"] == environment()  # the commit and library versions the run was made with


# ------------------------------------------------------------------ W&B and MLflow on rayfed-dg run

def test_wandb_and_mlflow_are_never_imported_unless_asked_for():
    code = ("import sys; from pathlib import Path; import rayfed_dg.cli, rayfed_dg.engine.running.run; "
            "from rayfed_dg.config import load_config; from rayfed_dg.engine.store.trackers import require_trackers, "
            "tracker_callbacks; cfg = load_config(None); require_trackers(cfg); "
            "assert tracker_callbacks(cfg, Path('.'), 'x') == []; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'mlflow')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("flag,mod,args", [
    ("--wandb", "wandb", ["--wandb", "proj"]),
    ("--mlflow", "mlflow", ["--mlflow", "sqlite:///mlflow.db"]),
    ("--mlflow", "mlflow", _sets("output.mlflow.tracking_uri=sqlite:///mlflow.db")),  # the config's section
])
def test_asking_for_wandb_or_mlflow_without_the_package_is_one_line(tmp_path, monkeypatch, capsys, flag, mod, args):
    from rayfed_dg.cli import main

    monkeypatch.setitem(sys.modules, mod, None)  # import fails, as when the package is absent
    code = main(["run", str(REPO / "configs" / "quickstart.yaml"), "--run-dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"rayfed-dg: error: output.{mod} ({flag}) needs the {mod} package (pip install {mod}"), err
    assert not (tmp_path / "run").exists()  # checked before anything is written


def test_an_mlflow_store_that_does_not_answer_is_one_line(tmp_path, capsys):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install -e '.[mlflow]')")
    from rayfed_dg.cli import main

    code = main(["run", str(REPO / "configs" / "quickstart.yaml"), "--run-dir", str(tmp_path / "run"),
                 "--mlflow", "nosuchscheme://x"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "output.mlflow.tracking_uri nosuchscheme://x: " in err, err
    assert not (tmp_path / "run").exists()


def _tiny_run(run_dir, *options):
    from rayfed_dg.cli import main

    return main(["run", str(REPO / "configs" / "quickstart.yaml"), "--target", "colour", "--run-dir", str(run_dir),
                 "--no-progress", *_sets(*TINY), *options])


def _expected_scalars(run_dir) -> dict[int, dict[str, float]]:
    """Per round, the TensorBoard tags' values computed by hand from the run's own tables."""
    import numpy as np

    m = pq.read_table(run_dir / "metrics.parquet").to_pylist()
    c = pq.read_table(run_dir / "clients.parquet").to_pylist()
    out = {}
    for r in sorted({x["round"] for x in m}):
        src = [x["accuracy"] for x in m if x["round"] == r and x["split"] == "source_val"]
        tgt = [x["accuracy"] for x in m if x["round"] == r and x["split"] == "target_test"]
        up = sum(x["bytes_up"] for x in c if x["round"] == r)
        out[r] = {"accuracy/source_val": 100 * float(np.mean(src)), "accuracy/target": 100 * float(np.mean(tgt)),
                  "comm/bytes_up": float(up)}
    return out


def _wandb_records(path):
    """The records of a W&B transaction log (``run-<id>.wandb``: a 7-byte
    header, then LevelDB-log blocks of 32 KiB; record header: CRC32, length,
    type 1 full | 2 first | 3 middle | 4 last)."""
    data, pos, buf = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            yield buf
            buf = b""


@pytest.mark.slow
def test_wandb_offline_logs_the_tensorboard_scalars(ray_session, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[wandb]')")
    from wandb.proto import wandb_internal_pb2 as pb

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    assert _tiny_run(run_dir, "--wandb", "rayfed-test", *_sets("output.wandb.mode=offline")) == 0
    logs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1, logs  # one W&B run per federation (one target here)
    history: dict[int, dict[str, float]] = {}
    runs = []
    for data in _wandb_records(logs[0]):
        rec = pb.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history[rec.history.step.num] = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                             for i in rec.history.item}
        elif kind == "run":
            runs.append(rec.run)
    assert runs and runs[0].project == "rayfed-test" and runs[0].display_name == "colour"
    want = _expected_scalars(run_dir)
    assert sorted(history) == sorted(want) == [1, 2]
    for r, tags in want.items():
        for tag, v in tags.items():
            assert history[r][tag] == pytest.approx(v, rel=1e-12, abs=1e-12), (r, tag)
        assert {"loss/train", "time/round_seconds", "comm/bytes_down"} <= set(history[r])


@pytest.mark.slow
def test_mlflow_logs_the_tensorboard_scalars_and_the_config(ray_session, tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install -e '.[mlflow]')")
    pytest.importorskip("sqlalchemy", reason="an MLflow SQLite store needs the full mlflow package, not mlflow-skinny")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    assert _tiny_run(run_dir, "--mlflow", uri, *_sets("output.name=tiny")) == 0
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("tiny")  # default experiment: output.name
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "colour" and runs[0].info.status == "FINISHED"
    run = runs[0]
    assert run.data.params["method.name"] == "fedavg" and run.data.params["training.rounds"] == "2"
    assert run.data.tags["target"] == "colour" and run.data.tags["rayfed_dg.run_dir"] == "run"
    for tag, by_round in {t: {r: v[t] for r, v in _expected_scalars(run_dir).items()}
                          for t in ("accuracy/source_val", "accuracy/target", "comm/bytes_up")}.items():
        hist = {h.step: h.value for h in client.get_metric_history(run.info.run_id, tag)}
        assert hist == pytest.approx(by_round, rel=1e-12, abs=1e-9), tag


# ------------------------------------------------------------------ what the CLI offers besides run and load

def test_calibrate_is_privacy_calibrate(capsys):
    import rayfed_dg
    from rayfed_dg.cli import main

    sets = {"compare": None, "data.resolution": 16, "model.width": 8}
    z = rayfed_dg.calibrate(REPO / "configs" / "quickstart.yaml", 6, sets)
    assert main(["privacy", "calibrate", str(REPO / "configs" / "quickstart.yaml"),
                 *_sets("compare=null", "data.resolution=16", "model.width=8"), "--epsilon", "6"]) == 0
    assert capsys.readouterr().out.strip() == f"privacy.updates.noise_multiplier={z:.4f}" and z == 2.3025
    from rayfed_dg.config import ConfigError

    with pytest.raises(ConfigError, match="give a positive epsilon"):
        rayfed_dg.calibrate(REPO / "configs" / "quickstart.yaml", 0, sets)


def test_collect_is_rayfed_dg_collect(tmp_path, capsys):
    import rayfed_dg
    from rayfed_dg.cli import main
    from rayfed_dg.engine.store.sweepdir import SweepDir

    recs = [{"method.lam": lam, "target": t, "seed": s, "finished": True, "status": "TERMINATED",
             "selected_round": 2, "selected_src_val": 0.5 + lam * (s - 0.5), "selected_target_acc": 0.25 + lam / 8,
             "rounds_run": 2, "resumed_from_round": 0} for s in (0, 1) for lam in (0.0, 1.0) for t in ("a", "b")]
    SweepDir(tmp_path / "lam").write("gperxan", ["method.lam"], ["a", "b"], recs, [])
    assert main(["collect", str(tmp_path / "lam"), "--format", "csv"]) == 0
    assert rayfed_dg.collect(tmp_path / "lam", "csv") + "\n" == capsys.readouterr().out
    assert rayfed_dg.collect([str(tmp_path / "lam")]).startswith("| method | seeds | a | b |")


def test_resume_takes_the_uri_of_a_runs_copy_and_downloads_it_first(tmp_path, monkeypatch):
    """``rayfed_dg.run(resume="s3://...")`` as ``rayfed-dg run --resume s3://...``: the copy (here a folder
    URI, as pyarrow opens it) is downloaded to the cache and resumed from there (the federations are not run
    here: ``run_planned`` stops the test)."""
    import shutil

    import rayfed_dg
    from rayfed_dg.config import ConfigError
    from rayfed_dg.engine.running import experiment

    old = Path(__file__).parent / "fixtures" / "rundir_12d6f0b" / "single"
    shutil.copytree(old, tmp_path / "bucket" / "runs" / "single")
    monkeypatch.setenv("RAYFED_DG_CACHE", str(tmp_path / "cache"))
    seen = []

    class Planned(Exception):
        pass

    def planned(exp, run_dir, progress=True):
        seen.append((run_dir.path, list(exp.targets), progress))
        raise Planned

    monkeypatch.setattr(experiment, "run_planned", planned)
    with pytest.raises(Planned):
        rayfed_dg.run(resume=f"file://{tmp_path}/bucket/runs/single", progress=False)
    local = tmp_path / "cache" / "runs" / str(tmp_path).lstrip("/") / "bucket" / "runs" / "single"
    assert seen == [(local, ["mono", "colour"], False)]
    assert sorted(p.relative_to(local) for p in local.rglob("*")) == \
        sorted(p.relative_to(old) for p in old.rglob("*"))
    with pytest.raises(ConfigError, match=r"no run there \(no run.json\)"):
        rayfed_dg.run(resume=f"file://{tmp_path}/bucket/runs")


@pytest.mark.slow
def test_a_dry_run_trains_one_round_and_keeps_nothing(ray_session, tmp_path, monkeypatch):
    import rayfed_dg

    monkeypatch.chdir(tmp_path)
    result = rayfed_dg.run(REPO / "configs" / "quickstart.yaml", {"compare": None, "data.resolution": 16,
                                                                  "model.width": 8}, target="colour",
                           dry_run=True, progress=False)
    assert set(result.metrics["round"]) == {1} and not result.run_dir.exists() and not list(tmp_path.iterdir())
