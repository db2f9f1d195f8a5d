"""TOPRTrainer as a drop-in GRPOTrainer: training, delegation to TRL's losses, off-policy data, metrics."""

import logging
import math
import os

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from topr_trl import TOPRConfig, TOPRTrainer
from topr_trl.offline.rollout import make_behaviour_rollout

from .conftest import logged_values, parity_reward, small_config_kwargs, small_trainer


def train_once(trainer_class, config_class, model_path, dataset, output_dir, **overrides):
    """The user's script: the only thing that differs between GRPO and TOPR is the two class names."""
    args = config_class(**small_config_kwargs(output_dir, **overrides))
    trainer = trainer_class(model=model_path, reward_funcs=parity_reward, args=args, train_dataset=dataset)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    changed = any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=False))
    return trainer, changed


@pytest.mark.parametrize("trainer_class,config_class", [(GRPOTrainer, GRPOConfig), (TOPRTrainer, TOPRConfig)])
def test_drop_in_swap_trains(trainer_class, config_class, tiny_model_path, arithmetic_dataset, tmp_path):
    trainer, changed = train_once(trainer_class, config_class, tiny_model_path, arithmetic_dataset, tmp_path)
    assert changed
    logged = trainer.state.log_history[0]
    assert math.isfinite(logged["loss"])
    if trainer_class is TOPRTrainer:
        for key in (
            "topr/positive_fraction",
            "topr/ratio_negative/mean",
            "topr/weight_positive/mean",
            "topr/negative_truncated_fraction",
            "topr/loss_positive",
            "topr/loss_negative",
            "entropy",
        ):
            assert key in logged, key
        assert "topr/effective_positive_proportion" not in logged  # 0.5 by construction under the advantage signal


def test_default_loss_is_topr_and_on_policy_weights_are_one(tiny_model_path, arithmetic_dataset, tmp_path):
    trainer, _ = train_once(TOPRTrainer, TOPRConfig, tiny_model_path, arithmetic_dataset, tmp_path, max_steps=3)
    assert trainer.args.loss_type == "topr"
    # On-policy and one update per generation: pi = mu, so every ratio and weight is exactly 1.
    for key in ("topr/ratio_positive/mean", "topr/ratio_negative/mean", "topr/weight_negative/mean"):
        assert logged_values(trainer, key) and all(v == pytest.approx(1.0) for v in logged_values(trainer, key)), key


def make_inputs(trainer, seed=0):
    """One generation batch, produced by the trainer itself (rewards, advantages, masks)."""
    torch.manual_seed(seed)
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer._prepare_inputs(batch)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo", "cispo"])
def test_trl_loss_types_compute_exactly_what_grpo_computes(loss_type, tiny_model_path, arithmetic_dataset, tmp_path):
    overrides = dict(loss_type=loss_type, num_iterations=2, beta=0.04, per_device_train_batch_size=8)
    grpo = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=parity_reward,
        train_dataset=arithmetic_dataset,
        args=GRPOConfig(**small_config_kwargs(tmp_path / "g", **overrides)),
    )
    topr = small_trainer(tiny_model_path, parity_reward, arithmetic_dataset, tmp_path / "t", **overrides)
    inputs = make_inputs(grpo)
    with torch.no_grad():  # move the policy away from mu so that ratios and clipping are exercised
        for p in list(grpo.model.parameters()) + list(topr.model.parameters()):
            p.add_(0.05 * torch.sin(torch.arange(p.numel(), dtype=p.dtype)).view_as(p))
    losses, grads = [], []
    for trainer in (grpo, topr):
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    assert losses[0] != 0
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_ppo_variant_reproduces_grpo_loss(tiny_model_path, arithmetic_dataset, tmp_path):
    """loss_type='ppo' with token ratios, the advantage signal and per-sequence aggregation is GRPO's own
    `loss_type='grpo'`: an independent check of the TOPR code path against TRL."""
    common = dict(num_iterations=2, per_device_train_batch_size=8)
    grpo = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=parity_reward,
        train_dataset=arithmetic_dataset,
        args=GRPOConfig(**small_config_kwargs(tmp_path / "g", loss_type="grpo", **common)),
    )
    topr = small_trainer(
        tiny_model_path,
        parity_reward,
        arithmetic_dataset,
        tmp_path / "t",
        loss_type="ppo",
        topr_ratio_level="token",
        **common,
    )
    inputs = make_inputs(grpo)
    with torch.no_grad():
        for p in list(grpo.model.parameters()) + list(topr.model.parameters()):
            p.add_(0.05 * torch.sin(torch.arange(p.numel(), dtype=p.dtype)).view_as(p))
    losses = [t.compute_loss(t.model, inputs) for t in (grpo, topr)]
    torch.testing.assert_close(losses[0], losses[1])


