"""The loss module against hand-computed values and gradients (paper Eq. 7, 8, 12)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from topr_trl.loss import (
    AGGREGATIONS,
    MAX_LOG_RATIO,
    PRESETS,
    RATIO_LEVELS,
    PolicyLossSpec,
    TruncationLimits,
    aggregate,
    baseline_for_effective_proportion,
    branch_losses,
    effective_positive_proportion,
    log_importance_ratio,
    policy_per_token_loss,
    signal_share_of_positives,
    topr_loss,
    truncated_ratio,
)


# the built-in losses' knobs at TOPRConfig's defaults, as a config's `policy_loss_spec` passes them
KNOBS = {"cispo_epsilon_low": 0.1, "cispo_epsilon_high": 0.1, "kimi15_tau": 0.1}


@pytest.fixture(autouse=True)
def float64_by_default():
    """Hand computations are in float64; restore the default so other test modules are unaffected."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def batch(seed=0, B=6, T=5):
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=generator) * 2
    behaviour = logps + torch.randn(B, T, generator=generator) * 0.3
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    signal = torch.tensor([1.0, -1.0, 0.5, -0.25, -2.0, 1.5])[:B]
    return logps, behaviour, mask, signal


def hand_weight(log_ratio, s, limits):
    lower, upper = (
        (limits.positive_lower, limits.positive_upper) if s >= 0 else (limits.negative_lower, limits.negative_upper)
    )
    return min(max(math.exp(min(log_ratio, MAX_LOG_RATIO)), lower), min(upper, math.exp(MAX_LOG_RATIO)))


def hand_loss_and_grad(logps, behaviour, mask, signal, limits, level, aggregation, max_len=7):
    """Loops over trajectories and tokens, written independently of the vectorised module."""
    B, T = logps.shape
    grad = torch.zeros(B, T)
    contributions = torch.zeros(B, T)  # d loss / d logp for each token, before aggregation
    for i in range(B):
        tokens = [t for t in range(T) if mask[i, t] > 0]
        s = float(signal[i])
        for t in tokens:
            if level == "token":
                lr = float(logps[i, t] - behaviour[i, t])
            else:
                lr = sum(float(logps[i, u] - behaviour[i, u]) for u in tokens)
                if level == "length_normalized":
                    lr /= max(len(tokens), 1)
            contributions[i, t] = -hand_weight(lr, s, limits) * s
    n_tokens = float(mask.sum())
    loss = 0.0
    for i in range(B):
        n_i = float(mask[i].sum())
        for t in range(T):
            if mask[i, t] == 0:
                continue
            if aggregation == "seq-mean-token-mean":
                scale = 1.0 / (max(n_i, 1.0) * B)
            elif aggregation in ("token-mean", "global-token-mean"):
                scale = 1.0 / n_tokens
            else:
                scale = 1.0 / (B * max_len)
            grad[i, t] = float(contributions[i, t]) * scale
            loss += float(contributions[i, t]) * float(logps[i, t]) * scale
    return loss, grad


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("level", RATIO_LEVELS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_and_gradient_match_hand_computation(preset, level, aggregation):
    logps, behaviour, mask, signal = batch()
    logps.requires_grad_(True)
    spec = PolicyLossSpec(limits=PRESETS[preset], ratio_level=level)
    loss, _ = topr_loss(
        logps, behaviour, signal, mask, spec, aggregation, max_completion_length=7, num_tokens=mask.sum()
    )
    loss.backward()
    expected_loss, expected_grad = hand_loss_and_grad(
        logps.detach(), behaviour, mask, signal, PRESETS[preset], level, aggregation
    )
    assert loss.item() == pytest.approx(expected_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(logps.grad, expected_grad)


def test_gradient_equals_eq8_computed_directly():
    """A softmax policy over a small vocabulary: the TOPR gradient of Eq. 8 (divided by trajectory length),
    built from per-trajectory grad log pi(tau) and stop-gradient weights, equals autograd of the loss."""
    torch.manual_seed(0)
    vocab, B, T = 7, 5, 4
    theta = torch.randn(T, vocab, requires_grad=True)
    tokens = torch.randint(vocab, (B, T))
    mask = torch.ones(B, T)
    mask[2, 2:] = 0
    mu_logps = torch.log_softmax(torch.randn(T, vocab), -1).gather(-1, tokens.T).T
    signal = torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0])

    def logps_of(params):
        return torch.log_softmax(params, -1).gather(-1, tokens.T).T  # (B, T)

    loss, _ = topr_loss(logps_of(theta), mu_logps, signal, mask)
    (autograd_grad,) = torch.autograd.grad(loss, theta)

    direct = torch.zeros_like(theta)
    for i in range(B):
        logp_tau = (logps_of(theta)[i] * mask[i]).sum()
        (grad_log_pi,) = torch.autograd.grad(logp_tau, theta)
        ratio = math.exp(logp_tau.detach().item() - float((mu_logps[i] * mask[i]).sum()))
        weight = 1.0 if signal[i] >= 0 else min(ratio, 1.0)  # Eq. 8: SFT on positives, TIS on negatives
        direct += weight * float(signal[i]) * grad_log_pi / mask[i].sum()
    direct = -direct / B  # the loss is minimised: its gradient is minus the ascent direction
    torch.testing.assert_close(autograd_grad, direct)


