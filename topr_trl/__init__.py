"""TOPR (Tapered Off-Policy REINFORCE, arXiv:2503.14286) for Hugging Face TRL.

Swap `GRPOTrainer`/`GRPOConfig` for `TOPRTrainer`/`TOPRConfig`; nothing else changes.
"""

from .config import TOPRConfig
from .loss import (
    POLICY_LOSSES,
    PRESETS,
    PolicyLossSpec,
    TruncationLimits,
    policy_per_token_loss,
    register_policy_loss,
    topr_loss,
)
from .trainer import TOPRTrainer


__version__ = "0.1.0"
__all__ = [
    "POLICY_LOSSES",
    "PRESETS",
    "PolicyLossSpec",
    "TOPRConfig",
    "TOPRTrainer",
    "TruncationLimits",
    "policy_per_token_loss",
    "register_policy_loss",
    "topr_loss",
]
