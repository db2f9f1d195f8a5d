"""The user's own held-out prompts and how a policy is measured on them: `load_test_prompts` (the prompts of a held-out
split, or why there are none) and `reward_evaluator` (the mean reward of the user's reward functions on completions
sampled from the policy, labelled exactly as generation labels the data). `topr-trl iterate` measures each iteration
with them (`topr_trl.commands.iterations`), and a training command its custom task (`topr_trl.tasks.loading`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from datasets import Dataset

from ..generation.completions import seeded_eval_sampling
from ..inputs.sources import load_data_source
from .generation import prompts_digest, sample_rows, score_rows
from .rollout import sample_with_logps


HELD_OUT_SAMPLES = 4  # completions sampled per held-out prompt: enough to see a mean reward move, cheap on a CPU


def load_test_prompts(
    dataset_name: str, split: str, train_split: str, config: str | None, train_prompts: Dataset
) -> tuple[Dataset | None, str | None]:
    """The prompts of the held-out `split` of the user's `dataset_name`, or (None, why there are none). A single file,
    or a folder whose files are not named after splits, holds the training split only; a "test" split that holds
    the training prompts themselves (a save_to_disk folder of one dataset) is none either: measuring on the
    training prompts would not be a held-out measure."""
    try:
        test = load_data_source(dataset_name, split, config=config, what="dataset", one_split=train_split)
    except (ValueError, FileNotFoundError) as error:
        return None, " ".join(str(error).split())
    if "prompt" not in test.column_names:
        return None, f"the {split!r} split of {dataset_name} has no `prompt` column (it has {test.column_names})"
    if len(test) == 0:
        return None, f"the {split!r} split of {dataset_name} is empty"

    if len(test) == len(train_prompts) and prompts_digest(test) == prompts_digest(train_prompts):
        return None, f"the {split!r} split of {dataset_name} holds the training prompts themselves"
    return test, None


def reward_evaluator(
    test_prompts: Dataset,
    reward_funcs: Sequence[Callable],
    reward_weights: Sequence[float] | None = None,
    num_samples: int = HELD_OUT_SAMPLES,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 256,
    seed: int = 0,
    chat_template_kwargs: dict | None = None,
    prompts_per_batch: int = 16,
) -> Callable[[object, object], dict]:
    """`evaluate(model, tokenizer) -> dict` for `run_iterations` on the user's own data: `num_samples` completions
    sampled for each of `test_prompts` and labelled with the user's reward functions exactly as generation labels
    the data the iterations train on (`sample_rows` and `score_rows`: the same prompt tokenization, the same
    weighted sum). Reports `mean_reward` (over the completions some function scored) with its standard error over
    prompts, `positive_share` (completions with reward > 0, the p of generated data), `unscored_share`, and how it
    was measured. Sampling runs in a forked RNG seeded with `seed`, so training's random state is left untouched."""
    functions = list(reward_funcs)
    weights = list(reward_weights) if reward_weights is not None else [1.0] * len(functions)

    def evaluate(model, tokenizer) -> dict:
        with seeded_eval_sampling(model, seed):
            rows = sample_rows(
                sample_with_logps,
                model,
                tokenizer,
                test_prompts,
                num_samples,
                prompts_per_batch,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_new_tokens=max_new_tokens,
                chat_template_kwargs=chat_template_kwargs,
            )
        score_rows(rows, functions, weights)
        rewards = [row["reward"] for row in rows]
        scored = [reward for reward in rewards if not math.isnan(reward)]
        per_prompt = [
            statistics.fmean(values)
            for start in range(0, len(rewards), num_samples)
            if (values := [r for r in rewards[start : start + num_samples] if not math.isnan(r)])
        ]
        return {
            "mean_reward": statistics.fmean(scored) if scored else math.nan,
            "mean_reward_se": statistics.stdev(per_prompt) / len(per_prompt) ** 0.5
            if len(per_prompt) > 1
            else math.nan,
            "positive_share": sum(reward > 0 for reward in scored) / len(rewards),
            "unscored_share": 1 - len(scored) / len(rewards),
            "num_problems": len(test_prompts),
            "num_samples": num_samples,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "max_new_tokens": max_new_tokens,
            "reward_funcs": [getattr(f, "__name__", type(f).__name__) for f in functions],
        }

    return evaluate
