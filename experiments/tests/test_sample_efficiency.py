"""experiments/sample_efficiency.py: the completion counts and the completions-to-reach computation (fast), and the
--smoke run end to end (slow set)."""

import json
from types import SimpleNamespace

import pytest

from experiments import sample_efficiency

from .conftest import script_refusal  # noqa: E402


COUNTS = dict(steps=5, batch_size=32, num_generations=8, prompts=10, iterations=3, iteration_prompts=7)


def point(completions, seconds, pass_at_1, step=None):
    return {
        "completions": completions,
        "seconds": seconds,
        "pass@1": pass_at_1,
        **({} if step is None else {"step": step}),
    }


def test_first_reaching_takes_the_first_point_at_or_above_the_target():
    curve = [point(0, 0.0, 0.60), point(100, 2.0, 0.70), point(200, 4.0, 0.66), point(300, 6.0, 0.75)]
    assert sample_efficiency.first_reaching(curve, 0.70) == curve[1]  # equal counts as reached
    assert sample_efficiency.first_reaching(curve, 0.72) == curve[3]  # the dip at 200 does not count
    assert sample_efficiency.first_reaching(curve, 0.80) is None
    assert sample_efficiency.first_reaching(curve, 0.50) == curve[0]  # the base model already reaches it


def test_summary_reports_per_seed_reach_and_never():
    runs = {
        "grpo/seed0": {
            "method": "grpo",
            "seed": 0,
            "target": 0.7,
            "completions": 300,
            "seconds": 6.0,
            "steps": 4,
            "curve": [point(0, 0, 0.6, 0), point(150, 3, 0.65, 2), point(300, 6, 0.7, 4)],
        },
        "grpo/seed1": {
            "method": "grpo",
            "seed": 1,
            "target": 0.8,
            "completions": 300,
            "seconds": 7.0,
            "steps": 4,
            "curve": [point(0, 0, 0.6, 0), point(150, 3, 0.85, 2), point(300, 7, 0.8, 4)],
        },
        # an offline run's curve: the base model, the base model after the generation (no step yet), then steps
        "topr_offline_k2/seed0": {
            "method": "topr_offline_k2",
            "seed": 0,
            "target": 0.7,
            "completions": 80,
            "seconds": 2.0,
            "steps": 2,
            "curve": [point(0, 0, 0.6), point(80, 0.5, 0.6), point(80, 1, 0.72, 1), point(80, 2, 0.74, 2)],
        },
        "topr_offline_k2/seed1": {
            "method": "topr_offline_k2",
            "seed": 1,
            "target": 0.8,
            "completions": 80,
            "seconds": 2.0,
            "steps": 2,
            "curve": [point(0, 0, 0.6), point(80, 0.5, 0.6), point(80, 1, 0.7, 1), point(80, 2, 0.75, 2)],
        },
        "topr_iterated/seed0": {
            "method": "topr_iterated",
            "seed": 0,
            "target": 0.7,
            "completions": 160,
            "seconds": 3.0,
            "steps": [1, 2],
            "curve": [
                point(0, 0, 0.6, 0),
                {**point(80, 2, 0.7), "iteration": 1},
                {**point(160, 3, 0.9), "iteration": 2},
            ],
        },
    }
    summary = sample_efficiency.summarise(runs, ["grpo", "topr_offline_k2", "topr_iterated", "sft_offline_k2"])
    assert summary["grpo"]["completions_to_target"] == [300, 150]
    assert summary["grpo"]["seconds_to_target"] == [6, 3]
    assert summary["topr_offline_k2"]["completions_to_target"] == [80, None]
    assert summary["topr_offline_k2"]["seconds_to_target"] == [1, None]
    assert summary["topr_offline_k2"]["reached"] == "1/2"
    assert summary["topr_offline_k2"]["final_pass@1"]["mean"] == pytest.approx(0.745)
    assert "sft_offline_k2" not in summary  # not run: no row rather than an empty one
    # the robust end point: the checkpoints in the last quarter of the steps (grpo: step 4 of 4; offline: step 2 of 2)
    assert summary["grpo"]["late_pass@1"]["values"] == [0.7, 0.8]
    assert summary["topr_offline_k2"]["late_pass@1"]["values"] == [0.74, 0.75]
    paired = summary["topr_offline_k2"]["late_minus_grpo"]
    assert paired["values"] == pytest.approx([0.04, -0.05]) and paired["seeds"] == [0, 1]
    assert summary["grpo"]["late_minus_grpo"] is None
    assert summary["topr_iterated"]["late_minus_grpo"]["seeds"] == [0]  # only the seeds both have
    assert summary["topr_iterated"]["late_pass@1"]["values"] == [0.9]  # iteration 2 of 2
    assert summary["topr_offline_k2"]["topr_minus_this"] is None  # not a control
    # the steps each method took, so unequal budgets are read as such (iterated: summed over its iterations)
    assert summary["grpo"]["steps"]["mean"] == 4 and summary["topr_iterated"]["steps"]["mean"] == 3


