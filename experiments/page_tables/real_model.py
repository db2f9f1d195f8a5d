"""The tables of docs/real-model.md, docs/off-policy.md's whole-vocabulary table and experiments/benchmarks.md's tables on the
real model, from experiments/evidence/real-model/ and experiments/evidence/benchmarks/ (`python -m experiments.page_tables`)."""

from __future__ import annotations

import statistics

from experiments.common import late_mean, mean_and_ci95, paired_difference
from experiments.page_tables.evidence import (
    EVIDENCE,
    evidence,
    fixed,
    interval,
    markdown_table,
    signed,
    signed_interval,
    signed_per_seed,
)


CANDIDATE_LABELS = {
    "word_problems_2_shot": "**word problems, two worked examples (shipped)**",
    "word_problems_0_shot": "word problems, no worked example",
    "word_problems_0_shot_no_instruction": 'word problems, no example, no "Answer with the number."',
    "plain_questions": '"What is 7 plus 5?" in 5 phrasings, numbers 1-12',
    "gsm8k": "GSM8K test questions",
}


def candidates_table() -> str:
    rows = []
    for name, label in CANDIDATE_LABELS.items():
        data = evidence(f"real-model/candidates-{name}")
        for row in data["results"]:
            rows.append(
                [
                    label,
                    f"{data['questions']} x {data['samples']}",
                    str(row["top_k"] or "none"),
                    f"{row['pass@1']:.3f} ± {row['pass@1_se']:.3f}",
                    f"{row['questions_0<p<1']:.2f}",
                    f"{row['mean_tokens']:.0f} (budget {data['max_new_tokens']})",
                    f"{row['truncated']:.2f}",
                ]
            )
    return markdown_table(
        [
            "candidate",
            "questions x samples",
            "top_k",
            "sampled pass@1",
            "questions with 0 < p < 1",
            "mean tokens",
            "cut at the budget",
        ],
        rows,
    )


def whole_vocabulary_table() -> str:
    data = evidence("real-model/whole-vocabulary-ratio")
    rows = [
        [
            f"top_k {row['top_k']}" if "top_k" in row else f"top_p {row['top_p']}",
            str(row["sequences"]),
            f"{row['mean_tokens']:.0f}",
            f"{row['ratio_median']:.3f}",
            f"{row['ratio_p10']:.3f}-{row['ratio_p90']:.3f}",
            f"{row['ratio_min']:.3f}",
            f"{row['per_token_kept_mass_mean']:.4f}",
        ]
        for row in data["results"]
    ]
    return markdown_table(
        [
            "mu samples with",
            "sequences",
            "mean tokens",
            "pi/mu on the whole vocabulary: median",
            "10th-90th percentile",
            "min",
            "per-token kept mass (geometric mean)",
        ],
        rows,
    )


README_RUNS = ("real-model/readme-run", "real-model/readme-run-avx512")
"""The README's real-model command, each timed from a fresh clone on its own host: the first gives the table, and every
other must print the same figures (the same seed; what the host changes is the time)."""


def readme_run_rows(data: dict) -> list[list[str]]:
    return [
        [
            when,
            f"{data[when]['pass@1']:.3f} ± {data[when]['pass@1_problem_se']:.3f}",
            f"{data[when]['greedy_accuracy']:.3f}",
            f"{data[when]['mean_completion_tokens']:.0f}",
            f"{data[when]['truncated_rate']:.2f}",
        ]
        for when in ("before", "after")
    ]


def readme_runs() -> list[dict]:
    """The timed runs of the README's real-model command; raises where a host printed other figures than the first."""
    runs = [evidence(name) for name in README_RUNS]
    for name, run in zip(README_RUNS[1:], runs[1:], strict=True):
        if readme_run_rows(run) != readme_run_rows(runs[0]):
            raise ValueError(f"{name} printed other held-out figures than {README_RUNS[0]}: give it its own table")
    return runs


def host(run: dict) -> str:
    return f"{run['machine']['cpu']} ({run['machine']['cpu_capability']})"


def wall_clock(run: dict) -> str:
    return f"{run['wall_clock_s'] / 60:.0f} min"


def peak_memory(run: dict) -> str:
    return f"{run['max_rss_kb'] / 2**20:.1f} GiB"


