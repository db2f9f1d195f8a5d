"""Figure 1 of the TOPR paper in miniature: one fixed dataset sampled once from mu, trained far off-policy
(several epochs) with naive REINFORCE, PPO-clip, TIS, positives-only SFT and TOPR; held-out accuracy and invalid
rate over training steps, several seeds.

    .venv/bin/python scripts/figure1.py                       # full: 3 seeds, writes docs/figure1.{json,png}
    .venv/bin/python scripts/figure1.py --seeds 0 --epochs 2  # quicker

The paper's claims to test: naive REINFORCE collapses, PPO stalls (its clipped ratio stops learning from data
far from pi), TOPR keeps improving.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from experiments import mean_and_ci95, prepare_base, sample_fixed_dataset, train_offline

METHODS = {
    # name: TOPRConfig overrides; every method uses the paper's signal R - c with +1/-1 rewards and c = 0
    "naive_reinforce": {"topr_preset": "naive_reinforce"},
    "ppo": {"pg_variant": "ppo", "topr_ratio_level": "token"},
    "tis": {"topr_preset": "tis"},
    "sft_positives": {"topr_preset": "sft"},
    "topr": {"topr_preset": "topr"},
}


def run(options) -> dict:
    from topr_trl.tasks import make_arithmetic_dataset

    work = Path(options.work_dir)
    base_dir = prepare_base(work, options.base_accuracy)
    held_out = make_arithmetic_dataset(options.eval_prompts, 2, seed=2)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--prompts", type=int, default=128, help="prompts in the fixed dataset (x8 completions)")
    parser.add_argument("--epochs", type=float, default=5.0, help="passes over the fixed dataset")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--base-accuracy", type=float, default=0.3)
    parser.add_argument("--work-dir", default="outputs/figure1")
    parser.add_argument("--output", default="docs/figure1", help="writes OUTPUT.json and OUTPUT.png")
    options = parser.parse_args(argv)
    results = run(options)
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(options.output + ".json").write_text(json.dumps(results, indent=2))
    plot(results, Path(options.output + ".png"))
    for method, row in results["summary"].items():
        print(f"{method:<16} final accuracy {row['accuracy']['mean']:.3f} ± {row['accuracy']['ci95']:.3f}   "
              f"invalid {row['invalid_rate']['mean']:.3f} ± {row['invalid_rate']['ci95']:.3f}   "
              f"malformed {row['malformed_rate']['mean']:.3f} ± {row['malformed_rate']['ci95']:.3f}")
    return results


if __name__ == "__main__":
    main()
