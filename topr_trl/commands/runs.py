"""What `train`, `generate` and `iterate` do with their parsed arguments: the checks, the task and model, the
trainer or the generation, the output folder, the summary. Each takes the dataclasses `parse_command` returns (TRL's
`main(script_args, training_args, model_args)` form), or ones built by hand, and reads nothing else of the command line:
what only the command line knows comes as an `Invocation` (`parse_command_line`), None from Python.

    script_args, training_args, model_args = parse_command("train", ["--task", "reasoning", "--max_steps", "5"])
    summary = train(script_args, training_args, model_args)
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import AutoConfig, AutoTokenizer, TrainerCallback
from trl import ModelConfig, get_peft_config

from ..config import TOPRConfig
from ..generation.completions import BACKENDS
from ..inputs.prompts import check_prompts_fit, model_positions, past_trained_context, rotary_context
from ..inputs.sources import check_data_source, check_local_data
from ..offline import (
    COMPOSITIONS,
    generate_offline_dataset,
    load_offline_source,
    proportion_of_positives,
    stored_reward,
)
from ..offline.generation import recorded_model
from ..offline.held_out import HELD_OUT_SAMPLES, load_test_prompts
from ..offline.schema import StoredTokensMismatch, check_stored_tokens
from ..runtime.distributed import gpu_available, say
from ..runtime.machine import describe_machine, machine_info
from ..tasks.loading import describe_accuracy, held_out_accuracy, load_task, task_evaluator
from ..tasks.user_rewards import weighted_reward
from ..trainer import TOPRTrainer
from ..validation import check_choice
from .arguments import GenerateScriptArguments, Invocation, IterateScriptArguments, TrainScriptArguments
from .curves import logged_curves, plot_curves
from .external_services import check_hub_push, check_trackers, check_vllm_server_mode, push_failure_reported
from .interruption import InterruptAtStepEnd, generation_ended_in_one_line, interrupted_run, rerun
from .iterations import IterationSettings, iteration_curves, run_iterations
from .output_folders import (
    checkpoint_to_resume,
    output_dir_lock,
    refuse_unresumable,
    refuse_unusable_output_dir,
    refuse_used_output_dir,
    removed_if_left_empty,
    shown_path,
)


# What a user's input can raise before or during a run; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, ImportError, ConnectionError)


def train(
    script_args: TrainScriptArguments,
    training_args: TOPRConfig,
    model_args: ModelConfig,
    invocation: Invocation | None = None,
) -> dict:
    """`topr-trl train`: TOPR on the task or data of `script_args` (online, offline with `offline_dataset`, or
    asynchronous), saving the model, `topr_summary.json` and the curves in `training_args.output_dir`; returns the
    summary (`{"dry_run": True}` for a dry run). `invocation`: what the command line knew (None from Python)."""
    offline = script_args.offline_dataset is not None
    _check_training_run(script_args, training_args)
    # Loaded before any model is built, so that a wrong path fails at once.
    offline_data = offline_eval = None
    if offline and not script_args.dry_run:
        offline_data = load_offline_source(script_args.offline_dataset, script_args.dataset_train_split)
        if training_args.eval_strategy != "no":  # the stored test split, replayed and scored as the eval set
            offline_eval = load_offline_source(script_args.offline_dataset, script_args.dataset_test_split)
    model, task, train_dataset, held_out, eval_dataset, reward_funcs = load_task(
        script_args,
        model_args.model_name_or_path,
        training_args.seed,
        offline=offline,
        eval_split=training_args.eval_strategy != "no",
    )
    if offline_data is not None:  # the tokenizer only: before the policy's weights load
        check_offline_policy(script_args.offline_dataset, offline_data, model, model_args.model_name_or_path)
    if offline and script_args.reward_funcs is None:  # the paper labels the data once, at generation
        reward_funcs = [stored_reward]
    # before any model loads, dry or not
    check_reward_weights(reward_funcs, training_args.reward_weights, invocation)
    if script_args.asynchronous and training_args.reward_weights is not None:
        # TRL's asynchronous trainer has no reward_weights: each function carries its weight, and the workers' sum
        # of them is GRPO's weighted sum
        reward_funcs = [
            weighted_reward(function, weight)
            for function, weight in zip(reward_funcs, training_args.reward_weights, strict=True)
        ]
        training_args.reward_weights = None
    async_args = (
        _asynchronous_config(script_args, training_args, model_args, eval_dataset) if script_args.asynchronous else None
    )
    if script_args.dry_run:
        _say_dry_run(script_args, training_args, task, model, reward_funcs, async_args)
        return {"dry_run": True}
    if offline:
        train_dataset, eval_dataset = offline_data, offline_eval
    else:
        for dataset in (train_dataset, eval_dataset):
            check_fits_the_model(
                model, dataset, training_args.max_completion_length, training_args.chat_template_kwargs
            )
    _note_hardware(invocation, training_args)

    output_dir = training_args.output_dir
    trainer = None
    with (
        removed_if_left_empty(output_dir, lambda: trainer is None or not trainer.state.log_history),
        output_dir_lock(output_dir),
    ):
        # again under the lock: a run that finished into this folder since the check above is not overwritten
        refuse_used_output_dir(output_dir, script_args.overwrite_output_dir, bool(training_args.resume_from_checkpoint))
        if async_args is not None:
            trainer = _asynchronous_trainer(
                script_args, async_args, model, reward_funcs, train_dataset, training_args.vllm_server_base_url
            )
        else:
            trainer = TOPRTrainer(
                model=model,
                reward_funcs=reward_funcs,
                args=training_args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                peft_config=get_peft_config(model_args),
            )
        summary = _trained(trainer, training_args, invocation, model, task, held_out)
        if async_args is not None:
            summary["asynchronous"] = _asynchronous_summary(trainer)
        _save_training_run(trainer, summary, script_args, training_args, asynchronous=async_args is not None)
    return summary


def _check_training_run(script_args: TrainScriptArguments, training_args: TOPRConfig) -> None:
    """The refusals `train` makes before it reads any data: the output folder, the trackers, the Hub push and the
    vLLM server (not in a dry run, which validates a recipe on a machine that may reach neither), the data path."""
    refuse_unusable_output_dir(training_args.output_dir)  # before what the folder holds: the lock's line first
    refuse_used_output_dir(
        training_args.output_dir, script_args.overwrite_output_dir, bool(training_args.resume_from_checkpoint)
    )
    refuse_unresumable(training_args)
    check_trackers(training_args.report_to)
    if not script_args.dry_run:
        check_hub_push(training_args)
        check_vllm_server_mode(training_args)
    check_data_source(script_args.offline_dataset, "--offline_dataset")


def _say_dry_run(script_args, training_args: TOPRConfig, task, model, reward_funcs, async_args) -> None:
    """A dry run's line: the recipe it validated (an empty or unreadable offline file fails here first)."""
    if script_args.offline_dataset and Path(script_args.offline_dataset).expanduser().is_file():
        check_local_data(
            script_args.offline_dataset, script_args.dataset_train_split, what="offline dataset", one_split="train"
        )
    asynchronous = (
        f" asynchronous: max_staleness={async_args.max_staleness} pipeline_steps="
        f"{script_args.async_pipeline_steps} lag={script_args.async_lag}"
        if async_args
        else ""
    )
    print(
        f"[topr-trl] configuration valid: task={task} model={model or 'built-in tiny model'} "
        f"loss_type={training_args.loss_type} limits={training_args.topr_limits} "
        f"rewards={[f.__name__ for f in reward_funcs]} offline_dataset={script_args.offline_dataset} "
        f"output_dir={training_args.output_dir}" + asynchronous
    )


