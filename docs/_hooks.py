"""mkdocs hook: docstrings name objects with Sphinx roles (``:class:`Pool```); mkdocstrings
renders the role's text before the code span, so drop it."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):(?=<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub("", html)
