"""The checks of TOPR's configs (`TOPRConfig`, `AsyncTOPRConfig`), in one place: `FIELD_CHECKS`, a table of field ->
check as the loss registry is one of loss -> function, then the checks that read several fields. A config's
`__post_init__` runs `check_before_trl_config`, TRL's own `__post_init__`, `check_fields` and the checks across fields;
each error is one line naming the field."""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from collections.abc import Callable
from typing import Any, Protocol

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


class _TRLConfig(Protocol):
    """What `check_before_trl_config` reads of a config, which is TOPRFields and one of TRL's configs
    (GRPOConfig, AsyncGRPOConfig): its `loss_type`, and TRL's fields it checks."""

    loss_type: str

    @property
    def learning_rate(self) -> float: ...

    @property
    def max_completion_length(self) -> int | None: ...


def check_before_trl_config(config: _TRLConfig, loss_types: tuple[str, ...]) -> None:
    """Before TRL's `__post_init__`: `loss_type` among what this config's trainer computes, and the values TRL's
    config takes that the run refuses later, far from the field (torch's optimizer: "Invalid learning rate";
    generate: `max_new_tokens`), refused here, naming the field."""
    check_choice("loss_type", config.loss_type, loss_types)
    if isinstance(config.learning_rate, (int, float)) and config.learning_rate < 0:
        raise ValueError(
            f"`learning_rate` must be >= 0, got {config.learning_rate!r}; the optimizer refuses a negative one."
        )
    if isinstance(config.max_completion_length, int) and config.max_completion_length < 1:
        raise ValueError(
            f"`max_completion_length` must be at least 1 (new tokens per completion), got "
            f"{config.max_completion_length!r}."
        )


def explain_generation_batch(config, generation_batch_set: bool) -> None:
    """GRPOConfig refuses a generation batch that `num_generations` does not divide, naming
    `generation_batch_size`; when the user set neither it nor `steps_per_generation`, the batch is theirs by
    other names: say it in those (GRPOConfig has set the batch before refusing it)."""
    batch, groups = config.generation_batch_size, config.num_generations
    if (
        generation_batch_set
        or not isinstance(batch, int)
        or not isinstance(groups, int)
        or groups < 1
        or batch % groups == 0
    ):
        return
    assert config.steps_per_generation is not None  # GRPOConfig set it with the batch (the user set neither)
    processes = batch // (config.per_device_train_batch_size * config.steps_per_generation)
    raise ValueError(
        f"`num_generations` ({groups}) must divide the completions generated per optimizer step, "
        f"`per_device_train_batch_size` ({config.per_device_train_batch_size}) x processes ({processes}) x "
        f"`gradient_accumulation_steps` ({config.gradient_accumulation_steps}) = {batch}: change "
        f"`num_generations` to a divisor of {batch}, or `per_device_train_batch_size` to a multiple of "
        f"{groups}."
    ) from None