def _trained(trainer, training_args: TOPRConfig, invocation: Invocation | None, model, task, held_out) -> dict:
    """Train `trainer` (interruptible at a step's end, resumable), with the held-out accuracy before and after where
    the task has held-out problems; returns the run's summary."""
    trainer.add_callback(LogLastStep())
    quiet_unmeasured_metrics()
    output_dir = training_args.output_dir
    summary: dict = {"output_dir": output_dir, "model": model, "task": task, "machine": machine_info()}
    say(f"measured on {describe_machine(summary['machine'])}")
    if held_out is not None:
        summary["held_out_problems"] = len(held_out)
        summary["before"] = held_out_accuracy(trainer, held_out, task)
        say(f"before training: {describe_accuracy(summary['before'], len(held_out))}")
    interrupt = InterruptAtStepEnd()
    trainer.add_callback(interrupt)
    try:
        with interrupt:
            trainer.train(resume_from_checkpoint=checkpoint_to_resume(training_args))
    except KeyboardInterrupt:
        raise interrupted_run(output_dir, invocation) from None
    except USER_ERRORS:  # a lost vLLM server: its one line starts on a line of its own, not after the progress bar
        print(file=sys.stderr, flush=True)
        raise
    if held_out is not None:
        summary["after"] = held_out_accuracy(trainer, held_out, task)
        say(f"after training:  {describe_accuracy(summary['after'], len(held_out))}")
    summary["steps"] = trainer.state.global_step
    return summary


