"""Offline TOPR (the paper's Algorithm 1), step one: sample n completions per prompt from mu once, label them, and
store them in the schema of docs/offline.md's "Offline dataset schema" table.

`generate_offline_dataset` writes every column of that table, in shards under a directory, and resumes an
interrupted run without losing or duplicating rows; `load_offline_dataset` reads the shards back and
`load_offline_source` loads an offline dataset from anywhere (shards, a `save_to_disk` folder, json/jsonl/csv/parquet
files, a Hub id).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import huggingface_hub
import torch
from datasets import Dataset, concatenate_datasets, load_from_disk
from transformers import AutoModelForCausalLM

from ..generation.completions import BACKENDS, free_vllm_memory, make_vllm_engine, vllm_available
from ..inputs.sources import load_data_source, looks_like_local_data
from ..runtime.distributed import outside_zero3_construction
from ..runtime.noise import progress_bar_class
from ..validation import check_choice
from .rollout import sample_with_logps, sample_with_logps_vllm
from .schema import check_reward_values


tqdm = progress_bar_class()


_MANIFEST = "manifest.json"
# 2: the manifest records the model (path or Hub id, revision, weights digest), the prompts (name, count, digest of
# the rows), the reward functions and every sampling setting. Version 1 (no "format" key) recorded only some
# sampling settings, so a folder it wrote cannot be checked against a run.
_MANIFEST_FORMAT = 2
_DIGEST_CHUNK = 8 << 20
# The files that define a model folder: weights, configs, tokenizer and chat template. Left out: a checkpoint's
# optimizer and scheduler states (.pt/.pth, as large as the model and irrelevant to sampling), training_args.bin
# and READMEs.
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".json", ".jinja", ".model", ".txt", ".tiktoken")
_NOT_MODEL_FILES = ("training_args.bin",)

# How each recorded setting is named in a refusal: as `generate_offline_dataset`'s arguments, or as `topr-trl
# generate`'s flags (`iterate` uses the same ones), so that it names what the user typed. A key missing is named as
# recorded.
_PYTHON_NAMES = {
    "model.name_or_path": "model",
    "dataset.name": "dataset_name",
    "dataset.num_prompts": "the number of prompts",
}
_FLAGS = {
    "model.name_or_path": "--model_name_or_path",
    "dataset.name": "--dataset_name",
    "dataset.num_prompts": "the number of prompts (--max_prompts)",
    "reward_funcs": "--reward_funcs",
    "num_completions": "--num_generations",
    "temperature": "--temperature",
    "top_p": "--top_p",
    "top_k": "--top_k",
    "max_new_tokens": "--max_completion_length",
    "backend": "--backend",
    "seed": "--seed",
    "chat_template_kwargs": "--chat_template_kwargs",
    "prompts_per_shard": "--prompts_per_shard",
}


class GeneratedWithOtherSettings(ValueError):
    """`output_dir` holds a generation that a run with these settings must not resume: made with other settings
    (`changes`, the `SettingChange`s of `setting_changes`), or one whose manifest is missing or was written by an
    older version and cannot be checked (`changes` empty). The message names each change as Python arguments, or
    as the command line's flags with `command_line`, and ends with `ways_out`. A ValueError, so that the command
    line reports it in one line."""

    def __init__(self, output_dir, changes: list, ways_out: str | None = None, command_line: bool = False):
        self.output_dir, self.changes = Path(output_dir), list(changes)
        ways_out = ways_out or "use another output_dir, or overwrite=True to delete it and generate again"
        if self.changes:
            described = "; ".join(describe_changes(self.changes, _FLAGS if command_line else _PYTHON_NAMES))
            what = (
                f"{output_dir} holds a generation made with other settings ({described}), so its rows are not "
                "samples of this run's model and prompts"
            )
        else:
            what = (
                f"{output_dir} holds a generation whose manifest ({_MANIFEST}) is missing or was written by an "
                "older topr-trl: it does not record the model, prompts and sampling settings that made it, so it "
                "cannot be checked against this run"
            )
        super().__init__(f"{what}: {ways_out}")


def _reward_name(function) -> str:
    return getattr(function, "__name__", type(function).__name__)


def _shown_source(name: str) -> str:
    """A model or dataset as recorded: a local path made absolute (the same folder named from another working
    directory is the same source), a Hub id as it is."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def _file_sha256(path: Path, known: dict) -> str:
    """The sha256 of `path`'s bytes, taken from `known` (a previous manifest's {path: [size, mtime_ns, sha256]})
    when the file's size and modification time are unchanged."""
    stat = path.stat()
    recorded = known.get(str(path))
    if recorded and recorded[:2] == [stat.st_size, stat.st_mtime_ns]:
        return recorded[2]
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_DIGEST_CHUNK):
            digest.update(chunk)
    known[str(path)] = [stat.st_size, stat.st_mtime_ns, digest.hexdigest()]
    return digest.hexdigest()


