"""In-domain test splits of the sources and a held-out validation domain:
what is set aside is never trained on, 0 changes nothing,
and the engine evaluates both every round."""
import numpy as np
import pytest
from conftest import tiny_cfg

from rayfed_dg.data import leave_one_domain_out
from rayfed_dg.engine.running.plan import resolve_targets, split_for
from rayfed_dg.errors import ConfigError, DataError


def test_source_test_split_is_disjoint_sized_and_zero_changes_nothing(tiny_ds):
    plain = leave_one_domain_out(tiny_ds, "colour", 0.2, 0)
    assert plain.source_test == {} and plain.heldout_val == {}
    same = leave_one_domain_out(tiny_ds, "colour", 0.2, 0, source_test_fraction=0.0)
    assert all(np.array_equal(a, b) for a, b in zip(plain.clients, same.clients))
    s = leave_one_domain_out(tiny_ds, "colour", 0.2, 0, source_test_fraction=0.25)
    assert sorted(s.source_test) == sorted(s.val) == sorted(d for d in tiny_ds.domain_names if d != "colour")
    for i, d in enumerate(s.client_domains):
        dom = np.flatnonzero(tiny_ds.domains == tiny_ds.domain_index(d))
        tr, va, te = s.clients[i], s.val[d], s.source_test[d]
        # a partition of the domain: nothing set aside for testing is trained or validated on
        assert len(np.intersect1d(tr, te)) == len(np.intersect1d(va, te)) == len(np.intersect1d(tr, va)) == 0
        assert np.array_equal(np.sort(np.concatenate([tr, va, te])), dom)
        # 25% test and still 20% of the whole domain for validation (per class, so within a few samples)
        assert abs(len(te) - 0.25 * len(dom)) <= 10 and abs(len(va) - 0.2 * len(dom)) <= 10
        for c in np.unique(tiny_ds.labels[dom]):  # stratified: every class is in each part
            assert (tiny_ds.labels[te] == c).any() and (tiny_ds.labels[tr] == c).any()


def test_heldout_domain_is_neither_trained_on_nor_a_target(tiny_ds):
    s = leave_one_domain_out(tiny_ds, "colour", 0.2, 0, heldout_val_domain="mono")
    assert list(s.heldout_val) == ["mono"] and "mono" not in s.val and "mono" not in s.client_domains
    mono = np.flatnonzero(tiny_ds.domains == tiny_ds.domain_index("mono"))
    assert np.array_equal(s.heldout_val["mono"], mono)
    assert not any(np.intersect1d(c, mono).size for c in s.clients)
    assert resolve_targets(tiny_ds, "all", "mono") == [d for d in tiny_ds.domain_names if d != "mono"]
    with pytest.raises(ConfigError, match="heldout_val_domain"):
        resolve_targets(tiny_ds, "mono", "mono")
    with pytest.raises(DataError, match="heldout_val_domain"):
        leave_one_domain_out(tiny_ds, "mono", 0.2, 0, heldout_val_domain="mono")
    with pytest.raises(ValueError, match="too little to train on"):
        tiny_cfg("data.val_fraction=0.5", "data.source_test_fraction=0.5")


@pytest.mark.ray
def test_engine_evaluates_source_test_and_heldout_rows_every_round(tiny_ds, engine_host, tmp_path):
    from rayfed_dg.engine import run_federation
    from rayfed_dg.engine.store.rundir import RunDir

    cfg = tiny_cfg("data.source_test_fraction=0.2", "data.heldout_val_domain=mono", "training.local_steps=2")
    split = split_for(cfg, tiny_ds, "colour")
    res = run_federation(cfg, split, None, None, tiny_ds.num_classes, tmp_path, progress=False,
                         host=engine_host(tiny_ds, 2))
    rows = RunDir(tmp_path).read_rows("metrics")
    for r in (1, 2):
        mine = {(m["split"], m["domain"]): m["samples"] for m in rows if m["round"] == r}
        assert {d: n for (sp, d), n in mine.items() if sp == "source_test"} == \
            {d: len(i) for d, i in split.source_test.items()}
        assert mine["heldout_val", "mono"] == len(split.heldout_val["mono"])
        assert ("source_val", "mono") not in mine
    assert res.selected_round in (1, 2)  # selection still reads source validation only
