"""Asynchronous against synchronous TOPR: trained samples per second at equal optimizer steps, in one run.

Both runs use `AsyncTOPRTrainer` and the stand-in rollout worker (`topr_trl.asynchronous.LaggedRolloutWorker`) on the
same model, prompts, batch and steps; they differ only in whether generation may overlap training:

    synchronous   the worker in lockstep: it generates a step's samples, then waits for the new policy version
    asynchronous  the worker runs ahead, up to --pipeline_steps steps of samples (TRL's default depth, 4)

Generation is made to take about as long as training, the case the issue names: a calibration run (synchronous,
no set time) measures the trainer's own time per step T (TRL's perf/fwd_bwd_s + perf/optimizer_s) and the worker's
real sampling time; the worker is then given seconds_per_sample = T / samples per step, so that a step's generation
takes max(T, real sampling time). The ideal ratio is (L + T) / max(L, T) = 2 at L = T. Runs alternate
(sync, async, sync, async, ...) so machine noise hits both alike; the ratio is reported per pair, with its median.

The model is random-initialised (speed does not depend on the weights) with --hidden_size, 4 layers, the project's
character tokenizer, and completions forced to --completion_length tokens (min_new_tokens) so every step does the
same work. One torch thread per side (OMP_NUM_THREADS=1): the trainer on one core, the worker thread on the other.

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.async_throughput               # experiments/evidence/benchmarks/async_throughput.json
    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.async_throughput --smoke --output /tmp/async_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import PrinterCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from topr_trl.asynchronous import AsyncTOPRConfig, AsyncTOPRTrainer  # noqa: E402
from topr_trl.asynchronous.stand_in import WorkerSettings, build_async_trainer  # noqa: E402
from topr_trl.tasks.reasoning import make_reasoning_dataset, reasoning_reward  # noqa: E402
from topr_trl.tasks.tiny import build_model, build_tokenizer, save_pretrained  # noqa: E402


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=3, help="synchronous/asynchronous run pairs")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--completion_length", type=int, default=32)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--pipeline_steps", type=int, default=4)
    parser.add_argument("--calibration_steps", type=int, default=6)
    parser.add_argument("--smoke", action="store_true", help="seconds: 4 steps, 1 pair, hidden 64")
    parser.add_argument("--output", default="experiments/evidence/benchmarks/async_throughput.json")
    options = parser.parse_args(argv)
    if options.smoke:
        options.steps, options.pairs, options.hidden_size, options.calibration_steps = 4, 1, 64, 3
        options.batch_size, options.completion_length = 16, 8
    return options


def one_run(model_path, options, worker: WorkerSettings, output_dir) -> dict:
    args = AsyncTOPRConfig(
        output_dir=str(output_dir),
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=options.batch_size,
        num_generations=options.num_generations,
        max_completion_length=options.completion_length,
        max_steps=worker_steps(options, worker),
        learning_rate=1e-4,
        token_budget=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = build_async_trainer(
        AsyncTOPRTrainer, model_path, reasoning_reward, args, make_reasoning_dataset(256), worker
    )
    trainer.remove_callback(PrinterCallback)  # the per-step logs stay in trainer.state.log_history
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    steps = [entry for entry in trainer.state.log_history if "perf/fwd_bwd_s" in entry]
    groups = options.batch_size // options.num_generations
    return {
        "wall_s": wall,
        "steps": len(steps),
        "trained_samples": sum(entry["batch/samples_per_step"] for entry in steps),
        "train_s_per_step": statistics.median(entry["perf/fwd_bwd_s"] + entry["perf/optimizer_s"] for entry in steps),
        "generation_s_per_step": statistics.median(
            entry["rollout/generation_s"] * groups for entry in steps if entry.get("rollout/generation_s")
        ),
        "rollout_wait_s_per_step": statistics.median(entry["perf/rollout_wait_s"] for entry in steps),
        "staleness_mean": statistics.mean(entry["sample/staleness_mean"] for entry in steps),
    }


def worker_steps(options, worker) -> int:
    return options.calibration_steps if worker.seconds_per_sample == 0 and worker.lockstep else options.steps


def main(argv=None) -> dict:
    options = parse(sys.argv[1:] if argv is None else argv)
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="async-throughput-"))
    tokenizer = build_tokenizer()
    model_path = str(
        save_pretrained(
            build_model(tokenizer, hidden_size=options.hidden_size, num_layers=4), tokenizer, work / "model"
        )
    )
    force = options.completion_length
    calibration = one_run(model_path, options, WorkerSettings(lockstep=True, min_new_tokens=force), work / "calibrate")
    samples_per_step = options.batch_size
    seconds_per_sample = calibration["train_s_per_step"] / samples_per_step
    print(
        f"calibration: training {calibration['train_s_per_step']:.3f} s/step, real sampling "
        f"{calibration['generation_s_per_step']:.3f} s/step -> {seconds_per_sample * 1000:.2f} ms per sample",
        flush=True,
    )
    pairs = []
    for index in range(options.pairs):
        pair = {}
        for mode, lockstep in (("synchronous", True), ("asynchronous", False)):
            worker = WorkerSettings(
                seconds_per_sample=seconds_per_sample,
                lockstep=lockstep,
                pipeline_steps=options.pipeline_steps,
                min_new_tokens=force,
            )
            result = one_run(model_path, options, worker, work / f"{mode}-{index}")
            result["samples_per_s"] = result["trained_samples"] / result["wall_s"]
            pair[mode] = result
            print(
                f"pair {index} {mode}: {result['samples_per_s']:.1f} samples/s, {result['wall_s']:.1f} s, "
                f"generation {result['generation_s_per_step']:.3f} s/step, training "
                f"{result['train_s_per_step']:.3f} s/step, staleness {result['staleness_mean']:.2f}",
                flush=True,
            )
        pair["ratio"] = pair["asynchronous"]["samples_per_s"] / pair["synchronous"]["samples_per_s"]
        pairs.append(pair)
    ratios = [pair["ratio"] for pair in pairs]
    results = {
        "what": "trained samples per second, asynchronous / synchronous AsyncTOPRTrainer, equal optimizer steps",
        "machine": "2-core CPU VM, OMP_NUM_THREADS=1 (trainer on one core, stand-in worker thread on the other)",
        "options": vars(options),
        "calibration": calibration,
        "seconds_per_sample": seconds_per_sample,
        "pairs": pairs,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ideal_ratio": "(L + T) / max(L, T), 2 at L = T",
    }
    print(
        f"asynchronous / synchronous trained samples per second: median {results['ratio_median']:.2f} "
        f"(range {results['ratio_min']:.2f}-{results['ratio_max']:.2f}, {len(ratios)} pairs)"
    )
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(options.output).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
