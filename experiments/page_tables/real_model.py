"""The tables of docs/real-model.md on the real model's task and the README's run, and the whole-vocabulary table it
shares with docs/off-policy.md, from experiments/evidence/real-model/."""

from __future__ import annotations

from experiments.page_tables.evidence import evidence, table


CANDIDATE_LABELS = {
    "word_problems_2_shot": "**word problems, two worked examples (shipped)**",
    "word_problems_0_shot": "word problems, no worked example",
    "word_problems_0_shot_no_instruction": 'word problems, no example, no "Answer with the number."',
    "plain_questions": '"What is 7 plus 5?" in 5 phrasings, numbers 1-12',
    "gsm8k": "GSM8K test questions",
}


def candidates_table() -> str:
    """The base model's sampled pass@1 on each candidate task (`experiments.real_task_candidates`)."""
    columns = {
        "candidate": "{label}",
        "questions x samples": "{questions} x {samples}",
        "top_k": lambda row: str(row["top_k"] or "none"),
        "sampled pass@1": "{pass@1:.3f} ± {pass@1_se:.3f}",
        "questions with 0 < p < 1": "{questions_0<p<1:.2f}",
        "mean tokens": "{mean_tokens:.0f} (budget {max_new_tokens})",
        "cut at the budget": "{truncated:.2f}",
    }
    files = {label: evidence(f"real-model/candidates-{name}") for name, label in CANDIDATE_LABELS.items()}
    return table(columns, [{**data, **row, "label": label} for label, data in files.items() for row in data["results"]])


def whole_vocabulary_table() -> str:
    """π/μ scored over the whole vocabulary under μ's truncation (`experiments.whole_vocabulary_ratio`)."""
    columns = {
        "mu samples with": lambda row: f"top_k {row['top_k']}" if "top_k" in row else f"top_p {row['top_p']}",
        "sequences": "{sequences}",
        "mean tokens": "{mean_tokens:.0f}",
        "pi/mu on the whole vocabulary: median": "{ratio_median:.3f}",
        "10th-90th percentile": "{ratio_p10:.3f}-{ratio_p90:.3f}",
        "min": "{ratio_min:.3f}",
        "per-token kept mass (geometric mean)": "{per_token_kept_mass_mean:.4f}",
    }
    return table(columns, evidence("real-model/whole-vocabulary-ratio")["results"])


README_RUNS = ("real-model/readme-run", "real-model/readme-run-avx512")
"""The README's real-model command, each timed from a fresh clone on its own host: the first gives the table, and every
other must print the same figures (the same seed; what the host changes is the time)."""


def held_out_table(data: dict) -> str:
    """The held-out figures before and after training that one host's run printed."""
    columns = {
        "held-out (48 test problems)": "{when}",
        "sampled pass@1 (temperature 1, 4 samples)": "{pass@1:.3f} ± {pass@1_problem_se:.3f}",
        "greedy accuracy": "{greedy_accuracy:.3f}",
        "mean completion tokens": "{mean_completion_tokens:.0f}",
        "cut at 64 tokens": "{truncated_rate:.2f}",
    }
    return table(columns, [{**data[when], "when": when} for when in ("before", "after")])


def readme_runs() -> list[dict]:
    """The timed runs of the README's real-model command; raises where a host printed other figures than the first."""
    runs = [evidence(name) for name in README_RUNS]
    for name, run in zip(README_RUNS[1:], runs[1:], strict=True):
        if held_out_table(run) != held_out_table(runs[0]):
            raise ValueError(f"{name} printed other held-out figures than {README_RUNS[0]}: give it its own table")
    return runs


def readme_run_table() -> str:
    runs = readme_runs()
    timings = "; ".join(
        f"on an {run['machine']['cpu']} ({run['machine']['cpu_capability']}), {run['wall_clock_s'] / 60:.0f} min "
        f"wall clock and {run['max_rss_kb'] / 2**20:.1f} GiB peak memory, the install {run['install_s']} s and the "
        f"GGUF conversion {run['conversion_s']} s (inside the run's time)"
        for run in runs
    )
    conditions = runs[0]["conditions"]
    return (
        f"{held_out_table(runs[0])}\n\n{runs[0]['steps']} steps, the same figures on every host; {timings}. "
        f"{conditions[0].upper()}{conditions[1:]}."
    )


TABLES = {
    "candidates": candidates_table,
    "whole-vocabulary": whole_vocabulary_table,
    "readme-run": readme_run_table,
}
