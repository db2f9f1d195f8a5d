"""Accuracy of asynchronous training on the real pipeline: a `topr-trl vllm-serve` process generates, TRL's own
rollout worker feeds the trainer, and the trainer's weights reach the server through its gloo weight path.

Where experiments/async_staleness.py sets the lag with a stand-in worker in lockstep, here nothing is staged: the
worker generates on the server while the trainer trains, and the staleness of each sample is whatever the pipeline
gives. Its depth is set the way a deployment sets it, by how often the weights are pushed (TRL's
`weight_sync_steps` W): the server then samples from one version for W steps, so samples arrive 0 to W - 1 versions
behind, plus the queue's own lag (the queue holds one step's samples, `queue_maxsize` = the batch, so that the
worker cannot run further ahead than the weight schedule). TRL's `sample/staleness_mean` counts weight pushes, not
updates; the summary gives both it and the lag in optimizer updates (`update_lag`). W = 1, 8 and 32 give a mean lag
of about 2, 5 and 16 updates. Methods:

    sync_topr         TOPRTrainer in vLLM server mode on the same server: generate a step, push, train (staleness 0)
    async_topr        AsyncTOPRTrainer with TRL's rollout worker, defaults (TOPR, keeps every sample)
    async_grpo_keep   TRL's AsyncGRPOTrainer with TRL's rollout worker, max_staleness=10**9: the loss TRL ships for
                      asynchronous training (token-level PPO clipping at 0.2), keeping every sample; run on a CPU
                      through `topr_trl.asynchronous.cpu.cpu_capable`, with this package's gloo weight path

Every run starts from the reasoning testbed's warm model (TRL's trainers push it to the server before the first
generation, so one server serves every run in turn), with the same prompts per seed, learning rate, batch and steps
as experiments/async_staleness.py, and a constant learning rate for every trainer (the default of TRL's
asynchronous config; GRPOConfig's is a linear decay to 0, which left alone would confound the comparison). The
server runs in float32 (the trainer's dtype) so that π/μ carries staleness
alone, pinned to the first core; the trainer, its worker and the evaluation run on the second. One thread each.

Held-out sampled pass@1 (temperature 1, the seed's own evaluation draw) at --checkpoints evenly spaced steps; the
robust statistic of a run is its late pass@1 (the mean of the checkpoints in the last quarter of the steps). Per
(method, W): late and final pass@1 (mean and 95 % t-interval over seeds), measured staleness, samples dropped, and
the first checkpoint whose seed-mean pass@1 reaches the synchronous runs' mean final pass@1, with its training
seconds (evaluation excluded; while the trainer evaluates, an asynchronous worker may fill its one-step queue, a
head start of at most one step per checkpoint). Paired by seed: async_topr against async_grpo_keep at each W, and
each asynchronous (method, W) against sync_topr.

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m experiments.async_server_accuracy \\
        --seeds 0 1 2 3 4 --learning_rate 1e-4 --output experiments/evidence/asynchronous/server_accuracy
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m experiments.async_server_accuracy --smoke \\
        --output /tmp/server_accuracy_smoke
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from experiments.async_server_throughput import free_port, start_server  # noqa: E402
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
    paired_difference,
    parse_testbed_options,
    prepare_testbed,
    save,
)


METHODS = {
    "sync_topr": "TOPRTrainer, vLLM server mode (synchronous)",
    "async_topr": "AsyncTOPRTrainer, TRL's worker (TOPR, keeps every sample)",
    "async_grpo_keep": "AsyncGRPOTrainer, TRL's worker, max_staleness=10**9 (PPO-clip, keeps every sample)",
}
SYNCHRONOUS = "sync_topr"
# logged per step by the trainers, averaged over a run's steps
DIAGNOSTICS = (
    "topr/weight_negative/mean",
    "topr/negative_truncated_fraction",
    "topr/ratio_negative/p50",
    "topr/ratio_positive/p50",
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
)
SMOKE = dict(
    seeds=[0],
    steps=6,
    batch_size=16,
    sync_every=[1, 4],
    eval_prompts=32,
    eval_samples=2,
    checkpoints=2,
    methods=list(METHODS),
)


def build_parser():
    parser = experiment_parser(
        __doc__,
        output="experiments/evidence/asynchronous/server_accuracy",
        epochs=None,
        eval_prompts=500,
        methods=METHODS,
    )
    parser.set_defaults(seeds=[0, 1, 2, 3, 4], learning_rate=1e-4)
    parser.add_argument(
        "--sync_every",
        type=int,
        nargs="+",
        default=[1, 8, 32],
        help="weight_sync_steps of the asynchronous runs: the pipeline's depth",
    )
    parser.add_argument(
        "--in_flight",
        type=int,
        default=None,
        help="samples the asynchronous worker may have in flight and queued (max_inflight_tasks and "
        "queue_maxsize; default: --batch_size, one step's): fewer make the pipeline shallower",
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--checkpoints", type=int, default=8, help="evaluations per run, evenly spaced")
    parser.add_argument(
        "--heartbeat", type=float, default=120.0, help="seconds without a sample after which TRL's trainer stops a run"
    )
    parser.add_argument("--smoke", action="store_true")
    return parser


def parse(parser, argv):
    return parse_testbed_options(parser, argv, SMOKE)


def build_trainer(method: str, sync_every: int, options, seed: int, base_path, url: str, output_dir: Path):
    """The trainer of one run, on the server at `url`."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.asynchronous import AsyncTOPRConfig, AsyncTOPRTrainer
    from topr_trl.asynchronous.cpu import cpu_capable
    from topr_trl.asynchronous.trainer import gloo_weight_transfer
    from topr_trl.tasks.reasoning import make_reasoning_dataset, max_completion_tokens, reasoning_reward

    prompts = make_reasoning_dataset(
        options.steps * options.batch_size // options.num_generations, options.digits, "train", seed=seed
    )
    common = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=options.batch_size,
        num_generations=options.num_generations,
        max_completion_length=max_completion_tokens(options.digits),
        temperature=1.0,
        learning_rate=options.learning_rate,
        max_grad_norm=1.0,
        max_steps=options.steps,
        # one schedule for all: AsyncGRPOConfig's default is constant, GRPOConfig's linear decay to 0
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=seed,
        disable_tqdm=True,
        vllm_server_base_url=url,
    )
    if method == SYNCHRONOUS:
        args = TOPRConfig(**common, use_vllm=True, vllm_mode="server", vllm_group_port=free_port())
        return TOPRTrainer(str(base_path), reasoning_reward, args=args, train_dataset=prompts)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    tokenizer.response_template = qwen3_template  # ChatML: TRL's worker parses responses as Qwen's
    in_flight = options.in_flight or options.batch_size
    pipeline = dict(
        weight_sync_steps=sync_every,
        queue_maxsize=in_flight,
        max_inflight_tasks=in_flight,
        token_budget=0,
        heartbeat_stale_after_s=options.heartbeat,
        max_staleness=10**9,
    )
    if method == "async_topr":
        args = AsyncTOPRConfig(**common, **pipeline)
        return AsyncTOPRTrainer(
            str(base_path), reasoning_reward, args, train_dataset=prompts, processing_class=tokenizer
        )
    args = AsyncGRPOConfig(**common, **pipeline)
    return cpu_capable(AsyncGRPOTrainer)(
        str(base_path),
        reasoning_reward,
        args,
        train_dataset=prompts,
        processing_class=tokenizer,
        weight_transfer=gloo_weight_transfer(args),
    )


