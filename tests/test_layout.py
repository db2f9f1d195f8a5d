"""The package's floors, as the README's layout says them: what a TRL user imports never imports the command layer
(the commands, their argument parsing, the built-in tasks, the iterations that drive generation and the trainer in
turn), the offline and evaluation modules stay below the trainers, and the asynchronous trainer takes what it shares
with `TOPRTrainer` from `training.shared`. Imports inside functions count: a lazy import is still an import."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest


PACKAGE = Path(__file__).resolve().parents[1] / "topr_trl"
COMMAND_LAYER = ("topr_trl.commands", "topr_trl.tasks", "topr_trl.__main__")
# (the modules a rule constrains, the modules they must not import, why)
RULES = [
    (
        lambda module: not module.startswith(COMMAND_LAYER) and module != "topr_trl",
        COMMAND_LAYER,
        "the library imports nothing from the command layer",
    ),
    (
        lambda module: module.startswith(("topr_trl.offline", "topr_trl.evaluation")),
        ("topr_trl.trainer", "topr_trl.asynchronous"),
        "offline/ and evaluation/ stay below the trainers",
    ),
    (
        lambda module: module.startswith("topr_trl.asynchronous"),
        ("topr_trl.trainer",),
        "the asynchronous trainer shares code with TOPRTrainer through training/shared.py, not by importing it",
    ),
]


def module_name(path: Path) -> str:
    parts = list(path.with_suffix("").relative_to(PACKAGE.parent).parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every topr_trl module `source` (the code of `module`) imports, relative imports resolved, each imported name
    also as `package.name` (a name may be a submodule)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            targets |= {target, *(f"{target}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
    return {target for target in targets if target.startswith("topr_trl")}


def within(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target == prefix or target.startswith(prefix + ".") for prefix in prefixes)


def test_the_import_reader_sees_a_lazy_relative_import_upward():
    source = "def f():\n    from ..trainer import TOPRTrainer\n"
    assert "topr_trl.trainer" in imported(source, "topr_trl.offline.replay")
    assert "topr_trl.trainer.TOPRTrainer" in imported(source, "topr_trl.offline.replay")
    assert imported("from .schema import x\n", "topr_trl.offline", is_package=True) >= {"topr_trl.offline.schema"}


@pytest.mark.parametrize("applies, forbidden, why", RULES, ids=[rule[2] for rule in RULES])
def test_no_module_imports_above_its_floor(applies, forbidden, why):
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if applies(module):
            upward = sorted(
                t for t in imported(path.read_text(), module, path.name == "__init__.py") if within(t, forbidden)
            )
            violations += [f"{module} -> {target}" for target in upward]
    assert not violations, f"{why}: {violations}"


MOST_LOOSE_MODULES = 8
"""The top level shows the architecture: the core's modules and one package per concern, not a heap of modules."""


