"""The tables of experiments/README.md, each from the evidence files its section names (experiments/evidence/<claim>/).

Each function returns one table as the page lays it out; the layout (labels, columns, emphasis) is the page's, every
number is read from the JSON each experiment script writes (`summary`, `late`, `paired`: see each script's docstring)
and rounded once, by the formats of `evidence.py`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from experiments.common import paired_difference
from experiments.page_tables.evidence import (
    bold,
    evidence,
    fixed,
    interval,
    markdown_table,
    negated,
    per_seed,
    signed,
    signed_interval,
    signed_per_seed,
)


# --- how the pages annotate a paired difference ------------------------------------------------------------------


def above(statistic: dict) -> int:
    return sum(value > 0 for value in statistic["values"])


def below(statistic: dict) -> int:
    return sum(value < 0 for value in statistic["values"])


def every_or_count(statistic: dict, every: str = "every seed", count: str = "{above} of {seeds}") -> str:
    """ "every seed" when every seed's difference has the mean's sign, else how many lie above 0 ("4 of 5")."""
    agreeing = above(statistic) if statistic["mean"] > 0 else below(statistic)
    if agreeing == len(statistic["values"]):
        return every
    return count.format(above=above(statistic), below=below(statistic), seeds=len(statistic["values"]))


def described(statistic: dict, every: str = "", some: str = "", emphasised: bool = False) -> str:
    """A paired difference with the page's note after it: `every` when every seed has the mean's sign, else `some`
    (formatted with the seeds above and below 0)."""
    agreeing = above(statistic) if statistic["mean"] > 0 else below(statistic)
    note = every if agreeing == len(statistic["values"]) else some
    return bold(signed_interval(statistic), emphasised) + note.format(
        above=above(statistic), below=below(statistic), seeds=len(statistic["values"])
    )


def decided(statistic: dict) -> bool:
    """Whether a paired difference's 95 % interval excludes 0 (the pages' rule for a decided comparison)."""
    return abs(statistic["mean"]) > statistic["ci95"]


def noted(text: str, note: str) -> str:
    return f"{text} ({note})" if note else text


def thousands(value: float) -> str:
    return f"{value:,.0f}"


def base_pass_at_1(name: str, method: str | None = None) -> list[float]:
    """Each seed's base model pass@1 in a Figure 1-style file: the step-0 checkpoint of that seed's run of `method`
    (the first method when None); with a draw per seed, every seed has its own."""
    runs = evidence(name)["runs"]
    method = method or evidence(name)["options"]["methods"][0]
    return [run["curve"][0]["pass@1"] for key, run in runs.items() if key.startswith(f"{method}/")]


# --- sample efficiency (experiments/sample_efficiency.py: summary[method]) ----------------------------------------

SAMPLE_EFFICIENCY = "sample_efficiency/sample_efficiency"


def validation_rates(name: str, methods: list[str], rates: list[str]) -> list[list[str]]:
    """Late pass@1 on the validation split by learning rate (one file per rate, `NAME{rate}`); the chosen rate (the
    highest mean over the methods) in bold. A cell whose rounding hides how close it is to the chosen rate's says by
    how much it differs."""
    late = {
        rate: {method: evidence(f"{name}{rate}")["summary"][method]["late_pass@1"] for method in methods}
        for rate in rates
    }
    chosen = max(rates, key=lambda rate: statistics.mean(late[rate][method]["mean"] for method in methods))
    rows = []
    for rate in rates:
        cells = []
        for method in methods:
            cell = interval(late[rate][method])
            best = late[chosen][method]["mean"]
            if rate != chosen and fixed(late[rate][method]["mean"]) == fixed(best):
                gap = best - late[rate][method]["mean"]
                cell += f" ({abs(gap):.4f} {'below' if gap > 0 else 'above'} {chosen})"
            cells.append(bold(cell, rate == chosen))
        rows.append([bold(rate, rate == chosen), *cells])
    return rows


def sample_efficiency_learning_rate() -> str:
    rows = validation_rates(
        "sample_efficiency/val_lr", ["grpo", "topr_online", "topr_offline_k4"], ["3e-5", "1e-4", "3e-4", "1e-3"]
    )
    return markdown_table(["learning rate", "online GRPO", "online TOPR", "offline TOPR, 4 passes"], rows)


SAMPLE_EFFICIENCY_METHODS = {
    # method: (label, emphasised)
    "grpo": ("online GRPO (TRL's default loss, `dapo`)", False),
    "topr_online": ("online TOPR", False),
    "topr_offline_k1": ("offline TOPR, 1 pass (fewer steps)", False),
    "topr_offline_k2": ("offline TOPR, 2 passes (fewer steps)", False),
    "topr_offline_k4": ("offline TOPR, 4 passes", True),
    "topr_iterated": ("iterated TOPR, 4 x 32 prompts, 1 pass each (fewer steps)", False),
    "sft_offline_k4": ("control: SFT on positives, 4 passes", False),
    "ppo_offline_k4": ("control: PPO-clip, 4 passes", False),
}


def sample_efficiency() -> str:
    summary = evidence(SAMPLE_EFFICIENCY)["summary"]
    rows = []
    for method, (label, emphasised) in SAMPLE_EFFICIENCY_METHODS.items():
        result = summary[method]
        paired = result["late_minus_grpo"]
        rows.append(
            [
                bold(label, emphasised),
                bold(thousands(result["completions_total"]["mean"]), emphasised),
                f"{result['steps']['mean']:.0f}",
                bold(interval(result["late_pass@1"]), emphasised),
                per_seed(result["late_pass@1"]["values"]),
                bold(signed_interval(paired), emphasised) if paired else "",
            ]
        )
    return markdown_table(
        ["method", "generated completions", "optimizer steps", "late pass@1", "per seed", "− online GRPO (paired)"],
        rows,
    )


HARDER_METHODS = {
    "grpo": "online GRPO",
    "topr_online": "online TOPR",
    "topr_offline_k4": "offline TOPR, 4 passes",
    "sft_offline_k4": "control: SFT on positives, 4 passes",
    "ppo_offline_k4": "control: PPO-clip, 4 passes",
}


def harder_sample_efficiency(
    name: str,
    against_topr: bool,
    notes: dict[str, tuple[str, str]] | None = None,
    emphasis: dict[str, tuple[bool, bool]] | None = None,
    grpo_against_topr: bool = False,
) -> str:
    """The harder settings' sample efficiency: every method against online GRPO and, with `against_topr`, offline
    TOPR against each reuse control (and against online GRPO with `grpo_against_topr`). `notes` maps a method to
    the annotations of its two paired cells (see `annotation`), `emphasis` to which of the two is in bold."""
    summary = evidence(name)["summary"]
    notes, emphasis = notes or {}, emphasis or {}
    rows = []
    for method, label in HARDER_METHODS.items():
        result = summary[method]
        note_grpo, note_topr = notes.get(method, ("", ""))
        bold_grpo, bold_topr = emphasis.get(method, (False, False))
        against_grpo = result["late_minus_grpo"]
        cells = [
            label,
            thousands(result["completions_total"]["mean"]),
            interval(result["late_pass@1"]),
            per_seed(result["late_pass@1"]["values"]),
            noted(bold(signed_interval(against_grpo), bold_grpo), annotation(against_grpo, note_grpo))
            if against_grpo
            else "",
        ]
        if against_topr:
            topr = result["topr_minus_this"]
            if method == "grpo" and grpo_against_topr:
                topr = summary["topr_offline_k4"]["late_minus_grpo"]
            cells.append(noted(bold(signed_interval(topr), bold_topr), annotation(topr, note_topr)) if topr else "")
        rows.append(cells)
    headers = ["method", "completions", "late pass@1", "per seed", "− online GRPO (paired)"]
    return markdown_table(headers + (["offline TOPR − this (paired)"] if against_topr else []), rows)


def annotation(statistic: dict, style: str) -> str:
    """A paired cell's note in parentheses, by `style`: "" none; "every": "every seed" when every seed agrees with
    the mean's sign, else how many lie above 0; "every below": the same counted below 0; otherwise a format of the
    count ("{above} of {seeds} above 0"), "every seed" when every seed agrees."""
    if not style:
        return ""
    if style == "every":
        return every_or_count(statistic)
    if style == "every below":
        return every_or_count(statistic, every="every seed below", count="{below} of {seeds} below")
    return every_or_count(statistic, count=style)


def d4_sample_efficiency() -> str:
    return harder_sample_efficiency("harder/d4_sample_efficiency", against_topr=False)


def d4_sample_efficiency_draw_per_seed() -> str:
    return harder_sample_efficiency(
        "harder/d4_sample_efficiency_draw_per_seed",
        against_topr=True,
        notes={"sft_offline_k4": ("", "every below"), "ppo_offline_k4": ("", "every")},
        emphasis={"ppo_offline_k4": (False, True)},
    )


def d5_sample_efficiency() -> str:
    return harder_sample_efficiency(
        "harder/d5_sample_efficiency",
        against_topr=True,
        grpo_against_topr=True,
        emphasis={"ppo_offline_k4": (False, True)},
    )


def d5_sample_efficiency_draw_per_seed() -> str:
    return harder_sample_efficiency(
        "harder/d5_sample_efficiency_draw_per_seed",
        against_topr=True,
        notes={"topr_offline_k4": ("every", ""), "sft_offline_k4": ("every", ""), "ppo_offline_k4": ("", "every")},
        emphasis={"topr_offline_k4": (True, False), "ppo_offline_k4": (False, True)},
    )


# --- Figure 1 and its variants (experiments/figure1.py: late[method][metric], paired["A-B"][metric]) -------------


def late(name: str, method: str, metric: str = "accuracy") -> dict:
    return evidence(name)["late"][method][metric]


def paired(name: str, comparison: str, metric: str = "accuracy") -> dict:
    return evidence(name)["paired"][comparison][metric]


def zeros_as_integers(values: list[float]) -> str:
    """Per-seed values, where a method whose every run ended at exactly 0 reads "0, 0, ..." (the 5-digit tables'
    layout)."""
    return ", ".join("0" for _ in values) if not any(values) else per_seed(values)


FIGURE1_LABELS = {
    "naive_reinforce": "naive REINFORCE",
    "ppo": "PPO-clip",
    "tis": "TIS",
    "sft_positives": "SFT on positives",
    "topr": "TOPR",
}


def figure1_rows(
    name: str,
    columns: list[str],
    notes: dict[str, str] | None = None,
    emphasis: dict[str, set[str]] | None = None,
    seeds_format: Callable = per_seed,
) -> list[list[str]]:
    """One row per method of a Figure 1 file, its cells by `columns`: "late" (late pass@1), "seeds", "carries"
    (≥ 2 carries, mean ± half-width), "carries mean", "greedy", "invalid", "paired" (TOPR − this). `notes` annotates a
    method's paired cell (see `annotation`); `emphasis` names the columns in bold per method ("label" included)."""
    notes, emphasis = notes or {}, emphasis or {}
    rows = []
    for method, label in FIGURE1_LABELS.items():
        emphasised = emphasis.get(method, set())
        cells = [bold(label, "label" in emphasised)]
        for column in columns:
            if column == "late":
                cell = interval(late(name, method))
            elif column == "seeds":
                cell = seeds_format(late(name, method)["values"])
            elif column == "carries":
                cell = interval(late(name, method, "pass@1_carries>=2"))
            elif column == "carries mean":
                cell = fixed(late(name, method, "pass@1_carries>=2")["mean"])
            elif column == "greedy":
                cell = fixed(late(name, method, "greedy_accuracy")["mean"])
            elif column == "invalid":
                cell = fixed(late(name, method, "invalid_rate")["mean"])
            elif column == "paired":
                if method == "topr":
                    cell = ""
                else:
                    difference = paired(name, f"topr-{method}")
                    cell = noted(
                        bold(signed_interval(difference), column in emphasised),
                        annotation(difference, notes.get(method, "")),
                    )
                    emphasised = emphasised - {column}
            else:
                raise ValueError(column)
            cells.append(bold(cell, column in emphasised))
        rows.append(cells)
    return rows


