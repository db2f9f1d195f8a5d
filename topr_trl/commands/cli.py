"""`topr-trl` (also `python -m topr_trl`): the command line.

    topr-trl train                      # tiny local model, built-in arithmetic task, CPU, about a minute
    topr-trl train --task reasoning     # the reasoning testbed (the paper's regime), CPU, a few minutes
    topr-trl train --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name prompts.jsonl \\
        --reward_funcs my_rewards:correctness   # your model, data and reward: TRL's GRPOConfig defaults + TOPR's
    topr-trl generate --num_generations 8            # an offline dataset sampled from mu, labelled
    topr-trl train --offline_dataset DIR_OR_FILE     # Algorithm 1: train on stored completions, no generation
    topr-trl iterate --iterations 2                  # generate, compose, train; mu_i = pi_{i-1}
    topr-trl evaluate --model_name_or_path outputs/topr-tiny-arithmetic --k 8   # sampled pass@1, pass@k, maj@k
    topr-trl vllm-serve --model MODEL                # a vLLM server for --use_vllm true --vllm_mode server (CPU or GPU)

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

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import AutoConfig, AutoTokenizer
from trl import get_peft_config

from ..config import check_choice
from ..curves import logged_curves, plot_curves
from ..distributed import end_process_group, gpu_available, say
from ..machine import describe_machine, machine_info
from ..offline import (
    COMPOSITIONS,
    generate_offline_dataset,
    load_offline_source,
    proportion_of_positives,
    stored_reward,
)
from ..offline.generation import GeneratedWithOtherSettings, recorded_model
from ..offline.held_out import HELD_OUT_SAMPLES, load_test_prompts
from ..offline.schema import StoredTokensMismatch, check_stored_tokens
from ..prompts import check_prompts_fit, model_positions
from ..sampling import BACKENDS
from ..sources import check_data_source, check_local_data
from ..tasks.loading import describe_accuracy, held_out_accuracy, load_task, task_evaluator
from ..tasks.user_rewards import weighted_reward
from ..trainer import TOPRTrainer
from ..vllm_server.command import serve
from .arguments import COMMANDS, build_parser, check_reward_weights, chosen_run, is_builtin_run, parse_command
from .evaluate import run as run_evaluate
from .iterations import IterationSettings, iteration_curves, run_iterations
from .output_folders import (
    SUMMARY_METRICS,
    InterruptAtStepEnd,
    LogLastStep,
    check_hub_push,
    check_trackers,
    check_vllm_server_mode,
    checkpoint_to_resume,
    interrupted,
    interrupted_run,
    last_logged,
    output_dir_lock,
    push_failure_reported,
    quiet_unmeasured_metrics,
    refuse_unusable_output_dir,
    refuse_used_output_dir,
    removed_if_left_empty,
    shown_path,
)


def _note_hardware(argv: list[str], training_args) -> None:
    """A custom run moved to the CPU by the hardware defaults says so (the built-in task is meant for the CPU)."""
    choice = chosen_run(argv)
    if not is_builtin_run(choice) and training_args.use_cpu and not choice.use_cpu and choice.bf16 is None:
        say("no GPU found: training on the CPU in fp32 (use_cpu=True, bf16=False)")


# ---------------------------------------------------------------------------------------------- commands
def train(argv: list[str]) -> dict:
    script_args, training_args, model_args = parse_command("train", argv)
    offline = script_args.offline_dataset is not None
    refuse_unusable_output_dir(training_args.output_dir)  # before what the folder holds: the lock's line first
    refuse_used_output_dir(training_args.output_dir, script_args.overwrite_output_dir,
                           bool(training_args.resume_from_checkpoint))
    check_trackers(training_args.report_to)
    if not script_args.dry_run:  # a dry run validates a recipe on a machine that may not reach the Hub or a GPU
        check_hub_push(training_args)
        check_vllm_server_mode(training_args)
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
    if offline_data is not None:  # the tokenizer only: before the policy's weights load
        check_offline_policy(script_args.offline_dataset, offline_data, model, model_args.model_name_or_path)
    if offline and script_args.reward_funcs is None:  # the paper labels the data once, at generation
        reward_funcs = [stored_reward]
    check_reward_weights(reward_funcs, training_args.reward_weights, argv)  # before any model loads, dry or not
    if script_args.asynchronous and training_args.reward_weights is not None:
        # TRL's asynchronous trainer has no reward_weights: each function carries its weight, and the workers' sum
        # of them is GRPO's weighted sum
        reward_funcs = [weighted_reward(function, weight)
                        for function, weight in zip(reward_funcs, training_args.reward_weights, strict=True)]
        training_args.reward_weights = None
    async_args = _asynchronous_config(script_args, training_args, model_args, eval_dataset) \
        if script_args.asynchronous else None
    if script_args.dry_run:
        if offline and Path(script_args.offline_dataset).expanduser().is_file():  # empty or unreadable: fail now
            check_local_data(script_args.offline_dataset, script_args.dataset_train_split, what="offline dataset",
                             one_split="train")
        print(f"[topr-trl] configuration valid: task={task} model={model or 'built-in tiny model'} "
              f"loss_type={training_args.loss_type} limits={training_args.topr_limits} "
              f"rewards={[f.__name__ for f in reward_funcs]} offline_dataset={script_args.offline_dataset} "
              f"output_dir={training_args.output_dir}"
              + (f" asynchronous: max_staleness={async_args.max_staleness} pipeline_steps="
                 f"{script_args.async_pipeline_steps} lag={script_args.async_lag}" if async_args else ""))
        return {"dry_run": True}
    if offline:
        train_dataset, eval_dataset = offline_data, offline_eval
    else:
        for dataset in (train_dataset, eval_dataset):
            check_fits_the_model(model, dataset, training_args.max_completion_length,
                                 training_args.chat_template_kwargs)
    _note_hardware(argv, training_args)

    output_dir = training_args.output_dir
    trainer = None
    with removed_if_left_empty(output_dir, lambda: trainer is None or not trainer.state.log_history), \
            output_dir_lock(output_dir):
        # again under the lock: a run that finished into this folder since the check above is not overwritten
        refuse_used_output_dir(output_dir, script_args.overwrite_output_dir, bool(training_args.resume_from_checkpoint))
        if async_args is not None:
            trainer = _asynchronous_trainer(script_args, async_args, model, reward_funcs, train_dataset,
                                            training_args.vllm_server_base_url)
        else:
            trainer = TOPRTrainer(model=model, reward_funcs=reward_funcs, args=training_args,
                                  train_dataset=train_dataset, eval_dataset=eval_dataset,
                                  peft_config=get_peft_config(model_args))
        trainer.add_callback(LogLastStep())
        quiet_unmeasured_metrics()
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
            raise interrupted_run("train", argv, output_dir) from None
        except USER_ERRORS:  # a lost vLLM server: its one line starts on a line of its own, not after the progress bar
            print(file=sys.stderr, flush=True)
            raise
        if held_out is not None:
            summary["after"] = held_out_accuracy(trainer, held_out, task)
            say(f"after training:  {describe_accuracy(summary['after'], len(held_out))}")
        summary["steps"] = trainer.state.global_step
        if async_args is not None:
            summary["asynchronous"] = _asynchronous_summary(trainer)
        summary["end_of_training"] = last_logged(trainer.state.log_history, SUMMARY_METRICS)
        if summary["end_of_training"]:
            say("at the end of training: " + ", ".join(
                f"{key} {value:.4g}" for key, value in summary["end_of_training"].items()))
        trainer.save_state()  # trainer_state.json: every logged value, from which the curves can be redrawn
        curves = None
        if trainer.accelerator.is_main_process:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            (Path(output_dir) / "topr_summary.json").write_text(json.dumps(summary, indent=2))
            curves = plot_curves(logged_curves(trainer.state.log_history), Path(output_dir) / "curves.png",
                                 f"topr-trl train: {shown_path(output_dir)} ({training_args.loss_type})")
        with push_failure_reported(output_dir, training_args.push_to_hub):
            trainer.save_model(output_dir)  # under --push_to_hub, TrainingArguments' save_model pushes the folder
            if not training_args.push_to_hub:  # (push_to_hub writes the card itself, naming the dataset too)
                data = script_args.offline_dataset or script_args.dataset_name
                if async_args is not None and data and Path(data).expanduser().exists():
                    data = None  # TRL's card would link a local path to the Hub; TOPRTrainer's names it as a path
                trainer.create_model_card(dataset_name=data)
            say(f"model and summary saved to {shown_path(output_dir)}")
            if curves:
                say(f"curves drawn to {shown_path(curves)} (TensorBoard: --report_to)")
            if training_args.push_to_hub:
                trainer.push_to_hub(dataset_name=script_args.offline_dataset or script_args.dataset_name)
    return summary


def check_fits_the_model(model: str, dataset, max_completion_length: int, chat_template_kwargs) -> None:
    """The prompts of `dataset` (None: nothing) are records the chat template takes and fit the model's positions
    with `max_completion_length` (`check_prompts_fit`), checked before any weight loads."""
    if dataset is None or "prompt" not in dataset.column_names:
        return
    positions = model_positions(AutoConfig.from_pretrained(model))
    try:
        check_prompts_fit(dataset["prompt"], AutoTokenizer.from_pretrained(model), positions, max_completion_length,
                          chat_template_kwargs)
    except ValueError as error:
        raise SystemExit(f"topr-trl: {error}") from None


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
            raise SystemExit(f"topr-trl: --offline_dataset {source} was sampled with "
                             f"{behaviour or 'another model'}'s tokenizer, not the built-in tiny model's: pass "
                             f"--model_name_or_path {behaviour or 'MODEL'} (or another model with its tokenizer) "
                             f"to train on it") from None
        raise SystemExit(f"topr-trl: --model_name_or_path {given}: {error}") from None
    if behaviour is not None and given is not None and not _same_model(behaviour, policy):
        say(f"the policy ({shown_path(policy)}) is another model than mu ({shown_path(behaviour)}, which sampled "
            f"--offline_dataset), with the same tokenizer: pi/mu starts where the two models differ, not at 1")


def _same_model(recorded: str, policy: str) -> bool:
    recorded_path, policy_path = Path(recorded).expanduser(), Path(policy).expanduser()
    if recorded_path.exists() and policy_path.exists():
        return recorded_path.resolve() == policy_path.resolve()
    return recorded == policy


def _asynchronous_config(script_args, training_args, model_args, eval_dataset):
    """`--asynchronous`: the run's TOPRConfig as an AsyncTOPRConfig, or a one-line exit saying what it cannot do."""
    refused = {"--offline_dataset": script_args.offline_dataset is not None, "--use_peft": model_args.use_peft,
               "an eval_strategy (TRL's asynchronous trainer has no evaluation loop)": eval_dataset is not None}
    for what, given in refused.items():
        if given:
            raise SystemExit(f"topr-trl: --asynchronous does not take {what}; drop it, or train without "
                             "--asynchronous.")
    from ..asynchronous.config import async_config_from  # noqa: PLC0415 - loads trl.experimental

    try:
        return async_config_from(training_args, max_staleness=script_args.async_max_staleness, token_budget=0,
                                 eval_strategy="no")
    except ValueError as error:
        raise SystemExit(f"topr-trl: --asynchronous: {error}") from None


