"""Figure 1 of the TOPR paper in miniature: one fixed dataset sampled once from mu, trained off-policy (several
epochs) with naive REINFORCE, PPO-clip, TIS, positives-only SFT and TOPR, and TOPR on data sampled from another
model (far off-policy); held-out accuracy and invalid rate over training steps, several seeds. On the reasoning
testbed (the default) the positives-only row is also the paper's Figure 4 comparison: pass@1 on the problems with
at least 2 carries, where the planted error strikes, is reported beside the overall pass@1. `topr_target` is TOPR
with the baseline c solved once on each fixed dataset for Eq. 12's p~ = --target_effective_proportion (the paper
sets c; the other methods use c = 0).

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.figure1          # 3 seeds, writes experiments/evidence/figure1/figure1.{json,png}
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.figure1 --task arithmetic --output experiments/evidence/stress/figure1

The paper's claims to test: naive REINFORCE collapses, PPO stalls (its clipped ratio stops learning from data
far from pi), TOPR keeps improving; far off-policy data still helps TOPR.

What counts is fixed by the options before a run (pre-registration): the seeds (--seeds), the checkpoints
(--eval_every), the robust end point (each run's mean of every metric over the checkpoints in the last
--late_share of its steps, `experiments.late_mean`) and the paired comparisons (--compare A-B: per seed, A's late
value minus B's, mean and 95 % t-interval over seeds). The final checkpoint is reported beside them.

At every checkpoint each run also records where PPO's clip would stop the gradient on its fixed dataset (the share
of the dataset's tokens with pi/mu above 1.2 on positives or below 0.8 on negatives, `experiments.
clipped_token_shares`, computed from the model's forward pass); `clipped_share` in the JSON has its seed means by
step, per method.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from experiments.common import (
    clipped_token_shares,
    experiment_parser,
    late_mean,
    mean_and_ci95,
    merge_results,
    paired_difference,
    prepare,
    results_header,
    sample_fixed_dataset,
    save,
    train_offline,
)


METHODS = {
    # name: TOPRConfig overrides; every method uses the paper's signal R - c with +1/-1 rewards and c = 0
    "naive_reinforce": {"loss_type": "naive_reinforce"},
    "ppo": {"loss_type": "ppo", "topr_ratio_level": "token"},
    "tis": {"loss_type": "tis"},
    "sft_positives": {"loss_type": "sft"},
    "topr": {"loss_type": "topr"},
    # TOPR on data sampled from another model (`--far_error_rate`): pi starts from the base model, mu is not it
    "topr_far_off_policy": {"loss_type": "topr"},
    # TOPR with the baseline c solved once on the fixed dataset for Eq. 12's p~ = --target_effective_proportion
    "topr_target": {"loss_type": "topr", "topr_baseline_scope": "dataset"},
    # TOPR with pi scored over the whole vocabulary although mu truncated (--sampling_top_k/--sampling_top_p): the
    # rows' `behaviour_sampling` dropped, as before pi was put on mu's support; the control for that fix
    "topr_whole_vocabulary": {"loss_type": "topr"},
}
UNSAID_SAMPLING = {"topr_whole_vocabulary"}
"""Methods trained on the fixed dataset without its `behaviour_sampling` column."""


def far_behaviour_model(options, work: Path, testbed) -> tuple:
    """(model, tokenizer, path) of the other model the far off-policy data is sampled from: the reasoning testbed's
    warm start with `--far_error_rate` and seed 1 (another init, other warm-start batches, another error rate)."""
    from topr_trl.tasks.reasoning import WarmStartSettings, build_reasoning_warm_model

    if testbed.task != "reasoning":
        raise SystemExit("topr_far_off_policy needs --task reasoning (the behaviour model is a testbed warm start)")
    settings = WarmStartSettings(
        digits=options.digits,
        error_rate=options.far_error_rate,
        steps=options.warm_steps,
        spurious_carry_rate=options.spurious_carry_rate,
        seed=1,
    )
    return build_reasoning_warm_model(work / "cache", settings)


def method_overrides(method: str, options) -> dict:
    """The TOPRConfig fields of `method`: METHODS' entry, and for topr_target its p~ from the options."""
    if method == "topr_target":
        return {**METHODS[method], "topr_target_effective_proportion": options.target_effective_proportion}
    return METHODS[method]


