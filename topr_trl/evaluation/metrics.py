"""Evaluation metrics for sampled answers: pass@k, majority voting (maj@k), bootstrap standard errors, and
the histogram of correct answers per question. Pure functions on answers and correctness flags, no models.

* pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code",
  arXiv:2107.03374): with n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k).
* maj@k is the correctness of the majority answer among k samples (self-consistency, Wang et al., 2022);
  `expected_maj_at_k` is its exact expectation over k of the n samples drawn without replacement.
* Standard errors follow the TOPR paper (Le Roux et al., 2025, arXiv:2503.14286): for each question draw K of
  its n samples without replacement and compute the metric on these draws, repeat B = 100 times, and take
  SE = sqrt(K * V / (n - K)), V the variance of the B estimates. This is the delete-d jackknife variance of
  Shao and Wu (1989, "A general theory for jackknife variance estimation", Ann. Statist. 17(3)) with d = n - K
  samples left out, here over B random subsets rather than all C(n, K) of them: the spread of a K-sample
  estimate around the n-sample one is (n - K) / K times the variance of the n-sample estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


__all__ = [
    "BootstrapResult",
    "bootstrap_maj_at_k",
    "bootstrap_pass_at_k",
    "bootstrap_standard_error",
    "correct_count_histogram",
    "expected_maj_at_k",
    "maj_at_k",
    "majority_vote",
    "mean_pass_at_k",
    "pass_at_k",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate for one question with `n` samples of which `c` are correct:
    1 - C(n-c, k) / C(n, k), the probability that k of the n samples drawn without replacement contain a
    correct one (Chen et al., 2021). Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which neither overflows
    nor loses precision for large n."""
    n, c, k = int(n), int(c), int(k)
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"need n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(num_samples, num_correct, k: int) -> float:
    """pass@k averaged over questions; `num_samples` is one n for all questions or one per question,
    `num_correct` one c per question."""
    num_correct = np.atleast_1d(np.asarray(num_correct))
    num_samples = np.broadcast_to(np.asarray(num_samples), num_correct.shape)
    if num_correct.size == 0:
        raise ValueError("no questions")
    return float(np.mean([pass_at_k(n, c, k) for n, c in zip(num_samples.tolist(), num_correct.tolist(), strict=True)]))


def _clusters(answers: Sequence[Any], equivalent: Callable[[Any, Any], bool] | None) -> list[list[int]]:
    """Indices of the non-None answers grouped into clusters of equal (or `equivalent`) answers, each cluster
    in order of appearance, clusters in order of their first member."""
    clusters: list[list[int]] = []
    if equivalent is None:
        by_answer: dict[Any, list[int]] = {}
        for index, answer in enumerate(answers):
            if answer is not None:
                if answer not in by_answer:
                    by_answer[answer] = []
                    clusters.append(by_answer[answer])
                by_answer[answer].append(index)
        return clusters
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        for cluster in clusters:
            if equivalent(answers[cluster[0]], answer):
                cluster.append(index)
                break
        else:
            clusters.append([index])
    return clusters


def majority_vote(answers: Sequence[Any], equivalent: Callable[[Any, Any], bool] | None = None):
    """The most frequent answer among `answers`, None answers (invalid samples) ignored; None when every
    answer is None.

    Answers are grouped by equality, or by `equivalent(a, b)` when given (which should then be an
    equivalence relation, e.g. `topr_trl.evaluation.rewards.gsm8k_numbers_equal` so that "18" and "18.00" vote
    together);
    the group's first answer represents it. Ties are broken deterministically in favour of the group whose
    first answer comes earliest in `answers`."""
    clusters = _clusters(answers, equivalent)
    if not clusters:
        return None
    best = max(clusters, key=len)  # max keeps the first of equal lengths: the earliest first appearance
    return answers[best[0]]


def maj_at_k(
    answers: Sequence[Any],
    reference: Any,
    is_correct: Callable[[Any, Any], bool],
    equivalent: Callable[[Any, Any], bool] | None = None,
) -> bool:
    """maj@k of one question for its k sampled `answers`: whether their `majority_vote` is correct according
    to `is_correct(answer, reference)`. False when every answer is None."""
    vote = majority_vote(answers, equivalent)
    return vote is not None and bool(is_correct(vote, reference))