def test_off_policy_behaviour_model_tapers_negatives(
    tiny_model_path, behaviour_model_path, arithmetic_dataset, tmp_path
):
    behaviour = AutoModelForCausalLM.from_pretrained(behaviour_model_path)
    tokenizer = AutoTokenizer.from_pretrained(behaviour_model_path)
    args = TOPRConfig(**small_config_kwargs(tmp_path, max_steps=4, per_device_train_batch_size=8))
    trainer = TOPRTrainer(
        model=tiny_model_path,
        reward_funcs=parity_reward,
        args=args,
        train_dataset=arithmetic_dataset,
        rollout_func=make_behaviour_rollout(behaviour, tokenizer),
    )
    trainer.train()
    negative_weights = logged_values(trainer, "topr/weight_negative/mean")
    positive_weights = logged_values(trainer, "topr/weight_positive/mean")
    assert negative_weights and positive_weights
    assert all(0 <= w < 1 for w in negative_weights)
    assert all(w < 1 for w in logged_values(trainer, "topr/ratio_negative/min"))
    assert all(w == 1.0 for w in positive_weights)
    assert all(math.isfinite(loss) for loss in logged_values(trainer, "loss"))
    # mu is another model: ratios are far from 1 on both branches; only the negatives' weights follow them
    assert all(r != pytest.approx(1.0) for r in logged_values(trainer, "topr/ratio_positive/mean"))


@pytest.mark.parametrize("mu_is_the_policy", [True, False])
def test_a_rollout_funcs_logprobs_are_said_to_be_mu_once_with_their_distance(
    mu_is_the_policy, tiny_model_path, behaviour_model_path, arithmetic_dataset, tmp_path, caplog
):
    """GRPOTrainer ignores a rollout_func's `logprobs` without vLLM; TOPR reads them as mu's. Said once, at the first
    batch, with pi/mu's span there: 1 (to float error) when they are the policy's own sampling log-probs, far from
    1 when they are another model's."""
    import re

    sampler = AutoModelForCausalLM.from_pretrained(tiny_model_path if mu_is_the_policy else behaviour_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    args = TOPRConfig(**small_config_kwargs(tmp_path, max_steps=2, per_device_train_batch_size=8))
    trainer = TOPRTrainer(
        model=tiny_model_path,
        reward_funcs=parity_reward,
        args=args,
        train_dataset=arithmetic_dataset,
        rollout_func=make_behaviour_rollout(sampler, tokenizer),
    )
    with caplog.at_level(logging.WARNING, logger="topr_trl"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "rollout_func returns `logprobs`" in r.getMessage()]
    assert len(said) == 1 and "topr_behaviour_source='policy'" in said[0]
    low, high = map(float, re.search(r"spans \[([^,]+), ([^\]]+)\]", said[0]).groups())
    if mu_is_the_policy:
        assert low == pytest.approx(1.0, abs=1e-3) and high == pytest.approx(1.0, abs=1e-3)
    else:
        assert low < 0.5 or high > 2.0


def test_reward_signal_with_baseline(tiny_model_path, arithmetic_dataset, tmp_path):
    """topr_signal='reward': the signal is R - c, so with +1/-1 rewards and c=0.5 every positive carries 0.5 and
    every negative -1.5, and the logged p~ follows Eq. 12."""
    args = TOPRConfig(
        **small_config_kwargs(tmp_path, topr_signal="reward", topr_baseline=0.5, per_device_train_batch_size=8)
    )
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset
    )
    inputs = make_inputs(trainer)
    texts = trainer.processing_class.batch_decode(inputs["completion_ids"], skip_special_tokens=True)
    expected = torch.tensor(parity_reward(texts)) - 0.5
    torch.testing.assert_close(inputs["topr_signal"], expected)
    assert set(expected.tolist()) == {0.5, -1.5}


