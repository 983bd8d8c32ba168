"""A method's declarations are read without building it (``Method.declare``, ``methods.declarations``).

The driver reads what a method declares (its phases, whether workers fold its uploads, its payloads, the server
hooks it overrides) before any model exists, from the class and the validated params; a built instance must
report the same, for every registered method and for the params that change an answer (CSAC's aggregation,
StableFDG's style).
"""
from __future__ import annotations

import pytest
from conftest import tiny_cfg

from rayfed_dg.methods import (
    SERVER_HOOKS,
    Declarations,
    Method,
    Phase,
    build_method,
    declarations,
    get_method_class,
    method_names,
    register_method,
)
from rayfed_dg.methods import base as method_base
from rayfed_dg.methods.payloads import released_payload_groups

# the server-side hooks each built-in method overrides, written out by hand: the engine refuses some
# combinations from these before anything is built (a new method adds its row here)
OVERRIDES = {
    "copa": {"assemble_global", "server_payloads"},
    "csac": {"assemble_global"},
    "dson": set(), "dsu": set(), "elcfs": set(), "fedadg": set(), "fedavg": set(), "fedbn": set(),
    "feddg_ga": {"after_round", "aggregation_weights"},
    "feddyn": {"aggregation_weights", "assemble_global"},
    "fedfd": {"server_payloads"}, "fedfda": {"server_payloads"},
    "fedgma": {"assemble_global"},
    "fediir": {"server_payloads"},
    "fedprox": set(), "fedsam": set(), "fedsr": set(), "gperxan": set(), "mixstyle": set(), "moon": set(),
    "rsc": set(),
    "scaffold": {"after_round", "aggregation_weights", "server_payloads"},
    "silobn": set(), "stablefdg": {"server_payloads"},
}

# params that change a declaration, beside each method's defaults
VARIANTS = [(name, ()) for name in sorted(OVERRIDES)] + [
    ("csac", ("method.aggregation=fedavg",)), ("csac", ("method.aggregation=l2",)),
    ("stablefdg", ("method.style=false",)), ("stablefdg", ("method.style=false", "method.attention=false")),
]


def config(name: str, *sets: str):
    stages = [f"stages.{s}={{}}" for s in get_method_class(name).stages_needed]
    return tiny_cfg(f"method.name={name}", *stages, *sets)


def test_every_method_has_its_overrides_written_here():
    assert sorted(OVERRIDES) == method_names()


@pytest.mark.parametrize("name,sets", VARIANTS, ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_declare_is_what_a_built_method_reports(name, sets):
    cfg = config(name, *sets)
    d = declarations(cfg)
    assert d == get_method_class(name).declare(cfg.method.params)
    built = build_method(cfg, 3)
    assert d.name == built.name == name
    assert d.phases == tuple(built.phases)
    assert d.folds_on_workers is bool(built.folds_on_workers)
    assert dict(d.shared_payloads) == dict(built.shared_payloads)
    assert d.overrides == frozenset(OVERRIDES[name]) and d.overrides <= set(SERVER_HOOKS)


def test_the_params_that_change_a_declaration_change_it():
    assert not declarations(config("csac")).folds_on_workers  # the layer-wise weights read every client's tensors
    assert declarations(config("csac", "method.aggregation=fedavg")).folds_on_workers
    assert declarations(config("stablefdg")).phases == (Phase.PREPARE, Phase.PERSONAL_EVAL)
    assert declarations(config("stablefdg", "method.style=false")).phases == (Phase.PERSONAL_EVAL,)


def test_declarations_are_frozen():
    d = declarations(config("scaffold"))
    with pytest.raises(AttributeError):
        d.phases = (Phase.PREPARE,)  # type: ignore[misc]
    with pytest.raises(TypeError):
        d.shared_payloads["scaffold_dc"] = "image"  # type: ignore[index]
    assert get_method_class("scaffold").shared_payloads == {"scaffold_dc": "client"}  # the class's dict untouched


def _boom(*a, **k):
    raise AssertionError("reading declarations built the method")


@pytest.mark.parametrize("name,sets", VARIANTS, ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_reading_declarations_builds_nothing(name, sets, monkeypatch):
    cfg = config(name, *sets)
    want = declarations(cfg)
    for cls in {get_method_class(n) for n in method_names()} | {Method}:
        monkeypatch.setattr(cls, "__init__", _boom)
        monkeypatch.setattr(cls, "build_model", _boom)
    monkeypatch.setattr(method_base, "build_backbone", _boom)
    with pytest.raises(AssertionError, match="built the method"):
        build_method(cfg, 3)
    assert declarations(cfg) == want
    assert released_payload_groups(cfg).keys() >= want.shared_payloads.keys()


def test_overrides_are_of_the_class_and_its_bases():
    class ReadsResults(Method):
        name = "reads_results"

        def after_round(self, round, results, server_state):
            pass

    class Weighted(ReadsResults):
        name = "weighted"

        def aggregation_weights(self, client_ids, sizes, server_state):
            return sizes

    assert Method.declare(None).overrides == frozenset()
    assert ReadsResults.declare(None).overrides == {"after_round"}
    assert Weighted.declare(None).overrides == {"after_round", "aggregation_weights"}
    assert Weighted.declare(None) == Declarations(name="weighted", phases=(Phase.PERSONAL_EVAL,),
                                                  folds_on_workers=True, shared_payloads={},
                                                  overrides=frozenset({"after_round", "aggregation_weights"}),
                                                  batchable=True)  # server hooks leave client training batchable


def test_a_declaration_of_the_params_needs_its_own_declare(monkeypatch):
    monkeypatch.setattr(method_base._REGISTRY, "_items", dict(method_base._REGISTRY._items))

    class Guess(Method):
        name = "guess"

        @property
        def phases(self):  # type: ignore[override]
            return (Phase.PREPARE,) if self.p else ()

    with pytest.raises(TypeError, match="phases is a property of the params.*override the classmethod declare"):
        register_method(Guess)

    class Declared(Guess):
        name = "declared"

        @classmethod
        def declare(cls, params):
            d = super().declare(params)
            return Declarations(d.name, (Phase.PREPARE,) if params else (), d.folds_on_workers, d.shared_payloads,
                                d.overrides)

    assert register_method(Declared) is Declared
    assert Declared.declare(True).phases == Declared(True, None, None, 1).phases == (Phase.PREPARE,)
    assert Declared.declare(False).phases == ()
