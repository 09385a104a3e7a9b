"""A griffe extension for the API reference: the package's docstrings use a few reStructuredText spellings.

mkdocstrings renders docstrings as Markdown; this rewrites, before parsing:

- ``Example:`` sections as ``Examples:`` (so the doctests render as Python code, not as quoted text);
- Sphinx roles (``:class:`~pkg.mod.Name```, ``:func:`name```, ...) as inline code of the shown name;
- double backticks as single ones (one code span; a ``[x]`` inside stays code, never a link).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc|ref|py:\w+):`(~?)([^`]+)`")
_DOUBLE = re.compile(r"``([^`]+?)``")
_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    target = target.split("<")[-1].rstrip(">").strip()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def rst_to_markdown(text: str) -> str:
    """The docstring ``text`` with its reStructuredText spellings in Markdown.

    Example:
        >>> rst_to_markdown("See :class:`~a.b.Plan` and ``x[0]``.")
        'See `Plan` and `x[0]`.'
    """
    text = _EXAMPLE.sub(r"\1Examples:", text)
    text = _ROLE.sub(_role, text)
    return _DOUBLE.sub(r"`\1`", text)


class RstToMarkdown(griffe.Extension):
    """Rewrite every loaded docstring with :func:`rst_to_markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the docstring of each object griffe loads."""
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
