"""MIRROR of the parts of TRL 1.16.0's `GRPOTrainer._compute_loss` (trl/trainer/grpo_trainer.py) that surround the
per-token policy loss: the forward pass, entropy and off-policy masks, the vLLM importance-sampling correction, KL
with its bias correction, aggregation and gradient-accumulation scaling, the entropy bonus with its adaptive
controller, the MoE auxiliary loss, and their metrics.

TRL 1.16 dispatches the per-token loss and the aggregation by `loss_type` inside that one method, so there is no
seam to hand it another per-token loss: this module is the one place that repeats it (with `topr_trl.loss.aggregate`,
its normalisations). Every method below is a copy, labelled with what it mirrors. tests/test_grpo_parity.py holds
them to TRL's (loss, gradients and metrics, feature by feature): rerun it when the TRL pin moves.
"""

from __future__ import annotations

from typing import Any

import torch

from ..loss import MAX_LOG_RATIO, aggregate, log_importance_ratio


# The multimodal inputs GRPOTrainer forwards to the model in its loss.
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class GRPOLossMirror:
    """Mixed into `TOPRTrainer` (a `GRPOTrainer`): GRPO's loss around a per-token policy loss."""

    def _policy_logps_and_entropies(self, model, inputs, **scoring):
        """MIRROR of GRPO's forward pass in `_compute_loss` (multimodal inputs included); `scoring` goes to the
        trainer's `_get_per_token_logps_and_entropies` as is."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        return self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            inputs["completion_ids"].size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in MULTIMODAL_KEYS},
            **scoring,
        )

    def _grpo_loss_around_policy_term(
        self, inputs, mode, mask, per_token_loss, per_token_logps, entropies, aux_loss, signal, behaviour_logps
    ):
        """MIRROR of `_compute_loss` after the per-token policy loss. Returns (loss, the masked per-token policy loss,
        the aggregation's arguments)."""
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

        aggregate_kwargs = self._aggregation_kwargs(inputs, mode)
        loss = aggregate(per_token_loss, mask, **aggregate_kwargs)
        policy_loss = loss.detach()  # logged before the accumulation scaling, as GRPO logs it
        if aggregate_kwargs["aggregation"] != "global-token-mean" and mode == "train":
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
        return loss, policy_per_token, aggregate_kwargs

    def _aggregation_kwargs(self, inputs, mode: str) -> dict[str, Any]:
        """MIRROR of GRPO's normalisers: the token count of `dapo` (the whole generation batch on all processes, per
        accumulation window) and the `max_completion_length` of `dr_grpo`."""
        kwargs: dict[str, Any] = {"aggregation": self.args.topr_loss_aggregation}
        if kwargs["aggregation"] == "global-token-mean":
            # `num_items_in_batch` counts the tokens of the whole generation batch on all processes.
            num_tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_tokens = num_tokens * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            kwargs["num_tokens"] = num_tokens
        elif kwargs["aggregation"] == "seq-mean-token-sum-norm":
            kwargs["max_completion_length"] = self.max_completion_length
        return kwargs

    def _entropy_bonus(self, entropies, mask, entropy_mask, mode: str) -> torch.Tensor:
        """MIRROR of GRPO's entropy bonus (static or adaptive coefficient, whose controller state is GRPOTrainer's
        own), scaled for gradient accumulation."""
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        mean_entropy = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
        if self.use_adaptive_entropy:
            coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            coef = self.entropy_coef
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            previous = self._entropy_window_stats
            self._entropy_window_stats = stats if previous is None else previous + stats
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

    def _global_masked_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        """MIRROR of GRPO's KL metric: the masked mean over all processes' tokens."""
        totals = torch.stack([(values * mask).sum(), mask.sum().to(values.dtype)]).detach()
        totals = self.accelerator.reduce(totals, reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()
