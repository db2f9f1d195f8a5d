"""`TOPRConfig`: `GRPOConfig` plus the fields of the TOPR loss family."""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

from trl import GRPOConfig

from .loss import (
    AGGREGATIONS,
    LIMIT_FIELDS,
    POLICY_LOSSES,
    RATIO_LEVELS,
    TRL_LOSS_TYPES,
    PolicyLossSpec,
    TruncationLimits,
    finite_non_negative,
)


SIGNALS: tuple[str, ...] = ("advantage", "reward")
BASELINE_MODES: tuple[str, ...] = ("group_mean", "batch_mean")
BEHAVIOUR_SOURCES: tuple[str, ...] = ("auto", "sampler", "policy")
BASELINE_SCOPES: tuple[str, ...] = ("batch", "dataset")
UNSCORED_BATCH_ACTIONS: tuple[str, ...] = ("train", "skip", "error")


# The fields every loss of TOPR's registry reads (`topr_trl.loss.POLICY_LOSSES`), and none of TRL's loss types; the
# fields only some of them read are listed with their registration (`RegisteredPolicyLoss.reads`). topr_offline_epochs,
# topr_behaviour_model, topr_unscored_batch and topr_check_finite concern the data and the run, not the loss, and
# apply to every loss type.
_FAMILY_FIELDS: tuple[str, ...] = (
    "topr_ratio_level",
    "topr_signal",
    "topr_baseline",
    "topr_target_effective_proportion",
    "topr_baseline_scope",
    "topr_positive_weight",
    "topr_negative_weight",
    "topr_loss_aggregation",
    "topr_behaviour_source",
)


def check_flag(field_name: str, value: object) -> None:
    """Raise a ValueError naming the field unless `value` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"`{field_name}` must be True or False, got {value!r}.")


def loss_types() -> tuple[str, ...]:
    """What `loss_type` takes now: the registered TOPR-family losses (live: a loss registered after import counts),
    then TRL's."""
    return (*POLICY_LOSSES, *TRL_LOSS_TYPES)


