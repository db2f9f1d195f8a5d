"""The findings table (the README's "What to expect" and the top of experiments/README.md): one row per finding, its
setting, its result and its verdict, every number and every verdict read from the evidence files.

A paired difference decides where its 95 % interval over seeds excludes 0 (the pre-registered study decides by its
own Holm-adjusted test instead). For a claim of the paper the verdict says whether it was reproduced; for the
project's own comparisons it says above, below or level."""

from __future__ import annotations

import statistics

from experiments.common import paired_difference
from experiments.page_tables import real_model
from experiments.page_tables.evidence import EVIDENCE, evidence, markdown_table, signed, signed_interval
from experiments.page_tables.results import FIGURE1, TARGETS, paired, stale_paired, sweep


def decided(difference: dict) -> bool:
    return len(difference["values"]) > 1 and abs(difference["mean"]) > difference["ci95"]


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


def low_target_row() -> list[str]:
    """TOPR − TIS at p̃ 1-20 % (Figures 5-6): the range of the paired means, and the p̃ where each is decided above."""
    differences = {target: evidence(sweep(target))["paired"][f"p0.67/pt{target}"] for target in TARGETS[:4]}
    means = [difference["mean"] for difference in differences.values()]
    above = [target for target, d in differences.items() if decided(d) and d["mean"] > 0]
    if len(above) == len(differences):
        verdict = "**reproduced**"
    elif above:
        verdict = f"**reproduced** at p̃ {', '.join(above)}; undecided at the rest"
    else:
        verdict = "**not reproduced** (undecided)"
    return [
        "TOPR tolerates a low p̃ far better than TIS (Figures 5-6)",
        f"{TINY}, p̃ {TARGETS[0]}-{TARGETS[3]}, {len(differences[TARGETS[0]]['values'])} seeds",
        f"TOPR − TIS {signed(min(means))} to {signed(max(means))}",
        verdict,
    ]


def best_targets() -> str:
    """The p̃ whose late pass@1 lies within 0.01 of the best (Figures 5-6's sweep)."""
    means = {target: evidence(sweep(target))["late"][f"p0.67/pt{target}/topr"]["mean"] for target in TARGETS}
    best = max(means.values())
    near = [target for target in TARGETS if best - means[target] <= 0.01]
    return near[0] if len(near) == 1 else f"{near[0]}-{near[-1]}"


def figure7_row() -> list[str]:
    summary = evidence("figure7/figure7")["summary"]
    topr, untruncated = summary["topr"]["max_grad_norm"]["mean"], summary["untruncated_is"]["max_grad_norm"]["mean"]
    verdict = "**reproduced**" if untruncated > 5 * topr else "**not reproduced**"
    return [
        "Truncation bounds the gradient where untruncated IS spikes (Figure 7)",
        f"{TINY}, {len(summary['topr']['max_grad_norm']['values'])} seeds",
        f"largest gradient norm {topr:.1f} against {untruncated:.1f}",
        verdict,
    ]


def real_model_off_policy(method: str) -> dict:
    """The earlier real-model runs (3 seeds): TOPR − `method` off-policy, each at its own validation choice."""
    topr_rate = real_model.chosen_learning_rate("off_policy")
    own_rate = real_model.chosen_learning_rate("off_policy", method)
    return paired_difference(
        real_model.held_out_late("off_policy", "topr", topr_rate),
        real_model.held_out_late("off_policy", method, own_rate),
    )


STUDY = EVIDENCE / "real-model-study"
TINY = "tiny testbed"


