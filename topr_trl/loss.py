"""The TOPR loss family as pure tensor functions.

Notation follows Le Roux, Bellemare et al., "Tapered Off-Policy REINFORCE" (arXiv:2503.14286). A batch holds
B trajectories tau (prompt + completion) sampled from a behaviour policy mu; `per_token_logps` are log pi of the
completion tokens under the policy being trained, `behaviour_logps` the same tokens under mu, `mask` marks
the completion tokens that count, and `signal` is the per-trajectory R(tau) - c (or a group advantage).

The TOPR gradient (Eq. 7) weights each trajectory's REINFORCE term by its importance ratio pi(tau)/mu(tau)
truncated to [a+, b+] when the signal is non-negative and to [a-, b-] when it is negative; the truncated ratio
is a constant (stop-gradient), and each trajectory's loss is divided by its length. Canonical TOPR is
(a+, b+, a-, b-) = (1, 1, 0, 1): an SFT step on positives, truncated importance sampling on negatives.

Every ratio is formed in log space and bounded above by `MAX_LOG_RATIO`, so no input (log-ratios of +-1e4,
fully masked rows, empty batches) produces inf or NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch


RatioLevel = Literal["sequence", "length_normalized", "token"]
Aggregation = Literal["seq-mean-token-mean", "token-mean", "global-token-mean", "seq-mean-token-sum-norm"]

RATIO_LEVELS: tuple[str, ...] = ("sequence", "length_normalized", "token")
AGGREGATIONS: tuple[str, ...] = ("seq-mean-token-mean", "token-mean", "global-token-mean", "seq-mean-token-sum-norm")

# exp(20) ~ 4.9e8. Only untruncated presets (an infinite upper limit) can reach it; beyond it a ratio would
# overflow to inf in float32 and turn the loss into NaN, so it is treated as e^20.
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class TruncationLimits:
    """The four truncation limits of Eq. 7: the ratio of a trajectory with non-negative signal is clipped to
    [positive_lower, positive_upper] (a+, b+), that of a negative one to [negative_lower, negative_upper] (a-, b-)."""

    positive_lower: float
    positive_upper: float
    negative_lower: float
    negative_upper: float

    def __post_init__(self) -> None:
        for branch in ("positive", "negative"):
            lower, upper = getattr(self, f"{branch}_lower"), getattr(self, f"{branch}_upper")
            if not (lower >= 0 and upper >= 0) or math.isnan(lower) or math.isnan(upper):
                raise ValueError(f"{branch} truncation limits must be >= 0, got [{lower}, {upper}]")
            if lower > upper:
                raise ValueError(f"{branch} truncation limits must satisfy lower <= upper, got [{lower}, {upper}]")


# Table 1 of the paper: each classical method is TOPR with particular limits (a+, b+, a-, b-).
PRESETS: dict[str, TruncationLimits] = {
    "sft": TruncationLimits(1.0, 1.0, 0.0, 0.0),
    "naive_reinforce": TruncationLimits(1.0, 1.0, 1.0, 1.0),
    "off_policy_reinforce": TruncationLimits(0.0, math.inf, 0.0, math.inf),
    "tis": TruncationLimits(0.0, 1.0, 0.0, 1.0),
    "topr": TruncationLimits(1.0, 1.0, 0.0, 1.0),
}


def log_importance_ratio(
    per_token_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    mask: torch.Tensor,
    level: RatioLevel = "sequence",
) -> torch.Tensor:
    """log pi/mu at the requested level; differentiable with respect to `per_token_logps`.

    - "sequence": log pi(tau)/mu(tau) = sum_t log pi(y_t)/mu(y_t), the paper's trajectory ratio; shape (B, 1).
    - "length_normalized": the mean of the token log-ratios (geometric mean of token ratios, as GSPO and TRL's
      `importance_sampling_level="sequence"`); shape (B, 1).
    - "token": one log-ratio per token (ROLL, Trinity-RFT); shape (B, T).

    Masked tokens and tokens whose behaviour log-prob is unknown (NaN, as vLLM reports some) contribute 0.
    """
    token_log_ratio = per_token_logps - behaviour_logps
    keep = mask.bool() & ~torch.isnan(token_log_ratio)
    token_log_ratio = torch.where(keep, token_log_ratio, torch.zeros_like(token_log_ratio))
    # A -inf behaviour log-prob (a token mu could not have sampled) would make the sum inf - inf = NaN.
    token_log_ratio = token_log_ratio.clamp(-1e6, 1e6)
    if level == "token":
        return token_log_ratio
    sequence_log_ratio = token_log_ratio.sum(dim=-1, keepdim=True)
    if level == "sequence":
        return sequence_log_ratio
    if level == "length_normalized":
        return sequence_log_ratio / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    raise ValueError(f"Unknown ratio level {level!r}; expected one of {RATIO_LEVELS}")


def truncated_ratio(log_ratio: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """[pi/mu] truncated to [lower, upper] (Eq. 7), as exp(clamp(log ratio, log lower, log upper)).

    `lower` may be 0 and `upper` may be inf. The result is detached: the truncated ratio is a weight, not a
    path for gradients.
    """
    if upper == 0:
        return torch.zeros_like(log_ratio, requires_grad=False)
    log_lower = math.log(lower) if lower > 0 else -math.inf
    log_upper = min(math.log(upper) if upper < math.inf else math.inf, MAX_LOG_RATIO)
    return log_ratio.detach().clamp(min=min(log_lower, log_upper), max=log_upper).exp()


def tapered_weights(log_ratio: torch.Tensor, is_positive: torch.Tensor, limits: TruncationLimits) -> torch.Tensor:
    """The tapered importance weight of Eq. 7: [pi/mu] in [a+, b+] where the signal is >= 0, in [a-, b-] where
    it is < 0. `is_positive` is (B, 1) and broadcasts over a token-level `log_ratio`."""
    positive = truncated_ratio(log_ratio, limits.positive_lower, limits.positive_upper)
    negative = truncated_ratio(log_ratio, limits.negative_lower, limits.negative_upper)
    return torch.where(is_positive, positive, negative)


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    aggregation: Aggregation = "seq-mean-token-mean",
    *,
    max_completion_length: int | None = None,
    num_tokens: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    MIRROR of TRL 1.16.0 `GRPOTrainer._compute_loss`'s normalisation by `loss_type` (trl/trainer/grpo_trainer.py):
    each aggregation below is one of its branches, named after it; tests/test_grpo_parity.py holds them to TRL's.

    - "seq-mean-token-mean": each trajectory's loss divided by its length, then averaged over trajectories
      (the paper; TRL's `grpo` normalisation). A fully masked row contributes 0.
    - "token-mean": mean over the local batch's tokens (TRL's `bnpo`, ROLL's and verl's `token-mean`).
    - "global-token-mean": sum divided by `num_tokens`, the token count of the whole accumulation window
      across processes (TRL's `dapo`).
    - "seq-mean-token-sum-norm": sum divided by B * `max_completion_length` (TRL's `dr_grpo`).
    """
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if aggregation == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).mean()
    if aggregation == "token-mean":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if aggregation == "global-token-mean":
        if num_tokens is None:
            raise ValueError("aggregation 'global-token-mean' needs `num_tokens`")
        return masked.sum() / torch.as_tensor(num_tokens, dtype=masked.dtype).clamp(min=1.0)
    if aggregation == "seq-mean-token-sum-norm":
        if max_completion_length is None:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs `max_completion_length`")
        return masked.sum() / (per_token_loss.size(0) * max_completion_length)
    raise ValueError(f"Unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


def ppo_clip_per_token_loss(
    log_ratio: torch.Tensor,
    signal: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate -min(r A, clip(r, 1-eps_low, 1+eps_high) A) (ROLL's `ppo`; GRPO's loss), with
    GRPOConfig's two-sided clipping `delta` (r capped at delta in the unclipped term) when given. `log_ratio` must
    carry the gradient. Returns the per-token loss and the effective (detached) weight."""
    ratio = log_ratio.clamp(max=MAX_LOG_RATIO).exp()
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    per_token_loss = -torch.min(ratio * signal, clipped * signal)
    # The gradient of the surrogate is ratio * A * grad log pi where unclipped, 0 where clipped (or capped by delta).
    unclipped = ratio * signal <= clipped * signal
    weight = ratio * unclipped
    if delta is not None:
        weight = weight * (log_ratio.exp() < delta)
    return per_token_loss, weight.detach()


def cispo_weights(log_ratio: torch.Tensor, epsilon_low: float, epsilon_high: float) -> torch.Tensor:
    """CISPO's stop-gradient ratio clipped to [1 - eps_low, 1 + eps_high] (ROLL's `cispo`)."""
    return truncated_ratio(log_ratio, max(1.0 - epsilon_low, 0.0), 1.0 + epsilon_high)


def kimi15_per_token_loss(
    per_token_logps: torch.Tensor, log_ratio: torch.Tensor, signal: torch.Tensor, tau: float
) -> torch.Tensor:
    """Kimi k1.5's REINFORCE with a squared log-ratio penalty, -A log pi + tau/2 (log pi/mu)^2 (ROLL's `kimi15`).
    `log_ratio` must carry the gradient."""
    return -signal * per_token_logps + 0.5 * tau * log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).pow(2)


@dataclass(frozen=True)
class PolicyLossSpec:
    """Everything that defines a policy loss of the family, resolved from `TOPRConfig`: `loss_type` names an entry of
    `POLICY_LOSSES`, `limits` are Eq. 7's (a+, b+, a-, b-) for the tapered entries (None for the others), the branch
    weights and PPO's clip apply across the family, and `knobs` holds the config fields the chosen loss registered
    with `reads=` (by field name), which the loss reads with `spec.knob(name)`: a loss with a knob of its own needs
    no field here."""

    loss_type: str = "topr"
    limits: TruncationLimits | None = PRESETS["topr"]
    ratio_level: RatioLevel = "sequence"
    positive_weight: float = 1.0
    negative_weight: float = 1.0
    ppo_epsilon_low: float = 0.2
    ppo_epsilon_high: float = 0.2
    ppo_delta: float | None = None
    knobs: Mapping[str, float] = field(default_factory=dict)

    def knob(self, name: str) -> float:
        """The value of config field `name`, which this spec's loss registered with `reads=`."""
        if name not in self.knobs:
            raise ValueError(
                f"the policy loss {self.loss_type!r} reads `{name}`: give it in "
                f"PolicyLossSpec(knobs={{{name!r}: ...}}) (a config's `policy_loss_spec` fills in every "
                "field the loss registered with reads=)."
            )
        return self.knobs[name]


