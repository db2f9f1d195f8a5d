"""The tables of experiments/benchmarks.md on the tiny models, the H100 and vLLM on a CPU, from experiments/evidence/benchmarks/
(`experiments/benchmark.py`, `vllm_generation.py`, `async_server_throughput.py`, `async_throughput.py`). The tables on
the real model are in `real_model`."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from experiments.page_tables.evidence import bold, evidence, markdown_table


def benchmark(name: str) -> dict:
    return evidence(f"benchmarks/{name}")


SETTINGS = {
    # experiments/benchmark.py's setting names, as the interleaved and one-process tables label them
    "grpo-dapo": "GRPOTrainer `dapo` (TRL's default)",
    "grpo-grpo": "GRPOTrainer `grpo`",
    "grpo-grpo-kl": "GRPOTrainer `grpo`, `beta=0.04`",
    "topr-online": "TOPRTrainer, online",
    "topr-offline": "TOPRTrainer, off-policy: frozen μ generates (`rollout_func`)",
    "topr-replay": "TOPRTrainer, offline dataset, μ's log-probs stored",
    "topr-replay-recompute": "TOPRTrainer, offline dataset, μ's log-probs recomputed",
}
LOSS_TRAINERS = {
    "grpo-grpo": 'GRPOTrainer `loss_type="grpo"`',
    "grpo-dapo": 'GRPOTrainer `loss_type="dapo"`',
    "topr-online": "TOPRTrainer (canonical TOPR)",
}


def quartiles(values: list[float], scale: float, digits: int) -> str:
    return " / ".join(f"{value * scale:.{digits}f}" for value in values)


def cpu_loss() -> str:
    """Loss + backward on one shared batch of the tiny model (`benchmark.py --loss_only`)."""
    result = benchmark("cpu-tiny-loss")["loss_only"]
    rows = [
        [label, f"{result['median_loss_backward_s'][name] * 1000:.2f}", quartiles(result["quartiles_s"][name], 1000, 2)]
        for name, label in LOSS_TRAINERS.items()
    ]
    return markdown_table(["trainer", "median ms", "quartiles ms"], rows)


def interleaved_rows(name: str, digits: int, labels: dict[str, str]) -> list[list[str]]:
    table = benchmark(name)["interleaved"]["table"]
    return [
        [
            labels.get(setting, SETTINGS[setting]),
            f"{row['median_step_s']:.{digits}f}",
            quartiles(row["quartiles_step_s"], 1, digits),
            f"{row['median_cpu_s']:.{digits}f}",
        ]
        for setting, row in table.items()
    ]


def cpu_interleaved() -> str:
    return markdown_table(
        ["setting", "wall s/step (median)", "quartiles", "CPU s/step"], interleaved_rows("cpu-tiny-interleaved", 4, {})
    )


STEP_TARGET = 1.02
"""The whole-step target: TOPR's step at most 1.02x GRPO's on the same work."""


def cpu_interleaved_ratios() -> str:
    ratios = benchmark("cpu-tiny-interleaved")["interleaved"]["ratios"]
    rows = []
    for key, label, target in (
        ("topr-online / grpo-grpo", "TOPR online / GRPO `grpo`", True),
        ("topr-online / grpo-dapo", "TOPR online / GRPO `dapo`", True),
        ("topr-online / grpo-grpo-kl", "TOPR online / GRPO `grpo` + KL", False),
        ("topr-replay-recompute / topr-replay", "offline, μ recomputed / μ stored", None),
    ):
        ratio = ratios[key]
        if target is None:
            rows.append([label, f"{ratio['step_time']:.3f}", f"{ratio['cpu_time']:.3f}", "extra work, reported apart"])
            continue
        verdict = (
            f"≤ {STEP_TARGET}: {'met' if ratio['step_time'] <= STEP_TARGET else 'not met'}"
            if target
            else "(TOPR needs no reference model)"
        )
        rows.append([label, bold(f"{ratio['step_time']:.3f}"), f"{ratio['cpu_time']:.3f}", verdict])
    return markdown_table(["ratio (same work)", "step time", "CPU time", "target"], rows)


PROCESS_LABELS = {
    "grpo-dapo": "GRPOTrainer `dapo`",
    "topr-offline": "TOPRTrainer, frozen μ generates",
    "topr-replay": "TOPRTrainer, offline, μ stored",
    "topr-replay-recompute": "TOPRTrainer, offline, μ recomputed",
}


def percent(value: float) -> str:
    return f"{100 * value:.2f} %"


def cpu_processes() -> str:
    """One process per setting on the tiny model: peak memory (RSS) and MFU (`benchmark.py`)."""
    rows = []
    for setting, row in benchmark("cpu-tiny")["table"].items():
        low, high = row["spread_peak_memory_mib"]
        rows.append(
            [
                PROCESS_LABELS.get(setting, SETTINGS[setting]),
                f"{row['median_step_s']:.4f}",
                f"{row['median_update_s']:.4f}",
                f"{row['tokens_per_s']:.0f}",
                f"{row['peak_memory_mib']:.1f} ({low:.1f}-{high:.1f})",
                percent(row["mfu_step"]),
                percent(row["mfu_update"]),
            ]
        )
    return markdown_table(
        ["setting", "s/step", "s/update", "tokens/s", "peak MiB (runs' min-max)", "MFU step", "MFU update"], rows
    )


GPU_LOSS_TRAINERS = {"grpo-grpo": "GRPOTrainer `grpo`", "grpo-dapo": "GRPOTrainer `dapo`", "topr-online": "TOPRTrainer"}


def gpu_loss() -> str:
    """Loss + backward on the H100 at the Qwen2.5-0.5B and 1.5B shapes."""
    rows = []
    for name, model in (("gpu-h100-05b-loss", "Qwen2.5-0.5B shape"), ("gpu-h100-15b-loss", "Qwen2.5-1.5B shape")):
        result = benchmark(name)["loss_only"]
        rows += [
            [
                model,
                label,
                f"{result['median_loss_backward_s'][setting] * 1000:.1f}",
                quartiles(result["quartiles_s"][setting], 1000, 1),
            ]
            for setting, label in GPU_LOSS_TRAINERS.items()
        ]
    return markdown_table(["model", "trainer", "median ms", "quartiles ms"], rows)


GPU_LABELS = {
    "grpo-dapo": "GRPOTrainer `dapo`",
    "topr-replay": "TOPRTrainer, offline, μ stored",
    "topr-replay-recompute": "TOPRTrainer, offline, μ recomputed",
}
"""The H100 tables' shorter labels."""


