"""The pages' numbers, generated from their evidence files, so that they cannot drift from their data.

    python -m experiments.page_tables          # prints every table
    python -m experiments.page_tables --write  # writes the tables into the pages, between their markers
    python -m experiments.page_tables --check  # lists what differs (a table or a quoted number), exits 1 if anything

Two kinds of numbers:
- **Tables**, generated whole. A page holds one between `<!-- table:NAME (python -m experiments.page_tables --write)
  -->` and `<!-- /table:NAME -->`; `--write` replaces what lies between with TABLES[NAME]() (a table may sit on several
  pages). Labels, column headers and emphasis are the generator's; every number comes from the JSON under
  experiments/evidence/ (the modules `results`, `benchmarks`, `real_model`).
- **Quoted numbers in prose** (the README's "What to expect", results.md's "What to expect (for users)", ...): each
  is a `Claim` in `claims.CLAIMS`, a fragment of the sentence with `{}` where the number goes and the function that
  computes it. The check asserts the filled-in fragment appears in its section; `--write` does not touch prose.

tests/test_page_tables.py runs the check in the default test run.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path

from experiments.page_tables import benchmarks, real_model, results
from experiments.page_tables.claims import CLAIMS, Claim
from experiments.page_tables.evidence import ROOT, files_read


TABLES: dict[str, Callable[[], str]] = {**real_model.TABLES, **results.TABLES, **benchmarks.TABLES}
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
"""The pages whose markers are filled and whose claims are checked."""

UNGENERATED = {
    # page: {a table's header line: why its numbers are not generated}
    "experiments/README.md": {
        "| the paper's claim | what this project found | regime | where |": "its cells are prose: the numbers they quote are claims (claims.py)",
        "| script (command above) | runs | wall time |": "wall times noted by hand beside other jobs, in no evidence file",
    },
    "experiments/benchmarks.md": {
        "| generation | pass@1 before | pass@1 after | greedy after | 60 steps | whole run |": "single `topr-trl train` runs of 2026-11-24/25 whose outputs were not kept under experiments/evidence/",
        "| generation | seed 0 | seed 1 | seed 2 | mean | truncated share of negatives (last step) | 60 steps |": "`topr-trl train` runs in server mode of 2026-11-25 whose outputs were not kept under experiments/evidence/",
    },
}
"""The tables of the pages this script answers for that it does not generate, and why: any other table there must sit
between markers, so that a table added by hand is caught."""

COMMAND = "python -m experiments.page_tables --write"
MARKED = re.compile(r"<!-- table:(?P<name>[\w.-]+) \(.*?\) -->\n(?P<body>.*?)\n<!-- /table:(?P=name) -->", re.S)


def marked(name: str, table: str) -> str:
    return f"<!-- table:{name} ({COMMAND}) -->\n{table}\n<!-- /table:{name} -->"


def filled(text: str) -> str:
    """The page's text with every marked table regenerated from its evidence."""
    return MARKED.sub(lambda match: marked(match["name"], TABLES[match["name"]]()), text)


def table_differences(page: str, text: str) -> list[str]:
    """What differs between the tables a page's `text` holds and what their evidence files give, one entry per
    table, with the lines that differ; an unknown table name, or a table of a page in UNGENERATED outside markers and
    not listed there, is a difference too."""
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
    if page in UNGENERATED:
        unmarked = MARKED.sub("", text).splitlines()
        for index, line in enumerate(unmarked):
            starts_table = line.startswith("|") and (index == 0 or not unmarked[index - 1].startswith("|"))
            if starts_table and line not in UNGENERATED[page]:
                differences.append(
                    f"{page}: the table {line[:80]!r}... is written by hand: give it a generator "
                    f"and markers, or say in UNGENERATED why its numbers cannot be generated"
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


def claim_differences(page: str, text: str, claims: list[Claim] | None = None) -> list[str]:
    """The claims on `page` whose number, computed from the evidence, is not what its section of `text` says."""
    differences = []
    for claim in claims if claims is not None else CLAIMS:
        if claim.page != page:
            continue
        with files_read() as sources:
            expected = claim.expected()
        try:
            where = section(text, claim.section)
        except KeyError:
            differences.append(f"{page}: no section {claim.section!r} for the claim {expected!r}")
            continue
        if expected not in " ".join(where.split()):
            differences.append(
                f"{page}, section {claim.section!r}: the evidence ({', '.join(sources)}) gives "
                f"{expected!r}, which the section does not say"
            )
    return differences


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def differences(pages: tuple[Path, ...] = PAGES) -> list[str]:
    """Everything that differs between the pages and their evidence, and every generated table no page holds."""
    found, names = [], set()
    for path in pages:
        text = path.read_text()
        names |= {match["name"] for match in MARKED.finditer(text)}
        found += table_differences(relative(path), text) + claim_differences(relative(path), text)
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
