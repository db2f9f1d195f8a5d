"""`TOPRTrainer`: TRL's `GRPOTrainer` with the TOPR loss family."""

from __future__ import annotations

import dataclasses
import logging
import textwrap
from pathlib import Path
from typing import Any

import torch
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id

from .config import TOPRConfig
from .loss import (
    MAX_LOG_RATIO,
    PolicyTerms,
    aggregate,
    baseline_for_target_share,
    branch_losses,
    log_importance_ratio,
    policy_per_token_loss,
)
from .offline.sampler import GroupShuffleSampler
from .offline.schema import (
    check_offline_columns,
    checked_eval_datasets,
    checked_reward_function,
    is_offline_dataset,
    needs_whole_groups,
    stored_reward,
    tokenize_offline_dataset,
    validate_offline_dataset,
    with_prompt_index,
)

logger = logging.getLogger(__name__)

# TOPRTrainer also takes a plain GRPOConfig (only the trainer's name swapped): TOPR's run-level fields then keep
# their TOPRConfig defaults, which are GRPOTrainer's behaviour.
_TOPR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TOPRConfig)}


def topr_setting(args, name: str):
    """`args.<name>`, or TOPRConfig's default when `args` is a GRPOConfig."""
    return getattr(args, name, _TOPR_DEFAULTS[name])

# Per-trajectory metrics are reduced with one collective: these are the sums, in this order.
_SUM_KEYS = (
    "n_positive", "n_negative", "n_zero", "ratio_sum_positive", "ratio_sum_negative", "ratio_count_positive",
    "ratio_count_negative", "weight_sum_positive", "weight_sum_negative", "truncated_negative", "mass_positive",
    "mass_total", "nonfinite_loss", "entropy_sum", "token_count",
)


