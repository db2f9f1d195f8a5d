"""Sample efficiency of TOPR against online GRPO on the reasoning testbed (`topr_trl.tasks.reasoning`):
held-out sampled pass@1 against the number of generated completions and against wall time, for

    grpo             online trl.GRPOTrainer, TRL's default loss (GRPOConfig.loss_type = "dapo" in TRL 1.16)
    topr_online      online TOPRTrainer (defaults: TOPR loss, group-advantage signal)
    topr_offline_kK  offline TOPR with reuse: one dataset sampled from the base model (--prompts x G completions,
                     `generate_offline_dataset`), then K passes over it (`topr_offline_epochs`), K in --offline_epochs
    topr_iterated    iterated TOPR (`run_iterations`, mu_i = pi_{i-1}): --iterations rounds of --iteration_prompts x G
    sft_offline_kK, ppo_offline_kK
                     the reuse controls (--controls): the same dataset and the same K passes (the largest of
                     --offline_epochs) with positives-only SFT (Table 1's (1,1,0,0)) or PPO clipping of the token
                     ratios against mu's stored log-probs (loss_type="ppo"): what reuse gives without TOPR's weights

Every run starts from the same warm-started model (default: 3 digits, error_rate 0.25, about 68 % sampled pass@1)
and is evaluated at a few checkpoints with `evaluate_model` (temperature 1, --eval_samples per problem on
--eval_prompts held-out problems; the standard error is across problems). "Generated completions" are counted
by the reward function as it scores them and checked against each method's formula (`expected_completions`);
wall time is training + generation, evaluation time excluded. One CPU thread (OMP_NUM_THREADS=1).

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.sample_efficiency            # full run, experiments/evidence/sample_efficiency/sample_efficiency.*
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.sample_efficiency --smoke --output outputs/sample_efficiency/smoke

Run times measured on one CPU thread (2-core shared machine): building the warm model, once, ~2-3 min (cached under
--work_dir/cache afterwards); --smoke ~20 s; the full run (defaults: 3 seeds; online 60 steps x 32 completions =
1,920; offline 60 prompts x 8 = 480 completions, K = 1, 2, 4; iterated 4 x 32 prompts x 8 = 1,024; 5 checkpoints
per run on 500 held-out problems x 4 samples) 6.2 min, most of it evaluation. Runs are deterministic on one thread of one machine.
The shared --base_accuracy option of `experiments.py` does not apply here (see --error_rate).

Reported per method (`summary`), fixed before any run by the options: the robust end point `late_pass@1`, each
run's mean pass@1 over the checkpoints in the last quarter of its steps (`experiments.late_mean`), as a mean and
95 % t-interval over seeds, and its paired difference to online GRPO of the same seeds (`late_minus_grpo`); the
optimizer steps each method took (offline K = 1, 2 and the iterated runs take fewer than the online 60 by
construction: one pass over fewer completions); the final pass@1; and, for the target accuracy (default: GRPO's
final pass@1 of the same seed; --target sets one), the completions and seconds at the first checkpoint at or
above it (a first crossing of a noisy curve, and for offline runs the whole dataset by construction: secondary).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from experiments.common import (  # noqa: E402
    Tracker,
    base_points,
    base_summary,
    experiment_parser,
    late_mean,
    mean_and_ci95,
    paired_difference,
    parse_testbed_options,
    prepare_testbed,
    resummarise_if_asked,
    run_trainer,
    save,
    train_config,
)


ONLINE = ("grpo", "topr_online")
SMOKE = dict(
    seeds=[0],
    steps=8,
    batch_size=16,
    prompts=8,
    iterations=2,
    iteration_prompts=8,
    eval_prompts=64,
    eval_samples=2,
    checkpoints=2,
    offline_epochs=[1, 2, 4],
)


# ---------------------------------------------------------------------------------------------------------
# Pure parts: counts and the completions-to-reach computation
# ---------------------------------------------------------------------------------------------------------


# the losses an offline run may train with: TOPR, and the reuse controls
OFFLINE_LOSSES = ("topr", "sft", "ppo")


def method_names(offline_epochs: list[int], controls: list[str] = ()) -> list[str]:
    """Every method a run has: the online ones, offline TOPR at each K, iterated TOPR, and each control loss at the
    largest K."""
    return [
        *ONLINE,
        *(f"topr_offline_k{k}" for k in offline_epochs),
        "topr_iterated",
        *(f"{loss}_offline_k{max(offline_epochs)}" for loss in controls),
    ]


def offline_method(method: str) -> tuple[str, int] | None:
    """(loss, passes) of an offline method name `<loss>_offline_k<K>`, None for another method."""
    loss, found, passes = method.partition("_offline_k")
    if not found or loss not in OFFLINE_LOSSES or not passes.isdigit():
        return None
    return loss, int(passes)


def expected_completions(
    method: str,
    *,
    steps: int,
    batch_size: int,
    num_generations: int,
    prompts: int,
    iterations: int,
    iteration_prompts: int,
) -> int:
    """Completions a method generates in all: online, num_generations x (batch_size / num_generations) prompts per
    generation batch x steps (one generation batch per optimizer step); offline, the dataset's rows, prompts x
    num_generations, whatever the passes over it; iterated, iteration_prompts x num_generations per iteration."""
    if method in ONLINE:
        return num_generations * (batch_size // num_generations) * steps
    if offline_method(method) is not None:
        return prompts * num_generations
    if method == "topr_iterated":
        return iterations * iteration_prompts * num_generations
    raise ValueError(f"unknown method {method!r}")


def first_reaching(curve: list[dict], target: float) -> dict | None:
    """The first point of `curve` (points with "pass@1", "completions", "seconds", in training order) whose pass@1
    is at least `target`, or None when the method never reaches it."""
    for point in curve:
        if point["pass@1"] >= target:
            return point
    return None


def late_point(run: dict) -> float:
    """A run's robust end point: its mean pass@1 over the checkpoints in the last quarter of its training (optimizer
    steps, or iterations for the iterated runs; the points before any training, the base model and an offline run's
    generation, excluded)."""
    return late_mean([{**point, "step": point.get("step", point.get("iteration", 0))} for point in run["curve"]])


def topr_minus_control(method: str, late: dict) -> dict | None:
    """For a reuse control `<loss>_offline_k<K>` (loss other than TOPR), the paired difference of offline TOPR with
    the same K minus the control; None for any other method or when that TOPR run is missing."""
    parsed = offline_method(method)
    if parsed is None or parsed[0] == "topr" or not late.get(f"topr_offline_k{parsed[1]}") or not late.get(method):
        return None
    return paired_difference(late[f"topr_offline_k{parsed[1]}"], late[method])


def summarise(runs: dict, methods: list[str]) -> dict:
    """Per method over seeds: the late pass@1 (`late_point`) and its paired difference to online GRPO, the optimizer
    steps, the final pass@1, completions and seconds in all, and those needed to reach each seed's target (None where
    never reached; `reached` counts the seeds that did)."""
    summary = {}
    late = {
        method: {run["seed"]: late_point(run) for run in runs.values() if run["method"] == method} for method in methods
    }
    for method in methods:
        chosen = [run for run in runs.values() if run["method"] == method]
        if not chosen:
            continue
        reach = [first_reaching(run["curve"], run["target"]) for run in chosen]
        reached = [point for point in reach if point is not None]
        steps = [sum(run["steps"]) if isinstance(run["steps"], list) else run["steps"] for run in chosen]
        summary[method] = {
            "late_pass@1": mean_and_ci95([late[method][run["seed"]] for run in chosen]),
            "late_minus_grpo": (
                paired_difference(late[method], late["grpo"]) if method != "grpo" and late.get("grpo") else None
            ),
            # a reuse control: offline TOPR with the same passes minus the control (what TOPR's weights add)
            "topr_minus_this": topr_minus_control(method, late),
            "steps": mean_and_ci95(steps),
            "final_pass@1": mean_and_ci95([run["curve"][-1]["pass@1"] for run in chosen]),
            "completions_total": mean_and_ci95([run["completions"] for run in chosen]),
            "seconds_total": mean_and_ci95([run["seconds"] for run in chosen]),
            "targets": [run["target"] for run in chosen],
            "reached": f"{len(reached)}/{len(chosen)}",
            "completions_to_target": [None if p is None else p["completions"] for p in reach],
            "seconds_to_target": [None if p is None else p["seconds"] for p in reach],
        }
    return summary


# ---------------------------------------------------------------------------------------------------------
# The methods
# ---------------------------------------------------------------------------------------------------------


def method_config(method: str, options, seed: int, output_dir: Path) -> dict:
    """The shared training settings (`experiments.train_config`) with the method's own learning rate when
    --method_learning_rates gives one."""
    return {
        **train_config(options, seed, output_dir),
        "learning_rate": options.method_learning_rates.get(method, options.learning_rate),
    }


def learning_rate_of_method(text: str) -> tuple[str, float]:
    """An argparse type: METHOD=RATE."""
    method, equals, rate = text.partition("=")
    try:
        return method, float(rate) if equals else float("nan")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected METHOD=RATE, e.g. grpo=1e-4") from None


def run_online(method, options, seed, base_path, held_out, base_point, work: Path) -> dict:
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.tasks.reasoning import make_reasoning_dataset, reasoning_reward

    prompts_needed = options.steps * options.batch_size // options.num_generations
    prompts = make_reasoning_dataset(prompts_needed, options.digits, "train", seed=seed)
    torch.manual_seed(seed)
    tracker = Tracker(held_out, options, reasoning_reward, "sample_efficiency", seed)
    tracker.curve.append(base_point)
    config_class, trainer_class = (GRPOConfig, GRPOTrainer) if method == "grpo" else (TOPRConfig, TOPRTrainer)
    config = config_class(
        max_steps=options.steps, **method_config(method, options, seed, work / f"{method}-seed{seed}")
    )
    steps = run_trainer(trainer_class, config, base_path, tracker.reward, prompts, tracker, options.checkpoints)
    return {
        "loss_type": config.loss_type,
        "steps": steps,
        "completions": tracker.completions,
        "seconds": tracker.seconds(),
        "curve": tracker.curve,
    }


def generate_once(options, seed, base_path, held_out, work: Path):
    """The offline dataset, sampled once from the base model; returns it with its completion count and time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from topr_trl.offline import generate_offline_dataset
    from topr_trl.tasks.reasoning import make_reasoning_dataset, max_completion_tokens, reasoning_reward

    folder = work / f"offline-data-seed{seed}"
    shutil.rmtree(folder, ignore_errors=True)  # timed from scratch, never resumed
    tracker = Tracker(held_out, options, reasoning_reward, "sample_efficiency", seed)
    torch.manual_seed(seed)
    data = generate_offline_dataset(
        AutoModelForCausalLM.from_pretrained(base_path),
        AutoTokenizer.from_pretrained(base_path),
        make_reasoning_dataset(options.prompts, options.digits, "train", seed=seed),
        tracker.reward,
        folder,
        num_completions=options.num_generations,
        max_new_tokens=max_completion_tokens(options.digits),
        show_progress=False,
        backend="transformers",
        seed=seed,
    )
    return data, tracker.completions, tracker.seconds()


