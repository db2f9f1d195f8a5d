"""`AsyncTOPRConfig`: TRL's `AsyncGRPOConfig` with TOPR's loss, and no staleness cap by default."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

from trl.experimental.async_grpo import AsyncGRPOConfig

from ..config import (
    SIGNALS,
    TOPRConfig,
    check_choice,
    check_flag,
    check_loss_knobs,
    policy_loss_spec_of,
    refuse_unread_knobs,
    resolve_limits,
    say_trl_loss_fields_unread,
    topr_field,
)
from ..loss import POLICY_LOSSES, RATIO_LEVELS, PolicyLossSpec, TruncationLimits


# How the per-token loss of a micro-batch is reduced: the paper's per-trajectory mean of token means, or TRL's
# asynchronous trainer's sum over the micro-batch's tokens divided by their number.
ASYNC_AGGREGATIONS: tuple[str, ...] = ("seq-mean-token-mean", "global-token-mean")


@dataclass
class AsyncTOPRConfig(AsyncGRPOConfig):
    r"""
    Configuration for [`~topr_trl.asynchronous.AsyncTOPRTrainer`]: every field of TRL's `AsyncGRPOConfig`, with
    `max_staleness` off by default, plus TOPR's loss fields (as in [`TOPRConfig`]).

    Parameters:
        max_staleness (`float`, *optional*, defaults to `inf`):
            TRL's cap: a sample generated more than this many policy versions before the one being trained is dropped
            (counted in `sample/dropped_stale_total`). `inf` keeps every sample: TOPR's truncated ratio weighs stale
            samples instead. An integer restores TRL's rule. How far generation may run ahead is set by
            `max_inflight_tasks` and `queue_maxsize`; with `max_inflight_tasks=-1` it defaults to TRL's default
            pipeline depth, 4 optimizer steps of samples.
        loss_type (`str`, *optional*, defaults to `"topr"`):
            A loss of TOPR's registry (`topr_trl.loss.POLICY_LOSSES`): `"topr"` and Table 1's rows (`"sft"`,
            `"naive_reinforce"`, `"off_policy_reinforce"`, `"tis"`), `"ppo"` (PPO clipping at `epsilon`,
            `epsilon_high`), `"cispo_two_sided"`, `"kimi15"`.
        topr_positive_lower (`float` or `None`, *optional*, defaults to `None`):
            a+ of Eq. 7 (None: the loss type's). Likewise `topr_positive_upper` (b+), `topr_negative_lower` (a-) and
            `topr_negative_upper` (b-).
        topr_ratio_level (`str`, *optional*, defaults to `"sequence"`):
            How pi/mu is formed: `"sequence"` (the paper: the product of the completion's token ratios, summed in log
            space over its packed tokens), `"length_normalized"` or `"token"`.
        topr_signal (`str`, *optional*, defaults to `"advantage"`):
            `"advantage"`: the rollout worker's group advantage (TRL's, (r - mean) / (std + 1e-8)); `"reward"`: the
            paper's R(tau) - c, from each sample's summed reward and `topr_baseline`.
        topr_baseline (`float`, *optional*, defaults to `0.0`):
            c, with `topr_signal="reward"`.
        topr_loss_aggregation (`str`, *optional*, defaults to `"seq-mean-token-mean"`):
            `"seq-mean-token-mean"` (the paper: each completion's loss divided by its length, averaged over the
            step's completions) or `"global-token-mean"` (TRL's asynchronous trainer: divided by the tokens of the
            micro-batch).
        topr_check_finite (`bool`, *optional*, defaults to `False`):
            As in [`TOPRConfig`]: stop on a non-finite TOPR loss (a `FloatingPointError` reporting the ratio ranges)
            instead of training on it (the `topr-trl` command line's default).
    """

    max_staleness: float = field(
        default=math.inf,
        metadata={"help": "Drop samples more than this many policy versions old (TRL's rule); inf (default) keeps "
                          "every sample, weighed by TOPR's truncated ratio."},
    )
    loss_type: str = field(default="topr", metadata={"help": f"The loss: one of {list(POLICY_LOSSES)}."})
    topr_positive_lower: float | None = field(default=None, metadata={"help": "a+ (None: the loss type's)."})
    topr_positive_upper: float | None = field(default=None, metadata={"help": "b+, may be inf (None: loss type's)."})
    topr_negative_lower: float | None = field(default=None, metadata={"help": "a- (None: the loss type's)."})
    topr_negative_upper: float | None = field(default=None, metadata={"help": "b-, may be inf (None: loss type's)."})
    topr_ratio_level: str = field(default="sequence", metadata={"help": f"How pi/mu is formed: {list(RATIO_LEVELS)}."})
    topr_signal: str = field(
        default="advantage", metadata={"help": "'advantage' (the worker's group advantage) or 'reward' (R - c)."})
    topr_baseline: float = field(default=0.0, metadata={"help": "c, with topr_signal='reward'."})
    topr_loss_aggregation: str = field(
        default="seq-mean-token-mean", metadata={"help": f"Loss aggregation: {list(ASYNC_AGGREGATIONS)}."})
    topr_check_finite: bool = topr_field("topr_check_finite")
    # the branch weights, the built-in losses' knobs and PPO's dual-clip delta, declared once in TOPRConfig
    topr_positive_weight: float = topr_field("topr_positive_weight")
    topr_negative_weight: float = topr_field("topr_negative_weight")
    cispo_epsilon_low: float = topr_field("cispo_epsilon_low")
    cispo_epsilon_high: float = topr_field("cispo_epsilon_high")
    kimi15_tau: float = topr_field("kimi15_tau")
    delta: float | None = topr_field("delta")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flag("topr_check_finite", self.topr_check_finite)
        check_choice("loss_type", self.loss_type, tuple(POLICY_LOSSES))
        check_choice("topr_ratio_level", self.topr_ratio_level, RATIO_LEVELS)
        check_choice("topr_signal", self.topr_signal, SIGNALS)
        check_choice("topr_loss_aggregation", self.topr_loss_aggregation, ASYNC_AGGREGATIONS)
        check_loss_knobs(self)
        refuse_unread_knobs(self)
        say_trl_loss_fields_unread(self)
        self.topr_baseline = TOPRConfig._parse_baseline(self.topr_baseline)
        if isinstance(self.topr_baseline, str):
            raise ValueError(f"`topr_baseline` must be a number for the asynchronous trainer, got "
                             f"{self.topr_baseline!r}: its samples arrive one at a time, not as a batch or a group "
                             "(use topr_signal='advantage' for a group baseline).")
        if self.topr_baseline != 0.0 and self.topr_signal == "advantage":
            warnings.warn("topr_baseline is only used with topr_signal='reward'; with 'advantage' the group "
                          "advantage already has its baseline subtracted.", UserWarning, stacklevel=3)
        staleness = self.max_staleness
        if not (isinstance(staleness, (int, float)) and (staleness == math.inf or
                                                          (staleness >= 0 and float(staleness).is_integer()))):
            raise ValueError(f"`max_staleness` must be a whole number of policy versions >= 0, or inf to keep every "
                             f"sample; got {staleness!r}.")
        if staleness != math.inf:
            self.max_staleness = int(staleness)
        limits = self.topr_limits  # validates the limits
        if limits is not None and limits.negative_lower > 0:
            warnings.warn(f"topr_negative_lower (a-) = {limits.negative_lower} > 0: the TOPR objective is then "
                          "unbounded (Prop. 3.2 of the paper). Set topr_negative_lower=0 unless this is the point "
                          "of the experiment.", UserWarning, stacklevel=3)

    @property
    def keeps_every_sample(self) -> bool:
        return self.max_staleness == math.inf

    @property
    def topr_limits(self) -> TruncationLimits | None:
        return resolve_limits(self)

    @property
    def policy_loss_spec(self) -> PolicyLossSpec:
        return policy_loss_spec_of(self)


# TOPRConfig fields with no counterpart in the asynchronous trainer, and the value that means "not used".
_SYNCHRONOUS_ONLY = {"beta": 0.0, "num_iterations": 1, "use_vllm": False, "topr_behaviour_model": None,
                     "topr_target_effective_proportion": None, "topr_offline_epochs": 1.0}


def async_config_from(args: TOPRConfig, **overrides) -> AsyncTOPRConfig:
    """The `AsyncTOPRConfig` of a run configured as a `TOPRConfig` (the command line's `--asynchronous`): every field
    the two share, then `overrides`. Every other field the run set (one that differs from what TOPRConfig makes of
    the shared fields alone, so that derived values such as `generation_batch_size` do not count) fails in one line
    naming it: the asynchronous trainer would not read it, and a setting must never be dropped without a word."""
    for name, unused in _SYNCHRONOUS_ONLY.items():
        value = getattr(args, name, unused)
        if value != unused:
            raise ValueError(f"`{name}`={value!r} has no effect on the asynchronous trainer: drop it (or train "
                             "without --asynchronous).")
    if args.topr_signal == "reward" and isinstance(args.topr_baseline, str):
        raise ValueError(f"`topr_baseline`={args.topr_baseline!r}: the asynchronous trainer takes a number (its "
                         "samples arrive one at a time); use topr_signal='advantage' for a group baseline.")
    own = {f.name for f in dataclasses.fields(AsyncTOPRConfig) if f.init}
    fields = [f for f in dataclasses.fields(type(args)) if f.init]
    # what the run set (a recipe, a config file, a flag): a field left at TOPRConfig's default takes the asynchronous
    # config's own (the two disagree on some, e.g. vllm_server_base_url)
    shared = {f.name: getattr(args, f.name) for f in fields if f.name in own and getattr(args, f.name) != _default(f)}
    shared.pop("max_staleness", None)
    reference = type(args)(**shared)  # what TOPRConfig derives from the shared fields alone
    dropped = [f"`{f.name}`={getattr(args, f.name)!r}" for f in fields if f.name not in own
               and f.name not in _SYNCHRONOUS_ONLY and getattr(args, f.name) != getattr(reference, f.name)]
    if dropped:  # all of them at once: one set field can derive another (steps_per_generation, generation_batch_size)
        raise ValueError(f"{', '.join(dropped)} {'is' if len(dropped) == 1 else 'are'} not read by the asynchronous "
                         "trainer: drop it (or train without --asynchronous).")
    return AsyncTOPRConfig(**{**shared, **overrides})


def _default(field_):
    if field_.default is not dataclasses.MISSING:
        return field_.default
    return field_.default_factory() if field_.default_factory is not dataclasses.MISSING else dataclasses.MISSING
