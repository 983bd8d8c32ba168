"""The package's import directions, read from the source (nothing is imported):
the engine's wings import only the wings their ``__init__`` allows
(``MAY_IMPORT``), and the layers below the engine never import it.  Every
import counts: module-level, inside functions and under TYPE_CHECKING."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "rayfed_dg"
ENGINE = PKG / "engine"
WINGS = sorted(p.name for p in ENGINE.iterdir() if (p / "__init__.py").exists())


def imported(path: Path, package: list[str] | None = None) -> set[str]:
    """Absolute names of the modules ``path`` imports, relative imports
    resolved against ``package`` (the file's own by default)."""
    tree = ast.parse(path.read_text())
    if package is None:
        package = list(path.relative_to(PKG.parent).parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # ``from . import x`` names a module
    return out


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["rayfed_dg", "engine"] and len(parts) > 2 and parts[2] in WINGS:
        return parts[2]
    return None


def allowed(wing: str) -> tuple[str, ...]:
    tree = ast.parse((ENGINE / wing / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if isinstance(target, ast.Name) and target.id == "MAY_IMPORT":
                return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"engine/{wing}/__init__.py declares no MAY_IMPORT")


def test_the_engine_is_wings_only():
    loose = sorted(p.name for p in ENGINE.glob("*.py") if p.name != "__init__.py")
    assert loose == [], "every engine module lives in a wing"
    assert set(WINGS) == {"running", "rounds", "workers", "privacy", "aggregation", "store", "clock"}


@pytest.mark.parametrize("wing", WINGS)
def test_a_wing_imports_only_the_wings_it_declares(wing):
    may = set(allowed(wing)) | {wing}
    assert set(allowed(wing)) <= set(WINGS)
    bad = []
    for path in sorted((ENGINE / wing).rglob("*.py")):
        for mod in imported(path):
            other = wing_of(mod)
            if other is not None and other not in may:
                bad.append(f"{path.relative_to(PKG)} imports {mod}")
            if mod == "rayfed_dg.engine":
                bad.append(f"{path.relative_to(PKG)} imports the engine package itself")
    assert bad == []


def test_the_wings_are_layered_without_a_circle():
    """The declared directions themselves form no circle: a wing cannot allow
    one that allows it back, directly or through others."""
    graph = {w: set(allowed(w)) for w in WINGS}

    def reach(w: str, seen: set[str]) -> set[str]:
        for v in graph[w] - seen:
            seen.add(v)
            reach(v, seen)
        return seen

    assert [w for w in WINGS if w in reach(w, set())] == []


@pytest.mark.parametrize("layer", ["data", "models", "methods", "stages", "config.py", "seeding.py", "errors.py",
                                   "utils.py", "plugins.py"])
def test_the_layers_below_the_engine_never_import_it(layer):
    root = PKG / layer
    paths = [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))
    bad = [f"{p.relative_to(PKG)} imports {m}" for p in paths for m in imported(p)
           if m == "rayfed_dg.engine" or m.startswith("rayfed_dg.engine.")]
    assert bad == []


def test_the_checker_sees_a_wrong_arrow(tmp_path):
    """The reader behind these tests resolves relative imports: an import
    from ``rounds`` written into ``clock`` is seen as one."""
    fake = tmp_path / "probe.py"
    fake.write_text("def f():\n    from ..rounds import server\n    from rayfed_dg.engine.store import records\n"
                    "from .devices import RoundPlan\n")
    found = {wing_of(m) for m in imported(fake, ["rayfed_dg", "engine", "clock"])} - {None}
    assert found == {"rounds", "store", "clock"}
