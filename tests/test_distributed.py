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


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_two_process_runs_agree_across_ranks(launch, tiny_model_path, tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", *LAUNCHES[launch], "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--main_process_port", "0", str(SCRIPT),
               tiny_model_path, str(tmp_path / "out")]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRL_EXPERIMENTAL_SILENCE": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = [json.loads(line[len("RESULT "):]) for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["world"] == 2 for r in results)
    assert results[0]["checksum"] == results[1]["checksum"]
    assert all(math.isfinite(loss) for r in results for loss in r["losses"])
    assert (tmp_path / "out" / "config.json").exists()
