"""docs/copies.md lists every copy of TRL code in the package and the test that holds each to TRL's original, and every
seam where TRL leaves no public way with the test that fails first: every `MIRROR` and `SEAM` label in the package has
its row in its table (the labelled function, its class, or its module named there), and every test a row names
exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "copies.md"


SEAMS_HEADING = "## Seams"


def rows(label: str = "MIRROR") -> dict[str, tuple[str, str]]:
    """file -> (the copy's or seam's cell, the holding tests' cell), from the page's table for `label`: the copies
    before the "Seams" heading, the seams after it."""
    copies, _, seams = PAGE.read_text().partition(SEAMS_HEADING)
    table = {}
    for line in (copies if label == "MIRROR" else seams).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`topr_trl/"):
            table[re.match(r"`(topr_trl/[\w/]+\.py)`", cells[0]).group(1)] = (cells[0], cells[2])
    return table


def mirror_labels(path: Path, word: str = "MIRROR") -> list[str]:
    """The names a `MIRROR` (or other `word`) label in `path` covers: "<module>" for the module docstring, else the function or class
    whose docstring carries it, or for a comment carrying it the function it is in, else the definition right after
    it (a method as Class.name)."""
    source = path.read_text()
    tree = ast.parse(source)
    labels = []
    if word in (ast.get_docstring(tree) or ""):
        labels.append("<module>")
    definitions = []  # (first line, name, docstring, last line, is a function) of every function and class
    for parent in ast.walk(tree):
        body = getattr(parent, "body", None)
        for node in body if isinstance(body, list) else ():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{parent.name}.{node.name}" if isinstance(parent, ast.ClassDef) else node.name
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                definitions.append(
                    (first, name, ast.get_docstring(node) or "", node.end_lineno, not isinstance(node, ast.ClassDef))
                )
    definitions.sort()
    labels += [name for _, name, docstring, *_ in definitions if word in docstring]
    for number, line in enumerate(source.splitlines(), 1):
        if line.strip().startswith("#") and word in line:
            inside = [
                (first, name) for first, name, _, last, function in definitions if function and first < number <= last
            ]
            labels.append(max(inside)[1] if inside else next(name for first, name, *_ in definitions if first > number))
    return labels


@pytest.mark.parametrize(("word", "at_least"), [("MIRROR", 6), ("SEAM", 5)])
def test_every_label_has_its_row(word, at_least):
    table = rows(word)
    missing = []
    for path in sorted((ROOT / "topr_trl").rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        for label in mirror_labels(path, word):
            cell = table.get(relative, ("", ""))[0]
            names = label.split(".")
            if label == "<module>" and relative in table:
                continue
            if not any(f"`{name}`" in cell for name in [label, *names]):
                missing.append(f"{relative}: {label}")
    assert not missing, f"{word} labels without a row in docs/copies.md: {missing}"
    assert len(table) >= at_least


def test_every_holding_test_exists():
    absent = []
    for _, held_by in [*rows("MIRROR").values(), *rows("SEAM").values()]:
        for file, name in re.findall(r"`(tests/\w+\.py)::(\w+)`", held_by):
            defined = {
                node.name
                for node in ast.walk(ast.parse((ROOT / file).read_text()))
                if isinstance(node, ast.FunctionDef)
            }
            if name not in defined:
                absent.append(f"{file}::{name}")
        assert re.search(r"`tests/\w+\.py::\w+`", held_by), held_by
    assert not absent, f"docs/copies.md names tests that do not exist: {absent}"


def test_the_label_reader_finds_each_kind_of_label(tmp_path):
    source = (
        '"""MIRROR of a module."""\n\n\ndef f():\n    """MIRROR of f."""\n\n\nclass C:\n'
        "    # ---- MIRROR of a method\n    def g(self):\n        pass\n\n    def h(self):\n        pass\n\n"
        "def k():\n    # MIRROR of what k hands TRL\n    return 1\n"
    )
    (tmp_path / "m.py").write_text(source)
    assert mirror_labels(tmp_path / "m.py") == ["<module>", "f", "C.g", "k"]
