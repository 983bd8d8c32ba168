"""Folder loaders on small generated trees, the decode cache, and the real data."""
import csv
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA_ROOT, needs_data
from PIL import Image

from rayfed_dg.data import DataError, load_dataset


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFED_DG_CACHE", str(tmp_path / "cache"))


def make_tree(root, domains, classes, n=2, ext="png", size=(20, 24)):
    rng = np.random.default_rng(0)
    for d in domains:
        for c in classes:
            p = root / d / c
            p.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(p / f"{i}.{ext}")
    return root


@pytest.mark.parametrize("name,domains", [
    ("pacs", ["photo", "art_painting", "cartoon", "sketch"]),
    ("office_home", ["Art", "Clipart", "Product", "Real_World"]),
    ("vlcs", ["Caltech101", "LabelMe", "SUN09", "VOC2007"]),
    ("domainnet", ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]),
])
def test_standard_layouts(tmp_path, name, domains):
    make_tree(tmp_path / "d", domains, ["a", "b", "c"], n=2, ext="jpg")
    ds = load_dataset(name, str(tmp_path / "d"), 16)
    assert ds.images.shape == (len(domains) * 6, 16, 16, 3)
    assert ds.class_names == ["a", "b", "c"] and len(ds.domain_names) == len(domains)
    assert all(v == 6 for v in ds.counts().values())