def run_offline(loss, epochs, options, seed, base_path, held_out, base_point, work: Path, generated) -> dict:
    import torch

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.offline import stored_reward

    data, completions, generation_seconds = generated
    tracker = Tracker(held_out, options, stored_reward, "sample_efficiency", seed)
    tracker.completions = completions
    tracker.started -= generation_seconds  # the dataset's generation is part of this method's time
    # every completion is generated before the first step: the curve is at the base model's pass@1 until then
    tracker.curve += [base_point, {**base_point, "completions": completions, "seconds": generation_seconds}]
    torch.manual_seed(seed)
    config = TOPRConfig(
        topr_offline_epochs=epochs,
        loss_type=loss,
        **method_config(f"{loss}_offline_k{epochs}", options, seed, work / f"{loss}_offline_k{epochs}-seed{seed}"),
    )
    steps = run_trainer(TOPRTrainer, config, base_path, stored_reward, data, tracker, options.checkpoints)
    return {
        "loss_type": loss,
        "epochs": epochs,
        "rows": len(data),
        "steps": steps,
        "completions": completions,
        "generation_seconds": generation_seconds,
        "seconds": tracker.seconds(),
        "curve": tracker.curve,
    }


def run_iterated(options, seed, base_path, held_out, base_point, work: Path) -> dict:
    import torch

    from topr_trl.commands.iterations import IterationSettings, run_iterations
    from topr_trl.tasks.reasoning import make_reasoning_dataset, max_completion_tokens, reasoning_reward

    folder = work / f"topr_iterated-seed{seed}"
    shutil.rmtree(folder, ignore_errors=True)  # timed from scratch, never resumed
    tracker = Tracker(held_out, options, reasoning_reward, "sample_efficiency", seed)
    tracker.curve.append(base_point)
    calls = []

    def evaluate(model, tokenizer):
        calls.append(None)
        if len(calls) == 1:  # run_iterations evaluates mu_0 first: the base model, already measured
            return base_point
        return tracker.checkpoint(model, tokenizer, iteration=len(calls) - 1)

    common = method_config("topr_iterated", options, seed, folder)
    for name in ("output_dir", "num_generations", "max_completion_length", "temperature"):
        common.pop(name)  # run_iterations sets these from the iteration settings
    settings = IterationSettings(
        num_iterations=options.iterations,
        num_completions=options.num_generations,
        max_new_tokens=max_completion_tokens(options.digits),
        composition="uniform",
        backend="transformers",
        save_steps=10**6,
        train_overrides=common,
    )
    torch.manual_seed(seed)
    summaries = run_iterations(
        str(base_path),
        make_reasoning_dataset(options.iteration_prompts, options.digits, "train", seed=seed),
        tracker.reward,
        folder,
        settings,
        evaluate=evaluate,
    )
    return {
        "rows": [s["rows"] for s in summaries],
        "steps": [s["train_steps"] for s in summaries],
        "completions": tracker.completions,
        "seconds": tracker.seconds(),
        "curve": tracker.curve,
    }


