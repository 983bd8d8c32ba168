"""Plugins (plugins.py): methods, stages and datasets from the user's own
modules, named by a config's ``plugins:`` or found as installed
``rayfed_dg.plugins`` entry points, imported in the driver and in every
process a config is sent to; the example of docs/extending.md (docs/examples/my_method.*)
run from outside the package."""
import math
import pickle
import shutil
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest
from conftest import REPO

import rayfed_dg.plugins as plugins

EXAMPLES = REPO / "docs" / "examples"


@pytest.fixture
def clean_registries(monkeypatch):
    """Whatever a test registers or imports is gone after it (later tests
    see the package's own registries, and no config carries its plugins)."""
    from rayfed_dg.data import base as data_base
    from rayfed_dg.methods import base as method_base
    from rayfed_dg.stages import base as stage_base

    for reg in (method_base._REGISTRY, stage_base._REGISTRY, data_base._REGISTRY):
        monkeypatch.setattr(reg, "_items", dict(reg._items))
    monkeypatch.setattr(plugins, "_LOADED", {})
    monkeypatch.setattr(plugins, "_ENTRY_POINTS_DONE", False)
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("my_method", "ep_plugin_mod", "broken_plugin", "twice_plugin"):
            del sys.modules[name]


def _plugin_dir(tmp_path):
    d = tmp_path / "plugin"
    d.mkdir()
    shutil.copy(EXAMPLES / "my_method.py", d / "my_method.py")
    return d


# ------------------------------------------------------------------ from outside the package

