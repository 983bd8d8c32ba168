"""``RunDir`` (engine/store/rundir.py) owns the run directory, and run directories
written before it stay readable; the typed rows of a round become table rows
in one place (``records.table_rows``); one helper gives a split's mean
accuracy per round (``records.split_means``).

``fixtures/rundir_12d6f0b`` was written by commit 12d6f0b (before ``RunDir``)::

    S="--set training.rounds=2 --set training.local_steps=25 --set data.limit_per_domain=80
       --set model.width=8 --set evaluation.batch_size=64 --no-progress"
    rayfed-dg run configs/quickstart.yaml --target mono,colour --set compare=null $S --run-dir single
    rayfed-dg run configs/quickstart.yaml --target mono $S --run-dir compare
    rayfed-dg run configs/quickstart.yaml --target mono $S --seeds 0,1 --run-dir compare_seeds

(checkpoints, TensorBoard files and all but ``single``'s best weights
removed), and ``expected/`` holds what that commit's ``rayfed-dg report`` and
``rayfed-dg evaluate`` printed on it.  Its three ``summary.json`` shapes: a
row's (``single``, every ``<label>/``), a compare run's ``{label: summary}``
(``compare/``, ``compare_seeds/seed<S>/``) and a ``--seeds`` run's
``{"seeds": ...}`` (``compare_seeds/``).
"""
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import REPO

from rayfed_dg.engine.store.records import (
    ClientRow,
    DropRow,
    LedgerRow,
    MetricRow,
    RoundResult,
    Split,
    split_mean,
    split_means,
    table_rows,
)
from rayfed_dg.engine.store.rundir import RunDir

OLD = Path(__file__).parent / "fixtures" / "rundir_12d6f0b"
EXPECTED = OLD / "expected"


def _cli(capsys, *argv) -> str:
    from rayfed_dg.cli import main

    assert main(list(argv)) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err, err
    return out


@pytest.mark.parametrize("run", ["single", "compare", "compare_seeds"])
def test_report_reads_a_run_directory_of_12d6f0b_as_it_did(capsys, run):
    assert _cli(capsys, "report", str(OLD / run)) == (EXPECTED / f"report_{run}.md").read_text()
    if run == "compare_seeds":
        assert _cli(capsys, "report", "--format", "csv", str(OLD / run)) == \
            (EXPECTED / "report_compare_seeds.csv").read_text()


def test_evaluate_reads_a_run_directory_of_12d6f0b_as_it_did(capsys):
    run = OLD / "single"
    for argv, name in (([], "evaluate_single.txt"),
                       (["--set", "evaluation.batch_size=16", "--target", "colour"], "evaluate_single_colour.txt")):
        want = (EXPECTED / name).read_text().split("\n", 1)  # its first line names the folder as it was given then
        got = _cli(capsys, "evaluate", str(run), *argv).split("\n", 1)
        assert got[0].split(" ", 1)[1] == want[0].split(" ", 1)[1] and got[1] == want[1]


def test_older_summary_shapes_are_no_runs_and_the_rows_below_them_are():
    from rayfed_dg.reporting import find_runs

    assert RunDir(OLD / "compare_seeds").summary() is None  # {"seeds": {...}}
    assert RunDir(OLD / "compare_seeds" / "seed1").summary() is None  # {label: summary}
    row = RunDir(OLD / "compare_seeds" / "seed1" / "gperxan").summary()
    assert row is not None and row["label"] == "gperxan" and row["seed"] == 1 and list(row["targets"]) == ["mono"]
    runs = find_runs(OLD / "compare_seeds")
    assert [(r.path.relative_to(OLD).as_posix(), r.label) for r in runs] == [
        ("compare_seeds/seed0/fedavg", "fedavg"), ("compare_seeds/seed0/gperxan", "gperxan"),
        ("compare_seeds/seed1/fedavg", "fedavg"), ("compare_seeds/seed1/gperxan", "gperxan")]
    root, rec = RunDir(OLD / "compare_seeds" / "seed1" / "gperxan").experiment()
    assert root.path == OLD / "compare_seeds" and rec["seeds"] == [0, 1] and rec["labels"] == ["fedavg", "gperxan"]
    assert RunDir(OLD / "single").targets() == ["mono", "colour"]
    # 2 rounds x (3 source domains + the target), per target; parts in (target, round) order
    metrics = RunDir(OLD / "single").read_table("metrics").to_pylist()
    assert [(m["target"], m["round"]) for m in metrics] == [(t, r) for t in ("colour", "mono") for r in (1, 2)
                                                            for _ in range(4)]


