"""Reduced runs of the evidence scripts (slow set): each runs from the repository, writes its JSON and PNG, and
reports what its docstring promises. Only orderings seen in every full run are asserted."""

import json
from pathlib import Path

import pytest

from .conftest import script_refusal


@pytest.mark.slow
def test_baseline_sweep_sets_the_effective_proportion(evidence_work_dir, tmp_path):
    from experiments import baseline_sweep

    results = baseline_sweep.main(
        [
            "--seeds",
            "0",
            "--targets",
            "0.01",
            "1.0",
            "--methods",
            "topr",
            "--epochs",
            "2",
            "--prompts",
            "32",
            "--eval_prompts",
            "200",
            "--eval_samples",
            "2",
            "--work_dir",
            str(evidence_work_dir),
            "--output",
            str(tmp_path / "sweep"),
        ]
    )
    runs = results["runs"]
    nearly_all_negative, positives_only = runs["p0.67/pt0.01/topr/seed0"], runs["p0.67/pt1/topr/seed0"]
    assert nearly_all_negative["measured_p"] == pytest.approx(0.67, abs=0.01)
    assert positives_only["baseline"] == -1.0 and nearly_all_negative["baseline"] > 0.9
    assert nearly_all_negative["curve"][-1]["accuracy"] < positives_only["curve"][-1]["accuracy"]
    assert json.loads((tmp_path / "sweep.json").read_text())["summary"]["start_accuracy"] > 0.5
    assert (tmp_path / "sweep.png").exists()


@pytest.mark.slow
def test_figure7_untruncated_importance_weights_spike_the_gradient(evidence_work_dir, tmp_path):
    from experiments import figure7

    # the low-p stress test on the built-in task with its documented settings (experiments/README.md), where untruncated
    # IS's largest gradient is above TOPR's in every seed
    results = figure7.main(
        [
            "--task",
            "arithmetic",
            "--proportion",
            "0.1",
            "--seeds",
            "0",
            "--epochs",
            "15",
            "--learning_rate",
            "2e-4",
            "--eval_prompts",
            "100",
            "--eval_every",
            "1000",
            "--work_dir",
            str(evidence_work_dir),
            "--output",
            str(tmp_path / "figure7"),
        ]
    )
    summary = results["summary"]
    assert results["task"] == "arithmetic"
    assert summary["untruncated_is"]["max_grad_norm"]["mean"] > summary["topr"]["max_grad_norm"]["mean"]
    assert len(results["runs"]["topr/seed0"]["grad_norms"]) == results["runs"]["topr/seed0"]["curve"][-1]["step"]
    assert (tmp_path / "figure7.png").exists()


@pytest.mark.slow
def test_iterations_report_each_strategy(evidence_work_dir, tmp_path):
    from experiments import iterations

    results = iterations.main(
        [
            "--seeds",
            "0",
            "--iterations",
            "1",
            "--prompts",
            "16",
            "--eval_prompts",
            "100",
            "--eval_samples",
            "2",
            "--batch_size",
            "8",
            "--steps_per_iteration",
            "20",
            "--work_dir",
            str(evidence_work_dir),
            "--output",
            str(tmp_path / "iterations"),
        ]
    )
    assert set(results["summary"]) == {"uniform", "positives_only", "anna_karenina"}
    # equal steps: 20 for every composition, though one pass over 16 x 8 rows in batches of 8 is 16 steps, and
    # fewer over the curated ones
    assert {run["strategy"]: run["steps"] for run in results["runs"].values()} == {
        "uniform": [20],
        "positives_only": [20],
        "anna_karenina": [20],
    }
    assert all(run["rows"][0] < 160 for run in results["runs"].values())
    proportions = {run["strategy"]: run["proportion_of_positives"][0] for run in results["runs"].values()}
    assert proportions["positives_only"] == 1.0 and proportions["anna_karenina"] < proportions["uniform"] < 1
    assert (tmp_path / "iterations.png").exists()


