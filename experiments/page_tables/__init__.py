"""The pages' numbers, generated from their evidence files, so that they cannot drift from their data.

    python -m experiments.page_tables          # prints every table
    python -m experiments.page_tables --write  # writes the tables into the pages, between their markers
    python -m experiments.page_tables --check  # lists what differs, exits 1 if anything

A page holds a table between `<!-- table:NAME (python -m experiments.page_tables --write) -->` and
`<!-- /table:NAME -->`; `--write` replaces what lies between with TABLES[NAME]() (a table may sit on several pages).
Labels, column headers and emphasis are the generator's; every number comes from the JSON under experiments/evidence/.
A page quotes a measured number only inside such a table: the check reports a table written by hand and, in the prose
of the lab's pages and of the README's "What to expect", a measured-looking number (three decimals, or a ±).

experiments/tests/test_page_tables.py runs the check.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path

from experiments.page_tables import benchmarks, findings, real_model, results
from experiments.page_tables.evidence import ROOT, files_read


TABLES: dict[str, Callable[[], str]] = {**findings.TABLES, **real_model.TABLES, **results.TABLES, **benchmarks.TABLES}
"""Every generated table by its marker name."""

PAGES = tuple(
    ROOT / name
    for name in (
        "README.md",
        "experiments/README.md",
        "experiments/benchmarks.md",
        "docs/real-model.md",
        "docs/off-policy.md",
    )
)
"""The pages whose markers are filled and whose tables are checked."""

PROSE_CHECKED = {
    # page: the section whose prose may quote no measured number (None: the whole page)
    "README.md": "What to expect",
    "experiments/README.md": None,
    "experiments/benchmarks.md": None,
}
MEASURED = re.compile(r"\d\.\d{3}|±")
"""What a measured number looks like in prose: three decimals, or an interval."""

COMMAND = "python -m experiments.page_tables --write"
MARKED = re.compile(r"<!-- table:(?P<name>[\w.-]+) \(.*?\) -->\n(?P<body>.*?)\n<!-- /table:(?P=name) -->", re.S)


def marked(name: str, table: str) -> str:
    return f"<!-- table:{name} ({COMMAND}) -->\n{table}\n<!-- /table:{name} -->"


def filled(text: str) -> str:
    """The page's text with every marked table regenerated from its evidence."""
    return MARKED.sub(lambda match: marked(match["name"], TABLES[match["name"]]()), text)


def table_differences(page: str, text: str) -> list[str]:
    """What differs between the tables a page's `text` holds and what their evidence files give, one entry per
    table, with the lines that differ; an unknown table name is a difference too."""
    differences = []
    for match in MARKED.finditer(text):
        name = match["name"]
        if name not in TABLES:
            differences.append(f"{page}: table {name!r} has no generator in experiments.page_tables")
            continue
        with files_read() as sources:
            expected = TABLES[name]()
        if match["body"] != expected:
            diff = difflib.unified_diff(
                match["body"].splitlines(), expected.splitlines(), "page", "evidence", lineterm="", n=0
            )
            differences.append(
                f"{page}: table {name!r} differs from {', '.join(sources)} ({COMMAND}):\n"
                + "\n".join(line for line in diff if not line.startswith(("---", "+++", "@@")))
            )
    return differences


def section(text: str, heading: str) -> str:
    """The part of a markdown page under `heading` (its text after `#`s), up to the next heading of its level or
    above."""
    lines = text.splitlines()
    # A "# comment" line in a fenced code block is not a heading.
    fenced, in_fence = [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        fenced.append(in_fence)

    def level(index: int) -> int:
        mark = lines[index].partition(" ")[0]
        return len(mark) if mark and set(mark) == {"#"} and not fenced[index] else 0

    for index, line in enumerate(lines):
        if level(index) and line.partition(" ")[2].strip() == heading:
            end = next(
                (later for later in range(index + 1, len(lines)) if 0 < level(later) <= level(index)), len(lines)
            )
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


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def differences(pages: tuple[Path, ...] = PAGES) -> list[str]:
    """Everything that differs between the pages and their evidence, what the checked pages write by hand, and every
    generated table no page holds."""
    found, names = [], set()
    for path in pages:
        text = path.read_text()
        names |= {match["name"] for match in MARKED.finditer(text)}
        found += table_differences(relative(path), text) + prose_differences(relative(path), text)
    found += [f"table {name!r} is generated but no page holds it" for name in TABLES if name not in names]
    return found


def write(pages: tuple[Path, ...] = PAGES) -> list[Path]:
    """Regenerates every marked table of the pages; returns the pages it changed."""
    changed = []
    for path in pages:
        text = path.read_text()
        if (new := filled(text)) != text:
            path.write_text(new)
            changed.append(path)
    return changed
