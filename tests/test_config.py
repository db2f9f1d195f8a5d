"""TOPRConfig: every GRPOConfig field keeps working; invalid settings fail at construction, naming the field."""

import dataclasses
import math

import pytest
from trl import GRPOConfig

from topr_trl import PRESETS, TOPRConfig
from topr_trl.config import TRL_LOSS_TYPES


def config(**kwargs):
    return TOPRConfig(output_dir="/tmp/topr-config-test", report_to="none", use_cpu=True, **kwargs)


def test_defaults_follow_the_paper():
    args = config()
    assert args.loss_type == "topr" and args.beta == 0.0
    assert args.topr_limits == PRESETS["topr"]
    assert args.topr_ratio_level == "sequence" and args.topr_loss_aggregation == "seq-mean-token-mean"
    spec = args.policy_loss_spec
    assert spec.variant == "topr" and spec.positive_weight == spec.negative_weight == 1.0


def test_every_grpo_field_is_a_topr_field_with_the_same_default():
    grpo_fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    topr_fields = {f.name: f for f in dataclasses.fields(TOPRConfig)}
    assert set(grpo_fields) <= set(topr_fields)
    changed = [name for name, f in grpo_fields.items() if f.default != topr_fields[name].default]
    assert changed == ["loss_type"]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_give_table1_limits(preset):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert config(topr_preset=preset).topr_limits == PRESETS[preset]


def test_explicit_limits_override_the_preset_and_accept_infinity():
    args = config(topr_preset="tis", topr_negative_upper=float("inf"), topr_positive_lower=1.0)
    limits = args.topr_limits
    assert (limits.positive_lower, limits.positive_upper, limits.negative_lower) == (1.0, 1.0, 0.0)
    assert math.isinf(limits.negative_upper)


def test_pg_variants_map_to_limits():
    with pytest.warns(UserWarning, match="unbounded"):  # a- = 1, then a- = 0.2
        assert config(pg_variant="vanilla").topr_limits == PRESETS["naive_reinforce"]
        limits = config(pg_variant="tis", tis_lower_bound=0.2, tis_upper_bound=2.0).topr_limits
    assert (limits.positive_lower, limits.positive_upper, limits.negative_lower, limits.negative_upper) == (0.2, 2.0, 0.2, 2.0)


def test_positive_negative_lower_limit_warns_prop_3_2():
    with pytest.warns(UserWarning, match="unbounded") as caught:
        config(topr_preset="naive_reinforce")
    unbounded = [warning for warning in caught if "unbounded" in str(warning.message)]
    assert unbounded[0].filename == __file__  # points at the user's TOPRConfig(...) line, not at dataclass internals


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("loss_type", "tpor", "topr"),
        ("topr_preset", "TIS", "tis"),
        ("topr_ratio_level", "seq", "sequence"),
        ("topr_signal", "rewards", "reward"),
        ("topr_loss_aggregation", "token_mean", "token-mean"),
        ("topr_behaviour_source", "vllm", "sampler"),
        ("pg_variant", "grpo", "ppo"),
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
    (dict(loss_type="dapo", pg_variant="ppo"), "pg_variant"),
    (dict(loss_type="grpo", topr_preset="sft"), "topr_preset"),
    (dict(loss_type="cispo", cispo_epsilon_high=0.3), "cispo_epsilon_high"),
    (dict(loss_type="grpo", topr_signal="reward"), "topr_signal"),
    (dict(pg_variant="ppo", topr_preset="sft"), "topr_preset"),
    (dict(pg_variant="cispo", topr_negative_upper=2.0), "topr_negative_upper"),
    (dict(pg_variant="topr", tis_upper_bound=2.0), "tis_upper_bound"),
    (dict(pg_variant="ppo", kimi15_tau=0.5), "kimi15_tau"),
])
def test_a_field_the_selected_loss_does_not_read_is_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}` has no effect .*drop it"):
        config(**kwargs)


def test_fields_the_selected_loss_reads_are_accepted():
    assert config(pg_variant="cispo", cispo_epsilon_high=0.3).policy_loss_spec.cispo_epsilon_high == 0.3
    assert config(pg_variant="ppo", delta=1.5).policy_loss_spec.ppo_delta == 1.5
    # fields about the data, not the loss, apply to TRL's loss types too
    assert config(loss_type="dapo", topr_offline_epochs=2.0, topr_unscored_batch="skip").loss_type == "dapo"
    assert config(loss_type="grpo", topr_baseline="0.0").loss_type == "grpo"  # the default, spelt out