def readme_run_table() -> str:
    runs = readme_runs()
    table = markdown_table(
        [
            "held-out (48 test problems)",
            "sampled pass@1 (temperature 1, 4 samples)",
            "greedy accuracy",
            "mean completion tokens",
            "cut at 64 tokens",
        ],
        readme_run_rows(runs[0]),
    )
    timings = "; ".join(
        f"on an {host(run)}, {wall_clock(run)} wall clock and {peak_memory(run)} peak memory, the install "
        f"{run['install_s']} s and the GGUF conversion {run['conversion_s']} s (inside the run's time)"
        for run in runs
    )
    return (
        f"{table}\n\n{runs[0]['steps']} steps, the same figures on every host; {timings}. "
        f"{runs[0]['conditions'][0].upper()}{runs[0]['conditions'][1:]}."
    )


LOSS_LABELS = {
    "grpo-dapo": 'GRPOTrainer `loss_type="dapo"` (TRL\'s default)',
    "grpo-grpo": 'GRPOTrainer `loss_type="grpo"`',
    "topr-online": "TOPRTrainer (canonical TOPR), μ unprocessed",
    "topr-online-top-k": "TOPRTrainer, μ sampled with top_k {top_k}: π on μ's support",
    "topr-online-top-p": "TOPRTrainer, μ sampled with top_p {top_p}: π on μ's support",
}


def loss_speed_table() -> str:
    """Loss + backward of each trainer on one shared batch of the real model (`experiments.benchmark --loss_only`)."""
    data = evidence("benchmarks/cpu-smollm2-support-floors")
    result, options = data["loss_only"], data["options"]
    medians, peaks = result["median_loss_backward_s"], result.get("peak_added_memory_mib", {})
    base = medians["grpo-dapo"]
    rows = [
        [
            label.format(top_k=options.get("top_k", 50), top_p=options.get("top_p", 0.95)),
            f"{medians[name]:.2f}",
            "/".join(f"{q:.2f}" for q in result["quartiles_s"][name]),
            f"{medians[name] / base:.3f}",
            f"{peaks[name]:.0f}" if name in peaks else "-",
            f"{peaks[name] / peaks['grpo-dapo']:.3f}" if name in peaks else "-",
        ]
        for name, label in LOSS_LABELS.items()
    ]
    lines = [
        markdown_table(
            [
                "trainer",
                "loss + backward, median s",
                "quartiles s",
                "time / dapo",
                "memory one call adds, MiB",
                "memory / dapo",
            ],
            rows,
        )
    ]
    lines.append(
        f"\n{options['batch_size']} completions ({options['num_generations']} per prompt) of "
        f"{options['completion_length']} tokens, forced to full length; {options['repeats'] * options['steps']} "
        f"timed calls per trainer after 3 warm-up rounds, interleaved call by call in one process; "
        f"float32, one thread, μ's log-probs kept from generation (an off-policy batch)."
    )
    return "\n".join(lines)


SUPPORT_DESIGNS = {
    "cpu-smollm2-support-tiles-idle": "the tiles (TRL's head read through a TorchFunctionMode; bins, band)",
    "cpu-smollm2-support-floors": "**the rule** (`topr_trl/support`: projected again; top-p sorted above its floors)",
}
"""Two designs of pi on mu's support, each timed in its own run against TOPR without truncation in that run."""


def support_cost_table() -> str:
    """What pi on mu's support costs on the real model, old design against new (`experiments.benchmark --loss_only
    --top_k 500`): each run's truncated calls against its own untruncated TOPR."""
    rows = []
    for name, label in SUPPORT_DESIGNS.items():
        data = evidence(f"benchmarks/{name}")
        result, options = data["loss_only"], data["options"]
        medians, peaks = result["median_loss_backward_s"], result.get("peak_added_memory_mib", {})
        for setting, truncation in (
            ("topr-online-top-k", f"top_k {options['top_k']}"),
            ("topr-online-top-p", f"top_p {options['top_p']}"),
        ):
            memory = f"{peaks[setting] / peaks['topr-online']:.3f}" if peaks.get("topr-online") else "-"
            rows.append(
                [
                    label,
                    f"`{result['library']['commit']}`",
                    truncation,
                    f"{medians[setting]:.2f} / {medians['topr-online']:.2f}",
                    f"**{medians[setting] / medians['topr-online']:.3f}**",
                    memory,
                ]
            )
    return markdown_table(
        [
            "design",
            "commit",
            "μ samples with",
            "loss + backward s (truncated / TOPR)",
            "time / TOPR untruncated",
            "memory / TOPR",
        ],
        rows,
    )


