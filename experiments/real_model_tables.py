"""The tables of docs/real-model.md (and docs/off-policy.md's whole-vocabulary table), generated from the evidence files under docs/evidence/real-model/ (so that the page's
numbers cannot drift from its data; tests/test_real_model.py checks the page holds them).

    python -m experiments.real_model_tables          # prints the tables
    python -m experiments.real_model_tables --write  # writes them into the pages (PAGES) between their markers
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "docs" / "evidence" / "real-model"
PAGES = (ROOT / "docs" / "real-model.md", ROOT / "docs" / "off-policy.md")
"""The pages that hold these tables (each table where the page has its markers)."""

CANDIDATE_LABELS = {
    "word_problems_2_shot": "**word problems, two worked examples (shipped)**",
    "word_problems_0_shot": "word problems, no worked example",
    "word_problems_0_shot_no_instruction": "word problems, no example, no \"Answer with the number.\"",
    "plain_questions": "\"What is 7 plus 5?\" in 5 phrasings, numbers 1-12",
    "gsm8k": "GSM8K test questions",
}


def markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + \
        ["| " + " | ".join(row) + " |" for row in rows]


def candidates_table() -> str:
    rows = []
    for name, label in CANDIDATE_LABELS.items():
        path = EVIDENCE / f"candidates-{name}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        for row in data["results"]:
            rows.append([label, f"{data['questions']} x {data['samples']}", str(row["top_k"] or "none"),
                         f"{row['pass@1']:.3f} ± {row['pass@1_se']:.3f}", f"{row['questions_0<p<1']:.2f}",
                         f"{row['mean_tokens']:.0f} (budget {data['max_new_tokens']})", f"{row['truncated']:.2f}"])
    return "\n".join(markdown_table(["candidate", "questions x samples", "top_k", "sampled pass@1",
                                      "questions with 0 < p < 1", "mean tokens", "cut at the budget"], rows))


def whole_vocabulary_table() -> str:
    data = json.loads((EVIDENCE / "whole-vocabulary-ratio.json").read_text())
    rows = [[f"top_k {row['top_k']}" if "top_k" in row else f"top_p {row['top_p']}", str(row["sequences"]),
             f"{row['mean_tokens']:.0f}", f"{row['ratio_median']:.3f}", f"{row['ratio_p10']:.3f}-{row['ratio_p90']:.3f}",
             f"{row['ratio_min']:.3f}", f"{row['per_token_kept_mass_mean']:.4f}"] for row in data["results"]]
    return "\n".join(markdown_table(["mu samples with", "sequences", "mean tokens",
                                      "pi/mu on the whole vocabulary: median", "10th-90th percentile", "min",
                                      "per-token kept mass (geometric mean)"], rows))


def readme_run_table() -> str:
    data = json.loads((EVIDENCE / "readme-run.json").read_text())
    rows = [[when, f"{data[when]['pass@1']:.3f} ± {data[when]['pass@1_problem_se']:.3f}",
             f"{data[when]['greedy_accuracy']:.3f}", f"{data[when]['mean_completion_tokens']:.0f}",
             f"{data[when]['truncated_rate']:.2f}"] for when in ("before", "after")]
    lines = markdown_table(["held-out (48 test problems)", "sampled pass@1 (temperature 1, 4 samples)",
                            "greedy accuracy", "mean completion tokens", "cut at 64 tokens"], rows)
    lines.append(f"\n{data['steps']} steps; {data['wall_clock_s'] / 60:.0f} min wall clock, "
                 f"{data['max_rss_kb'] / 2**20:.1f} GiB peak memory; {data['conditions']}.")
    return "\n".join(lines)


TABLES = {"candidates": candidates_table, "whole-vocabulary": whole_vocabulary_table, "readme-run": readme_run_table}


def marked(name: str, table: str) -> str:
    return f"<!-- table:{name} (python -m experiments.real_model_tables --write) -->\n{table}\n<!-- /table:{name} -->"


def write_page(page: Path) -> None:
    text = page.read_text()
    for name, make in TABLES.items():
        pattern = re.compile(rf"<!-- table:{re.escape(name)} .*?<!-- /table:{re.escape(name)} -->", re.S)
        text = pattern.sub(lambda _, n=name, m=make: marked(n, m()), text)
    page.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.write:
        for page in PAGES:
            write_page(page)
    else:
        for name, make in TABLES.items():
            print(marked(name, make()), end="\n\n")


if __name__ == "__main__":
    main()
