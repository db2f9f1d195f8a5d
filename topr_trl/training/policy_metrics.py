"""TOPR's training metrics as pure tensor functions: what each process sums, what it contributes to the minima and
maxima, and the logged values made from the reduced numbers. `TOPRTrainer` runs the two collectives in between.

Branches are by the sign of the signal; trajectories with zero signal (e.g. groups whose completions all got the same
reward, under the advantage signal) move nothing and are counted apart. Ratio statistics are per trajectory for
sequence-level ratios, per completion token for token-level ones.
"""

from __future__ import annotations

import torch

from ..loss import MAX_LOG_RATIO, PolicyTerms


def _ratio_and_branches(terms: PolicyTerms, signal: torch.Tensor, mask: torch.Tensor, read: torch.Tensor | None = None):
    """pi/mu (bounded like the loss's), and the elements of each branch (trajectories, or completion tokens), only
    those of the trajectories `read` (B,) names where given."""
    signal = signal.detach().float().reshape(-1, 1)
    sequence_level = terms.log_ratio.size(1) == 1
    element_mask = torch.ones_like(terms.log_ratio, dtype=torch.float) if sequence_level else mask.float()
    if read is not None:
        element_mask = element_mask * read.reshape(-1, 1).to(element_mask)
    ratio = terms.log_ratio.float().clamp(max=MAX_LOG_RATIO).exp()
    return signal, ratio, element_mask * (signal > 0), element_mask * (signal < 0)


def _truncated(terms: PolicyTerms, ratio: torch.Tensor, negative_weight: float) -> torch.Tensor:
    """Where the weight applied differs from the untruncated lambda- * pi/mu by more than a relative 1e-4 (or four
    roundings of the weights' dtype, if coarser); see `metric_sums`."""
    tolerance = max(1e-4, 4 * torch.finfo(terms.weights.dtype).eps)
    untruncated = ratio * negative_weight
    return (terms.weights.float() - untruncated).abs() > tolerance * untruncated


