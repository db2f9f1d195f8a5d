"""Two-process CPU data parallel and DeepSpeed ZeRO-2/3 runs of TOPRTrainer end with identical parameters."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("distributed_train.py")
LAUNCHES = {
    "ddp": ["--multi_gpu"],
    "zero2": ["--use_deepspeed", "--zero_stage", "2"],
    "zero3": ["--use_deepspeed", "--zero_stage", "3", "--zero3_init_flag", "false"],
}
# Unbuffered, each print reaches the pipe shared by both ranks in one write, so a line is never split by the other rank
LAUNCH_ENVIRONMENT = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                      "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_two_process_runs_agree_across_ranks(launch, tiny_model_path, tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", *LAUNCHES[launch], "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--main_process_port", "0", str(SCRIPT),
               tiny_model_path, str(tmp_path / "out"), str(tmp_path)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=LAUNCH_ENVIRONMENT)
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["world"] == 2 for r in results)
    assert results[0]["checksum"] == results[1]["checksum"]
    assert all(math.isfinite(loss) for r in results for loss in r["losses"])
    assert (tmp_path / "out" / "config.json").exists()


def launch_cli(launch: str, arguments: list[str]) -> subprocess.CompletedProcess:
    # ZeRO-3 saves full weights only with zero3_save_16bit_model (set in examples/accelerate/zero3*.yaml)
    saving = ["--zero3_save_16bit_model", "true"] if launch == "zero3" else []
    command = [sys.executable, "-m", "accelerate.commands.launch", *LAUNCHES[launch], *saving, "--num_processes",
               "2", "--num_machines", "1", "--mixed_precision", "no", "--main_process_port", "0", "-m", "topr_trl",
               *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=LAUNCH_ENVIRONMENT)


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_cli_train_under_accelerate_launch_saves_a_checkpoint_that_loads_back(launch, tmp_path):
    """`accelerate launch ... -m topr_trl train` on 2 CPU processes: the built-in model is built once (main process
    first), training runs, and both the Trainer checkpoint and the final model load back with the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    output = tmp_path / "run"
    completed = launch_cli(launch, [
        "train", "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2", "--task_train_prompts", "16",
        "--task_eval_prompts", "8", "--warm_start_accuracy", "0", "--base_model_dir", str(tmp_path / "base"),
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--learning_rate", "1e-2",
        "--topr_signal", "reward", "--output_dir", str(output)])
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stdout.count("held-out accuracy after training") == 1  # printed by the main process only
    final = AutoModelForCausalLM.from_pretrained(output)
    checkpoint = AutoModelForCausalLM.from_pretrained(output / "checkpoint-2")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    for (name, trained), saved, initial in zip(final.state_dict().items(), checkpoint.state_dict().values(),
                                               base.state_dict().values(), strict=True):
        assert torch.equal(trained, saved), name
    assert any(not torch.equal(a, b) for a, b in zip(final.state_dict().values(), base.state_dict().values()))
    assert json.loads((output / "topr_summary.json").read_text())["after"]["accuracy"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_cli_iterate_under_accelerate_launch(launch, tmp_path):
    """Two processes, two iterations: the main process generates each iteration's data, both train on it, and the
    first iteration's trainer (a DeepSpeed engine under ZeRO) is released before the second one starts."""
    completed = launch_cli(launch, [
        "iterate", "--iterations", "2", "--task_train_prompts", "8", "--task_eval_prompts", "8",
        "--warm_start_accuracy", "0", "--base_model_dir", str(tmp_path / "base"), "--num_generations", "4",
        "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "it")])
    assert completed.returncode == 0, completed.stderr[-4000:]
    for iteration in (0, 1):
        folder = tmp_path / "it" / f"iteration-{iteration:03d}"
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["rows"] == 32 and summary["train_steps"] == 4  # 32 rows, 2 processes x 4 rows per step
        assert len(list((folder / "data").glob("shard-*"))) == 1
    assert summary["behaviour_model"] == str(tmp_path / "it" / "iteration-000" / "model")
    assert completed.stdout.count("iteration 1: p=") == 1  # printed by the main process only
