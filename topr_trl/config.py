"""`TOPRConfig`: `GRPOConfig` plus the fields of the TOPR loss family; their checks are `topr_trl.validation`'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from trl import GRPOConfig

from .loss import AGGREGATIONS, POLICY_LOSSES, RATIO_LEVELS, TRL_LOSS_TYPES, PolicyLossSpec, TruncationLimits
from .runtime.noise import quiet_trl_deprecations
from .validation import (
    BEHAVIOUR_SOURCES,
    FIELD_CHECKS,
    UNSCORED_BATCH_ACTIONS,
    check_across_fields,
    check_before_trl_config,
    check_fields,
    explain_generation_batch,
    loss_types,
    policy_loss_spec_of,
    resolve_limits,
)


_GRPO_DELTA = GRPOConfig.__dataclass_fields__["delta"]


@dataclass
class TOPRFields:
    r"""
    TOPR's fields, declared once: [`TOPRConfig`] (on [`~trl.GRPOConfig`]) and `AsyncTOPRConfig` (on TRL's
    `AsyncGRPOConfig`) both inherit them, with their defaults, their help and their checks; each config's docstring
    says what they mean for its trainer. Listed before TRL's config among a config's bases, so that its `loss_type`
    and `delta` take GRPOConfig's place in the field order. The checks read TRL's fields too (`learning_rate`,
    `epsilon`, ...): a config is this class and one of TRL's.
    """

    loss_type: str = field(
        default="topr",
        metadata={
            "help": f"The loss: TOPR's {list(POLICY_LOSSES)} or TRL's {list(TRL_LOSS_TYPES)} (computed by GRPOTrainer)."
        },
    )
    topr_positive_lower: float | None = field(default=None, metadata={"help": "a+ (None: the loss type's)."})
    topr_positive_upper: float | None = field(default=None, metadata={"help": "b+, may be inf (None: loss type's)."})
    topr_negative_lower: float | None = field(
        default=None, metadata={"help": "a- (None: the loss type's); > 0 is unbounded."}
    )
    topr_negative_upper: float | None = field(default=None, metadata={"help": "b-, may be inf (None: loss type's)."})
    topr_ratio_level: str = field(default="sequence", metadata={"help": f"How pi/mu is formed: {list(RATIO_LEVELS)}."})
    topr_signal: str = field(
        default="advantage",
        metadata={"help": "'advantage' (GRPO's group advantage) or 'reward' (R - topr_baseline, the paper)."},
    )
    # Declared `str` because TRL's parser (HfArgumentParser) takes no `float | str` field, and c is a number or a mode;
    # `_check_topr_values` turns it into a float or a mode (the asynchronous config then refuses a mode: its samples
    # arrive one at a time, not in groups). Type checkers see what the constructor takes and the config then holds.
    if TYPE_CHECKING:
        topr_baseline: float | str = 0.0
    else:
        topr_baseline: str = field(
            default="0.0",
            metadata={"help": "Baseline c for topr_signal='reward': a number, 'group_mean' or 'batch_mean'."},
        )
    topr_positive_weight: float = field(default=1.0, metadata={"help": "Multiplier of the positive branch."})
    topr_negative_weight: float = field(default=1.0, metadata={"help": "Multiplier of the negative branch."})
    topr_loss_aggregation: str = field(
        default="seq-mean-token-mean", metadata={"help": f"Loss aggregation: {list(AGGREGATIONS)}."}
    )
    topr_check_finite: bool = field(
        default=False,
        metadata={
            "help": "Stop on an infinite reward (ValueError) or a non-finite TOPR loss (FloatingPointError) "
            "instead of training on it, as GRPOTrainer does (the CLI: True)."
        },
    )
    cispo_epsilon_low: float = field(default=0.1, metadata={"help": "cispo_two_sided: 1 - eps lower clip."})
    cispo_epsilon_high: float = field(default=0.1, metadata={"help": "cispo_two_sided: 1 + eps upper clip."})
    kimi15_tau: float = field(default=0.1, metadata={"help": "kimi15: squared log-ratio weight."})
    # GRPOConfig's own field (PPO's dual clip), which the "ppo" loss reads and TRL's AsyncGRPOConfig lacks: GRPOConfig's
    # default and help, so that TOPRConfig's is GRPOConfig's and the asynchronous "ppo" loss reads it too.
    # (cast: a Field's default is typed as possibly MISSING, which GRPOConfig's `delta`, defaulting to None, is not)
    delta: float | None = field(default=cast("float | None", _GRPO_DELTA.default), metadata=dict(_GRPO_DELTA.metadata))

    @property
    def uses_topr_loss(self) -> bool:
        """Whether the trainer computes the loss itself (a registered loss), rather than GRPOTrainer (TRL's)."""
        return self.loss_type in POLICY_LOSSES

    @property
    def topr_limits(self) -> TruncationLimits | None:
        """The truncation limits (a+, b+, a-, b-) in force: the loss type's (Eq. 7's entries of the registry),
        overridden by the explicit topr_*_lower/upper fields; None for a loss that is not Eq. 7's."""
        return resolve_limits(self)

    @property
    def policy_loss_spec(self) -> PolicyLossSpec:
        """The loss the trainer computes when `loss_type` is one of TOPR's registry."""
        return policy_loss_spec_of(self)


@dataclass
class TOPRConfig(TOPRFields, GRPOConfig):
    r"""
    Configuration for [`TOPRTrainer`]: every [`~trl.GRPOConfig`] field, plus the Tapered Off-Policy REINFORCE
    (TOPR, [arXiv:2503.14286](https://huggingface.co/papers/2503.14286)) loss family. Only `loss_type`
    changes default: `"topr"`. `loss_type` is the one selector of the loss: one of the losses TOPRTrainer computes
    (`topr_trl.loss.POLICY_LOSSES`, which `register_policy_loss` extends) or one of TRL's, which makes [`TOPRTrainer`]
    compute exactly what [`~trl.GRPOTrainer`] computes. Setting a field below that the chosen loss does not read (a
    `topr_*` field with one of TRL's loss types, `kimi15_tau` with `loss_type="ppo"`, ...) fails at construction,
    naming it.

    Parameters:
        loss_type (`str`, *optional*, defaults to `"topr"`):
            The loss. The rows of the paper's Table 1, Eq. 7 with truncation limits (a+, b+, a-, b-): `"topr"`
            (1, 1, 0, 1), `"sft"` (1, 1, 0, 0), `"naive_reinforce"` (1, 1, 1, 1; ROLL's `vanilla`),
            `"off_policy_reinforce"` (0, inf, 0, inf), `"tis"` (0, 1, 0, 1). Other off-policy losses on TOPR's signal,
            ratio and mu, to compare in one trainer: `"ppo"` (clipped surrogate with `epsilon`/`epsilon_high`/`delta`),
            `"cispo_two_sided"` (ROLL's CISPO) and `"kimi15"`. Or one of TRL's loss types (`"grpo"`, `"dr_grpo"`,
            `"dapo"`, `"bnpo"`, `"cispo"`, `"sapo"`, `"luspo"`, `"vespo"`), computed by GRPOTrainer.
        topr_positive_lower (`float` or `None`, *optional*, defaults to `None`):
            a+, the lower limit of the importance ratio of trajectories with non-negative signal, for the Eq. 7
            loss types. `None` takes the loss type's value. Set it (with the three others) to explore limits
            outside Table 1.
        topr_positive_upper (`float` or `None`, *optional*, defaults to `None`):
            b+, the upper limit for non-negative trajectories; may be `inf`. `None` takes the loss type's value.
        topr_negative_lower (`float` or `None`, *optional*, defaults to `None`):
            a-, the lower limit for negative trajectories. Any a- > 0 makes the objective unbounded (Prop. 3.2)
            and warns. `None` takes the loss type's value.
        topr_negative_upper (`float` or `None`, *optional*, defaults to `None`):
            b-, the upper limit for negative trajectories; may be `inf`. `None` takes the loss type's value.
        topr_ratio_level (`str`, *optional*, defaults to `"sequence"`):
            How pi/mu is formed: `"sequence"`, the product of token ratios pi(tau)/mu(tau) (the paper);
            `"length_normalized"`, the geometric mean of token ratios (GSPO; what TRL calls
            `importance_sampling_level="sequence"`); `"token"`, one ratio per token (ROLL, Trinity-RFT).
            The product tapers stale negatives faster as completions grow. That taper is what keeps TOPR stable
            on stale data: with 62-token completions and mu up to 63 updates behind, `"sequence"` gained
            (+0.033 late pass@1 over fresh data) while `"length_normalized"` collapsed (-0.359); see
            docs/off-policy.md, "Long completions".
        topr_signal (`str`, *optional*, defaults to `"advantage"`):
            What splits positives from negatives and scales the update. `"advantage"`: GRPO's group advantage,
            shaped by `scale_rewards` and `multi_objective_aggregation` exactly as a GRPO user has it today.
            `"reward"`: the paper's R(tau) - c with c set by `topr_baseline`; use it with +1/-1 rewards to
            reproduce the paper or to control the effective proportion of positives (Eq. 12).
        topr_baseline (`float` or `str`, *optional*, defaults to `0.0`):
            The baseline c subtracted from the reward when `topr_signal="reward"`: a number, `"group_mean"` (the
            mean reward of the prompt's completions) or `"batch_mean"`. Raising c lowers the effective share of
            positives p~ = p(1-c)/(1+(1-2p)c); the paper finds p~ of 10-20 % best.
        topr_target_effective_proportion (`float` or `None`, *optional*, defaults to `None`):
            With `topr_signal="reward"`: instead of a fixed `topr_baseline`, pick c so that the effective
            positive proportion p~ (Eq. 12, generalised to any rewards) equals this target; the paper finds
            0.1-0.2 best. Logged as `topr/baseline`. `None` keeps the fixed baseline.
        topr_baseline_scope (`str`, *optional*, defaults to `"batch"`):
            Where the target baseline is solved: `"batch"` (every generation batch, online or offline) or
            `"dataset"` (once, from the `reward` column of an offline dataset, the paper's setting).
        topr_positive_weight (`float`, *optional*, defaults to `1.0`):
            Multiplier of the positive branch (ROLL's `topr_positive_weight`). 1 in the paper.
        topr_negative_weight (`float`, *optional*, defaults to `1.0`):
            Multiplier of the negative branch (ROLL's `topr_negative_weight`). 1 in the paper.
        topr_loss_aggregation (`str`, *optional*, defaults to `"seq-mean-token-mean"`):
            `"seq-mean-token-mean"`: each trajectory's loss divided by its length, averaged over trajectories
            (the paper; TRL's `grpo`). `"token-mean"`: mean over the micro-batch's tokens (TRL's `bnpo`).
            `"global-token-mean"`: divided by the tokens of the whole accumulation window on all processes
            (TRL's `dapo`). `"seq-mean-token-sum-norm"`: divided by batch size times `max_completion_length`
            (TRL's `dr_grpo`).
        topr_behaviour_source (`str`, *optional*, defaults to `"auto"`):
            Where mu's log-probs come from. `"sampler"`: the generator's own sampling log-probs (vLLM, or a
            `rollout_func` that returns `logprobs`); TRL's separate vLLM importance-sampling correction is then
            switched off, since pi/mu already corrects for the sampler. `"policy"`: the policy's log-probs at
            generation time (TRL's old log-probs), with TRL's vLLM correction kept. `"auto"`: the sampler's when
            the generator returned them, else the policy's.
        topr_behaviour_model (`str` or `None`, *optional*, defaults to `None`):
            Path or Hub id of mu for an offline dataset without a `behaviour_logps` column: mu's log-probs are then
            computed by this frozen model (prepared like GRPO's reference model, so DeepSpeed ZeRO-3 shards it).
            Costs one extra forward pass per batch; storing the log-probs at generation time avoids it.
        topr_offline_epochs (`float`, *optional*, defaults to `1.0`):
            Passes over an offline `train_dataset` (one with `completion_ids` or `completion`): the paper's
            Algorithm 1 makes one.
            For offline data it replaces `num_train_epochs` (which keeps its meaning for online training); raise it
            to reuse the data, as in the paper's far-off-policy experiments. `max_steps` > 0 still takes precedence.
        topr_unscored_batch (`str`, *optional*, defaults to `"train"`):
            What to do with a training generation batch that no reward function could score (every reward function
            returned None or NaN for every completion), online or offline. `"train"`: what GRPOTrainer does (TRL
            logs its warning, the batch's signal is 0 so the policy term moves nothing, and the KL and entropy
            terms still act). `"skip"`: zero the whole loss of such steps (KL and entropy terms included), with one
            warning. `"error"`: stop with a `ValueError` naming the reward functions, since such a batch usually
            means a broken reward function (the `topr-trl` command line's default).
        topr_check_finite (`bool`, *optional*, defaults to `False`):
            Stop on non-finite numbers instead of training on them, as GRPOTrainer does: an infinite reward raises
            a `ValueError` naming the reward function, and a non-finite TOPR loss a `FloatingPointError` that
            reports the ratio ranges. Off by default (GRPOTrainer's behaviour: a non-finite loss is trained on and
            logged as NaN, and TOPRTrainer warns once); the `topr-trl` command line turns it on.
        topr_shared_prompt_forward (`bool`, *optional*, defaults to `False`):
            In the training forward (the policy's, and mu's or the reference model's where they run), compute each
            distinct prompt of a batch once for all the completions that share it, through transformers' cache,
            instead of once per completion: the same log-probs, entropies and gradients as GRPOTrainer's padded
            forward up to float rounding, at a fraction of the cost where prompts are long against completions
            (`num_generations` completions of one prompt). Where it cannot compute the same thing (multimodal
            inputs, gradient checkpointing, a mixture of experts' auxiliary loss) the padded forward runs, said once:
            set `gradient_checkpointing=False` (GRPOConfig defaults to `True`) for it to train. Off by default for
            that reason: under GRPOConfig's defaults it would train nothing differently.
        cispo_epsilon_low (`float`, *optional*, defaults to `0.1`):
            `loss_type="cispo_two_sided"`: the stop-gradient ratio is clipped below at 1 - `cispo_epsilon_low`.
        cispo_epsilon_high (`float`, *optional*, defaults to `0.1`):
            `loss_type="cispo_two_sided"`: the stop-gradient ratio is clipped above at 1 + `cispo_epsilon_high`.
        kimi15_tau (`float`, *optional*, defaults to `0.1`):
            `loss_type="kimi15"`: weight of the squared log-ratio penalty tau/2 (log pi/mu)^2.
    """

    topr_target_effective_proportion: float | None = field(
        default=None,
        metadata={"help": "Solve the baseline so that p~ (Eq. 12) hits this target (topr_signal='reward')."},
    )
    topr_baseline_scope: str = field(
        default="batch", metadata={"help": "Where the target baseline is solved: 'batch' or 'dataset' (offline)."}
    )
    topr_behaviour_source: str = field(
        default="auto", metadata={"help": f"Where mu's log-probs come from: {list(BEHAVIOUR_SOURCES)}."}
    )
    topr_behaviour_model: str | None = field(
        default=None, metadata={"help": "Frozen mu (path or hub id) for offline datasets without behaviour_logps."}
    )
    topr_offline_epochs: float = field(
        default=1.0, metadata={"help": "Passes over an offline dataset (Algorithm 1: 1); replaces num_train_epochs."}
    )
    topr_unscored_batch: str = field(
        default="train",
        metadata={
            "help": f"A training batch no reward function could score (all None/NaN): "
            f"{list(UNSCORED_BATCH_ACTIONS)} ('train': GRPOTrainer's behaviour; the CLI: 'error')."
        },
    )

    topr_shared_prompt_forward: bool = field(
        default=False,
        metadata={
            "help": "Compute each distinct prompt once for the completions that share it in the training forward "
            "(the same log-probs and gradients as the padded forward; faster where prompts are long)."
        },
    )

    def __post_init__(self) -> None:
        check_before_trl_config(self, loss_types())
        generation_batch_set = self.generation_batch_size is not None or self.steps_per_generation is not None
        try:
            with quiet_trl_deprecations():  # GRPOConfig's own default trips transformers' deprecation
                super().__post_init__()
        except ValueError:
            explain_generation_batch(self, generation_batch_set)
            raise
        check_fields(self, FIELD_CHECKS)
        check_across_fields(self)


# TOPRTrainer also takes a plain GRPOConfig (only the trainer's name swapped): TOPR's run-level fields then keep their
# TOPRConfig defaults, which are GRPOTrainer's behaviour.
_TOPR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TOPRConfig)}


def topr_setting(args, name: str):
    """`args.<name>`, or TOPRConfig's default when `args` is a GRPOConfig."""
    return getattr(args, name, _TOPR_DEFAULTS[name])
