"""`EvaluationCallback`: held-out pass@1, maj@k and invalid rate during training, logged like any metric.

    from topr_trl.evaluation.callbacks import EvaluationCallback
    from topr_trl.evaluation.runner import gsm8k_classify

    trainer = TOPRTrainer(model=..., reward_funcs=..., args=args, train_dataset=train)
    trainer.add_callback(EvaluationCallback(held_out, gsm8k_classify, trainer=trainer, eval_steps=50, k=4))
    trainer.train()   # log_history (and wandb, tensorboard, ...) get eval/pass@1, eval/invalid_rate, ...

Multi-process: the evaluation runs on the main process only (rank 0, on the unwrapped model, every prompt);
the other processes skip it and wait for rank 0 at the next collective operation, so keep the held-out set
small enough for that wait (the default distributed timeout is 30 minutes). The metrics therefore appear in
rank 0's `log_history` (which is the one reporters and checkpoints use). DeepSpeed ZeRO-3, whose sharded
parameters can only be gathered by all processes together, is not supported and raises at train begin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled

from .runner import EvaluationResult, evaluate_model, save_results


logger = logging.getLogger(__name__)

__all__ = ["EvaluationCallback"]


class EvaluationCallback(TrainerCallback):
    """Every `eval_steps` optimizer steps (and, with `at_train_end`, once after the last step unless that step
    was just evaluated; with `at_train_begin`, once before the first), sample `k` completions for each prompt
    of `dataset` (at most `num_prompts` of them) from the trainer's current model with `evaluate_model`, and
    log `<prefix>pass@1`, `<prefix>pass@<k>`, `<prefix>maj@<k>` and `<prefix>invalid_rate`.

    Logging goes through `transformers.Trainer.log` of `trainer` (pass it here or set `callback.trainer`
    later), so the values land in `trainer.state.log_history` with `step` = the global step and reach every
    reporter (note that the wandb reporter renames keys that do not start with `eval_` to `train/<key>`: use
    `prefix="eval_"` to get them under wandb's `eval/` section). GRPOTrainer's own `log`, which would flush
    its pending training metrics into this entry, is bypassed. Without a trainer, the entry is only appended
    to `state.log_history`.

    `classify(text, reference)` classes completions (e.g. `topr_trl.evaluation.runner.gsm8k_classify`). The sampling
    defaults: temperature 1 (the paper's evaluation), no top-k/top-p, `max_new_tokens` = the trainer's
    `max_completion_length` (or 256), a fixed `seed` (the same samples for an unchanged model; the training
    random state is not touched). `output_dir`: also save each evaluation's results (JSON + plot) in
    `output_dir/step-<N>/`. `results` keeps every `(step, EvaluationResult)`; `evaluate_kwargs` go to
    `evaluate_model` (e.g. `stop_strings`, `extract`)."""

    def __init__(
        self,
        dataset,
        classify: Callable[[str, Any], str],
        trainer: Trainer | None = None,
        eval_steps: int = 100,
        k: int = 4,
        num_prompts: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int | None = None,
        batch_size: int = 64,
        seed: int = 0,
        at_train_begin: bool = False,
        at_train_end: bool = True,
        prefix: str = "eval/",
        output_dir: str | Path | None = None,
        show_progress: bool = False,
        **evaluate_kwargs,
    ):
        if eval_steps < 1:
            raise ValueError(f"eval_steps must be positive, got {eval_steps}")
        if num_prompts is not None:
            dataset = dataset.select(range(min(num_prompts, len(dataset))))
        self.dataset = dataset
        self.classify = classify
        self.trainer = trainer
        self.eval_steps = eval_steps
        self.k = k
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.seed = seed
        self.at_train_begin = at_train_begin
        self.at_train_end = at_train_end
        self.prefix = prefix
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.show_progress = show_progress
        self.evaluate_kwargs = evaluate_kwargs
        self.results: list[tuple[int, EvaluationResult]] = []
        self._last_step: int | None = None

    # -- events ---------------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        if is_deepspeed_zero3_enabled():
            raise ValueError(
                "EvaluationCallback does not support DeepSpeed ZeRO-3 (it generates on the main "
                "process only, and ZeRO-3 parameters are gathered by all processes together)"
            )
        if self.at_train_begin:
            return self._evaluate(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > 0 and state.global_step % self.eval_steps == 0:
            return self._evaluate(args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        if self.at_train_end and self._last_step != state.global_step:
            return self._evaluate(args, state, control, **kwargs)

    # -- work -----------------------------------------------------------------------------------------------

    def metrics(self, result: EvaluationResult) -> dict[str, float]:
        """The logged values of one evaluation."""
        names = ["pass@1", f"pass@{result.k}", f"maj@{result.k}", "invalid_rate"]
        return {f"{self.prefix}{name}": float(result.metrics[name]) for name in dict.fromkeys(names)}

    def _evaluate(self, args, state, control, model=None, processing_class=None, **kwargs):
        self._last_step = state.global_step
        if not state.is_world_process_zero:
            return control
        trainer = self.trainer
        model = model if model is not None else getattr(trainer, "model", None)
        tokenizer = processing_class if processing_class is not None else kwargs.get("tokenizer")
        if tokenizer is None and trainer is not None:
            tokenizer = trainer.processing_class
        if model is None or tokenizer is None:
            raise ValueError("EvaluationCallback got no model or tokenizer from the trainer")
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a multimodal processor wraps its tokenizer
        max_new_tokens = self.max_new_tokens or getattr(args, "max_completion_length", None) or 256
        result = evaluate_model(
            model,
            tokenizer,
            self.dataset,
            self.classify,
            k=self.k,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=max_new_tokens,
            batch_size=self.batch_size,
            seed=self.seed,
            show_progress=self.show_progress,
            backend="transformers",
            **self.evaluate_kwargs,
        )
        self.results.append((state.global_step, result))
        if self.output_dir is not None:
            save_results(result, self.output_dir / f"step-{state.global_step}")
        logs = self.metrics(result)
        if trainer is not None:
            # transformers' Trainer.log, not GRPOTrainer.log: the latter would also flush (and clear) the
            # training metrics it is accumulating for its next log. Logging resets `control.should_log`, which
            # the trainer's own logging of this step may have set already: keep it.
            should_log = control.should_log
            Trainer.log(trainer, logs)
            control.should_log = should_log
        else:
            entry = dict(logs)
            if state.epoch is not None:
                entry["epoch"] = state.epoch
            state.log_history.append({**entry, "step": state.global_step})
        return control