def _save_training_run(trainer, summary: dict, script_args, training_args: TOPRConfig, asynchronous: bool) -> None:
    """The end of a run: the last logged metrics into `summary`, the trainer state, topr_summary.json and the curves
    (main process), the model and its card, and the push to the Hub where asked."""
    output_dir = training_args.output_dir
    summary["end_of_training"] = last_logged(trainer.state.log_history, SUMMARY_METRICS)
    if summary["end_of_training"]:
        say(
            "at the end of training: "
            + ", ".join(f"{key} {value:.4g}" for key, value in summary["end_of_training"].items())
        )
    trainer.save_state()  # trainer_state.json: every logged value, from which the curves can be redrawn
    curves = None
    if trainer.accelerator.is_main_process:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "topr_summary.json").write_text(json.dumps(summary, indent=2))
        curves = plot_curves(
            logged_curves(trainer.state.log_history),
            Path(output_dir) / "curves.png",
            f"topr-trl train: {shown_path(output_dir)} ({training_args.loss_type})",
        )
    with push_failure_reported(output_dir, training_args.push_to_hub):
        trainer.save_model(output_dir)  # under --push_to_hub, TrainingArguments' save_model pushes the folder
        if not training_args.push_to_hub:  # (push_to_hub writes the card itself, naming the dataset too)
            data = script_args.offline_dataset or script_args.dataset_name
            if asynchronous and data and Path(data).expanduser().exists():
                data = None  # TRL's card would link a local path to the Hub; TOPRTrainer's names it as a path
            trainer.create_model_card(dataset_name=data)
        say(f"model and summary saved to {shown_path(output_dir)}")
        if curves:
            say(f"curves drawn to {shown_path(curves)} (TensorBoard: --report_to)")
        if training_args.push_to_hub:
            trainer.push_to_hub(dataset_name=script_args.offline_dataset or script_args.dataset_name)


