"""vLLM against transformers `generate` on the same model: throughput, and the train/inference mismatch pi/mu.

    python -m experiments.vllm_generation --measure throughput [--models reasoning,27m,smollm2] [--repeats 3]
    python -m experiments.vllm_generation --measure mismatch [--num_prompts 64] [--num_generations 8]
    python -m experiments.vllm_generation --measure server_sync [--models reasoning,small,27m] [--repeats 10]

`throughput`: completions per second of a warm vLLM engine (`topr_trl.generation.completions.make_vllm_engine`) and of batched
transformers `generate` (`topr_trl.generation.completions.generate_completions`, left padding) on the same weights, prompts,
temperature and length (the engine in float32 like the transformers model by default; `--vllm_dtype auto` is vLLM's
own choice, bfloat16, which a CPU without native bfloat16 runs slowly); every completion is forced to the full length (vLLM's `min_tokens`, transformers'
`min_new_tokens`) so that both do the same work. The rounds alternate the two backends, and the ratio vLLM/HF of
the medians is printed. Models: the built-in reasoning model (~0.1M parameters), and random-weight tiny models of
head size 32 (`27m`: hidden 512, 8 layers; `small`: hidden 256, 4 layers) on the same character tokenizer.

`mismatch`: what TOPR sees at the first step of online training with `use_vllm=True` and
`topr_behaviour_source="sampler"` before any update (learning rate 0): completions sampled by vLLM with mu's
log-probs as vLLM reports them, and the policy's float32 log-probs of the same tokens (pi). It reports the per-token
|log pi - log mu|, the distribution of the sequence ratio pi/mu, and what the ratio does to Eq. 7's weights with
TOPR's limits (positives: [1, 1], so no effect; negatives: [0, 1], so a ratio below 1 shrinks the weight). The
engine's dtype is vLLM's default on a CPU (bfloat16, "auto") and float32 as the control that isolates the dtype.

`server_sync`: the cost of one weight push into `topr-trl vllm-serve` (its gloo path, `topr_trl.generation.vllm_server`) as
`TOPRTrainer` makes it before each generation: the announced tensors broadcast, the server's layerwise reload (and a
tied head's re-pack), then its prefix-cache reset. The server runs in its own process (vLLM's `auto` dtype, eager);
each push carries the model's weights after a random step, so that every one changes the server's model. Reports
the median and range of `--repeats` pushes after one warm-up, in ms and ms per MB of weights sent (float32).

Writes JSON with `--output`; prints the thread count, which changes CPU timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


MODELS = {"small": dict(hidden_size=256, num_layers=4), "27m": dict(hidden_size=512, num_layers=8)}


REAL_MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""The packaged pretrained model (trained weights, 49,152 tokens, tied embeddings), prompted with word problems."""


def model_path(name: str, work: Path) -> str:
    """The built-in reasoning model ("reasoning"), the packaged real model ("smollm2"), or a random-weight tiny model
    of the shape `MODELS[name]`."""
    if name in REAL_MODELS:
        from topr_trl.inputs.sources import resolve_model_source

        return resolve_model_source(REAL_MODELS[name], "--models")
    if name == "reasoning":
        from topr_trl.commands.arguments import TaskArguments
        from topr_trl.tasks.loading import builtin_model

        return str(builtin_model("reasoning", TaskArguments(task_digits=3, base_model_dir=str(work / "base")), seed=0))
    from topr_trl.tasks.tiny import build_model, build_tokenizer, save_pretrained

    tokenizer = build_tokenizer()
    return str(save_pretrained(build_model(tokenizer, seed=0, **MODELS[name]), tokenizer, work / name))


def reasoning_prompt_ids(tokenizer, num_prompts: int, split: str = "heldout") -> list[list[int]]:
    from topr_trl.inputs.prompts import tokenize_prompts
    from topr_trl.tasks.reasoning import make_reasoning_dataset

    return tokenize_prompts(tokenizer, make_reasoning_dataset(num_prompts, 3, split, seed=0)["prompt"])


def word_problem_prompt_ids(tokenizer, num_prompts: int) -> list[list[int]]:
    """The real task's held-out prompts (two worked examples as earlier turns, then the problem) under the chat
    template, as the trainer tokenizes them."""
    from topr_trl.inputs.prompts import tokenize_prompts
    from topr_trl.tasks.word_problems import make_word_problems

    return tokenize_prompts(tokenizer, make_word_problems(num_prompts, "test")["prompt"])


