"""Asynchronous TOPR against synchronous TOPR on a real vLLM server: trained samples per second at equal steps.

One `topr-trl vllm-serve` process generates for both (its gloo weight path keeps it on the policy); the trainer runs
in this process. The two runs differ only in whether generation may overlap training:

    synchronous   TOPRTrainer(use_vllm=True, vllm_mode="server"): generate a step's completions, push the weights,
                  train on them, and so on (TRL's GRPOTrainer loop)
    asynchronous  AsyncTOPRTrainer with TRL's own rollout worker on the same server: it generates while the trainer
                  trains, the weights are pushed after each step (TRL's protocol, `GlooWeightTransfer`)

No sleeps anywhere: generation is the server's real sampling, training the trainer's real steps. The server is
pinned to the first core and the trainer to the second (one thread each), so that they overlap only where the
asynchronous pipeline lets them. `--model tiny` (default) is random-initialised with --hidden_size and --num_layers
on the project's character tokenizer, prompts from the reasoning task; `--model smollm2` is the real model
(SmolLM2-135M-Instruct, the packaged copy where the Hub cannot be reached) on the word-problems task, its chat prompts
and TRL's rollout worker parsing its ChatML responses. Runs alternate
(synchronous, asynchronous, ...) so machine noise hits both alike; the ratio of samples per second is reported per
pair, with its median. Samples per second are counted in the steady state, from the end of the first step to the
end of the last (the worker's start and the first push excluded), as the samples each step trained (by default
the asynchronous trainer packs the synchronous step's batch, `token_budget=0`; `--token_budget N` fills rows of N
tokens as TRL's default does, so that its steps hold fewer samples). L (generation and weight push per step) and T
(the rest of a step) are timed in the synchronous run itself; the ideal ratio is (L + T) / max(L, T).

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m experiments.async_server_throughput --output experiments/evidence/benchmarks/async_server_throughput.json
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m experiments.async_server_throughput \
        --model smollm2 --steps 6 --pairs 2 --batch_size 8 --num_generations 4 --completion_length 64 \
        --output experiments/evidence/benchmarks/async_server_throughput_smollm2.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--completion_length", type=int, default=32)
    parser.add_argument(
        "--model",
        default="tiny",
        choices=("tiny", *REAL_MODELS),
        help="tiny: random weights on the reasoning task; smollm2: the real model on word problems",
    )
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument(
        "--token_budget",
        type=int,
        default=0,
        help="the asynchronous trainer's packing: 0 (default) packs a fixed batch_size samples per "
        "step, as the synchronous step trains; N > 0 fills rows of N tokens (TRL's "
        "token-budgeted micro-batches, whose steps hold fewer samples)",
    )
    parser.add_argument(
        "--server_dtype",
        default="float32",
        help="the server's dtype (float32: the trainer's; auto: vLLM's bfloat16, slow on CPUs without it)",
    )
    parser.add_argument(
        "--work_dir",
        default=None,
        help="keeps the model, the server's log and the runs there "
        "(default: a temporary directory, removed at the end)",
    )
    parser.add_argument("--output", default="experiments/evidence/benchmarks/async_server_throughput.json")
    return parser.parse_args(argv)


REAL_MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model_path: str, log: Path, dtype: str) -> tuple[subprocess.Popen, str]:
    """The server on the first core, one thread."""
    from topr_trl.generation.vllm_server.command import launch_server

    environment = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"}
    return launch_server(
        model_path,
        free_port(),
        log,
        "--gpu_memory_utilization",
        "0.5",
        "--dtype",
        dtype,
        env=environment,
        prefix=("taskset", "-c", "0"),
    )


class StepClock(TrainerCallback):
    """The time at the end of every optimizer step."""

    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


class Stopwatch:
    """Times each call of the named methods of one object (the synchronous trainer's vLLM client: generation and
    the weight push), by wrapping them on that instance."""

    def __init__(self, owner, names):
        self.seconds: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            setattr(owner, name, self._timed(name, getattr(owner, name)))

    def _timed(self, name, method):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name].append(time.perf_counter() - started)

        return timed


def task(options):
    """The prompts (as many as the run trains on) and their reward."""
    count = options.batch_size * options.steps
    if options.model in REAL_MODELS:
        from topr_trl.tasks.word_problems import make_word_problems, word_problem_reward

        return make_word_problems(count, "train"), word_problem_reward
    from topr_trl.tasks.reasoning import make_reasoning_dataset, reasoning_reward

    return make_reasoning_dataset(count, 3, seed=0), reasoning_reward


def model_folder(options, work: str) -> str:
    """The real model's trainable folder, or a random-weight tiny model saved under `work`."""
    if options.model in REAL_MODELS:
        from topr_trl.inputs.sources import resolve_model_source

        return str(resolve_model_source(REAL_MODELS[options.model], "--model"))
    from topr_trl.tasks.tiny import build_model, build_tokenizer, save_pretrained

    tokenizer = build_tokenizer()
    return str(
        save_pretrained(
            build_model(tokenizer, seed=0, hidden_size=options.hidden_size, num_layers=options.num_layers),
            tokenizer,
            Path(work) / "m",
        )
    )


