"""`TOPRConfig`: `GRPOConfig` plus the fields of the TOPR loss family."""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from .loss import AGGREGATIONS, PG_VARIANTS, PRESETS, RATIO_LEVELS, PolicyLossSpec, TruncationLimits

TRL_LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
LOSS_TYPES: tuple[str, ...] = ("topr", *TRL_LOSS_TYPES)
SIGNALS: tuple[str, ...] = ("advantage", "reward")
BASELINE_MODES: tuple[str, ...] = ("group_mean", "batch_mean")
BEHAVIOUR_SOURCES: tuple[str, ...] = ("auto", "sampler", "policy")
BASELINE_SCOPES: tuple[str, ...] = ("batch", "dataset")
UNSCORED_BATCH_ACTIONS: tuple[str, ...] = ("train", "skip", "error")


# The TOPR-family fields, and the pg_variants that read each one (empty: every variant of the family). None of them
# is read when loss_type is one of TRL's; topr_offline_epochs, topr_behaviour_model, topr_unscored_batch and
# topr_check_finite concern the data and the run, not the loss, and apply to every loss type.
_FIELDS_READ_BY: dict[str, tuple[str, ...]] = {
    "pg_variant": (),
    "topr_preset": ("topr",),
    "topr_positive_lower": ("topr",),
    "topr_positive_upper": ("topr",),
    "topr_negative_lower": ("topr",),
    "topr_negative_upper": ("topr",),
    "tis_lower_bound": ("tis",),
    "tis_upper_bound": ("tis",),
    "cispo_epsilon_low": ("cispo",),
    "cispo_epsilon_high": ("cispo",),
    "kimi15_tau": ("kimi15",),
    "topr_ratio_level": (),
    "topr_signal": (),
    "topr_baseline": (),
    "topr_target_effective_proportion": (),
    "topr_baseline_scope": (),
    "topr_positive_weight": (),
    "topr_negative_weight": (),
    "topr_loss_aggregation": (),
    "topr_behaviour_source": (),
}


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


