"""TOPRConfig: every GRPOConfig field keeps working; invalid settings fail at construction, naming the field."""

import dataclasses
import math
import typing
import warnings

import pytest
from trl import GRPOConfig

from topr_trl import PRESETS, TOPRConfig
from topr_trl.config import loss_types
from topr_trl.loss import POLICY_LOSSES, TRL_LOSS_TYPES


def config(**kwargs):
    return TOPRConfig(output_dir="/tmp/topr-config-test", report_to="none", use_cpu=True, **kwargs)


def test_defaults_follow_the_paper():
    args = config()
    assert args.loss_type == "topr" and args.beta == 0.0
    assert args.topr_limits == PRESETS["topr"]
    assert args.topr_ratio_level == "sequence" and args.topr_loss_aggregation == "seq-mean-token-mean"
    spec = args.policy_loss_spec
    assert spec.loss_type == "topr" and spec.positive_weight == spec.negative_weight == 1.0


def test_every_grpo_field_is_a_topr_field_with_the_same_default():
    grpo_fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    topr_fields = {f.name: f for f in dataclasses.fields(TOPRConfig)}
    assert set(grpo_fields) <= set(topr_fields)
    changed = [name for name, f in grpo_fields.items() if f.default != topr_fields[name].default]
    assert changed == ["loss_type"]


@pytest.mark.parametrize("row", list(PRESETS))
def test_each_table1_row_is_a_loss_type_with_its_limits(row):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert config(loss_type=row).topr_limits == PRESETS[row] == POLICY_LOSSES[row].limits


def test_losses_that_are_not_eq7_have_no_limits():
    assert config(loss_type="ppo").topr_limits is None and config(loss_type="kimi15").policy_loss_spec.limits is None


def test_explicit_limits_override_the_loss_types_and_accept_infinity():
    args = config(loss_type="tis", topr_negative_upper=float("inf"), topr_positive_lower=1.0)
    limits = args.topr_limits
    assert (limits.positive_lower, limits.positive_upper, limits.negative_lower) == (1.0, 1.0, 0.0)
    assert math.isinf(limits.negative_upper)


@pytest.mark.parametrize("name", ["pg_variant", "topr_preset", "tis_lower_bound", "tis_upper_bound"])
def test_the_selectors_loss_type_replaced_are_gone(name):
    """A package never released keeps no deprecated aliases: `loss_type` and the four limits are the only way."""
    with pytest.raises(TypeError, match=name):
        config(**{name: "ppo"})


def test_a_registered_loss_is_selectable_and_a_trl_name_is_refused():
    """The config checks the live registry: a loss registered after import is a loss_type at once."""
    import torch

    from topr_trl.loss import register_policy_loss

    @register_policy_loss("test_plain_reinforce", reads=())
    def plain_reinforce(per_token_logps, log_ratio, signal, is_positive, spec):
        return -signal * per_token_logps, torch.ones_like(log_ratio)

    try:
        assert "test_plain_reinforce" in loss_types()
        args = config(loss_type="test_plain_reinforce")
        assert args.policy_loss_spec.loss_type == "test_plain_reinforce" and args.topr_limits is None
        with pytest.raises(ValueError, match="`topr_negative_upper` has no effect"):
            config(loss_type="test_plain_reinforce", topr_negative_upper=2.0)
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test_plain_reinforce")(plain_reinforce)
    finally:
        POLICY_LOSSES.pop("test_plain_reinforce")
    with pytest.raises(ValueError, match="TRL's loss types"):
        register_policy_loss("grpo")(plain_reinforce)
    with pytest.raises(ValueError, match="`loss_type`"):
        config(loss_type="test_plain_reinforce")


