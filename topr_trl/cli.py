"""`topr-trl` (also `python -m topr_trl`): the command line.

    topr-trl train                      # tiny local model, built-in arithmetic task, CPU, a few minutes
    topr-trl train --config recipe.yaml --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name ...
    topr-trl generate --output_dir data/mu0 --num_generations 8      # offline dataset sampled from mu
    topr-trl train --offline_dataset data/mu0                         # Algorithm 1: train on it, no generation
    topr-trl iterate --iterations 2 --composition anna_karenina   # generate, compose, train; mu_i = pi_{i-1}
    topr-trl evaluate --model outputs/topr-arithmetic --task arithmetic --k 8   # pass@1, pass@k, maj@k

`train`, `generate` and `iterate` take TRL's conventions: `--config file.yaml`, then any field as a flag
(TOPRConfig and ModelConfig fields for `train` and `iterate`, ModelConfig fields for `generate`); an unknown flag
or YAML key fails naming the closest valid one. All of them run under `accelerate launch`.
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
# `iterate` trains one pass over each iteration's data (max_steps=-1) and checkpoints so that it can resume.
ITERATE_DEFAULTS = dict(TRAIN_DEFAULTS, output_dir="outputs/topr-iterations", max_steps=-1, save_strategy="steps",
                        save_steps=50, task_train_prompts=256)


@dataclass
class TaskArguments:
    """What to train on (shared by the subcommands). With no model and no dataset: the built-in task and model."""

    task: str = field(
        default="arithmetic",
        metadata={"help": "arithmetic (built-in), gsm8k or math500 (loaders and rewards of topr_trl), or custom "
                          "(--dataset_name with a `prompt` column and --reward_funcs)."},
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub id or local file of the prompt dataset; None: the task's default."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    few_shot: int = field(default=0, metadata={"help": "gsm8k/math500: worked examples prepended to each prompt."})
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
    dry_run: bool = field(default=False, metadata={"help": "Build and validate the configuration, then stop."})


@dataclass
class TrainScriptArguments(TaskArguments):
    offline_dataset: str | None = field(
        default=None,
        metadata={"help": "A dataset written by `topr-trl generate` (its directory, or the Hub id it was pushed to): "
                          "train on its stored completions, log-probs of mu and rewards without generating (the "
                          "paper's Algorithm 1). num_generations must equal its completions per prompt."},
    )


@dataclass
class GenerateScriptArguments(TaskArguments):
    """Sample an offline dataset from mu (the model), with GRPOConfig's names for the sampling knobs."""

    output_dir: str = field(default="outputs/offline-data", metadata={"help": "Where the dataset shards go."})
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (the paper: 16)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (the paper: 1)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus truncation (1: none)."})
    top_k: int = field(default=0, metadata={"help": "Top-k truncation (0: none; the paper: 500)."})
    max_completion_length: int = field(default=6, metadata={"help": "New tokens per completion (the paper: 512)."})
    max_prompts: int | None = field(default=None, metadata={"help": "Use only the first N prompts."})
    prompts_per_shard: int = field(default=64, metadata={"help": "Prompts per saved shard (the unit of resume)."})
    backend: str = field(default="auto", metadata={"help": "auto (vLLM when installed and a GPU is present), "
                                                            "vllm or transformers."})
    seed: int = field(default=0, metadata={"help": "Seed of sampling and of the built-in model."})
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


