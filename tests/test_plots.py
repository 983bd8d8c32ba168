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
    captured = capsys.readouterr()
    printed = captured.out.split()
    name = {"curves": "curves.png", "clients": "clients_fedbn.png", "tsne": "tsne_fedbn_colour.png",
            "pca": "pca_fedbn_colour.png"}[kind]
    assert printed == [str(out / name)]
    if kind in ("tsne", "pca"):  # a minute of t-SNE is announced, not silent
        what = {"tsne": "t-SNE", "pca": "PCA"}[kind]
        assert captured.err.startswith(f"{what}: fedbn, seed 0, target colour: features of up to 40 held-out images")
    data = (out / name).read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000


@pytest.mark.slow
def test_features_are_the_saved_models_penultimate_layer(tiny_run, tiny_ds):
    import numpy as np
    import torch

    from rayfed_dg.engine.running.reevaluate import load_run_config, saved_features
    from rayfed_dg.methods import build_method

    cfg = load_run_config(tiny_run, [])
    f = saved_features(cfg, tiny_ds, "colour", tiny_run, "best", per_domain=40)
    assert sorted(set(f["domain"])) == sorted(tiny_ds.domain_names)  # 3 source val splits and the target
    assert [int(f["is_target"][f["domain"] == d][0]) for d in ("mono", "colour")] == [0, 1]
    assert len(f["features"]) == 4 * 40 == len(f["label"])
    model = build_method(cfg, 3).build_model(tiny_ds.num_classes)
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


def _capture(monkeypatch):
    """Call plots' figure writers without writing: returns the figures they would save."""
    import rayfed_dg.plots as plots

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    return figs


def _visible_points(ax) -> set[tuple[int, float]]:
    """(round, value) of every point a reader can see: a line's vertices when
    it has a marker or joins two points, and every scatter dot."""
    pts = set()
    for line in ax.get_lines():
        x, y = line.get_xdata(), line.get_ydata()
        if line.get_marker() not in (None, "", "None", " ") or len(x) > 1:
            pts |= {(int(a), round(float(b), 6)) for a, b in zip(x, y)}
    for coll in ax.collections:
        pts |= {(int(round(a)), round(float(b), 6)) for a, b in coll.get_offsets()}
    return pts


@pytest.mark.parametrize("clients,per_round", [(10, 4), (1000, 10)])
def test_clients_plot_shows_every_sampled_client_and_round(tmp_path, monkeypatch, clients, per_round):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayfed_dg.plots import client_losses
    from rayfed_dg.reporting import RunRecord

    rng = np.random.default_rng(0)
    rows = [{"target": "mono", "round": r, "client": int(c), "domain": ("colour", "texture")[int(c) % 2],
             "train_loss": round(float(rng.random()), 6)}
            for r in range(1, 5) for c in rng.choice(clients, per_round, replace=False)]
    (tmp_path / "run").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "run" / "clients.parquet")
    figs = _capture(monkeypatch)
    client_losses(RunRecord(tmp_path / "run", "fedavg", {}), "t", tmp_path / "c.png")
    ax = figs[0].axes[0]
    # a client sampled in one round only, or in rounds 1 and 3, is on the figure too
    assert {(r["round"], r["train_loss"]) for r in rows} <= _visible_points(ax)
    n = len({r["client"] for r in rows})
    assert ax.get_title() == f"target mono: {n} clients trained, {per_round} a round"


def _seed_runs(tmp_path, tgt):
    from test_selection import SRC, make_run

    for s in tgt:  # the run's target order: texture before colour (not by name)
        make_run(tmp_path / f"seed{s}", "fedavg", s,
                 {t: (SRC, {1: 0.1, 2: tgt[s], 3: 0.3, 4: 0.3}) for t in ("texture", "colour")})


def test_seed_averaged_curves_have_a_spread_band(tmp_path, monkeypatch):
    import numpy as np

    from rayfed_dg.plots import learning_curves
    from rayfed_dg.reporting import collect_runs

    tgt = {0: 0.2, 1: 0.4, 2: 0.9}  # target accuracy at round 2, per seed
    _seed_runs(tmp_path, tgt)
    figs = _capture(monkeypatch)
    learning_curves(collect_runs([tmp_path]), ["texture"], tmp_path / "curves.png")
    target_ax = figs[0].axes[1]  # second row: target accuracy
    bands = [c for c in target_ax.collections if len(c.get_paths())]
    assert bands, "no spread band on a seed-averaged curve"
    ys = np.concatenate([p.vertices[:, 1] for p in bands[0].get_paths()])
    vals = [100 * v for v in tgt.values()]
    se = np.std(vals, ddof=1) / np.sqrt(3)  # mean ± SE, as report's cells
    assert np.isclose(ys.max(), np.mean(vals) + se) and np.isclose(ys.min(), 10)  # round 1: every seed 10%
    assert "3 seeds, band ± SE" in [t.get_text() for t in figs[0].legends[0].get_texts()][0]


def test_curve_panels_follow_the_run_order(tmp_path, monkeypatch):
    from rayfed_dg.plots import learning_curves
    from rayfed_dg.reporting import collect_runs

    _seed_runs(tmp_path, {0: 0.2, 1: 0.4})
    figs = _capture(monkeypatch)
    learning_curves(collect_runs([tmp_path]), None, tmp_path / "curves.png")
    assert [ax.get_title() for ax in figs[0].axes[:2]] == ["target texture", "target colour"]  # as report's columns