def run(options) -> dict:
    started = time.time()
    model, tokenizer, base_path, held_out, results = prepare_testbed(options)
    work = Path(options.work_dir)
    counts = dict(
        steps=options.steps,
        batch_size=options.batch_size,
        num_generations=options.num_generations,
        prompts=options.prompts,
        iterations=options.iterations,
        iteration_prompts=options.iteration_prompts,
    )
    bases = base_points(model, tokenizer, held_out, options)
    results["base"] = base_summary(bases)
    for seed, point in bases.items():
        print(
            f"[sample_efficiency] base pass@1 on seed {seed}'s draw {point['pass@1']:.3f} ± {point['pass@1_problem_se']:.3f}",
            flush=True,
        )
    for seed in options.seeds:
        base_point = {"step": 0, "completions": 0, "seconds": 0.0, **bases[seed]}
        generated = None
        target = options.target
        for method in options.methods:
            print(f"[sample_efficiency] seed {seed} {method}", flush=True)
            if method in ONLINE:
                outcome = run_online(method, options, seed, base_path, held_out, base_point, work / "runs")
            elif offline_method(method) is not None:
                if generated is None:
                    generated = generate_once(options, seed, base_path, held_out, work / "runs")
                outcome = run_offline(
                    *offline_method(method), options, seed, base_path, held_out, base_point, work / "runs", generated
                )
            else:
                outcome = run_iterated(options, seed, base_path, held_out, base_point, work / "runs")
            if target is None and method == "grpo":
                target = outcome["curve"][-1]["pass@1"]
            outcome["expected_completions"] = expected_completions(method, **counts)
            results["runs"][f"{method}/seed{seed}"] = {"method": method, "seed": seed, **outcome}
        for _key, run_ in results["runs"].items():
            if run_["seed"] == seed:
                run_["target"] = target if target is not None else float("nan")
    results["summary"] = summarise(results["runs"], options.methods)
    results["seconds"] = time.time() - started
    return results