def gpu_processes() -> str:
    """One process per setting on the H100; the generation share is the part of a step outside the update."""
    rows = []
    for setting, row in benchmark("gpu-h100-05b-proc")["table"].items():
        rows.append(
            [
                GPU_LABELS.get(setting, SETTINGS[setting]),
                f"{row['median_step_s']:.3f}",
                f"{row['median_update_s']:.3f}",
                f"{100 * (1 - row['median_update_s'] / row['median_step_s']):.1f} %",
                f"{row['tokens_per_s']:,.0f}",
                f"{row['peak_memory_mib']:,.1f}",
                percent(row["mfu_step"]),
                percent(row["mfu_update"]),
            ]
        )
    return markdown_table(
        ["setting", "s/step", "s/update", "gen. share", "tokens/s", "peak MiB", "MFU step", "MFU update"], rows
    )


def gpu_interleaved() -> str:
    return markdown_table(
        ["setting", "wall s/step (median)", "quartiles", "CPU s/step"],
        interleaved_rows("gpu-h100-05b-inter", 3, GPU_LABELS),
    )


GPU_SUPPORT_RUNS = {
    "gpu-h200-05b-support-loss": "the cascade before the rule (archive)",
    "gpu-h200-05b-floors-support-loss-scale1": "the rule with floors",
    "gpu-h200-05b-floors-support-loss-scale4": "the rule with floors",
    "gpu-h200-05b-floors-support-loss-scale8": "the rule with floors",
}
"""The H200 runs of pi on mu's support at the Qwen2.5-0.5B shape (`experiments/gpu_support.sh`), oldest first."""


def gpu_support() -> str:
    """Loss + backward with mu's top-k / top-p support against TOPR untruncated on one H200, per logit scale (1: random
    weights' flat rows; 8: peaked rows); the archived run predates both the rule and the floors."""
    rows = []
    for name, design in GPU_SUPPORT_RUNS.items():
        data = benchmark(name)
        result, options = data["loss_only"], data["options"]
        medians = result["median_loss_backward_s"]
        commit = f"`{result['library']['commit']}`" if "library" in result else "-"  # the archived run has none
        memory = result["peak_added_memory_mib"]
        for setting, truncation in (
            ("topr-online-top-k", f"top_k {options.get('top_k', 50)}"),
            ("topr-online-top-p", f"top_p {options.get('top_p', 0.95)}"),
        ):
            rows.append(
                [
                    design,
                    commit,
                    f"{options.get('logit_scale', 1.0):g}",
                    truncation,
                    f"{medians[setting] * 1000:.0f} / {medians['topr-online'] * 1000:.0f}",
                    f"**{medians[setting] / medians['topr-online']:.2f}**",
                    f"{memory[setting] / memory['topr-online']:.3f}",
                ]
            )
    return markdown_table(
        [
            "design",
            "commit",
            "logit scale",
            "μ samples with",
            "loss + backward ms (truncated / TOPR)",
            "time / TOPR untruncated",
            "memory / TOPR",
        ],
        rows,
    )


