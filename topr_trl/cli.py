"""`topr-trl` (also `python -m topr_trl`): the command line.

    topr-trl train                      # tiny local model, built-in arithmetic task, CPU, about a minute
    topr-trl train --task reasoning     # the reasoning testbed (the paper's regime), CPU, a few minutes
    topr-trl train --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name prompts.jsonl \\
        --reward_funcs my_rewards:correctness   # your model, data and reward: TRL's GRPOConfig defaults + TOPR's
    topr-trl generate --num_generations 8            # an offline dataset sampled from mu, labelled
    topr-trl train --offline_dataset DIR_OR_FILE     # Algorithm 1: train on stored completions, no generation
    topr-trl iterate --iterations 2                  # generate, compose, train; mu_i = pi_{i-1}
    topr-trl evaluate --model_name_or_path outputs/topr-tiny-arithmetic --k 8   # sampled pass@1, pass@k, maj@k

With no model and no dataset a command runs the built-in task on the built-in tiny model, with settings sized for
a 2-core CPU. A model or dataset on the command line (or in `--config`) makes it a custom run, which starts from
TRL's own GRPOConfig defaults (on a machine without a GPU: `use_cpu`, no bf16). `train`, `generate` and `iterate`
take `--config file.yaml`, then any field as a flag; `--help` shows the main flags, `--help-all` every one. A run
without `--output_dir` writes below the current folder, to `outputs/topr-<model>-<data>` (train),
`outputs/topr-iterations-<model>-<data>` (iterate) or `outputs/data-<model>-<data>` (generate); evaluate writes to
`outputs/eval-<task>`. A wrong input fails in one line starting with
`topr-trl:`; `--debug` shows the traceback. All commands run under `accelerate launch`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .evaluation.reasoning import max_completion_tokens
from .machine import describe_machine, machine_info
from .sources import check_data_source, check_model_source
from .user_rewards import BUILTIN_REWARDS, reporting_reward, resolve_reward

TASKS = ("arithmetic", "reasoning", "gsm8k", "math500", "custom")
BUILTIN_TASK = "arithmetic"  # what a command runs with no model, no dataset and no task
BUILTIN_TASKS = ("arithmetic", "reasoning")  # the tasks the built-in tiny model is built for
_TASK_REWARDS = {"arithmetic": ["arithmetic"], "reasoning": ["reasoning"],
                 "gsm8k": ["topr_trl.evaluation.rewards:gsm8k_reward"],
                 "math500": ["topr_trl.evaluation.rewards:math_reward"]}

# The built-in task's settings, sized for its ~80k-parameter model on a 2-core CPU. They apply only when the run
# uses the built-in tiny model (no --model_name_or_path); every other run starts from TRL's GRPOConfig defaults.
BUILTIN_TRAIN_DEFAULTS = dict(
    per_device_train_batch_size=16,
    num_generations=8,
    max_completion_length=6,
    max_steps=200,
    learning_rate=2e-4,
    lr_scheduler_type="constant",
    logging_steps=10,
    save_strategy="no",
    report_to="none",
    bf16=False,
    gradient_checkpointing=False,
    use_cpu=True,
    seed=0,
)
# `iterate` trains one pass over each iteration's data (max_steps=-1) and checkpoints so that it can resume.
BUILTIN_ITERATE_DEFAULTS = dict(BUILTIN_TRAIN_DEFAULTS, max_steps=-1, save_strategy="steps", save_steps=50,
                                task_train_prompts=256)
BUILTIN_GENERATE_DEFAULTS = dict(max_completion_length=6)
# The reasoning testbed (`topr_trl.evaluation.reasoning`: 3-digit addition written out with carries, a warm start that
# drops each carry with probability 0.25, about two thirds of samples correct), on top of the built-in settings:
# the setting of docs/results.md's sample-efficiency runs (32 completions per step, learning rate 3e-4, 60 steps).
REASONING_DEFAULTS = dict(per_device_train_batch_size=32, max_steps=60, learning_rate=3e-4, task_digits=3,
                          task_eval_prompts=500, base_model_dir="outputs/tiny-reasoning-base")
# Checks the Python API leaves off (GRPOTrainer's behaviour) and the command line turns on: a command-line user
# wants a broken reward function or a NaN to stop the run in one line rather than train on.
CLI_TRAINING_CHECKS = dict(topr_unscored_batch="error", topr_check_finite=True)
_OUTPUT_PREFIX = {"train": "topr", "iterate": "topr-iterations", "generate": "data"}


@dataclass
class TaskArguments:
    """What to train on (shared by the subcommands). With no model and no dataset: the built-in task and model."""

    task: str | None = field(
        default=None,
        metadata={"help": "arithmetic (the built-in task), reasoning (the built-in reasoning testbed: written "
                          "addition with carries, the paper's regime), gsm8k or math500 (topr_trl's loaders and "
                          "rewards), or custom (--dataset_name with a `prompt` column, and --reward_funcs). Default: "
                          "custom when --dataset_name is given, else arithmetic."},
    )
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "The prompt dataset: a Hub id, or a local .json/.jsonl/.csv/.parquet file, a folder of "
                          "them, or a save_to_disk folder. Needs a `prompt` column; other columns go to the reward "
                          "functions. For gsm8k/math500: where to load the benchmark from."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split evaluated during training when eval_strategy is not 'no'."}
    )
    few_shot: int = field(default=0, metadata={"help": "gsm8k/math500: worked examples prepended to each prompt."})
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": f"Reward functions: {', '.join(BUILTIN_REWARDS)}, 'module:function' (a module importable "
                          "from the current directory; TRL's 'module.function' too) or 'path/to/file.py:function'. "
                          "Default: the task's own."},
    )
    task_digits: int = field(default=2, metadata={"help": "Built-in tasks: operand digits (reasoning: 3)."})
    task_train_prompts: int = field(default=1000, metadata={"help": "Built-in tasks: training prompts."})
    task_eval_prompts: int = field(
        default=200, metadata={"help": "Built-in tasks: held-out problems for accuracy (reasoning: 500)."}
    )
    warm_start_accuracy: float = field(
        default=0.3, metadata={"help": "Arithmetic: SFT warm-start of the tiny model until this greedy accuracy."}
    )
    task_error_rate: float = field(
        default=0.25, metadata={"help": "Reasoning: probability that the warm start's solutions drop a carry."}
    )
    base_model_dir: str = field(
        default="outputs/tiny-arithmetic-base",
        metadata={"help": "Where the built-in tiny model is cached (reasoning: outputs/tiny-reasoning-base)."},
    )
    dry_run: bool = field(default=False, metadata={"help": "Build and validate the configuration, then stop."})


@dataclass
class TrainScriptArguments(TaskArguments):
    offline_dataset: str | None = field(
        default=None,
        metadata={"help": "Train on stored completions without generating (the paper's Algorithm 1): a folder "
                          "written by `topr-trl generate`, a save_to_disk folder, a .json/.jsonl/.csv/.parquet "
                          "file, or a Hub id. Columns: see the README's offline dataset schema. Rewards are the "
                          "stored `reward` column unless --reward_funcs is given."},
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Train into an output_dir that holds a finished run (it is refused "
                                         "otherwise)."}
    )


@dataclass
class GenerateScriptArguments(TaskArguments):
    """Sample an offline dataset from mu (the model), with GRPOConfig's names and defaults for the sampling knobs."""

    output_dir: str | None = field(
        default=None, metadata={"help": "Where the dataset shards go (default outputs/data-<model>-<data>)."}
    )
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (the paper: 16)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (the paper: 1)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus truncation (1: none)."})
    top_k: int = field(default=0, metadata={"help": "Top-k truncation (0: none; the paper: 500)."})
    max_completion_length: int = field(
        default=256, metadata={"help": "New tokens per completion (GRPOConfig's default; the paper: 512; the "
                                       "built-in task: 6)."}
    )
    max_prompts: int | None = field(default=None, metadata={"help": "Use only the first N prompts."})
    prompts_per_shard: int = field(default=64, metadata={"help": "Prompts per saved shard (the unit of resume)."})
    backend: str = field(default="auto", metadata={"help": "auto (vLLM when installed and a GPU is present), "
                                                            "vllm or transformers."})
    seed: int = field(default=0, metadata={"help": "Seed of sampling and of the built-in model."})
    chat_template_kwargs: str | None = field(
        default=None, metadata={"help": "JSON object of keyword arguments for the chat template (GRPOConfig's "
                                        "chat_template_kwargs; give training the same), e.g. '{\"enable_thinking\": "
                                        "false}'."}
    )
    push_to_hub: str | None = field(default=None, metadata={"help": "Hub dataset repository to push to (private)."})


@dataclass
class IterateScriptArguments(TaskArguments):
    """Iterated offline TOPR (Algorithm 1, mu_i = pi_{i-1}). Sampling uses TOPRConfig's num_generations, temperature,
    top_p, top_k and max_completion_length; training uses every other TOPRConfig field."""

    iterations: int = field(default=1, metadata={"help": "Iterations K (GRPO's num_iterations, the reuse of one "
                                                        "generation batch, keeps its meaning)."})
    composition: str = field(default="uniform", metadata={"help": "uniform, positives_only, anna_karenina or "
                                                                  "target_proportion."})
    target_proportion: float | None = field(default=None, metadata={"help": "For composition=target_proportion."})
    prompts_per_shard: int = field(default=64, metadata={"help": "Prompts per saved shard (the unit of resume)."})
    backend: str = field(default="auto", metadata={"help": "Generation: auto, vllm or transformers."})


# ---------------------------------------------------------------------------------------------- parsing
def config_settings(argv: list[str]) -> dict:
    """The mapping in the `--config` YAML file, or {} without one; a missing or malformed file exits in one line."""
    for index, argument in enumerate(argv):
        if argument.split("=", 1)[0] != "--config":
            continue
        path = argument.split("=", 1)[1] if "=" in argument else (argv[index + 1] if index + 1 < len(argv) else "")
        if not Path(path).is_file():
            raise SystemExit(f"topr-trl: config file {path!r} not found")
        import yaml

        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"topr-trl: config file {path!r} must hold a YAML mapping of field: value")
        return loaded
    return {}


def user_settings(argv: list[str]) -> dict:
    """What the user set, before any parsing: the `--config` keys, then the flags (which win), with their raw
    values (a bare flag reads as True)."""
    settings = dict(config_settings(argv))
    for index, argument in enumerate(argv):
        if not argument.startswith("--") or argument.split("=", 1)[0] == "--config":
            continue
        name, has_value, value = argument[2:].partition("=")
        name = name.replace("-", "_")
        if not has_value:
            following = argv[index + 1] if index + 1 < len(argv) else None
            value = True if following is None or following.startswith("--") else following
        settings[name] = value
    return settings


def _is_true(value) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")


def cpu_validation_overrides(settings: dict) -> list[str]:
    """For a dry run on a machine without a GPU: flags that turn off what needs one (bf16/fp16, vLLM), so that every
    other key and value of a GPU recipe still validates here. Says which ones it turned off."""
    from .distributed import gpu_available

    needs_gpu = {name: settings[name] for name in ("bf16", "fp16", "use_vllm") if _is_true(settings.get(name))}
    if not needs_gpu or gpu_available():
        return []
    print(f"[topr-trl] this configuration needs a GPU ({', '.join(f'{k}={v}' for k, v in needs_gpu.items())}); none "
          "here, so it is validated with those off", flush=True)
    return ["--use_cpu", "true", "--bf16", "false", "--fp16", "false", "--use_vllm", "false"]


def is_builtin_run(settings: dict) -> bool:
    """No model, no prompt dataset and no other task: the built-in tiny model on the built-in task."""
    task = settings.get("task")
    return not settings.get("model_name_or_path") and not settings.get("dataset_name") and task in (None, *BUILTIN_TASKS)


def builtin_task_defaults(settings: dict) -> dict:
    """The reasoning testbed's settings over the built-in ones (completion length from its digits); none for
    arithmetic."""
    if settings.get("task") != "reasoning":
        return {}
    return dict(REASONING_DEFAULTS,
                max_completion_length=max_completion_tokens(int(settings.get("task_digits", 3))))


def _short_name(value) -> str:
    """The last part of a model or data name, safe as a folder name; a data file keeps its format
    (`prompts.jsonl` -> `prompts-jsonl`), so that `prompts.jsonl` and `prompts.parquet` get folders of their own."""
    name = Path(str(value).rstrip("/")).name
    for suffix in (".jsonl", ".json", ".csv", ".parquet"):
        if name.endswith(suffix):
            name = f"{name.removesuffix(suffix)}-{suffix[1:]}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "run"


def default_output_dir(command: str, settings: dict) -> str:
    """`outputs/<prefix>-<model>-<data>` (prefix: `topr` for train, `topr-iterations` for iterate, `data` for
    generate): one folder per model and data, so runs do not overwrite each other."""
    model = _short_name(settings["model_name_or_path"]) if settings.get("model_name_or_path") else "tiny"
    data = settings.get("offline_dataset") or settings.get("dataset_name") or settings.get("task") or BUILTIN_TASK
    return f"outputs/{_OUTPUT_PREFIX[command]}-{model}-{_short_name(data)}"


def hardware_defaults() -> dict:
    """GRPOConfig asks for bf16 on the GPU, which TrainingArguments refuses on a machine without one: there, train on
    the CPU in fp32 unless the user says otherwise."""
    from .distributed import gpu_available

    return {} if gpu_available() else {"use_cpu": True, "bf16": False}


def run_defaults(command: str, settings: dict) -> dict:
    """The parser defaults of a run, below the YAML and the flags: the built-in task's small-model settings for a
    built-in run, TRL's own (adjusted to the hardware) otherwise, and an output folder of its own."""
    builtin = is_builtin_run(settings)
    if command == "generate":
        defaults = dict(BUILTIN_GENERATE_DEFAULTS) if builtin else {}
    else:
        defaults = dict(BUILTIN_TRAIN_DEFAULTS if command == "train" else BUILTIN_ITERATE_DEFAULTS) if builtin \
            else hardware_defaults()
    if command != "generate":
        defaults.update(CLI_TRAINING_CHECKS)
    if builtin:
        defaults.update(builtin_task_defaults(settings))
        if command == "iterate":
            defaults["max_steps"] = -1  # one pass over each iteration's data
    defaults["output_dir"] = default_output_dir(command, settings)
    return defaults


def parse(argv: list[str], dataclass_types: tuple, prog: str, defaults: dict | None = None):
    """TRL's parser (`--config file.yaml`, then flags), refusing misspelt flags and YAML keys first. `--help` shows
    the main flags, `--help-all` every one."""
    from trl import TrlParser

    parser = TrlParser(dataclass_types, prog=prog, add_help=False)
    for action in parser._actions:  # HfArgumentParser gives `--no_X` the help of `--X` ("Enable X ...")
        if any(option.startswith("--no_") for option in action.option_strings) and action.const is False:
            action.help = f"Turn off {action.dest} (sets it to False)."
    if defaults:
        parser.set_defaults(**{k: v for k, v in defaults.items()
                               if any(k == action.dest for action in parser._actions)})
    if "--help-all" in argv:
        parser.print_help()
        raise SystemExit(0)
    if "-h" in argv or "--help" in argv:
        print_short_help(parser, dataclass_types, prog)
        raise SystemExit(0)
    reject_unknown_flags(parser, argv)
    return parser.parse_args_and_config(argv)


# GRPOConfig / TrainingArguments fields a TOPR user sets most; `--help-all` lists the rest.
_COMMON_TRAINING_FLAGS = (
    "output_dir", "learning_rate", "lr_scheduler_type", "max_steps", "num_train_epochs", "per_device_train_batch_size",
    "gradient_accumulation_steps", "num_generations", "max_completion_length", "temperature", "top_p", "top_k",
    "beta", "use_vllm", "vllm_mode", "bf16", "use_cpu", "gradient_checkpointing", "logging_steps", "save_strategy",
    "save_steps", "eval_strategy", "eval_steps", "report_to", "seed", "push_to_hub", "hub_model_id",
    "resume_from_checkpoint",
)
_COMMON_MODEL_FLAGS = ("model_name_or_path", "dtype", "use_peft", "lora_r", "lora_alpha", "lora_target_modules")


def print_short_help(parser, dataclass_types: tuple, prog: str) -> None:
    """The flags of this command's own arguments and of TOPR first, then the common GRPO and model flags."""
    from trl import GRPOConfig, ModelConfig

    from .config import TOPRConfig

    grpo_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    groups: list[tuple[str, list[str]]] = []
    for kind in dataclass_types:
        names = [f.name for f in dataclasses.fields(kind)]
        if kind is TOPRConfig:
            groups.append(("TOPR (TOPRConfig's own fields)", [n for n in names if n not in grpo_fields]))
            groups.append(("training (GRPOConfig; the most used)", list(_COMMON_TRAINING_FLAGS)))
        elif kind is ModelConfig:
            groups.append(("model (TRL's ModelConfig; the most used)", list(_COMMON_MODEL_FLAGS)))
        else:
            groups.append((f"{prog.split()[-1]}: what to run on", names))
    short = argparse.ArgumentParser(prog=prog, add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                                    usage=f"{prog} [--config FILE.yaml] [--FIELD VALUE ...]",
                                    epilog="--help-all lists every option (all of GRPOConfig, TrainingArguments and "
                                           "ModelConfig). --debug shows the traceback of an error.")
    by_dest = {action.dest: action for action in parser._actions}
    shown: set[str] = set()
    for title, names in groups:
        group = short.add_argument_group(title)
        for name in names:
            if name in by_dest and name not in shown:
                group._add_action(by_dest[name])
                shown.add(name)
    short.print_help()


def reject_unknown_flags(parser, argv: list[str]) -> None:
    """Fail on a misspelt flag or YAML key with the closest valid one, before anything heavy is loaded."""
    known = {option for action in parser._actions for option in action.option_strings} | {"--config"}
    names = {action.dest for action in parser._actions}

    def fail(kind: str, name: str, candidates) -> None:
        close = difflib.get_close_matches(name, candidates, n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise SystemExit(f"topr-trl: unknown {kind} {name}.{hint}")

    for argument in argv:
        flag = argument.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            fail("option", flag, known)
    config = config_settings(argv)
    for key in config:
        if key not in names and key != "env":  # TRL's parser sets environment variables from `env`
            fail("key in the config file:", key, names)
    check_values(parser, argv, config)


def _expected(action) -> str:
    kind = getattr(action.type, "__name__", "")
    return {"float": "a number", "int": "an integer", "string_to_bool": "true or false"}.get(kind, f"a {kind} value")


def _invalid_value(action, value) -> str | None:
    """What `value` should have been for `action`'s option, or None when the parser will take it."""
    import argparse as _argparse

    for item in value if isinstance(value, list) else [value]:
        if item is None or item is True:  # a bare flag
            continue
        converted = item
        if callable(action.type) and isinstance(item, str):
            try:
                converted = action.type(item)
            except (TypeError, ValueError, _argparse.ArgumentTypeError):
                return _expected(action)
        if action.choices is not None and converted not in action.choices and str(converted) not in \
                [str(choice) for choice in action.choices]:
            return f"one of {[str(choice) for choice in action.choices]}"
    return None


def check_values(parser, argv: list[str], config: dict) -> None:
    """Fail in one line naming the flag (or the YAML key), the value and what it should be, before argparse prints
    its usage over hundreds of lines."""
    by_flag = {option: action for action in parser._actions for option in action.option_strings}
    by_dest = {action.dest: action for action in parser._actions if action.option_strings}
    index = 0
    while index < len(argv):
        flag, has_value, value = argv[index].partition("=")
        index += 1
        if not flag.startswith("--") or flag == "--config" or flag not in by_flag:
            continue
        values = [value] if has_value else []
        while not has_value and index < len(argv) and not argv[index].startswith("--"):
            values.append(argv[index])
            index += 1
        given = values if len(values) > 1 else (values[0] if values else None)
        wanted = _invalid_value(by_flag[flag], given)
        if wanted is not None:
            raise SystemExit(f"topr-trl: {flag} {' '.join(values)}: expected {wanted}")
    flags = {argument.partition("=")[0] for argument in argv}
    for key, value in config.items():
        action = by_dest.get(key)
        if action is None or any(option in flags for option in action.option_strings):
            continue  # the command line sets it
        wanted = _invalid_value(action, value)
        if wanted is not None:
            raise SystemExit(f"topr-trl: YAML key {key}: {value!r} in the config file: expected {wanted}")


# ---------------------------------------------------------------------------------------------- what to run on
def resolve_task(options: TaskArguments, model_name_or_path: str | None, offline: bool = False) -> str:
    """The task of the run, or a one-line exit saying what is missing."""
    from .config import check_choice

    task = options.task or ("custom" if options.dataset_name or (offline and model_name_or_path) else BUILTIN_TASK)
    check_choice("task", task, TASKS)
    if model_name_or_path is None and task not in BUILTIN_TASKS:
        what = f"--dataset_name {options.dataset_name}" if options.dataset_name else f"--task {task}"
        raise SystemExit(f"topr-trl: {what} selects a custom run, which needs --model_name_or_path (a Hub id or a "
                         "local model folder); the built-in tiny model knows only the arithmetic and reasoning "
                         "tasks")
    if task == "custom" and not options.dataset_name and not offline:
        raise SystemExit("topr-trl: a custom run needs --dataset_name (a Hub id or a local file with a `prompt` "
                         "column) or --offline_dataset")
    if model_name_or_path is not None and options.task is None and not options.dataset_name and not offline:
        raise SystemExit(f"topr-trl: --model_name_or_path {model_name_or_path} needs something to train on: "
                         "--dataset_name FILE_OR_HUB_ID with --reward_funcs, --task gsm8k|math500|arithmetic|"
                         "reasoning, or "
                         "--offline_dataset")
    if task == "custom" and not options.reward_funcs and not offline:
        raise SystemExit("topr-trl: a custom dataset needs --reward_funcs (e.g. my_rewards:correctness, a function "
                         "taking completions and the dataset's columns and returning one float per completion)")
    return task


def load_prompts(options: TaskArguments, split: str):
    """The custom prompt dataset: Hub id, local data files, or a save_to_disk folder; it must have `prompt`."""
    from .evaluation.benchmarks import load_source

    try:
        dataset = load_source(options.dataset_name, split, config=options.dataset_config)
    except RuntimeError as error:  # the Hub could not be reached; the message says what to do offline
        raise SystemExit(f"topr-trl: {error}") from error
    if "prompt" not in dataset.column_names:
        raise SystemExit(f"topr-trl: dataset {options.dataset_name!r} has no `prompt` column (it has "
                         f"{dataset.column_names}); rename the column that holds the prompts to `prompt`")
    return dataset


def load_task(options: TaskArguments, model_name_or_path: str | None, seed: int, offline: bool = False,
              eval_split: bool = False):
    """(model, task, training prompts, held-out set of the built-in task or None, evaluation dataset for the trainer
    or None, reward functions) of the run. Without a model, builds the built-in tiny one (on the main process first
    under `accelerate launch`); with `dry_run`, validates and loads nothing."""
    from .evaluation.arithmetic import make_arithmetic_dataset

    task = resolve_task(options, model_name_or_path, offline)
    check_model_source(model_name_or_path, dry_run=options.dry_run)  # before anything heavy, dry runs included
    check_data_source(options.dataset_name, "--dataset_name")
    reward_names = options.reward_funcs or _TASK_REWARDS.get(task, [])
    # a user's function that raises stops the command in one line naming it (the Python API lets it raise as is)
    reward_funcs = [reporting_reward(resolve_reward(name)) for name in reward_names]
    if options.dry_run:
        return model_name_or_path, task, None, None, None, reward_funcs
    if model_name_or_path is None:
        model_name_or_path = builtin_model(task, options, seed)
    held_out = eval_dataset = train_dataset = None
    if task == "arithmetic":
        train_dataset = make_arithmetic_dataset(options.task_train_prompts, options.task_digits, seed=1)
        held_out = make_arithmetic_dataset(options.task_eval_prompts, options.task_digits, seed=2)
    elif task == "reasoning":
        from .evaluation.reasoning import make_reasoning_dataset

        # train and held-out problems come from splits that are disjoint by construction
        train_dataset = make_reasoning_dataset(options.task_train_prompts, options.task_digits, "train", seed=1)
        held_out = make_reasoning_dataset(options.task_eval_prompts, options.task_digits, "heldout", seed=0)
    elif task == "gsm8k":
        from .evaluation.benchmarks import load_gsm8k

        source = options.dataset_name or "openai/gsm8k"
        train_dataset = load_gsm8k(options.dataset_train_split, source=source, few_shot=options.few_shot)
        if eval_split:
            eval_dataset = load_gsm8k(options.dataset_test_split, source=source, few_shot=options.few_shot)
    elif task == "math500":
        from .evaluation.benchmarks import load_math500

        train_dataset = load_math500(source=options.dataset_name or "HuggingFaceH4/MATH-500",
                                     few_shot=options.few_shot)
    elif options.dataset_name:
        train_dataset = load_prompts(options, options.dataset_train_split)
        if eval_split:
            eval_dataset = load_prompts(options, options.dataset_test_split)
    return model_name_or_path, task, train_dataset, held_out, eval_dataset, reward_funcs


def builtin_model(task: str, options: TaskArguments, seed: int) -> str:
    """The built-in tiny model of `task`: the shipped weights for the default settings (the same on every machine),
    else warm-started here once (on the main process first under `accelerate launch`, with progress); cached under
    --base_model_dir. Returns its folder."""
    from accelerate import PartialState

    from .distributed import outside_zero3_construction
    from .evaluation.arithmetic import build_warm_model, warm_model_folder, warm_model_key
    from .evaluation.reasoning import WarmStartSettings, build_reasoning_warm_model, warm_model_path
    from .evaluation.tiny import prebuilt_model

    if task == "reasoning":
        settings = WarmStartSettings(digits=options.task_digits, error_rate=options.task_error_rate, seed=seed)
        folder = warm_model_path(options.base_model_dir, settings)
        shipped = prebuilt_model(settings.key()) is not None
        what = (f"SFT on written solutions that drop each carry with probability {options.task_error_rate:g}, "
                f"{settings.steps} steps (1-3 min on an idle 2-core CPU)")
    else:
        folder = warm_model_folder(options.base_model_dir, options.task_digits, options.warm_start_accuracy, seed)
        shipped = prebuilt_model(warm_model_key(options.task_digits, options.warm_start_accuracy, seed)) is not None
        what = f"SFT warm start until {options.warm_start_accuracy:.0%} greedy accuracy (at most 3,000 steps)"
    state = PartialState()
    with state.main_process_first():
        if state.is_main_process:
            fresh = not (folder / "config.json").exists()
            started = time.time()
            if fresh and shipped:
                _print_main(f"installing the built-in tiny model's shipped weights into {folder}")
            elif fresh:  # seconds to minutes on an idle CPU, longer on a busy one: say what it is, and how far
                _print_main(f"building the built-in tiny model for these settings (once; cached in {folder}): "
                            f"{what}; on {describe_machine()}")

            def progress(step: int, steps: int, loss: float) -> None:
                _print_main(f"  warm start step {step}/{steps}, loss {loss:.3f}, {time.time() - started:.0f} s")

            with outside_zero3_construction():
                if task == "reasoning":
                    build_reasoning_warm_model(options.base_model_dir, settings, progress=progress)
                else:
                    build_warm_model(folder, digits=options.task_digits,
                                     target_accuracy=options.warm_start_accuracy, seed=seed, progress=progress)
            if fresh and not shipped:
                _print_main(f"built-in tiny model ready in {time.time() - started:.0f} s")
    return str(folder)


# ---------------------------------------------------------------------------------------------- run helpers
def refuse_used_output_dir(output_dir: str, overwrite: bool, resume: bool) -> None:
    """A folder that holds a finished run (its summary or its saved model) or an interrupted one (checkpoints) is not
    trained into again by accident: a finished one only with --overwrite_output_dir (or --resume_from_checkpoint to
    continue it), an interrupted one only with --resume_from_checkpoint (or --overwrite_output_dir to start again)."""
    from .distributed import last_checkpoint

    folder = Path(output_dir)
    if overwrite or resume or not folder.is_dir():
        return
    markers = [name for name in ("topr_summary.json", "model.safetensors", "adapter_model.safetensors")
               if (folder / name).exists()]
    if markers:
        raise SystemExit(f"topr-trl: {output_dir} holds a finished run ({markers[0]}); choose another --output_dir, "
                         "pass --overwrite_output_dir true to replace it or --resume_from_checkpoint true to "
                         "continue it")
    checkpoint = last_checkpoint(folder)
    if checkpoint is not None:
        raise SystemExit(f"topr-trl: {output_dir} holds an interrupted run (last checkpoint {Path(checkpoint).name}); "
                         "pass --resume_from_checkpoint true to continue it, --overwrite_output_dir true to start "
                         "again from step 0, or choose another --output_dir")


def checkpoint_to_resume(training_args) -> str | None:
    """`--resume_from_checkpoint PATH`, or `true` for the last checkpoint in output_dir (None when there is none)."""
    from .distributed import last_checkpoint

    checkpoint = training_args.resume_from_checkpoint
    if str(checkpoint).lower() == "true":
        return last_checkpoint(training_args.output_dir)
    return checkpoint


def task_evaluator(task: str, held_out):
    """How a built-in task's held-out problems are scored, as `evaluate(model, tokenizer) -> dict`: greedy accuracy
    for arithmetic; for reasoning, sampled pass@1 (temperature 1, 4 samples per problem, the headline: greedy
    decoding hides the planted error) with greedy accuracy beside it."""
    if task == "reasoning":
        from .evaluation.reasoning import measure_base_model

        return lambda model, tokenizer: measure_base_model(model, tokenizer, held_out)
    from .evaluation.arithmetic import accuracy

    return lambda model, tokenizer: accuracy(model, tokenizer, held_out)


def held_out_accuracy(trainer, held_out, task: str) -> dict:
    """The trainer's policy scored by `task_evaluator` (gathered under ZeRO-3). Every process must call it."""
    from .distributed import evaluate_policy

    return evaluate_policy(trainer, task_evaluator(task, held_out))


def describe_accuracy(result: dict | None, num_problems: int) -> str:
    """'greedy accuracy 0.290 on 200 held-out problems': every accuracy printed says how it was measured."""
    if not result:
        return "not measured"
    if "pass@1" in result:
        return (f"sampled pass@1 {result['pass@1']:.3f} ± {result['pass@1_problem_se']:.3f} (temperature "
                f"{result['temperature']:g}, {result['num_samples']} samples per problem), greedy accuracy "
                f"{result['greedy_accuracy']:.3f}, on {num_problems} held-out problems")
    return f"greedy accuracy {result['accuracy']:.3f} on {num_problems} held-out problems"


def _print_main(message: str) -> None:
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(f"[topr-trl] {message}", flush=True)


def _note_hardware(defaults: dict, settings: dict) -> None:
    """A custom run moved to the CPU by `hardware_defaults` says so (the built-in task is meant for the CPU)."""
    if not is_builtin_run(settings) and defaults.get("use_cpu") and "use_cpu" not in settings \
            and "bf16" not in settings:
        _print_main("no GPU found: training on the CPU in fp32 (use_cpu=True, bf16=False)")


# ---------------------------------------------------------------------------------------------- commands
def train(argv: list[str]) -> dict:
    from trl import ModelConfig, get_peft_config

    from .config import TOPRConfig
    from .offline import load_offline_source

    settings = user_settings(argv)
    defaults = run_defaults("train", settings)
    if _is_true(settings.get("dry_run")):
        argv = argv + cpu_validation_overrides(settings)
    script_args, training_args, model_args = parse(argv, (TrainScriptArguments, TOPRConfig, ModelConfig),
                                                   "topr-trl train", defaults)
    offline = script_args.offline_dataset is not None
    refuse_used_output_dir(training_args.output_dir, script_args.overwrite_output_dir,
                           bool(training_args.resume_from_checkpoint))
    check_data_source(script_args.offline_dataset, "--offline_dataset")
    # Loaded before any model is built, so that a wrong path fails at once.
    offline_data = offline_eval = None
    if offline and not script_args.dry_run:
        offline_data = load_offline_source(script_args.offline_dataset, script_args.dataset_train_split)
        if training_args.eval_strategy != "no":  # the stored test split, replayed and scored as the eval set
            offline_eval = load_offline_source(script_args.offline_dataset, script_args.dataset_test_split)
    model, task, train_dataset, held_out, eval_dataset, reward_funcs = load_task(
        script_args, model_args.model_name_or_path, training_args.seed, offline=offline,
        eval_split=training_args.eval_strategy != "no")
    if offline and script_args.reward_funcs is None:  # the paper labels the data once, at generation
        from .offline import stored_reward

        reward_funcs = [stored_reward]
    if script_args.dry_run:
        print(f"[topr-trl] configuration valid: task={task} model={model or 'built-in tiny model'} "
              f"loss_type={training_args.loss_type} limits={training_args.topr_limits} "
              f"rewards={[f.__name__ for f in reward_funcs]} offline_dataset={script_args.offline_dataset} "
              f"output_dir={training_args.output_dir}")
        return {"dry_run": True}
    if offline:
        train_dataset, eval_dataset = offline_data, offline_eval
    _note_hardware(defaults, settings)

    from .trainer import TOPRTrainer

    with removed_if_left_empty(training_args.output_dir):
        trainer = TOPRTrainer(model=model, reward_funcs=reward_funcs, args=training_args,
                              train_dataset=train_dataset, eval_dataset=eval_dataset,
                              peft_config=get_peft_config(model_args))
        summary: dict = {"output_dir": training_args.output_dir, "model": model, "task": task,
                         "machine": machine_info()}
        _print_main(f"measured on {describe_machine(summary['machine'])}")
        if held_out is not None:
            summary["held_out_problems"] = len(held_out)
            summary["before"] = held_out_accuracy(trainer, held_out, task)
            _print_main(f"before training: {describe_accuracy(summary['before'], len(held_out))}")
        trainer.train(resume_from_checkpoint=checkpoint_to_resume(training_args))
        if held_out is not None:
            summary["after"] = held_out_accuracy(trainer, held_out, task)
            _print_main(f"after training:  {describe_accuracy(summary['after'], len(held_out))}")
        summary["steps"] = trainer.state.global_step
        summary["end_of_training"] = last_logged(trainer.state.log_history, SUMMARY_METRICS)
        if summary["end_of_training"]:
            _print_main("at the end of training: " + ", ".join(
                f"{key} {value:.4g}" for key, value in summary["end_of_training"].items()))
        trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        Path(training_args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(training_args.output_dir) / "topr_summary.json").write_text(json.dumps(summary, indent=2))
        _print_main(f"model and summary saved to {shown_path(training_args.output_dir)}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.offline_dataset or script_args.dataset_name)
    return summary


# The last logged value of each, for the summary of a run (p~ only under topr_signal="reward").
SUMMARY_METRICS = ("loss", "reward", "reward_std", "topr/effective_positive_proportion", "topr/positive_fraction",
                   "topr/negative_truncated_fraction", "eval_reward")


def last_logged(log_history: list[dict], keys) -> dict:
    """The last value logged under each of `keys` (those never logged are left out)."""
    found = {}
    for entry in log_history:
        for key in keys:
            value = entry.get(key)
            if isinstance(value, (int, float)) and value == value:  # NaN is "not measured"
                found[key] = float(value)
    return found


def shown_path(path: str) -> str:
    """`path` as the user can open it from where they ran the command: relative when it lies below the current
    folder, absolute otherwise."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(resolved)


@contextlib.contextmanager
def removed_if_left_empty(output_dir: str):
    """A run that fails leaves no empty output folder behind: a folder this run created and wrote no file into is
    removed (one with any file, a checkpoint above all, is kept)."""
    from accelerate import PartialState

    folder = Path(output_dir)
    existed = folder.exists()
    try:
        yield
    except BaseException:
        if not existed and folder.is_dir() and PartialState().is_main_process \
                and not any(path.is_file() for path in folder.rglob("*")):
            shutil.rmtree(folder, ignore_errors=True)
        raise


def generate(argv: list[str]) -> dict:
    from accelerate import PartialState
    from trl import ModelConfig

    from .config import check_choice
    from .offline import BACKENDS, generate_offline_dataset, proportion_of_positives

    settings = user_settings(argv)
    options, model_args = parse(argv, (GenerateScriptArguments, ModelConfig), "topr-trl generate",
                                run_defaults("generate", settings))
    check_choice("backend", options.backend, BACKENDS)
    try:
        chat_template_kwargs = json.loads(options.chat_template_kwargs) if options.chat_template_kwargs else None
    except json.JSONDecodeError as error:
        raise SystemExit(f"topr-trl: --chat_template_kwargs must be a JSON object ({error})") from None
    model, task, prompts, _, _, reward_funcs = load_task(options, model_args.model_name_or_path, options.seed)
    if options.dry_run:
        print(f"[topr-trl] configuration valid: task={task} model={model or 'built-in tiny model'} "
              f"backend={options.backend} num_generations={options.num_generations} "
              f"rewards={[f.__name__ for f in reward_funcs]} output_dir={options.output_dir}")
        return {"dry_run": True}
    if not PartialState().is_main_process:  # sharded generation is resumable, not parallel: one process writes
        return {}
    import torch
    from transformers import AutoTokenizer

    if options.max_prompts is not None:
        prompts = prompts.select(range(min(options.max_prompts, len(prompts))))
    torch.manual_seed(options.seed)
    dataset = generate_offline_dataset(
        model, AutoTokenizer.from_pretrained(model), prompts, reward_funcs, options.output_dir,
        num_completions=options.num_generations, temperature=options.temperature, top_p=options.top_p,
        top_k=options.top_k, max_new_tokens=options.max_completion_length, prompts_per_shard=options.prompts_per_shard,
        backend=options.backend, seed=options.seed, push_to_hub=options.push_to_hub,
        chat_template_kwargs=chat_template_kwargs,
    )
    summary = {"rows": len(dataset), "prompts": len(prompts), "proportion_of_positives":
               proportion_of_positives(dataset), "truncated_fraction": sum(dataset["truncated"]) / len(dataset),
               "output_dir": options.output_dir, "machine": machine_info()}
    print(f"[topr-trl] generated {summary['rows']} completions for {summary['prompts']} prompts into "
          f"{options.output_dir}: p={summary['proportion_of_positives']:.3f} (share of positive rewards), "
          f"truncated {summary['truncated_fraction']:.3f}; on {describe_machine(summary['machine'])}", flush=True)
    return summary


def iterate(argv: list[str]) -> list[dict]:
    import torch
    from trl import ModelConfig

    from .config import TOPRConfig, check_choice
    from .offline.iterations import IterationSettings, run_iterations
    from .offline import BACKENDS, COMPOSITIONS

    settings = user_settings(argv)
    defaults = run_defaults("iterate", settings)
    if _is_true(settings.get("dry_run")):
        argv = argv + cpu_validation_overrides(settings)
    options, training_args, model_args = parse(argv, (IterateScriptArguments, TOPRConfig, ModelConfig),
                                               "topr-trl iterate", defaults)
    check_choice("composition", options.composition, COMPOSITIONS)
    check_choice("backend", options.backend, BACKENDS)
    model, task, prompts, held_out, _, reward_funcs = load_task(options, model_args.model_name_or_path,
                                                                training_args.seed)
    if options.dry_run:
        print(f"[topr-trl] configuration valid: {options.iterations} iteration(s), composition="
              f"{options.composition}, task={task}, model={model or 'built-in tiny model'}, "
              f"limits={training_args.topr_limits}, output_dir={training_args.output_dir}")
        return []
    _note_hardware(defaults, settings)
    torch.manual_seed(training_args.seed)
    iteration_settings = IterationSettings(
        num_iterations=options.iterations, num_completions=training_args.num_generations,
        temperature=training_args.temperature, top_p=training_args.top_p, top_k=training_args.top_k or 0,
        max_new_tokens=training_args.max_completion_length, composition=options.composition,
        target_proportion=options.target_proportion, prompts_per_shard=options.prompts_per_shard,
        backend=options.backend, train_args=training_args,
    )
    evaluate = task_evaluator(task, held_out) if held_out is not None else None
    summaries = run_iterations(model, prompts, reward_funcs, training_args.output_dir, iteration_settings,
                               evaluate=evaluate)
    problems = len(held_out) if held_out is not None else 0
    _print_main(f"measured on {describe_machine()}")
    for summary in summaries:
        _print_main(f"iteration {summary['iteration']}: p={summary['proportion_of_positives']:.3f}; before: "
                    f"{describe_accuracy(summary.get('evaluation_before'), problems)}; after: "
                    f"{describe_accuracy(summary.get('evaluation'), problems)}")
    return summaries


COMMANDS = ("train", "generate", "iterate", "evaluate")
# What a user's input can raise before or during a run; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, ImportError, ConnectionError)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [argument for argument in argv if argument != "--debug"]
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        print(f"commands: {', '.join(COMMANDS)}; `topr-trl COMMAND --help` for its flags")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated")  # TRL's own default trips it
    from .distributed import gpu_available

    if not gpu_available():  # DeepSpeed would guess the CPU, warning "Setting accelerator to CPU" on every command
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        run_command(argv[0], argv[1:])  # returns nothing: a console script exits 1 on a returned value
        from .distributed import end_process_group

        end_process_group()
    except USER_ERRORS as error:
        if debug:
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        message = message if message.startswith("topr-trl:") else f"topr-trl: {message}"
        raise SystemExit(f"{message} (--debug shows the traceback)") from None


def run_command(command: str, argv: list[str]):
    if command == "evaluate":
        from .evaluation.runner import main as evaluate_main

        return evaluate_main(argv, prog="topr-trl evaluate")
    return {"train": train, "generate": generate, "iterate": iterate}[command](argv)


if __name__ == "__main__":
    main()
