"""TOPR on the real model: SmolLM2-135M-Instruct (the packaged copy) on the built-in word problems
(`topr_trl.tasks.word_problems`), paired over seeds with an evaluation draw per seed, in two parts:

    online      TOPR (TOPRTrainer's defaults: TOPR's loss on the group-advantage signal) against GRPO (trl.GRPOTrainer
                itself, TRL's default loss "dapo") and positives-only SFT (TOPRTrainer, loss_type="sft"); each
                generates its own samples, --batch_size completions a step in groups of --num_generations
    off_policy  one fixed dataset sampled once per seed from the frozen base model (mu), --prompts x 8 completions,
                trained --epochs passes with TOPR, TIS and PPO-clip (token ratios against mu's stored log-probs), on
                the paper's signal R - c with c = 0, as experiments/figure1.py trains the small testbed

mu samples at temperature 1 with top_k 500 (the paper's sampling; the task's recipe) in both parts, so pi is scored on
mu's support. The held-out measure is sampled pass@1 at temperature 1 over the whole vocabulary (--eval_samples per
problem on --eval_prompts problems of the test split, or of the validation split with --eval_split validation, where
settings are chosen), greedy accuracy beside it. The robust end point is each run's mean over the checkpoints in the
last quarter of its steps (`experiments.common.late_mean`); comparisons are paired by seed.

Every run is written to its own file as it finishes (RUNS/<part>-<method>-seed<s>.json) and a rerun skips the runs on
disk, so that the runs can be spread over lanes (one per core, by seed) and over sessions; each run also keeps the
per-step log the mechanism reads (the negatives' mean truncated weight and truncated share, pi/mu's range):

    OMP_NUM_THREADS=1 python -m experiments.real_model_comparison --part online --seeds 0 &
    OMP_NUM_THREADS=1 python -m experiments.real_model_comparison --part online --seeds 1 &
    python -m experiments.real_model_comparison --summarise --learning_rate L   # OUTPUT_<part>-lr<L>.{json,png}

--summarise gathers the runs of one --eval_split and one --learning_rate (settings are chosen on the validation
split, reported on the held-out one).

--smoke: one seed, 2 steps, 4 problems, to check the pipeline in minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from experiments.common import (  # noqa: E402
    experiment_parser,
    held_out_curve,
    late_mean,
    mean_and_ci95,
    negative_weight_log,
    paired_difference,
    prepare,
    sample_fixed_dataset,
    train_offline,
)
from experiments.figure1 import METHODS as OFF_POLICY_LOSSES  # noqa: E402


PARTS = {
    # method: the trainer ("grpo": trl.GRPOTrainer as it comes) and the TOPRConfig overrides
    "online": {"topr": {}, "grpo": None, "sft_positives": {"loss_type": "sft"}},
    "off_policy": {method: OFF_POLICY_LOSSES[method] for method in ("topr", "tis", "ppo")},
}
COMPARISONS = {"online": ["topr-grpo", "topr-sft_positives"], "off_policy": ["topr-tis", "topr-ppo"]}
"""The paired comparisons A-B of the late values, fixed before any run."""
METRICS = ("pass@1", "greedy_accuracy", "mean_completion_tokens", "truncated_rate")
STEP_LOG = (
    "reward",
    "topr/weight_negative/mean",
    "topr/negative_truncated_fraction",
    "topr/ratio_negative/min",
    "topr/ratio_negative/max",
    "topr/negative_fraction",
    "completions/mean_length",
    "grad_norm",
)
"""What each run keeps of the trainer's per-step log (where the trainer logs it)."""
SMOKE = dict(seeds=[0], steps=2, prompts=2, epochs=1.0, eval_prompts=4, eval_samples=2, checkpoints=[0.5, 1.0])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = experiment_parser(
        __doc__, output="experiments/evidence/real-model/comparison", epochs=3.0, prompts=12, eval_prompts=48
    )
    parser.add_argument("--part", choices=list(PARTS), default="online")
    parser.add_argument("--methods", nargs="+", default=None, help="of the part's methods (default: all)")
    parser.add_argument("--steps", type=int, default=32, help="online: optimizer steps")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--top_k", type=int, default=500, help="mu's top-k at temperature 1 (0: off)")
    parser.add_argument(
        "--checkpoints",
        type=float,
        nargs="+",
        default=[0.5, 0.875, 1.0],
        help="held-out checkpoints at these fractions of the run's steps (and the start); the late "
        "value averages those in the last quarter",
    )
    parser.add_argument(
        "--runs",
        default="experiments/evidence/real-model/comparison",
        help="one JSON per run (and the base model's points per draw), skipped when present",
    )
    parser.add_argument("--summarise", action="store_true", help="gather the runs on disk into OUTPUT_<part>.json")
    parser.add_argument("--smoke", action="store_true", help=f"a pipeline check: {SMOKE}")
    parser.set_defaults(task="word_problems", batch_size=8, learning_rate=3e-5)
    options = parser.parse_args(argv)
    if options.smoke:
        for name, value in SMOKE.items():
            setattr(options, name, value)
        options.runs = str(Path(options.work_dir) / "smoke-runs")
        options.output = str(Path(options.work_dir) / "smoke")
    unknown = set(options.methods or ()) - set(PARTS[options.part])
    if unknown:
        parser.error(f"--methods {sorted(unknown)}: the {options.part} part has {list(PARTS[options.part])}")
    if options.batch_size % options.num_generations:
        parser.error("--batch_size must be a multiple of --num_generations (whole prompt groups per step)")
    return options