def test_the_api_reads_a_run_directory_of_12d6f0b():
    import rayfed_dg

    result = rayfed_dg.load(OLD / "compare_seeds")
    want = (EXPECTED / "report_compare_seeds.csv").read_text().splitlines()
    assert [",".join(r.values()) for r in result.summary] == want[1:]
    assert result.table() == (EXPECTED / "report_compare_seeds.md").read_text().split("\n\n", 1)[1].rstrip("\n")
    m = result.metrics
    # per row, 2 rounds x (3 source domains + the target), and gperxan's 3 clients' own models
    assert list(m.groupby(["seed", "label"], sort=False).size().items()) == [
        ((0, "fedavg"), 8), ((0, "gperxan"), 14), ((1, "fedavg"), 8), ((1, "gperxan"), 14)]
    mine = RunDir(OLD / "compare_seeds" / "seed1" / "gperxan").read_table("metrics").to_pandas()
    got = m[(m["seed"] == 1) & (m["label"] == "gperxan")].drop(columns=["label", "seed"]).reset_index(drop=True)
    assert got.equals(mine)
    assert len(result.clients) == 4 * 2 * 3 and set(result.ledger["label"]) == {"fedavg", "gperxan"}


# ------------------------------------------------------------------ the layout

def test_seed_and_row_folders(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.seed(None) is rd and rd.seed(3).path == tmp_path / "seed3"
    assert rd.seed(3).row("fedbn", many=True).path == tmp_path / "seed3" / "fedbn"
    assert rd.row("fedbn", many=False) is rd
    assert RunDir.seed_of("seed12") == 12 and RunDir.seed_of("seedling") is None
    assert rd.checkpoint("mono", 7) == tmp_path / "checkpoints" / "mono" / "round_00007.pt"
    assert rd.weights("best", "mono") == tmp_path / "best_mono.pt"


def test_config_is_written_once(tmp_path):
    from conftest import tiny_cfg

    rd = RunDir(tmp_path / "seed0")
    rd.write_config(tiny_cfg("training.seed=0"))
    rd.write_config(tiny_cfg("training.seed=5"))  # a resume never rewrites what the run started with
    assert rd.config_tree()["training"]["seed"] == 0


def test_tables_read_in_target_and_round_order_whatever_the_write_order(tmp_path):
    rd = RunDir(tmp_path)
    row = lambda r, acc: {"target": None, "round": r, "split": "source_val", "domain": "a", "client": None,  # noqa
                          "accuracy": acc, "loss": 1.0, "samples": 4, "clients_dropped": 0}
    for target, r in (("b", 2), ("a", 10), ("b", 1), ("a", 2)):
        rd.write_rows("metrics", target, r, [dict(row(r, r / 100), target=target)])
    rd.write_rows("metrics", "a", 3, [])  # nothing to write: no part
    t = rd.read_table("metrics")
    assert t.schema.field("client").type == pa.int64()
    assert [(x["target"], x["round"]) for x in t.to_pylist()] == [("a", 2), ("a", 10), ("b", 1), ("b", 2)]
    assert sorted(p.name for p in (tmp_path / "metrics.parquet").iterdir()) == \
        ["a-r00002.parquet", "a-r00010.parquet", "b-r00001.parquet", "b-r00002.parquet"]
    assert RunDir(tmp_path / "none").read_table("ledger").num_rows == 0


# ------------------------------------------------------------------ typed rows to table rows

def _round() -> RoundResult:
    metrics = [MetricRow(4, Split.SOURCE_VAL, "a", None, 0.5, 1.0, 10),
               MetricRow(4, Split.SOURCE_VAL, "b", None, 0.25, 2.0, 30),
               MetricRow(4, Split.TARGET_TEST, "t", None, 0.125, 3.0, 20),
               MetricRow(4, Split.PERSONAL_VAL, "a", 0, 0.75, 0.5, 10)]
    clients = [ClientRow(4, 0, "a", 10, 3, 0.9, 1.5, 100, 200, 0, False, None),
               ClientRow(4, 1, "b", 30, 0, None, None, 0, 0, 2, True, "worker died")]
    ledger = [LedgerRow(4, 0, "up", "model", 3, 100), LedgerRow(4, 0, "down", "model", 3, 200)]
    return RoundResult(round=4, sampled=[0, 1], dropped=[DropRow(4, 1, "worker died")], metrics=metrics,
                       ledger=ledger, clients=clients, train_loss=0.9, tasks_retried=2, seconds_total=2.0)


def test_a_rounds_typed_rows_become_table_rows_with_their_target():
    from rayfed_dg.engine.store.records import TABLES

    t = table_rows("mono", _round())
    for name, rows in t.items():  # exactly the table's columns
        assert all(sorted(r) == sorted(c for c, _ in TABLES[name]) for r in rows), name
        assert {r["target"] for r in rows} == {"mono"}
    assert [(m["split"], m["clients_dropped"]) for m in t["metrics"]] == \
        [("source_val", 1), ("source_val", 1), ("target_test", 1), ("personal_val", 1)]
    assert type(t["metrics"][0]["split"]) is str  # a Split is written as its name
    # the dropped client: a ledger row of group "dropped", after the round's own
    assert [(x["client"], x["direction"], x["group"], x["bytes"]) for x in t["ledger"]] == \
        [(0, "up", "model", 100), (0, "down", "model", 200), (1, "up", "dropped", 0)]
    assert [(c["client"], c["dropped"], c["drop_reason"]) for c in t["clients"]] == \
        [(0, False, None), (1, True, "worker died")]


def test_split_means_by_round():
    rows = table_rows("mono", _round())["metrics"] + [
        {"round": 2, "split": "source_val", "accuracy": 0.2}, {"round": 2, "split": "source_val", "accuracy": 0.4},
        {"round": 2, "split": "source_val", "accuracy": 0.9}]
    assert split_means(rows, Split.SOURCE_VAL) == pytest.approx({2: 0.5, 4: 0.375})
    assert list(split_means(rows, Split.SOURCE_VAL)) == [2, 4]  # by round
    assert split_mean(rows, Split.TARGET_TEST, 4) == 0.125 and split_mean(rows, Split.TARGET_TEST, 2) is None
    assert split_mean(rows, Split.PERSONAL_VAL, 4) == 0.75  # the clients' own models, not the global one


def test_target_result_reads_the_selected_round_through_the_helper():
    from rayfed_dg.engine.running.run import TargetResult

    res = TargetResult("mono")
    out = _round()
    assert res.add_round(out, table_rows("mono", out))
    s = res.summary()
    assert (s["selected_round"], s["source_val_acc"], s["target_acc"], s["personal_val_acc"]) == (4, 0.375, 0.125,
                                                                                                   0.75)
    assert s["clients_dropped"] == 1 and s["final_target_acc"] == 0.125
    assert res.ledger[-1]["group"] == "dropped" and res.clients == table_rows("mono", _round())["clients"]


def test_api_and_engine_do_not_import_the_cli():
    import ast

    for path in [REPO / "rayfed_dg" / "api.py", *(REPO / "rayfed_dg" / "engine").glob("*.py")]:
        tree = ast.parse(path.read_text())
        names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module] + \
            [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in names if m == "rayfed_dg.cli" or m.endswith(".cli")], path


def test_only_rundir_names_the_run_directorys_files():
    """The layout has one owner: no other module spells out its file names."""
    import ast

    names = {"run.json", "config.yaml", "summary.json", "skipped_images.txt"}
    for path in (REPO / "rayfed_dg").rglob("*.py"):
        if path.name == "rundir.py":
            continue
        found = {n.value for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Constant) and n.value in names}
        assert not found, (path, found)


def test_a_run_directory_names_its_rows_as_the_config_does(tmp_path):
    # repeated labels get -2, -3 in config order; reports find the row folders by these names
    from rayfed_dg.config import load_config, method_variants, save_config

    cfg = load_config(None, ['compare=[{name: fedavg}, {name: gperxan}, {name: fedavg}, {name: fedprox, label: fedavg}]'])
    save_config(cfg, tmp_path / "config.yaml")
    assert [label for label, _ in method_variants(cfg)] == ["fedavg", "gperxan", "fedavg-2", "fedavg-3"]
    assert RunDir(tmp_path).compare_labels() == ["fedavg", "gperxan", "fedavg-2", "fedavg-3"]