@dataclass
class PolicyTerms:
    """A per-token policy loss and the quantities its metrics are made of.

    `per_token_loss` is (B, T) and carries the gradient; the rest is detached. `weights` (the multiplier of
    s * grad log pi) and `log_ratio` are (B, 1) for sequence-level ratios and (B, T) for token-level ones.
    `is_positive` is (B, 1): the branch each trajectory took (signal >= 0).
    """

    per_token_loss: torch.Tensor
    weights: torch.Tensor
    log_ratio: torch.Tensor
    is_positive: torch.Tensor


# ---------------------------------------------------------------------------------------------------------
# The registry: the one table of the losses `TOPRTrainer` computes itself, selected by `TOPRConfig.loss_type`. Each
# entry is a pure function (log pi, log pi/mu, s, s >= 0, spec) -> (per-token loss, weight), registered with its
# truncation limits (Eq. 7's entries) and the TOPRConfig fields of its own knobs. `log_ratio` carries the gradient;
# the weight is the detached multiplier of s * grad log pi, from which the trainer's ratio and truncation metrics are
# made. TRL's loss types are not in it: GRPOTrainer computes those.
# ---------------------------------------------------------------------------------------------------------

# The loss types GRPOTrainer computes itself (TRL 1.16); `TOPRConfig.loss_type` also takes these.
TRL_LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
# The TOPRConfig fields that override an Eq. 7 entry's limits.
LIMIT_FIELDS: tuple[str, ...] = (
    "topr_positive_lower",
    "topr_positive_upper",
    "topr_negative_lower",
    "topr_negative_upper",
)
PolicyLossFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]