def expected_maj_at_k(
    answers: Sequence[Any],
    reference: Any,
    k: int,
    is_correct: Callable[[Any, Any], bool],
    equivalent: Callable[[Any, Any], bool] | None = None,
) -> float:
    """The exact expectation of `maj_at_k` over k of the n `answers` drawn uniformly without replacement
    (in random order), the maj@k analogue of the unbiased pass@k estimator.

    Under a random draw order, `majority_vote`'s earliest-first tie-break picks each of t tied groups with
    probability 1/t, so a draw where the correct group ties with t-1 others counts 1/t. The expectation is
    summed exactly over the multivariate hypergeometric counts of the groups, by dynamic programming over the
    groups (no enumeration of the C(n, k) subsets); None answers fill the draw but never vote."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    clusters = _clusters(answers, equivalent)
    sizes = [len(cluster) for cluster in clusters]
    correct = [bool(is_correct(answers[cluster[0]], reference)) for cluster in clusters]
    num_none = n - sum(sizes)
    total = 0.0
    for target, (size, target_correct) in enumerate(zip(sizes, correct, strict=True)):
        if not target_correct:
            continue
        others = [s for j, s in enumerate(sizes) if j != target]
        for a in range(1, min(size, k) + 1):
            # (drawn from the other groups, groups tied with `a`) -> number of ways
            states = {(0, 0): 1}
            for other in others:
                updated: dict[tuple[int, int], int] = {}
                for (used, ties), ways in states.items():
                    for x in range(0, min(other, a, k - a - used) + 1):
                        key = (used + x, ties + (x == a))
                        updated[key] = updated.get(key, 0) + ways * math.comb(other, x)
                states = updated
            ways_target = math.comb(size, a)
            for (used, ties), ways in states.items():
                rest = k - a - used
                if rest <= num_none:
                    total += ways_target * ways * math.comb(num_none, rest) / (ties + 1)
    return total / math.comb(n, k)


@dataclass(frozen=True)
class BootstrapResult:
    """`mean`: the mean of the B estimates (the metric at K samples per question); `standard_error`:
    sqrt(K * V / (n - K)) with V their variance (ddof=1); `estimates`: the B estimates."""

    mean: float
    standard_error: float
    estimates: np.ndarray
    k: int
    n: int


def _generator(seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def bootstrap_standard_error(
    samples: Sequence[Sequence[Any]],
    k: int,
    metric: Callable[[list[list[Any]]], float],
    num_bootstrap: int = 100,
    seed: int | np.random.Generator | None = 0,
) -> BootstrapResult:
    """The TOPR paper's bootstrap standard error of a metric computed from K samples per question.

    `samples[q]` holds the n samples of question q (the same n for every question: answers, correctness
    flags, anything `metric` understands). Each of the `num_bootstrap` (B) rounds draws, for every question
    independently, K = `k` of its n samples without replacement, and evaluates `metric(draws)`, `draws[q]`
    being question q's K samples in drawn order. With V the variance (ddof=1) of the B estimates,

        SE = sqrt(K * V / (n - K)),

    the delete-d jackknife variance (Shao and Wu, 1989) with d = n - K, as used by Le Roux et al. (2025,
    arXiv:2503.14286). Needs 1 <= K < n. Reproducible under `seed` (an int or a `numpy.random.Generator`)."""
    if len(samples) == 0:
        raise ValueError("no questions")
    lengths = {len(question) for question in samples}
    if len(lengths) != 1:
        raise ValueError(f"every question needs the same number of samples, got {sorted(lengths)}")
    n = lengths.pop()
    if not 1 <= k < n:
        raise ValueError(f"need 1 <= k < n for the jackknife factor K/(n-K), got k={k}, n={n}")
    if num_bootstrap < 2:
        raise ValueError("need at least 2 bootstrap rounds for a variance")
    rng = _generator(seed)
    estimates = np.empty(num_bootstrap, dtype=np.float64)
    for round_ in range(num_bootstrap):
        # A uniformly random ordering of each question's samples; its first k form the draw.
        chosen = np.argsort(rng.random((len(samples), n)), axis=1)[:, :k]
        draws = [[question[i] for i in row] for question, row in zip(samples, chosen.tolist(), strict=True)]
        estimates[round_] = float(metric(draws))
    variance = float(np.var(estimates, ddof=1))
    return BootstrapResult(
        mean=float(estimates.mean()),
        standard_error=math.sqrt(k * variance / (n - k)),
        estimates=estimates,
        k=k,
        n=n,
    )


def bootstrap_pass_at_k(
    correct, k: int, num_bootstrap: int = 100, seed: int | np.random.Generator | None = 0
) -> BootstrapResult:
    """`bootstrap_standard_error` of pass@K from a (questions, n) array of correctness flags: each round's
    estimate is the share of questions with at least one correct answer among their K drawn samples."""
    correct = np.asarray(correct, dtype=bool)
    if correct.ndim != 2:
        raise ValueError("correct must be a (questions, samples) array")
    return bootstrap_standard_error(
        correct.tolist(), k, lambda draws: float(np.mean([any(draw) for draw in draws])), num_bootstrap, seed
    )


def bootstrap_maj_at_k(
    answers: Sequence[Sequence[Any]],
    references: Sequence[Any],
    k: int,
    is_correct: Callable[[Any, Any], bool],
    equivalent: Callable[[Any, Any], bool] | None = None,
    num_bootstrap: int = 100,
    seed: int | np.random.Generator | None = 0,
) -> BootstrapResult:
    """`bootstrap_standard_error` of maj@K: `answers[q]` holds question q's n extracted answers (None for
    invalid ones) and `references[q]` its reference; each round's estimate is the share of questions whose
    K drawn answers have a correct majority vote."""
    if len(answers) != len(references):
        raise ValueError("one reference per question")

    def metric(draws):
        return float(
            np.mean([maj_at_k(draw, ref, is_correct, equivalent) for draw, ref in zip(draws, references, strict=True)])
        )

    return bootstrap_standard_error(answers, k, metric, num_bootstrap, seed)


def correct_count_histogram(correct, num_samples: int | None = None) -> np.ndarray:
    """`hist[c]` = the number of questions with exactly c correct answers, for c = 0..n.

    `correct` is either a (questions, n) array of correctness flags (n taken from it) or a 1-D sequence of
    per-question correct counts, in which case `num_samples` (n) is required."""
    values = np.asarray(correct)
    if values.ndim == 2:
        if num_samples is not None and num_samples != values.shape[1]:
            raise ValueError(f"num_samples={num_samples} but the array has {values.shape[1]} samples per question")
        num_samples = values.shape[1]
        counts = values.astype(bool).sum(axis=1)
    elif values.ndim == 1:
        if num_samples is None:
            raise ValueError("num_samples is needed with per-question counts")
        counts = values.astype(np.int64)
        if values.size and not np.array_equal(counts, values):
            raise ValueError("counts must be integers")
    else:
        raise ValueError("correct must be a (questions, samples) array or a 1-D sequence of counts")
    if counts.size and (counts.min() < 0 or counts.max() > num_samples):
        raise ValueError(f"counts must lie in [0, {num_samples}]")
    return np.bincount(counts, minlength=num_samples + 1)