def test_fixed_datasets_are_kept_apart_by_behaviour_model(tiny_model_path, behaviour_model_path, tmp_path):
    """Data sampled from one model is never reused as another's (the folder is named after mu)."""
    from experiments import common
    from topr_trl.tasks.arithmetic import arithmetic_reward, make_arithmetic_dataset

    testbed = common.Testbed(
        task="arithmetic",
        base_dir=Path(tiny_model_path),
        held_out=None,
        reward=arithmetic_reward,
        max_new_tokens=3,
        measure="",
        metrics=("accuracy",),
        prompts=lambda count, seed: make_arithmetic_dataset(count, 1, seed=seed),
        evaluate=lambda model, tokenizer, eval_seed: {},
    )
    from_base = common.sample_fixed_dataset(testbed, 2, 0, tmp_path)
    from_other = common.sample_fixed_dataset(testbed, 2, 0, tmp_path, behaviour=Path(behaviour_model_path))
    folders = sorted(path.name for path in (tmp_path / "data").iterdir())
    assert folders == sorted(
        {f"{Path(tiny_model_path).name}-2x8-seed0", f"{Path(behaviour_model_path).name}-2x8-seed0"}
    )
    assert from_base["behaviour_logps"] != from_other["behaviour_logps"]
    again = common.sample_fixed_dataset(testbed, 2, 0, tmp_path)
    assert again["completion_ids"] == from_base["completion_ids"]


def test_each_training_seed_has_its_own_evaluation_draw_shared_by_every_method(monkeypatch):
    """--eval_draw per_seed: seed s's runs and its base point are sampled with one seed of s's own, distinct from
    every other training seed's; the base model is evaluated once per draw. fixed: one draw (1234) for all."""
    from types import SimpleNamespace

    from experiments import common

    assert common.evaluation_seed("fixed", 0) == common.evaluation_seed("fixed", 7) == common.EVAL_SEED == 1234
    assert len({common.evaluation_seed("per_seed", seed) for seed in range(10)} | {common.EVAL_SEED}) == 11
    with pytest.raises(ValueError, match="eval_draw"):
        common.evaluation_seed("per_method", 0)
    calls = []
    testbed = common.Testbed(
        task="t",
        base_dir=Path("."),
        held_out=None,
        reward=None,
        max_new_tokens=1,
        measure="",
        metrics=(),
        prompts=None,
        evaluate=lambda m, t, eval_seed: calls.append(eval_seed) or {"pass@1": eval_seed / 10_000},
        eval_draw="per_seed",
    )
    first, again, other = (testbed.start(None, None, seed) for seed in (0, 0, 1))
    assert first is again and first != other and calls == [common.evaluation_seed("per_seed", s) for s in (0, 1)]
    options = SimpleNamespace(seeds=[0, 1, 2], eval_draw="fixed")
    monkeypatch.setattr(
        common,
        "held_out_pass_at_1",
        lambda *args, eval_seed, **kwargs: calls.append(eval_seed) or {"pass@1": eval_seed / 10_000},
    )
    calls.clear()
    assert set(common.base_points(None, None, None, options)) == {0, 1, 2} and calls == [1234]
    calls.clear()
    points = common.base_points(None, None, None, SimpleNamespace(seeds=[0, 1], eval_draw="per_seed"))
    assert calls == [1235, 1236]
    assert common.base_summary(points) == {
        "pass@1": pytest.approx((0.1235 + 0.1236) / 2),
        "by_seed": {"0": {"pass@1": 0.1235}, "1": {"pass@1": 0.1236}},
    }


