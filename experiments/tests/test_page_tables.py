"""The pages' tables against their evidence files (`experiments.page_tables`): every generated table of the README,
experiments/README.md, experiments/benchmarks.md, docs/real-model.md and docs/off-policy.md as the page holds it, and
no number written by hand in the prose of the checked pages. Reads JSON and text only.

And the check itself: a number edited by hand in a table, a table written by hand, or a measured number typed into a
checked page's prose is reported."""

from __future__ import annotations

import re

import pytest

from experiments.page_tables import (
    PAGES,
    ROOT,
    TABLES,
    differences,
    marked,
    prose_differences,
    section,
    table_differences,
)


def test_every_page_says_what_its_evidence_files_give():
    """A number edited by hand, or an evidence file changed without regenerating, fails here with the lines that
    differ (tables: `python -m experiments.page_tables --write`; a number typed into prose: move it into a table)."""
    found = differences()
    assert not found, "\n\n".join(found)


def test_every_generated_table_is_on_a_page():
    texts = [page.read_text() for page in PAGES]
    for name in TABLES:
        assert any(f"<!-- table:{name} (" in text for text in texts), name


def altered(text: str) -> str:
    """`text` with its last digit changed (a number misquoted by one in its last place)."""
    index = max(match.start() for match in re.finditer(r"\d", text))
    return text[:index] + str((int(text[index]) + 1) % 10) + text[index + 1 :]


@pytest.mark.parametrize("name", ["sample-efficiency", "figure7", "async-speed", "loss-speed"])
def test_a_number_edited_in_a_table_is_reported(name):
    page = next(page for page in PAGES if f"<!-- table:{name} (" in page.read_text())
    text = page.read_text()
    body = TABLES[name]()
    assert marked(name, body) in text
    found = table_differences("page", text.replace(marked(name, body), marked(name, altered(body))))
    assert len(found) == 1 and f"table {name!r} differs" in found[0], found


def test_a_hand_written_table_on_a_checked_page_is_reported():
    text = (ROOT / "experiments/README.md").read_text() + "\n| setting | pass@1 |\n|---|---|\n| TOPR | 0.950 |\n"
    found = prose_differences("experiments/README.md", text)
    assert len(found) == 1 and "written by hand" in found[0], found


@pytest.mark.parametrize(
    "page, sentence",
    [
        ("experiments/README.md", "TOPR ended at 0.950 on the held-out problems."),
        ("experiments/benchmarks.md", "TOPR's step cost 1.000x of GRPO's."),
        ("README.md", "TOPR is ahead by +0.15 ± 0.03."),
    ],
)
def test_a_measured_number_typed_into_a_checked_pages_prose_is_reported(page, sentence):
    text = (ROOT / page).read_text()
    assert not prose_differences(page, text)
    if page == "README.md":  # the README's check covers its "What to expect"
        where = section(text, "What to expect")
        text = text.replace(where, where + "\n" + sentence + "\n")
    else:
        text += "\n" + sentence + "\n"
    found = prose_differences(page, text)
    assert len(found) == 1 and sentence[:40] in found[0], found


def test_numbers_in_code_blocks_tables_and_unchecked_sections_are_not_prose():
    text = (
        "## What to expect\n```bash\nrun --lr 0.0001\n```\n"
        + marked("findings", "| 0.950 |\n|---|")
        + "\n## Other\n0.950\n"
    )
    assert prose_differences("README.md", text) == []


def test_a_marker_without_a_generator_is_reported():
    found = table_differences("page", marked("no-such-table", "| a |\n|---|"))
    assert len(found) == 1 and "no generator" in found[0], found


def test_section_reads_up_to_the_next_heading_of_its_level():
    text = "# Page\n\n## One\nfirst\n### Inner\ninner\n## Two\nsecond\n"
    assert section(text, "One") == "first\n### Inner\ninner"
    assert section(text, "Inner") == "inner"
    with pytest.raises(KeyError):
        section(text, "Three")


def test_a_comment_in_a_code_block_is_not_a_heading():
    text = "## One\nbefore\n```bash\n# a shell comment\nrun\n```\nafter\n## Two\nsecond"
    assert section(text, "One") == "before\n```bash\n# a shell comment\nrun\n```\nafter"
    with pytest.raises(KeyError):
        section(text, "a shell comment")