KnobCheck = Callable[[str, object], None]


def finite_non_negative(name: str, value: object) -> None:
    """The check of a knob that is a scale or a width: a finite number >= 0 (raises a ValueError naming it)."""
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")


@dataclass(frozen=True)
class RegisteredPolicyLoss:
    """An entry of `POLICY_LOSSES`: the function, Eq. 7's limits (None when it is not a tapered loss), the config
    fields only it reads (its knobs: passed to it in `PolicyLossSpec.knobs`; setting one with another loss type
    fails at construction) and the check each knob's value must pass when the loss is chosen."""

    function: PolicyLossFunction
    limits: TruncationLimits | None = None
    reads: tuple[str, ...] = ()
    check: KnobCheck = finite_non_negative

    @property
    def knobs(self) -> tuple[str, ...]:
        """The fields it reads beyond Eq. 7's limits (which reach it resolved, as `spec.limits`)."""
        return tuple(name for name in self.reads if name not in LIMIT_FIELDS)


POLICY_LOSSES: dict[str, RegisteredPolicyLoss] = {}


def register_policy_loss(
    name: str,
    *,
    limits: TruncationLimits | None = None,
    reads: tuple[str, ...] = (),
    check: KnobCheck = finite_non_negative,
):
    """Decorator adding a per-token policy loss to `POLICY_LOSSES` under `name`, which `TOPRConfig(loss_type=name)`
    then selects. `reads` names the config fields of its own knobs: a config built with this loss type checks each
    with `check(name, value)` and hands them to the function as `spec.knob(name)`; a config class without such a
    field (declare it in a `TOPRConfig` subclass) fails at construction. A name of TRL's (`TRL_LOSS_TYPES`) or one
    already registered is refused."""

    def register(function: PolicyLossFunction) -> PolicyLossFunction:
        if name in TRL_LOSS_TYPES:
            raise ValueError(
                f"{name!r} is one of TRL's loss types, computed by GRPOTrainer: register under another name."
            )
        if name in POLICY_LOSSES:
            raise ValueError(f"a policy loss named {name!r} is already registered.")
        POLICY_LOSSES[name] = RegisteredPolicyLoss(function, limits, tuple(reads), check)
        return function

    return register


