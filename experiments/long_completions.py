"""How the sequence ratio spreads with completion length, under the engine's bfloat16 mismatch and under policy drift.

TOPR weights a negative by min(1, pi(tau)/mu(tau)), the product of its token ratios. Anything in a token's ratio
that is not zero on average compounds over the completion: this script measures by how much, at every prefix length
l of the completions, S_l = sum over the first l tokens of log pi/mu, and what it makes of the negatives' weights
min(1, exp S) (the product, TOPR's default) and min(1, exp(S / l)) (the `length_normalized` level).

Two sources of pi/mu, each alone:

    mismatch  mu is vLLM's engine in bfloat16 (what a colocated engine or a server at `--dtype auto` runs on a CPU),
              pi the same weights in float32 (learning rate 0: nothing moved). Sampled at temperature 1 without
              truncation, so the support plays no part.
    drift     mu is the base model in float32 (transformers' sampling, exact log-probs), pi the policy after k
              optimizer steps of on-policy TOPR (learning rate 1e-4, the testbed's), k in --drift_steps: the data
              of a run whose samples are k versions old.

Models: the reasoning testbed's warm start at --digits (completions of about 9 tokens per digit: 37 at 3 digits,
about 130 at 12), and, for the mismatch alone, a random-initialised model of the testbed's shape sampled for
--random_length tokens (a near-uniform policy, as a base model on a hard task; EOS ignored).

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m experiments.long_completions --digits 3 12 \
        --output experiments/evidence/long_completions/long_completions
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


PREFIXES = (8, 16, 32, 64, 128, 256, 512)
"""Prefix lengths l at which the sequence log-ratio is read (those no completion reaches are left out)."""


def parse(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--digits", type=int, nargs="+", default=[3, 12], help="reasoning testbeds to measure")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--drift_steps", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument(
        "--warm_steps",
        type=int,
        nargs="+",
        default=None,
        help="SFT steps of each --digits warm start (default: the shipped recipe's, 3,000; longer "
        "solutions may need more)",
    )
    parser.add_argument("--random_length", type=int, default=512)
    parser.add_argument("--skip", nargs="*", default=[], choices=["mismatch", "drift", "random"])
    parser.add_argument("--work_dir", default="outputs/long_completions")
    parser.add_argument("--output", default="experiments/evidence/long_completions/long_completions")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------
# What is measured
# ---------------------------------------------------------------------------------------------------------


def spread(sums: list[float]) -> dict:
    """Median |S|, the 5 % and 95 % quantiles (linear interpolation between order statistics) of sequence
    log-ratios S."""
    cuts = statistics.quantiles(sums, n=20, method="inclusive")
    return {
        "median_abs_log_ratio": statistics.median(abs(s) for s in sums),
        "log_ratio_q05": cuts[0],
        "log_ratio_q95": cuts[-1],
    }


def negative_weights(negatives: list[tuple[float, int]]) -> dict:
    """The weights TOPR gives negatives of sequence log-ratio S over l tokens (pairs (S, l)): mean min(1, exp S),
    the share below 0.5, and mean min(1, exp(S / l)) at the length-normalised level; none without negatives."""
    if not negatives:
        return {}
    return {
        "negative_weight_mean": statistics.mean(min(1.0, math.exp(s)) for s, _ in negatives),
        "negative_weight_below_half": sum(math.exp(s) < 0.5 for s, _ in negatives) / len(negatives),
        "negative_weight_length_normalized_mean": statistics.mean(min(1.0, math.exp(s / n)) for s, n in negatives),
    }


def prefix_statistics(token_log_ratios: list[torch.Tensor], negative: list[bool]) -> list[dict]:
    """At each prefix length l that at least 8 completions reach: the spread of S_l over those completions (median
    |S_l|, 5 % and 95 % quantiles, standard deviation), the mean per-token log-ratio, and the negatives' weights
    (every completion counted as a negative when `negative` is all True): mean min(1, exp S_l), the share below
    0.5, and the same for the length-normalised ratio exp(S_l / l)."""
    rows = []
    for length in PREFIXES:
        reaching = [
            (ratios[:length].sum().item(), is_negative)
            for ratios, is_negative in zip(token_log_ratios, negative, strict=True)
            if ratios.numel() >= length
        ]
        if len(reaching) < 8:
            continue
        sums = [total for total, _ in reaching]
        negatives = [(total, length) for total, is_negative in reaching if is_negative]
        rows.append(
            {
                "length": length,
                "completions": len(sums),
                "negatives": len(negatives),
                **spread(sums),
                "log_ratio_std": statistics.pstdev(sums),
                "mean_token_log_ratio": statistics.mean(sums) / length,
                **negative_weights(negatives),
            }
        )
    return rows


def whole_completion_statistics(token_log_ratios: list[torch.Tensor], negative: list[bool]) -> dict:
    """The same at each completion's own length: what the loss sees."""
    sums = [ratios.sum().item() for ratios in token_log_ratios]
    lengths = [ratios.numel() for ratios in token_log_ratios]
    negatives = [(s, n) for s, n, is_negative in zip(sums, lengths, negative, strict=True) if is_negative]
    return {
        "completions": len(sums),
        "mean_length": statistics.mean(lengths),
        **spread(sums),
        "negatives": len(negatives),
        **negative_weights(negatives),
    }