def test_weights_are_stop_gradient():
    logps, behaviour, mask, signal = batch()
    logps.requires_grad_(True)
    terms = policy_per_token_loss(logps, behaviour, signal, mask, PolicyLossSpec(limits=PRESETS["tis"]))
    assert not terms.weights.requires_grad and not terms.log_ratio.requires_grad
    # d/d logp of -w*s*logp with w constant is -w*s: no term from d w / d logp
    terms.per_token_loss.sum().backward()
    torch.testing.assert_close(logps.grad, (-terms.weights * signal.reshape(-1, 1)).expand_as(logps) * 1.0)


def test_truncated_ratio_hand_values():
    log_ratio = torch.tensor([math.log(0.5), math.log(2.0), -1e4, 1e4, 0.0])
    torch.testing.assert_close(truncated_ratio(log_ratio, 0.0, 1.0), torch.tensor([0.5, 1.0, 0.0, 1.0, 1.0]))
    torch.testing.assert_close(truncated_ratio(log_ratio, 1.0, 1.0), torch.ones(5))
    untruncated = truncated_ratio(log_ratio, 0.0, math.inf)
    torch.testing.assert_close(untruncated, torch.tensor([0.5, 2.0, 0.0, math.exp(MAX_LOG_RATIO), 1.0]))
    torch.testing.assert_close(truncated_ratio(log_ratio, 0.0, 0.0), torch.zeros(5))


def test_sequence_ratio_is_the_product_of_token_ratios():
    logps, behaviour, mask, _ = batch()
    product = torch.exp(log_importance_ratio(logps, behaviour, mask, "sequence")).squeeze(1)
    expected = torch.tensor(
        [
            math.prod(math.exp(float(logps[i, t] - behaviour[i, t])) for t in range(logps.size(1)) if mask[i, t])
            for i in range(logps.size(0))
        ]
    )
    torch.testing.assert_close(product, expected)
    geometric = torch.exp(log_importance_ratio(logps, behaviour, mask, "length_normalized")).squeeze(1)
    torch.testing.assert_close(geometric, expected ** (1 / mask.sum(1)))


def test_canonical_topr_positive_weight_is_one_and_negative_weight_in_unit_interval():
    logps, behaviour, mask, signal = batch()
    for shift in (-3.0, 0.0, 3.0):
        terms = policy_per_token_loss(logps, behaviour + shift, signal, mask)
        positive = terms.is_positive.squeeze(1)
        assert torch.all(terms.weights[positive] == 1.0)
        assert torch.all((terms.weights[~positive] >= 0) & (terms.weights[~positive] <= 1))


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("level", RATIO_LEVELS)
@pytest.mark.parametrize("variant", ["topr", "ppo", "cispo_two_sided", "kimi15"])
def test_no_inf_or_nan_on_extreme_inputs(preset, level, variant):
    B, T = 6, 4
    logps = torch.full((B, T), -1.0, requires_grad=True)
    behaviour = torch.tensor([[1e4] * T, [-1e4] * T, [1e4] * T, [-1e4] * T, [float("nan")] * T, [-math.inf] * T])
    mask = torch.ones(B, T)
    mask[2] = 0  # a fully masked row
    spec = PolicyLossSpec(loss_type=variant, limits=PRESETS[preset], ratio_level=level, knobs=KNOBS)
    for signal in (torch.tensor([1.0, -1, 1, -1, 1, -1]), torch.ones(B), -torch.ones(B), torch.zeros(B)):
        for aggregation in AGGREGATIONS:
            loss, terms = topr_loss(
                logps, behaviour, signal, mask, spec, aggregation, max_completion_length=T, num_tokens=mask.sum()
            )
            (grad,) = torch.autograd.grad(loss, logps)
            assert torch.isfinite(loss) and torch.isfinite(grad).all() and torch.isfinite(terms.weights).all()