def generate(
    script_args: GenerateScriptArguments, model_args: ModelConfig, invocation: Invocation | None = None
) -> dict:
    """`topr-trl generate`: an offline dataset sampled from mu (the model) on the task's prompts, labelled by its
    rewards, written in resumable shards to `script_args.output_dir`; returns the summary (`{"dry_run": True}` for a
    dry run). `invocation`: what the command line knew (None from Python)."""
    check_choice("backend", script_args.backend, BACKENDS)
    given_kwargs = script_args.chat_template_kwargs
    try:
        chat_template_kwargs = json.loads(given_kwargs) if given_kwargs else None
    except json.JSONDecodeError as error:
        raise SystemExit(f"topr-trl: --chat_template_kwargs must be a JSON object ({error})") from None
    model, task, prompts, _, _, reward_funcs = load_task(script_args, model_args.model_name_or_path, script_args.seed)
    check_reward_weights(reward_funcs, script_args.reward_weights, invocation)
    if script_args.dry_run:
        print(
            f"[topr-trl] configuration valid: task={task} model={model or 'built-in tiny model'} "
            f"backend={script_args.backend} num_generations={script_args.num_generations} "
            f"rewards={[f.__name__ for f in reward_funcs]} output_dir={script_args.output_dir}"
        )
        return {"dry_run": True}
    if not PartialState().is_main_process:  # sharded generation is resumable, not parallel: one process writes
        return {}

    if script_args.max_prompts is not None:
        prompts = prompts.select(range(min(script_args.max_prompts, len(prompts))))
    refuse_unusable_output_dir(script_args.output_dir)
    check_fits_the_model(model, prompts, script_args.max_completion_length, chat_template_kwargs)
    torch.manual_seed(script_args.seed)
    if script_args.overwrite_output_dir and any(Path(script_args.output_dir).glob("shard-*")):
        say(f"--overwrite_output_dir: deleting the earlier generation in {shown_path(script_args.output_dir)}")
    with (
        generation_ended_in_one_line(
            kept=f"the shards written are kept in {shown_path(script_args.output_dir)}: "
            f"{rerun('generate', invocation)} to resume",
            ways_out=lambda _: (
                "pass another --output_dir, or --overwrite_output_dir true to delete it and generate again"
            ),
        ),
        removed_if_left_empty(script_args.output_dir),
        output_dir_lock(script_args.output_dir),
    ):
        dataset = generate_offline_dataset(
            model,
            AutoTokenizer.from_pretrained(model),
            prompts,
            reward_funcs,
            script_args.output_dir,
            num_completions=script_args.num_generations,
            temperature=script_args.temperature,
            top_p=script_args.top_p,
            top_k=script_args.top_k,
            max_new_tokens=script_args.max_completion_length,
            prompts_per_shard=script_args.prompts_per_shard,
            backend=script_args.backend,
            seed=script_args.seed,
            reward_weights=script_args.reward_weights,
            push_to_hub=script_args.push_to_hub,
            chat_template_kwargs=chat_template_kwargs,
            overwrite=script_args.overwrite_output_dir,
            # recorded in the manifest: a rerun on other prompts into this folder is refused, not resumed
            dataset_name=script_args.dataset_name or f"built-in {task} task",
        )
    return _generation_summary(dataset, len(prompts), script_args.output_dir)


def _generation_summary(dataset, num_prompts: int, output_dir: str) -> dict:
    """What `generate` made (rows, prompts, p, the truncated share, the machine), said in one line."""
    summary = {
        "rows": len(dataset),
        "prompts": num_prompts,
        "proportion_of_positives": proportion_of_positives(dataset),
        "truncated_fraction": sum(dataset["truncated"]) / len(dataset),
        "output_dir": output_dir,
        "machine": machine_info(),
    }
    print(
        f"[topr-trl] generated {summary['rows']} completions for {summary['prompts']} prompts into "
        f"{output_dir}: p={summary['proportion_of_positives']:.3f} (share of positive rewards), "
        f"truncated {summary['truncated_fraction']:.3f}; on {describe_machine(summary['machine'])}",
        flush=True,
    )
    return summary