def _parse_number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def check_choice(field_name: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise a ValueError naming the field, the allowed values and the closest one."""
    if value in allowed:
        return
    close = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"`{field_name}`={value!r} is not supported; choose one of {list(allowed)}.{hint}")


_GRPO_DELTA = GRPOConfig.__dataclass_fields__["delta"]


class _TRLConfig(Protocol):
    """What `TOPRFields._check_before_trl_config` reads of a config, which is TOPRFields and one of TRL's configs
    (GRPOConfig, AsyncGRPOConfig): its `loss_type`, and TRL's fields it checks."""

    loss_type: str

    @property
    def learning_rate(self) -> float: ...

    @property
    def max_completion_length(self) -> int | None: ...


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

    def _check_before_trl_config(self: _TRLConfig, loss_types: tuple[str, ...]) -> None:
        """Before TRL's `__post_init__`: `loss_type` among what this config's trainer computes, and the values TRL's
        config takes that the run refuses later, far from the field (torch's optimizer: "Invalid learning rate";
        generate: `max_new_tokens`), refused here, naming the field."""
        check_choice("loss_type", self.loss_type, loss_types)
        if isinstance(self.learning_rate, (int, float)) and self.learning_rate < 0:
            raise ValueError(
                f"`learning_rate` must be >= 0, got {self.learning_rate!r}; the optimizer refuses a negative one."
            )
        if isinstance(self.max_completion_length, int) and self.max_completion_length < 1:
            raise ValueError(
                f"`max_completion_length` must be at least 1 (new tokens per completion), got "
                f"{self.max_completion_length!r}."
            )

    def _check_topr_values(self, loss_aggregations: tuple[str, ...]) -> None:
        """Each TOPR field's own value, the loss's knobs included (after TRL's `__post_init__`); `topr_baseline`
        becomes a float or a mode. `loss_aggregations`: those this config's trainer computes."""
        check_choice("topr_ratio_level", self.topr_ratio_level, RATIO_LEVELS)
        check_choice("topr_signal", self.topr_signal, SIGNALS)
        check_choice("topr_loss_aggregation", self.topr_loss_aggregation, loss_aggregations)
        self.topr_baseline = parse_baseline(self.topr_baseline)
        check_flag("topr_check_finite", self.topr_check_finite)
        check_loss_knobs(self)

    def _check_what_the_loss_reads(self) -> None:
        """Last: a knob the chosen loss does not read fails; a TRL loss field it does not read, Prop. 3.2's unbounded
        limits and a baseline the signal does not read warn. The warnings point at the caller of the config's
        constructor (stacklevel 4: past this method, `__post_init__` and the dataclass `__init__`)."""
        refuse_unread_knobs(self)
        if self.uses_topr_loss:
            say_trl_loss_fields_unread(self)
        limits = self.topr_limits  # validates the limits
        if limits is not None and limits.negative_lower > 0:
            warnings.warn(
                f"topr_negative_lower (a-) = {limits.negative_lower} > 0: the TOPR objective is then unbounded "
                "(Prop. 3.2 of the paper) and training can collapse by pushing negatives' probabilities to 0. "
                "Set topr_negative_lower=0 unless this is the point of the experiment.",
                UserWarning,
                stacklevel=4,
            )
        if self.uses_topr_loss and self.topr_baseline != 0.0 and self.topr_signal == "advantage":
            warnings.warn(
                "topr_baseline is only used with topr_signal='reward'; with 'advantage' the group advantage "
                "already has its baseline subtracted.",
                UserWarning,
                stacklevel=4,
            )


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

    def __post_init__(self) -> None:
        self._check_before_trl_config(loss_types())
        generation_batch_set = self.generation_batch_size is not None or self.steps_per_generation is not None
        try:
            super().__post_init__()
        except ValueError:
            self._explain_generation_batch(generation_batch_set)
            raise
        self._check_topr_values(AGGREGATIONS)
        check_choice("topr_behaviour_source", self.topr_behaviour_source, BEHAVIOUR_SOURCES)
        check_choice("topr_baseline_scope", self.topr_baseline_scope, BASELINE_SCOPES)
        target = self.topr_target_effective_proportion
        if target is not None:
            if not (isinstance(target, (int, float)) and 0 < target < 1):
                raise ValueError(f"`topr_target_effective_proportion` must be in (0, 1), got {target!r}.")
            if self.topr_signal != "reward":
                raise ValueError(
                    "`topr_target_effective_proportion` sets the baseline of R - c: it needs topr_signal='reward'."
                )
        if not (isinstance(self.topr_offline_epochs, (int, float)) and self.topr_offline_epochs > 0):
            raise ValueError(f"`topr_offline_epochs` must be > 0, got {self.topr_offline_epochs!r}.")
        check_choice("topr_unscored_batch", self.topr_unscored_batch, UNSCORED_BATCH_ACTIONS)
        self._refuse_topr_fields_with_trls_loss()
        self._check_what_the_loss_reads()

    def _explain_generation_batch(self, generation_batch_set: bool) -> None:
        """GRPOConfig refuses a generation batch that `num_generations` does not divide, naming
        `generation_batch_size`; when the user set neither it nor `steps_per_generation`, the batch is theirs by
        other names: say it in those (GRPOConfig has set the batch before refusing it)."""
        batch, groups = self.generation_batch_size, self.num_generations
        if (
            generation_batch_set
            or not isinstance(batch, int)
            or not isinstance(groups, int)
            or groups < 1
            or batch % groups == 0
        ):
            return
        assert self.steps_per_generation is not None  # GRPOConfig set it with the batch (the user set neither)
        processes = batch // (self.per_device_train_batch_size * self.steps_per_generation)
        raise ValueError(
            f"`num_generations` ({groups}) must divide the completions generated per optimizer step, "
            f"`per_device_train_batch_size` ({self.per_device_train_batch_size}) x processes ({processes}) x "
            f"`gradient_accumulation_steps` ({self.gradient_accumulation_steps}) = {batch}: change "
            f"`num_generations` to a divisor of {batch}, or `per_device_train_batch_size` to a multiple of "
            f"{groups}."
        ) from None

    def _refuse_topr_fields_with_trls_loss(self) -> None:
        """One field selects the loss: `loss_type`. A TOPR-family field (or a field only registered losses read) with
        one of TRL's loss types fails here, naming the field to drop."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        if not self.uses_topr_loss:
            for name in (*_FAMILY_FIELDS, *(name for name in knob_readers() if name in defaults)):
                value = getattr(self, name)
                if value == defaults[name] or (name == "topr_baseline" and value == _parse_number(defaults[name])):
                    continue
                raise ValueError(
                    f"`{name}` has no effect with loss_type={self.loss_type!r} (TRL's own loss, computed "
                    f"by GRPOTrainer): drop it, or set a TOPR loss type ({', '.join(POLICY_LOSSES)})."
                )


def parse_baseline(value: float | str) -> float | str:
    """`topr_baseline` as a config holds it: a finite float, or one of `BASELINE_MODES`; a number given as a string
    (the command line's, see the field) is a float."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"`topr_baseline` must be finite, got {value!r}.")
        return float(value)
    if isinstance(value, str):
        if value in BASELINE_MODES:
            return value
        try:
            return parse_baseline(float(value))
        except ValueError:
            pass
    raise ValueError(f"`topr_baseline`={value!r} is not supported; give a number or one of {list(BASELINE_MODES)}.")


def resolve_limits(args) -> TruncationLimits | None:
    """The truncation limits (a+, b+, a-, b-) of a config with `loss_type` and the topr_*_lower/upper fields
    (TOPRConfig, AsyncTOPRConfig): the loss type's, overridden by the explicit fields; None for a loss that is not
    Eq. 7's."""
    entry = POLICY_LOSSES.get(args.loss_type)
    if entry is None or entry.limits is None:
        return None
    explicit = {name.removeprefix("topr_"): getattr(args, name) for name in LIMIT_FIELDS}
    resolved = {
        name: (getattr(entry.limits, name) if value is None else float(value)) for name, value in explicit.items()
    }
    try:
        return TruncationLimits(**resolved)
    except ValueError as error:
        raise ValueError(f"Invalid truncation limits topr_*_lower/upper: {error}.") from None


def policy_loss_spec_of(args) -> PolicyLossSpec:
    """The `PolicyLossSpec` of a config with `loss_type`, the limit fields, `topr_ratio_level`, PPO's `epsilon`,
    `epsilon_high` and `delta`, the branch weights, and the fields the chosen loss reads (its registration's
    `reads=`, passed as `knobs`): TOPRConfig and AsyncTOPRConfig alike."""
    entry = POLICY_LOSSES.get(args.loss_type)
    return PolicyLossSpec(
        loss_type=args.loss_type,
        limits=resolve_limits(args),
        ratio_level=args.topr_ratio_level,
        ppo_epsilon_low=float(args.epsilon),
        ppo_epsilon_high=float(args.epsilon_high if args.epsilon_high is not None else args.epsilon),
        ppo_delta=float(args.delta) if args.delta is not None else None,
        positive_weight=float(args.topr_positive_weight),
        negative_weight=float(args.topr_negative_weight),
        knobs={name: getattr(args, name) for name in (entry.knobs if entry else ())},
    )


BRANCH_WEIGHTS = ("topr_positive_weight", "topr_negative_weight")
"""The branch weights lambda+/lambda- every loss of the registry takes (ROLL's), checked by `check_loss_knobs`."""


def check_loss_knobs(args) -> None:
    """The branch weights, and every knob of the chosen loss (a field it registered with `reads=`), each by the
    loss's own check; a knob the config class does not declare fails here, naming it."""
    for name in BRANCH_WEIGHTS:
        finite_non_negative(name, getattr(args, name))
    entry = POLICY_LOSSES.get(args.loss_type)
    if entry is None:
        return
    for name in entry.knobs:
        if not hasattr(args, name):
            raise ValueError(
                f"loss_type={args.loss_type!r} reads `{name}`, which {type(args).__name__} does not "
                "declare: add it as a field of a subclass of the config."
            )
        entry.check(name, getattr(args, name))


_TRUNCATION = "TOPR's truncation of pi/mu, topr_positive_lower/upper and topr_negative_lower/upper (a+, b+, a-, b-)"
# GRPOConfig's loss fields, read by TRL's own losses (and `epsilon`, `epsilon_high`, `delta` by the "ppo" loss here):
# (the registered losses that read it, what TOPR has in its place). A registered loss that does not read one, set
# away from GRPOConfig's default, warns and names the counterpart; warned rather than refused, since a GRPO script
# with the names swapped keeps running (TOPRConfig's default loss is TOPR, which reads none of them).
TRL_LOSS_FIELDS: dict[str, tuple[tuple[str, ...], str]] = {
    "epsilon": (("ppo",), _TRUNCATION),
    "epsilon_high": (("ppo",), _TRUNCATION),
    "delta": (("ppo",), _TRUNCATION),
    "importance_sampling_level": (
        (),
        'topr_ratio_level="length_normalized" (GSPO\'s sequence-level ratio, the '
        'geometric mean of token ratios; "sequence" is the paper\'s product)',
    ),
    "sapo_temperature_pos": ((), _TRUNCATION),
    "sapo_temperature_neg": ((), _TRUNCATION),
}


def say_trl_loss_fields_unread(args) -> None:
    """Warns, once per field, when a GRPOConfig loss field (`TRL_LOSS_FIELDS`) is set away from its default and the
    registered loss of `args.loss_type` does not read it, naming what the loss has instead."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}  # GRPOConfig's, or AsyncGRPOConfig's
    for name, (readers, counterpart) in TRL_LOSS_FIELDS.items():
        if name in defaults and getattr(args, name, defaults[name]) != defaults[name] and args.loss_type not in readers:
            warnings.warn(
                f"`{name}`={getattr(args, name)!r} has no effect with loss_type={args.loss_type!r} (it is "
                f"read by TRL's own losses{' and ' + '/'.join(readers) if readers else ''}); its "
                f"counterpart is {counterpart}.",
                UserWarning,
                stacklevel=5,
            )  # the caller of the config, past TOPRFields' check, __post_init__, __init__


def knob_readers() -> dict[str, list[str]]:
    """Each field a registered loss reads (`reads=`), and the losses that read it."""
    return {
        name: [loss for loss, entry in POLICY_LOSSES.items() if name in entry.reads]
        for entry in POLICY_LOSSES.values()
        for name in entry.reads
    }


def refuse_unread_knobs(args) -> None:
    """A field set away from its default that the chosen loss does not read (`kimi15_tau` with `loss_type="ppo"`)
    fails in one line naming it and the losses that read it."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    for name, readers in knob_readers().items():
        if name in defaults and getattr(args, name) != defaults[name] and args.loss_type not in readers:
            raise ValueError(
                f"`{name}` has no effect with loss_type={args.loss_type!r} (it is read by loss_type "
                f"{' / '.join(repr(r) for r in readers)}): drop it."
            )


# TOPRTrainer also takes a plain GRPOConfig (only the trainer's name swapped): TOPR's run-level fields then keep their
# TOPRConfig defaults, which are GRPOTrainer's behaviour.
_TOPR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TOPRConfig)}


def topr_setting(args, name: str):
    """`args.<name>`, or TOPRConfig's default when `args` is a GRPOConfig."""
    return getattr(args, name, _TOPR_DEFAULTS[name])
