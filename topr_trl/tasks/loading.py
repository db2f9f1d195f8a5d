"""What a run trains on, chosen and loaded for the command line: the task of a run (`resolve_task`), its training
prompts, held-out problems, evaluation set and reward functions (`load_task`), the built-in tiny model of a
built-in task (`builtin_model`), and how a built-in task's held-out problems are scored and reported
(`task_evaluator`, `held_out_accuracy`, `describe_accuracy`).

`options` is a command's task arguments (`TaskArguments` of the command line: task, dataset_name, dataset_config,
splits, few_shot, reward_funcs, task_digits, task_train_prompts, task_eval_prompts, warm_start_accuracy,
task_error_rate, base_model_dir, dry_run). A wrong choice fails in one line starting with `topr-trl:`.
"""

from __future__ import annotations

import time
from pathlib import Path

from accelerate import PartialState

from ..inputs.prompts import has_chat_template, untemplated_conversation
from ..inputs.sources import check_data_source, check_local_data, load_data_source, resolve_model_source
from ..offline.held_out import reward_evaluator
from ..runtime.distributed import evaluate_policy, outside_zero3_construction, say
from ..runtime.machine import describe_machine
from ..validation import check_choice
from .registry import BUILTIN_TASK, CUSTOM_TASK, TASKS, builtin_task_names, no_held_out_split, training_task_names
from .user_rewards import reporting_reward, resolve_reward


def resolve_task(options, model_name_or_path: str | None, offline: bool = False) -> str:
    """The task of the run, or a one-line exit saying what is missing."""
    task = options.task or (CUSTOM_TASK if options.dataset_name or (offline and model_name_or_path) else BUILTIN_TASK)
    check_choice("task", task, training_task_names())
    if model_name_or_path is None and not TASKS[task].builtin:
        what = f"--dataset_name {options.dataset_name}" if options.dataset_name else f"--task {task}"
        known = " and ".join(builtin_task_names())
        raise SystemExit(
            f"topr-trl: {what} selects a custom run, which needs --model_name_or_path (a Hub id or a "
            f"local model folder); the built-in tiny model knows only the {known} tasks"
        )
    if task == CUSTOM_TASK and not options.dataset_name and not offline:
        raise SystemExit(
            "topr-trl: a custom run needs --dataset_name (a Hub id or a local file with a `prompt` "
            "column) or --offline_dataset"
        )
    if model_name_or_path is not None and options.task is None and not options.dataset_name and not offline:
        raise SystemExit(
            f"topr-trl: --model_name_or_path {model_name_or_path} needs something to train on: "
            "--dataset_name FILE_OR_HUB_ID with --reward_funcs, --task "
            f"{'|'.join(name for name in training_task_names() if name != CUSTOM_TASK)}, or "
            "--offline_dataset"
        )
    if task == CUSTOM_TASK and not options.reward_funcs and not offline:
        raise SystemExit(
            "topr-trl: a custom dataset needs --reward_funcs (e.g. my_rewards:correctness, a function "
            "taking completions and the dataset's columns and returning one float per completion)"
        )
    return task


def load_task(options, model_name_or_path: str | None, seed: int, offline: bool = False, eval_split: bool = False):
    """(model, task, training prompts, held-out set of the built-in task or None, evaluation dataset for the trainer
    or None, reward functions) of the run. Without a model, builds the built-in tiny one (on the main process first
    under `accelerate launch`); with `dry_run`, validates and loads nothing."""
    task = resolve_task(options, model_name_or_path, offline)
    if model_name_or_path is None and TASKS[task].default_model is not None:  # a built-in task on a real model
        model_name_or_path = TASKS[task].default_model
    # before anything heavy, dry runs included (which convert nothing and do not ask the Hub)
    model_name_or_path = resolve_model_source(
        model_name_or_path, convert=not options.dry_run, ask_hub=not options.dry_run
    )
    check_data_source(options.dataset_name, "--dataset_name")
    reward_names = options.reward_funcs or list(TASKS[task].reward_funcs)
    # a user's function that raises stops the command in one line naming it (the Python API lets it raise as is)
    reward_funcs = [reporting_reward(resolve_reward(name)) for name in reward_names]
    if options.dry_run:
        if task == CUSTOM_TASK and options.dataset_name:  # an empty or unreadable file fails here, not steps in
            check_local_data(options.dataset_name, options.dataset_train_split, config=options.dataset_config)
            check_chat_prompts(model_name_or_path, options.dataset_name, options.dataset_train_split, options)
            if eval_split:  # a single file holds the training split only: no held-out rows to evaluate on
                try:
                    check_local_data(
                        options.dataset_name,
                        options.dataset_test_split or "test",
                        config=options.dataset_config,
                        one_split=options.dataset_train_split,
                    )
                except ValueError as error:
                    raise no_held_out_split(str(error)) from None
        return model_name_or_path, task, None, None, None, reward_funcs
    if model_name_or_path is None:
        model_name_or_path = builtin_model(task, options, seed)
    data = TASKS[task].training_data(options, eval_split)
    return model_name_or_path, task, data.train, data.held_out, data.evaluation, reward_funcs