def test_the_earlier_real_model_row_pairs_each_seed_across_the_two_rates():
    """The findings row on the earlier real-model runs pairs TOPR at its own rate with each method at the method's own
    rate, which no summary does: each seed's difference is TOPR's late pass@1 in the summary of TOPR's rate minus the
    method's in the summary of its own rate (`real_model_comparison --summarise --learning_rate L`), computed here
    from those files instead of the runs."""
    from experiments.page_tables import findings
    from experiments.page_tables.evidence import evidence

    def late_by_seed(learning_rate: float, method: str) -> dict[int, float]:
        summary = evidence(f"{findings.EARLIER}_off_policy-lr{learning_rate:g}")
        return dict(zip(summary["seeds"], summary["late"][method]["pass@1"]["values"], strict=True))

    topr = late_by_seed(findings.chosen_learning_rate("off_policy"), "topr")
    for method in ("ppo", "tis"):
        own = late_by_seed(findings.chosen_learning_rate("off_policy", method), method)
        difference = findings.earlier_off_policy(method)
        seeds = sorted(set(topr) & set(own))
        assert difference["seeds"] == seeds and len(seeds) > 1
        assert difference["values"] == pytest.approx([topr[seed] - own[seed] for seed in seeds], abs=1e-12)


def test_a_method_has_its_own_rate_only_where_it_ran_at_the_comparisons_rate_too(monkeypatch):
    from experiments.page_tables import findings

    def run(method: str, learning_rate: float, late: float) -> dict:
        curve = [{"step": 0, "pass@1": 0.25}, {"step": 32, "pass@1": late}]
        return {"part": "online", "method": method, "options": {"learning_rate": learning_rate}, "curve": curve}

    runs = [run("topr", 3e-5, 0.7), run("topr", 1e-4, 0.1), run("grpo", 1e-5, 0.9)]
    monkeypatch.setattr(findings, "validation_runs", lambda: runs)
    assert findings.comparison_learning_rate("online") == 3e-5
    assert findings.chosen_learning_rate("online") == 3e-5
    assert findings.chosen_learning_rate("online", "grpo") == 3e-5  # one rate, not the comparison's: nothing chosen
    assert findings.chosen_learning_rate("online", "sft_positives") == 3e-5  # no run of its own
    runs.append(run("grpo", 3e-5, 0.2))
    assert findings.chosen_learning_rate("online", "grpo") == 1e-5
    # A rate run on a second seed is judged on the mean of both: 0.95 beats 1e-5's 0.9, but (0.2 + 0.95) / 2 does not.
    runs.append(run("grpo", 3e-5, 0.95))
    assert findings.validation_scores("online", "grpo") == pytest.approx({1e-5: 0.9, 3e-5: 0.575}, abs=1e-12)
    assert findings.chosen_learning_rate("online", "grpo") == 1e-5
    runs.append(run("grpo", 1e-5, 0.1))  # a second seed at 1e-5 brings its mean to 0.5, below 3e-5's 0.575
    assert findings.chosen_learning_rate("online", "grpo") == 3e-5
    # A rate TOPR tried after the comparison is TOPR's own choice when it wins, never the comparison's rate.
    runs.append(run("topr", 1e-5, 0.75))
    assert findings.comparison_learning_rate("online") == 3e-5
    assert findings.chosen_learning_rate("online") == 1e-5
    runs[:] = [run("topr", 1e-5, 0.75)]
    with pytest.raises(KeyError, match="pre-registered"):
        findings.comparison_learning_rate("online")


def test_a_host_whose_readme_run_printed_other_figures_is_reported(monkeypatch):
    """The README's real-model run is timed on several hosts and the page shows one table for all: a host whose
    held-out figures differ raises instead of being timed under figures it did not print."""
    import copy

    from experiments.page_tables import real_model

    first, second = (real_model.evidence(name) for name in real_model.README_RUNS)
    assert real_model.readme_runs() == [first, second]
    changed = copy.deepcopy(second)
    changed["after"]["greedy_accuracy"] += 1 / 48  # one more problem right: 0.417 -> 0.438
    monkeypatch.setattr(real_model, "evidence", lambda name: changed if name == real_model.README_RUNS[1] else first)
    with pytest.raises(ValueError, match="readme-run-avx512 printed other held-out figures"):
        real_model.readme_runs()