@register_policy_loss("topr", limits=PRESETS["topr"], reads=LIMIT_FIELDS)
@register_policy_loss("sft", limits=PRESETS["sft"], reads=LIMIT_FIELDS)
@register_policy_loss("naive_reinforce", limits=PRESETS["naive_reinforce"], reads=LIMIT_FIELDS)
@register_policy_loss("off_policy_reinforce", limits=PRESETS["off_policy_reinforce"], reads=LIMIT_FIELDS)
@register_policy_loss("tis", limits=PRESETS["tis"], reads=LIMIT_FIELDS)
def tapered_loss(per_token_logps, log_ratio, signal, is_positive, spec: PolicyLossSpec):
    """Eq. 7: -w(tau) s(tau) log pi(y_t), w = pi/mu truncated to [a+, b+] when s >= 0, to [a-, b-] when s < 0
    (`spec.limits`: TOPR and Table 1's rows; ROLL's `vanilla` is `naive_reinforce`, its `tis` is `tis`)."""
    assert spec.limits is not None  # registered with limits: a config's spec holds them resolved (`resolve_limits`)
    weights = tapered_weights(log_ratio, is_positive, spec.limits)
    return -(weights * signal) * per_token_logps, weights


@register_policy_loss("ppo")
def ppo_loss(per_token_logps, log_ratio, signal, is_positive, spec: PolicyLossSpec):
    """PPO's clipped surrogate (GRPO's policy term), with GRPOConfig's `epsilon`, `epsilon_high` and `delta`."""
    return ppo_clip_per_token_loss(log_ratio, signal, spec.ppo_epsilon_low, spec.ppo_epsilon_high, spec.ppo_delta)