def update_lag(step: int, staleness: float, sync_every: int) -> float:
    """Optimizer updates between the weights that generated the batch of `step` (1-based) and the policy that trains
    on it. TRL's staleness counts weight syncs (`model_version` grows once per push, every `sync_every` steps) and is
    taken when the sample is read; the dataloader reads the batch of step s while step s - 1 trains, after s - 2
    updates and (s - 2) // W pushes, so the batch came from the weights of update W * ((s - 2) // W - staleness)."""
    generating_update = sync_every * (max(step - 2, 0) // sync_every - staleness)
    return (step - 1) - generating_update


def pipeline_label(method: str, sync_every: int, in_flight: int | None) -> str:
    """How a run's pipeline was set: "sync", or "w<W>" (pushes every W steps, one step's samples in flight and
    queued) with "-f<N>" where N samples were instead."""
    if method == SYNCHRONOUS:
        return "sync"
    return f"w{sync_every}" + (f"-f{in_flight}" if in_flight else "")


def run_one(method: str, sync_every: int, options, seed: int, base_path, held_out, url: str, work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, PrinterCallback

    torch.manual_seed(seed)
    label = f"{method} {pipeline_label(method, sync_every, options.in_flight)}"
    trainer = build_trainer(
        method, sync_every, options, seed, base_path, url, work / f"{label.replace(' ', '-')}-seed{seed}"
    )
    trainer.remove_callback(PrinterCallback)
    # the clock starts once the trainer is built; the evaluator has the policy's architecture with generation's
    # attention (the asynchronous trainer's packed attention serves training only)
    tracker = Tracker(
        held_out,
        options,
        None,
        f"async_server_accuracy {label} seed {seed}",
        seed,
        evaluator=AutoModelForCausalLM.from_pretrained(base_path),
    )
    trainer.add_callback(checkpoint_callback(tracker, options.checkpoints))
    trainer.train()
    curve = tracker.curve
    history = trainer.state.log_history
    read = [
        (entry["step"], entry["sample/staleness_mean"])
        for entry in history
        if entry.get("sample/staleness_mean") is not None
    ]
    staleness = [value for _, value in read]
    outcome = {
        "steps": trainer.state.global_step,
        "curve": curve,
        "final_pass@1": curve[-1]["pass@1"],
        "training_seconds": curve[-1]["seconds"],
        "dropped": sum(entry.get("sample/dropped_stale_total") or 0 for entry in history),
        "staleness_mean": statistics.mean(staleness) if staleness else 0.0,
        "lag_mean": statistics.mean(update_lag(step, value, sync_every) for step, value in read) if read else 0.0,
        "staleness_counts": {str(k): v for k, v in sorted(getattr(trainer, "staleness_counts", {}).items())},
        # how hard each loss pushed on the samples it got: TOPR's negatives' weights, PPO's clipped share
        "diagnostics": {
            key: statistics.mean(values)
            for key in DIAGNOSTICS
            if (values := [entry[key] for entry in history if entry.get(key) is not None])
        },
    }
    del trainer
    return outcome


def summarise(runs: dict, methods) -> dict:
    """Per (method, pipeline) the late and final pass@1, staleness, lag and time to the synchronous accuracy, in the
    order of the measured lag; the paired differences of late pass@1 at each pipeline."""
    late: dict[tuple, dict[int, float]] = {}
    for run in runs.values():
        late.setdefault((run["method"], run["pipeline"]), {})[run["seed"]] = late_mean(run["curve"])
    synchronous = [run for run in runs.values() if run["method"] == SYNCHRONOUS]
    target = statistics.mean(run["final_pass@1"] for run in synchronous) if synchronous else None
    summary = {}
    for (method, pipeline), by_seed in late.items():
        chosen = [run for run in runs.values() if run["method"] == method and run["pipeline"] == pipeline]
        entry = {
            "late_pass@1": mean_and_ci95(list(by_seed.values())),
            "final_pass@1": mean_and_ci95([run["final_pass@1"] for run in chosen]),
            "staleness_mean": statistics.mean(run["staleness_mean"] for run in chosen),
            "lag_mean": statistics.mean(run["lag_mean"] for run in chosen),
            "dropped_mean": statistics.mean(run["dropped"] for run in chosen),
            "steps_mean": statistics.mean(run["steps"] for run in chosen),
            "training_seconds_mean": statistics.mean(run["training_seconds"] for run in chosen),
            "seeds": sorted(by_seed),
        }
        if target is not None:
            entry["reaches_sync_final"] = first_checkpoint_reaching(chosen, target)
        summary[f"{method}/{pipeline}"] = entry
    summary = dict(
        sorted(summary.items(), key=lambda item: (methods.index(item[0].split("/")[0]), item[1]["lag_mean"]))
    )
    paired = {}
    pipelines = dict.fromkeys(key.split("/")[1] for key in summary if not key.startswith(SYNCHRONOUS))
    for pipeline in pipelines:
        if ("async_topr", pipeline) in late and ("async_grpo_keep", pipeline) in late:
            paired[f"async_topr-async_grpo_keep/{pipeline}"] = paired_difference(
                late["async_topr", pipeline], late["async_grpo_keep", pipeline]
            )
        for method in ("async_topr", "async_grpo_keep"):
            if (method, pipeline) in late and synchronous:
                paired[f"{method}/{pipeline}-{SYNCHRONOUS}"] = paired_difference(
                    late[method, pipeline], late[SYNCHRONOUS, "sync"]
                )
    return {"sync_reference_final_pass@1": target, "by_method_and_pipeline": summary, "paired": paired}


def update_summary(results: dict) -> None:
    results["summary"] = summarise(results["runs"], results["options"]["methods"])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]["by_method_and_pipeline"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for method in results["options"]["methods"]:
        if method == SYNCHRONOUS:
            if f"{SYNCHRONOUS}/sync" in summary:
                late = summary[f"{SYNCHRONOUS}/sync"]["late_pass@1"]
                left.axhline(late["mean"], color="black", label=f"{METHODS[method]} ({late['mean']:.3f})")
                left.axhspan(late["mean"] - late["ci95"], late["mean"] + late["ci95"], color="black", alpha=0.1)
            continue
        entries = [summary[key] for key in summary if key.startswith(method + "/")]
        left.errorbar(
            [e["lag_mean"] for e in entries],
            [e["late_pass@1"]["mean"] for e in entries],
            yerr=[e["late_pass@1"]["ci95"] for e in entries],
            marker="o",
            capsize=3,
            label=METHODS[method],
        )
    if results.get("base"):
        left.axhline(results["base"]["pass@1"], color="grey", linestyle=":", label="base model")
    left.set_xscale("log", base=2)
    left.set_xticks([1, 2, 4, 8, 16, 32], ["1", "2", "4", "8", "16", "32"])
    left.set_xlabel("mean lag of the trained samples (optimizer updates, measured)")
    left.set_ylabel("held-out pass@1 (late: last quarter of steps)")
    left.legend(fontsize=7)
    for key in summary:
        runs = [run for run in results["runs"].values() if f"{run['method']}/{run['pipeline']}" == key]
        steps = sorted({point["step"] for run in runs for point in run["curve"]})
        seconds = [statistics.mean(p["seconds"] for run in runs for p in run["curve"] if p["step"] == s) for s in steps]
        accuracy = [statistics.mean(p["pass@1"] for run in runs for p in run["curve"] if p["step"] == s) for s in steps]
        right.plot(seconds, accuracy, marker=".", label=key)
    right.set_xlabel("training seconds (evaluation excluded), mean over seeds")
    right.set_ylabel("held-out pass@1, mean over seeds")
    right.legend(fontsize=7)
    figure.suptitle(f"Real pipeline: vLLM server + TRL's worker ({len(results['options']['seeds'])} seeds, 95% CI)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def merge(options) -> dict:
    results = merge_results(options.merge)
    runs = results["runs"].values()
    results["options"]["methods"] = [method for method in METHODS if any(run["method"] == method for run in runs)]
    results["options"]["output"] = options.output
    update_summary(results)
    return results


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    finished = finished_runs_if_asked(parser, argv, update_summary, plot, merge)
    if finished is not None:
        return finished
    options = parse(parser, argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {1})  # the trainer, its worker and the evaluation on the second core
    try:
        return run_all(options)
    finally:
        os.sched_setaffinity(0, cores)


def run_all(options) -> dict:
    started = time.time()
    model, tokenizer, base_path, held_out, results = prepare_testbed(options)
    results["base"] = base_summary(base_points(model, tokenizer, held_out, options))
    results["pipeline"] = (
        "topr-trl vllm-serve (float32, core 0) + TRL's rollout worker; queue_maxsize and "
        "max_inflight_tasks = batch_size; weight_sync_steps = W"
    )
    print(f"[async_server_accuracy] base pass@1 {results['base']['pass@1']:.3f}", flush=True)
    work = Path(options.work_dir) / "async-server-accuracy-runs"
    work.mkdir(parents=True, exist_ok=True)
    server, url = start_server(str(base_path), work / "server.log", "float32")
    output = Path(options.output + ".json")
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        for seed in options.seeds:
            for method in options.methods:
                for depth in [0] if method == SYNCHRONOUS else options.sync_every:
                    outcome = run_one(method, depth, options, seed, base_path, held_out, url, work)
                    pipeline = pipeline_label(method, depth, options.in_flight)
                    results["runs"][f"{method}/{pipeline}/seed{seed}"] = {
                        "method": method,
                        "pipeline": pipeline,
                        "sync_every": depth,
                        "in_flight": options.in_flight,
                        "seed": seed,
                        **outcome,
                    }
                    output.write_text(json.dumps(results, indent=1))  # progress kept
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    update_summary(results)
    results["seconds"] = time.time() - started
    save(results, options, plot)
    return results


if __name__ == "__main__":
    main()