def test_a_registered_loss_reads_its_own_knob_checked_at_construction():
    """A loss registered with `reads=("my_tau",)` gets the field of a config subclass in its spec; the knob is checked
    when the loss is chosen, refused with another loss, and a config class without the field fails naming it."""
    from dataclasses import dataclass

    import torch

    from topr_trl.loss import register_policy_loss

    @dataclass
    class TauConfig(TOPRConfig):
        my_tau: float = 0.25

    @register_policy_loss("test_tau_loss", reads=("my_tau",))
    def tau_loss(per_token_logps, log_ratio, signal, is_positive, spec):
        return -spec.knob("my_tau") * signal * per_token_logps, torch.ones_like(log_ratio)

    common = dict(output_dir="/tmp/unused", report_to="none", use_cpu=True, bf16=False)
    try:
        assert TauConfig(**common, loss_type="test_tau_loss", my_tau=0.5).policy_loss_spec.knobs == {"my_tau": 0.5}
        assert TauConfig(**common).policy_loss_spec.knobs == {}  # topr reads no knob
        with pytest.raises(ValueError, match="`my_tau` must be a finite number >= 0"):
            TauConfig(**common, loss_type="test_tau_loss", my_tau=-1.0)
        with pytest.raises(ValueError, match="`my_tau` has no effect with loss_type='topr'.*'test_tau_loss'"):
            TauConfig(**common, my_tau=0.5)
        with pytest.raises(ValueError, match="reads `my_tau`, which TOPRConfig does not declare"):
            TOPRConfig(**common, loss_type="test_tau_loss")
    finally:
        POLICY_LOSSES.pop("test_tau_loss")


def test_positive_negative_lower_limit_warns_prop_3_2():
    with pytest.warns(UserWarning, match="unbounded") as caught:
        config(loss_type="naive_reinforce")
    unbounded = [warning for warning in caught if "unbounded" in str(warning.message)]
    assert unbounded[0].filename == __file__  # points at the user's TOPRConfig(...) line, not at dataclass internals


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("loss_type", "tpor", "topr"),
        ("loss_type", "TIS", "tis"),
        ("topr_ratio_level", "seq", "sequence"),
        ("topr_signal", "rewards", "reward"),
        ("topr_loss_aggregation", "token_mean", "token-mean"),
        ("topr_behaviour_source", "vllm", "sampler"),
    ],
)
def test_unknown_names_raise_naming_field_and_allowed_values(field, value, allowed):
    with pytest.raises(ValueError, match=f"`{field}`") as error:
        config(**{field: value})
    assert allowed in str(error.value)


def test_lower_above_upper_raises():
    with pytest.raises(ValueError, match="lower <= upper"):
        config(topr_negative_lower=0.5, topr_negative_upper=0.2)


@pytest.mark.parametrize("field", ["topr_positive_weight", "topr_negative_weight", "kimi15_tau"])
def test_negative_weights_raise(field):
    with pytest.raises(ValueError, match=field):
        config(**{field: -1.0})


def test_baseline_parsing():
    assert config(topr_signal="reward", topr_baseline="0.25").topr_baseline == 0.25
    assert config(topr_signal="reward", topr_baseline=-0.5).topr_baseline == -0.5
    assert config(topr_signal="reward", topr_baseline="group_mean").topr_baseline == "group_mean"
    with pytest.raises(ValueError, match="topr_baseline"):
        config(topr_signal="reward", topr_baseline="median")
    with pytest.raises(ValueError, match="topr_baseline"):
        config(topr_signal="reward", topr_baseline=float("nan"))
    with pytest.warns(UserWarning, match="only used with topr_signal='reward'"):
        config(topr_baseline=0.3)


@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_trl_loss_types_are_accepted(loss_type):
    assert config(loss_type=loss_type).loss_type == loss_type