def top_level() -> set[str]:
    """The package's top-level modules (`name.py`, the package's own `__init__` and `__main__` aside) and packages
    (`name/`)."""
    modules = {path.name for path in PACKAGE.glob("*.py") if path.stem not in ("__init__", "__main__")}
    packages = {f"{path.name}/" for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    return modules | packages


def test_the_top_level_has_few_loose_modules():
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(loose) <= MOST_LOOSE_MODULES, loose


def test_the_layout_page_names_the_top_level_as_it_is():
    page = (PACKAGE.parent / "docs" / "layout.md").read_text()
    tree = page[page.index("```\ntopr_trl/\n") :].split("```")[1]
    # the top level is indented by two spaces; a line names its entries before its description
    in_page = set()
    for line in tree.splitlines():
        if re.match(r"^  \S", line):
            in_page |= set(itertools.takewhile(lambda word: word.endswith((".py", "/")), line.split()))
    assert in_page == top_level(), sorted(in_page ^ top_level())


def test_the_library_never_imports_the_lab():
    """experiments/ is the lab: its scripts import the library, never the other way, lazily or not."""
    importers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(name == "experiments" or name.startswith("experiments.") for name in names):
                importers.append(module_name(path))
    assert not importers, f"the library imports the lab: {importers}"


def test_the_wheel_holds_the_library_alone(tmp_path):
    """What `pip install` puts in site-packages: topr_trl and its metadata, none of the lab, tests or pages."""
    import shutil
    import subprocess
    import sys
    import zipfile

    # built from a copy of the sources beside the lab and the tests, so that the build leaves the checkout alone
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(PACKAGE.parent / name, source / name)
    for name in ("topr_trl", "experiments", "tests"):
        shutil.copytree(PACKAGE.parent / name, source / name, ignore=shutil.ignore_patterns("evidence", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("topr_trl-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"topr_trl"}, sorted(tops)


def test_importing_the_package_loads_neither_the_gloo_client_nor_the_gguf_converter():
    """`import topr_trl` (what every user pays) loads what training needs, not the optional paths: the gloo server
    client loads only in server mode, the GGUF converter only when a file is converted."""
    import subprocess
    import sys

    probe = "import sys, topr_trl; print(','.join(m for m in sys.modules if m.startswith('topr_trl')))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    modules = set(loaded.strip().split(","))
    assert "topr_trl.trainer" in modules  # the probe imported the package
    assert "topr_trl.generation.vllm_server.client" not in modules
    assert "topr_trl.inputs.gguf_conversion" not in modules


def test_trls_experimental_api_is_imported_in_one_module():
    """Every import of `trl.experimental` (absolute, or by a string importlib reads) sits in
    `topr_trl/asynchronous/trl_async.py`: a TRL release that moves the asynchronous trainer is a one-file change."""
    importers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
                names = [node.value]
            if any(name.startswith("trl.experimental") for name in names):
                importers.add(path.relative_to(PACKAGE).as_posix())
    assert importers == {"asynchronous/trl_async.py"}


def test_the_package_draws_text_bars_where_a_notebook_bar_cannot_draw():
    """tqdm.auto in a notebook without ipywidgets warns "IProgress not found" before falling back to text; the
    package's own bars (generation, evaluation) take the text bar there, and the notebook bar with ipywidgets."""
    import importlib.util

    import tqdm.std

    from topr_trl.runtime.noise import progress_bar_class

    if importlib.util.find_spec("ipywidgets") is None:
        assert progress_bar_class() is tqdm.std.tqdm
    else:
        import tqdm.auto

        assert progress_bar_class() is tqdm.auto.tqdm


def test_a_trainer_reads_through_at_most_two_mixins():
    """A TOPR step reads in the trainer and the few classes it names: each trainer mixes in at most two classes of
    this package above TRL's (what both trainers share are plain functions in `training.shared`)."""
    from trl import GRPOTrainer

    from topr_trl import TOPRTrainer
    from topr_trl.asynchronous import AsyncTOPRTrainer
    from topr_trl.asynchronous.trl_async import AsyncGRPOTrainer

    for trainer, trls in ((TOPRTrainer, GRPOTrainer), (AsyncTOPRTrainer, AsyncGRPOTrainer)):
        ours = [base for base in trainer.__mro__[1:] if base.__module__.startswith("topr_trl") and base is not trls]
        assert len(ours) <= 2, f"{trainer.__name__} mixes in {[base.__name__ for base in ours]}"


def test_no_library_function_runs_over_80_lines():
    """Short pieces: no function or method of the library is longer than 80 lines, its docstring included."""
    long = [
        f"{path.relative_to(PACKAGE).as_posix()}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long


def test_the_readme_stays_short():
    """The README is the front page, at most 200 lines; its "What to expect" at most 20 (a generated table and a
    link to the lab's page)."""
    lines = (PACKAGE.parent / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    start = lines.index("## What to expect")
    end = next(index for index in range(start + 1, len(lines)) if lines[index].startswith("## "))
    assert end - start - 1 <= 20
