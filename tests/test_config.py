import subprocess
import sys

import pytest

from rayfed_dg.config import ConfigError, load_config, method_variants


def write(tmp_path, text, name="exp.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_and_layering(tmp_path):
    write(tmp_path, "training:\n  lr: 0.5\n  rounds: 7\n", "base.yaml")
    p = write(tmp_path, "base: base.yaml\ntraining:\n  rounds: 3\nmethod:\n  name: fedprox\n  mu: 0.1\n")
    cfg = load_config(p, ["training.seed=5"])
    assert cfg.training.lr == 0.5 and cfg.training.rounds == 3 and cfg.training.seed == 5
    assert cfg.method.name == "fedprox" and cfg.method.raw_params() == {"mu": 0.1} and cfg.method.params.mu == 0.1
    assert cfg.data.name == "embedded_digits"  # untouched default


@pytest.mark.parametrize("text,key", [
    ("training:\n  lrr: 0.1\n", "training.lrr: unknown key"),
    ("training:\n  rounds: many\n", "training.rounds"),
    ("training:\n  lr: -1\n", "training.lr: Input should be greater than 0"),
    ("partition:\n  alpha: 0\n", "partition.alpha"),
    ("method:\n  name: fedprox\n  mu: -0.5\n", "method.mu"),
    ("method:\n  name: fedprox\n  nu: 1\n", "method.nu: unknown key"),
    ("method:\n  name: fedavgg\n", "did you mean fedavg"),
    ("bogus: 1\n", "bogus: unknown key"),
])
def test_bad_values_name_key_and_file(tmp_path, text, key):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert key in msg and str(p) in msg and "\n" not in msg


def test_bad_override_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match="training.batch_size"):
        load_config(None, ["training.batch_size=0"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["training.lr"])
    p = write(tmp_path, "training: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_compare_variants():
    cfg = load_config(None, ["compare=[{name: fedavg}, {name: fedprox, mu: 0.2, label: prox}]"])
    v = method_variants(cfg)
    assert [label for label, _ in v] == ["fedavg", "prox"]
    assert v[1][1].method.raw_params() == {"mu": 0.2} and v[1][1].compare is None
    # without compare, the method's own label names its row (two CCST variants of fedavg stay two rows)
    assert [label for label, _ in method_variants(load_config(None, ["method.label=ccst-k1"]))] == ["ccst-k1"]
    assert [label for label, _ in method_variants(load_config(None, []))] == ["fedavg"]


def test_a_compare_rows_devices_merge_over_the_comparisons():
    """A FedBuff row without the synchronous rows' deadline, the rest of the device model shared."""
    cfg = load_config(None, ["devices={enabled: true, deadline_s: 120, over_selection: 1.3, step_seconds: 10}",
                             "compare=[{name: fedavg}, {name: fedavg, label: fedbuff, server: {mode: fedbuff, "
                             "concurrency: 4}, devices: {deadline_s: null, over_selection: 1.0}}]"])
    rows = dict(method_variants(cfg))
    sync, buff = rows["fedavg"].devices, rows["fedbuff"].devices
    assert (sync.deadline_s, sync.over_selection, buff.deadline_s, buff.over_selection) == (120, 1.3, None, 1.0)
    assert sync.step_seconds == buff.step_seconds == 10 and rows["fedbuff"].method.raw_params() == {}
    with pytest.raises(ConfigError, match="only compare rows carry their own partition, stages, server or devices"):
        load_config(None, ["method.devices={deadline_s: 5}"])


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    p = write(tmp_path, "training:\n  lr: -0.1\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rayfed_dg", "run", str(p), "--run-dir", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "training.lr" in lines[0] and str(p) in lines[0]
    assert not out.exists()  # nothing written


def test_cosine_learning_rate_by_hand():
    import math

    from rayfed_dg.methods import build_method

    m = build_method(load_config(None, ["training.lr=0.1", "training.rounds=4", "training.lr_schedule=cosine"]), 3)
    assert [round(m.lr_at(r), 12) for r in (1, 2, 3, 4)] == [
        round(0.1 * 0.5 * (1 + math.cos(math.pi * k / 4)), 12) for k in range(4)]
    assert abs(m.lr_at(3) - 0.05) < 1e-12
    assert build_method(load_config(None, ["training.lr=0.1"]), 3).lr_at(7) == 0.1


@pytest.mark.parametrize("sets,hint", [
    (["training.lrr=0.1"], "training.lrr: unknown key (did you mean lr?)"),
    (["trainig.lr=0.1"], "trainig: unknown key (did you mean training?)"),
    (["data.on_corupt=skip"], "data.on_corupt: unknown key (did you mean on_corrupt?)"),
    (["method.name=fedprox", "method.muu=0.1"], "method.muu: unknown key (did you mean mu?)"),
    (["method.lable=x"], "method.lable: unknown key (did you mean label?)"),
])
def test_unknown_keys_get_a_did_you_mean(sets, hint):
    # as method and domain names do: the closest key the section has
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert hint in str(e.value) and "\n" not in str(e.value)


def test_local_steps_and_local_epochs_never_silently_override(tmp_path):
    from conftest import REPO

    # a file over a base: the one it names applies (the cross-device config says one local epoch)
    write(tmp_path, "training:\n  local_steps: 50\n", "base.yaml")
    t = load_config(write(tmp_path, "base: base.yaml\ntraining:\n  local_epochs: 1\n")).training
    assert (t.local_steps, t.local_epochs) == (None, 1)
    t = load_config(REPO / "configs" / "digits" / "cross_device_1000.yaml").training
    assert (t.local_steps, t.local_epochs) == (None, 1)
    # a --set over a file, either way; the later --set wins
    assert load_config(tmp_path / "base.yaml", ["training.local_epochs=2"]).training.local_steps is None
    t = load_config(REPO / "configs" / "quickstart.yaml", ["training.local_steps=3"]).training
    assert t.local_steps == 3 and "local_epochs" not in load_config(
        REPO / "configs" / "quickstart.yaml", ["training.local_steps=3"]).to_dict()["training"]
    t = load_config(None, ["training.local_steps=3", "training.local_epochs=2"]).training
    assert (t.local_steps, t.local_epochs) == (None, 2)
    # one file naming both is an error, naming the file and what to do
    both = write(tmp_path, "training:\n  local_steps: 5\n  local_epochs: 2\n", "both.yaml")
    with pytest.raises(ConfigError, match=r"both.yaml: training.local_steps \(5\) and training.local_epochs \(2\) "
                                          r"are both set.*keep one"):
        load_config(both)
    # a config rayfed-dg wrote before (every training key, both among them) reads as it ran: local_steps
    import yaml

    from rayfed_dg.config import ExperimentConfig

    old = ExperimentConfig().model_dump(mode="json")
    old["training"]["local_steps"] = 50
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    assert load_config(tmp_path / "old.yaml").training.local_steps == 50


def test_every_shipped_config_reads_its_data_through_the_data_root():
    """No config points outside $RAYFED_DG_DATA (a ../shared/data/PACS works only beside this checkout)."""
    from pathlib import Path

    from conftest import REPO

    for path in sorted((REPO / "configs").rglob("*.yaml")):
        root = load_config(path).data.root
        assert root is None or not (Path(root).is_absolute() or ".." in Path(root).parts), (path, root)


def test_a_saved_config_keeps_the_parameter_defaults_it_ran_with(tmp_path, monkeypatch):
    """config.yaml (what --resume and re-runs read) spells out every method and stage parameter, so a default
    changed in a later release (StableFDG's detach_explored) cannot switch a resumed run's variant."""
    from rayfed_dg.config import save_config, validate
    from rayfed_dg.methods import get_method_class, method_names

    for name in method_names():  # every method's defaults survive the round trip through YAML
        cls = get_method_class(name)
        cfg = load_config(None, [f"method.name={name}"] + [f"stages.{s}={{}}" for s in cls.stages_needed])
        save_config(cfg, tmp_path / "config.yaml")
        again = load_config(tmp_path / "config.yaml")
        assert again.method.raw_params() == cls.Params().model_dump(mode="json"), name
        assert validate(again.to_dict()).to_dict() == again.to_dict() == cfg.to_dict()
    cfg = load_config(None, ["compare=[{name: fedavg, stages: {ccst: {k: 2}}}, {name: stablefdg}]",
                             "stages.ccst={backend: adain}"])
    save_config(cfg, tmp_path / "config.yaml")
    from rayfed_dg.stages import get_stage_class

    # the next release's defaults
    stable, ccst = get_method_class("stablefdg"), get_stage_class("ccst")
    monkeypatch.setattr(stable, "Params", type("Params", (stable.Params,), {"__annotations__": {
        "detach_explored": bool}, "detach_explored": False}))
    monkeypatch.setattr(ccst, "Params", type("Params", (ccst.Params,), {"__annotations__": {
        "max_style_images": int}, "max_style_images": 128}))
    assert stable.Params().detach_explored is False and ccst.Params().max_style_images == 128
    saved = load_config(tmp_path / "config.yaml")
    variants = dict(method_variants(saved))
    monkeypatch.undo()
    assert get_method_class("stablefdg").Params().detach_explored is True
    assert variants["stablefdg"].method.params.detach_explored is True
    assert variants["fedavg"].stage_params("ccst").k == 2
    # written although never set: a compare row's own stage and the top-level one
    assert variants["fedavg"].stage_params("ccst").max_style_images == 256
    assert saved.stage_params("ccst").max_style_images == 256
    assert load_config(tmp_path / "config.yaml").stage_params("ccst").backend == "adain"


def test_resuming_a_run_saved_without_its_defaults_names_the_values_it_now_takes(tmp_path, capsys):
    import json

    from rayfed_dg.cli import main
    from rayfed_dg.config import save_config, unrecorded_defaults

    old = write(tmp_path, "method:\n  name: gperxan\n  lam: 0.25\nstages:\n  ccst: {k: 2}\ncompare:\n"
                "- name: stablefdg\n  alpha: 2.0\n  label: sfdg\n- name: fedavg\n", "config.yaml")
    lines = unrecorded_defaults(old)
    # the method: section is not named (compare rows replace it), a method without parameters neither
    assert [x.split(":")[0] for x in lines] == ["compare.0 (sfdg)", "stages.ccst (ccst)"]
    assert lines[0].startswith("compare.0 (sfdg): style=True") and "detach_explored=True" in lines[0]
    assert " alpha=" not in lines[0] and " k=" not in lines[1] and "max_style_images=256" in lines[1]
    assert unrecorded_defaults(write(tmp_path, "method:\n  name: gperxan\n", "one.yaml")) == [
        "method (gperxan): lam=0.5, norm=xan, personalize=True, placement=auto, bn_weight=auto"]
    save_config(load_config(old), tmp_path / "new.yaml")  # written by this release: nothing left to name
    assert unrecorded_defaults(tmp_path / "new.yaml") == []
    (tmp_path / "run.json").write_text(json.dumps({"targets": ["colour"], "seeds": None}))
    assert main(["run", "--resume", str(tmp_path), "--target", "mono"]) == 2  # refused, after the warning
    err = capsys.readouterr().err
    assert f"rayfed-dg: warning: {old} does not record compare.0 (sfdg): style=True" in err
    # a config given again is the user's (written without defaults): the run's own config.yaml is what is named
    assert main(["run", str(tmp_path / "one.yaml"), "--resume", str(tmp_path), "--target", "mono"]) == 2
    err = capsys.readouterr().err
    assert f"warning: {old} does not record compare.0" in err and "one.yaml does not record" not in err


def test_changing_the_method_of_a_saved_config_says_how():
    import tempfile
    from pathlib import Path

    from rayfed_dg.config import save_config

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.yaml"
        save_config(load_config(None, ["method.name=fedprox"]), path)
        with pytest.raises(ConfigError) as e:
            load_config(path, ["method.name=fedavg"])
        assert str(e.value).endswith("method.mu: unknown key (a parameter of fedprox, moon; to change method, "
                                     "replace the whole section: --set 'method={name: fedavg}')")
        assert load_config(path, ["method={name: fedavg}"]).method.name == "fedavg"
