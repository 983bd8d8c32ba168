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