def generation_speed_table() -> str:
    """vLLM's CPU engine against transformers `generate` on the real model (`experiments.vllm_generation`)."""
    rows = []
    for name in ("vllm_throughput_smollm2", "vllm_throughput_smollm2_bf16"):
        data = evidence(f"benchmarks/{name}")
        for row in data["results"]:
            rates = row["completions_per_second"]
            rows.append(
                [
                    row["vllm_dtype"],
                    f"{rates['vllm']:.2f}",
                    f"{rates['transformers']:.2f}",
                    f"**{row['ratio_vllm_over_transformers']:.2f}x**",
                    f"{row['engine_load_seconds']:.0f} s",
                    f"{row['completions']} x {row['completion_length']}",
                    str(data["threads"]),
                ]
            )
    return markdown_table(
        [
            "engine dtype",
            "vLLM completions/s",
            "transformers completions/s (float32)",
            "vLLM / transformers",
            "engine start",
            "completions x tokens",
            "threads",
        ],
        rows,
    )


def async_speed_table() -> str:
    """Asynchronous TOPR against synchronous on a real vLLM server with the real model
    (`experiments.async_server_throughput --model smollm2`)."""
    data = evidence("benchmarks/async_server_throughput_smollm2")
    runs = data["runs"]
    rows = [
        [
            f"{pair + 1}",
            f"{sync['seconds_per_step']:.1f}",
            f"{run['seconds_per_step']:.1f}",
            f"{sync['samples_per_second']:.3f}",
            f"{run['samples_per_second']:.3f}",
            f"**{ratio:.2f}**",
        ]
        for pair, (sync, run, ratio) in enumerate(zip(runs[::2], runs[1::2], data["ratios"], strict=True))
    ]
    lines = [
        markdown_table(
            [
                "pair",
                "synchronous s/step",
                "asynchronous s/step",
                "synchronous samples/s",
                "asynchronous samples/s",
                "asynchronous / synchronous",
            ],
            rows,
        )
    ]
    lines.append(
        f"\nMedian ratio **{data['median_ratio']:.2f}**. In the synchronous loop, generation and the weight "
        f"push took L = {data['L_generate_seconds_per_step']:.1f} s per step and the rest T = "
        f"{data['T_train_seconds_per_step']:.1f} s: the ideal ratio (L + T) / max(L, T) is "
        f"{data['ideal_ratio']:.2f}; the asynchronous trainer's own training took "
        f"{data['T_async_train_seconds_per_step']:.1f} s per step."
    )
    return "\n".join(lines)


def rule_speed_table() -> str:
    """The rule alone, floors against the whole-row sort, on the real model's logits (`experiments.rule_speed`)."""
    data = evidence("benchmarks/rule-floors-vs-whole-sort")
    rows = []
    for row in data["results"]:
        processing = row["processing"]
        setting = next(f"{name} {processing[name]}" for name in ("top_p", "top_k", "min_p") if processing.get(name))
        rows.append(
            [
                setting,
                f"{row['median_s']['baseline']:.2f}",
                f"{row['median_s']['this']:.2f}",
                f"**{row['this_over_baseline']:.2f}**",
                f"{row['max_abs_difference']:.0e}",
            ]
        )
    return markdown_table(
        ["μ samples with", "whole-row sort s", "floors s", "floors / whole-row sort", "largest log-prob difference"],
        rows,
    ) + (
        f"\n\n{data['rows']} rows of {data['vocabulary']:,} logits, {data['repeats']} calls each, interleaved; "
        f"{data['threads']} thread, {data['machine']['cpu']}."
    )


COMPARISON = "real-model/comparison"
PART_LABELS = {
    "online": "online",
    "off_policy": "off-policy (one dataset from the frozen base model)",
}
METHOD_LABELS = {
    "topr": "TOPR",
    "grpo": "GRPO (`dapo`, TRL's default)",
    "sft_positives": "SFT on positives",
    "tis": "TIS",
    "ppo": "PPO-clip",
}


def rate(learning_rate: float) -> str:
    """A learning rate as the commands write it: 3e-5, 1e-4."""
    return f"{learning_rate:.0e}".replace("e-0", "e-")


