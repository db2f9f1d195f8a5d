"""What TOPR costs against GRPOTrainer: the same model, data, batch shapes and seeds, interleaved in one run.

Each (trainer, setting) is run in its own subprocess so that peak memory is measured per setting; the settings
are interleaved round by round so that machine noise hits all of them alike. Completions are forced to the full
`max_completion_length` (min_new_tokens), so every setting does the same generation work.

    python scripts/benchmark.py --smoke                 # seconds; what CI runs (no assertion on times)
    python scripts/benchmark.py --repeats 5 --steps 20  # the CPU figures in the note
    python scripts/benchmark.py --model qwen2.5-0.5b --device cuda --bf16 --prompt-length 512 --completion-length 512

Prints a table (median and spread of seconds per step, tokens per second, peak memory) and the ratios
TOPR/GRPO, and writes them as JSON with `--output`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = {
    # name: (trainer, config overrides)
    "grpo-dapo": ("grpo", {}),
    "grpo-grpo": ("grpo", {"loss_type": "grpo"}),
    "grpo-grpo-kl": ("grpo", {"loss_type": "grpo", "beta": 0.04}),
    "topr-online": ("topr", {}),
    "topr-offline": ("topr", {"__behaviour__": True}),
}
# The pairs compared for the targets: the same work in both trainers.
RATIOS = {
    "topr-online / grpo-grpo": ("topr-online", "grpo-grpo"),
    "topr-online / grpo-dapo": ("topr-online", "grpo-dapo"),
    "topr-online / grpo-grpo-kl": ("topr-online", "grpo-grpo-kl"),
}
MODEL_SHAPES = {
    "tiny": dict(hidden_size=64, num_layers=2),
    "small": dict(hidden_size=256, num_layers=4),
    # Shapes of Qwen2.5-0.5B / 1.5B (random weights: weights do not change speed).
    "qwen2.5-0.5b": dict(hidden_size=896, num_layers=24, intermediate_size=4864, num_attention_heads=14,
                         num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_layers=28, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2),
}


def worker(options: dict) -> dict:
    """Run one setting and return its measurements (executed in a subprocess)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.rollout import make_behaviour_rollout
    from topr_trl.tasks import make_arithmetic_dataset

    trainer_name, overrides = SETTINGS[options["setting"]]
    overrides = dict(overrides)
    behaviour = overrides.pop("__behaviour__", False)
    cuda = options["device"] == "cuda"
    prompt_text = "1+1=" + "0" * max(options["prompt_length"] - 40, 0)  # pads prompts to the requested length
    dataset = make_arithmetic_dataset(256, digits=2, seed=0).map(
        lambda row: {"prompt": [{"role": "user", "content": row["prompt"][0]["content"] + prompt_text[4:]}]}
    )

    def length_reward(completions, **kwargs):  # any reward with variance: the loss must do real work
        return [float(hash(c[0]["content"]) % 3) for c in completions]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)

    common = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=options["batch_size"],
        num_generations=options["num_generations"], max_completion_length=options["completion_length"],
        max_prompt_length=None, generation_kwargs={"min_new_tokens": options["completion_length"]},
        max_steps=options["steps"] + options["warmup"], learning_rate=1e-6, logging_steps=10**6, report_to="none",
        save_strategy="no", use_cpu=not cuda, bf16=options["bf16"], gradient_checkpointing=False, seed=0,
    )
    config_class, trainer_class = (TOPRConfig, TOPRTrainer) if trainer_name == "topr" else (GRPOConfig, GRPOTrainer)
    try:
        args = config_class(**common, **overrides)
    except TypeError:  # max_prompt_length is gone in some TRL versions
        common.pop("max_prompt_length")
        args = config_class(**common, **overrides)
    extra = {}
    if behaviour:
        mu = AutoModelForCausalLM.from_pretrained(options["model_path"], dtype=torch.bfloat16 if options["bf16"] else None)
        mu.to("cuda" if cuda else "cpu")
        extra["rollout_func"] = make_behaviour_rollout(mu, AutoTokenizer.from_pretrained(options["model_path"]))
    timer = StepTimer()
    trainer = trainer_class(model=options["model_path"], reward_funcs=length_reward, args=args,
                            train_dataset=dataset, callbacks=[timer], **extra)
    generation_seconds: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*a, **k):  # generation is the same work in every setting; time it apart
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        output = generate_and_score(*a, **k)
        if cuda:
            torch.cuda.synchronize()
        generation_seconds.append(time.perf_counter() - start)
        return output

    trainer._generate_and_score_completions = timed_generate_and_score
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    times = timer.times[options["warmup"]:]
    # One generation per optimizer step here (steps_per_generation == gradient_accumulation_steps == 1).
    update_times = [t - g for t, g in zip(timer.times, generation_seconds, strict=True)][options["warmup"]:]
    tokens_per_step = options["batch_size"] * (options["prompt_length"] + options["completion_length"])
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"setting": options["setting"], "step_seconds": times, "update_seconds": update_times,
            "tokens_per_step": tokens_per_step,
            "peak_memory_mib": peak}


