"""Offline TOPR (the paper's Algorithm 1): sample n completions per prompt from mu once, label them, train.

The dataset has one row per completion; its columns (which are required, their types and meaning) are in the
table "Offline dataset schema" of README.md. `generate_offline_dataset` writes every column of that table, in
shards under a directory, and resumes an interrupted run without losing or duplicating rows;
`load_offline_dataset` reads the shards back and `load_offline_source` loads an offline dataset from anywhere
(shards, a `save_to_disk` folder, json/jsonl/csv/parquet files, a Hub id). TOPRTrainer trains from such a dataset
(no generation) when its `train_dataset` has a `completion_ids` or a `completion` column, replaying the stored
`prompt_ids` and `completion_ids`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from datasets import Dataset, concatenate_datasets, load_dataset, load_from_disk
from torch.utils.data import Sampler

from .rollout import (
    free_vllm_memory,
    make_vllm_engine,
    sample_with_logps,
    sample_with_logps_vllm,
    tokenize_prompts,
    vllm_available,
)

BACKENDS = ("auto", "transformers", "vllm")
COMPOSITIONS = ("uniform", "positives_only", "anna_karenina", "target_proportion")
OFFLINE_COLUMNS = ("prompt_index", "sample_index", "prompt_ids", "completion", "completion_ids", "behaviour_logps",
                   "truncated", "reward")
_MANIFEST = "manifest.json"
_HOW_TO_MAKE = ("generate completions with `topr-trl generate` or topr_trl.offline.generate_offline_dataset, or add "
                "a `completion` column (text) to the dataset")


def _reward_name(function) -> str:
    return getattr(function, "__name__", type(function).__name__)


def check_reward_values(name: str, values, num_completions: int) -> None:
    """Fail with one line naming the reward function `name` unless `values` is what a reward function must return:
    a list of floats (or None for a completion it cannot score), one per completion."""
    expected = f"a list of floats (or None), one per completion ({num_completions} here)"
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise TypeError(f"Reward function '{name}' returned {type(values).__name__} {values!r:.60}; it must return "
                        f"{expected}.")
    if len(values) != num_completions:
        raise ValueError(f"Reward function '{name}' returned {len(values)} values for {num_completions} completions; "
                         f"it must return {expected}.")
    for value in values:
        scalar = value is None or isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0
        if not scalar or isinstance(value, (str, bytes)):
            raise TypeError(f"Reward function '{name}' returned a list holding {type(value).__name__} {value!r:.40}; "
                            f"it must return {expected}.")


def generate_offline_dataset(
    model,
    tokenizer,
    prompts: Dataset,
    reward_funcs: Callable | Sequence[Callable],
    output_dir: str | Path,
    num_completions: int = 16,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 512,
    prompts_per_shard: int = 64,
    prompts_per_batch: int = 8,
    reward_weights: Sequence[float] | None = None,
    show_progress: bool = True,
    push_to_hub: str | None = None,
    private: bool = True,
    backend: str = "auto",
    seed: int = 0,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[Callable] | None = None,
) -> Dataset:
    """Sample `num_completions` completions per prompt from `model` (mu), score them, save them in shards.

    `backend`: "transformers" (`model` a loaded causal LM), "vllm" (`model` a model path or Hub id, a loaded model
    whose `name_or_path` is used, or a vLLM engine from `topr_trl.rollout.make_vllm_engine`), or "auto": vLLM when
    it is installed and a GPU is present, transformers otherwise. Both write the same schema; `seed` seeds the vLLM
    engine (seed transformers sampling with `torch.manual_seed`). An engine built here is released before returning,
    as is a model loaded here from a path, so that training can use their GPU memory.

    Prompts are tokenized exactly as GRPOTrainer tokenizes them (`topr_trl.rollout.tokenize_prompts`: the
    tokenizer's special tokens for plain text, the chat template for conversations); pass the training config's
    `chat_template_kwargs` (and `tools`) so that mu is conditioned as pi will be. The ids are stored as
    `prompt_ids`, and TOPRTrainer trains on them as stored.

    Defaults follow the paper (temperature 1; it uses top_k=500 and 512 new tokens). A shard is written
    atomically once all its prompts are done, so an interrupted run restarted with the same arguments
    resumes after the last complete shard: no row is lost or duplicated. Returns the whole dataset, which is
    also pushed to the Hub repository `push_to_hub` when given (credentials from `huggingface-cli login` or
    HF_TOKEN; never printed).
    """
    from .config import check_choice

    check_choice("backend", backend, BACKENDS)
    if backend == "auto":
        backend = "vllm" if vllm_available() else "transformers"
    given_model = model
    if backend == "vllm":
        prompts_per_batch = prompts_per_shard  # vLLM schedules a whole shard at once
    sampler = None  # loaded when a shard needs it: a resumed or finished generation (other ranks) loads no model
    reward_funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
    weights = list(reward_weights) if reward_weights is not None else [1.0] * len(reward_funcs)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"{len(weights)} reward_weights for {len(reward_funcs)} reward functions")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    settings = {"num_prompts": len(prompts), "num_completions": num_completions, "temperature": temperature,
                "top_p": top_p, "top_k": top_k, "max_new_tokens": max_new_tokens,
                "prompts_per_shard": prompts_per_shard, "reward_funcs": [_reward_name(f) for f in reward_funcs]}
    if chat_template_kwargs or tools:  # only when set, so that generations written before these existed resume
        settings["chat_template_kwargs"] = dict(chat_template_kwargs or {})
        settings["tools"] = [getattr(tool, "__name__", repr(tool)) for tool in tools or []]
    manifest_file = output_dir / _MANIFEST
    if manifest_file.exists():
        previous = json.loads(manifest_file.read_text())
        if previous["settings"] != settings:
            raise ValueError(f"{output_dir} holds a generation with other settings ({previous['settings']}); "
                             "use another output_dir or the same settings to resume")
    else:
        manifest_file.write_text(json.dumps({"settings": settings}, indent=2))
    from tqdm.auto import tqdm

    num_shards = math.ceil(len(prompts) / prompts_per_shard)
    progress = tqdm(total=len(prompts), desc="generating", unit="prompt", disable=not show_progress)
    for shard in range(num_shards):
        start, stop = shard * prompts_per_shard, min((shard + 1) * prompts_per_shard, len(prompts))
        shard_dir = output_dir / f"shard-{shard:05d}"
        if shard_dir.exists():
            progress.update(stop - start)
            continue
        if sampler is None:
            model, sampler = _load_sampler(model, backend, seed)
        rows = []
        for batch_start in range(start, stop, prompts_per_batch):
            batch = prompts.select(range(batch_start, min(batch_start + prompts_per_batch, stop)))
            samples = sampler(model, tokenizer, batch["prompt"], num_completions, temperature, top_p, top_k,
                             max_new_tokens, chat_template_kwargs=chat_template_kwargs, tools=tools)
            for offset, example in enumerate(batch):
                for sample_index in range(num_completions):
                    sample = samples[offset * num_completions + sample_index]
                    rows.append({**example, "prompt_index": batch_start + offset, "sample_index": sample_index,
                                 **sample})
            progress.update(len(batch))
        _score(rows, reward_funcs, weights)
        temporary = output_dir / f".shard-{shard:05d}.tmp"
        shutil.rmtree(temporary, ignore_errors=True)
        Dataset.from_list(rows).save_to_disk(str(temporary))
        temporary.rename(shard_dir)  # atomic: a shard directory is either complete or absent
    progress.close()
    if model is not given_model:  # loaded here, so released here; a model or engine passed in stays the caller's
        model = None
        if backend == "vllm":
            free_vllm_memory()
    dataset = load_offline_dataset(output_dir)
    if push_to_hub:
        dataset.push_to_hub(push_to_hub, private=private)
    return dataset


def _load_sampler(model, backend: str, seed: int) -> tuple[object, Callable]:
    """The model ready for `backend` ("vllm" or "transformers") and the function that samples from it."""
    if backend == "vllm":
        if isinstance(model, str) or hasattr(model, "name_or_path"):
            model = make_vllm_engine(model if isinstance(model, str) else model.name_or_path, seed=seed)
        return model, sample_with_logps_vllm
    if isinstance(model, str):
        import torch
        from transformers import AutoModelForCausalLM

        from .distributed import outside_zero3_construction

        with outside_zero3_construction():  # under `accelerate launch` the main process samples alone
            model = AutoModelForCausalLM.from_pretrained(model)
        model.to("cuda" if torch.cuda.is_available() else "cpu")
    return model, sample_with_logps


def _score(rows: list[dict], reward_funcs: list[Callable], weights: list[float]) -> None:
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
    total = [0.0] * len(rows)
    scored = [False] * len(rows)
    for function, weight in zip(reward_funcs, weights, strict=True):
        values = function(prompts=[row["prompt"] for row in rows], completions=[row["completion"] for row in rows],
                          **columns)
        if inspect.isawaitable(values):  # an async reward function, as GRPOTrainer accepts
            values = asyncio.run(values)
        check_reward_values(_reward_name(function), values, len(rows))
        for i, value in enumerate(values):
            value = math.nan if value is None else float(value)
            rows[i][f"rewards/{_reward_name(function)}"] = value
            if not math.isnan(value):
                total[i] += weight * value
                scored[i] = True
    for row, value, ok in zip(rows, total, scored, strict=True):
        row["reward"] = value if ok else math.nan


def load_offline_dataset(directory: str | Path) -> Dataset:
    """The complete shards of a generated dataset, in prompt order."""
    shards = sorted(Path(directory).glob("shard-*"))
    if not shards:
        raise FileNotFoundError(f"no generated shards in {directory}")
    parts = [load_from_disk(str(shard)) for shard in shards]
    if len({"prompt_ids" in part.column_names for part in parts}) > 1:
        # a generation resumed across the version that began storing prompt ids: the trainer tokenizes them all
        parts = [part.remove_columns("prompt_ids") if "prompt_ids" in part.column_names else part for part in parts]
    return concatenate_datasets(parts)


_LIST_COLUMNS = ("prompt_ids", "completion_ids", "behaviour_logps")


def load_offline_source(source: str | Path) -> Dataset:
    """An offline dataset from `source`: the shard folder `generate_offline_dataset` writes, a `save_to_disk` folder
    (a DatasetDict gives its `train` split, or its only one), a `.json`/`.jsonl`/`.csv`/`.parquet` file or a folder
    of such files (one format), or a Hub dataset id (its `train` split). Raises FileNotFoundError for a path that
    does not exist and ValueError for one that holds nothing loadable.

    CSV cannot hold lists: a CSV offline dataset normally carries `completion` text (tokenized by TOPRTrainer); list
    columns written as JSON text (`[1, 2, 3]`) are parsed back."""
    from .datasets import LOCAL_FORMATS, is_saved_dataset, load_source

    text = str(source)
    path = Path(text).expanduser()
    local = path.exists() or path.suffix.lower() in LOCAL_FORMATS or text.startswith((".", "/", "~")) \
        or text.count("/") > 1  # a Hub id is `name` or `owner/name`
    if not local:
        try:
            return load_dataset(text, split="train")
        except Exception as error:  # offline, the Hub's errors do not say that a local path was meant
            reason = (str(error).splitlines() or [""])[0][:200]
            raise FileNotFoundError(f"offline dataset {text!r} is no local path, and loading it from the Hub failed "
                                    f"({type(error).__name__}: {reason}); check the path or the Hub id") from error
    if not path.exists():
        raise FileNotFoundError(f"offline dataset {text!r} not found: give the folder `topr-trl generate` wrote, a "
                                "save_to_disk folder, a .json/.jsonl/.csv/.parquet file or folder, or a Hub id")
    if path.is_dir() and any(path.glob("shard-*")):
        return load_offline_dataset(path)
    if path.is_dir() and is_saved_dataset(path):
        return load_source(str(path), "train")
    files = [path] if path.is_file() else sorted(
        file for file in path.rglob("*") if file.is_file() and file.suffix.lower() in LOCAL_FORMATS)
    formats = {LOCAL_FORMATS.get(file.suffix.lower()) for file in files}
    if not files or None in formats:
        raise ValueError(f"{text!r} holds no offline dataset: expected generated shards (shard-*), a save_to_disk "
                         f"folder, or {'/'.join(LOCAL_FORMATS)} files")
    if len(formats) > 1:
        raise ValueError(f"{text!r} mixes data file formats {sorted(formats)}: keep one format per folder")
    if formats != {"csv"}:
        return load_source({"train": [str(file) for file in files]}, "train")
    # text stays text (a completion "3" is not the number 3); an empty completion (EOS at once) is ""
    dataset = load_dataset("csv", data_files=[str(file) for file in files], split="train",
                           converters={"prompt": str, "completion": str})
    if "completion" in dataset.column_names:
        dataset = dataset.map(lambda row: {"completion": row["completion"] or ""}, desc="reading completions")
    for column in _LIST_COLUMNS:
        if column in dataset.column_names and dataset.features[column].dtype in ("string", "large_string"):
            dataset = dataset.map(lambda row, c=column: {c: json.loads(row[c])}, desc=f"parsing {column}")
    return dataset


def stored_reward(completions, reward, **kwargs) -> list[float]:
    """A reward function that returns the dataset's `reward` column: train on the rewards computed at
    generation time instead of scoring again."""
    return [None if value is None or (isinstance(value, float) and math.isnan(value)) else value for value in reward]


# ---------------------------------------------------------------------------------------------- composition
def proportion_of_positives(dataset: Dataset, threshold: float = 0.0) -> float:
    """p: the share of rows whose reward is above `threshold`."""
    rewards = [r for r in dataset["reward"] if r is not None and not math.isnan(r)]
    return sum(r > threshold for r in rewards) / max(len(rewards), 1)


def compose(dataset: Dataset, strategy: str = "uniform", *, target_proportion: float | None = None,
            seed: int = 0, threshold: float = 0.0) -> tuple[Dataset, float]:
    """Select the rows an iteration trains on; returns the subset and its proportion of positives p.

    - "uniform": every row.
    - "positives_only": rows with reward > `threshold` (rejection sampling / SFT data).
    - "anna_karenina": per prompt, the first correct completion (by `sample_index`) and every incorrect one
      (the paper's curation: one way to be right, many ways to be wrong).
    - "target_proportion": subsample negatives or positives (uniformly at random) so that p equals
      `target_proportion` as closely as whole rows allow, keeping as many rows as possible.
    """
    rewards = dataset["reward"]
    positive = [r is not None and not math.isnan(r) and r > threshold for r in rewards]
    indices = list(range(len(dataset)))
    if strategy == "uniform":
        chosen = indices
    elif strategy == "positives_only":
        chosen = [i for i in indices if positive[i]]
    elif strategy == "anna_karenina":
        first_correct: dict[int, int] = {}
        for i in sorted(indices, key=lambda i: (dataset[i]["prompt_index"], dataset[i]["sample_index"])):
            if positive[i]:
                first_correct.setdefault(dataset[i]["prompt_index"], i)
        keep = set(first_correct.values())
        chosen = [i for i in indices if not positive[i] or i in keep]
    elif strategy == "target_proportion":
        if target_proportion is None or not 0 < target_proportion < 1:
            raise ValueError("strategy 'target_proportion' needs 0 < target_proportion < 1")
        positives = [i for i in indices if positive[i]]
        negatives = [i for i in indices if not positive[i]]
        if not positives or not negatives:
            raise ValueError("strategy 'target_proportion' needs both positive and negative rows")
        rng = random.Random(seed)
        # keep all of the scarcer side (relative to the target) and subsample the other
        if len(positives) / len(indices) > target_proportion:
            count = round(len(negatives) * target_proportion / (1 - target_proportion))
            positives = sorted(rng.sample(positives, max(count, 1)))
        else:
            count = round(len(positives) * (1 - target_proportion) / target_proportion)
            negatives = sorted(rng.sample(negatives, max(count, 1)))
        chosen = sorted(positives + negatives)
    else:
        raise ValueError(f"Unknown composition strategy {strategy!r}; expected one of {list(COMPOSITIONS)}")
    subset = dataset.select(chosen)
    return subset, (sum(positive[i] for i in chosen) / len(chosen) if chosen else float("nan"))


# ---------------------------------------------------------------------------------------------- training
class GroupShuffleSampler(Sampler):
    """Yields the rows of an offline dataset with whole prompt groups shuffled together, in generation batches
    of `batch_rows` rows, each batch repeated `repeat_count` times (GRPO reuses a generation batch for
    `num_iterations * steps_per_generation` steps). Rows of one group stay contiguous, so GRPO's group
    statistics (`view(-1, num_generations)`) see whole groups when every group has `num_generations` rows."""

    def __init__(self, group_ids: Sequence[int], batch_rows: int, repeat_count: int = 1, shuffle: bool = True,
                 seed: int = 0):
        self.groups: dict[int, list[int]] = {}
        for row, group in enumerate(group_ids):
            self.groups.setdefault(group, []).append(row)
        self.batch_rows, self.repeat_count, self.shuffle, self.seed = batch_rows, repeat_count, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _ordered_rows(self) -> list[int]:
        order = list(self.groups)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return [row for group in order for row in self.groups[group]]

    def __iter__(self):
        rows = self._ordered_rows()
        for start in range(0, len(rows) - self.batch_rows + 1, self.batch_rows):
            for _ in range(self.repeat_count):
                yield from rows[start : start + self.batch_rows]

    def __len__(self) -> int:
        total = sum(len(rows) for rows in self.groups.values())
        return (total // self.batch_rows) * self.batch_rows * self.repeat_count


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
            raise ValueError(f"{role} has stored rewards {stored_rewards} but no completions they score (neither "
                             f"`completion_ids` nor `completion`): {_HOW_TO_MAKE}.")
        if uses_stored_reward:
            raise ValueError(f"{role} has no `reward` column for topr_trl.offline.stored_reward (and no stored "
                             f"completions): either give a dataset with completions and a `reward` column "
                             f"({_HOW_TO_MAKE}), or real reward functions that score generated completions.")
        return
    if "prompt" not in columns:
        raise ValueError(f"offline {role} has no `prompt` column: each row needs the prompt its completion answers "
                         "(README.md, Offline dataset schema).")
    if uses_stored_reward and "reward" not in columns:
        raise ValueError(f"offline {role} has no `reward` column, which topr_trl.offline.stored_reward returns: either "
                         "add the stored rewards as a `reward` column, or pass real reward functions that score the "
                         "completions.")
    if "behaviour_logps" not in columns and not has_behaviour_model:
        hint = ("" if "completion_ids" in columns else " If `completion` holds reference answers rather than sampled "
                "completions, rename that column to train online.")
        raise ValueError(f"offline {role} has no `behaviour_logps` column: the log-probs of mu are needed for pi/mu. "
                         "Generate the dataset with topr_trl.offline.generate_offline_dataset, which stores them, or "
                         f"set topr_behaviour_model to the model that generated it.{hint}")


def with_prompt_index(dataset: Dataset) -> Dataset:
    """`dataset` with its `prompt_index` (the prompt group of each row): kept when present, else derived from
    identical prompts, numbered in order of first appearance."""
    if "prompt_index" in dataset.column_names:
        return dataset
    groups: dict[str, int] = {}
    index = [groups.setdefault(json.dumps(prompt, sort_keys=True, default=str), len(groups))
             for prompt in dataset["prompt"]]
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
            raise ValueError(f"`completion` must be text or one assistant message, got {completion!r:.80}; store "
                             "token ids as `completion_ids` instead")
        texts.append(completion)
    eos = tokenizer.eos_token_id
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    stopped = [not (truncated is not None and truncated[i]) for i in range(len(texts))]
    return [list(ids) + ([eos] if ended and (not ids or ids[-1] != eos) else [])
            for ids, ended in zip(encoded, stopped, strict=True)]


def _prompt_ids_batch(batch: dict, tokenizer, chat_template_kwargs, tools, chat_template) -> dict:
    return {"prompt_ids": tokenize_prompts(tokenizer, batch["prompt"], chat_template_kwargs, tools, chat_template)}


def _completion_ids_batch(batch: dict, tokenizer) -> dict:
    return {"completion_ids": completion_token_ids(tokenizer, batch["completion"], batch.get("truncated"))}


def tokenize_offline_dataset(
    dataset: Dataset, tokenizer, chat_template_kwargs: dict | None = None, tools: Sequence[Callable] | None = None,
    chat_template: str | None = None, role: str = "train_dataset",
) -> Dataset:
    """`dataset` with `prompt_ids` and `completion_ids` for replay, each tokenized once when not stored: prompts
    exactly as GRPOTrainer tokenizes them (`topr_trl.rollout.tokenize_prompts` with the trainer's
    `chat_template_kwargs`, `tools` and `chat_template`), completion text by `completion_token_ids`. Checks that
    `behaviour_logps`, when stored, has one value per completion token."""
    if "prompt_ids" not in dataset.column_names:
        dataset = dataset.map(_prompt_ids_batch, batched=True, desc=f"tokenizing the prompts of {role}",
                              fn_kwargs=dict(tokenizer=tokenizer, chat_template_kwargs=chat_template_kwargs,
                                             tools=tools, chat_template=chat_template))
    if "completion_ids" not in dataset.column_names:
        dataset = dataset.map(_completion_ids_batch, batched=True, desc=f"tokenizing the completions of {role}",
                              fn_kwargs=dict(tokenizer=tokenizer))
    if "behaviour_logps" in dataset.column_names:
        import pyarrow.compute as pc

        table = dataset.with_format("arrow")
        tokens = pc.list_value_length(table["completion_ids"]).to_pylist()
        logps = pc.list_value_length(table["behaviour_logps"]).to_pylist()
        for row, (n_tokens, n_logps) in enumerate(zip(tokens, logps, strict=True)):
            if n_tokens != n_logps:
                raise ValueError(f"offline {role} row {row} has {n_logps} behaviour_logps for {n_tokens} completion "
                                 "tokens: mu's log-probs must be those of the stored (or tokenized) completion, one "
                                 "per token, EOS included")
    return dataset


def validate_offline_dataset(
    dataset: Dataset, num_generations: int, needs_whole_groups: bool, batch_rows: int | None = None,
    role: str = "train_dataset", group_size_name: str = "num_generations",
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