@pytest.mark.slow
def test_the_readme_method_trains_from_outside_the_package(tmp_path):
    """cwd: a folder holding only copies of my_method.py and my_method.yaml;
    the package is imported as installed, the plugin from the cwd, in the
    driver and in the Ray workers (which build the method themselves)."""
    for name in ("my_method.py", "my_method.yaml"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    proc = subprocess.run([sys.executable, "-m", "rayfed_dg", "run", "my_method.yaml", "--target", "colour",
                           "--set", "training.rounds=2", "--set", "model.width=8", "--run-dir", "run",
                           "--no-progress"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.split("Target accuracy")[1]
    assert "fedavg_ls |" in table, proc.stdout
    run = tmp_path / "run"
    m = pq.read_table(run / "metrics.parquet").to_pylist()
    assert {r["round"] for r in m} == {1, 2} and all(math.isfinite(r["loss"]) for r in m)
    c = pq.read_table(run / "clients.parquet").to_pylist()
    assert len(c) == 6 and all(math.isfinite(r["train_loss"]) and r["local_steps"] > 0 for r in c)
    assert "plugins:\n- my_method" in (run / "config.yaml").read_text()  # a resume imports it again


def test_the_readme_method_smooths_the_labels(clean_registries, tmp_path, monkeypatch):
    """The example's loss is q'-cross-entropy, computed by hand on 2 samples of 3 classes."""
    import torch

    from rayfed_dg.config import load_config
    from rayfed_dg.methods import build_method

    monkeypatch.syspath_prepend(str(_plugin_dir(tmp_path)))
    cfg = load_config(None, ["plugins=[my_method]", "method.name=fedavg_ls", "method.smoothing=0.3"])
    method = build_method(cfg, 3)
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    y = torch.tensor([0, 1])
    logp = torch.log_softmax(logits, 1)
    eps, k = 0.3, 3
    # q' = (1 - eps) one-hot + eps / K: loss = -sum_k q'(k) log p(k), mean over samples
    want = -sum((1 - eps) * logp[i, y[i]] + eps / k * logp[i].sum() for i in range(2)) / 2
    got = method.loss(lambda x: x, logits, y, None)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert float(got) != pytest.approx(float(-logp[[0, 1], y].mean()), rel=1e-3)  # not the plain cross-entropy


@pytest.mark.slow
def test_the_readme_method_passes_the_method_contract(clean_registries, ray_session, tiny_ds, tmp_path, monkeypatch):
    """tests/test_contract.py's checks on the plugin method, with the plugin's
    folder on this process's sys.path only: the session's Ray workers (whose
    sys.path lacks it) import it from the folder each pickled config names."""
    import test_contract as contract

    folder = _plugin_dir(tmp_path)
    monkeypatch.syspath_prepend(str(folder))
    plugins.import_plugins(["my_method"])
    assert plugins.pickled_plugins() == (("my_method", str(folder.resolve())),)
    monkeypatch.setitem(contract.EXTRA, "fedavg_ls", ["plugins=[my_method]"])
    hosts = contract.make_hosts(ray_session, tiny_ds)
    try:
        contract.test_method_contract(ray_session, tiny_ds, hosts, "fedavg_ls")
    finally:
        contract.close_hosts(hosts)


# ------------------------------------------------------------------ entry points and the worker side

def _dist_info(root, value):
    """A distribution 'rayfed-ep-demo' as pip would install it, with one entry point."""
    info = root / "rayfed_ep_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rayfed-ep-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[rayfed_dg.plugins]\ndemo = {value}\n")


EP_MODULE = '''
from rayfed_dg.methods import Method, register_method


@register_method
class EpFedAvg(Method):
    name = "ep_fedavg"
'''


def test_an_installed_entry_point_plugin_is_found_and_travels_with_the_config(clean_registries, tmp_path,
                                                                                monkeypatch):
    from rayfed_dg.config import ConfigError, load_config

    site = tmp_path / "site"
    site.mkdir()
    (site / "ep_plugin_mod.py").write_text(EP_MODULE)
    _dist_info(site, "ep_plugin_mod")
    with pytest.raises(ConfigError, match="unknown method 'ep_fedavg'"):
        load_config(None, ["method.name=ep_fedavg"])  # not installed yet
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(plugins, "_ENTRY_POINTS_DONE", False)
    cfg = load_config(None, ["method.name=ep_fedavg"])  # no plugins: key: the entry point is enough
    assert cfg.method.name == "ep_fedavg" and plugins.loaded_plugins() == ["ep_plugin_mod"]
    assert cfg.__reduce_ex__(5)[1][1] == (("ep_plugin_mod", str(site.resolve())),)  # what the pickle carries
    # a process whose sys.path lacks the folder (a Ray worker) rebuilds the config and builds the method
    code = ("import pickle, sys; cfg = pickle.loads(sys.stdin.buffer.read()); "
            "from rayfed_dg.methods import build_method; print(type(build_method(cfg, 3)).__name__)")
    r = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(cfg), capture_output=True, timeout=120,
                       cwd=REPO)
    assert r.returncode == 0 and r.stdout.decode().strip() == "EpFedAvg", r.stderr.decode()[-2000:]


def test_without_plugins_a_config_pickles_as_before(clean_registries):
    from rayfed_dg.config import load_config

    cfg = load_config(None)
    assert cfg.__reduce_ex__(5)[0].__name__ == "__newobj__"  # object's own reduce: no plugin step
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_an_entry_point_that_does_not_import_is_one_line(clean_registries, tmp_path, monkeypatch):
    from rayfed_dg.config import ConfigError, load_config

    _dist_info(tmp_path, "no_such_ep_module")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        load_config(None)
    line = str(e.value)
    assert "\n" not in line and line.startswith(
        "plugin entry point demo = 'no_such_ep_module' (package rayfed-ep-demo): no module named "
        "'no_such_ep_module'"), line


# ------------------------------------------------------------------ bad plugins: one ConfigError line

@pytest.mark.parametrize("source,expect", [
    (None, "plugins: no_such_plugin_xyz: no module named 'no_such_plugin_xyz' (a plugin is a module importable "
           "from the current directory, PYTHONPATH or an installed package"),
    ("raise RuntimeError('boom\\nsecond line')", "plugins: broken_plugin: its import failed: RuntimeError: boom"),
    ("import no_such_dependency_xyz", "plugins: broken_plugin: its import failed: ModuleNotFoundError: No module "
                                      "named 'no_such_dependency_xyz'"),
    (EP_MODULE.replace('"ep_fedavg"', '"fedavg"'), "plugins: broken_plugin: its import failed: ValueError: "
                                                   "method 'fedavg' is registered twice"),
])
def test_a_plugin_that_does_not_import_is_one_config_error_line(clean_registries, tmp_path, monkeypatch, capsys,
                                                                 source, expect):
    from rayfed_dg.cli import main

    name = "no_such_plugin_xyz" if source is None else "broken_plugin"
    if source is not None:
        (tmp_path / "broken_plugin.py").write_text(textwrap.dedent(source))
    (tmp_path / "exp.yaml").write_text(f"plugins: [{name}]\nmethod: {{name: fedavg}}\n")
    monkeypatch.chdir(tmp_path)  # a plugin imports from the cwd, as with the rayfed-dg script
    assert main(["run", "exp.yaml", "--run-dir", "run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"rayfed-dg: error: exp.yaml: {expect}"), err
    assert not (tmp_path / "run").exists()


def test_a_search_space_file_of_ones_own_sweeps_the_plugin_method(clean_registries, tmp_path, monkeypatch):
    """``tune.py --space PATH.yaml`` takes a file anywhere; each trial's config
    (the space's config plus the trial's values) names the plugin, so the
    trial process imports it before validating."""
    from rayfed_dg.config import load_config
    from rayfed_dg.tuning import load_space, overrides_of

    shutil.copy(EXAMPLES / "my_method.yaml", tmp_path / "my_method.yaml")
    monkeypatch.syspath_prepend(str(_plugin_dir(tmp_path)))
    (tmp_path / "space.yaml").write_text("config: my_method.yaml\nparams:\n  method.smoothing: {grid: [0.0, 0.2]}\n")
    space = load_space(str(tmp_path / "space.yaml"))
    assert space["params"] == {"method.smoothing": {"grid": [0.0, 0.2]}}
    cfg = load_config(tmp_path / space["config"], overrides_of({"method.smoothing": 0.2, "target": "mono"}))
    assert cfg.method.name == "fedavg_ls" and cfg.method.params.smoothing == 0.2


STAGE_PLUGIN = """
from pydantic import BaseModel

from rayfed_dg.stages import Stage, register_stage


@register_stage
class Recolour(Stage):
    name = "recolour"

    class Params(BaseModel):
        strength: int = 1

    def run(self, server):
        return {}
"""


def test_report_on_a_run_with_a_plugin_stage_imports_the_plugin_in_a_fresh_process(tmp_path):
    """``report`` names a run by its label and its data stages' settings
    (``reporting._data_stage``), which looks the stage's class up: a fresh
    ``rayfed-dg report`` must import the run's plugins as the run did."""
    from test_selection import SRC, make_run

    (tmp_path / "recolour.py").write_text(STAGE_PLUGIN)
    make_run(tmp_path / "run", "fedavg", 0, {"x": (SRC, {1: 0.5, 2: 0.6, 3: 0.5, 4: 0.4})})
    (tmp_path / "run" / "config.yaml").write_text(
        "plugins: [recolour]\nmethod: {name: fedavg}\nstages: {recolour: {strength: 2}}\n")
    proc = subprocess.run([sys.executable, "-m", "rayfed_dg", "report", "run"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| fedavg + recolour(strength=2) | training-domain validation |" in proc.stdout, proc.stdout
    (tmp_path / "recolour.py").unlink()  # the plugin gone: one line naming the stage and why, no traceback
    proc = subprocess.run([sys.executable, "-m", "rayfed_dg", "report", "run"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "data stage 'recolour'" in proc.stderr, proc.stderr


OLD_CONTRACT = {
    "prepares_round = True": "sets prepares_round, gone in method contract v2: declare phases = (Phase.PREPARE",
    "averages_global = False": "sets averages_global, gone in method contract v2: name the keys assemble_global",
    "def assemble_global(self, round, results, global_state, server_state):\n        return {}":
        "assemble_global takes (round, results, average, previous, server_state)",
    "def __init__(self, params, model_cfg, training_cfg):\n        super().__init__(params, model_cfg, training_cfg, 1)":
        "__init__ takes (params, model_cfg, training_cfg, num_clients)",
}


@pytest.mark.parametrize("body", sorted(OLD_CONTRACT))
def test_a_plugin_written_for_the_first_method_contract_is_one_line_saying_what_to_change(
        clean_registries, tmp_path, monkeypatch, capsys, body):
    from rayfed_dg.cli import main

    (tmp_path / "old_plugin.py").write_text(textwrap.dedent("""
        from rayfed_dg.methods import Method, register_method

        @register_method
        class Old(Method):
            name = "old_contract"
        """) + textwrap.indent(body, "    ") + "\n")
    (tmp_path / "exp.yaml").write_text("plugins: [old_plugin]\nmethod: {name: old_contract}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "old_plugin", raising=False)
    assert main(["run", "exp.yaml", "--run-dir", "run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and OLD_CONTRACT[body] in err and "'old_contract'" in err, err
    assert not (tmp_path / "run").exists()
    sys.modules.pop("old_plugin", None)