def run(options) -> dict:
    work, testbed = prepare(options)
    results = results_header(options, testbed)
    far = None
    if "topr_far_off_policy" in options.methods:
        far_model, far_tokenizer, far = far_behaviour_model(options, work, testbed)
        results["far_behaviour_model"] = str(far)
        results["far_behaviour_start"] = testbed.evaluate(
            far_model, far_tokenizer, testbed.evaluation_seed(options.seeds[0])
        )
    for seed in options.seeds:
        truncation = dict(top_k=options.sampling_top_k, top_p=options.sampling_top_p)
        data = {"base": sample_fixed_dataset(testbed, options.prompts, seed, work, **truncation)}
        for method in options.methods:
            source = "far" if method == "topr_far_off_policy" else "base"
            if source not in data:
                data[source] = sample_fixed_dataset(testbed, options.prompts, seed, work, behaviour=far, **truncation)
            if method in UNSAID_SAMPLING:
                source = "unsaid"
                data.setdefault(source, data["base"].remove_columns("behaviour_sampling"))
            positives = sum(r > 0 for r in data[source]["reward"]) / len(data[source])
            run_result = train_offline(
                testbed,
                data[source],
                work / "runs" / f"figure1-{method}-seed{seed}",
                seed=seed,
                epochs=options.epochs,
                batch_size=options.batch_size,
                learning_rate=options.learning_rate,
                eval_every=options.eval_every,
                probe=lambda model, rows=data[source]: clipped_token_shares(model, rows),
                **method_overrides(method, options),
            )
            results["runs"][f"{method}/seed{seed}"] = {
                "method": method,
                "seed": seed,
                "dataset_positive_fraction": positives,
                **run_result,
            }
            curve = run_result["curve"]
            weights = [entry["weight_negative"] for entry in run_result["negative_weights"]]
            print(
                f"[figure1] seed {seed} {method:<20} p {positives:.3f} negatives' weight "
                f"{statistics.mean(weights) if weights else float('nan'):.3g}  "
                + "  ".join(f"{metric} {curve[0][metric]:.3f} -> {curve[-1][metric]:.3f}" for metric in testbed.metrics)
                + f"  ({run_result['seconds']:.0f}s)",
                flush=True,
            )
    summarise_all(results, testbed.metrics, options)
    return results


def summarise_all(results: dict, metrics, options) -> None:
    """The final-checkpoint summary, the late values and the pre-registered paired comparisons of `results`' runs."""
    results["summary"] = summarise(results["runs"], metrics)
    results["late"] = summarise_late(results["runs"], metrics, options.late_share)
    results["paired"] = compare(results["runs"], metrics, options.compare, options.late_share)
    results["clipped_share"] = clipped_share_by_step(results["runs"])
    results["negative_weight"] = negative_weight_by_method(results["runs"])


def negative_weight_by_method(runs: dict) -> dict:
    """Per method: mean and 95 % t-interval over seeds of each run's mean truncated weight on negatives (where the
    runs logged it): how hard negatives pushed."""
    outcome = {}
    for method in dict.fromkeys(run["method"] for run in runs.values()):
        means = [
            statistics.mean(entry["weight_negative"] for entry in run["negative_weights"])
            for run in runs.values()
            if run["method"] == method and run.get("negative_weights")
        ]
        if means:
            outcome[method] = mean_and_ci95(means)
    return outcome


def clipped_share_by_step(runs: dict) -> dict:
    """Per method, at each checkpoint: the seed mean of the share of the fixed dataset's tokens PPO's clip would
    stop (`experiments.clipped_token_shares`, by the signal's sign), where the runs recorded it."""
    outcome = {}
    for method in dict.fromkeys(run["method"] for run in runs.values()):
        curves = [run["curve"] for run in runs.values() if run["method"] == method]
        if not all("clipped_share" in point for curve in curves for point in curve):
            continue
        outcome[method] = [
            {
                "step": points[0]["step"],
                **{
                    key: statistics.mean(point[key] for point in points)
                    for key in ("clipped_share", "clipped_share_positive", "clipped_share_negative")
                },
            }
            for points in zip(*curves, strict=False)
        ]
    return outcome


def summarise(runs: dict, metrics) -> dict:
    """Per method: mean and 95 % t-interval half-width over seeds of each metric's final value."""
    summary = {}
    for method in dict.fromkeys(run["method"] for run in runs.values()):
        finals = [run["curve"][-1] for run in runs.values() if run["method"] == method]
        summary[method] = {metric: mean_and_ci95([f[metric] for f in finals]) for metric in metrics}
    return summary


def late_values(runs: dict, method: str, metric: str, share: float) -> dict[int, float]:
    """Per seed, a method's robust end point of `metric`: its mean over the checkpoints in the last `share` of the
    run's steps (the start excluded)."""
    return {run["seed"]: late_mean(run["curve"], metric, share) for run in runs.values() if run["method"] == method}


def summarise_late(runs: dict, metrics, share: float) -> dict:
    """Per method: mean and 95 % t-interval over seeds of each metric's robust end point (`late_values`)."""
    return {
        method: {metric: mean_and_ci95(list(late_values(runs, method, metric, share).values())) for metric in metrics}
        for method in dict.fromkeys(run["method"] for run in runs.values())
    }


