"""A Griffe extension that lets mkdocstrings render our docstrings as written.

The docstrings are Google style, but they say ``Example:`` (Griffe's Google parser
knows only ``Examples:``, and would render the doctest as a quotation), cross-refer
with Sphinx roles (``:func:`report```), which Markdown would print as they are, and
document module-level constants in ``#:`` comments, which Griffe does not read.  All
three are handled here, in the docs build only, so the package's docstrings and
doctests stay as they are.  A role that names a public name (``deterministic_ctx.__all__``)
becomes a link to its entry in the API reference; any other role becomes code.

Loaded by ``mkdocs.yml`` (``plugins.mkdocstrings.handlers.python.options.extensions``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from griffe import Docstring, Extension, Object

_INIT = Path(__file__).resolve().parent.parent / "deterministic_ctx" / "__init__.py"

_ROLE = re.compile(r":(?:py:)?(func|meth|class|data|attr|exc|mod|obj|const):`(~?)([^`]+)`")
_TITLED = re.compile(r"(.*?)\s*<([^<>]+)>", re.S)  # :meth:`title <target>`
_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


def _public_names() -> frozenset[str]:
    """``deterministic_ctx.__all__``, read from the source: nothing is imported."""
    for node in ast.parse(_INIT.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return frozenset(ast.literal_eval(node.value))
    raise LookupError(f"no __all__ in {_INIT}")


_PUBLIC = _public_names()


def _role(match: re.Match[str]) -> str:
    """A Sphinx role as Markdown: a link where the API reference has the target, else code."""
    kind, short, text = match.groups()
    text = " ".join(text.split())  # a role may wrap across lines
    titled = _TITLED.fullmatch(text)
    title, target = titled.groups() if titled else (None, text)
    parts = target.removeprefix("deterministic_ctx.").split(".")
    if parts[0] in _PUBLIC:  # a public name, or a member of one
        anchor: str | None = ".".join(["deterministic_ctx", *parts])
    elif parts[-1] in _PUBLIC and target.startswith("deterministic_ctx."):
        anchor = f"deterministic_ctx.{parts[-1]}"  # re-exported from its submodule
    else:
        anchor = None
    shown = title or (parts[-1] if short else target)
    if kind in ("func", "meth") and not title:
        shown += "()"
    return f"[`{shown}`][{anchor}]" if anchor else f"`{shown}`"


def rewrite(text: str) -> str:
    """A docstring as mkdocstrings should read it."""
    return _ROLE.sub(_role, _EXAMPLE.sub(r"\1Examples:", text))


class SphinxRolesAndExamples(Extension):
    """Rewrites every docstring Griffe loads (see the module's docstring)."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is None and obj.is_attribute:
            text = _comment_docstring(obj)
            if text:
                obj.docstring = Docstring(text, lineno=obj.lineno, parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)


def _comment_docstring(obj: Object) -> str:
    """The ``#:`` comment lines right above an assignment, as Sphinx reads them."""
    if obj.lineno is None or obj.filepath is None or isinstance(obj.filepath, list):
        return ""
    lines = obj.lines_collection[obj.filepath]
    found: list[str] = []
    index = obj.lineno - 2  # the line above the assignment, 0-based
    while index >= 0 and lines[index].lstrip().startswith("#:"):
        comment = lines[index].lstrip()[2:]
        found.append(comment[1:] if comment.startswith(" ") else comment)
        index -= 1
    return "\n".join(reversed(found))
