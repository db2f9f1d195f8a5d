"""Offline TOPR (the paper's Algorithm 1), step one: sample n completions per prompt from mu once, label them, and
store them in the schema of README.md's "Offline dataset schema" table.

`generate_offline_dataset` writes every column of that table, in shards under a directory, and resumes an
interrupted run without losing or duplicating rows; `load_offline_dataset` reads the shards back and
`load_offline_source` loads an offline dataset from anywhere (shards, a `save_to_disk` folder, json/jsonl/csv/parquet
files, a Hub id).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from datasets import Dataset, concatenate_datasets, load_from_disk

from ..sampling import BACKENDS, free_vllm_memory, make_vllm_engine, vllm_available
from ..sources import load_data_source, looks_like_local_data
from .rollout import sample_with_logps, sample_with_logps_vllm
from .schema import check_reward_values

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
    chat_template_kwargs: dict | None = None,
    tools: Sequence[Callable] | None = None,
) -> Dataset:
    """Sample `num_completions` completions per prompt from `model` (mu), score them, save them in shards.

    `backend`: "transformers" (`model` a loaded causal LM), "vllm" (`model` a model path or Hub id, a loaded model
    whose `name_or_path` is used, or a vLLM engine from `topr_trl.sampling.make_vllm_engine`), or "auto": vLLM when
    it is installed and a GPU is present, transformers otherwise. Both write the same schema; `seed` seeds the vLLM
    engine (seed transformers sampling with `torch.manual_seed`). An engine built here is released before returning,
    as is a model loaded here from a path, so that training can use their GPU memory.

    Prompts are tokenized exactly as GRPOTrainer tokenizes them (`topr_trl.offline.rollout.tokenize_prompts`: the
    tokenizer's special tokens for plain text, the chat template for conversations); pass the training config's
    `chat_template_kwargs` (and `tools`) so that mu is conditioned as pi will be. The ids are stored as
    `prompt_ids`, and TOPRTrainer trains on them as stored.

    Defaults follow the paper (temperature 1; it uses top_k=500 and 512 new tokens). A shard is written
    atomically once all its prompts are done, so an interrupted run restarted with the same arguments
    resumes after the last complete shard: no row is lost or duplicated. Returns the whole dataset, which is
    also pushed to the Hub repository `push_to_hub` when given (credentials from `huggingface-cli login` or
    HF_TOKEN; never printed).
    """
    from ..config import check_choice

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

        from ..distributed import outside_zero3_construction

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



def load_offline_source(source: str | Path, split: str = "train") -> Dataset:
    """The `split` of an offline dataset from `source`: the shard folder `generate_offline_dataset` writes (one
    split, `train`), or whatever `topr_trl.sources.load_data_source` loads: a `save_to_disk` folder (a DatasetDict
    gives `split`, or its only one), a `.json`/`.jsonl`/`.csv`/`.parquet` file (one split, `train`) or a folder of
    such files (one format; files named after their split, `train.jsonl` and `test.jsonl`, are the splits, as
    `datasets` reads a folder; a folder with no file named after a split is one split, `train`), or a Hub dataset
    id. Raises FileNotFoundError for a path that does not exist and ValueError for one that holds nothing loadable
    or not `split`.

    CSV cannot hold lists: a CSV offline dataset normally carries `completion` text (tokenized by TOPRTrainer); list
    columns written as JSON text (`[1, 2, 3]`) are parsed back."""
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir() and any(path.glob("shard-*")):
        if split != "train":
            raise ValueError(f"offline dataset {text!r} is a generated shard folder, which holds one split, 'train': "
                             f"it has no {split!r} split")
        return load_offline_dataset(path)
    if not path.exists() and (looks_like_local_data(text) or "/" not in text):  # on the Hub it is `owner/name`
        raise FileNotFoundError(f"offline dataset {text!r} not found: give the folder `topr-trl generate` wrote, a "
                                "save_to_disk folder, a .json/.jsonl/.csv/.parquet file or folder, or a Hub id")
    dataset = load_data_source(text, split, what="offline dataset", one_split="train")
    for column in _LIST_COLUMNS:  # written as JSON text where the format holds no lists (CSV)
        if column in dataset.column_names and getattr(dataset.features[column], "dtype", None) in ("string",
                                                                                                  "large_string"):
            dataset = dataset.map(lambda row, c=column: {c: json.loads(row[c])}, desc=f"parsing {column}")
    return dataset