def gpu_support_rule() -> str:
    """The rule alone per 1,000 tokens at Qwen2.5's vocabulary on the H200 (`experiments.benchmark --support_only`)."""
    data = benchmark("gpu-h200-05b-floors-support-rule")["support_only"]
    rows = [
        [case, f"{timing['ms_per_1k_tokens']['rule']:.1f}", f"{timing['ms_per_1k_tokens']['whole vocabulary']:.1f}"]
        for case, timing in data["timings"].items()
    ]
    return markdown_table(
        [
            "rows, μ samples with",
            "the rule ms / 1k tokens",
            f"log-softmax over all {data['vocabulary']:,} tokens ms / 1k tokens",
        ],
        rows,
    )


def short_exponent(value: float, digits: int = 1) -> str:
    """A small number as the pages write it: 3e-8, 1.3e-5 (`digits` significant digits)."""
    mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def vllm_mismatch() -> str:
    """vLLM's μ against the float32 policy at learning rate 0 (`vllm_generation.py --measure mismatch`)."""
    labels = {"bfloat16": "bfloat16 (vLLM's `auto` on a float32 model)", "float32": "float32 (control)"}
    rows = []
    for result in benchmark("vllm_mismatch")["results"]:
        tokens, ratio, negatives = result["token_abs_log_ratio"], result["sequence_ratio"], result["negatives"]
        if result["engine_dtype"] == "bfloat16":
            quantiles = " / ".join(f"{ratio[q]:.3f}" for q in ("q1", "q10", "q50", "q90", "q99"))
            rows.append(
                [
                    labels["bfloat16"],
                    f"{tokens['mean']:.4f} / {tokens['max']:.2f}",
                    f"{quantiles} ({ratio['q0']:.3f}, {ratio['q100']:.3f})",
                    f"{100 * negatives['truncated_share']:.0f} % of {negatives['count']}",
                    f"{negatives['mean_weight']:.3f} ({negatives['min_weight']:.3f})",
                ]
            )
        else:
            spread = max(abs(ratio[q] - 1) for q in ("q0", "q100"))
            lightest = 1 - negatives["min_weight"]
            rows.append(
                [
                    labels["float32"],
                    f"{short_exponent(tokens['mean'])} / {short_exponent(tokens['max'], 2)}",
                    f"1 within {short_exponent(spread, 2)}",
                    f"(all within {short_exponent(lightest)} of 1)",
                    f"{negatives['mean_weight']:.3f} ({negatives['min_weight']:.5f})",
                ]
            )
    return markdown_table(
        [
            "engine dtype",
            "mean / max per-token \\|log π − log μ\\|",
            "sequence ratio π/μ: 1 % / 10 % / 50 % / 90 % / 99 % quantiles (min, max)",
            "negatives with weight < 1",
            "mean (min) weight of negatives",
        ],
        rows,
    )


def parameters(count: int) -> str:
    return f"{count / 1e6:.2f}M" if count < 1e6 else f"{count / 1e6:.1f}M"


def rate(value: float) -> str:
    """Completions per second to three significant figures at most (146, 15.6, 2.7)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


SERVER_MODELS = {
    "reasoning": "built-in reasoning model ({parameters} parameters, tied)",
    "small": "random weights, hidden 256 x 4 layers ({parameters}, tied)",
    "27m": "random weights, hidden 512 x 8 layers ({parameters}, tied)",
}


def vllm_server_sync() -> str:
    """One weight push into a vLLM server (`vllm_generation.py --measure server_sync`)."""
    rows = []
    for result in benchmark("vllm_server_sync")["results"]:
        label = SERVER_MODELS[result["model"]].format(parameters=parameters(result["parameters"]))
        per_megabyte = result["ms_per_megabyte"]
        rows.append(
            [
                label,
                f"{result['megabytes']:.{2 if result['megabytes'] < 1 else 1}f} MB",
                str(result["tensors"]),
                f"{result['push_ms_median']:.1f} ms ({result['push_ms_min']:.1f}-{result['push_ms_max']:.1f})",
                f"{per_megabyte:.0f}" if per_megabyte >= 10 else f"{per_megabyte:.1f}",
            ]
        )
    return markdown_table(["model", "weights sent (float32)", "tensors", "push, median (min-max)", "ms per MB"], rows)


def vllm_throughput() -> str:
    """vLLM's CPU engine against transformers `generate` on the tiny models (`vllm_generation.py`)."""
    rows = []
    for name in ("vllm_throughput", "vllm_throughput_bf16"):
        for result in benchmark(name)["results"]:
            float32 = result["vllm_dtype"] == "float32"
            first = result["model"] == "reasoning"
            if float32:
                model = (
                    ("built-in reasoning model" if first else "random weights, hidden 512 x 8 layers")
                    + f" ({parameters(result['parameters'])}"
                    + (" parameters)" if first else ")")
                )
                dtype = "float32"
            else:
                model = "built-in reasoning model" if first else "hidden 512 x 8 layers"
                dtype = "bfloat16 (vLLM's `auto`)" if first else "bfloat16"
            rates = result["completions_per_second"]
            rows.append(
                [
                    model,
                    dtype,
                    rate(rates["vllm"]),
                    rate(rates["transformers"]),
                    bold(f"{result['ratio_vllm_over_transformers']:.2f}x", float32),
                    f"{result['engine_load_seconds']:.0f} s",
                ]
            )
    return markdown_table(
        [
            "model",
            "engine dtype",
            "vLLM completions/s",
            "transformers completions/s (float32)",
            "vLLM / transformers",
            "engine start",
        ],
        rows,
    )


