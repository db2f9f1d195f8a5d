"""Staleness: how far off-policy TOPR and GRPO-clip can go on the reasoning testbed (`topr_trl.tasks.reasoning`)
before held-out pass@1 degrades.

The behaviour policy mu lags the trained policy pi by up to K - 1 optimizer updates, for each K in --lags:

    topr        online TOPRTrainer, defaults (TOPR loss, group-advantage signal); mu's log-probs are the stored
                old_per_token_logps of the generation batch
    grpo_clip   online trl.GRPOTrainer with loss_type="grpo": PPO clipping of the ratio pi/mu at 1 -/+ epsilon
                (0.2, TRL's default), per-sequence length normalisation
    tis         the controls Figure 1 has (`experiments/figure1.py`): TOPRTrainer with loss_type="tis" (truncated
    sft_positives  importance sampling, the ratio capped at 1 on both branches) and loss_type="sft" (positives only,
                weight 1; negatives dropped), on the same signal, data and lag as topr
    topr_length_normalized  TOPR with topr_ratio_level="length_normalized" (the geometric mean of the token
                ratios, not their product): the guard for long completions

The lag is set with GRPOConfig.num_iterations = K (TRL's "mu" in the GRPO paper): each generation batch is reused for
K optimizer steps, and TRL keeps the log-probs of the policy that generated it as old_per_token_logps, so on the j-th
reuse pi is j updates ahead of mu. The number of optimizer steps (--steps) is the same for every K, so a larger K
generates fewer completions: ceil(steps / K) x batch_size (`expected_completions`). Why num_iterations rather than
steps_per_generation = K: the latter generates one K-times larger batch and spends one fresh slice per step, so mu
lags by the same 0..K-1 updates but the number of completions stays steps x batch_size and the prompts per
generation grow with K; num_iterations changes only the lag and the data budget, which is what "keep the optimizer
steps equal, generate less" asks for, and it keeps each step's batch (and group statistics) the same size as K = 1.
`--lag_via steps_per_generation` runs the other reading (fresh data, same completions) for comparison.

Every run starts from the warm model that experiments/sample_efficiency.py also starts from (cached under
--work_dir/cache, shared with it by default) and is evaluated as there, with `experiments.held_out_pass_at_1`
(temperature 1, --eval_samples per problem on --eval_prompts held-out problems, standard error across problems) at
--checkpoints evenly spaced steps. Completions
are counted by the reward function as it scores them and checked against `expected_completions`. One CPU thread.

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.staleness                   # full run, experiments/evidence/staleness/staleness.*
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.staleness --smoke --output outputs/staleness/smoke

Run times measured on one CPU thread (2-core shared machine, warm model already cached): --smoke 13 s (2 methods x
lags 1, 4; 8 steps of 16 completions; 64 held-out problems x 2 samples); `--seeds 0 1` (otherwise the defaults:
64 steps x 32 completions, lags 1 4 16 64, 4 checkpoints on 500 held-out problems x 4 samples) 5.5 min, most of it
evaluation (5.7 min with --lag_via steps_per_generation); the default 3 seeds with --lag_via steps_per_generation
8.5 min (not measured with num_iterations; expect about 8 min). The shared --prompts and --base_accuracy options
of `experiments.py` do not apply here.

Reported per (method, K): final pass@1 (mean, 95 % CI over seeds), the curve at each checkpoint, completions
generated, and the run-averaged off-policy statistics from trainer.state.log_history (topr/* for TOPR, clip_ratio/*
for GRPO-clip). Per method (`summary`): the largest K whose final pass@1 stays within one CI of the method's K = 1
result, every smaller K included (`largest_tolerated_lag`); with one seed the CI is 1.96 x the K = 1 final point's
standard error across problems. With two seeds the t-interval (t = 12.7) is so wide that the rule says little;
use three or more.

Measured (experiments/README.md, "Staleness"; 5 seeds, the shipped model, learning rate 1e-4, late pass@1, paired): at
K = 1 both methods give the same curve to the last digit (on-policy, ratio 1: the gradients coincide). With fresh
data (--lag_via steps_per_generation) TOPR at K = 64 ends above GRPO-clip in every seed and above its own K = 1.
With num_iterations = K both lose accuracy with every K and neither is better; the cause is the back-to-back order
of the reuse, not the amount of data (--reuse_spacing: the same reuse spaced 16 steps apart gains).
"""