def _asynchronous_trainer(script_args, async_args, model, reward_funcs, train_dataset, server_url=None):
    from ..asynchronous import AsyncTOPRTrainer  # noqa: PLC0415 - loads trl.experimental
    from ..asynchronous.stand_in import WorkerSettings, build_async_trainer  # noqa: PLC0415 - loads trl.experimental

    if server_url is not None:
        return _served_asynchronous_trainer(script_args, async_args, model, reward_funcs, train_dataset)

    say(f"asynchronous: the worker generates up to {script_args.async_pipeline_steps} steps ahead"
        + (f", {script_args.async_lag} policy versions behind" if script_args.async_lag else "")
        + ("" if async_args.keeps_every_sample else f"; samples over {async_args.max_staleness} versions old are "
           "dropped"))
    worker = WorkerSettings(lag=script_args.async_lag, seconds_per_sample=script_args.async_seconds_per_sample,
                            pipeline_steps=script_args.async_pipeline_steps)
    try:
        return build_async_trainer(AsyncTOPRTrainer, str(model), reward_funcs, async_args, train_dataset, worker)
    except ValueError as error:
        raise SystemExit(f"topr-trl: --asynchronous: {error}") from None


def _served_asynchronous_trainer(script_args, async_args, model, reward_funcs, train_dataset):
    """`--asynchronous --vllm_server_base_url URL`: TRL's own rollout worker generating on that server, which follows
    the policy through its weight path (gloo from `topr-trl vllm-serve` without a GPU, TRL's NCCL otherwise)."""
    from ..asynchronous import AsyncTOPRTrainer, with_response_template  # noqa: PLC0415 - loads trl.experimental

    stand_in = {"--async_lag": script_args.async_lag,
                "--async_seconds_per_sample": script_args.async_seconds_per_sample}
    if any(stand_in.values()):
        raise SystemExit(f"topr-trl: --asynchronous with --vllm_server_base_url generates on the server: "
                         f"{', '.join(flag for flag, value in stand_in.items() if value)} set(s) the in-process "
                         "stand-in worker only; drop it, or drop --vllm_server_base_url")
    tokenizer = with_response_template(AutoTokenizer.from_pretrained(model))
    step = async_args.per_device_train_batch_size * async_args.gradient_accumulation_steps * async_args.world_size
    if not gpu_available():  # vLLM's CPU engine can fail on many seeded requests at once ("CPU Generator does not
        async_args.max_inflight_tasks = step  # use offset"): one step's samples in flight
    say(f"asynchronous: TRL's rollout worker on the vLLM server at {async_args.vllm_server_base_url}, "
        f"{async_args.max_inflight_tasks} requests in flight")
    return AsyncTOPRTrainer(str(model), reward_funcs, async_args, train_dataset=train_dataset,
                            processing_class=tokenizer)


