import numpy as np
import pytest

from rayfed_dg.data import DataError, leave_one_domain_out, load_dataset, stratified_split


def test_embedded_digits_is_deterministic_and_domains_disjoint(tiny_ds):
    again = load_dataset("embedded_digits", None, 16)
    assert np.array_equal(again.images, tiny_ds.images) and np.array_equal(again.domains, tiny_ds.domains)
    assert tiny_ds.domain_names == ["mono", "negative", "colour", "texture"]
    assert sum(tiny_ds.counts().values()) == 1797
    # every domain holds every class, in near-equal shares
    for d in range(4):
        counts = np.bincount(tiny_ds.labels[tiny_ds.domains == d], minlength=10)
        assert counts.min() >= 40
    # domains differ in appearance: mean brightness of mono vs negative
    mono = tiny_ds.images[tiny_ds.domains == 0].mean()
    neg = tiny_ds.images[tiny_ds.domains == 1].mean()
    assert neg > 2 * mono


@pytest.mark.parametrize("strategy,n", [("per_domain", None), ("single_domain", 9)])
def test_lodo_split_never_shows_the_target(tiny_ds, strategy, n):
    s = leave_one_domain_out(tiny_ds, "negative", 0.2, 0, strategy, n)
    train = np.concatenate(s.clients)
    val = np.concatenate(list(s.val.values()))
    test = s.test["negative"]
    assert len(np.unique(train)) == len(train)  # each training sample belongs to one client
    assert not set(train) & set(val)
    assert (tiny_ds.domains[test] == 1).all() and len(test) == tiny_ds.counts()["negative"]
    assert not (tiny_ds.domains[train] == 1).any() and not (tiny_ds.domains[val] == 1).any()
    assert len(train) + len(val) + len(test) == 1797


def test_stratified_split_ratio_per_class():
    labels = np.repeat(np.arange(3), [10, 20, 30])
    tr, va = stratified_split(np.arange(60), labels, 0.1, seed=3)
    assert list(np.bincount(labels[va])) == [1, 2, 3]
    tr2, va2 = stratified_split(np.arange(60), labels, 0.1, seed=3)
    assert np.array_equal(va, va2)


def test_unknown_domain_and_dataset():
    ds = load_dataset("embedded_digits", None, 8)
    with pytest.raises(DataError, match="did you mean colour"):
        leave_one_domain_out(ds, "color", 0.2, 0)
    with pytest.raises(DataError, match="unknown dataset"):
        load_dataset("pacz", None, 8)


def test_skipped_images_are_named_on_every_load(tmp_path, monkeypatch, capsys):
    """data.on_corrupt: skip says which files it left out, and why, each time
    the data is read (a decode, then the cache), and partition / run show it."""
    from PIL import Image

    from rayfed_dg.cli import main

    monkeypatch.setenv("RAYFED_DG_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "pacs"
    for d in ("photo", "art_painting", "cartoon", "sketch"):
        for c in ("dog", "cat"):
            (root / d / c).mkdir(parents=True)
            for i in range(3):
                Image.fromarray(np.full((8, 8, 3), 30 * i, np.uint8)).save(root / d / c / f"{i}.png")
    bad = [root / "cartoon" / "cat" / "1.png", root / "sketch" / "dog" / "2.png"]
    for p in bad:
        p.write_bytes(b"\x89PNG broken")
    for _ in ("decoded", "cached"):
        with pytest.warns(UserWarning) as w:
            ds = load_dataset("pacs", str(root), 8, on_corrupt="skip")
        msg = str(w[0].message)
        assert f"left out 2 of 24 images under {root} that cannot be decoded: {bad[0]}, {bad[1]}" in msg
        assert "UnidentifiedImageError" in msg and "skipped_images.txt" in msg
        assert len(ds.labels) == 22 and ds.meta["skipped_files"] == [str(p) for p in bad]
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(f"data: {{name: pacs, root: {root}, on_corrupt: skip, resolution: 8}}\n")
    assert main(["partition", str(cfg), "--out", str(tmp_path / "parts")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rayfed-dg: warning: data.on_corrupt: skip: left out 2 of 24 images")
