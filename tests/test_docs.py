"""The documentation cannot drift from the code: every key of the typed config and every registered method's and
stage's parameter is in the generated configuration reference (docs/hooks/reference.py, called directly, without
MkDocs), every registered method has its section on docs/methods.md, and the README stays small with working links.
The site itself is built by .ci/run (`mkdocs build --strict`)."""
import importlib.util
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from rayfed_dg.config import DataConfig, ExperimentConfig
from rayfed_dg.methods import get_method_class, method_names
from rayfed_dg.stages import get_stage_class, stage_names

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load("reference")


def _walk(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key a config may name, written independently of the generator's walk."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for t in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(t, type) and issubclass(t, BaseModel):
                keys += _walk(t, f"{prefix}{name}.")
    return keys


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    nxt = re.compile(rf"^#{{1,{len(level)}}} ", re.M).search(text, start + len(heading))
    return text[start:nxt.start() if nxt else len(text)]


@pytest.fixture(scope="module")
def generated() -> str:
    return reference.config_reference()


def test_every_config_key_is_in_the_reference(generated):
    keys = _walk(ExperimentConfig)
    assert {"data.resolution", "output.wandb.project", "output.mlflow.tracking_uri", "server.tau", "plugins"} <= set(keys)
    missing = [k for k in keys if f"| `{k}` |" not in generated]
    assert not missing, f"keys missing from the generated reference: {missing}"
    rows = {line.split(" | ")[0][3:-1]: line for line in generated.splitlines() if line.startswith("| `")}
    # the description cell less the bounds the generator puts first (">= 8, <= 1024; ")
    undescribed = [k for k in keys if not re.sub(r"^([<>]=? \S+?(, |; |$))+", "", rows[k].split(" | ")[3].strip(" |"))]
    assert not undescribed, f"config keys without a description (a comment beside or above the field): {undescribed}"


def test_every_method_and_stage_parameter_is_in_its_section(generated):
    for name in method_names():
        section = _section(generated, f"### `{name}`")
        for param in get_method_class(name).Params.model_fields:
            assert f"| `method.{param}` |" in section, (name, param)
    for name in stage_names():
        section = _section(generated, f"### `{name}`")
        for param in get_stage_class(name).Params.model_fields:
            assert f"| `stages.{name}.{param}` |" in section, (name, param)


def test_reference_rows_carry_type_default_bounds_and_the_source_comment(generated):
    # a comment beside the field, one above it, bounds from Field(ge=, le=), a Literal's choices
    assert "| `data.root` | `str | null` | `null` | dataset folder; None for embedded data |" in generated
    assert ("| `data.source_test_fraction` | `float` | `0.0` | >= 0.0, < 1.0; an in-domain test split of each source "
            "domain (metrics split source_test); 0: none, training data as before |") in generated
    assert "| `data.resolution` | `int` | `32` | >= 8, <= 1024; image side in pixels the model sees |" in generated
    assert '| `data.on_corrupt` | `"fail" | "skip"` | `"fail"` | an undecodable image: stop, or skip and count |' \
        in generated
    assert reference._comments(DataConfig)["heldout_val_domain"].startswith("a domain held out of training")


def test_reference_tables_render_union_types_as_written(generated):
    # a pipe in a code span stays in its cell; an escaped one showed its backslash on the built page
    markdown = pytest.importorskip("markdown", reason="the docs' Markdown renderer comes with the dev extra (mkdocs)")
    html = markdown.markdown(generated, extensions=["tables"])
    assert '<td><code>str | null</code></td>' in html
    assert '<td><code>"fail" | "skip"</code></td>' in html and "\\|" not in html


def test_every_registered_method_has_a_section_on_the_methods_page():
    page = (ROOT / "docs" / "methods.md").read_text()
    headed = re.findall(r"^## `(\w+)`", page, re.M)
    assert sorted(headed) == sorted(method_names()), "one '## `name`' section per registered method, no other"
    for name in method_names():
        section = _section(page, next(h for h in re.findall(r"^## `\w+`.*$", page, re.M) if f"`{name}`" in h))
        assert f"<!-- method-params {name} -->" in section, name
        rendered = re.findall(r"^::: (\S+)", section, re.M)
        # the docstring shown is the one of the module that defines the method (fedavg is base.Method itself,
        # fedfda shares fedfd's module and section)
        assert rendered in ([get_method_class(name).__module__], []), (name, rendered)


def test_method_params_placeholder_becomes_the_table():
    text = reference.render("x\n<!-- method-params fedprox -->\ny")
    assert "| `method.mu` | `float` | `0.01` | >= 0.0; CCST's reference value |" in text
    assert "<!--" not in text
    assert "has no parameters of its own" in reference.render("<!-- method-params fedbn -->")


def test_plain_docstrings_keep_laid_out_paragraphs():
    plain = _load("plain_docstrings") if importlib.util.find_spec("griffe") else None
    if plain is None:
        pytest.skip("griffe (mkdocstrings' loader, in the dev extra) is not installed")
    doc = ("Title line.\n\nProse that wraps\nover two lines.\n\n* a bullet\n  continued\n\n"
           "Update:\n    x <- x + eta m\n\n``a``    one\n``bb``   two")
    assert plain.markdown(doc) == ("Title line.\n\nProse that wraps\nover two lines.\n\n* a bullet\n  continued\n\n"
                                   "```text\nUpdate:\n    x <- x + eta m\n```\n\n```text\n``a``    one\n``bb``   two\n```")


def test_readme_is_small_and_its_links_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024
    fast = 'python -m pytest -q -m "not slow"'
    assert f"pip install -e '.[dev]' && rayfed-dg run configs/quickstart.yaml\n{fast}\n" in readme
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links and all((ROOT / link).is_file() for link in links), [l for l in links if not (ROOT / l).is_file()]
    ci = (ROOT / ".ci" / "run").read_text()  # the README's command, then the slow tier after it, in two halves
    at = ci.index(f"\n{fast}\n")
    halves = [f'\n( exec python -m pytest -q -m "slow and {m}cluster" ) ' for m in ("", "not ")]
    assert all(at < ci.index(h) for h in halves)  # together exactly `-m slow`, each once (tests/test_ci.py: stopping)
    assert ci.count("\npython -m pytest") == 1 and ci.count("exec python -m pytest") == 2
    assert 'reap "$rest_pid" || rest=$?' in ci and 'reap "$cluster_pid" || cluster=$?' in ci
