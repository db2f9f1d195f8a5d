"""Reading the evidence files and writing their numbers the way the pages print them: every table goes through these
few formats, so that a page's "+0.010 ± 0.010" is the evidence file's paired difference rounded once, in one place."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[2]
EVIDENCE = ROOT / "experiments" / "evidence"

MINUS = "−"
"""The pages print negative numbers with the typographic minus sign (U+2212), not the ASCII hyphen."""


@functools.cache
def _read(name: str) -> dict:
    return json.loads((EVIDENCE / f"{name}.json").read_text())


READ: list[str] = []
"""The evidence files read since the list was last cleared, in order: what a difference names as its source."""


def evidence(name: str) -> dict:
    """experiments/evidence/NAME.json, parsed once per process (the check reads one file for many tables)."""
    if name not in READ:
        READ.append(name)
    return _read(name)


def fixed(value: float, digits: int = 3) -> str:
    """A measured value: `digits` decimals, the typographic minus."""
    return f"{value:.{digits}f}".replace("-", MINUS)


def signed(value: float, digits: int = 3) -> str:
    """A difference, always signed ("+0.010", "−0.033"); one that rounds to zero keeps its sign ("−0.000")."""
    return f"{value:+.{digits}f}".replace("-", MINUS)


def interval(statistic: dict) -> str:
    """`mean ± half-width` of an `experiments.common.mean_and_ci95` dictionary."""
    return f"{fixed(statistic['mean'])} ± {statistic['ci95']:.3f}"


def signed_interval(statistic: dict) -> str:
    """A paired difference's `±mean ± half-width`."""
    return f"{signed(statistic['mean'])} ± {statistic['ci95']:.3f}"


def listed(values: list[float], cell: Callable[[float], str] = fixed) -> str:
    """Values one after another ("0.964, 0.948"), each written by `cell`."""
    return ", ".join(cell(value) for value in values)


def decided(difference: dict) -> bool:
    """The pages' rule for a decided comparison: over more than one seed, its 95 % interval excludes 0."""
    return len(difference["values"]) > 1 and abs(difference["mean"]) > difference["ci95"]


def bold(text: str, emphasised: bool = True) -> str:
    """The pages' emphasis (a headline row or cell); an empty cell stays empty."""
    return f"**{text}**" if emphasised and text else text


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "|" + "".join(f" {cell} |" if cell else " |" for cell in cells)

    return "\n".join([line(headers), "|" + "---|" * len(headers), *(line(row) for row in rows)])


Cell = str | Callable[[Any], str]
"""How a column writes a row's cell: a format template of the row's fields ("{median:.2f} s"), or a function of it.
A template prints an ASCII hyphen: a value that can be negative goes through `fixed` or `signed`."""


def table(columns: dict[str, Cell], rows: Iterable[Any]) -> str:
    """A table of one row per item of `rows`, its columns by header."""

    def cell(column: Cell, row: Any) -> str:
        return column.format_map(row) if isinstance(column, str) else column(row)

    return markdown_table(list(columns), [[cell(column, row) for column in columns.values()] for row in rows])