def _folder_digest(folder: Path, known: dict) -> str:
    """sha256 over the name and full sha256 of each file that defines the model folder (`_MODEL_FILE_SUFFIXES`).

    Every byte is read, not a sample: a sampled digest (names, sizes, first and last MB) misses a change confined to
    the middle of a shard, as merging an adapter into some layers makes. It costs one read of the model (seconds per
    GB) on the first generation only: `known` memoizes each file's digest by size and modification time, so a
    resume reads no weights."""
    files = sorted(
        path
        for path in folder.iterdir()
        if path.is_file() and path.suffix in _MODEL_FILE_SUFFIXES and path.name not in _NOT_MODEL_FILES
    )
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{_file_sha256(path.resolve(), known)}\n".encode())
    return digest.hexdigest()


def _parameters_digest(model) -> str:
    """sha256 over a loaded model's state (names, dtypes, shapes, bytes): what it samples with, also when it was
    changed in memory after loading (its files would not tell). One tensor at a time goes to the CPU: seconds per
    GB, as for files."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _hub_commit(repo_id: str) -> str:
    """The commit a Hub model id resolves to now (from the local cache when offline): it fixes every file. Read from
    where its config (a model's, or an adapter's) is cached: .../snapshots/<commit>/config.json."""
    for config in ("config.json", "adapter_config.json"):
        try:
            return Path(huggingface_hub.hf_hub_download(repo_id, config)).parent.name
        except Exception as error:  # not cached offline, unreachable, or no such file: nor can generation load it
            failure = error
    reason = (str(failure).splitlines() or [""])[0][:200]
    raise ValueError(
        f"cannot tell which revision of the model {repo_id!r} this is, to record it with the generated "
        f"data ({type(failure).__name__}: {reason})"
    ) from failure


def model_identity(model, known: dict) -> dict:
    """What identifies the model samples come from: `name_or_path` (a local folder made absolute, or a Hub id),
    `revision` (the Hub commit; None for a local folder) and `weights` (a digest: of the folder's files, of a loaded
    model's parameters, or None for a Hub id, whose commit fixes them). `model` as `generate_offline_dataset` takes
    it: a path or Hub id, a loaded model, or a vLLM engine. `known` memoizes file digests (see `_file_sha256`)."""
    if isinstance(model, torch.nn.Module):
        return {
            "name_or_path": _shown_source(str(getattr(model, "name_or_path", "") or type(model).__name__)),
            "revision": None,
            "weights": f"parameters sha256:{_parameters_digest(model)}",
        }
    engine_config = getattr(getattr(model, "llm_engine", None), "model_config", None)  # a vLLM engine
    name = str(model) if isinstance(model, (str, Path)) else getattr(engine_config, "model", None)
    if name is None:  # an engine that does not say what it serves: recorded by its type only
        return {"name_or_path": type(model).__name__, "revision": None, "weights": None}
    path = Path(name).expanduser()
    if path.is_dir():
        return {
            "name_or_path": str(path.resolve()),
            "revision": None,
            "weights": f"files sha256:{_folder_digest(path, known)}",
        }
    if path.is_file():
        return {
            "name_or_path": str(path.resolve()),
            "revision": None,
            "weights": f"file sha256:{_file_sha256(path.resolve(), known)}",
        }
    return {"name_or_path": name, "revision": _hub_commit(name), "weights": None}


def prompts_digest(prompts: Dataset) -> str:
    """sha256 over the prompt rows in order, every column (the reward functions read them, and the generated rows
    carry them): it changes with the prompts, their order and their number (--max_prompts). Read as Arrow, so that
    nothing is decoded (an image's digest is that of its bytes)."""
    digest = hashlib.sha256()
    for batch in prompts.with_format("arrow").iter(batch_size=1024):
        digest.update(json.dumps(batch.to_pylist(), sort_keys=True, default=repr).encode())
    return digest.hexdigest()


def _flattened(settings: dict) -> dict:
    """`settings` with the model and dataset records spread into `model.<key>` and `dataset.<key>`."""
    flat = {}
    for key, value in settings.items():
        if key in ("model", "dataset") and isinstance(value, dict):
            flat.update({f"{key}.{inner}": item for inner, item in value.items()})
        else:
            flat[key] = value
    return flat


def _shown_value(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class SettingChange(NamedTuple):
    """A recorded generation setting that differs: `setting` (`model.<key>` and `dataset.<key>` for the fields of
    the model and dataset records), its recorded value, this run's, and for a model or dataset field the name of
    this run's model or dataset."""

    setting: str
    old: object
    new: object
    source: str | None = None


def setting_changes(old: dict, new: dict) -> list[SettingChange]:
    """What differs between two recorded generation settings. What follows from another change is not listed again:
    a digest whose source was renamed or recounted, the weights of other reward functions."""
    old_flat, new_flat = _flattened(old), _flattened(new)
    changed = [key for key in dict.fromkeys([*old_flat, *new_flat]) if old_flat.get(key) != new_flat.get(key)]
    # The same weights (prompt rows) under another path or name make the same data: a moved or copied model folder
    # (data file) resumes. A Hub id has no weights digest; its name and commit are what identify it.
    for name, digest in (("model.name_or_path", "model.weights"), ("dataset.name", "dataset.rows_sha256")):
        if name in changed and digest not in changed and old_flat.get(digest) is not None:
            changed.remove(name)
    if "model.name_or_path" in changed:
        changed = [key for key in changed if key not in ("model.revision", "model.weights")]
    if "dataset.name" in changed or "dataset.num_prompts" in changed:
        changed = [key for key in changed if key != "dataset.rows_sha256"]
    if "reward_funcs" in changed:  # one weight per function: other functions have other weights
        changed = [key for key in changed if key != "reward_weights"]
    sources = {"model": new_flat.get("model.name_or_path"), "dataset": new_flat.get("dataset.name")}
    return [
        SettingChange(key, old_flat.get(key), new_flat.get(key), sources.get(key.partition(".")[0])) for key in changed
    ]


def describe_changes(changes: list[SettingChange], names: dict) -> list[str]:
    """Each change as "name old -> new", the setting named by `names` (`_FLAGS` or `_PYTHON_NAMES`); a digest as
    what it digests, shortened."""
    texts = []
    for key, before, after, source in changes:
        owner = names["dataset.name" if key.startswith("dataset.") else "model.name_or_path"]
        if key == "model.weights":
            texts.append(f"{owner} {source}: its weights changed ({str(before)[:24]}... -> {str(after)[:24]}...)")
        elif key == "model.revision":
            texts.append(f"{owner} {source}: revision {before} -> {after}")
        elif key == "dataset.rows_sha256":
            texts.append(
                f"{owner} {source}: its prompt rows changed (sha256 {str(before)[:12]}... -> {str(after)[:12]}...)"
            )
        else:
            texts.append(f"{names.get(key, key)} {_shown_value(before)} -> {_shown_value(after)}")
    return texts


def _checked_manifest(output_dir: Path, settings: dict, known: dict, overwrite: bool) -> None:
    """Make `output_dir` hold the manifest of `settings`: written when new (or `overwrite`, after deleting the
    earlier generation), kept when it records the same settings (the generation resumes), else refused with
    `GeneratedWithOtherSettings`."""
    manifest_file = output_dir / _MANIFEST
    foreign = (
        sorted(
            entry.name
            for entry in output_dir.iterdir()
            if not entry.name.startswith((".", "shard-")) and entry.name != _MANIFEST
        )
        if output_dir.is_dir()
        else []
    )
    if foreign:  # a trained model's folder, say: shards beside it would mix the two, and nothing here deletes it
        raise ValueError(
            f"{output_dir} holds other files ({', '.join(foreign[:3])}"
            f"{f' and {len(foreign) - 3} more' if len(foreign) > 3 else ''}) and no generation: "
            "generate into a new or empty folder"
        )
    earlier = [*output_dir.glob("shard-*"), *output_dir.glob(".shard-*.tmp")]
    if overwrite:
        for shard in earlier:
            shutil.rmtree(shard)
        manifest_file.unlink(missing_ok=True)
    elif manifest_file.exists():
        try:
            previous = json.loads(manifest_file.read_text())
        except json.JSONDecodeError:  # cut short or edited by hand: it says nothing that can be checked
            previous = {}
        if not isinstance(previous, dict) or previous.get("format") != _MANIFEST_FORMAT:
            raise GeneratedWithOtherSettings(output_dir, [])
        changes = setting_changes(previous["settings"], settings)
        if changes:
            raise GeneratedWithOtherSettings(output_dir, changes)
        return
    elif any(output_dir.glob("shard-*")):  # shards nothing describes: whatever made them is unknown
        raise GeneratedWithOtherSettings(output_dir, [])
    manifest = {"format": _MANIFEST_FORMAT, "settings": settings, "file_digests": known}
    temporary = output_dir / f".{_MANIFEST}.tmp"
    temporary.write_text(json.dumps(manifest, indent=2))
    temporary.replace(manifest_file)  # atomic: another process reads the whole manifest or none


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
    dataset_name: str | None = None,
    overwrite: bool = False,
) -> Dataset:
    """Sample `num_completions` completions per prompt from `model` (mu), score them, save them in shards.

    `backend`: "transformers" (`model` a loaded causal LM), "vllm" (`model` a model path or Hub id, a loaded model
    whose `name_or_path` is used, or a vLLM engine from `topr_trl.generation.completions.make_vllm_engine`), or "auto":
    vLLM when it is installed and a GPU is present, transformers otherwise. Both write the same schema; `seed` seeds the
    vLLM engine (seed transformers sampling with `torch.manual_seed`). An engine built here is released before
    returning, as is a model loaded here from a path, so that training can use their GPU memory.

    Prompts are tokenized exactly as GRPOTrainer tokenizes them (`topr_trl.offline.rollout.tokenize_prompts`: the
    tokenizer's special tokens for plain text, the chat template for conversations); pass the training config's
    `chat_template_kwargs` (and `tools`) so that mu is conditioned as pi will be. The ids are stored as
    `prompt_ids`, and TOPRTrainer trains on them as stored.

    Defaults follow the paper (temperature 1; it uses top_k=500 and 512 new tokens). A shard is written atomically
    once all its prompts are done, so an interrupted run restarted with the same arguments resumes after the last
    complete shard: no row is lost or duplicated. Returns the whole dataset, also pushed to the Hub repository
    `push_to_hub` when given (credentials from `huggingface-cli login` or HF_TOKEN; never printed).

    `output_dir/manifest.json` records what defines the data: the model (`model_identity`: path or Hub id, Hub
    commit, digest of its weights), the prompts (`dataset_name`, their number and `prompts_digest`), the reward
    functions and weights, and every sampling setting. A run into a folder whose manifest records anything else, or
    that an older version wrote without these, is refused with `GeneratedWithOtherSettings` (a ValueError naming
    each change) rather than resumed on another model's rows; `overwrite=True` deletes the earlier generation and
    generates again.
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "auto":
        backend = "vllm" if vllm_available() else "transformers"
    if backend == "vllm":
        prompts_per_batch = prompts_per_shard  # vLLM schedules a whole shard at once
    reward_funcs, weights = _weighted_rewards(reward_funcs, reward_weights)
    output_dir = Path(output_dir)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens)
    defining = dict(num_completions=num_completions, **sampling, backend=backend, seed=seed)  # the manifest's order
    defining.update(chat_template_kwargs=chat_template_kwargs, prompts_per_shard=prompts_per_shard)
    _claim_folder(output_dir, overwrite, model, dataset_name, prompts, reward_funcs, weights, tools, **defining)
    shards = ShardPlan(output_dir, prompts_per_shard, prompts_per_batch, num_completions, show_progress)
    loaded_here = _write_shards(
        shards, model, backend, seed, tokenizer, prompts, reward_funcs, weights, sampling, chat_template_kwargs, tools
    )
    if loaded_here and backend == "vllm":  # an engine built here is released here; one passed in stays the caller's
        free_vllm_memory()
    dataset = load_offline_dataset(output_dir)
    if push_to_hub:
        dataset.push_to_hub(push_to_hub, private=private)
    return dataset


def _claim_folder(
    output_dir: Path, overwrite: bool, model, dataset_name, prompts, reward_funcs, weights, tools, **fields
):
    """Create `output_dir` and check (or write) its manifest: what defines the data (`generation_settings`) must be
    what the folder recorded, else `GeneratedWithOtherSettings` (or, with `overwrite`, the earlier data deleted)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    known_digests = _recorded_file_digests(output_dir)
    settings = generation_settings(
        model_identity(model, known_digests), dataset_name, prompts, reward_funcs, weights, tools, **fields
    )
    _checked_manifest(output_dir, settings, known_digests, overwrite)


def _weighted_rewards(reward_funcs, reward_weights) -> tuple[list[Callable], list[float]]:
    """The reward functions as a list, and one weight each (1 where none are given)."""
    reward_funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
    weights = list(reward_weights) if reward_weights is not None else [1.0] * len(reward_funcs)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"{len(weights)} reward_weights for {len(reward_funcs)} reward functions")
    return reward_funcs, weights


@dataclass(frozen=True)
class ShardPlan:
    """Where and how `generate_offline_dataset` writes its shards: `prompts_per_shard` prompts each, sampled
    `prompts_per_batch` at a time with `num_completions` completions per prompt."""

    output_dir: Path
    prompts_per_shard: int
    prompts_per_batch: int
    num_completions: int
    show_progress: bool


def _write_shards(
    plan: ShardPlan,
    model,
    backend,
    seed,
    tokenizer,
    prompts,
    reward_funcs,
    weights,
    sampling,
    chat_template_kwargs,
    tools,
) -> bool:
    """Sample, score and write every shard not yet on disk, each atomically (a shard directory is either complete or
    absent); mu is loaded only when a shard needs it (a resumed or finished generation loads no model). Returns
    whether a model or engine was loaded here (and so is the caller's to release)."""
    sampler, loaded = None, model
    num_shards = math.ceil(len(prompts) / plan.prompts_per_shard)
    progress = tqdm(total=len(prompts), desc="generating", unit="prompt", disable=not plan.show_progress)
    for shard in range(num_shards):
        start, stop = shard * plan.prompts_per_shard, min((shard + 1) * plan.prompts_per_shard, len(prompts))
        shard_dir = plan.output_dir / f"shard-{shard:05d}"
        if shard_dir.exists():
            progress.update(stop - start)
            continue
        if sampler is None:
            loaded, sampler = _load_sampler(model, backend, seed)
        rows = sample_rows(
            sampler,
            loaded,
            tokenizer,
            prompts.select(range(start, stop)),
            plan.num_completions,
            plan.prompts_per_batch,
            first_index=start,
            progress=progress,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
            **sampling,
        )
        score_rows(rows, reward_funcs, weights)
        temporary = plan.output_dir / f".shard-{shard:05d}.tmp"
        shutil.rmtree(temporary, ignore_errors=True)
        Dataset.from_list(rows).save_to_disk(str(temporary))
        temporary.rename(shard_dir)
    progress.close()
    return loaded is not model


def generation_settings(
    model: dict,
    dataset_name: str | None,
    prompts: Dataset,
    reward_funcs: Sequence[Callable],
    reward_weights: Sequence[float],
    tools: Sequence[Callable] | None,
    **sampling,
) -> dict:
    """Everything that defines a generation's rows, as its manifest records them (JSON values, so that a record
    read back compares equal): the model (`model_identity`), the prompts, the reward functions and their weights,
    the tools and the `sampling` settings (backend resolved)."""
    settings = {
        "model": model,
        "dataset": {
            "name": _shown_source(dataset_name) if dataset_name else None,
            "num_prompts": len(prompts),
            "rows_sha256": prompts_digest(prompts),
        },
        "reward_funcs": [_reward_name(function) for function in reward_funcs],
        "reward_weights": [float(weight) for weight in reward_weights],
        "tools": [getattr(tool, "__name__", repr(tool)) for tool in tools or []],
        **sampling,
        "chat_template_kwargs": dict(sampling.get("chat_template_kwargs") or {}),
    }
    return json.loads(json.dumps(settings))


def recorded_model(source) -> str | None:
    """The model (path or Hub id) the manifest of a generated folder `source` records as mu; None for data without
    such a manifest (a data file, a Hub dataset, a folder written otherwise)."""
    try:
        manifest = json.loads((Path(str(source)).expanduser() / _MANIFEST).read_text())
        return str(manifest["settings"]["model"]["name_or_path"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None


def _recorded_file_digests(output_dir: Path) -> dict:
    """The file digests a current manifest in `output_dir` memoizes ({} when there is none)."""
    try:
        manifest = json.loads((output_dir / _MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return dict(manifest.get("file_digests") or {}) if manifest.get("format") == _MANIFEST_FORMAT else {}


def _load_sampler(model, backend: str, seed: int) -> tuple[object, Callable]:
    """The model ready for `backend` ("vllm" or "transformers") and the function that samples from it."""
    if backend == "vllm":
        if isinstance(model, str) or hasattr(model, "name_or_path"):
            model = make_vllm_engine(model if isinstance(model, str) else model.name_or_path, seed=seed)
        return model, sample_with_logps_vllm
    if isinstance(model, str):
        with outside_zero3_construction():  # under `accelerate launch` the main process samples alone
            model = AutoModelForCausalLM.from_pretrained(model)
        model.to("cuda" if torch.cuda.is_available() else "cpu")
    return model, sample_with_logps


def sample_rows(
    sampler: Callable,
    model,
    tokenizer,
    prompts: Dataset,
    num_completions: int,
    prompts_per_batch: int,
    first_index: int = 0,
    progress=None,
    **sampling,
) -> list[dict]:
    """`num_completions` rows per prompt of `prompts`, sampled `prompts_per_batch` prompts at a time by `sampler`
    (`sample_with_logps` or `sample_with_logps_vllm`, given `sampling`): the prompt's columns, its `prompt_index`
    (numbered from `first_index`), the `sample_index` and the sampler's columns. `progress` (tqdm) counts prompts."""
    rows = []
    for batch_start in range(0, len(prompts), prompts_per_batch):
        batch = prompts.select(range(batch_start, min(batch_start + prompts_per_batch, len(prompts))))
        samples = sampler(model, tokenizer, batch["prompt"], num_completions, **sampling)
        for offset, example in enumerate(batch):
            for sample_index in range(num_completions):
                rows.append(
                    {
                        **example,
                        "prompt_index": first_index + batch_start + offset,
                        "sample_index": sample_index,
                        **samples[offset * num_completions + sample_index],
                    }
                )
        if progress is not None:
            progress.update(len(batch))
    return rows


def score_rows(rows: list[dict], reward_funcs: list[Callable], weights: list[float]) -> None:
    """Label `rows` in place as generation labels them: `rewards/<name>` per reward function (NaN where it returned
    None) and `reward`, their weighted sum over the functions that scored the row (NaN when none did)."""
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
    total = [0.0] * len(rows)
    scored = [False] * len(rows)
    for function, weight in zip(reward_funcs, weights, strict=True):
        values = function(
            prompts=[row["prompt"] for row in rows], completions=[row["completion"] for row in rows], **columns
        )
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


_JSON_COLUMNS = ("prompt_ids", "completion_ids", "behaviour_logps", "behaviour_sampling")


def load_offline_source(source: str | Path, split: str = "train") -> Dataset:
    """The `split` of an offline dataset from `source`: the shard folder `generate_offline_dataset` writes (one
    split, `train`), or whatever `topr_trl.inputs.sources.load_data_source` loads: a `save_to_disk` folder (a
    DatasetDict gives `split`, or its only one), a `.json`/`.jsonl`/`.csv`/`.parquet` file (one split, `train`) or a
    folder of such files (one format; files named after their split, `train.jsonl` and `test.jsonl`, are the splits, as
    `datasets` reads a folder; a folder with no file named after a split is one split, `train`), or a Hub dataset
    id. Raises FileNotFoundError for a path that does not exist and ValueError for one that holds nothing loadable
    or not `split`.

    CSV cannot hold lists: a CSV offline dataset normally carries `completion` text (tokenized by TOPRTrainer); list
    columns written as JSON text (`[1, 2, 3]`) are parsed back."""
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir() and (path / _MANIFEST).is_file() and not any(path.glob("shard-*")):
        # a generation that stopped before its first shard: its manifest is not data
        raise ValueError(
            f"offline dataset {text!r} is a `topr-trl generate` folder that holds no complete shard yet (the "
            "generation stopped before its first one): rerun the same generate command to continue it"
        )
    if path.is_dir() and any(path.glob("shard-*")):
        if split != "train":
            raise ValueError(
                f"offline dataset {text!r} is a generated shard folder, which holds one split, 'train': "
                f"it has no {split!r} split"
            )
        return load_offline_dataset(path)
    if not path.exists() and (looks_like_local_data(text) or "/" not in text):  # on the Hub it is `owner/name`
        raise FileNotFoundError(
            f"offline dataset {text!r} not found: give the folder `topr-trl generate` wrote, a "
            "save_to_disk folder, a .json/.jsonl/.csv/.parquet file or folder, or a Hub id"
        )
    dataset = load_data_source(text, split, what="offline dataset", one_split="train")
    for column in _JSON_COLUMNS:  # written as JSON text where the format holds no lists or records (CSV)
        if column in dataset.column_names and getattr(dataset.features[column], "dtype", None) in (
            "string",
            "large_string",
        ):
            dataset = dataset.map(lambda row, c=column: {c: json.loads(row[c])}, desc=f"parsing {column}")
    return dataset