@pytest.mark.parametrize("baseline", ["group_mean", "batch_mean"])
def test_mean_baselines_centre_the_signal(baseline, tiny_model_path, arithmetic_dataset, tmp_path):
    args = TOPRConfig(**small_config_kwargs(tmp_path, topr_signal="reward", topr_baseline=baseline))
    trainer = TOPRTrainer(
        model=tiny_model_path,
        reward_funcs=lambda completions, **kw: [float(len(c[0]["content"])) for c in completions],
        args=args,
        train_dataset=arithmetic_dataset,
    )
    trainer.train()  # fills the metrics through the full path
    batch = next(iter(trainer.get_train_dataloader()))
    output = trainer._generate_and_score_completions(batch)
    signal = output["topr_signal"]
    groups = signal.view(-1, 4) if baseline == "group_mean" else signal.view(1, -1)
    torch.testing.assert_close(groups.mean(dim=1), torch.zeros(groups.size(0)), atol=1e-5, rtol=0)


def test_reward_function_returning_none_or_nan_is_left_out(tiny_model_path, arithmetic_dataset, tmp_path):
    def flaky_reward(completions, answer, **kwargs):
        scores = parity_reward(completions)
        return [None if i % 3 == 0 else (float("nan") if i % 3 == 1 else s) for i, s in enumerate(scores)]

    for signal in ("advantage", "reward"):
        args = TOPRConfig(**small_config_kwargs(tmp_path / signal, topr_signal=signal, max_steps=2))
        trainer = TOPRTrainer(
            model=tiny_model_path, reward_funcs=flaky_reward, args=args, train_dataset=arithmetic_dataset
        )
        trainer.train()
        assert all(math.isfinite(loss) for loss in logged_values(trainer, "loss"))


def test_infinite_reward_raises_a_clear_error_when_checked(tiny_model_path, arithmetic_dataset, tmp_path):
    def broken_reward(completions, **kwargs):
        return [math.inf] * len(completions)

    trainer = small_trainer(tiny_model_path, broken_reward, arithmetic_dataset, tmp_path, topr_check_finite=True)
    with pytest.raises(ValueError, match="broken_reward.*infinite"):
        trainer.train()
    # GRPOTrainer's behaviour by default: it trains on (the loss is NaN), and TOPRTrainer warns
    grpo = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=broken_reward,
        train_dataset=arithmetic_dataset,
        args=GRPOConfig(**small_config_kwargs(tmp_path / "grpo")),
    )
    grpo.train()
    trainer = small_trainer(tiny_model_path, broken_reward, arithmetic_dataset, tmp_path / "default")
    trainer.train()
    assert trainer.state.global_step == grpo.state.global_step == 2


def test_sampler_source_without_sampler_is_rejected(tiny_model_path, arithmetic_dataset, tmp_path):
    args = TOPRConfig(**small_config_kwargs(tmp_path, topr_behaviour_source="sampler"))
    with pytest.raises(ValueError, match="rollout_func"):
        TOPRTrainer(model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset)


def test_num_iterations_makes_ratios_depart_from_one(tiny_model_path, arithmetic_dataset, tmp_path):
    """With several updates per generation batch, mu is the policy at generation time: as pi moves, pi/mu != 1."""
    args = TOPRConfig(
        **small_config_kwargs(
            tmp_path, num_iterations=4, max_steps=4, learning_rate=5e-2, per_device_train_batch_size=8
        )
    )
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset
    )
    trainer.train()
    ratios = logged_values(trainer, "topr/ratio_negative/mean") + logged_values(trainer, "topr/ratio_positive/mean")
    assert any(abs(r - 1) > 1e-3 for r in ratios)


def test_kl_entropy_bonus_and_accumulation(tiny_model_path, arithmetic_dataset, tmp_path):
    args = TOPRConfig(**small_config_kwargs(tmp_path, beta=0.04, entropy_coef=0.01, gradient_accumulation_steps=2))
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    assert "kl" in logged and "policy_loss" in logged and "entropy_coef" in logged
    assert math.isfinite(logged["loss"])


def test_lora_training_changes_only_adapter_weights(tiny_model_path, arithmetic_dataset, tmp_path):
    from peft import LoraConfig

    args = TOPRConfig(**small_config_kwargs(tmp_path, learning_rate=5e-2))
    trainer = TOPRTrainer(
        model=tiny_model_path,
        reward_funcs=parity_reward,
        args=args,
        train_dataset=arithmetic_dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(before[name], p)}
    assert changed and all("lora_" in name for name in changed)


