"""A griffe extension: render Sphinx cross-reference roles in docstrings as code.

Some docstrings use Sphinx roles (``:func:`enqueue```, ``:class:`~steeple.core.ports.Clock```),
which Markdown would show verbatim. This turns each into an inline code span with the text
Sphinx would display: the last component after ``~``, a relative ``.name`` without its dot.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(
    r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const|type):`(?P<tilde>~?)\.?(?P<target>[^`]+)`"
)


def display(match: re.Match[str]) -> str:
    """Return the code span Sphinx would show for one role."""
    target = match.group("target")
    if match.group("tilde"):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def render_roles(text: str) -> str:
    """Replace every Sphinx role in ``text`` by a code span."""
    return _ROLE.sub(display, text)


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the docstring of each loaded object."""
        if obj.docstring is not None:
            obj.docstring.value = render_roles(obj.docstring.value)
