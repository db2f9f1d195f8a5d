"""The main job's command line, on tiny settings."""

import json
import subprocess
import sys

import pytest

from topr_trl.cli import iterate as main_iterate
from topr_trl.cli import main, resolve_reward
from topr_trl.tasks import arithmetic_reward


def test_train_command_runs_the_builtin_job(tmp_path):
    output = tmp_path / "run"
    main(["train", "--max_steps", "2", "--task_train_prompts", "16", "--task_eval_prompts", "8",
          "--warm_start_accuracy", "0", "--base_model_dir", str(tmp_path / "base"), "--output_dir", str(output),
          "--per_device_train_batch_size", "4", "--num_generations", "4"])
    summary = json.loads((output / "topr_summary.json").read_text())
    assert set(summary) == {"before", "after"} and 0 <= summary["after"]["accuracy"] <= 1
    assert (output / "model.safetensors").exists() and (tmp_path / "base" / "config.json").exists()


def test_unknown_flag_is_rejected(tmp_path):
    with pytest.raises(SystemExit, match="Did you mean --topr_preset"):
        main(["train", "--topr_presett", "sft", "--output_dir", str(tmp_path)])


def test_module_entry_point_without_command_prints_usage():
    completed = subprocess.run([sys.executable, "-m", "topr_trl"], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2 and "topr-trl train" in completed.stdout


def test_reward_resolution():
    assert resolve_reward("arithmetic") is arithmetic_reward
    assert resolve_reward("topr_trl.tasks:arithmetic_reward") is arithmetic_reward
    with pytest.raises(ValueError, match="arithmetic"):
        resolve_reward("nonexistent")


def test_iterate_command_runs_offline_iterations(tmp_path):
    summaries = main_iterate(["--num_iterations", "1", "--task_train_prompts", "4", "--task_eval_prompts", "4",
                              "--num_completions", "4", "--per_device_train_batch_size", "8",
                              "--warm_start_accuracy", "0", "--base_model_dir", str(tmp_path / "base"),
                              "--output_dir", str(tmp_path / "iterations")])
    assert len(summaries) == 1 and summaries[0]["rows"] == 16 and "evaluation" in summaries[0]
    assert (tmp_path / "iterations" / "iteration-000" / "model" / "model.safetensors").exists()


@pytest.mark.slow
def test_one_offline_iteration_raises_accuracy_on_the_builtin_task(tmp_path):
    """Algorithm 1 on the built-in task with the command's defaults (warm start to 30 %, 256 prompts x 8)."""
    (summary,) = main_iterate(["--base_model_dir", str(tmp_path / "base"), "--output_dir", str(tmp_path / "it")])
    before, after = summary["evaluation_before"]["accuracy"], summary["evaluation"]["accuracy"]
    print(f"offline TOPR, one iteration: held-out accuracy {before:.3f} -> {after:.3f}")
    assert after >= before + 0.05


def test_evaluate_command_is_wired(tiny_model_path, tmp_path):
    main(["evaluate", "--model", tiny_model_path, "--k", "2", "--limit", "2", "--max_new_tokens", "4",
          "--output_dir", str(tmp_path / "eval")])
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert "pass@1" in json.dumps(results)
    assert (tmp_path / "eval" / "results.png").exists()
