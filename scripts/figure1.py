"""Figure 1 of the TOPR paper in miniature: one fixed dataset sampled once from mu, trained far off-policy
(several epochs) with naive REINFORCE, PPO-clip, TIS, positives-only SFT and TOPR; held-out accuracy and invalid
rate over training steps, several seeds.

    .venv/bin/python scripts/figure1.py                       # full: 3 seeds, writes docs/figure1.{json,png}
    .venv/bin/python scripts/figure1.py --seeds 0 --epochs 2  # quicker

The paper's claims to test: naive REINFORCE collapses, PPO stalls (its clipped ratio stops learning from data
far from pi), TOPR keeps improving.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments import experiment_parser, mean_and_ci95, prepare, sample_fixed_dataset, save, train_offline

METHODS = {
    # name: TOPRConfig overrides; every method uses the paper's signal R - c with +1/-1 rewards and c = 0
    "naive_reinforce": {"topr_preset": "naive_reinforce"},
    "ppo": {"pg_variant": "ppo", "topr_ratio_level": "token"},
    "tis": {"topr_preset": "tis"},
    "sft_positives": {"topr_preset": "sft"},
    "topr": {"topr_preset": "topr"},
}


def run(options) -> dict:
    work, base_dir, held_out = prepare(options)
    results: dict = {"options": vars(options), "runs": {}}
    for seed in options.seeds:
        data = sample_fixed_dataset(base_dir, options.prompts, seed, work)
        positives = sum(r > 0 for r in data["reward"]) / len(data)
        for method in options.methods:
            run_result = train_offline(
                base_dir, data, work / f"run-{method}-seed{seed}", held_out, seed=seed, epochs=options.epochs,
                batch_size=options.batch_size, learning_rate=options.learning_rate, eval_every=options.eval_every,
                **METHODS[method],
            )
            results["runs"][f"{method}/seed{seed}"] = {"method": method, "seed": seed,
                                                       "dataset_positive_fraction": positives, **run_result}
            curve = run_result["curve"]
            print(f"[figure1] seed {seed} {method:<16} accuracy {curve[0]['accuracy']:.3f} -> "
                  f"{curve[-1]['accuracy']:.3f}  invalid {curve[-1]['invalid_rate']:.3f}  "
                  f"malformed {curve[-1]['malformed_rate']:.3f}  "
                  f"({run_result['seconds']:.0f}s)", flush=True)
    results["summary"] = summarise(results["runs"])
    return results


def summarise(runs: dict) -> dict:
    """Per method: mean and 95 % t-interval half-width of the final accuracy and invalid rate over seeds."""
    summary = {}
    for method in dict.fromkeys(run["method"] for run in runs.values()):
        finals = [run["curve"][-1] for run in runs.values() if run["method"] == method]
        summary[method] = {metric: mean_and_ci95([f[metric] for f in finals])
                           for metric in ("accuracy", "invalid_rate", "malformed_rate")}
    return summary


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(16, 4))
    for method in dict.fromkeys(run["method"] for run in results["runs"].values()):
        curves = [run["curve"] for run in results["runs"].values() if run["method"] == method]
        steps = [point["step"] for point in curves[0]]
        for axis, metric in zip(axes, ("accuracy", "invalid_rate", "malformed_rate")):
            means = [statistics.mean(curve[i][metric] for curve in curves) for i in range(len(steps))]
            axis.plot(steps, means, label=method)
            if len(curves) > 1:
                low = [min(curve[i][metric] for curve in curves) for i in range(len(steps))]
                high = [max(curve[i][metric] for curve in curves) for i in range(len(steps))]
                axis.fill_between(steps, low, high, alpha=0.15)
    for axis, title in zip(axes, ("held-out accuracy (greedy)", "invalid rate (no integer)",
                                  "malformed rate (not one integer then EOS)")):
        axis.set_title(title)
        axis.set_xlabel("optimizer step")
    axes[0].legend()
    figure.suptitle("Figure 1 in miniature: one fixed dataset from mu, trained off-policy (mean, min-max over seeds)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = experiment_parser(__doc__, output="docs/figure1", epochs=5.0, methods=METHODS)
    parser.add_argument("--eval-every", type=int, default=20)
    options = parser.parse_args(argv)
    results = run(options)
    save(results, options, plot)
    for method, row in results["summary"].items():
        print(f"{method:<16} final accuracy {row['accuracy']['mean']:.3f} ± {row['accuracy']['ci95']:.3f}   "
              f"invalid {row['invalid_rate']['mean']:.3f} ± {row['invalid_rate']['ci95']:.3f}   "
              f"malformed {row['malformed_rate']['mean']:.3f} ± {row['malformed_rate']['ci95']:.3f}")
    return results


if __name__ == "__main__":
    main()