def d4_figure1() -> str:
    name = "harder/d4_figure1"
    start = fixed(statistics.mean(base_pass_at_1(name)), 2)
    return markdown_table(
        [f"method (start {start})", "late pass@1", "per seed", "TOPR − this (paired)", "invalid"],
        figure1_rows(name, ["late", "seeds", "paired", "invalid"]),
    )


def d4_figure1_draw_per_seed() -> str:
    name = "harder/d4_figure1_draw_per_seed"
    return markdown_table(
        ["method", "late pass@1", "per seed", "TOPR − this (paired)", "invalid"],
        figure1_rows(
            name,
            ["late", "seeds", "paired", "invalid"],
            notes={"ppo": "every", "tis": "{above} of {seeds}", "sft_positives": "{above} of {seeds}"},
        ),
    )


def d5_figure1() -> str:
    name = "harder/d5_figure1"
    start = fixed(statistics.mean(base_pass_at_1(name)))
    rows = figure1_rows(
        name,
        ["late", "seeds", "carries mean", "greedy", "invalid", "paired"],
        emphasis={"sft_positives": {"label", "late", "paired"}},
        seeds_format=zeros_as_integers,
    )
    return markdown_table(
        [
            f"method (start {start})",
            "late pass@1",
            "per seed",
            "≥ 2 carries",
            "greedy",
            "invalid",
            "TOPR − this (paired)",
        ],
        rows,
    )