def policy_token_logps(model, rows: list[dict]) -> list[torch.Tensor]:
    """log softmax(logits) (temperature 1, whole vocabulary) of each row's completion tokens under `model`, float32."""
    out = []
    with torch.no_grad():
        for row in rows:
            sequence = list(row["prompt_ids"]) + list(row["completion_ids"])
            logits = model(torch.tensor([sequence])).logits[0, len(row["prompt_ids"]) - 1 : -1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(row["completion_ids"])[:, None])[:, 0])
    return out


def log_ratios(model, rows: list[dict]) -> list[torch.Tensor]:
    """Per-token log pi/mu of `rows` (mu's log-probs stored as `behaviour_logps`), pi = `model`."""
    return [
        pi - torch.tensor(row["behaviour_logps"], dtype=torch.float32)
        for pi, row in zip(policy_token_logps(model, rows), rows, strict=True)
    ]


# ---------------------------------------------------------------------------------------------------------
# Sources of mu
# ---------------------------------------------------------------------------------------------------------


def engine_rows(
    model_path: Path, prompt_ids: list[list[int]], samples: int, max_tokens: int, ignore_eos: bool, seed: int = 0
) -> tuple[list[dict], str]:
    """Completions of vLLM's engine at its default dtype (bfloat16 on a CPU for a float32 checkpoint), temperature
    1, whole vocabulary, with the sampled tokens' log-probs."""
    from vllm import SamplingParams

    from topr_trl.generation.completions import free_vllm_memory, make_vllm_engine

    engine = make_vllm_engine(model_path, seed=seed, enforce_eager=True)
    dtype = str(engine.llm_engine.model_config.dtype)
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens, logprobs=0, ignore_eos=ignore_eos)
    outputs = engine.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    rows = [
        {
            "prompt_ids": ids,
            "completion_ids": list(sample.token_ids),
            "behaviour_logps": [
                step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids, strict=True)
            ],
        }
        for ids, request in zip(prompt_ids, outputs, strict=True)
        for sample in request.outputs
    ]
    del engine
    free_vllm_memory()
    return rows, dtype


def base_rows(model, tokenizer, prompts: list, samples: int, max_tokens: int) -> list[dict]:
    """Completions of the float32 base model (transformers), with their exact log-probs."""
    from topr_trl.offline.rollout import sample_with_logps

    torch.manual_seed(0)
    return sample_with_logps(model, tokenizer, prompts, num_completions=samples, max_new_tokens=max_tokens)