def test_nan_loss_stops_training_with_a_clear_error_when_checked(tiny_model_path, arithmetic_dataset, tmp_path, caplog):
    trainer = small_trainer(tiny_model_path, parity_reward, arithmetic_dataset, tmp_path, per_device_train_batch_size=8)
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._prepare_inputs(batch)
    with torch.no_grad():
        trainer.model.model.norm.weight.fill_(float("nan"))  # every log-prob, hence the loss, becomes NaN
    with pytest.raises(FloatingPointError, match="not finite"):
        trainer.args.topr_check_finite = True
        trainer.compute_loss(trainer.model, inputs)
    trainer.args.topr_check_finite = False  # GRPOTrainer's behaviour: the NaN loss is returned, with one warning
    with caplog.at_level(logging.WARNING, logger="topr_trl.trainer"):
        assert torch.isnan(trainer.compute_loss(trainer.model, inputs))
        assert torch.isnan(trainer.compute_loss(trainer.model, inputs))
    assert len([r for r in caplog.records if "not finite" in r.getMessage()]) == 1


def test_target_effective_proportion_per_batch(tiny_model_path, arithmetic_dataset, tmp_path):
    args = TOPRConfig(
        **small_config_kwargs(
            tmp_path,
            topr_signal="reward",
            topr_target_effective_proportion=0.15,
            per_device_train_batch_size=8,
            max_steps=3,
        )
    )
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset
    )
    trainer.train()
    baselines = logged_values(trainer, "topr/baseline")
    shares = logged_values(trainer, "topr/effective_positive_proportion")
    assert len(baselines) == 3 and all(-1 < c < 1 for c in baselines)
    assert shares and all(share == pytest.approx(0.15, abs=1e-4) for share in shares)


def test_target_effective_proportion_needs_the_reward_signal(tmp_path):
    with pytest.raises(ValueError, match="topr_signal='reward'"):
        TOPRConfig(**small_config_kwargs(tmp_path, topr_target_effective_proportion=0.15))
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        TOPRConfig(**small_config_kwargs(tmp_path, topr_signal="reward", topr_target_effective_proportion=1.5))


def test_model_card_cites_topr(tiny_model_path, arithmetic_dataset, tmp_path):
    trainer = small_trainer(tiny_model_path, parity_reward, arithmetic_dataset, tmp_path)
    trainer.create_model_card(model_name="tiny-topr")
    card = (tmp_path / "README.md").read_text()
    assert "2503.14286" in card and "Tapered Off-Policy REINFORCE" in card
    assert "## TOPR configuration" in card and "| 1.0, 1.0, 0.0, 1.0 |" in card and "`topr_signal` | advantage" in card


@pytest.mark.parametrize(
    "config_class, loss_type, says",
    [
        (GRPOConfig, None, "This model was trained with GRPO"),  # GRPOConfig's own default loss ("dapo")
        (TOPRConfig, "dapo", "This model was trained with GRPO"),
        (TOPRConfig, "sft", "This model was trained with the `sft` policy loss of topr-trl"),
    ],
)
def test_the_card_and_tags_name_the_loss_that_trained_never_topr_for_another(
    config_class, loss_type, says, tiny_model_path, arithmetic_dataset, tmp_path, caplog
):
    """Never claim TOPR where another loss trained: a GRPOConfig (which carries TRL's loss) warns that the run is
    GRPO's, and the card, the model's tags and the run cite TOPR only for loss_type='topr'."""
    overrides = {} if loss_type is None else {"loss_type": loss_type}
    with caplog.at_level(logging.WARNING, logger="topr_trl"):
        trainer = TOPRTrainer(
            model=tiny_model_path,
            reward_funcs=parity_reward,
            train_dataset=arithmetic_dataset,
            args=config_class(**small_config_kwargs(tmp_path, **overrides)),
        )
    warned = [record.getMessage() for record in caplog.records if "not TOPR" in record.getMessage()]
    if config_class is GRPOConfig:
        assert len(warned) == 1 and "loss_type='dapo'" in warned[0] and "TOPRConfig" in warned[0]
    else:
        assert not warned
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    assert says in card
    assert "2503.14286" not in card and "Tapered Off-Policy" not in card and "- topr\n" not in card
    assert "trl" in trainer.model.model_tags and "topr" not in trainer.model.model_tags
    if config_class is GRPOConfig or loss_type == "dapo":
        assert "Trained with TRL's `loss_type='dapo'`" in card and "## TOPR configuration" not in card