def validation_runs() -> list[dict]:
    """The runs on the validation split that choose the learning rate (`real_model_comparison --eval_split
    validation`), by part, method and learning rate."""
    paths = sorted((EVIDENCE / COMPARISON).glob("*-validation.json"))
    runs = [evidence(f"{COMPARISON}/{path.stem}") for path in paths if not path.name.startswith("start-")]
    order = list(PART_LABELS)
    return sorted(runs, key=lambda run: (order.index(run["part"]), run["method"], run["options"]["learning_rate"]))


# The rates TOPR ran on the validation split before the held-out comparison: the rule fixed then made TOPR's best
# among them every method's rate. Rates tried afterwards are controls; they never move the comparison's rate.
PRE_REGISTERED_RATES = (3e-5, 1e-4)


def validation_scores(part: str, method: str) -> dict[float, float]:
    """`method`'s late pass@1 on the validation split by learning rate: the mean over the seeds it ran at that rate
    (a rate run on more seeds is judged on all of them, not on its luckiest run)."""
    late_by_rate: dict[float, list[float]] = {}
    for run in validation_runs():
        if (run["part"], run["method"]) == (part, method):
            late_by_rate.setdefault(run["options"]["learning_rate"], []).append(late_mean(run["curve"]))
    return {learning_rate: statistics.mean(lates) for learning_rate, lates in late_by_rate.items()}


def best_validation_rate(part: str, method: str, rates: tuple[float, ...] | None = None) -> float | None:
    """The learning rate of `method`'s best validation score (among `rates` when given); None where it has no run
    there."""
    scores = {
        learning_rate: score
        for learning_rate, score in validation_scores(part, method).items()
        if rates is None or learning_rate in rates
    }
    return max(scores, key=scores.__getitem__) if scores else None


def comparison_learning_rate(part: str) -> float:
    """The comparison's one rate for every method: TOPR's best on validation among `PRE_REGISTERED_RATES`."""
    chosen = best_validation_rate(part, "topr", PRE_REGISTERED_RATES)
    if chosen is None:
        raise KeyError(f"{part}: TOPR has no validation run at the pre-registered rates {PRE_REGISTERED_RATES}")
    return chosen


def chosen_learning_rate(part: str, method: str = "topr") -> float:
    """A method's own choice: its best validation score (`validation_scores`) over every rate it tried, TOPR
    included. A method needs a run at the comparison's rate and at least one other to have a choice of its own; one
    without takes the comparison's rate (a single rate chooses nothing)."""
    comparison_rate = comparison_learning_rate(part)
    rates = {
        run["options"]["learning_rate"] for run in validation_runs() if (run["part"], run["method"]) == (part, method)
    }
    if comparison_rate not in rates or len(rates) < 2:
        return comparison_rate
    return best_validation_rate(part, method)


def held_out_late(part: str, method: str, learning_rate: float) -> dict[int, float]:
    """Each held-out run's late pass@1 by seed, for one method at one rate (the per-run files)."""
    paths = sorted((EVIDENCE / COMPARISON).glob(f"{part}-{method}-seed*-lr{learning_rate:g}.json"))
    runs = [evidence(f"{COMPARISON}/{path.stem}") for path in paths]
    return {run["seed"]: late_mean(run["curve"]) for run in runs}


def own_rate_controls() -> list[dict]:
    """The control for the one rate chosen on TOPR: each method held out at its own validation choice, paired by seed
    with TOPR at the comparison's rate, at TOPR's own choice where that differs (each at its own rate), and at the
    method's own rate where TOPR was held out there (both at the other method's choice). A pair where both sit at the
    comparison's rate is the comparison itself and is left out; a pair with no held-out runs on the method's side has
    no difference ("none run")."""
    controls = []
    for part in PART_LABELS:
        comparison_rate = comparison_learning_rate(part)
        for method in comparison_summary(part)["late"]:  # the part's methods, in the comparison's order
            if method == "topr":
                continue
            own_rate = chosen_learning_rate(part, method)
            late = held_out_late(part, method, own_rate)
            topr_rates = {comparison_rate, chosen_learning_rate(part)}
            if held_out_late(part, "topr", own_rate):
                topr_rates.add(own_rate)
            for topr_rate in sorted(topr_rates, reverse=True):
                if own_rate == topr_rate == comparison_rate:
                    continue
                topr = held_out_late(part, "topr", topr_rate)
                controls.append(
                    {
                        "part": part,
                        "method": method,
                        "learning_rate": own_rate,
                        "topr_learning_rate": topr_rate,
                        "late": mean_and_ci95(list(late.values())) if late else None,
                        "difference": paired_difference(topr, late) if late and topr else None,
                    }
                )
    return controls