def metric_sums(
    terms: PolicyTerms,
    signal: torch.Tensor,
    mask: torch.Tensor,
    entropies: torch.Tensor,
    loss: torch.Tensor,
    negative_weight: float,
    read: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """This process's sums, by name: the caller adds them over processes (one collective over the values, in the
    dict's order) and hands the totals to `policy_metrics`.

    A negative counts as truncated when the weight applied to it differs from its untruncated weight,
    lambda- * pi/mu, by more than a relative 1e-4 (or four roundings of the weights' dtype, if coarser): a ratio of
    1 + 1e-6 (mu = pi, log-probs recomputed in another batch layout) is not truncated by b- = 1. For Eq. 7's losses
    this is "pi/mu lies outside [a-, b-] by more than the tolerance"; it also covers CISPO's and PPO's clipping (PPO's
    weight drops to 0 where it clips). The ratio's statistics cover the trajectories `read` (B,) names (all: None);
    the weights' cover every trajectory."""
    signal, ratio, in_positive, in_negative = _ratio_and_branches(terms, signal, mask)
    read_elements = 1.0 if read is None else read.reshape(-1, 1).to(in_positive)  # the ratio's statistics only
    ratio_in_positive, ratio_in_negative = in_positive * read_elements, in_negative * read_elements
    mask = mask.float()
    weights = terms.weights.float()
    outside = _truncated(terms, ratio, negative_weight)
    if terms.log_ratio.size(1) == 1:
        mean_weight = weights
    else:
        mean_weight = (weights * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    magnitude = (mean_weight * signal).abs()  # |w s|: each trajectory's share of the update (p~ of Eq. 12)
    sums = {
        "n_positive": (signal > 0).sum(),
        "n_negative": (signal < 0).sum(),
        "n_zero": (signal == 0).sum(),
        "ratio_sum_positive": (ratio * ratio_in_positive).sum(),
        "ratio_sum_negative": (ratio * ratio_in_negative).sum(),
        "ratio_count_positive": ratio_in_positive.sum(),
        "ratio_count_negative": ratio_in_negative.sum(),
        "ratio_sq_sum_positive": (ratio.square() * ratio_in_positive).sum(),
        "ratio_sq_sum_negative": (ratio.square() * ratio_in_negative).sum(),
        "weight_sum_positive": (weights * in_positive).sum(),
        "weight_sum_negative": (weights * in_negative).sum(),
        "count_positive": in_positive.sum(),
        "count_negative": in_negative.sum(),
        "truncated_negative": (outside * ratio_in_negative).sum(),
        "mass_positive": (magnitude * (signal >= 0)).sum(),
        "mass_total": magnitude.sum(),
        "nonfinite_loss": (~torch.isfinite(loss.detach())).sum(),
        "entropy_sum": (entropies.detach() * mask).sum(),
        "token_count": mask.sum(),
    }
    return {name: value.float() for name, value in sums.items()}


def ratio_minima(
    terms: PolicyTerms, signal: torch.Tensor, mask: torch.Tensor, read: torch.Tensor | None = None
) -> torch.Tensor:
    """(min positive ratio, min negative ratio, -max positive ratio, -max negative ratio) on this process, inf for an
    empty branch (also when this process has no trajectory at all): the caller takes the minimum over processes."""
    _, ratio, in_positive, in_negative = _ratio_and_branches(terms, signal, mask, read)
    inf = torch.tensor([float("inf")], device=ratio.device)

    def least(values: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.where(members.bool(), values, inf).flatten(), inf]).amin()

    return torch.stack(
        [least(ratio, in_positive), least(ratio, in_negative), least(-ratio, in_positive), least(-ratio, in_negative)]
    )


RATIO_QUANTILES = (0.1, 0.5, 0.9)
"""The quantiles of pi/mu logged per branch (`topr/ratio_<branch>/p10`, `/p50`, `/p90`)."""


def branch_ratios(
    terms: PolicyTerms, signal: torch.Tensor, mask: torch.Tensor, read: torch.Tensor | None = None
) -> torch.Tensor:
    """(2, N): every element's pi/mu (trajectories, or completion tokens), on the positive row where it is a positive
    and on the negative row where it is a negative, NaN elsewhere: what the caller pads and gathers over processes
    for `ratio_quantiles`."""
    _, ratio, in_positive, in_negative = _ratio_and_branches(terms, signal, mask, read)
    nan = torch.tensor(float("nan"), device=ratio.device)
    return torch.stack(
        [torch.where(in_positive.bool(), ratio, nan).flatten(), torch.where(in_negative.bool(), ratio, nan).flatten()]
    )


def ratio_quantiles(ratios: torch.Tensor) -> dict[str, float]:
    """The `RATIO_QUANTILES` of each branch's pi/mu from the gathered (2, N) `branch_ratios` (NaN for an empty
    branch, also when no process had a trajectory: N = 0)."""
    levels = torch.tensor(RATIO_QUANTILES, dtype=torch.float32, device=ratios.device)
    ratios = torch.cat([ratios.float(), ratios.new_full((2, 1), float("nan"), dtype=torch.float32)], dim=1)
    values = torch.nanquantile(ratios, levels, dim=1).T.tolist()  # (branch, quantile); NaN where empty
    return {
        f"topr/ratio_{branch}/p{round(q * 100)}": value
        for branch, row in zip(("positive", "negative"), values, strict=True)
        for q, value in zip(RATIO_QUANTILES, row, strict=True)
    }


def effective_sample_size_fraction(ratio_sum: float, ratio_sq_sum: float, count: float) -> float:
    """Kish's effective sample size of importance weights over their number, (sum r)^2 / (n sum r^2): 1 when every
    pi/mu is equal (on-policy data), 1/n when one ratio dominates; NaN for none."""
    if count <= 0 or ratio_sq_sum <= 0:
        return float("nan")
    return ratio_sum**2 / (count * ratio_sq_sum)


def _share(sums: dict[str, float], numerator: str, denominator: str) -> float:
    """sums[numerator] / sums[denominator], NaN for an empty denominator."""
    return sums[numerator] / sums[denominator] if sums[denominator] > 0 else float("nan")


def policy_metrics(
    totals: dict[str, float], minima: list[float], branch_losses: list[float], reward_signal: bool
) -> dict[str, float]:
    """The logged metrics from the totals of `metric_sums` over processes, the minima of `ratio_minima` over processes
    and the mean (positive, negative) branch losses. NaN where a branch is empty."""
    minima = [value if abs(value) != float("inf") else float("nan") for value in minima]

    def share(numerator: str, denominator: str) -> float:
        return _share(totals, numerator, denominator)

    n_all = max(totals["n_positive"] + totals["n_negative"] + totals["n_zero"], 1.0)
    metrics = {
        "topr/positive_fraction": totals["n_positive"] / n_all,
        "topr/negative_fraction": totals["n_negative"] / n_all,
    }
    if reward_signal:
        # Under the advantage signal group advantages sum to 0, so p~ would read 0.5 (up to the weights) whatever the
        # user does; it is a choice, through the baseline c, only for R - c.
        metrics["topr/effective_positive_proportion"] = share("mass_positive", "mass_total")
    metrics.update(
        {
            "topr/ratio_positive/mean": share("ratio_sum_positive", "ratio_count_positive"),
            "topr/ratio_positive/min": minima[0],
            "topr/ratio_positive/max": -minima[2],
            "topr/ratio_negative/mean": share("ratio_sum_negative", "ratio_count_negative"),
            "topr/ratio_negative/min": minima[1],
            "topr/ratio_negative/max": -minima[3],
            "topr/ratio_ess_fraction": effective_sample_size_fraction(
                totals["ratio_sum_positive"] + totals["ratio_sum_negative"],
                totals["ratio_sq_sum_positive"] + totals["ratio_sq_sum_negative"],
                totals["ratio_count_positive"] + totals["ratio_count_negative"],
            ),
            "topr/ratio_negative/ess_fraction": effective_sample_size_fraction(
                totals["ratio_sum_negative"], totals["ratio_sq_sum_negative"], totals["ratio_count_negative"]
            ),
            "topr/weight_positive/mean": share("weight_sum_positive", "count_positive"),
            "topr/weight_negative/mean": share("weight_sum_negative", "count_negative"),
            "topr/negative_truncated_fraction": share("truncated_negative", "ratio_count_negative"),
            "topr/loss_positive": branch_losses[0],
            "topr/loss_negative": branch_losses[1],
            "entropy": share("entropy_sum", "token_count"),
        }
    )
    return metrics


def drift_and_mismatch_sums(
    per_token_logps: torch.Tensor, policy_at_generation: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """This process's (sum |drift|, sum |mismatch|, trajectories) for the two parts of each trajectory's
    log pi/mu = [log pi - log pi_gen] + [log pi_gen - log mu]: how far the policy moved since generation (drift), and
    how far the generator's own log-probs are from the policy's at generation time (engine mismatch: another dtype,
    kernels, or weights the engine was not synced to). Summed over the completion's tokens; the caller adds over
    processes and `drift_and_mismatch` divides."""
    mask = mask.float()
    drift = ((per_token_logps.detach().float() - policy_at_generation.float()) * mask).sum(1)
    mismatch = ((policy_at_generation.float() - sampler_logps.float()) * mask).sum(1)
    return torch.stack([drift.abs().sum(), mismatch.abs().sum(), torch.tensor(float(mask.size(0)), device=mask.device)])


def drift_and_mismatch(totals: list[float]) -> dict[str, float]:
    """The logged means of `drift_and_mismatch_sums` totals: mean |sequence log-ratio| of each part."""
    drift, mismatch, count = totals
    count = max(count, 1.0)
    return {"topr/log_ratio_drift/mean_abs": drift / count, "topr/log_ratio_mismatch/mean_abs": mismatch / count}


STALENESS_BIN_SUMS = (
    "count_positive",
    "ratio_sum_positive",
    "count_negative",
    "ratio_sum_negative",
    "ratio_sq_sum",
    "truncated_negative",
)
"""The columns of `staleness_bin_sums`, one row per staleness bin."""


def staleness_bin_sums(
    terms: PolicyTerms,
    signal: torch.Tensor,
    mask: torch.Tensor,
    trajectory_bins: torch.Tensor,
    num_bins: int,
    negative_weight: float,
    read: torch.Tensor | None = None,
) -> torch.Tensor:
    """This process's (num_bins, len(STALENESS_BIN_SUMS)) sums of each trajectory's pi/mu by the staleness bin of
    the sample it came from (`trajectory_bins`, (S,), -1 where unknown: left out): how far the policy moved from mu
    at each lag, per branch. The caller adds them over processes and `staleness_bin_metrics` divides. Elements are
    trajectories for sequence-level ratios, completion tokens for token-level ones (each in its trajectory's bin),
    of the trajectories `read` (B,) names where given."""
    _, ratio, in_positive, in_negative = _ratio_and_branches(terms, signal, mask, read)
    bins = trajectory_bins.to(ratio.device).long().reshape(-1, 1).expand_as(ratio)
    known = bins >= 0
    in_either = in_positive + in_negative
    columns = torch.stack(
        [
            in_positive,
            ratio * in_positive,
            in_negative,
            ratio * in_negative,
            ratio.square() * in_either,
            _truncated(terms, ratio, negative_weight).float() * in_negative,
        ],
        dim=-1,
    )
    sums = torch.zeros(num_bins, len(STALENESS_BIN_SUMS), device=ratio.device)
    return sums.index_add_(0, bins[known], columns[known])


def staleness_bin_metrics(totals: torch.Tensor, bin_names: list[str] | tuple[str, ...]) -> dict[str, float]:
    """The logged metrics of the bins that hold a trajectory, from `staleness_bin_sums` added over processes:
    `topr/staleness_<bin>/ratio_positive/mean`, `.../ratio_negative/mean` (NaN for an empty branch),
    `.../ratio_ess_fraction` (Kish, both branches) and `.../negative_truncated_fraction`."""
    metrics = {}
    for name, row in zip(bin_names, totals.tolist(), strict=True):
        sums = dict(zip(STALENESS_BIN_SUMS, row, strict=True))
        count = sums["count_positive"] + sums["count_negative"]
        if count <= 0:
            continue
        prefix = f"topr/staleness_{name}"
        metrics[f"{prefix}/ratio_positive/mean"] = _share(sums, "ratio_sum_positive", "count_positive")
        metrics[f"{prefix}/ratio_negative/mean"] = _share(sums, "ratio_sum_negative", "count_negative")
        metrics[f"{prefix}/ratio_ess_fraction"] = effective_sample_size_fraction(
            sums["ratio_sum_positive"] + sums["ratio_sum_negative"], sums["ratio_sq_sum"], count
        )
        metrics[f"{prefix}/negative_truncated_fraction"] = _share(sums, "truncated_negative", "count_negative")
    return metrics