class TOPRTrainer(GRPOTrainer):
    """
    Trainer for Tapered Off-Policy REINFORCE (TOPR, [arXiv:2503.14286](https://huggingface.co/papers/2503.14286)).

    A drop-in replacement for [`~trl.GRPOTrainer`]: same constructor, datasets, reward functions, callbacks,
    PEFT, vLLM generation, DeepSpeed and `accelerate launch`. With `loss_type="topr"` (the [`TOPRConfig`]
    default) the policy loss is TOPR's tapered importance-sampled REINFORCE (Eq. 7); with any of TRL's loss
    types the computation is GRPOTrainer's own. Only `_compute_loss` and the reward plumbing are overridden;
    masking, KL (`beta > 0`), the entropy bonus, gradient-accumulation scaling and metrics work as in GRPO.
    A `train_dataset` or `eval_dataset` of stored completions (README.md, Offline dataset schema) is checked at
    construction and replayed, stored token ids as they are, through GRPOTrainer's `rollout_func` path.
    """

    _tag_names = ["trl", "grpo", "topr"]
    _name = "TOPR"
    _paper = {
        "title": "Tapered Off-Policy REINFORCE: Stable and efficient reinforcement learning for LLMs",
        "id": "2503.14286",
        "citation": textwrap.dedent("""\
            @article{leroux2025tapered,
                title        = {{Tapered Off-Policy REINFORCE: Stable and efficient reinforcement learning for LLMs}},
                author       = {Nicolas Le Roux and Marc G. Bellemare and Jonathan Lebensold and Arnaud Bergeron and Joshua Greaves and Alex Fr{\\'e}chette and Carolyne Pelletier and Eric Thibodeau-Laufer and S{\\'a}ndor Toth and Sam Work},
                year         = 2025,
                eprint       = {arXiv:2503.14286},
            }"""),
    }

    def __init__(self, model, reward_funcs=None, args: TOPRConfig | None = None, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = TOPRConfig(f"{model_name.split('/')[-1]}-TOPR")
        reward_list = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        uses_stored_reward = any(function is stored_reward for function in reward_list)
        has_behaviour_model = topr_setting(args, "topr_behaviour_model") is not None
        train_dataset = kwargs.get("train_dataset")
        check_offline_columns(train_dataset, "train_dataset", uses_stored_reward, has_behaviour_model)
        self._offline = is_offline_dataset(train_dataset)
        if self._offline:
            if kwargs.get("rollout_func") is not None:
                raise ValueError("An offline train_dataset (with `completion_ids` or `completion`) replaces "
                                 "generation: drop rollout_func.")
            train_dataset = kwargs["train_dataset"] = with_prompt_index(train_dataset)
            validate_offline_dataset(train_dataset, args.num_generations, needs_whole_groups=needs_whole_groups(args),
                                     batch_rows=args.generation_batch_size)
            if isinstance(args, TOPRConfig):
                args.num_train_epochs = args.topr_offline_epochs
        kwargs["eval_dataset"] = checked_eval_datasets(kwargs.get("eval_dataset"), args, uses_stored_reward,
                                                             has_behaviour_model)
        self._dataset_baseline = None
        if args.loss_type == "topr" and args.topr_target_effective_proportion is not None:
            if args.topr_baseline_scope == "dataset":
                if not self._offline or "reward" not in train_dataset.column_names:
                    raise ValueError("topr_baseline_scope='dataset' solves the baseline from an offline dataset's "
                                     "`reward` column; online, use topr_baseline_scope='batch'.")
                rewards = torch.tensor([float("nan") if r is None else r for r in train_dataset["reward"]])
                self._dataset_baseline = baseline_for_target_share(rewards, args.topr_target_effective_proportion)
        self._replay_rows: list[dict] | None = None
        self._warned_unscored = self._warned_nonfinite = False
        super().__init__(model, reward_funcs, args=args, **kwargs)
        # Replay trains on stored token ids; what is not stored is tokenized once, here, the way GRPOTrainer would.
        if self._offline:
            self.train_dataset = self._tokenized_for_replay(self.train_dataset, "train_dataset")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {name: self._tokenized_for_replay(dataset, f"eval_dataset[{name!r}]")
                                 for name, dataset in self.eval_dataset.items()}
        elif self.eval_dataset is not None:
            self.eval_dataset = self._tokenized_for_replay(self.eval_dataset, "eval_dataset")
        self.reward_funcs = [checked_reward_function(function, name)
                             for function, name in zip(self.reward_funcs, self.reward_func_names, strict=True)]
        self._behaviour_model = None
        replayed = [self.train_dataset] if self._offline else []
        replayed += list(self.eval_dataset.values()) if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        if any(is_offline_dataset(d) and "behaviour_logps" not in d.column_names for d in replayed if d is not None):
            self._behaviour_model = self._load_frozen_behaviour_model(args.topr_behaviour_model)
        if self.loss_type != "topr":
            return
        self._loss_spec = args.policy_loss_spec
        source = args.topr_behaviour_source
        if source == "sampler" and not self.use_vllm and kwargs.get("rollout_func") is None and not self._offline:
            raise ValueError(
                "topr_behaviour_source='sampler' needs a generator that returns sampling log-probs: set "
                "use_vllm=True or pass a rollout_func that returns `logprobs`; or use 'auto' or 'policy'."
            )
        if self.use_vllm and source in ("auto", "sampler"):
            # mu is vLLM's own sampling distribution, so pi/mu already corrects the train/inference mismatch;
            # TRL's separate correction on top would count it twice.
            self.vllm_importance_sampling_correction = False

    def create_model_card(self, *args, **kwargs):
        """TRL's model card (which cites TOPR through `_paper`), plus the TOPR configuration that trained it."""
        super().create_model_card(*args, **kwargs)
        card = Path(self.args.output_dir) / "README.md"
        if not self.is_world_process_zero() or not card.exists():
            return
        # TRL names no base model for one loaded from a local folder, which its template renders as "[None]"
        local = get_config_model_id(self.model.config)
        card.write_text(card.read_text().replace(
            "fine-tuned version of [None](https://huggingface.co/None)",
            f"fine-tuned version of a local model (`{Path(str(local)).name or local}`)"))
        if self.loss_type != "topr":
            return
        spec = self._loss_spec
        fields = ["pg_variant", "topr_preset", "topr_ratio_level", "topr_signal", "topr_baseline",
                  "topr_target_effective_proportion", "topr_loss_aggregation", "topr_behaviour_source",
                  "topr_positive_weight", "topr_negative_weight", "learning_rate", "beta", "num_generations",
                  "temperature", "max_completion_length"]
        rows = [f"| truncation limits (a+, b+, a-, b-) | {spec.limits.positive_lower}, {spec.limits.positive_upper}, "
                f"{spec.limits.negative_lower}, {spec.limits.negative_upper} |"]
        rows += [f"| `{name}` | {getattr(self.args, name)} |" for name in fields]
        section = "\n## TOPR configuration\n\n| setting | value |\n|---|---|\n" + "\n".join(rows) + "\n"
        card.write_text(card.read_text() + section)

    # ------------------------------------------------------------------ offline data (Algorithm 1)
    def _tokenized_for_replay(self, dataset, role: str):
        if not is_offline_dataset(dataset):
            return dataset
        with self.accelerator.main_process_first():  # one process writes the datasets cache, the others read it
            return tokenize_offline_dataset(dataset, self.processing_class, self.chat_template_kwargs, self.tools,
                                            self.chat_template, role=role)

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

    def _replay_stored_completions(self, prompts: list, trainer) -> dict[str, list]:
        """A `rollout_func` that hands GRPOTrainer the stored rows of this batch: prompts and completions as stored
        token ids (decoded and scored exactly as generated ones), mu's stored log-probs as the sampler's."""
        rows = self._replay_rows
        if "prompt_ids" in rows[0]:
            prompt_ids = [list(row["prompt_ids"]) for row in rows]
        else:  # rows handed over directly rather than through the prepared dataset
            prompt_ids, _, _ = self._tokenize_prompts(prompts)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [list(row["completion_ids"]) for row in rows],
            "logprobs": [list(row["behaviour_logps"]) for row in rows] if "behaviour_logps" in rows[0] else None,
        }

    def _load_frozen_behaviour_model(self, name_or_path: str):
        """mu as a frozen model, prepared the way GRPOTrainer prepares its reference model (ZeRO-3-safe: no
        deep copy of a sharded policy, DeepSpeed shards this model itself)."""
        from transformers import AutoModelForCausalLM
        from trl.models import prepare_deepspeed, prepare_fsdp
        from trl.trainer.grpo_trainer import add_fused_lm_head

        model_init_kwargs = dict(self.args.model_init_kwargs or {})
        model_init_kwargs.setdefault("dtype", self.model.dtype)
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
            self._behaviour_model, input_ids, attention_mask, output["completion_ids"].size(1),
            batch_size=self.args.per_device_train_batch_size,
        )
        return logps

    # ------------------------------------------------------------------ rewards and the paper's signal
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        infinite = torch.isinf(rewards_per_func)
        if topr_setting(self.args, "topr_check_finite") and infinite.any():
            name = self.reward_func_names[int(infinite.any(dim=0).nonzero()[0])]
            raise ValueError(
                f"Reward function '{name}' returned an infinite reward. Return a finite number, or None (or NaN) for "
                "a completion it cannot score: such a completion is then left out of the update."
            )
        if self.model.training and torch.isnan(rewards_per_func).all():
            self._handle_unscored_batch()
        self._topr_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _handle_unscored_batch(self) -> None:
        """No completion of the whole (gathered) generation batch could be scored. GRPOTrainer warns and trains on
        (`topr_unscored_batch="train"`, nothing to do here); "error" stops, "skip" marks the batch (below)."""
        action = topr_setting(self.args, "topr_unscored_batch")
        names = ", ".join(f"'{name}'" for name in self.reward_func_names)
        if action == "error":
            raise ValueError(
                f"Every completion of the generation batch at step {self.state.global_step} got None/NaN from every "
                f"reward function ({names}), so the step would train nothing: fix the reward functions (or the dataset "
                "columns they read), or set topr_unscored_batch='skip' (or 'train') to go on."
            )
        if action == "skip" and not self._warned_unscored:
            logger.warning(f"Skipping a step whose completions no reward function ({names}) could score "
                           "(topr_unscored_batch='skip'); later such steps are skipped without this warning.")
            self._warned_unscored = True

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        # A batch of stored completions (training or evaluation) goes through GRPOTrainer's rollout_func path, a batch
        # of prompts is generated as GRPOTrainer would (its own generation, or the user's rollout_func).
        replay = "completion_ids" in inputs[0]
        generator = self.rollout_func
        if replay:
            self._replay_rows, self.rollout_func = inputs, self._replay_stored_completions
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._replay_rows, self.rollout_func = None, generator
        if replay and "behaviour_logps" not in inputs[0] and self._behaviour_model is not None:
            output["sampling_per_token_logps"] = self._behaviour_logps(output)
        if self.loss_type == "topr" and self.args.topr_signal == "reward":
            output["topr_signal"] = self._local_reward_signal(len(inputs))
        if (self.model.training and topr_setting(self.args, "topr_unscored_batch") == "skip"
                and torch.isnan(self._topr_rewards_per_func).all()):
            # the mark travels with the batch to the loss
            output["topr_unscored"] = torch.ones(len(inputs), dtype=torch.bool, device=output["completion_ids"].device)
        return output

    def _local_reward_signal(self, local_batch_size: int) -> torch.Tensor:
        """R(tau) - c for this process's completions, from the rewards of the whole (gathered) batch. A
        completion no reward function could score (all None/NaN) gets signal 0: it does not move the policy."""
        rewards_per_func = self._topr_rewards_per_func
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        baseline = self.args.topr_baseline
        if self._dataset_baseline is not None:
            baseline = self._dataset_baseline
        elif self.args.topr_target_effective_proportion is not None:
            baseline = baseline_for_target_share(rewards, self.args.topr_target_effective_proportion)
        if self.args.topr_target_effective_proportion is not None:
            self._metrics["train" if self.model.training else "eval"]["topr/baseline"].append(float(baseline))
        if baseline == "group_mean":
            num_generations = self.num_generations if self.model.training else self.num_generations_eval
            grouped = rewards.view(-1, num_generations)
            baseline_values = torch.nanmean(grouped, dim=1, keepdim=True).expand_as(grouped).reshape(-1)
        elif baseline == "batch_mean":
            baseline_values = torch.nanmean(rewards)
        else:
            baseline_values = baseline
        signal = torch.nan_to_num(rewards - baseline_values, nan=0.0)
        start = self.accelerator.process_index * local_batch_size
        return signal[start : start + local_batch_size]

    # ------------------------------------------------------------------ the loss
    def _compute_loss(self, model, inputs):
        loss = self._topr_loss(model, inputs) if self.loss_type == "topr" else super()._compute_loss(model, inputs)
        if "topr_unscored" in inputs:
            # topr_unscored_batch='skip': the batch moves nothing, not even through the KL or entropy terms
            loss = loss * 0.0
        return loss

    def _topr_loss(self, model, inputs):
        """TOPR's contribution: the per-token policy loss of the configured variant (`topr_trl.loss.POLICY_LOSSES`)
        on the signal and mu of this batch. Everything around it is GRPO's (`_grpo_loss_around_policy_term`)."""
        mode = "train" if self.model.training else "eval"
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        per_token_logps, entropies, aux_loss = self._policy_logps_and_entropies(model, inputs)
        signal = inputs["topr_signal"] if self.args.topr_signal == "reward" else inputs["advantages"]
        signal = signal.reshape(-1, 1)
        behaviour_logps = inputs.get("sampling_per_token_logps") if self._mu_is_sampler(inputs) else None
        if behaviour_logps is None:
            behaviour_logps = inputs.get("old_per_token_logps")
        if behaviour_logps is None:  # on-policy and aligned: GRPO skipped the old log-probs, pi = mu
            behaviour_logps = per_token_logps.detach()
        terms = policy_per_token_loss(per_token_logps, behaviour_logps, signal, mask, self._loss_spec)
        loss, policy_per_token, aggregation = self._grpo_loss_around_policy_term(
            inputs, mode, mask, terms.per_token_loss, per_token_logps, entropies, aux_loss, signal, behaviour_logps)
        health = self._log_policy_metrics(mode, terms, signal, mask, entropies, policy_per_token, aggregation, loss)
        self._on_nonfinite_loss(health)
        return loss

    # MIRROR of TRL 1.16.0 `GRPOTrainer._compute_loss` (trl/trainer/grpo_trainer.py, the code after the per-token
    # policy loss: entropy and off-policy masks, vLLM IS correction, KL with its bias correction, aggregation and
    # gradient-accumulation scaling, entropy bonus with its adaptive controller, MoE aux loss, and their metrics).
    # TRL 1.16 dispatches the per-token loss and the aggregation by `loss_type` inside that one method, so there is no
    # seam to hand it another per-token loss; this is the one place that repeats it. tests/test_grpo_parity.py holds
    # it to TRL's (loss, gradients and metrics, feature by feature): rerun it when the TRL pin moves.
    def _grpo_loss_around_policy_term(self, inputs, mode, mask, per_token_loss, per_token_logps, entropies, aux_loss,
                                      signal, behaviour_logps):
        """The scalar loss around a per-token policy loss, as GRPOTrainer builds it; returns (loss, the masked
        per-token policy loss, the aggregation's arguments)."""
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages=signal,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", behaviour_logps),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        if self.use_vllm and self.vllm_importance_sampling_correction:
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        policy_per_token = per_token_loss

        if self.beta != 0.0:
            ref_logps = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref_logps - per_token_logps) - (ref_logps - per_token_logps) - 1
            if self.args.use_bias_correction_kl:  # GRPO's ratio: against the old policy, at its importance level
                old_logps = inputs.get("old_per_token_logps")
                old_logps = per_token_logps.detach() if old_logps is None else old_logps
                level = "token" if self.importance_sampling_level == "token" else "length_normalized"
                log_weights = log_importance_ratio(per_token_logps, old_logps, mask, level)
                per_token_kl = per_token_kl * log_weights.clamp(max=MAX_LOG_RATIO).exp()
            per_token_loss = per_token_loss + self.beta * per_token_kl

        aggregation = self._aggregation_kwargs(inputs, mode)
        loss = aggregate(per_token_loss, mask, **aggregation)
        policy_loss = loss.detach()  # logged before the accumulation scaling, as GRPO logs it
        if aggregation["mode"] != "global-token-mean" and mode == "train":
            # HF Trainer does not divide by the accumulation steps for GRPO-style trainers (loss_is_scaled_for_ga).
            loss = loss / self.current_gradient_accumulation_steps

        if self._entropy_bonus_enabled:
            loss = loss - self._entropy_bonus(entropies, mask, entropy_mask, mode)
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.aux_loss_enabled:
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(self._global_masked_mean(per_token_kl, mask))
        return loss, policy_per_token, aggregation

    def _mu_is_sampler(self, inputs) -> bool:
        return self.args.topr_behaviour_source in ("auto", "sampler") and "sampling_per_token_logps" in inputs

    def _policy_logps_and_entropies(self, model, inputs):
        """The same forward pass GRPOTrainer's loss makes (multimodal inputs included)."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        multimodal_keys = (
            "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
            "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
        )
        return self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            inputs["completion_ids"].size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in multimodal_keys},
        )

    def _aggregation_kwargs(self, inputs, mode: str) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"mode": self.args.topr_loss_aggregation}
        if kwargs["mode"] == "global-token-mean":
            # `num_items_in_batch` counts the tokens of the whole generation batch on all processes.
            num_tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_tokens = num_tokens * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            kwargs["num_tokens"] = num_tokens
        elif kwargs["mode"] == "seq-mean-token-sum-norm":
            kwargs["max_completion_length"] = self.max_completion_length
        return kwargs

    def _entropy_bonus(self, entropies, mask, entropy_mask, mode: str) -> torch.Tensor:
        """GRPOTrainer's entropy bonus (static or adaptive coefficient), scaled for gradient accumulation."""
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        mean_entropy = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
        if self.use_adaptive_entropy:
            coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            coef = self.entropy_coef
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            if self.accelerator.sync_gradients:
                window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
                step = self.args.entropy_coef_delta
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + step, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - step, self.args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * mean_entropy

    # ------------------------------------------------------------------ metrics
    def _global_masked_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        totals = torch.stack([(values * mask).sum(), mask.sum().to(values.dtype)]).detach()
        totals = self.accelerator.reduce(totals, reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _log_policy_metrics(
        self, mode, terms: PolicyTerms, signal, mask, entropies, policy_per_token, aggregation, loss
    ) -> dict:
        """TOPR's metrics, reduced over processes with two collectives (every rank logs every key); returns what
        `_on_nonfinite_loss` needs (the reduction is shared, so every rank agrees).

        Branches are by the sign of the signal; trajectories with zero signal (e.g. groups whose completions all
        got the same reward, under the advantage signal) move nothing and are counted apart. Ratio statistics
        are per trajectory for sequence-level ratios, per completion token for token-level ones.
        """
        signal = signal.detach().float()
        mask = mask.float()
        positive, negative = signal > 0, signal < 0
        sequence_level = terms.log_ratio.size(1) == 1
        element_mask = torch.ones_like(terms.log_ratio, dtype=torch.float) if sequence_level else mask
        ratio = terms.log_ratio.float().clamp(max=MAX_LOG_RATIO).exp()
        weights = terms.weights.float()
        in_positive = element_mask * positive
        in_negative = element_mask * negative
        # A negative counts as truncated when the weight applied to it differs from its untruncated weight,
        # lambda- * pi/mu, by more than a relative 1e-4 (or four roundings of the weights' dtype, if coarser): a
        # ratio of 1 + 1e-6 (mu = pi, log-probs recomputed in another batch layout) is not truncated by b- = 1.
        # For Eq. 7's variants this is "pi/mu lies outside [a-, b-] by more than the tolerance"; it also covers
        # CISPO's and PPO's clipping (PPO's weight drops to 0 where it clips).
        tolerance = max(1e-4, 4 * torch.finfo(terms.weights.dtype).eps)
        untruncated = ratio * self._loss_spec.negative_weight
        outside = (weights - untruncated).abs() > tolerance * untruncated
        if sequence_level:
            mean_weight = weights
        else:
            mean_weight = (weights * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        magnitude = (mean_weight * signal).abs()
        sums = torch.stack([
            positive.sum(), negative.sum(), (signal == 0).sum(),
            (ratio * in_positive).sum(), (ratio * in_negative).sum(), in_positive.sum(), in_negative.sum(),
            (weights * in_positive).sum(), (weights * in_negative).sum(), (outside * in_negative).sum(),
            (magnitude * (signal >= 0)).sum(), magnitude.sum(), (~torch.isfinite(loss.detach())).sum(),
            (entropies.detach() * mask).sum(), mask.sum(),
        ]).float()
        sums = dict(zip(_SUM_KEYS, self.accelerator.reduce(sums, reduction="sum").tolist()))

        inf = torch.tensor(float("inf"), device=ratio.device)
        branch_loss_kwargs = {("aggregation" if k == "mode" else k): v for k, v in aggregation.items()}
        positive_loss, negative_loss = branch_losses(policy_per_token, terms.is_positive, mask, **branch_loss_kwargs)
        per_rank = torch.stack([  # minima (maxima as negated minima), then the branch losses
            torch.where(in_positive.bool(), ratio, inf).amin(), torch.where(in_negative.bool(), ratio, inf).amin(),
            torch.where(in_positive.bool(), -ratio, inf).amin(), torch.where(in_negative.bool(), -ratio, inf).amin(),
            positive_loss.float(), negative_loss.float(),
        ])
        gathered = self.accelerator.gather(per_rank.unsqueeze(0))
        extremes = [v if abs(v) != float("inf") else float("nan") for v in gathered[:, :4].amin(dim=0).tolist()]
        branch = gathered[:, 4:].mean(dim=0).tolist()

        def share(numerator: str, denominator: str) -> float:
            return sums[numerator] / sums[denominator] if sums[denominator] > 0 else float("nan")

        n_all = max(sums["n_positive"] + sums["n_negative"] + sums["n_zero"], 1.0)
        metrics = self._metrics[mode]
        metrics["topr/positive_fraction"].append(sums["n_positive"] / n_all)
        metrics["topr/negative_fraction"].append(sums["n_negative"] / n_all)
        if self.args.topr_signal == "reward":
            # Under the advantage signal group advantages sum to 0, so p~ would read 0.5 (up to the weights)
            # whatever the user does; it is a choice, through the baseline c, only for R - c.
            metrics["topr/effective_positive_proportion"].append(share("mass_positive", "mass_total"))
        metrics["topr/ratio_positive/mean"].append(share("ratio_sum_positive", "ratio_count_positive"))
        metrics["topr/ratio_positive/min"].append(extremes[0])
        metrics["topr/ratio_positive/max"].append(-extremes[2])
        metrics["topr/ratio_negative/mean"].append(share("ratio_sum_negative", "ratio_count_negative"))
        metrics["topr/ratio_negative/min"].append(extremes[1])
        metrics["topr/ratio_negative/max"].append(-extremes[3])
        metrics["topr/weight_positive/mean"].append(share("weight_sum_positive", "ratio_count_positive"))
        metrics["topr/weight_negative/mean"].append(share("weight_sum_negative", "ratio_count_negative"))
        metrics["topr/negative_truncated_fraction"].append(share("truncated_negative", "ratio_count_negative"))
        metrics["topr/loss_positive"].append(branch[0])
        metrics["topr/loss_negative"].append(branch[1])
        metrics["entropy"].append(share("entropy_sum", "token_count"))
        return {"nonfinite_processes": int(sums["nonfinite_loss"]),
                "ratio_ranges": f"positives [{extremes[0]}, {-extremes[2]}], negatives [{extremes[1]}, {-extremes[3]}]"}

    def _on_nonfinite_loss(self, health: dict) -> None:
        """GRPOTrainer trains on a non-finite loss (logged as NaN); TOPRTrainer does too unless topr_check_finite,
        warning once either way, with the ratio ranges that usually explain it."""
        if health["nonfinite_processes"] == 0:
            return
        message = (f"TOPR loss is not finite on {health['nonfinite_processes']} process(es) at step "
                   f"{self.state.global_step}. Ratio ranges: {health['ratio_ranges']}. Check the reward functions "
                   "and, in bf16/fp16, the model's logits; rerun with bf16=False to rule out overflow.")
        if topr_setting(self.args, "topr_check_finite"):
            raise FloatingPointError(message)
        if not self._warned_nonfinite:
            logger.warning(message + " Training goes on, as in GRPOTrainer (topr_check_finite=True stops here); "
                           "later such steps are not reported.")
            self._warned_nonfinite = True
