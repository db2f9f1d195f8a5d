"""The exact rule: the policy's log-prob of each sampled token on the support mu's processing kept,

    log pi_S(y) = z_y - logsumexp_{v in S + {y}} z_v,      z = logits / T.

Every filter keeps a prefix of a row's logits sorted in descending order: top-k the k largest and their ties (both
engines keep the ties at the k-th), top-p the tokens whose ascending cumulative probability exceeds 1 - p (both
engines sort ascending, take the softmax and its cumulative sum, and keep at least the largest), min-p those of
probability at least min_p times the largest. So a row's support is its first `support_length` sorted logits, each
filter applied in the generator's order to what the previous ones kept, and its normaliser is their logsumexp.

The sampled token always counts (`with_the_sampled_token`): mu gave it weight, but after the policy moved its own
filters may drop it, and pi_S(y) = 0 would give the weight 0 and no gradient. Tied with the smallest kept logit it
is one of the ties the cut kept (which of them is a sort's order), as the sampler kept it.

The sort is the rule; under top-k the support holds at most the k largest logits and their ties, which `torch.topk`
gives without sorting the vocabulary. No gradient: the ratio's value only.
"""

from __future__ import annotations

import torch

from .processing import SUPPORT_FILTERS, SamplerProcessing


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T in float32 (float32 logits at T = 1 are returned as they are, not copied)."""
    scaled = logits.float()
    return scaled if temperature == 1 else scaled / temperature


def descending_logits(scaled: torch.Tensor, processing: SamplerProcessing) -> torch.Tensor:
    """Each (N, V) row's largest logits in descending order, as many as its support can hold: under top-k the k
    largest and every tie at the k-th (of the row that has most), otherwise all of them."""
    vocabulary = scaled.size(-1)
    k = processing.top_k
    if not k or k >= vocabulary:
        return scaled.sort(dim=-1, descending=True).values
    largest = scaled.topk(k, dim=-1).values
    with_ties = int((scaled >= largest[:, -1:]).sum(dim=-1).max())
    return largest if with_ties == k else scaled.topk(with_ties, dim=-1).values


def support_length(descending: torch.Tensor, processing: SamplerProcessing) -> torch.Tensor:
    """(N,) how many of each row's sorted logits (N, W) the sampler keeps: its filters in its engine's order
    (`SUPPORT_FILTERS`), each on the tokens the previous ones kept, each as the engines write it."""
    width = descending.size(-1)
    position = torch.arange(width, device=descending.device)
    length = torch.full(descending.shape[:1], width, dtype=torch.long, device=descending.device)
    for name in SUPPORT_FILTERS[processing.engine]:
        kept = descending.masked_fill(position >= length.unsqueeze(-1), -torch.inf)
        if name == "top_k" and processing.top_k and processing.top_k < width:
            # a row already shorter than k has -inf at the k-th: the comparison then keeps what it kept
            kept_by_filter = (kept >= kept[:, processing.top_k - 1:processing.top_k]).sum(dim=-1)
        elif name == "top_p" and processing.top_p is not None and processing.top_p < 1:
            ascending = kept.flip(-1).softmax(dim=-1).cumsum(dim=-1)  # the engines' sum, smallest first
            kept_by_filter = (ascending > 1 - processing.top_p).sum(dim=-1).clamp_min(1)
        elif name == "min_p" and processing.min_p:
            probs = kept.softmax(dim=-1)
            kept_by_filter = (probs >= processing.min_p * probs[:, :1]).sum(dim=-1)
        else:
            continue
        length = torch.minimum(length, kept_by_filter)
    return length


def with_the_sampled_token(normaliser: torch.Tensor, chosen: torch.Tensor, smallest_kept: torch.Tensor
                           ) -> torch.Tensor:
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
        descending = descending_logits(scaled, processing)
        length = support_length(descending, processing)
        kept = torch.arange(descending.size(-1), device=descending.device) < length.unsqueeze(-1)
        normaliser = descending.masked_fill(~kept, -torch.inf).logsumexp(dim=-1)
        smallest_kept = descending.gather(-1, (length - 1).unsqueeze(-1)).squeeze(-1)
        return chosen - with_the_sampled_token(normaliser, chosen, smallest_kept)


def sampler_support(logits: torch.Tensor, processing: SamplerProcessing) -> torch.Tensor:
    """The tokens the sampler keeps, (N, V) bool: the first `support_length` of each row in the order of one sort
    (where the cut falls among tied logits, which of them are kept is that sort's order, as in the engines)."""
    scaled = scaled_logits(logits, processing.temperature)
    descending, order = scaled.sort(dim=-1, descending=True)
    length = support_length(descending, processing)
    kept = torch.arange(scaled.size(-1), device=scaled.device) < length.unsqueeze(-1)
    return torch.zeros_like(kept).scatter(-1, order, kept)
