"""Reading the evidence files and writing their numbers the way the pages print them.

Every generated table goes through these few formats, so that a page's "+0.010 ± 0.010" is the
evidence file's paired difference rounded once, in one place."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
EVIDENCE = ROOT / "experiments" / "evidence"

MINUS = "−"
"""The pages print negative numbers with the typographic minus sign (U+2212), not the ASCII hyphen."""


@functools.cache
def _read(name: str) -> dict:
    return json.loads((EVIDENCE / f"{name}.json").read_text())


_readers: list[list[str]] = []


def evidence(name: str) -> dict:
    """The JSON of experiments/evidence/NAME.json (e.g. "figure1/figure1"), read once per process (the check reads the same
    file for many tables); each `files_read` block in progress records the name."""
    for reader in _readers:
        if name not in reader:
            reader.append(name)
    return _read(name)


@contextlib.contextmanager
def files_read() -> Iterator[list[str]]:
    """The evidence files read inside the block, in order: what a difference names as its source."""
    reader: list[str] = []
    _readers.append(reader)
    try:
        yield reader
    finally:
        _readers.remove(reader)


def with_minus(text: str) -> str:
    return text.replace("-", MINUS)


def fixed(value: float, digits: int = 3) -> str:
    """A number as the pages print a measured value: `digits` decimals, the typographic minus."""
    return with_minus(f"{value:.{digits}f}")


def signed(value: float, digits: int = 3) -> str:
    """A difference: always signed ("+0.010", "−0.033"); a value that rounds to zero keeps its sign ("−0.000")."""
    return with_minus(f"{value:+.{digits}f}")


def interval(statistic: dict, digits: int = 3) -> str:
    """`mean ± half-width` of an `experiments.common.mean_and_ci95` dictionary."""
    return f"{fixed(statistic['mean'], digits)} ± {statistic['ci95']:.{digits}f}"


def signed_interval(statistic: dict, digits: int = 3, negate: bool = False) -> str:
    """A paired difference's `±mean ± half-width`; `negate` reads B − A from a file that stored A − B."""
    mean = -statistic["mean"] if negate else statistic["mean"]
    return f"{signed(mean, digits)} ± {statistic['ci95']:.{digits}f}"


def negated(statistic: dict) -> dict:
    """A paired difference read the other way round (B − A from A − B): the interval's half-width is the same."""
    return {**statistic, "mean": -statistic["mean"], "values": [-value for value in statistic["values"]]}


def per_seed(values: list[float], digits: int = 3) -> str:
    return ", ".join(fixed(value, digits) for value in values)


def signed_per_seed(values: list[float], digits: int = 3) -> str:
    return ", ".join(signed(value, digits) for value in values)


def bold(text: str, emphasised: bool = True) -> str:
    """The pages' emphasis (a headline row or cell); an empty cell stays empty."""
    return f"**{text}**" if emphasised and text else text


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "|" + "".join(f" {cell} |" if cell else " |" for cell in cells)

    return "\n".join([line(headers), "|" + "---|" * len(headers), *(line(row) for row in rows)])
