"""Paper-scale configs build and train one step (ImageNet weights swapped for
random ones, which this machine cannot download), and fail clearly without
their weights."""
import pytest
from conftest import REPO, needs_data

from rayfed_dg.cli import main

PAPER = REPO / "configs" / "paper"
CPU = ["--set", "engine.num_gpus_per_worker=0", "--set", "engine.num_cpus_per_worker=1"]

needs_pacs = needs_data("PACS")  # configs name data.root: PACS, under the data root


@needs_pacs
@pytest.mark.slow
@pytest.mark.data
@pytest.mark.parametrize("name", ["gperxan_pacs", "fedfda_pacs", "stablefdg_pacs"])
def test_dry_run_builds_and_trains(ray_session, tmp_path, monkeypatch, capsys, name):
    code = main(["run", str(PAPER / f"{name}.yaml"), "--dry-run", "--target", "photo", "--no-progress",
                 "--set", "model.pretrained=null", *CPU, "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert (tmp_path / "run" / "final_photo.pt").is_file() and "photo" in out.out


@needs_pacs
def test_paper_configs_fail_clearly_without_weights(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    code = main(["run", str(PAPER / "gperxan_pacs.yaml"), "--dry-run", *CPU, "--run-dir", str(tmp_path / "a")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "IMAGENET1K_V1 weights are not in the torch hub cache" in err[0]
    code = main(["run", str(PAPER / "ccst_pacs.yaml"), "--dry-run", "--set", "model.pretrained=null", *CPU,
                 "--run-dir", str(tmp_path / "b")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "vgg_normalised.pth" in err[0]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
