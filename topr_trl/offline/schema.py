"""What TOPRTrainer asks of an offline dataset (docs/offline.md, "Offline dataset schema"): the column checks made at
construction, the prompt groups, the one-time tokenization of what is not stored, and `stored_reward`. The trainer
imports this module and `sampler`, never the generation code.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
from collections.abc import Callable, Sequence

import pyarrow.compute as pc
import torch
from datasets import Dataset
from transformers.utils import logging
from trl.trainer.utils import is_async_callable

from ..inputs.prompts import tokenize_prompts
from ..loss import POLICY_LOSSES
from ..support import SamplerProcessing


logger = logging.get_logger(__name__)

OFFLINE_COLUMNS = (
    "prompt_index",
    "sample_index",
    "prompt_ids",
    "completion",
    "completion_ids",
    "behaviour_logps",
    "behaviour_sampling",
    "truncated",
    "reward",
)


_HOW_TO_MAKE = (
    "generate completions with `topr-trl generate` or topr_trl.offline.generate_offline_dataset, or add "
    "a `completion` column (text) to the dataset"
)


class RewardReturnError(TypeError, ValueError):
    """A reward function returned something that is not one number (or None) per completion. Both a TypeError and
    a ValueError: GRPOTrainer fails on such values with one or the other, and code that catches either still does."""


def check_reward_values(name: str, values, num_completions: int | None = None) -> None:
    """Fail with one line naming the reward function `name` unless `values` is what a reward function must return:
    a sequence of numbers (or None for a completion it cannot score), one per completion when `num_completions` is
    given."""
    expected = "a list of floats (or None), one per completion" + (
        f" ({num_completions} here)" if num_completions is not None else ""
    )
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise RewardReturnError(
            f"Reward function '{name}' returned {type(values).__name__} {values!r:.60}; it must return {expected}."
        )
    if num_completions is not None and len(values) != num_completions:
        raise RewardReturnError(
            f"Reward function '{name}' returned {len(values)} values for {num_completions} "
            f"completions; it must return {expected}."
        )
    for value in values:
        scalar = value is None or isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0
        if not scalar or isinstance(value, (str, bytes)):
            raise RewardReturnError(
                f"Reward function '{name}' returned a list holding {type(value).__name__} "
                f"{value!r:.40}; it must return {expected}."
            )


def stored_reward(completions, reward, **kwargs) -> list[float]:
    """A reward function that returns the dataset's `reward` column: train on the rewards computed at
    generation time instead of scoring again."""
    return [None if value is None or (isinstance(value, float) and math.isnan(value)) else value for value in reward]


def is_offline_dataset(dataset) -> bool:
    """Whether TOPRTrainer replays the stored completions of `dataset` instead of generating from its prompts."""
    columns = getattr(dataset, "column_names", None) or ()
    return "completion_ids" in columns or "completion" in columns


def check_offline_columns(dataset, role: str, uses_stored_reward: bool, has_behaviour_model: bool) -> None:
    """Refuse, in one line naming what is missing, a dataset (`role`: "train_dataset" or "eval_dataset") that
    TOPRTrainer could only misuse: stored rewards without the completions they score, `stored_reward` without a
    `reward` column, stored completions without their prompt or without mu's log-probs."""
    columns = list(getattr(dataset, "column_names", None) or ())
    stored_rewards = sorted(column for column in columns if column == "reward" or column.startswith("rewards/"))
    if not is_offline_dataset(dataset):
        if stored_rewards:
            raise ValueError(
                f"{role} has stored rewards {stored_rewards} but no completions they score (neither "
                f"`completion_ids` nor `completion`): {_HOW_TO_MAKE}."
            )
        if uses_stored_reward:
            raise ValueError(
                f"{role} has no `reward` column for topr_trl.offline.stored_reward (and no stored "
                f"completions): either give a dataset with completions and a `reward` column "
                f"({_HOW_TO_MAKE}), or real reward functions that score generated completions."
            )
        return
    if "prompt" not in columns:
        raise ValueError(
            f"offline {role} has no `prompt` column: each row needs the prompt its completion answers "
            "(docs/offline.md, 'Offline dataset schema')."
        )
    if uses_stored_reward and "reward" not in columns:
        raise ValueError(
            f"offline {role} has no `reward` column, which topr_trl.offline.stored_reward returns: either "
            "add the stored rewards as a `reward` column, or pass real reward functions that score the "
            "completions."
        )
    if "behaviour_logps" not in columns and not has_behaviour_model:
        hint = (
            ""
            if "completion_ids" in columns
            else " If `completion` holds reference answers rather than sampled "
            "completions, rename that column to train online."
        )
        raise ValueError(
            f"offline {role} has no `behaviour_logps` column: the log-probs of mu are needed for pi/mu. "
            "Generate the dataset with topr_trl.offline.generate_offline_dataset, which stores them, or "
            f"set topr_behaviour_model to the model that generated it.{hint}"
        )


