"""rayfed-dg plot: each kind writes a PNG from a tiny run."""
import pytest
from conftest import tiny_cfg

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_run(ray_session, tiny_ds, tmp_path_factory):
    """FedBN (client-local state, so personal curves too), 3 rounds, target colour."""
    from rayfed_dg.engine import run_experiment

    run_dir = tmp_path_factory.mktemp("plots") / "run"
    run_dir.mkdir()
    cfg = tiny_cfg("training.rounds=3", "training.local_steps=3", "method.name=fedbn",
                   "output.save_best_checkpoint=true")
    run_experiment(cfg, tiny_ds, ["colour"], run_dir, progress=False)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["curves", "clients", "tsne", "pca"])
def test_plot_writes_a_png(tiny_run, kind, capsys):
    from rayfed_dg.cli import main

    out = tiny_run.parent / f"plots-{kind}"
    assert main(["plot", str(tiny_run), "--kind", kind, "--out", str(out), "--per-domain", "40"]) == 0
    printed = capsys.readouterr().out.split()
    name = {"curves": "curves.png", "clients": "clients_fedbn.png", "tsne": "tsne_fedbn_colour.png",
            "pca": "pca_fedbn_colour.png"}[kind]
    assert printed == [str(out / name)]
    data = (out / name).read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000


@pytest.mark.slow
def test_features_are_the_saved_models_penultimate_layer(tiny_run, tiny_ds):
    import numpy as np
    import torch

    from rayfed_dg.engine.evaluate import load_run_config, saved_features
    from rayfed_dg.methods import build_method

    cfg = load_run_config(tiny_run, [])
    f = saved_features(cfg, tiny_ds, "colour", tiny_run, "best", per_domain=40)
    assert sorted(set(f["domain"])) == sorted(tiny_ds.domain_names)  # 3 source val splits and the target
    assert [int(f["is_target"][f["domain"] == d][0]) for d in ("mono", "colour")] == [0, 1]
    assert len(f["features"]) == 4 * 40 == len(f["label"])
    model = build_method(cfg).build_model(tiny_ds.num_classes)
    model.load_state_dict(torch.load(tiny_run / "best_colour.pt", weights_only=True))
    assert f["features"].shape[1] == model.feature_dim
    # a few target images again, through the saved model by hand
    sel = np.flatnonzero(f["domain"] == "colour")[:5]
    x = torch.from_numpy(tiny_ds.images[f["index"][sel]]).permute(0, 3, 1, 2).float() / 255
    x = (x - torch.tensor(cfg.data.mean).view(1, 3, 1, 1)) / torch.tensor(cfg.data.std).view(1, 3, 1, 1)
    model.eval()
    with torch.no_grad():
        np.testing.assert_allclose(f["features"][sel], model.features(x).numpy(), rtol=1e-5, atol=1e-6)
    assert (tiny_ds.labels[f["index"]] == f["label"]).all() and f["features"].std() > 0


def test_plot_without_runs_is_one_line_exit_2(tmp_path, capsys):
    from rayfed_dg.cli import main

    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no runs with records" in err[0]
