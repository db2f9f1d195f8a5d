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
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

METHODS = {
    # name: TOPRConfig overrides; every method uses the paper's signal R - c with +1/-1 rewards and c = 0
    "naive_reinforce": {"topr_preset": "naive_reinforce"},
    "ppo": {"pg_variant": "ppo", "topr_ratio_level": "token"},
    "tis": {"topr_preset": "tis"},
    "sft_positives": {"topr_preset": "sft"},
    "topr": {"topr_preset": "topr"},
}


def run(options) -> dict:
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.offline import generate_offline_dataset, stored_reward
    from topr_trl.tasks import accuracy, arithmetic_reward, build_warm_model, make_arithmetic_dataset

    warnings.filterwarnings("ignore", message=".*unbounded.*")
    work = Path(options.work_dir)
    base_dir = work / "base"
    build_warm_model(base_dir, digits=2, target_accuracy=options.base_accuracy, seed=0)
    held_out = make_arithmetic_dataset(options.eval_prompts, 2, seed=2)

    class Evaluate(TrainerCallback):
        def __init__(self, trainer_ref):
            self.trainer_ref, self.curve = trainer_ref, []

        def _evaluate(self, step):
            trainer = self.trainer_ref[0]
            self.curve.append({"step": step, **accuracy(trainer.model, trainer.processing_class, held_out)})

        def on_train_begin(self, args, state, control, **kwargs):
            self._evaluate(0)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % options.eval_every == 0:
                self._evaluate(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            if self.curve[-1]["step"] != state.global_step:
                self._evaluate(state.global_step)

    results: dict = {"options": vars(options), "runs": {}}
    for seed in options.seeds:
        torch.manual_seed(seed)
        mu = AutoModelForCausalLM.from_pretrained(base_dir)
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        data = generate_offline_dataset(mu, tokenizer, make_arithmetic_dataset(options.prompts, 2, seed=100 + seed),
                                        arithmetic_reward, work / f"data-seed{seed}", num_completions=8,
                                        max_new_tokens=6, show_progress=False)
        positives = sum(r > 0 for r in data["reward"]) / len(data)
        for method in options.methods:
            started = time.time()
            args = TOPRConfig(
                output_dir=str(work / f"run-{method}-seed{seed}"), per_device_train_batch_size=options.batch_size,
                num_generations=8, max_completion_length=6, topr_offline_epochs=options.epochs,
                learning_rate=options.learning_rate, lr_scheduler_type="constant", max_grad_norm=1.0,
                topr_signal="reward", topr_baseline=0.0, logging_steps=10, report_to="none",
                save_strategy="no", use_cpu=True, bf16=False, gradient_checkpointing=False, seed=seed,
                disable_tqdm=True, **METHODS[method],
            )
            trainer_ref = []
            evaluator = Evaluate(trainer_ref)
            trainer = TOPRTrainer(model=str(base_dir), reward_funcs=stored_reward, args=args, train_dataset=data,
                                  callbacks=[evaluator])
            trainer_ref.append(trainer)
            trainer.train()
            results["runs"][f"{method}/seed{seed}"] = {
                "method": method, "seed": seed, "curve": evaluator.curve, "dataset_positive_fraction": positives,
                "seconds": time.time() - started,
            }
            final = evaluator.curve[-1]
            print(f"[figure1] seed {seed} {method:<16} accuracy {evaluator.curve[0]['accuracy']:.3f} -> "
                  f"{final['accuracy']:.3f}  invalid {final['invalid_rate']:.3f}  ({time.time() - started:.0f}s)",
                  flush=True)
    results["summary"] = summarise(results["runs"])
    return results


def summarise(runs: dict) -> dict:
    """Per method: mean and 95 % t-interval half-width of the final accuracy and invalid rate over seeds."""
    t95 = {1: float("nan"), 2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78}
    summary = {}
    for method in dict.fromkeys(run["method"] for run in runs.values()):
        finals = [run["curve"][-1] for run in runs.values() if run["method"] == method]
        row = {}
        for metric in ("accuracy", "invalid_rate"):
            values = [f[metric] for f in finals]
            mean = statistics.mean(values)
            half = t95.get(len(values), 2.0) * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
            row[metric] = {"mean": mean, "ci95": half, "values": values}
        summary[method] = row
    return summary


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method in dict.fromkeys(run["method"] for run in results["runs"].values()):
        curves = [run["curve"] for run in results["runs"].values() if run["method"] == method]
        steps = [point["step"] for point in curves[0]]
        for axis, metric in zip(axes, ("accuracy", "invalid_rate")):
            means = [statistics.mean(curve[i][metric] for curve in curves) for i in range(len(steps))]
            axis.plot(steps, means, label=method)
            if len(curves) > 1:
                low = [min(curve[i][metric] for curve in curves) for i in range(len(steps))]
                high = [max(curve[i][metric] for curve in curves) for i in range(len(steps))]
                axis.fill_between(steps, low, high, alpha=0.15)
    for axis, title in zip(axes, ("held-out accuracy (greedy)", "invalid rate")):
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
              f"invalid {row['invalid_rate']['mean']:.3f} ± {row['invalid_rate']['ci95']:.3f}")
    return results


if __name__ == "__main__":
    main()