def with_prompt_index(dataset: Dataset) -> Dataset:
    """`dataset` with its `prompt_index` (the prompt group of each row): kept when present, else derived from
    identical prompts, numbered in order of first appearance."""
    if "prompt_index" in dataset.column_names:
        return dataset
    groups: dict[str, int] = {}
    index = [
        groups.setdefault(json.dumps(prompt, sort_keys=True, default=str), len(groups)) for prompt in dataset["prompt"]
    ]
    return dataset.add_column("prompt_index", index)


def completion_token_ids(tokenizer, completions: Sequence, truncated: Sequence | None = None) -> list[list[int]]:
    """Completion texts (or one-message conversational completions) as token ids: tokenized without special
    tokens, with EOS appended unless the row is `truncated` (a completion that stopped ends with EOS, which is what
    teaches the model to stop) or the text already ends with it."""
    texts = []
    for completion in completions:
        if isinstance(completion, list) and len(completion) == 1 and isinstance(completion[0], dict):
            completion = completion[0].get("content")
        if not isinstance(completion, str):
            raise ValueError(
                f"`completion` must be text or one assistant message, got {completion!r:.80}; store "
                "token ids as `completion_ids` instead"
            )
        texts.append(completion)
    eos = tokenizer.eos_token_id
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    stopped = [not (truncated is not None and truncated[i]) for i in range(len(texts))]
    return [
        list(ids) + ([eos] if ended and (not ids or ids[-1] != eos) else [])
        for ids, ended in zip(encoded, stopped, strict=True)
    ]


STORED_TOKENS_CHECKED = 32  # rows whose stored completion ids are decoded against their stored text


class StoredTokensMismatch(ValueError):
    """Stored completion ids that the policy's tokenizer reads as other text: they were sampled with another
    tokenizer, and training on them would train on other tokens than mu sampled."""


def check_stored_tokens(dataset: Dataset, tokenizer, role: str = "train_dataset") -> None:
    """Raises `StoredTokensMismatch` unless the first `STORED_TOKENS_CHECKED` rows' stored `completion_ids` decode,
    with `tokenizer`, to their stored `completion` text (as generation decodes them: special tokens skipped; spacing
    aside). A dataset without both columns has nothing to check (text alone is tokenized by the policy)."""
    if not {"completion", "completion_ids"} <= set(dataset.column_names) or len(dataset) == 0:
        return
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's text tokenizer
    rows = dataset.select_columns(["completion", "completion_ids"]).select(
        range(min(STORED_TOKENS_CHECKED, len(dataset)))
    )
    vocabulary = len(tokenizer)
    differing = []
    for row in rows:
        stored = row["completion"]
        if isinstance(stored, list) and len(stored) == 1 and isinstance(stored[0], dict):  # one assistant message
            stored = stored[0].get("content")
        if not isinstance(stored, str):
            return  # not the text generation writes: nothing to compare with
        ids = list(row["completion_ids"])
        decoded = tokenizer.decode(ids, skip_special_tokens=True) if max(ids, default=0) < vocabulary else None
        # whitespace aside: a detokenizer other than `decode` (vLLM's, a user's pipeline) may space text otherwise,
        # and another tokenizer reads the ids as other characters altogether
        if decoded is None or "".join(decoded.split()) != "".join(stored.split()):
            differing.append((stored, decoded))
    if differing:
        stored, decoded = differing[0]
        read_as = "ids beyond its vocabulary" if decoded is None else repr(decoded[:40])
        raise StoredTokensMismatch(
            f"offline {role}: {len(differing)} of the first {len(rows)} stored `completion_ids` are not this "
            f"tokenizer's ({type(tokenizer).__name__}, {vocabulary} tokens): the first reads as {read_as} where the "
            f"stored text is {stored[:40]!r}. They were sampled with another tokenizer: train a model with mu's "
            "tokenizer, or keep only the `completion` text, which the policy tokenizes"
        )