def test_clipped_token_shares_count_the_tokens_ppo_clips_by_the_signals_sign(tiny_model_path):
    """The share of a fixed dataset's tokens where PPO's clip stops the gradient, against hand-set behaviour
    log-probs: mu equal to pi clips nothing; mu e times above pi (ratio 0.37) clips every negative token and no
    positive one; mu e times below (ratio 2.7) the reverse."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from experiments import common

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    prompts, completions, rewards = [[5, 6, 7], [5, 8], [9, 6, 7, 8]], [[10, 11], [12, 13, 14], [11]], [1.0, -1.0, -1.0]
    with torch.no_grad():
        own = []
        for prompt, completion in zip(prompts, completions, strict=False):
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].log_softmax(-1)
            own.append([logits[len(prompt) - 1 + i, token].item() for i, token in enumerate(completion)])

    def data(shift):
        return Dataset.from_dict(
            {
                "prompt_ids": prompts,
                "completion_ids": completions,
                "reward": rewards,
                "behaviour_logps": [[value + shift for value in row] for row in own],
            }
        )

    # two rows per batch: the padded rows must read as the unpadded ones
    on_policy = common.clipped_token_shares(model, data(0.0), batch_size=2)
    assert on_policy == {"clipped_share": 0.0, "clipped_share_positive": 0.0, "clipped_share_negative": 0.0}
    mu_above = common.clipped_token_shares(model, data(1.0), batch_size=2)
    assert mu_above == {
        "clipped_share": pytest.approx(4 / 6),
        "clipped_share_positive": 0.0,
        "clipped_share_negative": 1.0,
    }
    mu_below = common.clipped_token_shares(model, data(-1.0))
    assert mu_below == {
        "clipped_share": pytest.approx(2 / 6),
        "clipped_share_positive": 1.0,
        "clipped_share_negative": 0.0,
    }


def test_a_script_refuses_a_task_it_does_not_run(capsys):
    from experiments import sample_efficiency

    assert "runs on the reasoning testbed only" in script_refusal(
        sample_efficiency.main, ["--task", "arithmetic"], capsys
    )


def test_late_mean_averages_the_last_quarter_of_the_steps():
    from experiments import common

    curve = [
        {"step": step, "pass@1": value}
        for step, value in [(0, 0.5), (20, 0.6), (40, 0.7), (60, 0.9), (70, 0.6), (80, 0.8)]
    ]
    # the last quarter of 80 steps is step > 60: 0.6 and 0.8; the spike at 60 and the dip at 70 do not decide it alone
    assert common.late_mean(curve) == pytest.approx(0.7)
    assert common.late_mean(curve, share=0.5) == pytest.approx((0.9 + 0.6 + 0.8) / 3)  # step > 40
    # checkpoints too sparse for the share: the last one
    assert common.late_mean([{"step": 0, "pass@1": 0.5}, {"step": 64, "pass@1": 0.75}]) == 0.75
    assert common.late_mean(curve, key="step") == pytest.approx(75)


def test_paired_difference_is_taken_per_seed():
    from experiments import common

    first, second = {0: 0.9, 1: 0.8, 2: 0.7, 3: 0.5}, {0: 0.8, 1: 0.75, 2: 0.6}
    paired = common.paired_difference(first, second)
    assert paired["seeds"] == [0, 1, 2]  # seed 3 has no partner
    assert paired["values"] == pytest.approx([0.1, 0.05, 0.1])
    assert paired["mean"] == pytest.approx(0.25 / 3)
    # t(2 df) = 4.30, sd of (0.1, 0.05, 0.1) = 0.02887
    assert paired["ci95"] == pytest.approx(4.30 * 0.028868 / 3**0.5, rel=1e-3)
    # the unpaired interval of the same seeds is wider: the seeds' shared level cancels in the pairing
    unpaired = common.mean_and_ci95([0.9, 0.8, 0.7])["ci95"] + common.mean_and_ci95([0.8, 0.75, 0.6])["ci95"]
    assert paired["ci95"] < unpaired
    with pytest.raises(ValueError, match="no seed in common"):
        common.paired_difference({0: 1.0}, {1: 1.0})


def test_the_validation_split_is_measured_apart_from_the_held_out_one():
    from experiments import common

    parser = common.experiment_parser("", output="x", epochs=None)
    assert parser.parse_args([]).eval_split == "heldout"
    assert parser.parse_args(["--eval_split", "validation"]).eval_split == "validation"
    with pytest.raises(SystemExit):
        parser.parse_args(["--eval_split", "train"])


def test_the_default_testbed_is_the_shipped_model():
    """The evidence scripts start from the weights every machine gets, not a warm start trained on local kernels."""
    from experiments import common
    from topr_trl.tasks.reasoning import WarmStartSettings
    from topr_trl.tasks.tiny import prebuilt_model

    options = common.experiment_parser("", output="x", epochs=None).parse_args([])
    settings = WarmStartSettings(digits=options.digits, error_rate=options.error_rate, steps=options.warm_steps)
    assert settings == WarmStartSettings()
    assert prebuilt_model(settings.key()) is not None


def test_iterations_compare_compositions_per_seed_at_the_last_iteration():
    from experiments import iterations

    runs = {
        f"{s}/seed{seed}": {"strategy": s, "seed": seed, "accuracy": curve}
        for s, seed, curve in [
            ("uniform", 0, [0.6, 0.8, 0.9, 0.94]),
            ("uniform", 1, [0.6, 0.8, 0.9, 0.92]),
            ("anna_karenina", 0, [0.6, 0.7, 0.9, 0.95]),
            ("anna_karenina", 1, [0.6, 0.7, 0.9, 0.90]),
        ]
    }
    results = {"runs": runs}
    iterations.update_summary(results)
    # three iterations: the last quarter is the last one
    assert results["late"]["uniform"]["values"] == [0.94, 0.92]
    assert set(results["paired"]) == {"uniform-anna_karenina"}
    assert results["paired"]["uniform-anna_karenina"]["values"] == pytest.approx([-0.01, 0.02])
    assert results["summary"]["uniform"][0]["mean"] == 0.6  # the base model, index 0


def test_figure7_counts_collapses_and_pairs_topr_with_untruncated_is():
    from experiments import figure7

    def run(method, seed, late):
        return {
            "method": method,
            "seed": seed,
            "curve": [{"step": 0, "accuracy": 0.6}, {"step": 40, "accuracy": 0.8}, {"step": 80, "accuracy": late}],
            "grad_norms": [{"step": 1, "grad_norm": 0.5}, {"step": 2, "grad_norm": 150.0}],
            "ratio_maxima": [{"step": 1, "topr/ratio_negative/max": 2.0}, {"step": 2, "topr/ratio_negative/max": 9.0}],
        }

    runs = {
        f"{m}/seed{s}": run(m, s, late)
        for m, s, late in [
            ("untruncated_is", 0, 0.95),
            ("untruncated_is", 1, 0.2),
            ("topr", 0, 0.96),
            ("topr", 1, 0.97),
        ]
    }
    summary = figure7.summarise(runs, clip=100.0)
    assert summary["untruncated_is"]["collapsed_seeds"] == [1] and summary["topr"]["collapsed_seeds"] == []
    assert summary["topr"]["late_minus_untruncated_is"]["values"] == pytest.approx([0.01, 0.77])
    assert summary["untruncated_is"]["largest_negative_ratio"] == [9.0, 9.0]
    assert summary["untruncated_is"]["clipped_step_fraction"]["mean"] == 0.5


def test_baseline_sweep_pairs_topr_with_tis_on_the_late_accuracy():
    from experiments import baseline_sweep

    def run(method, seed, late):
        return {
            "proportion": 0.67,
            "target": 0.1,
            "method": method,
            "seed": seed,
            "curve": [{"step": 0, "accuracy": 0.6}, {"step": 40, "accuracy": 0.1}, {"step": 80, "accuracy": late}],
        }

    runs = {
        f"{m}/{s}": run(m, s, late)
        for m, s, late in [("topr", 0, 0.9), ("topr", 1, 0.8), ("tis", 0, 0.0), ("tis", 1, 0.5)]
    }
    late, paired = baseline_sweep.summarise_late(runs)
    assert late["p0.67/pt0.1/topr"]["values"] == [0.9, 0.8]  # the dip at step 40 is not in the last quarter
    assert paired["p0.67/pt0.1"]["values"] == pytest.approx([0.9, 0.3])


def test_long_completions_read_the_sequence_log_ratio_at_each_prefix_and_the_negatives_weights():
    """Hand values: a completion of 64 tokens whose token log-ratios are all -0.01 has S_l = -0.01 l at every
    prefix; one of 16 tokens at +0.02 reaches only the prefixes up to 16. A negative's weight is min(1, exp S) under
    the product and min(1, exp(S / l)) length-normalised; positives count in the spread, not in the weights."""
    import math

    import torch

    from experiments.long_completions import prefix_statistics, whole_completion_statistics

    falling = [torch.full((64,), -0.01)] * 8
    rising = [torch.full((16,), 0.02)] * 8
    rows = {row["length"]: row for row in prefix_statistics(falling + rising, [True] * 8 + [False] * 8)}
    assert sorted(rows) == [8, 16, 32, 64]  # 128 and longer: no completion reaches them
    assert rows[64]["completions"] == 8 and rows[16]["completions"] == 16 and rows[16]["negatives"] == 8
    assert rows[64]["negative_weight_mean"] == pytest.approx(math.exp(-0.64), rel=1e-6)
    assert rows[64]["negative_weight_length_normalized_mean"] == pytest.approx(math.exp(-0.01), rel=1e-6)
    assert rows[64]["negative_weight_below_half"] == 0.0 and rows[64]["median_abs_log_ratio"] == pytest.approx(0.64)
    assert rows[16]["log_ratio_q05"] == pytest.approx(-0.16) and rows[16]["log_ratio_q95"] == pytest.approx(0.32)
    whole = whole_completion_statistics(falling + rising, [True] * 8 + [False] * 8)
    assert whole["mean_length"] == 40 and whole["negatives"] == 8
    assert whole["negative_weight_mean"] == pytest.approx(math.exp(-0.64), rel=1e-6)


def _simulated_update_lags(sync_every: int, steps: int, staleness_of_step) -> list[int]:
    """The lag of each step's batch, by playing the pipeline forward: TRL's dataloader reads the batch of step s
    while step s - 1 trains (the first two before step 1), from a sample `staleness_of_step(s)` pushes older than the
    newest; the weights are pushed after every `sync_every`-th update."""
    update_of_version, version, read = {0: 0}, 0, {}
    for step in range(1, steps + 1):
        for ahead in [1, 2] if step == 1 else [step + 1]:
            if ahead <= steps:
                read[ahead] = update_of_version[version - staleness_of_step(ahead)]
        lag = (step - 1) - read[step]  # updates applied before step s's gradient, minus those of the weights used
        yield lag
        if step % sync_every == 0:
            version += 1
            update_of_version[version] = step


@pytest.mark.parametrize("sync_every", [1, 3, 8])
def test_server_accuracy_counts_the_lag_in_optimizer_updates_not_in_weight_pushes(sync_every):
    from experiments.async_server_accuracy import update_lag

    def staleness(step):  # now and then a sample one push older than the newest, once a push exists to lag
        return 1 if step % 5 == 0 and (step - 2) // sync_every >= 1 else 0

    simulated = list(_simulated_update_lags(sync_every, 40, staleness))
    assert [update_lag(step, staleness(step), sync_every) for step in range(1, 41)] == simulated
    # the weights are pushed every W updates: a batch trains 0 to W updates behind, one push more is W further
    assert max(simulated) == (sync_every + (sync_every if sync_every > 1 else 1))
