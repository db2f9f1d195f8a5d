"""Figure 7 of the TOPR paper in miniature: untruncated importance sampling against TOPR on a negatively skewed
dataset, with gradient clipping at 100 (loose enough that clipping does not hide what the ratio does).

Per seed, one dataset is sampled from mu and subsampled to --proportion positives (default 0.4: the paper's
stress test with 60 % negatives); off-policy REINFORCE with the plain
sequence ratio pi/mu (limits (0, inf, 0, inf)) and TOPR (1, 1, 0, 1) are trained on it for several epochs.
Recorded: gradient norm per step (before clipping), the step's largest sequence ratio pi/mu among negatives and
positives (before truncation), and held-out accuracy over steps. Reported per method: the late accuracy (the
checkpoints in the last quarter of the steps), how many seeds collapsed (late accuracy below the start by more
than --collapse_margin, fixed before the run), and TOPR's paired difference to untruncated IS.

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.figure7     # 3 seeds, writes experiments/evidence/figure7/figure7.{json,png}
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.figure7 --task arithmetic --proportion 0.1 --eval_every 20 \
        --output experiments/evidence/stress/figure7                            # the low-p stress test

The paper's claim to test: with mostly negative data, untruncated IS weights on negatives grow as pi moves away
from mu, gradient norms explode and accuracy collapses; TOPR's truncation keeps them bounded.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments.common import (
    baseline_for,
    experiment_parser,
    late_mean,
    mean_and_ci95,
    paired_difference,
    prepare,
    results_header,
    sample_fixed_dataset,
    save,
    train_offline,
)


METHODS = {"untruncated_is": {"loss_type": "off_policy_reinforce"}, "topr": {"loss_type": "topr"}}


def run(options) -> dict:
    from topr_trl.offline import compose

    work, testbed = prepare(options)
    results = results_header(options, testbed)
    for seed in options.seeds:
        sampled = sample_fixed_dataset(testbed, options.prompts, seed, work)
        data, p = compose(sampled, "target_proportion", target_proportion=options.proportion, seed=seed)
        baseline = 0.0 if options.effective_proportion is None else baseline_for(p, options.effective_proportion)
        for method in options.methods:
            outcome = train_offline(
                testbed,
                data,
                work / "runs" / f"figure7-{method}-seed{seed}",
                seed=seed,
                epochs=options.epochs,
                batch_size=options.batch_size,
                learning_rate=options.learning_rate,
                max_grad_norm=options.max_grad_norm,
                eval_every=options.eval_every,
                topr_baseline=baseline,
                **METHODS[method],
            )
            norms = [entry["grad_norm"] for entry in outcome["grad_norms"]]
            results["runs"][f"{method}/seed{seed}"] = {
                "method": method,
                "seed": seed,
                "measured_p": p,
                "baseline": baseline,
                **outcome,
            }
            print(
                f"[figure7] seed {seed} p={p:.3f} {method:<15} accuracy {outcome['curve'][0]['accuracy']:.3f} -> "
                f"{outcome['curve'][-1]['accuracy']:.3f}  grad norm median {statistics.median(norms):.3g} "
                f"max {max(norms):.3g} ({outcome['seconds']:.0f}s)",
                flush=True,
            )
    results["summary"] = summarise(results["runs"], options.max_grad_norm, options.collapse_margin)
    return results


def late_accuracy(run: dict) -> float:
    return late_mean(run["curve"], "accuracy")


def summarise(runs: dict, clip: float, collapse_margin: float = 0.1) -> dict:
    """Per method over seeds: final and late accuracy, the seeds whose late accuracy fell more than `collapse_margin`
    below the start, the largest negative sequence ratio, maximum and median gradient norm, share of steps above
    `clip`; TOPR's paired late-accuracy difference to each other method."""
    summary = {}
    late = {}
    for method in dict.fromkeys(run["method"] for run in runs.values()):
        chosen = [run for run in runs.values() if run["method"] == method]
        late[method] = {run["seed"]: late_accuracy(run) for run in chosen}
        norms = [[entry["grad_norm"] for entry in run["grad_norms"]] for run in chosen]
        largest = [
            max(
                (entry.get("topr/ratio_negative/max", float("nan")) for entry in run.get("ratio_maxima", [])),
                default=float("nan"),
            )
            for run in chosen
        ]
        summary[method] = {
            "late_accuracy": mean_and_ci95(list(late[method].values())),
            "collapsed_seeds": [
                run["seed"]
                for run in chosen
                if late[method][run["seed"]] < run["curve"][0]["accuracy"] - collapse_margin
            ],
            "largest_negative_ratio": largest,
            "accuracy": mean_and_ci95([run["curve"][-1]["accuracy"] for run in chosen]),
            "max_grad_norm": mean_and_ci95([max(n) for n in norms]),
            "median_grad_norm": mean_and_ci95([statistics.median(n) for n in norms]),
            "clipped_step_fraction": mean_and_ci95([sum(x > clip for x in n) / len(n) for n in norms]),
        }
    if "topr" in late:
        for method in late:
            if method != "topr":
                summary["topr"][f"late_minus_{method}"] = paired_difference(late["topr"], late[method])
    return summary


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (norm_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"untruncated_is": "tab:red", "topr": "tab:blue"}
    for _key, run in results["runs"].items():
        colour = colours.get(run["method"])
        label = run["method"] if run["seed"] == results["options"]["seeds"][0] else None
        norm_axis.plot(
            [e["step"] for e in run["grad_norms"]],
            [e["grad_norm"] for e in run["grad_norms"]],
            color=colour,
            alpha=0.6,
            label=label,
        )
        accuracy_axis.plot(
            [point["step"] for point in run["curve"]],
            [point["accuracy"] for point in run["curve"]],
            color=colour,
            alpha=0.6,
            marker=".",
            label=label,
        )
    norm_axis.axhline(results["options"]["max_grad_norm"], color="grey", linestyle=":", label="clip")
    norm_axis.set_yscale("log")
    norm_axis.set_title("gradient norm before clipping")
    accuracy_axis.set_title(results["measure"], fontsize=9)
    for axis in (norm_axis, accuracy_axis):
        axis.set_xlabel("optimizer step")
        axis.legend()
    figure.suptitle(
        f"Figure 7 in miniature: {results['options']['proportion']:.0%} positives, gradient clipping at "
        f"{results['options']['max_grad_norm']:g} (one line per seed)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = experiment_parser(__doc__, output="experiments/evidence/figure7/figure7", epochs=15.0, methods=METHODS)
    parser.add_argument("--proportion", type=float, default=0.4, help="share of positives kept in the dataset")
    parser.add_argument(
        "--effective_proportion",
        type=float,
        default=None,
        help="set the baseline c so that Eq. 12's p~ equals this (default: c = 0, p~ = p)",
    )
    parser.add_argument("--max_grad_norm", type=float, default=100.0)
    parser.add_argument("--eval_every", type=int, default=40)
    parser.add_argument(
        "--collapse_margin",
        type=float,
        default=0.1,
        help="a run has collapsed when its late accuracy is this far below its start",
    )
    options = parser.parse_args(argv)
    results = run(options)
    save(results, options, plot)
    for method, row in results["summary"].items():
        print(
            f"{method:<15} late accuracy {row['late_accuracy']['mean']:.3f} ± {row['late_accuracy']['ci95']:.3f}  "
            f"collapsed seeds {row['collapsed_seeds']}  "
            f"final accuracy {row['accuracy']['mean']:.3f} ± {row['accuracy']['ci95']:.3f}  "
            f"max grad norm {row['max_grad_norm']['mean']:.3g}  median {row['median_grad_norm']['mean']:.3g}"
        )
    return results


if __name__ == "__main__":
    main()
