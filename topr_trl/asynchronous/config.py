"""`AsyncTOPRConfig`: TRL's `AsyncGRPOConfig` with TOPR's loss, and no staleness cap by default."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..config import TOPRConfig, TOPRFields
from ..loss import POLICY_LOSSES
from ..runtime.noise import quiet_trl_deprecations
from ..validation import (
    FIELD_CHECKS,
    check_before_trl_config,
    check_fields,
    check_loss_knobs,
    check_what_the_loss_reads,
    choice,
    number_baseline,
    staleness,
)
from .trl_async import AsyncGRPOConfig


# How the per-token loss of a micro-batch is reduced: the paper's per-trajectory mean of token means, or TRL's
# asynchronous trainer's sum over the micro-batch's tokens divided by their number.
ASYNC_AGGREGATIONS: tuple[str, ...] = ("seq-mean-token-mean", "global-token-mean")

_TOPR_FIELDS = {f.name for f in dataclasses.fields(TOPRFields)}
ASYNC_FIELD_CHECKS = {
    **{name: check for name, check in FIELD_CHECKS.items() if name in _TOPR_FIELDS},
    "topr_loss_aggregation": choice(ASYNC_AGGREGATIONS),
    "topr_baseline": number_baseline,
    "max_staleness": staleness,
}
"""AsyncTOPRConfig's checks: TOPRConfig's of the fields the two share (`topr_trl.validation.FIELD_CHECKS`), its two
aggregations, a baseline that is a number, and `max_staleness`."""


@dataclass
class AsyncTOPRConfig(TOPRFields, AsyncGRPOConfig):
    r"""
    Configuration for [`~topr_trl.asynchronous.AsyncTOPRTrainer`]: every field of TRL's `AsyncGRPOConfig`, with
    `max_staleness` off by default, plus TOPR's loss fields (`topr_trl.config.TOPRFields`, as in [`TOPRConfig`]).

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
        metadata={
            "help": "Drop samples more than this many policy versions old (TRL's rule); inf (default) keeps "
            "every sample, weighed by TOPR's truncated ratio."
        },
    )
    # TOPR's fields are TOPRFields'. These two take fewer values here than in TOPRConfig, so their help lists these:
    # TRL's losses are GRPOTrainer's, which this trainer is not, and the packed micro-batch has two aggregations.
    loss_type: str = field(default="topr", metadata={"help": f"The loss: one of {list(POLICY_LOSSES)}."})
    topr_loss_aggregation: str = field(
        default="seq-mean-token-mean", metadata={"help": f"Loss aggregation: {list(ASYNC_AGGREGATIONS)}."}
    )

    def __post_init__(self) -> None:
        check_before_trl_config(self, tuple(POLICY_LOSSES))
        with quiet_trl_deprecations():  # TRL's defaults trip transformers' deprecation
            super().__post_init__()
        check_fields(self, ASYNC_FIELD_CHECKS)
        check_loss_knobs(self)
        check_what_the_loss_reads(self)

    @property
    def keeps_every_sample(self) -> bool:
        return self.max_staleness == math.inf


# TOPRConfig fields with no counterpart in the asynchronous trainer, and the value that means "not used".
_SYNCHRONOUS_ONLY = {
    "beta": 0.0,
    "num_iterations": 1,
    "use_vllm": False,
    "topr_behaviour_model": None,
    "topr_target_effective_proportion": None,
    "topr_offline_epochs": 1.0,
}


def async_config_from(args: TOPRConfig, **overrides) -> AsyncTOPRConfig:
    """The `AsyncTOPRConfig` of a run configured as a `TOPRConfig` (the command line's `--asynchronous`): every field
    the two share, then `overrides`. Every other field the run set (one that differs from what TOPRConfig makes of
    the shared fields alone, so that derived values such as `generation_batch_size` do not count) fails in one line
    naming it: the asynchronous trainer would not read it, and a setting must never be dropped without a word."""
    for name, unused in _SYNCHRONOUS_ONLY.items():
        value = getattr(args, name, unused)
        if value != unused:
            raise ValueError(
                f"`{name}`={value!r} has no effect on the asynchronous trainer: drop it (or train "
                "without --asynchronous)."
            )
    if args.topr_signal == "reward" and isinstance(args.topr_baseline, str):
        raise ValueError(
            f"`topr_baseline`={args.topr_baseline!r}: the asynchronous trainer takes a number (its "
            "samples arrive one at a time); use topr_signal='advantage' for a group baseline."
        )
    own = {f.name for f in dataclasses.fields(AsyncTOPRConfig) if f.init}
    fields = [f for f in dataclasses.fields(type(args)) if f.init]
    # what the run set (a recipe, a config file, a flag): a field left at TOPRConfig's default takes the asynchronous
    # config's own (the two disagree on some, e.g. vllm_server_base_url)
    shared = {f.name: getattr(args, f.name) for f in fields if f.name in own and getattr(args, f.name) != _default(f)}
    shared.pop("max_staleness", None)
    reference = type(args)(**shared)  # what TOPRConfig derives from the shared fields alone
    dropped = [
        f"`{f.name}`={getattr(args, f.name)!r}"
        for f in fields
        if f.name not in own and f.name not in _SYNCHRONOUS_ONLY and getattr(args, f.name) != getattr(reference, f.name)
    ]
    if dropped:  # all of them at once: one set field can derive another (steps_per_generation, generation_batch_size)
        raise ValueError(
            f"{', '.join(dropped)} {'is' if len(dropped) == 1 else 'are'} not read by the asynchronous "
            "trainer: drop it (or train without --asynchronous)."
        )
    return AsyncTOPRConfig(**{**shared, **overrides})


def _default(field_):
    if field_.default is not dataclasses.MISSING:
        return field_.default
    return field_.default_factory() if field_.default_factory is not dataclasses.MISSING else dataclasses.MISSING
