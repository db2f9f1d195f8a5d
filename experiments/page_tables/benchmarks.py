"""The tables of experiments/benchmarks.md (those on the real model shared with docs/real-model.md), from
experiments/evidence/benchmarks/ (`experiments/benchmark.py`, `vllm_generation.py`, `async_server_throughput.py`)."""

from __future__ import annotations

from collections.abc import Callable

from experiments.page_tables.evidence import evidence, table


def benchmark(name: str) -> dict:
    return evidence(f"benchmarks/{name}")


LOSS_LABELS = {
    "grpo-dapo": 'GRPOTrainer `loss_type="dapo"` (TRL\'s default)',
    "grpo-grpo": 'GRPOTrainer `loss_type="grpo"`',
    "topr-online": "TOPRTrainer (canonical TOPR), μ unprocessed",
    "topr-online-top-k": "TOPRTrainer, μ sampled with top_k {top_k}: π on μ's support",
    "topr-online-top-p": "TOPRTrainer, μ sampled with top_p {top_p}: π on μ's support",
}


def loss_speed_table() -> str:
    """Loss + backward of each trainer on one shared batch of the real model (`experiments.benchmark --loss_only`)."""
    data = benchmark("cpu-smollm2-support-floors")
    result, options = data["loss_only"], data["options"]
    medians, peaks = result["median_loss_backward_s"], result["peak_added_memory_mib"]
    columns = {
        "trainer": lambda name: LOSS_LABELS[name].format(top_k=options["top_k"], top_p=options.get("top_p", 0.95)),
        "loss + backward, median s": lambda name: f"{medians[name]:.2f}",
        "quartiles s": lambda name: "/".join(f"{q:.2f}" for q in result["quartiles_s"][name]),
        "time / dapo": lambda name: f"{medians[name] / medians['grpo-dapo']:.3f}",
        "memory one call adds, MiB": lambda name: f"{peaks[name]:.0f}",
        "memory / dapo": lambda name: f"{peaks[name] / peaks['grpo-dapo']:.3f}",
    }
    return (
        f"{table(columns, LOSS_LABELS)}\n\n{options['batch_size']} completions ({options['num_generations']} per "
        f"prompt) of {options['completion_length']} tokens, forced to full length; "
        f"{options['repeats'] * options['steps']} timed calls per trainer after 3 warm-up rounds, interleaved call by "
        f"call in one process; "
        f"float32, one thread, μ's log-probs kept from generation (an off-policy batch)."
    )


def support_rows(name: str, design: str = "") -> list[dict]:
    """One run of π on μ's support: its top-k and top-p calls, each against the run's own untruncated TOPR."""
    result, options = benchmark(name)["loss_only"], benchmark(name)["options"]
    medians, memory = result["median_loss_backward_s"], result["peak_added_memory_mib"]
    return [
        {
            "design": design,
            "commit": result["library"]["commit"],
            "truncation": truncation,
            "truncated": medians[f"topr-online-{setting}"],
            "untruncated": medians["topr-online"],
            "ratio": medians[f"topr-online-{setting}"] / medians["topr-online"],
            "memory": memory[f"topr-online-{setting}"] / memory["topr-online"],
        }
        for setting, truncation in (("top-k", f"top_k {options['top_k']}"), ("top-p", f"top_p {options['top_p']}"))
    ]


SUPPORT_DESIGNS = {
    "cpu-smollm2-support-tiles-idle": "the tiles (TRL's head read through a TorchFunctionMode; bins, band)",
    "cpu-smollm2-support-floors": "**the rule** (`topr_trl/support`: projected again; top-p sorted above its floors)",
}
"""Two designs of π on μ's support on the real model, each timed in its own run (`--loss_only --top_k 500`)."""