def _asynchronous_summary(trainer) -> dict:
    """What the asynchronous run trained on: samples per staleness, samples dropped (0 unless capped)."""
    counts = dict(sorted(trainer.staleness_counts.items()))
    dropped = sum(entry.get("sample/dropped_stale_total") or 0 for entry in trainer.state.log_history)
    read = sum(counts.values())
    mean = sum(k * v for k, v in counts.items()) / read if read else float("nan")
    say(f"asynchronous: {read} samples read, staleness mean {mean:.2f}, max {max(counts, default=0)} policy "
        f"versions; {dropped:g} dropped")
    return {"staleness_counts": {str(k): v for k, v in counts.items()}, "staleness_mean": mean, "dropped": dropped}


def generate(argv: list[str]) -> dict:
    options, model_args = parse_command("generate", argv)
    check_choice("backend", options.backend, BACKENDS)
    try:
        chat_template_kwargs = json.loads(options.chat_template_kwargs) if options.chat_template_kwargs else None
    except json.JSONDecodeError as error:
        raise SystemExit(f"topr-trl: --chat_template_kwargs must be a JSON object ({error})") from None
    model, task, prompts, _, _, reward_funcs = load_task(options, model_args.model_name_or_path, options.seed)
    check_reward_weights(reward_funcs, options.reward_weights, argv)
    if options.dry_run:
        print(f"[topr-trl] configuration valid: task={task} model={model or 'built-in tiny model'} "
              f"backend={options.backend} num_generations={options.num_generations} "
              f"rewards={[f.__name__ for f in reward_funcs]} output_dir={options.output_dir}")
        return {"dry_run": True}
    if not PartialState().is_main_process:  # sharded generation is resumable, not parallel: one process writes
        return {}

    if options.max_prompts is not None:
        prompts = prompts.select(range(min(options.max_prompts, len(prompts))))
    refuse_unusable_output_dir(options.output_dir)
    check_fits_the_model(model, prompts, options.max_completion_length, chat_template_kwargs)
    torch.manual_seed(options.seed)
    if options.overwrite_output_dir and any(Path(options.output_dir).glob("shard-*")):
        say(f"--overwrite_output_dir: deleting the earlier generation in {shown_path(options.output_dir)}")
    try:
        with removed_if_left_empty(options.output_dir), output_dir_lock(options.output_dir):
            dataset = generate_offline_dataset(
                model, AutoTokenizer.from_pretrained(model), prompts, reward_funcs, options.output_dir,
                num_completions=options.num_generations, temperature=options.temperature, top_p=options.top_p,
                top_k=options.top_k, max_new_tokens=options.max_completion_length,
                prompts_per_shard=options.prompts_per_shard, backend=options.backend, seed=options.seed,
                reward_weights=options.reward_weights,
                push_to_hub=options.push_to_hub, chat_template_kwargs=chat_template_kwargs,
                overwrite=options.overwrite_output_dir,
                # recorded in the manifest: a rerun on other prompts into this folder is refused, not resumed
                dataset_name=options.dataset_name or f"built-in {task} task",
                )
    except KeyboardInterrupt:
        raise interrupted(f"the shards written are kept in {shown_path(options.output_dir)}: rerun the same command "
                          "to resume") from None
    except GeneratedWithOtherSettings as refusal:  # named as the flags the user types
        raise GeneratedWithOtherSettings(
            refusal.output_dir, refusal.changes, command_line=True,
            ways_out="pass another --output_dir, or --overwrite_output_dir true to delete it and generate again",
        ) from None
    summary = {"rows": len(dataset), "prompts": len(prompts), "proportion_of_positives":
               proportion_of_positives(dataset), "truncated_fraction": sum(dataset["truncated"]) / len(dataset),
               "output_dir": options.output_dir, "machine": machine_info()}
    print(f"[topr-trl] generated {summary['rows']} completions for {summary['prompts']} prompts into "
          f"{options.output_dir}: p={summary['proportion_of_positives']:.3f} (share of positive rewards), "
          f"truncated {summary['truncated_fraction']:.3f}; on {describe_machine(summary['machine'])}", flush=True)
    return summary