def own_rate_table() -> str:
    rows = []
    for control in own_rate_controls():
        difference = control["difference"]
        rows.append(
            [
                PART_LABELS[control["part"]],
                METHOD_LABELS[control["method"]],
                rate(control["learning_rate"]),
                rate(control["topr_learning_rate"]),
                *(
                    [
                        ", ".join(str(seed) for seed in difference["seeds"]),
                        spread(control["late"]),
                        signed_per_seed(difference["values"]),
                        paired_shown(difference),
                        verdict(difference),
                    ]
                    if difference
                    else ["none run", "", "", "", ""]
                ),
            ]
        )
    return markdown_table(
        [
            "part",
            "method",
            "its own rate (on validation)",
            "TOPR's rate",
            "seeds",
            "its late pass@1",
            "TOPR − it, per seed",
            "paired mean ± 95 %",
            "TOPR is",
        ],
        rows,
    )


def real_model_validation_table() -> str:
    rows = [
        [
            PART_LABELS[run["part"]],
            METHOD_LABELS[run["method"]],
            rate(run["options"]["learning_rate"]),
            str(run["seed"]),
            fixed(run["curve"][0]["pass@1"]),
            fixed(late_mean(run["curve"])),
            fixed(late_mean(run["curve"], "greedy_accuracy")),
            f"{run['seconds'] / 60:.0f}",
        ]
        for run in validation_runs()
    ]
    return markdown_table(
        [
            "part",
            "method",
            "learning rate",
            "seed",
            "validation pass@1 at the start",
            "late pass@1",
            "late greedy accuracy",
            "minutes",
        ],
        rows,
    )


def comparison_summary(part: str) -> dict:
    return evidence(f"{COMPARISON}_{part}-lr{comparison_learning_rate(part):g}")


def spread(statistic: dict) -> str:
    """`mean ± half-width` over seeds; the value alone for one seed (no interval)."""
    return interval(statistic) if len(statistic["values"]) > 1 else fixed(statistic["mean"])


def real_model_comparison_table() -> str:
    rows = []
    for part in PART_LABELS:
        summary = comparison_summary(part)
        for method, late in summary["late"].items():
            negatives = summary["negatives"].get(method, {})
            rows.append(
                [
                    PART_LABELS[part],
                    METHOD_LABELS[method],
                    rate(summary["options"]["learning_rate"]),
                    str(len(late["pass@1"]["values"])),
                    spread(summary["start"]["pass@1"]),
                    spread(late["pass@1"]),
                    spread(late["greedy_accuracy"]),
                    fixed(late["mean_completion_tokens"]["mean"], 0),
                    fixed(negatives["weight_negative"]["mean"], 2) if negatives else "",
                    fixed(negatives["negative_truncated_fraction"]["mean"], 2) if negatives else "",
                ]
            )
    return markdown_table(
        [
            "part",
            "method",
            "learning rate",
            "seeds",
            "held-out pass@1 at the start",
            "late pass@1",
            "late greedy accuracy",
            "late tokens",
            "negatives' mean weight",
            "negatives truncated",
        ],
        rows,
    )


def verdict(difference: dict) -> str:
    """What a paired interval decides: above or below zero, or undecided (it holds 0, or one seed only)."""
    low, high = difference["mean"] - difference["ci95"], difference["mean"] + difference["ci95"]
    if len(difference["values"]) < 2:
        return "one seed: undecided"
    return "above" if low > 0 else "below" if high < 0 else "undecided"


def paired_shown(difference: dict) -> str:
    """A paired difference as the pages print it: `±mean ± half-width`, the mean alone for one seed."""
    return signed_interval(difference) if len(difference["values"]) > 1 else signed(difference["mean"])


TABLES = {
    "candidates": candidates_table,
    "whole-vocabulary": whole_vocabulary_table,
    "readme-run": readme_run_table,
    "loss-speed": loss_speed_table,
    "generation-speed": generation_speed_table,
    "support-cost": support_cost_table,
    "async-speed": async_speed_table,
    "rule-speed": rule_speed_table,
    "real-model-validation": real_model_validation_table,
    "real-model-comparison": real_model_comparison_table,
    "real-model-own-rate": own_rate_table,
}