def d5_figure1_draw_per_seed() -> str:
    name = "harder/d5_figure1_draw_per_seed"
    rows = figure1_rows(
        name,
        ["late", "seeds", "greedy", "invalid", "paired"],
        seeds_format=zeros_as_integers,
        notes={"ppo": "every", "tis": "{above} of {seeds}", "sft_positives": "{above} of {seeds}"},
    )
    return markdown_table(["method", "late pass@1", "per seed", "greedy", "invalid", "TOPR − this (paired)"], rows)


def positive_share(name: str, method: str) -> float:
    """The mean share of positives in the fixed datasets of `method`'s runs: p, and p̃ at c = 0."""
    runs = evidence(name)["runs"]
    return statistics.mean(
        run["dataset_positive_fraction"] for key, run in runs.items() if key.startswith(f"{method}/")
    )


def pooled(first: str, second: str, comparison: str, metric: str = "accuracy") -> dict:
    """A paired difference over the seeds of two files (the pre-registered seeds and their replication), pooled
    after the fact: each seed's difference as its file gives it."""

    def by_seed(name: str) -> dict[int, float]:
        if comparison in evidence(name)["paired"]:
            statistic = paired(name, comparison, metric)
            return dict(zip(statistic["seeds"], statistic["values"], strict=True))
        # a difference the file did not compare: from its late values, seed by seed
        first_method, second_method = comparison.split("-")
        seeds = evidence(name)["options"]["seeds"]
        a, b = late(name, first_method, metric)["values"], late(name, second_method, metric)["values"]
        return {seed: x - y for seed, x, y in zip(seeds, a, b, strict=True)}

    values = {**by_seed(first), **by_seed(second)}
    return paired_difference(values, dict.fromkeys(values, 0.0))