def refuse_topr_fields_with_trls_loss(config) -> None:
    """One field selects the loss: `loss_type`. A TOPR-family field (or a field only registered losses read) with
    one of TRL's loss types fails here, naming the field to drop."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    if config.loss_type not in POLICY_LOSSES:
        for name in (*_FAMILY_FIELDS, *(name for name in knob_readers() if name in defaults)):
            value = getattr(config, name)
            if value == defaults[name] or (name == "topr_baseline" and value == _parse_number(defaults[name])):
                continue
            raise ValueError(
                f"`{name}` has no effect with loss_type={config.loss_type!r} (TRL's own loss, computed "
                f"by GRPOTrainer): drop it, or set a TOPR loss type ({', '.join(POLICY_LOSSES)})."
            )


def check_what_the_loss_reads(config, stacklevel: int = 4) -> None:
    """Last: a knob the chosen loss does not read fails; a TRL loss field it does not read, Prop. 3.2's unbounded
    limits and a baseline the signal does not read warn. The warnings point at the caller of the config's
    constructor (stacklevel 4: past this function, `__post_init__` and the dataclass `__init__`)."""
    refuse_unread_knobs(config)
    if config.loss_type in POLICY_LOSSES:
        say_trl_loss_fields_unread(config, stacklevel + 1)
    limits = resolve_limits(config)  # validates the limits
    if limits is not None and limits.negative_lower > 0:
        warnings.warn(
            f"topr_negative_lower (a-) = {limits.negative_lower} > 0: the TOPR objective is then unbounded "
            "(Prop. 3.2 of the paper) and training can collapse by pushing negatives' probabilities to 0. "
            "Set topr_negative_lower=0 unless this is the point of the experiment.",
            UserWarning,
            stacklevel=stacklevel,
        )
    if config.loss_type in POLICY_LOSSES and config.topr_baseline != 0.0 and config.topr_signal == "advantage":
        warnings.warn(
            "topr_baseline is only used with topr_signal='reward'; with 'advantage' the group advantage "
            "already has its baseline subtracted.",
            UserWarning,
            stacklevel=stacklevel,
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


def check_loss_knobs(args) -> None:
    """Every knob of the chosen loss (a field it registered with `reads=`), each by the loss's own check; a knob the
    config class does not declare fails here, naming it."""
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


def say_trl_loss_fields_unread(args, stacklevel: int = 5) -> None:
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
                stacklevel=stacklevel,
            )  # the caller of the config's constructor


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


# ---------------------------------------------------------------------------------------------- the table
Check = Callable[[str, Any], Any]
"""A field's check: (field name, value) -> the value the config holds (the value itself, or normalised), raising a
ValueError that names the field."""


def choice(allowed: tuple[str, ...]) -> Check:
    """The check of a field that takes one of `allowed` (`check_choice`)."""

    def check(name: str, value: object) -> object:
        check_choice(name, value, allowed)
        return value

    return check


def flag(name: str, value: object) -> object:
    check_flag(name, value)
    return value


def non_negative(name: str, value: object) -> object:
    finite_non_negative(name, value)
    return value


def positive(name: str, value: object) -> object:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"`{name}` must be > 0, got {value!r}.")
    return value


def share_or_none(name: str, value: object) -> object:
    if value is not None and (isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value < 1)):
        raise ValueError(f"`{name}` must be in (0, 1), got {value!r}.")
    return value


def baseline(name: str, value: float | str) -> float | str:
    return parse_baseline(value)


def number_baseline(name: str, value: float | str) -> float:
    """The asynchronous trainer's c: a number (its samples arrive one at a time, not as a batch or a group)."""
    parsed = parse_baseline(value)
    if isinstance(parsed, str):
        raise ValueError(
            f"`{name}` must be a number for the asynchronous trainer, got {parsed!r}: its samples arrive one at a "
            "time, not as a batch or a group (use topr_signal='advantage' for a group baseline)."
        )
    return parsed


def staleness(name: str, value: object) -> object:
    """A whole number of policy versions >= 0, or inf (keep every sample)."""
    if not (isinstance(value, (int, float)) and (value == math.inf or (value >= 0 and float(value).is_integer()))):
        raise ValueError(
            f"`{name}` must be a whole number of policy versions >= 0, or inf to keep every sample; got {value!r}."
        )
    return value if value == math.inf else int(value)


FIELD_CHECKS: dict[str, Check] = {
    "topr_ratio_level": choice(RATIO_LEVELS),
    "topr_signal": choice(SIGNALS),
    "topr_loss_aggregation": choice(AGGREGATIONS),
    "topr_baseline": baseline,
    "topr_check_finite": flag,
    "topr_positive_weight": non_negative,
    "topr_negative_weight": non_negative,
    "topr_behaviour_source": choice(BEHAVIOUR_SOURCES),
    "topr_baseline_scope": choice(BASELINE_SCOPES),
    "topr_target_effective_proportion": share_or_none,
    "topr_offline_epochs": positive,
    "topr_unscored_batch": choice(UNSCORED_BATCH_ACTIONS),
    "topr_shared_prompt_forward": flag,
}
"""TOPRConfig's own fields and their checks, run in this order after GRPOConfig's `__post_init__` (`check_fields`);
the checks that read several fields follow (`check_across_fields`). AsyncTOPRConfig derives its table from this one."""


def check_fields(config, checks: dict[str, Check]) -> None:
    """Each field of `checks` checked, and set to the value its check returns."""
    for name, check in checks.items():
        setattr(config, name, check(name, getattr(config, name)))


def check_across_fields(config) -> None:
    """TOPRConfig's checks that read several fields, after `check_fields`: the chosen loss's knobs, the target share's
    signal, TOPR fields with one of TRL's losses, and what the loss reads (`check_what_the_loss_reads`)."""
    check_loss_knobs(config)
    if config.topr_target_effective_proportion is not None and config.topr_signal != "reward":
        raise ValueError(
            "`topr_target_effective_proportion` sets the baseline of R - c: it needs topr_signal='reward'."
        )
    refuse_topr_fields_with_trls_loss(config)
    check_what_the_loss_reads(config, stacklevel=5)