def _prompt_ids_batch(batch: dict, tokenizer, chat_template_kwargs, tools, chat_template) -> dict:
    return {"prompt_ids": tokenize_prompts(tokenizer, batch["prompt"], chat_template_kwargs, tools, chat_template)}


def _completion_ids_batch(batch: dict, tokenizer) -> dict:
    return {"completion_ids": completion_token_ids(tokenizer, batch["completion"], batch.get("truncated"))}


def tokenize_offline_dataset(
    dataset: Dataset,
    tokenizer,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[Callable] | None = None,
    chat_template: str | None = None,
    role: str = "train_dataset",
) -> Dataset:
    """`dataset` with `prompt_ids` and `completion_ids` for replay, each tokenized once when not stored: prompts
    exactly as GRPOTrainer tokenizes them (`topr_trl.offline.rollout.tokenize_prompts` with the trainer's
    `chat_template_kwargs`, `tools` and `chat_template`), completion text by `completion_token_ids`. Checks that
    `behaviour_logps`, when stored, has one value per completion token."""
    if "prompt_ids" not in dataset.column_names:
        dataset = dataset.map(
            _prompt_ids_batch,
            batched=True,
            desc=f"tokenizing the prompts of {role}",
            fn_kwargs=dict(
                tokenizer=tokenizer, chat_template_kwargs=chat_template_kwargs, tools=tools, chat_template=chat_template
            ),
        )
    if "completion_ids" not in dataset.column_names:
        dataset = dataset.map(
            _completion_ids_batch,
            batched=True,
            desc=f"tokenizing the completions of {role}",
            fn_kwargs=dict(tokenizer=tokenizer),
        )
    if "behaviour_logps" in dataset.column_names:
        table = dataset.with_format("arrow")
        tokens = pc.list_value_length(table["completion_ids"]).to_pylist()
        logps = pc.list_value_length(table["behaviour_logps"]).to_pylist()
        for row, (n_tokens, n_logps) in enumerate(zip(tokens, logps, strict=True)):
            if n_tokens != n_logps:
                raise ValueError(
                    f"offline {role} row {row} has {n_logps} behaviour_logps for {n_tokens} completion "
                    "tokens: mu's log-probs must be those of the stored (or tokenized) completion, one "
                    "per token, EOS included"
                )
    return dataset


def validate_offline_dataset(
    dataset: Dataset,
    num_generations: int,
    needs_whole_groups: bool,
    batch_rows: int | None = None,
    role: str = "train_dataset",
    group_size_name: str = "num_generations",
) -> None:
    """Fail early, naming the problem, on an offline dataset (with `prompt_index`) TOPRTrainer cannot train from
    (`batch_rows`: the rows of one generation batch, GRPOConfig's `generation_batch_size`; `group_size_name`: the
    config field that sets the group size, `num_generations` or `num_generations_eval` for an eval dataset)."""
    if batch_rows is not None and len(dataset) < batch_rows:
        raise ValueError(
            f"offline {role} has {len(dataset)} rows, fewer than one batch of {batch_rows} "
            "(generation_batch_size: per_device_train_batch_size x processes x steps_per_generation), so there is "
            "nothing to train on. Lower per_device_train_batch_size or generate more rows (a curated composition "
            "such as positives_only keeps only part of what was generated)."
        )
    if needs_whole_groups:
        sizes: dict[int, int] = {}
        for group in dataset["prompt_index"]:
            sizes[group] = sizes.get(group, 0) + 1
        uneven = {g: n for g, n in sizes.items() if n != num_generations}
        if uneven:
            example = next(iter(uneven.items()))
            raise ValueError(
                f"{len(uneven)} prompt group(s) of offline {role} do not have {group_size_name}={num_generations} "
                f"rows (e.g. prompt {example[0]} has {example[1]}). The group advantage and group_mean baseline need "
                f"whole groups: set {group_size_name} to the dataset's completions per prompt, or train with "
                "topr_signal='reward' and a numeric topr_baseline (e.g. after Anna Karenina or target-proportion "
                "composition)."
            )