def test_a_topr_config_gives_no_warning_and_a_topr_card(tiny_model_path, arithmetic_dataset, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="topr_trl"):
        trainer = small_trainer(tiny_model_path, parity_reward, arithmetic_dataset, tmp_path)
    assert not [record for record in caplog.records if "not TOPR" in record.getMessage()]
    assert "topr" in trainer.model.model_tags


@pytest.mark.parametrize("signal", ["advantage", "reward"])
def test_training_leaves_no_state_beyond_what_grpo_trainer_keeps(signal, tiny_model_path, arithmetic_dataset, tmp_path):
    """Data flows one way: the attributes a TOPRTrainer gains or changes the type of while training are those a
    GRPOTrainer gains on the same run (TRL's own state), and the batch's rows carry nothing of TOPR's afterwards."""

    def attributes_gained(trainer_class, config_class, extra):
        trainer = trainer_class(
            model=tiny_model_path,
            reward_funcs=parity_reward,
            train_dataset=arithmetic_dataset,
            args=config_class(**small_config_kwargs(tmp_path / trainer_class.__name__, **extra)),
        )
        before = {name: type(value) for name, value in vars(trainer).items()}
        rollout = trainer.rollout_func
        trainer.train()
        assert trainer.rollout_func is rollout
        return {name for name, value in vars(trainer).items() if before.get(name, object) is not type(value)}

    topr = attributes_gained(TOPRTrainer, TOPRConfig, {"topr_signal": signal})
    grpo = attributes_gained(GRPOTrainer, GRPOConfig, {})
    assert topr == grpo and grpo  # GRPOTrainer does gain some (its buffers), TOPR none of its own
    rows = [dict(row) for row in arithmetic_dataset.select(range(8))]
    trainer = small_trainer(tiny_model_path, parity_reward, arithmetic_dataset, tmp_path / "rows", topr_signal=signal)
    output = trainer._generate_and_score_completions(rows)
    assert not any(key.startswith("topr_") for row in rows for key in row)
    assert ("topr_signal" in output) == (signal == "reward")


def test_a_registered_loss_reads_its_own_knob_from_a_config_subclass(tiny_model_path, arithmetic_dataset, tmp_path):
    """A new loss with a knob of its own touches two places: its registration (`reads=`) and a field of a config
    subclass. The knob reaches the loss the trainer computes: on the same batch, scale 2 gives exactly twice the loss
    of scale 1 (doubling is exact in binary floating point, term by term and through the sums) and scale 0 gives 0."""
    from dataclasses import dataclass

    from topr_trl.loss import POLICY_LOSSES, register_policy_loss

    @dataclass
    class ScaledConfig(TOPRConfig):
        reinforce_scale: float = 1.0

    @register_policy_loss("test_scaled_reinforce", reads=("reinforce_scale",))
    def scaled_reinforce(per_token_logps, log_ratio, signal, is_positive, spec):
        return -spec.knob("reinforce_scale") * signal * per_token_logps, torch.ones_like(log_ratio)

    try:
        trainers = [
            TOPRTrainer(
                model=tiny_model_path,
                reward_funcs=parity_reward,
                train_dataset=arithmetic_dataset,
                args=ScaledConfig(
                    **small_config_kwargs(
                        tmp_path / str(scale), reinforce_scale=scale, loss_type="test_scaled_reinforce"
                    )
                ),
            )
            for scale in (1.0, 2.0, 0.0)
        ]
        inputs = make_inputs(trainers[0])
        one, two, zero = [trainer.compute_loss(trainer.model, inputs).detach() for trainer in trainers]
        assert one.abs() > 1e-3 and torch.equal(two, 2 * one) and zero == 0
    finally:
        POLICY_LOSSES.pop("test_scaled_reinforce")