def load_task(task_args: TaskArguments, model_name_or_path: str | None, seed: int):
    """(model, training prompts, held-out prompts or None, reward functions) of the chosen task. Without a model,
    builds the built-in tiny one (on the main process first under `accelerate launch`); with `dry_run`, validates
    and loads nothing."""
    from accelerate import PartialState

    from .config import check_choice
    from .distributed import outside_zero3_construction
    from .tasks import build_warm_model, make_arithmetic_dataset

    check_choice("task", task_args.task, TASKS)
    reward_names = task_args.reward_funcs or _task_reward_names(task_args.task)
    if not reward_names:
        raise SystemExit("topr-trl: --task custom needs --reward_funcs")
    reward_funcs = [resolve_reward(name) for name in reward_names]
    builtin_task = task_args.task == "arithmetic"
    if model_name_or_path is None and not builtin_task:
        raise SystemExit("topr-trl: --model_name_or_path is required outside the built-in task")
    if task_args.dry_run:
        return model_name_or_path, None, None, reward_funcs
    if model_name_or_path is None:
        state = PartialState()
        with state.main_process_first():
            if state.is_main_process:
                with outside_zero3_construction():
                    build_warm_model(task_args.base_model_dir, digits=task_args.task_digits,
                                     target_accuracy=task_args.warm_start_accuracy, seed=seed)
        model_name_or_path = task_args.base_model_dir
    eval_dataset = None
    if builtin_task:
        train_dataset = make_arithmetic_dataset(task_args.task_train_prompts, task_args.task_digits, seed=1)
        eval_dataset = make_arithmetic_dataset(task_args.task_eval_prompts, task_args.task_digits, seed=2)
    elif task_args.task == "gsm8k":
        from .datasets import load_gsm8k

        train_dataset = load_gsm8k(task_args.dataset_train_split, source=task_args.dataset_name or "openai/gsm8k",
                                   few_shot=task_args.few_shot)
    elif task_args.task == "math500":
        from .datasets import load_math500

        train_dataset = load_math500(source=task_args.dataset_name or "HuggingFaceH4/MATH-500",
                                     few_shot=task_args.few_shot)
    else:
        from datasets import load_dataset

        train_dataset = load_dataset(task_args.dataset_name, task_args.dataset_config,
                                     split=task_args.dataset_train_split)
    return model_name_or_path, train_dataset, eval_dataset, reward_funcs


def load_offline_data(source: str):
    """A dataset written by `topr-trl generate`: its local directory, or the Hub id it was pushed to."""
    from .offline import load_offline_dataset

    if Path(source).exists():
        return load_offline_dataset(source)
    if source.startswith((".", "/", "~")) or source.count("/") != 1:  # a path, not a Hub id `user/name`
        raise SystemExit(f"topr-trl: offline dataset {source!r} not found; write one with `topr-trl generate "
                         f"--output_dir {source}` or give the Hub id it was pushed to")
    from datasets import load_dataset

    return load_dataset(source, split="train")


def parse(argv: list[str], dataclass_types: tuple, prog: str, defaults: dict | None = None):
    """TRL's parser (`--config file.yaml`, then flags), refusing misspelt flags and YAML keys first."""
    from trl import TrlParser

    parser = TrlParser(dataclass_types, prog=prog)
    if defaults:
        parser.set_defaults(**{k: v for k, v in defaults.items()
                               if any(k == action.dest for action in parser._actions)})
    reject_unknown_flags(parser, argv)
    return parser.parse_args_and_config(argv)


def checkpoint_to_resume(training_args) -> str | None:
    """`--resume_from_checkpoint PATH`, or `true` for the last checkpoint in output_dir (None when there is none)."""
    from .distributed import last_checkpoint

    checkpoint = training_args.resume_from_checkpoint
    if str(checkpoint).lower() == "true":
        return last_checkpoint(training_args.output_dir)
    return checkpoint


def held_out_accuracy(trainer, eval_dataset) -> dict:
    """Greedy accuracy of the trainer's policy (gathered under ZeRO-3). Every process must call it."""
    from .distributed import evaluate_policy
    from .tasks import accuracy

    return evaluate_policy(trainer, lambda model, tokenizer: accuracy(model, tokenizer, eval_dataset))


