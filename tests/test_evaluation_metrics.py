"""pass@k, majority voting, bootstrap standard errors and histograms of `topr_trl.evaluation.metrics`."""

import itertools
import math
import random

import numpy as np
import pytest

from topr_trl.evaluation.metrics import (
    bootstrap_maj_at_k,
    bootstrap_pass_at_k,
    bootstrap_standard_error,
    correct_count_histogram,
    expected_maj_at_k,
    maj_at_k,
    majority_vote,
    mean_pass_at_k,
    pass_at_k,
)
from topr_trl.evaluation.rewards import gsm8k_numbers_equal


def _equal(answer, reference):
    return answer == reference


# ------------------------------------------------------------------------------------------------------------
# pass@k
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_enumeration_of_subsets(n):
    for c in range(n + 1):
        flags = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(flags, k))
            brute = sum(any(subset) for subset in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    n, c, k = 10_000, 5_000, 100
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Python integers: exact up to the final division
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001, rel=1e-12)
    assert pass_at_k(200, 3, 10) == pytest.approx(1 - math.comb(197, 10) / math.comb(200, 10), rel=1e-12)
    assert pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(5, 1, 5) == 1.0


@pytest.mark.parametrize("n, c, k", [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_mean_pass_at_k():
    assert mean_pass_at_k(4, [0, 2, 4], 1) == pytest.approx((0 + 0.5 + 1) / 3)
    assert mean_pass_at_k([2, 4], [1, 1], 2) == pytest.approx((1.0 + 0.5) / 2)


# ------------------------------------------------------------------------------------------------------------
# Majority vote and maj@k
# ------------------------------------------------------------------------------------------------------------


def test_majority_vote():
    assert majority_vote(["3", "5", "5", None, None, None]) == "5"  # None never wins
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None
    assert majority_vote(["7", "3", "3", "7"]) == "7"  # tie: the answer seen first wins
    assert majority_vote(["3", "7", "7", "3"]) == "3"
    assert majority_vote(["18", "18.00", "17", "17"]) == "17"
    assert majority_vote(["18", "18.00", "17", "17", "$18"], equivalent=gsm8k_numbers_equal) == "18"


def test_maj_at_k():
    assert maj_at_k(["18.0", "17", "18"], "18", gsm8k_numbers_equal, equivalent=gsm8k_numbers_equal)
    assert not maj_at_k(["18.0", "17", "18"], "18", _equal)  # without grouping, "18.0" wins the tie and is wrong
    assert not maj_at_k([None, None], "18", _equal)


def _brute_force_maj(answers, reference, k, is_correct, equivalent=None):
    """maj@k averaged over every ordered draw of k of the answers (all permutations of all k-subsets)."""
    draws = list(itertools.permutations(answers, k))
    return sum(maj_at_k(list(draw), reference, is_correct, equivalent) for draw in draws) / len(draws)


@pytest.mark.parametrize("seed", range(12))
def test_expected_maj_at_k_matches_enumeration(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    answers = [rng.choice(["1", "2", "3", None]) for _ in range(n)]
    for k in range(1, n + 1):
        expected = expected_maj_at_k(answers, "1", k, _equal)
        assert expected == pytest.approx(_brute_force_maj(answers, "1", k, _equal), abs=1e-12), (answers, k)


def test_expected_maj_at_k_with_ties_and_equivalence():
    answers = ["18", "17", "18.0", "17", None, "$18"]
    for k in range(1, 7):
        expected = expected_maj_at_k(answers, "18", k, gsm8k_numbers_equal, gsm8k_numbers_equal)
        brute = _brute_force_maj(answers, "18", k, gsm8k_numbers_equal, gsm8k_numbers_equal)
        assert expected == pytest.approx(brute, abs=1e-12)
    # Without ties, ordered and unordered draws agree: compare with plain k-subsets too.
    answers = ["a", "a", "a", "b", "b"]
    for k in (1, 3, 5):
        subsets = list(itertools.combinations(answers, k))
        brute = sum(majority_vote(list(s)) == "a" for s in subsets) / len(subsets)
        assert expected_maj_at_k(answers, "a", k, _equal) == pytest.approx(brute, abs=1e-12)
    # Two answers tied over all samples: each wins half the draws of size n.
    assert expected_maj_at_k(["a", "b"], "a", 2, _equal) == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------------------------
# Bootstrap standard error
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def correctness():
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, size=60)
    return rng.random((60, 8)) < p[:, None]


def test_bootstrap_is_reproducible_and_follows_the_formula(correctness):
    first = bootstrap_pass_at_k(correctness, k=4, seed=123)
    again = bootstrap_pass_at_k(correctness, k=4, seed=123)
    other = bootstrap_pass_at_k(correctness, k=4, seed=124)
    assert first.estimates.shape == (100,)
    np.testing.assert_array_equal(first.estimates, again.estimates)
    assert first.standard_error == again.standard_error
    assert not np.array_equal(first.estimates, other.estimates)
    assert first.standard_error != other.standard_error
    variance = np.var(first.estimates, ddof=1)
    assert first.standard_error == pytest.approx(math.sqrt(4 * variance / (8 - 4)))
    assert first.mean == pytest.approx(first.estimates.mean())
    generator_result = bootstrap_pass_at_k(correctness, k=4, seed=np.random.default_rng(123))
    np.testing.assert_array_equal(generator_result.estimates, first.estimates)


def test_bootstrap_mean_estimates_pass_at_k(correctness):
    result = bootstrap_pass_at_k(correctness, k=3, num_bootstrap=400, seed=0)
    exact = mean_pass_at_k(8, correctness.sum(axis=1), 3)
    assert abs(result.mean - exact) < 4 * result.estimates.std(ddof=1) / math.sqrt(400) + 1e-12


@pytest.mark.parametrize("k", [1, 3, 6])
def test_bootstrap_se_of_a_mean_matches_the_analytic_standard_error(correctness, k):
    """For the mean correctness, the K-sample estimate has variance sum_q s_q^2 (n-K) / (K n Q^2) around the
    n-sample one (finite-population correction), so K V / (n - K) recovers sum_q s_q^2 / (n Q^2), s_q^2 the
    unbiased variance of question q's flags: the usual standard error of the accuracy, whatever K."""
    n, questions = correctness.shape[1], correctness.shape[0]
    result = bootstrap_standard_error(
        correctness.tolist(), k, lambda draws: float(np.mean(draws)), num_bootstrap=3000, seed=1
    )
    analytic = math.sqrt(np.var(correctness, axis=1, ddof=1).sum() / (n * questions**2))
    assert result.standard_error == pytest.approx(analytic, rel=0.08)


def test_bootstrap_maj_at_k():
    answers = [["1", "1", "2", None], ["3", "4", "4", "4"], [None, None, "5", "6"]]
    references = ["1", "3", "6"]
    result = bootstrap_maj_at_k(answers, references, k=2, is_correct=_equal, seed=0)
    again = bootstrap_maj_at_k(answers, references, k=2, is_correct=_equal, seed=0)
    np.testing.assert_array_equal(result.estimates, again.estimates)
    assert np.all((result.estimates >= 0) & (result.estimates <= 1))
    exact = np.mean([expected_maj_at_k(a, r, 2, _equal) for a, r in zip(answers, references, strict=False)])
    assert result.mean == pytest.approx(exact, abs=0.1)
    assert result.standard_error > 0


def test_bootstrap_rejects_bad_arguments(correctness):
    with pytest.raises(ValueError):
        bootstrap_pass_at_k(correctness, k=8)  # K = n: no jackknife factor
    with pytest.raises(ValueError):
        bootstrap_standard_error([[1, 2, 3], [1, 2]], 1, lambda draws: 0.0)
    with pytest.raises(ValueError):
        bootstrap_pass_at_k(correctness, k=2, num_bootstrap=1)


# ------------------------------------------------------------------------------------------------------------
# Histogram of correct answers per question
# ------------------------------------------------------------------------------------------------------------


def test_correct_count_histogram():
    flags = np.array([[1, 1, 0], [0, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(correct_count_histogram(flags), [1, 0, 2, 1])
    np.testing.assert_array_equal(correct_count_histogram([2, 0, 3, 2], num_samples=3), [1, 0, 2, 1])
    np.testing.assert_array_equal(correct_count_histogram([], num_samples=2), [0, 0, 0])
    with pytest.raises(ValueError):
        correct_count_histogram([2, 0, 3])  # counts need num_samples
    with pytest.raises(ValueError):
        correct_count_histogram([4], num_samples=3)
    with pytest.raises(ValueError):
        correct_count_histogram(flags, num_samples=4)
