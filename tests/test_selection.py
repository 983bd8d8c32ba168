"""DomainBed's model-selection rules on hand-made records, the standard error
over seeds, and the report that puts them side by side."""
import json
import math

import numpy as np
import pytest

from rayfed_dg.engine.store.rundir import RunDir
from rayfed_dg.engine.store.selection import (
    RULES,
    LastRound,
    TestDomainOracle,
    TrainingDomainValidation,
    mean_se,
    select,
    select_round,
)


def rows(src: dict, tgt: dict, personal: dict | None = None, target="t"):
    """Evaluation rows: per round two source domains whose mean is src[r], one target."""
    out = []
    for r in sorted(src):
        out += [{"target": target, "round": r, "split": "source_val", "domain": "a", "accuracy": src[r] - 0.05},
                {"target": target, "round": r, "split": "source_val", "domain": "b", "accuracy": src[r] + 0.05},
                {"target": target, "round": r, "split": "target_test", "domain": target, "accuracy": tgt[r]}]
        for c, acc in enumerate((personal or {}).get(r, [])):
            out.append({"target": target, "round": r, "split": "personal_val", "domain": "a", "client": c,
                        "accuracy": acc})
    return out


SRC = {1: 0.5, 2: 0.8, 3: 0.8, 4: 0.6}  # best at 2 (tie with 3 goes to the earlier round)
TGT = {1: 0.9, 2: 0.4, 3: 0.5, 4: 0.3}  # best at 1, last evaluated round 4


def test_three_rules_on_hand_made_records():
    recs = rows(SRC, TGT)
    assert TrainingDomainValidation().choose(recs) == 2
    assert LastRound().choose(recs) == 4
    assert TestDomainOracle().choose(recs) == 1
    assert select(recs, TrainingDomainValidation()) == {"round": 2, "source_val": pytest.approx(0.8),
                                                        "target_acc": 0.4, "source_test": None, "personal_val": None}
    assert select(recs, LastRound())["target_acc"] == 0.3
    assert select(recs, TestDomainOracle())["target_acc"] == 0.9
    assert select_round(recs) == (2, pytest.approx(0.8))
    assert [r.upper_bound for r in RULES] == [False, False, False, True]
    assert RULES[1].choose(recs) is None  # held-out-domain validation: no held-out domain in these records
    assert select([], TrainingDomainValidation()) is None


def test_the_oracle_and_personal_figures_never_change_the_training_domain_choice():
    rng = np.random.default_rng(0)
    for _ in range(50):
        tgt = {r: float(rng.random()) for r in SRC}
        personal = {r: list(rng.random(3)) for r in SRC}
        recs = rows(SRC, tgt, personal)
        assert TrainingDomainValidation().choose(recs) == 2
        assert TestDomainOracle().choose(recs) == max(tgt, key=lambda r: (tgt[r], -r))


def test_last_round_is_the_last_evaluated_one():
    recs = rows({1: 0.5, 2: 0.6}, {1: 0.1, 2: 0.2}) + \
        [{"round": 3, "split": "personal_val", "domain": "a", "client": 0, "accuracy": 1.0}]
    assert LastRound().choose(recs) == 2


def test_standard_error_by_hand():
    vals = [0.5, 0.7, 0.9]
    m, se = mean_se(vals)
    mean = (0.5 + 0.7 + 0.9) / 3
    sd = math.sqrt(((0.5 - mean) ** 2 + (0.7 - mean) ** 2 + (0.9 - mean) ** 2) / (3 - 1))
    assert m == pytest.approx(0.7) and se == pytest.approx(sd / math.sqrt(3))  # 0.11547
    assert se == pytest.approx(0.2 / math.sqrt(3))
    assert mean_se([0.4]) == (pytest.approx(0.4), None)
    assert mean_se([0.5, 0.7])[1] == pytest.approx(0.1)  # two seeds: half their difference


