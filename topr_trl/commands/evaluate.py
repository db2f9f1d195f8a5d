"""`topr-trl evaluate`: sample k completions per question of a task and report pass@1, pass@k, maj@k, the invalid
rate and bootstrap standard errors (`topr_trl.evaluation.runner.evaluate_model`), written to results.json and
results.png. The tasks: the built-in ones' held-out problems (`topr_trl.tasks`), GSM8K / MATH / MATH-500 with their
answer checkers (`topr_trl.evaluation`), or the user's prompts scored by the user's reward functions.

    topr-trl evaluate --model_name_or_path outputs/topr-tiny-arithmetic --task arithmetic --k 8 \\
        --output_dir outputs/eval
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from ..evaluation.runner import evaluate_model, json_safe, save_results
from ..generation.completions import BACKENDS
from ..inputs.sources import check_data_source, resolve_model_source
from ..runtime.machine import describe_machine, machine_info
from ..tasks.registry import BUILTIN_TASK, CUSTOM_TASK, ROW_COLUMN, TASKS
from ..tasks.user_rewards import reporting_reward, resolve_reward, reward_classifier
from ..validation import check_choice
from .arguments import parse_command


def _resolve_task(options) -> str:
    """The task: as given, or `custom` for a dataset with reward functions; one line refuses what cannot be meant."""
    task = options.task or (CUSTOM_TASK if options.dataset_name or options.reward_funcs else BUILTIN_TASK)
    if task == CUSTOM_TASK and not (options.dataset_name and options.reward_funcs):
        raise SystemExit(
            "topr-trl: evaluating your own prompts needs --dataset_name (a file or Hub id with a `prompt` "
            "column) and --reward_funcs (module:function, scoring each completion: > 0 counts as "
            "correct); or give --task gsm8k|math|math500 to use that benchmark's answer checker"
        )
    if TASKS[task].builtin and options.dataset_name:
        raise SystemExit(
            f"topr-trl: --task {task} makes its own held-out problems: drop --dataset_name, or evaluate "
            "your prompts with --reward_funcs (and no --task)"
        )
    if task != CUSTOM_TASK and options.reward_funcs:
        raise SystemExit(
            f"topr-trl: --task {task} scores with its own answer checker: drop --reward_funcs, or "
            "evaluate your prompts with --dataset_name and no --task"
        )
    return task


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`topr-trl evaluate --model_name_or_path PATH [--task arithmetic|gsm8k|math500|math] [--k 8] ...`: evaluate,
    print the summary as JSON, write `results.json` and `results.png` to `--output_dir`; returns the summary."""
    return run(*parse_command("evaluate", list(sys.argv[1:] if argv is None else argv)))


def run(options) -> dict[str, Any]:
    """Evaluate as `options` (`topr_trl.commands.arguments.EvaluateArguments`) say; returns the summary."""
    try:
        if options.task is not None:
            check_choice("task", options.task, tuple(TASKS))
        check_choice("backend", options.backend, BACKENDS)
    except ValueError as error:  # one line, also when called as topr_trl.commands.evaluate.main
        raise SystemExit(f"topr-trl: {error}") from None
    if options.limit is not None and options.limit < 1:
        raise SystemExit("topr-trl: --limit must be positive")
    options.task = _resolve_task(options)

    options.model_name_or_path = resolve_model_source(options.model_name_or_path)
    check_data_source(options.dataset_name, "--dataset_name")
    task = TASKS[options.task]
    dataset = task.evaluation_data(options)
    if options.limit is not None:
        dataset = dataset.select(range(min(options.limit, len(dataset))))

    tokenizer = AutoTokenizer.from_pretrained(options.tokenizer or options.model_name_or_path)
    classify, answer_column = task.classifier() if task.classifier is not None else None, "answer"
    if options.task == CUSTOM_TASK:
        functions = [reporting_reward(resolve_reward(name)) for name in options.reward_funcs]
        classify, answer_column = reward_classifier(functions, dataset), ROW_COLUMN
    result = evaluate_model(
        options.model_name_or_path,
        tokenizer,
        dataset,
        classify,
        k=options.k,
        answer_column=answer_column,
        num_samples=options.num_samples,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        max_new_tokens=options.max_completion_length or task.max_new_tokens(options.task_digits),
        batch_size=options.batch_size,
        seed=options.seed,
        show_progress=not options.no_progress,
        num_bootstrap=options.num_bootstrap,
        backend=options.backend,
        stop_strings=options.stop,
    )

    result.settings.update(task=options.task, machine=machine_info())
    if options.task == CUSTOM_TASK:
        result.settings.update(dataset=options.dataset_name, reward_funcs=options.reward_funcs)
        # the classifier needed the row's index; the user reads the row's own reference: every column the reward
        # functions read (an `answer`, a `solution`, ...)
        columns = [name for name in dataset.column_names if name not in ("prompt", ROW_COLUMN)]
        for record in result.records:
            row = dataset[int(record["reference"])]
            record["reference"] = json_safe({name: row[name] for name in columns})
    output_dir = Path(options.output_dir or f"outputs/eval-{options.task}")
    paths = save_results(result, output_dir, plot=not options.no_plot)
    summary = json_safe(result.summary())
    print(json.dumps(summary, indent=2), flush=True)
    how = "greedy" if options.temperature == 0 else f"sampled at temperature {options.temperature:g}"
    correct = "reward > 0" if options.task == CUSTOM_TASK else "correct answer"
    print(
        f"[topr-trl] pass@1 {result.pass_at_1:.3f} ({how}, {result.num_samples} samples per problem, "
        f"{correct}) on {result.num_prompts} problems; maj@{result.k} {result.maj_at_k:.3f}; on "
        f"{describe_machine(result.settings['machine'])}",
        flush=True,
    )
    print(
        f"[topr-trl] evaluation written to {paths['json']}" + (f" and {paths['plot']}" if "plot" in paths else ""),
        flush=True,
    )
    return summary


if __name__ == "__main__":
    main()