def drifted_policies(base_path: Path, digits: int, steps: list[int], learning_rate: float, work: Path) -> dict:
    """{k: state dict after k optimizer steps} of on-policy TOPR from the warm start (the testbed's batch: 32
    completions, 8 per prompt, constant learning rate, gradient norm clipped at 1)."""
    from transformers import TrainerCallback

    from topr_trl import TOPRConfig, TOPRTrainer
    from topr_trl.tasks.reasoning import make_reasoning_dataset, max_completion_tokens, reasoning_reward

    kept: dict[int, dict] = {}

    class Keep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step in steps:
                kept[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    args = TOPRConfig(
        str(work / f"drift-d{digits}"),
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=max_completion_tokens(digits),
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=max(steps),
        logging_steps=10**6,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    trainer = TOPRTrainer(
        str(base_path),
        reasoning_reward,
        args=args,
        train_dataset=make_reasoning_dataset(32 * max(steps), digits, "train", seed=0),
        callbacks=[Keep()],
    )
    trainer.train()
    return kept


# ---------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------


def measure(name: str, token_log_ratios: list[torch.Tensor], negative: list[bool], **about) -> dict:
    result = {
        "name": name,
        **about,
        "whole": whole_completion_statistics(token_log_ratios, negative),
        "prefixes": prefix_statistics(token_log_ratios, negative),
    }
    whole = result["whole"]
    print(
        f"{name}: mean length {whole['mean_length']:.0f}, median |log pi/mu| {whole['median_abs_log_ratio']:.4f}, "
        f"negatives' mean weight {whole.get('negative_weight_mean', float('nan')):.3f} "
        f"(length-normalised {whole.get('negative_weight_length_normalized_mean', float('nan')):.3f})",
        flush=True,
    )
    return result


def reasoning_measurements(options, digits: int, warm_steps: int, work: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from topr_trl.inputs.prompts import tokenize_prompts
    from topr_trl.tasks.reasoning import (
        WarmStartSettings,
        build_reasoning_warm_model,
        make_reasoning_dataset,
        max_completion_tokens,
        reasoning_reward,
    )

    settings = WarmStartSettings(digits=digits, steps=warm_steps)
    model, tokenizer, path = build_reasoning_warm_model(work / "cache", settings)
    prompts = make_reasoning_dataset(options.prompts, digits, "validation", seed=0)
    answers = [answer for answer in prompts["answer"] for _ in range(options.samples)]

    def negatives(rows):
        texts = [tokenizer.decode(row["completion_ids"], skip_special_tokens=True) for row in rows]
        return [reward < 0 for reward in reasoning_reward(texts, answers)]

    results = []
    about = {"model": f"reasoning warm start, {digits} digits", "settings": settings.to_dict()}
    if "mismatch" not in options.skip:
        prompt_ids = tokenize_prompts(tokenizer, list(prompts["prompt"]), None, None)
        rows, dtype = engine_rows(path, prompt_ids, options.samples, max_completion_tokens(digits), ignore_eos=False)
        results.append(
            measure(
                f"mismatch, {digits} digits",
                log_ratios(model.eval(), rows),
                negatives(rows),
                source="mismatch",
                engine_dtype=dtype,
                **about,
            )
        )
    if "drift" not in options.skip:
        rows = base_rows(
            model.eval(), tokenizer, list(prompts["prompt"]), options.samples, max_completion_tokens(digits)
        )
        flags = negatives(rows)
        base_accuracy = 1 - sum(flags) / len(flags)
        if base_accuracy == 0:  # GRPO's group advantage is 0 in every group: TOPRTrainer would not move the policy
            reason = "no base sample is correct, so GRPO's group advantage is 0 and nothing moves the policy"
            print(f"drift, {digits} digits: not measured ({reason})", flush=True)
            return [*results, {"name": f"drift, {digits} digits", "source": "drift", "skipped": reason, **about}]
        policy = AutoModelForCausalLM.from_pretrained(path).eval()
        for steps, state in sorted(
            drifted_policies(path, digits, options.drift_steps, options.learning_rate, work).items()
        ):
            policy.load_state_dict(state)
            results.append(
                measure(
                    f"drift of {steps} steps, {digits} digits",
                    log_ratios(policy, rows),
                    flags,
                    source="drift",
                    drift_steps=steps,
                    learning_rate=options.learning_rate,
                    base_sampled_accuracy=base_accuracy,
                    **about,
                )
            )
    return results


def random_model_measurement(options, work: Path) -> dict:
    from topr_trl.inputs.prompts import tokenize_prompts
    from topr_trl.tasks.reasoning import make_reasoning_dataset
    from topr_trl.tasks.tiny import build_model, build_tokenizer, save_pretrained

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0)
    path = save_pretrained(model, tokenizer, work / "random-model")
    prompts = make_reasoning_dataset(options.prompts, 3, "validation", seed=0)
    prompt_ids = tokenize_prompts(tokenizer, list(prompts["prompt"]), None, None)
    rows, dtype = engine_rows(path, prompt_ids, options.samples, options.random_length, ignore_eos=True)
    return measure(
        f"mismatch, random model, {options.random_length} tokens",
        log_ratios(model.eval(), rows),
        [True] * len(rows),
        source="mismatch",
        engine_dtype=dtype,
        model="random-initialised testbed shape (64 x 2), EOS ignored",
    )


def plot(results: list[dict], output: str) -> None:
    import matplotlib  # noqa: PLC0415 - only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - only when plotting

    figure, (spread, weight) = plt.subplots(1, 2, figsize=(11, 4))
    for result in (result for result in results if "skipped" not in result):
        lengths = [row["length"] for row in result["prefixes"]]
        spread.plot(
            lengths, [row["median_abs_log_ratio"] for row in result["prefixes"]], marker="o", label=result["name"]
        )
        with_negatives = [row for row in result["prefixes"] if "negative_weight_mean" in row]
        weight.plot(
            [row["length"] for row in with_negatives],
            [row["negative_weight_mean"] for row in with_negatives],
            marker="o",
            label=result["name"],
        )
    spread.set(
        xscale="log",
        yscale="log",
        xlabel="prefix length (tokens)",
        ylabel="median |sum of log pi/mu|",
        title="spread of the sequence log-ratio",
    )
    weight.set(
        xscale="log",
        xlabel="prefix length (tokens)",
        ylabel="mean min(1, pi/mu) of negatives",
        title="negatives' weight under the product ratio",
        ylim=(0, 1.05),
    )
    spread.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(f"{output}.png", dpi=120)


def main(argv=None) -> dict:
    options = parse(argv)
    torch.set_num_threads(1)
    work = Path(options.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    warm_steps = options.warm_steps or [3000] * len(options.digits)
    results = []
    for digits, steps in zip(options.digits, warm_steps, strict=True):
        results.extend(reasoning_measurements(options, digits, steps, work))
    if "random" not in options.skip:
        results.append(random_model_measurement(options, work))
    summary = {
        "options": vars(options),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "results": results,
    }
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{options.output}.json").write_text(json.dumps(summary, indent=2))
    plot(results, options.output)
    return summary


if __name__ == "__main__":
    main()