def make_run(path, label, seed, per_target):
    """A finished run directory: metrics parts and summary.json, by hand."""
    path.mkdir(parents=True)
    tables = RunDir(path)
    summary = {"targets": {}, "method": label, "label": label, "seed": seed}
    for t, (src, tgt) in per_target.items():
        recs = rows(src, tgt, target=t)
        for r in src:
            tables.write_rows("metrics", t, r, [dict(x, clients_dropped=0, loss=1.0, samples=10) for x in recs
                                           if x["round"] == r])
        best, val = select_round(recs)
        summary["targets"][t] = {"selected_round": best, "source_val_acc": val, "target_acc": tgt[best]}
    summary["average_target_acc"] = float(np.mean([v["target_acc"] for v in summary["targets"].values()]))
    (path / "summary.json").write_text(json.dumps(summary))


def test_report_puts_the_three_rules_side_by_side_with_se_over_seeds(tmp_path, capsys):
    from rayfed_dg.cli import main

    # seeds 0, 1, 2 of one method under a --seeds parent; targets x and y
    accs = {0: (0.40, 0.60), 1: (0.50, 0.70), 2: (0.90, 0.80)}  # target x at the training-domain round, per seed
    for s, (x2, y2) in accs.items():
        make_run(tmp_path / "run" / f"seed{s}", "fedavg", s,
                 {"x": (SRC, {1: 0.95, 2: x2, 3: 0.5, 4: 0.30 + s / 10}),
                  "y": (SRC, {1: 0.85, 2: y2, 3: 0.5, 4: 0.20})})
    assert main(["report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "SE = std(ddof=1)/sqrt(n)" in out and "upper bound" in out
    table = {l.split(" | ")[1]: [c.strip() for c in l.strip("| ").split(" | ")] for l in out.splitlines()
             if l.startswith("| fedavg")}
    assert list(table) == ["training-domain validation", "last round", "test-domain oracle (upper bound)"]

    def cell(vals):
        m, se = mean_se([100 * v for v in vals])
        return f"{m:.2f} ± {se:.2f}"

    td = table["training-domain validation"]
    assert td[2] == "3" and td[3] == cell([0.4, 0.5, 0.9]) and td[4] == cell([0.6, 0.7, 0.8])
    assert td[3] == "60.00 ± 15.28"  # by hand: mean 60, SE = 26.46 / sqrt(3)
    assert td[5] == cell([(x + y) / 2 for x, y in accs.values()])
    assert table["last round"][3] == cell([0.3, 0.4, 0.5]) and table["last round"][4] == "20.00 ± 0.00"
    assert table["test-domain oracle (upper bound)"][3:5] == ["95.00 ± 0.00", "85.00 ± 0.00"]
    # the same table as CSV and LaTeX
    assert main(["report", str(tmp_path / "run"), "--format", "csv"]) == 0
    csv_lines = capsys.readouterr().out.strip().splitlines()
    assert csv_lines[0] == "method,selection,seeds,x,y,avg" and len(csv_lines) == 4
    assert csv_lines[1].startswith("fedavg,training-domain validation,3,60.00 ± 15.28,")
    assert main(["report", str(tmp_path / "run"), "--format", "latex"]) == 0
    tex = capsys.readouterr().out
    assert r"\begin{tabular}" in tex and r"60.00 $\pm$ 15.28" in tex and tex.startswith("% ")


def test_report_joins_one_directory_per_target_into_one_seed(tmp_path, capsys):
    from rayfed_dg.cli import main

    # seeds 0 and 1 of one variant, each target run into its own directory, plus a seed holding both targets
    tgt = {0: {"x": 0.40, "y": 0.60}, 1: {"x": 0.50, "y": 0.90}, 2: {"x": 0.70, "y": 0.80}}
    dirs = []
    for s in (0, 1):
        for t in ("x", "y"):
            dirs.append(tmp_path / f"{t}-s{s}")
            make_run(dirs[-1], "ccst", s, {t: (SRC, {1: 0.1, 2: tgt[s][t], 3: 0.1, 4: 0.1})})
    dirs.append(tmp_path / "both-s2")
    make_run(dirs[-1], "ccst", 2, {t: (SRC, {1: 0.1, 2: tgt[2][t], 3: 0.1, 4: 0.1}) for t in ("x", "y")})
    assert main(["report", "--format", "csv"] + [str(d) for d in dirs]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "method,selection,seeds,x,y,avg"
    row = lines[1].split(",")
    # three seeds, not five runs; each seed's average over x and y, then mean ± SE over the seeds
    assert row[:3] == ["ccst", "training-domain validation", "3"]
    assert row[3] == "53.33 ± 8.82" and row[4] == "76.67 ± 8.82"  # by hand: (40, 50, 70) and (60, 90, 80)
    assert row[5] == "65.00 ± 7.64"  # seed averages 50, 70, 75: sd sqrt(350 / 2), over sqrt(3)
    # the same seed and target twice is an error, not a third seed
    make_run(tmp_path / "x-s0-again", "ccst", 0, {"x": (SRC, {1: 0.1, 2: 0.9, 3: 0.1, 4: 0.1})})
    assert main(["report", str(dirs[0]), str(tmp_path / "x-s0-again")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ccst seed 0 has target x in two runs" in err


def test_report_adds_heldout_domain_rule_in_domain_test_and_personalized_columns(tmp_path, capsys):
    from rayfed_dg.cli import main

    # held-out domain h is best at round 3, sources at round 2; in-domain test and personal rows per round
    heldout = {1: 0.2, 2: 0.3, 3: 0.7, 4: 0.1}
    source_test = {1: 0.11, 2: 0.22, 3: 0.33, 4: 0.44}
    for s, shift in ((0, 0.0), (1, 0.1)):
        path = tmp_path / "run" / f"seed{s}"
        path.mkdir(parents=True)
        tables = RunDir(path)
        recs = rows(SRC, {r: v + shift for r, v in TGT.items()}, personal={r: [0.5, 0.7 + shift] for r in SRC})
        for r in SRC:
            recs += [{"target": "t", "round": r, "split": "heldout_val", "domain": "h", "accuracy": heldout[r]},
                     {"target": "t", "round": r, "split": "source_test", "domain": "a", "accuracy": source_test[r]},
                     {"target": "t", "round": r, "split": "source_test", "domain": "b", "accuracy": source_test[r]}]
        for r in SRC:
            tables.write_rows("metrics", "t", r, [dict(x, clients_dropped=0, loss=1.0, samples=10, client=x.get("client"))
                                             for x in recs if x["round"] == r])
        best, val = select_round(recs)
        (path / "summary.json").write_text(json.dumps({"targets": {"t": {"selected_round": best, "source_val_acc": val,
                                                                         "target_acc": TGT[best] + shift}},
                                                       "method": "fedbn", "label": "fedbn", "seed": s}))
    assert main(["report", str(tmp_path / "run"), "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "method,selection,seeds,t,avg,in-domain test (sources),personalized (own val)"
    table = {line.split(",")[1]: line.split(",")[2:] for line in lines[1:]}
    # by hand, round 3 for the held-out rule: target (0.5, 0.6) -> 55 ± 5; in-domain 33; personal (0.6, 0.65)
    assert table["held-out-domain validation"] == ["2", "55.00 ± 5.00", "55.00 ± 5.00", "33.00 ± 0.00",
                                                   "62.50 ± 2.50"]
    # training-domain validation picks round 2: target (0.4, 0.5), in-domain 22
    assert table["training-domain validation"][1] == "45.00 ± 5.00" and table["training-domain validation"][3] == \
        "22.00 ± 0.00"
    # a run without a held-out domain has no such row, and no extra columns
    capsys.readouterr()
    make_run(tmp_path / "plain", "fedavg", 0, {"t": (SRC, TGT)})
    assert main(["report", str(tmp_path / "plain"), "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "method,selection,seeds,t,avg" and not any("held-out" in line for line in lines)
