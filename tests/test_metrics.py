"""TOPRTrainer's metrics mean what the README says: truncation counted with a tolerance, p~ only where it is a
choice, branch losses with the stated signs."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from topr_trl import TOPRConfig, TOPRTrainer
from topr_trl.loss import PRESETS, PolicyLossSpec, policy_per_token_loss
from topr_trl.offline import generate_offline_dataset, stored_reward
from topr_trl.training.shared import log_policy_metrics

from .conftest import parity_reward, small_config_kwargs


# naive REINFORCE (a- = 1) is compared on purpose; its construction warns that the objective is unbounded
pytestmark = pytest.mark.filterwarnings("ignore:topr_negative_lower:UserWarning")

# Sequence log-ratios log pi/mu of six negatives: three are 0 up to float rounding, two are clearly off 0.
NEGATIVE_LOG_RATIOS = [1e-6, -1e-6, 0.0, 0.3, -0.3, 2e-6]
POSITIVE_LOG_RATIOS = [0.3, -0.3]  # positives are never counted, whatever their truncation


def logged_values(trainer, key) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if entry.get(key) is not None]


def truncated_fraction_logged(trainer) -> float:
    """Feed the trainer's metric code a batch with the log-ratios above and read back the fraction it logs."""
    log_ratios = torch.tensor(NEGATIVE_LOG_RATIOS + POSITIVE_LOG_RATIOS)
    signal = torch.tensor([-1.0] * len(NEGATIVE_LOG_RATIOS) + [1.0] * len(POSITIVE_LOG_RATIOS)).view(-1, 1)
    per_token_logps = torch.full((len(log_ratios), 3), math.log(0.5))
    behaviour_logps = per_token_logps.clone()
    behaviour_logps[:, 0] -= log_ratios  # the whole sequence log-ratio sits on the first token
    mask = torch.ones_like(per_token_logps)
    terms = policy_per_token_loss(per_token_logps, behaviour_logps, signal, mask, trainer._loss_spec)
    loss = (terms.per_token_loss * mask).sum(1).div(3).mean()
    log_policy_metrics(
        trainer.accelerator,
        trainer._metrics["train"],
        terms,
        signal,
        mask,
        torch.ones_like(mask),
        terms.per_token_loss,
        {"aggregation": "seq-mean-token-mean"},
        loss,
        negative_weight=trainer._loss_spec.negative_weight,
        reward_signal=trainer.args.topr_signal == "reward",
    )
    return trainer._metrics["train"]["topr/negative_truncated_fraction"][-1]


def outside_limits_fraction(lower: float, upper: float, relative_tolerance: float = 1e-4) -> float:
    """The README's definition, computed independently of the trainer: pi/mu outside [a-, b-] by more than a
    relative 1e-4."""
    ratios = [math.exp(x) for x in NEGATIVE_LOG_RATIOS]
    outside = [r < lower * (1 - relative_tolerance) or r > upper * (1 + relative_tolerance) for r in ratios]
    return sum(outside) / len(ratios)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ({}, outside_limits_fraction(PRESETS["topr"].negative_lower, PRESETS["topr"].negative_upper)),  # 1/6
        ({"loss_type": "naive_reinforce"}, outside_limits_fraction(1.0, 1.0)),  # 2/6
        ({"loss_type": "tis"}, outside_limits_fraction(0.0, 1.0)),
        ({"loss_type": "off_policy_reinforce"}, 0.0),
        ({"topr_negative_weight": 0.5}, outside_limits_fraction(0.0, 1.0)),  # lambda- is not truncation
        ({"loss_type": "cispo_two_sided"}, outside_limits_fraction(0.9, 1.1)),  # CISPO clips to [1 - 0.1, 1 + 0.1]
        # PPO with A < 0 clips (weight 0) where r < 1 - 0.2: only exp(-0.3) = 0.74
        ({"loss_type": "ppo"}, 1 / 6),
    ],
    ids=["topr", "naive_reinforce", "tis", "off_policy_reinforce", "negative_weight", "cispo", "ppo"],
)
def test_truncation_is_counted_with_a_tolerance(overrides, expected, tiny_model_path, arithmetic_dataset, tmp_path):
    args = TOPRConfig(**small_config_kwargs(tmp_path, **overrides))
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset
    )
    assert truncated_fraction_logged(trainer) == pytest.approx(expected)


