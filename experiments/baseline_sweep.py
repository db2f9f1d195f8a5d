"""Figures 5-6 of the TOPR paper in miniature: the baseline c decides the effective proportion of positives.

Per seed, one dataset is sampled from mu and subsampled to each of --proportions positives (`compose`, strategy
"target_proportion"; default 0.67, the paper's GSM8K regime and the reasoning testbed's own). For each, c is set so that Eq. 12's effective proportion p~ = p(1-c)/(1+(1-2p)c) spans
1 % to 100 % (p~ = 100 % is c = -1: negatives get weight 0, i.e. SFT on positives), and TOPR and TIS are trained
off-policy on it; final held-out accuracy per (p, p~, method).

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.baseline_sweep    # 3 seeds, writes experiments/evidence/figures5-6/baseline_sweep.{json,png}
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.baseline_sweep --task arithmetic --proportions 0.1 0.5 \
        --output experiments/evidence/stress/baseline_sweep                        # the low-p stress test

The paper's claims to test: accuracy depends strongly on p~ whatever the dataset's p (so the baseline can make
up for a badly balanced dataset); the best p~ is small but not zero (10-20 % on GSM8K); too few positives
(p~ -> 0) is harmful, and TOPR is more robust to the choice than TIS.
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


METHODS = {"topr": {"loss_type": "topr"}, "tis": {"loss_type": "tis"}}


def run(options) -> dict:
    from topr_trl.offline import compose

    work, testbed = prepare(options)
    results = results_header(options, testbed)
    for seed in options.seeds:
        sampled = sample_fixed_dataset(testbed, options.prompts, seed, work)
        for proportion in options.proportions:
            data, p = compose(sampled, "target_proportion", target_proportion=proportion, seed=seed)
            for target in options.targets:
                c = baseline_for(p, target)
                for method in options.methods:
                    key = f"p{proportion:g}/pt{target:g}/{method}/seed{seed}"
                    outcome = train_offline(
                        testbed,
                        data,
                        work / "runs" / f"sweep-{key.replace('/', '-')}",
                        seed=seed,
                        epochs=options.epochs,
                        batch_size=options.batch_size,
                        learning_rate=options.learning_rate,
                        topr_baseline=c,
                        eval_every=options.eval_every,
                        **METHODS[method],
                    )
                    results["runs"][key] = {
                        "proportion": proportion,
                        "measured_p": p,
                        "rows": len(data),
                        "target": target,
                        "baseline": c,
                        "method": method,
                        "seed": seed,
                        **outcome,
                    }
                    print(
                        f"[sweep] seed {seed} p={p:.3f} p~={target:<5g} c={c:+.3f} {method:<4} accuracy "
                        f"{outcome['curve'][0]['accuracy']:.3f} -> {outcome['curve'][-1]['accuracy']:.3f} "
                        f"({outcome['seconds']:.0f}s)",
                        flush=True,
                    )
    results["summary"] = summarise(results["runs"])
    results["late"], results["paired"] = summarise_late(results["runs"])
    return results


def summarise_late(runs: dict) -> tuple[dict, dict]:
    """Per "p/p~/method": the late accuracy (checkpoints in the last quarter of the steps; with no checkpoint
    between the start and the end, the final one), mean and 95 % CI over seeds; per "p/p~": TOPR − TIS, paired by
    seed, where both ran."""
    late: dict[str, dict[int, float]] = {}
    for run in runs.values():
        key = f"p{run['proportion']:g}/pt{run['target']:g}/{run['method']}"
        late.setdefault(key, {})[run["seed"]] = late_mean(run["curve"], "accuracy")
    paired = {}
    for key in late:
        setting, _, method = key.rpartition("/")
        if method == "topr" and f"{setting}/tis" in late:
            paired[setting] = paired_difference(late[key], late[f"{setting}/tis"])
    return {key: mean_and_ci95(list(values.values())) for key, values in late.items()}, paired


def summarise(runs: dict) -> dict:
    """{"p/p~/method": final accuracy mean and 95 % CI over seeds}, plus the common start accuracy."""
    groups: dict[str, list[float]] = {}
    for run in runs.values():
        key = f"p{run['proportion']:g}/pt{run['target']:g}/{run['method']}"
        groups.setdefault(key, []).append(run["curve"][-1]["accuracy"])
    summary = {key: mean_and_ci95(values) for key, values in groups.items()}
    summary["start_accuracy"] = statistics.mean(run["curve"][0]["accuracy"] for run in runs.values())
    return summary


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    options = results["options"]
    summary = results["summary"]
    figure, axes = plt.subplots(
        1, len(options["proportions"]), figsize=(max(8.0, 5.5 * len(options["proportions"])), 4.5), squeeze=False
    )
    for axis, proportion in zip(axes[0], options["proportions"], strict=False):
        for method in options["methods"]:
            rows = [summary[f"p{proportion:g}/pt{t:g}/{method}"] for t in options["targets"]]
            axis.errorbar(
                options["targets"],
                [r["mean"] for r in rows],
                yerr=[0 if r["ci95"] != r["ci95"] else r["ci95"] for r in rows],
                capsize=3,
                marker="o",
                label=method.upper(),
            )
        axis.axhline(summary["start_accuracy"], color="grey", linestyle=":", label="start")
        axis.axvspan(0.1, 0.2, color="green", alpha=0.08, label="paper's best p~")
        axis.set_xscale("log")
        axis.set_ylim(-0.02, 1.02)  # a 3-seed t-interval can reach past [0, 1]; accuracy cannot
        axis.set_xlabel("effective proportion of positives p~ (set by the baseline c)")
        axis.set_title(f"dataset with {proportion:.0%} positives")
    axes[0][0].set_ylabel(f"final {results['measure']}\n(mean, 95 % CI)", fontsize=8)
    axes[0][0].legend()
    figure.suptitle(f"Figures 5-6 in miniature ({results['task']} task): the baseline sets p~; TOPR vs TIS")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = experiment_parser(
        __doc__, output="experiments/evidence/figures5-6/baseline_sweep", epochs=3.0, methods=METHODS
    )
    parser.add_argument(
        "--proportions",
        type=float,
        nargs="+",
        default=[0.67],
        help="proportions of positives p the dataset is subsampled to",
    )
    parser.add_argument(
        "--targets",
        type=float,
        nargs="+",
        default=[0.01, 0.05, 0.1, 0.2, 0.35, 0.6, 1.0],
        help="effective proportions p~ the baseline is solved for",
    )
    parser.add_argument(
        "--eval_every",
        type=int,
        default=0,
        help="evaluate every this many steps (0: start and end only); the late accuracy averages "
        "the checkpoints in the last quarter of the steps",
    )
    options = parser.parse_args(argv)
    for target in options.targets:
        if not 0 < target <= 1:
            parser.error(f"--targets must lie in (0, 1]; got {target}")
    results = run(options)
    save(results, options, plot)
    print(f"start accuracy {results['summary']['start_accuracy']:.3f}")
    for key, row in results["summary"].items():
        if key != "start_accuracy":
            late = results["late"][key]
            print(
                f"{key:<24} final accuracy {row['mean']:.3f} ± {row['ci95']:.3f}  "
                f"late {late['mean']:.3f} ± {late['ci95']:.3f}"
            )
    for setting, difference in results["paired"].items():
        print(f"{setting:<16} TOPR - TIS (late, paired) {difference['mean']:+.3f} ± {difference['ci95']:.3f}")
    return results


if __name__ == "__main__":
    main()
