"""The numbers quoted in the pages' prose, each tied to the evidence file that gives it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    page: str
    section: str
    template: str
    compute: Callable[[], str | tuple[str, ...]]

    def expected(self) -> str:
        values = self.compute()
        return self.template.format(*(values if isinstance(values, tuple) else (values,)))


CLAIMS: list[Claim] = []
