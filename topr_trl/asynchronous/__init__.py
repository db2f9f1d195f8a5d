"""Asynchronous TOPR on TRL 1.16's `trl.experimental.async_grpo`: generation runs ahead of training and no stale
sample is thrown away. Imported on its own (`from topr_trl.asynchronous import AsyncTOPRTrainer`), so that
`import topr_trl` does not load TRL's experimental package."""

import os


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from .config import AsyncTOPRConfig  # noqa: E402
from .cpu import CPUSupport, tree_attention_sdpa  # noqa: E402
from .lagged_worker import InProcessWeightTransfer, LaggedRolloutWorker  # noqa: E402
from .trainer import AsyncTOPRTrainer, ConsumedSamples, with_response_template  # noqa: E402


__all__ = [
    "AsyncTOPRConfig",
    "AsyncTOPRTrainer",
    "CPUSupport",
    "ConsumedSamples",
    "InProcessWeightTransfer",
    "LaggedRolloutWorker",
    "tree_attention_sdpa",
    "with_response_template",
]