def seeds_of(name: str, comparison: str) -> dict:
    if comparison in evidence(name)["paired"]:
        return paired(name, comparison)
    return pooled(name, name, comparison)


def replication(first: str, second: str, notes: list[tuple[str, str, str]], header: str) -> str:
    """The baseline follow-up's pre-registered seeds, their replication and the two pooled."""
    rows = []
    comparisons = [
        ("TOPR (p̃ = 0.5) − SFT on positives", "topr_target-sft_positives"),
        ("TOPR (p̃ = 0.5) − TOPR (c = 0)", "topr_target-topr"),
        ("TOPR (c = 0) − SFT on positives", "topr-sft_positives"),
    ]
    for (label, comparison), cell_notes in zip(comparisons, notes, strict=True):
        cells = [label]
        for statistic, note in zip(
            (seeds_of(first, comparison), seeds_of(second, comparison), pooled(first, second, comparison)),
            cell_notes,
            strict=True,
        ):
            text = signed_interval(statistic)
            if note:
                extra = ""
                if "{carries}" in note:
                    carries = pooled(first, second, comparison, "pass@1_carries>=2")
                    extra = f"{signed_interval(carries)}, {above(carries)} of {len(carries['values'])}"
                text += (
                    " ("
                    + note.format(
                        above=above(statistic),
                        seeds=len(statistic["values"]),
                        carries=extra,
                        low=signed(statistic["mean"] - statistic["ci95"]),
                    )
                    + ")"
                )
            cells.append(text)
        rows.append(cells)
    return markdown_table(header, rows)


# --- the warm start is the CPU's (4- and 5-digit warm starts built on two CPUs) -----------------------------------


def base_points(names: list[str]) -> list[float]:
    """Every seed's base pass@1 in the files `names` (figure1-style files: each run's step 0; sample-efficiency
    files: `base`, by seed when each seed has its own draw)."""
    points = []
    for name in names:
        data = evidence(name)
        if "late" in data:
            points += [run["curve"][0]["pass@1"] for run in data["runs"].values()]
        elif "by_seed" in data["base"]:
            points += [seed["pass@1"] for seed in data["base"]["by_seed"].values()]
        else:
            points.append(data["base"]["pass@1"])
    return points


def collapsed(name: str, method: str) -> str:
    """How many of `method`'s runs ended below their start (late pass@1 under the seed's base point)."""
    bases = base_pass_at_1(name, method)
    ends = late(name, method)["values"]
    fallen = sum(end < base for end, base in zip(ends, bases, strict=True))
    return "TIS collapses" if fallen == len(ends) else f"{fallen} of {len(ends)} collapse"


# --- Figure 1 at 3 digits ----------------------------------------------------------------------------------------

FIGURE1 = "figure1/figure1"


def figure1() -> str:
    data = evidence(FIGURE1)
    rows = figure1_rows(
        FIGURE1, ["late", "seeds", "carries", "greedy", "invalid", "paired"], emphasis={"topr": {"label", "late"}}
    )
    far = "topr_far_off_policy"
    label = (
        f"TOPR, far off-policy (μ: another model, pass@1 {data['far_behaviour_start']['pass@1']:.2f}, "
        f"{100 * positive_share(FIGURE1, far):.0f} % positive data)"
    )
    rows.append(
        [
            label,
            interval(late(FIGURE1, far)),
            per_seed(late(FIGURE1, far)["values"]),
            interval(late(FIGURE1, far, "pass@1_carries>=2")),
            fixed(late(FIGURE1, far, "greedy_accuracy")["mean"]),
            fixed(late(FIGURE1, far, "invalid_rate")["mean"]),
            signed_interval(paired(FIGURE1, f"topr-{far}")),
        ]
    )
    start = fixed(statistics.mean(base_pass_at_1(FIGURE1)))
    return markdown_table(
        [
            f"method (start {start})",
            "late pass@1",
            "per seed",
            "≥ 2 carries",
            "greedy",
            "invalid",
            "TOPR − this (paired)",
        ],
        rows,
    )


def exact_ratio() -> str:
    rows = []
    for name, label in (("exact_ratio/topk5", "top_k 5"), ("exact_ratio/topp09", "top_p 0.9")):
        weight = evidence(name)["negative_weight"]
        rows.append(
            [
                label,
                f"{interval(weight['topr'])} ({per_seed(weight['topr']['values'])})",
                interval(weight["topr_whole_vocabulary"]),
                interval(late(name, "topr")),
                interval(late(name, "topr_whole_vocabulary")),
                signed_interval(paired(name, "topr-topr_whole_vocabulary")),
            ]
        )
    return markdown_table(
        [
            "μ sampled with",
            "negatives' mean weight, exact (per seed)",
            "whole vocabulary",
            "late pass@1, exact",
            "whole vocabulary",
            "exact − whole (paired)",
        ],
        rows,
    )