def support_cost_table() -> str:
    columns = {
        "design": "{design}",
        "commit": "`{commit}`",
        "μ samples with": "{truncation}",
        "loss + backward s (truncated / TOPR)": "{truncated:.2f} / {untruncated:.2f}",
        "time / TOPR untruncated": "**{ratio:.3f}**",
        "memory / TOPR": "{memory:.3f}",
    }
    return table(columns, [row for name, design in SUPPORT_DESIGNS.items() for row in support_rows(name, design)])


GPU_LOSS = {"gpu-h100-05b-loss": "Qwen2.5-0.5B shape", "gpu-h100-15b-loss": "Qwen2.5-1.5B shape"}
GPU_LOSS_TRAINERS = {"grpo-grpo": "GRPOTrainer `grpo`", "grpo-dapo": "GRPOTrainer `dapo`", "topr-online": "TOPRTrainer"}


def gpu_loss() -> str:
    """Loss + backward on the H100 at the Qwen2.5-0.5B and 1.5B shapes (`experiments.benchmark --loss_only`)."""
    rows = [
        {
            "model": model,
            "trainer": label,
            "median": 1000 * result["median_loss_backward_s"][trainer],
            "quartiles": " / ".join(f"{1000 * q:.1f}" for q in result["quartiles_s"][trainer]),
        }
        for name, model in GPU_LOSS.items()
        for result in [benchmark(name)["loss_only"]]
        for trainer, label in GPU_LOSS_TRAINERS.items()
    ]
    return table(
        {"model": "{model}", "trainer": "{trainer}", "median ms": "{median:.1f}", "quartiles ms": "{quartiles}"}, rows
    )


def generation_speed_table() -> str:
    """vLLM's CPU engine against transformers `generate` on the real model (`experiments.vllm_generation`)."""
    columns = {
        "engine dtype": "{vllm_dtype}",
        "vLLM completions/s": "{completions_per_second[vllm]:.2f}",
        "transformers completions/s (float32)": "{completions_per_second[transformers]:.2f}",
        "vLLM / transformers": "**{ratio_vllm_over_transformers:.2f}x**",
        "engine start": "{engine_load_seconds:.0f} s",
        "completions x tokens": "{completions} x {completion_length}",
        "threads": "{threads}",
    }
    names = ("vllm_throughput_smollm2", "vllm_throughput_smollm2_bf16")
    return table(
        columns, [{**row, "threads": data["threads"]} for data in map(benchmark, names) for row in data["results"]]
    )


def async_speed_table() -> str:
    """Asynchronous TOPR against synchronous on a real vLLM server with the real model
    (`experiments.async_server_throughput --model smollm2`)."""
    data = benchmark("async_server_throughput_smollm2")
    runs = data["runs"]  # each synchronous run, then its asynchronous one
    rows = [
        {"pair": index + 1, "sync": runs[2 * index], "async": runs[2 * index + 1], "ratio": ratio}
        for index, ratio in enumerate(data["ratios"])
    ]
    columns = {
        "pair": "{pair}",
        "synchronous s/step": "{sync[seconds_per_step]:.1f}",
        "asynchronous s/step": "{async[seconds_per_step]:.1f}",
        "synchronous samples/s": "{sync[samples_per_second]:.3f}",
        "asynchronous samples/s": "{async[samples_per_second]:.3f}",
        "asynchronous / synchronous": "**{ratio:.2f}**",
    }
    return (
        f"{table(columns, rows)}\n\nMedian ratio **{data['median_ratio']:.2f}**. In the synchronous loop, generation "
        f"and the weight push took L = {data['L_generate_seconds_per_step']:.1f} s per step and the rest T = "
        f"{data['T_train_seconds_per_step']:.1f} s: the ideal ratio (L + T) / max(L, T) is "
        f"{data['ideal_ratio']:.2f}; the asynchronous trainer's own training took "
        f"{data['T_async_train_seconds_per_step']:.1f} s per step."
    )


TABLES: dict[str, Callable[[], str]] = {
    "loss-speed": loss_speed_table,
    "generation-speed": generation_speed_table,
    "async-speed": async_speed_table,
    "support-cost": support_cost_table,
    "gpu-loss": gpu_loss,
}