def throughput(name: str, work: Path, num_completions: int, length: int, repeats: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from topr_trl.generation.completions import generate_completions, make_vllm_engine

    path = model_path(name, work)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = (word_problem_prompt_ids if name in REAL_MODELS else reasoning_prompt_ids)(tokenizer, num_completions)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    started = time.perf_counter()
    llm = make_vllm_engine(path, seed=0, dtype=dtype)
    load_seconds = time.perf_counter() - started
    params = SamplingParams(n=1, temperature=1.0, max_tokens=length, min_tokens=length, logprobs=0)

    def run_vllm() -> int:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)  # noqa: F821
        return sum(len(sample.token_ids) for output in outputs for sample in output.outputs)

    def run_hf() -> int:
        rows = generate_completions(
            model, tokenizer, prompts, max_new_tokens=length, min_new_tokens=length, with_logps=True
        )
        return sum(len(row["completion_ids"]) for row in rows)

    run_vllm(), run_hf()  # warm-up: the engine's first call and transformers' first batch are slower
    seconds: dict[str, list[float]] = {"vllm": [], "transformers": []}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for backend, run in (("vllm", run_vllm), ("transformers", run_hf)):
            started = time.perf_counter()
            tokens[backend] = run()
            seconds[backend].append(time.perf_counter() - started)
    median = {backend: statistics.median(values) for backend, values in seconds.items()}
    result = {
        "model": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "completions": len(prompts),
        "completion_length": length,
        "vllm_dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "transformers_dtype": str(model.dtype).removeprefix("torch."),
        "engine_load_seconds": load_seconds,
        "seconds": seconds,
        "tokens": tokens,
        "completions_per_second": {backend: len(prompts) / value for backend, value in median.items()},
        "ratio_vllm_over_transformers": median["transformers"] / median["vllm"],
    }
    del llm
    from topr_trl.generation.completions import free_vllm_memory

    free_vllm_memory()
    return result


def quantiles(values: torch.Tensor) -> dict[str, float]:
    points = torch.tensor([0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0], dtype=values.dtype)
    return {
        f"q{int(p * 100)}": v for p, v in zip(points.tolist(), torch.quantile(values, points).tolist(), strict=False)
    }


def mismatch(work: Path, num_prompts: int, num_generations: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from topr_trl.generation.completions import free_vllm_memory, make_vllm_engine
    from topr_trl.loss import PRESETS, tapered_weights
    from topr_trl.offline.rollout import sample_with_logps_vllm
    from topr_trl.tasks.reasoning import make_reasoning_dataset, max_completion_tokens, reasoning_reward

    path = model_path("reasoning", work)
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path).eval()
    llm = make_vllm_engine(path, seed=0, dtype=dtype)
    engine_dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    prompts = make_reasoning_dataset(num_prompts, 3, "train", seed=0)
    rows = sample_with_logps_vllm(
        llm, tokenizer, prompts["prompt"], num_completions=num_generations, max_new_tokens=max_completion_tokens(3)
    )
    del llm
    free_vllm_memory()
    answers = [answer for answer in prompts["answer"] for _ in range(num_generations)]
    rewards = torch.tensor(reasoning_reward([row["completion"] for row in rows], answers), dtype=torch.float64)
    token_gaps, log_ratios = [], []
    with torch.no_grad():
        for row in rows:
            ids = row["prompt_ids"] + row["completion_ids"]
            start = len(row["prompt_ids"])
            logits = policy(torch.tensor([ids])).logits[0, start - 1 : -1].float()
            pi = torch.log_softmax(logits, -1).gather(-1, torch.tensor(row["completion_ids"])[:, None])[:, 0]
            gap = pi.double() - torch.tensor(row["behaviour_logps"], dtype=torch.float64)
            token_gaps.append(gap)
            log_ratios.append(gap.sum())
    token_gap = torch.cat(token_gaps)
    log_ratio = torch.stack(log_ratios)
    ratio = log_ratio.exp()
    negative = rewards < 0  # the reasoning reward is +1 / -1 and TOPR's default signal is R with c = 0
    weights = tapered_weights(log_ratio, ~negative, PRESETS["topr"])
    return {
        "engine_dtype": engine_dtype,
        "policy_dtype": "float32",
        "sequences": len(rows),
        "tokens": token_gap.numel(),
        "positive_share": (~negative).double().mean().item(),
        "token_abs_log_ratio": {"mean": token_gap.abs().mean().item(), "max": token_gap.abs().max().item()},
        "sequence_ratio": {"mean": ratio.mean().item(), "std": ratio.std().item(), **quantiles(ratio)},
        "sequence_ratio_below_1_share": (ratio < 1).double().mean().item(),
        "negatives": {
            "count": int(negative.sum()),
            "truncated_share": (weights[negative] < 1).double().mean().item(),
            "mean_weight": weights[negative].mean().item(),
            "min_weight": weights[negative].min().item(),
        },
        "positives_mean_weight": weights[~negative].mean().item(),
    }