def figure4_d4(name: str, header: str, carries_interval: bool, carries_bold: bool, notes: tuple[str, str]) -> str:
    rows = []
    for method in ("sft_positives", "topr", "tis"):
        carries = late(name, method, "pass@1_carries>=2")
        rows.append(
            [
                FIGURE1_LABELS[method],
                interval(late(name, method)),
                interval(carries) if carries_interval else fixed(carries["mean"]),
            ]
        )
    for (comparison, label, emphasised), note in zip(
        (("topr-sft_positives", "TOPR − SFT on positives (paired)", True), ("topr-tis", "TOPR − TIS (paired)", False)),
        notes,
        strict=True,
    ):
        difference = paired(name, comparison)
        rows.append(
            [
                bold(label, emphasised),
                f"{bold(signed_interval(difference), emphasised)} "
                f"({note.format(above=above(difference), below=below(difference), seeds=len(difference['values']))})",
                bold(signed_interval(paired(name, comparison, "pass@1_carries>=2")), emphasised and carries_bold),
            ]
        )
    return markdown_table([header, "all problems", ">= 2 carries"], rows)


def figure4_d4_preregistered() -> str:
    return figure4_d4(
        "figure1/figure4_d4_preregistered",
        "late pass@1 (steps 112 and 128), 8 seeds",
        True,
        True,
        ("{above} seeds of {seeds} above 0", "{below} of {seeds} below 0"),
    )


# --- Figures 5-6 (experiments/baseline_sweep.py: late["p/pt/method"], paired["p/pt"]) ----------------------------

TARGETS = ["0.01", "0.05", "0.1", "0.2", "0.35", "0.6", "1"]


def sweep(target: str, draw: str = "") -> str:
    return f"figures5-6/baseline_sweep_{'low' if float(target) <= 0.2 else 'high'}{draw}"


def solved_baseline(name: str, key: str) -> float:
    return statistics.mean(
        run["baseline"] for label, run in evidence(name)["runs"].items() if label.startswith(f"{key}/topr/")
    )


def figures5_6() -> str:
    best = max(TARGETS, key=lambda t: evidence(sweep(t))["late"][f"p0.67/pt{t}/topr"]["mean"])
    widest = max(TARGETS[:4], key=lambda t: evidence(sweep(t))["paired"][f"p0.67/pt{t}"]["mean"])
    rows = []
    for target in TARGETS:
        data, key = evidence(sweep(target)), f"p0.67/pt{target}"
        difference = data["paired"][key]
        rows.append(
            [
                target,
                signed(solved_baseline(sweep(target), key)),
                bold(interval(data["late"][f"{key}/topr"]), target == best),
                interval(data["late"][f"{key}/tis"]),
                bold(signed_interval(difference), target == widest),
                signed_per_seed(difference["values"]),
            ]
        )
    start = fixed(evidence(sweep("0.01"))["summary"]["start_accuracy"])
    return markdown_table(
        [
            f"target p̃ (p = 0.67, start {start})",
            "baseline c",
            "TOPR, late",
            "TIS, late",
            "TOPR − TIS (paired)",
            "per seed",
        ],
        rows,
    )


# --- Figure 7 (experiments/figure7.py: summary[method]) ----------------------------------------------------------


def figure7() -> str:
    data = evidence("figure7/figure7")
    steps = [len(run["grad_norms"]) for run in data["runs"].values()]
    rows = []
    for method, label in (("untruncated_is", "untruncated IS"), ("topr", "TOPR")):
        result = data["summary"][method]
        seeds = len(result["late_accuracy"]["values"])
        rows.append(
            [
                label,
                bold(interval(result["late_accuracy"]), method == "topr"),
                per_seed(result["late_accuracy"]["values"]),
                f"{len(result['collapsed_seeds'])} of {seeds}",
                ", ".join(f"{norm:.1f}" for norm in result["max_grad_norm"]["values"]),
                ", ".join(f"{ratio:.0f}" for ratio in result["largest_negative_ratio"]),
            ]
        )
    return markdown_table(
        [
            f"{len(data['options']['seeds'])} seeds, {min(steps)}-{max(steps)} steps",
            "late pass@1",
            "per seed",
            "collapsed",
            "largest gradient norm, per seed",
            "largest negative ratio π/μ, per seed",
        ],
        rows,
    )


# --- iterations (experiments/iterations.py: summary[strategy] per iteration, late, paired) -----------------------

ITERATIONS = "iterations/equal_steps"
COMPOSITIONS = {"uniform": "uniform", "positives_only": "positives only", "anna_karenina": "Anna Karenina (c = 0)"}


def iteration_means(name: str, strategy: str, field: str) -> list[float]:
    """The seed mean of `field` ("proportion_of_positives", "rows") at each iteration."""
    runs = [run for run in evidence(name)["runs"].values() if run["strategy"] == strategy]
    return [statistics.mean(values) for values in zip(*(run[field] for run in runs), strict=True)]


