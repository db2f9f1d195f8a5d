"""Accuracy against staleness for asynchronous training on the reasoning testbed: TOPR keeping every sample against
TRL's AsyncGRPOTrainer as shipped (dropping stale samples) and GRPO-clip keeping them.

Every run trains the reasoning testbed's warm model (`topr_trl.tasks.reasoning`, as experiments/staleness.py) with a
trainer of TRL's asynchronous family fed by the stand-in worker (`topr_trl.asynchronous.LaggedRolloutWorker`) in
lockstep with lag K: the samples of each step come from the policy K versions before the newest one, so TRL's
staleness counter reads K for every sample once K versions exist (and the sample is trained one optimizer step
after it is read: TRL's dataloader reads one micro-batch ahead). Methods:

    async_topr        AsyncTOPRTrainer, defaults: TOPR's loss (Eq. 7, group-advantage signal), no staleness cap
    async_grpo_drop   trl.experimental.async_grpo.AsyncGRPOTrainer as shipped: token-level PPO clipping at
                      epsilon 0.2 and max_staleness=4 (a sample more than 4 versions old is dropped)
    async_grpo_keep   the same trainer with max_staleness=10**9: GRPO-clip keeping every sample
    async_topr_token_mean  the control: AsyncTOPRTrainer with TRL's aggregation (the sum over the micro-batch's
                      tokens divided by their number) instead of the paper's mean over completions of the mean over
                      each completion's tokens: what is TOPR's loss and what is the aggregation
    async_tis         Figure 1's controls: AsyncTOPRTrainer with loss_type="tis" (the ratio capped
    async_sft_positives  at 1 on both branches) and loss_type="sft" (positives only), keeping every sample

(TRL's trainer runs on a CPU through `topr_trl.asynchronous.cpu.cpu_capable`; nothing else of it is changed.) With
K > 4 the dropping trainer gets no sample it accepts once K versions exist: the lockstep worker then waits for a
new version that never comes and the run stops at TRL's heartbeat check (`--heartbeat` seconds); the steps it
trained are recorded, and the model is evaluated as it stands.

Held-out sampled pass@1 (temperature 1, --eval_samples per problem on --eval_prompts problems of the held-out split,
disjoint from the training prompts) at --checkpoints evenly spaced steps; the robust statistic of a run is its late
pass@1, the mean of its checkpoints in the last quarter of the steps (`experiments.late_mean`). Per (method, K): the
late and final pass@1 (mean and 95 % t-interval over seeds), samples dropped, steps trained, and the first checkpoint
whose seed-mean pass@1 reaches the final pass@1 of async_topr at K=0 (the synchronous reference: lockstep, no lag),
with its training seconds (evaluation excluded). Paired by seed (`experiments.paired_difference`): the first method
against each other one at every K, and every method's K against its own K = 0. One torch thread.
`--resummarise JSON` recomputes the summary of finished runs.

    # the rerun under the method of experiments/README.md (experiments/evidence/asynchronous/async_staleness): shipped model, learning rate 1e-4 (chosen on
    # validation for the synchronous runs), 8 checkpoints; the keeping trainers first, then the dropping one and
    # the control
    S=experiments.async_staleness O=outputs/async_v2 common="--seeds 0 1 2 3 4 --learning_rate 1e-4 --checkpoints 8"
    OMP_NUM_THREADS=1 .venv/bin/python -m $S $common --methods async_topr async_grpo_keep --output $O/main
    OMP_NUM_THREADS=1 .venv/bin/python -m $S $common --methods async_grpo_drop --lags 16 64 --output $O/drop
    OMP_NUM_THREADS=1 .venv/bin/python -m $S $common --methods async_topr_token_mean --lags 0 64 --output $O/control
    .venv/bin/python -m $S --merge $O/main.json $O/drop.json $O/control.json --output experiments/evidence/asynchronous/async_staleness
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.async_staleness --smoke --output /tmp/async_staleness_smoke
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from experiments.common import (  # noqa: E402
    Tracker,
    base_points,
    base_summary,
    checkpoint_callback,
    experiment_parser,
    finished_runs_if_asked,
    first_checkpoint_reaching,
    late_mean,
    mean_and_ci95,
    merge_results,
    paired_by_lag,
    parse_testbed_options,
    prepare_testbed,
    save,
)


METHODS = {
    "async_topr": "AsyncTOPRTrainer (TOPR, keeps every sample)",
    "async_grpo_drop": "AsyncGRPOTrainer as shipped (PPO-clip, drops samples > 4 versions old)",
    "async_grpo_keep": "AsyncGRPOTrainer, max_staleness=10**9 (PPO-clip, keeps every sample)",
    "async_topr_token_mean": "AsyncTOPRTrainer, loss over the micro-batch's tokens (TRL's aggregation)",
    "async_tis": "AsyncTOPRTrainer, loss_type='tis' (truncated IS, keeps every sample)",
    "async_sft_positives": "AsyncTOPRTrainer, loss_type='sft' (positives only, keeps every sample)",
}
# What each method trains with: its package's asynchronous trainer and config, and the fields it sets on top of the
# shared ones ("topr_trl": AsyncTOPRTrainer; "trl": TRL's AsyncGRPOTrainer made CPU-capable).
METHOD_SETTINGS = {
    "async_topr": ("topr_trl", {}),
    "async_grpo_drop": ("trl", {"max_staleness": 4}),
    "async_grpo_keep": ("trl", {"max_staleness": 10**9}),
    "async_topr_token_mean": ("topr_trl", {"topr_loss_aggregation": "global-token-mean"}),
    "async_tis": ("topr_trl", {"loss_type": "tis"}),
    "async_sft_positives": ("topr_trl", {"loss_type": "sft"}),
}
SMOKE = dict(
    seeds=[0],
    steps=6,
    batch_size=16,
    lags=[0, 8],
    eval_prompts=32,
    eval_samples=2,
    checkpoints=2,
    heartbeat=5.0,
    methods=["async_topr", "async_grpo_drop"],
)


def build_parser():
    parser = experiment_parser(
        __doc__,
        output="experiments/evidence/asynchronous/async_staleness",
        epochs=None,
        eval_prompts=500,
        methods=METHODS,
    )
    parser.set_defaults(seeds=[0, 1, 2, 3, 4])
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 4, 16, 64])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--checkpoints", type=int, default=8, help="evaluations per run, evenly spaced")
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=10.0,
        help="seconds without a sample after which a run stops (TRL's heartbeat check)",
    )
    parser.add_argument("--smoke", action="store_true")
    return parser


def parse(parser, argv):
    return parse_testbed_options(parser, argv, SMOKE)


def run_one(method, lag, options, seed, base_path, held_out, work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, PrinterCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from topr_trl.asynchronous import AsyncTOPRConfig, AsyncTOPRTrainer
    from topr_trl.asynchronous.cpu import cpu_capable
    from topr_trl.asynchronous.stand_in import WorkerSettings, build_async_trainer
    from topr_trl.tasks.reasoning import make_reasoning_dataset, max_completion_tokens, reasoning_reward

    prompts = make_reasoning_dataset(
        options.steps * options.batch_size // options.num_generations, options.digits, "train", seed=seed
    )
    common = dict(
        output_dir=str(work / f"{method}-k{lag}-seed{seed}"),
        per_device_train_batch_size=options.batch_size,
        num_generations=options.num_generations,
        max_completion_length=max_completion_tokens(options.digits),
        temperature=1.0,
        learning_rate=options.learning_rate,
        max_grad_norm=1.0,
        max_steps=options.steps,
        token_budget=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=seed,
        disable_tqdm=True,
        heartbeat_stale_after_s=options.heartbeat,
    )
    package, overrides = METHOD_SETTINGS[method]
    trainer_class, config_class = {
        "topr_trl": (AsyncTOPRTrainer, AsyncTOPRConfig),
        "trl": (cpu_capable(AsyncGRPOTrainer), AsyncGRPOConfig),
    }[package]
    config = config_class(**common, **overrides)
    torch.manual_seed(seed)
    # the evaluator has the policy's architecture with generation's attention (the trainer's packed attention
    # serves training only)
    tracker = Tracker(
        held_out,
        options,
        None,
        f"async_staleness {method} K={lag} seed {seed}",
        seed,
        evaluator=AutoModelForCausalLM.from_pretrained(base_path),
    )
    trainer = build_async_trainer(
        trainer_class,
        str(base_path),
        reasoning_reward,
        config,
        prompts,
        WorkerSettings(lag=lag, lockstep=True),
        callbacks=[checkpoint_callback(tracker, options.checkpoints)],
    )
    trainer.remove_callback(PrinterCallback)
    stalled = None
    try:
        trainer.train()
    except RuntimeError as error:  # TRL's heartbeat check: no acceptable sample arrived
        stalled = str(error)
        trainer.rollout_worker.stop()
        if not tracker.curve or tracker.curve[-1]["step"] != trainer.state.global_step:
            tracker.checkpoint(
                trainer.accelerator.unwrap_model(trainer.model),
                trainer.processing_class,
                step=trainer.state.global_step,
            )
    curve = tracker.curve
    history = trainer.state.log_history
    return {
        "steps": trainer.state.global_step,
        "stalled": stalled,
        "curve": curve,
        # logged, plus what TRL's sink holds for the next log (a stalled run stops before logging its drops)
        "dropped": sum(entry.get("sample/dropped_stale_total") or 0 for entry in history)
        + sum(trainer._metrics["train"].get("sample/dropped_stale_total", [])),
        "trained_samples": sum(entry.get("batch/samples_per_step") or 0 for entry in history),
        "staleness_mean": statistics.mean(
            [entry["sample/staleness_mean"] for entry in history if entry.get("sample/staleness_mean") is not None]
            or [math.nan]
        ),
        "final_pass@1": curve[-1]["pass@1"],
    }


def summarise(runs: dict, methods, lags) -> dict:
    summary = {}
    reference = [run["final_pass@1"] for run in runs.values() if run["method"] == "async_topr" and run["lag"] == 0]
    target = statistics.mean(reference) if reference else None
    for method in methods:
        for lag in lags:
            chosen = [run for run in runs.values() if run["method"] == method and run["lag"] == lag]
            if not chosen:
                continue
            entry = {
                "late_pass@1": mean_and_ci95([late_mean(run["curve"]) for run in chosen]),
                "final_pass@1": mean_and_ci95([run["final_pass@1"] for run in chosen]),
                "dropped_mean": statistics.mean(run["dropped"] for run in chosen),
                "steps_mean": statistics.mean(run["steps"] for run in chosen),
                "stalled_runs": sum(run["stalled"] is not None for run in chosen),
                "staleness_mean": statistics.mean(run["staleness_mean"] for run in chosen),
                "seeds": sorted(run["seed"] for run in chosen),
            }
            if target is not None:
                entry["reaches_sync_final"] = first_checkpoint_reaching(chosen, target)
            summary[f"{method}/k{lag}"] = entry
    return {
        "sync_reference_final_pass@1": target,
        "by_method_and_lag": summary,
        # the first method against each other one at every K, each K against K = 0 within a method
        "paired": paired_by_lag(runs, methods, lags, reference=0),
    }


def update_summary(results: dict) -> None:
    """Recomputes `results["summary"]` from its runs in place (`--resummarise`)."""
    results["summary"] = summarise(results["runs"], results["options"]["methods"], results["options"]["lags"])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]["by_method_and_lag"]
    lags = results["options"]["lags"]
    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    for method in results["options"]["methods"]:
        points = [(lag, summary[f"{method}/k{lag}"]["late_pass@1"]) for lag in lags if f"{method}/k{lag}" in summary]
        positions = [lags.index(lag) for lag, _ in points]
        stalled = [lag for lag, _ in points if summary[f"{method}/k{lag}"]["stalled_runs"]]
        label = METHODS[method] + (f"; stopped after ~5 steps at K = {', '.join(map(str, stalled))}" if stalled else "")
        axis.errorbar(
            positions,
            [p["mean"] for _, p in points],
            yerr=[p["ci95"] for _, p in points],
            marker="o",
            capsize=3,
            label=label,
            linestyle="-" if len(points) == len(lags) else "none",
        )
    if results.get("base"):
        axis.axhline(results["base"]["pass@1"], color="grey", linestyle=":", label="base model")
    axis.set_xticks(range(len(lags)), [str(lag) for lag in lags])
    axis.set_xlabel("lag K of the behaviour policy (policy versions)")
    axis.set_ylabel("held-out pass@1 (late: last quarter of steps)")
    axis.set_title(f"Asynchronous training against staleness ({len(results['options']['seeds'])} seeds, 95% CI)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def merge(options) -> dict:
    """One results dict from the files of one experiment split into disjoint runs (other seeds, methods or lags)."""
    results = merge_results(options.merge)
    runs = results["runs"].values()
    results["options"]["methods"] = [method for method in METHODS if any(run["method"] == method for run in runs)]
    results["options"]["lags"] = sorted({run["lag"] for run in runs})
    results["summary"] = summarise(results["runs"], results["options"]["methods"], results["options"]["lags"])
    results["options"]["output"] = options.output
    return results


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    finished = finished_runs_if_asked(parser, argv, update_summary, plot, merge)
    if finished is not None:
        return finished
    options = parse(parser, argv)
    started = time.time()
    model, tokenizer, base_path, held_out, results = prepare_testbed(options)
    results["base"] = base_summary(base_points(model, tokenizer, held_out, options))
    print(f"[async_staleness] base pass@1 {results['base']['pass@1']:.3f} (mean over the seeds' draws)", flush=True)
    work = Path(options.work_dir) / "async-staleness-runs"
    for seed in options.seeds:
        for method in options.methods:
            for lag in options.lags:
                outcome = run_one(method, lag, options, seed, base_path, held_out, work)
                results["runs"][f"{method}/k{lag}/seed{seed}"] = {"method": method, "lag": lag, "seed": seed, **outcome}
                Path(options.output + ".json").parent.mkdir(parents=True, exist_ok=True)
                Path(options.output + ".json").write_text(json.dumps(results, indent=1))  # progress kept
    results["summary"] = summarise(results["runs"], options.methods, options.lags)
    results["seconds"] = time.time() - started
    save(results, options, plot)
    return results


if __name__ == "__main__":
    main()
