"""experiments/staleness.py: the completions formula for a lag, the largest-tolerated-lag rule, the run averages of the
logged statistics (fast), and the --smoke run end to end (slow set)."""

import json
import math

import pytest

from experiments import staleness

from .conftest import script_refusal  # noqa: E402


def test_expected_completions_for_a_lag():
    expected = staleness.expected_completions
    # num_iterations = K: one batch of 32 every K steps, 64 steps
    assert [expected(k, steps=64, batch_size=32) for k in (1, 4, 16, 64)] == [2048, 512, 128, 32]
    assert expected(3, steps=8, batch_size=16) == 3 * 16  # generations at steps 0, 3, 6: the last one half used
    assert expected(64, steps=8, batch_size=16) == 16  # a lag longer than the run still generates once
    # steps_per_generation = K: a K-times larger batch every K steps, as many completions as on-policy
    assert [expected(k, steps=64, batch_size=32, lag_via="steps_per_generation") for k in (1, 4, 64)] == [2048] * 3
    # reuse_spacing S: S batches every S x K steps, each reused every S steps; the same completions as S = 1
    assert [expected(4, steps=64, batch_size=32, reuse_spacing=s) for s in (1, 4, 16)] == [512] * 3
    assert expected(4, steps=64, batch_size=32, reuse_spacing=32) == 1024  # one generation of 32 batches, half used
    with pytest.raises(ValueError, match="unknown lag_via"):
        expected(4, steps=8, batch_size=16, lag_via="epochs")
    with pytest.raises(ValueError, match=">= 1"):
        expected(0, steps=8, batch_size=16)


def final(mean, ci95=0.05):
    return {"mean": mean, "ci95": ci95}


def test_largest_tolerated_lag_stops_at_the_first_degradation():
    rule = staleness.largest_tolerated_lag
    # threshold 0.70 - 0.05 = 0.65: K = 4 is inside, K = 16 falls below, K = 64's recovery does not count
    outcome = rule({1: final(0.70), 4: final(0.66, 0.2), 16: final(0.60), 64: final(0.69)})
    assert outcome["lag"] == 4
    assert outcome["threshold"] == pytest.approx(0.65)
    assert outcome["within"] == {1: True, 4: True, 16: False, 64: True}
    # an improvement is not a degradation; the boundary counts as within
    assert rule({1: final(0.70), 4: final(0.90), 16: final(0.65), 64: final(0.6499)})["lag"] == 16
    # only K = 1's CI sets the tolerance, not the lagged runs' own CIs
    assert rule({1: final(0.70, 0.01), 4: final(0.68, 0.5)})["lag"] == 1
    with pytest.raises(ValueError, match="K = 1"):
        rule({4: final(0.7)})
    with pytest.raises(ValueError, match="not finite"):
        rule({1: final(0.7, float("nan")), 4: final(0.7)})


def test_run_averages_take_the_logged_statistics_over_steps_leaving_out_nan():
    history = [
        {"step": 1, "loss": 0.3, "topr/ratio_negative/min": 1.0, "topr/negative_truncated_fraction": 0.0},
        {
            "step": 2,
            "loss": 0.2,
            "topr/ratio_negative/min": 0.5,
            "topr/negative_truncated_fraction": 0.2,
            "clip_ratio/region_mean": 0.1,
        },
        {"step": 3, "topr/ratio_negative/min": float("nan"), "topr/negative_truncated_fraction": 0.4},
        {"train_runtime": 9.0, "train_loss": 0.25},  # the final summary entry has none of them
    ]
    averages = staleness.run_averages(history)
    assert averages == {
        "clip_ratio/region_mean": pytest.approx(0.1),
        "topr/negative_truncated_fraction": pytest.approx(0.2),
        "topr/ratio_negative/min": pytest.approx(0.75),
    }


def run(method, lag, seed, pass_at_1, se=0.02):
    return {
        "method": method,
        "lag": lag,
        "seed": seed,
        "completions": 32 // lag,
        "seconds": 1.0,
        "logged": {"topr/ratio_negative/min": 1.0 / lag},
        "curve": [{"pass@1": pass_at_1, "pass@1_problem_se": se}],
    }


def test_summary_uses_seed_cis_or_the_problem_se_for_one_seed():
    runs = {
        f"{m}/k{k}/seed{s}": run(m, k, s, p)
        for m, k, s, p in [
            ("topr", 1, 0, 0.70),
            ("topr", 1, 1, 0.74),
            ("topr", 4, 0, 0.40),
            ("topr", 4, 1, 0.42),
            ("grpo_clip", 1, 0, 0.70),
            ("grpo_clip", 4, 0, 0.67),
        ]
    }
    summary = staleness.summarise(runs, staleness.METHODS, [1, 4, 16])
    topr = summary["topr"]
    assert set(topr["lags"]) == {1, 4}  # K = 16 not run: no row
    assert topr["lags"][1]["final_pass@1"]["mean"] == pytest.approx(0.72)
    assert topr["lags"][1]["final_pass@1"]["ci95"] == pytest.approx(12.71 * math.sqrt(0.0008) / math.sqrt(2))
    assert topr["lags"][4]["logged"]["topr/ratio_negative/min"] == pytest.approx(0.25)
    assert topr["largest_tolerated_lag"]["lag"] == 1  # 0.41 < 0.72 - 0.254 (t with 1 dof is wide)
    one_seed = summary["grpo_clip"]["lags"][1]["final_pass@1"]
    assert one_seed["ci95"] == pytest.approx(1.96 * 0.02)  # 0.70 - 0.039 = 0.661 <= 0.67
    assert summary["grpo_clip"]["largest_tolerated_lag"]["lag"] == 4


