"""The pages' numbers, generated from their evidence files, so that they cannot drift from their data.

    python -m experiments.page_tables          # prints every table
    python -m experiments.page_tables --write  # writes the tables into the pages, between their markers
    python -m experiments.page_tables --check  # lists what differs, exits 1 if anything

A page holds each table between `<!-- table:NAME (...) -->` and `<!-- /table:NAME -->`, filled with TABLES[NAME]();
every number comes from the JSON under experiments/evidence/. The check also reports a table written by hand and, in
the prose of the lab's pages and the README's "What to expect", a measured-looking number (three decimals, or a ±).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path

from experiments.page_tables import benchmarks, findings, real_model, results
from experiments.page_tables.evidence import READ, ROOT


TABLES: dict[str, Callable[[], str]] = {**findings.TABLES, **real_model.TABLES, **results.TABLES, **benchmarks.TABLES}
"""Every generated table by its marker name."""

# page: the section whose prose may quote no measured number (None: the whole page)
PROSE_CHECKED = {"README.md": "What to expect", "experiments/README.md": None, "experiments/benchmarks.md": None}
PAGES = tuple(ROOT / page for page in [*PROSE_CHECKED, "docs/real-model.md", "docs/off-policy.md"])
"""The pages whose markers are filled and whose tables are checked."""
MEASURED = re.compile(r"\d\.\d{3}|±")
"""What a measured number looks like in prose: three decimals, or an interval."""

COMMAND = "python -m experiments.page_tables --write"
MARKED = re.compile(r"<!-- table:(?P<name>[\w.-]+) \(.*?\) -->\n(?P<body>.*?)\n<!-- /table:(?P=name) -->", re.S)


def marked(name: str, table: str) -> str:
    return f"<!-- table:{name} ({COMMAND}) -->\n{table}\n<!-- /table:{name} -->"


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def table_differences(page: str, text: str) -> list[str]:
    """One entry per table of the page's `text` that differs from what its evidence gives, with the lines that
    differ; a table with no generator is a difference too."""
    differences = []
    for match in MARKED.finditer(text):
        name = match["name"]
        if name not in TABLES:
            differences.append(f"{page}: table {name!r} has no generator in experiments.page_tables")
            continue
        READ.clear()
        expected = TABLES[name]()
        if match["body"] != expected:
            diff = difflib.unified_diff(match["body"].splitlines(), expected.splitlines(), lineterm="", n=0)
            differences.append(
                f"{page}: table {name!r} differs from {', '.join(READ)} ({COMMAND}):\n"
                + "\n".join(line for line in diff if not line.startswith(("---", "+++", "@@")))
            )
    return differences


def section(text: str, heading: str) -> str:
    """The part of a markdown page under `heading`, up to the next heading of its level or above."""
    lines = text.splitlines()
    # A "# comment" line in a fenced code block is not a heading.
    fenced, in_fence = [], False
    for line in lines:
        in_fence ^= line.lstrip().startswith("```")
        fenced.append(in_fence)

    def level(index: int) -> int:
        mark = lines[index].partition(" ")[0]
        return len(mark) if mark and set(mark) == {"#"} and not fenced[index] else 0

    for index, line in enumerate(lines):
        if level(index) and line.partition(" ")[2].strip() == heading:
            end = next((later for later in range(index + 1, len(lines)) if 0 < level(later) <= level(index)), None)
            return "\n".join(lines[index + 1 : end])
    raise KeyError(f"no heading {heading!r}")


def prose_differences(page: str, text: str) -> list[str]:
    """What a checked page (or section) writes by hand: a table outside markers, or a measured-looking number in its
    prose. A measured number belongs in a generated table."""
    if page not in PROSE_CHECKED:
        return []
    part = MARKED.sub("", text if PROSE_CHECKED[page] is None else section(text, PROSE_CHECKED[page]))
    lines = re.sub(r"```.*?```", "", part, flags=re.S).splitlines()
    tables = [
        f"{page}: the table {line[:80]!r}... is written by hand: give it a generator and markers"
        for index, line in enumerate(lines)
        if line.startswith("|") and (index == 0 or not lines[index - 1].startswith("|"))
    ]
    numbers = [
        f"{page}: the prose quotes {line.strip()[:100]!r}: move the number into a generated table beside it"
        for line in lines
        if not line.startswith("|") and MEASURED.search(line)
    ]
    return tables + numbers


def differences(pages: tuple[Path, ...] = PAGES) -> list[str]:
    """What differs between the pages and their evidence, what the checked pages write by hand, and every generated
    table no page holds."""
    found, names = [], set()
    for path in pages:
        text = path.read_text()
        names |= {match["name"] for match in MARKED.finditer(text)}
        found += table_differences(relative(path), text) + prose_differences(relative(path), text)
    return found + [f"table {name!r} is generated but no page holds it" for name in TABLES if name not in names]


def write(pages: tuple[Path, ...] = PAGES) -> list[Path]:
    """Regenerates every marked table of the pages; returns the pages it changed."""
    changed = []
    for path in pages:
        text = path.read_text()
        new = MARKED.sub(lambda match: marked(match["name"], TABLES[match["name"]]()), text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed
