"""`topr-trl` (also `python -m topr_trl`): the command line.

    topr-trl train                      # tiny local model, built-in arithmetic task, CPU, a few minutes
    topr-trl train --config recipe.yaml --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name ...
    topr-trl iterate --num_iterations 2 --composition anna_karenina   # offline TOPR, mu_i = pi_{i-1}
    topr-trl evaluate --model outputs/topr-arithmetic --task arithmetic --k 8   # pass@1, pass@k, maj@k

`train` takes TRL's conventions: `--config file.yaml`, then any TOPRConfig / ModelConfig field as a flag.
"""

from __future__ import annotations

import difflib
import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .tasks import arithmetic_reward

REWARD_FUNCTIONS = {"arithmetic": arithmetic_reward}
TASKS = ("arithmetic", "gsm8k", "math500", "custom")


def _task_reward_names(task: str) -> list[str]:
    return {"arithmetic": ["arithmetic"], "gsm8k": ["topr_trl.rewards:gsm8k_reward"],
            "math500": ["topr_trl.rewards:math_reward"]}.get(task, [])

# The main job's defaults: sized for a 2-core CPU. Every one can be overridden on the command line or in YAML.
TRAIN_DEFAULTS = dict(
    output_dir="outputs/topr-arithmetic",
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


@dataclass
class TrainScriptArguments:
    """What to train on. With no model and no dataset, the built-in task and tiny model are used."""

    task: str = field(
        default="arithmetic",
        metadata={"help": "arithmetic (built-in), gsm8k or math500 (loaders and rewards of topr_trl), or custom "
                          "(--dataset_name with a `prompt` column and --reward_funcs)."},
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub id or local file of the dataset; None: the task's default."}
    )
    few_shot: int = field(default=0, metadata={"help": "gsm8k/math500: worked examples prepended to each prompt."})
    dry_run: bool = field(default=False, metadata={"help": "Build and validate the configuration, then stop."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": f"Reward functions: {sorted(REWARD_FUNCTIONS)} or 'package.module:function'; "
                          "None: the task's own."},
    )
    task_digits: int = field(default=2, metadata={"help": "Built-in task: operand digits."})
    task_train_prompts: int = field(default=1000, metadata={"help": "Built-in task: training prompts."})
    task_eval_prompts: int = field(default=200, metadata={"help": "Built-in task: held-out prompts for accuracy."})
    warm_start_accuracy: float = field(
        default=0.3, metadata={"help": "Built-in tiny model: SFT warm-start until this greedy accuracy."}
    )
    base_model_dir: str = field(
        default="outputs/tiny-arithmetic-base", metadata={"help": "Where the built-in tiny model is cached."}
    )


def resolve_reward(name: str):
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    module_name, _, function_name = name.partition(":")
    if not function_name:
        raise ValueError(f"Unknown reward function {name!r}: use one of {sorted(REWARD_FUNCTIONS)} or 'module:function'.")
    return getattr(importlib.import_module(module_name), function_name)


def reject_unknown_flags(parser, argv: list[str]) -> None:
    """Fail on a misspelt flag or YAML key with the closest valid one, before anything heavy is loaded."""
    known = {option for action in parser._actions for option in action.option_strings} | {"--config"}
    names = {action.dest for action in parser._actions}

    def fail(kind: str, name: str, candidates) -> None:
        close = difflib.get_close_matches(name, candidates, n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise SystemExit(f"topr-trl: unknown {kind} {name}.{hint}")

    for index, argument in enumerate(argv):
        flag = argument.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            fail("option", flag, known)
        if flag == "--config":
            path = argument.split("=", 1)[1] if "=" in argument else argv[index + 1]
            import yaml

            for key in (yaml.safe_load(Path(path).read_text()) or {}):
                if key not in names:
                    fail(f"key in {path}:", key, names)


def train(argv: list[str]) -> dict:
    from trl import ModelConfig, TrlParser, get_peft_config

    from .config import TOPRConfig
    from .tasks import accuracy, build_warm_model, make_arithmetic_dataset
    from .trainer import TOPRTrainer

    parser = TrlParser((TrainScriptArguments, TOPRConfig, ModelConfig), prog="topr-trl train")
    parser.set_defaults(**TRAIN_DEFAULTS)
    reject_unknown_flags(parser, argv)
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    from .config import check_choice

    check_choice("task", script_args.task, TASKS)
    reward_names = script_args.reward_funcs or _task_reward_names(script_args.task)
    if not reward_names:
        raise SystemExit("topr-trl train: --task custom needs --reward_funcs")
    reward_funcs = [resolve_reward(name) for name in reward_names]
    if script_args.dry_run:
        print(f"[topr-trl] configuration valid: task={script_args.task} model={model_args.model_name_or_path} "
              f"loss_type={training_args.loss_type} limits={training_args.topr_limits} rewards={reward_names}")
        return {"dry_run": True}

    builtin_task = script_args.task == "arithmetic"
    if model_args.model_name_or_path is None and not builtin_task:
        raise SystemExit("topr-trl train: --model_name_or_path is required outside the built-in task")
    if model_args.model_name_or_path is None:
        build_warm_model(script_args.base_model_dir, digits=script_args.task_digits,
                         target_accuracy=script_args.warm_start_accuracy, seed=training_args.seed)
        model_args.model_name_or_path = script_args.base_model_dir
    if builtin_task:
        train_dataset = make_arithmetic_dataset(script_args.task_train_prompts, script_args.task_digits, seed=1)
        eval_dataset = make_arithmetic_dataset(script_args.task_eval_prompts, script_args.task_digits, seed=2)
    elif script_args.task == "gsm8k":
        from .datasets import load_gsm8k

        train_dataset = load_gsm8k(script_args.dataset_train_split, source=script_args.dataset_name or "openai/gsm8k",
                                   few_shot=script_args.few_shot)
        eval_dataset = None
    elif script_args.task == "math500":
        from .datasets import load_math500

        train_dataset = load_math500(source=script_args.dataset_name or "HuggingFaceH4/MATH-500",
                                     few_shot=script_args.few_shot)
        eval_dataset = None
    else:
        from datasets import load_dataset

        train_dataset = load_dataset(script_args.dataset_name, script_args.dataset_config,
                                     split=script_args.dataset_train_split)
        eval_dataset = None

    trainer = TOPRTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        peft_config=get_peft_config(model_args),
    )
    summary: dict = {}
    if eval_dataset is not None:
        summary["before"] = accuracy(trainer.model, trainer.processing_class, eval_dataset)
        print(f"[topr-trl] held-out accuracy before training: {summary['before']}", flush=True)
    trainer.train()
    if eval_dataset is not None:
        summary["after"] = accuracy(trainer.model, trainer.processing_class, eval_dataset)
        print(f"[topr-trl] held-out accuracy after training:  {summary['after']}", flush=True)
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        Path(training_args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(training_args.output_dir) / "topr_summary.json").write_text(json.dumps(summary, indent=2))
        print(f"[topr-trl] model and summary saved to {training_args.output_dir}", flush=True)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return summary


@dataclass
class IterateScriptArguments:
    """Iterated offline TOPR (Algorithm 1, mu_i = pi_{i-1}) on the built-in task, or on a given model."""

    output_dir: str = field(default="outputs/topr-iterations", metadata={"help": "One folder per iteration."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "mu_0; None: the built-in tiny model."})
    num_iterations: int = field(default=1, metadata={"help": "Iterations K."})
    num_completions: int = field(default=8, metadata={"help": "Completions sampled per prompt."})
    composition: str = field(default="uniform", metadata={"help": "uniform, positives_only, anna_karenina, "
                                                                  "target_proportion."})
    target_proportion: float | None = field(default=None, metadata={"help": "For composition=target_proportion."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_k: int = field(default=0, metadata={"help": "Top-k truncation (0: none; the paper uses 500)."})
    max_new_tokens: int = field(default=6, metadata={"help": "Completion length cap."})
    learning_rate: float = field(default=2e-4, metadata={"help": "TOPR learning rate."})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Rows per optimizer step."})
    task_digits: int = field(default=2, metadata={"help": "Built-in task: operand digits."})
    task_train_prompts: int = field(default=256, metadata={"help": "Built-in task: prompts per iteration."})
    task_eval_prompts: int = field(default=200, metadata={"help": "Built-in task: held-out prompts."})
    warm_start_accuracy: float = field(default=0.3, metadata={"help": "Built-in model: SFT warm-start target."})
    base_model_dir: str = field(default="outputs/tiny-arithmetic-base", metadata={"help": "Built-in model cache."})
    seed: int = field(default=0, metadata={"help": "Seed of the built-in model and of sampling."})


def iterate(argv: list[str]) -> list[dict]:
    import torch
    from transformers import HfArgumentParser

    from .iterate import IterationSettings, run_iterations
    from .tasks import accuracy, build_warm_model, make_arithmetic_dataset

    parser = HfArgumentParser(IterateScriptArguments, prog="topr-trl iterate")
    reject_unknown_flags(parser, argv)
    (options,) = parser.parse_args_into_dataclasses(argv)
    torch.manual_seed(options.seed)
    if options.model_name_or_path is None:
        build_warm_model(options.base_model_dir, digits=options.task_digits,
                         target_accuracy=options.warm_start_accuracy, seed=options.seed)
        options.model_name_or_path = options.base_model_dir
    prompts = make_arithmetic_dataset(options.task_train_prompts, options.task_digits, seed=1)
    held_out = make_arithmetic_dataset(options.task_eval_prompts, options.task_digits, seed=2)
    settings = IterationSettings(
        num_iterations=options.num_iterations, num_completions=options.num_completions,
        temperature=options.temperature, top_k=options.top_k, max_new_tokens=options.max_new_tokens,
        composition=options.composition, target_proportion=options.target_proportion,
        train_overrides=dict(learning_rate=options.learning_rate, lr_scheduler_type="constant",
                             per_device_train_batch_size=options.per_device_train_batch_size, use_cpu=True,
                             bf16=False, gradient_checkpointing=False, logging_steps=10, seed=options.seed),
    )
    summaries = run_iterations(options.model_name_or_path, prompts, arithmetic_reward, options.output_dir, settings,
                               evaluate=lambda model, tokenizer: accuracy(model, tokenizer, held_out))
    for summary in summaries:
        print(f"[topr-trl] iteration {summary['iteration']}: p={summary['proportion_of_positives']:.3f} "
              f"before={summary.get('evaluation_before')} after={summary.get('evaluation')}", flush=True)
    return summaries


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .evaluate import main as evaluate_main

    commands = {
        "train": train,
        "iterate": iterate,
        "evaluate": lambda arguments: evaluate_main(arguments, prog="topr-trl evaluate"),
    }
    if not argv or argv[0] not in commands:
        print(__doc__)
        print(f"commands: {', '.join(commands)}")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