def compare(runs: dict, metrics, pairs: list[str], share: float) -> dict:
    """Each pre-registered pair "A-B" with both methods run: per metric, the paired difference of the late values."""
    ran = {run["method"] for run in runs.values()}
    outcome = {}
    for pair in pairs:
        first, second = pair.split("-")
        if first in ran and second in ran:
            outcome[pair] = {
                metric: paired_difference(
                    late_values(runs, first, metric, share), late_values(runs, second, metric, share)
                )
                for metric in metrics
            }
    return outcome


def comparison(text: str) -> str:
    """An argparse type: "A-B" with A and B methods of this script."""
    first, dash, second = text.partition("-")
    if not dash or first not in METHODS or second not in METHODS or first == second:
        raise argparse.ArgumentTypeError(f"{text!r}: expected METHOD-METHOD, two of {list(METHODS)}")
    return text


TITLES = {
    "accuracy": "held-out accuracy",
    "greedy_accuracy": "greedy accuracy",
    "invalid_rate": "invalid rate",
    "malformed_rate": "malformed rate (not one integer then EOS)",
    "pass@1_carries>=2": "pass@1 on problems with >= 2 carries",
}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(next(iter(results["summary"].values())))
    figure, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    axes = axes[0]
    for method in dict.fromkeys(run["method"] for run in results["runs"].values()):
        curves = [run["curve"] for run in results["runs"].values() if run["method"] == method]
        steps = [point["step"] for point in curves[0]]
        for axis, metric in zip(axes, metrics, strict=False):
            means = [statistics.mean(curve[i][metric] for curve in curves) for i in range(len(steps))]
            axis.plot(steps, means, label=method)
            if len(curves) > 1:
                low = [min(curve[i][metric] for curve in curves) for i in range(len(steps))]
                high = [max(curve[i][metric] for curve in curves) for i in range(len(steps))]
                axis.fill_between(steps, low, high, alpha=0.15)
    for axis, metric in zip(axes, metrics, strict=False):
        axis.set_title(TITLES.get(metric, metric))
        axis.set_xlabel("optimizer step")
    axes[0].set_ylabel(results["measure"], fontsize=8)
    axes[0].legend(fontsize=8)
    figure.suptitle(
        f"Figure 1 in miniature ({results['task']} task): one fixed dataset from mu, trained off-policy "
        "(mean, min-max over seeds)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = experiment_parser(
        __doc__, output="experiments/evidence/figure1/figure1", epochs=4.0, prompts=128, methods=METHODS
    )
    parser.add_argument("--eval_every", type=int, default=32)
    parser.add_argument(
        "--late_share",
        type=float,
        default=0.25,
        help="the robust end point averages the checkpoints in this last share of the steps",
    )
    parser.add_argument(
        "--compare",
        nargs="*",
        type=comparison,
        default=["topr-sft_positives", "topr-tis", "topr-ppo", "topr-naive_reinforce", "topr-topr_far_off_policy"],
        help="pre-registered paired comparisons A-B of the late values (pairs whose methods ran)",
    )
    parser.add_argument(
        "--sampling_top_k", type=int, default=0, help="mu samples the fixed datasets with this top-k (0: off)"
    )
    parser.add_argument(
        "--sampling_top_p", type=float, default=1.0, help="mu samples the fixed datasets with this top-p (1: off)"
    )
    parser.add_argument(
        "--far_error_rate",
        type=float,
        default=0.5,
        help="topr_far_off_policy: planted carry-drop rate of the other model the data comes from",
    )
    parser.add_argument(
        "--target_effective_proportion",
        type=float,
        default=0.5,
        help="topr_target: the p~ (Eq. 12) its baseline c is solved for on each fixed dataset",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        default=None,
        help="merge these result files of one command run on disjoint seeds (e.g. one per core) into "
        "--output, with the late values and comparisons of their own options; trains nothing",
    )
    options = parser.parse_args(argv)
    if options.merge:
        results = merge_results(options.merge)
        recorded = argparse.Namespace(**{**results["options"], "output": options.output})
        summarise_all(results, list(next(iter(results["summary"].values()))), recorded)
        results["options"] = vars(recorded)
        save(results, recorded, plot)
        return results
    results = run(options)
    save(results, options, plot)
    print(f"measure: {results['measure']}")
    for method, row in results["summary"].items():
        print(
            f"{method:<20} final "
            + "   ".join(f"{metric} {value['mean']:.3f} ± {value['ci95']:.3f}" for metric, value in row.items())
        )
    for method, row in results["late"].items():
        print(
            f"{method:<20} late  "
            + "   ".join(f"{metric} {value['mean']:.3f} ± {value['ci95']:.3f}" for metric, value in row.items())
        )
    for pair, row in results["paired"].items():
        print(
            f"{pair:<32} paired late "
            + "   ".join(f"{metric} {value['mean']:+.3f} ± {value['ci95']:.3f}" for metric, value in row.items())
        )
    return results


if __name__ == "__main__":
    main()