def test_domainnet_top_classes(tmp_path):
    root = make_tree(tmp_path / "d", ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"], ["a", "b"])
    make_tree(tmp_path / "extra", ["real"], ["c"], n=5)
    (root / "real" / "c").mkdir()
    for f in (tmp_path / "extra" / "real" / "c").iterdir():
        f.rename(root / "real" / "c" / f.name)
    ds = load_dataset("domainnet", str(root), 8, top_classes=2)
    assert ds.class_names == ["a", "b"]  # 12 images each beat c's 5
    ds3 = load_dataset("domainnet", str(root), 8, top_classes=3)
    assert ds3.class_names == ["a", "b", "c"] and len(ds3.labels) == 29


def test_digits_dg_train_val_layout(tmp_path):
    for d in ("mnist", "svhn"):
        for part in ("train", "val"):
            make_tree(tmp_path / "dg" / d, [part], ["0", "1"], n=2)
    ds = load_dataset("digits", str(tmp_path / "dg"), 8)
    assert ds.domain_names == ["mnist", "svhn"] and ds.counts() == {"mnist": 8, "svhn": 8}


def test_camelyon17_wilds_layout(tmp_path):
    root = tmp_path / "cam"
    rows = []
    for center, patient in ((0, 4), (1, 10), (3, 21)):
        for k in range(3):
            x, y = 100 * k, 50
            d = root / "patches" / f"patient_{patient:03d}_node_1"
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((12, 12, 3), 40 * k, np.uint8)).save(
                d / f"patch_patient_{patient:03d}_node_1_x_{x}_y_{y}.png")
            rows.append({"patient": patient, "node": 1, "x_coord": x, "y_coord": y, "tumor": k % 2,
                         "center": center, "split": 0})
    with open(root / "metadata.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ds = load_dataset("camelyon17", str(root), 8)
    assert ds.domain_names == ["hospital1", "hospital2", "hospital4"] and list(ds.labels) == [0, 1, 0] * 3
    (root / "patches" / "patient_004_node_1" / "patch_patient_004_node_1_x_0_y_50.png").unlink()
    with pytest.raises(DataError, match="missing: .*patch_patient_004_node_1_x_0_y_50.png"):
        load_dataset("camelyon17", str(root), 8)


def test_bad_roots_fail_with_one_line(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_dataset("pacs", str(tmp_path / "nowhere"), 8)
    make_tree(tmp_path / "wrong", ["photo", "art"], ["a"])
    with pytest.raises(DataError) as e:
        load_dataset("pacs", str(tmp_path / "wrong"), 8)
    msg = str(e.value)
    assert "expected domain folders photo, art_painting, cartoon, sketch" in msg and "found art, photo" in msg
    assert "\n" not in msg
    with pytest.raises(DataError, match="needs data.root"):
        load_dataset("pacs", None, 8)
    (tmp_path / "empty" / "photo" / "dog").mkdir(parents=True)
    with pytest.raises(DataError, match="holds no images"):
        load_dataset("folder", str(tmp_path / "empty"), 8)


def test_corrupt_image_fails_with_path_or_is_skipped_and_counted(tmp_path):
    root = make_tree(tmp_path / "d", ["x", "y"], ["a", "b"], n=3)
    bad = root / "y" / "b" / "1.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(DataError, match=f"cannot decode image {bad}"):
        load_dataset("folder", str(root), 8)
    ds = load_dataset("folder", str(root), 8, on_corrupt="skip")
    assert len(ds.images) == 11 and ds.meta["skipped_corrupt"] == 1 and ds.meta["skipped_files"] == [str(bad)]
    assert ds.counts() == {"x": 6, "y": 5}


def test_decode_cache_hit_on_second_load_and_invalidated_by_change(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "d", ["x", "y"], ["a"], n=2)
    a = load_dataset("folder", str(root), 8)
    b = load_dataset("folder", str(root), 8)
    assert a.meta["cache"] == "miss" and b.meta["cache"] == "hit" and np.array_equal(a.images, b.images)
    assert load_dataset("folder", str(root), 12).meta["cache"] == "miss"  # resolution is in the key
    import PIL

    with monkeypatch.context() as m:  # and Pillow's version, which decodes and resizes
        m.setattr(PIL, "__version__", PIL.__version__ + ".other")
        assert load_dataset("folder", str(root), 8).meta["cache"] == "miss"
    assert load_dataset("folder", str(root), 8).meta["cache"] == "hit"
    Image.fromarray(np.zeros((5, 5, 3), np.uint8)).save(root / "x" / "a" / "new.png")
    c = load_dataset("folder", str(root), 8)
    assert c.meta["cache"] == "miss" and len(c.images) == 5


@pytest.mark.slow
@pytest.mark.data
@needs_data("PACS")
def test_real_pacs_counts():
    ds = load_dataset("pacs", str(DATA_ROOT / "PACS"), 32)
    assert ds.counts() == {"photo": 1670, "art_painting": 2048, "cartoon": 2344, "sketch": 3929}
    assert ds.num_classes == 7 and len(ds.images) == 9991


@pytest.mark.slow
@pytest.mark.data
@needs_data("digits")
def test_real_digits_counts():
    ds = load_dataset("digits", str(DATA_ROOT / "digits"), 32)
    assert ds.counts() == {"mnist": 6000, "mnist_m": 6000, "usps": 6000} and ds.num_classes == 10


def test_data_root_resolution(tmp_path, monkeypatch):
    from rayfed_dg.data.sources import resolve_root

    monkeypatch.setenv("RAYFED_DG_DATA", str(tmp_path / "root"))
    assert resolve_root("pacs", "PACS") == str(tmp_path / "root" / "PACS")  # relative: under the data root
    assert resolve_root("pacs", "mine/pacs") == str(tmp_path / "root" / "mine" / "pacs")
    assert resolve_root("pacs", str(tmp_path / "elsewhere")) == str(tmp_path / "elsewhere")  # absolute: kept
    assert resolve_root("pacs", "~/x") == str(Path.home() / "x")
    assert resolve_root("pacs", None) == str(tmp_path / "root" / "PACS")  # unset: where `data fetch` puts it
    assert resolve_root("office_home", None) == str(tmp_path / "root" / "OfficeHome")
    assert resolve_root("embedded_digits", None) is None and resolve_root("folder", None) is None
    monkeypatch.delenv("RAYFED_DG_DATA")
    assert resolve_root("vlcs", "VLCS") == str(Path.home() / "data" / "VLCS")  # default data root ~/data


def test_config_reads_its_dataset_under_the_data_root(tmp_path, monkeypatch):
    from rayfed_dg.config import load_config
    from rayfed_dg.engine import load_data

    make_tree(tmp_path / "root" / "PACS", ["photo", "art_painting", "cartoon", "sketch"], ["a", "b"], n=1)
    monkeypatch.setenv("RAYFED_DG_DATA", str(tmp_path / "root"))
    for root in ("data.root=PACS", "data.root=null"):
        ds = load_data(load_config(None, ["data.name=pacs", root, "data.resolution=8"]))
        assert ds.meta["root"] == str(tmp_path / "root" / "PACS") and len(ds.labels) == 8
    monkeypatch.setenv("RAYFED_DG_DATA", str(tmp_path / "empty"))
    with pytest.raises(DataError) as e:
        load_data(load_config(None, ["data.name=office_home", "data.resolution=8"]))
    msg = str(e.value)
    assert msg.startswith(f"data.root {tmp_path}/empty/OfficeHome does not exist") and "\n" not in msg
    assert f"fetch it with `rayfed-dg data fetch office_home` (writes {tmp_path}/empty/OfficeHome" in msg