def test_config_parses_from_command_line_strings():
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(TOPRConfig).parse_args_into_dataclasses(
        [
            "--output_dir",
            "/tmp/x",
            "--report_to",
            "none",
            "--use_cpu",
            "true",
            "--topr_negative_upper",
            "inf",
            "--topr_baseline",
            "group_mean",
            "--topr_signal",
            "reward",
        ]
    )
    assert math.isinf(args.topr_limits.negative_upper) and args.topr_baseline == "group_mean"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(loss_type="cispo", cispo_epsilon_high=0.3), "cispo_epsilon_high"),
        (dict(loss_type="grpo", topr_signal="reward"), "topr_signal"),
        (dict(loss_type="dapo", topr_negative_upper=2.0), "topr_negative_upper"),
        (dict(loss_type="cispo_two_sided", topr_negative_upper=2.0), "topr_negative_upper"),
        (dict(loss_type="ppo", kimi15_tau=0.5), "kimi15_tau"),
        (dict(loss_type="topr", cispo_epsilon_low=0.3), "cispo_epsilon_low"),
    ],
)
def test_a_field_the_selected_loss_does_not_read_is_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}` has no effect .*drop it"):
        config(**kwargs)


def test_fields_the_selected_loss_reads_are_accepted():
    assert (
        config(loss_type="cispo_two_sided", cispo_epsilon_high=0.3).policy_loss_spec.knob("cispo_epsilon_high") == 0.3
    )
    assert config(loss_type="ppo", delta=1.5).policy_loss_spec.ppo_delta == 1.5
    # fields about the data, not the loss, apply to TRL's loss types too
    assert config(loss_type="dapo", topr_offline_epochs=2.0, topr_unscored_batch="skip").loss_type == "dapo"
    assert config(loss_type="grpo", topr_baseline="0.0").loss_type == "grpo"  # the default, spelt out


@pytest.mark.parametrize(
    ("kwargs", "counterpart"),
    [
        ({"epsilon": 0.3}, "topr_positive_lower"),
        ({"epsilon_high": 0.28}, "topr_negative_lower/upper"),
        ({"delta": 2.0}, "truncation"),
        ({"importance_sampling_level": "sequence"}, 'topr_ratio_level="length_normalized"'),
        ({"sapo_temperature_pos": 2.0}, "truncation"),
        ({"sapo_temperature_neg": 2.0}, "truncation"),
    ],
)
def test_trls_loss_fields_set_under_topr_say_they_are_not_read_and_name_the_counterpart(kwargs, counterpart):
    """A DAPO or GSPO user who swaps the names is told their clipping or sequence-level ratio is off, once per field;
    PPO's clipping here reads epsilon/epsilon_high/delta, and TRL's own losses (computed by GRPOTrainer) read them
    all, so neither warns; nor do the defaults."""
    ((name, value),) = kwargs.items()
    with pytest.warns(UserWarning, match=rf"`{name}`={value!r} has no effect with loss_type='topr'") as caught:
        config(**kwargs)
    said = [str(w.message) for w in caught if "has no effect" in str(w.message)]
    assert len(said) == 1 and counterpart in said[0]
    quiet = [{"loss_type": "dapo"}, {"loss_type": "gspo"} if "gspo" in TRL_LOSS_TYPES else {"loss_type": "grpo"}]
    if name in ("epsilon", "epsilon_high", "delta"):
        quiet.append({"loss_type": "ppo"})
    for other in [*quiet, {}]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config(**({**kwargs, **other} if other else {}))
        assert not [w for w in caught if "has no effect" in str(w.message)], other


def test_the_asynchronous_config_says_the_same_of_trls_clipping():
    from topr_trl.asynchronous import AsyncTOPRConfig

    with pytest.warns(UserWarning, match=r"`epsilon_high`=0.3 has no effect with loss_type='topr'"):
        AsyncTOPRConfig(output_dir="/tmp/topr-config-test", report_to="none", use_cpu=True, epsilon_high=0.3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AsyncTOPRConfig(
            output_dir="/tmp/topr-config-test", report_to="none", use_cpu=True, epsilon_high=0.3, loss_type="ppo"
        )
    assert not [w for w in caught if "has no effect" in str(w.message)]


# AsyncTOPRConfig declares these TOPRFields fields again, with TOPRFields' default: they take fewer values there (TRL's
# loss types are GRPOTrainer's; the packed micro-batch has two aggregations), and their help lists those.
NARROWED_BY_THE_ASYNCHRONOUS_CONFIG = {"loss_type", "topr_loss_aggregation"}


def own_annotations(cls) -> set[str]:
    """The fields `cls` itself declares (its body's annotations), not those it inherits."""
    return set(cls.__dict__.get("__annotations__", {}))


def test_topr_fields_are_declared_once_for_both_configs():
    """TOPR's fields are TOPRFields': TOPRConfig and AsyncTOPRConfig inherit them (the same dataclass field: default,
    type and help), and neither declares one again, but for the asynchronous config's narrowed choices. What the
    asynchronous config adds to TRL's AsyncGRPOConfig is exactly TOPRFields' fields."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from topr_trl.asynchronous import AsyncTOPRConfig
    from topr_trl.config import TOPRFields

    shared = {f.name: f for f in dataclasses.fields(TOPRFields)}
    trl_fields = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    assert {f.name for f in dataclasses.fields(AsyncTOPRConfig)} - trl_fields == set(shared)
    assert not own_annotations(TOPRConfig) & set(shared)
    assert own_annotations(AsyncTOPRConfig) & set(shared) == NARROWED_BY_THE_ASYNCHRONOUS_CONFIG
    shared_types, asynchronous_types = typing.get_type_hints(TOPRFields), typing.get_type_hints(AsyncTOPRConfig)
    for name, declared in shared.items():
        assert TOPRConfig.__dataclass_fields__[name] is declared, name
        asynchronous = AsyncTOPRConfig.__dataclass_fields__[name]
        if name in NARROWED_BY_THE_ASYNCHRONOUS_CONFIG:
            assert asynchronous.default == declared.default and asynchronous_types[name] == shared_types[name], name
        else:
            assert asynchronous is declared, name


def both_configs(**kwargs) -> list:
    """TOPRConfig and AsyncTOPRConfig with the same settings."""
    from topr_trl.asynchronous import AsyncTOPRConfig

    common = dict(output_dir="/tmp/topr-config-test", report_to="none", use_cpu=True, bf16=False)
    return [cls(**common, **kwargs) for cls in (TOPRConfig, AsyncTOPRConfig)]


@pytest.mark.parametrize(
    "setting",
    [
        {"topr_signal": "rewards"},
        {"topr_ratio_level": "seq"},
        {"topr_baseline": "abc"},
        {"topr_baseline": math.inf},
        {"topr_check_finite": "yes"},
        {"topr_negative_weight": -1.0},
        {"kimi15_tau": 0.5},
        {"loss_type": "kimi15", "kimi15_tau": -1.0},
        {"topr_positive_lower": 2.0, "topr_positive_upper": 1.0},
        {"learning_rate": -1.0},
        {"max_completion_length": 0},
    ],
)
def test_both_configs_refuse_a_setting_in_the_same_line(setting):
    """One check of each TOPR field, run by both configs: the same one-line ValueError."""
    from topr_trl.asynchronous import AsyncTOPRConfig

    common = dict(output_dir="/tmp/topr-config-test", report_to="none", use_cpu=True, bf16=False)
    said = []
    for cls in (TOPRConfig, AsyncTOPRConfig):
        with pytest.raises(ValueError) as error:
            cls(**common, **setting)
        said.append(str(error.value))
    assert said[0] == said[1] and "\n" not in said[0], said


def test_both_configs_take_a_topr_field_alike():
    """The same settings give the same TOPR values (the baseline given as a string read as a number), the same loss,
    and the same warnings, each pointing at the line that built the config."""
    from topr_trl.config import TOPRFields

    setting = dict(
        loss_type="tis",
        topr_signal="reward",
        topr_baseline="0.25",
        topr_negative_lower=0.5,
        topr_positive_weight=2.0,
        topr_check_finite=True,
        epsilon_high=0.3,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        synchronous, asynchronous = both_configs(**setting)
    assert synchronous.topr_baseline == asynchronous.topr_baseline == 0.25
    assert all(getattr(synchronous, f.name) == getattr(asynchronous, f.name) for f in dataclasses.fields(TOPRFields))
    assert synchronous.policy_loss_spec == asynchronous.policy_loss_spec
    said = [(str(w.message), w.filename) for w in caught if w.category is UserWarning]
    assert len(said) == 4 and said[:2] == said[2:] and {filename for _, filename in said} == {__file__}, said