from __future__ import annotations

import math
import os
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
    paired_by_lag,
    parse_testbed_options,
    prepare_testbed,
    resummarise_if_asked,
    run_trainer,
    save,
    train_config,
)


# Each method's trainer and what it sets on top of the shared configuration (one place to add a method).
METHOD_TRAINERS = {
    "topr": ("topr_trl", {}),
    "grpo_clip": ("trl", {"loss_type": "grpo"}),
    "tis": ("topr_trl", {"loss_type": "tis"}),
    "sft_positives": ("topr_trl", {"loss_type": "sft"}),
    # the guard for long completions: the geometric mean of the token ratios instead of their product
    "topr_length_normalized": ("topr_trl", {"topr_ratio_level": "length_normalized"}),
}
METHODS = ("topr", "grpo_clip")  # the default run; the controls are asked for with --methods
LAG_VIA = ("num_iterations", "steps_per_generation")
LOGGED_PREFIXES = ("topr/", "clip_ratio/")
SMOKE = dict(seeds=[0], steps=8, batch_size=16, lags=[1, 4], eval_prompts=64, eval_samples=2, checkpoints=2)


# ---------------------------------------------------------------------------------------------------------
# Pure parts: completions for a lag, the tolerated-lag rule, run averages of the logged statistics
# ---------------------------------------------------------------------------------------------------------


def expected_completions(
    lag: int, *, steps: int, batch_size: int, lag_via: str = "num_iterations", reuse_spacing: int = 1
) -> int:
    """Completions generated in `steps` optimizer steps of `batch_size` completions when mu lags by up to lag - 1
    updates: with num_iterations = lag one batch is generated every `lag` steps (the last one even when the run
    stops before reusing it `lag` times), or with `reuse_spacing` S > 1 (steps_per_generation = S) S batches every
    S x lag steps, each reused every S steps; with steps_per_generation = lag a lag-times larger batch is."""
    if lag < 1 or steps < 1 or reuse_spacing < 1:
        raise ValueError(
            f"lag, steps and reuse_spacing must be >= 1, got lag={lag}, steps={steps}, reuse_spacing={reuse_spacing}"
        )
    if lag_via == "num_iterations":
        return math.ceil(steps / (lag * reuse_spacing)) * reuse_spacing * batch_size
    generations = math.ceil(steps / lag)
    if lag_via == "steps_per_generation":
        return generations * lag * batch_size
    raise ValueError(f"unknown lag_via {lag_via!r}: choose among {LAG_VIA}")


def largest_tolerated_lag(finals: dict[int, dict]) -> dict:
    """The largest lag K whose final pass@1 mean stays within one CI of the K = 1 mean, K and every smaller lag
    (a drop below mean_1 - ci_1 is a degradation; a rise is not). `finals` maps K to {"mean", "ci95"}; "ci95" of
    K = 1 must be finite. Returns the lag, the threshold and, per K, whether it stayed within."""
    if 1 not in finals:
        raise ValueError("the lag K = 1 (on-policy reference) is missing")
    reference, half = finals[1]["mean"], finals[1]["ci95"]
    if not math.isfinite(half):
        raise ValueError("the K = 1 CI is not finite: run two seeds or more, or give a standard error")
    threshold = reference - half
    within = {lag: finals[lag]["mean"] >= threshold for lag in sorted(finals)}
    tolerated = 1
    for lag in sorted(finals):
        if not within[lag]:
            break
        tolerated = lag
    return {"lag": tolerated, "threshold": threshold, "within": within}