def iterate(
    script_args: IterateScriptArguments,
    training_args: TOPRConfig,
    model_args: ModelConfig,
    invocation: Invocation | None = None,
) -> list[dict]:
    """`topr-trl iterate`: iterated offline TOPR (Algorithm 1, mu_i = pi_{i-1}) into `training_args.output_dir`,
    resuming a folder that holds some of it; returns each iteration's summary (`[]` for a dry run). `invocation`:
    what the command line knew (None from Python)."""
    check_trackers(training_args.report_to)
    check_choice("composition", script_args.composition, COMPOSITIONS)
    check_choice("backend", script_args.backend, BACKENDS)
    model, task, prompts, held_out, _, reward_funcs = load_task(
        script_args, model_args.model_name_or_path, training_args.seed
    )
    check_reward_weights(reward_funcs, training_args.reward_weights, invocation)
    if script_args.dry_run:
        print(
            f"[topr-trl] configuration valid: {script_args.iterations} iteration(s), composition="
            f"{script_args.composition}, task={task}, model={model or 'built-in tiny model'}, "
            f"limits={training_args.topr_limits}, output_dir={training_args.output_dir}"
        )
        return []
    refuse_unusable_output_dir(training_args.output_dir)
    check_fits_the_model(model, prompts, training_args.max_completion_length, training_args.chat_template_kwargs)
    _note_hardware(invocation, training_args)
    torch.manual_seed(training_args.seed)
    iteration_settings = IterationSettings(
        num_iterations=script_args.iterations,
        num_completions=training_args.num_generations,
        temperature=training_args.temperature,
        top_p=training_args.top_p,
        top_k=training_args.top_k or 0,
        max_new_tokens=training_args.max_completion_length,
        composition=script_args.composition,
        target_proportion=script_args.target_proportion,
        prompts_per_shard=script_args.prompts_per_shard,
        backend=script_args.backend,
        train_args=training_args,
        dataset_name=script_args.dataset_name or f"built-in {task} task",  # recorded with each iteration's data
    )
    held_out, evaluate, unmeasured = _iteration_measure(
        script_args, training_args, task, prompts, held_out, reward_funcs
    )
    quiet_unmeasured_metrics()
    with (
        generation_ended_in_one_line(
            kept=f"finished iterations and the current one's checkpoints are kept in "
            f"{shown_path(training_args.output_dir)}: {rerun('iterate', invocation)} to resume",
            ways_out=lambda iteration: (
                f"pass another --output_dir, or delete {shown_path(iteration.parent)} to redo "
                "that iteration with these settings"
            ),
        ),
        removed_if_left_empty(training_args.output_dir),
        output_dir_lock(training_args.output_dir),
    ):
        summaries = run_iterations(
            model,
            prompts,
            reward_funcs,
            training_args.output_dir,
            iteration_settings,
            evaluate=evaluate,
            callbacks=[LogLastStep()],
        )
    _report_iterations(summaries, training_args.output_dir, held_out, evaluate is not None, unmeasured)
    return summaries


def _iteration_measure(script_args, training_args: TOPRConfig, task, prompts, held_out, reward_funcs):
    """The held-out problems `iterate` measures each iteration on, the measure, and the line saying why there is none
    (None when there is): a built-in task's own measure; the user's data's test split, scored by its rewards."""
    evaluate, unmeasured = (task_evaluator(task, held_out) if held_out is not None else None), None
    if task == "custom":  # the user's data: measured on its held-out split, when it has one
        held_out, unmeasured = load_test_prompts(
            script_args.dataset_name,
            script_args.dataset_test_split,
            script_args.dataset_train_split,
            script_args.dataset_config,
            prompts,
        )
        if held_out is not None:
            held_out = held_out.select(range(min(script_args.task_eval_prompts, len(held_out))))
            evaluate = task_evaluator(
                task,
                held_out,
                reward_funcs,
                reward_weights=training_args.reward_weights,
                num_samples=HELD_OUT_SAMPLES,
                temperature=training_args.temperature,
                top_p=training_args.top_p,
                top_k=training_args.top_k or 0,
                max_new_tokens=training_args.max_completion_length,
                seed=training_args.seed,
                chat_template_kwargs=getattr(training_args, "chat_template_kwargs", None),
            )
            say(
                f"held-out measure: the first {len(held_out)} prompts (--task_eval_prompts) of the "
                f"{script_args.dataset_test_split!r} split, scored by --reward_funcs"
            )
        else:
            unmeasured = (
                f"no test split: {unmeasured}. Pass --dataset_test_split SPLIT naming a held-out split "
                "of --dataset_name to measure each iteration before and after"
            )
    elif held_out is None:
        unmeasured = (
            f"--task {task} has no held-out measure in iterate: measure an iteration's model with "
            f"`topr-trl evaluate --task {task} --model_name_or_path "
            f"{shown_path(training_args.output_dir)}/iteration-000/model`"
        )
    return held_out, evaluate, unmeasured