def _print_main(accelerator_state, message: str) -> None:
    if accelerator_state.is_main_process:
        print(f"[topr-trl] {message}", flush=True)


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
    from accelerate import PartialState
    from trl import ModelConfig, get_peft_config

    from .config import TOPRConfig
    from .trainer import TOPRTrainer

    script_args, training_args, model_args = parse(argv, (TrainScriptArguments, TOPRConfig, ModelConfig),
                                                   "topr-trl train", TRAIN_DEFAULTS)
    model, train_dataset, eval_dataset, reward_funcs = load_task(script_args, model_args.model_name_or_path,
                                                                 training_args.seed)
    if script_args.offline_dataset is not None:
        from .offline import stored_reward

        if script_args.reward_funcs is None:  # the paper labels the data once, at generation
            reward_funcs = [stored_reward]
    if script_args.dry_run:
        print(f"[topr-trl] configuration valid: task={script_args.task} model={model} "
              f"loss_type={training_args.loss_type} limits={training_args.topr_limits} "
              f"rewards={[f.__name__ for f in reward_funcs]} offline_dataset={script_args.offline_dataset}")
        return {"dry_run": True}
    if script_args.offline_dataset is not None:
        train_dataset = load_offline_data(script_args.offline_dataset)

    trainer = TOPRTrainer(model=model, reward_funcs=reward_funcs, args=training_args, train_dataset=train_dataset,
                          peft_config=get_peft_config(model_args))
    state = PartialState()
    summary: dict = {}
    if eval_dataset is not None:
        summary["before"] = held_out_accuracy(trainer, eval_dataset)
        _print_main(state, f"held-out accuracy before training: {summary['before']}")
    trainer.train(resume_from_checkpoint=checkpoint_to_resume(training_args))
    if eval_dataset is not None:
        summary["after"] = held_out_accuracy(trainer, eval_dataset)
        _print_main(state, f"held-out accuracy after training:  {summary['after']}")
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        Path(training_args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(training_args.output_dir) / "topr_summary.json").write_text(json.dumps(summary, indent=2))
        _print_main(state, f"model and summary saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.offline_dataset or script_args.dataset_name)
    return summary


def generate(argv: list[str]) -> dict:
    from accelerate import PartialState
    from trl import ModelConfig

    from .config import check_choice
    from .offline import BACKENDS, generate_offline_dataset, proportion_of_positives

    options, model_args = parse(argv, (GenerateScriptArguments, ModelConfig), "topr-trl generate")
    check_choice("backend", options.backend, BACKENDS)
    model, prompts, _, reward_funcs = load_task(options, model_args.model_name_or_path, options.seed)
    if options.dry_run:
        print(f"[topr-trl] configuration valid: task={options.task} model={model} backend={options.backend} "
              f"num_generations={options.num_generations} rewards={[f.__name__ for f in reward_funcs]}")
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
    )
    summary = {"rows": len(dataset), "prompts": len(prompts), "proportion_of_positives":
               proportion_of_positives(dataset), "truncated_fraction": sum(dataset["truncated"]) / len(dataset),
               "output_dir": options.output_dir}
    print(f"[topr-trl] generated {summary['rows']} completions for {summary['prompts']} prompts into "
          f"{options.output_dir}: p={summary['proportion_of_positives']:.3f}, "
          f"truncated {summary['truncated_fraction']:.3f}", flush=True)
    return summary


def iterate(argv: list[str]) -> list[dict]:
    import torch
    from accelerate import PartialState
    from trl import ModelConfig

    from .config import TOPRConfig, check_choice
    from .iterate import IterationSettings, run_iterations
    from .offline import BACKENDS, COMPOSITIONS
    from .tasks import accuracy

    options, training_args, model_args = parse(argv, (IterateScriptArguments, TOPRConfig, ModelConfig),
                                               "topr-trl iterate", ITERATE_DEFAULTS)
    check_choice("composition", options.composition, COMPOSITIONS)
    check_choice("backend", options.backend, BACKENDS)
    model, prompts, held_out, reward_funcs = load_task(options, model_args.model_name_or_path, training_args.seed)
    if options.dry_run:
        print(f"[topr-trl] configuration valid: {options.iterations} iteration(s), composition="
              f"{options.composition}, model={model}, limits={training_args.topr_limits}")
        return []
    torch.manual_seed(training_args.seed)
    settings = IterationSettings(
        num_iterations=options.iterations, num_completions=training_args.num_generations,
        temperature=training_args.temperature, top_p=training_args.top_p, top_k=training_args.top_k or 0,
        max_new_tokens=training_args.max_completion_length, composition=options.composition,
        target_proportion=options.target_proportion, prompts_per_shard=options.prompts_per_shard,
        backend=options.backend, train_args=training_args,
    )
    evaluate = (lambda model, tokenizer: accuracy(model, tokenizer, held_out)) if held_out is not None else None
    summaries = run_iterations(model, prompts, reward_funcs, training_args.output_dir, settings, evaluate=evaluate)
    for summary in summaries:
        _print_main(PartialState(), f"iteration {summary['iteration']}: p={summary['proportion_of_positives']:.3f} "
                                    f"before={summary.get('evaluation_before')} after={summary.get('evaluation')}")
    return summaries


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .evaluate import main as evaluate_main

    commands = {
        "train": train,
        "generate": generate,
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
