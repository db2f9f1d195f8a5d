"""Replay of stored completions in `TOPRTrainer` (the paper's Algorithm 1): a `train_dataset` or `eval_dataset` of
stored completions (docs/offline.md, "Offline dataset schema") is checked before GRPOTrainer sees it, tokenized
once, ordered in whole prompt groups, and handed to GRPOTrainer through its `rollout_func` path, stored token ids as
they are, with mu's stored log-probs (or those of a frozen mu) as the sampler's."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import datasets
import torch
from torch.utils.data import Dataset as TorchDataset
from transformers import AutoModelForCausalLM
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.trainer.grpo_trainer import RolloutFunc, add_fused_lm_head

from ..config import TOPRConfig, topr_setting
from ..inputs.sources import needs_resolving, resolve_model_source
from .group_order import GroupShuffleSampler
from .schema import (
    check_offline_columns,
    check_stored_tokens,
    checked_eval_datasets,
    is_offline_dataset,
    needs_whole_groups,
    stored_reward,
    tokenize_offline_dataset,
    validate_offline_dataset,
    with_prompt_index,
)


def prepare_replayed_datasets(args, reward_funcs, trainer_kwargs: dict) -> bool:
    """Checks the datasets in a trainer's keyword arguments before GRPOTrainer sees them (an offline train_dataset gets
    its prompt index; the eval datasets are checked); returns whether training replays stored completions."""
    reward_list = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    uses_stored_reward = any(function is stored_reward for function in reward_list)
    has_behaviour_model = topr_setting(args, "topr_behaviour_model") is not None
    train_dataset = trainer_kwargs.get("train_dataset")
    check_offline_columns(train_dataset, "train_dataset", uses_stored_reward, has_behaviour_model)
    offline = is_offline_dataset(train_dataset)
    if offline:
        if trainer_kwargs.get("rollout_func") is not None:
            raise ValueError(
                "An offline train_dataset (with `completion_ids` or `completion`) replaces generation: "
                "drop rollout_func."
            )
        train_dataset = trainer_kwargs["train_dataset"] = with_prompt_index(train_dataset)
        validate_offline_dataset(
            train_dataset,
            args.num_generations,
            needs_whole_groups=needs_whole_groups(args),
            batch_rows=args.generation_batch_size,
        )
    trainer_kwargs["eval_dataset"] = checked_eval_datasets(
        trainer_kwargs.get("eval_dataset"), args, uses_stored_reward, has_behaviour_model
    )
    return offline


def replayed_rollout(rows: list[dict], prompts: list, trainer) -> dict[str, list]:
    """GRPOTrainer's `rollout_func` output for stored rows: prompts and completions as stored token ids (decoded and
    scored exactly as generated ones), mu's stored log-probs as the sampler's (None when not stored)."""
    if "prompt_ids" in rows[0]:
        prompt_ids = [list(row["prompt_ids"]) for row in rows]
    else:  # rows handed over directly rather than through the prepared dataset
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": [list(row["completion_ids"]) for row in rows],
        "logprobs": [list(row["behaviour_logps"]) for row in rows] if "behaviour_logps" in rows[0] else None,
    }


class OfflineReplay:
    """Mixed into `TOPRTrainer` (a `GRPOTrainer`) constructed with `self._offline` set (by
    `prepare_replayed_datasets`)."""

    # the trainer's attributes it replaces, as transformers' Trainer and TRL's GRPOTrainer type them
    eval_dataset: TorchDataset | dict[str, TorchDataset] | datasets.Dataset | None
    rollout_func: RolloutFunc | None

    def _prepare_replay(self) -> None:
        """After GRPOTrainer's construction: replay trains on stored token ids, and what is not stored is tokenized
        once, here, the way GRPOTrainer would; a frozen mu is loaded when stored rows lack mu's log-probs."""
        if self._offline:
            self.train_dataset = self._tokenized_for_replay(self.train_dataset, "train_dataset")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {
                name: self._tokenized_for_replay(dataset, f"eval_dataset[{name!r}]")
                for name, dataset in self.eval_dataset.items()
            }
        elif self.eval_dataset is not None:
            self.eval_dataset = self._tokenized_for_replay(self.eval_dataset, "eval_dataset")
        replayed = [self.train_dataset] if self._offline else []
        replayed += list(self.eval_dataset.values()) if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        self._behaviour_model = None
        if any(is_offline_dataset(d) and "behaviour_logps" not in d.column_names for d in replayed if d is not None):
            self._behaviour_model = self._load_frozen_behaviour_model(self.args.topr_behaviour_model)

    def _tokenized_for_replay(self, dataset, role: str):
        if not is_offline_dataset(dataset):
            return dataset
        check_stored_tokens(dataset, self.processing_class, role)
        with self.accelerator.main_process_first():  # one process writes the datasets cache, the others read it
            return tokenize_offline_dataset(
                dataset, self.processing_class, self.chat_template_kwargs, self.tools, self.chat_template, role=role
            )

    def set_initial_training_values(self, args, dataloader):
        """HF Trainer's epoch and step counts; over stored completions the passes are `topr_offline_epochs` (Algorithm
        1 makes one), worked out here on a copy so that the user's config keeps its `num_train_epochs`."""
        if self._offline and isinstance(args, TOPRConfig):
            args = copy.copy(args)
            args.num_train_epochs = args.topr_offline_epochs
        return super().set_initial_training_values(args, dataloader)

    def _get_train_sampler(self, dataset=None):
        if not self._offline:
            return super()._get_train_sampler(dataset)
        dataset = self.train_dataset if dataset is None else dataset
        return GroupShuffleSampler(
            dataset["prompt_index"],
            batch_rows=self.args.generation_batch_size,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
            shuffle=self.shuffle_dataset,
            seed=self.args.seed,
        )

    def _get_eval_sampler(self, eval_dataset):
        if not is_offline_dataset(eval_dataset):
            return super()._get_eval_sampler(eval_dataset)
        # every stored row once, prompt groups whole and in order: nothing to repeat, nothing to shuffle
        return GroupShuffleSampler(eval_dataset["prompt_index"], batch_rows=1, shuffle=False)

    @contextlib.contextmanager
    def _replaying(self, rows: list[dict]):
        """For one call of GRPOTrainer's `_generate_and_score_completions`, its generator is `replayed_rollout` bound
        to these rows. GRPOTrainer's one seam for completions it does not generate is `rollout_func(prompts,
        trainer)`, which sees the prompts only, so the rows travel in the bound function; the user's generator is back
        when the call returns or raises."""
        # SEAM: rollout_func sees the prompts only, so the stored rows travel in a function bound for one call
        generator = self.rollout_func
        self.rollout_func = lambda prompts, trainer: replayed_rollout(rows, prompts, trainer)
        try:
            yield
        finally:
            self.rollout_func = generator

    def _load_frozen_behaviour_model(self, name_or_path: str):
        """mu as a frozen model, prepared the way GRPOTrainer prepares its reference model (ZeRO-3-safe: no deep copy
        of a sharded policy, DeepSpeed shards this model itself)."""
        model_init_kwargs = dict(self.args.model_init_kwargs or {})
        model_init_kwargs.setdefault("dtype", self.model.dtype)
        if needs_resolving(name_or_path):  # a .gguf file, or a packaged Hub id where the Hub cannot be reached
            name_or_path = resolve_model_source(name_or_path, what="behaviour model")
        behaviour = AutoModelForCausalLM.from_pretrained(name_or_path, **model_init_kwargs)
        behaviour.eval().requires_grad_(False)
        # The same chunked, temperature-scaled log-prob head GRPOTrainer gives its policy and reference model.
        add_fused_lm_head(behaviour, temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(behaviour, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(behaviour, self.accelerator)
        return self.accelerator.prepare_model(behaviour, evaluation_mode=True)

    @torch.no_grad()
    def _behaviour_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """Per-token log-probs of the completions under the frozen mu, at the policy's sampling temperature."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self._behaviour_model,
            input_ids,
            attention_mask,
            output["completion_ids"].size(1),
            batch_size=self.args.per_device_train_batch_size,
        )
        return logps