def run(kind: str, model_path: str, url: str, options, output_dir: str) -> dict:
    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.asynchronous import AsyncTOPRConfig, AsyncTOPRTrainer, with_response_template

    dataset, reward = task(options)
    common = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=options.batch_size,
        num_generations=options.num_generations,
        max_completion_length=options.completion_length,
        max_steps=options.steps,
        learning_rate=1e-5,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        topr_signal="reward",
        seed=0,
    )
    if kind == "synchronous":
        args = TOPRConfig(
            **common, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_group_port=free_port()
        )
        trainer = TOPRTrainer(model_path, reward, args=args, train_dataset=dataset)
        timed = Stopwatch(trainer.vllm_generation, ("generate", "sync_weights"))
    else:
        from transformers import AutoTokenizer

        tokenizer = with_response_template(AutoTokenizer.from_pretrained(model_path))
        args = AsyncTOPRConfig(
            **common,
            vllm_server_base_url=url,
            topr_baseline=0.5,
            max_inflight_tasks=options.batch_size,
            token_budget=options.token_budget,
        )
        trainer = AsyncTOPRTrainer(model_path, reward, args, train_dataset=dataset, processing_class=tokenizer)
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    # samples trained per step: the batch (synchronous); what TRL's packing put in the step (asynchronous)
    samples = [entry.get("batch/samples_per_step", options.batch_size) for entry in history]
    # steady state: from the end of the first step (the worker's start, the first push) to the end of the last
    seconds = clock.ends[-1] - clock.ends[0]
    lengths = [entry.get("completions/mean_length") for entry in history if entry.get("completions/mean_length")]
    result = {
        "kind": kind,
        "seconds": seconds,
        "steps": trainer.state.global_step,
        "samples_per_second": sum(samples[1:]) / seconds,
        "samples_per_step": samples,
        "mean_completion_length": statistics.mean(lengths) if lengths else None,
        "step_time_mean": statistics.mean(e["step_time"] for e in history if "step_time" in e)
        if any("step_time" in e for e in history)
        else None,
    }
    result["seconds_per_step"] = seconds / (len(clock.ends) - 1)
    if kind == "synchronous":  # L: generation and weight push per step, both on the server; T: the rest of a step
        result["generate_seconds_per_step"] = statistics.mean(timed.seconds["generate"][1:])
        result["push_seconds_per_step"] = statistics.mean(timed.seconds["sync_weights"][1:] or [0.0])
    if kind == "asynchronous":  # the trainer's own time per step (T): TRL's forward-backward and optimizer timings
        result["train_seconds_per_step"] = statistics.mean(
            e["perf/fwd_bwd_s"] + e.get("perf/optimizer_s", 0.0) for e in history[1:] if "perf/fwd_bwd_s" in e
        )
        result["staleness"] = dict(sorted(trainer.staleness_counts.items()))
    del trainer
    return result


def main(argv=None) -> dict:
    options = parse(argv)
    hf_logging.set_verbosity_error()
    os.sched_setaffinity(0, {1})  # the trainer on the second core; the server on the first
    torch.set_num_threads(1)
    with contextlib.nullcontext(options.work_dir) if options.work_dir else tempfile.TemporaryDirectory() as work:
        model_path = model_folder(options, work)
        server, url = start_server(model_path, Path(work) / "server.log", options.server_dtype)
        try:
            runs = []
            for pair in range(options.pairs):
                for kind in ("synchronous", "asynchronous"):
                    result = run(kind, model_path, url, options, str(Path(work) / f"{kind}-{pair}"))
                    runs.append(result)
                    print(json.dumps(result), flush=True)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    ratios = [a["samples_per_second"] / s["samples_per_second"] for s, a in zip(runs[::2], runs[1::2], strict=True)]
    # L and T of the synchronous loop, timed in it: L its generation and weight push (the server's work), T the rest
    # of its step (scoring, the loss, backward, the optimizer); the asynchronous trainer's own T is reported beside
    synchronous = runs[::2]
    generate = statistics.median(run["generate_seconds_per_step"] + run["push_seconds_per_step"] for run in synchronous)
    train = statistics.median(run["seconds_per_step"] for run in synchronous) - generate
    summary = {
        "options": vars(options),
        "threads": torch.get_num_threads(),
        "runs": runs,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "T_train_seconds_per_step": train,
        "T_async_train_seconds_per_step": statistics.median(run["train_seconds_per_step"] for run in runs[1::2]),
        "L_generate_seconds_per_step": generate,
        "ideal_ratio": (generate + train) / max(generate, train),
    }
    print(
        f"L (generation and push per step) {generate:.2f} s, T (the rest of the synchronous step) {train:.2f} s, "
        f"L/T {generate / train:.2f}; ideal ratio {summary['ideal_ratio']:.2f}; the asynchronous trainer's own "
        f"training per step {summary['T_async_train_seconds_per_step']:.2f} s",
        flush=True,
    )
    print(
        f"asynchronous / synchronous samples per second: {', '.join(f'{r:.2f}' for r in ratios)} "
        f"(median {summary['median_ratio']:.2f})",
        flush=True,
    )
    if options.output:
        Path(options.output).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