def test_a_reuse_control_is_compared_with_topr_at_the_same_passes():
    def offline(method, seed, late):
        return {
            "method": method,
            "seed": seed,
            "target": 0.5,
            "completions": 80,
            "seconds": 1.0,
            "steps": 4,
            "curve": [point(0, 0, 0.6, 0), point(80, 1, late, 4)],
        }

    runs = {
        f"{m}/seed{s}": offline(m, s, late)
        for m, s, late in [
            ("topr_offline_k4", 0, 0.9),
            ("topr_offline_k4", 1, 0.8),
            ("sft_offline_k4", 0, 0.85),
            ("sft_offline_k4", 1, 0.82),
            ("ppo_offline_k2", 0, 0.5),
        ]
    }
    summary = sample_efficiency.summarise(runs, ["topr_offline_k4", "sft_offline_k4", "ppo_offline_k2"])
    assert summary["sft_offline_k4"]["topr_minus_this"]["values"] == pytest.approx([0.05, -0.02])
    assert summary["ppo_offline_k2"]["topr_minus_this"] is None  # no TOPR run with 2 passes


def test_expected_completions_follow_each_methods_formula():
    expected = sample_efficiency.expected_completions
    assert expected("grpo", **COUNTS) == 5 * 32  # G x (B / G) prompts x steps
    assert expected("topr_online", **COUNTS) == 5 * 32
    for k in (1, 2, 4):  # passes over the dataset generate nothing more
        assert expected(f"topr_offline_k{k}", **COUNTS) == 10 * 8
    assert expected("topr_iterated", **COUNTS) == 3 * 7 * 8
    assert expected("sft_offline_k4", **COUNTS) == expected("ppo_offline_k4", **COUNTS) == 10 * 8
    with pytest.raises(ValueError, match="unknown method"):
        expected("ppo", **COUNTS)


def test_method_names_add_each_control_at_the_largest_number_of_passes():
    names = sample_efficiency.method_names([1, 4, 2], ["sft", "ppo"])
    assert names[-2:] == ["sft_offline_k4", "ppo_offline_k4"]
    assert sample_efficiency.offline_method("ppo_offline_k4") == ("ppo", 4)
    assert sample_efficiency.offline_method("topr_offline_k2") == ("topr", 2)
    assert sample_efficiency.offline_method("topr_iterated") is None
    assert sample_efficiency.offline_method("dapo_offline_k4") is None


def test_options_are_checked(capsys):
    assert "unknown methods ['topr_offline_k3']" in script_refusal(
        sample_efficiency.main, ["--methods", "topr_offline_k3", "--offline_epochs", "1", "2"], capsys
    )
    assert "--batch_size must be a multiple of --num_generations" in script_refusal(
        sample_efficiency.main, ["--batch_size", "12", "--num_generations", "8"], capsys
    )
    for rates in (["grpo"], ["gpro=1e-4"], ["grpo=-1"]):
        assert "each must be METHOD=RATE" in script_refusal(
            sample_efficiency.main, ["--method_learning_rates", *rates], capsys
        )
    assert "expected METHOD=RATE" in script_refusal(
        sample_efficiency.main, ["--method_learning_rates", "grpo=fast"], capsys
    )