def iterations() -> str:
    summary = evidence(ITERATIONS)["summary"]
    best = max(COMPOSITIONS, key=lambda strategy: summary[strategy][-1]["mean"])
    rows = []
    for strategy, label in COMPOSITIONS.items():
        curve = summary[strategy]
        shares = iteration_means(ITERATIONS, strategy, "proportion_of_positives")
        rows_used = iteration_means(ITERATIONS, strategy, "rows")
        emphasised = strategy == best
        rows.append(
            [
                bold(label, emphasised),
                fixed(curve[0]["mean"]),
                *(bold(interval(point), emphasised) for point in curve[1:]),
                "1" if all(share == 1 for share in shares) else ", ".join(f"{share:.2f}" for share in shares),
                thousands(rows_used[0]) if len(set(rows_used)) == 1 else ", ".join(thousands(r) for r in rows_used),
            ]
        )
    return markdown_table(
        [
            "composition (32 steps per iteration)",
            "base",
            "iteration 1",
            "iteration 2",
            "iteration 3",
            "p per iteration",
            "rows per iteration",
        ],
        rows,
    )


def late_values(name: str, strategy: str) -> dict[int, float]:
    """Each seed's last-iteration pass@1 (the late statistic of three iterations)."""
    return {run["seed"]: run["accuracy"][-1] for run in evidence(name)["runs"].values() if run["strategy"] == strategy}


# --- staleness (experiments/staleness.py: summary[method]["lags"][K], paired["method/kK-k1"], ...) ---------------


def lagged(name: str, method: str, lag: int) -> dict:
    return evidence(f"staleness/{name}")["summary"][method]["lags"][str(lag)]["late_pass@1"]


def stale_paired(name: str, key: str) -> dict:
    return evidence(f"staleness/{name}")["paired"][key]


def staleness_fresh() -> str:
    files = {4: "fresh_a", 16: "fresh_b", 64: "fresh_b"}
    rows = [
        ["TOPR", *(bold(interval(lagged(files[k], "topr", k)), k == 64) for k in files)],
        ["GRPO-clip", *(interval(lagged(files[k], "grpo_clip", k)) for k in files)],
    ]
    for label, key in (
        ("TOPR − GRPO-clip (paired)", "topr-grpo_clip/k{k}"),
        ("TOPR, K − (K = 1) (paired)", "topr/k{k}-k1"),
        ("GRPO-clip, K − (K = 1) (paired)", "grpo_clip/k{k}-k1"),
    ):
        cells = []
        for k in files:
            statistic = stale_paired(files[k], key.format(k=k))
            cells.append(
                noted(bold(signed_interval(statistic)), every_or_count(statistic))
                if decided(statistic)
                else signed_interval(statistic)
            )
        rows.append([label, *cells])
    reference = lagged("fresh_b", "topr", 1)
    return markdown_table([f"late pass@1 (K = 1: {interval(reference)} for both)", "K = 4", "K = 16", "K = 64"], rows)


def staleness_controls() -> str:
    name = "controls"
    labels = {"topr": "TOPR", "grpo_clip": "GRPO-clip", "tis": "TIS", "sft_positives": "SFT on positives"}
    best = max(labels, key=lambda method: lagged(name, method, 64)["mean"])
    rows = [
        [
            label,
            interval(lagged(name, method, 1)),
            bold(interval(lagged(name, method, 64)), method == best),
            signed_interval(stale_paired(name, f"{method}/k64-k1")),
        ]
        for method, label in labels.items()
    ]
    for method in ("tis", "sft_positives"):
        cells = []
        for lag in (1, 64):
            statistic = stale_paired(name, f"topr-{method}/k{lag}")
            every = every_or_count(statistic) == "every seed" and statistic["mean"] != 0
            cells.append(noted(bold(signed_interval(statistic), every and lag == 64), "every seed" if every else ""))
        rows.append([f"TOPR − {labels[method]} (paired)", *cells, ""])
    return markdown_table(["late pass@1", "K = 1", "K = 64", "K = 64 − K = 1 (paired)"], rows)


# --- asynchronous training (experiments/async_staleness.py: summary.by_method_and_lag, summary.paired) ----------

ASYNC = "asynchronous/async_staleness"
LAGS = [0, 1, 4, 16, 64]


def by_lag(name: str, key: str) -> dict:
    return evidence(name)["summary"]["by_method_and_lag"][key]


def async_paired(name: str, key: str) -> dict:
    return evidence(name)["summary"]["paired"][key]


