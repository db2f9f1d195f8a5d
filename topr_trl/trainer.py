"""`TOPRTrainer`: TRL's `GRPOTrainer` with the TOPR loss family."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from contextlib import nullcontext
from contextvars import ContextVar
from pathlib import Path

import torch
from transformers.utils import logging
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id

from .config import TOPRConfig, topr_setting
from .generation.completions import generate_without_router_logits
from .generation.vllm_colocate import use_cpu_weight_reload
from .inputs.packaged_models import converted_source, packaged_hub_id
from .inputs.prompts import check_prompt_columns
from .inputs.sources import needs_resolving, resolve_model_source
from .loss import POLICY_LOSSES, baseline_for_target_share, policy_per_token_loss, reads_the_ratio, reward_signal
from .offline.replay import OfflineReplay, prepare_replayed_datasets
from .offline.schema import checked_reward_function, is_offline_dataset
from .runtime.noise import quiet_trl_deprecations, tell_deepspeed_the_cpu
from .support.scoring import completion_processed_log_probs
from .training.checkpoint_weights import loaded_through_renaming
from .training.grpo_mirror import MULTIMODAL_KEYS, GRPOLossMirror
from .training.policy_metrics import (
    drift_and_mismatch,
    drift_and_mismatch_sums,
)
from .training.shared import (
    TOPR_NAME,
    TOPR_PAPER,
    TOPR_TAG_NAMES,
    check_finite_loss,
    forward_on_mus_support,
    log_policy_metrics,
    mu_processing,
    trained_method,
    warn_history_dependent_sampling,
)
from .training.shared_prompt import (
    chunked_shared_prompt_logps,
    distinct_prompts,
    tail_hidden_states,
    why_the_padded_forward_runs,
)


logger = logging.get_logger(__name__)


DERIVED_FROM_REWARDS: ContextVar[dict[str, torch.Tensor] | None] = ContextVar("topr_derived_from_rewards", default=None)
"""What TOPR derives from the rewards within one `_generate_and_score_completions` call: `topr_signal` (this
process's rows' R - c) and `topr_unscored` (the mark of a skipped unscored batch). `_calculate_rewards`, the hook
that sees the gathered rewards, fills it; the call that opened it puts it on the batch it returns. It lives for that
call only: nothing is written on TRL's input rows, nothing parked on the trainer."""


def name_adapters_base(model) -> dict[str, str]:
    """A PEFT adapter on a model converted from a packaged copy (the Hub out of reach) names the packaged Hub id as
    its base in its adapter_config.json, not the local cache folder it was loaded from, which exists on this machine
    only; returns {cache folder: Hub id} for the card (`TOPRTrainer.save_model`)."""
    renamed = {}
    for config in (getattr(model, "peft_config", None) or {}).values():
        hub_id = packaged_hub_id(config.base_model_name_or_path or "")
        if hub_id is not None:
            renamed[config.base_model_name_or_path] = hub_id
            config.base_model_name_or_path = hub_id
    return renamed


def without_vllm(args: TOPRConfig) -> TOPRConfig:
    """A shallow copy of `args` with `use_vllm=False` (not validated again: the user's config already was)."""
    unconnected = copy.copy(args)
    unconnected.use_vllm = False
    return unconnected


