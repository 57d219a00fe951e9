"""Renders the benchmarks' Markdown reports from the Jinja2 templates in ``loadtest/templates/``.

The report writers (``to_markdown`` and the like) compute the numbers; the templates hold the words
and the table layouts. Templates see two helpers besides what they are given: the ``fmt`` filter,
``format(value, spec)`` (``{{ x | fmt('.1%') }}`` is ``f"{x:.1%}"``), and ``cell(row, key, spec)``,
the formatted value or ``-`` where the row lacks the key. A missing name is an error, not an empty
string (``StrictUndefined``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2

TEMPLATES_DIR = Path(__file__).parent / "templates"


def _fmt(value: Any, spec: str) -> str:
    if isinstance(value, jinja2.Undefined):
        str(value)  # a StrictUndefined raises UndefinedError, naming the missing field
    return format(value, spec)


def _cell(row: dict[str, Any], key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)
_ENV.filters["fmt"] = _fmt
_ENV.globals["cell"] = _cell


def render(name: str, **context: Any) -> str:
    """The template ``loadtest/templates/NAME`` rendered with ``context``."""
    return _ENV.get_template(name).render(**context)


def write_report(out_dir: Path, stem: str, report: dict[str, Any], markdown: str) -> None:
    """``out_dir/<stem>.json`` and ``out_dir/<stem>.md``, the pair every benchmark commits."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown)
