"""`topr-trl` (also `python -m topr_trl`): the command line.

    topr-trl train                      # tiny local model, built-in arithmetic task, CPU, a few minutes
    topr-trl train --config recipe.yaml --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name ...

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

    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub id or local path of a prompt dataset; None: built-in arithmetic."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["arithmetic"],
        metadata={"help": f"Reward functions: {sorted(REWARD_FUNCTIONS)} or 'package.module:function'."},
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
    """Fail on a misspelt flag with the closest valid one, before anything heavy is loaded."""
    known = {option for action in parser._actions for option in action.option_strings}
    for argument in argv:
        flag = argument.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            close = difflib.get_close_matches(flag, known, n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise SystemExit(f"topr-trl train: unknown option {flag}.{hint}")


def train(argv: list[str]) -> dict:
    from trl import ModelConfig, TrlParser, get_peft_config

    from .config import TOPRConfig
    from .tasks import accuracy, build_warm_model, make_arithmetic_dataset
    from .trainer import TOPRTrainer

    parser = TrlParser((TrainScriptArguments, TOPRConfig, ModelConfig), prog="topr-trl train")
    parser.set_defaults(**TRAIN_DEFAULTS)
    reject_unknown_flags(parser, argv)
    script_args, training_args, model_args = parser.parse_args_and_config(argv)

    builtin_task = script_args.dataset_name is None
    if model_args.model_name_or_path is None:
        build_warm_model(script_args.base_model_dir, digits=script_args.task_digits,
                         target_accuracy=script_args.warm_start_accuracy, seed=training_args.seed)
        model_args.model_name_or_path = script_args.base_model_dir
    if builtin_task:
        train_dataset = make_arithmetic_dataset(script_args.task_train_prompts, script_args.task_digits, seed=1)
        eval_dataset = make_arithmetic_dataset(script_args.task_eval_prompts, script_args.task_digits, seed=2)
    else:
        from datasets import load_dataset

        train_dataset = load_dataset(script_args.dataset_name, script_args.dataset_config,
                                     split=script_args.dataset_train_split)
        eval_dataset = None

    trainer = TOPRTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[resolve_reward(name) for name in script_args.reward_funcs],
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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": train}
    if not argv or argv[0] not in commands:
        print(__doc__)
        print(f"commands: {', '.join(commands)}")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