@pytest.mark.parametrize("penalty, warned", [(1.0, False), (1.2, True)])
def test_a_repetition_penalty_is_said_to_bias_pi_over_mu(
    penalty, warned, tiny_model_path, arithmetic_dataset, tmp_path, caplog
):
    """mu sampled with a repetition penalty depends on the tokens already seen, which pi's scoring does not replay:
    the run says once that pi/mu carries the penalty (GRPOTrainer accepts the setting, so TOPRTrainer trains on)."""
    with caplog.at_level(logging.WARNING, logger="topr_trl"):
        small_trainer(tiny_model_path, parity_reward, arithmetic_dataset, tmp_path, repetition_penalty=penalty)
    said = [record.getMessage() for record in caplog.records if "repetition_penalty" in record.getMessage()]
    assert len(said) == int(warned)
    assert not said or "repetition_penalty=1.2" in said[0] and "pi/mu" in said[0]


def test_a_dataset_without_a_prompt_column_is_refused_at_construction_naming_its_columns(
    tiny_model_path, arithmetic_dataset, tmp_path
):
    """From Python, as a user meets it: a dataset whose prompts sit under another name fails when the trainer is built,
    in one line naming the columns and the rename, not with a bare `KeyError: 'prompt'` at the first step; the same
    for an eval dataset, one of a dict of them included."""
    renamed = arithmetic_dataset.rename_column("prompt", "question")
    config = TOPRConfig(**small_config_kwargs(tmp_path / "run"))
    for datasets, name in (
        ({"train_dataset": renamed}, "train_dataset"),
        ({"train_dataset": arithmetic_dataset, "eval_dataset": {"held_out": renamed}}, "eval_dataset['held_out']"),
    ):
        with pytest.raises(ValueError) as refusal:
            TOPRTrainer(model=tiny_model_path, reward_funcs=parity_reward, args=config, **datasets)
        message = str(refusal.value)
        assert message.startswith(f"{name} has no 'prompt' column (its columns: question, answer)"), message
        assert f"{name}.rename_column('question', 'prompt')" in message and "\n" not in message


def test_a_dataset_routing_environments_needs_no_prompt_column(tiny_model_path, tmp_path):
    """With `environment_factory`, GRPOTrainer takes a dataset of only an `environment` column (each environment's
    reset() supplies the prompt): the prompt-column check stands aside, as TRL's own multi-environment tests need
    (trl_compat: `test_train_with_multiple_environments`, with a model whose template renders tool calls)."""

    class Counter:
        def reset(self, **kwargs):
            return "Count to three."

        def count(self, x: int) -> int:
            """
            Count one up.

            Args:
                x: The count so far.

            Returns:
                The next count.
            """
            return x + 1

    routing = Dataset.from_dict({"environment": ["counter", "counter"]})
    config = TOPRConfig(**small_config_kwargs(tmp_path / "run", per_device_train_batch_size=2, num_generations=2))
    try:
        TOPRTrainer(
            model=tiny_model_path,
            reward_funcs=parity_reward,
            args=config,
            train_dataset=routing,
            environment_factory={"counter": Counter},
        )
    except ValueError as refusal:  # TRL's own checks go on: the tiny model's chat template renders no tool calls
        assert "'prompt' column" not in str(refusal), refusal


def test_a_python_run_prints_none_of_trls_deprecation_or_deepspeed_noise(tiny_model_path, tmp_path):
    """A user's script: config, trainer, one step, in a fresh process. transformers 5 deprecates the
    `gradient_checkpointing` names TRL 1.16 still uses (its GRPOConfig default, its generation context) and DeepSpeed
    logs its guess of the CPU: before, four such lines on every run; now none, while a warning of the user's own
    still shows."""
    import subprocess
    import sys

    script = f"""
import warnings
from datasets import Dataset
from topr_trl import TOPRConfig, TOPRTrainer
args = TOPRConfig({str(tmp_path)!r}, per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                  max_steps=1, report_to="none", save_strategy="no", use_cpu=True)
prompts = Dataset.from_dict({{"prompt": ["1+1=", "2+2=", "3+3=", "4+4="]}})
TOPRTrainer({tiny_model_path!r}, lambda completions, **kwargs: [1.0] * len(completions), args=args,
            train_dataset=prompts).train()
warnings.warn("the user's own", FutureWarning)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("DS_ACCELERATOR", None)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "gradient_checkpointing" not in run.stderr and "Setting accelerator" not in run.stderr, run.stderr
    assert "the user's own" in run.stderr