def run_file(options, method: str, seed: int) -> Path:
    split = "" if options.eval_split == "heldout" else f"-{options.eval_split}"
    return Path(options.runs) / f"{options.part}-{method}-seed{seed}-lr{options.learning_rate:g}{split}.json"


def step_log(log_history: list[dict]) -> list[dict]:
    return [
        {"step": entry["step"], **{key: entry[key] for key in STEP_LOG if key in entry}}
        for entry in log_history
        if any(key in entry for key in STEP_LOG)
    ]


def online_run(testbed, method: str, seed: int, options, output_dir: Path) -> dict:
    """One online run from the base model: `options.steps` steps of generation and training, the held-out curve."""
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from topr_trl import TOPRConfig, TOPRTrainer

    overrides = PARTS["online"][method]
    trainer_class, config_class = (GRPOTrainer, GRPOConfig) if overrides is None else (TOPRTrainer, TOPRConfig)
    config = config_class(
        output_dir=str(output_dir),
        per_device_train_batch_size=options.batch_size,
        num_generations=options.num_generations,
        max_completion_length=testbed.max_new_tokens,
        temperature=1.0,
        top_k=options.top_k,
        learning_rate=options.learning_rate,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=options.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=seed,
        disable_tqdm=True,
        **(overrides or {}),
    )
    prompts = testbed.prompts(options.steps * options.batch_size // options.num_generations, seed)
    curve: list[dict] = []
    started = time.time()
    trainer = trainer_class(
        model=str(testbed.base_dir),
        reward_funcs=testbed.reward,
        args=config,
        train_dataset=prompts,
        callbacks=[held_out_curve(testbed, seed, 0, curve, fractions=options.checkpoints)],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return {
        "curve": curve,
        "log": step_log(trainer.state.log_history),
        "negative_weights": negative_weight_log(trainer.state.log_history),
        "seconds": time.time() - started,
    }


def off_policy_run(testbed, method: str, seed: int, options, output_dir: Path) -> dict:
    data = sample_fixed_dataset(testbed, options.prompts, seed, Path(options.work_dir), top_k=options.top_k)
    result = train_offline(
        testbed,
        data,
        output_dir,
        seed=seed,
        epochs=options.epochs,
        batch_size=options.batch_size,
        learning_rate=options.learning_rate,
        fractions=tuple(options.checkpoints),
        **PARTS["off_policy"][method],
    )
    result["dataset_positive_fraction"] = sum(r > 0 for r in data["reward"]) / len(data)
    result["dataset_mean_tokens"] = statistics.mean(map(len, data["completion_ids"]))
    return result


RUNNERS = {"online": online_run, "off_policy": off_policy_run}


def with_cached_start(testbed, options, seed: int) -> None:
    """The base model's held-out point on this seed's draw, measured once and kept on disk beside the runs (every
    method of the seed, in any process, starts from the same point)."""
    split = "" if options.eval_split == "heldout" else f"-{options.eval_split}"
    path = Path(options.runs) / f"start-seed{seed}{split}.json"
    eval_seed = testbed.evaluation_seed(seed)
    if path.is_file():
        testbed.starts[eval_seed] = json.loads(path.read_text())
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    point = testbed.start(
        AutoModelForCausalLM.from_pretrained(testbed.base_dir), AutoTokenizer.from_pretrained(testbed.base_dir), seed
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(point, indent=2))


def train(options) -> None:
    from topr_trl.runtime.machine import machine_info

    work, testbed = prepare(options)
    for seed in options.seeds:
        with_cached_start(testbed, options, seed)
        for method in options.methods or PARTS[options.part]:
            path = run_file(options, method, seed)
            if path.is_file():
                print(f"[{options.part}] seed {seed} {method}: on disk ({path})", flush=True)
                continue
            result = RUNNERS[options.part](
                testbed, method, seed, options, work / "runs" / f"real-{options.part}-{method}-seed{seed}"
            )
            record = {
                "part": options.part,
                "method": method,
                "seed": seed,
                "options": vars(options),
                "measure": testbed.measure,
                "base_model": str(testbed.base_dir),
                "machine": machine_info(),
                "threads": os.environ.get("OMP_NUM_THREADS"),
                **result,
            }
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=2))
            curve = result["curve"]
            print(
                f"[{options.part}] seed {seed} {method:<14} pass@1 {curve[0]['pass@1']:.3f} -> "
                f"{curve[-1]['pass@1']:.3f} (late {late_mean(curve):.3f})  {result['seconds']:.0f}s",
                flush=True,
            )


