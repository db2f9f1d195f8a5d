"""pi on the support mu sampled from, so that pi/mu measures how far the policy moved and nothing else.

mu's log-probs (vLLM's `processed_logprobs`, `topr_trl.generation.completions`'s, a stored dataset's) are those of the
processed sampling distribution: logits / T, the tokens outside top-k / top-p / min-p removed, the rest renormalised.
TRL scores the policy on the whole vocabulary, so the kept mass enters every token's ratio (at top_k 3 on a high-entropy
policy pi/mu was ~1e-20 at learning rate 0; TRL issue #6789). `processing` says how mu sampled, `rule` is the exact rule
on a row of logits, `scoring` runs it in the trainer's forward."""

from .processing import SamplerProcessing
from .rule import processed_log_probs


__all__ = ["SamplerProcessing", "processed_log_probs"]
