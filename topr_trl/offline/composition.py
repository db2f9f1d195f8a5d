"""Which generated rows an iteration trains on: uniform, positives only, Anna Karenina (the paper's curation) or a
target proportion of positives."""

from __future__ import annotations

import math
import random

from datasets import Dataset


COMPOSITIONS = ("uniform", "positives_only", "anna_karenina", "target_proportion")


def proportion_of_positives(dataset: Dataset, threshold: float = 0.0) -> float:
    """p: the share of rows whose reward is above `threshold`."""
    rewards = [r for r in dataset["reward"] if r is not None and not math.isnan(r)]
    return sum(r > threshold for r in rewards) / max(len(rewards), 1)


def compose(
    dataset: Dataset,
    strategy: str = "uniform",
    *,
    target_proportion: float | None = None,
    seed: int = 0,
    threshold: float = 0.0,
) -> tuple[Dataset, float]:
    """Select the rows an iteration trains on; returns the subset and its proportion of positives p.

    - "uniform": every row.
    - "positives_only": rows with reward > `threshold` (rejection sampling / SFT data).
    - "anna_karenina": per prompt, the first correct completion (by `sample_index`) and every incorrect one
      (the paper's curation: one way to be right, many ways to be wrong).
    - "target_proportion": subsample negatives or positives (uniformly at random) so that p equals
      `target_proportion` as closely as whole rows allow, keeping as many rows as possible.
    """
    rewards = dataset["reward"]
    positive = [r is not None and not math.isnan(r) and r > threshold for r in rewards]
    indices = list(range(len(dataset)))
    if strategy == "uniform":
        chosen = indices
    elif strategy == "positives_only":
        chosen = [i for i in indices if positive[i]]
    elif strategy == "anna_karenina":
        first_correct: dict[int, int] = {}
        for i in sorted(indices, key=lambda i: (dataset[i]["prompt_index"], dataset[i]["sample_index"])):
            if positive[i]:
                first_correct.setdefault(dataset[i]["prompt_index"], i)
        keep = set(first_correct.values())
        chosen = [i for i in indices if not positive[i] or i in keep]
    elif strategy == "target_proportion":
        if target_proportion is None or not 0 < target_proportion < 1:
            raise ValueError("strategy 'target_proportion' needs 0 < target_proportion < 1")
        positives = [i for i in indices if positive[i]]
        negatives = [i for i in indices if not positive[i]]
        if not positives or not negatives:
            raise ValueError("strategy 'target_proportion' needs both positive and negative rows")
        rng = random.Random(seed)
        # keep all of the scarcer side (relative to the target) and subsample the other
        if len(positives) / len(indices) > target_proportion:
            count = round(len(negatives) * target_proportion / (1 - target_proportion))
            positives = sorted(rng.sample(positives, max(count, 1)))
        else:
            count = round(len(positives) * (1 - target_proportion) / target_proportion)
            negatives = sorted(rng.sample(negatives, max(count, 1)))
        chosen = sorted(positives + negatives)
    else:
        raise ValueError(f"Unknown composition strategy {strategy!r}; expected one of {list(COMPOSITIONS)}")
    subset = dataset.select(chosen)
    return subset, (sum(positive[i] for i in chosen) / len(chosen) if chosen else float("nan"))
