"""Offline TOPR (the paper's Algorithm 1): sample n completions per prompt from mu once, label them, train.

Dataset schema (one row per completion; rows of a prompt are contiguous and share `prompt_index`):

| column | type | meaning |
|---|---|---|
| every column of the prompt dataset | | e.g. `prompt`, `answer`; passed to reward functions as in GRPO |
| `prompt_index` | int | index of the prompt in the prompt dataset (the group) |
| `sample_index` | int | 0..n-1 within the group |
| `completion` | str | decoded completion (special tokens removed) |
| `completion_ids` | list[int] | the sampled tokens; ends with EOS when the completion stopped (EOS is kept: it is what teaches the model to stop) |
| `behaviour_logps` | list[float] | log mu(y_t) of every completion token under the *sampling* distribution: logits / temperature, then top-k and top-p truncation, renormalised. This is what vLLM reports as processed log-probs, and the mu of pi/mu |
| `truncated` | bool | True when the completion hit `max_new_tokens` without EOS |
| `reward` | float | the weighted sum of the reward functions (NaN when none could score it) |
| `rewards/<name>` | float | each reward function's value |

`generate_offline_dataset` writes the dataset in shards under a directory and resumes an interrupted run
without losing or duplicating rows; `load_offline_dataset` reads it back. TOPRTrainer trains from such a
dataset (no generation) when its `train_dataset` has a `completion_ids` column.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from datasets import Dataset, concatenate_datasets, load_from_disk
from torch.utils.data import Sampler

from .rollout import free_vllm_memory, make_vllm_engine, sample_with_logps, sample_with_logps_vllm, vllm_available

BACKENDS = ("auto", "transformers", "vllm")
COMPOSITIONS = ("uniform", "positives_only", "anna_karenina", "target_proportion")
OFFLINE_COLUMNS = ("prompt_index", "sample_index", "completion", "completion_ids", "behaviour_logps", "truncated",
                   "reward")
_MANIFEST = "manifest.json"


def _reward_name(function) -> str:
    return getattr(function, "__name__", type(function).__name__)


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
) -> Dataset:
    """Sample `num_completions` completions per prompt from `model` (mu), score them, save them in shards.

    `backend`: "transformers" (`model` a loaded causal LM), "vllm" (`model` a model path or Hub id, a loaded model
    whose `name_or_path` is used, or a vLLM engine from `topr_trl.rollout.make_vllm_engine`), or "auto": vLLM when
    it is installed and a GPU is present, transformers otherwise. Both write the same schema; `seed` seeds the vLLM
    engine (seed transformers sampling with `torch.manual_seed`). An engine built here is released before returning,
    as is a model loaded here from a path, so that training can use their GPU memory.

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
                             max_new_tokens)
            for offset, example in enumerate(batch):
                for sample_index in range(num_completions):
                    sample = dict(samples[offset * num_completions + sample_index])
                    del sample["prompt_ids"]  # the trainer tokenizes prompts itself, with its own template
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
    return concatenate_datasets([load_from_disk(str(shard)) for shard in shards])


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


def validate_offline_dataset(
    dataset: Dataset, num_generations: int, needs_whole_groups: bool, has_behaviour_model: bool = False,
    batch_rows: int | None = None,
) -> None:
    """Fail early, naming the problem, on a dataset TOPRTrainer cannot train from offline (`batch_rows`: the rows
    of one generation batch, GRPOConfig's `generation_batch_size`)."""
    missing = [column for column in ("prompt", "completion_ids", "prompt_index") if column not in dataset.column_names]
    if missing:
        raise ValueError(f"offline train_dataset lacks columns {missing}; generate it with "
                         "topr_trl.offline.generate_offline_dataset (schema in its module docstring)")
    if "behaviour_logps" not in dataset.column_names and not has_behaviour_model:
        raise ValueError("offline train_dataset has no `behaviour_logps` column: the log-probs of mu are needed for "
                         "pi/mu. Generate the dataset with topr_trl.offline.generate_offline_dataset, which stores "
                         "them, or set topr_behaviour_model to the model that generated it.")
    if batch_rows is not None and len(dataset) < batch_rows:
        raise ValueError(
            f"offline train_dataset has {len(dataset)} rows, fewer than one batch of {batch_rows} "
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
                f"{len(uneven)} prompt group(s) do not have num_generations={num_generations} rows (e.g. prompt "
                f"{example[0]} has {example[1]}). The group advantage and group_mean baseline need whole groups: "
                "set num_generations to the dataset's completions per prompt, or train with topr_signal='reward' "
                "and a numeric topr_baseline (e.g. after Anna Karenina or target-proportion composition)."
            )