def iterate(argv: list[str]) -> list[dict]:
    options, training_args, model_args = parse_command("iterate", argv)
    check_trackers(training_args.report_to)
    check_choice("composition", options.composition, COMPOSITIONS)
    check_choice("backend", options.backend, BACKENDS)
    model, task, prompts, held_out, _, reward_funcs = load_task(options, model_args.model_name_or_path,
                                                                training_args.seed)
    check_reward_weights(reward_funcs, training_args.reward_weights, argv)
    if options.dry_run:
        print(f"[topr-trl] configuration valid: {options.iterations} iteration(s), composition="
              f"{options.composition}, task={task}, model={model or 'built-in tiny model'}, "
              f"limits={training_args.topr_limits}, output_dir={training_args.output_dir}")
        return []
    refuse_unusable_output_dir(training_args.output_dir)
    check_fits_the_model(model, prompts, training_args.max_completion_length, training_args.chat_template_kwargs)
    _note_hardware(argv, training_args)
    torch.manual_seed(training_args.seed)
    iteration_settings = IterationSettings(
        num_iterations=options.iterations, num_completions=training_args.num_generations,
        temperature=training_args.temperature, top_p=training_args.top_p, top_k=training_args.top_k or 0,
        max_new_tokens=training_args.max_completion_length, composition=options.composition,
        target_proportion=options.target_proportion, prompts_per_shard=options.prompts_per_shard,
        backend=options.backend, train_args=training_args,
        dataset_name=options.dataset_name or f"built-in {task} task",  # recorded with each iteration's data
    )
    evaluate, unmeasured = (task_evaluator(task, held_out) if held_out is not None else None), None
    if task == "custom":  # the user's data: measured on its held-out split, when it has one
        held_out, unmeasured = load_test_prompts(options.dataset_name, options.dataset_test_split,
                                                 options.dataset_train_split, options.dataset_config, prompts)
        if held_out is not None:
            held_out = held_out.select(range(min(options.task_eval_prompts, len(held_out))))
            evaluate = task_evaluator(
                task, held_out, reward_funcs, reward_weights=training_args.reward_weights,
                num_samples=HELD_OUT_SAMPLES, temperature=training_args.temperature,
                top_p=training_args.top_p, top_k=training_args.top_k or 0,
                max_new_tokens=training_args.max_completion_length, seed=training_args.seed,
                chat_template_kwargs=getattr(training_args, "chat_template_kwargs", None))
            say(f"held-out measure: the first {len(held_out)} prompts (--task_eval_prompts) of the "
                f"{options.dataset_test_split!r} split, scored by --reward_funcs")
        else:
            unmeasured = (f"no test split: {unmeasured}. Pass --dataset_test_split SPLIT naming a held-out split "
                          "of --dataset_name to measure each iteration before and after")
    elif held_out is None:
        unmeasured = (f"--task {task} has no held-out measure in iterate: measure an iteration's model with "
                      f"`topr-trl evaluate --task {task} --model_name_or_path "
                      f"{shown_path(training_args.output_dir)}/iteration-000/model`")
    quiet_unmeasured_metrics()
    try:
        with removed_if_left_empty(training_args.output_dir), output_dir_lock(training_args.output_dir):
            summaries = run_iterations(model, prompts, reward_funcs, training_args.output_dir, iteration_settings,
                                       evaluate=evaluate, callbacks=[LogLastStep()])
    except KeyboardInterrupt:
        raise interrupted(f"finished iterations and the current one's checkpoints are kept in "
                          f"{shown_path(training_args.output_dir)}: rerun the same command to resume") from None
    except GeneratedWithOtherSettings as refusal:  # named as the flags the user types
        raise GeneratedWithOtherSettings(
            refusal.output_dir, refusal.changes, command_line=True,
            ways_out=f"pass another --output_dir, or delete {shown_path(refusal.output_dir.parent)} to redo that "
                     "iteration with these settings") from None
    problems = len(held_out) if held_out is not None else 0
    say(f"measured on {describe_machine()}")
    if unmeasured:
        say(unmeasured)
    for index, summary in enumerate(summaries):
        line = f"iteration {summary['iteration']}: p={summary['proportion_of_positives']:.3f}"
        if evaluate is not None:  # mu_i = pi_{i-1}: an iteration starts where the previous one ended
            before = summary.get("evaluation_before") or (summaries[index - 1].get("evaluation") if index else None)
            line += (f"; before: {describe_accuracy(before, problems)}; after: "
                     f"{describe_accuracy(summary.get('evaluation'), problems)}")
        say(line)
    if PartialState().is_main_process:
        curves, boundaries = iteration_curves(training_args.output_dir)
        drawn = plot_curves(curves, Path(training_args.output_dir) / "curves.png",
                            f"topr-trl iterate: {shown_path(training_args.output_dir)} (dashed: a new iteration)",
                            boundaries)
        if drawn:
            say(f"curves of every iteration drawn to {shown_path(drawn)}")
    return summaries


