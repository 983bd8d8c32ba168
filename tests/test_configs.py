"""Every shipped config and search space validates."""

import pytest
from conftest import REPO

from rayfed_dg.config import load_config, method_variants
from rayfed_dg.tuning import load_space, space_names

CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(REPO)) for p in CONFIGS])
def test_config_validates_and_every_variant_builds(path):
    from rayfed_dg.methods import build_method, get_method_class

    cfg = load_config(path)
    variants = method_variants(cfg)
    assert len(variants) == (len(cfg.compare) if cfg.compare else 1)
    for label, v in variants:
        # the typed parameters are the method's own model, and the model builds with them on this backbone
        assert isinstance(v.method.params, get_method_class(v.method.name).Params), label
        if not v.model.pretrained:  # paper configs need ImageNet weights: their dry run is in test_paper_configs
            # (the partition's client count is known once the data is: a stand-in of 3 here, for COPA's heads)
            n = v.partition.num_clients or 3
            assert sum(p.numel() for p in build_method(v, n).build_model(7).parameters()) > 0


@pytest.mark.parametrize("name", space_names())
def test_space_loads_and_its_keys_are_config_keys(name):
    import json

    space = load_space(name)
    cfg_path = REPO / space["config"]
    for key, dist in space["params"].items():
        probe = next(iter(dist.values()))[0]
        tree = load_config(cfg_path, list(space.get("set", [])) + [f"{key}={json.dumps(probe)}"]).to_dict()
        for part in key.split("."):  # the searched key reaches the config with the searched value
            tree = tree[part]
        assert tree == probe, (key, tree, probe)
