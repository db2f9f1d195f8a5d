"""The exact rule: the policy's log-prob of each sampled token on the support mu's processing kept,

    log pi_S(y) = z_y - logsumexp_{v in S + {y}} z_v,      z = logits / T.

Each filter keeps a prefix of a row's logits sorted in descending order, as both engines write it: top-k the k largest
and their ties; top-p the tokens whose ascending cumulative probability exceeds 1 - p (at least the largest); min-p
those of probability at least min_p times the largest. They run in the generator's order, each on what the previous
ones kept (`support_length`). The sampled token always counts (`with_the_sampled_token`): mu gave it weight, and
pi_S(y) = 0 would leave it no weight and no gradient.

Only a row's top is sorted (`descending_groups`): top-k's k largest and their ties; for top-p the tokens above
probability (1 - p) / (2V) (those below hold at most (1 - p) / 2 together, so the engines' ascending sum passes them
far from 1 - p), the rest entering the sum as one term; for min-p those above min_p times the largest. Values only:
no gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .processing import SUPPORT_FILTERS, SamplerProcessing


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T in float32 (float32 logits at T = 1 are returned as they are, not copied)."""
    scaled = logits.float()
    return scaled if temperature == 1 else scaled / temperature


TAIL_MARGIN = 2.0
"""Tokens of probability at most (1 - p) / (TAIL_MARGIN * V) are left out of top-p's sort: together they hold at most
(1 - p) / TAIL_MARGIN, so float rounding of the engines' sum cannot carry one of them over the cut."""
WHOLE_SORT_SHARE = 0.25
"""A row whose logits above the floors are more than this share of it (a flat row) is sorted whole."""


class RowGroup(NamedTuple):
    """Rows (`rows`: indices) with their largest logits in descending order, as many as the widest row's support can
    hold, and the logsumexp of the rest of each row (`tail`; None where nothing a filter reads is left out)."""

    rows: torch.Tensor
    descending: torch.Tensor
    tail: torch.Tensor | None


def descending_groups(scaled: torch.Tensor, processing: SamplerProcessing) -> list[RowGroup]:
    """The (N, V) rows' largest logits, as many as each support can hold, in groups of rows of similar width (one
    wide row would otherwise make every row of a block as wide). Under top-k the k largest and every tie at the k-th,
    in one group: the cut falls inside them in both engines' orders. Otherwise those above the floors of top-p and
    min-p (the module's docstring), grouped by the power of two above their count, and the rows mostly above the
    floors sorted whole."""
    rows, vocabulary = scaled.shape
    every_row = torch.arange(rows, device=scaled.device)
    k = processing.top_k
    if k and k < vocabulary:
        largest = scaled.topk(k, dim=-1).values
        with_ties = int((scaled >= largest[:, -1:]).sum(dim=-1).max())
        return [RowGroup(every_row, largest if with_ties == k else scaled.topk(with_ties, dim=-1).values, None)]
    floors = []
    normaliser = scaled.logsumexp(dim=-1, keepdim=True)
    if processing.top_p is not None and processing.top_p < 1:
        floors.append(normaliser + math.log((1 - processing.top_p) / (TAIL_MARGIN * vocabulary)))
    if processing.min_p:
        # a hair below the exact floor: the engines compare probabilities, rounded, not logits
        floors.append(scaled.amax(dim=-1, keepdim=True) + math.log(processing.min_p) - 1e-3)
    if not floors:  # top-k at or above the vocabulary: nothing is cut
        return [RowGroup(every_row, scaled.sort(dim=-1, descending=True).values, None)]
    widths = (scaled >= torch.stack(floors).amin(dim=0)).sum(dim=-1)
    # a group per power of two of the width (at most log2(V) of them); 0 for the rows sorted whole
    group_of = torch.where(widths > WHOLE_SORT_SHARE * vocabulary, 0, widths.float().log2().ceil().long() + 1)
    groups = []
    for group in group_of.unique().tolist():
        members = every_row[group_of == group]
        block = scaled[members]
        if group == 0:
            groups.append(RowGroup(members, block.sort(dim=-1, descending=True).values, None))
            continue
        window = block.topk(int(widths[members].max()), dim=-1).values
        # the mass below the window, from the window's own (the tail's terms are too small to matter one by one)
        tail_mass = (1 - (window - normaliser[members]).exp().sum(dim=-1)).clamp_min(0)
        groups.append(RowGroup(members, window, normaliser[members].squeeze(-1) + tail_mass.log()))
    return groups


