"""The findings table (README's "What to expect", experiments/README.md) and the pre-registered study's table. A paired
difference decides where its 95 % interval excludes 0 (the study: Holm); a paper's claim is reproduced or not."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from experiments import real_model_study as study
from experiments.common import late_mean, paired_difference
from experiments.page_tables.evidence import EVIDENCE, decided, evidence, markdown_table, signed, signed_interval
from experiments.page_tables.results import (
    FIGURE1,
    FIGURE1_LABELS,
    TARGETS,
    paired,
    stale_paired,
    sweep_late,
    sweep_paired,
)


TINY = "tiny testbed"


def claim_verdict(difference: dict) -> str:
    """A claim of the paper that TOPR comes out ahead: reproduced where the interval lies above 0."""
    if decided(difference):
        return "**reproduced**" if difference["mean"] > 0 else "**not reproduced** (below)"
    return "**not reproduced** (undecided)"


def level_verdict(difference: dict) -> str:
    if decided(difference):
        return "above" if difference["mean"] > 0 else "below"
    return "level"


def seeds(difference: dict) -> str:
    return f"{len(difference['values'])} seeds"


def paired_row(finding: str, setting: str, label: str, difference: dict, verdict: Callable[[dict], str]) -> list[str]:
    return [finding, f"{setting}, {seeds(difference)}", f"{label} {signed_interval(difference)}", verdict(difference)]


FIGURE1_FINDINGS = {
    # the method TOPR is compared with: (the finding, how its verdict reads)
    "ppo": ("TOPR beats PPO-clip on one fixed off-policy dataset (Figure 1)", claim_verdict),
    "tis": ("TIS is level with TOPR where positives are common (Figure 6)", level_verdict),
    "sft_positives": ("Negatives add to what positives teach (Figure 4)", claim_verdict),
}


def low_target_row() -> list[str]:
    """TOPR − TIS at p̃ 1-20 % (Figures 5-6): the range of the paired means, and the p̃ where each is decided above."""
    differences = {target: sweep_paired(target) for target in TARGETS[:4]}
    means = [difference["mean"] for difference in differences.values()]
    above = [target for target, difference in differences.items() if decided(difference) and difference["mean"] > 0]
    if len(above) == len(differences):
        verdict = "**reproduced**"
    elif above:
        verdict = f"**reproduced** at p̃ {', '.join(above)}; undecided at the rest"
    else:
        verdict = "**not reproduced** (undecided)"
    return [
        "TOPR tolerates a low p̃ far better than TIS (Figures 5-6)",
        f"{TINY}, p̃ {TARGETS[0]}-{TARGETS[3]}, {seeds(differences[TARGETS[0]])}",
        f"TOPR − TIS {signed(min(means))} to {signed(max(means))}",
        verdict,
    ]


def best_target_row() -> list[str]:
    """The p̃ whose late pass@1 lies within 0.01 of the best (Figures 5-6's sweep), against the paper's 10-20 %."""
    means = {target: sweep_late(target, "topr")["mean"] for target in TARGETS}
    near = [target for target in TARGETS if max(means.values()) - means[target] <= 0.01]
    best = near[0] if len(near) == 1 else f"{near[0]}-{near[-1]}"
    verdict = "**reproduced**" if best in ("0.1", "0.2", "0.1-0.2") else "**not reproduced**"
    return ["p̃ of 10-20 % works best (Eq. 12)", f"{TINY}, p̃ {TARGETS[0]}-{TARGETS[-1]}", f"best p̃ {best}", verdict]


def figure7_row() -> list[str]:
    summary = evidence("figure7/figure7")["summary"]
    topr, untruncated = summary["topr"]["max_grad_norm"]["mean"], summary["untruncated_is"]["max_grad_norm"]["mean"]
    return [
        "Truncation bounds the gradient where untruncated IS spikes (Figure 7)",
        f"{TINY}, {len(summary['topr']['max_grad_norm']['values'])} seeds",
        f"largest gradient norm {topr:.1f} against {untruncated:.1f}",
        "**reproduced**" if untruncated > 5 * topr else "**not reproduced**",
    ]


# --- the earlier real-model runs (experiments/real_model_comparison.py, not pre-registered) -----------------------

EARLIER = "real-model/comparison"
PRE_REGISTERED_RATES = (3e-5, 1e-4)
"""The rates TOPR ran on validation before the held-out comparison; rates tried afterwards never move its rate."""


def validation_runs() -> list[dict]:
    """The earlier runs on the validation split (`--eval_split validation`), which choose the learning rates."""
    paths = sorted((EVIDENCE / EARLIER).glob("*-validation.json"))
    return [evidence(f"{EARLIER}/{path.stem}") for path in paths if not path.name.startswith("start-")]


def validation_scores(part: str, method: str) -> dict[float, float]:
    """Late validation pass@1 by rate, the mean over every seed run at that rate (not its luckiest run)."""
    late_by_rate: dict[float, list[float]] = {}
    for run in validation_runs():
        if (run["part"], run["method"]) == (part, method):
            late_by_rate.setdefault(run["options"]["learning_rate"], []).append(late_mean(run["curve"]))
    return {rate: statistics.mean(lates) for rate, lates in late_by_rate.items()}


def comparison_learning_rate(part: str) -> float:
    """The earlier comparison's one rate for every method: TOPR's best on validation among `PRE_REGISTERED_RATES`."""
    scores = {rate: score for rate, score in validation_scores(part, "topr").items() if rate in PRE_REGISTERED_RATES}
    if not scores:
        raise KeyError(f"{part}: TOPR has no validation run at the pre-registered rates {PRE_REGISTERED_RATES}")
    return max(scores, key=scores.__getitem__)


def chosen_learning_rate(part: str, method: str = "topr") -> float:
    """A method's best validation score over its rates; with no run at the comparison's rate and another, that one."""
    comparison_rate, scores = comparison_learning_rate(part), validation_scores(part, method)
    if comparison_rate not in scores or len(scores) < 2:
        return comparison_rate
    return max(scores, key=scores.__getitem__)


def held_out_late(part: str, method: str, learning_rate: float) -> dict[int, float]:
    """Each held-out run's late pass@1 by seed, for one method at one rate."""
    paths = sorted((EVIDENCE / EARLIER).glob(f"{part}-{method}-seed*-lr{learning_rate:g}.json"))
    return {run["seed"]: late_mean(run["curve"]) for run in (evidence(f"{EARLIER}/{path.stem}") for path in paths)}


def earlier_off_policy(method: str) -> dict:
    """TOPR − `method` off-policy, each at its own validation choice, paired by seed."""
    return paired_difference(
        held_out_late("off_policy", "topr", chosen_learning_rate("off_policy")),
        held_out_late("off_policy", method, chosen_learning_rate("off_policy", method)),
    )


# --- the pre-registered real-model study (experiments/real_model_study.py) ----------------------------------------

STUDY = EVIDENCE / "real-model-study"


def study_summary() -> dict:
    """The study's summary computed from its run files (what `real_model_study --summarise` writes)."""
    return study.summarise(study.load_runs(STUDY / "runs"))


def study_row() -> list[str]:
    """The pre-registered study's four verdicts in one row, or how far its runs have come."""
    labels = {"topr_whole_vocabulary": "whole vocabulary", "tis": "TIS", "ppo": "PPO-clip", "sft_positives": "SFT"}
    summary = study_summary()
    if summary["complete"]:
        comparisons = summary["comparisons"]
        result = "; ".join(
            f"− {labels[row['b']]} {signed(row['difference'])} (Holm p {row['p_holm']:.3f})" for row in comparisons
        )
        verdict = ", ".join(f"{labels[row['b']]}: {row['verdict']}" for row in comparisons)
    else:
        done = len(list((STUDY / "runs").glob("*.json")))
        planned = len(study.METHODS) * (len(study.GRID) * len(study.VALIDATION_SEEDS) + len(study.TEST_SEEDS))
        result, verdict = f"running: {done} of about {planned} runs on disk", "pending"
    return [
        "TOPR against the exact ratio's ablation, TIS, PPO-clip and SFT on positives, **pre-registered**",
        "SmolLM2-135M-Instruct, word problems, one dataset from μ (top_p 0.95), 10 held-out seeds",
        result,
        verdict,
    ]


def study_table() -> str:
    """Each method's validation means by rate, its choice and its held-out end point; the comparisons once every
    held-out run is in."""
    summary, planned = study_summary(), len(study.VALIDATION_SEEDS)
    rows = []
    for method, choice in summary["choices"].items():
        held = summary["held_out"][method]
        means = ", ".join(
            f"{rate}: {row['mean']:.3f}" + ("" if row["seeds"] == planned else f" ({row['seeds']} of {planned} seeds)")
            for rate, row in choice["validation_so_far"].items()
        )
        chosen = "-" if choice["chosen"] is None else f"{choice['chosen']:g}"
        chosen += "" if choice["final"] or choice["chosen"] is None else " (not final)"
        rows.append(
            [method, means or "-", chosen, f"{held['mean']:.3f} ({len(held['seeds'])} seeds)" if held["seeds"] else "-"]
        )
    table = markdown_table(["method", "validation mean by rate", "chosen rate", "held-out pass@1"], rows)
    comparisons = [
        [
            f"{row['a']} − {row['b']}",
            f"{signed(row['difference'])} [{signed(row['ci95'][0])}, {signed(row['ci95'][1])}]",
            f"{row['p']:.4f}",
            f"{row['p_holm']:.4f}",
            row["verdict"],
        ]
        for row in summary["comparisons"]
    ]
    if not comparisons:
        return table
    spread = statistics.mean(len(row["seeds"]) for row in summary["comparisons"])
    header = [f"comparison ({spread:.0f} seeds)", "difference [95 % interval]", "sign-flip p", "Holm p", "verdict"]
    return table + "\n\n" + markdown_table(header, comparisons)


def findings_table() -> str:
    on_policy = evidence("sample_efficiency/sample_efficiency")["summary"]["topr_online"]["late_minus_grpo"]
    stale = stale_paired("fresh_b", "topr-grpo_clip/k64")
    real = {method: earlier_off_policy(method) for method in ("ppo", "tis")}
    loss_ratio = evidence("benchmarks/gpu-h100-15b-loss")["loss_only"]["ratios"]["topr-online / grpo-grpo"]
    memory = evidence("benchmarks/cpu-smollm2-shared-prompt-memory")  # timed apart: one process per trainer
    shared = {**memory, **evidence("benchmarks/cpu-smollm2-shared-prompt")}
    rows = [
        *(
            paired_row(finding, TINY, f"TOPR − {FIGURE1_LABELS[method]}", paired(FIGURE1, f"topr-{method}"), verdict)
            for method, (finding, verdict) in FIGURE1_FINDINGS.items()
        ),
        low_target_row(),
        best_target_row(),
        figure7_row(),
        paired_row("On-policy, TOPR and GRPO", f"{TINY}, online", "TOPR − GRPO", on_policy, level_verdict),
        paired_row("μ 63 updates behind: TOPR and GRPO-clip", TINY, "TOPR − GRPO-clip", stale, level_verdict),
        [
            "Figure 1 on a real model (earlier runs, not pre-registered)",
            f"SmolLM2-135M-Instruct, each method at its own rate, {seeds(real['ppo'])}",
            f"TOPR − PPO-clip {signed_interval(real['ppo'])}; − TIS {signed_interval(real['tis'])}",
            f"PPO-clip: {level_verdict(real['ppo'])}; TIS: {level_verdict(real['tis'])}",
        ],
        study_row(),
        [
            "TOPR's loss + backward costs what GRPO's does",
            "Qwen2.5-1.5B shape, one H100",
            f"{loss_ratio:.3f}x GRPOTrainer's",
            "level" if abs(loss_ratio - 1) < 0.02 else ("dearer" if loss_ratio > 1 else "cheaper"),
        ],
        [
            "Loss + backward with each prompt computed once (`topr_shared_prompt_forward`)",
            "SmolLM2-135M-Instruct, two-shot word problems, 8 completions a prompt, CPU",
            f"{shared['loss_backward_vs_grpo']:.3f}x GRPOTrainer's (FLOPs bound {shared['flops_bound']:.3f}), peak memory "
            f"{shared['peak_added_memory_vs_grpo']:.3f}x",
            "cheaper" if shared["loss_backward_vs_grpo"] < 1 else "not cheaper",
        ],
    ]
    return markdown_table(["finding", "setting", "result (paired, 95 % interval)", "verdict"], rows)


TABLES = {"findings": findings_table, "real-model-study": study_table}
