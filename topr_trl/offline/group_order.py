"""The order in which TOPRTrainer replays an offline dataset: whole prompt groups, shuffled together."""

from __future__ import annotations

import random
from collections.abc import Sequence

from torch.utils.data import Sampler


class GroupShuffleSampler(Sampler):
    """Yields the rows of an offline dataset with whole prompt groups shuffled together, in generation batches
    of `batch_rows` rows, each batch repeated `repeat_count` times (GRPO reuses a generation batch for
    `num_iterations * steps_per_generation` steps). Rows of one group stay contiguous, so GRPO's group
    statistics (`view(-1, num_generations)`) see whole groups when every group has `num_generations` rows."""

    def __init__(
        self, group_ids: Sequence[int], batch_rows: int, repeat_count: int = 1, shuffle: bool = True, seed: int = 0
    ):
        self.groups: dict[int, list[int]] = {}
        for row, group in enumerate(group_ids):
            self.groups.setdefault(group, []).append(row)
        self.batch_rows, self.repeat_count, self.shuffle, self.seed = batch_rows, repeat_count, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _ordered_rows(self) -> list[int]:
        order = list(self.groups)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return [row for group in order for row in self.groups[group]]

    def __iter__(self):
        rows = self._ordered_rows()
        for start in range(0, len(rows) - self.batch_rows + 1, self.batch_rows):
            for _ in range(self.repeat_count):
                yield from rows[start : start + self.batch_rows]

    def __len__(self) -> int:
        total = sum(len(rows) for rows in self.groups.values())
        return (total // self.batch_rows) * self.batch_rows * self.repeat_count
