"""experiments/real_model_study.py: its statistics against hand-computed values, the rate rule and the queue it
deals, the claims that keep two lanes off one run, and the summary's verdicts (on runs written here by hand)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from experiments import real_model_study as study


def test_the_sign_flip_p_counts_the_assignments_at_least_as_extreme():
    # 3 positives: of the 8 sign assignments only +++ and --- reach |sum| 6
    assert study.sign_flip_p([1.0, 2.0, 3.0]) == pytest.approx(2 / 8)
    # the sums of (+-1, +-2, +-3) are +-6, +-4, +-2, +-0: observed |-1 + 2 + 3| = 4 is reached by 4 of the 8
    assert study.sign_flip_p([-1.0, 2.0, 3.0]) == pytest.approx(4 / 8)
    # 8 differences of one sign: the smallest p 8 seeds can give
    assert study.sign_flip_p([0.1] * 8) == pytest.approx(2 / 256)
    # a mean of 0 is as extreme as every assignment
    assert study.sign_flip_p([0.5, -0.5]) == 1.0


def test_holm_multiplies_by_the_remaining_count_and_keeps_the_order():
    adjusted = study.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.5})
    # sorted 0.01, 0.03, 0.04, 0.5 -> 4 x 0.01, 3 x 0.03, max(0.09, 2 x 0.04), max(0.09, 1 x 0.5)
    assert adjusted == pytest.approx({"a": 0.04, "c": 0.09, "b": 0.09, "d": 0.5})
    assert study.holm({"a": 0.6, "b": 0.7}) == pytest.approx({"a": 1.0, "b": 1.0})


def test_a_comparison_is_paired_by_seed_with_a_t_interval():
    row = study.compare({0: 0.5, 1: 0.7, 2: 0.4}, {0: 0.3, 1: 0.4, 2: 0.5, 3: 0.9})
    assert row["seeds"] == [0, 1, 2]
    assert row["differences"] == pytest.approx([0.2, 0.3, -0.1])
    half = 4.303 * math.sqrt(((0.2 - 0.4 / 3) ** 2 + (0.3 - 0.4 / 3) ** 2 + (-0.1 - 0.4 / 3) ** 2) / 2) / math.sqrt(3)
    assert row["difference"] == pytest.approx(0.4 / 3)
    assert row["ci95"] == pytest.approx([0.4 / 3 - half, 0.4 / 3 + half])
    assert row["p"] == pytest.approx(study.sign_flip_p([0.2, 0.3, -0.1]))
    assert study.verdict(0.1, 0.049) == "above" and study.verdict(-0.1, 0.01) == "below"
    assert study.verdict(0.3, 0.05) == "undecided"


@pytest.mark.parametrize(
    "scores, expected",
    [
        ({3e-6: 0.2, 1e-5: 0.5, 3e-5: 0.4}, (1e-5, None)),  # interior: final
        ({3e-6: 0.6, 1e-5: 0.5, 3e-5: 0.4}, (3e-6, 1e-6)),  # the lowest rate: try one lower
        ({3e-6: 0.2, 1e-5: 0.5, 3e-5: 0.6}, (3e-5, 1e-4)),  # the highest: one higher
        ({1e-6: 0.5, 3e-6: 0.6, 1e-5: 0.5, 3e-5: 0.4}, (3e-6, None)),  # extended: now interior
        ({3e-6: 0.5, 1e-5: 0.5, 3e-5: 0.4}, (3e-6, 1e-6)),  # an exact tie goes to the smaller rate
        ({3e-7: 0.9, 1e-6: 0.5}, (3e-7, None)),  # the ladder's end
    ],
)
def test_the_rate_is_the_best_validation_mean_and_an_edge_extends_the_grid(scores, expected):
    assert study.choose_rate(scores) == expected


def record(split: str, method: str, seed: int, rate: float, value: float) -> dict:
    return {"split": split, "method": method, "seed": seed, "learning_rate": rate, "pass@1": value}


def validation(method: str, means: dict[float, float]) -> list[dict]:
    return [record("validation", method, s, r, v) for r, v in means.items() for s in study.VALIDATION_SEEDS]


def test_the_queue_holds_each_methods_pending_rates_then_its_chosen_rate_on_the_held_out_seeds(monkeypatch):
    # two validation seeds, as pre-registered before the resize: a rate is complete only when both are in
    monkeypatch.setattr(study, "VALIDATION_SEEDS", (100, 101))
    monkeypatch.setattr(study, "SPLITS", {"validation": (100, 101), "test": study.TEST_SEEDS})
    records = validation("topr", {3e-6: 0.2, 1e-5: 0.5, 3e-5: 0.4}) + validation("tis", {3e-6: 0.6, 1e-5: 0.5})
    records.append(record("validation", "ppo", study.VALIDATION_SEEDS[0], 3e-6, 0.1))  # one seed of one rate
    queue = study.planned_runs("validation", records)
    # topr is final; tis still needs 3e-5; ppo its second seed at 3e-6 and both at the other rates
    assert not [run for run in queue if run[0] == "topr"]
    assert [run for run in queue if run[0] == "tis"] == [("tis", s, 3e-5) for s in study.VALIDATION_SEEDS]
    assert ("ppo", study.VALIDATION_SEEDS[0], 3e-6) not in queue and ("ppo", study.VALIDATION_SEEDS[1], 3e-6) in queue
    # held out: topr alone, at its choice, every held-out seed, none of the validation seeds
    held_out = study.planned_runs("test", records)
    assert held_out == [("topr", seed, 1e-5) for seed in study.TEST_SEEDS]
    assert not set(study.TEST_SEEDS) & set(study.VALIDATION_SEEDS)
    # an edge choice extends the grid by one rate on the validation seeds before any held-out run
    records = validation("sft_positives", {3e-6: 0.2, 1e-5: 0.3, 3e-5: 0.4})
    assert {run for run in study.planned_runs("validation", records) if run[0] == "sft_positives"} == {
        ("sft_positives", s, 1e-4) for s in study.VALIDATION_SEEDS
    }
    assert not [run for run in study.planned_runs("test", records) if run[0] == "sft_positives"]


def test_a_claim_keeps_a_run_for_its_live_lane_and_frees_it_when_the_lane_is_gone(tmp_path):
    assert study.claim("validation-topr-seed100-lr1e-05", tmp_path)
    assert study.claim("validation-topr-seed100-lr1e-05", tmp_path)  # its own claim
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "held.claim").write_text(str(other.pid))
        assert not study.claim("held", tmp_path)  # another live lane's
    finally:
        other.kill()
        other.wait()
    assert study.claim("held", tmp_path)  # its lane has ended: taken over
    assert (tmp_path / "held.claim").read_text() == str(os.getpid())


def test_the_summary_compares_topr_with_each_method_at_its_own_rate_with_holm_verdicts():
    rates = {3e-6: 0.2, 1e-5: 0.5, 3e-5: 0.4}
    records = [r for method in study.METHODS for r in validation(method, rates)]
    for seed in study.TEST_SEEDS:
        records.append(record("test", "topr", seed, 1e-5, 0.6 + 0.01 * seed))
        records.append(record("test", "tis", seed, 1e-5, 0.3))  # below topr on every seed
        records.append(record("test", "ppo", seed, 1e-5, 0.6 + 0.01 * seed + (0.05 if seed % 2 else -0.05)))
        records.append(record("test", "sft_positives", seed, 1e-5, 0.5))
        records.append(record("test", "topr_whole_vocabulary", seed, 1e-5, 0.55 + 0.02 * seed))
        records.append(record("test", "tis", seed, 3e-5, 0.9))  # not its chosen rate: left out
    summary = study.summarise(records)
    assert summary["complete"]
    rows = {row["b"]: row for row in summary["comparisons"]}
    assert set(rows) == set(study.COMPARED) and all(row["a"] == "topr" for row in rows.values())
    assert rows["tis"]["difference"] == pytest.approx(statistics_mean([0.3 + 0.01 * s for s in study.TEST_SEEDS]))
    # 10 seeds of one sign: p = 2/1024; Holm multiplies the smallest by the 4 comparisons
    assert rows["tis"]["p"] == pytest.approx(2 / 2 ** len(study.TEST_SEEDS))
    assert rows["tis"]["verdict"] == "above" and rows["sft_positives"]["verdict"] == "above"
    assert rows["ppo"]["difference"] == pytest.approx(0.0, abs=1e-12) and rows["ppo"]["verdict"] == "undecided"
    expected = study.holm({b: row["p"] for b, row in rows.items()})
    assert {b: row["p_holm"] for b, row in rows.items()} == pytest.approx(expected)
    json.dumps(summary)  # the file it writes


def statistics_mean(values):
    return sum(values) / len(values)


def test_an_unfinished_study_says_so_instead_of_a_verdict():
    records = [r for method in study.METHODS for r in validation(method, {3e-6: 0.2, 1e-5: 0.5, 3e-5: 0.4})]
    records += [record("test", m, s, 1e-5, 0.5 + 0.1 * (m == "topr")) for m in study.METHODS for s in (0, 1, 2)]
    summary = study.summarise(records)
    assert not summary["complete"]
    assert {row["verdict"] for row in summary["comparisons"]} == {"incomplete"}