def test_options_are_checked(capsys):
    refused = [
        script_refusal(staleness.main, argv, capsys)
        for argv in (
            ["--lags", "4", "16"],  # no on-policy reference
            ["--batch_size", "12", "--num_generations", "8"],
            ["--methods", "ppo"],
            ["--lag_via", "steps_per_generation", "--reuse_spacing", "4"],
            ["--reuse_spacing", "0"],
        )
    ]
    assert "--lags must be >= 1 and include 1" in refused[0]
    assert "--batch_size must be a multiple of --num_generations" in refused[1]
    assert "argument --methods: invalid choice: 'ppo'" in refused[2]
    assert all(
        "--reuse_spacing must be >= 1, and above 1 only with --lag_via num_iterations" in message
        for message in refused[3:]
    )


@pytest.mark.slow
def test_smoke_run_has_every_method_and_lag_with_the_formulas_completions(evidence_work_dir, tmp_path):
    # the warm model is built once per session under the shared work dir (~2-3 min on one thread)
    output = tmp_path / "staleness"
    staleness.main(["--smoke", "--work_dir", str(evidence_work_dir), "--output", str(output)])
    results = json.loads(output.with_suffix(".json").read_text())
    options = results["options"]
    assert results["threads"]["torch"] == 1
    runs = results["runs"]
    assert {(r["method"], r["lag"]) for r in runs.values()} == {
        (m, k) for m in staleness.METHODS for k in options["lags"]
    }
    for run_ in runs.values():
        expected = staleness.expected_completions(
            run_["lag"],
            steps=options["steps"],
            batch_size=options["batch_size"],
            lag_via=options["lag_via"],
            reuse_spacing=options["reuse_spacing"],
        )
        assert run_["completions"] == run_["expected_completions"] == expected
        assert run_["steps"] == options["steps"]
        assert run_["num_iterations"] == run_["lag"]
        assert run_["loss_type"] == ("grpo" if run_["method"] == "grpo_clip" else "topr")
    # on-policy (K = 1) TOPR's and PPO-clip's gradients coincide: the same final pass@1 (equal to the last digit in
    # every full run so far)
    assert runs["topr/k1/seed0"]["curve"][-1]["pass@1"] == pytest.approx(
        runs["grpo_clip/k1/seed0"]["curve"][-1]["pass@1"], abs=0.02
    )
    assert "topr/negative_truncated_fraction" in runs["topr/k4/seed0"]["logged"]
    assert set(results["summary"]) == set(staleness.METHODS)
    assert output.with_suffix(".png").exists()


def test_paired_comparisons_take_the_late_pass_at_1_per_seed():
    def curved(method, lag, seed, late):
        return {
            "method": method,
            "lag": lag,
            "seed": seed,
            "curve": [{"step": 0, "pass@1": 0.6}, {"step": 32, "pass@1": 0.1}, {"step": 64, "pass@1": late}],
        }

    runs = {
        f"{m}/k{k}/seed{s}": curved(m, k, s, late)
        for m, k, s, late in [
            ("topr", 1, 0, 0.80),
            ("topr", 1, 1, 0.82),
            ("topr", 4, 0, 0.70),
            ("topr", 4, 1, 0.76),
            ("grpo_clip", 1, 0, 0.80),
            ("grpo_clip", 4, 0, 0.50),
            ("grpo_clip", 4, 1, 0.56),
        ]
    }
    paired = staleness.paired_comparisons(runs, staleness.METHODS, [1, 4, 16])
    # the last quarter of 64 steps is the final checkpoint: the dip at step 32 does not count
    assert paired["topr/k4-k1"]["values"] == pytest.approx([-0.10, -0.06])
    assert paired["grpo_clip/k4-k1"]["seeds"] == [0]  # seed 1 has no K = 1 run
    assert paired["topr-grpo_clip/k4"]["values"] == pytest.approx([0.20, 0.20])
    assert paired["topr-grpo_clip/k1"]["seeds"] == [0]
    assert not any("k16" in name for name in paired)  # not run


def test_resummarise_recomputes_a_finished_runs_json(tmp_path):
    runs = {
        f"{m}/k{k}/seed{s}": {
            **run(m, k, s, p),
            "curve": [
                {"step": 0, "pass@1": 0.6, "pass@1_problem_se": 0.02},
                {"step": 64, "pass@1": p, "pass@1_problem_se": 0.02},
            ],
        }
        for m, k, s, p in [("topr", 1, 0, 0.8), ("topr", 4, 0, 0.7), ("topr", 1, 1, 0.9), ("topr", 4, 1, 0.6)]
    }
    path = tmp_path / "old.json"
    path.write_text(
        json.dumps(
            {
                "runs": runs,
                "base": {"pass@1": 0.6},
                "summary": {},
                "options": {"seeds": [0, 1], "lags": [1, 4], "lag_via": "num_iterations"},
            }
        )
    )
    staleness.main(["--resummarise", str(path)])
    rewritten = json.loads(path.read_text())
    assert rewritten["paired"]["topr/k4-k1"]["values"] == pytest.approx([-0.1, -0.3])
    assert rewritten["summary"]["topr"]["lags"]["4"]["late_pass@1"]["mean"] == pytest.approx(0.65)
    assert path.with_suffix(".png").exists()
