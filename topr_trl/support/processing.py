"""How mu turned logits into its sampling distribution: the temperature, then the truncation filters (top-k, top-p,
min-p) in its generator's order. A stored row's `behaviour_sampling` is `SamplerProcessing.as_row()`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


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
        return cls(
            **{name: row[name] for name in ("temperature", "top_k", "top_p", "min_p") if row.get(name) is not None},
            engine=row.get("engine") or "transformers",
        )