# What a user's input can raise before or during a run; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, ImportError, ConnectionError)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [argument for argument in argv if argument != "--debug"]
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        build_parser()[0].print_help()
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated")  # TRL's own default trips it

    if not gpu_available():  # DeepSpeed would guess the CPU, warning "Setting accelerator to CPU" on every command
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        run_command(argv[0], argv[1:])  # returns nothing: a console script exits 1 on a returned value
        end_process_group()
    except KeyboardInterrupt:  # Ctrl-C outside training (which says more: `interrupted_run`)
        if debug:
            raise
        raise interrupted("rerun the same command to start again (a train run that saved checkpoints continues "
                          "with --resume_from_checkpoint true)") from None
    except USER_ERRORS as error:
        if debug:
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        message = message if message.startswith("topr-trl:") else f"topr-trl: {message}"
        raise SystemExit(f"{message} (--debug shows the traceback)") from None


def run_command(command: str, argv: list[str]):
    if command == "evaluate":
        return run_evaluate(*parse_command("evaluate", argv))
    if command == "vllm-serve":
        parser = build_parser()[1]["vllm-serve"]
        if "-h" in argv or "--help" in argv or "--help-all" in argv:
            parser.print_help()
            raise SystemExit(0)
        return serve(*parser.parse_args_into_dataclasses(argv, return_remaining_strings=True))
    return {"train": train, "generate": generate, "iterate": iterate}[command](argv)


if __name__ == "__main__":
    main()