# The ignore: TRL sets GRPOTrainer._entropy_window_stats to None in its __init__, so mypy types it None, and to a
# tensor in its loss; the mirror of that adaptive-entropy step (`GRPOLossMirror`) types it as the tensor it holds.
class TOPRTrainer(OfflineReplay, GRPOLossMirror, GRPOTrainer):  # type: ignore[misc]
    """
    Trainer for Tapered Off-Policy REINFORCE (TOPR, [arXiv:2503.14286](https://huggingface.co/papers/2503.14286)).

    A drop-in replacement for [`~trl.GRPOTrainer`]: same constructor, datasets, reward functions, callbacks,
    PEFT, vLLM generation, DeepSpeed and `accelerate launch`. With `loss_type="topr"` (the [`TOPRConfig`]
    default) the policy loss is TOPR's tapered importance-sampled REINFORCE (Eq. 7), with any loss of
    `topr_trl.loss.POLICY_LOSSES` that loss; with any of TRL's loss types the computation is GRPOTrainer's own.

    This module is what TOPR changes in GRPOTrainer: the per-token policy loss on the signal and mu of each batch
    (masking, KL, the entropy bonus, aggregation and accumulation scaling stay GRPO's, through the labelled copy in
    `topr_trl.training.grpo_mirror`), the paper's signal R - c computed where the rewards are, TOPR's metrics, and the
    opt-in checks. A `train_dataset` or `eval_dataset` of stored completions is replayed (`topr_trl.offline.replay`).
    """

    _tag_names = TOPR_TAG_NAMES
    _name = TOPR_NAME
    _paper = TOPR_PAPER
    # the user's TOPRConfig (with TRL's losses, possibly a GRPOConfig: those paths read TOPR's fields by `topr_setting`)
    args: TOPRConfig

    def __init__(self, model, reward_funcs=None, args: TOPRConfig | None = None, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = TOPRConfig(f"{model_name.split('/')[-1]}-TOPR")
        if needs_resolving(model):  # a .gguf file, or a packaged Hub id where the Hub cannot be reached
            model = resolve_model_source(model)
        if args.loss_type in POLICY_LOSSES and not hasattr(args, "policy_loss_spec"):
            raise ValueError(
                f"loss_type={args.loss_type!r} is TOPR's: pass a TOPRConfig (a GRPOConfig has no TOPR fields)."
            )
        if not hasattr(args, "policy_loss_spec"):  # a GRPOConfig, or another config without TOPR's fields
            # A GRPOConfig carries TRL's loss_type (default "dapo"): the run is GRPOTrainer's, and a user who swapped
            # only the trainer's name must not believe it trained TOPR.
            logger.warning(
                f"TOPRTrainer was given a {type(args).__name__}, so it trains TRL's loss_type={args.loss_type!r} "
                "exactly as GRPOTrainer would, not TOPR (no topr/* metrics; the model card names that loss). To "
                "train TOPR, pass a topr_trl.TOPRConfig (loss_type='topr' by default) with the same fields."
            )
        self._name, self._paper, self._tag_names = trained_method(args.loss_type)
        if kwargs.get("environment_factory") is None:  # with one, the environment's reset() supplies the prompts
            check_prompt_columns(
                {name: kwargs[name] for name in ("train_dataset", "eval_dataset") if kwargs.get(name) is not None}
            )
        self._offline = prepare_replayed_datasets(args, reward_funcs, kwargs)
        self._dataset_baseline = self._baseline_of_dataset(args, kwargs.get("train_dataset"))
        self._sampler_processing = None  # how mu's sampling truncated, for TOPR's losses: set below
        gloo_server = self._generates_on_gloo_server(args)
        # GRPOTrainer's constructor connects to a vLLM server by NCCL, and TRL has no seam to connect another way: it
        # is given a copy of the config that says "no vLLM", and the gloo client is connected below; the trainer then
        # holds the user's own config, untouched.
        # SEAM: GRPOTrainer connects to a server by NCCL in its constructor; see docs/copies.md
        tell_deepspeed_the_cpu()
        with quiet_trl_deprecations():
            super().__init__(model, reward_funcs, args=without_vllm(args) if gloo_server else args, **kwargs)
        if gloo_server:
            self.args = args
            self._connect_gloo_server(args)
        self._prepare_replay()
        self._renamed_bases = name_adapters_base(self.model)
        self.reward_funcs = [
            checked_reward_function(function, name)
            for function, name in zip(self.reward_funcs, self.reward_func_names, strict=True)
        ]
        if self.use_vllm and args.vllm_mode == "colocate":
            use_cpu_weight_reload(self.vllm_generation)
        generate_without_router_logits(self.model)  # GRPOTrainer's own generate fails on Mixtral's router loss
        self._said_rollout_logprobs = False  # `_say_rollout_logprobs_are_mu` speaks once
        self._loss_spec = args.policy_loss_spec if args.loss_type in POLICY_LOSSES else None
        if self._loss_spec is None:
            return
        source = args.topr_behaviour_source
        if source == "sampler" and not self.use_vllm and kwargs.get("rollout_func") is None and not self._offline:
            raise ValueError(
                "topr_behaviour_source='sampler' needs a generator that returns sampling log-probs: set "
                "use_vllm=True or pass a rollout_func that returns `logprobs`; or use 'auto' or 'policy'."
            )
        self._sampler_processing = mu_processing(
            args, self.temperature, "vllm" if self.use_vllm else "transformers", replayed=self._replayed_datasets()
        )
        if args.loss_type in POLICY_LOSSES and not self._offline:  # offline, mu is the stored rows' sampler
            warn_history_dependent_sampling(self.repetition_penalty)
        if self.use_vllm and source in ("auto", "sampler"):
            # mu is vLLM's own sampling distribution, so pi/mu already corrects the train/inference mismatch;
            # TRL's separate correction on top would count it twice.
            self.vllm_importance_sampling_correction = False

    def _replayed_datasets(self) -> list:
        """The datasets of stored completions this trainer replays (training offline, evaluation), whose stored rows
        say how mu sampled them (`topr_trl.training.shared.mu_processing`)."""
        replayed = [self.train_dataset] if self._offline else []
        replayed += list(self.eval_dataset.values()) if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        return [dataset for dataset in replayed if is_offline_dataset(dataset)]

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, *args, scored_rows: torch.Tensor | None = None, **kwargs
    ):
        """GRPOTrainer's log-probs (its fused head: the whole vocabulary at the trainer's temperature), plus, for
        TOPR's losses when mu's sampling truncated or used another temperature, the constant that scores pi on mu's
        support (`forward_on_mus_support`): pi/mu is then exact at learning rate 0, and the gradient
        stays GRPO's. The backbone's hidden states of the same forward are projected again for the sequences
        `scored_rows` (B,) names (every one by default; none where nothing reads the log-probs' values, see
        `_rows_reading_the_ratio`)."""
        forward, shared = self._training_forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if self._sampler_processing is None or (scored_rows is not None and not bool(scored_rows.any())):
            return forward()
        scored = attention_mask
        if scored_rows is not None:
            scored = attention_mask * scored_rows.to(attention_mask).unsqueeze(-1)

        def completion_tokens(outputs, owner, captured):
            """pi's log-probs on mu's support of the completion tokens of the scored sequences (B, logits_to_keep)."""
            hidden = tail_hidden_states(captured.hidden) if shared else captured.hidden
            processed = completion_processed_log_probs(
                owner,
                torch.cat(hidden),
                input_ids,
                scored,
                logits_to_keep,
                self._sampler_processing,
                captured.head_dtype(self.args.cast_lm_head_to_fp32),
            )
            return processed, scored[:, -logits_to_keep:]

        return forward_on_mus_support(model, forward, completion_tokens)

    def _training_forward(
        self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
    ) -> tuple[Callable[[], tuple], bool]:
        """The forward `_get_per_token_logps_and_entropies` runs, and whether it is the shared-prompt one: with
        `topr_shared_prompt_forward`, each distinct prompt computed once for the rows that share it
        (`topr_trl.training.shared_prompt`), where that computes what GRPOTrainer's padded forward does; else (and
        said once where it cannot) GRPOTrainer's own."""
        padded = functools.partial(
            super()._get_per_token_logps_and_entropies,
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            *args,
            **kwargs,
        )
        if args or not topr_setting(self.args, "topr_shared_prompt_forward"):
            return padded, False
        if distinct_prompts(input_ids, attention_mask, logits_to_keep)[0].size(0) == input_ids.size(0):
            return padded, False  # no two rows share a prompt (one completion each): nothing to compute once
        reason = why_the_padded_forward_runs(
            model,
            input_ids.size(1) - logits_to_keep,
            bool(kwargs.get("compute_aux_loss")),
            multimodal=any(kwargs.get(key) is not None for key in MULTIMODAL_KEYS),
        )
        if reason is not None:
            logger.warning_once(f"topr_shared_prompt_forward: {reason}, so the padded forward runs (said once).")
            return padded, False
        shared = functools.partial(
            chunked_shared_prompt_logps,
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            kwargs.get("batch_size"),
            bool(kwargs.get("compute_entropy")),
            self.accelerator.autocast,
        )
        return shared, True

    @staticmethod
    def _generates_on_gloo_server(args) -> bool:
        """Server mode against a server running this package's gloo weight path (`topr-trl vllm-serve` without a GPU):
        TRL's own server mode pushes weights by NCCL only."""
        if not (getattr(args, "use_vllm", False) and args.vllm_mode == "server"):
            return False
        from .generation.vllm_server.client import uses_gloo_server  # noqa: PLC0415 - server mode only

        return uses_gloo_server(args)

    def _connect_gloo_server(self, args) -> None:
        """What GRPOTrainer's constructor does for server mode, with the gloo client
        (`topr_trl.generation.vllm_server.client`): the same `VLLMGeneration` arguments, so generation, the weight walk
        and the prefix-cache reset stay TRL's."""
        from .generation.vllm_server.client import (  # noqa: PLC0415 - server mode only
            GlooServerGeneration,
            server_generation_arguments,
        )

        self.use_vllm = True
        self.vllm_generation = GlooServerGeneration(**server_generation_arguments(self, args))
        self._last_loaded_step = -1

    def _baseline_of_dataset(self, args, train_dataset) -> float | None:
        """c solved once from an offline dataset's `reward` column (topr_baseline_scope='dataset', the paper's
        setting), or None."""
        if (
            args.loss_type not in POLICY_LOSSES
            or args.topr_target_effective_proportion is None
            or args.topr_baseline_scope != "dataset"
        ):
            return None
        if not self._offline or "reward" not in train_dataset.column_names:
            raise ValueError(
                "topr_baseline_scope='dataset' solves the baseline from an offline dataset's `reward` "
                "column; online, use topr_baseline_scope='batch'."
            )
        rewards = torch.tensor([float("nan") if r is None else r for r in train_dataset["reward"]])
        return baseline_for_target_share(rewards, args.topr_target_effective_proportion)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not loaded_through_renaming(self, resume_from_checkpoint, model):  # see topr_trl.training.checkpoint_weights
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self):
        if not loaded_through_renaming(self, self.state.best_model_checkpoint):
            super()._load_best_model()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Trainer's save (checkpoints included); an adapter's card (PEFT writes the base model's local folder) names
        the packaged Hub id its adapter_config.json names (`name_adapters_base`)."""
        super().save_model(output_dir, _internal_call)
        card = Path(str(output_dir or self.args.output_dir)) / "README.md"
        if self._renamed_bases and self.is_world_process_zero() and card.is_file():
            text = card.read_text()
            for folder, hub_id in self._renamed_bases.items():
                text = text.replace(folder, hub_id)  # `base_model:` and the `base_model:adapter:` tag
            card.write_text(text)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card (which cites TOPR through `_paper`), plus what trained the model: the data, the reward
        functions and their weights, and the TOPR configuration. A local dataset is named as a path (TRL's template
        would link it to the Hub); the quick start loads the saved folder when the model is not on the Hub."""
        local_data = dataset_name is not None and Path(str(dataset_name)).expanduser().exists()
        super().create_model_card(model_name=model_name, dataset_name=None if local_data else dataset_name, tags=tags)
        card = Path(self.args.output_dir) / "README.md"
        if not self.is_world_process_zero() or not card.exists():
            return
        text = card.read_text().replace('model="None"', f'model="{self.args.output_dir}"')
        weights = self.reward_weights.tolist()
        text += "\n## Training data and rewards\n\n" + (
            f"Trained on the local dataset `{dataset_name}`.\n\n" if local_data else ""
        )
        text += "| reward function | weight |\n|---|---|\n" + "".join(
            f"| `{name}` | {weight:g} |\n" for name, weight in zip(self.reward_func_names, weights, strict=True)
        )
        card.write_text(text)
        # TRL names no base model for one loaded from a local folder, which its template renders as "[None]"; a
        # folder converted from a GGUF file (a packaged Hub id without the Hub) is named by what it came from
        local = get_config_model_id(self.model.config)
        source = converted_source(local) if local else None
        card.write_text(
            card.read_text().replace(
                "fine-tuned version of [None](https://huggingface.co/None)",
                f"fine-tuned version of {source}"
                if source
                else f"fine-tuned version of a local model (`{Path(str(local)).name or local}`)",
            )
        )
        if self._loss_spec is None:
            card.write_text(
                card.read_text() + f"\n## Loss\n\nTrained with TRL's `loss_type={self.args.loss_type!r}`, "
                "computed exactly as GRPOTrainer computes it (through topr-trl's TOPRTrainer), not with "
                "TOPR.\n"
            )
            return
        limits = self._loss_spec.limits
        fields = [
            "loss_type",
            "topr_ratio_level",
            "topr_signal",
            "topr_baseline",
            "topr_target_effective_proportion",
            "topr_loss_aggregation",
            "topr_behaviour_source",
            "topr_positive_weight",
            "topr_negative_weight",
            "learning_rate",
            "beta",
            "num_generations",
            "temperature",
            "max_completion_length",
        ]
        rows = (
            []
            if limits is None
            else [
                f"| truncation limits (a+, b+, a-, b-) | {limits.positive_lower}, {limits.positive_upper}, "
                f"{limits.negative_lower}, {limits.negative_upper} |"
            ]
        )
        rows += [f"| `{name}` | {getattr(self.args, name)} |" for name in fields]
        section = "\n## TOPR configuration\n\n| setting | value |\n|---|---|\n" + "\n".join(rows) + "\n"
        card.write_text(card.read_text() + section)

    # ------------------------------------------------------------------ rewards and the paper's signal
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """GRPO's rewards (gathered over processes), checked; what TOPR derives from them is computed here, where they
        are, and handed to the batch through `DERIVED_FROM_REWARDS`: this process's signal R - c, and the mark of a
        skipped unscored batch."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        infinite = torch.isinf(rewards_per_func)
        if topr_setting(self.args, "topr_check_finite") and infinite.any():
            name = self.reward_func_names[int(infinite.any(dim=0).nonzero()[0])]
            raise ValueError(
                f"Reward function '{name}' returned an infinite reward. Return a finite number, or None (or NaN) for "
                "a completion it cannot score: such a completion is then left out of the update."
            )
        derived = DERIVED_FROM_REWARDS.get()
        if derived is None:  # called outside `_generate_and_score_completions`: nothing to hand on
            return rewards_per_func
        if self.model.training and torch.isnan(rewards_per_func).all() and self._unscored_batch_is_skipped():
            derived["topr_unscored"] = torch.ones(len(inputs), dtype=torch.bool, device=rewards_per_func.device)
        if self._loss_spec is not None and self.args.topr_signal == "reward":
            start = self.accelerator.process_index * len(inputs)
            derived["topr_signal"] = self._reward_signal(rewards_per_func)[start : start + len(inputs)]
        return rewards_per_func

    def _unscored_batch_is_skipped(self) -> bool:
        """No completion of the whole (gathered) generation batch could be scored. GRPOTrainer warns and trains on
        (`topr_unscored_batch="train"`); "error" stops; "skip" zeroes the step's loss (True)."""
        action = topr_setting(self.args, "topr_unscored_batch")
        names = ", ".join(f"'{name}'" for name in self.reward_func_names)
        if action == "error":
            raise ValueError(
                f"Every completion of the generation batch at step {self.state.global_step} got None/NaN from every "
                f"reward function ({names}), so the step would train nothing: fix the reward functions (or the dataset "
                "columns they read), or set topr_unscored_batch='skip' (or 'train') to go on."
            )
        if action == "skip":
            logger.warning_once(
                f"Skipping steps whose completions no reward function ({names}) could score "
                "(topr_unscored_batch='skip'); this is said once."
            )
        return action == "skip"

    def _reward_signal(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """R(tau) - c for the whole (gathered) generation batch; a completion no reward function could score (all
        None/NaN) gets signal 0: it does not move the policy."""
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        target = self.args.topr_target_effective_proportion
        baseline = self.args.topr_baseline
        if self._dataset_baseline is not None:
            baseline = self._dataset_baseline
        elif target is not None:
            baseline = baseline_for_target_share(rewards, target)
        assert self.model is not None
        if target is not None:
            self._metrics["train" if self.model.training else "eval"]["topr/baseline"].append(float(baseline))
        num_generations = self.num_generations if self.model.training else self.num_generations_eval
        assert num_generations is not None  # GRPOConfig checked it against the batch; GRPOTrainer fills in the eval one
        return reward_signal(rewards, baseline, num_generations)

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        # A batch of stored completions (training or evaluation) goes through GRPOTrainer's rollout_func path, a batch
        # of prompts is generated as GRPOTrainer would (its own generation, or the user's rollout_func).
        replay = "completion_ids" in inputs[0]
        derived: dict[str, torch.Tensor] = {}
        opened = DERIVED_FROM_REWARDS.set(derived)
        try:
            with self._replaying(inputs) if replay else nullcontext(), quiet_trl_deprecations():
                output = super()._generate_and_score_completions(inputs)
        finally:
            DERIVED_FROM_REWARDS.reset(opened)
        device = output["completion_ids"].device
        if replay and "behaviour_logps" not in inputs[0] and self._behaviour_model is not None:
            output["sampling_per_token_logps"] = self._behaviour_logps(output)
        output.update({key: value.to(device) for key, value in derived.items()})
        if (
            not replay
            and self.rollout_func is not None
            and output.get("sampling_per_token_logps") is not None
            and not self.use_vllm
        ):  # the user's rollout_func returned `logprobs`: pi/mu reads them as mu's
            output["topr_rollout_logprobs"] = torch.ones(len(inputs), dtype=torch.bool, device=device)
        return output

    # ------------------------------------------------------------------ the loss
    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs) if self._loss_spec is None else self._topr_loss(model, inputs)
        if "topr_unscored" in inputs:
            # topr_unscored_batch='skip': the batch moves nothing, not even through the KL or entropy terms
            loss = loss * 0.0
        return loss

    def _rows_reading_the_ratio(self, signal: torch.Tensor, on_policy: bool) -> torch.Tensor:
        """(B,) the sequences whose log-probs' values must be pi's on mu's support (`topr_trl.support`): those whose
        weight reads pi/mu (`reads_the_ratio`: not canonical TOPR's positives, whose weight is pinned at 1), every one
        where a KL term or GRPO's off-policy mask reads the log-probs too, and none `on_policy` (mu's log-probs are
        this forward's own, detached: GRPO kept none from generation time) without KL: pi/mu is then 1 whatever the
        support."""
        if on_policy and self.beta == 0.0:
            return torch.zeros_like(signal.reshape(-1), dtype=torch.bool)
        if self.beta != 0.0 or self.off_policy_mask_threshold is not None:
            return torch.ones_like(signal.reshape(-1), dtype=torch.bool)
        assert self._loss_spec is not None  # called by `_topr_loss`: one of TOPR's losses
        return reads_the_ratio(signal, self._loss_spec)

    def _say_rollout_logprobs_are_mu(self, policy_logps, rollout_logps, mask) -> None:
        """Once, at the first batch: GRPOTrainer ignores a rollout_func's `logprobs` without vLLM; TOPR takes them as
        mu's, which is right when they are the sampler's and wrong otherwise (log-probs from a model in train mode,
        under dropout or another precision): say so, with how far they are from the policy's here."""
        if self._said_rollout_logprobs:
            return
        self._said_rollout_logprobs = True
        with torch.no_grad():
            gap = ((policy_logps - rollout_logps) * mask).sum(-1)  # log pi/mu of each completion
            values = self.accelerator.gather(gap.float())
        logger.warning(
            "the rollout_func returns `logprobs`: TOPR uses them as mu's (GRPOTrainer ignores them without vLLM). At "
            f"this first batch, before any update, pi/mu per completion spans [{values.exp().min().item():.3g}, "
            f"{values.exp().max().item():.3g}] (1 where they are the sampler's and the policy sampled); if they are "
            "not the sampler's log-probs, set topr_behaviour_source='policy'."
        )

    def _topr_loss(self, model, inputs):
        """TOPR's contribution: the per-token policy loss of the configured loss type (`topr_trl.loss.POLICY_LOSSES`)
        on the signal and mu of this batch. Everything around it is GRPO's (`_grpo_loss_around_policy_term`)."""
        mode = "train" if self.model.training else "eval"
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        signal = inputs["topr_signal"] if self.args.topr_signal == "reward" else inputs["advantages"]
        signal = signal.reshape(-1, 1)
        on_policy = inputs.get("sampling_per_token_logps") is None and inputs.get("old_per_token_logps") is None
        scored = self._rows_reading_the_ratio(signal, on_policy)
        per_token_logps, entropies, aux_loss = self._policy_logps_and_entropies(model, inputs, scored_rows=scored)
        # pi/mu of a sequence not scored on a truncated mu's support would carry the bias: it is not reported
        ratio_read = scored if self._sampler_processing is not None and not on_policy else None
        # mu: the sampler's log-probs when asked for and given (vLLM, a rollout_func, stored rows), else the policy's at
        # generation time; on-policy and aligned, GRPO skipped those: then pi = mu.
        behaviour_logps = None
        if self.args.topr_behaviour_source in ("auto", "sampler"):
            behaviour_logps = inputs.get("sampling_per_token_logps")
        if behaviour_logps is None:
            behaviour_logps = inputs.get("old_per_token_logps")
        if behaviour_logps is None:
            behaviour_logps = per_token_logps.detach()
        policy_at_generation, sampler_logps = inputs.get("old_per_token_logps"), inputs.get("sampling_per_token_logps")
        if policy_at_generation is not None and sampler_logps is not None:
            compared = mask if ratio_read is None else mask * ratio_read.to(mask).unsqueeze(-1)
            totals = self.accelerator.reduce(
                drift_and_mismatch_sums(per_token_logps, policy_at_generation, sampler_logps, compared), reduction="sum"
            )
            for name, value in drift_and_mismatch(totals.tolist()).items():
                self._metrics[mode][name].append(value)
        if "topr_rollout_logprobs" in inputs and behaviour_logps is inputs.get("sampling_per_token_logps"):
            self._say_rollout_logprobs_are_mu(per_token_logps, behaviour_logps, mask)
        terms = policy_per_token_loss(per_token_logps, behaviour_logps, signal, mask, self._loss_spec)
        loss, policy_per_token, aggregate_kwargs = self._grpo_loss_around_policy_term(
            inputs, mode, mask, terms.per_token_loss, per_token_logps, entropies, aux_loss, signal, behaviour_logps
        )
        nonfinite, ratio_ranges = log_policy_metrics(
            self.accelerator,
            self._metrics[mode],
            terms,
            signal,
            mask,
            entropies,
            policy_per_token,
            aggregate_kwargs,
            loss,
            negative_weight=self._loss_spec.negative_weight,
            reward_signal=self.args.topr_signal == "reward",
            ratio_read=ratio_read,
        )
        check_finite_loss(nonfinite, ratio_ranges, stop=self.args.topr_check_finite, step=self.state.global_step)
        return loss