def summarise(part: str, runs: list[dict]) -> dict:
    """The part's late values per method (mean and 95 % t-interval over seeds), the pre-registered paired
    comparisons, and the mechanism: the negatives' mean truncated weight and truncated share per method."""
    methods = list(dict.fromkeys(run["method"] for run in runs))
    late = {
        method: {
            metric: {run["seed"]: late_mean(run["curve"], metric) for run in runs if run["method"] == method}
            for metric in METRICS
        }
        for method in methods
    }
    starts = {run["seed"]: run["curve"][0] for run in runs}
    summary = {
        "part": part,
        "seeds": sorted(starts),
        "measure": runs[0]["measure"],
        "options": {
            key: runs[0]["options"][key]
            for key in (
                "steps",
                "prompts",
                "epochs",
                "batch_size",
                "num_generations",
                "learning_rate",
                "top_k",
                "eval_prompts",
                "eval_samples",
                "checkpoints",
                "eval_split",
                "eval_draw",
            )
        },
        "start": {metric: mean_and_ci95([point[metric] for point in starts.values()]) for metric in METRICS},
        "late": {
            method: {metric: mean_and_ci95(list(values.values())) for metric, values in by_metric.items()}
            for method, by_metric in late.items()
        },
        "paired": {},
        "negatives": {},
        "seconds": {
            method: statistics.mean(run["seconds"] for run in runs if run["method"] == method) for method in methods
        },
    }
    for pair in COMPARISONS[part]:
        first, second = pair.split("-")
        if first in late and second in late and set(late[first]["pass@1"]) & set(late[second]["pass@1"]):
            summary["paired"][pair] = {
                metric: paired_difference(late[first][metric], late[second][metric]) for metric in METRICS
            }
    for method in methods:
        logs = [run["negative_weights"] for run in runs if run["method"] == method and run["negative_weights"]]
        if logs:
            summary["negatives"][method] = {
                key: mean_and_ci95([statistics.mean(entry[key] for entry in log if key in entry) for log in logs])
                for key in ("weight_negative", "negative_truncated_fraction")
            }
    return summary


def plot(runs: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method in summary["late"]:
        curves = [run["curve"] for run in runs if run["method"] == method]
        steps = [point["step"] for point in curves[0]]
        means = [statistics.mean(curve[i]["pass@1"] for curve in curves) for i in range(len(steps))]
        axes[0].plot(steps, means, marker="o", label=method)
        # online, a step whose completions were all correct logs no negative: average each step over the seeds
        # that logged it
        by_step: dict[int, list[float]] = {}
        for run in runs:
            if run["method"] == method:
                for entry in run["negative_weights"]:
                    by_step.setdefault(entry["step"], []).append(entry["weight_negative"])
        if by_step:
            steps = sorted(by_step)
            axes[1].plot(steps, [statistics.mean(by_step[step]) for step in steps], label=method)
    axes[0].set_title(f"held-out {summary['measure']}", fontsize=8)
    axes[1].set_title("negatives' mean truncated weight per step")
    for axis in axes:
        axis.set_xlabel("optimizer step")
        if axis.get_legend_handles_labels()[0]:  # GRPO alone logs no negatives' weight
            axis.legend(fontsize=8)
    figure.suptitle(f"SmolLM2-135M-Instruct, word problems, {summary['part']} (mean over seeds {summary['seeds']})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def gather(options) -> dict[str, dict]:
    outcome = {}
    for part in PARTS:
        files = sorted(Path(options.runs).glob(f"{part}-*.json"))
        runs = [json.loads(path.read_text()) for path in files]
        chosen = [
            (path, run)
            for path, run in zip(files, runs, strict=True)
            if run["options"]["eval_split"] == options.eval_split
            and run["options"]["learning_rate"] == options.learning_rate
        ]
        if not chosen:
            continue
        summary = summarise(part, [run for _, run in chosen])
        summary["runs"] = [str(path) for path, _ in chosen]
        split = "" if options.eval_split == "heldout" else f"-{options.eval_split}"
        output = Path(f"{options.output}_{part}-lr{options.learning_rate:g}{split}")
        output.parent.mkdir(parents=True, exist_ok=True)
        output.with_suffix(".json").write_text(json.dumps(summary, indent=2))
        plot(runs, summary, output.with_suffix(".png"))
        outcome[part] = summary
        for method, row in summary["late"].items():
            print(f"{part:<10} {method:<14} late pass@1 {row['pass@1']['mean']:.3f} ± {row['pass@1']['ci95']:.3f}")
        for pair, row in summary["paired"].items():
            print(f"{part:<10} {pair:<20} paired {row['pass@1']['mean']:+.3f} ± {row['pass@1']['ci95']:.3f}")
    return outcome


def main(argv: list[str] | None = None):
    options = parse(argv)
    if options.summarise:
        return gather(options)
    train(options)
    return None


if __name__ == "__main__":
    main()
