"""Griffe extension: the package's plain-text docstrings rendered as written.

The docstrings are plain text, not Markdown: ASCII equations on indented lines, hook maps and layouts in aligned
columns.  Markdown would run those lines together, so each paragraph that relies on its line breaks (a line
indented deeper than its paragraph's text, or columns aligned with runs of spaces) becomes a ``text`` block; the
other paragraphs stay Markdown (prose, ``*`` lists, ``code``).
"""
from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_COLUMNS = re.compile(r"\S {3,}\S")


def _laid_out(block: list[str]) -> bool:
    first = block[0]
    indent = len(first) - len(first.lstrip())
    text_indent = indent + (2 if first.lstrip().startswith(("* ", "- ")) else 0)
    return any(_COLUMNS.search(line.strip()) for line in block) or any(
        len(line) - len(line.lstrip()) > text_indent for line in block[1:])


def markdown(doc: str) -> str:
    blocks: list[list[str]] = [[]]
    for line in doc.splitlines():
        if line.strip():
            blocks[-1].append(line.rstrip())
        elif blocks[-1]:
            blocks.append([])
    out = [("```text\n" + "\n".join(b) + "\n```") if _laid_out(b) else "\n".join(b) for b in blocks if b]
    return "\n\n".join(out)


class PlainDocstrings(Extension):
    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