@pytest.fixture(scope="module")
def data_from_the_policy(tiny_model_path, arithmetic_dataset, tmp_path_factory):
    """Completions sampled from the policy itself: mu = pi, so every replayed ratio is 1 up to float rounding
    (generation and training compute the log-probs in different batch layouts)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    return generate_offline_dataset(
        model,
        tokenizer,
        arithmetic_dataset.select(range(8)),
        parity_reward,
        tmp_path_factory.mktemp("mu-is-pi"),
        num_completions=4,
        max_new_tokens=6,
        prompts_per_shard=2,
        prompts_per_batch=2,
        show_progress=False,
    )


@pytest.mark.parametrize("preset", ["topr", "naive_reinforce"])
def test_replay_of_the_policy_own_samples_truncates_nothing(preset, data_from_the_policy, tiny_model_path, tmp_path):
    args = TOPRConfig(
        **small_config_kwargs(
            tmp_path, max_steps=-1, per_device_train_batch_size=8, learning_rate=0.0, loss_type=preset
        )
    )
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=stored_reward, args=args, train_dataset=data_from_the_policy
    )
    trainer.train()
    ratios = logged_values(trainer, "topr/ratio_negative/min") + logged_values(trainer, "topr/ratio_negative/max")
    assert len(ratios) == 8 and all(r == pytest.approx(1.0, abs=1e-4) for r in ratios)  # pi = mu throughout
    assert logged_values(trainer, "topr/negative_truncated_fraction") == [0.0] * 4


@pytest.mark.parametrize(
    "mu_shift,preset,expected",
    [
        (-0.05, "topr", 1.0),  # mu's stored log-probs lowered: every pi/mu > 1, cut to b- = 1
        (-0.05, "off_policy_reinforce", 0.0),  # [0, inf] truncates nothing
        (0.05, "topr", 0.0),  # every pi/mu < 1: inside [0, 1]
        (0.05, "naive_reinforce", 1.0),  # [1, 1] truncates every ratio that is not 1
    ],
)
def test_replay_with_mu_clearly_off_pi_is_truncated(
    mu_shift, preset, expected, data_from_the_policy, tiny_model_path, tmp_path
):
    """The policy's own samples with mu's stored log-probs moved by 0.05 per token: every ratio is at least
    exp(0.05) away from 1, on the side the shift sets."""
    data = data_from_the_policy.map(lambda row: {"behaviour_logps": [x + mu_shift for x in row["behaviour_logps"]]})
    args = TOPRConfig(
        **small_config_kwargs(tmp_path, max_steps=2, per_device_train_batch_size=8, learning_rate=0.0, loss_type=preset)
    )
    trainer = TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, args=args, train_dataset=data)
    trainer.train()
    ratios = logged_values(trainer, "topr/ratio_negative/min") + logged_values(trainer, "topr/ratio_negative/max")
    assert len(ratios) == 4 and all((r > 1.04) if mu_shift < 0 else (r < 0.96) for r in ratios)
    assert logged_values(trainer, "topr/negative_truncated_fraction") == [expected] * 2


@pytest.mark.parametrize("signal", ["advantage", "reward"])
def test_effective_positive_proportion_is_logged_only_where_it_is_a_choice(
    signal, tiny_model_path, arithmetic_dataset, tmp_path
):
    args = TOPRConfig(**small_config_kwargs(tmp_path, topr_signal=signal))
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset
    )
    trainer.train()
    shares = logged_values(trainer, "topr/effective_positive_proportion")
    if signal == "advantage":
        assert not any("topr/effective_positive_proportion" in entry for entry in trainer.state.log_history)
        return
    # +1/-1 rewards, c = 0, on-policy weights 1: Eq. 12 gives p~ = p, the share of positive trajectories.
    assert len(shares) == 2 and shares == pytest.approx(logged_values(trainer, "topr/positive_fraction"))


def test_branch_losses_have_the_stated_signs(tiny_model_path, arithmetic_dataset, tmp_path):
    args = TOPRConfig(**small_config_kwargs(tmp_path, max_steps=3))
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset
    )
    trainer.train()
    positive, negative = (logged_values(trainer, f"topr/loss_{b}") for b in ("positive", "negative"))
    assert len(positive) == len(negative) == 3
    assert all(p > 0 for p in positive) and all(n < 0 for n in negative)


def test_effective_sample_size_fraction_and_ratio_quantiles_by_hand():
    """Kish's ESS fraction: 1 for equal ratios, 1/n when one ratio carries everything, (1+3)^2 / (2 (1+9)) = 0.8 for
    (1, 3). Quantiles per branch by linear interpolation (torch.quantile), NaN for an empty branch."""
    from topr_trl.training.policy_metrics import branch_ratios, effective_sample_size_fraction, ratio_quantiles

    assert effective_sample_size_fraction(4.0, 4.0, 4) == 1.0
    assert effective_sample_size_fraction(4.0, 16.0, 4) == 0.25
    assert effective_sample_size_fraction(4.0, 10.0, 2) == pytest.approx(0.8)
    assert math.isnan(effective_sample_size_fraction(0.0, 0.0, 0))
    log_ratios = torch.log(torch.tensor([[0.5], [1.0], [2.0], [3.0], [4.0]]))
    signal = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0])
    terms = policy_per_token_loss(
        torch.zeros(5, 2), -log_ratios.expand(5, 2) / 2, signal.view(-1, 1), torch.ones(5, 2), PolicyLossSpec()
    )
    quantiles = ratio_quantiles(branch_ratios(terms, signal, torch.ones(5, 2)))
    assert math.isnan(quantiles["topr/ratio_positive/p50"])
    # negatives 0.5, 1, 2, 3, 4: p10 = 0.5 + 0.4 * 0.5, p50 = 2, p90 = 3 + 0.6 * 1
    assert [quantiles[f"topr/ratio_negative/p{q}"] for q in (10, 50, 90)] == pytest.approx([0.7, 2.0, 3.6], rel=1e-5)


def test_drift_and_mismatch_split_the_log_ratio_by_hand():
    """log pi/mu = (log pi - log pi_gen) + (log pi_gen - log mu), each summed over the completion's tokens (the
    masked one left out), then |.| averaged over trajectories."""
    from topr_trl.training.policy_metrics import drift_and_mismatch, drift_and_mismatch_sums

    pi = torch.tensor([[-1.0, -2.0, -9.0], [-1.5, -1.0, -1.0]])
    pi_gen = torch.tensor([[-1.1, -2.1, 0.0], [-1.5, -1.0, -1.0]])
    mu = torch.tensor([[-1.1, -2.0, 5.0], [-1.0, -1.0, -1.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    metrics = drift_and_mismatch(drift_and_mismatch_sums(pi, pi_gen, mu, mask).tolist())
    # drift: 0.2 and 0; mismatch: -0.1 and (-0.5 + 0 + 0.5) = 0
    assert metrics["topr/log_ratio_drift/mean_abs"] == pytest.approx(0.1, rel=1e-5)
    assert metrics["topr/log_ratio_mismatch/mean_abs"] == pytest.approx(0.05, rel=1e-5)


def test_ratios_by_staleness_bin_by_hand():
    """Six trajectories in three bins (one unknown, -1, left out): per bin and branch the mean pi/mu, Kish's ESS over
    both branches and the share of negatives whose weight min(1, pi/mu) is truncated (ratio above 1)."""
    from topr_trl.training.policy_metrics import staleness_bin_metrics, staleness_bin_sums

    ratios = torch.tensor([0.5, 2.0, 1.0, 4.0, 0.25, 3.0])
    signal = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, -1.0])
    bins = torch.tensor([0, 0, 2, 2, 2, -1])
    log_ratios = torch.log(ratios).view(-1, 1)
    terms = policy_per_token_loss(
        torch.zeros(6, 2), -log_ratios.expand(6, 2) / 2, signal.view(-1, 1), torch.ones(6, 2), PolicyLossSpec()
    )
    sums = staleness_bin_sums(terms, signal, torch.ones(6, 2), bins, 4, negative_weight=1.0)
    metrics = staleness_bin_metrics(sums, ("a", "b", "c", "d"))
    assert {key.split("/")[1] for key in metrics} == {"staleness_a", "staleness_c"}  # empty bins are not logged
    # bin a: positive 0.5, negative 2 (truncated to 1); ESS (0.5 + 2)^2 / (2 (0.25 + 4)) = 6.25 / 8.5
    assert metrics["topr/staleness_a/ratio_positive/mean"] == pytest.approx(0.5, rel=1e-6)
    assert metrics["topr/staleness_a/ratio_negative/mean"] == pytest.approx(2.0, rel=1e-6)
    assert metrics["topr/staleness_a/ratio_ess_fraction"] == pytest.approx(6.25 / 8.5, rel=1e-6)
    assert metrics["topr/staleness_a/negative_truncated_fraction"] == 1.0
    # bin c: positive 0.25, negatives 1 (not truncated) and 4 (truncated); ESS 5.25^2 / (3 (0.0625 + 1 + 16))
    assert metrics["topr/staleness_c/ratio_positive/mean"] == pytest.approx(0.25, rel=1e-6)
    assert metrics["topr/staleness_c/ratio_negative/mean"] == pytest.approx(2.5, rel=1e-6)
    assert metrics["topr/staleness_c/ratio_ess_fraction"] == pytest.approx(5.25**2 / (3 * 17.0625), rel=1e-6)
    assert metrics["topr/staleness_c/negative_truncated_fraction"] == 0.5
