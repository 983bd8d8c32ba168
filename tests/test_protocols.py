"""The published protocols as presets (configs/protocols/): FedIIR's
DomainBed setting, FedDG-GA's and FedDG-Benchmark's (Bai et al.); FedIIR's
proportional single-domain split by hand; each preset validates and runs
with ``--dry-run`` where its dataset is on this machine."""
import numpy as np
import pytest
from conftest import DATA_ROOT, REPO

from rayfed_dg.cli import main
from rayfed_dg.config import load_config
from rayfed_dg.data.protocol import partition_proportional

PROTOCOLS = REPO / "configs" / "protocols"
PRESETS = sorted(p.stem for p in PROTOCOLS.glob("*.yaml"))
DATA = {"pacs": "PACS", "vlcs": "VLCS", "office_home": "OfficeHome"}
SMALL = ["--set", "model.pretrained=null", "--set", "engine.num_gpus_per_worker=0", "--set",
         "engine.num_cpus_per_worker=1", "--set", "data.resolution=32", "--set", "data.limit_per_domain=300"]


def test_proportional_split_gives_each_next_client_to_the_domain_with_most_samples_per_client():
    # a: 10, b: 4, c: 7 samples; 5 clients: one each, then a (10/1 largest), then c (7/1 > 5/2 > 4/1... 7 > 5)
    src = {"a": np.arange(10), "b": np.arange(100, 104), "c": np.arange(200, 207)}
    clients, doms = partition_proportional(src, None, num_clients=5, seed=0)
    assert doms == ["a", "a", "b", "c", "c"]
    assert [len(c) for c in clients] == [5, 5, 4, 3, 4]  # floor(n / k) each, the last also the n mod k left
    flat = np.concatenate(clients)
    assert sorted(flat.tolist()) == sorted(np.concatenate(list(src.values())).tolist())  # each sample once
    again, _ = partition_proportional(src, None, num_clients=5, seed=0)
    assert all(np.array_equal(x, y) for x, y in zip(clients, again))
    # ties go to the first domain
    _, doms = partition_proportional({"a": np.arange(4), "b": np.arange(4, 8)}, None, num_clients=3, seed=0)
    assert doms == ["a", "a", "b"]


def test_every_preset_validates_and_names_its_source():
    assert {"fediir_pacs", "fediir_vlcs", "fediir_officehome", "feddg_ga_pacs", "bai_heterogeneity_pacs"} <= set(
        PRESETS)
    for name in PRESETS:
        cfg = load_config(PROTOCOLS / f"{name}.yaml", [])
        header = (PROTOCOLS / f"{name}.yaml").read_text().split("\ndata:")[0]
        assert "public code" in header or "configs" in header, name  # where the protocol comes from
        assert cfg.output.name.startswith("protocol-"), name
    assert load_config(PROTOCOLS / "fediir_pacs.yaml", []).partition.strategy == "proportional"
    assert load_config(PROTOCOLS / "bai_heterogeneity_pacs.yaml", []).data.heldout_val_domain == "art_painting"


@pytest.mark.slow
@pytest.mark.data
@pytest.mark.parametrize("name", PRESETS)
def test_preset_dry_run(ray_session, tmp_path, capsys, name):
    cfg = load_config(PROTOCOLS / f"{name}.yaml", [])
    folder = DATA[cfg.data.name]
    if not (DATA_ROOT / folder).is_dir():
        pytest.skip(f"{DATA_ROOT / folder} is not present (set RAYFED_DG_DATA or run `rayfed-dg data fetch "
                    f"{cfg.data.name}`)")
    target = {"pacs": "photo", "vlcs": "SUN09", "office_home": "Clipart"}[cfg.data.name]
    code = main(["run", str(PROTOCOLS / f"{name}.yaml"), "--dry-run", "--no-progress", *SMALL, "--target", target,
                 "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert (tmp_path / "run" / f"final_{target}.pt").is_file()


def test_proportional_split_with_one_client_per_domain_is_the_domains():
    src = {"a": np.arange(0, 7), "b": np.arange(7, 10)}
    clients, doms = partition_proportional(src, None, num_clients=2, seed=0)
    assert doms == ["a", "b"] and [c.tolist() for c in clients] == [list(range(7)), [7, 8, 9]]