def study_row() -> list[str]:
    """The pre-registered study's four verdicts in one row, or how far its runs have come."""
    labels = {"topr_whole_vocabulary": "whole vocabulary", "tis": "TIS", "ppo": "PPO-clip", "sft_positives": "SFT"}
    summary = study_summary()
    if summary["complete"]:
        result = "; ".join(
            f"− {labels[row['b']]} {signed(row['difference'])} (Holm p {row['p_holm']:.3f})"
            for row in summary["comparisons"]
        )
        verdict = ", ".join(f"{labels[row['b']]}: {row['verdict']}" for row in summary["comparisons"])
    else:
        from experiments import real_model_study as study

        done = len(list((STUDY / "runs").glob("*.json")))
        planned = len(study.METHODS) * (len(study.GRID) * len(study.VALIDATION_SEEDS) + len(study.TEST_SEEDS))
        result, verdict = f"running: {done} of about {planned} runs on disk", "pending"
    return [
        "TOPR against the exact ratio's ablation, TIS, PPO-clip and SFT on positives, **pre-registered**",
        "SmolLM2-135M-Instruct, word problems, one dataset from μ (top_p 0.95), 10 held-out seeds",
        result,
        verdict,
    ]


def findings_table() -> str:
    figure1 = {method: paired(FIGURE1, f"topr-{method}") for method in ("ppo", "tis", "sft_positives")}
    on_policy = evidence("sample_efficiency/sample_efficiency")["summary"]["topr_online"]["late_minus_grpo"]
    stale = stale_paired("fresh_b", "topr-grpo_clip/k64")
    real = {method: real_model_off_policy(method) for method in ("ppo", "tis")}
    loss_ratio = evidence("benchmarks/gpu-h100-15b-loss")["loss_only"]["ratios"]["topr-online / grpo-grpo"]
    tiny = TINY
    rows = [
        [
            "TOPR beats PPO-clip on one fixed off-policy dataset (Figure 1)",
            f"{tiny}, {seeds(figure1['ppo'])}",
            f"TOPR − PPO-clip {signed_interval(figure1['ppo'])}",
            claim_verdict(figure1["ppo"]),
        ],
        [
            "TIS is level with TOPR where positives are common (Figure 6)",
            f"{tiny}, {seeds(figure1['tis'])}",
            f"TOPR − TIS {signed_interval(figure1['tis'])}",
            level_verdict(figure1["tis"]),
        ],
        [
            "Negatives add to what positives teach (Figure 4)",
            f"{tiny}, {seeds(figure1['sft_positives'])}",
            f"TOPR − SFT on positives {signed_interval(figure1['sft_positives'])}",
            claim_verdict(figure1["sft_positives"]),
        ],
        low_target_row(),
        [
            "p̃ of 10-20 % works best (Eq. 12)",
            f"{tiny}, p̃ {TARGETS[0]}-{TARGETS[-1]}",
            f"best p̃ {best_targets()}",
            "**reproduced**" if best_targets() in ("0.1", "0.2", "0.1-0.2") else "**not reproduced**",
        ],
        figure7_row(),
        [
            "On-policy, TOPR and GRPO",
            f"{tiny}, online, {seeds(on_policy)}",
            f"TOPR − GRPO {signed_interval(on_policy)}",
            level_verdict(on_policy),
        ],
        [
            "μ 63 updates behind: TOPR and GRPO-clip",
            f"{tiny}, {seeds(stale)}",
            f"TOPR − GRPO-clip {signed_interval(stale)}",
            level_verdict(stale),
        ],
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
    ]
    return markdown_table(["finding", "setting", "result (paired, 95 % interval)", "verdict"], rows)


def study_summary() -> dict:
    """The study's summary computed from its run files (what `real_model_study --summarise` writes)."""
    from experiments import real_model_study

    return real_model_study.summarise(real_model_study.load_runs(STUDY / "runs"))


def study_table() -> str:
    """The pre-registered study: each method's validation means by rate, its choice and its held-out end point; the
    comparisons once every held-out run is in."""
    from experiments import real_model_study

    summary = study_summary()
    rows = []
    for method, choice in summary["choices"].items():
        held = summary["held_out"][method]
        seeds = len(real_model_study.VALIDATION_SEEDS)
        means = ", ".join(
            f"{rate}: {row['mean']:.3f}" + ("" if row["seeds"] == seeds else f" ({row['seeds']} of {seeds} seeds)")
            for rate, row in choice["validation_so_far"].items()
        )
        chosen = (
            "-" if choice["chosen"] is None else f"{choice['chosen']:g}" + ("" if choice["final"] else " (not final)")
        )
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


TABLES = {"findings": findings_table, "real-model-study": study_table}