def _report_iterations(summaries: list[dict], output_dir: str, held_out, measured: bool, unmeasured) -> None:
    """Each iteration's line (p, held-out accuracy before and after where `measured`) and the curves of them all."""
    problems = len(held_out) if held_out is not None else 0
    say(f"measured on {describe_machine()}")
    if unmeasured:
        say(unmeasured)
    for index, summary in enumerate(summaries):
        line = f"iteration {summary['iteration']}: p={summary['proportion_of_positives']:.3f}"
        if measured:  # mu_i = pi_{i-1}: an iteration starts where the previous one ended
            before = summary.get("evaluation_before") or (summaries[index - 1].get("evaluation") if index else None)
            line += (
                f"; before: {describe_accuracy(before, problems)}; after: "
                f"{describe_accuracy(summary.get('evaluation'), problems)}"
            )
        say(line)
    if PartialState().is_main_process:
        curves, boundaries = iteration_curves(output_dir)
        drawn = plot_curves(
            curves,
            Path(output_dir) / "curves.png",
            f"topr-trl iterate: {shown_path(output_dir)} (dashed: a new iteration)",
            boundaries,
        )
        if drawn:
            say(f"curves of every iteration drawn to {shown_path(drawn)}")


# ---------------------------------------------------------------------------------------------- checks
def check_reward_weights(reward_funcs: list, reward_weights: list[float] | None, invocation: Invocation | None) -> None:
    """One weight per reward function, which GRPOTrainer checks only when it is built: a dry run checks it too, in
    the user's words (a flag, a key of the config file, or from Python the field)."""
    if reward_weights is None or len(reward_weights) == len(reward_funcs):
        return
    names = ", ".join(getattr(function, "__name__", "reward") for function in reward_funcs)
    given = "reward_weights"
    if invocation is not None:
        given = "--reward_weights" if "reward_weights" in invocation.flags else f"{given} (set in the config file)"
    raise SystemExit(
        f"topr-trl: {given} gives {len(reward_weights)} weight(s) for {len(reward_funcs)} reward "
        f"function(s) ({names}): give one weight per reward function, in the order of reward_funcs, "
        "or no weights (all 1)"
    )


def _note_hardware(invocation: Invocation | None, training_args: TOPRConfig) -> None:
    """A custom command-line run moved to the CPU by the hardware defaults says so (the built-in task is meant for
    the CPU); a run called from Python chose its settings itself."""
    if invocation is not None and invocation.moved_to_the_cpu() and training_args.use_cpu:
        say("no GPU found: training on the CPU in fp32 (use_cpu=True, bf16=False)")


def check_fits_the_model(model: str, dataset, max_completion_length: int, chat_template_kwargs) -> None:
    """The prompts of `dataset` (None: nothing) are records the chat template takes and fit the model's positions
    with `max_completion_length` (`check_prompts_fit`), checked before any weight loads."""
    if dataset is None or "prompt" not in dataset.column_names:
        return
    config, tokenizer = AutoConfig.from_pretrained(model), AutoTokenizer.from_pretrained(model)
    try:
        check_prompts_fit(
            dataset["prompt"], tokenizer, model_positions(config), max_completion_length, chat_template_kwargs
        )
    except ValueError as error:
        raise SystemExit(f"topr-trl: {error}") from None
    context = rotary_context(config)
    if context is not None:
        warning = past_trained_context(
            dataset["prompt"], tokenizer, context, max_completion_length, chat_template_kwargs
        )
        if warning:
            say(warning)


