"""Iterated offline TOPR: mu_0 is the base model and mu_i = pi_{i-1}. Each iteration generates a dataset from
mu_i, composes it, trains one TOPR pass, evaluates and saves the model.

Layout under `output_dir`, one folder per iteration:

    iteration-000/data/         generated shards (resumable, see topr_trl.offline)
    iteration-000/train/        Trainer checkpoints (a killed run resumes from the last one)
    iteration-000/model/        the trained policy, mu of the next iteration
    iteration-000/summary.json  p of the composed data, evaluation, run times; written last: marks it done

A run restarted with the same arguments skips finished iterations and resumes the unfinished one where it
stopped: generation at the last complete shard, training at the last checkpoint. An unfinished iteration whose data
was generated with other settings (model, prompts, sampling) is refused rather than resumed on them.

It sits above the trainer and the offline modules it drives (`topr_trl.offline`: generation, composition,
the stored reward); `topr_trl.offline.held_out` measures iterations on the user's own data.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from accelerate import PartialState
from datasets import Dataset
from transformers import AutoTokenizer

from ..config import TOPRConfig
from ..offline import generation
from ..offline.composition import compose
from ..offline.generation import GeneratedWithOtherSettings
from ..offline.schema import stored_reward
from ..runtime.distributed import empty_caches, evaluate_policy, last_checkpoint, release_for_next_trainer
from ..runtime.machine import machine_info
from ..trainer import TOPRTrainer
from .curves import logged_curves


@dataclass
class IterationSettings:
    """What each iteration does. Training uses a copy of `train_args` (a TOPRConfig, e.g. from `topr-trl iterate
    --config`) with its output_dir moved into the iteration's folder, or else a TOPRConfig built from the generation
    settings and `train_overrides` (learning rate, batch size, ...)."""

    num_iterations: int = 2
    num_completions: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    composition: str = "uniform"
    target_proportion: float | None = None
    prompts_per_shard: int = 64
    save_steps: int = 50
    backend: str = "auto"
    train_overrides: dict = field(default_factory=dict)
    train_args: object | None = None  # a TOPRConfig; when given, each iteration trains with a copy of it
    dataset_name: str | None = None  # where the prompts come from, recorded with each iteration's data


def run_iterations(
    base_model: str,
    prompts: Dataset,
    reward_funcs: Callable | Sequence[Callable],
    output_dir: str | Path,
    settings: IterationSettings | None = None,
    evaluate: Callable[[object, object], dict] | None = None,
    callbacks: list | None = None,
) -> list[dict]:
    """Run (or resume) `settings.num_iterations` iterations; returns each iteration's summary. `evaluate(model,
    tokenizer)` runs on every process with the policy's full weights (gathered under ZeRO-3), before the first
    iteration and after each one."""
    output_dir = Path(output_dir)
    summaries: list[dict] = []
    behaviour_path = base_model
    settings = settings if settings is not None else IterationSettings()
    for iteration in range(settings.num_iterations):
        folder = output_dir / f"iteration-{iteration:03d}"
        summary_file = folder / "summary.json"
        if summary_file.exists():
            summaries.append(json.loads(summary_file.read_text()))
            behaviour_path = str(folder / "model")
            continue
        started = time.time()
        data = _iteration_data(behaviour_path, prompts, reward_funcs, folder, iteration, settings)
        data, proportion = compose(data, settings.composition, target_proportion=settings.target_proportion)
        args = _iteration_config(settings, folder)
        trainer = TOPRTrainer(
            model=behaviour_path, reward_funcs=stored_reward, args=args, train_dataset=data, callbacks=callbacks
        )
        before = evaluate_policy(trainer, evaluate) if evaluate and iteration == 0 else None
        trainer.train(resume_from_checkpoint=last_checkpoint(folder / "train"))
        trainer.save_model(str(folder / "model"))
        trainer.save_state()  # <folder>/train/trainer_state.json: the iteration's logged curves (`iteration_curves`)
        summary = {
            "iteration": iteration,
            "behaviour_model": behaviour_path,
            "rows": len(data),
            "proportion_of_positives": proportion,
            "composition": settings.composition,
            "train_steps": trainer.state.global_step,
            "seconds": time.time() - started,
            "machine": machine_info(),  # threads and CPU kernels change a CPU run's figures
        }
        if before is not None:
            summary["evaluation_before"] = before
        if evaluate:
            summary["evaluation"] = evaluate_policy(trainer, evaluate)
        if PartialState().is_main_process:
            summary_file.write_text(json.dumps(summary, indent=2))
        summaries.append(summary)
        behaviour_path = str(folder / "model")
        # the next iteration's generation (a vLLM engine, maybe) needs the memory the trainer holds
        release_for_next_trainer(trainer)
        del trainer
        empty_caches()
    return summaries


def _iteration_data(behaviour_path: str, prompts, reward_funcs, folder: Path, iteration: int, settings) -> Dataset:
    """Iteration `iteration`'s offline dataset, sampled from mu = `behaviour_path` into `folder / "data"` (resumed
    where shards are written)."""
    tokenizer = AutoTokenizer.from_pretrained(behaviour_path)
    # the main process generates; the others then find every shard written and only load them
    with PartialState().main_process_first():
        try:
            return generation.generate_offline_dataset(
                behaviour_path,
                tokenizer,
                prompts,
                reward_funcs,
                folder / "data",
                num_completions=settings.num_completions,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,
                max_new_tokens=settings.max_new_tokens,
                prompts_per_shard=settings.prompts_per_shard,
                backend=settings.backend,
                # mu samples from the prompt ids the trainer will replay (GRPOConfig's chat_template_kwargs)
                chat_template_kwargs=getattr(settings.train_args, "chat_template_kwargs", None),
                # the stored `reward` is what each iteration trains on: the weighted sum training would take
                reward_weights=getattr(settings.train_args, "reward_weights", None),
                dataset_name=settings.dataset_name,
            )
        except GeneratedWithOtherSettings as refusal:  # `iterate` has no --overwrite_output_dir: say its ways out
            raise GeneratedWithOtherSettings(
                refusal.output_dir,
                refusal.changes,
                ways_out=f"use another output_dir, or delete {folder} to redo iteration {iteration} with these "
                "settings",
            ) from None


def _iteration_config(settings: IterationSettings, folder: Path) -> TOPRConfig:
    """The config an iteration trains with: a copy of `settings.train_args` (else one built from `settings`) writing
    into `folder / "train"`, with the paper's R - c signal where composed data has no whole groups."""
    grouped = settings.composition == "uniform"
    if settings.train_args is not None:
        args = copy.deepcopy(settings.train_args)
        args.output_dir = str(folder / "train")
        args.reward_weights = None  # applied at generation: the stored `reward` is already the weighted sum
        if not grouped and args.topr_signal == "advantage":  # curated data has no whole groups: R - c
            args.topr_signal = "reward"
    else:
        config = dict(
            output_dir=str(folder / "train"),
            save_strategy="steps",
            save_steps=settings.save_steps,
            num_generations=settings.num_completions,
            max_completion_length=settings.max_new_tokens,
            temperature=settings.temperature,
            report_to="none",
        )
        if not grouped:  # curated data no longer has whole groups: the paper's R - c signal
            config.update(topr_signal="reward", topr_baseline=0.0)
        config.update(settings.train_overrides)
        args = TOPRConfig(**config)
    return args


def iteration_curves(output_dir: str | Path) -> tuple[dict, list[int]]:
    """The logged curves of every iteration in `output_dir`, one after another (each iteration's steps shifted by
    the steps before it), and the steps where iterations 1, 2, ... start: what `topr_trl.commands.curves.plot_curves`
    draws."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    boundaries, offset = [], 0
    for state_file in sorted(Path(output_dir).glob("iteration-*/train/trainer_state.json")):
        state = json.loads(state_file.read_text())
        if offset:
            boundaries.append(offset)
        for key, (steps, values) in logged_curves(state.get("log_history", []), step_offset=offset).items():
            curves.setdefault(key, ([], []))[0].extend(steps)
            curves[key][1].extend(values)
        offset += int(state.get("global_step", 0))
    return curves, boundaries