def run_averages(log_history: list[dict], prefixes=LOGGED_PREFIXES) -> dict:
    """Mean over the run's logged steps of every metric under `prefixes` (NaN entries, e.g. a ratio minimum over no
    negative tokens, are left out)."""
    values: dict[str, list[float]] = {}
    for entry in log_history:
        for key, value in entry.items():
            if key.startswith(prefixes) and isinstance(value, (int, float)) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    return {key: sum(v) / len(v) for key, v in sorted(values.items())}


def summarise(runs: dict, methods, lags) -> dict:
    """Per method: per lag over seeds the final pass@1 (mean, 95 % CI), completions and the run-averaged logged
    statistics; then the largest tolerated lag (one seed: the CI is 1.96 x the K = 1 final point's problem SE)."""
    summary = {}
    for method in methods:
        per_lag = {}
        for lag in lags:
            chosen = [run for run in runs.values() if run["method"] == method and run["lag"] == lag]
            if not chosen:
                continue
            final = mean_and_ci95([run["curve"][-1]["pass@1"] for run in chosen])
            if len(chosen) == 1:
                final["ci95"] = 1.96 * chosen[0]["curve"][-1]["pass@1_problem_se"]
                final["ci_source"] = "1.96 x SE across problems (one seed)"
            keys = sorted({key for run in chosen for key in run["logged"]})
            per_lag[lag] = {
                "final_pass@1": final,
                # the robust end point: mean pass@1 over the checkpoints in the last quarter of the steps
                "late_pass@1": mean_and_ci95([late_mean(run["curve"]) for run in chosen]),
                "completions": mean_and_ci95([run["completions"] for run in chosen]),
                "seconds": mean_and_ci95([run["seconds"] for run in chosen]),
                "logged": {
                    key: mean_and_ci95([run["logged"][key] for run in chosen if key in run["logged"]])["mean"]
                    for key in keys
                },
            }
        if not per_lag:
            continue
        row = {"lags": per_lag}
        if 1 in per_lag:
            row["largest_tolerated_lag"] = largest_tolerated_lag(
                {lag: entry["final_pass@1"] for lag, entry in per_lag.items()}
            )
        summary[method] = row
    return summary


def paired_comparisons(runs: dict, methods, lags) -> dict:
    """Paired differences of the late pass@1 (per seed, then mean and 95 % t-interval): each lag against K = 1
    within a method ("topr/k4-k1"), and the first method against each other at every lag ("topr-grpo_clip/k4")."""
    return paired_by_lag(runs, methods, lags, reference=1)


# ---------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------


def run_lagged(method, lag, options, seed, base_path, held_out, base_point, work: Path) -> dict:
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.tasks.reasoning import make_reasoning_dataset, reasoning_reward

    # enough prompts for fresh data every step (steps_per_generation); num_iterations uses the first 1/lag of them
    prompts = make_reasoning_dataset(
        options.steps * options.batch_size // options.num_generations, options.digits, "train", seed=seed
    )
    torch.manual_seed(seed)
    tracker = Tracker(held_out, options, reasoning_reward, "staleness", seed)
    tracker.curve.append(base_point)
    common = {
        **train_config(options, seed, work / f"{method}-k{lag}-seed{seed}"),
        "logging_steps": 1,
        options.lag_via: lag,
    }
    if options.reuse_spacing > 1:  # reuse each batch every S steps instead of back to back (num_iterations only)
        common["steps_per_generation"] = options.reuse_spacing
    package, overrides = METHOD_TRAINERS[method]
    config_class, trainer_class = {"trl": (GRPOConfig, GRPOTrainer), "topr_trl": (TOPRConfig, TOPRTrainer)}[package]
    common.update(overrides)
    config = config_class(max_steps=options.steps, **common)
    built: list = []

    def keep(**kwargs):  # run_trainer does not hand its trainer back; the log history is on it
        built.append(trainer_class(**kwargs))
        return built[0]

    steps = run_trainer(keep, config, base_path, tracker.reward, prompts, tracker, options.checkpoints)
    return {
        "loss_type": config.loss_type,
        "epsilon": config.epsilon,
        "num_iterations": config.num_iterations,
        "steps_per_generation": config.steps_per_generation,
        "steps": steps,
        "completions": tracker.completions,
        "seconds": tracker.seconds(),
        "curve": tracker.curve,
        "logged": run_averages(built[0].state.log_history),
    }