def check_chat_prompts(model_name_or_path: str | None, dataset_name: str, split: str, options) -> None:
    """The dry run's look at what the chat template will be asked to render: conversational prompts for a local
    model whose tokenizer carries no chat template stop in one line (a real run checks every row once the tokenizer
    is loaded: `check_prompts_fit`)."""
    if model_name_or_path is None or has_chat_template(model_name_or_path) is not False:
        return
    if not Path(dataset_name).expanduser().exists():
        return  # a Hub dataset: read in the run
    rows = load_data_source(dataset_name, split, config=options.dataset_config, one_split=split)
    row = next((index for index, prompt in enumerate(rows["prompt"]) if isinstance(prompt, list)), None)
    if row is not None:
        raise SystemExit(f"topr-trl: {untemplated_conversation(row)}")


def builtin_model(task: str, options, seed: int) -> str:
    """The built-in tiny model of `task`: the shipped weights for the default settings (the same on every machine),
    else warm-started here once (on the main process first under `accelerate launch`, with progress); cached under
    --base_model_dir. Returns its folder."""
    tiny = TASKS[task].tiny_model(options, seed)
    folder, shipped, what = tiny.folder, tiny.shipped, tiny.what
    state = PartialState()
    with state.main_process_first():
        if state.is_main_process:
            fresh = not (folder / "config.json").exists()
            started = time.time()
            if fresh and shipped:
                say(f"installing the built-in tiny model's shipped weights into {folder}")
            elif fresh:  # seconds to minutes on an idle CPU, longer on a busy one: say what it is, and how far
                say(
                    f"building the built-in tiny model for these settings (once; cached in {folder}): "
                    f"{what}; on {describe_machine()}"
                )

            def progress(step: int, steps: int, loss: float) -> None:
                say(f"  warm start step {step}/{steps}, loss {loss:.3f}, {time.time() - started:.0f} s")

            with outside_zero3_construction():
                tiny.build(progress)
            if fresh and not shipped:
                say(f"built-in tiny model ready in {time.time() - started:.0f} s")
    return str(folder)


def task_evaluator(task: str, held_out, reward_funcs=None, **sampling):
    """How a task's held-out problems are scored, as `evaluate(model, tokenizer) -> dict`: greedy accuracy for
    arithmetic; for reasoning, sampled pass@1 (temperature 1, 4 samples per problem, the headline: greedy decoding
    hides the planted error) with greedy accuracy beside it; for a custom task (the user's prompts of a test split),
    the mean reward of `reward_funcs` on sampled completions (`topr_trl.offline.held_out.reward_evaluator`, given
    `sampling`: temperature, top_p, top_k, max_new_tokens, seed, chat_template_kwargs, num_samples)."""
    if task == CUSTOM_TASK:
        return reward_evaluator(held_out, reward_funcs, **sampling)
    return TASKS[task].held_out_evaluator(held_out)


def held_out_accuracy(trainer, held_out, task: str) -> dict:
    """The trainer's policy scored by `task_evaluator` (gathered under ZeRO-3). Every process must call it."""
    return evaluate_policy(trainer, task_evaluator(task, held_out))


def describe_accuracy(result: dict | None, num_problems: int) -> str:
    """'greedy accuracy 0.290 on 200 held-out problems': every accuracy printed says how it was measured."""
    if not result:
        return "not measured"
    if "mean_reward" in result:
        unscored = f", unscored {result['unscored_share']:.3f}" if result.get("unscored_share") else ""
        error = result.get("mean_reward_se")
        error = f" ± {error:.3f}" if error is not None and error == error else ""  # no SE from a single prompt
        return (
            f"mean reward {result['mean_reward']:.3f}{error}, reward > 0 on "
            f"{result['positive_share']:.3f}{unscored} (sampled at temperature {result['temperature']:g}, "
            f"{result['num_samples']} samples per prompt, at most {result['max_new_tokens']} new tokens), on "
            f"{num_problems} held-out prompts"
        )
    if "pass@1" in result:
        return (
            f"sampled pass@1 {result['pass@1']:.3f} ± {result['pass@1_problem_se']:.3f} (temperature "
            f"{result['temperature']:g}, {result['num_samples']} samples per problem), greedy accuracy "
            f"{result['greedy_accuracy']:.3f}, on {num_problems} held-out problems"
        )
    return f"greedy accuracy {result['accuracy']:.3f} on {num_problems} held-out problems"