@dataclass
class TOPRConfig(GRPOConfig):
    r"""
    Configuration for [`TOPRTrainer`]: every [`~trl.GRPOConfig`] field, plus the Tapered Off-Policy REINFORCE
    (TOPR, [arXiv:2503.14286](https://huggingface.co/papers/2503.14286)) loss family. Only `loss_type`
    changes default: `"topr"`. Any of TRL's loss types makes [`TOPRTrainer`] compute exactly what
    [`~trl.GRPOTrainer`] computes; setting a field below that the chosen loss does not read (a `topr_*` field with
    one of TRL's loss types, `topr_preset` with `pg_variant="ppo"`, ...) fails at construction, naming it.

    Parameters:
        loss_type (`str`, *optional*, defaults to `"topr"`):
            `"topr"` for the TOPR family configured below, or one of TRL's loss types (`"grpo"`, `"dr_grpo"`,
            `"dapo"`, `"bnpo"`, `"cispo"`, `"sapo"`, `"luspo"`, `"vespo"`), which are delegated to GRPOTrainer.
        topr_preset (`str`, *optional*, defaults to `"topr"`):
            Truncation limits (a+, b+, a-, b-) of Eq. 7 from a row of the paper's Table 1: `"sft"` (1, 1, 0, 0),
            `"naive_reinforce"` (1, 1, 1, 1), `"off_policy_reinforce"` (0, inf, 0, inf), `"tis"` (0, 1, 0, 1) or
            `"topr"` (1, 1, 0, 1). Change it to compare against the baselines of the paper.
        topr_positive_lower (`float` or `None`, *optional*, defaults to `None`):
            a+, the lower limit of the importance ratio of trajectories with non-negative signal. `None` takes
            the preset's value. Set it (with the three others) to explore limits outside Table 1.
        topr_positive_upper (`float` or `None`, *optional*, defaults to `None`):
            b+, the upper limit for non-negative trajectories; may be `inf`. `None` takes the preset's value.
        topr_negative_lower (`float` or `None`, *optional*, defaults to `None`):
            a-, the lower limit for negative trajectories. Any a- > 0 makes the objective unbounded (Prop. 3.2)
            and warns. `None` takes the preset's value.
        topr_negative_upper (`float` or `None`, *optional*, defaults to `None`):
            b-, the upper limit for negative trajectories; may be `inf`. `None` takes the preset's value.
        topr_ratio_level (`str`, *optional*, defaults to `"sequence"`):
            How pi/mu is formed: `"sequence"`, the product of token ratios pi(tau)/mu(tau) (the paper);
            `"length_normalized"`, the geometric mean of token ratios (GSPO; what TRL calls
            `importance_sampling_level="sequence"`); `"token"`, one ratio per token (ROLL, Trinity-RFT).
            Long completions make sequence ratios of negatives small quickly; `"length_normalized"` is gentler.
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
        pg_variant (`str`, *optional*, defaults to `"topr"`):
            ROLL's `pg_variant`, to compare off-policy losses in one trainer with the same signal, ratio level,
            mu and aggregation: `"topr"` (Eq. 7 with the limits above), `"vanilla"` (REINFORCE, the
            `"naive_reinforce"` limits), `"tis"` (`[tis_lower_bound, tis_upper_bound]` on both branches),
            `"ppo"` (clipped surrogate with `epsilon`/`epsilon_high`), `"cispo"` and `"kimi15"`.
        tis_lower_bound (`float`, *optional*, defaults to `0.0`):
            Lower truncation of the ratio for `pg_variant="tis"`.
        tis_upper_bound (`float`, *optional*, defaults to `1.0`):
            Upper truncation of the ratio for `pg_variant="tis"`.
        cispo_epsilon_low (`float`, *optional*, defaults to `0.1`):
            `pg_variant="cispo"`: the stop-gradient ratio is clipped below at 1 - `cispo_epsilon_low`.
        cispo_epsilon_high (`float`, *optional*, defaults to `0.1`):
            `pg_variant="cispo"`: the stop-gradient ratio is clipped above at 1 + `cispo_epsilon_high`.
        kimi15_tau (`float`, *optional*, defaults to `0.1`):
            `pg_variant="kimi15"`: weight of the squared log-ratio penalty tau/2 (log pi/mu)^2.
    """

    loss_type: str = field(
        default="topr",
        metadata={"help": f"'topr' or one of TRL's loss types {list(TRL_LOSS_TYPES)} (delegated to GRPOTrainer)."},
    )
    topr_preset: str = field(
        default="topr",
        metadata={"help": f"Truncation limits from a row of the paper's Table 1: {list(PRESETS)}."},
    )
    topr_positive_lower: float | None = field(default=None, metadata={"help": "a+ (None: from the preset)."})
    topr_positive_upper: float | None = field(default=None, metadata={"help": "b+, may be inf (None: preset)."})
    topr_negative_lower: float | None = field(default=None, metadata={"help": "a- (None: preset); > 0 is unbounded."})
    topr_negative_upper: float | None = field(default=None, metadata={"help": "b-, may be inf (None: preset)."})
    topr_ratio_level: str = field(
        default="sequence", metadata={"help": f"How pi/mu is formed: {list(RATIO_LEVELS)}."}
    )
    topr_signal: str = field(
        default="advantage",
        metadata={"help": "'advantage' (GRPO's group advantage) or 'reward' (R - topr_baseline, the paper)."},
    )
    topr_baseline: str = field(
        default="0.0",
        metadata={"help": "Baseline c for topr_signal='reward': a number, 'group_mean' or 'batch_mean'."},
    )
    topr_target_effective_proportion: float | None = field(
        default=None, metadata={"help": "Solve the baseline so that p~ (Eq. 12) hits this target (topr_signal='reward')."}
    )
    topr_baseline_scope: str = field(
        default="batch", metadata={"help": "Where the target baseline is solved: 'batch' or 'dataset' (offline)."}
    )
    topr_positive_weight: float = field(default=1.0, metadata={"help": "Multiplier of the positive branch."})
    topr_negative_weight: float = field(default=1.0, metadata={"help": "Multiplier of the negative branch."})
    topr_loss_aggregation: str = field(
        default="seq-mean-token-mean", metadata={"help": f"Loss aggregation: {list(AGGREGATIONS)}."}
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
        metadata={"help": f"A training batch no reward function could score (all None/NaN): "
                          f"{list(UNSCORED_BATCH_ACTIONS)} ('train': GRPOTrainer's behaviour; the CLI: 'error')."},
    )
    topr_check_finite: bool = field(
        default=False,
        metadata={"help": "Stop on an infinite reward (ValueError) or a non-finite TOPR loss (FloatingPointError) "
                          "instead of training on it, as GRPOTrainer does (the CLI: True)."},
    )
    pg_variant: str = field(default="topr", metadata={"help": f"Off-policy loss variant: {list(PG_VARIANTS)}."})
    tis_lower_bound: float = field(default=0.0, metadata={"help": "pg_variant='tis': lower ratio bound."})
    tis_upper_bound: float = field(default=1.0, metadata={"help": "pg_variant='tis': upper ratio bound."})
    cispo_epsilon_low: float = field(default=0.1, metadata={"help": "pg_variant='cispo': 1 - eps lower clip."})
    cispo_epsilon_high: float = field(default=0.1, metadata={"help": "pg_variant='cispo': 1 + eps upper clip."})
    kimi15_tau: float = field(default=0.1, metadata={"help": "pg_variant='kimi15': squared log-ratio weight."})

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        super().__post_init__()
        check_choice("topr_preset", self.topr_preset, tuple(PRESETS))
        check_choice("topr_ratio_level", self.topr_ratio_level, RATIO_LEVELS)
        check_choice("topr_signal", self.topr_signal, SIGNALS)
        check_choice("topr_loss_aggregation", self.topr_loss_aggregation, AGGREGATIONS)
        check_choice("topr_behaviour_source", self.topr_behaviour_source, BEHAVIOUR_SOURCES)
        check_choice("pg_variant", self.pg_variant, PG_VARIANTS)
        self.topr_baseline = self._parse_baseline(self.topr_baseline)
        check_choice("topr_baseline_scope", self.topr_baseline_scope, BASELINE_SCOPES)
        target = self.topr_target_effective_proportion
        if target is not None:
            if not (isinstance(target, (int, float)) and 0 < target < 1):
                raise ValueError(f"`topr_target_effective_proportion` must be in (0, 1), got {target!r}.")
            if self.topr_signal != "reward":
                raise ValueError("`topr_target_effective_proportion` sets the baseline of R - c: it needs "
                                 "topr_signal='reward'.")
        if not (isinstance(self.topr_offline_epochs, (int, float)) and self.topr_offline_epochs > 0):
            raise ValueError(f"`topr_offline_epochs` must be > 0, got {self.topr_offline_epochs!r}.")
        check_choice("topr_unscored_batch", self.topr_unscored_batch, UNSCORED_BATCH_ACTIONS)
        if not isinstance(self.topr_check_finite, bool):
            raise ValueError(f"`topr_check_finite` must be True or False, got {self.topr_check_finite!r}.")
        for name in ("topr_positive_weight", "topr_negative_weight", "cispo_epsilon_low", "cispo_epsilon_high",
                     "kimi15_tau"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
        self._refuse_fields_without_effect()
        limits = self.topr_limits  # validates the limits
        if self.loss_type == "topr" and limits.negative_lower > 0:
            warnings.warn(
                f"topr_negative_lower (a-) = {limits.negative_lower} > 0: the TOPR objective is then unbounded "
                "(Prop. 3.2 of the paper) and training can collapse by pushing negatives' probabilities to 0. "
                "Set topr_negative_lower=0 unless this is the point of the experiment.",
                UserWarning,
                stacklevel=3,  # the caller of TOPRConfig(...), past the dataclass __init__
            )
        if self.loss_type == "topr" and self.topr_baseline != 0.0 and self.topr_signal == "advantage":
            warnings.warn(
                "topr_baseline is only used with topr_signal='reward'; with 'advantage' the group advantage "
                "already has its baseline subtracted.",
                UserWarning,
                stacklevel=3,  # the caller of TOPRConfig(...), past the dataclass __init__
            )

    def _refuse_fields_without_effect(self) -> None:
        """One field selects the loss: `loss_type` (TRL's loss types, or "topr" for the family), then `pg_variant`
        within the family. A field the selected loss does not read fails here, naming the field to drop."""
        defaults = {f.name: f.default for f in dataclasses.fields(TOPRConfig)}
        changed = [name for name in _FIELDS_READ_BY if getattr(self, name) != defaults[name]
                   and not (name == "topr_baseline" and self.topr_baseline == _parse_number(defaults[name]))]
        for name in changed:
            readers = _FIELDS_READ_BY[name]
            if self.loss_type != "topr":
                raise ValueError(f"`{name}` has no effect with loss_type={self.loss_type!r} (TRL's own loss, computed "
                                 "by GRPOTrainer): drop it, or set loss_type='topr'.")
            if readers and self.pg_variant not in readers:
                raise ValueError(f"`{name}` has no effect with pg_variant={self.pg_variant!r} (it is read by "
                                 f"pg_variant {' / '.join(repr(r) for r in readers)}): drop it.")

    @staticmethod
    def _parse_baseline(value: float | str) -> float | str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"`topr_baseline` must be finite, got {value!r}.")
            return float(value)
        if isinstance(value, str):
            if value in BASELINE_MODES:
                return value
            try:
                return TOPRConfig._parse_baseline(float(value))
            except ValueError:
                pass
        raise ValueError(
            f"`topr_baseline`={value!r} is not supported; give a number or one of {list(BASELINE_MODES)}."
        )

    @property
    def topr_limits(self) -> TruncationLimits:
        """The truncation limits (a+, b+, a-, b-) in force, from `pg_variant`, the preset and explicit fields."""
        if self.pg_variant == "vanilla":
            return PRESETS["naive_reinforce"]
        if self.pg_variant == "tis":
            low, high = float(self.tis_lower_bound), float(self.tis_upper_bound)
            return TruncationLimits(low, high, low, high)
        preset = PRESETS[self.topr_preset]
        explicit = {
            "positive_lower": self.topr_positive_lower,
            "positive_upper": self.topr_positive_upper,
            "negative_lower": self.topr_negative_lower,
            "negative_upper": self.topr_negative_upper,
        }
        resolved = {name: (getattr(preset, name) if value is None else float(value)) for name, value in explicit.items()}
        try:
            return TruncationLimits(**resolved)
        except ValueError as error:
            raise ValueError(f"Invalid truncation limits topr_*_lower/upper: {error}.") from None

    @property
    def policy_loss_spec(self) -> PolicyLossSpec:
        """The loss the trainer computes when `loss_type="topr"`."""
        return PolicyLossSpec(
            variant=self.pg_variant,
            limits=self.topr_limits,
            ratio_level=self.topr_ratio_level,
            positive_weight=float(self.topr_positive_weight),
            negative_weight=float(self.topr_negative_weight),
            ppo_epsilon_low=float(self.epsilon),
            ppo_epsilon_high=float(self.epsilon_high if self.epsilon_high is not None else self.epsilon),
            ppo_delta=float(self.delta) if self.delta is not None else None,
            cispo_epsilon_low=float(self.cispo_epsilon_low),
            cispo_epsilon_high=float(self.cispo_epsilon_high),
            kimi15_tau=float(self.kimi15_tau),
        )
