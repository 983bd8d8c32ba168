"""Every shipped config and search space validates."""

import pytest

from conftest import REPO
from rayfed_dg.config import load_config, method_variants
from rayfed_dg.tuning import load_space, space_names

CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(REPO)) for p in CONFIGS])
def test_config_validates(path):
    cfg = load_config(path)
    assert method_variants(cfg)


@pytest.mark.parametrize("name", space_names())
def test_space_loads_and_its_keys_are_config_keys(name):
    import json

    space = load_space(name)
    cfg_path = REPO / space["config"]
    for key, dist in space["params"].items():
        probe = next(iter(dist.values()))[0]
        load_config(cfg_path, list(space.get("set", [])) + [f"{key}={json.dumps(probe)}"])