def run(options) -> dict:
    started = time.time()
    model, tokenizer, base_path, held_out, results = prepare_testbed(options)
    work = Path(options.work_dir)
    bases = base_points(model, tokenizer, held_out, options)
    results["base"] = base_summary(bases)
    for seed, point in bases.items():
        print(
            f"[staleness] base pass@1 on seed {seed}'s draw {point['pass@1']:.3f} ± {point['pass@1_problem_se']:.3f}",
            flush=True,
        )
    for seed in options.seeds:
        base_point = {"step": 0, "completions": 0, "seconds": 0.0, **bases[seed]}
        for method in options.methods:
            for lag in options.lags:
                print(f"[staleness] seed {seed} {method} K={lag}", flush=True)
                outcome = run_lagged(
                    method, lag, options, seed, base_path, held_out, base_point, work / "staleness-runs"
                )
                outcome["expected_completions"] = expected_completions(
                    lag,
                    steps=options.steps,
                    batch_size=options.batch_size,
                    lag_via=options.lag_via,
                    reuse_spacing=options.reuse_spacing,
                )
                results["runs"][f"{method}/k{lag}/seed{seed}"] = {"method": method, "lag": lag, "seed": seed, **outcome}
    results["summary"] = summarise(results["runs"], options.methods, options.lags)
    results["paired"] = paired_comparisons(results["runs"], options.methods, options.lags)
    results["seconds"] = time.time() - started
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {method: plt.cm.tab10(i) for i, method in enumerate(results["summary"])}
    for method, row in results["summary"].items():
        lags = sorted(int(lag) for lag in row["lags"])
        finals = [row["lags"][lag]["final_pass@1"] for lag in lags]
        axes[0].errorbar(
            lags,
            [f["mean"] for f in finals],
            yerr=[f["ci95"] for f in finals],
            marker="o",
            capsize=3,
            color=colours[method],
            label=method,
        )
        if "largest_tolerated_lag" in row:
            axes[0].axhline(
                row["largest_tolerated_lag"]["threshold"], color=colours[method], linestyle=":", linewidth=1
            )
    first_seed = results["options"]["seeds"][0]
    styles = dict(zip(sorted(results["options"]["lags"]), ("-", "--", "-.", ":", "-"), strict=False))
    for run_ in results["runs"].values():
        if run_["seed"] != first_seed:
            continue
        curve = run_["curve"]
        axes[1].plot(
            [p["step"] for p in curve],
            [p["pass@1"] for p in curve],
            marker="o",
            markersize=3,
            linestyle=styles.get(run_["lag"], "-"),
            color=colours[run_["method"]],
            label=f"{run_['method']} K={run_['lag']}",
        )
    axes[0].set_xscale("log", base=2)
    axes[0].set_ylim(0, 1)  # a two-seed t-interval spans far beyond [0, 1]
    axes[0].axhline(results["base"]["pass@1"], color="grey", linewidth=1)
    axes[0].set_xlabel(f"lag K ({results['options']['lag_via']}); same optimizer steps for every K")
    axes[0].set_ylabel("final held-out sampled pass@1 (95 % CI)")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel(f"optimizer step (seed {first_seed})")
    axes[1].set_ylabel("held-out sampled pass@1")
    axes[1].legend(fontsize=7, ncol=2)
    figure.suptitle(
        "Staleness: TOPR vs GRPO-clip with mu lagging pi by up to K - 1 updates "
        "(dotted: K = 1 mean - CI; grey: base model)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def update_summary(results: dict) -> None:
    """`results`' summary and paired comparisons, from its runs (for --resummarise)."""
    methods = [m for m in METHOD_TRAINERS if any(run["method"] == m for run in results["runs"].values())]
    lags = sorted({run["lag"] for run in results["runs"].values()})
    results["summary"] = summarise(results["runs"], methods, lags)
    results["paired"] = paired_comparisons(results["runs"], methods, lags)
    for name, difference in results["paired"].items():
        print(f"paired late pass@1 {name:<24} {difference['mean']:+.3f} ± {difference['ci95']:.3f}")


def main(argv=None) -> dict:
    parser = experiment_parser(
        __doc__, output="experiments/evidence/staleness/staleness", epochs=None, eval_prompts=500
    )
    # the warm model cache is shared with sample_efficiency.py; 3e-4 is its learning rate
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=tuple(METHOD_TRAINERS))
    parser.add_argument(
        "--lags",
        type=int,
        nargs="+",
        default=[1, 4, 16, 64],
        help="K: mu lags pi by up to K - 1 updates (K = 1 must be among them for the summary rule)",
    )
    parser.add_argument(
        "--lag_via", default="num_iterations", choices=LAG_VIA, help="the GRPOConfig field set to K (see the docstring)"
    )
    parser.add_argument(
        "--reuse_spacing",
        type=int,
        default=1,
        help="with --lag_via num_iterations: steps between two uses of one batch (S, set as "
        "steps_per_generation): S = 1 reuses a batch K times back to back, S > 1 generates S "
        "batches at once and cycles through them K times (same completions, mu up to S x K - 1 "
        "updates behind)",
    )
    parser.add_argument("--steps", type=int, default=64, help="optimizer steps, the same for every K")
    parser.add_argument("--num_generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--checkpoints", type=int, default=4, help="evaluations per training run")
    parser.add_argument("--smoke", action="store_true", help=f"a tiny run (overrides: {SMOKE})")
    rewritten = resummarise_if_asked(parser, argv, update_summary, plot)
    if rewritten is not None:
        return rewritten
    options = parse_testbed_options(parser, argv, SMOKE)
    if any(lag < 1 for lag in options.lags) or 1 not in options.lags:
        parser.error("--lags must be >= 1 and include 1 (the on-policy reference of the summary)")
    options.lags = sorted(set(options.lags))
    if options.reuse_spacing < 1 or (options.reuse_spacing > 1 and options.lag_via != "num_iterations"):
        parser.error("--reuse_spacing must be >= 1, and above 1 only with --lag_via num_iterations")
    results = run(options)
    save(results, options, plot)
    print(f"base pass@1 {results['base']['pass@1']:.3f}", flush=True)
    for method, row in results["summary"].items():
        for lag, entry in row["lags"].items():
            final, logged = entry["final_pass@1"], entry["logged"]
            shown = {
                k: round(v, 3)
                for k, v in logged.items()
                if k in ("topr/ratio_negative/min", "topr/negative_truncated_fraction", "clip_ratio/region_mean")
            }
            late = entry["late_pass@1"]
            print(
                f"{method:<10} K={lag:<3} final pass@1 {final['mean']:.3f} ± {final['ci95']:.3f}  "
                f"late {late['mean']:.3f} ± {late['ci95']:.3f}  "
                f"completions {entry['completions']['mean']:>6.0f}  {entry['seconds']['mean']:5.0f}s  {shown}",
                flush=True,
            )
        if "largest_tolerated_lag" in row:
            rule = row["largest_tolerated_lag"]
            print(
                f"{method:<10} largest K within one CI of K=1 (>= {rule['threshold']:.3f}): {rule['lag']}", flush=True
            )
    for name, difference in results["paired"].items():
        print(f"paired late pass@1 {name:<24} {difference['mean']:+.3f} ± {difference['ci95']:.3f}", flush=True)
    return results


if __name__ == "__main__":
    main()