def async_staleness() -> str:
    def late_cells(method: str, emphasised: set[int], lags: list[int] = LAGS) -> list[str]:
        return [
            bold(interval(by_lag(ASYNC, f"{method}/k{k}")["late_pass@1"]), k in emphasised) if k in lags else ""
            for k in LAGS
        ]

    dropping = [by_lag(ASYNC, f"async_grpo_drop/k{k}") for k in (16, 64)]
    rows = [
        ["AsyncTOPRTrainer (keeps every sample)", *late_cells("async_topr", {64})],
        ["AsyncGRPOTrainer keeping every sample (GRPO-clip)", *late_cells("async_grpo_keep", {0, 1, 4})],
        [
            "AsyncGRPOTrainer as shipped (drops > 4 versions)",
            "as keeping",
            "as keeping",
            "as keeping",
            f"{interval(dropping[0]['late_pass@1'])}: the run stopped after {dropping[0]['steps_mean']} steps (every "
            f"later sample dropped), so this is its start, not a trained result",
            f"the same: stopped after {dropping[1]['steps_mean']} steps",
        ],
        [
            bold("AsyncTOPR − GRPO-clip keeping (paired)"),
            *(
                bold(signed_interval(async_paired(ASYNC, f"async_topr-async_grpo_keep/k{k}")), k in (16, 64))
                for k in LAGS
            ),
        ],
    ]
    for method, label, emphasised in (
        ("async_topr", "AsyncTOPR, K − (K = 0) (paired)", {64}),
        ("async_grpo_keep", "GRPO-clip keeping, K − (K = 0) (paired)", {16, 64}),
    ):
        rows.append(
            [
                label,
                "",
                *(bold(signed_interval(async_paired(ASYNC, f"{method}/k{k}-k0")), k in emphasised) for k in LAGS[1:]),
            ]
        )
    rows.append(
        [
            "control: AsyncTOPR with TRL's token-mean aggregation",
            *late_cells("async_topr_token_mean", set(), lags=[0, 64]),
        ]
    )
    return markdown_table(["late pass@1, 5 seeds", *(f"K = {k}" for k in LAGS)], rows)


SERVER = "asynchronous/server_accuracy"
PIPELINES = {
    "w1-f8": "push every step, 8 samples in flight",
    "w1": "push every step, one step in flight",
    "w8": "push every 8 steps",
    "w32": "push every 32 steps",
}


def seconds_per_step_after(name: str, method: str, pipeline: str, step: int = 8) -> float:
    """The seed mean of a run's training seconds per step from its checkpoint at `step` to its last one (the
    asynchronous worker's start-up left out)."""
    rates = []
    for run in evidence(name)["runs"].values():
        if run["method"] == method and run["pipeline"] == pipeline:
            start = next(point for point in run["curve"] if point["step"] == step)
            end = run["curve"][-1]
            rates.append((end["seconds"] - start["seconds"]) / (end["step"] - start["step"]))
    return statistics.mean(rates)


def server_accuracy() -> str:
    summary = evidence(SERVER)["summary"]
    results, pairs = summary["by_method_and_pipeline"], summary["paired"]
    sync = results["sync_topr/sync"]
    rows = [
        [
            "synchronous TOPRTrainer, server mode",
            f"{sync['lag_mean']:.0f}",
            f"{sync['staleness_mean']:.0f}",
            f"{bold(interval(sync['late_pass@1']))} (sync)",
            "",
            "",
            "",
            "",
            f"{seconds_per_step_after(SERVER, 'sync_topr', 'sync'):.3f}",
        ]
    ]
    best = max(PIPELINES, key=lambda pipeline: results[f"async_topr/{pipeline}"]["late_pass@1"]["mean"])
    for pipeline, label in PIPELINES.items():
        topr, keep = results[f"async_topr/{pipeline}"], results[f"async_grpo_keep/{pipeline}"]
        lag = statistics.mean([topr["lag_mean"], keep["lag_mean"]])
        staleness = statistics.mean([topr["staleness_mean"], keep["staleness_mean"]])
        seconds = statistics.mean(
            seconds_per_step_after(SERVER, method, pipeline) for method in ("async_topr", "async_grpo_keep")
        )
        differences = [
            pairs[f"async_topr-async_grpo_keep/{pipeline}"],
            pairs[f"async_topr/{pipeline}-sync_topr"],
            pairs[f"async_grpo_keep/{pipeline}-sync_topr"],
        ]
        rows.append(
            [
                label,
                f"{lag:.0f}" if lag >= 10 else f"{lag:.1f}",
                f"{staleness:.1f}",
                bold(interval(topr["late_pass@1"]), pipeline == best),
                interval(keep["late_pass@1"]),
                *(
                    described(
                        difference,
                        ", every seed" if decided(difference) else "",
                        " ({below} of {seeds} below)" if pipeline == "w1-f8" and index == 0 else "",
                        emphasised=decided(difference),
                    )
                    for index, difference in enumerate(differences)
                ),
                f"{seconds:.2f}",
            ]
        )
    return markdown_table(
        [
            "pipeline",
            "lag (updates)",
            "TRL staleness (pushes)",
            "AsyncTOPR",
            "AsyncGRPOTrainer keeping",
            "AsyncTOPR − GRPO-clip",
            "AsyncTOPR − sync",
            "GRPO-clip − sync",
            "s/step after step 8",
        ],
        rows,
    )


# --- the stress test on the arithmetic task (late greedy accuracy) -----------------------------------------------