def check_offline_policy(source: str, data, policy: str, given: str | None) -> None:
    """An offline dataset's stored completion ids must be the policy's tokens (`check_stored_tokens`): without a
    model named, a one-line exit asking for one (the built-in tiny model, taken by default, reads other tokens);
    with one, the check's one line. A policy with mu's tokenizer that is another model than the one the manifest
    records as mu is legitimate, and said: pi/mu then starts away from 1."""
    tokenizer = AutoTokenizer.from_pretrained(policy)
    behaviour = recorded_model(source)
    try:
        check_stored_tokens(data, tokenizer)
    except StoredTokensMismatch as error:
        if given is None:
            raise SystemExit(
                f"topr-trl: --offline_dataset {source} was sampled with "
                f"{behaviour or 'another model'}'s tokenizer, not the built-in tiny model's: pass "
                f"--model_name_or_path {behaviour or 'MODEL'} (or another model with its tokenizer) "
                f"to train on it"
            ) from None
        raise SystemExit(f"topr-trl: --model_name_or_path {given}: {error}") from None
    if behaviour is not None and given is not None and not _same_model(behaviour, policy):
        say(
            f"the policy ({shown_path(policy)}) is another model than mu ({shown_path(behaviour)}, which sampled "
            f"--offline_dataset), with the same tokenizer: pi/mu starts where the two models differ, not at 1"
        )


def _same_model(recorded: str, policy: str) -> bool:
    recorded_path, policy_path = Path(recorded).expanduser(), Path(policy).expanduser()
    if recorded_path.exists() and policy_path.exists():
        return recorded_path.resolve() == policy_path.resolve()
    return recorded == policy


def _asynchronous_config(script_args, training_args, model_args, eval_dataset):
    """`--asynchronous`: the run's TOPRConfig as an AsyncTOPRConfig, or a one-line exit saying what it cannot do."""
    refused = {
        "--offline_dataset": script_args.offline_dataset is not None,
        "--use_peft": model_args.use_peft,
        "an eval_strategy (TRL's asynchronous trainer has no evaluation loop)": eval_dataset is not None,
    }
    for what, given in refused.items():
        if given:
            raise SystemExit(
                f"topr-trl: --asynchronous does not take {what}; drop it, or train without --asynchronous."
            )
    from ..asynchronous.config import async_config_from  # noqa: PLC0415 - loads trl.experimental

    try:
        return async_config_from(
            training_args, max_staleness=script_args.async_max_staleness, token_budget=0, eval_strategy="no"
        )
    except ValueError as error:
        raise SystemExit(f"topr-trl: --asynchronous: {error}") from None


def _asynchronous_trainer(script_args, async_args, model, reward_funcs, train_dataset, server_url=None):
    from ..asynchronous import AsyncTOPRTrainer  # noqa: PLC0415 - loads trl.experimental
    from ..asynchronous.stand_in import WorkerSettings, build_async_trainer  # noqa: PLC0415 - loads trl.experimental

    if server_url is not None:
        return _served_asynchronous_trainer(script_args, async_args, model, reward_funcs, train_dataset)

    say(
        f"asynchronous: the worker generates up to {script_args.async_pipeline_steps} steps ahead"
        + (f", {script_args.async_lag} policy versions behind" if script_args.async_lag else "")
        + (
            ""
            if async_args.keeps_every_sample
            else f"; samples over {async_args.max_staleness} versions old are dropped"
        )
    )
    worker = WorkerSettings(
        lag=script_args.async_lag,
        seconds_per_sample=script_args.async_seconds_per_sample,
        pipeline_steps=script_args.async_pipeline_steps,
    )
    try:
        return build_async_trainer(AsyncTOPRTrainer, str(model), reward_funcs, async_args, train_dataset, worker)
    except ValueError as error:
        raise SystemExit(f"topr-trl: --asynchronous: {error}") from None