def needs_whole_groups(args) -> bool:
    """Whether the configured signal reads prompt groups (GRPO's advantage, or the group-mean baseline), so that an
    offline dataset must hold `num_generations` rows per prompt."""
    return args.loss_type not in POLICY_LOSSES or args.topr_signal == "advantage" or args.topr_baseline == "group_mean"


def checked_eval_datasets(eval_dataset, args, uses_stored_reward: bool, has_behaviour_model: bool):
    """The eval dataset(s) with each offline one refused now if it cannot be replayed and scored (as the train
    dataset), and given its prompt groups. Eval batches are scored in groups of `num_generations_eval` rows."""
    if eval_dataset is None:
        return None
    named = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset}
    checked = {}
    for name, dataset in named.items():
        role = "eval_dataset" if name is None else f"eval_dataset[{name!r}]"
        check_offline_columns(dataset, role, uses_stored_reward, has_behaviour_model)
        if is_offline_dataset(dataset):
            dataset = with_prompt_index(dataset)
            group_size = args.num_generations_eval or args.num_generations
            validate_offline_dataset(
                dataset,
                group_size,
                needs_whole_groups=needs_whole_groups(args),
                role=role,
                group_size_name="num_generations_eval",
            )
            if len(dataset) % group_size:
                raise ValueError(
                    f"offline {role} has {len(dataset)} rows, not a multiple of num_generations_eval="
                    f"{group_size} (GRPOTrainer scores eval batches in groups of that many rows): "
                    "set num_generations_eval to a divisor of it, or drop rows."
                )
        checked[name] = dataset
    return checked[None] if None in checked else checked


def checked_reward_function(function, name: str):
    """`function` failing, in one line naming it, where GRPOTrainer would fail on what it returned with a bare
    TypeError (a string, a number, a list of lists, ...). Everything GRPOTrainer passes is passed through untouched
    (no keyword is assumed: environment-owned rewards get `environments` only), and what the function returns is
    handed back as it is (a generator as the list it yields); counting the values is left to GRPOTrainer, which
    says the same. Name, docstring and async-ness are kept; a reward model is returned as it is."""
    if isinstance(function, torch.nn.Module):  # a reward model: GRPOTrainer reads its logits itself
        return function

    def checked_values(values):
        if not hasattr(values, "__len__") and hasattr(values, "__iter__"):
            values = list(values)  # a generator: GRPOTrainer iterates once, and the check iterates too
        check_reward_values(name, values)
        return values

    if is_async_callable(function):

        @functools.wraps(function)
        async def checked_async(*args, **kwargs):
            return checked_values(await function(*args, **kwargs))

        return checked_async

    @functools.wraps(function)
    def checked(*args, **kwargs):
        return checked_values(function(*args, **kwargs))

    return checked


def stored_processing(datasets: Sequence[Dataset], trainer_processing: SamplerProcessing) -> SamplerProcessing:
    """How mu sampled the stored rows (their `behaviour_sampling`: temperature, top_k, top_p, min_p, engine), one for
    all the replayed datasets, since pi is scored on mu's support with it. Rows that do not say are taken to have
    been sampled with the trainer's own settings (`trainer_processing`), said once; rows that disagree fail in one
    line."""
    found = set()
    for dataset in datasets:
        if "behaviour_sampling" not in dataset.column_names:
            found.add(None)
            continue
        found.update(None if row is None else json.dumps(row, sort_keys=True) for row in dataset["behaviour_sampling"])
    stated = sorted(value for value in found if value is not None)
    if len(stated) > 1:
        raise ValueError(
            f"the stored rows were sampled in {len(stated)} ways (`behaviour_sampling`: "
            f"{', '.join(stated[:3])}): pi is scored on the support mu sampled from, one way per run; "
            "train on each part apart"
        )
    if not stated:
        logger.warning_once(
            "The stored rows do not say how mu sampled them (no `behaviour_sampling` column): pi/mu assumes this "
            f"trainer's settings (temperature {trainer_processing.temperature}, top_k {trainer_processing.top_k}, "
            f"top_p {trainer_processing.top_p}, min_p {trainer_processing.min_p}). `topr-trl generate` stores them."
        )
        return trainer_processing
    if None in found:
        raise ValueError(
            "some stored rows say how mu sampled them (`behaviour_sampling`) and some do not: pi/mu "
            "needs it for every row"
        )
    return SamplerProcessing.from_row(json.loads(stated[0]))
