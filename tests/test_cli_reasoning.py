"""`--task reasoning`: the reasoning testbed as a built-in task of the CLI (the README's main job). Fast: its
defaults, and the task's prompts, reward and held-out measurement with a user's model. Slow: the built-in job end to
end, held-out sampled pass@1 recomputed from the saved model."""

import json

import pytest

from topr_trl.commands import arguments
from topr_trl.commands.cli import main
from topr_trl.tasks.reasoning import make_reasoning_dataset, max_completion_tokens, measure_base_model


def parsed(command, argv):
    return arguments.parse_command(command, argv)


def test_reasoning_task_has_its_own_builtin_settings():
    options, config, _ = parsed("train", ["--task", "reasoning"])
    assert arguments.is_builtin_run(arguments.chosen_run(["--task", "reasoning"]))
    assert (config.per_device_train_batch_size, config.max_steps, config.learning_rate) == (32, 60, 3e-4)
    assert config.max_completion_length == max_completion_tokens(3) and options.task_digits == 3
    assert options.task_eval_prompts == 500 and options.base_model_dir == "outputs/tiny-reasoning-base"
    assert config.output_dir == "outputs/topr-tiny-reasoning"
    options, config, _ = parsed("train", ["--task", "reasoning", "--task_digits", "4", "--max_steps", "5"])
    assert config.max_completion_length == max_completion_tokens(4) and config.max_steps == 5
    _, config, _ = parsed("iterate", ["--task", "reasoning"])
    assert config.max_steps == -1 and config.per_device_train_batch_size == 32
    _, config, _ = parsed("train", [])  # the arithmetic task keeps its own
    assert config.max_completion_length == arguments.recipe("builtin-train")["max_completion_length"] == 6


def test_reasoning_task_trains_a_users_model_and_reports_sampled_pass_at_1(tiny_model_path, tmp_path, capsys):
    main(
        [
            "train",
            "--task",
            "reasoning",
            "--model_name_or_path",
            tiny_model_path,
            "--max_steps",
            "1",
            "--per_device_train_batch_size",
            "8",
            "--num_generations",
            "8",
            "--max_completion_length",
            "8",
            "--task_eval_prompts",
            "4",
            "--output_dir",
            str(tmp_path / "run"),
            "--use_cpu",
            "true",
            "--bf16",
            "false",
            "--report_to",
            "none",
        ]
    )
    summary = json.loads((tmp_path / "run" / "topr_summary.json").read_text())
    assert summary["held_out_problems"] == 4
    assert summary["before"]["num_samples"] == 4 and summary["before"]["temperature"] == 1.0
    printed = capsys.readouterr().out
    assert "sampled pass@1" in printed and "greedy accuracy" in printed and "on 4 held-out problems" in printed


def test_an_unknown_task_names_the_reasoning_one():
    with pytest.raises(SystemExit, match="reasoning"):
        main(["train", "--task", "reasonning"])


@pytest.mark.slow
def test_builtin_reasoning_job_raises_sampled_pass_at_1(evidence_work_dir, tmp_path):
    # the warm model is shared with the evidence scripts' slow tests (same settings, same cache key)
    output = tmp_path / "run"
    main(
        [
            "train",
            "--task",
            "reasoning",
            "--base_model_dir",
            str(evidence_work_dir / "cache"),
            "--max_steps",
            "30",
            "--task_eval_prompts",
            "200",
            "--output_dir",
            str(output),
        ]
    )
    summary = json.loads((output / "topr_summary.json").read_text())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    held_out = make_reasoning_dataset(200, 3, "heldout", seed=0)
    again = measure_base_model(
        AutoModelForCausalLM.from_pretrained(output), AutoTokenizer.from_pretrained(output), held_out
    )
    assert again["pass@1"] == pytest.approx(summary["after"]["pass@1"], abs=1e-9)
    assert 0.55 < summary["before"]["pass@1"] < 0.8  # the paper's regime: about two thirds correct
    assert summary["after"]["pass@1"] > summary["before"]["pass@1"] + 0.05