def update_summary(results: dict) -> None:
    """`results`' summary, from its runs (for --resummarise)."""
    results["summary"] = summarise(
        results["runs"], list(dict.fromkeys(run["method"] for run in results["runs"].values()))
    )


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    methods = list(results["summary"])
    colours = {method: plt.cm.tab10(i) for i, method in enumerate(methods)}
    first_seed = results["options"]["seeds"][0]
    for run_ in results["runs"].values():
        curve, label = run_["curve"], run_["method"] if run_["seed"] == first_seed else None
        for axis, x in zip(axes, ("completions", "seconds"), strict=False):
            axis.errorbar(
                [p[x] for p in curve],
                [p["pass@1"] for p in curve],
                yerr=[p["pass@1_problem_se"] for p in curve],
                color=colours[run_["method"]],
                marker="o",
                markersize=3,
                capsize=2,
                alpha=0.8,
                label=label,
            )
    targets = {run_["target"] for run_ in results["runs"].values() if run_["target"] == run_["target"]}
    for axis in axes:
        for target in targets:
            axis.axhline(target, color="grey", linestyle=":", linewidth=1)
    axes[0].set_xlabel("generated completions")
    axes[1].set_xlabel("wall time, s (training + generation, 1 CPU thread)")
    axes[0].set_ylabel("held-out sampled pass@1 (± SE over problems)")
    axes[0].legend(fontsize=8)
    figure.suptitle(
        "Sample efficiency: TOPR (online, offline with reuse, iterated) vs online GRPO (dotted: GRPO's final pass@1)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = experiment_parser(
        __doc__,
        output="experiments/evidence/sample_efficiency/sample_efficiency",
        epochs=None,
        prompts=60,
        eval_prompts=500,
    )
    # 3e-4: 40 GRPO steps take the default model from ~0.71 to ~0.87 pass@1; 1e-3 collapses it to 0 (seed 0)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="subset of grpo topr_online topr_offline_k<K> topr_iterated and the controls "
        "<loss>_offline_k<K> (default: all)",
    )
    parser.add_argument("--steps", type=int, default=60, help="online optimizer steps (one generation batch each)")
    parser.add_argument("--num_generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--offline_epochs", type=int, nargs="+", default=[1, 2, 4], help="passes K over the dataset")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--iteration_prompts", type=int, default=32, help="prompts (x G) sampled per iteration")
    parser.add_argument(
        "--method_learning_rates",
        nargs="*",
        type=learning_rate_of_method,
        default=[],
        help="METHOD=RATE: a method's own learning rate (chosen on --eval_split validation), "
        "--learning_rate for the others",
    )
    parser.add_argument(
        "--controls",
        nargs="*",
        default=["sft", "ppo"],
        choices=OFFLINE_LOSSES[1:],
        help="reuse controls: these losses on the same dataset with the largest K of --offline_epochs",
    )
    parser.add_argument(
        "--checkpoints",
        type=int,
        default=12,
        help="evaluations per training run (the late pass@1 averages those in the last quarter)",
    )
    parser.add_argument("--target", type=float, default=None, help="pass@1 to reach (default: GRPO's final)")
    parser.add_argument("--smoke", action="store_true", help=f"a tiny run (overrides: {SMOKE})")
    rewritten = resummarise_if_asked(parser, argv, update_summary, plot)
    if rewritten is not None:
        return rewritten
    options = parse_testbed_options(parser, argv, SMOKE)
    known = method_names(options.offline_epochs, options.controls)
    options.methods = options.methods or known
    unknown = [m for m in options.methods if m not in known]
    if unknown:
        parser.error(f"unknown methods {unknown}: choose among {known}")
    rates = dict(options.method_learning_rates)
    wrong = [f"{m}={r}" for m, r in rates.items() if m not in known or not r > 0]
    if wrong:
        parser.error(
            f"--method_learning_rates {wrong}: each must be METHOD=RATE with a method among {known} and a positive rate"
        )
    options.method_learning_rates = rates
    results = run(options)
    save(results, options, plot)
    print(
        f"base pass@1 {results['base']['pass@1']:.3f}; target per seed "
        f"{[round(t, 3) for t in next(iter(results['summary'].values()))['targets']]}",
        flush=True,
    )
    for method, row in results["summary"].items():
        paired = row["late_minus_grpo"]
        versus = f"  - grpo {paired['mean']:+.3f} ± {paired['ci95']:.3f}" if paired else ""
        print(
            f"{method:<17} late pass@1 {row['late_pass@1']['mean']:.3f} ± {row['late_pass@1']['ci95']:.3f}{versus}  "
            f"steps {row['steps']['mean']:.0f}  "
            f"final {row['final_pass@1']['mean']:.3f} ± {row['final_pass@1']['ci95']:.3f}  "
            f"completions {row['completions_total']['mean']:>7.0f}  {row['seconds_total']['mean']:6.0f}s  "
            f"reached target {row['reached']}: completions {row['completions_to_target']} "
            f"seconds {[None if s is None else round(s) for s in row['seconds_to_target']]}",
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()