def support_length(
    descending: torch.Tensor, processing: SamplerProcessing, tail: torch.Tensor | None = None
) -> torch.Tensor:
    """(N,) how many of each row's sorted logits (N, W) the sampler keeps, its filters in its engine's order
    (`SUPPORT_FILTERS`). `tail` (`descending_groups`) counts in top-p's sum as one term while no filter before it has
    cut; no filter keeps it (top-p and min-p cut above it by construction)."""
    width = descending.size(-1)
    if tail is not None:
        descending = torch.cat([descending, tail.unsqueeze(-1)], dim=-1)
    position = torch.arange(descending.size(-1), device=descending.device)
    in_window = position < width
    length = torch.full(descending.shape[:1], descending.size(-1), dtype=torch.long, device=descending.device)
    for name in SUPPORT_FILTERS[processing.engine]:
        kept = descending.masked_fill(position >= length.unsqueeze(-1), -torch.inf)
        if name == "top_k" and processing.top_k and processing.top_k < width:
            # a row already shorter than k has -inf at the k-th: the comparison then keeps what it kept
            kept_by_filter = ((kept >= kept[:, processing.top_k - 1 : processing.top_k]) & in_window).sum(dim=-1)
        elif name == "top_p" and processing.top_p is not None and processing.top_p < 1:
            ascending = kept.flip(-1).softmax(dim=-1).cumsum(dim=-1)  # the engines' sum, smallest first
            kept_by_filter = (ascending > 1 - processing.top_p).sum(dim=-1).clamp_min(1)
        elif name == "min_p" and processing.min_p:
            probs = kept.softmax(dim=-1)
            kept_by_filter = ((probs >= processing.min_p * probs[:, :1]) & in_window).sum(dim=-1)
        else:
            continue
        length = torch.minimum(length, kept_by_filter)
    return length.clamp_max(width)


def with_the_sampled_token(normaliser: torch.Tensor, chosen: torch.Tensor, smallest_kept: torch.Tensor) -> torch.Tensor:
    """The support's logsumexp `normaliser` with the sampled token's scaled logit `chosen` added where it lies below
    the smallest kept logit (it is one of the kept ones otherwise, or tied with them)."""
    return torch.where(chosen < smallest_kept, torch.logaddexp(normaliser, chosen), normaliser)


def processed_log_probs(logits: torch.Tensor, tokens: torch.Tensor, processing: SamplerProcessing) -> torch.Tensor:
    """log pi_S(y) (float32) for each (..., V) row of `logits` (any dtype) and its sampled token y (...)."""
    if logits.dim() != 2:
        flat = processed_log_probs(logits.reshape(-1, logits.size(-1)), tokens.reshape(-1), processing)
        return flat.reshape(tokens.shape)
    with torch.no_grad():
        scaled = scaled_logits(logits, processing.temperature)
        chosen = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if not processing.truncates:  # the whole vocabulary at mu's temperature
            return chosen - scaled.logsumexp(dim=-1)
        normaliser, smallest_kept = torch.empty_like(chosen), torch.empty_like(chosen)
        for rows, descending, tail in descending_groups(scaled, processing):
            length = support_length(descending, processing, tail)
            kept = torch.arange(descending.size(-1), device=descending.device) < length.unsqueeze(-1)
            normaliser[rows] = descending.masked_fill(~kept, -torch.inf).logsumexp(dim=-1)
            smallest_kept[rows] = descending.gather(-1, (length - 1).unsqueeze(-1)).squeeze(-1)
        return chosen - with_the_sampled_token(normaliser, chosen, smallest_kept)