@register_policy_loss("cispo_two_sided", reads=("cispo_epsilon_low", "cispo_epsilon_high"))
def cispo_loss(per_token_logps, log_ratio, signal, is_positive, spec: PolicyLossSpec):
    """ROLL's CISPO: REINFORCE weighted by the stop-gradient ratio clipped to [1 - eps_low, 1 + eps_high]. (TRL's
    `loss_type="cispo"` clips from above only, at `epsilon_high`, and aggregates like `dapo`.)"""
    weights = cispo_weights(log_ratio, spec.knob("cispo_epsilon_low"), spec.knob("cispo_epsilon_high"))
    return -(weights * signal) * per_token_logps, weights


@register_policy_loss("kimi15", reads=("kimi15_tau",))
def kimi15_loss(per_token_logps, log_ratio, signal, is_positive, spec: PolicyLossSpec):
    """Kimi k1.5's REINFORCE with a squared log-ratio penalty (weight 1: the penalty, not a ratio, keeps it near mu)."""
    tau = spec.knob("kimi15_tau")
    return kimi15_per_token_loss(per_token_logps, log_ratio, signal, tau), torch.ones_like(log_ratio)


def policy_per_token_loss(
    per_token_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    signal: torch.Tensor,
    mask: torch.Tensor,
    spec: PolicyLossSpec = PolicyLossSpec(),
) -> PolicyTerms:
    """The per-token loss of `spec.loss_type` (looked up in `POLICY_LOSSES`). For "topr" its gradient is Eq. 7:

        -w(tau) * lambda(tau) * s(tau) * grad log pi(y_t),
        w(tau) = [pi(tau)/mu(tau)] truncated to [a+, b+] if s(tau) >= 0, to [a-, b-] if s(tau) < 0  (stop-grad)

    where s is `signal` (R(tau) - c in the paper, or a group advantage) and lambda the branch weight
    (ROLL's `topr_{positive,negative}_weight`; 1 in the paper). Aggregated with "seq-mean-token-mean" and the
    canonical limits, it is the TOPR objective of Eq. 8 divided by trajectory length. `signal` is (B,) or (B, 1).
    """
    entry = POLICY_LOSSES.get(spec.loss_type)
    if entry is None:
        raise ValueError(f"Unknown policy loss {spec.loss_type!r}; expected one of {list(POLICY_LOSSES)}")
    signal = signal.reshape(-1, 1).to(per_token_logps.dtype)
    is_positive = signal >= 0
    log_ratio = log_importance_ratio(per_token_logps, behaviour_logps, mask, spec.ratio_level)
    per_token_loss, weights = entry.function(per_token_logps, log_ratio, signal, is_positive, spec)
    branch_weight = torch.where(
        is_positive, torch.full_like(signal, spec.positive_weight), torch.full_like(signal, spec.negative_weight)
    )
    return PolicyTerms(
        per_token_loss * branch_weight, (weights * branch_weight).detach(), log_ratio.detach(), is_positive
    )


def topr_loss(
    per_token_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    signal: torch.Tensor,
    mask: torch.Tensor,
    spec: PolicyLossSpec = PolicyLossSpec(),
    aggregation: Aggregation = "seq-mean-token-mean",
    **aggregate_kwargs,
) -> tuple[torch.Tensor, PolicyTerms]:
    """The scalar loss of `policy_per_token_loss` under `aggregation`, with its terms. With the defaults this
    is the paper's TOPR loss: sequence ratios, canonical limits, each trajectory divided by its length."""
    terms = policy_per_token_loss(per_token_logps, behaviour_logps, signal, mask, spec)
    return aggregate(terms.per_token_loss, mask, aggregation, **aggregate_kwargs), terms


