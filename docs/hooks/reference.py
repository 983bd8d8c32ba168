"""MkDocs hook: the pages generated from the code at build time, so they cannot drift from it.

* ``<!-- config-reference -->`` becomes ``config_reference()``: every key of the typed config
  (``rayfed_dg.config.ExperimentConfig``, walked recursively), then every registered method's and data
  stage's ``Params``, each with its type, default, bounds and description.  The description is the
  field's ``Field(description=...)`` or else the comment written beside or just above it in the source.
* ``<!-- method-params NAME -->`` becomes the parameter table of method ``NAME`` (the methods page).

Pure Python apart from ``on_page_markdown`` (the hook MkDocs calls): ``tests/test_docs.py`` calls the
generator directly, without MkDocs.
"""
from __future__ import annotations

import ast
import inspect
import io
import json
import re
import textwrap
import tokenize
import types
import typing
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

CONFIG_MARK = "<!-- config-reference -->"
PARAMS_MARK = re.compile(r"<!-- method-params (\w+) -->")


def _type_name(ann: Any) -> str:
    # shown in a code span, where a table cell's pipe needs no escape (an escape would show as a backslash)
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    if ann is type(None):
        return "null"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return getattr(ann, "__name__", str(ann))


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "see below"
    return json.dumps(value)


def _bounds(field: Any) -> str:
    ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return ", ".join(f"{sym} {getattr(m, op)}" for m in field.metadata for op, sym in ops.items()
                     if getattr(m, op, None) is not None)


@cache
def _comments(cls: type) -> dict[str, str]:
    """Each field of ``cls`` (its own annotations) -> the comment beside it, or the comment lines just above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comment_at = {tok.start[0]: tok.string.lstrip("#").strip()
                  for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    out = {}
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    shared, prev_end = "", 0  # a comment above a field also covers the uncommented fields right below it
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            shared = ""
            continue
        beside = [comment_at[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in comment_at]
        above, n = [], stmt.lineno - 1
        while n in comment_at and lines[n - 1].strip().startswith("#"):
            above.insert(0, comment_at[n])
            n -= 1
        if above:
            shared = " ".join(above)
        elif beside or stmt.lineno != prev_end + 1:
            shared = ""
        out[stmt.target.id] = " ".join(above + beside) or shared
        prev_end = stmt.end_lineno or stmt.lineno
    return out


def _description(model: type[BaseModel], name: str) -> str:
    field = model.model_fields[name]
    if field.description:
        return field.description
    owner = next((c for c in model.__mro__ if name in vars(c).get("__annotations__", {})), model)
    return _comments(owner).get(name, "")


def _section_model(ann: Any) -> type[BaseModel] | None:
    for a in (ann, *typing.get_args(ann)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _slug(key: str) -> str:
    # Python-Markdown's toc slug of the heading `key`
    return re.sub(r"[^\w\- ]", "", key).strip().lower().replace(" ", "-")


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        desc = _description(model, name).replace("|", "\\|")
        if not desc and _section_model(field.annotation) and typing.get_origin(field.annotation) not in (list, dict):
            desc = f"the section [`{prefix}{name}`](#{_slug(prefix + name)}) below"
        bounds = _bounds(field)
        rows.append(f"| `{prefix}{name}` | `{_type_name(field.annotation)}` | `{_default(field)}` | "
                    f"{bounds + '; ' if bounds and desc else bounds}{desc} |")
    return rows


_HEAD = ["| key | type | default | description |", "|---|---|---|---|"]


def _table(model: type[BaseModel], prefix: str) -> str:
    return "\n".join(_HEAD + _rows(model, prefix))


def config_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """(dotted key, the model holding it) for every field of ``model``, nested sections walked depth first."""
    out = []
    for name, field in model.model_fields.items():
        out.append((prefix + name, model))
        sub = _section_model(field.annotation)
        if sub is not None and typing.get_origin(field.annotation) not in (list, dict):
            out += config_keys(sub, f"{prefix}{name}.")
    return out


def _doc(cls: type) -> str:
    return inspect.cleandoc(cls.__doc__) if cls.__doc__ and cls.__doc__ is not BaseModel.__doc__ else ""


def method_params(name: str) -> str:
    from rayfed_dg.methods import get_method_class

    params = get_method_class(name).Params
    if not params.model_fields:
        return f"`{name}` has no parameters of its own."
    return _table(params, "method.")


def config_reference() -> str:
    from rayfed_dg.config import ExperimentConfig
    from rayfed_dg.methods import method_names
    from rayfed_dg.stages import get_stage_class, stage_names

    parts = ["Generated at build time from `rayfed_dg/config.py` and the registered methods' and stages' "
             "`Params` (`docs/hooks/reference.py`): what a config file or `--set` may name.",
             "## Top level", _table(ExperimentConfig, "")]
    sections: list[tuple[str, type[BaseModel]]] = [
        (key, sub) for key, model in config_keys(ExperimentConfig)
        if (sub := _section_model(model.model_fields[key.rsplit(".", 1)[-1]].annotation)) is not None]
    for key, sub in sections:
        parts += [f"## `{key}`", _doc(sub), _table(sub, key + ".")]
    parts.append("## Method parameters\n\nBeside `method.name` (and in each `compare:` row), by method.")
    for name in method_names():
        parts += [f"### `{name}`", method_params(name)]
    parts.append("## Data stage parameters\n\nUnder `stages.<name>` (`stages: {ccst: {k: 2}}`).")
    for name in stage_names():
        params = get_stage_class(name).Params
        parts += [f"### `{name}`", _table(params, f"stages.{name}.") if params.model_fields
                  else "No parameters."]
    return "\n\n".join(p for p in parts if p) + "\n"


def render(markdown: str) -> str:
    if CONFIG_MARK in markdown:
        markdown = markdown.replace(CONFIG_MARK, config_reference())
    return PARAMS_MARK.sub(lambda m: method_params(m.group(1)), markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return render(markdown)
