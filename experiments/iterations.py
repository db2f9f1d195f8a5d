"""Iterated offline TOPR in miniature (the paper's Section 5 iterations, mu_i = pi_{i-1}) with three ways of
composing each iteration's data: uniform (every sample), positives only (rejection sampling, i.e. SFT), and Anna
Karenina (per prompt the first correct completion and every incorrect one).

Each iteration samples 8 completions for each training prompt from the current model, composes the data, trains one
TOPR pass on it with the paper's signal R - c (c = 0, or the c giving Eq. 12's p~ = --effective_proportion over
the iteration's data; `--signal advantage`: GRPO's group advantage), and evaluates the testbed's held-out measure.

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.iterations       # 3 seeds x 3 strategies x 3 iterations, experiments/evidence/iterations/iterations.*
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.iterations --steps_per_iteration 32   # every composition 32 steps
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.iterations --task arithmetic --prompts 256 --eval_prompts 200 \
        --output experiments/evidence/stress/iterations                             # the low-p stress test

One pass over a curated iteration is fewer optimizer steps than over the uniform one (Anna Karenina keeps ~40 % of
the rows): with --steps_per_iteration N every composition trains N steps per iteration (several passes over a small
composition), so compositions are compared at equal steps; the steps each run took are recorded either way.

The paper's claims to test: accuracy keeps rising over iterations; keeping negatives (uniform, Anna Karenina)
beats positives only, and Anna Karenina, which spends the batch on negatives once a prompt is solved, is best.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from experiments.common import (
    experiment_parser,
    late_mean,
    mean_and_ci95,
    paired_difference,
    prepare,
    results_header,
    resummarise_if_asked,
    save,
)


STRATEGIES = ("uniform", "positives_only", "anna_karenina")


def run(options) -> dict:
    import torch

    from topr_trl.commands.iterations import IterationSettings, run_iterations

    work, testbed = prepare(options)
    results = results_header(options, testbed)
    baseline = (
        {"topr_baseline": 0.0}
        if options.effective_proportion is None
        else {"topr_target_effective_proportion": options.effective_proportion, "topr_baseline_scope": "dataset"}
    )
    for seed in options.seeds:
        prompts = testbed.prompts(options.prompts, seed)
        for strategy in options.strategies:
            torch.manual_seed(seed)
            settings = IterationSettings(
                num_iterations=options.iterations,
                num_completions=8,
                max_new_tokens=testbed.max_new_tokens,
                composition=strategy,
                save_steps=10_000,
                backend="transformers",
                train_overrides=dict(
                    learning_rate=options.learning_rate,
                    lr_scheduler_type="constant",
                    per_device_train_batch_size=options.batch_size,
                    topr_signal=options.signal,
                    use_cpu=True,
                    bf16=False,
                    gradient_checkpointing=False,
                    logging_steps=10,
                    seed=seed,
                    disable_tqdm=True,
                    max_grad_norm=1.0,
                    **({} if options.signal == "advantage" else baseline),
                    **({} if options.steps_per_iteration is None else {"max_steps": options.steps_per_iteration}),
                ),
            )
            folder = work / "iterations" / f"{testbed.task}-{strategy}-{options.signal}-seed{seed}"
            shutil.rmtree(folder, ignore_errors=True)  # never resumed from a run with other settings
            eval_seed = testbed.evaluation_seed(seed)  # this training seed's held-out draw
            summaries = run_iterations(
                str(testbed.base_dir),
                prompts,
                testbed.reward,
                folder,
                settings,
                evaluate=lambda model, tokenizer, eval_seed=eval_seed: testbed.evaluate(model, tokenizer, eval_seed),
            )
            curve = [summaries[0]["evaluation_before"]["accuracy"]] + [s["evaluation"]["accuracy"] for s in summaries]
            results["runs"][f"{strategy}/seed{seed}"] = {
                "strategy": strategy,
                "seed": seed,
                "accuracy": curve,
                "proportion_of_positives": [s["proportion_of_positives"] for s in summaries],
                "rows": [s["rows"] for s in summaries],
                "steps": [s["train_steps"] for s in summaries],
                "seconds": sum(s["seconds"] for s in summaries),
            }
            print(
                f"[iterations] seed {seed} {strategy:<15} accuracy "
                + " -> ".join(f"{a:.3f}" for a in curve)
                + "  p "
                + ", ".join(f"{s['proportion_of_positives']:.2f}" for s in summaries)
                + "  steps "
                + ", ".join(str(s["train_steps"]) for s in summaries),
                flush=True,
            )
    update_summary(results)
    return results


def summarise(runs: dict) -> dict:
    """Per strategy: accuracy after each iteration (index 0 = before any), mean and 95 % CI over seeds."""
    summary = {}
    for strategy in dict.fromkeys(run["strategy"] for run in runs.values()):
        curves = [run["accuracy"] for run in runs.values() if run["strategy"] == strategy]
        summary[strategy] = [mean_and_ci95([curve[i] for curve in curves]) for i in range(len(curves[0]))]
    return summary


def late_values(runs: dict, strategy: str) -> dict[int, float]:
    """Per seed, a strategy's robust end point: the mean accuracy over the iterations in the last quarter of the
    run (`experiments.late_mean` with the iteration as the step; the base model excluded)."""
    return {
        run["seed"]: late_mean([{"step": i, "accuracy": a} for i, a in enumerate(run["accuracy"])], "accuracy")
        for run in runs.values()
        if run["strategy"] == strategy
    }


def compare(runs: dict) -> dict:
    """Every pair of strategies that ran ("A-B", in STRATEGIES' order): the paired difference of the late values."""
    ran = [s for s in STRATEGIES if any(run["strategy"] == s for run in runs.values())]
    return {
        f"{first}-{second}": paired_difference(late_values(runs, first), late_values(runs, second))
        for i, first in enumerate(ran)
        for second in ran[i + 1 :]
    }


def update_summary(results: dict) -> None:
    """`results`' per-iteration summary, late values and paired comparisons, from its runs."""
    results["summary"] = summarise(results["runs"])
    results["late"] = {
        strategy: mean_and_ci95(list(late_values(results["runs"], strategy).values()))
        for strategy in results["summary"]
    }
    results["paired"] = compare(results["runs"])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for strategy, points in results["summary"].items():
        axis.errorbar(
            range(len(points)),
            [p["mean"] for p in points],
            yerr=[0 if p["ci95"] != p["ci95"] else p["ci95"] for p in points],
            marker="o",
            capsize=3,
            label=strategy,
        )
    axis.set_xlabel("iteration (0 = base model)")
    axis.set_ylabel(f"{results['measure']}\n(mean, 95 % CI)", fontsize=8)
    axis.set_title(f"Iterated offline TOPR ({results['task']} task): data composition")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = experiment_parser(__doc__, output="experiments/evidence/iterations/iterations", epochs=None, prompts=128)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument(
        "--signal",
        default="reward",
        choices=["reward", "advantage"],
        help="reward: the paper's R - c with c = 0; advantage: GRPO's group advantage (uniform only: "
        "curated data has no whole groups)",
    )
    parser.add_argument(
        "--effective_proportion",
        type=float,
        default=None,
        help="with --signal reward: set c per iteration so that Eq. 12's p~ equals this over the "
        "iteration's data (default: c = 0)",
    )
    parser.add_argument(
        "--steps_per_iteration",
        type=int,
        default=None,
        help="optimizer steps per iteration for every composition (default: one pass over the "
        "iteration's data, so curated compositions take fewer steps)",
    )
    rewritten = resummarise_if_asked(parser, argv, update_summary, plot)
    if rewritten is not None:
        return rewritten
    options = parser.parse_args(argv)
    if options.steps_per_iteration is not None and options.steps_per_iteration < 1:
        parser.error("--steps_per_iteration must be >= 1")
    if options.signal == "advantage" and set(options.strategies) != {"uniform"}:
        parser.error("--signal advantage needs whole prompt groups: use it with --strategies uniform")
    results = run(options)
    save(results, options, plot)
    for strategy, points in results["summary"].items():
        print(f"{strategy:<15} " + " -> ".join(f"{p['mean']:.3f}±{p['ci95']:.3f}" for p in points))
    for pair, difference in results["paired"].items():
        print(f"paired late accuracy {pair:<30} {difference['mean']:+.3f} ± {difference['ci95']:.3f}")
    return results


if __name__ == "__main__":
    main()