def test_zero_length_completions_and_empty_masks():
    for logps, mask in (
        (torch.zeros(3, 0, requires_grad=True), torch.zeros(3, 0)),
        (torch.zeros(3, 4, requires_grad=True), torch.zeros(3, 4)),
    ):
        for aggregation in AGGREGATIONS:
            loss, _ = topr_loss(
                logps,
                logps.detach(),
                torch.tensor([1.0, -1.0, 0.0]),
                mask,
                aggregation=aggregation,
                max_completion_length=4,
                num_tokens=mask.sum(),
            )
            (grad,) = torch.autograd.grad(loss, logps)
            assert loss.item() == 0.0 and torch.all(grad == 0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_branch_losses_add_up_to_the_loss(aggregation):
    logps, behaviour, mask, signal = batch()
    kwargs = dict(max_completion_length=7, num_tokens=mask.sum())
    loss, terms = topr_loss(logps, behaviour, signal, mask, aggregation=aggregation, **kwargs)
    positive, negative = branch_losses(terms.per_token_loss, terms.is_positive, mask, aggregation, **kwargs)
    torch.testing.assert_close(positive + negative, loss)
    assert positive.item() != 0 and negative.item() != 0


def test_branch_weights_scale_each_branch():
    logps, behaviour, mask, signal = batch()
    base = policy_per_token_loss(logps, behaviour, signal, mask)
    scaled = policy_per_token_loss(
        logps, behaviour, signal, mask, PolicyLossSpec(positive_weight=2.0, negative_weight=0.5)
    )
    factor = torch.where(base.is_positive, 2.0, 0.5)
    torch.testing.assert_close(scaled.per_token_loss, base.per_token_loss * factor)


def test_ppo_cispo_kimi15_hand_values():
    logps = torch.tensor([[math.log(0.5)], [math.log(0.5)]], requires_grad=True)
    behaviour = torch.log(torch.tensor([[0.25], [0.25]]))  # ratio 2 on both rows
    mask = torch.ones(2, 1)
    signal = torch.tensor([1.0, -1.0])
    token = dict(ratio_level="token")
    ppo = policy_per_token_loss(logps, behaviour, signal, mask, PolicyLossSpec(loss_type="ppo", **token))
    # positive: min(2*1, 1.2*1) = 1.2 -> loss -1.2, clipped (no gradient); negative: min(-2, -1.2) = -2 -> loss 2
    torch.testing.assert_close(ppo.per_token_loss.detach(), torch.tensor([[-1.2], [2.0]]))
    (grad,) = torch.autograd.grad(ppo.per_token_loss.sum(), logps)
    torch.testing.assert_close(grad, torch.tensor([[0.0], [2.0]]))  # d(-r*A)/dlogp = -r*A = 2 on the negative
    cispo = policy_per_token_loss(
        logps, behaviour, signal, mask, PolicyLossSpec(loss_type="cispo_two_sided", knobs=KNOBS, **token)
    )
    torch.testing.assert_close(cispo.weights, torch.tensor([[1.1], [1.1]]))
    kimi = policy_per_token_loss(
        logps, behaviour, signal, mask, PolicyLossSpec(loss_type="kimi15", knobs=KNOBS, **token)
    )
    log2 = math.log(2)
    expected = torch.tensor([[-math.log(0.5) + 0.05 * log2**2], [math.log(0.5) + 0.05 * log2**2]])
    torch.testing.assert_close(kimi.per_token_loss.detach(), expected)


def test_aggregate_rejects_missing_normaliser_and_unknown_mode():
    x, m = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(x, m, "global-token-mean")
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate(x, m, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate(x, m, "mean")


def test_truncation_limits_validation():
    with pytest.raises(ValueError, match="lower <= upper"):
        TruncationLimits(1.0, 0.5, 0.0, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        TruncationLimits(0.0, 1.0, -0.1, 1.0)


@settings(max_examples=200, deadline=None)
@given(p=st.floats(0.01, 0.99), target=st.floats(0.01, 0.99))
def test_baseline_solver_hits_target_effective_proportion(p, target):
    c = baseline_for_effective_proportion(p, target)
    assert -1 < c < 1
    assert effective_positive_proportion(p, c) == pytest.approx(target, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(n_pos=st.integers(1, 50), n_neg=st.integers(1, 50), c=st.floats(-0.95, 0.95))
def test_measured_share_of_positives_equals_eq12_for_pm1_rewards(n_pos, n_neg, c):
    rewards = torch.tensor([1.0] * n_pos + [-1.0] * n_neg)
    measured = signal_share_of_positives(rewards - c).item()
    p = n_pos / (n_pos + n_neg)
    assert measured == pytest.approx(effective_positive_proportion(p, c), rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(n_pos=st.integers(1, 40), n_neg=st.integers(1, 40), target=st.floats(0.02, 0.98))
def test_general_baseline_solver_matches_closed_form_for_pm1_rewards(n_pos, n_neg, target):
    from topr_trl.loss import baseline_for_target_share

    rewards = torch.tensor([1.0] * n_pos + [-1.0] * n_neg)
    c = baseline_for_target_share(rewards, target)
    p = n_pos / (n_pos + n_neg)
    assert c == pytest.approx(baseline_for_effective_proportion(p, target), abs=1e-6)
    assert signal_share_of_positives(rewards - c).item() == pytest.approx(target, abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(rewards=st.lists(st.floats(-5, 5), min_size=2, max_size=30), target=st.floats(0.05, 0.95))
def test_general_baseline_solver_hits_target_share(rewards, target):
    from topr_trl.loss import baseline_for_target_share

    rewards = torch.tensor(rewards)
    c = baseline_for_target_share(rewards, target)
    if rewards.min() == rewards.max():
        assert c == 0.0
    else:
        # the share jumps where c crosses a reward value; away from jumps it is hit exactly
        share = signal_share_of_positives(rewards - c).item()
        below = signal_share_of_positives(rewards - (c - 1e-6)).item()
        above = signal_share_of_positives(rewards - (c + 1e-6)).item()
        assert min(below, above) - 1e-4 <= target <= max(below, above) + 1e-4 or share == pytest.approx(
            target, abs=1e-4
        )


def test_registry_holds_one_entry_per_loss_type_and_dispatches_once():
    """`POLICY_LOSSES` is the one table of TOPR's loss types, each with its limits: each entry, called directly on
    (log pi, log pi/mu, s, s >= 0, spec), gives what `policy_per_token_loss` gives for that loss type, by hand below
    (ratio 0.5 on both rows, so that the limits of Table 1's rows all differ)."""
    from topr_trl.loss import POLICY_LOSSES

    assert tuple(POLICY_LOSSES) == (
        "tis",
        "off_policy_reinforce",
        "naive_reinforce",
        "sft",
        "topr",
        "ppo",
        "cispo_two_sided",
        "kimi15",
    )
    assert {name: entry.limits for name, entry in POLICY_LOSSES.items() if entry.limits is not None} == PRESETS
    log_half = math.log(0.5)
    logps = torch.tensor([[log_half], [log_half]])
    log_ratio = torch.full((2, 1), log_half)
    signal = torch.tensor([[1.0], [-1.0]])
    positive = signal >= 0
    hand = {  # (per-token loss -w s log pi, weight w)
        "topr": ([[-log_half], [0.5 * log_half]], [[1.0], [0.5]]),  # [1, 1] and [0, 1]
        "naive_reinforce": ([[-log_half], [log_half]], [[1.0], [1.0]]),  # [1, 1] and [1, 1]
        "tis": ([[-0.5 * log_half], [0.5 * log_half]], [[0.5], [0.5]]),  # [0, 1] and [0, 1]
        "sft": ([[-log_half], [0.0]], [[1.0], [0.0]]),  # [1, 1] and [0, 0]
        "off_policy_reinforce": ([[-0.5 * log_half], [0.5 * log_half]], [[0.5], [0.5]]),  # [0, inf] both
        "ppo": ([[-0.5], [0.8]], [[0.5], [0.0]]),  # -min(rA, clip(r, 0.8, 1.2)A); the negative is clipped
        "cispo_two_sided": ([[-0.9 * log_half], [0.9 * log_half]], [[0.9], [0.9]]),  # r clipped to [0.9, 1.1]
        "kimi15": ([[-log_half + 0.05 * log_half**2], [log_half + 0.05 * log_half**2]], [[1.0], [1.0]]),
    }
    for name, entry in POLICY_LOSSES.items():
        spec = PolicyLossSpec(loss_type=name, limits=entry.limits, ratio_level="token", knobs=KNOBS)
        loss, weight = entry.function(logps, log_ratio, signal, positive, spec)
        torch.testing.assert_close(loss, torch.tensor(hand[name][0]), msg=name)
        torch.testing.assert_close(weight, torch.tensor(hand[name][1]), msg=name)
        terms = policy_per_token_loss(logps, logps - log_ratio, signal, torch.ones(2, 1), spec)
        torch.testing.assert_close(terms.per_token_loss, loss, msg=name)


def test_reward_signal_subtracts_each_baseline_and_zeroes_unscored():
    """s = R - c (by hand) for a number, the group mean and the batch mean; a NaN reward is left out of the means
    and gets 0."""
    from topr_trl.loss import reward_signal

    rewards = torch.tensor([1.0, -1.0, 1.0, float("nan")])
    torch.testing.assert_close(reward_signal(rewards, 0.5, 2), torch.tensor([0.5, -1.5, 0.5, 0.0]))
    torch.testing.assert_close(reward_signal(rewards, "group_mean", 2), torch.tensor([1.0, -1.0, 0.0, 0.0]))
    torch.testing.assert_close(reward_signal(rewards, "batch_mean", 2), torch.tensor([2 / 3, -4 / 3, 2 / 3, 0.0]))


def test_ppo_two_sided_clip_caps_the_ratio_at_delta():
    """GRPOConfig's `delta`: -min(min(r, delta) A, clip(r) A); with A < 0 and r = 3 > delta = 2.5 the loss is
    2.5 |A| and carries no gradient (without delta: 3 |A| with gradient 3 |A|)."""
    logps = torch.tensor([[math.log(0.75)]], requires_grad=True)
    behaviour = torch.log(torch.tensor([[0.25]]))
    spec = PolicyLossSpec(loss_type="ppo", ratio_level="token", ppo_delta=2.5)
    terms = policy_per_token_loss(logps, behaviour, torch.tensor([-1.0]), torch.ones(1, 1), spec)
    torch.testing.assert_close(terms.per_token_loss.detach(), torch.tensor([[2.5]]))
    (grad,) = torch.autograd.grad(terms.per_token_loss.sum(), logps)
    assert grad.item() == 0.0 and terms.weights.item() == 0.0
    free = policy_per_token_loss(
        logps, behaviour, torch.tensor([-1.0]), torch.ones(1, 1), PolicyLossSpec(loss_type="ppo", ratio_level="token")
    )
    torch.testing.assert_close(free.per_token_loss.detach(), torch.tensor([[3.0]]))


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_packed_loss_equals_the_padded_loss_with_its_gradient(aggregation):
    """Completions packed flat in any order of their segments (as TRL's asynchronous trainer packs rows) give the
    loss and gradient of the same completions as a padded batch: the sequence ratio does not depend on packing."""
    from topr_trl.loss import packed_topr_loss, unpack_segments

    generator = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2]
    signal = torch.tensor([1.0, -1.0, -0.5, 0.7])
    padded_logps = -torch.rand(4, 5, generator=generator) * 3
    padded_behaviour = padded_logps - 0.3 * torch.randn(4, 5, generator=generator)
    mask = torch.arange(5).expand(4, 5) < torch.tensor(lengths)[:, None]
    # pack: segments interleaved as a packer could place them (2, 0, 3, 1), tokens in order within each
    layout = [(s, t) for s in (2, 0, 3, 1) for t in range(lengths[s])]
    segment_id = torch.tensor([s for s, _ in layout])
    flat_logps = torch.stack([padded_logps[s, t] for s, t in layout]).requires_grad_()
    flat_behaviour = torch.stack([padded_behaviour[s, t] for s, t in layout])
    flat_signal = signal[segment_id]

    values, unpacked_mask = unpack_segments(flat_logps.detach(), segment_id)
    assert torch.equal(unpacked_mask, mask)
    assert torch.equal(values[mask], padded_logps[mask])

    packed, _, _ = packed_topr_loss(flat_logps, flat_behaviour, flat_signal, segment_id, aggregation=aggregation)
    packed.backward()
    reference_logps = padded_logps.clone().requires_grad_()
    reference, _ = topr_loss(reference_logps, padded_behaviour, signal, mask, aggregation=aggregation)
    reference.backward()
    assert packed.item() == pytest.approx(reference.item(), abs=1e-7)
    expected_grad = torch.stack([reference_logps.grad[s, t] for s, t in layout])
    assert torch.allclose(flat_logps.grad, expected_grad, atol=1e-7)
    # another packing of the same completions (segments in another order) gives the same loss
    other = [(s, t) for s in (1, 3, 0, 2) for t in range(lengths[s])]
    other_ids = torch.tensor([s for s, _ in other])
    repacked, _, _ = packed_topr_loss(
        torch.stack([padded_logps[s, t] for s, t in other]),
        torch.stack([padded_behaviour[s, t] for s, t in other]),
        signal[other_ids],
        other_ids,
        aggregation=aggregation,
    )
    assert repacked.item() == pytest.approx(reference.item(), abs=1e-7)
