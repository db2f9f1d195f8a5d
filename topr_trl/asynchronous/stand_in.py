"""One asynchronous run on this machine: a trainer of TRL's asynchronous family (TOPR's, or TRL's own on a CPU) fed by
the stand-in rollout worker, sampling from a second copy of the model. Used by `topr-trl train --asynchronous` and the
scripts that measure asynchrony (experiments/async_throughput.py, experiments/async_staleness.py)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoModelForCausalLM, AutoTokenizer

from .lagged_worker import LaggedRolloutWorker


@dataclass(frozen=True)
class WorkerSettings:
    """The stand-in worker of a run (see `LaggedRolloutWorker`): `lag` policy versions behind, at least
    `seconds_per_sample` per completion, in `lockstep` with the trainer (synchronous) or running up to
    `pipeline_steps` optimizer steps of samples ahead (asynchronous)."""

    lag: int = 0
    seconds_per_sample: float = 0.0
    lockstep: bool = False
    pipeline_steps: int = 4
    min_new_tokens: int = 0


def samples_per_step(args) -> int:
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size


def build_async_trainer(
    trainer_class,
    model: str,
    reward_funcs,
    args,
    train_dataset,
    worker: WorkerSettings,
    processing_class=None,
    callbacks=None,
):
    """`trainer_class(model, reward_funcs, args, ...)` with a `LaggedRolloutWorker` sampling from `model` loaded
    again, and its in-process weight transfer. `args.weight_sync_steps` optimizer steps make one policy version."""
    tokenizer = processing_class or AutoTokenizer.from_pretrained(model)
    step = samples_per_step(args)
    if step % args.num_generations:
        raise ValueError(
            f"per_device_train_batch_size x gradient_accumulation_steps x processes ({step}) must be a "
            f"multiple of num_generations ({args.num_generations}): the worker generates whole groups."
        )
    rollout_worker = LaggedRolloutWorker(
        AutoModelForCausalLM.from_pretrained(model),
        tokenizer,
        train_dataset,
        reward_funcs,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        lag=worker.lag,
        seconds_per_sample=worker.seconds_per_sample,
        lockstep=worker.lockstep,
        samples_per_version=step * args.weight_sync_steps,
        max_queued_samples=max(worker.pipeline_steps, 1) * step,
        chat_template_kwargs=args.chat_template_kwargs,
        generation_kwargs={"min_new_tokens": worker.min_new_tokens} if worker.min_new_tokens else None,
        seed=args.seed,
    )
    return trainer_class(
        model,
        reward_funcs,
        args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        rollout_worker=rollout_worker,
        weight_transfer=rollout_worker.weight_transfer(),
    )