ASYNC_SERVER = [
    # file, how the page names the setting, decimals of the mean completion length
    ("async_server_throughput", "hidden {hidden} x {layers} layers, {tokens} ({length})", 1),
    (
        "async_server_throughput_generation_heavy",
        "hidden {hidden} x {layers}, {tokens} ({length}), generation-heavy",
        0,
    ),
    ("async_server_throughput_training_heavy", "hidden {hidden} x {layers}, {tokens} ({length}), training-heavy", 0),
]


def async_server() -> str:
    """Asynchronous against synchronous TOPR on a real vLLM server, three ratios of generation to training."""
    rows = []
    for name, label, length_digits in ASYNC_SERVER:
        data = benchmark(name)
        options, runs = data["options"], data["runs"]
        synchronous = [run for run in runs if run["kind"] == "synchronous"]
        asynchronous = [run for run in runs if run["kind"] == "asynchronous"]
        length = statistics.mean(run["mean_completion_length"] for run in synchronous)
        generation, training = data["L_generate_seconds_per_step"], data["T_train_seconds_per_step"]
        rows.append(
            [
                label.format(
                    hidden=options["hidden_size"],
                    layers=options["num_layers"],
                    tokens=options["completion_length"],
                    length=f"{length:.{length_digits}f}",
                ),
                f"{generation:.2f} s",
                f"{training:.2f} s",
                f"{generation / training:.2f}",
                f"{data['ideal_ratio']:.2f}",
                f"{data['T_async_train_seconds_per_step']:.2f} s",
                ", ".join(f"{run['samples_per_second']:.1f}" for run in synchronous),
                ", ".join(f"{run['samples_per_second']:.1f}" for run in asynchronous),
                ", ".join(f"{ratio:.2f}" for ratio in data["ratios"]),
                bold(f"{data['median_ratio']:.2f}"),
            ]
        )
    return markdown_table(
        [
            "setting (model, completion tokens, mean length)",
            "L",
            "T",
            "L/T",
            "ideal (L+T)/max(L,T)",
            "async T",
            "synchronous samples/s (3 pairs)",
            "asynchronous samples/s",
            "ratio per pair",
            "**median ratio**",
        ],
        rows,
    )


def async_stand_in() -> str:
    """The pipelining demo on a stand-in worker (`async_throughput.py`)."""
    rows = []
    for index, pair in enumerate(benchmark("async_throughput")["pairs"]):
        synchronous, asynchronous = pair["synchronous"], pair["asynchronous"]
        rows.append(
            [
                str(index),
                f"{synchronous['samples_per_s']:.2f} ({synchronous['wall_s']:.1f})",
                f"{asynchronous['samples_per_s']:.2f} ({asynchronous['wall_s']:.1f})",
                f"{pair['ratio']:.2f}",
                f"{asynchronous['train_s_per_step']:.2f} s",
                f"{asynchronous['staleness_mean']:.2f}",
            ]
        )
    return markdown_table(
        [
            "pair",
            "synchronous samples/s (wall s)",
            "asynchronous samples/s (wall s)",
            "ratio",
            "async T per step",
            "async staleness (mean)",
        ],
        rows,
    )


TABLES: dict[str, Callable[[], str]] = {
    "cpu-loss": cpu_loss,
    "cpu-interleaved": cpu_interleaved,
    "cpu-interleaved-ratios": cpu_interleaved_ratios,
    "cpu-processes": cpu_processes,
    "gpu-loss": gpu_loss,
    "gpu-processes": gpu_processes,
    "gpu-interleaved": gpu_interleaved,
    "gpu-support": gpu_support,
    "gpu-support-rule": gpu_support_rule,
    "vllm-mismatch": vllm_mismatch,
    "vllm-server-sync": vllm_server_sync,
    "vllm-throughput": vllm_throughput,
    "async-server": async_server,
    "async-stand-in": async_stand_in,
}