def test_a_method_trains_at_its_own_learning_rate(tmp_path):
    options = SimpleNamespace(
        batch_size=32, num_generations=8, digits=3, learning_rate=3e-4, method_learning_rates={"grpo": 1e-4}
    )
    assert sample_efficiency.method_config("grpo", options, 0, tmp_path)["learning_rate"] == 1e-4
    assert sample_efficiency.method_config("topr_online", options, 0, tmp_path)["learning_rate"] == 3e-4


@pytest.mark.slow
def test_smoke_run_counts_completions_and_beats_the_base_model(evidence_work_dir, tmp_path):
    # the warm model is built once per session under the shared work dir (~2-3 min on one thread)
    output = tmp_path / "sample_efficiency"
    sample_efficiency.main(["--smoke", "--work_dir", str(evidence_work_dir), "--output", str(output)])
    results = json.loads(output.with_suffix(".json").read_text())
    options = results["options"]
    counts = {name: options[name] for name in COUNTS}
    assert results["threads"]["torch"] == 1
    assert set(results["summary"]) == set(
        sample_efficiency.method_names(options["offline_epochs"], options["controls"])
    )
    assert {run["loss_type"] for run in results["runs"].values() if run["method"].endswith("_offline_k4")} == {
        "topr",
        "sft",
        "ppo",
    }
    for run in results["runs"].values():
        curve = run["curve"]
        completions = [p["completions"] for p in curve]
        assert completions == sorted(completions), run["method"]
        assert run["completions"] == completions[-1]
        assert run["completions"] == run["expected_completions"]
        assert run["expected_completions"] == sample_efficiency.expected_completions(run["method"], **counts)
        assert run["target"] == results["runs"]["grpo/seed0"]["curve"][-1]["pass@1"]  # the default target
        assert [p["seconds"] for p in curve] == sorted(p["seconds"] for p in curve)
    # every run's final model is the trained one, not the base model: the evaluation is seeded, so an unchanged model
    # would score exactly the base model's point on the same draw. Whether the runs improve is the full run's question: at this size
    # (8 steps of 2 prompts) the head-32 reasoning model ends below its base (0.43-0.52 against 0.57, 64 problems x
    # 2 samples), where the earlier head-16 model's k = 4 run ended above it (0.71 against 0.60)
    # pass@1 alone is coarse here (k/128: a trained model can land on the base's value, as topr_offline_k1 did on
    # seed 0's draw, 88/128), so the whole point is compared: its per-problem spread and carries score as well
    measures = ("pass@1", "pass@1_problem_se", "pass@1_carries>=2", "invalid_rate")
    base = results["base"]["by_seed"]["0"]
    for run in results["runs"].values():
        assert [run["curve"][-1][m] for m in measures] != [base[m] for m in measures], run["method"]
    assert output.with_suffix(".png").exists()


def test_resummarise_adds_the_current_summary_to_a_finished_run(tmp_path):
    runs = {
        "topr_offline_k4/seed0": {
            "method": "topr_offline_k4",
            "seed": 0,
            "target": 0.5,
            "completions": 80,
            "seconds": 1.0,
            "steps": 4,
            "curve": [point(0, 0, 0.6, 0), point(80, 1, 0.9, 4)],
        },
        "sft_offline_k4/seed0": {
            "method": "sft_offline_k4",
            "seed": 0,
            "target": 0.5,
            "completions": 80,
            "seconds": 1.0,
            "steps": 4,
            "curve": [point(0, 0, 0.6, 0), point(80, 1, 0.8, 4)],
        },
    }
    path = tmp_path / "old.json"
    for run in runs.values():
        for checkpoint in run["curve"]:
            checkpoint["pass@1_problem_se"] = 0.01
    path.write_text(json.dumps({"runs": runs, "summary": {}, "options": {"seeds": [0]}}))
    sample_efficiency.main(["--resummarise", str(path)])
    summary = json.loads(path.read_text())["summary"]
    assert summary["sft_offline_k4"]["topr_minus_this"]["values"] == pytest.approx([0.1])
    assert path.with_suffix(".png").exists()
