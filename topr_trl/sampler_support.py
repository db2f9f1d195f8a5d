"""pi on the support mu sampled from: the sampler's processing (temperature, top-k, top-p, min-p) applied to the
policy's logits, so that pi/mu measures how far the policy moved and nothing else.

mu's log-probs (vLLM's `processed_logprobs`, `topr_trl.sampling`'s, a stored dataset's) are those of the *processed*
sampling distribution: the logits divided by the temperature, the tokens outside top-k / top-p / min-p removed, and
the rest renormalised. TRL scores the policy with the whole vocabulary at the trainer's temperature. Per token the
two differ by the log of the kept mass, and the sequence ratio multiplies it over every token: at top_k 3 on a
high-entropy policy pi/mu was ~1e-20 at learning rate 0, every negative's TOPR weight ~0 (TRL issue #6789 is the same
bias in TRL's own correction).

The processed log-prob of token y is

    log pi_S(y) = z_y - logsumexp_{v in S} z_v,      z = logits / T,

where S is the support the processing keeps, computed from the policy's own logits and always holding the sampled
token (a token mu sampled has mu > 0; after the policy moves, its own truncation may drop it, and pi_S(y) = 0 would
give the weight 0 and no gradient). At learning rate 0 S is mu's support exactly, so pi/mu = 1 up to the engines'
arithmetic. The trainer takes the value log pi_S(y) in place of TRL's log pi_T'(y) (T' the trainer's temperature,
which TRL's fused head uses) and keeps TRL's gradient (`on_mus_support`): TOPR's weight is a stop-gradient, so the
ratio reads pi_S while the gradient stays grad log pi_T'.

The order of the filters is the generator's: transformers applies top-k, top-p, then min-p; vLLM applies min-p first
(`SamplerProcessing.engine`). The top-k and top-p rules are those both engines share: ties at the k-th logit are kept,
and top-p removes the tokens whose ascending cumulative probability is at most 1 - p, keeping at least one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
from accelerate.utils import extract_model_from_parallel
from trl.trainer.utils import maybe_gather_lm_head_ctx


SUPPORT_FILTERS: dict[str, tuple[str, ...]] = {
    "transformers": ("top_k", "top_p", "min_p"),  # GenerationMixin._get_logits_processor's warper order
    "vllm": ("min_p", "top_k", "top_p"),  # vllm.v1.sample.Sampler: min-p as a logits processor, then top-k/top-p
}
"""The order in which each generator applies its truncation filters after the temperature."""


@dataclass(frozen=True)
class SamplerProcessing:
    """How mu turned logits into its sampling distribution (what a stored row's `behaviour_sampling` holds):
    `temperature` divides the logits; `top_k` (0 or None: off) keeps the k largest; `top_p` (1.0 or None: off) the
    smallest nucleus of mass >= p; `min_p` (0 or None: off) the tokens of probability >= min_p times the largest;
    `engine` names the order of the filters (`SUPPORT_FILTERS`)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    engine: str = "transformers"

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"sampling temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"sampling top_k must be >= 0 (0 or None: off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"sampling min_p must be in [0, 1], got {self.min_p}")
        if self.engine not in SUPPORT_FILTERS:
            raise ValueError(f"sampling engine must be one of {sorted(SUPPORT_FILTERS)}, got {self.engine!r}")

    @property
    def truncates(self) -> bool:
        """Whether any filter removes tokens (else the support is the whole vocabulary)."""
        return bool(self.top_k) or (self.top_p is not None and self.top_p < 1) or bool(self.min_p)

    def differs_from(self, trainer_temperature: float) -> bool:
        """Whether pi scored at `trainer_temperature` over the whole vocabulary differs from pi under this
        processing."""
        return self.truncates or not math.isclose(self.temperature, trainer_temperature, rel_tol=1e-6)

    def as_row(self) -> dict:
        return asdict(self)

    @classmethod
    def from_row(cls, row: dict) -> SamplerProcessing:
        return cls(**{name: row.get(name) for name in ("temperature", "top_k", "top_p", "min_p") if
                      row.get(name) is not None}, engine=row.get("engine") or "transformers")


def history_dependent_sampling(repetition_penalty: float) -> str | None:
    """What a run must be told when mu's sampling depended on the tokens already seen, which pi's scoring does not
    replay (None when it did not): a repetition penalty rescales the logits of every token in the prompt or the
    completion so far before temperature and truncation, so pi/mu then carries the penalty's effect on top of how far
    the policy moved."""
    if repetition_penalty == 1.0:
        return None
    return (f"repetition_penalty={repetition_penalty} changes mu's sampling distribution by the tokens already seen, "
            "and pi is not scored with it: pi/mu carries the penalty's effect as well as the policy's movement "
            "(negatives' weights are off by it). Leave repetition_penalty at 1.0 for an exact ratio.")


def _keep_top_k(scaled: torch.Tensor, keep: torch.Tensor, k: int) -> torch.Tensor:
    if k >= scaled.size(-1):
        return keep
    kth = scaled.masked_fill(~keep, -math.inf).topk(k, dim=-1).values[..., -1:]
    return keep & (scaled >= kth)


def _keep_top_p(scaled: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Top-p's support without sorting the vocabulary (`_keep_top_p_in_bins`); the rows the bins leave undecided
    (float rounding at the crossing) are sorted (`_keep_top_p_sorted`)."""
    if p >= 1:
        return keep
    kept, undecided = _keep_top_p_in_bins(scaled, keep, p)
    if bool(undecided.any()):
        rows = undecided.nonzero().squeeze(-1)
        kept[rows] = _keep_top_p_sorted(scaled[rows], keep[rows], p)
    return kept


EXP_FLOOR = -87.0
"""The least exponent `mass_weights` takes: e^-87 = 1.6e-38, float32's smallest normal number. A token more than 87
below its row's largest logit weighs that instead of its subnormal or zero weight, which adds under 1e-32 to a row's
mass of at least 1 (its largest token weighs 1), far below float32's resolution; a CPU's `exp` is up to 20 times slower
where its result is subnormal (a trained model's peaked rows: 19 against 1 ns per logit on the project's AMD EPYC)."""


def mass_weights(scaled: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """exp(`scaled` - `reference`) (a new tensor; `reference` broadcasts, e.g. each row's largest logit (N, 1)), each
    at least e^`EXP_FLOOR`."""
    return torch.sub(scaled, reference).clamp_min_(EXP_FLOOR).exp_()


TOP_P_BINS = 2048
"""How many equal bins of logit value `_keep_top_p_in_bins` splits each row's range into: the tokens of the bin
where the ascending mass crosses 1 - p are the only ones sorted (a few hundred on a flat 152k-token row)."""


TOP_P_ROUNDING = 2.0**-20
"""How close (relative) a token's cumulative mass may come to 1 - p for two summation orders to disagree on whether
it is removed: 8 float32 ulps, against a cumulative sum of float32 probabilities (a few ulps apart in two orders). On
a flat 151,936-token row about one row in twenty comes that close. The candidates (`_prefix_top_p`) take it of the
row's whole mass: their mass above a token is p's side of the cut, normalised by the whole row's logsumexp."""


TOP_P_NEGLIGIBLE = 2.0**-17
"""The most the tokens a top-p cut within `TOP_P_ROUNDING` of 1 - p may keep or remove can weigh, as a share of the
support's mass, for the bins (`_keep_top_p_in_bins`, `nucleus_from_band`) or the candidates (`_prefix_top_p`) to
decide the row by their own sum; past it the row is left to the sort. Such a cut is the float rounding's in every
engine (the sampler's own logits come from other kernels, a KV cache, another batch, bf16 in vLLM, and vLLM's
sampler sums in its own order), so the sort on the trainer's logits is no closer to the sampler's cut than the
bins: what is bounded is how far the two may be apart.
The log of the support's mass then differs from the sort's by at most 2^-17 = 7.6e-6 (8 ulps of a log-probability
between -8 and -16): on a flat 151,936-token row a token at the cut weighs 3e-6 of the support, and the sort of its
whole row (7 ms on a CPU, after projecting it again) is spared; a row whose cut may move a heavier token (ties, a
small vocabulary, a small p) is still sorted."""


def _keep_top_p_in_bins(scaled: torch.Tensor, keep: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-p's support of each (N, V) row among `keep`, the rows it leaves undecided) as `_keep_top_p_sorted` gives
    it, with no sort of the vocabulary: each row's kept tokens fall into `TOP_P_BINS` bins of equal logit width, the
    bins' probability masses add up from the lowest, and the bin where they pass 1 - p is the only one whose tokens
    are sorted. Every token of a lower bin has an ascending cumulative mass <= 1 - p (removed), every token of a
    higher bin one > 1 - p (kept); in the crossing bin, the first tokens in ascending order whose cumulative mass is
    <= 1 - p are removed, ties among them in the order of the sort, as the sorted rule leaves them. The masses are
    summed in another order than the sorted cumulative sum, so a row with a token whose cumulative mass is within
    `TOP_P_ROUNDING` of 1 - p is undecided where the tokens that may fall either way could weigh over
    `TOP_P_NEGLIGIBLE` of the support (`_rounding_decides`), as is one whose crossing bin the rounding leaves whole
    (no kept token, or none found)."""
    n, _ = scaled.shape
    every = bool(keep.all())  # no earlier filter: no masked copies of the rows
    masked = scaled if every else scaled.masked_fill(~keep, -math.inf)
    high = masked.amax(dim=-1, keepdim=True)
    weights = mass_weights(scaled, high)  # probabilities times the row's sum `whole`, 0 outside `keep`
    if not every:
        weights.masked_fill_(~keep, 0.0)
    whole = weights.sum(dim=-1)
    low = (scaled if every else scaled.masked_fill(~keep, math.inf)).amin(dim=-1, keepdim=True)
    # tokens outside `keep` weigh 0 anywhere
    bins, mass, scale = _mass_in_value_bins(scaled, low, high, weights, exact=True)
    limit = (1 - p) * whole  # 1 - p of the row's mass
    crossing = _crossing_bin(mass, torch.zeros_like(whole), limit)
    members = keep & (bins == crossing.bin.unsqueeze(-1))
    row, column = members.nonzero(as_tuple=True)
    values, columns = ascending_by_row(row, scaled[row, column], n, column)  # the crossing bin's tokens
    reference = high.squeeze(-1)
    cut = _ascending_cut(values, crossing.under, limit, reference)
    stays = cut.stays
    rounding = _rounding_decides(crossing, cut, low.squeeze(-1), scale.squeeze(-1), reference, whole, limit)
    undecided = crossing.none_passes | ~stays.any(dim=-1) | rounding
    kept = keep & (bins > crossing.bin.unsqueeze(-1))
    rows = torch.arange(n, device=scaled.device).unsqueeze(-1).expand_as(stays)
    kept[rows[stays], columns[stays]] = True
    return kept, undecided


class _CrossingBin(NamedTuple):
    """Where a row's ascending mass, bin by bin, first passes `limit`: that `bin` (N,), the mass `under` it (N,),
    whether `none_passes` the limit (N,) (the rounding of the sums: the row is undecided), and whether the mass under
    the crossing bin (the cumulative mass of the last token under it) is `near` the limit (N,), within
    `TOP_P_ROUNDING`: a cut the order of the sum decides."""

    bin: torch.Tensor
    under: torch.Tensor
    none_passes: torch.Tensor
    near: torch.Tensor


def _crossing_bin(mass: torch.Tensor, below: torch.Tensor, limit: torch.Tensor) -> _CrossingBin:
    """`_CrossingBin` of (N, B) bins of ascending value holding `mass` each (float64: `_mass_in_value_bins`), above
    tokens of mass `below` (N,); `under` in `below`'s dtype."""
    # the mass under each bin, summed as such: taking a bin's mass off the sum through it would lose the small mass
    # under a heavy bin to the rounding of the sum (an ulp of the whole row's mass: 1e-6 of 1 - p = 0.05 of it)
    lower = below.unsqueeze(-1) + torch.nn.functional.pad(mass[:, :-1], (1, 0)).cumsum(dim=-1)
    passed = lower + mass > limit.unsqueeze(-1)
    crossing = passed.int().argmax(dim=-1)
    under = lower.gather(-1, crossing.unsqueeze(-1)).squeeze(-1)
    near = (under - limit).abs() <= limit * TOP_P_ROUNDING
    return _CrossingBin(crossing, under.to(below.dtype), ~passed[:, -1], near)


def _rounding_decides(crossing: _CrossingBin, cut: _Cut, low: torch.Tensor, scale: torch.Tensor,
                      reference: torch.Tensor, mass: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """(N,) the rows whose top-p cut the order of the sum decides and the sort must make: a token's cumulative mass
    within `TOP_P_ROUNDING` of 1 - p (under the crossing bin, `crossing.near`, or in it, `cut.at_the_cut`) where the
    tokens that may fall either way could weigh over `TOP_P_NEGLIGIBLE` of the support. Those tokens are the ones
    whose cumulative mass lies within the rounding of `limit`: the first of them lies in the crossing bin or under
    it (`scale` bins a unit above each row's `low`), so weighs at most a token at the bin's upper edge, and the rest
    together at most the rounding's width, 2 x `TOP_P_ROUNDING` x `limit`. The support holds at least `mass` -
    `limit` (masses in units of exp(`reference`))."""
    upper_edge = torch.where(scale > 0, low + (crossing.bin + 1) / scale, reference)  # one value: as heavy as any
    ambiguous = mass_weights(upper_edge, reference) + 2 * TOP_P_ROUNDING * limit
    return (crossing.near | cut.at_the_cut) & (ambiguous > TOP_P_NEGLIGIBLE * (mass - limit))


BIN_SUM_ELEMENTS = 2**20
"""How many weights `_mass_in_value_bins` casts to float64 at once for an exact sum (8 MB): a float64 copy of every
row at once would be the largest tensor of the whole-row path."""


def _mass_in_value_bins(scaled: torch.Tensor, low: torch.Tensor, high: torch.Tensor, weights: torch.Tensor,
                        exact: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each token's bin (N, V) int64, each bin's mass (N, `TOP_P_BINS`), bins per unit of logit (N, 1)): the (N, V)
    `scaled` logits in `TOP_P_BINS` bins of equal width between each row's `low` and `high` (N, 1), with the
    tokens' `weights` added up per bin, in float64 where `exact`. A row of one value (or a spread below float32's
    range) is all in bin 0.

    A float32 `scatter_add_` adds a bin's weights one at a time, each addition rounded, and on thousands of near-equal
    weights (a flat row's, bf16 logits' ties) the roundings go one way: 13,107 equal weights summed 1.4e-4 under
    their exact sum, 140 times `TOP_P_ROUNDING`, and the cut removed a token far from 1 - p that the sort keeps
    (tests/test_sampler_support.py). The sort's cumulative sum is exact to float32 (a CPU's `cumsum`
    accumulates float32 in float64; a GPU's scan rounds log2(V) times), so where the cut is made the bins' masses
    are summed in float64."""
    scale = _bins_per_logit(low, high)
    bins = _value_bins(scaled, low, scale).long()
    if not exact:
        return bins, weights.new_zeros(scaled.size(0), TOP_P_BINS).scatter_add_(-1, bins, weights), scale
    mass = weights.new_zeros(scaled.size(0), TOP_P_BINS, dtype=torch.float64)
    rows = max(1, BIN_SUM_ELEMENTS // max(1, scaled.size(-1)))
    for start in range(0, scaled.size(0), rows):
        mass[start:start + rows].scatter_add_(-1, bins[start:start + rows], weights[start:start + rows].double())
    return bins, mass, scale


def _bins_per_logit(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """How many of `TOP_P_BINS` equal bins span a unit of logit between `low` and `high`: 0 where they are one value,
    or their spread is past float32's range or not finite (every token then in bin 0)."""
    scale = torch.where(high - low > 0, TOP_P_BINS / (high - low), 0.0)
    return torch.where(torch.isfinite(scale), scale, 0.0)


def _value_bins(values: torch.Tensor, low: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each of `values`' bin (as float, whole numbers 0 to `TOP_P_BINS` - 1), `scale` bins a unit above `low`."""
    return (values - low).mul_(scale).clamp_(0, TOP_P_BINS - 1)


def padded_by_row(row: torch.Tensor, values: torch.Tensor, n: int, fill: float) -> torch.Tensor:
    """(n, M) the `values` of each of n rows from (row index, value) pairs ordered by row (as `nonzero` gives them),
    in that order, padded with `fill` (M the most any row has)."""
    counts = torch.bincount(row, minlength=n)
    place = torch.arange(row.numel(), device=row.device) - (counts.cumsum(0) - counts)[row]
    padded = values.new_full((n, max(int(counts.max()) if n and row.numel() else 0, 1)), fill)
    padded[row, place] = values
    return padded


def ascending_by_row(row: torch.Tensor, values: torch.Tensor, n: int, labels: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, M) each row's `values` in ascending order, padded with inf, and their `labels` alike (None without), from
    the flat (row index, value, label) triples of N rows, in any order (M the most any row has)."""
    if row.numel() > 1 and not bool((row[1:] >= row[:-1]).all()):
        by_row = row.argsort(stable=True)
        row, values = row[by_row], values[by_row]
        labels = labels[by_row] if labels is not None else None
    padded, order = padded_by_row(row, values, n, math.inf).sort(dim=-1)
    if labels is None:
        return padded, None
    return padded, padded_by_row(row, labels, n, 0).gather(-1, order)


NUCLEUS_BAND_SHARE = 0.004
"""Half the width, in shares of a row's mass, of the band `share_band` brackets around where the row's ascending mass
passes 1 - p: about three standard errors of that share estimated on one 32,768-token vocabulary tile."""


def nucleus_band_applies(processing: SamplerProcessing) -> bool:
    """Whether top-p is the only filter that truncates, so a row's support is the tokens above the value where its
    ascending mass passes 1 - p (`nucleus_from_band`)."""
    return processing.top_p is not None and processing.top_p < 1 and not processing.top_k and not processing.min_p


def share_band(scaled: torch.Tensor, low_share: float | torch.Tensor, high_share: float | torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) (N,): logit values bracketing where the ascending cumulative mass of each (N, W) row of scaled
    logits passes `low_share` and `high_share` of the row's mass (floats, or (N, 1) per row), at the resolution of
    `TOP_P_BINS` value bins (the bins' edges; -inf / inf at the ends, inf where a share is not reached)."""
    high = scaled.amax(dim=-1, keepdim=True)
    low = scaled.amin(dim=-1, keepdim=True)
    _, mass, scale = _mass_in_value_bins(scaled, low, high, mass_weights(scaled, high))
    share = mass.cumsum(dim=-1) / mass.sum(dim=-1, keepdim=True)
    first = (share > low_share).int().argmax(dim=-1, keepdim=True)  # the bin where the low share is passed
    reached = share >= high_share
    last = reached.int().argmax(dim=-1, keepdim=True)
    width = torch.where(scale > 0, 1 / scale, math.inf)
    band_low = torch.where(first > 0, low + first * width, -math.inf)
    band_high = torch.where((last < TOP_P_BINS - 1) & reached.any(dim=-1, keepdim=True), low + (last + 1) * width,
                            math.inf)
    return band_low.squeeze(-1), band_high.squeeze(-1)


def nucleus_from_band(row: torch.Tensor, members: torch.Tensor, below: torch.Tensor, mass: torch.Tensor,
                      reference: torch.Tensor, chosen: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logsumexp of the scaled logits over top-p's support plus the sampled token, the rows this does not
    decide) for N rows of which only a band of values is known: `members` (K,) the scaled logits in the band, of the
    rows `row` (K,), in any order, `below` the mass of each row's tokens under the band and `mass` its whole mass,
    both in units of exp(`reference`), and `chosen` the sampled token's scaled logit. As `_keep_top_p_in_bins` cuts
    a whole row, the members fall into `TOP_P_BINS` bins of equal value between the row's least and largest, their
    masses add up from `below`, and only the bin where they pass 1 - p is sorted: the tokens before the crossing are
    removed as `_keep_top_p_sorted` removes them (ties in order), and the support's mass is the whole less theirs. A
    crossing under the band (`below` past 1 - p), above it (no bin passes it) or within rounding of 1 - p where the
    tokens it may move are not negligible (`_rounding_decides`) leaves the row undecided."""
    n = below.numel()
    limit = (1 - p) * mass
    low = torch.full_like(below, math.inf).scatter_reduce(0, row, members, "amin")
    high = torch.full_like(below, -math.inf).scatter_reduce(0, row, members, "amax")
    scale = _bins_per_logit(low, high)
    # int32 bins and places: the temporaries per member stay at a few times its 4 bytes (up to 2^25 members)
    bins = _value_bins(members, low[row], scale[row]).int()
    binned = members.new_zeros(n * TOP_P_BINS, dtype=torch.float64).index_add_(  # exact, as `_mass_in_value_bins`
        0, row.int() * TOP_P_BINS + bins, mass_weights(members, reference[row]).double())
    crossing = _crossing_bin(binned.view(n, TOP_P_BINS), below, limit)
    in_crossing = (bins == crossing.bin.int()[row]).nonzero().squeeze(-1)
    ascending, _ = ascending_by_row(row[in_crossing].long(), members[in_crossing], n)  # the crossing bin's members
    cut = _ascending_cut(ascending, crossing.under, limit, reference)
    removed_count = (cut.present & ~cut.stays).sum(dim=-1, keepdim=True)
    removed = torch.where(removed_count > 0, cut.cumulative.gather(-1, (removed_count - 1).clamp_min(0)),
                          crossing.under.unsqueeze(-1)).squeeze(-1)
    smallest_kept = ascending.gather(-1, removed_count.clamp_max(ascending.size(-1) - 1)).squeeze(-1)
    rounding = _rounding_decides(crossing, cut, low, scale, reference, mass, limit)
    undecided = (~torch.isfinite(mass) | ~torch.isfinite(below) | (below >= limit * (1 - TOP_P_ROUNDING))
                 | crossing.none_passes | ~cut.stays.any(dim=-1) | rounding)
    return _with_the_sampled_token(reference + (mass - removed).log(), chosen, smallest_kept), undecided


class _Cut(NamedTuple):
    """Top-p's cut among a row's tokens in ascending order: `present` (not padding), `cumulative` their ascending
    cumulative mass, `stays` whether each is kept (its cumulative mass > 1 - p of the row's), and `at_the_cut` (N,)
    whether a token's cumulative mass is within `TOP_P_ROUNDING` of 1 - p."""

    present: torch.Tensor
    cumulative: torch.Tensor
    stays: torch.Tensor
    at_the_cut: torch.Tensor


def _ascending_cut(values: torch.Tensor, below: torch.Tensor, limit: torch.Tensor, reference: torch.Tensor) -> _Cut:
    """`_Cut` of (N, M) scaled logits `values` in ascending order (inf: padding), above tokens of mass `below` (N,),
    against `limit` (N,) = (1 - p) x the row's mass, masses in units of exp(`reference`) (N,). A token within rounding
    of 1 - p (ties at the cut: 12 of 60 equal tokens at p = 0.8) may fall either way in two summation orders, so
    its row is left to the sort, which engines use."""
    present = torch.isfinite(values)
    cumulative = below.unsqueeze(-1) + torch.where(present, (values - reference.unsqueeze(-1)).exp(), 0.0).cumsum(-1)
    stays = present & (cumulative > limit.unsqueeze(-1))
    at_the_cut = (present & ((cumulative - limit.unsqueeze(-1)).abs() <= (limit * TOP_P_ROUNDING).unsqueeze(-1)))
    return _Cut(present, cumulative, stays, at_the_cut.any(dim=-1))


def _with_the_sampled_token(normaliser: torch.Tensor, chosen: torch.Tensor, smallest_kept: torch.Tensor
                            ) -> torch.Tensor:
    """The support's logsumexp `normaliser` with the sampled token's scaled logit `chosen` added where it lies below
    the smallest kept logit; tied with a kept one, it is one of the ties the cut kept (which ones is a sort's
    order), as the sampler kept it."""
    return torch.where(chosen < smallest_kept, torch.logaddexp(normaliser, chosen), normaliser)


def _keep_top_p_sorted(scaled: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Top-p as both engines write it: sort ascending, remove the tokens whose cumulative probability is <= 1 - p,
    keep at least the largest. The reference `_keep_top_p_in_bins` is held to (tests/test_sampler_support.py)."""
    ascending, order = scaled.masked_fill(~keep, -math.inf).sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    removed = cumulative <= 1 - p
    removed[..., -1] = False  # at least one token
    return keep & ~removed.scatter(-1, order, removed)


def _keep_min_p(scaled: torch.Tensor, keep: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0:
        return keep
    probs = scaled.masked_fill(~keep, -math.inf).softmax(dim=-1)
    return keep & (probs >= min_p * probs.amax(dim=-1, keepdim=True))


_FILTERS: dict[str, Callable[[torch.Tensor, torch.Tensor, SamplerProcessing], torch.Tensor]] = {
    "top_k": lambda scaled, keep, s: _keep_top_k(scaled, keep, s.top_k) if s.top_k else keep,
    "top_p": lambda scaled, keep, s: _keep_top_p(scaled, keep, s.top_p) if s.top_p is not None else keep,
    "min_p": lambda scaled, keep, s: _keep_min_p(scaled, keep, s.min_p) if s.min_p else keep,
}


def sampler_support(logits: torch.Tensor, processing: SamplerProcessing) -> torch.Tensor:
    """The tokens the sampler keeps, (..., V) bool, from (..., V) logits: its filters in its engine's order, each on
    the logits the previous ones left."""
    scaled = scaled_logits(logits, processing.temperature)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    for name in SUPPORT_FILTERS[processing.engine]:
        keep = _FILTERS[name](scaled, keep, processing)
    return keep


def processed_log_probs(logits: torch.Tensor, tokens: torch.Tensor, processing: SamplerProcessing,
                        candidates: int | None = None) -> torch.Tensor:
    """log pi_S(y) for each (..., V) row of `logits` and its token y (...): the log-softmax of logits / T over the
    sampler's support, which always holds y. No gradient: the ratio's value only.

    Every filter keeps a prefix of the tokens sorted by logit (top-k: the k largest and their ties; top-p: those
    whose mass above them is < p; min-p: those within log(min_p) of the largest), so the support is decided on the
    largest `candidates` logits (`SUPPORT_CANDIDATES` by default, 0: none; `torch.topk`); a row whose support may
    reach past them (a flat distribution under top-p or min-p, ties past the candidates) takes the whole-vocabulary
    path (`sampler_support`, whose top-p sorts no row either). Both give the same support."""
    candidates = SUPPORT_CANDIDATES if candidates is None else candidates
    if logits.dim() != 2:  # (..., V): the same on the flattened rows
        flat = processed_log_probs(logits.reshape(-1, logits.size(-1)), tokens.reshape(-1), processing, candidates)
        return flat.reshape(tokens.shape)
    with torch.no_grad():
        # The logits stay in their dtype (bf16 under mixed precision) until a few of them are chosen: a float32 copy of
        # every row would be the largest tensor here, and the order and ties of the logits are the same in both.
        temperature = processing.temperature
        chosen = scaled_logits(logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), temperature)
        if not candidates:
            return chosen - _whole_vocabulary_normaliser(logits, tokens, processing)
        total = scaled_logits(logits, temperature).logsumexp(dim=-1) if needs_whole_row_mass(processing) else None
        _, normaliser, undecided = _normaliser_on_candidates(logits, chosen, total, processing, candidates)
        rows = undecided.nonzero().squeeze(-1)
        if rows.numel():
            normaliser[rows] = _whole_vocabulary_normaliser(logits[rows], tokens[rows], processing)
        return chosen - normaliser


def _whole_vocabulary_normaliser(logits: torch.Tensor, tokens: torch.Tensor, processing: SamplerProcessing
                                 ) -> torch.Tensor:
    return with_the_sampled_token(sampler_support(logits, processing), logits, tokens, processing.temperature)


def with_the_sampled_token(keep: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, temperature: float
                           ) -> torch.Tensor:
    """The logsumexp of the scaled (N, V) `logits` over the support `keep` plus each row's sampled token, which the
    support holds already where it ties a kept logit: a cut among ties keeps as many of them as the sampler did, and
    the sampled one was among those (which ones the cut keeps is a sort's order; `normaliser_of_candidates` reads the
    sampled token alike)."""
    scaled = scaled_logits(logits, temperature)
    return _with_the_sampled_token(scaled.masked_fill(~keep, -math.inf).logsumexp(dim=-1),
                                   scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
                                   scaled.masked_fill(~keep, math.inf).amin(dim=-1))


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T in float32 (float32 logits at T = 1 are returned as they are, not copied)."""
    scaled = logits.float()
    return scaled if temperature == 1 else scaled / temperature


SUPPORT_CANDIDATES = 1024
"""How many of the largest logits `processed_log_probs` decides the support on (top-k: k plus a margin for ties)
before the whole vocabulary. One stage: once top-p sorts no row (`_keep_top_p_in_bins`), the whole vocabulary of a
row the 1,024 leave undecided costs less than a `topk` of 16,384 (0.58 s against 0.95 s for 220 Zipf-like rows of
151,936 logits, two CPU threads)."""


class _Prefix(NamedTuple):
    """Where the filters applied so far leave each row's support among its sorted candidates: `kept` (N, C) a prefix,
    `whole` (N,) whether that prefix is the whole support (a filter has truncated within the candidates), and
    `undecided` (N,) rows whose support may reach past the candidates."""

    kept: torch.Tensor
    whole: torch.Tensor
    undecided: torch.Tensor


def _prefix_top_k(prefix: _Prefix, values: torch.Tensor, total: torch.Tensor | None, s: SamplerProcessing) -> _Prefix:
    if not s.top_k or s.top_k >= values.size(-1):  # the candidates are k + 16 unless the vocabulary is smaller
        return prefix
    boundary = values[:, s.top_k - 1:s.top_k]
    ties_past = ~prefix.whole & (values[:, -1] >= boundary[:, 0])  # ties at the k-th logit beyond the candidates
    return _Prefix(prefix.kept & (values >= boundary),  # the k largest and their ties, as both engines keep them
                   torch.ones_like(prefix.whole), prefix.undecided | ties_past)


def _prefix_top_p(prefix: _Prefix, values: torch.Tensor, total: torch.Tensor | None,
                  s: SamplerProcessing) -> _Prefix:
    if s.top_p is None or s.top_p >= 1:
        return prefix
    kept_total = _masked_logsumexp(values, prefix.kept)
    if total is None:  # `needs_whole_row_mass` said no earlier filter leaves the candidates short of the support
        assert bool(prefix.whole.all()), "top-p on candidates short of the support needs the whole row's mass"
        total = kept_total
    total = torch.where(prefix.whole, kept_total, total)
    probs = torch.where(prefix.kept, (values - total.unsqueeze(-1)).exp(), 0.0)
    above = probs.cumsum(dim=-1) - probs
    nucleus = prefix.kept & (above < s.top_p)  # the kept mass above each token is < p
    undecided = prefix.undecided | _runs_past(prefix, nucleus) | _candidate_rounding_decides(prefix, probs, above, s)
    return _Prefix(nucleus, torch.ones_like(prefix.whole), undecided)


def _candidate_rounding_decides(prefix: _Prefix, probs: torch.Tensor, above: torch.Tensor, s: SamplerProcessing
                                ) -> torch.Tensor:
    """(N,) the rows whose top-p cut on the candidates the order of the sum decides and the sort must make, as
    `_rounding_decides` for the bins: a candidate whose mass `above` it is within `TOP_P_ROUNDING` of p (of the whole
    row's mass, 1: the candidates' probabilities are normalised by the whole row's logsumexp, the sort's by its own
    softmax, each a few 2^-24 of 1 off), where the tokens that may fall either way (the first of them any candidate
    in that window, the rest together at most its width) could weigh over `TOP_P_NEGLIGIBLE` of the support (at
    least p)."""
    near = prefix.kept & ((above - s.top_p).abs() <= TOP_P_ROUNDING)
    ambiguous = torch.where(near, probs, 0.0).amax(dim=-1) + 2 * TOP_P_ROUNDING
    return near.any(dim=-1) & (ambiguous > TOP_P_NEGLIGIBLE * s.top_p)


def _prefix_min_p(prefix: _Prefix, values: torch.Tensor, total: torch.Tensor | None, s: SamplerProcessing) -> _Prefix:
    if not s.min_p:
        return prefix
    nucleus = prefix.kept & (values >= values[:, :1] + math.log(s.min_p))  # p >= min_p * the largest p
    return _Prefix(nucleus, torch.ones_like(prefix.whole), prefix.undecided | _runs_past(prefix, nucleus))


def _runs_past(prefix: _Prefix, nucleus: torch.Tensor) -> torch.Tensor:
    """Rows whose new prefix may continue past the candidates: every kept candidate stays, and the support before
    this filter was wider than the candidates."""
    return ~prefix.whole & (nucleus == prefix.kept).all(dim=-1)


_CANDIDATE_FILTERS: dict[str, Callable[[_Prefix, torch.Tensor, torch.Tensor | None, SamplerProcessing], _Prefix]] = {
    "top_k": _prefix_top_k, "top_p": _prefix_top_p, "min_p": _prefix_min_p}
"""`_FILTERS` on the sorted candidates: each filter keeps a prefix."""


def candidate_width(processing: SamplerProcessing, candidates: int, vocabulary: int) -> int:
    """How many of a row's largest logits decide its support (top-k: k plus a margin for ties)."""
    return min(vocabulary, processing.top_k + 16 if processing.top_k else candidates)


def needs_whole_row_mass(processing: SamplerProcessing) -> bool:
    """Whether top-p may run on candidates that are not yet the support (no top-k, nor vLLM's min-p, truncated them
    first): its nucleus is then a share of the whole row's mass, which the candidates alone do not give."""
    if processing.top_p is None or processing.top_p >= 1:
        return False
    before = SUPPORT_FILTERS[processing.engine]
    before = before[:before.index("top_p")]
    return not (("top_k" in before and processing.top_k) or ("min_p" in before and processing.min_p))


def _normaliser_on_candidates(logits: torch.Tensor, chosen: torch.Tensor, total: torch.Tensor | None,
                              processing: SamplerProcessing, candidates: int):
    """(the candidates' scaled values, then `normaliser_of_candidates`) on the largest `candidates` of (N, V)
    `logits` in any dtype."""
    vocabulary = logits.size(-1)
    width = candidate_width(processing, candidates, vocabulary)
    values = scaled_logits(logits.topk(width, dim=-1).values, processing.temperature)  # descending
    return (values, *normaliser_of_candidates(values, chosen, total if width < vocabulary else None,
                                              width == vocabulary, processing))


def normaliser_of_candidates(values: torch.Tensor, chosen: torch.Tensor, total: torch.Tensor | None, whole: bool,
                             processing: SamplerProcessing) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp of the scaled logits over the support plus the sampled token, the rows these candidates do not
    decide), from each row's largest scaled logits `values` (N, W) in descending order, the sampled tokens' scaled
    logits `chosen` (N,), whether the W candidates are the `whole` vocabulary, and the logsumexp of the whole scaled
    row `total` (N,), which top-p reads when `needs_whole_row_mass` (else None)."""
    rows = values.shape[:1]
    prefix = _Prefix(torch.ones_like(values, dtype=torch.bool),
                     torch.full(rows, whole, dtype=torch.bool, device=values.device),
                     torch.zeros(rows, dtype=torch.bool, device=values.device))
    for name in SUPPORT_FILTERS[processing.engine]:
        prefix = _CANDIDATE_FILTERS[name](prefix, values, total, processing)
    undecided = prefix.undecided | ~prefix.whole  # no filter truncated: the support is the whole vocabulary
    smallest_kept = torch.where(prefix.kept, values, math.inf).amin(dim=-1)
    return _with_the_sampled_token(_masked_logsumexp(values, prefix.kept), chosen, smallest_kept), undecided


def _masked_logsumexp(values: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(~kept, -math.inf).logsumexp(dim=-1)


class CapturedBackbone(NamedTuple):
    """What `captured_outputs` saw of the backbone's forward: its last hidden states in call order (detached), and
    the autocast dtype in force there (None without autocast), which is the dtype TRL's fused head projects in."""

    hidden: list[torch.Tensor]
    autocast_dtypes: list[torch.dtype | None]

    def head_dtype(self, cast_lm_head_to_fp32: bool = False) -> torch.dtype:
        """MIRROR of the dtype TRL 1.16's chunked log-prob kernel computes the head's logits in
        (`trl/kernels/chunked_logprob.py`, `compute_dtype`; `add_fused_lm_head` disables autocast and casts to
        float32 under `cast_lm_head_to_fp32`): the autocast dtype where autocast was on, else the hidden states'.
        Scoring pi's support in another dtype than TRL's log-probs would put the two roundings into pi/mu (a bf16
        logit of 10 is rounded by up to 0.03). tests/test_sampler_support.py holds it to TRL's kernel."""
        if cast_lm_head_to_fp32:
            return torch.float32
        return self.autocast_dtypes[0] or self.hidden[0].dtype


@contextmanager
def captured_outputs(module: torch.nn.Module) -> Iterator[CapturedBackbone]:
    """The outputs `module` returns while the block runs, in call order (detached last hidden states), with the
    autocast dtype of each call: how the trainer sees the backbone's hidden states of TRL's fused-head forward
    without running the backbone twice."""
    captured = CapturedBackbone([], [])

    def hook(_module, _inputs, output):
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        captured.hidden.append(hidden.detach())
        device = hidden.device.type
        captured.autocast_dtypes.append(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                                        else None)

    handle = module.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def fused_head_parts(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the backbone whose last hidden state TRL's fused head projects, the causal LM that owns the head) of a policy
    as the trainer holds it (wrapped by DDP or DeepSpeed, PEFT or not): where TRL's `add_fused_lm_head` looks them
    up (`base_model`, `get_output_embeddings()`). accelerate unwraps DDP, FSDP and DeepSpeed: a DeepSpeedEngine
    forwards unknown attributes to its module, `get_output_embeddings` among them, but its own `config` is
    DeepSpeed's dict."""
    model = extract_model_from_parallel(model)
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    return model.base_model, model


def head_transform(owner: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """MIRROR of what TRL 1.16's `add_fused_lm_head` (trl/trainer/utils.py) does to the head's product before dividing
    by the temperature: in float32 the model's logit scale (`logit_scale`, `output_multiplier`, `lm_head_multiplier`,
    `logits_scaling`), then final soft-capping; the product as it is where neither applies. Elementwise and
    increasing, so the largest logits of a row are the largest products."""
    config = owner.config.get_text_config()
    scale = getattr(config, "logit_scale", None)
    if scale is None:
        scale = getattr(config, "output_multiplier", None)
    if scale is None:
        scale = getattr(config, "lm_head_multiplier", None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scale = config.logits_scaling if config.model_type == "hyperclovax" else 1 / config.logits_scaling
    softcap = getattr(config, "final_logit_softcapping", None)

    def transform(product: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            product = product.float() * scale
        if softcap is not None:
            product = torch.tanh(product.float() / softcap) * softcap
        return product

    return transform


@contextmanager
def head_projection(owner: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[Callable]:
    """MIRROR of the logits TRL 1.16's `add_fused_lm_head` (trl/trainer/utils.py) scores before dividing by the
    temperature, as a function of (N, H) hidden states: the output embedding (and bias) in `dtype` (the head's own by
    default; `CapturedBackbone.head_dtype` for TRL's), the product rounded to it as TRL's tiles are, then
    `head_transform`. The logits stay in `dtype` where no scale or soft-cap applies (`processed_log_probs` reads any
    dtype). The weight is cast once for every call of the block. tests/test_sampler_support.py holds it to TRL's
    fused log-probs."""
    transform = head_transform(owner)
    head = owner.get_output_embeddings()
    weight, bias = head.weight, head.bias
    if hasattr(weight, "full_tensor"):  # FSDP2's DTensor
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    with maybe_gather_lm_head_ctx(weight, bias):
        dtype = dtype or weight.dtype
        cast_weight = weight.detach().to(dtype)
        cast_bias = bias.detach().to(dtype) if bias is not None else None

        def project(hidden: torch.Tensor) -> torch.Tensor:
            with torch.autocast(hidden.device.type, enabled=False):
                product = torch.nn.functional.linear(hidden.to(cast_weight.device, dtype), cast_weight, cast_bias)
            return transform(product)

        yield project


def head_logits(owner: torch.nn.Module, hidden: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`head_projection` of one block of hidden states, in float32."""
    with head_projection(owner, dtype) as project:
        return project(hidden).float()


CORRECTION_CHUNK_ELEMENTS = 2**25
"""How many logits `chunked_processed_log_probs` holds at once (tokens x vocabulary): 128 MB in float32, the
processing adding a few masks of that size (top-p's sort: its values and int64 indices), against TRL's fused head's
4,096 x 32,768 projection tile. 220 tokens at a 151,936-token vocabulary."""


def completion_processed_log_probs(owner: torch.nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor,
                                   attention_mask: torch.Tensor, logits_to_keep: int,
                                   processing: SamplerProcessing, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`processed_log_probs` of the last `logits_to_keep` tokens of each sequence (B, logits_to_keep), 0 where
    `attention_mask` is 0: from the backbone's last hidden states (B, L, H), which predict token t at position t-1,
    projected in `dtype` (`head_projection`)."""
    hidden = hidden[:, -logits_to_keep - 1:-1]
    tokens = input_ids[:, -logits_to_keep:]
    positions = attention_mask[:, -logits_to_keep:].bool().nonzero(as_tuple=True)
    values = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    values[positions] = chunked_processed_log_probs(owner, hidden[positions], tokens[positions],
                                                    processing, dtype).to(values.device)
    return values


def chunked_processed_log_probs(owner: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor,
                                processing: SamplerProcessing, dtype: torch.dtype | None = None,
                                candidates: int | None = None) -> torch.Tensor:
    """`processed_log_probs` (on `candidates`) for N tokens from their (N, H) hidden states, projected in `dtype`
    (`head_projection`), `CORRECTION_CHUNK_ELEMENTS` logits at a time."""
    step = max(1, CORRECTION_CHUNK_ELEMENTS // owner.config.get_text_config().vocab_size)
    with head_projection(owner, dtype) as project:
        values = [processed_log_probs(project(hidden[start:start + step]), tokens[start:start + step].to(hidden.device),
                                      processing, candidates)
                  for start in range(0, hidden.size(0), step)]
    return torch.cat(values) if values else hidden.new_zeros(0, dtype=torch.float32)


def on_mus_support(log_probs: torch.Tensor, processed: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """TRL's `log_probs` (carrying the gradient) with the value of `processed` where `valid`: the ratio reads pi on
    mu's support, and the gradient stays grad log pi (TOPR's weight is a stop-gradient constant)."""
    shift = (processed.to(log_probs.dtype) - log_probs.detach()) * valid
    return log_probs + shift