def unpack_segments(
    token_values: torch.Tensor, segment_id: torch.Tensor, num_segments: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed completions as a padded batch: `token_values` (N,) are the tokens of several completions laid out flat
    (as TRL's asynchronous trainer packs them), `segment_id` (N,) the completion each token belongs to (0..S-1), in
    order within each completion. Returns the (S, L) values, L the longest completion, and the (S, L) mask of real
    tokens. Differentiable with respect to `token_values`; a segment id with no token gives an all-masked row."""
    segment_id = segment_id.long()
    if num_segments is None:
        num_segments = int(segment_id.max()) + 1 if segment_id.numel() else 0
    lengths = torch.bincount(segment_id, minlength=num_segments)
    width = int(lengths.max()) if lengths.numel() else 0
    order = torch.argsort(segment_id, stable=True)
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.empty_like(segment_id)
    position[order] = torch.arange(segment_id.numel(), device=segment_id.device) - starts[segment_id[order]]
    padded = token_values.new_zeros(num_segments, width).index_put((segment_id, position), token_values)
    mask = torch.zeros(num_segments, width, dtype=torch.bool, device=token_values.device)
    mask[segment_id, position] = True
    return padded, mask


def packed_topr_loss(
    per_token_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    token_signal: torch.Tensor,
    segment_id: torch.Tensor,
    spec: PolicyLossSpec = PolicyLossSpec(),
    aggregation: Aggregation = "seq-mean-token-mean",
    **aggregate_kwargs,
) -> tuple[torch.Tensor, PolicyTerms, torch.Tensor]:
    """`topr_loss` on packed completions (`unpack_segments`): the sequence ratio of Eq. 7 is each completion's sum of
    token log-ratios, whatever row or position its tokens were packed at. `token_signal` (N,) repeats each
    completion's signal on its tokens (TRL's packed `advantages`). Returns the loss, its terms and the (S, L) mask,
    the terms being those of the padded batch (one row per completion)."""
    logps, mask = unpack_segments(per_token_logps, segment_id)
    behaviour, _ = unpack_segments(behaviour_logps.to(per_token_logps.dtype), segment_id)
    signal, _ = unpack_segments(token_signal.to(per_token_logps.dtype), segment_id)
    # the signal of a completion is the one its tokens carry; read at its first token
    first = signal[:, :1]
    loss, terms = topr_loss(logps, behaviour, first, mask, spec, aggregation, **aggregate_kwargs)
    return loss, terms, mask


def branch_losses(
    per_token_loss: torch.Tensor, is_positive: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The aggregated loss restricted to the positive and to the negative branch; for every aggregation the
    two add up to the whole loss.

    Sign convention: these are parts of the loss that is minimised, not of the objective J. For the losses of the
    form -w * lambda * s * log pi(y_t) (Eq. 7's entries and cispo_two_sided; w, lambda >= 0, log pi <= 0) the
    positive branch (s >= 0) is >= 0 and the negative branch (s < 0) is <= 0: a falling positive loss means positives'
    log-probabilities rise, a falling (more negative) negative loss means negatives' log-probabilities fall.
    PPO's surrogate -min(r A, clip(r) A) has the opposite signs; kimi15 adds its non-negative penalty to both."""
    per_token_loss = per_token_loss.detach()
    zero = torch.zeros_like(per_token_loss)
    positive = aggregate(torch.where(is_positive, per_token_loss, zero), mask, aggregation, **kwargs)
    negative = aggregate(torch.where(is_positive, zero, per_token_loss), mask, aggregation, **kwargs)
    return positive, negative


def reads_the_ratio(signal: torch.Tensor, spec: PolicyLossSpec) -> torch.Tensor:
    """(B,) whether each trajectory's weight depends on pi/mu: not where Eq. 7's limits of its branch (a+ = b+ for
    signal >= 0, a- = b- below) pin the weight to one value, as canonical TOPR's [1, 1] does for positives (an SFT
    step) and SFT's [0, 0] for negatives; always for a loss outside Eq. 7 (PPO, CISPO, Kimi-1.5)."""
    is_positive = signal.reshape(-1) >= 0
    limits = spec.limits
    if limits is None:
        return torch.ones_like(is_positive)
    positive_reads = limits.positive_lower != limits.positive_upper
    negative_reads = limits.negative_lower != limits.negative_upper
    return (is_positive & positive_reads) | (~is_positive & negative_reads)


def reward_signal(rewards: torch.Tensor, baseline: float | str, num_generations: int) -> torch.Tensor:
    """The paper's signal s(tau) = R(tau) - c for a generation batch of rewards (B,), grouped by prompt in runs of
    `num_generations`. `baseline` is c: a number, "group_mean" (the mean reward of the prompt's completions) or
    "batch_mean". A NaN reward (a completion no reward function could score) is left out of the means and gets
    signal 0, so it does not move the policy."""
    if baseline == "group_mean":
        grouped = rewards.view(-1, num_generations)
        values = torch.nanmean(grouped, dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    elif baseline == "batch_mean":
        values = torch.nanmean(rewards)
    else:
        values = torch.as_tensor(float(baseline), dtype=rewards.dtype, device=rewards.device)
    return torch.nan_to_num(rewards - values, nan=0.0)


def effective_positive_proportion(p: float | torch.Tensor, c: float | torch.Tensor) -> float | torch.Tensor:
    """Eq. 12: with rewards +1/-1, a proportion p of positives and baseline c, the share of the update that
    comes from positives is p~ = p(1 - c) / (1 + (1 - 2p) c)."""
    return p * (1 - c) / (1 + (1 - 2 * p) * c)


def baseline_for_effective_proportion(p: float, target: float) -> float:
    """The baseline c in (-1, 1) that makes Eq. 12's p~ equal `target`, for +1/-1 rewards and 0 < p < 1."""
    if not (0 < p < 1 and 0 < target < 1):
        raise ValueError(f"need 0 < p < 1 and 0 < target < 1, got p={p}, target={target}")
    return (p - target) / (p + target * (1 - 2 * p))


def signal_share_of_positives(signal: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The measured effective positive proportion: the share of sum |w * s| carried by trajectories with
    s >= 0. With +1/-1 rewards, a constant baseline and unit weights it equals Eq. 12. NaN on an all-zero batch."""
    magnitude = signal.abs() if weights is None else (weights * signal).abs()
    total = magnitude.sum()
    return torch.where(total > 0, magnitude[signal >= 0].sum() / total, torch.full_like(total, float("nan")))


def baseline_for_target_share(rewards: torch.Tensor, target: float, iterations: int = 60) -> float:
    """The baseline c for which trajectories with R - c >= 0 carry a share `target` of sum |R - c|: the
    effective positive proportion p~ of Eq. 12, generalised to any rewards (for +1/-1 rewards it equals
    `baseline_for_effective_proportion`). The share decreases as c grows, so c is found by bisection between
    the smallest and largest reward. NaN rewards are ignored; with fewer than two distinct rewards p~ cannot be
    moved and 0 is returned."""
    if not 0 < target < 1:
        raise ValueError(f"target must be in (0, 1), got {target}")
    rewards = rewards[~torch.isnan(rewards)].double()
    if rewards.numel() == 0 or rewards.min() == rewards.max():
        return 0.0
    low, high = rewards.min().item(), rewards.max().item()
    for _ in range(iterations):
        middle = (low + high) / 2
        if signal_share_of_positives(rewards - middle).item() > target:
            low = middle
        else:
            high = middle
    return (low + high) / 2
