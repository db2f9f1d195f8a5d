"""pi on the support mu sampled from, so that pi/mu measures how far the policy moved and nothing else.

mu's log-probs (vLLM's `processed_logprobs`, `topr_trl.sampling`'s, a stored dataset's) are those of the *processed*
sampling distribution: the logits divided by the temperature, the tokens outside top-k / top-p / min-p removed, and
the rest renormalised. TRL scores the policy on the whole vocabulary at the trainer's temperature. Per token the two
differ by the log of the kept mass, and the sequence ratio multiplies it over every token: at top_k 3 on a
high-entropy policy pi/mu was ~1e-20 at learning rate 0, every negative's TOPR weight ~0 (TRL issue #6789 is the same
bias in TRL's own correction). The trainers score pi on mu's support instead: exact at learning rate 0.

    processing.py   how mu sampled (`SamplerProcessing`: temperature, top-k, top-p, min-p, the generator's order)
    rule.py         the exact rule on a row of logits (`processed_log_probs`)
    scoring.py      the rule inside the trainer's forward: hidden states by a forward hook, the head's projection of
                    the tokens whose weight reads the ratio, the constant added to TRL's log-probs
"""

from .processing import SUPPORT_FILTERS, SamplerProcessing, history_dependent_sampling
from .rule import processed_log_probs, sampler_support
from .scoring import (
    captured_outputs,
    chunked_processed_log_probs,
    completion_processed_log_probs,
    fused_head_parts,
    head_logits,
    on_mus_support,
)


__all__ = ["SUPPORT_FILTERS", "SamplerProcessing", "captured_outputs", "chunked_processed_log_probs",
           "completion_processed_log_probs", "fused_head_parts", "head_logits", "history_dependent_sampling",
           "on_mus_support", "processed_log_probs", "sampler_support"]