def server_sync(name: str, work: Path, repeats: int) -> dict:
    import socket

    from transformers import AutoModelForCausalLM

    from topr_trl.generation.vllm_server.client import GlooVLLMClient
    from topr_trl.generation.vllm_server.command import launch_server

    path = model_path(name, work)
    model = AutoModelForCausalLM.from_pretrained(path)
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    started = time.perf_counter()
    server, url = launch_server(path, ports[0], work / f"server-{name}.log", "--gpu_memory_utilization", "0.5")
    try:
        start_seconds = time.perf_counter() - started
        client = GlooVLLMClient(base_url=url, group_port=ports[1], connection_timeout=60)
        client.init_communicator()
        metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]
        megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
        timings = []
        for repeat in range(repeats + 1):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1e-3 * torch.randn_like(parameter))
            began = time.perf_counter()
            client.update_named_params(metadata, ((n, p.data) for n, p in model.named_parameters()))
            client.reset_prefix_cache()
            if repeat:  # the first push is the warm-up
                timings.append((time.perf_counter() - began) * 1e3)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    median = statistics.median(timings)
    return {
        "model": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "megabytes": megabytes,
        "tensors": len(metadata),
        "push_ms_median": median,
        "push_ms_min": min(timings),
        "push_ms_max": max(timings),
        "ms_per_megabyte": median / megabytes,
        "server_start_seconds": start_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", choices=("throughput", "mismatch", "server_sync"), required=True)
    parser.add_argument(
        "--models", default="reasoning,27m", help=f"throughput: comma-separated, of reasoning, {', '.join(MODELS)}"
    )
    parser.add_argument("--num_completions", type=int, default=128, help="throughput: completions per round")
    parser.add_argument("--completion_length", type=int, default=64, help="throughput: tokens per completion")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="throughput: timed rounds per backend; server_sync: timed pushes (after one warm-up)",
    )
    parser.add_argument(
        "--vllm_dtype",
        default="float32",
        help="throughput: the engine's dtype (float32: the "
        "transformers model's; auto: vLLM's default, "
        "bfloat16 on a float32 model)",
    )
    parser.add_argument("--num_prompts", type=int, default=64, help="mismatch: prompts")
    parser.add_argument("--num_generations", type=int, default=8, help="mismatch: completions per prompt")
    parser.add_argument("--dtypes", default="auto,float32", help="mismatch: the engine dtypes, comma-separated")
    parser.add_argument("--output", help="write the results as JSON here")
    options = parser.parse_args()
    for name in options.models.split(","):
        if name not in ("reasoning", *MODELS, *REAL_MODELS):
            parser.error(
                f"--models: unknown model {name!r}; choose from reasoning, {', '.join([*MODELS, *REAL_MODELS])}"
            )
    threads = torch.get_num_threads()
    print(f"torch threads {threads} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as work:
        if options.measure == "throughput":
            for name in options.models.split(","):
                result = throughput(
                    name,
                    Path(work),
                    options.num_completions,
                    options.completion_length,
                    options.repeats,
                    options.vllm_dtype,
                )
                results.append(result)
                rates = result["completions_per_second"]
                print(
                    f"{name} ({result['parameters'] / 1e6:.2f}M parameters, vLLM {result['vllm_dtype']}, "
                    f"HF {result['transformers_dtype']}): vLLM {rates['vllm']:.1f} completions/s, HF "
                    f"{rates['transformers']:.1f}; vLLM/HF {result['ratio_vllm_over_transformers']:.2f}x",
                    flush=True,
                )
        elif options.measure == "server_sync":
            for name in options.models.split(","):
                result = server_sync(name, Path(work), options.repeats)
                results.append(result)
                print(
                    f"{name} ({result['parameters'] / 1e6:.2f}M parameters, {result['megabytes']:.1f} MB, "
                    f"{result['tensors']} tensors): push {result['push_ms_median']:.1f} ms median "
                    f"({result['push_ms_min']:.1f}-{result['push_ms_max']:.1f}), "
                    f"{result['ms_per_megabyte']:.2f} ms/MB",
                    flush=True,
                )
        else:
            for dtype in options.dtypes.split(","):
                result = mismatch(Path(work), options.num_prompts, options.num_generations, dtype)
                results.append(result)
                print(json.dumps(result, indent=2), flush=True)
    if options.output:
        Path(options.output).write_text(
            json.dumps(
                {"measure": options.measure, "threads": threads, "options": vars(options), "results": results}, indent=2
            )
        )


if __name__ == "__main__":
    main()