def _served_asynchronous_trainer(script_args, async_args, model, reward_funcs, train_dataset):
    """`--asynchronous --vllm_server_base_url URL`: TRL's own rollout worker generating on that server, which follows
    the policy through its weight path (gloo from `topr-trl vllm-serve` without a GPU, TRL's NCCL otherwise)."""
    from ..asynchronous import AsyncTOPRTrainer, with_response_template  # noqa: PLC0415 - loads trl.experimental

    stand_in = {
        "--async_lag": script_args.async_lag,
        "--async_seconds_per_sample": script_args.async_seconds_per_sample,
    }
    if any(stand_in.values()):
        raise SystemExit(
            f"topr-trl: --asynchronous with --vllm_server_base_url generates on the server: "
            f"{', '.join(flag for flag, value in stand_in.items() if value)} set(s) the in-process "
            "stand-in worker only; drop it, or drop --vllm_server_base_url"
        )
    tokenizer = with_response_template(AutoTokenizer.from_pretrained(model))
    step = async_args.per_device_train_batch_size * async_args.gradient_accumulation_steps * async_args.world_size
    if not gpu_available():  # vLLM's CPU engine can fail on many seeded requests at once ("CPU Generator does not
        async_args.max_inflight_tasks = step  # use offset"): one step's samples in flight
    say(
        f"asynchronous: TRL's rollout worker on the vLLM server at {async_args.vllm_server_base_url}, "
        f"{async_args.max_inflight_tasks} requests in flight"
    )
    return AsyncTOPRTrainer(
        str(model), reward_funcs, async_args, train_dataset=train_dataset, processing_class=tokenizer
    )


def _asynchronous_summary(trainer) -> dict:
    """What the asynchronous run trained on: samples per staleness, samples dropped (0 unless capped)."""
    counts = dict(sorted(trainer.staleness_counts.items()))
    dropped = sum(entry.get("sample/dropped_stale_total") or 0 for entry in trainer.state.log_history)
    read = sum(counts.values())
    mean = sum(k * v for k, v in counts.items()) / read if read else float("nan")
    say(
        f"asynchronous: {read} samples read, staleness mean {mean:.2f}, max {max(counts, default=0)} policy "
        f"versions; {dropped:g} dropped"
    )
    return {"staleness_counts": {str(k): v for k, v in counts.items()}, "staleness_mean": mean, "dropped": dropped}


# ---------------------------------------------------------------------------------------------- what a run reports
# The last logged value of each, for the summary of a run (p~ only under topr_signal="reward").
SUMMARY_METRICS = (
    "loss",
    "reward",
    "reward_std",
    "topr/effective_positive_proportion",
    "topr/positive_fraction",
    "topr/negative_truncated_fraction",
    "eval_reward",
)


def last_logged(log_history: list[dict], keys) -> dict:
    """The last value logged under each of `keys` (those never logged are left out)."""
    found = {}
    for entry in log_history:
        for key in keys:
            value = entry.get(key)
            if isinstance(value, (int, float)) and value == value:  # NaN is "not measured"
                found[key] = float(value)
    return found


class LogLastStep(TrainerCallback):
    """Logs the last step whatever `logging_steps` is, so that a run shorter than the logging interval (or one that
    ends between two logs) still reports its last loss, reward and TOPR's metrics."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_log = True
        return control


class _UnmeasuredMetricFilter(logging.Filter):
    """TRL logs a metric that no sample measured at a step (TOPR's ratios of a batch without negatives, a reward no
    completion could be given) as None; TensorBoard's callback then warns once per such key at every log, which says
    nothing a user can act on and buries the run's own lines. Only those warnings are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "of type <class 'NoneType'>" not in record.getMessage()


def quiet_unmeasured_metrics() -> None:
    """Drop those warnings (once per process: a second call adds nothing)."""
    integrations = logging.getLogger("transformers.integrations.integration_utils")
    if not any(isinstance(existing, _UnmeasuredMetricFilter) for existing in integrations.filters):
        integrations.addFilter(_UnmeasuredMetricFilter())
