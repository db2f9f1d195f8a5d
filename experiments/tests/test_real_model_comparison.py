"""experiments/real_model_comparison.py: the summary of the real model's paired runs, computed again here by hand,
and a rerun that skips the runs on disk (runs spread over lanes and sessions)."""

from __future__ import annotations

import json
import statistics

import pytest

from experiments import real_model_comparison as comparison


def run(part: str, method: str, seed: int, late: tuple[float, float], weights: list[float] | None = None) -> dict:
    """A run whose curve has a start, a mid checkpoint and two late checkpoints (steps 28 and 32 of 32)."""
    points = [(0, 0.25), (16, 0.9), (28, late[0]), (32, late[1])]
    curve = [
        {
            "step": step,
            "pass@1": value,
            "greedy_accuracy": value / 2,
            "mean_completion_tokens": 30.0,
            "truncated_rate": 0.1,
        }
        for step, value in points
    ]
    return {
        "part": part,
        "method": method,
        "seed": seed,
        "measure": "sampled pass@1",
        "seconds": 100.0 + seed,
        "options": {
            "steps": 32,
            "prompts": 12,
            "epochs": 3.0,
            "batch_size": 8,
            "num_generations": 8,
            "learning_rate": 3e-5,
            "top_k": 500,
            "eval_prompts": 48,
            "eval_samples": 4,
            "checkpoints": [0.5, 0.875, 1.0],
            "eval_split": "heldout",
            "eval_draw": "per_seed",
        },
        "curve": curve,
        "negative_weights": [
            {"step": i + 1, "weight_negative": w, "negative_truncated_fraction": 0.0}
            for i, w in enumerate(weights or [])
        ],
    }


def test_the_summary_is_the_late_mean_and_the_paired_difference_by_seed():
    runs = [
        run("off_policy", "topr", 0, (0.5, 0.7), [1.0, 0.5]),
        run("off_policy", "topr", 1, (0.4, 0.4), [0.2, 0.4]),
        run("off_policy", "tis", 0, (0.3, 0.3), [1.0, 1.0]),
        run("off_policy", "tis", 1, (0.6, 0.4)),
        run("off_policy", "ppo", 0, (0.1, 0.1)),
    ]
    summary = comparison.summarise("off_policy", runs)
    # the late value averages the checkpoints after 3/4 of the steps (28 and 32), not the mid one (16)
    assert summary["late"]["topr"]["pass@1"]["values"] == pytest.approx([0.6, 0.4])
    assert summary["late"]["topr"]["greedy_accuracy"]["mean"] == pytest.approx(0.25)
    # TOPR - TIS per seed: 0.6 - 0.3 and 0.4 - 0.5; a t-interval with one degree of freedom (12.71)
    differences = [0.3, -0.1]
    paired = summary["paired"]["topr-tis"]["pass@1"]
    assert paired["mean"] == pytest.approx(0.1)
    assert paired["ci95"] == pytest.approx(12.71 * statistics.stdev(differences) / 2**0.5)
    # TOPR - PPO has one shared seed only
    assert summary["paired"]["topr-ppo"]["pass@1"]["seeds"] == [0]
    assert summary["paired"]["topr-ppo"]["pass@1"]["mean"] == pytest.approx(0.5)
    # the negatives' weight: each run's mean over its steps, then the mean over seeds (runs without a log left out)
    assert summary["negatives"]["topr"]["weight_negative"]["mean"] == pytest.approx((0.75 + 0.3) / 2)
    assert summary["negatives"]["tis"]["weight_negative"]["values"] == [1.0]
    assert "ppo" not in summary["negatives"]
    assert summary["start"]["pass@1"]["mean"] == pytest.approx(0.25)
    assert summary["seeds"] == [0, 1]


def test_a_rerun_skips_the_runs_on_disk(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    runs.mkdir()
    options = comparison.parse(
        [
            "--part",
            "online",
            "--seeds",
            "3",
            "--runs",
            str(runs),
            "--methods",
            "topr",
            "--work_dir",
            str(tmp_path / "work"),
        ]
    )
    record = run("online", "topr", 3, (0.5, 0.5))
    comparison.run_file(options, "topr", 3).write_text(json.dumps(record))
    (runs / "start-seed3.json").write_text(json.dumps(record["curve"][0]))

    def refuse(*args, **kwargs):
        raise AssertionError("a run on disk was trained again")

    monkeypatch.setitem(comparison.RUNNERS, "online", refuse)
    comparison.train(options)
    assert "seed 3 topr: on disk" in capsys.readouterr().out


def test_a_method_of_another_part_is_refused(capsys):
    with pytest.raises(SystemExit):
        comparison.parse(["--part", "online", "--methods", "tis"])
    assert "the online part has ['topr', 'grpo', 'sft_positives']" in capsys.readouterr().err


def test_the_summary_gathers_one_split_and_one_learning_rate(tmp_path):
    """Settings are chosen on the validation split: a summary never mixes learning rates or splits."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for learning_rate, split, late in ((3e-5, "heldout", 0.5), (1e-4, "heldout", 0.9), (3e-5, "validation", 0.1)):
        record = run("online", "topr", 0, (late, late))
        record["options"] |= {"learning_rate": learning_rate, "eval_split": split}
        suffix = "" if split == "heldout" else f"-{split}"
        (runs / f"online-topr-seed0-lr{learning_rate:g}{suffix}.json").write_text(json.dumps(record))
    output = tmp_path / "summary"
    options = comparison.parse(["--summarise", "--runs", str(runs), "--output", str(output), "--learning_rate", "3e-5"])
    summary = comparison.gather(options)["online"]
    assert summary["late"]["topr"]["pass@1"]["values"] == [0.5]
    assert summary["runs"] == [str(runs / "online-topr-seed0-lr3e-05.json")]
    assert (tmp_path / "summary_online-lr3e-05.json").is_file()


def test_the_figure_takes_seeds_whose_negatives_were_logged_at_different_steps(tmp_path):
    """Online, a step whose completions were all correct logs no negative, so the seeds' logs differ in length (the
    first three-seed summary failed on this)."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for seed, weights in ((0, [1.0, 0.5, 0.25]), (1, [0.2])):
        record = run("online", "topr", seed, (0.5, 0.5), weights)
        (runs / f"online-topr-seed{seed}-lr3e-05.json").write_text(json.dumps(record))
    output = tmp_path / "summary"
    options = comparison.parse(["--summarise", "--runs", str(runs), "--output", str(output), "--learning_rate", "3e-5"])
    summary = comparison.gather(options)["online"]
    assert summary["negatives"]["topr"]["weight_negative"]["values"] == pytest.approx([1.75 / 3, 0.2])
    assert (tmp_path / "summary_online-lr3e-05.png").stat().st_size > 0
