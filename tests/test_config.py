"""TOPRConfig: every GRPOConfig field keeps working; invalid settings fail at construction, naming the field."""

import dataclasses
import math
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
        ["--output_dir", "/tmp/x", "--report_to", "none", "--use_cpu", "true", "--topr_negative_upper", "inf",
         "--topr_baseline", "group_mean", "--topr_signal", "reward"]
    )
    assert math.isinf(args.topr_limits.negative_upper) and args.topr_baseline == "group_mean"


@pytest.mark.parametrize("kwargs, field", [
    (dict(loss_type="cispo", cispo_epsilon_high=0.3), "cispo_epsilon_high"),
    (dict(loss_type="grpo", topr_signal="reward"), "topr_signal"),
    (dict(loss_type="dapo", topr_negative_upper=2.0), "topr_negative_upper"),
    (dict(loss_type="cispo_two_sided", topr_negative_upper=2.0), "topr_negative_upper"),
    (dict(loss_type="ppo", kimi15_tau=0.5), "kimi15_tau"),
    (dict(loss_type="topr", cispo_epsilon_low=0.3), "cispo_epsilon_low"),
])
def test_a_field_the_selected_loss_does_not_read_is_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}` has no effect .*drop it"):
        config(**kwargs)


def test_fields_the_selected_loss_reads_are_accepted():
    assert config(loss_type="cispo_two_sided", cispo_epsilon_high=0.3).policy_loss_spec.knob("cispo_epsilon_high") == 0.3
    assert config(loss_type="ppo", delta=1.5).policy_loss_spec.ppo_delta == 1.5
    # fields about the data, not the loss, apply to TRL's loss types too
    assert config(loss_type="dapo", topr_offline_epochs=2.0, topr_unscored_batch="skip").loss_type == "dapo"
    assert config(loss_type="grpo", topr_baseline="0.0").loss_type == "grpo"  # the default, spelt out


@pytest.mark.parametrize(("kwargs", "counterpart"), [
    ({"epsilon": 0.3}, "topr_positive_lower"), ({"epsilon_high": 0.28}, "topr_negative_lower/upper"),
    ({"delta": 2.0}, "truncation"), ({"importance_sampling_level": "sequence"}, 'topr_ratio_level="length_normalized"'),
    ({"sapo_temperature_pos": 2.0}, "truncation"), ({"sapo_temperature_neg": 2.0}, "truncation")])
def test_trls_loss_fields_set_under_topr_say_they_are_not_read_and_name_the_counterpart(kwargs, counterpart):
    """A DAPO or GSPO user who swaps the names is told their clipping or sequence-level ratio is off, once per field;
    PPO's clipping here reads epsilon/epsilon_high/delta, and TRL's own losses (computed by GRPOTrainer) read them
    all, so neither warns; nor do the defaults."""
    (name, value), = kwargs.items()
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
        AsyncTOPRConfig(output_dir="/tmp/topr-config-test", report_to="none", use_cpu=True, epsilon_high=0.3,
                        loss_type="ppo")
    assert not [w for w in caught if "has no effect" in str(w.message)]