def stress() -> str:
    figure1, sweep_name, figure7_name, iterations_name = (
        f"stress/{name}" for name in ("figure1", "baseline_sweep", "figure7", "iterations")
    )
    naive = evidence(figure1)["late"]["naive_reinforce"]
    broken = sorted([naive["invalid_rate"]["mean"], naive["malformed_rate"]["mean"]])
    figure1_cells = (
        f"naive REINFORCE {fixed(naive['accuracy']['mean'])} ({100 * broken[0]:.0f}-{100 * broken[1]:.0f} % "
        f"of answers invalid or malformed), PPO-clip {interval(late(figure1, 'ppo'))}, TIS "
        f"{interval(late(figure1, 'tis'))}, **SFT on positives {interval(late(figure1, 'sft_positives'))}**, "
        f"TOPR {interval(late(figure1, 'topr'))}"
    )
    figure1_paired = (
        f"TOPR − SFT **{signed_interval(paired(figure1, 'topr-sft_positives'))}**, TOPR − PPO-clip "
        f"**{signed_interval(paired(figure1, 'topr-ppo'))}**, TOPR − TIS "
        f"{signed_interval(paired(figure1, 'topr-tis'))}, TOPR − naive "
        f"{signed_interval(paired(figure1, 'topr-naive_reinforce'))}"
    )
    sweep_data = evidence(sweep_name)
    proportions = sorted({key.split("/")[0] for key in sweep_data["paired"]})
    points = sweep_data["paired"]
    level = sum(point["mean"] >= 0 for point in points.values())
    level_text = f"at all {len(points)} points" if level == len(points) else f"at {level} of {len(points)} points"
    groups = []
    for proportion in proportions:
        decided = [
            (key.split("/pt")[1], point)
            for key, point in points.items()
            if key.startswith(f"{proportion}/") and point["mean"] - point["ci95"] > 0
        ]
        if decided:
            parts = [f"{100 * float(target):.0f} % ({signed_interval(point)})" for target, point in decided]
            listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
            groups.append(f"p = {100 * float(proportion[1:]):.0f} %, p̃ = {listed}")
    sweep_paired = f"TOPR − TIS ≥ 0 {level_text}; above 0 at " + ", and at ".join(groups) + "; level at p̃ ≥ 0.6"
    ends = [sweep_data["late"][f"{proportion}/pt1/topr"] for proportion in proportions]
    sweep_cells = f"TOPR rises with p̃ on both datasets, to {interval(ends[0])} and {interval(ends[1])} at p̃ = 1"
    figure7_summary = evidence(figure7_name)["summary"]
    norms = {method: figure7_summary[method]["max_grad_norm"]["values"] for method in ("untruncated_is", "topr")}
    figure7_cells = (
        f"both fall: untruncated IS {interval(figure7_summary['untruncated_is']['late_accuracy'])}, TOPR "
        f"{interval(figure7_summary['topr']['late_accuracy'])}"
    )
    figure7_paired = (
        f"TOPR − IS {signed_interval(figure7_summary['topr']['late_minus_untruncated_is'])}; IS's largest "
        f"gradient norm {min(norms['untruncated_is']):.1f}-{max(norms['untruncated_is']):.1f} per seed "
        f"against TOPR's {min(norms['topr']):.1f}-{max(norms['topr']):.1f}"
    )
    iteration_late, iteration_paired = evidence(iterations_name)["late"], evidence(iterations_name)["paired"]
    iterations_cells = (
        f"uniform {interval(iteration_late['uniform'])}, **positives only "
        f"{interval(iteration_late['positives_only'])}**, Anna Karenina "
        f"{interval(iteration_late['anna_karenina'])}"
    )
    iterations_paired = (
        f"positives only − uniform **{signed_interval(negated(iteration_paired['uniform-positives_only']))}**, "
        f"− Anna Karenina **{signed_interval(iteration_paired['positives_only-anna_karenina'])}**"
    )
    start = fixed(evidence(figure1)["runs"]["topr/seed0"]["curve"][0]["accuracy"])
    rows = [
        ["Figure 1 (`evidence/stress/figure1.*`)", figure1_cells, figure1_paired],
        [
            "Figures 5-6 (`evidence/stress/baseline_sweep.*`, p = "
            + " and ".join(f"{100 * float(p[1:]):.0f} %" for p in proportions)
            + ")",
            sweep_cells,
            sweep_paired,
        ],
        [
            f"Figure 7 (`evidence/stress/figure7.*`, p = {100 * evidence(figure7_name)['options']['proportion']:.0f} %)",
            figure7_cells,
            figure7_paired,
        ],
        ["Iterations (`evidence/stress/iterations.*`)", iterations_cells, iterations_paired],
    ]
    return markdown_table(["figure", f"late greedy accuracy (start {start})", "paired"], rows)


# --- registry -----------------------------------------------------------------------------------------------------

TABLES: dict[str, Callable[[], str]] = {
    "sample-efficiency-learning-rate": sample_efficiency_learning_rate,
    "sample-efficiency": sample_efficiency,
    "d5-figure1": d5_figure1,
    "figure1": figure1,
    "exact-ratio": exact_ratio,
    "figure4-d4": figure4_d4_preregistered,
    "figures5-6": figures5_6,
    "figure7": figure7,
    "iterations": iterations,
    "staleness-fresh": staleness_fresh,
    "staleness-controls": staleness_controls,
    "async-staleness": async_staleness,
    "server-accuracy": server_accuracy,
    "stress": stress,
}