def loss_only(options, model_path: str) -> dict:
    """Loss + backward of each trainer on the *same* generated batch, interleaved call by call in one process:
    the part of a step where TOPR and GRPO differ, free of generation noise."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.tasks import make_arithmetic_dataset

    cuda = options.device == "cuda"
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=options.batch_size,
                  num_generations=options.num_generations, max_completion_length=options.completion_length,
                  generation_kwargs={"min_new_tokens": options.completion_length}, report_to="none",
                  use_cpu=not cuda, bf16=options.bf16, gradient_checkpointing=False, seed=0)

    def reward(completions, **kwargs):
        return [float(hash(c[0]["content"]) % 3) for c in completions]

    dataset = make_arithmetic_dataset(64, digits=2)
    trainers = {
        "grpo-grpo": GRPOTrainer(model=model_path, reward_funcs=reward, train_dataset=dataset,
                                 args=GRPOConfig(loss_type="grpo", **common)),
        "grpo-dapo": GRPOTrainer(model=model_path, reward_funcs=reward, train_dataset=dataset,
                                 args=GRPOConfig(loss_type="dapo", **common)),
        "topr-online": TOPRTrainer(model=model_path, reward_funcs=reward, train_dataset=dataset,
                                   args=TOPRConfig(**common)),
    }
    first = next(iter(trainers.values()))
    inputs = first._prepare_inputs(next(iter(first.get_train_dataloader())))
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for repeat in range(options.repeats * options.steps + 3):
        for name, trainer in trainers.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            trainer.compute_loss(trainer.model, inputs).backward()
            if cuda:
                torch.cuda.synchronize()
            if repeat >= 3:  # warm-up calls
                times[name].append(time.perf_counter() - start)
            trainer.model.zero_grad()
    medians = {name: statistics.median(values) for name, values in times.items()}
    quartiles = {name: statistics.quantiles(values, n=4) for name, values in times.items()}
    return {"median_loss_backward_s": medians, "quartiles_s": quartiles,
            "ratios": {f"topr-online / {name}": medians["topr-online"] / medians[name]
                       for name in ("grpo-grpo", "grpo-dapo")}}


def build_model(shape: str, path: str) -> None:
    from topr_trl.tiny import build_model as build, build_tokenizer, save_pretrained

    tokenizer = build_tokenizer()
    kwargs = dict(MODEL_SHAPES[shape])
    hidden, layers = kwargs.pop("hidden_size"), kwargs.pop("num_layers")
    save_pretrained(build(tokenizer, hidden_size=hidden, num_layers=layers, **kwargs), tokenizer, path)


def summarise(results: dict[str, list[dict]]) -> dict:
    table = {}
    for setting, runs in results.items():
        per_run = [statistics.median(r["step_seconds"]) for r in runs if r["step_seconds"]]
        all_steps = [t for r in runs for t in r["step_seconds"]]
        median = statistics.median(all_steps)
        table[setting] = {
            "median_step_s": median,
            "median_update_s": statistics.median(t for r in runs for t in r["update_seconds"]),
            "spread_step_s": [min(per_run), max(per_run)],
            "tokens_per_s": runs[0]["tokens_per_step"] / median,
            "peak_memory_mib": statistics.median(r["peak_memory_mib"] for r in runs),
        }
    ratios = {}
    for name, (numerator, denominator) in RATIOS.items():
        if numerator in table and denominator in table:
            ratios[name] = {
                "step_time": table[numerator]["median_step_s"] / table[denominator]["median_step_s"],
                "update_time": table[numerator]["median_update_s"] / table[denominator]["median_update_s"],
                "peak_memory": table[numerator]["peak_memory_mib"] / table[denominator]["peak_memory_mib"],
            }
    return {"table": table, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny and short: checks the script runs")
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--loss-only", action="store_true",
                        help="time only loss+backward on one shared batch, all trainers in one process")
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        print("RESULT " + json.dumps(worker(json.loads(options.worker))), flush=True)
        return
    if options.smoke:
        options.repeats, options.steps, options.warmup, options.batch_size, options.num_generations = 1, 2, 1, 4, 4
        options.completion_length, options.prompt_length = 8, 16
    model_path = tempfile.mkdtemp(prefix="topr-bench-model-")
    build_model(options.model, model_path)
    if options.loss_only:
        result = loss_only(options, model_path)
        for name, median in result["median_loss_backward_s"].items():
            print(f"{name:<14} loss+backward median {median * 1000:.2f} ms  quartiles "
                  f"{[round(q * 1000, 2) for q in result['quartiles_s'][name]]}")
        for name, ratio in result["ratios"].items():
            print(f"{name:<28} {ratio:.3f}")
        if options.output:
            with open(options.output, "w") as handle:
                json.dump({"loss_only": result, "options": vars(options)}, handle, indent=2)
        return
    results: dict[str, list[dict]] = {name: [] for name in options.settings}
    for repeat in range(options.repeats):
        for setting in options.settings:  # interleaved: every round runs every setting once
            spec = {key: getattr(options, key) for key in ("device", "bf16", "steps", "warmup", "batch_size",
                                                           "num_generations", "prompt_length", "completion_length")}
            spec.update(setting=setting, model_path=model_path)
            completed = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                       capture_output=True, text=True)
            lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
            if completed.returncode != 0 or not lines:
                sys.exit(f"setting {setting} failed:\n{completed.stderr[-3000:]}")
            results[setting].append(json.loads(lines[-1][len("RESULT "):]))
            print(f"[benchmark] round {repeat + 1}/{options.repeats} {setting}: "
                  f"{statistics.median(results[setting][-1]['step_seconds']):.4f} s/step", flush=True)
    summary = summarise(results)
    summary["options"] = vars(options)
    print(f"\n{'setting':<16} {'s/step':>8} {'spread of run medians':>22} {'s/update':>9} {'tokens/s':>9} "
          f"{'peak MiB':>9}")
    for setting, row in summary["table"].items():
        spread = f"{row['spread_step_s'][0]:.4f}-{row['spread_step_s'][1]:.4f}"
        print(f"{setting:<16} {row['median_step_s']:>8.4f} {spread:>22} {row['median_update_s']:>9.4f} "
              f"{row['tokens_per_s']:>9.0f} {row['peak_memory_mib']:>9.0f}")
    print("\n(s/update: the step without generation and scoring, i.e. the loss, backward and optimizer work)")
    for name, ratio in summary["ratios"].items():
        print(f"{name:<28} step time {ratio['step_time']:.3f}   update time {ratio['update_time']:.3f}   "
              f"peak memory {ratio['peak_memory']:.3f}")
    if options.output:
        with open(options.output, "w") as handle:
            json.dump(summary, handle, indent=2)


if __name__ == "__main__":
    main()
